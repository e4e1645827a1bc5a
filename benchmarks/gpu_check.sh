#!/usr/bin/env bash
# The GPU check of issue 24 in one command (see benchmarks/gpu_check.py and benchmarks/README.md):
# the CUDA tests and the GPU benchmarks, tables and pytest summary in $OUT or ./gpu_check_out.
# Runs from any directory; the package is imported from this checkout (nothing to install).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec python3 benchmarks/gpu_check.py "$@"
