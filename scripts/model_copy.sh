#!/usr/bin/env bash
# A temporary copy of a model (or config) directory without its generation_config.json, optionally depth-truncated
# (LAYERS: the same widths and layer pattern, the first LAYERS layers). Prints the copy's path.
#   bash scripts/model_copy.sh <dir> [layers]
set -euo pipefail
DIR="$(mktemp -d)/model"
cp -r "$1" "$DIR"
rm -f "$DIR/generation_config.json"
if [[ -n "${2:-}" ]]; then
  python3 - "$DIR/config.json" "$2" <<'PY'
import json, sys
path, layers = sys.argv[1], int(sys.argv[2])
config = json.load(open(path))
text = config.get("text_config", config)
text["num_hidden_layers"] = layers
text["layer_types"] = text["layer_types"][:layers]
json.dump(config, open(path, "w"), indent=1)
PY
fi
echo "$DIR"
