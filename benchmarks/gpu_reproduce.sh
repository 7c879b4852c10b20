#!/usr/bin/env bash
# Reproduce the GPU measurements of BENCHMARKS.md on a CUDA machine with the package installed (and the models
# fetchable, or already in MICROSPEC_CACHE). Results go to $OUT (default ./gpu_out).
#   bash benchmarks/gpu_reproduce.sh STAGE [STAGE ...]      (KEY=qwen2.5-coder-1.5b by default)
# Stages:
#   checks     the custom ops and the Triton layer kernels against their torch references (random inputs)
#   profile    per-phase time and kernel counts of a decode step, Triton vs the torch reference; one layer's pieces
#   lossless   every method vs AR with a random head, fp32 (logic: token for token) and bf16, alone and batched
#              (the batched engine's CUDA graphs, padding rows included)
#   train      train an EAGLE head for KEY into $HEAD (<= TRAIN_LIMIT s wall, caching included), with --eval
#   bench      Spec-Bench + HumanEval: AR, EAGLE, FR-Spec, MicroSpec with $HEAD, and the outside references
#   sampling   the same at temperature 0.7 (speculative sampling)
#   sweep      in-flight batching: ar, eagle, microspec at concurrency LEVELS, and vLLM at the same levels
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
REFS=${REFS:-hf-compiled}    # outside references: hf, hf-compiled, vllm, vllm-eagle (vLLM where installed)
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
