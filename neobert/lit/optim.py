"""Optimizers and learning-rate schedules of every job, from the shared `optimizer` and `scheduler` config
sections: AdamW (or the M0 baseline's Adam) with weight decay on matrices only, StableAdamW (torch-optimi), or Muon
on the hidden matrices with AdamW on the rest; linear warm-up, then the paper's cosine decay (pretraining),
warmup-stable-decay (wsd) or a linear decay to 0 (fine-tuning)."""

from __future__ import annotations

import math
from typing import Callable

import torch
from optimi import StableAdamW
from torch import nn

from neobert.config import OptimizerConfig, SchedulerConfig


def parameter_groups(model: nn.Module, weight_decay: float, decay_norms_biases_embeddings: bool = False,
                     params=None):
    """Weight decay on matrices only: norms, biases and embeddings are excluded unless asked for. `params`: only
    these of the model's parameters (default: all)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for param in (model.parameters() if params is None else params):
        if not param.requires_grad:
            continue
        exempt = param.ndim < 2 or id(param) in embeddings
        (no_decay if exempt and not decay_norms_biases_embeddings else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_adamw(model: nn.Module, lr: float, weight_decay: float, betas=(0.9, 0.95), eps: float = 1e-8,
                decay_norms_biases_embeddings: bool = False) -> torch.optim.AdamW:
    groups = parameter_groups(model, weight_decay, decay_norms_biases_embeddings)
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, fused=fusable(groups))


def fusable(groups) -> bool | None:
    """Whether the fused (one kernel for all tensors) Adam/AdamW applies: faster than PyTorch's default per-tensor
    loop on CPU as on GPU (docs/benchmarks.md)."""
    return all(p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point
               for g in groups for p in g["params"]) or None


def warmup_cosine(warmup_steps: int, total_steps: int, decay_fraction: float = 0.9,
                  final_ratio: float = 0.1) -> Callable[[int], float]:
    """Multiplier of the peak lr: linear from 0 over `warmup_steps`, cosine down to `final_ratio` at
    `decay_fraction * total_steps`, constant after (the paper's pretraining schedule)."""
    decay_end = max(int(decay_fraction * total_steps), warmup_steps + 1)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return step / warmup_steps
        if step >= decay_end:
            return final_ratio
        progress = (step - warmup_steps) / (decay_end - warmup_steps)
        return final_ratio + (1.0 - final_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def warmup_linear(warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """GLUE fine-tuning: linear warm-up then linear decay to 0 at `total_steps`."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return step / warmup_steps
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))

    return factor


def warmup_stable_decay(warmup_steps: int, decay_start: float, total_steps: int, shape: str = "1-sqrt",
                        final_ratio: float = 0.0) -> Callable[[int], float]:
    """Warmup-stable-decay: linear from 0 over `warmup_steps`, the peak until `decay_start` (math.inf: never),
    then down to `final_ratio` at `total_steps` along `shape` (linear, cosine or 1-sqrt, where the progress p runs
    from 0 to 1: 1 - p, (1 + cos(pi p)) / 2, 1 - sqrt(p)), constant after. The value at a step depends on that
    step alone, so a stable phase can be extended and a decay branched from any of its steps."""
    shapes = {"linear": lambda p: 1.0 - p, "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),
              "1-sqrt": lambda p: 1.0 - math.sqrt(p)}
    decay = shapes[shape]

    def factor(step: int) -> float:
        if step < warmup_steps:
            return step / warmup_steps
        if step < decay_start:
            return 1.0
        if step >= total_steps:
            return final_ratio
        progress = (step - decay_start) / (total_steps - decay_start)
        return final_ratio + (1.0 - final_ratio) * decay(progress)

    return factor


def build_optimizer(model: nn.Module, config: OptimizerConfig) -> torch.optim.Optimizer:
    if config.name == "adamw":
        return build_adamw(model, config.lr, config.weight_decay, config.betas, config.eps,
                           config.decay_norms_biases_embeddings)
    if config.name == "muon":
        return build_muon(model, config)
    groups = parameter_groups(model, config.weight_decay, config.decay_norms_biases_embeddings)
    if config.name == "stable_adamw":
        # decouple_lr=False: AdamW's weight decay (scaled by the lr), so optimizer.weight_decay means the same
        optimizer = StableAdamW(groups, lr=config.lr, betas=tuple(config.betas), eps=config.eps,
                                weight_decay=config.weight_decay, triton=None if on_cuda(groups) else False)
        optimizer.register_load_state_dict_post_hook(no_triton_off_cuda)
        return optimizer
    # Adam with coupled L2 decay (the M0 baseline)
    return torch.optim.Adam(groups, lr=config.lr, betas=tuple(config.betas), eps=config.eps, fused=fusable(groups))


def on_cuda(groups: list[dict]) -> bool:
    return all(param.is_cuda for group in groups for param in group["params"])


def no_triton_off_cuda(optimizer: torch.optim.Optimizer) -> None:
    """torch-optimi 0.3.3 chooses its Triton kernels on the parameters it has gathered at the first step, an empty
    list then (optimi/stableadamw.py:150-151, `_default_to_triton(params)` before the loop that fills `params`),
    so whenever Triton is installed it picks them for CPU parameters too, and fails ("Pointer argument ... cannot
    be accessed from Triton (cpu tensor?)"): a CPU run on a GPU machine. Off CUDA the choice is made here (no
    Triton), also after a checkpoint written on a GPU restores the groups' `triton` flag."""
    if not on_cuda(optimizer.param_groups):
        for group in optimizer.param_groups:
            group["triton"] = False


def muon_split(model: nn.Module) -> tuple[dict[str, nn.Parameter], dict[str, nn.Parameter]]:
    """(Muon's parameters, AdamW's), by name. Muon takes the hidden matrices: the weights of the nn.Linear layers
    inside the model's repeated blocks (every nn.ModuleList: NeoBERT's transformer_encoder, a Hugging Face BERT's
    encoder.layer), i.e. NeoBERT's qkv, wo, w12 and w3 (the fused qkv is one matrix, as stored: Muon
    orthogonalises it whole, which keeps the three projections' update scales tied). AdamW takes the rest: token
    embeddings, the MLM decoder, pooler and classification heads, norms and biases."""
    hidden = {id(layer.weight) for blocks in model.modules() if isinstance(blocks, nn.ModuleList)
              for layer in blocks.modules() if isinstance(layer, nn.Linear)}
    muon, adamw = {}, {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            (muon if id(param) in hidden and param.ndim == 2 else adamw)[name] = param
    return muon, adamw


class MuonWithAdamW(torch.optim.Optimizer):
    """torch.optim.Muon on the hidden matrices and AdamW on the rest (`muon_split`), stepped together as one
    optimizer, so the lr schedulers, Lightning's clipping and checkpoints see one object: `param_groups` are both
    optimizers' groups (the same dicts), `state_dict` holds both."""

    def __init__(self, muon: torch.optim.Muon, adamw: torch.optim.AdamW):
        self.muon, self.adamw = muon, adamw
        super().__init__([p for g in muon.param_groups + adamw.param_groups for p in g["params"]], {})
        self.param_groups = muon.param_groups + adamw.param_groups

    @property
    def state(self):  # read by Lightning to move the state between devices
        return {**self.muon.state, **self.adamw.state}

    @state.setter
    def state(self, value) -> None:  # Optimizer.__init__ sets an empty one; the inner optimizers hold the state
        pass

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])


def build_muon(model: nn.Module, config: OptimizerConfig) -> MuonWithAdamW:
    """Muon with its update scaled to AdamW's update RMS (`adjust_lr_fn="match_rms_adamw"`: 0.2 x sqrt(max(rows,
    columns)), Moonshot's convention), so one lr serves both groups and AdamW's lr and weight decay carry over."""
    muon_params, adamw_params = muon_split(model)
    muon = torch.optim.Muon(list(muon_params.values()), lr=config.muon_lr or config.lr,
                            weight_decay=config.weight_decay if config.muon_weight_decay is None
                            else config.muon_weight_decay,
                            momentum=config.muon_momentum, adjust_lr_fn="match_rms_adamw")
    groups = parameter_groups(model, config.weight_decay, config.decay_norms_biases_embeddings,
                              params=adamw_params.values())  # decay on matrices only, as build_adamw
    groups = [g for g in groups if g["params"]]
    adamw = torch.optim.AdamW(groups, lr=config.lr, betas=tuple(config.betas), eps=config.eps, fused=fusable(groups))
    return MuonWithAdamW(muon, adamw)


def lr_factor(config: SchedulerConfig, total_steps: int, start_step: int = 0) -> Callable[[int], float]:
    """The multiplier of the peak lr at each optimizer step; `start_step` is where a wsd decay branch starts."""
    warmup = config.warmup(total_steps)
    if config.name == "wsd":
        return warmup_stable_decay(warmup, config.decay_start(total_steps, start_step), total_steps,
                                   config.decay_shape, config.final_ratio)
    if config.name == "cosine":
        return warmup_cosine(warmup, total_steps, config.decay_fraction, config.final_ratio)
    return warmup_linear(warmup, total_steps)


def configure_optimizers(model: nn.Module, optimizer: OptimizerConfig, scheduler: SchedulerConfig,
                         total_steps: int, start_step: int = 0, first_step: int = 0) -> dict:
    """What a LightningModule's `configure_optimizers` returns: the optimizer and its per-step schedule over
    `total_steps` optimizer steps (`start_step`: see lr_factor) that begins at global step `first_step` (a phase
    of a phased recipe with a schedule of its own; both other steps count from there)."""
    built = build_optimizer(model, optimizer)
    factor = lr_factor(scheduler, total_steps, start_step)
    # max: LambdaLR evaluates step 0 when it is built, before a phase's checkpoint restores the step count
    schedule = torch.optim.lr_scheduler.LambdaLR(built, lambda step: factor(max(0, step - first_step)))
    return {"optimizer": built, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
