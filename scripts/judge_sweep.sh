#!/usr/bin/env bash
# The judge's procedure, as one script: start the server cold through ./start.sh, then at once the throughput sweep
# c = 1, 2, 4, 8, 16, 32, 64 (64 requests a level, 1,024-token prompts, 300-token outputs, temperature 1, no warm-up
# requests), scored as the sum of weight x total tok/s (weights 1, 1, 2, 2, 4, 4, 8; qwen_jax.bench.serve). Prints
# launch-to-ready seconds and the score; RESTART=1 then stops and starts the server again on the compile cache it
# filled and prints that restart's ready time. Everything lands under $OUT (RESULTS.json entry, logs).
#
#   MODEL=<config or checkpoint dir> [LOAD_FORMAT=dummy] [PORT=8000] [DEVICE=4xH200] [LABEL=...] [CACHE=/tmp/cc]
#   [LEVELS=1,2,4,8,16,32,64] [REQUESTS=64] [OUTLEN=300] [RESTART=1] bash scripts/judge_sweep.sh [server flags]
# e.g. `bash scripts/judge_sweep.sh --layout DP=2,TP=2`; with no layout flag the server takes --layout auto.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
MODEL="${MODEL:?MODEL: a model (or config) directory}"
PORT="${PORT:-8000}"
TAG="${TAG:-judge_$PORT}"
CACHE="${CACHE:-/tmp/qwen_jax_cc}"
export PYTHONUNBUFFERED=1 QWEN_JAX_PROGRESS=0 QWEN_JAX_START_TIMEOUT="${QWEN_JAX_START_TIMEOUT:-590}"
export QWEN_JAX_LOG="$OUT/$TAG.log" QWEN_JAX_PID_FILE="$OUT/$TAG.pid"
ARGS=(--model "$MODEL" --served-model-name m --load-format "${LOAD_FORMAT:-dummy}" --port "$PORT"
      --compilation-cache-dir "$CACHE" --disable-access-log "$@")
now() { date +%s.%N; }
since() { python3 -c "import sys; print(round($(now) - float(sys.argv[1]), 1))" "$1"; }

cached=$(ls "$CACHE" 2>/dev/null | wc -l)
t0=$(now)
echo "$TAG launched at $(date +%T.%N)"
./start.sh "${ARGS[@]}" > "$OUT/${TAG}_start.txt" 2>&1 || { echo "start failed"; tail -30 "$QWEN_JAX_LOG"; exit 1; }
echo "$TAG ready_s $(since "$t0") (the compile cache had $cached entries at launch: 0 is a cold start)"
MODEL="$MODEL" TAG="$TAG" bash scripts/judge_levels.sh "$@"
grep -c "compiled " "$QWEN_JAX_LOG" | sed "s/^/$TAG programs compiled: /"
grep "compiled .* programs in\|working memory\|max_num_seqs\|KV cache\|layout:\|loaded " "$QWEN_JAX_LOG" | cut -c1-260
bash scripts/startup_timeline.sh "$QWEN_JAX_LOG"
./start.sh --stop > /dev/null
if [[ "${RESTART:-0}" == 1 ]]; then
  export QWEN_JAX_LOG="$OUT/${TAG}_restart.log"
  t0=$(now)
  ./start.sh "${ARGS[@]}" > "$OUT/${TAG}_restart.txt" 2>&1 || { echo "restart failed"; tail -30 "$QWEN_JAX_LOG"; }
  echo "$TAG warm_restart_ready_s $(since "$t0")"
  bash scripts/startup_timeline.sh "$QWEN_JAX_LOG"
  ./start.sh --stop > /dev/null
fi
