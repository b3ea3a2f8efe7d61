"""neobert.instruments.host_waits: the device's idle time in a profiled step, split into the host's (by the operators around
the late launch) and the device's own, on hand-made Chrome traces in torch.profiler's format, and None for a CPU
recording."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from neobert.instruments.host_waits import (AFTER_SYNC, NO_HOST_OP, NO_LAUNCH, PROFILER, HostWait, host_wait_lines,
                                            host_waits, read_trace)


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
    assert (fa4.calls, fa4.host_us, fa4.device_us) == (1, 60 - 2, 10)  # its own time: aten::empty's 2 left out
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


def test_what_a_real_trace_holds_beside_kernels_changes_nothing():
    """A GPU-side annotation spanning kernels, flow events, the trace's own span, a sync that launched nothing, a copy
    tied to its cudaMemcpyAsync and a CUDA graph's replay (its kernels share the launch's correlation): busy is the
    kernels' union, the replay's kernels are launched by the graph's launch."""
    trace = compiled_step()
    trace["traceEvents"] += [
        {"ph": "X", "cat": "gpu_user_annotation", "name": "## Call CompiledFxGraph ##", "pid": 0, "tid": 7, "ts": 0,
         "dur": 120},
        {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 1, "pid": 1, "tid": 1, "ts": 10},
        {"ph": "f", "cat": "ac2g", "name": "ac2g", "id": 1, "pid": 0, "tid": 7, "ts": 12, "bp": "e"},
        {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler", "pid": "Spans", "tid": "PyTorch Profiler", "ts": -50,
         "dur": 300},
        op("aten::copy_", 96, 4), launch(97, 4, name="cudaMemcpyAsync"),
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "pid": 0, "tid": 7, "ts": 98, "dur": 2,
         "args": {"correlation": 4}},
        op("CUDAGraph::replay", 101, 3), launch(102, 5, name="cudaGraphLaunch"),
        kernel(103, 3, 5, "graph_kernel_a"), kernel(106, 2, 5, "graph_kernel_b"),
    ]
    report = host_waits(trace)
    assert report.busy_us == 18 + 10 + 5 + 2 + 5  # the annotation's 120 µs counted nowhere
    assert report.span_us == 108 and report.unlaunched == 0 and report.dropped == 0
    waits = {w.innermost: w.idle_us for w in report.waits}
    assert waits["aten::copy_"] == 3 and waits["CUDAGraph::replay"] == 3  # idle 95-98 and 100-103


def test_idle_while_the_host_sat_in_a_sync_is_blamed_on_the_sync_not_the_next_launch():
    """An .item() after the first kernel: the host blocks in cudaStreamSynchronize until the device is done, then
    runs Python before its next launch. The idle between is the read's."""
    trace = {"traceEvents": [
        op("aten::mm", 0, 2), launch(1, 1), kernel(2, 20, 1),
        op("aten::item", 3, 25), op("aten::_local_scalar_dense", 3, 25), launch(4, 9, name="cudaMemcpyAsync"),
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "pid": 1, "tid": 1, "ts": 5, "dur": 18},
        op("aten::add", 40, 5), launch(42, 2), kernel(44, 3, 2),
    ]}
    report = host_waits(trace)
    assert report.waits == [HostWait(AFTER_SYNC + "aten::_local_scalar_dense", "aten::item", 22, 1),
                            HostWait("aten::mm", "aten::mm", 2, 1)]  # the step's start: not after a sync


def test_a_launch_still_in_its_call_when_the_device_went_idle_is_the_hosts():
    trace = {"traceEvents": [op("aten::mm", 0, 5), launch(1, 1), kernel(2, 8, 1),
                             op("triton_poi_fused_mul_0", 5, 30),
                             {**launch(6, 2, name="cuLaunchKernelEx", cat="cuda_driver"), "dur": 20},
                             kernel(27, 3, 2)]}
    report = host_waits(trace)  # launched from 6 to 26; the device idle from 10
    assert report.queued_us == 0 and report.waits[0] == HostWait("triton_poi_fused_mul_0", "triton_poi_fused_mul_0", 17, 1)


def test_the_gaps_inside_a_cuda_graphs_replay_are_the_devices_own():
    """A replay's kernels run while its (traced, so lengthened) cudaGraphLaunch call goes on: they share its
    correlation, and the gaps between them had their kernels queued."""
    trace = {"traceEvents": [op("CUDAGraphNode.run", 0, 60), {**launch(2, 1, name="cudaGraphLaunch"), "dur": 50},
                             kernel(5, 10, 1), kernel(17, 10, 1), kernel(29, 10, 1)]}
    report = host_waits(trace)
    assert report.queued_us == 4 and report.late_us == 5  # the two inner gaps; the wait before the replay began


def test_operator_times_count_a_calls_own_time_and_only_calls_that_launched():
    """A nested same-name operator is one launching call, its time less its child's; a call that launched nothing
    (a CPU copy) is not counted; an operator ending exactly at a launch does not hold it."""
    trace = {"traceEvents": [
        op("aten::sum", 0, 55), op("aten::sum", 10, 38), launch(20, 1), kernel(21, 5, 1),
        op("aten::copy_", 60, 30),
        op("aten::empty", 95, 5), op("aten::mul", 90, 20), launch(100, 2), kernel(101, 5, 2),
    ]}
    operators = {o.name: o for o in host_waits(trace).operators}
    assert set(operators) == {"aten::sum", "aten::mul"}
    assert (operators["aten::sum"].calls, operators["aten::sum"].host_us) == (1, 38)
    assert operators["aten::mul"].host_us == 20 - 5


def test_a_wrapper_range_is_never_the_outermost_operator():
    """Lightning runs the whole closure inside the optimizer's step range: the outermost is what is inside it."""
    trace = {"traceEvents": [op("Optimizer.step#AdamW.step", 0, 100), op("[pl][module]model", 1, 90),
                             op("Torch-Compiled Region: 0/0", 2, 80), op("aten::mm", 10, 10), launch(15, 1),
                             kernel(16, 5, 1)]}
    assert host_waits(trace).waits == [HostWait("aten::mm", "Torch-Compiled Region: 0/0", 16, 1)]


def test_a_device_event_stamped_before_the_recording_is_left_out_and_counted():
    trace = compiled_step()
    trace["traceEvents"].append(kernel(-1e9, 5, 77))
    report = host_waits(trace)
    assert report.dropped == 1 and report.span_us == 95 and report.late_us == 58 and report.profiler_us == 0
    assert "1 stamped before the recording began (left out)" in host_wait_lines(report)[1]


def test_the_lines_survive_an_empty_span_and_name_each_wait_once():
    trace = {"traceEvents": [kernel(5, 0, 1)]}  # one zero-length kernel, no host event
    lines = host_wait_lines(host_waits(trace))
    assert lines[0].startswith("- device idle 0.00 ms of the recording's 0.00 ms (the profiler")
    lines = "\n".join(host_wait_lines(host_waits(compiled_step())))
    assert "; aten::mm (in Torch-Compiled Region: 0/0) 0.01 ms over 1 gap\n" in lines
    assert "over 2 gaps" in "\n".join(host_wait_lines(host_waits({"traceEvents": [
        op("aten::mm", 0, 30), launch(1, 1), kernel(2, 1, 1), launch(10, 2), kernel(12, 1, 2)]})))


def test_the_profilers_own_work_is_its_own():
    """CUPTI's buffer request (kineto's "overhead" event, on the H200's trace: 2.2 ms inside one aten::div) held the
    launch: the part of the idle it covers is the profiler's, the rest the launch's operators', and an operator's own
    time leaves it out (not twice where it falls in a child's time); other overhead events are not counted."""
    trace = {"traceEvents": [
        op("aten::mm", 0, 5), launch(1, 1), kernel(2, 8, 1),
        op("aten::div", 20, 100), {"ph": "X", "cat": "overhead", "name": "Activity Buffer Request", "pid": -1,
                                   "tid": 0, "ts": 22, "dur": 90},
        {"ph": "X", "cat": "overhead", "name": "Buffer Flush", "pid": -1, "tid": 0, "ts": 112, "dur": 3},
        launch(115, 2), kernel(117, 2, 2),
    ]}
    report = host_waits(trace)
    assert report.profiler_us == 90 and report.late_us == 2 + 17  # the start's 2; 10-117 less the request's 90
    assert HostWait(PROFILER, PROFILER, 90, 1) in report.waits and HostWait("aten::div", "aten::div", 17, 1) in (
        report.waits)
    assert report.idle_us == report.span_us - report.busy_us
    assert {o.name: o.host_us for o in report.operators}["aten::div"] == 100 - 90
    nested = {"traceEvents": [
        op("aten::linear", 0, 100), op("aten::addmm", 10, 50), launch(30, 1), launch(90, 2), kernel(95, 5, 1),
        kernel(101, 1, 2), {"ph": "X", "cat": "overhead", "name": "Activity Buffer Request", "ts": 20, "dur": 20}]}
    own = {o.name: o.host_us for o in host_waits(nested).operators}
    assert own == {"aten::linear": 100 - 50, "aten::addmm": 50 - 20}
