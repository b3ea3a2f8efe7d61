"""Token classification (NER): the task table, CoNLL-layout reading (hub or local files), first-sub-token label
alignment with truncation accounting (the DataModule that serves them is `neobert.data.ner_datamodule.NerDataModule`,
on the layout and batching of `neobert.data.finetune`).

Every source yields the same thing, an `NerSplit` (words and tags per sentence), so everything after reading is
one code path:
* `data.path=None`: the task's hub data set (`wnut_17`, `eriktks/conll2003`; needs the hub, fails fast offline
  naming `data.path`);
* `data.path=<dir>`: local CoNLL files `<dir>/train.conll`, `<dir>/dev.conll` (also `validation.*`, `test.*`, with
  the suffixes .conll .txt .tsv .iob .bio); `data.files.<split>=<file>` names a file of its own.

The CoNLL layout: one `token<TAB>tag` (or whitespace-separated columns, the tag last: CoNLL-2003's
`EU NNP B-NP B-ORG`) per line, sentences separated by a blank or whitespace-only line; `-DOCSTART-` lines are
document separators. A tag outside the task's label set, a line without a tag, an empty file and bytes that are not
UTF-8 are DataErrors naming the file and line.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import datasets
import torch
from seqeval.metrics.sequence_labeling import get_entities
from torch.utils.data import Dataset

from neobert.config.ner import NerDataConfig
from neobert.errors import ConfigError, DataError
from neobert.hub import HubUnreachableError, require_hub
from neobert.model.heads import IGNORE_INDEX

log = logging.getLogger(__name__)

OUTSIDE = "O"
DOCSTART = "-DOCSTART-"
SUFFIXES = (".conll", ".txt", ".tsv", ".iob", ".iob2", ".bio")
# Local file stems of each split, first match wins (WNUT's own names are `data.files` away).
SPLIT_STEMS = {"train": ("train",), "validation": ("dev", "validation", "valid", "val"), "test": ("test",)}


@dataclass(frozen=True)
class NerTask:
    """One NER data set: its hub name and its tags, in the hub's `ner_tags` order (the label ids)."""

    name: str
    hub_dataset: str
    labels: tuple[str, ...]

    @property
    def entity_types(self) -> list[str]:
        return sorted({label[2:] for label in self.labels if label != OUTSIDE})


NER_TASKS: dict[str, NerTask] = {
    task.name: task
    for task in (
        NerTask("wnut17", "wnut_17", (
            "O", "B-corporation", "I-corporation", "B-creative-work", "I-creative-work", "B-group", "I-group",
            "B-location", "I-location", "B-person", "I-person", "B-product", "I-product")),
        NerTask("conll2003", "eriktks/conll2003", (
            "O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC")),
    )
}


def get_ner_task(name: str) -> NerTask:
    if name not in NER_TASKS:
        raise ConfigError(f"unknown NER task {name!r}; known tasks: {sorted(NER_TASKS)}")
    return NER_TASKS[name]


@dataclass
class NerSplit:
    """Sentences of one split: words and their tags, and where they came from (for messages)."""

    words: list[list[str]]
    tags: list[list[str]]
    source: str
    first_lines: list[int] = field(default_factory=list)  # local files: the line each sentence starts on

    def __len__(self) -> int:
        return len(self.words)

    def num_entities(self) -> int:
        return sum(len(get_entities(tags)) for tags in self.tags)

    def select(self, indices: Sequence[int]) -> "NerSplit":
        pick = lambda values: [values[i] for i in indices] if values else []  # noqa: E731
        return NerSplit(pick(self.words), pick(self.tags), self.source, pick(self.first_lines))


# ------------------------------------------------------------------------------------------------ reading
def read_conll(path: str | Path, labels: Sequence[str]) -> NerSplit:
    """Reads a CoNLL-layout file (see the module docstring). Every problem is a DataError naming `path:line`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist" if not path.exists() else f"{path} is not a file")
    allowed = set(labels)
    split = NerSplit([], [], str(path))
    words: list[str] = []
    tags: list[str] = []

    def end_sentence() -> None:
        if words:
            split.words.append(list(words))
            split.tags.append(list(tags))
            words.clear()
            tags.clear()

    for number, raw in enumerate(path.read_bytes().splitlines(), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise DataError(f"{path}:{number}: not UTF-8 text (byte {raw[err.start:err.start + 1]!r} at column "
                            f"{err.start + 1}: {err.reason})") from None
        if number == 1:
            line = line.removeprefix("\ufeff")
        if not line.strip():  # an empty or whitespace-only line (WNUT's train file has lines of one tab)
            end_sentence()
            continue
        fields = [f.strip() for f in line.split("\t")] if "\t" in line else line.split()
        if fields[0] == DOCSTART:
            end_sentence()
            continue
        if len(fields) < 2 or not fields[-1]:
            raise DataError(f"{path}:{number}: no tag: expected `token<TAB>tag` (or columns with the tag last), "
                            f"got {line.strip()!r}")
        token, tag = fields[0], fields[-1]
        if not token:
            raise DataError(f"{path}:{number}: no token before the tag {tag!r}")
        if tag not in allowed:
            raise DataError(f"{path}:{number}: tag {tag!r} is not in the label set ({', '.join(labels)})")
        if not words:
            split.first_lines.append(number)
        words.append(token)
        tags.append(tag)
    end_sentence()
    if not split.words:
        raise DataError(f"{path}: no sentences (the file is empty{' or blank' if path.stat().st_size else ''})")
    return split


def split_file(config: NerDataConfig, split: str) -> Path:
    """The local file of `split`: `data.files.<split>`, else `<data.path>/<stem><suffix>` (SPLIT_STEMS, SUFFIXES)."""
    if split in config.files:
        return Path(config.files[split])
    root = Path(config.path)
    if not root.is_dir():
        raise FileNotFoundError(f"data.path={config.path!r} is not a directory")
    for stem in SPLIT_STEMS[split]:
        for suffix in SUFFIXES:
            if (root / f"{stem}{suffix}").is_file():
                return root / f"{stem}{suffix}"
    names = ", ".join(f"{s}.conll" for s in SPLIT_STEMS[split])
    raise FileNotFoundError(f"no {split} file in data.path={config.path!r} (looked for {names}, also .txt/.tsv/.iob; "
                            f"or set data.files.{split})")


def uses_hub(config: NerDataConfig, split: str) -> bool:
    return config.path is None and split not in config.files


def load_ner_split(task: NerTask, split: str, config: NerDataConfig) -> NerSplit:
    """One split, from local CoNLL files or the task's hub data set."""
    if not uses_hub(config, split):
        return read_conll(split_file(config, split), task.labels)
    try:
        require_hub(task.hub_dataset, "data.path")
    except HubUnreachableError as err:
        raise HubUnreachableError(f"{err} For example `data.path=/data/{task.name}` holding train.conll and "
                                  f"dev.conll (one `token<TAB>tag` per line, a blank line between sentences).") from err
    dataset = datasets.load_dataset(task.hub_dataset, split=split)
    names = dataset.features["ner_tags"].feature.names
    unknown = sorted(set(names) - set(task.labels))
    if unknown:
        raise DataError(f"{task.hub_dataset}/{split}: tags {unknown} are not in the {task.name} label set")
    tags = [[names[t] for t in row] for row in dataset["ner_tags"]]
    keep = [i for i, words in enumerate(dataset["tokens"]) if words]
    return NerSplit([list(dataset["tokens"][i]) for i in keep], [tags[i] for i in keep],
                    f"{task.hub_dataset}/{split}")


def example_subset(sentences: NerSplit, split: str, limit: int) -> NerSplit:
    """At most `limit` sentences of a split (`data.max_train_examples`, `data.max_eval_examples`; 0: all of them):
    of the train split a random `limit` (seed 0: the same subset at every run and seed of a sweep), of any other
    split its first `limit`; kept in file order. The NerDataModule's and the Hugging Face Trainer baseline's
    (scripts/hf_trainer_ner.py)."""
    if not limit or limit >= len(sentences):
        return sentences
    order = (torch.randperm(len(sentences), generator=torch.Generator().manual_seed(0)).tolist()
             if split == "train" else list(range(len(sentences))))
    return sentences.select(sorted(order[:limit]))


# ------------------------------------------------------------------------------------------------ alignment
class TokenizedNer(Dataset):
    """Sub-token ids and labels per sentence: the first sub-token of each word carries its tag id, the other
    sub-tokens and the special tokens IGNORE_INDEX (-100). `word_positions[i][w]` is the position of word w's
    first sub-token, -1 for a word with no sub-token (cut by truncation, or one the tokenizer drops, such as a
    zero-width space): such words are predicted "O" and scored against their FULL gold tags (`tags`), never
    dropped from the gold sequence."""

    def __init__(self, split: NerSplit, task: NerTask, tokenizer, max_length: int, name: str = ""):
        if not getattr(tokenizer, "is_fast", False):
            raise ConfigError(f"tokenizer {type(tokenizer).__name__} is not a fast tokenizer: token classification "
                              f"needs its word alignment (word_ids)")
        label_id = {label: i for i, label in enumerate(task.labels)}
        self.tags = split.tags
        encoded = tokenizer(split.words, is_split_into_words=True, truncation=True, max_length=max_length)
        self.input_ids: list[list[int]] = encoded["input_ids"]
        self.labels: list[list[int]] = []
        self.word_positions: list[list[int]] = []
        self.truncated, self.entities_dropped, self.words_without_tokens = 0, 0, 0
        for i, (words, tags) in enumerate(zip(split.words, split.tags)):
            word_ids = encoded.word_ids(i)
            labels, positions = [IGNORE_INDEX] * len(word_ids), [-1] * len(words)
            previous = None
            for position, word in enumerate(word_ids):
                if word is not None and word != previous:
                    labels[position] = label_id[tags[word]]
                    positions[word] = position
                previous = word
            self.labels.append(labels)
            self.word_positions.append(positions)
            if encoded.encodings[i].overflowing:
                last_kept = max((w for w in word_ids if w is not None), default=-1)
                self.truncated += 1
                self.entities_dropped += sum(end > last_kept for _, _, end in get_entities(tags))
                self.words_without_tokens += sum(p < 0 for p in positions[: last_kept + 1])
            else:
                self.words_without_tokens += sum(p < 0 for p in positions)
        if self.truncated:
            log.warning("NER %s: %d of %d sentences truncated to %d sub-tokens (data.max_length), %d gold entities "
                        "dropped from the input; they stay in the gold sequence and count as missed (the cut "
                        "words are predicted O)", name or split.source, self.truncated, len(self), max_length,
                        self.entities_dropped)
        if self.words_without_tokens:
            log.info("NER %s: %d words have no sub-token (the tokenizer drops them); they are predicted O",
                     name or split.source, self.words_without_tokens)

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.input_ids[i], "labels": self.labels[i], "idx": i}

    def lengths(self) -> list[int]:
        return [len(ids) for ids in self.input_ids]
