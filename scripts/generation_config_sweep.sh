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
DIR="$(bash scripts/model_copy.sh "$SOURCE" "${LAYERS:-}")"
depth="${LAYERS:+, depth-truncated to $LAYERS layers}"
MODEL="$DIR" TAG=plain LABEL="temperature only$depth" bash scripts/judge_sweep.sh "$@"
echo '{"top_k": 20, "top_p": 0.95}' > "$DIR/generation_config.json"
MODEL="$DIR" TAG=genconfig LABEL="generation_config top_k 20 top_p 0.95$depth" bash scripts/judge_sweep.sh "$@"
# ECHO=1: then MTP at full acceptance with that generation_config (scripts/echo_sampling_tpot.sh; the same
# programs, so the restart compiles nothing).
[[ "${ECHO:-0}" == 1 ]] && MODEL="$SOURCE" bash scripts/echo_sampling_tpot.sh "$@"
