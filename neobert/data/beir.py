"""A retrieval data set in the BEIR layout, read from a local directory (tests, firewalled machines, your own
collection): `python -m experiments.mteb --tasks beir:<dir>` scores it with mteb (`neobert.eval.mteb`).

    <dir>/corpus.jsonl        {"_id": "d1", "title": "...", "text": "..."} per line (`title` may be absent or empty)
    <dir>/queries.jsonl       {"_id": "q1", "text": "..."} per line
    <dir>/qrels/<split>.tsv   header `query-id<TAB>corpus-id<TAB>score`, then one judged pair per line (integer score;
                              0 = judged not relevant, > 0 = relevant, graded)

The split is the one asked for (`beir_split`), else the only file under qrels/. Queries without a relevant
document in that split are left out (mteb and BEIR do the same). Every problem is a `DataError` naming the file and
the line: a missing file, a line that is not JSON, a missing or repeated `_id`, a document with neither title nor
text, a query without text, a qrels line with another shape, a non-integer score, or an id that neither
corpus.jsonl nor queries.jsonl holds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from neobert.errors import DataError
from neobert.layout import BEIR_CORPUS, BEIR_QRELS_DIR, BEIR_QUERIES

QRELS_HEADER = ("query-id", "corpus-id", "score")


@dataclass
class BeirData:
    corpus: dict[str, tuple[str, str]]  # id -> (title, text)
    queries: dict[str, str]  # id -> text (only the queries with a relevant document in the split)
    qrels: dict[str, dict[str, int]]  # query id -> {document id: score}
    split: str


def beir_splits(directory: str | Path) -> list[str]:
    """The splits a BEIR directory has judgements for (qrels/<split>.tsv), sorted."""
    qrels = Path(directory) / BEIR_QRELS_DIR
    return sorted(p.stem for p in qrels.glob("*.tsv")) if qrels.is_dir() else []


def choose_split(directory: str | Path, split: Optional[str] = None, key: str = "beir_split") -> str:
    """`split` when given (its qrels file must exist), else the only split of the directory."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise DataError(f"BEIR directory {str(directory)!r} is a file, not a directory (a BEIR directory holds "
                        f"{BEIR_CORPUS}, {BEIR_QUERIES} and {BEIR_QRELS_DIR}/<split>.tsv)")
    if not directory.is_dir():
        raise DataError(f"BEIR directory {str(directory)!r} does not exist (expected {BEIR_CORPUS}, {BEIR_QUERIES} "
                        f"and {BEIR_QRELS_DIR}/<split>.tsv in it)")
    splits = beir_splits(directory)
    if not splits:
        raise DataError(f"{directory / BEIR_QRELS_DIR}: no qrels file (<split>.tsv, e.g. test.tsv)")
    if split is None:
        if len(splits) > 1:
            raise DataError(f"{directory / BEIR_QRELS_DIR} holds the splits {splits}: choose one with `{key}`")
        return splits[0]
    if Path(split).name != split or split.endswith(".tsv") or split in ("", ".", ".."):
        raise DataError(f"`{key}`={split!r} is not a split name: a split is the name of a qrels file of "
                        f"{directory / BEIR_QRELS_DIR} without .tsv (splits there: {splits})")
    if split not in splits:
        raise DataError(f"{directory / BEIR_QRELS_DIR / (split + '.tsv')} does not exist (`{key}`={split!r}; "
                        f"splits there: {splits})")
    return split


def read_beir(directory: str | Path, split: Optional[str] = None, key: str = "beir_split") -> BeirData:
    """Reads and checks a BEIR directory (see the module docstring); `key` is the config key named in messages
    about the split."""
    directory = Path(directory)
    split = choose_split(directory, split, key)
    corpus = {}
    for path, number, row in _jsonl_rows(directory / BEIR_CORPUS, "the corpus"):
        doc_id = _row_id(row, path, number, corpus)
        title, text = _text(row, "title", path, number), _text(row, "text", path, number)
        if not (title.strip() or text.strip()):
            raise DataError(f"{path}:{number}: document {doc_id!r} has an empty text (and no title)")
        corpus[doc_id] = (title, text)
    queries = {}
    for path, number, row in _jsonl_rows(directory / BEIR_QUERIES, "the queries"):
        query_id = _row_id(row, path, number, queries)
        text = _text(row, "text", path, number)
        if not text.strip():
            raise DataError(f"{path}:{number}: query {query_id!r} has an empty text")
        queries[query_id] = text
    qrels = _read_qrels(directory / BEIR_QRELS_DIR / f"{split}.tsv", queries, corpus)
    if not any(score > 0 for judged in qrels.values() for score in judged.values()):
        raise DataError(f"{directory / BEIR_QRELS_DIR / (split + '.tsv')}: no relevant pair (every score is 0)")
    kept = {q: t for q, t in queries.items() if any(s > 0 for s in qrels.get(q, {}).values())}
    return BeirData(corpus=corpus, queries=kept, qrels={q: qrels[q] for q in kept}, split=split)


def _jsonl_rows(path: Path, what: str):
    if not path.is_file():
        raise DataError(f"{path} does not exist ({what} of a BEIR directory)")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise DataError(f"{path} is not UTF-8 text: {err}") from err
    rows = 0
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{number}: not JSON ({err})") from err
        if not isinstance(row, dict):
            raise DataError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
        rows += 1
        yield path, number, row
    if not rows:
        raise DataError(f"{path} is empty")


def _row_id(row: dict, path: Path, number: int, seen: dict) -> str:
    if row.get("_id") is None or str(row["_id"]) == "":
        raise DataError(f"{path}:{number}: no `_id`")
    row_id = str(row["_id"])
    if row_id in seen:
        raise DataError(f"{path}:{number}: `_id` {row_id!r} appears twice")
    return row_id


def _text(row: dict, column: str, path: Path, number: int) -> str:
    value = row.get(column) or ""
    if not isinstance(value, str):
        raise DataError(f"{path}:{number}: `{column}` must be a string, got {type(value).__name__}")
    return value


def _read_qrels(path: Path, queries: dict, corpus: dict) -> dict[str, dict[str, int]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise DataError(f"{path} is not UTF-8 text: {err}") from err
    qrels: dict[str, dict[str, int]] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        fields = line.rstrip("\r\n").split("\t")
        if number == 1 and tuple(f.strip() for f in fields) == QRELS_HEADER:
            continue
        if len(fields) != 3:
            raise DataError(f"{path}:{number}: expected 3 tab-separated fields (query-id, corpus-id, score), got "
                            f"{len(fields)}")
        query_id, doc_id, score = (f.strip() for f in fields)
        try:
            value = int(score)
        except ValueError as err:
            raise DataError(f"{path}:{number}: score {score!r} is not an integer") from err
        if query_id not in queries:
            raise DataError(f"{path}:{number}: query id {query_id!r} is not in {path.parent.parent / BEIR_QUERIES}")
        if doc_id not in corpus:
            raise DataError(f"{path}:{number}: corpus id {doc_id!r} is not in {path.parent.parent / BEIR_CORPUS}")
        qrels.setdefault(query_id, {})[doc_id] = value
    if not qrels:
        raise DataError(f"{path} holds no judged pair")
    return qrels
