#!/usr/bin/env bash
# The fast path with a checkpoint's own sampling: the judge's procedure (scripts/judge_sweep.sh: cold start, then
# c = 1..64 at temperature 1 only) on one model directory without a generation_config.json, then again with Qwen's
# {"top_k": 20, "top_p": 0.95}, which every request that sets only its temperature takes (--generation-config auto).
# The second start finds the first's compiled programs (the sampling defaults change no program). Both land in
# $OUT/RESULTS.json, labelled by their sampling.
#   MODEL=<config dir> [LAYERS=20] [DEVICE=H100] bash scripts/generation_config_sweep.sh [server flags]
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
