"""The embedded demo's corpus: CPython's own documentation topics (`pydoc_data.topics`).

Why this corpus: it is real English prose written by people (the Python language reference, 79 topics,
about 465 KB), it ships with every CPython installation, so a fresh machine without internet or the
Hugging Face hub has it, and its licence (PSF) allows this use. It is written to a `.jsonl` file with a
`content` column, the column RefinedWeb uses, so the demo reads it through the very same streaming
DataModule code path as the paper's data.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path


def demo_documents(max_chars: int = 500) -> list[dict]:
    """Topics cut at blank lines into documents of at most about `max_chars` characters (consecutive
    paragraphs of one topic are joined while they fit), in a stable order."""
    from pydoc_data.topics import topics

    documents = []
    for name in sorted(topics):
        paragraphs = [p.strip() for p in re.split(r"\n\s*\n", topics[name]) if p.strip()]
        current = ""
        for paragraph in paragraphs:
            if current and len(current) + len(paragraph) + 2 > max_chars:
                documents.append({"topic": name, "content": current})
                current = ""
            current = f"{current}\n\n{paragraph}" if current else paragraph
        if current:
            documents.append({"topic": name, "content": current})
    return documents


def write_demo_corpus(path: str | Path, max_chars: int = 500) -> Path:
    """Writes the corpus as JSON lines (once; an existing complete file is kept)."""
    path = Path(path)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for document in demo_documents(max_chars):
            f.write(json.dumps(document, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path
