"""The MLM head over the masked rows: NeoBERT's decoder (768 -> 30,522) and its float32 cross-entropy, in
bf16, forward + backward, as the pretraining step runs them, and with the decoder padded for the matmuls only:

* as_is: `nn.Linear(768, 30522)` and `F.cross_entropy(logits.float())`, what `NeoBERTForMaskedLM` runs. On Hopper
  its three GEMMs run Ampere-generation CUTLASS kernels with 2-element alignment (`cutlass_80_..._align2`): 30,522
  is not a multiple of 8, so the logits' rows are not 16-byte aligned;
* padded: the same weight and bias with zero rows up to a multiple of 64 (30,528) for the matmul, the logits sliced
  back to 30,522 (`neobert.model.modeling.padded_linear`, what `NeoBERTConfig.decoder_pad_multiple=64` runs): what
  padding in the computation only (the checkpoint keeps its shape) costs (the padded copy of the weight, the
  zero-filled gradient of the slice) and gives (aligned GEMMs);
* compiled, padded_compiled: both under `torch.compile` (Inductor may pad or fuse on its own).

The head alone; run_checks.sh's step `check_decoder_as_is` measures the switch in the pretraining loop. Each on the
same rows, alternated, the median of `repeats`; and the loss's,
the rows' gradient's and the weight gradient's largest error against float32 on the same bf16 input, over the
float32 value's largest.

    python scripts/bench/decoder_ab.py [ROWS=6989] [REPEATS=20]     # CUDA when there is a GPU, else the CPU
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from neobert.instruments.ab import CallTime, compare, device_label, samples_described, seconds_per_call
from neobert.model import NeoBERTConfig
from neobert.model.heads import padded_linear

PAD_TO = 64  # rows of the padded decoder: a multiple of this (16-byte aligned bf16 rows, and whole GEMM tiles)


def as_is(decoder: nn.Linear, rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(decoder(rows).float(), targets)


def padded(decoder: nn.Linear, rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(padded_linear(rows, decoder.weight, decoder.bias, PAD_TO).float(), targets)


def forward_backward(run, decoder: nn.Linear, rows: torch.Tensor, targets: torch.Tensor):
    """(loss, the rows' gradient, the weight's gradient) of one forward + backward."""
    rows = rows.detach().requires_grad_()
    decoder.zero_grad(set_to_none=True)
    loss = run(decoder, rows, targets)
    loss.backward()
    return loss, rows.grad, decoder.weight.grad


def main(rows: int = 6989, repeats: int = 20) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = NeoBERTConfig.from_preset("neobert")
    torch.manual_seed(0)
    reference = nn.Linear(config.hidden_size, config.vocab_size).to(device)  # float32
    decoder = nn.Linear(config.hidden_size, config.vocab_size).to(device)
    decoder.load_state_dict(reference.state_dict())
    decoder.to(torch.bfloat16)
    hidden = torch.randn(rows, config.hidden_size, device=device).to(torch.bfloat16)
    targets = torch.randint(0, config.vocab_size, (rows,), device=device)
    variants = {"as_is": as_is, "padded": padded, "compiled": torch.compile(as_is),
                "padded_compiled": torch.compile(padded)}
    print(f"MLM decoder + cross-entropy forward + backward, {rows:,} rows x {config.hidden_size} -> "
          f"{config.vocab_size:,} (padded: {config.vocab_size + -config.vocab_size % PAD_TO:,}) bf16, "
          f"{device_label(device)}, torch {torch.__version__}, {samples_described(repeats)}")
    flops = 3 * 2 * rows * config.hidden_size * config.vocab_size  # the three GEMMs at the real vocabulary
    expected = [value.float() for value in forward_backward(as_is, reference, hidden.float(), targets)]

    def time_one(run) -> CallTime:
        return seconds_per_call(lambda: forward_backward(run, decoder, hidden, targets), device)

    def describe(run, median: float, reference_median: float) -> str:
        got = forward_backward(run, decoder, hidden, targets)
        loss, rows_grad, weight_grad = (((g.float() - e).abs().max() / e.abs().max()).item()
                                        for g, e in zip(got, expected))
        return (f"{median * 1e3:8.3f} ms  {flops / median / 1e12:6.1f} TFLOP/s  {reference_median / median:5.2f}x "
                f"as_is  max error vs float32: loss {loss:.2e}, rows gradient {rows_grad:.2e}, weight gradient "
                f"{weight_grad:.2e}")

    print("\n".join(compare(variants, time_one, describe, repeats, width=15)))


if __name__ == "__main__":
    main(*(int(arg) for arg in sys.argv[1:]))
