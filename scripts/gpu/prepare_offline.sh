#!/usr/bin/env bash
# Prepares, on a machine with the package registry, what a GPU machine WITHOUT registry or hub access needs to run
# scripts/gpu/run_checks.sh (docs/pretraining.md, "First GPU run"): wheels of the dependencies its image lacks
# (DeepSpeed built pure-Python), a local bert-base-uncased tokenizer and a local corpus of long documents.
#   bash scripts/gpu/prepare_offline.sh [OUT_DIR=.gpu] [PYTHON_VERSION=3.12]
# Writes OUT_DIR/wheels, OUT_DIR/tokenizer, OUT_DIR/corpus (4 JSONL files: a multiple of ranks x data.num_workers).
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/gpu/pins.sh
OUT=${1:-.gpu}
PY=${2:-3.12}
PYTHON=.venv/bin/python
mkdir -p "$OUT/wheels"
# What the GPU image (torch, lightning, transformers, sentence-transformers) lacks, at the versions this project
# pins in its venv; liger-kernel for NeoBERTConfig.kernels=liger (scripts/gpu/pins.sh).
packages=$(venv_pins datasets dill multiprocess omegaconf hjson pydantic pydantic_core annotated-types \
    typing-inspection torch-optimi transformers)
$PYTHON -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$OUT/wheels" $packages "$LIGER_PIN"
DS_BUILD_OPS=0 $PYTHON -m pip wheel -q --no-deps --no-build-isolation -w "$OUT/wheels" \
    "$(venv_pins deepspeed)" seqeval
$PYTHON - "$OUT" <<'PY'
import sys
from pathlib import Path
from neobert.data.tokenizer import load_tokenizer
out = Path(sys.argv[1])
load_tokenizer("google-bert/bert-base-uncased", config_key="data.tokenizer").save_pretrained(out / "tokenizer")
PY
if [ ! -d "$OUT/corpus" ]; then
    # The offline corpus's paragraphs, joined into documents of >= 6,000 characters so that the recipe's truncation
    # at 1,024 tokens fills its rows as RefinedWeb's long pages do.
    $PYTHON -m experiments.offline_corpus "$OUT/paragraphs.jsonl" --shuffle-seed 0 \
        --roots "$($PYTHON -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')"
    $PYTHON - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
documents, current, size = [], [], 0
for line in open(out / "paragraphs.jsonl"):
    current.append(json.loads(line)["content"])
    size += len(current[-1])
    if size >= 6000:
        documents.append("\n\n".join(current))
        current, size = [], 0
(out / "corpus").mkdir()
for part in range(4):
    with open(out / "corpus" / f"part{part}.jsonl", "w") as file:
        file.writelines(json.dumps({"content": text}) + "\n" for text in documents[part::4])
print(f"{len(documents)} documents in {out / 'corpus'}")
PY
    rm "$OUT/paragraphs.jsonl"
fi
du -sh "$OUT"/*
