#!/usr/bin/env bash
# Rehearses a GPU lease on this CPU: scripts/gpu/run_checks.sh run by a replica of the GPU image's Python (3.12,
# torch 2.11.0+cu130 without a GPU, transformers 5.17, lightning 2.6.6, ...: ENVIRONMENT_NOTES.md's list, and what the
# earlier leases' runs show it has), from a prepared folder as a device call would carry it. What a CPU can prove:
# the folder installs and unpacks, its packages import (FlashAttention 4 and QuACK included), the CUDA tests collect
# (they skip here), the jobs' configs validate with the real packages. Found that a lease's `tests` step carried with
# .gpu_fa4 alone stopped at collection (2026-11-26); the kernels themselves need the GPU.
#   bash scripts/gpu/rehearse_on_cpu.sh [PREPARED=.gpu_fa4] [STEP ...=tests_fa4 tests]
# PYTHON312 (default: python3.12 on PATH) makes the replica's venv once, in REPLICA (default /tmp/gpu_image_replica,
# about 6 GB with torch's CUDA libraries); the run's files go to REPLICA/results, its packages to REPLICA/site-packages.
set -euo pipefail
cd "$(dirname "$0")/../.."
PREPARED=${1:-.gpu_fa4}
shift $(( $# < 1 ? $# : 1 ))
STEPS=${*:-tests_fa4 tests}
REPLICA=${REPLICA:-/tmp/gpu_image_replica}
PYTHON312=${PYTHON312:-python3.12}
if [ ! -x "$REPLICA"/venv/bin/python3 ]; then
    "$PYTHON312" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' || {
        echo "error: PYTHON312=$PYTHON312 is not a Python 3.12 (the image's)" >&2; exit 2; }
    "$PYTHON312" -m venv "$REPLICA"/venv
    # The image's packages (ENVIRONMENT_NOTES.md), then those its earlier runs used without carrying them
    "$REPLICA"/venv/bin/pip install -q torch==2.11.0 transformers==5.17.0 lightning==2.6.6 'torchmetrics==1.9.*' \
        'sentence-transformers>=6.0' 'huggingface_hub==1.33.*' 'tokenizers==0.23.*' pandas pyarrow \
        einops pytest pytest-timeout matplotlib xxhash psutil msgpack py-cpuinfo ninja
fi
rm -rf "$REPLICA"/site-packages "$REPLICA"/results "$REPLICA"/scratch
PATH=$REPLICA/venv/bin:$PATH RUN_CHECKS_SITE=$REPLICA/site-packages RUN_CHECKS_SCRATCH=$REPLICA/scratch \
    bash scripts/gpu/run_checks.sh "$PREPARED" "$REPLICA"/results $STEPS
echo "rehearsal: $REPLICA/results/log.txt"
