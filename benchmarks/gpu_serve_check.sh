#!/usr/bin/env bash
# Serving on a GPU machine: `microspec serve` on the real tritonserver, one streamed request, a short load run.
# Run from the repo root (python3.12 with CUDA torch):
#   bash benchmarks/gpu_serve_check.sh ENGINE_DIR [DRAFT_DIR]
# Needs nvidia-pytriton (tritonserver and its Python backend) and tritonclient importable (SERVE_SITE: an extra
# folder for them, default /tmp/serve-site), and numpy 1.x for Triton's Python stub in STUB_SITE (default
# /tmp/stub-site; see trtllm_microspec/serving/server.py).
# Knobs: INSTANCE_KIND=gpu|cpu (Triton instance kind; the model runs on cuda either way), GRPC_PORT, MAX_TOKENS,
# CONCURRENCY, REQUESTS, DEVICE (cuda; cpu with INSTANCE_KIND=cpu rehearses the script on a CPU machine).
set -euo pipefail
ENGINE=${1:?usage: gpu_serve_check.sh ENGINE_DIR [DRAFT_DIR]}
DRAFT=(${2:+--draft "$2"})
DEVICE=${DEVICE:-cuda}
KIND=${INSTANCE_KIND:-gpu}
PORT=${GRPC_PORT:-8001}
MAX_TOKENS=${MAX_TOKENS:-256}
CONCURRENCY=${CONCURRENCY:-4}
REQUESTS=${REQUESTS:-16}

LOG=/tmp/microspec-serve.out
TRITON_LOG=/tmp/tritonserver.log
source benchmarks/serve_up.sh
serve_up "$LOG" --engine "$ENGINE" "${DRAFT[@]}" --device "$DEVICE" --instance-kind "$KIND" --grpc-port "$PORT" \
  --http-port $((PORT - 1)) --metrics-port $((PORT + 1)) --log-file "$TRITON_LOG"
stop() {
  kill -TERM $SERVE 2>/dev/null && wait $SERVE || true
  tail -n 1 "$LOG"
  echo "after stop: $(pgrep -fc triton_python_backend_stub || true) stub processes, $(ls /dev/shm | grep -c ^microspec_ || true) shared-memory regions"
}
trap stop EXIT

echo "== one streamed request"
"${MS[@]}" client --url 127.0.0.1:$PORT --chat --max-tokens "$MAX_TOKENS" \
  --prompt "Explain in a few sentences why the sky is blue."
echo "== load: $REQUESTS requests, concurrency $CONCURRENCY, $MAX_TOKENS tokens max"
"${MS[@]}" client --url 127.0.0.1:$PORT --chat --max-tokens "$MAX_TOKENS" --concurrency "$CONCURRENCY" --requests "$REQUESTS" \
  --prompt "Write a short poem about the ocean." --prompt "What is the capital of Australia? Answer briefly." \
  --prompt "Explain how a hash map works." --prompt "Give three tips for learning to play the guitar."
echo "== fault: the model's process killed under load (serve fails the requests in flight, restarts tritonserver)"
"${MS[@]}" client --url 127.0.0.1:$PORT --chat --max-tokens "$MAX_TOKENS" --concurrency "$CONCURRENCY" \
  --requests "$CONCURRENCY" --prompt "Explain how a hash map works." >/tmp/microspec-fault-load.out 2>&1 &
LOAD=$!
sleep 2
STUB=$(pgrep -f "triton_python_backend_stub .* microspec_${SERVE}_" | head -n 1)
T0=$(date +%s.%N)
kill -9 "$STUB"
wait $LOAD || true  # its requests end with an error, at once
echo "load ended $(python3 -c "import time; print(f'{time.time() - $T0:.1f}')") s after the kill: $(tail -n 1 /tmp/microspec-fault-load.out)"
for _ in $(seq 300); do grep -q "ready again" "$LOG" && break; kill -0 $SERVE; sleep 1; done
grep "microspec serve:" "$LOG"
"${MS[@]}" client --url 127.0.0.1:$PORT --chat --max-tokens 32 --prompt "Say hello."
