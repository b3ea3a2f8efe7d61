#!/usr/bin/env bash
# On a GPU machine: the checks of docs/benchmarks.md's GPU sections in one call, each with its own time limit, so a
# short lease still returns what finished. Reads what scripts/gpu/prepare_offline.sh wrote (wheels are installed
# into /tmp/site when present); writes logs and CSVs into RESULTS (default: $OUT, else runs/gpu_checks).
#   bash scripts/gpu/run_checks.sh [PREPARED=.gpu] [RESULTS]
set -u
cd "$(dirname "$0")/../.."
PREPARED=${1:-.gpu}
RESULTS=${2:-${OUT:-runs/gpu_checks}}
mkdir -p "$RESULTS"
if ls "$PREPARED"/wheels/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$PREPARED"/wheels/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
LOG=$RESULTS/log.txt
step() { echo "=== $(date -u +%T) $*" | tee -a "$LOG"; }
# throughput NAME SECONDS key=value...: one experiments.throughput run, its tables logged, its CSV kept as NAME.csv
throughput() {
    local name=$1 seconds=$2
    shift 2
    timeout "$seconds" python3 -m experiments.throughput "$@" output_dir=/tmp/"$name" 2>&1 | tail -14 | tee -a "$LOG"
    cp /tmp/"$name"/throughput.csv "$RESULTS"/"$name".csv
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
step "the fused kernels against the eager path"
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py 2>&1 | tail -6 | tee -a "$LOG"
step "training throughput: eager, liger, bert-base"
throughput throughput_training 120 mode=training 'lengths=[512,1024]' 'models=[neobert,neobert-liger,bert-base]' \
    'batch_sizes=[32,64]' search_top=2 repeats=5
step "the recipe on this node: experiments.gpu_check --config neobert"
timeout 240 python3 -m experiments.gpu_check --config neobert --steps 16 warmup_steps=4 resume_steps=4 \
    logging.log_every_n_steps=2 data.source="$PREPARED"/corpus data.tokenizer="$PREPARED"/tokenizer \
    output_dir=/tmp/gpu_check > /tmp/gpu_check.log 2>&1
echo "gpu_check exit $?" | tee -a "$LOG"
cp /tmp/gpu_check/gpu_check.md /tmp/gpu_check/gpu_check.json "$RESULTS"/ 2>/dev/null || tail -40 /tmp/gpu_check.log >> "$LOG"
step "inference throughput: eager, liger, bert-base, modernbert-base"
throughput throughput_inference 90 mode=inference 'lengths=[512,1024,4096]' \
    'models=[neobert,neobert-liger,bert-base,modernbert-base]' 'batch_sizes=[16,32,64]' search_top=2 repeats=3
step "training throughput, compiled: neobert, bert-base"
throughput throughput_compiled 100 mode=training 'lengths=[512]' 'models=[neobert,bert-base]' 'batch_sizes=[64]' \
    search_top=1 repeats=5 compile=true
step done
