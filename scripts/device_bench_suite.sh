#!/usr/bin/env bash
# One H200 call that measures what the issues ask of a single GPU, each part under its own time limit (PARTS picks):
# kernel benchmark, decode/prefill step profile vs roofline, kernel parity, the server with the serving table and a
# chat request, a restart with the compile cache, then engine-skeleton traces (scaled).
# Everything lands under $OUT (RESULTS.json entries included).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
MODEL="${MODEL:-.devdata/Qwen3.5-35B-A3B}"
export PYTHONUNBUFFERED=1 QWEN_JAX_PROGRESS=0
PARTS=" ${PARTS:-kernels step_profile traces kernel_parity server restart} "  # also: gdn_prefill one_batch latency_4b multi_gpu_steps multi_gpu_dp
part() { [[ "$PARTS" == *" $1 "* ]] || return 1; echo "== $1 ($(date +%T))"; }

if part kernels; then
  timeout "${T_KERNELS:-420}" python3 -m qwen_jax.bench.kernels --defaults-only --budget-s 150 > "$OUT/kernels.txt" 2>&1
  awk '/^### /{s=1; print; next} s && /^\|/{s=2; print; next} s==2{s=0} /FAILED/' "$OUT/kernels.txt"  # the tables
fi

if part gdn_prefill; then  # the chunked-prefill kernel alone (new, never compiled for a GPU before): its whole sweep
  timeout "${T_GDN_PREFILL:-540}" python3 -m qwen_jax.bench.kernels --only gdn_prefill --budget-s 420 \
    > "$OUT/gdn_prefill.txt" 2>&1; tail -40 "$OUT/gdn_prefill.txt"
fi

if part step_profile; then
  for k in ${STEP_KERNELS:-reference gpu}; do
    timeout "${T_STEP:-150}" python3 -m qwen_jax.bench.step_profile --config "$MODEL/config.json" --batches 1,16,64 \
      --context 1024 --kernels $k --prefill "${PREFILL:-1024,2048}" --no-layers > "$OUT/step_profile_$k.txt" 2>&1
    grep '^{"decode\|^{"prefill' "$OUT/step_profile_$k.txt" || tail -5 "$OUT/step_profile_$k.txt"
  done
fi

if part kernel_parity; then  # one process, one copy of the random weights, engines with both kernel settings
  PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout "${T_PARITY:-420}" python3 scripts/kernel_parity.py \
    --model "$MODEL" --steps "${PARITY_STEPS:-256}" ${PARITY_ARGS:---prompts 4 --embed-scale 1 --residual-scale 0.002 --dt-bias -4} \
    --out "$OUT/parity.json" > "$OUT/parity.log" 2>&1
  grep "^{" "$OUT/parity.log" || tail -20 "$OUT/parity.log"
fi

export QWEN_JAX_LOG="$OUT/server.log" QWEN_JAX_START_TIMEOUT=${QWEN_JAX_START_TIMEOUT:-300}
URL=http://127.0.0.1:8000
SERVER_ARGS=(--model "$MODEL" --served-model-name m --load-format dummy --max-model-len "${MAX_MODEL_LEN:-4096}"
             --max-num-seqs "${MAX_NUM_SEQS:-64}" --port 8000 --kernels "${KERNELS:-gpu}"
             --compilation-cache-dir /tmp/qwen_jax_cc)
chat() {  # one greedy chat request, its JSON reply saved to $OUT/chat.json
  curl -s "$URL/v1/chat/completions" -H 'Content-Type: application/json' \
    -d '{"model":"m","messages":[{"role":"user","content":"Say hello."}],"max_tokens":16,"temperature":0}' \
    > "$OUT/chat.json"; cut -c1-600 "$OUT/chat.json"; echo
}
if part server; then
  t0=$(date +%s)
  ./start.sh "${SERVER_ARGS[@]}" > "$OUT/start.txt" 2>&1 || tail -30 "$OUT/server.log"
  echo "start_s $(( $(date +%s) - t0 )) (compile cache: $(ls /tmp/qwen_jax_cc 2>/dev/null | wc -l) entries now)"
  grep -i "fit\|load" "$OUT/server.log" | head -5
  # The whole table as one RESULTS.json entry: each level warms up with 2 requests, then WAVES waves of c requests.
  timeout "${T_SERVE:-$(( 575 - SECONDS ))}" python3 -m qwen_jax.bench.serve --base-url "$URL" --model m --tokenizer "$MODEL" \
    --concurrency "${CONC:-1,2,4,8,16,32,64}" --waves "${WAVES:-1}" --input-len 1024 --output-len "${OUTLEN:-1024}" \
    --results "$OUT/RESULTS.json" --device H200 --device-count 1 --layout TP=1 --weights random \
    --model-config "$MODEL/config.json" --no-progress --label "kernels=${KERNELS:-gpu}" \
    --levels-out "$OUT/levels.json" ${PREV:+--previous-levels "$PREV"} > "$OUT/serve_bench.txt" 2>&1
  chat
  grep -v "^W1\|^I1" "$OUT/serve_bench.txt" | tail -30
  curl -s "$URL/metrics" > "$OUT/metrics.txt"; grep "^qwen_jax_engine_step" "$OUT/metrics.txt"
  grep -i "compiled [0-9]* programs\|working memory\|loaded" "$OUT/server.log" | cut -c1-160 | tail -16
  ./start.sh --stop
fi

if part restart; then  # start-up again with the persistent compile cache filled by the run above
  t0=$(date +%s)
  ./start.sh "${SERVER_ARGS[@]}" > "$OUT/restart.txt" 2>&1 || tail -30 "$OUT/server.log"
  echo "warm_start_s $(( $(date +%s) - t0 ))"
  chat
  ./start.sh --stop
fi

if part traces; then
timeout "${T_TRACES:-150}" python3 -m qwen_jax.bench.engine --config "$MODEL/config.json" --device cuda --mode traces \
  --scale --warmup 1 --repeats 2 --results "$OUT/RESULTS.json" --device-name H200 --layout TP=1 \
  --kernels "${KERNELS:-gpu}" \
  > "$OUT/traces.txt" 2>&1; grep -v "^W1\|^I1" "$OUT/traces.txt" | tail -12
fi

if part one_batch; then  # SGLang-style batch latency, 4,096-token inputs (through qwen_jax.LLM)
  timeout "${T_ONE_BATCH:-300}" python3 -m qwen_jax.bench.engine --config "$MODEL/config.json" --device cuda \
    --mode one-batch --batch "${BATCHES:-1,2,4,8,16,64}" --input-len 4096 --output-len 32 --warmup 1 \
    --kernels "${KERNELS:-gpu}" --results "$OUT/RESULTS.json" --device-name H200 --layout TP=1 \
    > "$OUT/one_batch.txt" 2>&1; grep -v "^W1\|^I1" "$OUT/one_batch.txt" | tail -12
fi

if part latency_4b; then  # single-request latency of the dense hybrid (Qwen3.5-4B shapes), through the server
  M4=.devdata/Qwen3.5-4B
  ./start.sh --model "$M4" --served-model-name m --load-format dummy --max-model-len 8704 --max-num-seqs 4 --port 8000 \
    --kernels "${KERNELS:-gpu}" --compilation-cache-dir /tmp/qwen_jax_cc > "$OUT/start_4b.txt" 2>&1 || tail -30 "$OUT/server.log"
  timeout "${T_LATENCY:-400}" python3 -m qwen_jax.bench.latency --base-url "$URL" --model m --tokenizer "$M4" \
    --num-requests "${LAT_N:-50}" --results "$OUT/RESULTS.json" --device H200 --device-count 1 --layout TP=1 \
    --weights random --label "Qwen3.5-4B shapes, kernels=${KERNELS:-gpu}" --no-progress > "$OUT/latency_4b.txt" 2>&1
  grep -v "^W1\|^I1" "$OUT/latency_4b.txt" | tail -12
  ./start.sh --stop
fi

# 2 GPUs (nvidia-h200-x2), issue 5. Two parts, each fits one 10-minute call:
# multi_gpu_steps: decode/prefill step times on one GPU, TP=2 and EP=2 (GPU busy time too: --profile);
# multi_gpu_dp: the same batches through the engine on one replica and on 2 (B=64: 32 rows per replica).
if part multi_gpu_steps; then
  for layout in "--tensor-parallel-size 1" "--tensor-parallel-size 2" "--tensor-parallel-size 2 --enable-expert-parallel"; do
    for k in ${STEP_KERNELS:-gpu}; do
      name="$(echo "$layout" | tr -d ' -')_$k"
      devices=$([[ "$layout" == *"size 1"* ]] && echo 0 || echo "${CUDA_VISIBLE_DEVICES:-0,1}")
      CUDA_VISIBLE_DEVICES=$devices timeout "${T_STEP:-180}" python3 -m qwen_jax.bench.step_profile \
        --config "$MODEL/config.json" --batches 1,64 --context 1024 --kernels $k --prefill 2048 --no-layers --profile \
        $layout > "$OUT/step_profile_$name.txt" 2>&1
      echo "$name"; grep '^{"mesh\|^{"decode\|^{"prefill' "$OUT/step_profile_$name.txt" | cut -c1-700
      [[ ${PIPESTATUS[0]} == 0 ]] || tail -5 "$OUT/step_profile_$name.txt"  # no result lines: show the error
    done
  done
fi

if part multi_gpu_dp; then
  for dp in 1 2; do
    timeout "${T_ONE_BATCH:-200}" python3 -m qwen_jax.bench.engine --config "$MODEL/config.json" --device cuda \
      --mode one-batch --batch "${BATCHES:-1,64}" --input-len 1024 --output-len 64 --warmup 1 \
      --kernels "${KERNELS:-gpu}" --data-parallel-size $dp --results "$OUT/RESULTS.json" --device-name H200 \
      --layout "DP=$dp" > "$OUT/one_batch_dp$dp.txt" 2>&1; grep -v "^W1\|^I1" "$OUT/one_batch_dp$dp.txt" | tail -6
  done
fi
