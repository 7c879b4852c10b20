#!/usr/bin/env bash
# Reproduce the GPU measurements of BENCHMARKS.md on a CUDA machine with the package installed (and the models
# fetchable, or already in MICROSPEC_CACHE). Results go to $OUT (default ./gpu_out).
#   bash benchmarks/gpu_reproduce.sh STAGE [STAGE ...]      (KEY=qwen2.5-coder-1.5b by default)
# Stages:
#   checks     the custom ops and the Triton layer kernels against their torch references (random inputs)
#   profile    per-phase time and kernel counts of a decode step, default path vs the torch reference; one layer's
#              pieces; each projection: cuBLAS vs the skinny GEMM vs the default
#   kernels-ab the Triton layer kernels (skinny GEMM configs included) against the torch reference, then the
#              profile with the per-projection A/B table (cuBLAS vs skinny GEMM vs default) at rows 1,4,16,60,64
#   lossless   every method vs AR with a random head, fp32 (logic: token for token) and bf16, alone and batched
#              (the batched engine's CUDA graphs, padding rows included)
#   train      train an EAGLE head for KEY into $HEAD (<= TRAIN_LIMIT s wall, caching included), with --eval
#   bench      Spec-Bench + HumanEval: AR, EAGLE, FR-Spec, MicroSpec with $HEAD, and the outside references
#   sampling   the same at temperature 0.7 (speculative sampling)
#   sweep      in-flight batching: ar, eagle, microspec at concurrency LEVELS, and vLLM at the same levels
#   fill       the paper's window (microspec-paper) vs the filled one (microspec) beside eagle and frspec, per
#              category, and both over W_max FILL_SWEEP (Fig. 6, Fig. 1b's filled line); runs build-freq if missing
#   openai     serve --openai-port: the same load through gRPC and the OpenAI endpoint at concurrency 1 and 64
#              (benchmarks/gpu_openai_overhead.sh; needs the serve extra, nvidia-pytriton and STUB_SITE)
#   head-ab    draft-head recipes at equal wall time (issue 28): distill KEY's own answers for DISTILL_LIMIT s
#              into $OUT/head_ab/distilled (kept: a rerun reuses it), then one train-draft per arm of ARMS, each
#              --time-limit ARM_LIMIT, scored by held-out top-1 at depths 1-5 (the same held-out distilled
#              conversations for every arm) and acceptance (eagle, default tree) on EVAL_Q questions of each
#              Spec-Bench category + HumanEval -> $OUT/head_ab/head_ab.md. Arms: sharegpt (today's data),
#              distilled, mixed (distilled + ShareGPT), sharegpt-pruned, mixed-pruned (--loss pruned),
#              mixed-pruned-ttt2. ~17 min on an H200 with the default 3 arms.
#   policy     the speculation policy (issue 22; ~6-8 min on an H200, 2 of them vLLM's two start-ups): ar, eagle
#              and microspec with the fixed default tree and with --spec-policy auto, vLLM AR and vLLM EAGLE (the
#              same head) beside, at POLICY_LEVELS on
#              the load stage's Spec-Bench first turns (POLICY_K x c of them at level c), batched runs only; the
#              acceptance and the tree sizes the policy chose per level in the table
#   load       throughput under load (~5 min on an H200): the batched engine's step timeline at batch 64/128/256,
#              then AR and vLLM on LOAD_LIMIT x 6 Spec-Bench first turns (240) at LOAD_LEVELS, batched runs only
set -euo pipefail
KEY=${KEY:-qwen2.5-coder-1.5b}
OUT=${OUT:-gpu_out}
HEAD=${HEAD:-${MICROSPEC_CACHE:-$HOME/.cache/microspec}/engines/$KEY/eagle}
LIMIT=${LIMIT:-3}            # questions per Spec-Bench category
TOKENS=${TOKENS:-256}        # new tokens per turn
TRAIN_LIMIT=${TRAIN_LIMIT:-450}   # the held-out evaluation and --eval run after it: ~10 minutes in all
TRAIN_ARGS=${TRAIN_ARGS:---eval}
METHODS=${METHODS:-ar,eagle,frspec,microspec}   # frspec needs `microspec build-freq --engine KEY` first
LEVELS=${LEVELS:-1,2,4,8,16,32}  # sweep: the concurrency levels
LOAD_LEVELS=${LOAD_LEVELS:-32,64,128,256}  # load: the concurrency levels
LOAD_LIMIT=${LOAD_LIMIT:-40}  # load: first turns per Spec-Bench category (6 categories: 240 requests)
POLICY_LEVELS=${POLICY_LEVELS:-1,4,16,64,256}  # policy: the concurrency levels
POLICY_K=${POLICY_K:-2}      # policy: first turns per level, per unit of concurrency (level c decodes K x c)
POLICY_TOKENS=${POLICY_TOKENS:-128}  # policy: new tokens per request
POLICY_METHODS=${POLICY_METHODS:-ar,eagle@fixed,eagle@auto,microspec@fixed,microspec@auto,vllm,vllm-eagle}
REFS=${REFS:-hf-compiled}    # outside references: hf, hf-compiled, vllm, vllm-eagle (vLLM where installed)
FILL_SWEEP=${FILL_SWEEP:-1024}  # fill: W_max points beside the main 3072 (a comma list; empty: none)
DISTILL_LIMIT=${DISTILL_LIMIT:-170}   # head-ab: seconds of distilling (engine load included)
DISTILL_ARGS=${DISTILL_ARGS:---max-batch 256}
ARM_LIMIT=${ARM_LIMIT:-220}  # head-ab: --time-limit of each arm (tokenising and caching included; --eval after it)
ARMS=${ARMS:-sharegpt mixed mixed-pruned}
EVAL_Q=${EVAL_Q:-2}          # head-ab: --eval questions per category
AB_ARGS=${AB_ARGS:-}         # head-ab: more train-draft arguments for every arm (e.g. --epochs 2)
mkdir -p "$OUT"
ms() { python3 -m trtllm_microspec.cli "$@"; }
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    checks)
      python3 -m plugins.check | tee "$OUT/plugins_check.txt" | tail -2
      python3 -m plugins.check_layers | tee "$OUT/check_layers.txt" | grep -v "^PASS" ;;
    profile)
      ms profile --engine "$KEY" --out "$OUT/profile_$KEY.md" ;;
    kernels-ab)
      { python3 -m plugins.check_layers || echo "check_layers FAILED (the profile still runs: a skinny config that"\
          "disagrees with cuBLAS at first use is never picked)"; } | tee "$OUT/check_layers.txt" | grep -v "^PASS"
      ms profile --engine "$KEY" --rows 1,4,16,60,64 --iters 20 --out "$OUT/kernels_ab_$KEY.md" 2>&1 \
        | grep -v "^profile: rows" ;;
    lossless)
      python3 - "$KEY" "$OUT/random_head" <<'EOF'
import sys, torch
from trtllm_microspec.llm import resolve_engine
from trtllm_microspec.models.model import ModelConfig
from trtllm_microspec.spec.eagle import EagleDraft, draft_config, save_draft
engine = resolve_engine(sys.argv[1])
torch.manual_seed(0)  # a random head: losslessness must hold for any draft
save_draft(EagleDraft(draft_config(ModelConfig.load(engine / "config.json")), bias=False), sys.argv[2], engine)
EOF
      for dt in float32 bfloat16; do
        ms bench --engine "$KEY" --draft "$OUT/random_head" --dtype $dt --methods ar,eagle,microspec --limit 1 \
          --max-new-tokens 128 --warmup 1 --concurrency 1,4 --out "$OUT/lossless_$dt" 2>&1 | grep "mismatches"
        grep -A9 "in-flight batching" "$OUT/lossless_$dt/results.md" | tail -6
      done ;;
    train)
      ms train-draft --engine "$KEY" --out "$HEAD" --time-limit "$TRAIN_LIMIT" --save-every 0 $TRAIN_ARGS \
        2>&1 | tr '\r' '\n' | grep "\[train-draft\]\|^{\|rror" | tee "$OUT/train_$KEY.log" ;;
    bench)
      ms bench --engine "$KEY" --draft "$HEAD" --methods "$METHODS,$REFS" --limit "$LIMIT" \
        --max-new-tokens "$TOKENS" --warmup 2 --out "$OUT/bench_$KEY" | grep "tok/s" ;;
    sampling)
      ms bench --engine "$KEY" --draft "$HEAD" --methods ar,eagle,microspec --temperature 0.7 --seed 0 --limit "$LIMIT" \
        --max-new-tokens "$TOKENS" --warmup 2 --out "$OUT/bench_${KEY}_t0.7" | grep "tok/s" ;;
    sweep)
      ms bench --engine "$KEY" --draft "$HEAD" --methods ar,eagle,microspec,vllm --concurrency "$LEVELS" \
        --limit "$LIMIT" --max-new-tokens "$TOKENS" --warmup 2 --out "$OUT/sweep_$KEY" | grep "tok/s" ;;
    fill)
      engine=$(python3 -c "from trtllm_microspec.llm import resolve_engine; print(resolve_engine('$KEY'))" | tail -1)
      [ -f "$engine/token_freq.safetensors" ] || ms build-freq --engine "$KEY"   # the fill's and frspec's ranking
      ms bench --engine "$KEY" --draft "$HEAD" --methods ar,eagle,frspec,microspec-paper,microspec --limit "$LIMIT" \
        --max-new-tokens "$TOKENS" --warmup 2 ${FILL_SWEEP:+--w-max-sweep "$FILL_SWEEP"} --out "$OUT/fill_$KEY" \
        | grep "tok/s" ;;
    openai)
      OUT="$OUT/openai_$KEY" LEVELS="1 64" bash benchmarks/gpu_openai_overhead.sh "$KEY" "$HEAD" | tail -9 ;;
    head-ab)
      AB="$OUT/head_ab"; DIST="$AB/distilled"
      mkdir -p "$AB"
      if [ ! -f "$DIST/manifest.json" ]; then
        ms distill --engine "$KEY" --out "$DIST" --time-limit "$DISTILL_LIMIT" $DISTILL_ARGS 2>&1 \
          | tr '\r' '\n' | grep --line-buffered "\[distill\]\|^{\|rror" | tee "$AB/distill.log"
      fi
      for arm in $ARMS; do
        case $arm in
          sharegpt) args="--heldout-data $DIST" ;;
          sharegpt-pruned) args="--heldout-data $DIST --loss pruned" ;;
          distilled) args="--data $DIST" ;;
          mixed) args="--data $DIST --mix-sharegpt" ;;
          mixed-pruned) args="--data $DIST --mix-sharegpt --loss pruned" ;;
          mixed-pruned-ttt2) args="--data $DIST --mix-sharegpt --loss pruned --ttt-steps 2" ;;
          *) echo "unknown head-ab arm $arm"; exit 2 ;;
        esac
        ms train-draft --engine "$KEY" --out "$AB/$arm" --time-limit "$ARM_LIMIT" --save-every 0 --eval \
          --eval-methods eagle --eval-questions "$EVAL_Q" $args $AB_ARGS 2>&1 | tr '\r' '\n' \
          | grep --line-buffered "\[train-draft\]\|^{\|rror" | tee "$AB/$arm.log" || true
        grep "^{" "$AB/$arm.log" | tail -1 > "$AB/$arm.json" || true
      done
      python3 - "$AB" $ARMS <<'EOF' | tee "$AB/head_ab.md"
import json, sys
from pathlib import Path
ab, arms = Path(sys.argv[1]), sys.argv[2:]
m = json.loads((ab / "distilled" / "manifest.json").read_text())
print(f"distilled: {m['conversations']} conversations, {m['answers']} answers, {m['answer_tokens']:,} answer "
      f"tokens ({m['tokens']:,} in all), settings {json.dumps(m['settings'])}\n")
print("| arm | data | loss | ttt | train tokens | epochs | train tok/s | held-out top-1 d1..d5 | acceptance (eagle) "
      "| wall s |")
print("|---|---|---|---|---|---|---|---|---|---|")
for arm in arms:
    f = ab / f"{arm}.json"
    if not f.exists() or not f.read_text().strip():
        print(f"| {arm} | failed: see {arm}.log | | | | | | | | |")
        continue
    r = json.loads(f.read_text())
    acc = " / ".join(f"{a:.3f}" for a in r["heldout_acc"])
    print(f"| {arm} | {r['data']} | {r['loss']} | {r['ttt_steps']} | {r['train_tokens']:,} | {r['epochs']} | "
          f"{r['train_tok_per_s']:,} | {acc} | {r.get('acceptance', {}).get('eagle', '-')} | {r['wall_s']:.0f} |")
EOF
      ;;
    policy)
      # 43 first turns of each of the 6 Spec-Bench categories: 258, enough for the 256 level
      ms bench --engine "$KEY" --draft "$HEAD" --methods "$POLICY_METHODS" --concurrency "$POLICY_LEVELS" \
        --requests-per-level "$POLICY_K" --batched-only --limit 43 \
        --categories mt_bench,translation,summarization,qa,math_reasoning,rag --max-new-tokens "$POLICY_TOKENS" \
        --warmup 1 --out "$OUT/policy_$KEY" 2>&1 | grep -E "tok/s|rror"
      grep "^|" "$OUT/policy_$KEY/results.md" ;;  # batched-only: the one table is the in-flight batching one
    load)
      ms profile --engine "$KEY" --timeline --batch 64,128,256 --context 512 --new-tokens 128 \
        --out "$OUT/timeline_$KEY.md" 2>&1 | grep -E "^timeline:|rror"
      ms bench --engine "$KEY" --methods ar,vllm --concurrency "$LOAD_LEVELS" --batched-only --limit "$LOAD_LIMIT" \
        --categories mt_bench,translation,summarization,qa,math_reasoning,rag --max-new-tokens "$TOKENS" --warmup 1 \
        --out "$OUT/load_$KEY" 2>&1 | grep -E "tok/s|rror"
      grep -A12 "in-flight batching" "$OUT/load_$KEY/results.md" | tail -9 ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
