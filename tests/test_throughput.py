"""Throughput benchmark: the batch-size search, the FLOP accounting (neobert.instruments.timing) and a tiny end-to-end
run (neobert.instruments.throughput)."""

from __future__ import annotations

import csv
import dataclasses
import gzip
import json
import re
from pathlib import Path

import pytest
import torch

from neobert.config import ConfigError
from neobert.config.throughput import ThroughputConfig
from neobert.instruments import encoders
from neobert.instruments import timing as tp
from neobert.instruments import throughput as job
from neobert.instruments.kernel_profile import CATEGORIES, MATMUL, summarise
from neobert.instruments.throughput_report import markdown_table, profile_markdown, read_csv
from neobert.model import kernels


def tiny_neobert_and_batch() -> tuple[encoders.BenchModel, encoders.Batch]:
    """The tiny encoder on CPU and a full batch of 2 x 8 tokens: what a test of one step's bookkeeping runs."""
    bench = encoders.build_model("neobert", torch.device("cpu"), torch.float32, neobert_preset="tiny")
    return bench, encoders.make_batch(2, 8, "full", bench.vocab_size, bench.pad_token_id, torch.device("cpu"))


def test_search_picks_largest_fitting_then_fastest():
    probed, timed = [], []

    def fits(size):
        probed.append(size)
        return size <= 16  # a memory limit between 16 and 32

    speeds = {1: 100.0, 2: 180.0, 4: 300.0, 8: 420.0, 16: 390.0, 32: 999.0}

    def throughput(size):
        timed.append(size)
        return speeds[size]

    best, largest, measured = tp.search_batch_size([32, 1, 2, 4, 8, 16, 64], fits, throughput, top=3)
    assert largest == 16
    assert best == 8  # the fastest of the three largest that fit, not the largest
    assert sorted(timed) == [4, 8, 16] and measured == {4: 300.0, 8: 420.0, 16: 390.0}
    assert probed == [1, 2, 4, 8, 16, 32]  # stops probing at the first size that does not fit


def test_search_when_nothing_fits():
    assert tp.search_batch_size([4, 8], lambda s: False, lambda s: 1.0) == (None, None, {})


def test_a_size_that_runs_out_of_memory_while_timed_is_left_out_with_the_larger_ones():
    """Under CUDA graphs a size records its graphs in the timing, after the probe's one step: memory can run out
    there. That size and the larger ones are left out; the smaller ones timed before it keep their figures."""
    timed = []

    def throughput(size):
        timed.append(size)
        return None if size == 8 else float(size)

    assert tp.search_batch_size([2, 4, 8, 16], lambda s: True, throughput, top=3) == (4, 4, {4: 4.0})
    assert timed == [4, 8]  # 16 not timed once 8 ran out
    assert tp.search_batch_size([4, 8], lambda s: True, lambda s: None, top=2) == (None, None, {})


def test_the_jobs_search_drops_a_size_out_of_memory_in_its_timed_steps_and_keeps_the_other(monkeypatch, caplog):
    real_time_step = job.time_step

    def time_step(bench, batch, *args):
        if batch.input_ids.shape[0] == 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_time_step(bench, batch, *args)

    monkeypatch.setattr(job, "time_step", time_step)
    bench, _ = tiny_neobert_and_batch()
    config = ThroughputConfig(neobert_preset="tiny", batch_sizes=[2, 4], search_top=2, max_tokens=0, warmup=1,
                              device="cpu")
    with caplog.at_level("INFO", logger=job.__name__):
        size, batch = job._search(bench, "full", 8, [2, 4], config, torch.device("cpu"), True, None)
    assert size == 2 and batch.input_ids.shape == (2, 8)
    assert re.search(r"full L=8 neobert: tokens/s by batch size in the search \(one step each\): 2: [\d,]+; kept 2",
                     caplog.text)  # the sizes timed, for a reader of the log: 4 ran out of memory
    monkeypatch.setattr(job, "time_step", lambda *args: (_ for _ in ()).throw(RuntimeError("CUDA error: misaligned")))
    with pytest.raises(RuntimeError, match="misaligned"):  # not a memory error: the row's, not the size's
        job._search(bench, "full", 8, [2, 4], config, torch.device("cpu"), True, None)


def test_neobert_flop_accounting_matches_hand_count():
    device = torch.device("cpu")
    bench = encoders.build_model("neobert", device, torch.float32, neobert_preset="tiny")
    cfg = bench.module.config
    hidden, ffn, layers = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_hidden_layers
    per_layer = 3 * hidden * hidden + hidden * hidden + 2 * ffn * hidden + ffn * hidden
    assert bench.matmul_weights == layers * per_layer
    seq = 128
    expected = 2 * layers * per_layer + 4 * layers * hidden * seq
    assert bench.flops_per_token(seq, training=False) == expected
    assert bench.flops_per_token(seq, training=True) == 3 * expected


def test_hf_flop_accounting_uses_every_linear_a_token_goes_through():
    bench = encoders.build_model("bert-base", torch.device("cpu"), torch.float32)
    linears = [m for m in bench.module.modules() if isinstance(m, torch.nn.Linear)]
    # 12 layers x (q, k, v, out, in, out) + the pooler, which runs on one token per sequence: not counted
    assert len(linears) == 12 * 6 + 1 and bench.module.pooler is not None
    per_layer = 4 * 768 * 768 + 2 * 768 * 3072
    assert bench.matmul_weights == 12 * per_layer
    assert bench.flops_per_token(512, False) == 2 * 12 * per_layer + 4 * 12 * 768 * 512


@pytest.mark.parametrize("layout", ["full", "padded", "unpadded"])
def test_a_batchs_flops_count_attention_over_its_documents_real_lengths(layout):
    """Padding computes nothing useful and a document attends over itself only: a batch's FLOPs per real token are
    the matmuls' plus 4 x layers x hidden x sum(n_i^2) / sum(n_i), not attention at the padded width."""
    bench = encoders.build_model("neobert", torch.device("cpu"), torch.float32, neobert_preset="tiny")
    batch = encoders.make_batch(6, 64, layout, bench.vocab_size, bench.pad_token_id, torch.device("cpu"),
                          distribution="lognormal")
    lengths = [64] * 6 if layout == "full" else (
        batch.attention_mask.sum(1).tolist() if layout == "padded" else batch.cu_seqlens.diff().tolist())
    assert batch.squared_lengths == sum(n * n for n in lengths) and batch.real_tokens == sum(lengths)
    layers, hidden = bench.num_layers, bench.hidden_size
    for training in (False, True):
        per_token = (2 * bench.matmul_weights + 4 * layers * hidden * sum(n * n for n in lengths) / sum(lengths))
        assert bench.batch_flops_per_token(batch, training) == pytest.approx(per_token * (3 if training else 1))
    if layout == "full":
        assert bench.batch_flops_per_token(batch, False) == bench.flops_per_token(64, False)
        assert encoders.rows_as_documents(batch).squared_lengths == batch.squared_lengths
    else:  # shorter documents than the width: less attention per token
        assert bench.batch_flops_per_token(batch, False) < bench.flops_per_token(max(lengths), False)


def test_modernbert_on_flash_attention_2_is_windowed_and_gets_no_per_flop_ratio():
    """transformers gives ModernBERT's sliding window to FlashAttention 2: its local layers skip blocks that a dense
    FLOP count counts, as the FlexAttention and FA4 rows' do; SDPA computes them."""
    assert encoders.windowed("modernbert-base", "flash_attention_2") and encoders.windowed("modernbert-base-flex", "flex_attention")
    assert not encoders.windowed("modernbert-base", "sdpa") and not encoders.windowed("bert-base", "flash_attention_2")
    row = dict(mode="inference", layout="full", seq_len=512, batch_size=8, step_s=1.0, flops_per_token=1e9,
               achieved_flops=1e12, mfu=None, params=1, device="cuda", dtype="bfloat16")
    rows = [tp.ThroughputRow("neobert", tokens_per_s=1000.0, note="", **row),
            tp.ThroughputRow("modernbert-base", tokens_per_s=800.0, note="attention: flash_attention_2"
                             + encoders.WINDOW_NOTE, **row),
            tp.ThroughputRow("bert-base", tokens_per_s=2000.0, note="attention: sdpa", **row)]
    table = markdown_table(rows)
    assert "| 1.25x; n/a |" in table and "| 0.50x; 1.00x |" in table


@pytest.mark.parametrize("layout", ["full", "padded", "unpadded"])
def test_batches_count_only_real_tokens(layout):
    batch = encoders.make_batch(4, 64, layout, vocab_size=100, pad_token_id=0, device=torch.device("cpu"))
    if layout == "full":
        assert batch.real_tokens == 4 * 64 and bool((batch.input_ids != 0).all())
    elif layout == "padded":
        assert batch.real_tokens == int(batch.attention_mask.sum()) < 4 * 64
        assert bool((batch.input_ids[batch.attention_mask == 0] == 0).all())
        assert int(batch.attention_mask.sum(1).max()) == 64  # one full-length document sets the width
    else:
        assert batch.input_ids.dim() == 1 and batch.real_tokens == batch.input_ids.numel() == int(batch.cu_seqlens[-1])


def test_unpadded_neobert_matches_padded_outputs():
    """The varlen path the benchmark times computes the same thing as the padded path."""
    bench = encoders.build_model("neobert", torch.device("cpu"), torch.float32, neobert_preset="tiny")
    bench.module.eval()
    padded = encoders.make_batch(3, 32, "padded", bench.vocab_size, 0, torch.device("cpu"), seed=1)
    packed = encoders.make_batch(3, 32, "unpadded", bench.vocab_size, 0, torch.device("cpu"), seed=1)
    with torch.no_grad():
        a = bench.forward(bench.module, padded)[padded.attention_mask.bool()]
        b = bench.forward(bench.module, packed)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_official_code_unavailable_is_reported(tmp_path):
    with pytest.raises(encoders.ModelUnavailable, match="model.py"):
        encoders.build_model("neobert-official", torch.device("cpu"), torch.float32, official_code_dir=str(tmp_path))


def test_bad_config_is_named():
    with pytest.raises(ValueError, match="models"):
        ThroughputConfig(models=["gpt-2"]).validate()
    with pytest.raises(ValueError, match="layouts"):
        ThroughputConfig(layouts=["sparse"]).validate()
    with pytest.raises(ConfigError, match="'repeats'"):
        ThroughputConfig(repeats=0).validate()


def test_tiny_end_to_end_writes_csv_png_markdown(tmp_path):
    from experiments.throughput import main

    out = tmp_path / "bench"
    paths = main(["--models", "neobert,bert-base,neobert-official", "--lengths", "16,32", "--layouts",
                  "full,unpadded", "--output-dir", str(out), "neobert_preset=tiny", "max_tokens=64", "repeats=2",
                  "batch_sizes=[1,2,4,8]", f"official_code_dir={tmp_path}", "matmul_calls=2",
                  "device=cpu"])  # the CPU path (token budget, fp32 matmul reference), also on a GPU machine
    rows = list(csv.DictReader(open(paths["csv"])))
    measured = {(r["model"], r["layout"], r["seq_len"]): r for r in rows if r["tokens_per_s"]}
    for length in ("16", "32"):
        for model in ("neobert", "bert-base"):
            row = measured[(model, "full", length)]
            assert float(row["tokens_per_s"]) > 0 and float(row["achieved_flops"]) > 0
            assert int(row["batch_size"]) * int(length) <= 64  # the CPU token budget
            # fp32 on CPU: the share of a matmul rate measured between the timed steps of this run
            assert row["peak_source"] == "measured matmul 4096x768x3072" and float(row["peak_flops"]) > 1e9
            assert float(row["mfu"]) == pytest.approx(float(row["achieved_flops"]) / float(row["peak_flops"]))
    assert ("neobert", "unpadded", "16") in measured and ("bert-base", "unpadded", "16") not in measured
    official = [r for r in rows if r["model"] == "neobert-official"]
    assert official and all(r["note"].startswith("not available") and not r["tokens_per_s"] for r in official)
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = paths["markdown"].read_text()
    assert "| neobert / bert-base |" in table and "neobert-official: not available" in table
    assert "% of the matmul rate measured in this run" in table and "Matmul reference (measured" in table
    assert "standalone before the models" in table
    assert "profile" not in paths and not (out / "throughput_profile.csv").exists()  # profile=false: none
    assert not (out / "throughput_traces").exists()
    assert "where the time goes" not in table
    # on a CPU the host runs the work itself: no share of it spent issuing
    assert all(not r["issued_share"] for r in rows) and "the host's time to issue a step" not in table


def test_a_step_leaves_the_hosts_issue_time_and_gpu_rows_report_its_share(monkeypatch, tmp_path):
    """time_step leaves the seconds the host took before the final wait for the device; a GPU row's share of its step
    is reported per model and length, and read back from the CSV."""
    bench, batch = tiny_neobert_and_batch()
    waits = []
    monkeypatch.setattr(tp, "synchronize", lambda device: (waits.append(1), __import__("time").sleep(0.05)))
    total = tp.time_step(bench, batch, True, torch.device("cpu"))
    assert len(waits) == 2 and 0 < bench.issued_s < total - 0.04  # the final wait is not the host's issuing
    rows = [tp.ThroughputRow(model, "training", "full", 1024, 32, tokens, 0.1, 1e9, 1e14, 0.3, 1, "cuda", "bfloat16",
                             issued_share=share)
            for model, tokens, share in (("neobert", 265010.0, 0.93), ("bert-base", 500000.0, 0.61))]
    paths = job.write_reports(rows, tmp_path)
    table = paths["markdown"].read_text()
    assert ("### training, full batches: the host's time to issue a step, % of the step (well below 100: the kernels "
            "set the pace)") in table
    assert "| neobert | 93 |" in table and "| bert-base | 61 |" in table
    assert [row.issued_share for row in read_csv(paths["csv"])] == [0.93, 0.61]


def test_profile_true_reports_where_each_rows_step_went_per_tflop_of_its_model(tmp_path):
    from experiments.throughput import main

    out = tmp_path / "bench"
    (out / "throughput_traces").mkdir(parents=True)
    (out / "throughput_traces" / "training_full_16_roberta-base.json.gz").write_bytes(b"")  # an earlier run's
    paths = main(["--models", "neobert,bert-base", "--lengths", "16", "--output-dir", str(out), "neobert_preset=tiny",
                  "batch_sizes=[2]", "repeats=1", "matmul_calls=2", "device=cpu", "profile=true", "--overwrite"])
    timed = {r["model"]: r for r in csv.DictReader(open(paths["csv"]))}
    assert "profile" not in next(iter(timed.values()))  # the profile has its own tables
    assert [row.profile for row in read_csv(paths["csv"])] == [None, None]
    lines = list(csv.DictReader(open(paths["profile"])))
    for model in ("neobert", "bert-base"):
        mine = [line for line in lines if line["model"] == model]
        assert [line["category"] for line in mine] == list(CATEGORIES)  # every category, zeros included
        assert {(line["mode"], line["layout"], line["seq_len"], line["batch_size"]) for line in mine} == {
            ("inference", "full", "16", "2")}
        assert sum(float(line["share"]) for line in mine) == pytest.approx(1, abs=1e-4)
        matmul = next(line for line in mine if line["category"] == MATMUL)
        assert float(matmul["self_ms"]) > 0 and mine[0]["source"] == "CPU operators" and not mine[0]["device_busy_ms"]
        work_tflop = 2 * 16 * float(timed[model]["flops_per_token"]) / 1e12  # the step's real tokens x FLOPs/token
        rounding_us = 0.05  # self_ms is written to 0.1 µs: a category of a few µs is off by up to 1-2% there
        for line in mine:
            assert float(line["us_per_tflop"]) == pytest.approx(float(line["self_ms"]) * 1e3 / work_tflop, rel=1e-3,
                                                                abs=rounding_us / work_tflop)
            assert float(line["us_per_1k_tokens"]) == pytest.approx(float(line["self_ms"]) * 1e6 / 32, rel=1e-3,
                                                                    abs=rounding_us * 1e3 / 32 + 1e-4)
    names = list(csv.DictReader(open(paths["profile_names"])))
    assert {(n["model"], n["name"]) for n in names if n["category"] == MATMUL} >= {("bert-base", "aten::addmm")}
    assert any(n["model"] == "neobert" and n["category"] == MATMUL and n["name"].startswith("aten::") for n in names)
    # each profiled step's Chrome trace, for the gaps a device waits in (Perfetto, chrome://tracing)
    traces = sorted(path.name for path in paths["traces"].iterdir())
    assert traces == ["inference_full_16_bert-base.json.gz", "inference_full_16_neobert.json.gz"]
    with gzip.open(paths["traces"] / traces[1], "rt") as trace:
        events = json.load(trace)["traceEvents"]
    assert any(event.get("name") == "aten::linear" for event in events)
    table = paths["markdown"].read_text()
    assert "### where the time goes: inference, full batches, 16 tokens (CPU operators, one step)" in table
    assert "| neobert (2) |" in table and "| bert-base (2) |" in table and "operators / profiled step" in table


def test_every_row_is_profiled_once_every_row_is_timed_on_its_real_tokens(monkeypatch):
    """The profiler runs after the last timed step (its tracer may stay attached and slow what follows), one step per
    timed row, on the row's batch: its real tokens, padded and unpadded layouts included."""
    calls = []
    real_time_step, real_profile_step = job.time_step, job.profile_step
    monkeypatch.setattr(job, "time_step", lambda model, *a, **k: calls.append(("time", model.name)) or
                        real_time_step(model, *a, **k))
    monkeypatch.setattr(job, "profile_step", lambda model, *a, **k: calls.append(("profile", model.name)) or
                        real_profile_step(model, *a, **k))
    config = ThroughputConfig(models=["neobert", "bert-base"], neobert_preset="tiny", lengths=[8, 16],
                              layouts=["full", "padded"], batch_sizes=[4], repeats=2, warmup=0, device="cpu",
                              matmul_calls=1, profile=True)
    rows = job.run_throughput(config)
    timed = [("time", "neobert"), ("time", "bert-base")] * 2
    assert calls == timed * 4 + [("profile", row.model) for row in rows]  # 2 layouts x 2 lengths, then the profiles
    assert all(row.profile.tokens == round(row.tokens_per_s * row.step_s) for row in rows)  # the timed step's tokens
    padded = [row for row in rows if row.layout == "padded"]
    assert all(row.profile.tokens < 4 * row.seq_len for row in padded)  # real tokens, not the padded slots
    config.layouts, config.models = ["unpadded"], ["neobert"]
    [unpadded, _] = job.run_throughput(config)
    assert unpadded.profile.tokens == round(unpadded.tokens_per_s * unpadded.step_s) < 4 * 8


def test_a_profile_that_fails_costs_its_row_nothing_but_the_profile(monkeypatch, caplog, tmp_path):
    real_profile_step = job.profile_step

    def profile_step(model, *args):
        if model.name == "bert-base":
            raise RuntimeError("CUPTI is not available")
        return real_profile_step(model, *args)

    monkeypatch.setattr(job, "profile_step", profile_step)
    config = ThroughputConfig(models=["neobert", "bert-base"], neobert_preset="tiny", lengths=[16], batch_sizes=[2],
                              repeats=1, device="cpu", matmul_calls=1, profile=True, output_dir=str(tmp_path))
    neobert, bert = job.run_throughput(config)
    assert neobert.profile is not None and "profile failed" not in neobert.note
    assert bert.tokens_per_s > 0 and bert.profile is None
    assert bert.note.endswith("profile failed: RuntimeError: CUPTI is not available")
    assert "bert-base: profile failed: RuntimeError: CUPTI is not available" in caplog.text
    table = job.write_reports([neobert, bert], tmp_path)["markdown"].read_text()
    assert "| neobert (2) |" in table and "- bert-base: profile failed: RuntimeError: CUPTI is not available" in table
    bert.note = "attention: sdpa; profile failed: RuntimeError: CUPTI is not available"  # every row failed: listed
    paths = job.write_reports([bert], tmp_path / "all_failed")
    assert "- bert-base: profile failed" in paths["markdown"].read_text() and paths["profile"].exists()


def test_a_gpu_recording_without_a_kernel_is_a_failed_profile_and_a_failed_training_step_leaves_no_gradient(
        monkeypatch):
    bench, batch = tiny_neobert_and_batch()
    row = tp.ThroughputRow("neobert", "training", "full", 8, 2, 1.0, 1.0, 1.0, None, None, None, "cuda", "bfloat16",
                           note="attention: sdpa (no mask)")
    monkeypatch.setattr(job, "profile_step", lambda *a: summarise([], "CUDA kernels", 1, 10.0, 0.0, 16))
    job._profile_row(row, bench, batch, True, torch.device("cuda"), None, Path("unused.json.gz"))
    assert row.profile is None
    assert row.note == "attention: sdpa (no mask); profile failed: the recording holds no CUDA kernel"

    def fails_after_the_backward(model, batch, *args):
        encoders.neobert_forward(model.module, batch).sum().backward()
        raise RuntimeError("the profiler stopped")

    monkeypatch.setattr(job, "profile_step", fails_after_the_backward)
    job._profile_row(row, bench, batch, True, torch.device("cpu"), None, Path("unused.json.gz"))
    assert all(p.grad is None for p in bench.module.parameters())  # the next step starts from no gradient
    assert row.note.endswith("profile failed: RuntimeError: the profiler stopped")


def test_a_gpu_rows_profile_reads_where_the_device_waited_from_its_trace(monkeypatch, tmp_path, caplog):
    """The profiled step's trace (here one as torch.profiler writes it, with FlashAttention 4's op launching late) is
    read into row.host_waits, and throughput.md says it; a trace that cannot be read costs the profile nothing."""
    from test_host_waits import compiled_step

    bench, batch = tiny_neobert_and_batch()
    trace_path = tmp_path / "inference_full_8_neobert.json.gz"

    def profile_step(*args):
        with gzip.open(args[-1], "wt") as handle:
            json.dump(compiled_step(), handle)
        return summarise([("flash_fwd", 10.0), ("nvjet_gemm", 18.0)], "CUDA kernels", 1, 95.0, 33.0, 16)

    monkeypatch.setattr(job, "profile_step", profile_step)
    row = tp.ThroughputRow("neobert", "inference", "full", 8, 2, 1.0, 1e-4, 1.0, None, None, None, "cuda", "bfloat16")
    job._profile_row(row, bench, batch, False, torch.device("cuda"), None, trace_path)
    assert row.profile.host_waits.late_us == 58 and row.profile.host_waits.queued_us == 4
    text = job.write_reports([row], tmp_path)["markdown"].read_text()
    assert ("### where the device waited on the host: inference, full batches, 8 tokens, neobert (2), the profiled "
            "step") in text
    assert "- device idle 0.06 ms of the recording's 0.10 ms (65%; the profiler slows the host)" in text
    assert ("neobert::flash_attn_4_varlen (in Torch-Compiled Region: 0/0) 0.05 ms over 1 gap; aten::mm (in "
            "Torch-Compiled Region: 0/0) 0.01 ms over 1 gap") in text
    assert ("- operators whose own host time exceeds their kernels': neobert::flash_attn_4_varlen 1 call, host 0.06 "
            "ms against kernels 0.01 ms; aten::add 1 call") in text

    monkeypatch.setattr(job, "profile_step", lambda *args: (args[-1].write_text("{not json"), profile_step(
        *args[:-1], tmp_path / "elsewhere.json.gz"))[1])
    row = tp.ThroughputRow("neobert", "inference", "full", 8, 2, 1.0, 1e-4, 1.0, None, None, None, "cuda", "bfloat16")
    job._profile_row(row, bench, batch, False, torch.device("cuda"), None, tmp_path / "broken.json")
    assert row.profile is not None and row.profile.host_waits is None and "profile failed" not in row.note
    assert "where the device waited was not read from" in caplog.text
    assert "where the device waited" not in job.write_reports([row], tmp_path / "broken")["markdown"].read_text()


def test_a_gpu_profile_table_takes_a_unit_that_fits_and_says_how_busy_the_device_was():
    rows = []
    for model, flops, tokens, kernels, step_s, busy_us in (
            ("neobert", 6e8, 32768, {"sm90_xmma_gemm_bf16": 30000.0, "flash_fwd_kernel": 8000.0,
                                     "triton_poi_fused_mul_silu_0": 5000.0}, 0.050, 45000.0),
            ("bert-base", 2e8, 16384, {"sm90_xmma_gemm_bf16": 4000.0, "flash_fwd_kernel": 1000.0}, 0.006, 4800.0)):
        # the profiled step's wall time is the profiler's, longer than the timed step: not the busy column's base
        profile = summarise(list(kernels.items()), "CUDA kernels", steps=1, wall_us=step_s * 1.2e6, busy_us=busy_us,
                            tokens=tokens)
        rows.append(tp.ThroughputRow(model, "inference", "full", 512, tokens // 512, tokens / step_s, step_s, flops,
                                     None, None, None, "cuda", "bfloat16", profile=profile))
    table = profile_markdown(rows)
    assert "### where the time goes: inference, full batches, 512 tokens (CUDA kernels, one step)" in table
    assert "ms per TFLOP of each model's work (share of its kernel time)" in table
    assert "device busy / timed step" in table
    # neobert: 30 ms of matmul over 32,768 tokens x 6e8 FLOPs (19.66 TFLOP) = 1.526 ms per TFLOP, 70% of 43 ms;
    # busy 45 of the timed step's 50 ms
    assert "| neobert (64) | 1.526 (70%) | 0.407 (19%) | 0.254 (12%) | 2.187 | 90% |" in table
    assert "| bert-base (32) | 1.221 (80%) | 0.305 (20%) | 0.000 (0%) | 1.526 | 80% |" in table
    assert "norm" not in table.split("\n")[4]  # a category no model spent time in has no column


def test_model_overrides_reach_every_neobert_row_but_its_own_choice_and_are_listed_in_its_note(monkeypatch):
    from neobert.model import config as model_config_module

    built = {}
    real_build = encoders._build_neobert

    def build(name, *args):
        built[name] = real_build(name, *args)
        return built[name]

    monkeypatch.setattr(encoders, "_build_neobert", build)
    config = ThroughputConfig(models=["neobert", "neobert-padded_sdpa", "bert-base"], neobert_preset="tiny",
                              lengths=[16], batch_sizes=[2], repeats=1, device="cpu", matmul_calls=1,
                              model_overrides={"rope_theta": 20000.0, "attention_kernel": "varlen_attn"})
    rows = {row.model: row for row in job.run_throughput(config)}
    assert list(built) == ["neobert-padded_sdpa"] and built["neobert-padded_sdpa"].module.config.rope_theta == 20000
    assert built["neobert-padded_sdpa"].module.config.attention_kernel == "padded_sdpa"  # the row's own kernel wins
    assert rows["neobert-padded_sdpa"].tokens_per_s > 0 and rows["neobert-padded_sdpa"].note.endswith(
        "; rope_theta=20000.0")
    # neobert takes the overrides' kernel, which runs on a GPU only: its row says so
    assert rows["neobert"].note == "not available: attention_kernel=varlen_attn runs on CUDA GPUs only"
    assert "rope_theta" not in rows["bert-base"].note
    config.model_overrides = {"rope_theta": 20000.0}
    [row] = [row for row in job.run_throughput(config) if row.model == "neobert"]
    assert row.tokens_per_s > 0 and row.note == "attention: sdpa (no mask); rope_theta=20000.0"
    assert built["neobert"].module.config.rope_theta == 20000
    # a kernel choice through the overrides: the rows say why it cannot run here (a CPU), as neobert-quack's would
    monkeypatch.setattr(model_config_module, "quack_missing_reason", lambda: None)
    monkeypatch.setattr(encoders, "quack_missing_reason", lambda: None)
    config.model_overrides = {"kernels": "quack"}
    [row] = [row for row in job.run_throughput(config) if row.model == "neobert"]
    assert row.tokens_per_s is None and row.note == "not available: kernels=quack runs on CUDA GPUs only"


@pytest.mark.parametrize("name, overrides, kernels, attention_kernel, extra_note", [
    ("neobert", {"kernels": "quack", "attention_kernel": "flash_attn_4"}, "quack", "flash_attn_4", "; kernels=quack"),
    ("neobert-quack", {"kernels": "liger"}, "quack", "auto", ""),  # the row's kernels win, and its name says them
    ("neobert-liger", {"attention_kernel": "varlen_attn"}, "liger", "varlen_attn", ""),
    ("neobert-varlen_attn", {"kernels": "quack", "attention_kernel": "padded_sdpa"}, "quack", "varlen_attn",
     "; kernels=quack"),
    ("neobert-padded_sdpa", {"rope_theta": 20000.0}, "eager", "padded_sdpa", "; rope_theta=20000.0"),
])
def test_each_neobert_row_takes_its_own_choice_then_the_overrides_and_its_note_says_what_its_name_does_not(
        monkeypatch, name, overrides, kernels, attention_kernel, extra_note):
    """Built for a GPU (the model itself builds on this CPU): a row's own choice wins over the overrides, and its note
    lists what its name does not say."""
    _pretend_every_kernel_is_installed_on_a_hopper_gpu(monkeypatch)
    bench = encoders._build_neobert(name, torch.device("cuda"), torch.bfloat16, True, "tiny", dict(overrides), False)
    config = bench.module.config
    assert (config.kernels, config.attention_kernel) == (kernels, attention_kernel)
    assert bench.attention["unpadded"].endswith(extra_note) and bench.attention["unpadded"].count(";") == (
        extra_note.count(";"))


@pytest.mark.parametrize("name, overrides, compute_dtype, compiled, why", [
    ("neobert-liger", {}, torch.bfloat16, True, "kernels=liger runs eager models only"),
    ("neobert-quack", {}, torch.float32, False, "here (swiglu, torch.float32) it would run eager"),
    ("neobert", {"kernels": "quack", "activation": "gelu"}, torch.bfloat16, False, "here (gelu, torch.bfloat16)"),
    ("neobert", {"kernels": "quack", "hidden_size": 68, "num_attention_heads": 2}, torch.bfloat16, False,
     "widths multiples of 8"),
])
def test_a_row_whose_kernels_would_not_run_is_unavailable_saying_why(monkeypatch, name, overrides, compute_dtype,
                                                                    compiled, why):
    """Otherwise it would time the eager MLP, or Inductor's kernels, under the name of another."""
    _pretend_every_kernel_is_installed_on_a_hopper_gpu(monkeypatch)
    with pytest.raises(encoders.ModelUnavailable, match=re.escape(why)):
        encoders._build_neobert(name, torch.device("cuda"), compute_dtype, True, "tiny", dict(overrides), compiled)
    monkeypatch.setattr(kernels, "cuda_capability", lambda: (7, 5))
    if name == "neobert-quack" and compute_dtype == torch.float32:  # bf16 on a GPU before Ampere: no QuACK either
        with pytest.raises(encoders.ModelUnavailable, match="compute capability 8.0 or later"):
            encoders._build_neobert(name, torch.device("cuda"), torch.bfloat16, True, "tiny", {}, False)


def _pretend_every_kernel_is_installed_on_a_hopper_gpu(monkeypatch):
    from neobert.model import attention
    from neobert.model import config as model_config_module

    for module in (encoders, model_config_module):
        monkeypatch.setattr(module, "liger_missing_reason", lambda: None)
        monkeypatch.setattr(module, "quack_missing_reason", lambda: None)
    monkeypatch.setattr(kernels, "cuda_capability", lambda: (9, 0))
    monkeypatch.setattr(encoders, "attention_kernel_missing_reason", lambda kernel: None)
    monkeypatch.setattr(attention, "attention_kernel_missing_reason", lambda kernel: None)
    monkeypatch.setattr(model_config_module, "attention_kernel_missing_reason", lambda kernel: None)


@pytest.mark.parametrize("overrides, message", [
    ({"kernel": "liger"}, r"'model_overrides\.kernel': not a NeoBERTConfig field"),
    ({"kernels": "fused"}, r"'model_overrides\.kernels': must be one of"),
    ({"decoder_pad_multiple": 64}, r"'model_overrides\.decoder_pad_multiple': a field of the model's heads"),
    ({"dropout": "x"}, r"'model_overrides\.dropout': must be a number in \[0, 1\), got 'x'"),
    ({"preset": "tinyy"}, r"'neobert_preset': unknown 'tinyy'; known presets: \['bert-base', 'mini', 'neobert'"),
])
def test_bad_model_overrides_or_preset_name_the_key_before_any_work(monkeypatch, overrides, message):
    monkeypatch.setattr(job, "build_model", lambda *a, **k: pytest.fail("built a model"))
    preset = overrides.pop("preset", "tiny")
    with pytest.raises(ConfigError, match=message):
        job.run_throughput(ThroughputConfig(neobert_preset=preset, device="cpu", model_overrides=overrides))


def test_compiled_models_are_timed_and_an_emulated_bf16_run_has_no_matmul_reference(monkeypatch):
    from neobert.eval import flops

    config = ThroughputConfig(models=["neobert"], neobert_preset="tiny", lengths=[16], batch_sizes=[2], repeats=1,
                              compile=True, device="cpu", matmul_calls=2)
    [row] = job.run_throughput(config)
    assert row.tokens_per_s > 0 and row.peak_source.startswith("measured") and 0 < row.mfu
    monkeypatch.setattr(flops, "cpu_has_native_bf16", lambda: False)
    config = ThroughputConfig(models=["neobert"], neobert_preset="tiny", lengths=[16], batch_sizes=[2], repeats=1,
                              dtype="bfloat16", device="cpu", matmul_calls=2)
    [row] = job.run_throughput(config)
    assert row.tokens_per_s > 0 and row.peak_flops is None and row.mfu is None


def test_training_mode_times_a_backward_and_counts_3x_flops():
    config = ThroughputConfig(models=["neobert"], neobert_preset="tiny", lengths=[16], layouts=["full", "padded"],
                              batch_sizes=[2], repeats=1, mode="training", matmul_calls=2)
    rows = job.run_throughput(config)
    assert [(r.layout, r.batch_size) for r in rows] == [("full", 2), ("padded", 2)]
    inference = encoders.build_model("neobert", torch.device("cpu"), torch.float32, neobert_preset="tiny")
    assert rows[0].flops_per_token == 3 * inference.flops_per_token(16, training=False)
    assert rows[1].tokens_per_s > 0 and rows[1].achieved_flops == pytest.approx(rows[1].tokens_per_s *
                                                                                 rows[1].flops_per_token)


def test_lognormal_lengths_are_seeded_capped_and_padded_to_the_batch_maximum():
    lengths = encoders.document_lengths(4000, 512, torch.Generator().manual_seed(0), "lognormal")
    assert lengths == encoders.document_lengths(4000, 512, torch.Generator().manual_seed(0), "lognormal")
    assert min(lengths) >= 8 and max(lengths) == 512
    assert sorted(lengths)[2000] == pytest.approx(128, rel=0.1)  # median length / 4
    assert 0.01 < sum(n == 512 for n in lengths) / 4000 < 0.06  # the tail reaches the cap
    padded = encoders.make_batch(8, 512, "padded", 100, 0, torch.device("cpu"), seed=3, distribution="lognormal")
    unpadded = encoders.make_batch(8, 512, "unpadded", 100, 0, torch.device("cpu"), seed=3, distribution="lognormal")
    assert padded.input_ids.shape[1] == int(padded.attention_mask.sum(1).max()) < 512
    assert padded.real_tokens == unpadded.real_tokens == int(unpadded.cu_seqlens[-1])


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_bfloat16_on_cpu_casts_inference_weights_and_autocasts_training(mode, monkeypatch):
    built = {}
    real_build = encoders.build_model

    def spy(name, device, dtype, *args, **kwargs):
        built[name] = dtype
        return real_build(name, device, dtype, *args, **kwargs)

    monkeypatch.setattr(job, "build_model", spy)
    config = ThroughputConfig(models=["neobert"], neobert_preset="tiny", lengths=[16], layouts=["padded"],
                              batch_sizes=[2], repeats=1, mode=mode, dtype="bfloat16", device="cpu", matmul_calls=2)
    [row] = job.run_throughput(config)
    assert row.dtype == "bfloat16" and row.tokens_per_s > 0
    assert built["neobert"] == (torch.bfloat16 if mode == "inference" else torch.float32)  # mixed: fp32 weights
    with pytest.raises(ConfigError, match="'dtype'"):
        ThroughputConfig(dtype="float16x").validate()
    with pytest.raises(ConfigError, match="'length_distribution'"):
        ThroughputConfig(length_distribution="zipf").validate()


def test_bfloat16_on_a_cpu_without_native_bf16_is_warned(tmp_path, caplog, monkeypatch):
    from neobert.eval import flops

    with_flag, without = tmp_path / "avx512", tmp_path / "avx2"
    with_flag.write_text("flags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n")
    without.write_text("flags\t\t: fpu sse2 avx2\n")
    assert flops.cpu_has_native_bf16(with_flag) is True and flops.cpu_has_native_bf16(without) is False
    assert flops.cpu_has_native_bf16(tmp_path / "missing") is None
    for native, warned in ((False, True), (True, False), (None, False)):
        monkeypatch.setattr(flops, "cpu_has_native_bf16", lambda native=native: native)
        caplog.clear()
        with caplog.at_level("WARNING", logger="neobert.eval.flops"):
            assert flops.warn_if_bf16_is_emulated("cpu", torch.bfloat16) is warned
        assert ("emulated" in caplog.text) is warned
    assert not flops.warn_if_bf16_is_emulated("cpu", torch.float32)
    assert not flops.warn_if_bf16_is_emulated("cuda", torch.bfloat16)


def test_the_matmul_reference_is_warmed_up_preallocated_interleaved_and_a_median_of_many_calls(monkeypatch):
    """The method of the CPU's matmul reference: single cold calls understate the rate a warmed-up loop reaches."""
    events, outputs, instances = [], [], []
    real_mm = torch.mm

    def mm(a, b, *, out=None):
        outputs.append(out)
        events.append(("mm", a.dtype, torch.get_num_threads()))
        return real_mm(a, b, out=out)

    class Recording(tp.MatmulReference):
        def __init__(self, device, dtype, calls):
            super().__init__(device, dtype, shape=(64, 32, 48), calls=calls)  # small: the test is of the method
            instances.append(self)
            events.append(("warmed up",))

        def measure(self):
            events.append(("measure",))
            return super().measure()

    real_step = tp.time_step

    def step(*args, **kwargs):
        events.append(("model",))
        return real_step(*args, **kwargs)

    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(job, "MatmulReference", Recording)
    monkeypatch.setattr(job, "time_step", step)
    monkeypatch.setattr(job, "warn_if_bf16_is_emulated", lambda device_type, dtype: False)  # any CPU
    config = ThroughputConfig(models=["neobert", "bert-base"], neobert_preset="tiny", lengths=[16], batch_sizes=[2],
                              repeats=3, warmup=0, matmul_calls=20, dtype="bfloat16", mode="training", device="cpu",
                              threads=1)
    rows = job.run_throughput(config)

    [reference] = instances
    mm_calls = [e for e in events if e[0] == "mm"]
    # In the models' compute dtype (bf16 autocast in training, though the weights are float32) and threads.
    assert {(dtype, threads) for _, dtype, threads in mm_calls} == {(torch.bfloat16, 1)}
    assert all(out is reference.out for out in outputs)  # one preallocated output: no allocation is timed
    assert events[:4] == [("mm", torch.bfloat16, 1)] * 3 + [("warmed up",)]  # warm-up, not counted
    kinds = [e[0] for e in events[4:] if e[0] != "mm"]
    # standalone first (no model built yet), then every repetition: both models, then the reference
    assert kinds == ["measure"] + ["model", "model", "measure"] * 3
    assert len(mm_calls) == 3 + 20 * 4
    for row in rows:
        assert row.peak_flops > 0 and row.reference_standalone > 0 and row.mfu == row.achieved_flops / row.peak_flops


def test_the_matmul_reference_reports_the_median_of_all_calls(monkeypatch):
    ticks = iter(range(10_000))
    durations = iter([4.0, 1.0, 2.0, 3.0, 100.0] * 2)  # seconds of successive calls: one outlier per measure

    def clock():  # start, end pairs: each call takes the next duration
        tick = next(ticks)
        return 0.0 if tick % 2 == 0 else next(durations)

    reference = tp.MatmulReference(torch.device("cpu"), torch.float32, shape=(8, 8, 8), calls=5, warmup=1)
    monkeypatch.setattr(tp.time, "perf_counter", clock)
    rates = reference.measure() + reference.measure()
    import statistics

    assert len(rates) == 10 and statistics.median(rates) == reference.flops / 3.0


@pytest.fixture
def compiled(monkeypatch):
    """torch.compile as the job calls it, with a cheap backend that records each graph's input shapes: (those shapes,
    the job's keyword arguments of each call); dynamo's caches fresh before and after."""
    graphs, calls = [], []
    real_compile = torch.compile

    def recording_backend(graph_module, example_inputs):
        graphs.append(tuple(tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)))
        return graph_module.forward

    def compile_spy(module, **kwargs):
        calls.append(kwargs)
        return real_compile(module, backend=recording_backend, dynamic=kwargs["dynamic"])

    monkeypatch.setattr(torch, "compile", compile_spy)
    torch._dynamo.reset()
    yield graphs, calls
    torch._dynamo.reset()


def test_compile_times_one_static_graph_per_shape_and_never_falls_back_to_eager(compiled):
    """The batch-size search runs several shapes: dynamo would make the graph dynamic at the second (slower, and not
    what a fixed-shape deployment runs) and, past its recompile limit, run eager without a word."""
    graphs, calls = compiled
    sizes = [1, 2, 3, 4, 5, 6]
    config = ThroughputConfig(models=["neobert"], neobert_preset="tiny", lengths=[8, 16], batch_sizes=sizes,
                              search_top=len(sizes), max_tokens=0, repeats=1, warmup=1, compile=True, device="cpu",
                              matmul_calls=1)
    rows = job.run_throughput(config)
    assert calls == [{"dynamic": False, "mode": "default"}]
    assert all(isinstance(n, int) for shapes in graphs for shape in shapes for n in shape)  # no symbolic size
    # 12 shapes (6 sizes x 2 lengths), more than dynamo's default recompile limit of 8: every one compiled
    input_shapes = {shapes[0] for shapes in graphs}
    assert {(size, length) for size in sizes for length in (8, 16)} <= input_shapes
    assert len(rows) == 2 and all(r.tokens_per_s > 0 for r in rows)


def test_variants_of_one_model_compile_each_shape_without_falling_back_to_eager(compiled):
    """neobert and its neobert-<kernel> rows run the same forward code, whose compiled graphs dynamo counts against one
    recompile limit: 2 variants x 2 lengths x 4 sizes are 16 graphs of that code, past a limit sized per model (8),
    where the later rows would have run eager and been reported as compiled."""
    graphs, _ = compiled
    sizes = [1, 2, 3, 4]
    config = ThroughputConfig(models=["neobert", "neobert-padded_sdpa"], neobert_preset="tiny",
                              lengths=[8, 16], batch_sizes=sizes, search_top=len(sizes), max_tokens=0, repeats=1,
                              warmup=1, compile=True, device="cpu", matmul_calls=1)
    # dynamo's cap on one code object's graphs all told (256) is raised too: here, as if it were below the run's 16
    with torch._dynamo.config.patch(accumulated_recompile_limit=4):
        rows = job.run_throughput(config)
    assert len(rows) == 4 and all(r.tokens_per_s > 0 for r in rows)
    # neobert's graphs take [size, length] ids; neobert-padded_sdpa's the rows as documents, [size x length] ids
    assert {(size, length) for size in sizes for length in (8, 16)} <= {shapes[0] for shapes in graphs}
    assert len(set(graphs)) >= 16, graphs


def test_a_model_past_its_recompile_limit_loses_its_rows_and_none_is_timed_eager(monkeypatch, compiled):
    """A miscounted limit (ModernBERT with FA4, compiled, on the H100) costs the models that hit it their rows, this
    one failed and the later ones not run (each would compile until the same error), never a row timed in eager;
    the rows measured before it are kept, and the run goes on."""
    count = job.expected_graphs
    monkeypatch.setattr(job, "expected_graphs", lambda *args: 1)  # dynamo's own limit, 8, for the run's 24 graphs
    searched, real_search = [], job._search
    monkeypatch.setattr(job, "_search", lambda bench, layout, length, *args: searched.append((bench.name, length))
                        or real_search(bench, layout, length, *args))
    config = ThroughputConfig(models=["neobert", "neobert-padded_sdpa"], neobert_preset="tiny", lengths=[8, 16, 32],
                              batch_sizes=[1, 2, 3, 4], search_top=4, max_tokens=0, repeats=1, warmup=1, compile=True,
                              device="cpu", matmul_calls=1)
    rows = {(row.model, row.seq_len): row for row in job.run_throughput(config)}
    assert len(rows) == 6
    # the 8 graphs of one forward, both models' at length 8 (the shared code object): timed
    assert all(rows[name, 8].tokens_per_s > 0 for name in config.models)
    for name in config.models:
        assert rows[name, 16].tokens_per_s is None
        assert rows[name, 16].note.startswith("failed: FailOnRecompileLimitHit")
        assert rows[name, 32].tokens_per_s is None
        assert rows[name, 32].note.startswith("not run: past the recompile limit at full L=16")
        assert "this run allows: 8 at a time" in rows[name, 32].note
    assert not [length for _, length in searched if length == 32]  # not run: not even compiled to fail again
    # the count: every model's shapes, the FlexAttention row's mask and kernel graphs beside
    config = ThroughputConfig(layouts=["full", "unpadded"], compile=True)
    assert count(config, ["neobert"] * 5, [128, 256, 512, 1024, 2048, 4096], list(range(11))) == 660
    config = ThroughputConfig(layouts=["full"])
    assert count(config, ["neobert", "modernbert-base-flex"], [512], [1, 2]) == 2 * (1 * 1 * 2 * 2 + 4)
    # transformers' FA4 attention, compiled: a graph break, and a resumed frame per layer (ModernBERT's 22) a shape
    assert count(config, ["neobert", "modernbert-base-fa4"], [1024], [16]) == 2
    config = ThroughputConfig(layouts=["full"], compile=True)
    assert count(config, ["neobert", "modernbert-base-fa4"], [1024, 2048], [16]) == 2 * (1 + 22)


def test_eager_models_stay_eager_beside_the_compiled_rows_and_say_so(compiled):
    """compile=true with eager_models: those rows are a reference at their best in the same run (bert-base compiled
    ran 0.39x its eager speed on the H100), the others compiled; each row's note says which."""
    _, calls = compiled
    config = ThroughputConfig(models=["neobert", "bert-base"], eager_models=["bert-base"], neobert_preset="tiny",
                              lengths=[16], batch_sizes=[2], repeats=1, warmup=1, compile=True, device="cpu",
                              matmul_calls=1)
    rows = {row.model: row for row in job.run_throughput(config)}
    assert len(calls) == 1  # neobert's
    assert rows["bert-base"].tokens_per_s > 0 and rows["bert-base"].note.endswith("; eager (eager_models)")
    assert rows["neobert"].tokens_per_s > 0 and "eager" not in rows["neobert"].note
    with pytest.raises(ConfigError, match="'eager_models'.*set compile=true too"):
        ThroughputConfig(models=["neobert", "bert-base"], eager_models=["bert-base"]).validate()
    with pytest.raises(ConfigError, match=r"'eager_models'.*\['roberta-base'\] not in models"):
        ThroughputConfig(models=["neobert"], eager_models=["roberta-base"], compile=True).validate()
    with pytest.raises(ConfigError, match="'eager_models'.*names every model"):
        ThroughputConfig(models=["bert-base"], eager_models=["bert-base"], compile=True).validate()
    # an eager row compiles nothing of its own: not counted as a compiled FA4 row of transformers
    config = ThroughputConfig(models=["neobert", "modernbert-base-fa4"], eager_models=["modernbert-base-fa4"],
                              layouts=["full"], compile=True)
    assert job.expected_graphs(config, config.models, [1024], [16]) == 2


def test_compile_mode_reaches_torch_compile_and_cuda_graph_modes_start_a_step_per_call(monkeypatch, compiled):
    """compile_mode=reduce-overhead compiles with that mode, and each timed call begins a new step of the CUDA graphs
    (on CPU Inductor records none, so this runs here); a mode without compile=true, or an unknown one, is refused."""
    _, calls = compiled
    steps = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: steps.append(1))
    timed, real_time_step = [], tp.time_step
    monkeypatch.setattr(job, "time_step", lambda *args, **kwargs: timed.append(1) or real_time_step(*args, **kwargs))
    config = ThroughputConfig(models=["neobert"], neobert_preset="tiny", lengths=[16], batch_sizes=[2], repeats=2,
                              warmup=2, compile=True, compile_mode="reduce-overhead", device="cpu", matmul_calls=1)
    [row] = job.run_throughput(config)
    assert row.tokens_per_s > 0 and calls == [{"dynamic": False, "mode": "reduce-overhead"}]
    assert len(steps) == len(timed) >= 2  # every call, the two timed repetitions among them
    with pytest.raises(ConfigError, match="compile_mode.*set compile=true too"):
        ThroughputConfig(compile_mode="max-autotune").validate()
    with pytest.raises(ConfigError, match="compile_mode.*must be one of"):
        ThroughputConfig(compile=True, compile_mode="fast").validate()
    # compilation, and the recording of the CUDA graphs, in untimed steps only
    with pytest.raises(ConfigError, match="'warmup'.*needs 2 untimed step"):
        ThroughputConfig(compile=True, compile_mode="reduce-overhead", warmup=1).validate()
    with pytest.raises(ConfigError, match="'warmup'.*needs 1 untimed step"):
        ThroughputConfig(compile=True, warmup=0).validate()
    ThroughputConfig(warmup=0).validate()  # eager: the user's choice


def test_encoders_without_a_packed_forward_skip_the_unpadded_layout_saying_why():
    from neobert.instruments.encoders import build_model

    bert = build_model("bert-base", torch.device("cpu"), torch.float32)  # SDPA here: no FlashAttention 2
    assert bert.skipped_layouts == {"unpadded": "no unpadded path on this machine"}
    assert "unpadded" not in build_model("neobert", torch.device("cpu"), torch.float32, "tiny").skipped_layouts


def test_modernbert_flex_runs_flexattention_and_equals_sdpa():
    """modernbert-base-flex: transformers' flex_attention, whose block mask skips the blocks that ModernBERT's
    sliding window hides (its local layers, two of every three); the same weights give SDPA's outputs (a small
    ModernBERT here, 512 tokens = 4 x 4 blocks of 128: FlexAttention compiles, ~15 s on a CPU)."""
    from transformers import AutoModel, ModernBertConfig
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from neobert.instruments.encoders import WINDOW_NOTE, build_model, hf_attention

    cpu = torch.device("cpu")
    assert (hf_attention("modernbert-base-flex", cpu), hf_attention("modernbert-base", cpu)) == ("flex_attention", "sdpa")
    bench = build_model("modernbert-base-flex", cpu, torch.float32)
    assert bench.module.config._attn_implementation == "flex_attention" and bench.num_layers == 22
    assert bench.attention["full"] == "attention: flex_attention" + WINDOW_NOTE and "unpadded" in bench.skipped_layouts

    config = ModernBertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                              local_attention=16, global_attn_every_n_layers=3, vocab_size=1000,
                              max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                              cls_token_id=1, sep_token_id=2)
    torch.manual_seed(0)
    sdpa = AutoModel.from_config(config, attn_implementation="sdpa").eval()
    flex = AutoModel.from_config(config, attn_implementation="flex_attention").eval()
    flex.load_state_dict(sdpa.state_dict())
    ids = torch.randint(5, 1000, (2, 512))
    mask = torch.ones_like(ids)
    mask[1, 400:] = 0  # padding too: the block mask hides it as SDPA's mask does
    flex_attention, skipped = ALL_ATTENTION_FUNCTIONS["flex_attention"], {}

    def spy(module, query, key, value, attention_mask, **kwargs):  # the block mask of each layer: % of blocks skipped
        skipped[module.layer_idx] = attention_mask.sparsity()
        return flex_attention(module, query, key, value, attention_mask, **kwargs)

    ALL_ATTENTION_FUNCTIONS["flex_attention"] = spy
    try:
        with torch.no_grad():
            expected = sdpa(input_ids=ids, attention_mask=mask).last_hidden_state
            got = flex(input_ids=ids, attention_mask=mask).last_hidden_state
    finally:
        ALL_ATTENTION_FUNCTIONS["flex_attention"] = flex_attention
    keep = mask.bool()
    torch.testing.assert_close(got[keep], expected[keep], rtol=1e-4, atol=1e-4)
    # layer 0 is global; 1 and 2 are local: each query block needs itself and its neighbours, 6 of 16 are skipped
    assert skipped[0] == 0 and skipped[1] == skipped[2] == 37.5


def test_a_flex_row_is_unavailable_for_training_on_cpu_and_reported_without_a_per_flop_ratio():
    """FlexAttention has no CPU backward: a training run there reports the row as not available (the others still
    run). Its FLOPs are counted dense, so the report gives its speed ratio and its note, not a per-FLOP ratio."""
    from neobert.instruments.encoders import WINDOW_NOTE, ModelUnavailable, build_model
    from neobert.instruments.throughput_report import markdown_table
    from neobert.instruments.timing import ThroughputRow

    with pytest.raises(ModelUnavailable, match="no backward on a CPU"):
        build_model("modernbert-base-flex", torch.device("cpu"), torch.float32, training=True)

    def row(model, tokens_per_s, note=""):
        return ThroughputRow(model, "inference", "full", 1024, 16, tokens_per_s, 0.1, 1e9, tokens_per_s * 1e9, 0.3,
                             1, "cuda", "bfloat16", note=note, peak_flops=1e15, peak_source="published")

    table = markdown_table([row("neobert", 500.0), row("modernbert-base", 400.0),
                            row("modernbert-base-flex", 625.0, "attention: flex_attention" + WINDOW_NOTE),
                            row("modernbert-base-fa4", 1000.0, "attention: flash_attention_4" + WINDOW_NOTE)])
    assert "| neobert / modernbert-base | 1.25x; 1.25x |" in table
    assert "| neobert / modernbert-base-flex | 0.80x; n/a |" in table
    assert "| neobert / modernbert-base-fa4 | 0.50x; n/a |" in table
    assert f"- modernbert-base-flex: attention: flex_attention{WINDOW_NOTE}" in table
    assert f"- modernbert-base-fa4: attention: flash_attention_4{WINDOW_NOTE}" in table


def test_modernbert_fa4_row_runs_flash_attention_4_on_a_gpu_and_says_why_not_elsewhere(monkeypatch):
    """modernbert-base-fa4: transformers' flash_attention_4 (FA4's local window skips the blocks the sliding window
    hides), only on a CUDA GPU with flash-attn-4 installed; modernbert-base takes flash_attention_2 only where
    flash-attn 2 itself is installed (flash-attn-4 alone also installs a package named flash_attn)."""
    from neobert.instruments import encoders
    from neobert.instruments.encoders import ModelUnavailable, build_model, hf_attention
    from neobert.model import attention

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert hf_attention("modernbert-base-fa4", cpu) == hf_attention("modernbert-base-fa4", cuda) == "flash_attention_4"
    monkeypatch.setattr(encoders, "flash_attn_packages", lambda: (False, True))  # flash-attn-4 alone
    assert hf_attention("modernbert-base", cuda) == "sdpa"
    monkeypatch.setattr(encoders, "flash_attn_packages", lambda: (True, False))  # flash-attn 2
    assert (hf_attention("modernbert-base", cuda), hf_attention("modernbert-base", cpu)) == ("flash_attention_2", "sdpa")
    monkeypatch.setattr(attention, "_HAS_FLASH_ATTN_4", False)
    with pytest.raises(ModelUnavailable, match="needs FlashAttention 4 .pip install flash-attn-4"):
        build_model("modernbert-base-fa4", cuda, torch.bfloat16)
    monkeypatch.setattr(attention, "_HAS_FLASH_ATTN_4", True)
    with pytest.raises(ModelUnavailable, match="FlashAttention 4 runs on CUDA GPUs only"):
        build_model("modernbert-base-fa4", cpu, torch.bfloat16)


@pytest.mark.parametrize("fails_on_call", [1, 3])  # in the batch search, or in the timed repeats
def test_a_model_that_builds_but_fails_to_run_is_a_row_saying_why_and_the_others_are_measured(
        monkeypatch, tmp_path, fails_on_call):
    """A kernel that installs and builds but has no implementation for this GPU or shape (FA4 on an A100, a Triton
    'out of resource') raises at its first step, or later: its rows say why, every other row is timed and the
    reports are written."""
    build = job.build_model
    calls = []

    def build_failing(name, *args, **kwargs):
        bench = build(name, *args, **kwargs)
        if name == "neobert-padded_sdpa":
            forward = bench.forward

            def failing(module, batch):
                calls.append(1)
                if len(calls) >= fails_on_call:
                    raise NotImplementedError("No kernel for\nthis GPU")
                return forward(module, batch)

            bench.forward = failing
        return bench

    monkeypatch.setattr(job, "build_model", build_failing)
    config = ThroughputConfig(models=["neobert", "neobert-padded_sdpa"], neobert_preset="tiny", lengths=[8, 16],
                              batch_sizes=[2], repeats=3, warmup=1, device="cpu", matmul_calls=1, mode="training",
                              output_dir=str(tmp_path))
    paths = job.run_throughput_job(config)
    rows = {(row.model, row.seq_len): row for row in read_csv(paths["csv"])}
    for length in (8, 16):
        assert rows["neobert", length].tokens_per_s > 0
        failed = rows["neobert-padded_sdpa", length]
        assert failed.tokens_per_s is None and failed.note == "failed: NotImplementedError: No kernel for this GPU"
    assert "failed: NotImplementedError" in paths["markdown"].read_text()


def test_an_accelerator_error_stops_the_run_rather_than_failing_every_later_row(monkeypatch, tmp_path):
    """An illegal address or a device-side assert leaves the GPU's context unusable: the rows after it would all
    fail, blamed on models that did not. The rows measured before it are written."""
    build = job.build_model

    def build_failing(name, *args, **kwargs):
        bench = build(name, *args, **kwargs)
        if name == "neobert-padded_sdpa":
            forward = bench.forward

            def failing(module, batch):  # at 16 tokens, after the rows of 8 are measured
                if batch.real_tokens > 2 * 8:
                    raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
                return forward(module, batch)

            bench.forward = failing
        return bench

    monkeypatch.setattr(job, "build_model", build_failing)
    config = ThroughputConfig(models=["neobert", "neobert-padded_sdpa"], neobert_preset="tiny", lengths=[8, 16],
                              batch_sizes=[2], repeats=1, device="cpu", matmul_calls=1, output_dir=str(tmp_path))
    with pytest.raises(torch.AcceleratorError, match="illegal memory access"):
        job.run_throughput_job(config)
    # what was measured before it (both at 8 tokens) is written, then the error
    rows = read_csv(tmp_path / "throughput.csv")
    assert [(row.model, row.seq_len) for row in rows] == [("neobert", 8), ("neobert-padded_sdpa", 8)]
    assert all(row.tokens_per_s > 0 for row in rows)


def test_a_published_bf16_peak_is_no_mfu_denominator_for_float32_and_a_given_peak_says_so(monkeypatch):
    """The published peaks are dense bf16 tensor-core rates: a float32 run has no MFU against them (on CPU the
    measured matmul rate stands in); a peak the config gives is labelled as given."""
    from neobert.eval import flops

    # as if this device had a published bf16 peak (a GPU's), through the rule that leaves float32 out
    monkeypatch.setattr(flops, "peak_flops_of", lambda name: 1e15)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "a GPU")
    monkeypatch.setattr(job, "peak_flops", lambda device, dtype: flops.peak_flops(torch.device("cuda"), dtype))
    base = dict(models=["neobert"], neobert_preset="tiny", lengths=[16], batch_sizes=[2], repeats=1, device="cpu",
                matmul_calls=1)
    [bf16] = job.run_throughput(ThroughputConfig(dtype="bfloat16", **base))
    assert (bf16.peak_source, bf16.peak_flops) == ("published", 1e15)
    [fp32] = job.run_throughput(ThroughputConfig(dtype="float32", **base))
    assert fp32.peak_source.startswith("measured matmul") and fp32.peak_flops != 1e15
    [given] = job.run_throughput(ThroughputConfig(dtype="float32", peak_flops=2e12, **base))
    assert (given.peak_source, given.peak_flops) == ("given (peak_flops)", 2e12)


def test_a_trace_that_cannot_be_written_costs_the_profile_nothing(monkeypatch, tmp_path, caplog):
    """The trace is a help to the profile's figures, which stand without it (a full disk, an exporter's error)."""
    bench, batch = tiny_neobert_and_batch()

    def fails(self, path, *args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", fails)
    summary = tp.profile_step(bench, batch, False, torch.device("cpu"), trace_path=tmp_path / "step.json.gz")
    assert summary.tokens == 16 and summary.total_us > 0
    assert "trace was not written" in caplog.text and not (tmp_path / "step.json.gz").exists()


def test_a_run_cut_short_leaves_the_tables_of_what_it_timed(monkeypatch, tmp_path):
    """The tables are written after each layout and length: a run killed at its time limit (a `timeout`,
    here an exit in the middle of the second length) leaves the first length's rows in throughput.csv and .md."""
    real_time_step = job.time_step

    def time_step(model, batch, *args, **kwargs):
        if batch.input_ids.shape[-1] == 32:
            raise SystemExit("the time limit")
        return real_time_step(model, batch, *args, **kwargs)

    monkeypatch.setattr(job, "time_step", time_step)
    config = ThroughputConfig(models=["neobert"], neobert_preset="tiny", lengths=[16, 32], batch_sizes=[2],
                              repeats=1, device="cpu", matmul_calls=1, output_dir=str(tmp_path))
    with pytest.raises(SystemExit):
        job.run_throughput_job(config)
    assert [(row.seq_len, row.tokens_per_s > 0) for row in read_csv(tmp_path / "throughput.csv")] == [(16, True)]
    table = (tmp_path / "throughput.md").read_text()
    assert table.startswith(job.UNFINISHED) and "| neobert | " in table
    assert not (tmp_path / "throughput.png").exists()  # the plot is the whole run's

    # cut short while profiling: the profiles taken so far are in the tables
    monkeypatch.setattr(job, "time_step", real_time_step)
    real_profile_row = job._profile_row

    def profile_row(row, *args):
        if row.seq_len == 32:
            raise SystemExit("the time limit")
        real_profile_row(row, *args)

    monkeypatch.setattr(job, "_profile_row", profile_row)
    with pytest.raises(SystemExit):
        job.run_throughput_job(dataclasses.replace(config, profile=True), overwrite=True)
    profiled = list(csv.DictReader(open(tmp_path / "throughput_profile.csv")))
    assert {r["seq_len"] for r in profiled} == {"16"} and len(read_csv(tmp_path / "throughput.csv")) == 2
    assert (tmp_path / "throughput.md").read_text().startswith(job.UNFINISHED)
    monkeypatch.setattr(job, "_profile_row", real_profile_row)
    job.run_throughput_job(dataclasses.replace(config, profile=True), overwrite=True)  # a run that ends: no such line
    assert not (tmp_path / "throughput.md").read_text().startswith(job.UNFINISHED)


def gpu_rows(lengths, models, first_tokens):
    """Inference rows as a GPU step writes them: one per model and length, tokens/s counting down."""
    return [tp.ThroughputRow(model, "inference", "full", length, 16, first_tokens - 1000.0 * i - length, 0.02, 1e9,
                             1e14, 0.3, 1, "cuda", "bfloat16", note=f"{model} at {length}", issued_share=0.1)
            for length in lengths for i, model in enumerate(models)]


def test_report_re_makes_the_tables_and_the_plot_of_several_runs_csvs_without_running_a_model(tmp_path, monkeypatch):
    """Several runs each return a CSV: --report merges them in the order given into one CSV (written aside, then
    renamed), its Markdown tables (the later CSV's rows beside the earlier's, their ratios per length) and the Figure 3
    plot."""
    from experiments.throughput import main

    first = job.write_reports(gpu_rows([1024, 2048], ["neobert", "modernbert-base-fa4"], 700_000.0), tmp_path / "a",
                              plot=False)["csv"]
    second = job.write_reports(gpu_rows([1024, 2048], ["neobert-flash_attn_4"], 800_000.0), tmp_path / "b",
                               plot=False)["csv"]
    monkeypatch.setattr(job, "run_throughput", lambda *a, **k: pytest.fail("--report ran a measurement"))
    out = tmp_path / "merged"
    paths = main(["--report", str(first), str(second), "--output-dir", str(out)])
    assert paths["plot"] == out / "throughput.png" and paths["plot"].stat().st_size > 0
    assert not list(out.glob("*.part*")) and not list(out.glob(".*.partial"))
    merged = read_csv(paths["csv"])
    assert merged == read_csv(first) + read_csv(second)  # every field back, in the order given
    table = paths["markdown"].read_text()
    assert "| neobert-flash_attn_4 | 798,976 (16) | 797,952 (16) |" in table
    assert "neobert / neobert-flash_attn_4" in table  # the ratios span both CSVs' rows


def test_report_refuses_what_it_cannot_read_or_would_overwrite_and_writes_nothing(tmp_path):
    from experiments.throughput import main

    good = job.write_reports(gpu_rows([512], ["neobert"], 900_000.0), tmp_path / "good", plot=False)["csv"]
    other = tmp_path / "other.csv"
    other.write_text("step,loss\n1,2.5\n")
    binary = tmp_path / "binary.csv"
    binary.write_bytes(good.read_bytes().replace(b"neobert", b"neo\xff\xfebert"))
    bad_row = tmp_path / "bad_row.csv"
    bad_row.write_text(good.read_text().replace(",512,", ",five hundred,"))
    cut_short = tmp_path / "cut_short.csv"  # a line cut where a writer stopped
    cut_short.write_text(good.read_text() + "bert-base,inference,full,\n")
    too_long = tmp_path / "too_long.csv"
    too_long.write_text(good.read_text().rstrip("\n") + ",extra\n")
    empty = tmp_path / "empty.csv"
    empty.write_text(good.read_text().splitlines()[0] + "\n")
    out = tmp_path / "out"
    cases = {
        str(tmp_path / "missing.csv"): "does not exist",
        str(other): "other.csv: not the throughput job's CSV (throughput.csv): no column achieved_flops, batch_size",
        str(binary): "binary.csv: not a readable CSV (UnicodeDecodeError",
        str(bad_row): "bad_row.csv, line 2: not a throughput row",
        str(empty): "empty.csv: no rows",
        str(cut_short): "cut_short.csv, line 3: not a throughput row",
        str(too_long): "too_long.csv, line 2: not a throughput row",
    }
    for path, message in cases.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            main(["--report", str(good), path, "--output-dir", str(out)])
    assert not out.exists()
    # the merged CSV would replace one it reads
    with pytest.raises(ConfigError, match="would replace"):
        main(["--report", str(good), "--output-dir", str(good.parent)])
    assert read_csv(good)[0].seq_len == 512
    # measurement flags and overrides have nothing to act on
    for extra in (["--models", "neobert"], ["compile=true"], ["--lengths", "512"]):
        with pytest.raises(ConfigError, match="--report re-makes reports from CSVs"):
            main(["--report", str(good), "--output-dir", str(out), *extra])
    assert not out.exists()
