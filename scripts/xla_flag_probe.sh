#!/usr/bin/env bash
# Compile seconds against step time under XLA flag sets: bench.step_profile (decode 1 and 64 rows, one 8,192-token
# prefill) once per flag set, each in a fresh process with an empty compile cache, program store and Triton cache.
# Prints each program's compile seconds (the compile workers' log) and the step times.
#   MODEL=<config dir> [BATCHES=1,64] [PREFILL=8192] bash scripts/xla_flag_probe.sh "" "--xla_gpu_autotune_level=0" ...
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
MODEL="${MODEL:?MODEL: a config directory}"
i=0
for flags in "$@"; do
  i=$((i + 1)); scratch=$(mktemp -d)
  echo "== flags [$flags]"
  t0=$(date +%s)
  TMPDIR="$scratch" TRITON_CACHE_DIR="$scratch/triton" XLA_FLAGS="$flags" timeout "${LIMIT:-200}" \
    python3 -m qwen_jax.bench.step_profile --config "$MODEL" --kernels gpu --batches "${BATCHES:-1,64}" \
    --prefill "${PREFILL:-8192}" --steps 10 --no-layers > "$OUT/probe_$i.json" 2> "$OUT/probe_$i.log"
  echo "rc $? in $(( $(date +%s) - t0 )) s"
  grep -o "[a-z_]*\[[^]]*\]: lowered in [0-9.]*s, compiled in [0-9.]*s" "$OUT/probe_$i.log" | sort | head -60
  grep "compiled .* programs in" "$OUT/probe_$i.log" | cut -c1-160
  grep -v '"decode": \[' "$OUT/probe_$i.json" | cut -c1-400
  rm -rf "$scratch"
done
