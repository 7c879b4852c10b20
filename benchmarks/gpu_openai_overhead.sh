#!/usr/bin/env bash
# The OpenAI endpoint's overhead over gRPC: one `microspec serve --openai-port`, the same load through both APIs
# (the same prompts, greedy, streamed, chat template) at each concurrency, then the two side by side.
# Run from the repo root (python3.12 with CUDA torch):
#   bash benchmarks/gpu_openai_overhead.sh ENGINE_DIR [DRAFT_DIR]
# Needs what gpu_serve_check.sh needs (nvidia-pytriton + tritonclient in SERVE_SITE, numpy<2 in STUB_SITE) and
# fastapi + uvicorn importable. Knobs: LEVELS (concurrency levels, default "1 64"), REQUESTS_PER_LEVEL (default:
# 4 x the level, at least 16), MAX_TOKENS (256), METHOD (microspec), DEVICE (cuda), INSTANCE_KIND (gpu), GRPC_PORT
# (8001; HTTP one below, metrics one above, OpenAI two above), OUT (results folder, default /tmp/openai-overhead).
# DEVICE=cpu INSTANCE_KIND=cpu rehearses it on a CPU machine.
set -euo pipefail
ENGINE=${1:?usage: gpu_openai_overhead.sh ENGINE_DIR [DRAFT_DIR]}
DRAFT=(${2:+--draft "$2"})
DEVICE=${DEVICE:-cuda}
KIND=${INSTANCE_KIND:-gpu}
PORT=${GRPC_PORT:-8001}
OPENAI_PORT=$((PORT + 2))
MAX_TOKENS=${MAX_TOKENS:-256}
LEVELS=${LEVELS:-1 64}
METHOD=${METHOD:-microspec}
OUT=${OUT:-/tmp/openai-overhead}
MAX_BATCH=$(echo $LEVELS | tr ' ' '\n' | sort -n | tail -1)

mkdir -p "$OUT"
TRITON_LOG=$OUT/tritonserver.log
source benchmarks/serve_up.sh
# the queue holds a whole level's requests beyond the batch, so that none is refused
serve_up "$OUT/serve.out" --engine "$ENGINE" "${DRAFT[@]}" --method "$METHOD" --device "$DEVICE" --instance-kind "$KIND" \
  --max-batch "$MAX_BATCH" --max-queue-size 1024 --grpc-port "$PORT" --http-port $((PORT - 1)) \
  --metrics-port $((PORT + 1)) --openai-port "$OPENAI_PORT" --log-file "$TRITON_LOG"

PROMPTS=(--prompt "Write a short poem about the ocean." --prompt "What is the capital of Australia? Answer briefly."
         --prompt "Explain how a hash map works." --prompt "Give three tips for learning to play the guitar."
         --prompt "Summarize the plot of Romeo and Juliet in three sentences."
         --prompt "Write a Python function that checks whether a string is a palindrome."
         --prompt "What causes the seasons on Earth?" --prompt "List five uses of baking soda.")
GRPC=127.0.0.1:$PORT
OPENAI=http://127.0.0.1:$OPENAI_PORT/v1
for c in $LEVELS; do
  n=${REQUESTS_PER_LEVEL:-$(( c * 4 > 16 ? c * 4 : 16 ))}
  for api in grpc openai; do
    url=$GRPC; [ $api = openai ] && url=$OPENAI
    # once unmeasured (CUDA graphs of this batch size), then measured
    "${MS[@]}" client --url "$url" --chat --max-tokens "$MAX_TOKENS" --concurrency "$c" --requests "$c" "${PROMPTS[@]}" >/dev/null
    "${MS[@]}" client --url "$url" --chat --max-tokens "$MAX_TOKENS" --concurrency "$c" --requests "$n" "${PROMPTS[@]}" \
      --json >"$OUT/$api-c$c.json"
    echo "== $api, concurrency $c, $n requests: $(python3 -c "import json,sys; r=json.load(open(sys.argv[1]));
print(f\"{r['output_tokens_per_s']:.1f} tok/s, TTFT p50 {r['ttft_s']['p50']*1e3:.1f} ms, ITL p50 {r['itl_s']['p50']*1e3:.2f} ms\")" "$OUT/$api-c$c.json")"
  done
done
python3 - "$OUT" $LEVELS <<'EOF'
import json, sys
out, levels = sys.argv[1], sys.argv[2:]
ms = lambda p: f"{p['p50'] * 1e3:.1f} / {p['p99'] * 1e3:.1f}"
print("\n| concurrency | API | requests | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | latency p50 / p99 (ms) |")
print("|---|---|---|---|---|---|---|")
for c in levels:
    r = {api: json.load(open(f"{out}/{api}-c{c}.json")) for api in ("grpc", "openai")}
    for api, x in r.items():
        print(f"| {c} | {api} | {x['completed']}/{x['requests']} | {x['output_tokens_per_s']:.1f} | {ms(x['ttft_s'])} | "
              f"{ms(x['itl_s'])} | {ms(x['latency_s'])} |")
    g, o = r["grpc"], r["openai"]
    print(f"| {c} | openai - grpc | | {o['output_tokens_per_s'] / g['output_tokens_per_s'] - 1:+.1%} | "
          f"{(o['ttft_s']['p50'] - g['ttft_s']['p50']) * 1e3:+.2f} | {(o['itl_s']['p50'] - g['itl_s']['p50']) * 1e3:+.3f} | "
          f"{(o['latency_s']['p50'] - g['latency_s']['p50']) * 1e3:+.1f} |")
EOF
