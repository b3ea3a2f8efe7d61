"""Validation's held-out documents stay out of training whatever the number of streams (ranks x workers): with one
stream they are skipped; split over several, `datasets` would skip a share of the count in every stream's own shards
and train on most of them, so they are dropped by content."""

from __future__ import annotations

import json

import pytest
from test_pretrain import tiny_config

from neobert.data.corpus import open_source
from neobert.data.pretraining import PretrainingStream
from neobert.data.tokenizer import load_tokenizer


@pytest.mark.parametrize("devices, workers", [(1, 1), (2, 2), (3, 1)])
def test_held_out_documents_are_never_trained_on(tmp_path, devices, workers):
    for shard in range(8):
        with open(tmp_path / f"shard-{shard}.jsonl", "w") as f:
            for doc in range(30):
                f.write(json.dumps({"content": f"shard {shard} document {doc}"}) + "\n")
    config = tiny_config(tmp_path, f"data.source={tmp_path}/shard-*.jsonl", "data.validation_docs=40",
                         f"data.num_workers={workers}")
    held_out = {example["content"] for example in open_source(config.data).take(40)}
    assert len(held_out) == 40
    trained = []
    for rank in range(devices):
        stream = PretrainingStream(config.data, config.masking, load_tokenizer(), 4, rank=rank, world_size=devices,
                                   skip_docs=40)
        for worker in range(workers):
            trained += [example["content"] for example in stream.source(rank * workers + worker, epoch=0)]
    assert not held_out & set(trained)
    assert len(trained) == len(set(trained)) == 8 * 30 - 40  # every other document once
