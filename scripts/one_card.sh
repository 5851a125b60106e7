#!/usr/bin/env bash
# Qwen3.5-35B-A3B (random weights) on one 80 GB card: first a configuration that cannot fit (--max-num-seqs 128),
# which must be refused before the weights load, naming the limit; then a cold start at max_model_len 4096 with the
# most sequences that fit (no --max-num-seqs), and the serving benchmark at c = 1, 16 and 32 (1,024 in / 1,024 out,
# two waves a level). KEEP=1 leaves the server up (scripts/judge_levels.sh can follow); else it is stopped.
#   MODEL=<35B-A3B config dir> [UTIL=0.95] [DEVICE=1xH100] [CACHE=/tmp/qwen_jax_cc] [REFUSAL=0] [LEVELS=1,16,32]
#   bash scripts/one_card.sh [flags]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
MODEL="${MODEL:?MODEL: a model (or config) directory}"
export PYTHONUNBUFFERED=1 QWEN_JAX_PROGRESS=0 QWEN_JAX_START_TIMEOUT=560 QWEN_JAX_PID_FILE="$OUT/server.pid"
ARGS=(--model "$MODEL" --served-model-name m --load-format dummy --port 8000 --max-model-len 4096
      --gpu-memory-utilization "${UTIL:-0.95}" --compilation-cache-dir "${CACHE:-/tmp/qwen_jax_cc}" --disable-access-log)
now() { date +%s.%N; }
since() { python3 -c "import sys; print(round($(now) - float(sys.argv[1]), 1))" "$1"; }
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader

if [[ "${REFUSAL:-1}" == 1 ]]; then
  t0=$(now)
  QWEN_JAX_LOG="$OUT/refused.log" ./start.sh "${ARGS[@]}" --max-num-seqs 128 "$@" > "$OUT/refused.txt" 2>&1 \
    && { echo "--max-num-seqs 128 was NOT refused"; ./start.sh --stop; }
  echo "refused after $(since "$t0") s:"; grep -h "MemoryPlanError\|measured in\|loading weights" "$OUT/refused.log" \
    | cut -c1-400 | tail -4
fi

export QWEN_JAX_LOG="$OUT/server.log"
cached=$(ls "${CACHE:-/tmp/qwen_jax_cc}" 2>/dev/null | wc -l)
t0=$(now)
./start.sh "${ARGS[@]}" "$@" > "$OUT/start.txt" 2>&1 || { echo "start failed"; tail -40 "$QWEN_JAX_LOG"; exit 1; }
echo "ready_s $(since "$t0") (compile cache entries at launch: $cached)"
grep "max_num_seqs\|working memory\|device memory\|KV cache\|compiled .* programs in" "$QWEN_JAX_LOG" \
  | cut -c1-300
python3 -m qwen_jax.bench.serve --base-url http://127.0.0.1:8000 --model m --tokenizer "$MODEL" \
  --concurrency "${LEVELS:-1,16,32}" --waves 2 --levels-out "$OUT/levels.json" --input-len 1024 --output-len 1024 --temperature 1 --results "$OUT/RESULTS.json" \
  --device "${DEVICE:-1xH100}" --layout TP=1 --weights random --model-config "$MODEL/config.json" \
  --bandwidth "${BANDWIDTH:-3.35}" --no-progress \
  --label "35B-A3B on one 80 GB card: max_model_len 4096, the most sequences that fit, gpu_memory_utilization ${UTIL:-0.95}" \
  > "$OUT/one_card_serve.txt" 2>&1
grep -A6 "^ conc" "$OUT/one_card_serve.txt" | grep -v "^$" || tail -20 "$OUT/one_card_serve.txt"
echo "errors in the log: $(grep -c 'out of memory\|RESOURCE_EXHAUSTED\|Traceback' "$QWEN_JAX_LOG")"
echo "programs jitted while serving: $(grep -c 'is not compiled' "$QWEN_JAX_LOG")"
[[ "${KEEP:-0}" == 1 ]] || ./start.sh --stop > /dev/null
