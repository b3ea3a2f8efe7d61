"""neobert.eval.host_waits: the device's idle time in a profiled step, split into the host's (by the operators around
the late launch) and the device's own, on hand-made Chrome traces in torch.profiler's format, and None for a CPU
recording."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from neobert.eval.host_waits import NO_HOST_OP, NO_LAUNCH, HostWait, host_waits, read_trace


def op(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}


def launch(ts, correlation, tid=1, name="cudaLaunchKernel", cat="cuda_runtime"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": 1,
            "args": {"correlation": correlation}}


def kernel(ts, dur, correlation, name="k"):
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur,
            "args": {"correlation": correlation}}


def compiled_step() -> dict:
    """A compiled region on the main thread: a matmul (launched at 10, run 12-30), FlashAttention 4's op whose Python
    takes until 75 to launch (run 76-86), an add launched at 85 while the device was still busy (run 90-95)."""
    return {"traceEvents": [
        op("Torch-Compiled Region: 0/0", 0, 100),
        op("aten::mm", 5, 10), launch(10, 1),
        op("neobert::flash_attn_4_varlen", 20, 60), op("aten::empty", 22, 2), launch(75, 2, name="cuLaunchKernel",
                                                                                    cat="cuda_driver"),
        op("aten::add", 82, 8), launch(85, 3),
        kernel(12, 18, 1, "nvjet_gemm"), kernel(76, 10, 2, "flash_fwd"), kernel(90, 5, 3, "add_kernel"),
        {"ph": "i", "cat": "instant", "name": "ignored", "ts": 50},  # not a complete event: not read
    ]}


def test_idle_is_the_hosts_when_the_next_launch_came_after_the_device_went_idle():
    report = host_waits(compiled_step())
    assert report.span_us == 95  # the first host event at 0 to the last kernel's end
    assert report.busy_us == 18 + 10 + 5
    assert report.late_us == 12 + 46  # before the first kernel, and 30-76 waiting for FA4's launch at 75
    assert report.queued_us == 4  # the add was launched at 85, before the device went idle at 86
    assert report.busy_us + report.idle_us == report.span_us
    assert report.waits == [HostWait("neobert::flash_attn_4_varlen", "Torch-Compiled Region: 0/0", 46, 1),
                            HostWait("aten::mm", "Torch-Compiled Region: 0/0", 12, 1)]


def test_each_launching_operators_host_time_is_set_against_its_kernels_device_time():
    operators = {o.name: o for o in host_waits(compiled_step()).operators}
    assert set(operators) == {"aten::mm", "neobert::flash_attn_4_varlen", "aten::add"}  # aten::empty launched nothing
    fa4 = operators["neobert::flash_attn_4_varlen"]
    assert (fa4.calls, fa4.host_us, fa4.device_us) == (1, 60, 10)
    assert [o.name for o in host_waits(compiled_step()).operators][0] == "neobert::flash_attn_4_varlen"  # most over


def test_overlapping_kernels_count_once_and_launches_on_other_threads_find_their_own_operators():
    trace = {"traceEvents": [
        op("autograd::engine::evaluate_function: MmBackward0", 0, 50, tid=2), op("aten::mm", 10, 30, tid=2),
        launch(20, 1, tid=2), launch(30, 2, tid=1),  # a launch on thread 1 inside no operator
        kernel(25, 20, 1), kernel(30, 10, 2),  # the second runs inside the first (another stream)
        launch(60, 3, tid=2), kernel(70, 5, 3),  # launched after the device went idle at 45, by no operator
    ]}
    report = host_waits(trace)
    assert report.busy_us == 20 + 5
    assert report.late_us == 25 + 25 and report.queued_us == 0
    assert report.waits == [HostWait("aten::mm", "autograd::engine::evaluate_function: MmBackward0", 25, 1),
                            HostWait(NO_HOST_OP, NO_HOST_OP, 25, 1)]


def test_a_kernel_whose_launch_is_missing_is_counted_as_the_hosts_and_said_so():
    trace = {"traceEvents": [op("aten::mm", 0, 5), kernel(10, 5, 99)]}
    assert host_waits(trace).waits == [HostWait(NO_LAUNCH, NO_LAUNCH, 10, 1)]


def test_a_recording_without_device_events_has_no_report(tmp_path):
    """A CPU profile, written by torch.profiler and read back as the throughput job writes it (gzip)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as recording:
        torch.randn(64, 64) @ torch.randn(64, 64)
    path = tmp_path / "step.json.gz"
    recording.export_chrome_trace(str(path))
    trace = read_trace(path)
    assert any(e.get("cat") == "cpu_op" for e in trace["traceEvents"])
    assert host_waits(trace) is None


def test_read_trace_takes_plain_json_too(tmp_path):
    (tmp_path / "t.json").write_text(json.dumps(compiled_step()))
    with gzip.open(tmp_path / "t.json.gz", "wt") as handle:
        json.dump(compiled_step(), handle)
    assert read_trace(tmp_path / "t.json") == read_trace(tmp_path / "t.json.gz") == compiled_step()


@pytest.mark.parametrize("shift", [0.0, 1e6])
def test_absolute_timestamps_change_nothing(shift):
    trace = compiled_step()
    for e in trace["traceEvents"]:
        e["ts"] += shift
    report = host_waits(trace)
    assert (report.late_us, report.queued_us, report.busy_us) == (58, 4, 33)
