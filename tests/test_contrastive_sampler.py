"""The contrastive batches: no duplicate text in a global batch (10k random draws), exact resumption (the sampler
alone and through a Lightning checkpoint), several hard negatives per query."""

from __future__ import annotations

import json
import random
from itertools import islice

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from neobert.config.contrastive import ContrastiveConfig, ContrastiveDataConfig, ContrastiveLossConfig
from neobert.data.contrastive import (
    BatchItem,
    ContrastiveBatchSampler,
    ContrastiveCollator,
    ContrastiveCorpus,
    ContrastiveDataModule,
    ContrastiveExample,
    load_corpora,
    read_local_examples,
)


def _random_corpus(name: str, size: int, vocabulary: int, rng: random.Random) -> ContrastiveCorpus:
    """Texts drawn from a small vocabulary, so that examples share queries, positives and negatives often; an
    example's own texts are distinct (as load_corpora leaves them)."""
    examples = []
    for _ in range(size):
        texts = rng.sample(range(vocabulary), 2 + rng.randint(0, 3))
        examples.append(ContrastiveExample(f"{name}{texts[0]}", f"{name}{texts[1]}",
                                           tuple(f"{name}{t}" for t in texts[2:])))
    return ContrastiveCorpus(name, examples)


def _texts(corpora, batch: list[BatchItem]) -> list[str]:
    """Every text the batch puts in front of the loss (its queries, positives and the negatives it uses)."""
    texts = []
    for item in batch:
        example = corpora[item.dataset].examples[item.example]
        texts += [example.query, example.positive, *example.negatives[:item.negatives]]
    return texts


def test_no_duplicate_text_in_10k_random_batches_while_the_unfiltered_sampler_has_them():
    rng = random.Random(0)
    draws = duplicates_without_filter = 0
    while draws < 10_000:
        corpora = [_random_corpus(name, rng.randint(40, 120), rng.randint(150, 400), rng)
                   for name in ("a", "b", "c")[:rng.randint(1, 3)]]
        batch_size, seed = rng.randint(2, 8), rng.randint(0, 99)
        sampler = ContrastiveBatchSampler(corpora, batch_size, alpha=0.5, seed=seed, steps_per_epoch=500)
        unfiltered = ContrastiveBatchSampler(corpora, batch_size, alpha=0.5, seed=seed, steps_per_epoch=500,
                                             no_duplicates=False)
        for batch, other in zip(sampler, unfiltered):
            texts = _texts(corpora, batch)
            assert len(texts) == len(set(texts)), f"duplicate in {batch}"
            assert len(batch) == batch_size and len({item.dataset for item in batch}) == 1
            assert len({item.negatives for item in batch}) == 1
            assert batch[0].negatives == min(len(corpora[i.dataset].examples[i.example].negatives) for i in batch)
            other_texts = _texts(corpora, other)
            duplicates_without_filter += len(other_texts) != len(set(other_texts))
            draws += 1
    assert duplicates_without_filter > 1000  # the data provoke duplicates: the filter is what removes them


@pytest.mark.parametrize("world_size, epoch_length", [(1, 7), (2, 5)])
def test_the_sampler_resumes_exactly_from_its_state_across_epochs_and_ranks(world_size, epoch_length):
    corpora = [_random_corpus(name, 60, 90, random.Random(name)) for name in ("x", "y")]

    def sampler(rank):
        return ContrastiveBatchSampler(corpora, 4, 1.0, seed=5, rank=rank, world_size=world_size,
                                       steps_per_epoch=epoch_length)

    for rank in range(world_size):
        uninterrupted = sampler(rank)
        expected = [batch for _ in range(6) for batch in uninterrupted]  # 6 epochs
        first = sampler(rank)
        seen = [batch for _ in range(2) for batch in first] + list(islice(first, 3))  # stop in the 3rd epoch
        state = json.loads(json.dumps(first.state_dict()))  # it survives a checkpoint's serialisation
        resumed = sampler(rank)
        resumed.load_state_dict(state)
        rest = list(iter(resumed))
        while len(seen) + len(rest) < len(expected):
            rest += list(iter(resumed))
        assert seen + rest[:len(expected) - len(seen)] == expected
    # Ranks take disjoint slices of the same global batch.
    if world_size == 2:
        for a, b in zip(sampler(0), sampler(1)):
            assert a[0].dataset == b[0].dataset and not {i.example for i in a} & {i.example for i in b}


def test_several_hard_negatives_per_query_from_every_layout(tmp_path):
    listed = tmp_path / "mined.jsonl"
    listed.write_text(json.dumps({"query": "q", "positive": "p", "negatives": ["n1", "n2", "p", "n1", "n3"]}) + "\n")
    numbered = tmp_path / "numbered.csv"
    numbered.write_text("anchor,positive,negative_2,negative_1\nq,p,m2,m1\n")
    assert read_local_examples(listed)[0].negatives == ("n1", "n2", "p", "n1", "n3")
    assert read_local_examples(numbered)[0].negatives == ("m1", "m2")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"query": "q", "positive": "p", "negatives": "n1"}) + "\n")
    with pytest.raises(ValueError, match="'negatives' must be a list"):
        read_local_examples(bad)
    with pytest.raises(TypeError, match="tuple of texts"):
        ContrastiveExample("q", "p", "n1")
    # The positive repeated as a negative, and a repeated negative, are dropped; the cap keeps the first ones.
    config = ContrastiveDataConfig(datasets=["Mined"], local_files={"Mined": str(listed)})
    assert load_corpora(config)[0].examples[0].negatives == ("n1", "n2", "n3")
    config.max_hard_negatives = 2
    assert load_corpora(config)[0].examples[0].negatives == ("n1", "n2")
    config.use_hard_negatives = False
    assert load_corpora(config)[0].examples[0].negatives == ()


def test_the_collator_stacks_k_negatives_per_query_example_major():
    from neobert.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("bert-base-uncased")
    examples = [ContrastiveExample("first query", "first answer", ("wrong one", "wrong two")),
                ContrastiveExample("second query", "second answer", ("bad one", "bad two"))]
    batch = ContrastiveCollator(tokenizer, 16)(examples)
    assert batch["query"]["input_ids"].shape[0] == 2 and batch["negative"]["input_ids"].shape[0] == 4
    decoded = tokenizer.batch_decode(batch["negative"]["input_ids"], skip_special_tokens=True)
    assert decoded == ["wrong one", "wrong two", "bad one", "bad two"]
    assert "negative" not in ContrastiveCollator(tokenizer, 16)([ContrastiveExample("q", "p")] * 2)
    with pytest.raises(ValueError, match="different numbers of hard negatives"):
        ContrastiveCollator(tokenizer, 16)([examples[0], ContrastiveExample("q", "p", ("n",))])


class _RecordBatches(Callback):
    def __init__(self):
        self.batches = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append(batch["query"]["input_ids"].clone())


def test_a_run_resumed_from_a_lightning_checkpoint_trains_on_the_same_batches(tmp_path):
    """The DataModule's position (batches trained, not batches prefetched) is saved in the checkpoint: a run
    stopped after 3 steps and resumed to 7 sees the batches of an uninterrupted 7-step run, across epochs."""
    from neobert.config import LoggingConfig, TrainerConfig
    from neobert.data.backbone import load_backbone
    from neobert.lit.contrastive import ContrastiveModule
    from neobert.lit.trainer import build_trainer

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"query": f"question {i % 9}", "positive": f"answer {i}"}) + "\n"
                            for i in range(20)))
    data_config = ContrastiveDataConfig(datasets=["Pairs"], local_files={"Pairs": str(data)}, batch_size=4,
                                        max_length=16)
    logging = LoggingConfig(loggers=[], progress_bar=False)

    def fit(max_steps: int, ckpt_path=None, checkpoints=None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        backbone = load_backbone("preset:tiny")
        config = ContrastiveConfig(loss=ContrastiveLossConfig(), trainer=TrainerConfig(
            accelerator="cpu", devices=1, max_steps=max_steps, precision="32-true"))
        recorder = _RecordBatches()
        callbacks = [recorder] + ([ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=3, save_top_k=-1,
                                                   filename="step{step}")] if checkpoints else [])
        trainer = build_trainer(config.trainer, logging, None, callbacks=callbacks, use_distributed_sampler=False,
                                max_epochs=-1)
        module = ContrastiveModule(backbone, config.loss, config.optimizer, config.scheduler, config.trainer)
        trainer.fit(module, datamodule=ContrastiveDataModule(data_config, backbone.tokenizer), ckpt_path=ckpt_path)
        return recorder.batches

    expected = fit(7)  # 20 examples / 4 = 5 batches per epoch: 7 steps cross an epoch boundary
    first = fit(3, checkpoints=tmp_path / "ckpt")
    [checkpoint] = (tmp_path / "ckpt").glob("*.ckpt")
    assert torch.load(checkpoint, weights_only=False)["ContrastiveDataModule"] == {"trained_batches": 3}
    resumed = fit(7, ckpt_path=checkpoint)
    assert len(first) == 3 and len(resumed) == 4
    for step, (got, want) in enumerate(zip(first + resumed, expected)):
        assert torch.equal(got, want), f"step {step} trained on another batch"


def test_the_contrastive_job_resumes_a_stopped_run_to_the_uninterrupted_weights(tmp_path):
    """experiments.contrastive with checkpoints every 2 steps, stopped after 4 of 6 steps then resumed, exports the
    weights of an uninterrupted 6-step run; a second run into the same output_dir without resume is refused."""
    from safetensors.torch import load_file

    from experiments.contrastive import main
    from neobert.config import ConfigError
    from neobert.layout import WEIGHTS_NAME

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"query": f"question {i % 7}", "positive": f"answer {i}",
                                        "negatives": [f"wrong {i}", f"wrong {i + 1}"]}) + "\n" for i in range(24)))

    def run(output: str, *extra: str) -> dict:
        return main(["--config", "contrastive", "--model", "preset:tiny", "--output-dir", str(tmp_path / output),
                     "data.datasets=[Pairs]", f"data.local_files.Pairs={data}", "data.batch_size=4",
                     "data.max_length=16", "optimizer.lr=1e-3", "scheduler.warmup_steps=1", "trainer.max_steps=6",
                     "trainer.checkpoint_every_n_steps=2", "trainer.keep_checkpoints=-1",
                     "trainer.precision=32-true", "trainer.accelerator=cpu", "logging.progress_bar=false",
                     "loss.matryoshka_dims=[64,16]", *extra])

    run("whole")
    run("stopped")
    # The stop: only the step-4 checkpoint is left, as if the process had died during step 5.
    checkpoints = tmp_path / "stopped" / "checkpoints"
    for path in checkpoints.glob("*.ckpt"):
        if "step-00000004" not in path.name:
            path.unlink()
    with pytest.raises(ConfigError, match="resume=true"):
        run("stopped")
    resumed = run("stopped", "resume=true")
    assert resumed["steps"] == 6
    whole = load_file(tmp_path / "whole" / "export" / WEIGHTS_NAME)
    again = load_file(tmp_path / "stopped" / "export" / WEIGHTS_NAME)
    for name in whole:
        torch.testing.assert_close(again[name], whole[name], rtol=0, atol=0, msg=name)
    assert json.loads((tmp_path / "whole" / "export" / "matryoshka.json").read_text())["dims"] == [64, 16]


def test_a_data_set_that_cannot_fill_a_duplicate_free_batch_is_named():
    """Eight examples over three distinct positives cannot make a duplicate-free batch of four: the error names the
    data set and the key to lower, instead of looping for ever; without the filter the batches are drawn."""
    corpus = ContrastiveCorpus("Narrow", [ContrastiveExample(f"q{i}", f"p{i % 3}") for i in range(8)])
    with pytest.raises(ValueError, match=r"'Narrow' cannot fill a batch of 4 without repeating a text.*batch_size"):
        list(ContrastiveBatchSampler([corpus], 4, 1.0, steps_per_epoch=3))
    assert len(list(ContrastiveBatchSampler([corpus], 4, 1.0, steps_per_epoch=3, no_duplicates=False))) == 3
