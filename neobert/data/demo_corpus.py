"""The embedded demo's corpus: CPython's own documentation topics (`pydoc_data.topics`).

Why this corpus: it is real English prose written by people (the Python language reference, 79 topics,
about 465 KB), it ships with every CPython installation, so a fresh machine without internet or the
Hugging Face hub has it, and its licence (PSF) allows this use. It is written to a `.jsonl` file with a
`content` column, the column RefinedWeb uses, so the demo reads it through the very same streaming
DataModule code path as the paper's data.

`write_fallback_glue` builds a small pair-classification task from it, in GLUE RTE's parquet layout, for
machines with neither the hub nor GLUE files (the ablation ladder's evaluation).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from pydoc_data.topics import topics

from neobert.data.offline_corpus import chunk_paragraphs
from neobert.layout import write_atomically


def demo_documents(max_chars: int = 500) -> list[dict]:
    """Topics cut at blank lines into documents of at most about `max_chars` characters (consecutive
    paragraphs of one topic are joined while they fit), in a stable order."""
    return [{"topic": name, "content": piece} for name in sorted(topics)
            for piece in chunk_paragraphs(topics[name], max_chars)]


def write_demo_corpus(path: str | Path, max_chars: int = 500) -> Path:
    """Writes the corpus as JSON lines (once; an existing complete file is kept)."""
    path = Path(path)
    if path.is_file():
        return path
    return write_atomically(path, (json.dumps(d, ensure_ascii=False) + "\n" for d in demo_documents(max_chars)))


def write_fallback_glue(corpus: str | Path, directory: str | Path, train: int = 480, validation: int = 160,
                        seed: int = 0) -> Path:
    """A small pair-classification task in GLUE RTE's parquet layout (`<directory>/rte/{train,validation}.parquet`,
    kept when it exists), built from the demo corpus: sentence1 is a passage of a document, sentence2 is either
    another passage of the same document (label 0, "entailment") or of a document on another topic (label 1).
    It is not RTE; it only tells whether pretraining taught the encoder something about topical coherence.
    Returns `directory`, the GLUE root to read it from."""
    directory = Path(directory) / "rte"
    if (directory / "validation.parquet").is_file():
        return directory.parent
    documents = [json.loads(line) for line in Path(corpus).read_text(encoding="utf-8").splitlines() if line]
    by_topic: dict[str, list[str]] = {}
    for doc in documents:
        sentences = [s.strip() for s in doc["content"].replace("\n", " ").split(". ") if len(s.split()) >= 4]
        by_topic.setdefault(doc["topic"], []).extend(sentences)
    topics_with_pairs = [t for t, s in by_topic.items() if len(s) >= 2]
    if len(topics_with_pairs) < 2:
        raise RuntimeError(f"{corpus}: too few topics to build the fallback pair task")
    rng = random.Random(seed)
    rows = []
    for index in range(train + validation):
        topic = rng.choice(topics_with_pairs)
        first, second = rng.sample(by_topic[topic], 2)
        label = index % 2  # balanced classes
        if label:
            other = rng.choice([t for t in topics_with_pairs if t != topic])
            second = rng.choice(by_topic[other])
        rows.append({"sentence1": first, "sentence2": second, "label": label})
    rng.shuffle(rows)
    directory.mkdir(parents=True, exist_ok=True)
    for split, part in (("train", rows[:train]), ("validation", rows[train:])):
        table = pa.Table.from_pylist([{**r, "idx": i} for i, r in enumerate(part)])
        pq.write_table(table, directory / f"{split}.parquet")
    return directory.parent
