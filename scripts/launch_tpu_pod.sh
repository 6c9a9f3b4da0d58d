#!/usr/bin/env bash
# Train on a Cloud TPU VM pod slice: every worker of the slice runs the same command, and
# `jxformers train` starts jax.distributed from the TPU environment (no flags needed).
# The work directory must be shared by all workers (a GCS-fuse mount or NFS): orbax
# writes the sharded checkpoint from every process, process 0 writes the logs.
#
#   bash scripts/launch_tpu_pod.sh TPU_NAME ZONE EXPERIMENT WORKDIR [--set KEY=VALUE ...]
#   JXFORMERS_REPO=https://example.org/you/jxformers.git \
#   bash scripts/launch_tpu_pod.sh my-v4-32 us-central2-b shakespeare_lm /mnt/shared/runs/lm \
#        --set preset=paper --set mesh.fsdp=4
#
# Untested here: no TPU was available to this project (docs/distributed.md).
set -euo pipefail
if [ $# -lt 4 ]; then
  echo "usage: $0 TPU_NAME ZONE EXPERIMENT WORKDIR [--set KEY=VALUE ...]" >&2
  exit 2
fi
tpu="$1"; zone="$2"; experiment="$3"; workdir="$4"; shift 4
repo="${JXFORMERS_REPO:?set JXFORMERS_REPO to a git URL of jxformers that every worker can clone}"
args=$(printf ' %q' "$experiment" --workdir "$workdir" --no-progress "$@")
# Install on every worker (idempotent), then train on every worker at once.
gcloud compute tpus tpu-vm ssh "$tpu" --zone "$zone" --worker=all --command "
  set -e
  test -d jxformers || git clone -q $repo jxformers
  cd jxformers && python3 -m pip install -q -e . 'jax[tpu]'
  python3 -m jxformers.tools.cli train$args
"
