"""The pretraining LightningModule and job: schedules, config errors, exact resume, strategies, export."""

import dataclasses
import json
from pathlib import Path

import lightning as L
import pytest
import torch

from neobert.config import ConfigError, load_config
from neobert.config.pretrain import PretrainConfig
from neobert.data.demo_corpus import demo_documents
from neobert.hub import HubUnreachableError
import neobert.jobs.pretrain as pretrain_job
from neobert.jobs.pretrain import init_weights, prepare, run_pretraining
from neobert.lit.pretrain import MLMPretrainingModule
from neobert.lit.trainer import build_strategy, build_trainer, check_launch_environment, resolve_precision


def write_corpus(path: Path, n: int = 120) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for doc in demo_documents()[:n]:
            f.write(json.dumps(doc) + "\n")
    return path


def tiny_config(tmp_path: Path, *overrides: str) -> PretrainConfig:
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    base = [
        "model.preset=tiny", "model.overrides.max_length=64", f"data.source={corpus}", "data.max_length=32",
        "data.shuffle_buffer=40", "data.num_workers=0", "trainer.micro_batch_size=4", "trainer.max_steps=4",
        "trainer.accelerator=cpu", "trainer.devices=1", "logging.progress_bar=false", "logging.log_every_n_steps=1",
        "trainer.checkpoint_every_n_steps=2", "scheduler.warmup_steps=1", f"output_dir={tmp_path / 'run'}",
    ]
    return load_config(PretrainConfig, None, base + list(overrides))


# ---------------------------------------------------------------------------------------------- schedules
@pytest.mark.parametrize("name", ["cosine", "linear"])
def test_schedule_values_at_key_steps(tmp_path, name):
    config = tiny_config(tmp_path, f"scheduler.name={name}", "scheduler.warmup_steps=10", "trainer.max_steps=100",
                         "optimizer.lr=1e-3")
    tokenizer, model_config, _ = prepare(config)
    module = MLMPretrainingModule(config, model_config, tokenizer)
    setup = module.configure_optimizers()
    optimizer, scheduler = setup["optimizer"], setup["lr_scheduler"]["scheduler"]
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["betas"] == (0.9, 0.95)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    lrs = []
    for _ in range(101):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    peak = 1e-3
    assert lrs[0] == 0 and lrs[5] == pytest.approx(peak / 2) and lrs[10] == pytest.approx(peak)
    if name == "cosine":  # to 10% of the peak at 90% of the steps, then constant
        assert lrs[50] == pytest.approx(0.1 * peak + 0.9 * peak * 0.5 * (1 + torch.cos(torch.tensor(torch.pi * 40 / 80)).item()))
        assert lrs[90] == pytest.approx(0.1 * peak) and lrs[100] == pytest.approx(0.1 * peak)
    else:
        assert lrs[55] == pytest.approx(peak / 2) and lrs[100] == 0


def test_adam_baseline_uses_coupled_decay(tmp_path):
    config = tiny_config(tmp_path, "optimizer.name=adam", "optimizer.weight_decay=0.01")
    tokenizer, model_config, _ = prepare(config)
    optimizer = MLMPretrainingModule(config, model_config, tokenizer).configure_optimizers()["optimizer"]
    assert type(optimizer) is torch.optim.Adam and optimizer.param_groups[0]["weight_decay"] == 0.01


# ---------------------------------------------------------------------------------------------- config errors
def test_config_errors_name_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  max_stepz: 10\n")
    with pytest.raises(ConfigError, match="trainer.max_stepz"):
        load_config(PretrainConfig, bad)
    with pytest.raises(ConfigError, match="trainer.micro_batch_size"):
        load_config(PretrainConfig, None, ["trainer.micro_batch_size=big"])
    with pytest.raises(ConfigError, match="masking.strategy"):
        prepare(tiny_config(tmp_path, "masking.strategy=random"))
    with pytest.raises(ConfigError, match="data.source"):
        prepare(tiny_config(tmp_path, f"data.source={tmp_path / 'missing' / 'corpus.jsonl'}"))
    with pytest.raises(HubUnreachableError, match="data.source"):
        prepare(tiny_config(tmp_path, "data.source=tiiuae/falcon-refinedweb"))
    with pytest.raises(ConfigError, match="model"):
        prepare(tiny_config(tmp_path, "model.overrides.activation=relu"))
    with pytest.raises(ConfigError, match="data.max_length"):
        prepare(tiny_config(tmp_path, "data.max_length=128"))
    with pytest.raises(ConfigError, match="init_from"):
        prepare(tiny_config(tmp_path, f"init_from={tmp_path / 'nope'}"))


def test_paper_recipe_configs():
    stage1 = load_config(PretrainConfig, "neobert")
    t = stage1.trainer
    assert stage1.model.preset == "neobert" and stage1.data.source == "tiiuae/falcon-refinedweb"
    assert t.max_steps == 1_000_000 and stage1.data.max_length == 1024 and t.strategy == "deepspeed_stage_2"
    assert t.micro_batch_size * t.accumulate_grad_batches * t.devices * t.num_nodes * stage1.data.max_length == 2**21
    assert (stage1.masking.rate, stage1.masking.strategy) == (0.2, "all_mask")
    assert (stage1.optimizer.lr, stage1.optimizer.weight_decay, stage1.scheduler.warmup_steps) == (6e-4, 0.1, 2000)
    assert stage1.data.packing == "none" and t.gradient_clip_val == 1.0
    stage2 = load_config(PretrainConfig, "neobert-4096")
    assert stage2.data.max_length == 4096 and stage2.trainer.max_steps == 50_000
    assert stage2.data.length_buckets == [0, 1024, 2048] and stage2.data.bucket_probabilities == [0.2, 0.4, 0.4]
    assert stage2.init_from == str(Path(stage1.output_dir) / "export")
    assert stage2.trainer.strategy == "deepspeed_stage_2"  # inherited


# ---------------------------------------------------------------------------------------------- strategies
def test_a_stale_local_rank_without_a_launcher_fails_instead_of_hanging(tmp_path):
    two = tiny_config(tmp_path, "trainer.strategy=ddp", "trainer.devices=2").trainer
    with pytest.raises(ConfigError, match="LOCAL_RANK=0 is set"):
        check_launch_environment(two, {"LOCAL_RANK": "0", "NODE_RANK": "0", "MASTER_PORT": "1234"})
    check_launch_environment(two, {"LOCAL_RANK": "0", "WORLD_SIZE": "2"})  # torchrun, or Lightning's own rank 1
    check_launch_environment(two, {"LOCAL_RANK": "0", "SLURM_NTASKS": "2"})  # srun
    check_launch_environment(two, {})  # Lightning starts rank 1 itself
    check_launch_environment(tiny_config(tmp_path).trainer, {"LOCAL_RANK": "0"})  # one device: nothing to wait for


def test_strategies_by_name_and_deepspeed_config_on_cpu(tmp_path, monkeypatch):
    from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy, StrategyRegistry

    config = tiny_config(tmp_path, "trainer.strategy=deepspeed_stage_2")
    strategy = build_strategy(config.trainer, micro_batch_size=4)  # Lightning's strategy, as an object
    assert isinstance(strategy, DeepSpeedStrategy) and type(StrategyRegistry.get("deepspeed_stage_2")) is not type(strategy)
    assert strategy.config["train_micro_batch_size_per_gpu"] == 4
    assert strategy.config["zero_optimization"]["stage"] == 2
    assert strategy.config["zero_optimization"]["overlap_comm"] and strategy.config["zero_optimization"]["contiguous_gradients"]
    # Lightning refuses DeepSpeed without CUDA; it is run on GPUs, never forced onto a CPU.
    trainer = build_trainer(config.trainer, config.logging, config.output_dir)
    assert trainer.gradient_clip_val == 1.0 and trainer.accumulate_grad_batches == 1
    with pytest.raises(Exception, match="(?i)cuda|gpu"):
        run_pretraining(config)
    # refused before the data and the model are prepared, naming the key (Lightning's own error came at the fit)
    monkeypatch.setattr(pretrain_job, "prepare", lambda *args: pytest.fail("prepared before the refusal"))
    with pytest.raises(ConfigError, match=r"'trainer\.strategy': deepspeed_stage_2 \(DeepSpeed\) runs on CUDA GPUs "
                                          r"only.*trainer\.strategy=auto"):
        run_pretraining(config)
    for accelerator in ("auto", "gpu"):
        with pytest.raises(ConfigError, match="trainer.strategy"):
            run_pretraining(dataclasses.replace(config, trainer=dataclasses.replace(config.trainer,
                                                                                    accelerator=accelerator)))
    assert isinstance(build_strategy(tiny_config(tmp_path, "trainer.strategy=fsdp2").trainer), ModelParallelStrategy)
    assert resolve_precision(config.trainer) == "32-true"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_precision(config.trainer) == "32-true"  # accelerator=cpu asked for
    assert resolve_precision(dataclasses.replace(config.trainer, accelerator="auto")) == "bf16-mixed"


# ---------------------------------------------------------------------------------------------- resume
class Recorder(L.Callback):
    def __init__(self, stop_at_step=None):
        self.batches, self.losses, self.stop_at_step = [], [], stop_at_step
        self.sequences = []  # per batch: its documents (unpadded) or rows

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if self.stop_at_step is not None and trainer.global_step == self.stop_at_step:
            raise InterruptedError("simulated crash")
        self.batches.append((batch["input_ids"].clone(), batch["labels"].clone()))
        self.sequences.append(len(batch["cu_seqlens"]) - 1 if "cu_seqlens" in batch else batch["input_ids"].shape[0])

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def crash_and_resume(tmp_path: Path, overrides, crash_at: int) -> tuple[Recorder, Recorder, Recorder]:
    """(uninterrupted, crashed at `crash_at`, resumed) recordings of the same tiny run with `overrides`: an
    uninterrupted run in tmp_path/a, a run in tmp_path/b stopped at the start of step `crash_at`, then resumed."""
    straight = Recorder()
    run_pretraining(tiny_config(tmp_path / "a", *overrides), [straight])
    first = Recorder(stop_at_step=crash_at)
    with pytest.raises(InterruptedError):
        run_pretraining(tiny_config(tmp_path / "b", *overrides), [first])
    assert (tmp_path / "b" / "run" / "checkpoints" / "last.ckpt").exists()
    second = Recorder()
    run_pretraining(tiny_config(tmp_path / "b", *overrides, "resume=true"), [second])
    return straight, first, second


@pytest.mark.slow
def test_resume_sees_the_same_batches_and_losses(tmp_path):
    # 3 micro-batches per step and 2 workers: the crash after step 3 (9 batches) leaves the loader mid-round-robin.
    overrides = ["trainer.max_steps=4", "trainer.accumulate_grad_batches=3", "trainer.checkpoint_every_n_steps=3",
                 "data.num_workers=2", "data.shuffle_buffer=16"]
    straight, first, second = crash_and_resume(tmp_path, overrides, crash_at=3)

    resumed_batches, resumed_losses = first.batches + second.batches, first.losses + second.losses
    assert len(resumed_batches) == len(straight.batches) == 12
    for (ids_a, labels_a), (ids_b, labels_b) in zip(straight.batches, resumed_batches):
        assert torch.equal(ids_a, ids_b) and torch.equal(labels_a, labels_b)
    assert resumed_losses == pytest.approx(straight.losses, abs=1e-6)


# ---------------------------------------------------------------------------------------------- export
def test_export_loads_in_transformers_and_initialises_stage_two(tmp_path):
    import neobert  # noqa: F401  (registers the Auto classes)
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    from experiments.export import main as export_main

    config = tiny_config(tmp_path, "trainer.max_steps=2")
    export_dir = run_pretraining(config)
    assert (export_dir / "config.json").is_file() and (export_dir / "model.safetensors").is_file()
    assert (Path(config.output_dir) / "loss.png").stat().st_size > 0

    again = export_main([str(Path(config.output_dir) / "checkpoints" / "last.ckpt"), str(tmp_path / "again")])
    hf_model = AutoModelForMaskedLM.from_pretrained(str(again)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(again))
    batch = tokenizer(["the assert statement"], return_tensors="pt")
    ours = torch.load(Path(config.output_dir) / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    stage2 = tiny_config(tmp_path / "stage2", f"init_from={export_dir}")
    tok, model_config, _ = prepare(stage2)
    module = MLMPretrainingModule(stage2, model_config, tok)
    init_weights(module.model, stage2.init_from)
    for key, value in module.model.state_dict().items():
        torch.testing.assert_close(value, ours["model." + key])
    with torch.no_grad():
        expected = module.model.eval()(batch["input_ids"], batch["attention_mask"]).logits
        torch.testing.assert_close(hf_model(**batch).logits, expected)


def test_the_demo_corpus_is_written_only_to_the_demos_own_source(tmp_path, monkeypatch):
    from neobert.jobs.pretrain import load_pretrain_config

    monkeypatch.chdir(tmp_path)
    config = load_pretrain_config(None, ["data.source=tiiuae/falcon-refinedweb"])
    assert config.data.source == "tiiuae/falcon-refinedweb" and not (tmp_path / "tiiuae").exists()
    with pytest.raises(HubUnreachableError, match="data.source"):
        prepare(config)
    load_pretrain_config(None, [f"data.source={tmp_path / 'typo.jsonl'}"])
    assert not (tmp_path / "typo.jsonl").exists()
    demo = load_pretrain_config(None, [])
    assert (tmp_path / demo.data.source).is_file()  # the demo itself still runs offline


def test_the_profiler_reports_where_the_step_time_goes(tmp_path):
    config = tiny_config(tmp_path, "trainer.profiler=simple", "trainer.max_steps=2")
    run_pretraining(config)
    [report] = (tmp_path / "run").glob("*profile*.txt")
    text = report.read_text()
    for action in ("train_dataloader_next", "training_step", "backward", "optimizer_step"):
        assert action in text, action
    with pytest.raises(ConfigError, match="'trainer.profiler'"):
        tiny_config(tmp_path, "trainer.profiler=cprofile").validate()
