#!/usr/bin/env bash
# Rehearses a GPU run on this CPU: scripts/gpu/run_checks.sh run by a replica of the GPU image's Python (3.12,
# torch 2.11.0+cu130 without a GPU, transformers 5.17, lightning 2.6.6, ...: ENVIRONMENT_NOTES.md's list), from a
# prepared folder as it would be copied to the GPU machine. What a CPU can prove: the folder installs and unpacks,
# its packages import (FlashAttention 4 and QuACK included), the CUDA tests collect (those that need a GPU skip; a
# folder lacking a package the tests import stops them at collection); a throughput or gpu_check step also validates
# its config with the real packages, but then runs its full-size models on the CPU until its time limit. The kernels
# themselves need the GPU.
#   bash scripts/gpu/rehearse_on_cpu.sh [PREPARED=.gpu_fa4] [STEP ...=tests_fa4 tests]
# PYTHON312 (default: python3.12 on PATH) makes the replica's venv once, in REPLICA (default /tmp/gpu_image_replica,
# about 5.5 GB with torch's CUDA libraries; a folder of its own: outside the checkout, which a remote run copies).
# The run's files go to REPLICA/results, its packages to REPLICA/site-packages. Exit status 1 when a test failed or
# did not collect, or a step exited otherwise than 0 (the lines are printed).
set -euo pipefail
REPLICA=$(realpath -m "${REPLICA:-/tmp/gpu_image_replica}")
cd "$(dirname "$0")/../.."
PREPARED=${1:-.gpu_fa4}
shift $(( $# < 1 ? $# : 1 ))
STEPS=${*:-tests_fa4 tests}
PYTHON312=${PYTHON312:-python3.12}
MARKER=$REPLICA/.gpu_image_replica  # written once the venv is complete: a folder without it is not this script's
case $REPLICA/ in "$PWD"/*) echo "error: REPLICA=$REPLICA is inside the checkout" >&2; exit 2 ;; esac
if [ ! -f "$MARKER" ]; then
    if [ -e "$REPLICA" ] && [ -n "$(ls -A "$REPLICA")" ]; then
        echo "error: REPLICA=$REPLICA exists without $MARKER (not made by this script, or its install did not" \
             "finish): remove it, or choose another REPLICA" >&2; exit 2
    fi
    "$PYTHON312" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' || {
        echo "error: PYTHON312=$PYTHON312 is not a Python 3.12 (the image's)" >&2; exit 2; }
    "$PYTHON312" -m venv "$REPLICA"/venv
    # The image's packages (ENVIRONMENT_NOTES.md), then those its earlier runs used without carrying them
    "$REPLICA"/venv/bin/pip install -q torch==2.11.0 transformers==5.17.0 lightning==2.6.6 'torchmetrics==1.9.*' \
        'sentence-transformers>=6.0' 'huggingface_hub==1.33.*' 'tokenizers==0.23.*' pandas pyarrow \
        einops pytest pytest-timeout matplotlib xxhash psutil msgpack py-cpuinfo ninja
    touch "$MARKER"
fi
rm -rf "$REPLICA"/site-packages "$REPLICA"/results "$REPLICA"/scratch
PATH=$REPLICA/venv/bin:$PATH RUN_CHECKS_SITE=$REPLICA/site-packages RUN_CHECKS_SCRATCH=$REPLICA/scratch \
    bash scripts/gpu/run_checks.sh "$PREPARED" "$REPLICA"/results $STEPS
echo "rehearsal: $REPLICA/results/log.txt"
if grep -E "^(FAILED|ERROR) | exit [1-9]" "$REPLICA"/results/log.txt; then
    echo "rehearsal: the lines above failed" >&2
    exit 1
fi
