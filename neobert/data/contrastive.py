"""Contrastive training data (paper Section 5.2): (query, positive[, hard negative]) examples from the
paper's training sets, each prefixed with its data set's instruction, one data set per batch, data sets drawn in
proportion to size**alpha, and no repeated text inside a batch (a repeat would be a false in-batch negative).

Every data set is a hub data set by default (`CONTRASTIVE_DATASETS`, in `neobert.config.contrastive`) and can be
replaced by a local file with `data.local_files.<name>=<path>`; a name that is not in the registry is a local-only
data set. Local files:
* `.jsonl` / `.csv` / `.tsv` with columns `query` (or `anchor`), `positive` and optionally `negative`;
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
from typing import Iterator, Optional

import lightning as L
import torch
from datasets import load_dataset
from torch.utils.data import DataLoader, Dataset, Sampler

from neobert.config.contrastive import CONTRASTIVE_DATASETS, ContrastiveDataConfig, ContrastiveSource
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
    negative: Optional[str] = None


def read_sts_pairs(path: str | Path) -> list[tuple[str, str, float]]:
    """(sentence1, sentence2, score) from an STS Benchmark release CSV (headerless, tab-separated: genre, file,
    year, id, score, sentence1, sentence2[, sources]) or a CSV/TSV with columns sentence1, sentence2, score."""
    path = Path(path)
    lines = _read_text(path).splitlines()
    if not lines:
        raise ValueError(f"{path} is empty")
    header = lines[0].split("\t" if "\t" in lines[0] else ",")
    if {"sentence1", "sentence2", "score"} <= set(header):
        return [(r["sentence1"], r["sentence2"], float(r["score"])) for r in _read_table(path)]
    pairs = []
    for number, line in enumerate(lines, 1):
        fields = line.split("\t")  # the release has stray quotes, so no csv quoting rules
        if len(fields) < 7:
            raise ValueError(f"{path}:{number}: expected the STS Benchmark layout (7 tab-separated fields: "
                             f"genre, file, year, id, score, sentence1, sentence2), got {len(fields)} fields")
        try:
            score = float(fields[4])
        except ValueError as err:
            raise ValueError(f"{path}:{number}: score {fields[4]!r} is not a number") from err
        pairs.append((fields[5], fields[6], score))
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
        raise ValueError(f"{path} holds no examples")
    columns = set(rows[0])
    if {"premise", "hypothesis", "label"} <= columns:
        return _examples_from_nli(rows, path)
    if {"sentence1", "sentence2", "score"} <= columns:
        return _examples_from_sts([(r["sentence1"], r["sentence2"], float(r["score"])) for r in rows],
                                  sts_min_score)
    query = "query" if "query" in columns else "anchor"
    if query not in columns or "positive" not in columns:
        raise ValueError(f"{path}: expected columns query (or anchor), positive[, negative], or the All-NLI "
                         f"(premise, hypothesis, label) or STS (sentence1, sentence2, score) layouts; "
                         f"got {sorted(columns)}")
    return [ContrastiveExample(_text(r, query, path, i), _text(r, "positive", path, i),
                               r.get("negative") or None) for i, r in enumerate(rows, 1)]


def load_hub_examples(name: str, source: ContrastiveSource, sts_min_score: float) -> list[ContrastiveExample]:
    require_hub(f"{name} ({source.hub})", f"data.local_files.{name}")
    table = load_dataset(source.hub, source.subset, split=source.split)
    if source.score is not None:
        return _examples_from_sts(zip(table[source.query], table[source.positive], table[source.score]),
                                  sts_min_score)
    negatives = table[source.negative] if source.negative else [None] * len(table)
    return [ContrastiveExample(q, p, n or None) for q, p, n in zip(table[source.query], table[source.positive],
                                                                   negatives) if q and p]


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
            examples.append(ContrastiveExample(premise, hypothesis, negatives[i % len(negatives)] if negatives
                                               else None))
    if not examples:
        raise ValueError(f"{path}: no entailment pairs (label 'entailment' or 0) in this NLI file")
    return examples


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text: {err}") from err


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    for number, line in enumerate(_read_text(path).splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not a JSON object: {err}") from err
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
        raise ValueError(f"{path}: example {number} has an empty or missing {column!r}")
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
            raise ValueError(f"unknown contrastive data set {name!r}: not in the registry "
                             f"({sorted(CONTRASTIVE_DATASETS)}) and no local file; set "
                             f"`data.local_files.{name}` to a local file")
        else:
            examples = load_hub_examples(name, source, config.sts_min_score)
        if config.max_examples_per_dataset:
            examples = examples[: config.max_examples_per_dataset]
        if not examples:
            raise ValueError(f"contrastive data set {name!r} has no usable examples")
        query_instruction = config.instructions.get(name, source.query_instruction if source else "")
        document_instruction = query_instruction
        if source is not None and source.document_instruction is not None and name not in config.instructions:
            document_instruction = source.document_instruction
        corpora.append(ContrastiveCorpus(name, [
            ContrastiveExample(prepend_instruction(query_instruction, e.query),
                               prepend_instruction(document_instruction, e.positive),
                               prepend_instruction(document_instruction, e.negative)
                               if e.negative and config.use_hard_negatives else None)
            for e in examples]))
        log.info("contrastive data set %s: %d examples", name, len(examples))
    return corpora


class ContrastiveBatchSampler(Sampler[list[tuple[int, int]]]):
    """Yields this rank's share of global batches, each from ONE data set, data sets drawn with probability
    proportional to size**alpha. Every rank draws the same data set sequence (same seed) and takes its own
    slice of the same global batch, so the batch gathered across devices is one duplicate-free batch.

    A global batch never holds the same query or document text twice (it would be a false negative for
    InfoNCE); an example that would repeat one is deferred to a later batch. Items are (dataset, example)."""

    def __init__(self, corpora: list[ContrastiveCorpus], batch_size: int, alpha: float, seed: int = 0,
                 rank: int = 0, world_size: int = 1, steps_per_epoch: Optional[int] = None):
        self.corpora, self.batch_size, self.rank, self.world_size = corpora, batch_size, rank, world_size
        self.global_batch = batch_size * world_size
        too_small = [c.name for c in corpora if len(c.examples) < self.global_batch]
        if too_small:
            raise ValueError(f"data sets {too_small} have fewer examples than one global batch "
                             f"({batch_size} x {world_size} devices); lower data.batch_size")
        sizes = torch.tensor([len(c.examples) for c in corpora], dtype=torch.float64)
        self.probabilities = (sizes ** alpha / (sizes ** alpha).sum()).tolist()
        self.steps_per_epoch = steps_per_epoch or int(sum(len(c.examples) for c in corpora) // self.global_batch)
        self.seed, self.epoch = seed, 0
        # Per data set: the queue of example indices still to serve this pass, persisted across epochs.
        self._queues: list[deque[int]] = [deque() for _ in corpora]
        self._passes = [0] * len(corpora)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        rng = random.Random(self.seed * 1_000_003 + self.epoch)
        for _ in range(self.steps_per_epoch):
            dataset = rng.choices(range(len(self.corpora)), weights=self.probabilities)[0]
            batch = self._next_global_batch(dataset)
            mine = batch[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
            yield [(dataset, index) for index in mine]

    def _next_global_batch(self, dataset: int) -> list[int]:
        examples = self.corpora[dataset].examples
        queue = self._queues[dataset]
        batch, seen, deferred = [], set(), []
        while len(batch) < self.global_batch:
            if not queue:
                queue.extend(self._shuffled(dataset))
            index = queue.popleft()
            example = examples[index]
            texts = {example.query, example.positive} | ({example.negative} if example.negative else set())
            if texts & seen:
                deferred.append(index)
                if len(deferred) > len(examples):
                    raise ValueError(f"data set {self.corpora[dataset].name!r} cannot fill a batch of "
                                     f"{self.global_batch} without repeating a text; lower data.batch_size")
                continue
            seen |= texts
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

    def __getitem__(self, item: tuple[int, int]) -> ContrastiveExample:
        dataset, index = item
        return self.corpora[dataset].examples[index]

    def __len__(self) -> int:
        return sum(len(c.examples) for c in self.corpora)


class ContrastiveCollator:
    """Tokenizes queries, positives and (when every example of the batch has one) hard negatives."""

    def __init__(self, tokenizer, max_length: int):
        self.tokenizer, self.max_length = tokenizer, max_length

    def _tokenize(self, texts: list[str]) -> dict[str, torch.Tensor]:
        encoded = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length,
                                 return_tensors="pt", return_token_type_ids=False)
        return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}

    def __call__(self, examples: list[ContrastiveExample]) -> dict[str, dict[str, torch.Tensor]]:
        batch = {"query": self._tokenize([e.query for e in examples]),
                 "positive": self._tokenize([e.positive for e in examples])}
        # A data set either has hard negatives for every example or not at all; a partial set (e.g. an NLI
        # premise with no contradiction) trains on in-batch negatives only, so shapes agree across devices.
        if all(e.negative for e in examples):
            batch["negative"] = self._tokenize([e.negative for e in examples])
        return batch


class ContrastiveDataModule(L.LightningDataModule):
    def __init__(self, config: ContrastiveDataConfig, tokenizer):
        super().__init__()
        self.config, self.tokenizer = config, tokenizer
        self.corpora: list[ContrastiveCorpus] | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.corpora is None:
            self.corpora = load_corpora(self.config)

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        sampler = ContrastiveBatchSampler(self.corpora, self.config.batch_size, self.config.alpha,
                                          self.config.seed, rank, world)
        return DataLoader(_CorporaDataset(self.corpora), batch_sampler=sampler,
                          collate_fn=ContrastiveCollator(self.tokenizer, self.config.max_length),
                          num_workers=self.config.num_workers)
