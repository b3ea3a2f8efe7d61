"""Phased runs and bad input: a run directory holds one plan (a changed phase length
or override is refused naming what changed), resume=false is refused on a directory with checkpoints as a single
run's is, every phase's resolved config is checked before the first step (the phase named), the logged steps are
contiguous and the per-source token counts cumulative across phases, and a bad phase length says what is wrong.

`tp.yaml` is a phased recipe at test size: three phases of 2, 2 and the rest of 6 steps over two local JSONL
sources, run through the command line in-process (`run_cli`: one line, status 2)."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
from test_mixtures import write_source
from test_pretrain import Recorder, tiny_config

from experiments.pretrain import main
from neobert.config import ConfigError
from neobert.jobs.cli import run_cli
from neobert.jobs.phases import plan_phases, run_phases
from neobert.layout import metrics_csvs

PHASES = [
    {"name": "pretraining", "steps": 2},
    {"name": "extension", "steps": 2, "overrides": {"masking.rate": 0.3, "data.max_length": 48}},
    {"name": "decay", "overrides": {"scheduler.phase": "decay"}},
]


def sources(tmp_path: Path) -> list[dict]:
    web = write_source(tmp_path / "web.jsonl", "alpha", 60)
    wiki = write_source(tmp_path / "wiki.jsonl", "beta", 40)
    return [{"name": "web", "source": str(web)}, {"name": "wiki", "source": str(wiki)}]


def write_recipe(tmp_path: Path, phases=None, **top) -> Path:
    """tp.yaml: the tiny model, two local sources, three phases (2/2/rest of 6 steps), validation at every
    boundary, resume=true."""
    recipe = {
        "model": {"preset": "tiny", "overrides": {"max_length": 64}},
        "data": {"source": None, "sources": sources(tmp_path), "max_length": 32, "shuffle_buffer": 16,
                 "num_workers": 0, "validation_docs": 8},
        "scheduler": {"name": "wsd", "phase": "stable", "warmup_steps": 1},
        "trainer": {"accelerator": "cpu", "devices": 1, "micro_batch_size": 4, "max_steps": 6,
                    "checkpoint_every_n_steps": 2, "eval_every_n_steps": 2},  # validated at each boundary
        "logging": {"progress_bar": False, "log_every_n_steps": 1},
        "output_dir": str(tmp_path / "tp"),
        "resume": True,
        "phases": PHASES if phases is None else phases,
        **top,
    }
    path = tmp_path / "tp.yaml"
    path.write_text(json.dumps(recipe))  # JSON is YAML
    return path


def cli(capsys, *argv) -> tuple[int, str]:
    """(status, the last line on stderr) of `python -m experiments.pretrain argv`, run in-process."""
    capsys.readouterr()
    status = run_cli(main, [str(a) for a in argv])
    lines = capsys.readouterr().err.strip().splitlines()
    return status, lines[-1] if lines else ""


def snapshot(directory: Path) -> dict:
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


# -------------------------------------------------------------------------------------- one plan per directory
def test_a_changed_phase_length_is_refused_naming_what_changed(tmp_path, capsys):
    recipe = write_recipe(tmp_path)
    assert cli(capsys, "--config", recipe)[0] == 0
    run = tmp_path / "tp"
    before = snapshot(run)
    longer = [dict(PHASES[0], steps=3)] + PHASES[1:]
    status, line = cli(capsys, "--config", write_recipe(tmp_path, longer))
    assert status == 2
    assert line == (f"error: output_dir='{run}' holds a phased run of another plan ({run}/phases.json): phase "
                    f"'pretraining' steps 0-2 there, 0-3 here; phase 'extension' steps 2-4 there, 3-5 here; phase "
                    f"'decay' steps 4-6 there, 5-6 here. A run directory holds one plan: run it with the plan it "
                    f"holds to continue it, or choose another output_dir")
    assert snapshot(run) == before  # nothing retrained, no last-v1.ckpt beside last.ckpt
    # a changed override of every phase, or of one phase, is a changed plan too
    status, line = cli(capsys, "--config", write_recipe(tmp_path), "optimizer.lr=1e-4")
    assert status == 2 and line.endswith(
        "phases.json): optimizer.lr 0.0006 there, 0.0001 here (phases 'pretraining', 'extension', 'decay'). A run "
        "directory holds one plan: run it with the plan it holds to continue it, or choose another output_dir")
    retuned = PHASES[:2] + [dict(PHASES[2], overrides={"scheduler.phase": "decay", "masking.rate": 0.1})]
    status, line = cli(capsys, "--config", write_recipe(tmp_path, retuned))
    assert status == 2 and "phases.json): masking.rate 0.3 there, 0.1 here (phase 'decay'). " in line
    assert snapshot(run) == before
    # what only says where and how it runs is no change of plan: the finished run is done
    assert cli(capsys, "--config", write_recipe(tmp_path), "logging.progress_bar=true", "data.num_workers=0")[0] == 0
    assert snapshot(run) == before


# ----------------------------------------------------------------------- resume=false and new overrides
def test_resume_false_is_refused_on_a_phased_run_as_on_a_single_run(tmp_path, capsys):
    recipe = write_recipe(tmp_path)
    run = tmp_path / "tp"
    with pytest.raises(InterruptedError):  # killed in its second phase
        run_phases(_load(recipe), extra_callbacks=[Recorder(stop_at_step=3)])
    before = snapshot(run)
    refusal = (f"error: output_dir='{run}' already holds checkpoints: set resume=true to continue that run, or "
               f"choose another output_dir")
    assert cli(capsys, "--config", recipe, "resume=false") == (2, refusal)
    assert snapshot(run) == before  # it used to resume anyway
    assert cli(capsys, "--config", recipe)[0] == 0  # resume=true finishes it
    finished = snapshot(run)
    assert cli(capsys, "--config", recipe, "resume=false", "optimizer.lr=1e-4") == (2, refusal)
    assert snapshot(run) == finished  # it used to report "done" and use nothing new


def test_a_rerun_of_a_phase_into_an_existing_branch_is_refused_when_it_changes(tmp_path, capsys):
    recipe = write_recipe(tmp_path)
    assert cli(capsys, "--config", recipe)[0] == 0
    assert cli(capsys, "--config", recipe, "--phase", "extension")[0] == 0
    branch = tmp_path / "tp" / "from-extension"
    before = snapshot(branch)
    status, line = cli(capsys, "--config", recipe, "--phase", "extension", "optimizer.lr=5e-4")
    assert status == 2 and line == (
        f"error: output_dir='{branch}' holds a phased run of another plan ({branch}/phases.json): optimizer.lr "
        f"0.0006 there, 0.0005 here (phases 'extension', 'decay'). A run directory holds one plan: run it with the "
        f"plan it holds to continue it, or move {branch} away to branch again")
    assert cli(capsys, "--config", recipe, "--phase", "extension", "resume=false") == (
        2, f"error: output_dir='{branch}' already holds checkpoints: set resume=true to continue that run, or choose "
           f"another output_dir")
    assert snapshot(branch) == before


def _load(recipe: Path):
    from neobert.jobs.pretrain import load_pretrain_config

    return load_pretrain_config(str(recipe))


# -------------------------------------------------------------------- every phase checked before the first step
@pytest.mark.parametrize("change, message", [
    ({"data.sources": [{"name": "web", "source": "MISSING/gone.jsonl"}]},
     "phase 'extension': data.sources[0].source='MISSING/gone.jsonl' does not exist"),
    ({"data.sources": [{"name": "web", "source": "WEB", "text_column": "text"}]},
     "phase 'extension': data.sources[0].text_column='text' is not a column of the data; columns: ['content']"),
    ({"data.max_length": 128},
     "phase 'extension': invalid config key 'data.max_length': 128 exceeds the model's max_length 64 (set "
     "model.overrides.max_length)"),
])
def test_every_phase_is_checked_before_the_first_step(tmp_path, capsys, change, message):
    web = sources(tmp_path)[0]["source"]
    change = json.loads(json.dumps(change).replace("MISSING", str(tmp_path)).replace('"WEB"', json.dumps(web)))
    phases = [PHASES[0], dict(PHASES[1], overrides=change), PHASES[2]]
    config = _load(write_recipe(tmp_path, phases))
    with pytest.raises(ConfigError) as raised:
        run_phases(config)
    assert str(raised.value) == message.replace("MISSING", str(tmp_path))
    assert not (tmp_path / "tp").exists()  # nothing trained, nothing written
    status, line = cli(capsys, "--config", write_recipe(tmp_path, phases))
    assert (status, line) == (2, "error: " + message.replace("MISSING", str(tmp_path)))


def test_a_wrong_text_column_of_a_source_names_its_key():
    from neobert.data.corpus import check_column

    with pytest.raises(ConfigError, match=re.escape("data.sources[1].text_column='text' is not a column")):
        check_column({"content": []}, "text", "data.sources[1].text_column")


# ------------------------------------------------------------------------------------------- phased metrics
def test_phased_metrics_are_contiguous_and_count_tokens_across_phases(tmp_path, capsys):
    recipe = write_recipe(tmp_path)
    assert cli(capsys, "--config", recipe)[0] == 0
    rows = []
    for path in metrics_csvs(tmp_path / "tp"):
        with open(path) as f:
            rows += [row for row in csv.DictReader(f) if row.get("train/loss")]
    steps = [int(row["step"]) for row in rows]
    assert steps == list(range(6))  # one logged step per optimizer step, none skipped at a boundary, < max_steps
    for name in ("web", "wiki"):
        drawn = [float(row[f"train/tokens/{name}"]) for row in rows]
        assert drawn == sorted(drawn) and drawn[-1] > drawn[1] > 0  # drawn so far: never restarts at a phase
    shares = [float(rows[2]["train/share/web"]), float(rows[2]["train/share/wiki"])]
    assert sum(shares) == pytest.approx(1.0)  # the share stays the phase's own


# -------------------------------------------------------------------------------- what is wrong with a length
@pytest.mark.parametrize("phases, message", [
    ("[{name: a, steps: 0}, {name: b}]", "invalid config key 'phases[0].steps': must be positive, got 0 (leave it "
                                         "out only in the last phase, which then runs to trainer.max_steps)"),
    ("[{name: a, tokens: -1000}, {name: b}]", "invalid config key 'phases[0].tokens': must be positive, got -1000"),
    ("[{name: a, steps: -2}, {name: b}]", "invalid config key 'phases[0].steps': must be positive, got -2"),
    ("[{name: a, steps: 2, tokens: 1000}, {name: b}]",
     "invalid config key 'phases[0].tokens': give steps or tokens, not both (steps=2 is set)"),
    ("[{name: a}, {name: b, steps: 2}]", "invalid config key 'phases[0].steps': only the last phase may leave its "
                                         "length out (it runs to trainer.max_steps)"),
    ("[{name: a, steps: 8}, {name: b}]", "invalid config key 'phases[1].steps': no step is left for phase 'b': the "
                                         "phases before it end at step 8 = trainer.max_steps"),
])
def test_a_bad_phase_length_says_what_is_wrong(tmp_path, phases, message):
    with pytest.raises(ConfigError) as raised:
        plan_phases(tiny_config(tmp_path, f"phases={phases}", "trainer.max_steps=8"))
    assert str(raised.value) == message


def test_a_new_phase_keeps_the_tokens_drawn_from_each_shared_source():
    from neobert.data.stream_state import MixtureState, StreamState, carried_state

    web, wiki, code = ("web",) * 5, ("wiki",) * 5, ("code",) * 5
    old = StreamState(mixture=MixtureState.fresh(2))
    old.mixture.tokens, old.mixture.documents = [900, 300], [30, 10]
    second = carried_state(old, [web, wiki], [code, web])
    assert second.mixture.tokens == [0, 0] and second.mixture.tokens_before == [0, 900]
    second.mixture.tokens = [50, 70]
    third = carried_state(second, [code, web], [web, wiki, code])  # wiki left out in the second phase
    assert third.mixture.tokens_before == [970, 0, 50]
