"""RMSNorm in bf16, forward + backward, each way the model can run it (docs/benchmarks.md):

* PyTorch's `F.rms_norm`: on CUDA its fused kernel (aten::_fused_rms_norm, one kernel each way, float32
  accumulation), what the model runs on CUDA since this script was written; on a CPU a float32 round trip;
* `rms_norm_in_dtype`: the model's eager CPU path (no float32 copy of x), a chain of kernels on a GPU;
* Liger-Kernel's RMSNorm (`kernels=liger`), where liger-kernel and a GPU are there;
* QuACK's RMSNorm (Dao-AILab's CuTe DSL kernels, `quack-kernels`: flash-attn-4 depends on it, so it comes with
  scripts/gpu/prepare_fa4.sh's archive), where it and a GPU are there: a candidate, not a path of the model.

Each on the same rows, alternated, the median of `repeats`; and each output's and input gradient's largest error
against float32 on the same bf16 input.

    python scripts/bench/norm_ab.py [ROWS=32768] [REPEATS=20]     # CUDA when there is a GPU, else the CPU
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from neobert.instruments.ab import (CallTime, compare, device_label, optional_attribute, samples_described,
                                    seconds_per_call)
from neobert.model.kernels import liger_missing_reason, liger_rms_norm
from neobert.model.layers import rms_norm_in_dtype

HIDDEN, EPS = 768, 1e-5


def timed(norm, x, weight, grad) -> CallTime:
    """Seconds per forward + backward (`seconds_per_call`), each on fresh leaves."""
    return seconds_per_call(lambda: norm(x.detach().requires_grad_(), weight.detach().requires_grad_()).backward(grad),
                            x.device)


def errors(norm, x, weight, grad) -> tuple[float, float]:
    """Largest |output - float32| and |input gradient - float32's|, both over the float32 value's largest."""
    x16, w16 = x.detach().requires_grad_(), weight.detach().requires_grad_()
    out = norm(x16, w16)
    out.backward(grad)
    x32, w32 = x.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    expected = F.rms_norm(x32, (HIDDEN,), w32, EPS)
    expected.backward(grad.float())
    return ((out.float() - expected).abs().max() / expected.abs().max()).item(), \
        ((x16.grad.float() - x32.grad).abs().max() / x32.grad.abs().max()).item()


def main(rows: int = 32768, repeats: int = 20) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    x = (torch.randn(rows, HIDDEN, device=device) * 4).to(torch.bfloat16)
    weight = torch.empty(HIDDEN, device=device).uniform_(0.5, 1.5).to(torch.bfloat16)
    grad = torch.randn(rows, HIDDEN, device=device).to(torch.bfloat16)
    variants = {"F.rms_norm": lambda x, w: F.rms_norm(x, (HIDDEN,), w, EPS),
                "rms_norm_in_dtype": lambda x, w: rms_norm_in_dtype(x, w, EPS)}
    liger_missing = liger_missing_reason() if device.type == "cuda" else None
    if device.type == "cuda" and liger_missing is None:
        variants["liger"] = lambda x, w: liger_rms_norm(x, w, EPS)
    print(f"RMSNorm forward + backward, {rows:,} x {HIDDEN} bf16, {device_label(device)}, "
          f"torch {torch.__version__}, {samples_described(repeats)}")

    def measure(norms: dict) -> None:
        """Times `norms` in alternation with the reference and prints each: time, ratio, errors."""
        def describe(norm, median: float, reference: float) -> str:
            output_error, gradient_error = errors(norm, x, weight, grad)
            return (f"{median * 1e3:8.3f} ms  {reference / median:5.2f}x rms_norm_in_dtype  max error vs float32: "
                    f"output {output_error:.2e}, input gradient {gradient_error:.2e}")

        print("\n".join(compare({"rms_norm_in_dtype": variants["rms_norm_in_dtype"], **norms},
                                lambda norm: timed(norm, x, weight, grad), describe, repeats, width=18)))

    measure(variants)
    if liger_missing:
        print(f"  {'liger':18s} not measured: {liger_missing}")
    if device.type == "cuda":  # QuACK, a candidate in an alternation of its own: failing or stalling costs its row
        quack_rmsnorm, why = optional_attribute("quack", "rmsnorm")
        if quack_rmsnorm is None:
            print(f"  {'quack':18s} not measured: {why}")
        else:  # beside F.rms_norm, the eager CUDA path it would replace (its ratio in the same alternation)
            measure({"F.rms_norm": variants["F.rms_norm"], "quack": lambda x, w: quack_rmsnorm(x, w, eps=EPS)})


if __name__ == "__main__":
    main(*(int(arg) for arg in sys.argv[1:]))
