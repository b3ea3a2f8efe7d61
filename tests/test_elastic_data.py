"""Data that survives a change of machines (neobert.data.stream_layout): the DataModule driven as each rank and
DataLoader worker would drive it gives the same documents, masked alike, in every optimizer step on 1 device x 8
accumulation, 2 x 4, 4 x 2 and 8 x 1, with 0, 1 or 4 workers; a checkpoint of one layout resumes on another at
exactly the next global batch, across a phase boundary and with a mixture too; what cannot go on exactly is
refused."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from types import SimpleNamespace

import pytest

from neobert.config import ConfigError, load_config
from neobert.config.pretrain import MaskingConfig, PretrainConfig, PretrainDataConfig, PretrainTrainerConfig
from neobert.data import pretraining
from neobert.data.corpus import DocumentTokenizer, truncate
from neobert.data.demo_corpus import demo_documents
from neobert.data.pretraining import PretrainingDataModule
from neobert.data.stream_layout import StreamLayout, resume_problem
from neobert.data.stream_state import DATA_STATE_KEY
from neobert.errors import CheckpointError
from test_data_pretraining import corpus, tokenizer  # noqa: F401  (the 300 demo documents and the tokenizer)

STREAMS, MICRO_BATCH, GLOBAL_MICRO_BATCHES = 32, 2, 8
LAYOUTS = [(1, 8), (2, 4), (4, 2), (8, 1)]  # devices x accumulation: 8 micro-batches per optimizer step


def data_config(corpus, workers: int, **overrides) -> PretrainDataConfig:
    values = dict(source=str(corpus), max_length=32, shuffle_buffer=4, num_workers=workers, streams=STREAMS)
    return PretrainDataConfig(**{**values, **overrides})


class Rank:
    """One rank's DataModule and DataLoader workers, as Lightning and torch drive them: worker i reads with
    get_worker_info().id == i, the loader takes their batches in turn, and training_step records each batch."""

    def __init__(self, data, tokenizer, rank: int, world_size: int, accumulate: int, monkeypatch,
                 state: dict | None = None, phase: str = ""):
        trainer = PretrainTrainerConfig(micro_batch_size=MICRO_BATCH, accumulate_grad_batches=accumulate)
        self.datamodule = PretrainingDataModule(data, MaskingConfig(), tokenizer, MICRO_BATCH, trainer, phase=phase)
        self.datamodule.trainer = SimpleNamespace(global_rank=rank, world_size=world_size)
        self.datamodule.setup("fit")
        if state is not None:
            self.datamodule.load_state_dict(state)
        stream, self.workers = self.datamodule.train_stream(), []
        for worker in range(max(1, data.num_workers)):
            info = SimpleNamespace(id=worker) if data.num_workers else None
            monkeypatch.setattr(pretraining, "get_worker_info", lambda info=info: info)
            batches = iter(stream)
            self.workers.append(itertools.chain([next(batches)], batches))  # the reader is fixed at its first batch
        self.turn = 0

    def next_batch(self) -> dict:
        batch = next(self.workers[self.turn % len(self.workers)])
        self.turn += 1
        self.datamodule.record(batch[DATA_STATE_KEY])
        return batch


def content(batch: dict) -> tuple:
    return tuple(batch["input_ids"].reshape(-1).tolist()), tuple(batch["labels"].reshape(-1).tolist())


def train(ranks: list[Rank], accumulate: int, steps: int) -> list[list[tuple]]:
    """Each optimizer step's micro-batches, all ranks together (their order within a step does not count)."""
    return [sorted(content(rank.next_batch()) for rank in ranks for _ in range(accumulate)) for _ in range(steps)]


def start(data, tokenizer, world_size, accumulate, monkeypatch, state=None, phase=""):
    return [Rank(data, tokenizer, r, world_size, accumulate, monkeypatch, state, phase) for r in range(world_size)]


def checkpoint(ranks: list[Rank]) -> dict:
    """The DataModule state a checkpoint holds: every rank's, gathered as all_gather_object does."""
    states = [rank.datamodule.state_dict() for rank in ranks]
    streams = {k: v for state in states for k, v in state["streams"].items()}
    return states[0] | {"streams": streams, "trained_batches": [s["trained_batches"][0] for s in states]}


def test_every_layout_and_worker_count_trains_the_same_batches_in_the_same_steps(corpus, tokenizer, monkeypatch):
    runs = {}
    for (devices, accumulate), workers in itertools.product(LAYOUTS, (0, 1, 4)):
        ranks = start(data_config(corpus, workers), tokenizer, devices, accumulate, monkeypatch)
        runs[devices, accumulate, workers] = train(ranks, accumulate, steps=3)
    reference = runs[1, 8, 0]
    assert len({micro_batch for step in reference for micro_batch in step}) == 3 * GLOBAL_MICRO_BATCHES
    for layout, steps in runs.items():
        assert steps == reference, f"devices x accumulation x workers {layout} trains other batches"


@pytest.mark.parametrize("before, after", [((2, 4, 1), (1, 8, 0)), ((1, 8, 4), (4, 2, 1)), ((8, 1, 0), (2, 4, 4))])
def test_a_checkpoint_resumes_on_another_layout_at_exactly_the_next_global_batch(corpus, tokenizer, monkeypatch,
                                                                                  before, after):
    (devices, accumulate, workers), (devices_after, accumulate_after, workers_after) = before, after
    uninterrupted = train(start(data_config(corpus, 0), tokenizer, 1, 8, monkeypatch), 8, steps=5)
    ranks = start(data_config(corpus, workers), tokenizer, devices, accumulate, monkeypatch)
    first = train(ranks, accumulate, steps=2)
    resumed = start(data_config(corpus, workers_after), tokenizer, devices_after, accumulate_after, monkeypatch,
                    state=checkpoint(ranks))
    assert first + train(resumed, accumulate_after, steps=3) == uninterrupted


def test_each_document_is_trained_once_across_a_resume_on_another_layout(corpus, tokenizer, monkeypatch):
    # Unshuffled (shuffle_buffer 1), stream s reads documents s, s + 32, s + 64, ...; one step is 8 micro-batches
    # of 2 whole documents (max_length 512, no packing), so 16 steps give every stream 8 of its 9 or 10 documents:
    # the corpus' first 256 documents, each once. 12 steps on 2 devices x 4, then 4 on 1 x 8 with 4 workers.
    def data(workers):
        return data_config(corpus, workers, max_length=512, shuffle_buffer=1, unpad=False)

    uninterrupted = train(start(data(0), tokenizer, 1, 8, monkeypatch), 8, steps=16)
    ranks = start(data(1), tokenizer, 2, 4, monkeypatch)
    first = train(ranks, 4, steps=12)
    resumed = train(start(data(4), tokenizer, 1, 8, monkeypatch, state=checkpoint(ranks)), 8, steps=4)
    assert first + resumed == uninterrupted
    trained = [original_document(ids, labels, row) for step in uninterrupted for ids, labels in step
               for row in range(MICRO_BATCH)]
    tokenize = DocumentTokenizer(tokenizer, "content")
    first_256 = [tuple(truncate(ids, 512, set(tokenizer.all_special_ids)))
                 for ids in tokenize.encode([doc["content"] for doc in demo_documents()[:256]])]
    assert Counter(trained) == Counter(first_256)


def original_document(ids: tuple, labels: tuple, row: int) -> tuple:
    """Row `row` of a padded micro-batch's content with its masked tokens put back, [PAD]s dropped."""
    width = len(ids) // MICRO_BATCH
    ids, labels = ids[row * width:(row + 1) * width], labels[row * width:(row + 1) * width]
    return tuple(label if label != -100 else token for token, label in zip(ids, labels) if token != 0)


def test_a_phase_boundary_carries_the_streams_to_another_layout_and_batch(corpus, tokenizer, monkeypatch):
    ranks = start(data_config(corpus, 1), tokenizer, 2, 4, monkeypatch, phase="a")
    train(ranks, 4, steps=2)
    saved = checkpoint(ranks)
    # phase b: 12 micro-batches per step, on 3 x 4 or 1 x 12 readers of the same 32 streams (3 does not divide 32:
    # refused), on 4 x 3 and 2 x 6: the same batches
    with pytest.raises(ConfigError, match=r"data.streams=32 cannot be read by 3 device\(s\)"):
        start(data_config(corpus, 1), tokenizer, 3, 4, monkeypatch, state=saved, phase="b")
    four = train(start(data_config(corpus, 1), tokenizer, 4, 3, monkeypatch, state=saved, phase="b"), 3, steps=2)
    two = train(start(data_config(corpus, 2), tokenizer, 2, 6, monkeypatch, state=saved, phase="b"), 6, steps=2)
    assert four == two and len(four[0]) == 12


def test_a_mixture_resumes_on_another_layout_exactly(tmp_path, tokenizer, monkeypatch):
    paths = []
    for name, docs in (("web", demo_documents()[:150]), ("code", demo_documents()[150:300])):
        paths.append(tmp_path / f"{name}.jsonl")
        paths[-1].write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    sources = "[" + ", ".join(f"{{name: s{i}, source: '{p}', weight: {i + 1}}}" for i, p in enumerate(paths)) + "]"

    def mixture(workers):
        overrides = [f"data.sources={sources}", "data.max_length=32", "data.shuffle_buffer=4",
                     f"data.num_workers={workers}", "data.streams=8"]
        return load_config(PretrainConfig, None, overrides).data

    uninterrupted = train(start(mixture(0), tokenizer, 1, 4, monkeypatch), 4, steps=4)
    ranks = start(mixture(2), tokenizer, 4, 1, monkeypatch)
    first = train(ranks, 1, steps=2)
    resumed = train(start(mixture(1), tokenizer, 2, 2, monkeypatch, state=checkpoint(ranks)), 2, steps=2)
    assert first + resumed == uninterrupted


def test_a_resume_that_cannot_go_on_exactly_is_refused_naming_the_keys(corpus, tokenizer, monkeypatch):
    ranks = start(data_config(corpus, 1), tokenizer, 2, 4, monkeypatch)
    train(ranks, 4, steps=1)
    saved = checkpoint(ranks)
    cases = {  # (devices, accumulation, workers, data.streams): the refusal
        (2, 2, 1, STREAMS): r"optimizer steps take 8 micro-batches .* set trainer.accumulate_grad_batches=4 on these "
                            r"2 device\(s\)",
        (3, 1, 1, STREAMS): r"use a number of devices x num_nodes dividing 8",
        (4, 2, 3, STREAMS): r"data.streams=32 cannot be read by 4 device\(s\) x 3 data.num_workers = 12 readers .* "
                            r"in \[1, 2, 4, 8, 16, 32\]",
        (2, 4, 1, 16): r"cut into data.streams=32, this run asks for data.streams=16: set data.streams=32",
    }
    for (devices, accumulate, workers, streams), message in cases.items():
        with pytest.raises(ConfigError, match=message):
            start(data_config(corpus, workers, streams=streams), tokenizer, devices, accumulate, monkeypatch,
                  state=saved)
    trainer = PretrainTrainerConfig(micro_batch_size=4, accumulate_grad_batches=4)
    datamodule = PretrainingDataModule(data_config(corpus, 1), MaskingConfig(), tokenizer, 4, trainer)
    datamodule.trainer = SimpleNamespace(global_rank=0, world_size=2)
    with pytest.raises(ConfigError, match=r"trainer.micro_batch_size=4, but the checkpoint's batches were cut at 2"):
        datamodule.load_state_dict(saved)
    # a data state cut or mixed up: one stream's position lost
    broken = saved | {"streams": {k: v for k, v in saved["streams"].items() if k != 3}}
    with pytest.raises(CheckpointError, match="stream 3 made 0 batches, 8 trained micro-batches give it 1"):
        start(data_config(corpus, 1), tokenizer, 2, 4, monkeypatch, state=broken)


def test_the_layout_maps_micro_batches_to_readers_that_own_whole_streams():
    layout = StreamLayout(streams=12, world_size=2, workers=3)
    readers = {layout.reader(rank, position): (rank, position) for rank in range(2) for position in range(3)}
    assert sorted(readers) == list(range(6))
    for reader, (rank, position) in readers.items():
        # the rank's k-th micro-batch is the run's k x 2 + rank; its worker at position k mod 3 reads it
        owned = {(k * 2 + rank) % 12 for k in range(position, 120, 3)}
        assert owned == set(layout.streams_of(reader))
    assert [layout.batches_before(5, n) for n in (0, 5, 6, 17, 18)] == [0, 0, 1, 1, 2]
    assert StreamLayout(8, 3, 1).problem() and not StreamLayout(8, 4, 2).problem()


def test_a_checkpoint_written_before_data_streams_resumes_on_its_own_layout_only():
    legacy = {"streams": {}, "trained_batches": [4, 4], "num_streams": 4, "phase": "", "sources": []}
    assert resume_problem(legacy, StreamLayout(4, 2, 2), 4, 2, True) is None
    assert "written for 2 device(s) x 2 data.num_workers, before data.streams" in resume_problem(
        legacy, StreamLayout(4, 4, 1), 4, 2, True)


def test_data_streams_is_typed_and_bounded():
    with pytest.raises(ConfigError, match="data.streams"):
        load_config(PretrainConfig, None, ["data.streams=-1"])
    with pytest.raises(ConfigError, match="data.streams"):
        load_config(PretrainConfig, None, ["data.streams=1000000"])


def test_a_new_run_whose_readers_cannot_share_the_streams_is_refused_before_anything_is_written(tmp_path):
    from neobert.jobs.pretrain import run_pretraining
    from test_pretrain import tiny_config

    config = tiny_config(tmp_path, "data.streams=4", "data.num_workers=3")
    with pytest.raises(ConfigError, match=r"'data.streams': data.streams=4 cannot be read by 1 device\(s\) x 3 "
                                          r"data.num_workers = 3 readers"):
        run_pretraining(config)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").rglob("*"))
