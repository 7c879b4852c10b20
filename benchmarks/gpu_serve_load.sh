#!/usr/bin/env bash
# The server under load beside the offline engine (issue 36): one `microspec serve --openai-port`, the Spec-Bench
# first turns of the load stage repeated to REQUESTS at each of LEVELS over gRPC and over the OpenAI endpoint
# (`microspec bench --server`: streamed, chat template, greedy; the same requests once unmeasured first), then the
# offline engine on the same requests (`bench --concurrency ... --requests ... --prefix-cache --batched-only`, ar and
# METHOD; the prefix cache on as in the server), and the three side by side.
# Run from the repo root (python3.12 with CUDA torch):
#   bash benchmarks/gpu_serve_load.sh ENGINE_DIR_OR_KEY [DRAFT_DIR]
# Needs what gpu_serve_check.sh needs (nvidia-pytriton + tritonclient in SERVE_SITE, numpy<2 in STUB_SITE) and
# fastapi + uvicorn importable. Knobs: LEVELS (default "64,256"), REQUESTS (1000), MAX_TOKENS (256), LIMIT (40 first
# turns of each of 6 categories), METHOD (microspec), GRPC_PORT (8001; HTTP one below, metrics one above, OpenAI two
# above), OUT (results folder, default /tmp/serve-load), DEVICE (cuda), INSTANCE_KIND (gpu). DEVICE=cpu
# INSTANCE_KIND=cpu LEVELS=2 REQUESTS=4 MAX_TOKENS=8 rehearses it on a CPU machine.
set -euo pipefail
ENGINE=${1:?usage: gpu_serve_load.sh ENGINE_DIR_OR_KEY [DRAFT_DIR]}
DRAFT=(${2:+--draft "$2"})
PORT=${GRPC_PORT:-8001}
OPENAI_PORT=$((PORT + 2))
LEVELS=${LEVELS:-64,256}
REQUESTS=${REQUESTS:-1000}
MAX_TOKENS=${MAX_TOKENS:-256}
LIMIT=${LIMIT:-40}
METHOD=${METHOD:-microspec}
DEVICE=${DEVICE:-cuda}
KIND=${INSTANCE_KIND:-gpu}
OUT=${OUT:-/tmp/serve-load}
MAX_BATCH=$(echo $LEVELS | tr ',' '\n' | sort -n | tail -1)
CATS=mt_bench,translation,summarization,qa,math_reasoning,rag

mkdir -p "$OUT"
TRITON_LOG=$OUT/tritonserver.log
source benchmarks/serve_up.sh
# the queue holds a whole level's requests beyond the batch, so that none is refused
serve_up "$OUT/serve.out" --engine "$ENGINE" "${DRAFT[@]}" --method "$METHOD" --device "$DEVICE" --instance-kind "$KIND" \
  --max-batch "$MAX_BATCH" --max-queue-size $((REQUESTS + MAX_BATCH)) --grpc-port "$PORT" --http-port $((PORT - 1)) \
  --metrics-port $((PORT + 1)) --openai-port "$OPENAI_PORT" --log-file "$TRITON_LOG"
for api in grpc openai; do
  url=127.0.0.1:$PORT; [ $api = openai ] && url=http://127.0.0.1:$OPENAI_PORT/v1
  "${MS[@]}" bench --server "$url" --concurrency "$LEVELS" --requests "$REQUESTS" --limit "$LIMIT" --categories "$CATS" \
    --max-new-tokens "$MAX_TOKENS" --warmup 1 --out "$OUT/$api" 2>&1 | grep -E "tok/s|rror"
done
kill -TERM $SERVE && wait $SERVE || true
trap - EXIT
# with the prefix cache, as the server runs (its default): the same prompts repeat in both
"${MS[@]}" bench --engine "$ENGINE" "${DRAFT[@]}" --device "$DEVICE" --methods "ar,$METHOD" --concurrency "$LEVELS" \
  --requests "$REQUESTS" --prefix-cache --batched-only --limit "$LIMIT" --categories "$CATS" --max-new-tokens "$MAX_TOKENS" --warmup 1 \
  --out "$OUT/offline" 2>&1 | grep -E "tok/s|rror"
python3 - "$OUT" "$METHOD" <<'EOF'
import json, sys
out, method = sys.argv[1], sys.argv[2]
ms = lambda p: f"{p['p50'] * 1e3:.1f} / {p['p99'] * 1e3:.1f}"
runs = json.load(open(f"{out}/offline/results.json"))["runs"]
offline = {(m, r["concurrency"]): r for m, run in runs.items() for r in run.get("batched") or []}
print("\nx offline: against the offline engine's METHOD at the same level. TTFT: the server's from each request's "
      "sending (the client keeps c in flight), the offline engine's from the level's submission of all of them "
      "(queueing for a slot included); ITL: the client's per request (last piece - first) / (tokens - 1), the "
      "engine's per step.")
print("\n| concurrency | system | requests | output tok/s | x offline | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) |")
print("|---|---|---|---|---|---|---|")
for api in ("grpc", "openai"):
    for x in json.load(open(f"{out}/{api}/results.json"))["levels"]:
        c, off = x["concurrency"], offline.get((method, x["concurrency"]))
        ratio = f"{x['output_tokens_per_s'] / off['output_tokens_per_s']:.2f}" if off else "-"
        print(f"| {c} | server, {api} | {x['completed']}/{x['requests']} | {x['output_tokens_per_s']:.1f} | {ratio} | "
              f"{ms(x['ttft_s'])} | {ms(x['itl_s'])} |")
for (m, c), r in sorted(offline.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    print(f"| {c} | offline, {m} | {r['requests']} | {r['output_tokens_per_s']:.1f} | "
          f"{r['output_tokens_per_s'] / offline[(method, c)]['output_tokens_per_s']:.2f} | {ms(r['ttft_s'])} | "
          f"{ms(r['itl_s'])} |")
EOF
