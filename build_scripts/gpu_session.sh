#!/usr/bin/env bash
# Stages of a GPU session on the lent H200 (see build_scripts/xfer.sh for moving models there first).
# Run from the repo root there:  bash build_scripts/gpu_session.sh STAGE [STAGE ...]
#   setup     carried wheels (.xfer/wheels, .whl*) -> /tmp/site; data -> /root/stash
#   engines   /root/stash/KEY.gguf -> /root/engines/KEY for every stashed model; FR-Spec frequencies
#   plugins   build the CUDA extension, then the CUDA-vs-reference agreement check
#   lossless  every method vs AR on Spec-Bench prompts with smollm2-135m (bf16, CUDA graphs)
#   kernels   microspec bench-kernels
# Results go to $OUT (the device tool brings them back).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 MICROSPEC_CACHE=/root/cache OUT=${OUT:-/tmp/out}
export PYTHONPATH=/tmp/site:$PWD MICROSPEC_DATA=/root/stash/data MICROSPEC_SHAREGPT_WHEEL=/root/stash/sharegpt.whl
ms() { python3 -m trtllm_microspec.cli "$@"; }
mkdir -p /root/stash /root/engines "$OUT"

for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    setup)
      for d in .xfer/wheels .whl .whl2; do
        ls $d/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile \
          --no-cache-dir --upgrade --target /tmp/site $d/*.whl
      done
      [ -d .xfer/data ] && cp -r .xfer/data /root/stash/
      ls .xfer/sharegpt*.whl >/dev/null 2>&1 && cp .xfer/sharegpt*.whl /root/stash/sharegpt.whl
      nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader ;;
    engines)
      for g in /root/stash/*.gguf; do
        key=$(basename "$g" .gguf)
        [ -f /root/engines/$key/config.json ] || ms build "$g" --out /root/engines/$key > /dev/null
        [ -f /root/engines/$key/token_freq.safetensors ] || ms build-freq --engine /root/engines/$key --limit 4000
        ls /root/engines/$key
      done ;;
    plugins)
      python3 build_scripts/build_plugins.py && python3 -m plugins.check 2>&1 | tee $OUT/plugins_check.txt ;;
    lossless)
      python3 - <<'EOF'
import torch
from pathlib import Path
from trtllm_microspec.models.model import ModelConfig
from trtllm_microspec.spec.eagle import EagleDraft, draft_config, save_draft
eng = Path("/root/engines/smollm2-135m")
if not (eng / "eagle").exists():  # a random head: losslessness must hold for any draft
    torch.manual_seed(0)
    save_draft(EagleDraft(draft_config(ModelConfig.load(eng / "config.json")), bias=False), Path("/root/random_draft"), eng)
EOF
      draft=/root/engines/smollm2-135m/eagle; [ -d $draft ] || draft=/root/random_draft
      ms bench --engine /root/engines/smollm2-135m --draft $draft --device cuda \
        --methods ar,eagle,frspec,microspec,ctx-only,ext-only,naive --limit 2 --max-new-tokens 128 --warmup 1 \
        --out $OUT/lossless_smollm2 ;;
    kernels)
      ms bench-kernels --out $OUT/bench_kernels.md ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
echo "=== done $(date +%T)"
