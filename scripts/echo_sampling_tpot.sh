#!/usr/bin/env bash
# MTP at full acceptance (--load-format dummy_echo) with a checkpoint's own sampling: a model directory with
# generation_config.json {"top_k": 20, "top_p": 0.95}; c = 1 TPOT of greedy requests, then of requests at TEMPERATURE
# (default 0.01), which take top_k/top_p from that file and draw from the top-k/top-p sampler (nearly always the
# draft). Both land in $OUT/RESULTS.json; the count of programs jitted while serving is printed last (0: none).
#   MODEL=<config dir> [LAYERS=20] [DEVICE=H100] [CACHE=/tmp/qwen_jax_cc] bash scripts/echo_sampling_tpot.sh [flags]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
DIR="$(bash scripts/model_copy.sh "${MODEL:?MODEL: a model (or config) directory}" "${LAYERS:-}")"
echo '{"top_k": 20, "top_p": 0.95}' > "$DIR/generation_config.json"
depth="${LAYERS:+, depth-truncated to $LAYERS layers}"
export PYTHONUNBUFFERED=1 QWEN_JAX_PROGRESS=0 QWEN_JAX_LOG="$OUT/echo.log" QWEN_JAX_PID_FILE="$OUT/echo.pid"
t0=$(date +%s)
./start.sh --model "$DIR" --served-model-name m --load-format dummy_echo --port 8000 \
  --compilation-cache-dir "${CACHE:-/tmp/qwen_jax_cc}" \
  --disable-access-log "$@" > "$OUT/echo_start.txt" 2>&1 || { tail -30 "$QWEN_JAX_LOG"; exit 1; }
echo "echo server ready in $(( $(date +%s) - t0 )) s"
for temperature in 0 "${TEMPERATURE:-0.01}"; do
  python3 -m qwen_jax.bench.serve --base-url http://127.0.0.1:8000 --model m --tokenizer "$DIR" --concurrency 1 \
    --num-requests 16 --warmup-requests 2 --input-len 1024 --output-len 300 --temperature "$temperature" \
    --results "$OUT/RESULTS.json" --device "${DEVICE:-H200}" --layout TP=1 --weights random --no-progress \
    --label "dummy_echo MTP (default policy), generation_config top_k 20 top_p 0.95, temperature $temperature$depth" \
    > "$OUT/echo_$temperature.txt" 2>&1
  grep -A4 "^ conc" "$OUT/echo_$temperature.txt" | grep -v "^$" || tail -20 "$OUT/echo_$temperature.txt"
done
echo "programs jitted while serving: $(grep -c 'is not compiled' "$QWEN_JAX_LOG")"
./start.sh --stop > /dev/null
