#!/usr/bin/env bash
# The GPU checks of one machine, as a user runs pipeclock: results in benchmarks/results/gpu.md.
#
#   bash benchmarks/gpu_checks.sh [--budget SECONDS] [--out FILE]
#
# Runs from any folder, as it is, on a machine where nothing can be installed: the checkout's .venv when
# there is one, else the python3 on PATH (torch and transformers installed), with pipeclock read from
# this checkout (PYTHONPATH). Under 5 minutes on one GPU and 16 cores; without a GPU it runs the same
# checks at toy sizes, its page in $TMPDIR/pipeclock-gpu-checks-cpu.md. The checks: benchmarks/gpu_checks.py.
set -euo pipefail
cd "$(dirname "$0")/.."
python=.venv/bin/python
[ -x "$python" ] || python=python3
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m benchmarks.gpu_checks "$@"
