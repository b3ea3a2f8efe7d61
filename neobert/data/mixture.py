"""Data mixtures: which sources a run draws documents from (`data.sources`) and with what probability, the draws
themselves, and the stage-2 mixture of length buckets (`data.length_buckets`, `bucketed_documents`).

Each source is read exactly as a single `data.source` is (`SourceData`: the run's data settings with that source's
fields), so it streams, shuffles in blocks, shards over ranks and workers and resumes the same way; the stream
(`neobert.data.pretraining.PretrainingStream.mixed`) hands each source's documents to `mixed_documents`, which draws
the source of every document with its own seeded generator. The probability of source i is proportional to
weight_i, times size_i^tau when `data.mixture_temperature` (tau) is > 0 (mmBERT's temperature sampling: tau < 1
flattens the sizes towards uniform). A size is the source's `size` when set, else the bytes of its local files,
measured here.

Why not a library mixer (see docs/pretraining.md, "Data mixtures"): `datasets.interleave_datasets` fixes the
probabilities for the whole stream (no per-source epochs, no retiring a source and renormalising) and mixes raw
examples before our per-source held-out split and block shuffle; litdata's `CombinedStreamingDataset` and
MosaicML `streaming` need every source converted to their shard formats first.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from neobert.config import ConfigError
from neobert.config.pretrain import PretrainDataConfig, SourceData
from neobert.data.corpus import local_data_files, source_name
from neobert.data.stream_state import MixtureState, StreamState, derived_seed
from neobert.errors import DataError

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


def mixed_documents(documents: list[Iterator[list[int]]], mix: MixtureState, sources: list[MixtureSource],
                    data: PretrainDataConfig, stream: int) -> Iterator[list[int]]:
    """Documents of the mixture: each draw picks a source with this stream's generator for that draw (seeded
    by the draw's number, so a resumed stream draws the same), then takes that source's next document. A
    source that reaches its max_epochs is retired and the others' probabilities renormalised (logged).
    `documents`: this stream's documents of each source; `mix`: the stream state's (`StreamState.mixture`)."""
    cap = data.max_length if data.packing == "none" else None  # tokens a document trains on
    while True:
        active = active_probabilities(sources, mix.retired)
        if not active:
            raise DataError(f"every source of data.sources has reached its max_epochs (stream {stream}): raise "
                            f"a max_epochs, or trainer.max_steps is beyond the mixture")
        rng = random.Random(derived_seed(data.seed, stream, mix.draws, 17))
        index = rng.choices(list(active), weights=list(active.values()))[0]
        epoch = mix.sources[index].epoch
        ids = next(documents[index], None)
        if ids is None:  # retired: drawn again, from the rest, with the same draw's generator
            mix.retired.append(index)
            log.info("data: source %r finished its max_epochs=%d (stream %d): retired; the others' shares are "
                     "now %s", sources[index].name, sources[index].max_epochs, stream,
                     {sources[i].name: round(p, 4)
                      for i, p in active_probabilities(sources, mix.retired).items()})
            continue
        if mix.sources[index].epoch != epoch:
            log.info("data: source %r starts its epoch %d (stream %d)", sources[index].name,
                     mix.sources[index].epoch, stream)
        mix.draws += 1
        mix.tokens[index] += min(len(ids), cap) if cap else len(ids)
        mix.documents[index] += 1
        yield ids


def bucketed_documents(documents: Iterator[list[int]], state: StreamState, data: PretrainDataConfig, stream: int,
                       num_streams: int) -> Iterator[list[int]]:
    """The stage-2 length-bucket mixture: draw bucket b with probability bucket_probabilities[b], then emit the
    next document (in stream order) that is >= length_buckets[b] tokens long. Documents wait in the queue of the
    longest bucket they qualify for; one arriving at a full queue is dropped (counted in `skipped`)."""
    thresholds, probabilities = list(data.length_buckets), list(data.bucket_probabilities)
    if state.queues is None:
        state.queues, state.arrivals = [[] for _ in thresholds], 0
    queues = state.queues  # per bucket: [arrival number, token ids]
    too_short_since = None  # the epoch since which every document has been shorter than every bucket
    while True:
        rng = random.Random(derived_seed(data.seed, stream, state.draws, 7))
        wanted = rng.choices(range(len(thresholds)), weights=probabilities)[0]
        while not any(queues[wanted:]):
            ids = next(documents)
            home = max((b for b, t in enumerate(thresholds) if len(ids) >= t), default=None)
            if home is None:
                too_short_since = state.epoch if too_short_since is None else too_short_since
                if state.epoch >= too_short_since + 2:  # a whole epoch without a document to draw
                    corpus = "data.sources" if state.mixture is not None else source_name(data)
                    raise DataError(f"{corpus} has no document of at least data.length_buckets[0]="
                                    f"{thresholds[0]} tokens (stream {stream} of {num_streams}): lower "
                                    f"data.length_buckets")
            else:
                too_short_since = None
            if home is None or len(queues[home]) >= data.bucket_queue_docs:
                state.position.skipped["bucket_overflow"] = state.position.skipped.get("bucket_overflow", 0) + 1
                continue
            queues[home].append([state.arrivals, ids])
            state.arrivals += 1
        source = min((b for b in range(wanted, len(thresholds)) if queues[b]), key=lambda b: queues[b][0][0])
        state.draws += 1
        yield queues[source].pop(0)[1]
