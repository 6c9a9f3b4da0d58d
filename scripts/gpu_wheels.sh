#!/usr/bin/env bash
# Fetch, as wheels into .whl/ (git-ignored), what the GPU machine's image lacks for
# scripts/gpu_campaign.sh: grain and its two missing needs (array-record, portpicker),
# beartype (the test suite's jaxtyping hook), and flash-linear-attention's kernels
# (fla-core; its einops is in the image) so bench_linear_kernels.py times them beside
# ours. The machine cannot reach PyPI; its Python is 3.12. gpu_campaign.sh installs them.
#
#   bash scripts/gpu_wheels.sh        # here; then carry .whl with each device call
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d .whl "grain==${GRAIN_VERSION:-0.2.18}" "array-record==0.8.6" "portpicker==1.6.0" "beartype==0.23.1" \
    "fla-core==${FLA_VERSION:-0.6.0}"
ls -l .whl
