#!/usr/bin/env bash
# One request at a time, end to end through /v1/completions (qwen_jax.bench.latency), at AdaptFM's latency shapes
# (64 in / 128 out, 2,048 / 256, 8,192 / 256), after a start through ./start.sh whose launch-to-ready seconds are
# printed (an empty compile cache: a cold start). Results land in $OUT/RESULTS.json.
#   MODEL=<config dir> [LAYERS=...] [DEVICE=H100] [CACHE=/tmp/qwen_jax_cc] [REQUESTS=10] bash scripts/latency_shapes.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
DIR="$(bash scripts/model_copy.sh "${MODEL:?MODEL: a model (or config) directory}" "${LAYERS:-}")"
CACHE="${CACHE:-/tmp/qwen_jax_cc}"
export PYTHONUNBUFFERED=1 QWEN_JAX_PROGRESS=0 QWEN_JAX_LOG="$OUT/latency.log" QWEN_JAX_PID_FILE="$OUT/latency.pid"
cached=$(ls "$CACHE" 2>/dev/null | wc -l)
t0=$(date +%s.%N)
./start.sh --model "$DIR" --served-model-name m --load-format dummy --port 8000 --compilation-cache-dir "$CACHE" \
  --max-model-len 8448 --disable-access-log "$@" > "$OUT/latency_start.txt" 2>&1 \
  || { tail -30 "$QWEN_JAX_LOG"; exit 1; }
echo "ready_s $(python3 -c "import time; print(round(time.time() - $t0, 1))") (compile cache entries at launch: $cached)"
grep "compiled .* programs in\|max_num_seqs\|working memory\|device memory" "$QWEN_JAX_LOG" | cut -c1-200
python3 -m qwen_jax.bench.latency --base-url http://127.0.0.1:8000 --model m --tokenizer "$DIR" \
  --warmup 2 --num-requests "${REQUESTS:-10}" --results "$OUT/RESULTS.json" --device "${DEVICE:-H100}" \
  --layout TP=1 --weights random --no-progress --label "AdaptFM latency shapes, one request at a time" \
  > "$OUT/latency.txt" 2>&1
tail -8 "$OUT/latency.txt"
echo "programs jitted while serving: $(grep -c 'is not compiled' "$QWEN_JAX_LOG")"
./start.sh --stop > /dev/null
