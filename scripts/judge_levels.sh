#!/usr/bin/env bash
# The judge's client against a server that is already up: c = 1, 2, 4, 8, 16, 32, 64 (64 requests a level, 1,024-token
# prompts, 300-token outputs, temperature 1, no warm-up requests), scored as the sum of weight x total tok/s (weights
# 1, 1, 2, 2, 4, 4, 8; qwen_jax.bench.serve). scripts/judge_sweep.sh starts the server cold and runs this.
#   MODEL=<the server's model dir (its tokenizer)> [PORT=8000] [DEVICE=H200] [LABEL=...] [LEVELS=...] [REQUESTS=64]
#   [OUTLEN=300] [TAG=judge] bash scripts/judge_levels.sh [label's flags]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
TAG="${TAG:-judge}"
python3 -m qwen_jax.bench.serve --base-url "http://127.0.0.1:${PORT:-8000}" --model m \
  --tokenizer "${MODEL:?MODEL: the model directory}" \
  --concurrency "${LEVELS:-1,2,4,8,16,32,64}" --num-requests "${REQUESTS:-64}" --warmup-requests 0 \
  --input-len 1024 --output-len "${OUTLEN:-300}" --temperature 1 --results "$OUT/RESULTS.json" \
  --device "${DEVICE:-H200}" --layout "${LAYOUT_LABEL:-auto}" --weights random --no-progress \
  --label "judge procedure: cold start then c=1..64; ${LABEL:-} flags: $*" > "$OUT/${TAG}_serve.txt" 2>&1
grep -A12 "^ conc" "$OUT/${TAG}_serve.txt" | grep -v "^$" ; grep "weighted score" "$OUT/${TAG}_serve.txt" \
  || tail -20 "$OUT/${TAG}_serve.txt"
