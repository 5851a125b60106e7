#!/usr/bin/env bash
# Device check of the server on full-size random weights (one GPU), as a judge runs it: cold start through
# ./start.sh (which returns once every program is compiled and has run), the serving benchmark at each concurrency of
# LEVELS (1,024 in / 1,024 out, one wave each), /metrics, then (RESTART=1) a warm restart
# with the persistent compile cache. Everything lands under $OUT (RESULTS.json entry, logs, metrics).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
MODEL="${MODEL:-.devdata/Qwen3.5-35B-A3B}"
export PYTHONUNBUFFERED=1 QWEN_JAX_PROGRESS=0 QWEN_JAX_LOG="$OUT/server.log" QWEN_JAX_START_TIMEOUT=400
# STEP_TRACE=1: the engine core writes one JSON line per step to $OUT/steps.jsonl (engine/core.py)
[[ "${STEP_TRACE:-0}" == 1 ]] && export QWEN_JAX_STEP_TRACE="$OUT/steps.jsonl"
# LOG_COMPILES=1: JAX logs every compile; those after the warm-up are printed at the end
[[ "${LOG_COMPILES:-0}" == 1 ]] && export JAX_LOG_COMPILES=1
# LOAD_FORMAT=dummy_echo with TEMPERATURE=0: full acceptance of the MTP head's drafts (weights.py); SPEC_CONFIG:
# --speculative-config
ARGS=(--model "$MODEL" --served-model-name m --load-format "${LOAD_FORMAT:-dummy}"
      ${SPEC_CONFIG:+--speculative-config "$SPEC_CONFIG"} --max-model-len "${MAX_MODEL_LEN:-4096}" --max-num-seqs
      "${MAX_NUM_SEQS:-256}" --kernels "${KERNELS:-auto}" --port 8000 --compilation-cache-dir /tmp/qwen_jax_cc)
URL=http://127.0.0.1:8000
now() { date +%s.%N; }
since() { python3 -c "import sys; print(round($(now) - float(sys.argv[1]), 1))" "$1"; }

t0=$(now); ./start.sh "${ARGS[@]}" > "$OUT/start.txt" 2>&1 || { tail -40 "$OUT/server.log"; exit 1; }
echo "cold_start_s $(since "$t0")"
step_costs() {  # per-step host costs over one level, from two /metrics scrapes
  python3 - "$1" "$2" <<'PY'
import re, sys
def read(path):
    return {m[1]: float(m[2]) for m in re.finditer(r"^qwen_jax_(engine_step\w*|generation_tokens)_total(?:\{[^}]*\})? (\S+)",
                                                   open(path).read(), re.M)}
a, b = read(sys.argv[1]), read(sys.argv[2])
d = {k: b[k] - a.get(k, 0.0) for k in b}
n = max(d.get("engine_steps", 0), 1)
print(f"steps {n:.0f}: wall {1e3 * d['engine_step_seconds'] / n:.2f} ms/step, plan+issue "
      f"{1e3 * d['engine_step_plan_seconds'] / n:.2f}, of which dispatch {1e3 * d['engine_step_dispatch_seconds'] / n:.2f}, "
      f"device wait {1e3 * d['engine_step_device_wait_seconds'] / n:.2f}; tokens {d['generation_tokens']:.0f}")
PY
}
# LEVELS: concurrencies, each optionally with its own temperature (c@t; default $TEMPERATURE)
for level in ${LEVELS:-1 64 256}; do
  c=${level%@*}; temperature=${TEMPERATURE:-1.0}; [[ "$level" == *@* ]] && temperature=${level#*@}
  tag=$c; [[ "$level" == *@* ]] && tag=${c}_t$temperature
  curl -s "$URL/metrics" > "$OUT/metrics_before_c$tag.txt"
  # GPU busy: the share of each 100 ms in which a kernel ran, sampled by the driver over the level
  nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 100 > "$OUT/gpu_busy_c$tag.txt" &
  smi=$!
  timeout 400 python3 -m qwen_jax.bench.serve --base-url "$URL" --model m --tokenizer "$MODEL" --concurrency "$c" \
    --waves 1 --temperature "$temperature" --input-len 1024 --output-len "${OUTLEN:-1024}" --results "$OUT/RESULTS.json" --device H200 \
    --device-count 1 --layout TP=1 --weights random --model-config "$MODEL/config.json" --no-progress \
    --label "kernels=${KERNELS:-auto} max_num_seqs=${MAX_NUM_SEQS:-256} load_format=${LOAD_FORMAT:-dummy} speculative_config=${SPEC_CONFIG:-default} temperature=$temperature" > "$OUT/serve_c$tag.txt" 2>&1
  kill $smi
  grep -A3 "^ conc" "$OUT/serve_c$tag.txt" | head -3
  grep "speculative decoding" "$OUT/serve_c$tag.txt"
  # over the requests' span: from the first sample with a kernel running to the last (the client first builds its
  # prompts, seconds with an idle GPU)
  python3 -c "import sys; v = [float(x) for x in open(sys.argv[1]) if x.strip()]; on = [i for i, x in enumerate(v) if x > 0];
b = v[on[0]:on[-1] + 1] if on else v; print(f'GPU busy (nvidia-smi, {len(b)} samples of 100 ms): {sum(b) / max(len(b), 1):.1f}%')" \
    "$OUT/gpu_busy_c$tag.txt"
  curl -s "$URL/metrics" > "$OUT/metrics_after_c$tag.txt"
  step_costs "$OUT/metrics_before_c$tag.txt" "$OUT/metrics_after_c$tag.txt"
done
# One constrained request on the device: a json_schema reply that must parse and match the schema.
curl -s "$URL/v1/chat/completions" -H 'Content-Type: application/json' -d '{"model": "m", "max_tokens": 64,
  "messages": [{"role": "user", "content": "Give a number."}], "response_format": {"type": "json_schema",
  "json_schema": {"name": "n", "schema": {"type": "object", "properties": {"n": {"type": "integer"}},
  "required": ["n"], "additionalProperties": false}}}}' > "$OUT/structured.json"
python3 -c "import json, sys; r = json.load(open(sys.argv[1])); c = r['choices'][0]; v = json.loads(c['message']['content']);
assert set(v) == {'n'} and isinstance(v['n'], int), v; print('structured output:', c['message']['content'], c['finish_reason'])" \
  "$OUT/structured.json" || { echo "structured output failed:"; head -c 600 "$OUT/structured.json"; echo; }
curl -s "$URL/metrics" > "$OUT/metrics.txt"
grep "^qwen_jax_engine_step\|^vllm:generation_tokens_total" "$OUT/metrics.txt"
grep "compiled\|loaded" "$OUT/server.log" | cut -c1-170
if [[ "${LOG_COMPILES:-0}" == 1 ]]; then
  echo "compiles after the warm-up:"
  sed -n '/engine ready/,$p' "$OUT/server.log" | grep -i "compiling\|compilation" | cut -c1-300 | head -40
fi
./start.sh --stop > /dev/null
cp "$OUT/server.log" "$OUT/server_cold.log"
if [[ "${RESTART:-1}" == 1 ]]; then
  t0=$(now); ./start.sh "${ARGS[@]}" > "$OUT/restart.txt" 2>&1 || tail -20 "$OUT/server.log"
  echo "warm_start_s $(since "$t0")"
  ./start.sh --stop > /dev/null
fi
