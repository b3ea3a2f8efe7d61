"""Contrastive training data (paper Section 5.2): (query, positive[, hard negative]) examples from the
paper's training sets, each prefixed with its data set's instruction, one data set per batch, data sets drawn in
proportion to size**alpha, no repeated text inside a batch (a repeat would be a false in-batch negative), and an
exactly resumable order of batches.

Every data set is a hub data set by default (`CONTRASTIVE_DATASETS`, in `neobert.config.contrastive`) and can be
replaced by a local file with `data.local_files.<name>=<path>`; a name that is not in the registry is a local-only
data set. Local files:
* `.jsonl` / `.csv` / `.tsv` with columns `query` (or `anchor`), `positive` and optionally hard negatives: a
  `negative` column, numbered `negative_1` ... `negative_k` columns (sentence-transformers' mined layout), or a
  jsonl `negatives` list (what `python -m experiments.mine_negatives` writes);
* All-NLI format: columns `premise`, `hypothesis`, `label` (entailment / contradiction, or 0 / 2 as in SNLI);
  each premise becomes (premise, an entailed hypothesis, a contradicted hypothesis when there is one);
* STS format: the STS Benchmark release CSV (`sts-train.csv`: tab-separated genre, file, year, id, score,
  sentence1, sentence2, headerless) or any file with columns `sentence1`, `sentence2`, `score`; pairs with
  score >= `data.sts_min_score` are positives.
"""

from __future__ import annotations

import csv
import json
import logging
import random
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, NamedTuple, Optional

import lightning as L
import torch
from datasets import load_dataset
from torch.utils.data import DataLoader, Dataset, Sampler

from neobert.config.contrastive import CONTRASTIVE_DATASETS, ContrastiveDataConfig, ContrastiveSource
from neobert.errors import DataError
from neobert.hub import require_hub

log = logging.getLogger(__name__)


def prepend_instruction(instruction: str | None, text: str) -> str:
    """`instruction` + `text`, with a space between them unless the instruction already ends with whitespace
    (the released instructions mix both: "... Query: " and "Retrieve semantically similar text.")."""
    if not instruction:
        return text
    return instruction + text if instruction[-1].isspace() else f"{instruction} {text}"


# ----------------------------------------------------------------------------------------------- examples


@dataclass(frozen=True)
class ContrastiveExample:
    query: str
    positive: str
    negatives: tuple[str, ...] = ()  # hard negatives, most useful first (mined ones are in rank order)

    def __post_init__(self):
        if isinstance(self.negatives, str):  # would silently become one negative per character
            raise TypeError("ContrastiveExample.negatives is a tuple of texts, not one string")
        object.__setattr__(self, "negatives", tuple(self.negatives))

    @property
    def texts(self) -> tuple[str, ...]:
        return (self.query, self.positive, *self.negatives)


def read_sts_pairs(path: str | Path) -> list[tuple[str, str, float]]:
    """(sentence1, sentence2, score) from an STS Benchmark release CSV (headerless, tab-separated: genre, file,
    year, id, score, sentence1, sentence2[, sources]) or a CSV/TSV with columns sentence1, sentence2, score."""
    path = Path(path)
    lines = _read_text(path).splitlines()
    if not lines:
        raise DataError(f"{path} is empty")
    header = lines[0].split("\t" if "\t" in lines[0] else ",")
    if {"sentence1", "sentence2", "score"} <= set(header):
        pairs = [(r["sentence1"], r["sentence2"], float(r["score"])) for r in _read_table(path)]
        return _without_empty_sentences(pairs, path, first_line=2)
    pairs = []
    for number, line in enumerate(lines, 1):
        fields = line.split("\t")  # the release has stray quotes, so no csv quoting rules
        if len(fields) < 7:
            raise DataError(f"{path}:{number}: expected the STS Benchmark layout (7 tab-separated fields: "
                             f"genre, file, year, id, score, sentence1, sentence2), got {len(fields)} fields")
        try:
            score = float(fields[4])
        except ValueError as err:
            raise DataError(f"{path}:{number}: score {fields[4]!r} is not a number") from err
        pairs.append((fields[5], fields[6], score))
    return _without_empty_sentences(pairs, path, first_line=1)


def _without_empty_sentences(pairs: list, path: Path, first_line: int) -> list:
    """An STS pair with an empty sentence would be scored as if it held text: a DataError naming the line."""
    for number, (first, second, _) in enumerate(pairs, first_line):
        if not (first or "").strip() or not (second or "").strip():
            raise DataError(f"{path}:{number}: an empty sentence{'1' if not (first or '').strip() else '2'}")
    return pairs


def read_local_examples(path: str | Path, sts_min_score: float = 4.0) -> list[ContrastiveExample]:
    """Examples from a local file in any of the layouts of this module's docstring."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"contrastive data file {str(path)!r} does not exist")
    if path.suffix in (".csv", ".tsv") and not _has_header(path, ("query", "anchor", "premise")):
        return _examples_from_sts(read_sts_pairs(path), sts_min_score)
    rows = _read_jsonl(path) if path.suffix in (".jsonl", ".json") else _read_table(path)
    if not rows:
        raise DataError(f"{path} holds no examples")
    columns = set(rows[0])
    if {"premise", "hypothesis", "label"} <= columns:
        return _examples_from_nli(rows, path)
    if {"sentence1", "sentence2", "score"} <= columns:
        return _examples_from_sts([(r["sentence1"], r["sentence2"], float(r["score"])) for r in rows],
                                  sts_min_score)
    query = "query" if "query" in columns else "anchor"
    if query not in columns or "positive" not in columns:
        raise DataError(f"{path}: expected columns query (or anchor), positive[, negative], or the All-NLI "
                         f"(premise, hypothesis, label) or STS (sentence1, sentence2, score) layouts; "
                         f"got {sorted(columns)}")
    return [ContrastiveExample(_text(r, query, path, i), _text(r, "positive", path, i), _negatives(r, path, i))
            for i, r in enumerate(rows, 1)]


def _negatives(row: dict, path: Path, number: int) -> tuple[str, ...]:
    """The hard negatives of a row: a `negatives` list, a `negative` text, or `negative_1` ... `negative_k`."""
    if "negatives" in row:
        values = row["negatives"]
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise DataError(f"{path}: example {number}: 'negatives' must be a list of texts")
    else:
        numbered = sorted((k for k in row if k.startswith("negative_") and k[9:].isdigit()), key=lambda k: int(k[9:]))
        values = [row[k] for k in (["negative"] if "negative" in row else []) + numbered]
    return tuple(v for v in values if isinstance(v, str) and v.strip())


def load_hub_examples(name: str, source: ContrastiveSource, sts_min_score: float) -> list[ContrastiveExample]:
    require_hub(f"{name} ({source.hub})", f"data.local_files.{name}")
    table = load_dataset(source.hub, source.subset, split=source.split)
    if source.score is not None:
        return _examples_from_sts(zip(table[source.query], table[source.positive], table[source.score]),
                                  sts_min_score)
    negatives = table[source.negative] if source.negative else [None] * len(table)
    return [ContrastiveExample(q, p, (n,) if n else ()) for q, p, n in zip(table[source.query],
                                                                          table[source.positive], negatives) if q and p]


def _examples_from_sts(pairs, min_score: float) -> list[ContrastiveExample]:
    return [ContrastiveExample(a, b) for a, b, score in pairs if float(score) >= min_score]


_ENTAILMENT = {"entailment", "0"}
_CONTRADICTION = {"contradiction", "2"}


def _examples_from_nli(rows: list[dict], path: Path) -> list[ContrastiveExample]:
    entailed: dict[str, list[str]] = {}
    contradicted: dict[str, list[str]] = {}
    for row in rows:
        label = str(row["label"]).strip().lower()
        target = entailed if label in _ENTAILMENT else contradicted if label in _CONTRADICTION else None
        if target is not None:
            target.setdefault(row["premise"], []).append(row["hypothesis"])
    examples = []
    for premise, hypotheses in entailed.items():
        negatives = contradicted.get(premise, [])
        for i, hypothesis in enumerate(hypotheses):
            examples.append(ContrastiveExample(premise, hypothesis, (negatives[i % len(negatives)],) if negatives
                                               else ()))
    if not examples:
        raise DataError(f"{path}: no entailment pairs (label 'entailment' or 0) in this NLI file")
    return examples


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path} is not UTF-8 text: {err}") from err


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    for number, line in enumerate(_read_text(path).splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{number}: not a JSON object: {err}") from err
    return rows


def _read_table(path: Path) -> list[dict]:
    text = _read_text(path)
    delimiter = "\t" if path.suffix == ".tsv" or "\t" in text.split("\n", 1)[0] else ","
    return list(csv.DictReader(text.splitlines(), delimiter=delimiter, quoting=csv.QUOTE_MINIMAL))


def _has_header(path: Path, names) -> bool:
    first = _read_text(path).split("\n", 1)[0]
    return any(name in first.replace("\t", ",").split(",") for name in names)


def _text(row: dict, column: str, path: Path, number: int) -> str:
    value = row.get(column)
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{path}: example {number} has an empty or missing {column!r}")
    return value


# ----------------------------------------------------------------------------------------------- batching


@dataclass
class ContrastiveCorpus:
    """One data set's examples, instructions already applied."""

    name: str
    examples: list[ContrastiveExample]


def load_corpora(config: ContrastiveDataConfig) -> list[ContrastiveCorpus]:
    config.validate()  # also when built in Python rather than loaded from YAML
    corpora = []
    for name in config.datasets:
        source = CONTRASTIVE_DATASETS.get(name)
        if name in config.local_files:
            examples = read_local_examples(config.local_files[name], config.sts_min_score)
        elif source is None:
            raise DataError(f"unknown contrastive data set {name!r}: not in the registry "
                             f"({sorted(CONTRASTIVE_DATASETS)}) and no local file; set "
                             f"`data.local_files.{name}` to a local file")
        else:
            examples = load_hub_examples(name, source, config.sts_min_score)
        if config.max_examples_per_dataset:
            examples = examples[: config.max_examples_per_dataset]
        if not examples:
            raise DataError(f"contrastive data set {name!r} has no usable examples")
        query_instruction = config.instructions.get(name, source.query_instruction if source else "")
        document_instruction = query_instruction
        if source is not None and source.document_instruction is not None and name not in config.instructions:
            document_instruction = source.document_instruction
        kept_negatives = config.max_hard_negatives if config.use_hard_negatives else 0
        corpora.append(ContrastiveCorpus(name, [
            _with_instructions(e, query_instruction, document_instruction, kept_negatives) for e in examples]))
        log.info("contrastive data set %s: %d examples", name, len(examples))
    return corpora


def _with_instructions(example: ContrastiveExample, query_instruction: str, document_instruction: str,
                       max_negatives: Optional[int]) -> ContrastiveExample:
    """The example as the model sees it; a hard negative that repeats the example's own query or positive (or an
    earlier negative) is dropped, since it would be scored against itself."""
    query = prepend_instruction(query_instruction, example.query)
    positive = prepend_instruction(document_instruction, example.positive)
    negatives = dict.fromkeys(prepend_instruction(document_instruction, n) for n in example.negatives)
    negatives = [n for n in negatives if n not in (query, positive)]
    return ContrastiveExample(query, positive, tuple(negatives[:max_negatives]))


class BatchItem(NamedTuple):
    """One example of a batch, as the sampler names it."""

    dataset: int
    example: int
    negatives: int  # how many of its hard negatives this batch uses (the same for every example of the batch)


class ContrastiveBatchSampler(Sampler[list[BatchItem]]):
    """Yields this rank's share of global batches, each from ONE data set, data sets drawn with probability
    proportional to size**alpha. Every rank draws the same data set sequence (same seed) and takes its own
    slice of the same global batch, so the batch gathered across devices is one duplicate-free batch.

    With `no_duplicates`, a global batch never holds the same text twice, whether query, positive or hard negative
    (a repeated positive is a false negative for InfoNCE); an example that would repeat one is deferred to a later
    batch. A batch uses as many hard negatives per example as its poorest example has, so every rank contributes
    the same number of candidates.

    The batches are one deterministic stream from (corpora, seed): epochs only cut it into `steps_per_epoch`
    pieces. `state_dict` is how many global batches were drawn; `restart(n)` replays the first n (no text is
    touched), so a resumed run continues with the very batches an uninterrupted one would see."""

    def __init__(self, corpora: list[ContrastiveCorpus], batch_size: int, alpha: float, seed: int = 0,
                 rank: int = 0, world_size: int = 1, steps_per_epoch: Optional[int] = None,
                 no_duplicates: bool = True):
        self.corpora, self.batch_size, self.rank, self.world_size = corpora, batch_size, rank, world_size
        self.global_batch = batch_size * world_size
        too_small = [c.name for c in corpora if len(c.examples) < self.global_batch]
        if too_small:
            raise DataError(f"data sets {too_small} have fewer examples than one global batch "
                             f"({batch_size} x {world_size} devices); lower data.batch_size")
        sizes = torch.tensor([len(c.examples) for c in corpora], dtype=torch.float64)
        self.probabilities = (sizes ** alpha / (sizes ** alpha).sum()).tolist()
        self.steps_per_epoch = steps_per_epoch or int(sum(len(c.examples) for c in corpora) // self.global_batch)
        self.seed, self.no_duplicates = seed, no_duplicates
        self.restart(0)

    def restart(self, batches_drawn: int) -> None:
        """Positions the stream just after its first `batches_drawn` global batches."""
        self._dataset_rng = random.Random(self.seed)
        # Per data set: the queue of example indices still to serve in this pass over it, and the passes so far.
        self._queues: list[deque[int]] = [deque() for _ in self.corpora]
        self._passes = [0] * len(self.corpora)
        self.batches_drawn = 0
        for _ in range(batches_drawn):
            self._draw()

    def state_dict(self) -> dict:
        return {"batches_drawn": self.batches_drawn}

    def load_state_dict(self, state: dict) -> None:
        self.restart(state["batches_drawn"])

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[list[BatchItem]]:
        for _ in range(self.steps_per_epoch):
            yield self._draw()

    def _draw(self) -> list[BatchItem]:
        dataset = self._dataset_rng.choices(range(len(self.corpora)), weights=self.probabilities)[0]
        batch = self._next_global_batch(dataset)
        examples = self.corpora[dataset].examples
        negatives = min(len(examples[index].negatives) for index in batch)
        self.batches_drawn += 1
        mine = batch[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
        return [BatchItem(dataset, index, negatives) for index in mine]

    def _next_global_batch(self, dataset: int) -> list[int]:
        examples = self.corpora[dataset].examples
        queue = self._queues[dataset]
        batch, seen, deferred = [], set(), []
        while len(batch) < self.global_batch:
            if not queue:
                queue.extend(self._shuffled(dataset))
            index = queue.popleft()
            texts = examples[index].texts
            if self.no_duplicates and not seen.isdisjoint(texts):
                deferred.append(index)
                if len(deferred) > len(examples):
                    raise DataError(f"data set {self.corpora[dataset].name!r} cannot fill a batch of "
                                     f"{self.global_batch} without repeating a text; lower data.batch_size")
                continue
            seen.update(texts)
            batch.append(index)
        queue.extendleft(reversed(deferred))  # served first next time
        return batch

    def _shuffled(self, dataset: int) -> list[int]:
        order = list(range(len(self.corpora[dataset].examples)))
        random.Random(self.seed * 7919 + dataset * 104_729 + self._passes[dataset]).shuffle(order)
        self._passes[dataset] += 1
        return order


class _CorporaDataset(Dataset):
    def __init__(self, corpora: list[ContrastiveCorpus]):
        self.corpora = corpora

    def __getitem__(self, item: BatchItem) -> ContrastiveExample:
        example = self.corpora[item.dataset].examples[item.example]
        return ContrastiveExample(example.query, example.positive, example.negatives[:item.negatives])

    def __len__(self) -> int:
        return sum(len(c.examples) for c in self.corpora)


class ContrastiveCollator:
    """Tokenizes queries, positives and hard negatives (k per example, example-major: [B x k] texts)."""

    def __init__(self, tokenizer, max_length: int):
        self.tokenizer, self.max_length = tokenizer, max_length

    def _tokenize(self, texts: list[str]) -> dict[str, torch.Tensor]:
        encoded = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length,
                                 return_tensors="pt", return_token_type_ids=False)
        return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}

    def __call__(self, examples: list[ContrastiveExample]) -> dict[str, dict[str, torch.Tensor]]:
        batch = {"query": self._tokenize([e.query for e in examples]),
                 "positive": self._tokenize([e.positive for e in examples])}
        if len({len(e.negatives) for e in examples}) != 1:
            raise DataError("the examples of a batch have different numbers of hard negatives")
        if examples[0].negatives:
            batch["negative"] = self._tokenize([n for e in examples for n in e.negatives])
        return batch


class ContrastiveDataModule(L.LightningDataModule):
    """The contrastive batches; its `state_dict` (in every Lightning checkpoint) is how many batches were trained,
    which the LightningModule reports with `record_trained_batch`, so prefetched batches never count."""

    def __init__(self, config: ContrastiveDataConfig, tokenizer):
        super().__init__()
        self.config, self.tokenizer = config, tokenizer
        self.corpora: list[ContrastiveCorpus] | None = None
        self.trained_batches = 0

    def setup(self, stage: str | None = None) -> None:
        if self.corpora is None:
            self.corpora = load_corpora(self.config)

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        sampler = ContrastiveBatchSampler(self.corpora, self.config.batch_size, self.config.alpha,
                                          self.config.seed, rank, world, no_duplicates=self.config.no_duplicates)
        sampler.restart(self.trained_batches)
        return DataLoader(_CorporaDataset(self.corpora), batch_sampler=sampler,
                          collate_fn=ContrastiveCollator(self.tokenizer, self.config.max_length),
                          num_workers=self.config.num_workers)

    def record_trained_batch(self) -> None:
        self.trained_batches += 1

    def state_dict(self) -> dict:
        return {"trained_batches": self.trained_batches}

    def load_state_dict(self, state: dict) -> None:
        self.trained_batches = state["trained_batches"]
