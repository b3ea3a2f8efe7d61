"""Data mixtures (`data.sources`): which sources a run draws documents from, and with what probability.

Each source is read exactly as a single `data.source` is (`SourceData`: the run's data settings with that source's
fields), so it streams, shuffles in blocks, shards over ranks and workers and resumes the same way; the stream
(`neobert.data.pretraining.PretrainingStream.mixed`) draws the source of every document with its own seeded
generator. The probability of source i is proportional to weight_i, times size_i^tau when
`data.mixture_temperature` (tau) is > 0 (mmBERT's temperature sampling: tau < 1 flattens the sizes towards
uniform). A size is the source's `size` when set, else the bytes of its local files, measured here.

Why not a library mixer (see docs/pretraining.md, "Data mixtures"): `datasets.interleave_datasets` fixes the
probabilities for the whole stream (no per-source epochs, no retiring a source and renormalising) and mixes raw
examples before our per-source held-out split and block shuffle; litdata's `CombinedStreamingDataset` and
MosaicML `streaming` need every source converted to their shard formats first.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from neobert.config import ConfigError
from neobert.config.pretrain import PretrainDataConfig, SourceData
from neobert.data.corpus import local_data_files

log = logging.getLogger(__name__)


@dataclass
class MixtureSource:
    name: str
    probability: float  # of drawing this source, among all (renormalised over the sources still active)
    max_epochs: int  # 0 = endless
    data: PretrainDataConfig  # what the single-source code reads: the run's settings with this source's fields


def mixture_sources(data: PretrainDataConfig) -> list[MixtureSource]:
    """The run's sources: `data.sources`, or `data.source` as a mixture of one (named after nothing: no
    per-source metrics then)."""
    if not data.sources:
        return [MixtureSource("", 1.0, 0, data)]
    shared = {f.name: getattr(data, f.name) for f in dataclasses.fields(PretrainDataConfig)}
    views = []
    for i, source in enumerate(data.sources):
        fields = {**shared, "source": source.source, "hub_config": source.hub_config, "split": source.split,
                  "text_column": source.text_column, "text_sample_by": source.text_sample_by, "sources": []}
        views.append(SourceData(**fields, key=f"data.sources[{i}].source"))
    weights = [data.source_weights.get(s.name, s.weight) for s in data.sources]
    if data.mixture_temperature > 0:
        sizes = [source_size(source, i) for i, source in enumerate(data.sources)]
        weights = temperature_weights(weights, sizes, data.mixture_temperature)
        log.info("mixture: temperature %g over sizes %s -> probabilities %s", data.mixture_temperature,
                 dict(zip((s.name for s in data.sources), sizes)),
                 {s.name: round(w / sum(weights), 4) for s, w in zip(data.sources, weights)})
    total = sum(weights)
    return [MixtureSource(s.name, w / total, s.max_epochs, view) for s, w, view in zip(data.sources, weights, views)]


def temperature_weights(weights: list[float], sizes: list[float], tau: float) -> list[float]:
    """weight_i x size_i^tau, scaled by one factor so the largest is 1: computed as logarithms, since size^tau
    is past a float for large tau (1,000 bytes^110 > 1e308; the product used to be an OverflowError). The
    probabilities are the same: only the ratios count. A weight or size of 0 stays 0."""
    logs = [math.log(w) + tau * math.log(size) if w > 0 and size > 0 else -math.inf
            for w, size in zip(weights, sizes)]
    top = max(logs)
    return [math.exp(value - top) if top > -math.inf else 0.0 for value in logs]


def source_size(source, index: int) -> float:
    """`size` when set, else the bytes of the source's local files."""
    if source.size:
        return float(source.size)
    files = local_data_files(source.source, f"data.sources[{index}].source")
    if files is None:
        raise ConfigError(f"invalid config key 'data.sources[{index}].size': {source.source!r} is not local, so "
                          f"its size cannot be measured for data.mixture_temperature: set it (tokens, documents "
                          f"or bytes, the same unit for every source)")
    return float(sum(Path(f).stat().st_size for f in files))


def active_probabilities(sources: list[MixtureSource], retired: list[int]) -> dict[int, float]:
    """The sources still drawn and their probabilities, renormalised over them."""
    active = {i: s.probability for i, s in enumerate(sources) if i not in retired and s.probability > 0}
    total = sum(active.values())
    return {i: p / total for i, p in active.items()}
