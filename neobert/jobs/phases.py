"""Phased pretraining (`phases:` in a recipe): one command runs every phase in order, each from where the one
before ended, as Ettin (pretraining -> context extension -> decay), mmBERT and ModernBERT train.

A phase is the recipe with its own overrides and those of the phases before it applied (`phase_config`), run by
`run_pretraining` from the checkpoint that ended the phase before (`PhaseRun`): the weights, the optimizer state,
the global step and so the learning-rate schedule (one schedule over trainer.max_steps, the whole recipe: no second
warm-up unless a phase asks for one) carry over; so does the data position in every source a phase shares with the
one before (`neobert.data.stream_state.carried_state`). A phase ends with its own final checkpoint
(`checkpoints/phase-<name>.ckpt`, never rotated away) and its export (`export/<name>/`, with `phase.json` written
last). Running the command again resumes wherever it stopped: mid-phase, at a boundary, or re-exporting a phase
whose export a crash interrupted. `--phase NAME` reruns from the start of phase NAME, from the previous phase's
final checkpoint, into `output_dir/from-<NAME>/` (a new decay off a finished pretraining phase, say).

Before the first step, every phase still to run is checked as a whole run would be (`prepare`: its config, its
data sources, its model and lengths), the phase named in the error; and a run directory holds one plan
(`phases.json`, `plan_record`): `resume=false` into a directory with checkpoints is refused as a single run's is,
and a plan that differs from the one recorded there (a phase's length, any key of a phase's resolved config) is
refused naming what changed.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import lightning as L
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from neobert.config import ConfigError
from neobert.config.pretrain import PHASE_KEYS, PretrainConfig
from neobert.errors import CheckpointError, UserInputError
from neobert.hub import HubUnreachableError
from neobert.jobs.pretrain import prepare, run_pretraining
from neobert.layout import EXPORT_DIR, PHASE_PLAN, checkpoint_dir, write_atomically
from neobert.lit.checkpoints import refuse_existing_checkpoints, verify_checkpoint
from neobert.outputs import hold_output_dir

log = logging.getLogger(__name__)

PHASE_DONE = "phase.json"  # written into a phase's export directory once the export is complete


@dataclass
class PhaseRun:
    """One phase as `run_pretraining` runs it."""

    index: int
    name: str
    start_step: int  # the global step it starts at (the end of the phase before)
    end_step: int  # its trainer.max_steps
    total_steps: int  # the recipe's trainer.max_steps
    schedule_start: int  # the first step of its lr schedule (its segment: see plan_phases)
    schedule_end: int
    config: PretrainConfig  # resolved: this phase's overrides applied, max_steps = end_step, its export_dir
    start_checkpoint: Path | None  # the final checkpoint of the phase before (None: the first phase)
    final_checkpoint: Path  # written at its end, before the export

    def checkpoint(self, resumable: Path | None) -> Path | None:
        """Where the phase's training state comes from: its own final checkpoint (finished: only the export is
        left), else its newest checkpoint inside the phase (resume), else the phase before's final checkpoint."""
        if _step_of(self.final_checkpoint) == self.end_step:
            return self.final_checkpoint
        if resumable is not None and self.start_step < (_step_of(resumable) or -1) <= self.end_step:
            return resumable
        return self.start_checkpoint

    def done(self) -> bool:
        marker = Path(self.config.export_dir) / PHASE_DONE
        return marker.is_file() and _step_of(self.final_checkpoint) == self.end_step


def _step_of(path: Path | None) -> int | None:
    if path is None or not Path(path).exists():
        return None
    try:
        return verify_checkpoint(path)
    except CheckpointError:
        return None


def phase_config(config: PretrainConfig, index: int) -> PretrainConfig:
    """The recipe with the overrides of phases 0..index applied in order (a phase keeps what the phases before it
    changed unless it changes it again), resolved and checked as a whole config (as the loader does: this builds
    the config itself); phases cleared."""
    resolved = OmegaConf.structured(config)
    resolved.phases = []
    for k, phase in enumerate(config.phases[: index + 1]):
        for key, value in phase.overrides.items():
            where = f"phases[{k}].overrides.{key}"
            if not key.startswith(PHASE_KEYS):
                raise ConfigError(f"invalid config key '{where}': {key} cannot change between phases (the weights, "
                                  f"optimizer state and data streams carry over); a phase may change {PHASE_KEYS}")
            try:
                OmegaConf.update(resolved, key, copy.deepcopy(value), merge=True)  # a list is replaced whole
            except (OmegaConfBaseException, ValueError, TypeError) as err:
                raise ConfigError(f"invalid config key '{where}': {err}") from err
    try:
        result = OmegaConf.to_object(resolved)
    except OmegaConfBaseException as err:
        raise ConfigError(f"invalid config key 'phases[{index}].overrides': {err}") from err
    result.resolve()  # what this phase's keys decide (its data.packing given as a boolean, its data.static_shapes)
    try:
        result.validate()
    except ConfigError as err:
        raise ConfigError(f"{err} (in phase {index}, {config.phases[index].name!r})") from err
    return result


def plan_phases(config: PretrainConfig) -> list[PhaseRun]:
    """Every phase resolved and placed on the step axis; what would fail later is refused here, naming the key."""
    names = [phase.name for phase in config.phases]
    runs, start = [], 0
    output = Path(config.output_dir)
    for index, phase in enumerate(config.phases):
        key = f"phases[{index}]"
        if not phase.name or not phase.name.replace("-", "").replace("_", "").isalnum():
            raise ConfigError(f"invalid config key '{key}.name': must be a name of letters, digits, '-' or '_' (it "
                              f"names the export directory), got {phase.name!r}")
        if phase.name in names[:index]:
            raise ConfigError(f"invalid config key '{key}.name': {phase.name!r} names two phases")
        if phase.steps is not None and phase.tokens is not None:
            raise ConfigError(f"invalid config key '{key}.tokens': give steps or tokens, not both "
                              f"(steps={phase.steps} is set)")
        for field in ("steps", "tokens"):
            value = getattr(phase, field)
            if value is not None and value <= 0:
                raise ConfigError(f"invalid config key '{key}.{field}': must be positive, got {value}" + (
                    " (leave it out only in the last phase, which then runs to trainer.max_steps)" if value == 0
                    else ""))
        resolved = phase_config(config, index)
        last = index == len(config.phases) - 1
        if phase.steps is not None:
            length = phase.steps
        elif phase.tokens is not None:
            length = math.ceil(phase.tokens / (resolved.trainer.batch_size * resolved.data.max_length))
        elif last:
            length = config.trainer.max_steps - start
            if length <= 0:
                raise ConfigError(f"invalid config key '{key}.steps': no step is left for phase {phase.name!r}: the "
                                  f"phases before it end at step {start} = trainer.max_steps")
        else:
            raise ConfigError(f"invalid config key '{key}.steps': only the last phase may leave its length out "
                              f"(it runs to trainer.max_steps)")
        end = start + length
        if end > config.trainer.max_steps:
            raise ConfigError(f"invalid config key '{key}.steps': the phases up to {phase.name!r} end at step {end}, "
                              f"beyond trainer.max_steps={config.trainer.max_steps}")
        resolved.trainer.max_steps = end
        resolved.export_dir = str(Path(config.export_dir or output / EXPORT_DIR) / phase.name)
        resolved.resume = config.resume if index == 0 else True  # later phases continue the recipe's own run
        runs.append(PhaseRun(index, phase.name, start, end, config.trainer.max_steps, start, end, resolved,
                             runs[-1].final_checkpoint if runs else None,
                             checkpoint_dir(output) / f"phase-{phase.name}.ckpt"))
        start = end
    _refuse_architecture_changes(runs)
    _schedule_segments(config, runs)
    return runs


def _schedule_segments(config: PretrainConfig, runs: list[PhaseRun]) -> None:
    """The lr schedule runs on across phases, one schedule from the first phase to the next phase that changes
    a scheduler.* key: that phase starts a schedule of its own (over its steps and those of the phases after it
    that keep it), without a warm-up unless it sets scheduler.warmup_steps or scheduler.warmup_fraction itself
    (NeoBERT's stage 2: constant at 6e-5 after stage 1's cosine; Ettin's decay phase). optimizer.lr alone keeps
    the schedule and changes its peak."""
    starts = [run.index for run in runs if run.index == 0 or any(
        key.startswith("scheduler.") for key in config.phases[run.index].overrides)]
    for first, following in zip(starts, starts[1:] + [len(runs)]):
        segment = runs[first:following]
        own_warmup = first == 0 or any(key in ("scheduler.warmup_steps", "scheduler.warmup_fraction")
                                       for key in config.phases[first].overrides)
        for run in segment:
            run.schedule_start, run.schedule_end = segment[0].start_step, segment[-1].end_step
            if not own_warmup:
                run.config.scheduler.warmup_steps, run.config.scheduler.warmup_fraction = 0, None


def _refuse_architecture_changes(runs: list[PhaseRun]) -> None:
    # PHASE_KEYS already keeps the model's shape out of a phase's overrides; the tokenizer and the model preset
    # must also agree, whatever a phase's data section says.
    first = runs[0].config
    for run in runs[1:]:
        for key in ("model.preset", "data.tokenizer", "trainer.devices", "trainer.num_nodes", "data.num_workers"):
            section, field = key.split(".")
            if getattr(getattr(run.config, section), field) != getattr(getattr(first, section), field):
                raise ConfigError(f"invalid config key 'phases[{run.index}].overrides.{key}': cannot change between "
                                  f"phases")


def run_phases(config: PretrainConfig, from_phase: str | None = None,
               extra_callbacks: Sequence[L.Callback] = ()) -> list[Path]:
    """Runs (or resumes) every phase in order; returns their export directories. `from_phase`: rerun from the
    start of that phase, from the previous phase's final checkpoint, into output_dir/from-<name>."""
    runs = plan_phases(config)
    if from_phase is not None:
        runs = _branch(config, runs, from_phase)
    output = Path(runs[0].config.output_dir)  # output_dir, or output_dir/from-<name>
    with hold_output_dir(output) as writer:  # for every phase: each one's run_pretraining holds it again
        if not config.resume:  # as a single run: a new run must not mix its checkpoints with an earlier run's
            refuse_existing_checkpoints(output)
        plan = plan_record(runs)
        refuse_another_plan(output, plan, branch=from_phase is not None)
        check_phases(runs)
        if writer and _read_plan(output) != plan:
            write_atomically(output / PHASE_PLAN, [json.dumps(plan, indent=1) + "\n"])
        return [run_phase(run, extra_callbacks) for run in runs]


def run_phase(run: PhaseRun, extra_callbacks: Sequence[L.Callback]) -> Path:
    """One phase of `run_phases` (a done one is only logged); returns its export directory."""
    if run.done():
        log.info("phase %r (steps %d-%d) is done: %s", run.name, run.start_step, run.end_step, run.config.export_dir)
    else:
        log.info("phase %r: steps %d-%d of %d", run.name, run.start_step, run.end_step, run.total_steps)
        run_pretraining(run.config, extra_callbacks, phase=run)
        marker = Path(run.config.export_dir) / PHASE_DONE
        if marker.parent.is_dir():  # rank 0 exported
            marker.write_text(json.dumps({"phase": run.name, "start_step": run.start_step,
                                          "end_step": run.end_step}) + "\n")
    return Path(run.config.export_dir)


def check_phases(runs: list[PhaseRun]) -> None:
    """Every phase still to run checked before the first step, as a run checks itself before its own (`prepare`:
    the config, the data sources' files and columns, the model and its lengths): an error names the phase, instead
    of surfacing when that phase starts, after the phases before it trained."""
    for run in runs:
        if run.done():
            continue
        try:
            prepare(run.config, run)
        except (UserInputError, HubUnreachableError) as err:
            raise type(err)(f"phase {run.name!r}: {err}") from err


# What a plan is not: where and on what it runs, how it is logged and evaluated, and what the phases set for
# themselves (their trainer.max_steps: the plan's steps).
PLAN_IGNORED = ("resume", "output_dir", "export_dir", "trainer.max_steps", "trainer.accelerator", "trainer.devices",
                "trainer.num_nodes", "logging.", "glue_callback.", "mteb_callback.")


def plan_record(runs: list[PhaseRun]) -> dict:
    """The plan of a phased run, as `phases.json` records it: every phase's name, steps and resolved config (each
    field of the schema, a dict or list as one value), less PLAN_IGNORED."""
    phases = []
    for run in runs:
        flat = {key: value for key, value in _fields(run.config).items() if not key.startswith(PLAN_IGNORED)}
        phases.append({"name": run.name, "start_step": run.start_step, "end_step": run.end_step, "config": flat})
    return json.loads(json.dumps({"phases": phases}, default=str))


def _fields(obj, prefix: str = "") -> dict:
    if dataclasses.is_dataclass(obj):
        return {key: value for field in dataclasses.fields(obj)
                for key, value in _fields(getattr(obj, field.name), f"{prefix}{field.name}.").items()}
    return {prefix[:-1]: json.loads(json.dumps(obj, default=lambda o: dataclasses.asdict(o)
                                              if dataclasses.is_dataclass(o) else str(o)))}


def _read_plan(output: Path) -> dict | None:
    try:
        return json.loads((output / PHASE_PLAN).read_text())
    except (OSError, ValueError):
        return None


def refuse_another_plan(output: Path, plan: dict, branch: bool = False) -> None:
    """A run directory holds one plan: once it holds checkpoints, a plan other than the one it recorded (a phase's
    length, a key of a phase's resolved config) is a ConfigError naming what changed. A key only one of the two
    plans knows (a schema of another release) is no change."""
    recorded = _read_plan(output)
    if recorded is None or not any(checkpoint_dir(output).glob("*.ckpt")):
        return
    changes = plan_changes(recorded, plan)
    if changes:
        shown = "; ".join(changes[:6]) + (f"; and {len(changes) - 6} more" if len(changes) > 6 else "")
        elsewhere = f"move {output} away to branch again" if branch else "choose another output_dir"
        raise ConfigError(f"output_dir={str(output)!r} holds a phased run of another plan ({output / PHASE_PLAN}): "
                          f"{shown}. A run directory holds one plan: run it with the plan it holds to continue it, "
                          f"or {elsewhere}")


def plan_changes(there: dict, here: dict) -> list[str]:
    """What differs between two plans (`plan_record`), one phrase per change."""
    old, new = there.get("phases", []), here["phases"]
    if [p.get("name") for p in old] != [p["name"] for p in new]:
        return [f"phases {[p.get('name') for p in old]} there, {[p['name'] for p in new]} here"]
    changes, keys = [], {}
    for a, b in zip(old, new):
        if (a.get("start_step"), a.get("end_step")) != (b["start_step"], b["end_step"]):
            changes.append(f"phase {b['name']!r} steps {a.get('start_step')}-{a.get('end_step')} there, "
                           f"{b['start_step']}-{b['end_step']} here")
        for key, value in b["config"].items():
            if key in a.get("config", {}) and a["config"][key] != value:
                shown = (key, _shown(a["config"][key]), _shown(value))
                keys.setdefault(shown, []).append(b["name"])
    for (key, was, now), names in keys.items():
        where = f"phase {names[0]!r}" if len(names) == 1 else "phases " + ", ".join(repr(n) for n in names)
        changes.append(f"{key} {was} there, {now} here ({where})")
    return changes


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _branch(config: PretrainConfig, runs: list[PhaseRun], name: str) -> list[PhaseRun]:
    names = [run.name for run in runs]
    if name not in names:
        raise ConfigError(f"--phase {name!r} is not a phase of this recipe: {names}")
    index = names.index(name)
    start = runs[index].start_checkpoint
    if start is not None and _step_of(start) != runs[index].start_step:
        raise ConfigError(f"--phase {name!r} starts from the final checkpoint of phase {names[index - 1]!r}, "
                          f"{start}, which is missing or unreadable: run that phase first")
    branch = dataclasses.replace(config, output_dir=str(Path(config.output_dir) / f"from-{name}"), export_dir=None)
    branched = plan_phases(branch)[index:]
    branched[0].start_checkpoint = start
    branched[0].config.resume = True
    return branched
