#!/usr/bin/env bash
# Device check of the server on full-size random weights (one GPU): cold start, a chat request, a 64-way burst
# through the serving benchmark, then a restart with the persistent compile cache. Results under $OUT (or ./out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
MODEL="${MODEL:-.devdata/Qwen3.5-35B-A3B}"
export QWEN_JAX_LOG="$OUT/server.log" QWEN_JAX_PROGRESS=0
ARGS=(--model "$MODEL" --load-format dummy --max-model-len 2304 --max-num-seqs 64 --port 8000
      --compilation-cache-dir /tmp/qwen_jax_cc)
URL=http://127.0.0.1:8000
bench() {  # bench CONCURRENCY NUM_REQUESTS
  timeout "${BENCH_TIMEOUT:-240}" python3 -m qwen_jax.bench.serve --base-url "$URL" --model m --tokenizer "$MODEL" \
    --concurrency "$1" --num-requests "$2" --input-len 1024 --output-len "${OUTLEN:-32}" --results "$OUT/RESULTS.json" \
    --device H200 --device-count 1 --layout TP=1 --weights random --model-config "$MODEL/config.json" --no-progress \
    2>&1 | tee -a "$OUT/serve_bench.txt"
}
since() { python3 -c "import time,sys; print(round(time.time()-float(sys.argv[1]),1))" "$1"; }

t0=$(date +%s.%N); ./start.sh "${ARGS[@]}" || { tail -50 "$OUT/server.log"; exit 1; }
echo "cold_start_s $(since "$t0")"
t0=$(date +%s.%N)
curl -s "$URL/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"model":"m","messages":[{"role":"user","content":"Say hello."}],"max_tokens":16,"temperature":0}' \
  | tee "$OUT/chat.json"; echo; echo "chat_s $(since "$t0")"
./start.sh --stop
t0=$(date +%s.%N); ./start.sh "${ARGS[@]}" || { tail -50 "$OUT/server.log"; exit 1; }
echo "warm_start_s $(since "$t0")"
bench 1 4
bench 64 64
curl -s "$URL/metrics" > "$OUT/metrics.txt"
./start.sh --stop
