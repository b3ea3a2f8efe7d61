"""The pretraining step loop reads nothing back from the device between two log reads: no `.item()`, no `bool()` of a
tensor, no boolean-mask indexing or `nonzero` (data-dependent shapes), no copy to the CPU. On a GPU each of those
stalls the pipeline until the device catches up. Every tensor operation of the training step, the backward, the
gradient clipping and the optimizer step is watched through a TorchFunctionMode; steps that read their metrics
(every logging.log_every_n_steps) are excluded, the others must read nothing."""

from __future__ import annotations

import sys

import lightning as L
import pytest
import torch
from test_pretrain import tiny_config
from torch.overrides import TorchFunctionMode

from neobert.jobs.pretrain import run_pretraining

# Operations that read a device value on the host (or return a shape that depends on device values).
# `new_tensor`: a tensor made from host values, a host-to-device copy on a GPU.
HOST_READS = {"__bool__", "__int__", "__float__", "__index__", "item", "tolist", "numpy", "cpu", "nonzero",
              "masked_select", "unique", "unique_consecutive", "new_tensor"}


class HostReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if sys._getframe(1).f_globals.get("__name__", "").startswith("torch.optim"):
            pass  # the step counter of a (non-capturable) optimizer: PyTorch keeps it on the CPU, read without a sync
        elif name in HOST_READS:
            self.reads.append(name)
        elif name == "__getitem__" and any(isinstance(a, torch.Tensor) and a.dtype == torch.bool
                                           for a in _flatten(args[1:])):
            self.reads.append("boolean-mask indexing")
        elif name == "repeat_interleave" and kwargs.get("output_size") is None and isinstance(
                args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor):
            self.reads.append("repeat_interleave without output_size")
        return func(*args, **kwargs)


def _flatten(items):
    for item in items:
        if isinstance(item, (tuple, list)):
            yield from _flatten(item)
        else:
            yield item


class WatchSteps(L.Callback):
    """Watches every training batch from its start (forward, loss, backward, clipping, optimizer, every callback's
    on_train_batch_end, the progress bar included) to the end of Lightning's own bookkeeping of the batch (its
    logger connector's on_batch_end, which reads what was logged with prog_bar=True)."""

    def __init__(self):
        self.reads_per_step: dict[int, list[str]] = {}
        self.mode: HostReads | None = None

    def on_train_start(self, trainer, module):
        connector = trainer._logger_connector
        lightnings_end = connector.on_batch_end

        def on_batch_end():
            lightnings_end()
            if self.mode is not None:
                self.mode.__exit__(None, None, None)
                self.reads_per_step[trainer.global_step] = self.mode.reads
                self.mode = None

        connector.on_batch_end = on_batch_end

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.mode = HostReads()
        self.mode.__enter__()


@pytest.mark.parametrize("packing", ["none", "greedy"])
def test_the_training_step_reads_nothing_from_the_device_between_log_reads(tmp_path, packing):
    watch = WatchSteps()
    run_pretraining(tiny_config(tmp_path, f"data.packing={packing}", "trainer.max_steps=6",
                                "logging.log_every_n_steps=3", "trainer.checkpoint_every_n_steps=100",
                                "trainer.gradient_clip_val=1.0", "logging.progress_bar=true"), [watch])
    # Steps are numbered after their update: steps 3 and 6 read the metrics, the others must not read anything.
    assert sorted(watch.reads_per_step) == [1, 2, 3, 4, 5, 6]
    quiet = {step: reads for step, reads in watch.reads_per_step.items() if step % 3}
    assert quiet == {1: [], 2: [], 4: [], 5: []}
    assert watch.reads_per_step[3], "the watch saw no read at a log step: it would not see one elsewhere either"
