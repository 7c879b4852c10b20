#!/usr/bin/env bash
# Issue 15 on a 2-GPU machine: tensor parallelism (TP=1 vs TP=2) and data-parallel serving (one vs two instances).
#   bash benchmarks/tp_gpu.sh STAGE [STAGE ...]      (KEY=qwen2.5-coder-1.5b, results in $OUT, default ./tp_out)
# Stages:
#   equal      fp32: TP=2 emits TP=1's tokens for ar and microspec (one chat prompt, 256 tokens)
#   speed      Spec-Bench + HumanEval, ar and microspec with $HEAD, bf16, at TP=1 then TP=2 (tokens/s in results.md)
#   allreduce  at TP=2 (ar and microspec): tokens/s, ms a step, the same step's all-reduces timed alone in a CUDA
#              graph (their share of a step), and each rank's target weights
#   dp         `serve --gpus 0` vs `serve --gpus 0,1`: 4 x c requests at concurrency c = 16 and 32 (output tok/s),
#              each instance's running requests sampled twice a second (dp_gpus_*_running.txt)
# mpirun needs --allow-run-as-root as root; serving needs what benchmarks/gpu_serve_check.sh describes (STUB_SITE).
set -euo pipefail
KEY=${KEY:-qwen2.5-coder-1.5b}
OUT=${OUT:-tp_out}
HEAD=${HEAD:-${MICROSPEC_CACHE:-$HOME/.cache/microspec}/engines/$KEY/eagle}
LIMIT=${LIMIT:-3}
TOKENS=${TOKENS:-256}
STUB_SITE=${STUB_SITE:-/tmp/stub-site}
PROMPT="Write a Python function that merges two sorted lists, with a docstring and tests."
MPI=(mpirun --allow-run-as-root -n 2)
mkdir -p "$OUT"
ms() { python3 -m trtllm_microspec.cli "$@"; }
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    equal)
      for m in ar microspec; do
        ms generate --engine "$KEY" --draft "$HEAD" --method $m --dtype float32 --chat --prompt "$PROMPT" \
          --max-new-tokens "$TOKENS" --json > "$OUT/equal_${m}_tp1.json"
        "${MPI[@]}" python3 -m trtllm_microspec.cli generate --tp 2 --engine "$KEY" --draft "$HEAD" --method $m \
          --dtype float32 --chat --prompt "$PROMPT" --max-new-tokens "$TOKENS" --json > "$OUT/equal_${m}_tp2.json"
        python3 - "$OUT/equal_${m}_tp1.json" "$OUT/equal_${m}_tp2.json" <<'EOF'
import json, sys
a, b = (json.load(open(f))["token_ids"] for f in sys.argv[1:])
print(f"{sys.argv[2]}: {len(b)} tokens, TP=2 == TP=1: {a == b}")
EOF
      done ;;
    speed)
      ms bench --engine "$KEY" --draft "$HEAD" --methods ar,microspec --limit "$LIMIT" --max-new-tokens "$TOKENS" \
        --out "$OUT/speed_tp1"
      "${MPI[@]}" python3 -m trtllm_microspec.cli bench --tp 2 --engine "$KEY" --draft "$HEAD" --methods ar,microspec \
        --limit "$LIMIT" --max-new-tokens "$TOKENS" --out "$OUT/speed_tp2" ;;
    allreduce)
      for m in ar microspec; do
        # the script goes to a file: mpirun hands stdin to rank 0 only (rank 1 would wait at NCCL's init forever)
        cat > "$OUT/allreduce.py" <<'EOF'
import sys, time, torch
from trtllm_microspec import LLM, parallel
key, head, method, prompt, tokens = sys.argv[1:]
llm = LLM(key, method, draft=head if method != "ar" else None, tp=2)
llm.generate(prompt, int(tokens), chat=True)  # warm-up: CUDA-graph capture
r = llm.generate(prompt, int(tokens), chat=True)
steps = r.stats["rounds"] or r.stats["new_tokens"]
step_ms = r.stats["wall_s"] / steps * 1e3
# the collectives of one target pass alone: 2 all-reduces a layer over the rows a step runs (AR 1, a tree
# total_tokens), captured in one CUDA graph as the engine captures them (zeros: the sums stay finite)
c = llm.target.cfg
rows = 1 if method == "ar" else llm.tree.total_tokens
x = torch.zeros(rows, c.hidden_size, dtype=llm.target.cache.k.dtype, device="cuda")
for _ in range(3):
    parallel.all_reduce(x)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    for _ in range(2 * c.num_layers):
        parallel.all_reduce(x)
g.replay()
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(100):
    g.replay()
torch.cuda.synchronize()
ar_ms = (time.perf_counter() - t0) / 100 * 1e3
weights = sum(p.numel() * p.element_size() for p in llm.target.parameters()) / 2**30
print(f"rank {parallel.rank()} {method}: {r.stats['tokens_per_s']:.1f} tok/s, {step_ms:.2f} ms a step; "
      f"its {2 * c.num_layers} all-reduces of [{rows}, {c.hidden_size}] alone {ar_ms:.3f} ms "
      f"({ar_ms / step_ms:.1%} of a step); target weights {weights:.2f} GiB on this GPU")
EOF
        "${MPI[@]}" python3 "$OUT/allreduce.py" "$KEY" "$HEAD" $m "$PROMPT" "$TOKENS" | tee "$OUT/allreduce_$m.txt"
      done ;;
    dp)
      for gpus in 0 0,1; do
        # python itself in the background (not the `ms` function's subshell), so that `kill` reaches the server
        python3 -m trtllm_microspec.cli serve --engine "$KEY" --draft "$HEAD" --gpus $gpus --stub-site "$STUB_SITE" \
          --grpc-port 8101 --http-port 8100 --metrics-port 8102 > "$OUT/serve_$gpus.out" 2>&1 &
        SERVE=$!
        until grep -q "ready in" "$OUT/serve_$gpus.out"; do
          kill -0 $SERVE 2>/dev/null || { cat "$OUT/serve_$gpus.out"; exit 1; }
          sleep 2
        done
        for c in 16 32; do
          ms client --url 127.0.0.1:8101 --chat --prompt "$PROMPT" --max-tokens "$TOKENS" --concurrency $c \
            --requests $((4 * c)) > "$OUT/dp_gpus_${gpus}_c$c.txt" &
          CLIENT=$!
          # each instance's running requests twice a second: how Triton spreads the load over the instances
          while kill -0 $CLIENT 2>/dev/null; do
            python3 -c 'import urllib.request as u; print(" ".join(l.split("instance=\"")[1].split("\"")[0] + "=" +
              l.rsplit(" ", 1)[1] for l in u.urlopen("http://127.0.0.1:8102/metrics").read().decode().splitlines()
              if l.startswith("microspec_running_requests{")))' >> "$OUT/dp_gpus_${gpus}_c${c}_running.txt" || true
            sleep 0.5
          done
          cat "$OUT/dp_gpus_${gpus}_c$c.txt"
        done
        kill $SERVE && wait $SERVE || true
      done ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
