"""The stream's resume state is a dataclass (`StreamState`) saved in every checkpoint as the plain dict it always was:
a state in that format, every key of it, loads and saves back identically, so earlier checkpoints resume."""

import itertools

from test_data_pretraining import tokenizer  # noqa: F401 - the shared fixture
from test_mixtures import mixture_data, three_sources  # noqa: F401 - the shared fixture

from neobert.config.pretrain import MaskingConfig
from neobert.data.pretraining import PretrainingDataModule, PretrainingStream
from neobert.data.stream_state import MixtureState, SourcePosition, StreamState, batch_stream_state

# The keys of a stream's saved state, as checkpoints hold them (in this order): the position in the source, then the
# stream's own; "arrivals" from the first length-bucket draw on.
STREAM_KEYS = ["epoch", "source", "block", "taken", "skipped", "batches", "draws", "queues", "builder", "mixture"]
MIXTURE_KEYS = ["draws", "retired", "tokens", "documents", "sources"]  # then "tokens_before" from a second phase on
POSITION_KEYS = ["epoch", "source", "block", "taken", "skipped"]

# A stream's state as a checkpoint of today's format holds it: a mixture of three sources in its second phase, with
# length buckets and packing, every optional key present.
SAVED = {
    "epoch": 0, "source": None, "block": 0, "taken": 0, "skipped": {"bucket_overflow": 3},
    "batches": 7, "draws": 28,
    "queues": [[[30, [101, 1008, 102]]], [[31, [101, 2005, 3722, 2000, 102]]]],
    "builder": {"packer": {"closed": [[[101, 4137, 102]]], "open": [[101, 4539, 5537]]}},
    "mixture": {
        "draws": 33, "retired": [1], "tokens": [412, 97, 40], "documents": [21, 12, 3],
        "sources": [
            {"epoch": 1, "source": {"shard_idx": 0, "shard_example_idx": 16}, "block": 2, "taken": 5,
             "skipped": {"empty": 1}},
            {"epoch": 3, "source": None, "block": 0, "taken": 0, "skipped": {}},
            {"epoch": 0, "source": None, "block": 0, "taken": 3, "skipped": {}},
        ],
        "tokens_before": [900, 0, 0],
    },
    "arrivals": 32,
}


def test_a_saved_state_loads_and_saves_back_identically():
    state = StreamState.from_dict(SAVED)
    assert state.position == SourcePosition(skipped={"bucket_overflow": 3})
    assert state.mixture.sources[0].source == {"shard_idx": 0, "shard_example_idx": 16}
    assert state.mixture.tokens_before == [900, 0, 0] and state.arrivals == 32
    again = state.to_dict()
    assert again == SAVED and repr(again) == repr(SAVED)  # repr: the same keys in the same order, at every level
    first = {**SAVED, "queues": None, "builder": None, "mixture": None}  # no buckets, no mixture, a first phase
    del first["arrivals"]
    assert StreamState.from_dict(first).to_dict() == first and list(first) == STREAM_KEYS
    mixture = {**SAVED["mixture"]}
    del mixture["tokens_before"]
    assert MixtureState.from_dict(mixture).to_dict() == mixture


def test_the_dataclass_says_the_keys_of_the_saved_state():
    assert list(StreamState().to_dict()) == STREAM_KEYS
    assert list(StreamState(queues=[[]], arrivals=0).to_dict()) == STREAM_KEYS + ["arrivals"]
    assert list(MixtureState.fresh(2).to_dict()) == MIXTURE_KEYS
    assert list(MixtureState.fresh(2).to_dict()["sources"][0]) == list(SourcePosition().to_dict()) == POSITION_KEYS


def test_a_stream_s_state_and_a_checkpoint_of_it_round_trip(three_sources, tokenizer):  # noqa: F811
    data = mixture_data(three_sources, weights=(2, 1, 1))
    data.length_buckets, data.bucket_probabilities, data.packing = [0, 16], [0.5, 0.5], "greedy"  # every key saved
    batches = list(itertools.islice(iter(PretrainingStream(data, MaskingConfig(), tokenizer, 4)), 12))
    saved = batch_stream_state(batches[-1])
    assert list(saved) == STREAM_KEYS + ["arrivals"] and list(saved["mixture"]) == MIXTURE_KEYS
    assert list(saved["mixture"]["sources"][0]) == POSITION_KEYS and saved["builder"]["packer"]["open"]
    assert repr(StreamState.from_dict(saved).to_dict()) == repr(saved)
    # a checkpoint in today's format, with a second phase's mixture state: loaded and saved unchanged
    datamodule = PretrainingDataModule(data, MaskingConfig(), tokenizer, 4)
    checkpoint = datamodule.state_dict() | {"streams": {0: SAVED}, "trained_batches": [7]}
    resumed = PretrainingDataModule(data, MaskingConfig(), tokenizer, 4)
    resumed.load_state_dict(checkpoint)
    assert resumed.state_dict() == checkpoint
    assert resumed.source_counts() == {"documents": {"alpha": 21, "beta": 12, "gamma": 3},
                                       "tokens": {"alpha": 412 + 900, "beta": 97, "gamma": 40}}
