"""A pretraining stream's state: what it resumes from, how a batch carries it, and how a phase boundary carries it.

Every random choice a stream makes (a block's shuffle, a batch's masking, a source or length-bucket draw) is seeded
by `derived_seed` from the data seed, the stream and a counter of this state, so the state is all a resume needs
(the stream itself: `neobert.data.pretraining`).
"""

from __future__ import annotations

import copy
import pickle

DATA_STATE_KEY = "data_state"


def derived_seed(*parts: int) -> int:
    """A 63-bit seed from integers (stable across processes, unlike hash())."""
    seed = 0
    for part in parts:
        seed = (seed * 1_000_003 + int(part) + 1) % (2**63)
    return seed


class EncodedStreamState:
    """A stream's state after one of its batches, as the batch carries it (`batch[DATA_STATE_KEY]["state"]`): the
    whole state pickled once, in the DataLoader worker, and beside it the few numbers read at every batch (the
    position, for error messages; a mixture's documents and tokens drawn per source, for train/share/<source>).

    With packing the state holds the packer's open rows, token id by token id (~10^5 Python objects with best fit
    at 32 x 1,024): as plain lists they were walked at every batch by Lightning's transfer to the device
    (`apply_to_collection`), the DataLoader's `default_convert` and `pin_memory`, and unpickled object by object
    from the worker: 60-90 ms of host time per batch in Lightning's transfer alone (2-core EPYC). This object is a
    leaf to all of them (neither a mapping, a sequence nor a dataclass; `bytes` would not do: it is a sequence,
    walked byte by byte).
    """

    def __init__(self, state: dict):
        self.pickled = pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
        self.batches, self.epoch, self.block, self.taken = (state[k] for k in ("batches", "epoch", "block", "taken"))
        mixture = state.get("mixture") or {}
        # per source; TOKENS_BEFORE: the tokens drawn in the phases before (carried_state)
        self.drawn = {key: list(mixture.get(key, ())) for key in ("documents", "tokens", TOKENS_BEFORE)}

    def decode(self) -> dict:
        """The plain state (a new copy at every call)."""
        return pickle.loads(self.pickled)


def batch_stream_state(batch: dict) -> dict:
    """The plain state of the stream after `batch` (a `PretrainingStream` batch), as a checkpoint saves it and
    `PretrainingStream(start_states=...)` restarts from it."""
    return batch[DATA_STATE_KEY]["state"].decode()


def fresh_stream_state() -> dict:
    return {**fresh_source_state(), "batches": 0, "draws": 0, "queues": None, "builder": None, "mixture": None}


def source_identity(data) -> tuple:
    """What makes two phases' sources the same data: where it is read from."""
    return (data.source, data.hub_config, data.split, data.text_column, data.text_sample_by)


SOURCE_POSITION_KEYS = ("epoch", "source", "block", "taken", "skipped")
# In a mixture's state from the second phase on: per source, the tokens drawn from it in the phases before.
TOKENS_BEFORE = "tokens_before"


def carried_state(state: dict, saved: list[tuple], now: list[tuple]) -> dict:
    """A stream's state for a new phase: the position in every source the phases share, by identity; a new stream
    otherwise (no pending documents, batches counted from 0, new sources from their start, and the documents and
    tokens drawn counted from 0: train/share/<source> is the phase's own, against the phase's own targets). The
    tokens drawn from each shared source so far are kept beside, in TOKENS_BEFORE: train/tokens/<source> counts
    on across phases."""
    mixture = state.get("mixture")
    positions = ({saved[0]: {k: state[k] for k in SOURCE_POSITION_KEYS}} if len(saved) == 1 and mixture is None
                 else {identity: position for identity, position in zip(saved, (mixture or {}).get("sources", []))})
    fresh = fresh_stream_state()
    if len(now) == 1:
        fresh.update(copy.deepcopy(positions.get(now[0], {})))
        return fresh
    mix = fresh_mixture_state(len(now))
    mix["draws"] = (mixture or {}).get("draws", 0)  # the source draws go on, never repeating a phase's
    for i, identity in enumerate(now):
        if identity in positions:
            mix["sources"][i] = copy.deepcopy(positions[identity])
    mixture = mixture or {}
    earlier = mixture.get(TOKENS_BEFORE) or [0] * len(saved)
    drawn = {identity: before + tokens for identity, before, tokens in zip(saved, earlier, mixture.get("tokens", []))}
    mix[TOKENS_BEFORE] = [drawn.get(identity, 0) for identity in now]
    fresh["mixture"] = mix
    return fresh


def fresh_mixture_state(sources: int) -> dict:
    """Where a stream is in a mixture: draws made, retired sources, tokens drawn and the position in each source."""
    return {"draws": 0, "retired": [], "tokens": [0] * sources, "documents": [0] * sources,
            "sources": [fresh_source_state() for _ in range(sources)]}


def fresh_source_state() -> dict:
    """Where a stream is in one source: its epoch, the source's own state at the current block, the documents of
    the block taken, and the documents skipped (empty, undecodable)."""
    return {"epoch": 0, "source": None, "block": 0, "taken": 0, "skipped": {}}
