"""The documents of a pretraining corpus: where they come from (a hub dataset, or local .txt/.jsonl/.json/
.parquet/.csv files, streamed through Hugging Face `datasets`), their token ids, and whole-corpus utilities
(iterating, the unigram-entropy baseline, pre-tokenized shards). The batch stream is `neobert.data.pretraining`.
"""

from __future__ import annotations

import copy
import glob
import logging
import math
import os
from collections import Counter
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq
from datasets import load_dataset

from neobert.config import ConfigError
from neobert.hub import require_hub

log = logging.getLogger(__name__)

TOKENS_COLUMN = "input_ids"  # the column of pre-tokenized shards
BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
UNDECODABLE = "\ufffd"  # what undecodable bytes of a .txt file become (encoding_errors="replace")


def local_data_files(source: str, key: str = "data.source") -> list[str] | None:
    """The files a local `source` names (a file, a directory or a glob), or None when it is a hub name."""
    path = Path(source).expanduser()
    if path.is_file():
        files = [str(path)]
    elif path.is_dir():
        files = sorted(str(p) for p in path.rglob("*") if p.suffix in BUILDERS and p.is_file())
        if not files:
            raise ConfigError(f"{key}={source!r} is a directory with no {sorted(BUILDERS)} files")
    elif any(c in source for c in "*?["):
        files = sorted(f for f in glob.glob(str(path), recursive=True) if Path(f).is_file())
        if not files:
            raise ConfigError(f"{key}={source!r} matches no files")
    elif source.startswith((".", "/", "~")) or Path(source).suffix in BUILDERS:
        raise ConfigError(f"{key}={source!r} does not exist")
    else:
        return None
    suffixes = {Path(f).suffix for f in files}
    if len(suffixes) != 1 or not suffixes <= set(BUILDERS):
        raise ConfigError(f"{key}={source!r}: expected files of one type among {sorted(BUILDERS)}, got {sorted(suffixes)}")
    return files


def open_source(data, split: str | None = None):
    """A streaming Hugging Face IterableDataset of raw documents (or of token ids when pre-tokenized)."""
    if data.pretokenized_dir:
        files = local_data_files(str(Path(data.pretokenized_dir) / "*.parquet"), "data.pretokenized_dir")
        return load_dataset("parquet", data_files=files, split="train", streaming=True)
    files = local_data_files(data.source)
    if files is None:
        require_hub(data.source, "data.source")
        return load_dataset(data.source, data.hub_config, split=split or data.split, streaming=True)
    builder = BUILDERS[Path(files[0]).suffix]
    options = {"sample_by": data.text_sample_by, "encoding_errors": "replace"} if builder == "text" else {}
    return load_dataset(builder, data_files=files, split="train", streaming=True, **options)


def text_column(data) -> str:
    if data.pretokenized_dir:
        return TOKENS_COLUMN
    files = local_data_files(data.source)
    return "text" if files and Path(files[0]).suffix == ".txt" else data.text_column


class DocumentTokenizer:
    """Raw texts -> token ids (with the tokenizer's special tokens, no truncation). Empty, missing and
    undecodable documents are skipped and counted, never fatal."""

    def __init__(self, tokenizer, column: str):
        self.column = column
        self.pretokenized = column == TOKENS_COLUMN
        self.backend = None
        if not self.pretokenized:
            self.backend = copy.deepcopy(tokenizer.backend_tokenizer)
            self.backend.no_truncation()
            self.backend.no_padding()

    def __call__(self, batch: dict, skipped: dict) -> list[list[int]]:
        if self.column not in batch:
            raise ConfigError(f"data.text_column={self.column!r} is not a column of the data; "
                              f"columns: {sorted(batch)}")
        values = batch[self.column]
        if self.pretokenized:
            return [list(v) for v in values if v]
        texts = []
        for text in values:
            if not isinstance(text, str) or not text.strip():
                skipped["empty"] = skipped.get("empty", 0) + 1
            elif UNDECODABLE in text:
                skipped["undecodable"] = skipped.get("undecodable", 0) + 1
            else:
                texts.append(text)
        return [encoding.ids for encoding in self.backend.encode_batch(texts)] if texts else []


def truncate(ids: list[int], max_length: int, special_ids: set[int]) -> list[int]:
    """Keeps the first tokens and the closing special token ([SEP]) when there is one."""
    if len(ids) <= max_length:
        return ids
    return ids[: max_length - 1] + [ids[-1]] if ids[-1] in special_ids else ids[:max_length]


def iterate_documents(data, tokenizer, max_docs: int | None = None) -> Iterator[list[int]]:
    """Token ids of the training documents in source order (validation documents excluded)."""
    tokenize, skipped = DocumentTokenizer(tokenizer, text_column(data)), {}
    dataset = open_source(data).skip(data.validation_docs)
    if max_docs:
        dataset = dataset.take(max_docs)
    for block in dataset.iter(batch_size=1000):
        yield from tokenize(block, skipped)


def unigram_entropy(data, tokenizer, max_docs: int | None = None) -> float:
    """Entropy (nats) of the distribution of maskable tokens (no special tokens) as training sees them
    (truncated to data.max_length unless packed): the loss of a model that ignores context."""
    special = set(tokenizer.all_special_ids)
    counts: Counter = Counter()
    for ids in iterate_documents(data, tokenizer, max_docs):
        if not data.packing:
            ids = truncate(ids, data.max_length, special)
        counts.update(t for t in ids if t not in special)
    total = sum(counts.values())
    if not total:
        raise RuntimeError(f"data.source={data.source!r} has no tokens to compute a unigram baseline from")
    return -sum(c / total * math.log(c / total) for c in counts.values())


def pretokenize(data, tokenizer, out_dir: str | Path, docs_per_shard: int = 100_000) -> list[Path]:
    """Writes the documents' token ids as parquet shards (column `input_ids`) for `data.pretokenized_dir`.
    Validation documents are kept in front so `data.validation_docs` holds out the same ones."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenize, skipped = DocumentTokenizer(tokenizer, text_column(data)), {}
    shards, rows = [], []

    def flush(chunk: list) -> None:
        path = out_dir / f"shard-{len(shards):05d}.parquet"
        table = pa.table({TOKENS_COLUMN: pa.array(chunk, type=pa.list_(pa.int32()))})
        pq.write_table(table, str(path) + ".tmp")
        os.replace(str(path) + ".tmp", path)
        shards.append(path)

    for block in open_source(data).iter(batch_size=1000):
        rows.extend(tokenize(block, skipped))
        while len(rows) >= docs_per_shard:
            flush(rows[:docs_per_shard])
            rows = rows[docs_per_shard:]
    if rows:
        flush(rows)
    if skipped:
        log.warning("pretokenize skipped documents: %s", skipped)
    return shards
