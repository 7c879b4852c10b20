# Sourced by the serving benchmarks (gpu_openai_overhead.sh, gpu_serve_load.sh): SERVE_SITE (nvidia-pytriton +
# tritonclient, default /tmp/serve-site) on the path, STUB_SITE (numpy<2 for Triton's Python stub, default
# /tmp/stub-site) checked, MS the CLI, the device and commit printed, and
#   serve_up LOG SERVE_ARGS...   `microspec serve SERVE_ARGS` in the background until it prints its endpoints
#                                (SERVE: its pid; stopped when the script exits; TRITON_LOG: shown if it fails)
SERVE_SITE=${SERVE_SITE:-/tmp/serve-site}
STUB_SITE=${STUB_SITE:-/tmp/stub-site}
[ -d "$STUB_SITE/numpy" ] || { echo "no numpy for Triton's Python stub in $STUB_SITE"; exit 2; }
export PYTHONPATH=$SERVE_SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}
MS=(python3 -m trtllm_microspec.cli)
python3 -c "import torch; print('device:', torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu',
                                 '| torch', torch.__version__)"
git log -1 --format='commit %h %s' 2>/dev/null || true

serve_up() {
  local log=$1
  shift
  "${MS[@]}" serve --stub-site "$STUB_SITE" "$@" >"$log" 2>&1 &
  SERVE=$!
  trap 'kill -TERM $SERVE 2>/dev/null && wait $SERVE || true' EXIT
  until grep -q "Ctrl-C" "$log"; do
    kill -0 $SERVE 2>/dev/null || { echo "serve exited:"; tail -n 20 "$log" ${TRITON_LOG:-}; exit 1; }
    sleep 1
  done
  cat "$log"
}
