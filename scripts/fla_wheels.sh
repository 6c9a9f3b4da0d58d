#!/usr/bin/env bash
# Fetch flash-linear-attention's kernels as wheels into .whl/ (git-ignored), for a GPU
# machine that has torch and triton but no way to reach PyPI; bench_linear_kernels.py
# then times its Triton chunk kernels beside ours. fla-core holds `fla.ops` and needs
# only einops (the `flash-linear-attention` package adds models and transformers).
#
#   bash scripts/fla_wheels.sh
#   # there, before the benchmark:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site python scripts/bench_linear_kernels.py --lengths 4096 16384 --head-dims 128
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
python3 -m pip download --no-deps --only-binary=:all: -d .whl "fla-core==${FLA_VERSION:-0.6.0}" "einops==${EINOPS_VERSION:-0.8.1}"
ls -l .whl
