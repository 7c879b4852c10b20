#!/usr/bin/env bash
# Serving on the GPU machine (issue 6): `microspec serve` on the real tritonserver, one streamed request, a short
# load run. Run from the repo root there (python3.12 with CUDA torch, no internet):
#   bash build_scripts/device_serve_check.sh ENGINE_DIR [DRAFT_DIR]
# Wheels come carried and are installed by `gpu_session.sh setup`: .whl/ (nvidia-pytriton: tritonserver and its
# Python backend) and .whl2/ (tritonclient, grpcio, protobuf, python-rapidjson, ml_dtypes, jinja2, markupsafe) into
# /tmp/serve-site, and numpy 1.26 into /tmp/stub-site for Triton's Python stub only.
# Knobs: INSTANCE_KIND=gpu|cpu (Triton instance kind; the model runs on cuda either way), GRPC_PORT, MAX_TOKENS,
# CONCURRENCY, REQUESTS, DEVICE (cuda; cpu with INSTANCE_KIND=cpu rehearses the script on a CPU machine).
set -euo pipefail
ENGINE=${1:?usage: device_serve_check.sh ENGINE_DIR [DRAFT_DIR]}
DRAFT=(${2:+--draft "$2"})
DEVICE=${DEVICE:-cuda}
KIND=${INSTANCE_KIND:-gpu}
PORT=${GRPC_PORT:-8001}
MAX_TOKENS=${MAX_TOKENS:-256}
CONCURRENCY=${CONCURRENCY:-4}
REQUESTS=${REQUESTS:-16}

[ -d /tmp/serve-site/pytriton ] && [ -d /tmp/stub-site/numpy ] || { echo "run gpu_session.sh setup with .whl and .whl2 first"; exit 2; }
export PYTHONPATH=/tmp/serve-site:/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
MS=(python3 -m trtllm_microspec.cli)

python3 -c "import torch; print('device:', torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu',
                                 '| torch', torch.__version__)"
LOG=/tmp/microspec-serve.out
"${MS[@]}" serve --engine "$ENGINE" "${DRAFT[@]}" --device "$DEVICE" --instance-kind "$KIND" --stub-site /tmp/stub-site \
  --grpc-port "$PORT" --http-port $((PORT - 1)) --metrics-port $((PORT + 1)) --log-file /tmp/tritonserver.log \
  >"$LOG" 2>&1 &
SERVE=$!
stop() {
  kill -TERM $SERVE 2>/dev/null && wait $SERVE || true
  tail -n 1 "$LOG"
  echo "after stop: $(pgrep -fc triton_python_backend_stub || true) stub processes, $(ls /dev/shm | grep -c ^microspec_ || true) shared-memory regions"
}
trap stop EXIT
until grep -q "ready in" "$LOG"; do
  kill -0 $SERVE 2>/dev/null || { echo "serve exited:"; tail -n 20 /tmp/tritonserver.log; exit 1; }
  sleep 1
done
cat "$LOG"

echo "== one streamed request"
"${MS[@]}" client --url 127.0.0.1:$PORT --chat --max-tokens "$MAX_TOKENS" \
  --prompt "Explain in a few sentences why the sky is blue."
echo "== load: $REQUESTS requests, concurrency $CONCURRENCY, $MAX_TOKENS tokens max"
"${MS[@]}" client --url 127.0.0.1:$PORT --chat --max-tokens "$MAX_TOKENS" --concurrency "$CONCURRENCY" --requests "$REQUESTS" \
  --prompt "Write a short poem about the ocean." --prompt "What is the capital of Australia? Answer briefly." \
  --prompt "Explain how a hash map works." --prompt "Give three tips for learning to play the guitar."
