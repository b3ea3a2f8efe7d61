"""NeoBERT's RoPE over q and k of packed documents in bf16, forward + backward, each way it could run:

* eager: `neobert.model.rope.rotate_in_dtype`, the eager bf16 rotation off a GPU (q and k side by side in one
  pass over the fused projection's view: a copy for the swapped pairs, then a multiply and a fused multiply-add;
  on a GPU its `mul` and `addcmul` run PyTorch's non-vectorized elementwise kernel over the strided view, its `flip`
  an index kernel);
* complex: q and k copied to float32 and turned by one complex multiply, then cast back: the float32 path of
  `apply_rope` (the official code's arithmetic), which the model's eager bf16 rotation takes on a GPU;
* compiled: `apply_rope` under `torch.compile` (one fused kernel each way, computing in float32);
* quack: QuACK's `apply_rotary_emb` (Dao-AILab's CuTe DSL kernel, `quack-kernels`, which comes with
  scripts/gpu/prepare_fa4.sh's archive): `interleaved=True` rotates adjacent pairs, NeoBERT's layout (Liger's RoPE
  rotates halves, so it would need q and k permuted); `cu_seqlens` restarts positions per document; q and k in one
  call, as 128-wide vectors whose second half (k) takes the first half's frequencies again. Where it and a GPU are:
  a candidate, not a path of the model.

Each on the same view of a fused qkv projection, alternated, the median of `repeats`; and each output's and
gradient's largest error against the float32 rotation, over its largest value.

    python scripts/bench/rope_ab.py [TOKENS=32768] [REPEATS=20]     # CUDA when there is a GPU, else the CPU
"""

from __future__ import annotations

import sys

import torch

from neobert.instruments.ab import (CallTime, compare, device_label, optional_attribute, samples_described,
                                    seconds_per_call)
from neobert.model import NeoBERTConfig
from neobert.model.attention import position_ids_from_cu_seqlens
from neobert.model.rope import RotaryTables, apply_rope, rope_tables, rotate_in_dtype

DOCUMENT = 512  # tokens per packed document


def timed(rotate, qk, grad) -> CallTime:
    """Seconds per forward + backward (`seconds_per_call`), each on a fresh leaf."""
    return seconds_per_call(lambda: rotate(qk.detach().requires_grad_()).backward(grad), qk.device)


def errors(rotate, reference, qk, grad) -> tuple[float, float]:
    """Largest |value - float32's| over float32's largest: the output, and the gradient."""
    def forward_backward(rotate, qk, grad):
        qk = qk.detach().requires_grad_()
        out = rotate(qk)
        out.backward(grad)
        return out.float(), qk.grad.float()

    got = forward_backward(rotate, qk, grad)
    expected = forward_backward(reference, qk.float(), grad.float())
    return tuple(((g - e).abs().max() / e.abs().max()).item() for g, e in zip(got, expected))


def interleaved_tables(head_dim: int, length: int, theta: float,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), float32 [length, head_dim]: by position, the table of flash-attn's and QuACK's interleaved rotary
    (pair i of a vector turned by angle [position, i]) for q and k side by side as one 2 x head_dim vector, k's half
    repeating q's frequencies (tests/test_bench_scripts.py checks it against `apply_rope`)."""
    by_position = rope_tables(head_dim, torch.arange(length, device=device), theta).repeat(1, 2, 1)
    return by_position[..., 0].contiguous(), by_position[..., 1].contiguous()


def main(tokens: int = 32768, repeats: int = 20) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if tokens % DOCUMENT:  # every token in a document: QuACK leaves rows past the last cu_seqlens unwritten
        raise ValueError(f"TOKENS must be a multiple of {DOCUMENT}, got {tokens}")
    config = NeoBERTConfig.from_preset("neobert")
    heads, head_dim = config.num_attention_heads, config.head_dim
    torch.manual_seed(0)
    qkv = torch.randn(tokens, heads, 3 * head_dim, device=device).to(torch.bfloat16)  # the model's fused projection
    qk = qkv[..., : 2 * head_dim]  # the strided view the model rotates
    grad = torch.randn(tokens, heads, 2 * head_dim, device=device).to(torch.bfloat16)
    cu_seqlens = torch.arange(0, tokens + 1, DOCUMENT, device=device, dtype=torch.int32)
    positions = position_ids_from_cu_seqlens(cu_seqlens, tokens)
    tables = RotaryTables.side_by_side(rope_tables(head_dim, positions, config.rope_theta), 2)

    def in_dtype(x):
        return rotate_in_dtype(x, tables)

    def as_the_model_does(x):  # float32: the complex multiply, the errors' reference
        return apply_rope(x, tables)

    def complex_rotation(x):
        return apply_rope(x.float(), tables).type_as(x)

    variants = {"eager": in_dtype, "complex": complex_rotation, "compiled": torch.compile(as_the_model_does)}
    print(f"RoPE forward + backward of q and k, {tokens:,} tokens in documents of {DOCUMENT} x {heads} heads x "
          f"{head_dim}, bf16, {device_label(device)}, torch {torch.__version__}, {samples_described(repeats)}")

    def measure(rotations: dict) -> None:
        """Times `rotations` in alternation with eager and prints each: time, ratio, errors."""
        def describe(rotate, median: float, eager: float) -> str:
            output, gradient = errors(rotate, as_the_model_does, qk, grad)
            return (f"{median * 1e3:8.3f} ms  {eager / median:5.2f}x eager  max error vs float32: output "
                    f"{output:.2e}, gradient {gradient:.2e}")

        print("\n".join(compare({"eager": in_dtype, **rotations}, lambda rotate: timed(rotate, qk, grad), describe,
                                repeats, width=9)))

    measure(variants)
    if device.type == "cuda":  # QuACK, a candidate in an alternation of its own: failing or stalling costs its row
        apply_rotary_emb, why = optional_attribute("quack.rotary", "apply_rotary_emb")
        if apply_rotary_emb is None:
            print(f"  {'quack':9s} not measured: {why}")
        else:
            cos, sin = interleaved_tables(head_dim, DOCUMENT, config.rope_theta, device)
            measure({"quack": lambda x: apply_rotary_emb(x, cos, sin, interleaved=True, cu_seqlens=cu_seqlens,
                                                         max_seqlen=DOCUMENT)})


if __name__ == "__main__":
    main(*(int(arg) for arg in sys.argv[1:]))
