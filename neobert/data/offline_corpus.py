"""A larger offline English corpus for pretraining on a CPU machine without the hub: the prose documentation that
CPython and the installed packages ship (`.rst`, `.md` and `.txt` files under the standard library and
site-packages, and the docstrings of the standard library's modules, classes and functions), cut into documents at
paragraph boundaries, filtered to prose, and deduplicated.

Why: the demo corpus (`neobert.data.demo_corpus`, ~0.5 MB) is memorised within a few hundred steps of a small
model; this one is tens of MB on a typical installation, still real English written by people, and present on
every machine that can run the suite.

Licences: every text keeps its own: the PSF licence for CPython, mostly MIT, BSD or Apache-2.0 for packages.
Each document records the file it came from (`source`), so its licence can be looked up. The corpus is built on
the user's machine from what is installed there; this suite does not redistribute it.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import re
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator

from neobert.layout import write_atomically

DOC_SUFFIXES = (".rst", ".md", ".txt")
MAX_FILE_BYTES = 2_000_000  # larger "text" files are data (word lists, tables), not prose
# A prose paragraph: mostly letters and spaces, words of ordinary length, not code or a table.
MIN_LETTER_FRACTION = 0.75
CODE_LINE = re.compile(r"^\s*(>>>|\.\.\.|\$ |[{}\[\]|+=#*-]{3,}|def |class |import |from \S+ import )")


def default_roots() -> list[Path]:
    """The standard library and site-packages of this interpreter."""
    paths = sysconfig.get_paths()
    return sorted({Path(paths["stdlib"]), Path(paths["purelib"]), Path(paths["platlib"])})


def chunk_paragraphs(text: str, max_chars: int) -> list[str]:
    """`text` cut at blank lines into pieces of at most about `max_chars` characters: consecutive paragraphs are
    joined while they fit; a longer paragraph stays whole."""
    pieces, current = [], ""
    for paragraph in (p.strip() for p in re.split(r"\n\s*\n", text)):
        if not paragraph:
            continue
        if current and len(current) + len(paragraph) + 2 > max_chars:
            pieces.append(current)
            current = ""
        current = f"{current}\n\n{paragraph}" if current else paragraph
    if current:
        pieces.append(current)
    return pieces


def is_prose(paragraph: str, min_words: int) -> bool:
    """Whether a paragraph reads as English prose rather than code, a table, a list of names or markup."""
    words = paragraph.split()
    if len(words) < min_words or any(CODE_LINE.match(line) for line in paragraph.splitlines()):
        return False
    letters = sum(c.isalpha() or c.isspace() for c in paragraph)
    mean_word = sum(len(w) for w in words) / len(words)
    return letters / len(paragraph) >= MIN_LETTER_FRACTION and 2.5 <= mean_word <= 9


def source_texts(roots: Iterable[str | Path]) -> Iterator[tuple[str, str]]:
    """(source, text): every documentation file, then the docstrings of every `.py` file, in sorted path order.
    Unreadable, binary and non-UTF-8 files are skipped."""
    files = sorted({p for root in roots for p in Path(root).rglob("*") if p.suffix in DOC_SUFFIXES + (".py",)})
    for path in files:
        try:
            if not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
                continue
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if path.suffix == ".py":
            yield from ((f"{path}:{name}", doc) for name, doc in _docstrings(text))
        else:
            yield str(path), text


def _docstrings(source: str) -> Iterator[tuple[str, str]]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                yield getattr(node, "name", "<module>"), doc


def offline_documents(roots: Iterable[str | Path] | None = None, max_chars: int = 1000,
                      min_words: int = 12) -> Iterator[dict]:
    """Documents {"content", "source"}: prose paragraphs of every source text, joined up to `max_chars`; a
    document whose normalised text was seen before is dropped (licence files, vendored copies, repeated
    docstrings)."""
    seen: set[bytes] = set()
    for source, text in source_texts(roots if roots is not None else default_roots()):
        prose = "\n\n".join(p for p in re.split(r"\n\s*\n", text) if is_prose(p.strip(), min_words))
        for piece in chunk_paragraphs(prose, max_chars):
            key = hashlib.blake2b(" ".join(piece.lower().split()).encode(), digest_size=16).digest()
            if key not in seen:
                seen.add(key)
                yield {"content": piece, "source": source}


def write_offline_corpus(path: str | Path, roots: Iterable[str | Path] | None = None, max_chars: int = 1000,
                         min_words: int = 12, shuffle_seed: int | None = None) -> dict:
    """Writes the corpus as JSON lines (`content`, `source`) atomically, once (an existing file is kept), and
    returns its size and content hash: {"documents", "characters", "sha256", "path"}. `shuffle_seed` writes the
    documents in a seeded random order instead of file order: in file order a stream's shuffle buffer still
    trains package by package, and the first documents (held out for validation) all come from one package."""
    path = Path(path)
    if not path.is_file():
        documents = offline_documents(roots, max_chars, min_words)
        if shuffle_seed is not None:
            documents = list(documents)
            random.Random(shuffle_seed).shuffle(documents)
        write_atomically(path, (json.dumps(d, ensure_ascii=False) + "\n" for d in documents))
    documents = characters = 0
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for line in f:
            documents += 1
            characters += len(json.loads(line)["content"])
            digest.update(line)
    if not documents:
        raise ValueError(f"{path}: no prose found under the given roots")
    # The corpus depends on what is installed: the hash tells whether two machines trained on the same text.
    return {"documents": documents, "characters": characters, "sha256": digest.hexdigest(), "path": str(path)}


# Small corpora of two other kinds of prose than the demo's (the Python reference's topics), built here in seconds
# from what every install of this package has, for offline mixtures (recipes/cpu-phases): the docstrings and docs
# of some standard-library packages, and of some of this package's dependencies. Written when a config names them.
STDLIB_SOURCE = "runs/offline/stdlib.jsonl"
PACKAGES_SOURCE = "runs/offline/packages.jsonl"
STDLIB_PACKAGES = ("email", "asyncio", "json", "logging", "unittest", "http", "concurrent", "importlib",
                   "collections", "urllib")
DEPENDENCY_PACKAGES = ("lightning", "omegaconf", "datasets")


def small_offline_sources() -> dict[str, list[Path]]:
    """The small offline corpora by their path (relative to the working directory) and the folders they read."""
    paths = sysconfig.get_paths()
    return {STDLIB_SOURCE: [Path(paths["stdlib"]) / name for name in STDLIB_PACKAGES],
            PACKAGES_SOURCE: [Path(paths["purelib"]) / name for name in DEPENDENCY_PACKAGES]}


def write_small_offline_source(path: str) -> dict | None:
    """Writes `path` if it is one of the small offline corpora (seeded order; kept when it exists); None if not."""
    roots = small_offline_sources().get(str(path))
    return None if roots is None else write_offline_corpus(path, roots, shuffle_seed=0)

