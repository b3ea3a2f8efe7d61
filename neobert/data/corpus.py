"""The documents of a pretraining corpus: where they come from (a hub dataset, or local .txt/.jsonl/.json/
.parquet/.csv files, streamed through Hugging Face `datasets`), their token ids, and whole-corpus utilities
(iterating, the unigram-entropy baseline, pre-tokenized shards). The batch stream is `neobert.data.pretraining`.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import functools
import glob
import hashlib
import json
import logging
import math
import os
from collections import Counter
from pathlib import Path
from typing import Iterator

import pandas
import pyarrow as pa
import pyarrow.parquet as pq
from datasets import load_dataset

from neobert.config import ConfigError
from neobert.config.pretrain import SourceData
from neobert.errors import DataError
from neobert.hub import is_hub_name, require_hub
from neobert.outputs import SHARDS, claim_output_dir, filled_the_disk, out_of_space

log = logging.getLogger(__name__)

TOKENS_COLUMN = "input_ids"  # the column of pre-tokenized shards
BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
UNDECODABLE = "\ufffd"  # what undecodable bytes of a .txt file become (encoding_errors="replace")
# `datasets` logs a JSON file it cannot parse at ERROR itself, then raises: our DataError line says it once, with the
# file's line number.
logging.getLogger("datasets.packaged_modules.json.json").setLevel(logging.CRITICAL)
# What reading a local file that is not what its suffix says raises (bad JSON, non-UTF-8 JSON or CSV, ...).
READ_ERRORS = (pa.ArrowException, UnicodeDecodeError, pandas.errors.EmptyDataError, pandas.errors.ParserError)
SMALL_PARQUET_BYTES = 1 << 16  # a parquet file without rows is smaller than this: only those are opened to check


def local_data_files(source: str, key: str = "data.source") -> list[str] | None:
    """The files a local `source` names (a file, a directory or a glob), or None when it is a hub name
    (`neobert.hub.is_hub_name`); any other name that does not exist is a ConfigError."""
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
    elif is_hub_name(source):
        return None
    else:
        raise ConfigError(f"{key}={source!r} does not exist")
    suffixes = {Path(f).suffix for f in files}
    if len(suffixes) != 1 or not suffixes <= set(BUILDERS):
        raise ConfigError(f"{key}={source!r}: expected files of one type among {sorted(BUILDERS)}, got {sorted(suffixes)}")
    return files


def source_key(data) -> str:
    """The config key of the corpus: data.source, or data.sources[i].source for a source of a mixture."""
    return data.key if isinstance(data, SourceData) else "data.source"


def source_name(data) -> str:
    """`data.source='...'` (or `data.pretokenized_dir='...'`, `data.sources[1].source='...'`): how messages name the
    corpus."""
    if data.pretokenized_dir:
        return f"data.pretokenized_dir={data.pretokenized_dir!r}"
    return f"{source_key(data)}={data.source!r}"


def no_usable_documents(data, skipped: dict, held_out: int = 0, detail: str = "") -> DataError:
    """The error of a corpus (or of the part a stream reads) without one usable document."""
    not_text = f", {skipped['not text']} not text (e.g. numbers)" if skipped.get("not text") else ""
    message = (f"{source_name(data)} has no usable documents ({skipped.get('empty', 0)} empty, "
               f"{skipped.get('undecodable', 0)} undecodable{not_text})")
    if held_out:
        message += f" after the first data.validation_docs={held_out}, which validation holds out"
    return DataError(message + (f"; {detail}" if detail else ""))


def _is_empty_file(path: str) -> bool:
    size = os.path.getsize(path)
    if size == 0:
        return True
    return path.endswith(".parquet") and size < SMALL_PARQUET_BYTES and pq.ParquetFile(path).metadata.num_rows == 0


def file_columns(path: str) -> list[str] | None:
    """The columns of a local file, read cheaply: a parquet schema, a JSON lines file's first object, a CSV header;
    None where there are none to read (a text file, a first line that is not a JSON object)."""
    stat = os.stat(path)
    return _read_columns(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=None)  # every stream opens its source: a file's columns are read once per process
def _read_columns(path: str, mtime_ns: int, size: int) -> list[str] | None:
    suffix = Path(path).suffix
    if suffix == ".parquet":
        return pq.read_schema(path).names
    if suffix not in (".jsonl", ".csv"):
        return None
    with open(path, encoding="utf-8", errors="replace") as handle:
        first = next((line for line in handle if line.strip()), "")
    if suffix == ".csv":
        return next(csv.reader([first]), [])
    with contextlib.suppress(json.JSONDecodeError):
        row = json.loads(first)
        return sorted(row) if isinstance(row, dict) else None
    return None


def check_file_columns(data, files: list[str]) -> None:
    """Every file of a source holds its text column, and no column the first file lacks (`datasets` reads every
    file with the first one's columns: another one is a CastError mid-run); checked before any document is read."""
    if data.pretokenized_dir or len(files) < 2:  # one file: a missing column is check_column's
        return
    column, reference = text_column(data), file_columns(files[0])
    if reference is None:
        return
    key = source_key(data).rsplit(".", 1)[0] + ".text_column"
    for path in files:
        columns = file_columns(path)
        if columns is None:
            continue
        if column not in columns:
            raise DataError(f"{source_name(data)}: {path} has no column {key}={column!r} (its columns: {columns})")
        extra = [name for name in columns if name not in reference]
        if extra:
            raise DataError(f"{source_name(data)}: {path} has the column {extra[0]!r}, which {files[0]} lacks (its "
                            f"columns: {reference}): every file of a source is read with the first file's columns; "
                            f"give them all the same columns")


def open_source(data, split: str | None = None):
    """A streaming Hugging Face IterableDataset of raw documents (or of token ids when pre-tokenized). Empty local
    files are left out (the readers choke on them); a corpus of empty files only is a DataError."""
    if data.pretokenized_dir:
        files = local_data_files(str(Path(data.pretokenized_dir) / "*.parquet"), "data.pretokenized_dir")
        builder, options = "parquet", {}
    else:
        files = local_data_files(data.source, source_key(data))
        if files is None:
            require_hub(data.source, source_key(data))
            return load_dataset(data.source, data.hub_config, split=split or data.split, streaming=True)
        builder = BUILDERS[Path(files[0]).suffix]
        options = {"sample_by": data.text_sample_by, "encoding_errors": "replace"} if builder == "text" else {}
    nonempty = [f for f in files if not _is_empty_file(f)]
    if not nonempty:
        raise no_usable_documents(data, {}, detail=f"its {len(files)} file(s) are empty")
    check_file_columns(data, nonempty)
    try:
        return load_dataset(builder, data_files=nonempty, split="train", streaming=True, **options)
    except StopIteration:  # the json builder's schema inference found no row
        raise no_usable_documents(data, {}, detail="its files hold no rows") from None
    except READ_ERRORS as err:
        raise DataError(f"{source_name(data)} cannot be read as {builder} files: {type(err).__name__}: "
                        f"{err}") from err


def read_blocks(dataset, batch_size: int, data) -> Iterator[dict]:
    """`dataset.iter(batch_size)`, with a local file that cannot be read (not the format its suffix says, not
    UTF-8 where the format needs it) reported as a DataError naming the source (and, for JSON lines, the file and
    line that is not JSON)."""
    try:
        yield from dataset.iter(batch_size=batch_size)
    except READ_ERRORS as err:
        where = first_bad_json_line(data) if isinstance(err, pa.ArrowInvalid) and "JSON" in str(err) else None
        if isinstance(err, UnicodeDecodeError):
            where = first_undecodable_line(data)
        detail = where or f"{type(err).__name__}: {err}"
        raise DataError(f"{source_name(data)} cannot be read: {detail}") from err


def first_bad_json_line(data) -> str | None:
    """`line N of FILE is not JSON (why)` for the first line of the source's .jsonl files that does not parse
    (`datasets` reports a row number, counted from 0 and without the blank lines); None if none is found."""
    files = [] if data.pretokenized_dir else local_data_files(data.source, source_key(data)) or []
    for path in (f for f in files if Path(f).suffix == ".jsonl"):
        with open(path, encoding="utf-8", errors="replace") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    json.loads(line)
                except json.JSONDecodeError as err:
                    return f"line {number} of {path} is not JSON ({err.msg}, column {err.colno})"
    return None


def first_undecodable_line(data) -> str | None:
    """`line N of FILE is not UTF-8 (...)` for the first line of the source's JSON lines or CSV files that is not
    (the reader's error gives a position in its block, not the file); None if none is found."""
    files = [] if data.pretokenized_dir else local_data_files(data.source, source_key(data)) or []
    for path in (f for f in files if Path(f).suffix in (".jsonl", ".json", ".csv")):
        with open(path, "rb") as handle:
            for number, line in enumerate(handle, start=1):
                try:
                    line.decode("utf-8")
                except UnicodeDecodeError as err:
                    return (f"line {number} of {path} is not UTF-8 (byte {line[err.start:err.start + 1]!r} at "
                            f"column {err.start + 1}: {err.reason})")
    return None


def text_column(data) -> str:
    if data.pretokenized_dir:
        return TOKENS_COLUMN
    files = local_data_files(data.source, source_key(data))
    return "text" if files and Path(files[0]).suffix == ".txt" else data.text_column


def usable_documents(values, pretokenized: bool, skipped: dict) -> list:
    """The usable documents of a block of one column; empty, missing, undecodable ones and values that are not text
    are counted in `skipped` ("empty", "undecodable", "not text") and left out."""
    usable = []
    for value in values:
        if pretokenized:
            if value:
                usable.append(list(value))
            else:
                skipped["empty"] = skipped.get("empty", 0) + 1
        elif value is not None and not isinstance(value, str):  # a number or a list where text belongs
            skipped["not text"] = skipped.get("not text", 0) + 1
        elif not value or not value.strip():
            skipped["empty"] = skipped.get("empty", 0) + 1
        elif UNDECODABLE in value:
            skipped["undecodable"] = skipped.get("undecodable", 0) + 1
        else:
            usable.append(value)
    return usable


def check_column(batch: dict, column: str, key: str = "data.text_column") -> None:
    """`key`: the config key of the column (a source of a mixture: `data.sources[i].text_column`)."""
    if column not in batch:
        raise ConfigError(f"{key}={column!r} is not a column of the data; columns: {sorted(batch)}")


def check_has_documents(data, held_out: int = 0, batch_size: int = 64) -> None:
    """Reads a local corpus up to its first usable training document (one after the `held_out` validation
    documents): a corpus without one is a DataError counting what was skipped, raised before any training work.
    Hub sources are checked by the stream itself, at its first batch."""
    if not data.pretokenized_dir and local_data_files(data.source, source_key(data)) is None:
        return
    column, skipped, row, usable = text_column(data), {}, 0, 0
    for block in read_blocks(open_source(data), batch_size, data):
        check_column(block, column, source_key(data).rsplit(".", 1)[0] + ".text_column")
        for value in block[column]:
            if usable_documents([value], column == TOKENS_COLUMN, skipped):
                if row >= held_out:
                    return
                usable += 1
            row += 1
    if not usable:
        raise no_usable_documents(data, skipped)
    raise DataError(f"{source_name(data)} has {usable} usable documents, all among the first "
                    f"data.validation_docs={held_out} that validation holds out: none is left to train on "
                    f"({skipped.get('empty', 0)} empty, {skipped.get('undecodable', 0)} undecodable)")


# A document longer than this is tokenized a piece at a time: a whole 17 MB one took a tiny run from 1.0 GB to 3.6 GB
# (the tokenizer's encoding keeps offsets and strings for every token); the ids are the same.
LONG_DOCUMENT_CHARS = 1 << 20


class DocumentTokenizer:
    """Raw texts -> token ids (with the tokenizer's special tokens, no truncation). Empty, missing and
    undecodable documents are skipped and counted (`usable_documents`), never fatal."""

    def __init__(self, tokenizer, column: str):
        self.column = column
        self.pretokenized = column == TOKENS_COLUMN
        self.backend = None
        if not self.pretokenized:
            self.backend = copy.deepcopy(tokenizer.backend_tokenizer)
            self.backend.no_truncation()
            self.backend.no_padding()

    def __call__(self, batch: dict, skipped: dict) -> list[list[int]]:
        return self.encode(self.usable(batch, skipped))

    def usable(self, batch: dict, skipped: dict) -> list:
        """The block's usable documents, not yet tokenized (which ones is decided on the raw values)."""
        check_column(batch, self.column)
        return usable_documents(batch[self.column], self.pretokenized, skipped)

    def encode(self, documents: list) -> list[list[int]]:
        """Token ids of usable documents (`usable`), in their order; one longer than LONG_DOCUMENT_CHARS a piece at a
        time (`encode_long`)."""
        if self.pretokenized or not documents:
            return list(documents)
        short = self.backend.encode_batch([text for text in documents if len(text) <= LONG_DOCUMENT_CHARS])
        encoded = (encoding.ids for encoding in short)
        return [next(encoded) if len(text) <= LONG_DOCUMENT_CHARS else self.encode_long(text) for text in documents]

    def encode_long(self, text: str) -> list[int]:
        """The ids of one long text, the same as encoding it whole: its pieces end before a whitespace character
        (no token spans one; a byte-level BPE reads the space at the start of the next piece), each encoded without
        the special tokens, which frame the whole (a text without whitespace is cut at the bound)."""
        prefix, suffix = self.special_frame()
        body = []
        for start, end in whitespace_pieces(text, LONG_DOCUMENT_CHARS):
            body.extend(self.backend.encode(text[start:end], add_special_tokens=False).ids)
        return prefix + body + suffix

    def special_frame(self) -> tuple[list[int], list[int]]:
        """The special tokens the tokenizer puts before and after a text ([CLS] and [SEP] for BERT's)."""
        inner = self.backend.encode("a", add_special_tokens=False).ids
        whole = self.backend.encode("a", add_special_tokens=True).ids
        start = next(i for i in range(len(whole)) if whole[i:i + len(inner)] == inner)
        return whole[:start], whole[start + len(inner):]


def whitespace_pieces(text: str, size: int) -> Iterator[tuple[int, int]]:
    """(start, end) of consecutive pieces of `text` of at most about `size` characters, each after the first
    starting at a whitespace character where the piece has one."""
    start = 0
    while start < len(text):
        end = min(start + size, len(text))
        if end < len(text):
            cut = max(text.rfind(c, start + 1, end + 1) for c in (" ", "\n", "\t"))
            end = cut if cut > start else end
        yield start, end
        start = end


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
    for block in read_blocks(dataset, 1000, data):
        yield from tokenize(block, skipped)


def unigram_entropy(data, tokenizer, max_docs: int | None = None) -> float:
    """Entropy (nats) of the distribution of maskable tokens (no special tokens) as training sees them
    (truncated to data.max_length unless packed): the loss of a model that ignores context."""
    special = set(tokenizer.all_special_ids)
    counts: Counter = Counter()
    for ids in iterate_documents(data, tokenizer, max_docs):
        if data.packing == "none":
            ids = truncate(ids, data.max_length, special)
        counts.update(t for t in ids if t not in special)
    total = sum(counts.values())
    if not total:
        raise DataError(f"{source_name(data)} has no tokens to compute a unigram baseline from")
    return -sum(c / total * math.log(c / total) for c in counts.values())


def source_inputs(data) -> list[tuple[str, str]]:
    """The local files a command reads from `data` (one source, or each of data.sources), labelled with their
    config key, for `neobert.outputs.claim_output_dir`: its output directory must hold none of them."""
    named = ([(f"data.sources[{i}].source", s.source) for i, s in enumerate(data.sources)] if data.sources
             else [(source_key(data), data.source)])
    if data.pretokenized_dir:
        named.append(("data.pretokenized_dir", data.pretokenized_dir))
    inputs = []
    for key, source in named:
        path = Path(source).expanduser()
        files = [path] if path.exists() else [Path(f) for f in glob.glob(str(path), recursive=True)]
        inputs += [(f"{key}={source!r}", file) for file in files]
    return inputs


PRETOKENIZED_EXISTS = ("pretokenize directory {directory} already holds shards of an earlier --pretokenize ({held}): "
                       "they would be read beside the new ones; remove them or choose another directory")
NO_PARTIAL_SHARDS = "no partial shard is left, and the shards this run wrote before it are removed (an incomplete set)"


def write_shard(rows: list, path: Path) -> Path:
    """One parquet shard of token ids, written under a temporary name and renamed: a failed write leaves none."""
    table = pa.table({TOKENS_COLUMN: pa.array(rows, type=pa.list_(pa.int32()))})
    tmp = Path(str(path) + ".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)  # only once there is a shard to write
    try:
        pq.write_table(table, str(tmp))
    except BaseException as err:
        full, written = filled_the_disk(err, path.parent), tmp.stat().st_size if tmp.exists() else 0
        tmp.unlink(missing_ok=True)
        if full:
            raise out_of_space(path.parent, path.name, written, NO_PARTIAL_SHARDS, known=False) from err
        raise
    os.replace(tmp, path)
    return path


def pretokenize(data, tokenizer, out_dir: str | Path, docs_per_shard: int = 100_000) -> list[Path]:
    """Writes the documents' token ids as parquet shards (column `input_ids`) for `data.pretokenized_dir`.
    Validation documents are kept in front so `data.validation_docs` holds out the same ones. A directory with
    shards of an earlier pretokenization (they would be read with the new ones), or holding the corpus it reads,
    is refused before anything is written (`neobert.outputs.claim_output_dir`); others' files there stay."""
    out_dir = Path(out_dir)
    claim_output_dir(out_dir, SHARDS, where=f"pretokenize directory {out_dir}", noun="directory",
                     earlier=PRETOKENIZED_EXISTS, inputs=source_inputs(data))
    tokenize, skipped = DocumentTokenizer(tokenizer, text_column(data)), {}
    shards, rows, created = [], [], not out_dir.exists()
    try:
        for block in read_blocks(open_source(data), 1000, data):
            rows.extend(tokenize(block, skipped))
            while len(rows) >= docs_per_shard:
                shards.append(write_shard(rows[:docs_per_shard], out_dir / f"shard-{len(shards):05d}.parquet"))
                rows = rows[docs_per_shard:]
        if rows:
            shards.append(write_shard(rows, out_dir / f"shard-{len(shards):05d}.parquet"))
    except BaseException:  # a full disk, bad data further on, an interrupt: an incomplete set of shards is no output
        for shard in shards:
            shard.unlink(missing_ok=True)
        if created and out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()
        raise
    if not shards:
        raise no_usable_documents(data, skipped)
    if skipped:
        log.warning("pretokenize skipped documents: %s", skipped)
    return shards


def document_digest(value) -> bytes:
    """A document's identity (its text, or its token ids when pre-tokenized)."""
    raw = value.encode("utf-8", "replace") if isinstance(value, str) else str(value).encode()
    return hashlib.blake2b(raw, digest_size=16).digest()


def held_out_digests(data, count: int) -> frozenset[bytes]:
    """The digests of the first `count` documents of the source: validation's documents, kept out of training."""
    column = text_column(data)
    return frozenset(document_digest(example[column]) for example in open_source(data).take(count))
