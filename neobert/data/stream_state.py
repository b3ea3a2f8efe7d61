"""A pretraining stream's state: what it resumes from (`StreamState`), how a batch carries it (`EncodedStreamState`),
and how a phase boundary carries it (`carried_state`).

Every random choice a stream makes (a block's shuffle, a batch's masking, a source or length-bucket draw) is seeded
by `derived_seed` from the data seed, the stream and a counter of this state, so the state is all a resume needs
(the stream itself: `neobert.data.pretraining`).
"""

from __future__ import annotations

import copy
import pickle
from dataclasses import dataclass, field, fields

DATA_STATE_KEY = "data_state"


def derived_seed(*parts: int) -> int:
    """A 63-bit seed from integers (stable across processes, unlike hash())."""
    seed = 0
    for part in parts:
        seed = (seed * 1_000_003 + int(part) + 1) % (2**63)
    return seed


@dataclass
class SourcePosition:
    """Where a stream is in one source: a restart reads the source from `source` (its `datasets` state at the start
    of the current block), shuffles the block as before (seeded by epoch and block) and skips its `taken` documents.
    """

    epoch: int = 0  # the source's epochs finished
    source: dict | None = None  # the source's own `state_dict` at the start of the current block (None: its start)
    block: int = 0  # the current block of data.shuffle_buffer documents, in this epoch
    taken: int = 0  # documents of the current block used
    skipped: dict[str, int] = field(default_factory=dict)  # documents skipped, per reason (empty, undecodable, ...)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class MixtureState:
    """Where a stream is in a mixture (data.sources): draws made, retired sources, tokens and documents drawn per
    source in this phase, and the position in each source."""

    draws: int = 0  # source draws made (each seeds its own generator)
    retired: list[int] = field(default_factory=list)  # the sources past their max_epochs, in retiring order
    tokens: list[int] = field(default_factory=list)  # per source, in this phase
    documents: list[int] = field(default_factory=list)  # per source, in this phase
    sources: list[SourcePosition] = field(default_factory=list)
    # From the second phase on (carried_state): per source, the tokens drawn in the phases before; saved only then.
    tokens_before: list[int] | None = None

    @classmethod
    def fresh(cls, sources: int) -> MixtureState:
        return cls(tokens=[0] * sources, documents=[0] * sources, sources=[SourcePosition() for _ in range(sources)])

    def to_dict(self) -> dict:
        mixture = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "tokens_before"}
        mixture["sources"] = [position.to_dict() for position in self.sources]
        if self.tokens_before is not None:
            mixture["tokens_before"] = self.tokens_before
        return mixture

    @classmethod
    def from_dict(cls, mixture: dict) -> MixtureState:
        return cls(**{**mixture, "sources": [SourcePosition(**position) for position in mixture["sources"]]})


@dataclass
class StreamState:
    """What a stream resumes from: its position in its source (or in each source of a mixture), the batches it has
    made, the length-bucket draws and queues, and the batch builder's carry-over (documents or packed rows not yet
    in a batch). Every random choice of the stream is seeded by one of these counters (`derived_seed`), so nothing
    else is needed to go on exactly where it stopped.

    Saved for each stream in every checkpoint (`PretrainingDataModule.state_dict`) as one plain dict, the position's
    fields flattened into it: `to_dict` / `from_dict`, the format of every checkpoint so far (`arrivals` only from
    the first bucket draw on, a mixture's `tokens_before` only from its second phase on).
    """

    position: SourcePosition = field(default_factory=SourcePosition)  # a single source's (with a mixture: unread)
    batches: int = 0  # batches made (each seeds its masking; with the stream's rank and worker, its optimizer step)
    draws: int = 0  # length-bucket draws made (data.length_buckets; each seeds its own generator)
    queues: list[list[list]] | None = None  # per bucket: [arrival number, token ids] of each waiting document
    builder: dict | None = None  # `BatchBuilder.state()`: truncated documents or the packer's rows, not yet batched
    mixture: MixtureState | None = None  # data.sources
    arrivals: int | None = None  # documents queued in buckets so far (None until the first bucket draw)

    @property
    def epoch(self) -> int:
        """The epoch the stream is in: its source's, or with a mixture the least of its drawn sources' (each has been
        read through that many times; a retired source's epoch no longer moves, and the stream's own position is
        unread there)."""
        if self.mixture is None:
            return self.position.epoch
        mixture = self.mixture
        return min(source.epoch for i, source in enumerate(mixture.sources) if i not in mixture.retired)

    def to_dict(self) -> dict:
        """The plain state a checkpoint saves."""
        state = {**self.position.to_dict(), "batches": self.batches, "draws": self.draws, "queues": self.queues,
                 "builder": self.builder, "mixture": None if self.mixture is None else self.mixture.to_dict()}
        if self.arrivals is not None:
            state["arrivals"] = self.arrivals
        return state

    @classmethod
    def from_dict(cls, state: dict) -> StreamState:
        """The state saved as `state` (a checkpoint's, or `batch_stream_state`'s); its objects are used, not copied."""
        state = dict(state)
        position = SourcePosition(**{f.name: state.pop(f.name) for f in fields(SourcePosition)})
        mixture = state.pop("mixture")
        return cls(position, mixture=None if mixture is None else MixtureState.from_dict(mixture), **state)


class EncodedStreamState:
    """A stream's state after one of its batches, as the batch carries it (`batch[DATA_STATE_KEY]["state"]`): the
    whole state pickled once (as its plain dict), in the DataLoader worker, and beside it the few numbers read at
    every batch (the position, for error messages; a mixture's documents and tokens drawn per source, for
    train/share/<source>).

    With packing the state holds the packer's open rows, token id by token id (~10^5 Python objects with best fit
    at 32 x 1,024): as plain lists they were walked at every batch by Lightning's transfer to the device
    (`apply_to_collection`), the DataLoader's `default_convert` and `pin_memory`, and unpickled object by object
    from the worker: 60-90 ms of host time per batch in Lightning's transfer alone (2-core EPYC). This object is a
    leaf to all of them (neither a mapping, a sequence nor a dataclass; `bytes` would not do: it is a sequence,
    walked byte by byte).
    """

    def __init__(self, state: StreamState):
        self.pickled = pickle.dumps(state.to_dict(), protocol=pickle.HIGHEST_PROTOCOL)
        self.batches = state.batches
        self.epoch, self.block, self.taken = state.position.epoch, state.position.block, state.position.taken
        mixture = state.mixture or MixtureState()
        # per source; tokens_before: the tokens drawn in the phases before (carried_state)
        self.drawn = {"documents": list(mixture.documents), "tokens": list(mixture.tokens),
                      "tokens_before": list(mixture.tokens_before or ())}

    def decode(self) -> dict:
        """The plain state (a new copy at every call)."""
        return pickle.loads(self.pickled)


def batch_stream_state(batch: dict) -> dict:
    """The plain state of the stream after `batch` (a `PretrainingStream` batch), as a checkpoint saves it and
    `PretrainingStream(start_states=...)` restarts from it."""
    return batch[DATA_STATE_KEY]["state"].decode()


def source_identity(data) -> tuple:
    """What makes two phases' sources the same data: where it is read from."""
    return (data.source, data.hub_config, data.split, data.text_column, data.text_sample_by)


def carried_state(state: StreamState, saved: list[tuple], now: list[tuple]) -> StreamState:
    """A stream's state for a new phase: the position in every source the phases share, by identity; a new stream
    otherwise (no pending documents, batches counted from 0, new sources from their start, and the documents and
    tokens drawn counted from 0: train/share/<source> is the phase's own, against the phase's own targets). The
    tokens drawn from each shared source so far are kept beside, in `tokens_before`: train/tokens/<source> counts
    on across phases."""
    mixture = state.mixture
    positions = ({saved[0]: state.position} if len(saved) == 1 and mixture is None
                 else dict(zip(saved, mixture.sources if mixture else [])))
    fresh = StreamState()
    if len(now) == 1:
        fresh.position = copy.deepcopy(positions.get(now[0], SourcePosition()))
        return fresh
    mix = MixtureState.fresh(len(now))
    mix.draws = mixture.draws if mixture else 0  # the source draws go on, never repeating a phase's
    for i, identity in enumerate(now):
        if identity in positions:
            mix.sources[i] = copy.deepcopy(positions[identity])
    mixture = mixture or MixtureState()
    earlier = mixture.tokens_before or [0] * len(saved)
    drawn = {identity: before + tokens for identity, before, tokens in zip(saved, earlier, mixture.tokens)}
    mix.tokens_before = [drawn.get(identity, 0) for identity in now]
    fresh.mixture = mix
    return fresh
