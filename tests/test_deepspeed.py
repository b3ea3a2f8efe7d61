"""The DeepSpeed path, checked on CPU against the pinned libraries' own code (Lightning refuses to run its DeepSpeed
strategy without CUDA, but DeepSpeed's engine itself initialises on CPU with gloo):

* the strategy Lightning gets is configured with our micro-batch size (Lightning's auto-select reads
  `train_dataloader.batch_sampler.batch_size`, which our DataLoader of ready batches does not have);
* with gradient accumulation the gradient equals the unaccumulated one (Lightning and DeepSpeed each divide the
  loss by the accumulation count: once is right);
* the export and the EMA read DeepSpeed's fp32 master weights, and the gradient norm comes from the engine;
* a checkpoint directory rewritten in place (last.ckpt) never looks complete while it is being written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from test_pretrain import tiny_config

from neobert.config import ConfigError, load_config
from neobert.config.pretrain import PretrainConfig
from neobert.jobs.pretrain import prepare
from neobert.lit.strategies import (DEEPSPEED_LATEST, DeepSpeedPrecisionOnce, NeoBERTDeepSpeedStrategy,
                                    deepspeed_strategy)
from neobert.lit.trainer import build_strategy

pytest.importorskip("deepspeed")
REPO = Path(__file__).resolve().parents[1]


def attach(strategy, dataloader, accumulate: int, clip: float) -> None:
    """What Lightning's `_format_config` reads of the LightningModule and its Trainer, around a real DataLoader."""
    source = SimpleNamespace(is_defined=lambda: True, dataloader=lambda: dataloader)
    trainer = SimpleNamespace(accumulate_grad_batches=accumulate, gradient_clip_val=clip,
                              fit_loop=SimpleNamespace(_data_source=source))
    strategy._lightning_module = SimpleNamespace(trainer=trainer)


@pytest.mark.parametrize("name", ["neobert", "neobert-4096", "recipes/neobert-wsd"])
def test_the_paper_configs_render_deepspeeds_config_with_our_micro_batch(tmp_path, name):
    shipped = load_config(PretrainConfig, name)
    assert shipped.trainer.strategy == "deepspeed_stage_2"
    # Our pretraining DataLoader (batch_size=None: the stream yields whole batches), from a tiny local corpus.
    _, _, datamodule = prepare(tiny_config(tmp_path))
    dataloader = datamodule.train_dataloader()
    assert dataloader.batch_sampler is None

    strategy = build_strategy(shipped.trainer, shipped.trainer.micro_batch_size)
    assert isinstance(strategy, NeoBERTDeepSpeedStrategy)
    assert isinstance(strategy.precision_plugin, DeepSpeedPrecisionOnce)
    attach(strategy, dataloader, shipped.trainer.accumulate_grad_batches, shipped.trainer.gradient_clip_val)
    strategy._format_config()  # Lightning's own formatting, as in its setup
    config = strategy.config
    assert config["train_micro_batch_size_per_gpu"] == shipped.trainer.micro_batch_size
    assert config["gradient_accumulation_steps"] == shipped.trainer.accumulate_grad_batches
    assert config["gradient_clipping"] == 1.0
    assert config["zero_optimization"]["stage"] == 2
    assert config["bf16"] == {"enabled": True, "check_grad_overflow": False}  # no host read per step
    tokens = (config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * 8
              * shipped.data.max_length)
    assert tokens == 2 ** 21  # the paper's 2M tokens per step on 8 GPUs

    # Lightning's strategy as the name alone builds it fails on the same DataLoader (Lightning issue #19460).
    plain = DeepSpeedStrategy(stage=2)
    plain.precision_plugin = DeepSpeedPrecisionOnce("bf16-mixed")
    attach(plain, dataloader, 8, 1.0)
    with pytest.raises(AttributeError, match="batch_size"):
        plain._format_config()


def test_trainer_deepspeed_tunes_the_rendered_config_and_bf16_reads_no_overflow_flag_every_step(tmp_path):
    """Under DeepSpeed bf16 every step read an overflow flag on the host (a device sync, DeepSpeed
    0.19.8 runtime/zero/stage_1_and_2.py:3237-3249); trainer.deepspeed turns the check off by default and passes
    DeepSpeed's bucket and overlap settings through, as DeepSpeed's own config parser then reads them."""
    from deepspeed.runtime.precision_config import get_bfloat16_config

    _, _, datamodule = prepare(tiny_config(tmp_path))
    dataloader = datamodule.train_dataloader()

    def rendered(*overrides: str) -> dict:
        config = load_config(PretrainConfig, "neobert", list(overrides)).trainer
        strategy = build_strategy(config, config.micro_batch_size)
        attach(strategy, dataloader, config.accumulate_grad_batches, config.gradient_clip_val)
        strategy._format_config()
        return strategy.config

    shipped = rendered()
    assert shipped["bf16"] == {"enabled": True, "check_grad_overflow": False}
    assert get_bfloat16_config(shipped).check_grad_overflow is False
    assert shipped["zero_optimization"]["reduce_bucket_size"] == 200_000_000  # Lightning's default, untouched
    tuned = rendered("trainer.deepspeed.check_grad_overflow=true", "trainer.deepspeed.reduce_bucket_size=50000000",
                     "trainer.deepspeed.overlap_comm=false", "trainer.strategy=deepspeed_stage_1")
    assert get_bfloat16_config(tuned).check_grad_overflow is True
    zero = tuned["zero_optimization"]
    assert (zero["stage"], zero["reduce_bucket_size"], zero["overlap_comm"]) == (1, 50_000_000, False)
    fp16 = rendered("trainer.precision=16-mixed")
    assert "bf16" not in fp16 and fp16["fp16"]["enabled"]  # fp16 keeps its loss scaling and its overflow check
    with pytest.raises(ConfigError, match="'trainer.deepspeed.reduce_bucket_size': must be positive"):
        load_config(PretrainConfig, "neobert", ["trainer.deepspeed.reduce_bucket_size=0"])
    with pytest.raises(ConfigError, match="trainer.deepspeed.bucket_size"):
        load_config(PretrainConfig, "neobert", ["trainer.deepspeed.bucket_size=5"])


def test_every_deepspeed_name_keeps_lightnings_settings():
    offload = deepspeed_strategy("deepspeed_stage_2_offload", "bf16-mixed", 4)
    assert offload.config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert deepspeed_strategy("deepspeed_stage_3", "bf16-mixed").config["zero_optimization"]["stage"] == 3
    with pytest.raises(ValueError, match="not a registered DeepSpeed strategy"):
        deepspeed_strategy("ddp", "bf16-mixed")


ENGINE_SCRIPT = r'''
import json, os, sys
from types import SimpleNamespace
import torch, lightning as L
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import deepspeed
from lightning.pytorch.loops.optimization.automatic import ClosureResult
from lightning.pytorch.plugins.precision import DeepSpeedPrecision
from neobert.lit.strategies import (DeepSpeedPrecisionOnce, NeoBERTDeepSpeedStrategy, deepspeed_grad_norm,
                                    master_state_dict)
from neobert.model import NeoBERTConfig, NeoBERTForMaskedLM

torch.distributed.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
ACCUMULATE = 4
torch.manual_seed(0)
batches = [torch.randn(3, 16) for _ in range(ACCUMULATE)]
targets = [torch.randn(3, 1) for _ in range(ACCUMULATE)]
initial = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).state_dict()

def model():
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    net.load_state_dict(initial)
    return net

class Stand(L.LightningModule):  # what the precision plugin reads: module.trainer.model is the engine
    pass

def accumulated_norm(plugin):
    net = model()
    engine, *_ = deepspeed.initialize(
        model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.0), dist_init_required=False,
        config={"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": ACCUMULATE,
                "zero_optimization": {"stage": 2}, "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True})
    module = Stand()
    module._trainer = SimpleNamespace(model=engine)
    for x, y in zip(batches, targets):
        loss = torch.nn.functional.mse_loss(engine(x), y)
        loss = ClosureResult.from_training_step_output(loss, ACCUMULATE).closure_loss  # Lightning's normalisation
        plugin.backward(loss, module, None)
        engine.step()
    return float(engine.get_global_grad_norm())

# The gradient of one step over the same four micro-batches, without accumulation.
reference = model()
torch.nn.functional.mse_loss(reference(torch.cat(batches)), torch.cat(targets)).backward()
unaccumulated = float(torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]))

result = {"unaccumulated": unaccumulated, "ours": accumulated_norm(DeepSpeedPrecisionOnce("32-true")),
          "lightning": accumulated_norm(DeepSpeedPrecision("32-true"))}

# bf16 ZeRO-2: the module holds bf16 copies, the optimizer the fp32 masters.
net = NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny", vocab_size=100, max_length=32))
engine, *_ = deepspeed.initialize(
    model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-2), dist_init_required=False,
    config={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
            "zero_optimization": {"stage": 2}, "gradient_clipping": 1.0, "zero_allow_untested_optimizer": True})
ids = torch.randint(5, 100, (2, 16))
labels = torch.where(torch.rand(2, 16) < 0.3, ids, torch.full_like(ids, -100))
for _ in range(3):
    engine.backward(engine(ids, labels=labels).loss)
    engine.step()
strategy = NeoBERTDeepSpeedStrategy(parallel_devices=[torch.device("cpu")])
strategy.model = engine
master = master_state_dict(engine.module, strategy)
bf16 = engine.module.state_dict()
weights = [name for name, p in engine.module.named_parameters()]
result["master_dtypes"] = sorted({str(master[n].dtype) for n in weights})
result["module_dtypes"] = sorted({str(bf16[n].dtype) for n in weights})
result["master_rounds_to_module"] = all(torch.equal(master[n].bfloat16(), bf16[n]) for n in weights)
result["master_is_finer"] = any(not torch.equal(master[n], bf16[n].float()) for n in weights)
norm = deepspeed_grad_norm(strategy)
result["engine_norm"] = float(norm)
result["grads_on_params"] = sum(p.grad is not None for p in engine.module.parameters())
print("RESULT" + json.dumps(result))
'''


def run_engine_script(text: str, folder) -> dict:
    """A script driving DeepSpeed's real engine on CPU (gloo, one process), run in a subprocess (it sets process-wide
    state) with a file for its process group's store as its argument (no port to collide with another run's): the
    JSON it prints after "RESULT"."""
    script = folder / "engine.py"
    script.write_text(text)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    done = subprocess.run([sys.executable, str(script), str(folder / "store")], capture_output=True, text=True,
                          env=env, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT"))


@pytest.fixture(scope="module")
def engine_results(tmp_path_factory):
    return run_engine_script(ENGINE_SCRIPT, tmp_path_factory.mktemp("ds"))


def test_accumulated_gradient_under_deepspeed_equals_the_unaccumulated_one(engine_results):
    assert engine_results["ours"] == pytest.approx(engine_results["unaccumulated"], rel=1e-5)
    # Lightning's plugin as shipped: the loss divided twice, the gradient 4x (the accumulation) too small.
    assert engine_results["lightning"] == pytest.approx(engine_results["unaccumulated"] / 4, rel=1e-5)


def test_exports_and_ema_read_deepspeeds_fp32_master_weights(engine_results):
    assert engine_results["module_dtypes"] == ["torch.bfloat16"]
    assert engine_results["master_dtypes"] == ["torch.float32"]
    assert engine_results["master_rounds_to_module"] and engine_results["master_is_finer"]


def test_the_gradient_norm_comes_from_the_engine(engine_results):
    assert engine_results["grads_on_params"] == 0  # ZeRO-2 keeps no .grad on the parameters: nothing to read there
    assert engine_results["engine_norm"] > 0


def test_the_end_of_run_export_gathers_the_masters_on_the_gpu_after_lightnings_teardown(monkeypatch):
    """Every DeepSpeed run on an H100 ended in `RuntimeError: No backend type associated with device type
    cpu` at its export. Lightning's teardown had moved the module to the CPU (lightning 2.6.6 strategies/strategy.py
    :534-536) and DeepSpeed all-reduces a buffer shaped like the parameter, on the parameter's device (deepspeed
    0.19.8 utils/tensor_fragment.py:87-95), which NCCL refuses for CPU tensors. CUDA is mocked: the module's `to`
    records where it is sent, and the gather behaves as NCCL does, refusing unless the module is on the GPU."""
    import deepspeed.utils

    from neobert.lit.strategies import master_state_dict

    gpu = torch.device("cuda", 0)
    module = torch.nn.Linear(3, 2).bfloat16()  # where Lightning's teardown left it: on the CPU
    placed = {"device": torch.device("cpu")}
    moves = []

    def to(device):
        moves.append(torch.device(device))
        placed["device"] = torch.device(device)
        return module

    def nccl_gather(param):
        if placed["device"] != gpu:
            raise RuntimeError("No backend type associated with device type cpu")
        return torch.full(param.shape, 0.25)  # the fp32 master (on the CPU here: the mock has no GPU tensors)

    monkeypatch.setattr(module, "to", to)
    monkeypatch.setattr(deepspeed.utils, "safe_get_full_fp32_param", nccl_gather)
    strategy = NeoBERTDeepSpeedStrategy(parallel_devices=[gpu])
    state = master_state_dict(module, strategy)
    assert moves == [gpu, torch.device("cpu")]  # to the strategy's GPU for the gather, then back where it was
    assert all(value.dtype == torch.float32 and bool((value == 0.25).all()) for value in state.values())
    assert all(value.device.type == "cpu" for value in state.values())


def test_a_checkpoint_rewritten_in_place_has_no_latest_while_it_is_written(tmp_path):
    directory = tmp_path / "last.ckpt"
    (directory / "checkpoint").mkdir(parents=True)
    (directory / DEEPSPEED_LATEST).write_text("checkpoint")  # the previous save's mark
    seen = {}

    class Engine:
        def save_checkpoint(self, path, client_state, tag, exclude_frozen_parameters):
            seen["latest during the write"] = (Path(path) / DEEPSPEED_LATEST).exists()
            (Path(path) / DEEPSPEED_LATEST).write_text(tag)  # DeepSpeed writes it after every rank's files

    strategy = NeoBERTDeepSpeedStrategy()
    strategy.model = Engine()
    strategy.save_checkpoint({"global_step": 4}, directory)
    assert seen == {"latest during the write": False}
    assert (directory / DEEPSPEED_LATEST).read_text() == "checkpoint"


def test_bf16_mixed_clips_with_the_fused_optimizer():
    """Lightning's MixedPrecision refuses to clip for a fused AdamW, even in bf16 where nothing is
    scaled; ours clips (and in fp16 unscales first)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    from neobert.lit.strategies import ClippingMixedPrecision

    weights = torch.nn.Parameter(torch.ones(4))
    weights.grad = torch.full((4,), 3.0)
    optimizer = torch.optim.AdamW([weights], fused=True)
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        MixedPrecision("bf16-mixed", "cpu").clip_gradients(optimizer, 1.0)
    ClippingMixedPrecision("bf16-mixed", "cpu").clip_gradients(optimizer, 1.0)
    assert float(weights.grad.norm()) == pytest.approx(1.0, rel=1e-4)

    fp16 = ClippingMixedPrecision("16-mixed", "cpu")  # a GradScaler: the gradients are scaled until unscaled
    loss = (weights * 3).sum()
    weights.grad = None
    fp16.scaler.scale(loss).backward()
    scale = float(fp16.scaler.get_scale())
    assert float(weights.grad[0]) == pytest.approx(3 * scale)
    fp16.clip_gradients(optimizer, 1.0)
    assert float(weights.grad.norm()) == pytest.approx(1.0, rel=1e-4)  # clipped after unscaling, not before


REPLAY_SCRIPT = r'''
"""Each micro-batch's gradient handed back in one buffer that the next "replay" overwrites, as Inductor's CUDA graph
trees hand out a graph's outputs (a cached tensor: AccumulateGrad takes it over as param.grad); four micro-batches
accumulated by DeepSpeed's real engine under each ZeRO setting. Printed: whether the accumulated gradient is right."""
import json, os, sys
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import torch, deepspeed
torch.distributed.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
torch._C._set_cached_tensors_enabled(True)
ACCUMULATE = 4


class Replayed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(64))
        self.buffer = None

    def forward(self, x):
        module = self

        class Product(torch.autograd.Function):
            @staticmethod
            def forward(ctx, w):
                return (w * x).sum()

            @staticmethod
            def backward(ctx, grad):
                if module.buffer is None:
                    module.buffer = torch.empty(64, dtype=torch.bfloat16)
                    torch._C._add_cached_tensor(module.buffer)
                module.buffer.copy_(grad * x)  # the replay writes the same memory every time
                return module.buffer

        return Product.apply(self.w)


results = {}
for stage, contiguous, offload in ((1, True, False), (2, True, False), (2, False, False), (2, True, True)):
    net = Replayed()
    zero = {"stage": stage, "contiguous_gradients": contiguous, "overlap_comm": True}
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": ACCUMULATE, "bf16": {"enabled": True},
              "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True, "zero_optimization": zero}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        config["zero_force_ds_cpu_optimizer"] = False
    engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.0),
                                      dist_init_required=False, config=config)
    xs = [torch.full((64,), float(i + 1)) for i in range(ACCUMULATE)]
    for x in xs:
        engine.backward(engine(x.bfloat16()))
        engine.step()
    expected = float(torch.stack(xs).sum(0).norm()) / ACCUMULATE  # the engine divides the loss by the accumulation
    name = f"deepspeed_stage_{stage}" + "_offload" * offload
    results[f"{name} {contiguous}"] = abs(float(engine.get_global_grad_norm()) - expected) < 1e-3 * expected
print("RESULT" + json.dumps(results))
'''


def test_cuda_graphs_with_accumulation_are_allowed_exactly_where_deepspeed_copies_the_replayed_gradients_out(
        tmp_path):
    """model.compile_mode=reduce-overhead with accumulation is allowed for the DeepSpeed settings whose accumulated
    gradient stays right when every micro-batch's gradient comes in the same overwritten buffer (CUDA graph trees'
    outputs), and refused for the others."""
    from test_pretrain import tiny_config

    from neobert.config import ConfigError

    right = run_engine_script(REPLAY_SCRIPT, tmp_path)
    assert right == {"deepspeed_stage_1 True": False, "deepspeed_stage_2 True": True,
                     "deepspeed_stage_2 False": False, "deepspeed_stage_2_offload True": True}
    for case, correct in right.items():
        strategy, contiguous = case.split()
        keys = ("data.packing=best_fit", "model.compile=true", "model.compile_mode=reduce-overhead",
                "trainer.accumulate_grad_batches=4", f"trainer.strategy={strategy}",
                f"trainer.deepspeed.contiguous_gradients={contiguous.lower()}")
        if correct:
            tiny_config(tmp_path, *keys)
        else:
            with pytest.raises(ConfigError, match="model.compile_mode"):
                tiny_config(tmp_path, *keys)
