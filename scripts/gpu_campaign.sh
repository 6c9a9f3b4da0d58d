#!/usr/bin/env bash
# The GPU campaign: every check and benchmark that needs a real GPU, in phases that each
# fit one 10-minute device call (docs/kernels.md says what each table measured). Run on
# the GPU machine from the repository root; tables and logs go to $OUT (default
# runs/gpu), to be copied into docs/kernel_runs/ and docs/moe_runs/ afterwards.
#
#   bash scripts/gpu_wheels.sh                 # here, once: what the GPU image lacks, into .whl/
#   bash scripts/gpu_campaign.sh mosaic        # there, one phase per call (carry .whl)
#   bash scripts/gpu_campaign.sh triton
#   bash scripts/gpu_campaign.sh linear
#   bash scripts/gpu_campaign.sh models
#   bash scripts/gpu_campaign.sh check         # a short check after kernel changes
#
# Phases:
#   mosaic  the Mosaic GPU forward on hardware: gpu_check against the float32 reference
#           (one and two consumer warpgroups), then timed beside the Triton kernel and
#           cuDNN at 8K/16K, d = 128, K/V ring depths 2 and 4
#   triton  gpu_check of the Triton kernels (patterns, cuDNN/segment/ALiBi routes,
#           training), and the rows not yet timed: causal ALiBi, Sparse Transformer parts
#   linear  the chunked linear-attention kernel beside flash-linear-attention (carried
#           wheels) and causal softmax; then its state walks split over d_v blocks
#           (block_v 32, 64) against the same call unsplit, at 16K (420 + 120 s)
#   check   gpu_check of the Triton kernels (no training curves) and the Mosaic GPU forward,
#           non-finite keys and values included, and what the non-finite pass costs
#   models  the MoE benchmark in bf16, whole-image generation (Katharopoulos et al.) and
#           the models benchmark at the LRA Text shape (He et al. 2023's speed table)
#   device  a first look at a device kind not measured before (one call): the Mosaic GPU
#           check, the flash table (Triton, Mosaic GPU, cuDNN) at 8K/16K, the models table
# Tables are named by the device (h100_..., h200_...), read from nvidia-smi.
# After the phases, scripts/gpu_targets.py reads the tables and prints each speed target
# of the kernel issue as met, MISSED or not measured.
# Each step has its own time limit, so one that hangs or fails leaves the others' output.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
# The device's short name (h100, h200, ...) names the tables, so runs on two kinds never mix.
DEV=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o '[AHBL][0-9]\{2,3\}' | head -1 | tr 'A-Z' 'a-z')
DEV=${DEV:-gpu}

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

step() {  # step SECONDS LOGNAME COMMAND...: run with a limit, log to $OUT, report the status
    local limit=$1 log=$2
    shift 2
    echo "== $* (limit ${limit}s)" | tee -a "$OUT/$log.log"
    local start=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee -a "$OUT/$log.log"
    echo "== exit ${PIPESTATUS[0]} after $((SECONDS - start))s" | tee -a "$OUT/$log.log"
}

phase_mosaic() {
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/mosaic.log"
    $PY -c 'import jax; print("jax", jax.__version__, jax.devices())' | tee -a "$OUT/mosaic.log"
    step 120 mosaic $PY scripts/gpu_check.py --backend mosaic_gpu --block 64 64
    step 100 mosaic $PY scripts/gpu_check.py --backend mosaic_gpu --block 128 64
    step 260 mosaic $PY scripts/bench_kernels.py --lengths 8192 16384 --head-dims 128 \
        --only dense causal "causal window 512" "longformer w256 g2" --impls pallas cudnn --mosaic --mosaic-stages 2 4 \
        --repeat 5 \
        --out "$OUT/${DEV}_mosaic.md"
}

phase_triton() {
    step 300 triton $PY scripts/gpu_check.py  # 230 s were not enough for its last two training cases (2026-11-26)
    step 280 triton $PY scripts/bench_kernels.py --lengths 8192 16384 --head-dims 128 \
        --only dense "causal alibi" "sparse_transformer strided s128 causal" "sparse_transformer fixed s128 c8 causal" \
        --impls pallas "xla op" --repeat 5 --out "$OUT/${DEV}_sparse_alibi.md"
}

phase_linear() {
    # fla's backward autotunes for over 5 minutes on its first call: forward only here.
    step 420 linear $PY scripts/bench_linear_kernels.py --lengths 4096 16384 --head-dims 128 --repeat 5 \
        --scan-max 0 --fla-forward-only --time-limit 300 --out "$OUT/linear_${DEV}_fla.md"
    # The state walks split over d_v blocks: never timed before; the pair shows whether it pays.
    step 120 linear $PY scripts/bench_linear_kernels.py --lengths 16384 --head-dims 128 --only "linear causal" \
        --impls "pallas block_v" --block-v 32 64 --repeat 5 --no-fla --time-limit 90 --out "$OUT/linear_${DEV}_split.md"
}

phase_check() {
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/check.log"
    step 220 check $PY scripts/gpu_check.py --no-training
    step 150 check $PY scripts/bench_non_finite.py --out "$OUT/${DEV}_non_finite.md"
    step 110 check $PY scripts/gpu_check.py --backend mosaic_gpu --block 128 64
}

phase_models() {
    step 240 models $PY scripts/bench_moe.py --dtype bfloat16 --out "$OUT/moe_${DEV}.md"
    step 240 models $PY scripts/bench_image_generation.py
    step 150 models $PY scripts/bench_models.py --lengths 1024 2048 4096 --out "$OUT/models_${DEV}.md"
}

phase_device() {
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/device.log"
    $PY -c 'import jax; print("jax", jax.__version__, jax.devices())' | tee -a "$OUT/device.log"
    step 110 device $PY scripts/gpu_check.py --backend mosaic_gpu --block 128 64
    step 240 device $PY scripts/bench_kernels.py --lengths 8192 16384 --head-dims 128 \
        --only dense causal "causal window 512" "longformer w256 g2" --impls pallas cudnn --mosaic --mosaic-stages 2 \
        --repeat 5 --out "$OUT/${DEV}_flash.md"
    step 150 device $PY scripts/bench_models.py --lengths 1024 2048 4096 --out "$OUT/models_${DEV}.md"
}

for phase in "${@:-mosaic}"; do
    "phase_$phase"
done
# The targets as far as this machine's tables (and the committed ones) show them.
if ls "$OUT"/*.md >/dev/null 2>&1; then
    $PY scripts/gpu_targets.py "$OUT"/*.md | tee -a "$OUT/targets.log"
fi
