#!/usr/bin/env bash
# Install the package with its test extra (CPU PyTorch from the local wheel cache), check that imports run one way
# (lint-imports: the layers contract in pyproject.toml), then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e ".[test]"
lint-imports
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"
export JAX_PLATFORMS=cpu
python3 -m pytest tests "$@"
