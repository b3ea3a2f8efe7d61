"""The A/B scripts (scripts/bench; a GPU machine runs run_checks.sh's steps `norms`, `mlp`, `rope`): their one timer
(neobert.instruments.ab.alternate) warms up, alternates, keeps medians and leaves out a candidate that fails; each script
runs on CPU at a small size and prints every variant there (with its errors against float32 where it checks them: a
script broken here would cost minutes on a GPU); and the rotary tables QuACK's candidate gets turn q and k as the
model does."""

from __future__ import annotations

import importlib.machinery
import runpy
import statistics
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from transformers import BertConfig

from neobert.instruments import ab
from neobert.instruments.ab import alternate, compare, optional_attribute, seconds_per_call
from neobert.model import NeoBERTConfig
from neobert.model.attention import position_ids_from_cu_seqlens
from neobert.model.rope import RotaryTables, apply_rope, rope_tables
from test_attention_kernels import install_flash_attn_4

BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench"


def bench(name: str) -> dict:
    return runpy.run_path(str(BENCH / f"{name}.py"), run_name="bench")


def test_alternate_warms_up_then_alternates_keeps_medians_and_leaves_out_a_failing_candidate():
    calls = []

    def variant(name, seconds, fails=False):
        def run():
            calls.append(name)
            if fails:
                raise RuntimeError("no kernel for this GPU")
            return seconds.pop(0) if len(seconds) > 1 else seconds[0]
        return run

    medians, failed, shares = alternate({"a": variant("a", [9.0, 9.0, 3.0, 1.0, 2.0]), "b": variant("b", [5.0]),
                                         "c": variant("c", [1.0], fails=True)}, repeats=3)
    assert calls == ["a", "a", "b", "b", "c"] + ["a", "b"] * 3  # two warm-ups each, a failure stops at its first
    assert medians == {"a": 2.0, "b": 5.0} and failed == {"c": "RuntimeError: no kernel for this GPU"}
    assert shares == {}  # plain seconds: no host share to report


def test_a_sample_is_the_mean_of_calls_back_to_back_with_the_hosts_share_of_it_on_a_gpu(monkeypatch):
    """`calls` calls between two waits for the device, on a clock the test moves: the host's issuing is the time up to
    the last call, the device's wait the second synchronize. A device still busy when the host has issued every call
    gives a small share; a host that takes the whole time to issue them, a share of 1 (HOST_BOUND); a CPU has none."""
    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(ab, "time", types.SimpleNamespace(perf_counter=lambda: clock.now))
    waits = []

    def device_busy_for(seconds):
        def synchronize(device):
            waits.append(device.type)
            if len(waits) % 2 == 0:  # the wait after the calls: the device still runs the queued work
                clock.now += seconds
        return synchronize

    def host_takes(seconds):
        def step():
            calls.append(1)
            clock.now += seconds
        return step

    cuda = torch.device("cuda")  # a device object only: no GPU is touched, the waits are the fake's
    calls = []
    monkeypatch.setattr(ab, "synchronize", device_busy_for(0.04))
    assert ab.seconds_per_call(host_takes(0.002), cuda, calls=5) == pytest.approx((0.01, 0.2))
    monkeypatch.setattr(ab, "synchronize", device_busy_for(0.0))
    assert ab.seconds_per_call(host_takes(0.01), cuda, calls=5) == pytest.approx((0.01, 1.0))
    on_cpu = ab.seconds_per_call(host_takes(0.01), torch.device("cpu"), calls=7)
    assert on_cpu.seconds == pytest.approx(0.01) and on_cpu.issued_share is None
    assert len(calls) == 17 and waits == ["cuda"] * 4 + ["cpu"] * 2


def test_alternate_keeps_the_median_host_share_and_compare_counts_the_bound_itself_as_host_paced():
    samples = {"fa4": [ab.CallTime(1.0, 0.5), ab.CallTime(3.0, 0.9), ab.CallTime(2.0, 0.95)],
               "sdpa": [ab.CallTime(2.0, 0.1), ab.CallTime(2.0, 0.89), ab.CallTime(2.0, 0.2)]}
    medians, failed, shares = alternate({name: lambda name=name: samples[name].pop(0) for name in samples},
                                        repeats=3, warmups=0)
    assert medians == {"fa4": 2.0, "sdpa": 2.0} and failed == {} and shares == {"fa4": 0.9, "sdpa": 0.2}
    lines = compare({"fa4": 0, "sdpa": 0}, lambda _: ab.CallTime(1.0, 0.9), lambda *args: "1 s", 1, width=4)
    assert lines == ["  fa4  1 s; host 90% (the host set the pace)", "  sdpa 1 s; host 90% (the host set the pace)"]


def test_compare_adds_the_hosts_share_on_a_gpu_and_says_when_the_host_set_the_pace():
    samples = {"eager": ab.CallTime(2.0, 0.3), "fa4": ab.CallTime(1.0, 0.95), "cpu": ab.CallTime(4.0, None)}
    lines = compare({name: name for name in samples}, lambda name: samples[name],
                    lambda name, median, reference: f"{median:.1f} s", 1, width=5)
    assert lines == ["  eager 2.0 s; host 30%", "  fa4   1.0 s; host 95% (the host set the pace)", "  cpu   4.0 s"]


def test_compare_describes_each_variant_against_the_first_and_refuses_a_failed_reference():
    def fails(seconds):
        raise ValueError("tile does not fit")

    lines = compare({"eager": 2.0, "fast": 1.0, "broken": None}, lambda s: fails(s) if s is None else s,
                    lambda seconds, median, reference: f"{median:.1f} s, {reference / median:.1f}x", 3, width=6)
    assert lines == ["  broken not measured: ValueError: tile does not fit", "  eager  2.0 s, 1.0x",
                     "  fast   1.0 s, 2.0x"]
    with pytest.raises(RuntimeError, match="the reference 'broken' failed: ValueError"):
        compare({"broken": None, "eager": 2.0}, lambda s: fails(s) if s is None else s, lambda *a: "", 1, width=6)


def test_optional_attribute_says_why_a_candidate_library_is_missing_or_fails(monkeypatch, tmp_path):
    (tmp_path / "broken_kernels.py").write_text("raise ImportError('needs sm90')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert optional_attribute("no_such_kernels.mlp", "mlp_func") == (None, "no_such_kernels is not installed")
    assert optional_attribute("broken_kernels", "rmsnorm") == (None, "ImportError: needs sm90")
    assert optional_attribute("statistics", "median") == (statistics.median, None)


@pytest.mark.parametrize("script, size, variants", [
    ("norm_ab", 512, ["rms_norm_in_dtype", "F.rms_norm"]),
    ("mlp_ab", 256, ["eager", "compiled"]),
    ("rope_ab", 1024, ["eager", "complex", "compiled"]),
    ("decoder_ab", 64, ["as_is", "padded", "compiled", "padded_compiled"]),
])
def test_each_bench_runs_on_cpu_and_prints_every_variant_with_its_errors(monkeypatch, capsys, script, size, variants):
    torch._dynamo.reset()
    monkeypatch.setattr(ab, "CALLS_PER_SAMPLE", 1)  # a smoke run: one call per sample (bf16 is emulated on a CPU)
    bench(script)["main"](size, 1)
    lines = capsys.readouterr().out.splitlines()
    assert "CPU" in lines[0] and "median of 1" in lines[0]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert list(rows) == variants
    for row in rows.values():
        errors = [float(word.rstrip(",")) for word in row.split("float32:")[1].split() if word[0].isdigit()]
        assert errors and all(0 < error < 0.05 for error in errors)  # bf16 against float32, never a wrong layout


TINY_BERT = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=192)


@pytest.mark.parametrize("script, arguments, keywords, rows", [
    ("compile_ab", (1, "float32"), dict(preset="tiny", bert=TINY_BERT, length=16),
     [f"{model} {variant}" for model in ("neobert", "bert-base")
      for variant in ("eager", "compiled, static", "compiled, dynamic", "compiled, frozen")]),
    ("compile_scope_ab", (1, 16, "tiny", 1), {},
     [f"{name}: median step" for name in ("eager", "model", "blocks", "blocks_head_eager")] + ["blocks / model"]),
    ("encoder_ab", (1, "float32"), dict(preset="tiny", length=16), ["before-27", "before-15", "now"]),
    ("rope_and_swiglu", (1, 16), {}, ["one call", "two calls", "real pairs", "clone", "out of place", "in place"] * 2),
    ("static_packing_ab", ("tiny", 1, 2, 64), {},
     ["eager, unpadded", "eager, static", "eager, static+filler", "compiled, static", "compiled, unpadded"]),
])
def test_each_cpu_bench_times_every_variant_with_the_suites_timer(monkeypatch, capsys, script, arguments, keywords,
                                                                   rows):
    """The scripts that time CPU variants: every row is printed, in order, with a figure, none left out, each
    sample taken by the suite's timer (ab.seconds_per_call), not one of the script's own."""
    samples = []
    monkeypatch.setattr(ab, "seconds_per_call", lambda *args, **kwargs: samples.append(1) or
                        seconds_per_call(*args, **kwargs))
    torch._dynamo.reset()
    main = bench(script)["main"]
    if "BATCHES" in main.__globals__:  # a smoke run: 3 distinct batches a sample, not the script's 20
        monkeypatch.setitem(main.__globals__, "BATCHES", 3)
    main(*arguments, **keywords)
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    measured = [line for line in lines if line.startswith(tuple(rows)) and any(c.isdigit() for c in line)]
    assert [max((row for row in rows if line.startswith(row)), key=len) for line in measured] == rows, lines
    assert not any("not measured" in line for line in lines)
    assert len(samples) >= 3 * len(set(rows) - {"blocks / model"})  # two warm-ups and a timed sample a variant


def test_quacks_interleaved_tables_turn_q_and_k_as_apply_rope_does():
    """flash-attn's and QuACK's interleaved rotary, written out: pair (2i, 2i+1) of each vector turned by angle
    [position, i], positions restarting at each document (cu_seqlens); q and k as one vector of 2 x head_dim."""
    config = NeoBERTConfig.from_preset("neobert")
    heads, head_dim, document, tokens = config.num_attention_heads, config.head_dim, 64, 192
    qk = torch.randn(tokens, heads, 2 * head_dim)
    cu_seqlens = torch.arange(0, tokens + 1, document, dtype=torch.int32)
    positions = position_ids_from_cu_seqlens(cu_seqlens, tokens)
    expected = apply_rope(qk, RotaryTables.side_by_side(rope_tables(head_dim, positions, config.rope_theta), 2))
    cos, sin = bench("rope_ab")["interleaved_tables"](head_dim, document, config.rope_theta, torch.device("cpu"))
    assert cos.shape == sin.shape == (document, head_dim) and cos.is_contiguous() and sin.is_contiguous()
    even, odd = qk[..., 0::2], qk[..., 1::2]
    cos, sin = cos[positions][:, None, :], sin[positions][:, None, :]
    turned = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    torch.testing.assert_close(turned, expected, rtol=0, atol=1e-6)


def test_a_candidate_failing_while_timed_or_checked_costs_only_its_row_with_the_first_line_of_why():
    """An error at a variant's n-th timed call (an out-of-memory, a kernel's) or in its check against float32 is
    that variant's: the reference and the others keep their rows; a compiler's many-line message is cut to its
    first line, so that the step's log keeps the table."""
    calls = {"late": 0}

    def late(seconds):
        calls["late"] += 1
        if calls["late"] > 3:  # two warm-ups, one timed sample, then
            raise RuntimeError("CUDA out of memory.\nTried to allocate 2.00 GiB\nmore diagnostics")
        return seconds

    def describe(variant, median, reference):
        if variant == "unchecked":
            raise ValueError("mismatched layouts\nsecond line")
        return f"{median:.1f} s"

    lines = compare({"eager": 2.0, "late": "late", "unchecked": "unchecked"},
                    lambda v: late(1.0) if v == "late" else 1.5 if v == "unchecked" else v, describe, 3, width=9)
    assert lines == ["  late      not measured: failed at timed sample 2: RuntimeError: CUDA out of memory.",
                     "  eager     2.0 s",
                     "  unchecked not measured: its check against float32 failed: ValueError: mismatched layouts"]


def test_the_attention_bench_runs_on_cpu_and_says_why_a_backend_is_not_measured(monkeypatch, capsys):
    """attention_ab on a CPU: SDPA as the model calls it, the forced backends a CPU has, compiled; the GPU-only
    backends each a line saying why; both modes; every measured output, and in training every gradient, near those
    of attention written out in float32 (einsum: a wrong transpose of the fused projection's views would not be)."""
    torch._dynamo.reset()
    monkeypatch.setattr(ab, "CALLS_PER_SAMPLE", 1)  # a smoke run: one call per sample
    bench("attention_ab")["main"](1024, 1)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("Attention, 2 x 512 tokens") and "CPU" in lines[0]
    modes = [i for i, line in enumerate(lines) if line.startswith(("Forward alone", "Forward + backward"))]
    assert len(modes) == 2
    for start, end in ((modes[0], modes[1]), (modes[1], len(lines))):
        rows = {line.split()[0]: line for line in lines[start + 1:end]}
        assert set(rows) == {"sdpa", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_compiled", "compiled_cudnn"}
        assert "not measured: RuntimeError" in rows["sdpa_cudnn"]
        for name in ("sdpa", "sdpa_flash", "sdpa_compiled", "compiled_cudnn"):
            errors = [float(word.rstrip(",")) for word in rows[name].split("float32:")[1].split()
                      if word[0].isdigit()]
            assert len(errors) == (1 if start == modes[0] else 2) and all(0 < e < 0.05 for e in errors), rows[name]
    with pytest.raises(ValueError, match="multiple of LENGTH"):
        bench("attention_ab")["main"](1000, 1)


def test_the_attention_benchs_flash_attention_4_candidates_on_a_stand_in(monkeypatch):
    """FA4's rows need a GPU; their wiring is checked here on the stand-in of flash-attn-4 that the model's FA4 tests
    use (attention written out, tests/test_attention_kernels.py): each candidate returns the rows' attention in q's
    layout; the 128 x 128 candidates pass that tile to _flash_attn_fwd (the varlen one asking for the logsumexp, as
    the model's op does, so that only the tile differs), in the forward alone (the training alternation has no tiled
    candidate, having no backward for it); without the package, none and why."""
    script = bench("attention_ab")
    with monkeypatch.context() as absent:
        absent.setitem(sys.modules, "flash_attn", None)  # whether or not this machine has it
        variants, why = script["fa4_variants"](True)
    assert variants == {} and "flash_attn" in why
    calls = []
    package = types.ModuleType("flash_attn")  # found as installed: what optional_attribute looks for first
    package.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    install_flash_attn_4(monkeypatch, calls, [])
    assert set(script["fa4_variants"](True)[0]) == {"sdpa", "fa4", "fa4_dense"}
    variants, why = script["fa4_variants"](False)
    assert why is None and set(variants) == {"sdpa", "fa4", "fa4_dense", "fa4_128x128", "fa4_dense_128x128"}
    q, k, v = torch.randn(2, 16, 3, 3 * 8).split(8, dim=-1)
    expected = script["reference_attention"](q, k, v)
    for name, attend in variants.items():
        out = attend(q, k, v)
        assert out.shape == q.shape and torch.allclose(out, expected, atol=1e-5), name
    tiled = [call for name, call in calls if name == "flash_attn_4 _flash_attn_fwd"]
    assert tiled == [{"tile_mn": (128, 128), "return_lse": True},  # the varlen one as the model's op: with the lse
                     {"tile_mn": (128, 128), "return_lse": False}]
