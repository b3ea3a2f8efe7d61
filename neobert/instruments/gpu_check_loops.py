"""The GPU-node check's loop stages (`neobert.instruments.gpu_check` runs them in order): the recipe's real training
loop under a strategy (`loop_stage`, its figures from the metrics CSV, with `profile` a recording of its steps),
then the resume from the loop's checkpoint (`resume_stage`). Their rows, the Plan and the shared helpers are in
`neobert.instruments.gpu_check_stages`."""

from __future__ import annotations

import dataclasses
import statistics
import time
import traceback
from pathlib import Path

import lightning as L
import torch
from torch.profiler import profile

from neobert.config.gpu_check import GpuCheckConfig
from neobert.config.pretrain import PretrainConfig
from neobert.data.stream_state import DATA_STATE_KEY
from neobert.errors import CheckpointError
from neobert.eval.plots import read_curves
from neobert.instruments.gpu_check_stages import (FAILED, LOOP_PROFILE_FILES, MFU, RESUME, SKIPPED, TOKENS_PER_S,
                                                  VAL_LOSS, Plan, StageRow, attempt, log_interval, memory_estimate_gib,
                                                  peak_memory_gib, start_peak_memory, summarise_recording, unavailable)
from neobert.instruments.kernel_profile import KernelProfile, profiler_activities
from neobert.instruments.timing import synchronize
from neobert.jobs.cli import one_line
from neobert.jobs.pretrain import run_pretraining
from neobert.layout import metrics_csvs
from neobert.lit.checkpoints import newest_readable_checkpoint, verify_checkpoint
from neobert.lit.pretrain import real_tokens


# ---------------------------------------------------------------------------------------------- 2. the loops
class LoopProfiler(L.Callback):
    """torch.profiler over `steps` optimizer steps of a training loop from global step `first_step`, on rank zero:
    where the loop's time goes beside the ceiling's step (the optimizer, the strategy's copies and collectives, the
    device waiting for the host). The device is synchronised at both ends, so that the wall time is the steps'. It
    counts the recorded micro-batches' real tokens as the pretraining module does (`real_tokens`). `result` holds the
    summary once the steps are done (or the loop ended first: then over the steps it ran)."""

    def __init__(self, first_step: int, steps: int, device: torch.device, output_dir: Path) -> None:
        self.first_step, self.steps, self.device, self.output_dir = first_step, steps, device, output_dir
        self.recording: profile | None = None
        self.started_at, self.started_step = 0.0, 0
        self.tokens: list[int | torch.Tensor] = []  # per recorded micro-batch, summed when the recording stops
        self.result: KernelProfile | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if (self.recording is None and self.result is None and trainer.is_global_zero
                and trainer.global_step == self.first_step and batch_idx % trainer.accumulate_grad_batches == 0):
            synchronize(self.device)
            self.recording = profile(activities=profiler_activities(self.device))
            self.recording.start()
            self.started_at, self.started_step = time.perf_counter(), trainer.global_step
        if self.recording is not None:
            self.tokens.append(real_tokens(batch, (batch.get(DATA_STATE_KEY) or {}).get("stats")))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self.recording is not None and trainer.global_step >= self.first_step + self.steps:
            self._stop(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.recording is not None:
            self._stop(trainer)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if self.recording is not None:  # the loop failed: nothing summarised, and no profiler left running
            recording, self.recording = self.recording, None
            recording.stop()

    def _stop(self, trainer) -> None:
        synchronize(self.device)
        wall = time.perf_counter() - self.started_at
        recording, self.recording = self.recording, None
        recording.stop()
        tokens = int(sum(self.tokens))  # a mask's device sums are read here, after the recording
        self.result = summarise_recording(recording, self.device, trainer.global_step - self.started_step, wall,
                                          self.output_dir, LOOP_PROFILE_FILES, tokens)


class StepProbe(L.Callback):
    """The global steps a run started and ended at, and its Trainer (whether fit finished)."""

    def __init__(self) -> None:
        self.trainer: L.Trainer | None = None
        self.started: int | None = None
        self.ended: int | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.trainer, self.started = trainer, trainer.global_step

    def on_train_end(self, trainer, pl_module) -> None:
        self.ended = trainer.global_step

    @property
    def trained(self) -> bool:
        return self.trainer is not None and self.trainer.state.finished


def compiled_graphs() -> int:
    """The graphs torch.compile has compiled in this process so far (dynamo's count)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]  # torch imports dynamo


def train(plan: Plan, run: PretrainConfig, label: str, *callbacks: L.Callback) -> StepProbe:
    """run_pretraining with a probe (and `callbacks`). A failure after training finished (the export, the summary) is
    the export stage's: printed and kept in plan.export_errors, while this stage keeps its figures."""
    probe = StepProbe()
    try:
        run_pretraining(run, extra_callbacks=[probe, *callbacks])
    except Exception as err:
        if not probe.trained:
            raise
        traceback.print_exc()
        plan.export_errors.append(f"after the {label}: {type(err).__name__}: {one_line(err)}")
    return probe


def loop_config(plan: Plan, strategy: str, run_name: str) -> PretrainConfig:
    """The recipe for `steps` steps under `strategy` in output_dir/run_name, validating and checkpointing at the
    last step, with the CSV logger; no unigram baseline (it is not the loop); the export in the run directory."""
    steps = plan.config.steps
    trainer = dataclasses.replace(plan.recipe.trainer, strategy=strategy, max_steps=steps,
                                  checkpoint_every_n_steps=steps, eval_every_n_steps=steps)
    data = dataclasses.replace(plan.recipe.data, baseline_docs=0)
    logging = plan.recipe.logging  # the CSV logger writes what the loop's figures are read from
    if "csv" not in logging.loggers:
        logging = dataclasses.replace(logging, loggers=[*logging.loggers, "csv"])
    run = dataclasses.replace(plan.recipe, trainer=trainer, data=data, logging=logging,
                              output_dir=str(plan.output_dir / run_name), export_dir=None, resume=False)
    run.validate()
    return run


def loop_stage(plan: Plan, title: str, strategy: str, run_name: str,
               profiler: LoopProfiler | None = None) -> tuple[StageRow, PretrainConfig | None]:
    """(the row, the loop's config when it trained). `profiler`: records steps of this loop (`loop_profiler`)."""
    row = StageRow(title, strategy)
    reason = unavailable(strategy, plan.device)
    if reason and plan.device.type == "cuda":  # a GPU node that cannot run the strategy fails the check
        row.status, row.error = FAILED, reason
        return row, None
    if reason:
        row.status, row.notes = SKIPPED, reason
        return row, None
    run = loop_config(plan, strategy, run_name)
    trained = []
    callbacks = [profiler] if profiler is not None else []

    def work() -> None:
        try:
            row.memory_estimate_gib = memory_estimate_gib(plan, run)
        except Exception as err:  # noqa: BLE001 - an estimate the preflight cannot make is noted, not fatal
            row.notes = f"no memory estimate ({type(err).__name__}: {one_line(err)}); "
        start_peak_memory(plan.device)
        if run.model.compile:
            # As in a pretraining run's own process: the ceilings' graphs neither count here nor use up dynamo's
            # recompile limit, past which it runs a frame eagerly with one warning, and the row would time that
            torch._dynamo.reset()
        graphs = compiled_graphs()
        # suppress_errors off: under it (TORCHDYNAMO_SUPPRESS_ERRORS=1) dynamo refuses fail_on_recompile_limit_hit
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, suppress_errors=False):
            probe = train(plan, run, title, *callbacks)
        row.peak_memory_gib = peak_memory_gib(plan.device)
        trained.append(probe.trained)
        row.tokens_per_s, row.mfu, validation = loop_figures(plan, run)
        checkpoint, _ = newest_readable_checkpoint(run.output_dir)
        if checkpoint is None or verify_checkpoint(checkpoint) != plan.config.steps:
            raise CheckpointError(f"{run.output_dir}: no checkpoint of step {plan.config.steps} was written")
        row.notes += (f"steps {plan.config.timed_from}-{plan.config.steps - 1} of {plan.config.steps}"
                      + untimed_steps(plan.config, profiled=profiler is not None)
                      + f"; validation loss {validation:.4f}; checkpoint {checkpoint.name} (step {plan.config.steps})")
        if run.model.compile:  # a recompiling loop (a shape that changes, a size not taken as dynamic) shows here
            scope = run.model.compile_scope
            row.notes += (f"; torch.compile ({scope}) compiled {compiled_graphs() - graphs} graphs in training and "
                          f"validation" + (" (the blocks' and the MLM head's scoring)" if scope == "blocks" else ""))

    attempt(row, work)
    return row, (run if any(trained) else None)


def untimed_steps(config: GpuCheckConfig, profiled: bool) -> str:
    """Why a loop's timed steps start after its warm-up, if they do (profile=true: both loops start alike)."""
    if not config.profile:
        return ""
    first, last = config.warmup_steps, config.warmup_steps + config.profile_steps - 1
    if profiled:
        recorded = f"step {first}" if first == last else f"steps {first}-{last}"
        return f" ({recorded} profiled and step {last + 1}, whose log interval holds the profiler's stop, not timed)"
    return " (from the step the profiled recipe's loop is timed from)"


def loop_profiler(plan: Plan) -> LoopProfiler | None:
    """With profile=true, a profiler of the recipe's loop over the `profile_steps` steps after the warm-up (left out
    of its tokens/s: GpuCheckConfig.timed_from)."""
    if not plan.config.profile:
        return None
    return LoopProfiler(plan.config.warmup_steps, plan.config.profile_steps, plan.device, plan.output_dir)


def loop_figures(plan: Plan, run: PretrainConfig) -> tuple[float, float | None, float]:
    """(tokens/s, MFU or None, the final validation loss) from the run's metrics CSV: the mean of the log intervals
    whose steps all come after the warm-up (and the profiled steps: GpuCheckConfig.timed_from)."""
    interval = log_interval(plan.config, run)
    curves = read_curves(metrics_csvs(run.output_dir), [TOKENS_PER_S, MFU, VAL_LOSS])

    def after_warmup(points: dict[int, float]) -> list[float]:
        return [value for step, value in sorted(points.items()) if step - interval + 1 >= plan.config.timed_from]

    rates, mfus = after_warmup(curves[TOKENS_PER_S]), after_warmup(curves[MFU])
    if not rates:
        raise RuntimeError(f"{run.output_dir}: no {TOKENS_PER_S} logged after the warm-up in its metrics CSV")
    if not curves[VAL_LOSS]:
        raise RuntimeError(f"{run.output_dir}: no {VAL_LOSS} logged: the validation did not run")
    return statistics.fmean(rates), (statistics.fmean(mfus) if mfus else None), curves[VAL_LOSS][max(curves[VAL_LOSS])]


# ---------------------------------------------------------------------------------------------- 3. the resume
def resume_stage(plan: Plan, loop: PretrainConfig | None) -> StageRow:
    steps, more = plan.config.steps, plan.config.resume_steps
    row = StageRow(f"{RESUME} +{more} steps", loop.trainer.strategy if loop else "")
    if loop is None:
        row.status, row.notes = SKIPPED, "no loop trained: nothing to resume"
        return row
    run = dataclasses.replace(loop, resume=True, trainer=dataclasses.replace(loop.trainer, max_steps=steps + more))

    def work() -> None:
        checkpoint, _ = newest_readable_checkpoint(run.output_dir)
        if checkpoint is None:
            raise CheckpointError(f"{run.output_dir} holds no readable checkpoint to resume from")
        saved = verify_checkpoint(checkpoint)
        start_peak_memory(plan.device)
        probe = train(plan, run, row.stage)
        row.peak_memory_gib = peak_memory_gib(plan.device)
        expected = (steps, steps, steps + more)
        if (saved, probe.started, probe.ended) != expected:
            raise CheckpointError(f"expected a resume from the checkpoint of step {steps} to start there and end at "
                                  f"step {steps + more}; the checkpoint {checkpoint.name} is of step {saved}, and the "
                                  f"run started at step {probe.started} and ended at step {probe.ended}")
        row.notes = f"from {checkpoint.name} (step {saved}): started at step {probe.started}, ended at {probe.ended}"

    attempt(row, work)
    return row
