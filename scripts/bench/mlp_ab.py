"""NeoBERT's SwiGLU MLP (768 -> 2 x 2,048 -> 768) in bf16, forward + backward, each way it could run:

* eager: `neobert.model.layers.SwiGLU`, PyTorch's matmuls with silu(gate) * up between them (elementwise kernels
  over the 2 x 2,048-wide activation);
* compiled: the same module under `torch.compile` (Inductor fuses the elementwise work, not into the matmuls);
* liger: `kernels=liger` (Liger-Kernel's fused SwiGLU between the same matmuls), where liger-kernel and a GPU are;
* quack: `kernels=quack`, QuACK's `mlp_func` (Dao-AILab's CuTe DSL GEMMs with SwiGLU fused into the first GEMM's
  epilogue forward and its gradient into the backward GEMM's; `quack-kernels`, which comes with
  scripts/gpu/prepare_fa4.sh's archive) on the same weights (`concat_layout`: gate then up, as `w12` stacks them),
  where it and a GPU are (`neobert.model.kernels.quack_swiglu_mlp`). Untuned (`tuned=False`, QuACK's default tile
  for the GPU's generation): its autotuner compiles dozens of configurations per GEMM, minutes per shape.
* quack_compiled: the same under `torch.compile` (QuACK's GEMMs are custom ops Dynamo traces), as the model's
  compiled blocks run it.

Each on the same rows, alternated, the median of `repeats`; and each output's, input gradient's and w12 gradient's
largest error against float32 on the same bf16 input, over the float32 value's largest (a wrong weight layout
would show here as an error near 1).

    python scripts/bench/mlp_ab.py [ROWS=32768] [REPEATS=20]     # CUDA when there is a GPU, else the CPU
"""

from __future__ import annotations

import sys

import torch

from neobert.instruments.ab import (CallTime, compare, device_label, optional_attribute, samples_described,
                                    seconds_per_call)
from neobert.model import NeoBERTConfig
from neobert.model.kernels import liger_missing_reason
from neobert.model.layers import SwiGLU


def timed(run, module, x, grad) -> CallTime:
    """Seconds per forward + backward (`seconds_per_call`), each from cleared gradients."""
    def step():
        module.zero_grad(set_to_none=True)
        run(module, x.detach().requires_grad_()).backward(grad)

    return seconds_per_call(step, x.device)


def errors(run, module, reference, x, grad) -> tuple[float, float, float]:
    """Largest |value - float32's| over float32's largest: the output, x's gradient, w12's gradient."""
    def forward_backward(run, module, x, grad):
        x = x.detach().requires_grad_()
        module.zero_grad(set_to_none=True)
        out = run(module, x)
        out.backward(grad)
        return out.float(), x.grad.float(), module.w12.weight.grad.float()

    got = forward_backward(run, module, x, grad)
    expected = forward_backward(lambda m, x: m(x), reference, x.float(), grad.float())
    return tuple(((g - e).abs().max() / e.abs().max()).item() for g, e in zip(got, expected))


def main(rows: int = 32768, repeats: int = 20) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = NeoBERTConfig.from_preset("neobert")
    torch.manual_seed(0)
    reference_mlp = SwiGLU(config.hidden_size, config.ffn_hidden_size).to(device)  # float32
    x = torch.randn(rows, config.hidden_size, device=device).to(torch.bfloat16)
    grad = torch.randn(rows, config.hidden_size, device=device).to(torch.bfloat16)

    def module(kernels: str = "eager") -> SwiGLU:
        copy = SwiGLU(config.hidden_size, config.ffn_hidden_size, kernels=kernels).to(device)
        copy.load_state_dict(reference_mlp.state_dict())
        return copy.to(torch.bfloat16)

    variants = {"eager": (module(), lambda m, x: m(x))}
    variants["compiled"] = (torch.compile(module()), lambda m, x: m(x))
    liger_missing = liger_missing_reason() if device.type == "cuda" else None
    if device.type == "cuda" and liger_missing is None:
        variants["liger"] = (module("liger"), lambda m, x: m(x))
    print(f"SwiGLU MLP forward + backward, {rows:,} x {config.hidden_size} -> 2 x {config.ffn_hidden_size} bf16, "
          f"{device_label(device)}, torch {torch.__version__}, {samples_described(repeats)}")
    # the two matmuls' FLOPs, forward (2 per multiply-add) and backward (twice the forward)
    flops = 3 * 2 * rows * config.hidden_size * 3 * config.ffn_hidden_size

    def measure(mlps: dict) -> None:
        """Times `mlps` in alternation with eager and prints each: time, TFLOP/s, ratio, errors."""
        def describe(variant, median: float, eager: float) -> str:
            mlp, run = variant
            output, input_grad, w12_grad = errors(run, mlp, reference_mlp, x, grad)
            return (f"{median * 1e3:8.3f} ms  {flops / median / 1e12:6.1f} TFLOP/s  {eager / median:5.2f}x eager  "
                    f"max error vs float32: output {output:.2e}, x gradient {input_grad:.2e}, w12 gradient "
                    f"{w12_grad:.2e}")

        def time_one(variant) -> CallTime:
            mlp, run = variant
            return timed(run, mlp, x, grad)

        print("\n".join(compare({"eager": variants["eager"], **mlps}, time_one, describe, repeats, width=14)))

    measure(variants)
    if liger_missing:
        print(f"  {'liger':14s} not measured: {liger_missing}")
    if device.type == "cuda":  # QuACK, a candidate in an alternation of its own: failing or stalling costs its row
        mlp_func, why = optional_attribute("quack.mlp", "mlp_func")
        if mlp_func is None:
            print(f"  {'quack':14s} not measured: {why}")
        else:  # beside compiled eager, what kernels=quack would replace (its ratio in the same alternation)
            measure({"compiled": variants["compiled"], "quack": (module("quack"), lambda m, x: m(x)),
                     "quack_compiled": (torch.compile(module("quack")), lambda m, x: m(x))})


if __name__ == "__main__":
    main(*(int(arg) for arg in sys.argv[1:]))
