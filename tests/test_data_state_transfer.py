"""The data state a pretraining batch carries (`batch[DATA_STATE_KEY]`) is a few objects whatever the packing: Lightning
walks every batch's collections to move it to the device (`apply_to_collection`), the DataLoader walks it too
(`default_convert`, `pin_memory`), and best fit's open rows, token ids as Python lists, made that ~100 ms of host work
per batch at the paper's micro-batch. The stream's full state is one opaque object, decoded for checkpoints."""

import dataclasses
import itertools
import json
from collections.abc import Mapping, Sequence

import pytest
import torch
from lightning.pytorch.utilities import move_data_to_device
from test_data_pretraining import tokenizer  # noqa: F401 - the shared fixture

from neobert.config.pretrain import MaskingConfig, PretrainDataConfig
from neobert.data.demo_corpus import demo_documents
from neobert.data.pretraining import PretrainingDataModule, PretrainingStream
from neobert.data.stream_state import DATA_STATE_KEY, batch_stream_state

MICRO_BATCH = 8
MAX_LENGTH = 512
OPEN_ROWS = 64  # data.packing_open_rows' default: 64 open rows of ~500 token ids each ride the stream state


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    with path.open("w") as f:
        for doc in demo_documents():
            f.write(json.dumps(doc) + "\n")
    return path


def walked_objects(value) -> int:
    """The objects a walk of `value` visits as Lightning's `apply_to_collection` does: mappings, dataclasses and every
    sequence but `str` (`bytes` too, byte by byte) are opened; a tensor or any other object is one leaf, not opened."""
    if isinstance(value, torch.Tensor):
        return 0  # the batch's own data: moved, not counted
    if isinstance(value, Mapping):
        return 1 + sum(walked_objects(v) for v in value.values())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return 1 + sum(walked_objects(getattr(value, f.name)) for f in dataclasses.fields(value))
    if isinstance(value, Sequence) and not isinstance(value, str):
        return 1 + sum(walked_objects(v) for v in value)
    return 1


def twelfth_batch(corpus, tokenizer, packing: str) -> dict:
    data = PretrainDataConfig(source=str(corpus), max_length=MAX_LENGTH, shuffle_buffer=200, num_workers=0,
                              packing=packing, packing_open_rows=OPEN_ROWS)
    return next(itertools.islice(iter(PretrainingStream(data, MaskingConfig(), tokenizer, MICRO_BATCH)), 11, None))


def test_the_data_state_is_a_few_objects_whatever_the_packing(corpus, tokenizer):
    walked, handed_over = {}, {}
    for packing in ("none", "greedy", "best_fit"):
        batch = twelfth_batch(corpus, tokenizer, packing)
        if packing == "best_fit":  # the stream's state itself is big: the packer's open rows, token id by token id
            assert walked_objects(batch_stream_state(batch)) > 10_000
        walked[packing] = walked_objects(batch[DATA_STATE_KEY])
        moved = move_data_to_device(batch, "cpu")
        handed_over[packing] = moved[DATA_STATE_KEY]["state"] is batch[DATA_STATE_KEY]["state"]
    # the stream id, the encoded state and the stats (rows, tokens, squared lengths, mask rate) in their dicts: a
    # handful, the same with or without packing (the plain state of old: 19, 248 and 31,512)
    assert walked["none"] == walked["greedy"] == walked["best_fit"] <= 12, walked
    assert all(handed_over.values()), handed_over  # the encoded state is a leaf: handed over as it is, not walked


def test_the_checkpointed_data_position_is_the_plain_stream_state(corpus, tokenizer):
    batch = twelfth_batch(corpus, tokenizer, "best_fit")
    data = PretrainDataConfig(source=str(corpus), max_length=MAX_LENGTH, packing="best_fit", num_workers=0)
    datamodule = PretrainingDataModule(data, MaskingConfig(), tokenizer, MICRO_BATCH)
    datamodule.trained_batches = 11  # the stream's eleven batches before it were trained too
    datamodule.record(batch[DATA_STATE_KEY])
    saved = datamodule.state_dict()
    assert saved["streams"] == {0: batch_stream_state(batch)} and saved["trained_batches"] == [12]
    assert type(saved["streams"][0]) is dict and type(saved["streams"][0]["builder"]["packer"]["open"]) is list
    resumed = PretrainingDataModule(data, MaskingConfig(), tokenizer, MICRO_BATCH)
    resumed.load_state_dict(saved)
    assert resumed.state_dict() == saved  # a checkpoint's position (this format, older ones too) loads unchanged
