#!/usr/bin/env bash
# The fast path with a checkpoint's own sampling: the judge's procedure (scripts/judge_sweep.sh: cold start, then
# c = 1..64 at temperature 1 only) on one model directory without a generation_config.json, then again with Qwen's
# {"top_k": 20, "top_p": 0.95}, which every request that sets only its temperature takes (--generation-config auto).
# The second start finds the first's compiled programs (the sampling defaults change no program). Both land in
# $OUT/RESULTS.json, labelled by their sampling.
#   MODEL=<config dir> [LAYERS=20] [DEVICE=H100] [ECHO=1] bash scripts/generation_config_sweep.sh [server flags]
# LAYERS: a depth-truncated copy of the config (the same widths and layer pattern, the first LAYERS layers).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
SOURCE="${MODEL:?MODEL: a model (or config) directory}"
DIR="$(mktemp -d)/model"
cp -r "$SOURCE" "$DIR"
rm -f "$DIR/generation_config.json"
if [[ -n "${LAYERS:-}" ]]; then
  python3 - "$DIR/config.json" "$LAYERS" <<'EOF'
import json, sys
path, layers = sys.argv[1], int(sys.argv[2])
config = json.load(open(path))
text = config.get("text_config", config)
text["num_hidden_layers"] = layers
text["layer_types"] = text["layer_types"][:layers]
json.dump(config, open(path, "w"), indent=1)
EOF
fi
depth="${LAYERS:+, depth-truncated to $LAYERS layers}"
MODEL="$DIR" TAG=plain LABEL="temperature only$depth" bash scripts/judge_sweep.sh "$@"
echo '{"top_k": 20, "top_p": 0.95}' > "$DIR/generation_config.json"
MODEL="$DIR" TAG=genconfig LABEL="generation_config top_k 20 top_p 0.95$depth" bash scripts/judge_sweep.sh "$@"
# ECHO=1: then MTP at full acceptance (--load-format dummy_echo; the same programs, so the restart compiles nothing),
# with the generation_config still there: c = 1 TPOT of greedy requests, and of requests at TEMPERATURE (default
# 0.01), which the top-k/top-p sampler draws from (nearly always the draft).
if [[ "${ECHO:-0}" == 1 ]]; then
  export QWEN_JAX_LOG="$OUT/echo.log" QWEN_JAX_PID_FILE="$OUT/echo.pid"
  ./start.sh --model "$DIR" --served-model-name m --load-format dummy_echo --port 8000 \
    --compilation-cache-dir "${CACHE:-/tmp/qwen_jax_cc}" \
    --disable-access-log "$@" > "$OUT/echo_start.txt" 2>&1 || { tail -30 "$QWEN_JAX_LOG"; exit 1; }
  for temperature in 0 "${TEMPERATURE:-0.01}"; do
    python3 -m qwen_jax.bench.serve --base-url http://127.0.0.1:8000 --model m --tokenizer "$DIR" --concurrency 1 \
      --num-requests 16 --warmup-requests 2 --input-len 1024 --output-len 300 --temperature "$temperature" \
      --results "$OUT/RESULTS.json" --device "${DEVICE:-H200}" --layout TP=1 --weights random --no-progress \
      --label "dummy_echo MTP (default policy), generation_config top_k 20 top_p 0.95, temperature $temperature$depth" \
      > "$OUT/echo_$temperature.txt" 2>&1
    grep -A4 "^ conc" "$OUT/echo_$temperature.txt" | grep -v "^$" || tail -20 "$OUT/echo_$temperature.txt"
  done
  grep -c "is not compiled" "$QWEN_JAX_LOG"
  ./start.sh --stop > /dev/null
fi
