"""Lightning strategies and precision plugins as our runs need them, each fixing a way the library defaults would
fail on the paper's recipe (docs/pretraining.md, "First GPU run"):

* `ClippingMixedPrecision`: Lightning's `MixedPrecision` refuses to clip gradients for an optimizer that unscales
  inside its `step` (`_step_supports_amp_scaling`: the fused AdamW every job uses), even in bf16-mixed where
  nothing is scaled. Here bf16 clips as in fp32; fp16 unscales first (GradScaler.unscale_, which the fused step
  then respects), so clipping sees the true gradients.
* `DeepSpeedPrecisionOnce`: Lightning's automatic optimization already divides the loss by
  `accumulate_grad_batches`; DeepSpeed's `engine.backward` divides it again by its `gradient_accumulation_steps`
  unless told not to (`scale_wrt_gas`). Once is right.
* `NeoBERTDeepSpeedStrategy`: Lightning's DeepSpeed strategy with the micro-batch size given (Lightning would read
  it from `train_dataloader.batch_sampler.batch_size`, which a DataLoader of ready batches, `batch_size=None`, does
  not have), the precision plugin above, and a checkpoint rewritten in place (last.ckpt) made unreadable for the
  duration of the write (its `latest` file removed first), so that a kill mid-save is never resumed from.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.precision import DeepSpeedPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy, Strategy, StrategyRegistry
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from neobert.config import DeepSpeedConfig

DEEPSPEED_LATEST = "latest"  # written by DeepSpeed after every rank's files: the mark of a complete checkpoint


class ClippingMixedPrecision(MixedPrecision):
    def clip_gradients(self, optimizer, clip_val: int | float = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        if clip_val > 0 and self.scaler is not None and getattr(optimizer, "_step_supports_amp_scaling", False):
            # fp16 with a fused optimizer: Lightning left the gradients scaled for the optimizer to unscale
            self.scaler.unscale_(optimizer)
        Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)


class DeepSpeedPrecisionOnce(DeepSpeedPrecision):
    def backward(self, tensor: torch.Tensor, model, optimizer, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("scale_wrt_gas", False)  # Lightning has divided by the accumulation already
        super().backward(tensor, model, optimizer, *args, **kwargs)


class NeoBERTDeepSpeedStrategy(DeepSpeedStrategy):
    def save_checkpoint(self, checkpoint: dict, filepath, storage_options: Any | None = None) -> None:
        filepath = self.broadcast(filepath)
        if self.is_global_zero:  # the directory's old `latest` would vouch for a half-rewritten checkpoint
            with contextlib.suppress(FileNotFoundError):
                (Path(filepath) / DEEPSPEED_LATEST).unlink()
        self.barrier("neobert_deepspeed_unmark")
        super().save_checkpoint(checkpoint, filepath, storage_options)


def is_deepspeed(strategy: str | Strategy) -> bool:
    return isinstance(strategy, DeepSpeedStrategy) or (isinstance(strategy, str) and strategy.startswith("deepspeed"))


# Lightning precision -> the dtype of the weights a loop holds, and of its autocast (neobert.lit.strategies.loop_dtypes)
AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
WEIGHT_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16}
# DeepSpeed's bf16/fp16: its engine casts the module's weights, and Lightning's DeepSpeedPrecision adds no autocast
DEEPSPEED_WEIGHT_DTYPES = {"bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16, "16-mixed": torch.float16,
                           "16-true": torch.float16}


def loop_dtypes(strategy: str, precision: str) -> tuple[torch.dtype, torch.dtype | None]:
    """(weights, autocast) a training loop under `strategy` and Lightning `precision` computes with on its GPUs:
    DeepSpeed's half precision holds half-precision weights without autocast (its engine casts the module); FSDP2
    under bf16-mixed gathers bf16 weights under autocast (`fsdp2_mixed_precision`); otherwise (one device, DDP)
    *-true holds its dtype's weights and *-mixed float32 weights under autocast."""
    if is_deepspeed(strategy) and precision in DEEPSPEED_WEIGHT_DTYPES:
        return DEEPSPEED_WEIGHT_DTYPES[precision], None
    if strategy == "fsdp2" and precision == "bf16-mixed":
        return torch.bfloat16, torch.bfloat16
    return WEIGHT_DTYPES.get(precision, torch.float32), AUTOCAST_DTYPES.get(precision)


def loop_compute_dtype(strategy: str, precision: str) -> torch.dtype:
    """The dtype a training loop's matmuls compute in (`loop_dtypes`): its autocast's, else its weights'."""
    weights, autocast = loop_dtypes(strategy, precision)
    return autocast or weights


def deepspeed_strategy(name: str, precision: str, micro_batch_size: int | None = None,
                       tuning: DeepSpeedConfig | None = None) -> NeoBERTDeepSpeedStrategy:
    """Lightning's registered DeepSpeed strategy `name` (deepspeed_stage_2, ..._offload, ...) with its own settings
    and those of `tuning` (trainer.deepspeed) over them, our precision plugin, and `micro_batch_size` as DeepSpeed's
    `train_micro_batch_size_per_gpu` (None: Lightning reads it from the DataLoader, which works for DataLoaders
    that batch)."""
    if name not in StrategyRegistry or not issubclass(StrategyRegistry[name]["strategy"], DeepSpeedStrategy):
        raise ValueError(f"{name!r} is not a registered DeepSpeed strategy")
    tuning = tuning or DeepSpeedConfig()
    settings = {**StrategyRegistry[name]["init_params"], **tuning.strategy_settings()}
    if micro_batch_size is not None:
        settings["logging_batch_size_per_gpu"] = micro_batch_size
    strategy = NeoBERTDeepSpeedStrategy(precision_plugin=DeepSpeedPrecisionOnce(precision), **settings)
    if precision.startswith("bf16"):  # Lightning writes {"enabled": True} only where no "bf16" section exists
        strategy.config["bf16"] = {"enabled": True, "check_grad_overflow": tuning.check_grad_overflow}
    return strategy


class DataParallelFSDP2Strategy(ModelParallelStrategy):
    """Lightning's ModelParallelStrategy with every rank data-parallel (the LightningModule applies `fully_shard`
    in configure_model). Its "auto" data-parallel size is the node count (lightning `strategies/model_parallel.py`,
    setup_environment), meant for tensor parallelism within a node: with tensor_parallel_size=1 any run of more
    than one GPU per node failed at setup ("... multiplied should equal the world size")."""

    def __init__(self) -> None:
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1)

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes  # known here: devices resolved, even "auto"
        super().setup_environment()


def fsdp2_strategy() -> ModelParallelStrategy:
    """Data-parallel FSDP2 over every GPU of every node."""
    return DataParallelFSDP2Strategy()


def fsdp2_mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """FSDP2's policy for a Lightning precision: bf16 parameters and fp32 gradient reduction under bf16-mixed
    (the fp32 shards stay the optimizer's master weights); FSDP2's default (no casting) otherwise."""
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def fsdp2_shard(model: torch.nn.Module, blocks: Iterable[torch.nn.Module], mesh: DeviceMesh, precision: str) -> None:
    """FSDP2 in a LightningModule's configure_model (the strategy's `device_mesh["data_parallel"]` as `mesh`): shard
    every block, then the rest of `model`. Under bf16-mixed the shards are gathered and computed in bf16 and the
    gradients reduced in fp32 (without a policy FSDP2 would move fp32 over the wire both ways); the fp32 shards stay
    the optimizer's."""
    policy = fsdp2_mixed_precision(precision)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def mixed_precision_plugin(precision: str, on_cpu: bool) -> ClippingMixedPrecision | None:
    """The AMP plugin for bf16-mixed / 16-mixed runs of strategies that use Lightning's MixedPrecision (single
    device, DDP, fsdp2); None for other precisions. On CPU, Lightning runs 16-mixed as bf16-mixed."""
    if precision not in ("16-mixed", "bf16-mixed"):
        return None
    if on_cpu:
        return ClippingMixedPrecision("bf16-mixed", "cpu")
    return ClippingMixedPrecision(precision, "cuda")


def master_state_dict(module: torch.nn.Module, strategy: Strategy | None) -> dict[str, torch.Tensor]:
    """`module.state_dict()` with every parameter at full precision. Under DeepSpeed with bf16 the module's
    parameters are bf16 copies and the fp32 master weights live in the ZeRO optimizer's partitions: they are
    gathered here (`safe_get_full_fp32_param`, a collective: every rank must call this), on the strategy's device
    (`module_on_device`), and returned on the device the module was on."""
    state = module.state_dict()
    if not isinstance(strategy, DeepSpeedStrategy):
        return state
    from deepspeed.utils import safe_get_full_fp32_param  # deepspeed: an optional GPU dependency

    with module_on_device(module, strategy.root_device):
        for name, param in module.named_parameters():
            master = safe_get_full_fp32_param(param)
            if master is not None:  # None: a parameter the optimizer does not hold (frozen)
                state[name] = master.to(state[name].device)
    return state


@contextlib.contextmanager
def module_on_device(module: torch.nn.Module, device: torch.device):
    """The module on `device` for the duration, back where it was after. Why: when `trainer.fit` returns, Lightning's
    teardown has moved the module to the CPU (lightning 2.6.6 `Strategy.teardown`, strategies/strategy.py:534-536,
    reached from DeepSpeedStrategy through DDPStrategy.teardown), while DeepSpeed's fp32 masters stay on the GPU in
    the ZeRO optimizer. `safe_get_full_fp32_param` all-reduces a buffer made with `zeros_like(param)` (deepspeed
    0.19.8 utils/tensor_fragment.py:87-95), so on CPU parameters NCCL raised "No backend type associated with device
    type cpu" at every DeepSpeed run's end-of-run export."""
    where = next(module.parameters()).device
    if where == device:
        yield module
        return
    module.to(device)
    try:
        yield module
    finally:
        module.to(where)


def deepspeed_grad_norm(strategy: Strategy) -> torch.Tensor | float | None:
    """The global gradient norm of the last optimizer step as DeepSpeed computed it (before clipping). Under ZeRO
    the parameters' `.grad` are None or one rank's slice, so it cannot be computed from them."""
    if not isinstance(strategy, DeepSpeedStrategy):
        return None
    return strategy.deepspeed_engine.get_global_grad_norm()
