"""The package's layers only look down, with no cycles, and every function-local import has a reason.

Layers, lowest first: base (`neobert.errors`, `neobert.hub`, `neobert.layout`, `neobert.outputs`, `neobert.config`)
<- `model` <- `data` <- `eval` <- `lit` <- `jobs` <- `instruments` (what measures speed and memory: nothing that
trains imports it); `experiments/` sits on top and parses arguments only: it imports the standard library,
`neobert.jobs`, `neobert.instruments` and the base layer, nothing else. See docs/architecture.md, which names every
job and instrument.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "neobert"
EXPERIMENTS = PACKAGE.parent / "experiments"
ARCHITECTURE_DOC = PACKAGE.parent / "docs" / "architecture.md"
LAYERS = {"errors": 0, "hub": 0, "layout": 0, "outputs": 0, "config": 0, "model": 1, "data": 2, "eval": 3, "lit": 4, "jobs": 5,
          "instruments": 6}
# Heavy or optional dependencies that package code may import inside a function (each with a reason beside it).
LAZY_ALLOWED = ("flash_attn", "xformers", "liger_kernel", "quack", "deepspeed", "mteb", "matplotlib", "sentence_transformers",
                "lightning.pytorch.utilities.deepspeed", "neobert.eval.mteb", "neobert.jobs.mteb")


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) == 1:
        return LAYERS["model"]  # neobert/__init__.py registers the model with transformers
    return LAYERS.get(parts[1])


def imports_of(path: Path, package: Path = PACKAGE) -> list[tuple[str, int, bool, str]]:
    """(imported module, line, inside a function?, the line's source with its comment) for every import."""
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    found.append((alias.name, child.lineno, in_function, lines[child.lineno - 1]))
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                names = [child.module] + [f"{child.module}.{a.name}" for a in child.names]
                target = next((n for n in reversed(names) if _is_module(n, package)), child.module)
                found.append((target, child.lineno, in_function, lines[child.lineno - 1]))
            visit(child, nested)

    visit(tree, False)
    return found


def _is_module(name: str, package: Path) -> bool:
    if not name.startswith(package.name):
        return False
    relative = Path(*name.split(".")[1:]) if "." in name else Path()
    return (package / relative).with_suffix(".py").is_file() or (package / relative / "__init__.py").is_file()


def layering_violations(package: Path = PACKAGE) -> list[str]:
    """Upward imports, circular imports between modules, and function-local imports without an allowed reason."""
    problems, graph = [], {}
    for path in sorted(package.rglob("*.py")):
        module = module_name(path, package)
        graph[module] = set()
        for target, line, in_function, text in imports_of(path, package):
            where = f"{path.relative_to(package.parent)}:{line}"
            if in_function:
                explained = "#" in text or _has_comment_above(path, line)
                if not (target.startswith(LAZY_ALLOWED) and explained):
                    problems.append(f"{where}: function-local import of {target} (allowed only for heavy optional "
                                    f"dependencies {LAZY_ALLOWED}, with a one-line reason)")
            if not target.startswith(package.name + ".") and target != package.name:
                continue
            graph[module].add(target)
            source_layer, target_layer = layer_of(module), layer_of(target)
            if source_layer is None or target_layer is None:
                problems.append(f"{where}: {module} or {target} is in no layer (add it to LAYERS)")
            elif target_layer > source_layer:
                problems.append(f"{where}: {module} (layer {source_layer}) imports {target} (layer {target_layer}), "
                                f"a layer above it")
    problems += [f"circular import: {' -> '.join(cycle)}" for cycle in _cycles(graph)]
    return problems


def _has_comment_above(path: Path, line: int) -> bool:
    return path.read_text().splitlines()[line - 2].strip().startswith("#")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle found by depth-first search (module-level edges; a package's __init__ is its own node)."""
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph.get(node, ())):
            if target == node or target not in graph:
                continue
            if state.get(target) == "open":
                cycles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target, stack + [target])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def experiment_violations(experiments: Path = EXPERIMENTS, package: Path = PACKAGE) -> list[tuple[str, int, str]]:
    """(file, line, module) for every import of `experiments/` beyond the standard library, `neobert.jobs`,
    `neobert.instruments` and the base layer: a command line parses its arguments and calls its job, and nothing
    else."""
    problems = []
    for path in sorted(experiments.glob("*.py")):
        for target, line, _, _ in imports_of(path, package):
            parts = target.split(".")
            if parts[0] == package.name:
                allowed = len(parts) > 1 and (parts[1] in ("jobs", "instruments") or LAYERS.get(parts[1]) == 0)
            else:
                allowed = parts[0] in sys.stdlib_module_names
            if not allowed:
                problems.append((path.name, line, target))
    return problems


def test_the_package_layers_only_look_down():
    assert layering_violations() == []


def test_experiments_parse_arguments_only():
    unexpected = [f"experiments/{name}:{line}: imports {target}, beyond the standard library, neobert.jobs, "
                  f"neobert.instruments and the base layer (a command line parses arguments only: the work goes in its job)"
                  for name, line, target in experiment_violations()]
    assert unexpected == []


def test_the_architecture_doc_names_every_job_and_command_line():
    doc = ARCHITECTURE_DOC.read_text()
    jobs = [p.name for room in ("jobs", "instruments") for p in sorted((PACKAGE / room).glob("*.py"))
            if p.name != "__init__.py"]
    commands = [f"experiments.{p.stem}" for p in sorted(EXPERIMENTS.glob("*.py")) if p.name != "__init__.py"]
    assert [name for name in jobs if f"`{name}`" not in doc] == []
    assert [command for command in commands if f"`{command}`" not in doc] == []


def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    package = tmp_path / "neobert"
    for name, text in {"__init__.py": "", "model/__init__.py": "", "eval/__init__.py": "", "lit/__init__.py": "",
                       **files}.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    return package


@pytest.mark.parametrize("files,expected", [
    ({"eval/metrics.py": "from neobert.lit.trainer import build\n", "lit/trainer.py": "build = 1\n"},
     "a layer above it"),
    ({"model/a.py": "def f():\n    from neobert.model import b\n", "model/b.py": "x = 1\n"},
     "function-local import of neobert.model.b"),
    ({"model/a.py": "from neobert.model import b\n", "model/b.py": "from neobert.model.a import x\nx = 1\n"},
     "circular import"),
    ({"lit/a.py": "def f():\n    from mteb import evaluate\n"}, "function-local import of mteb"),
    ({"jobs/pretrain.py": "from neobert.instruments.timing import time_step\n", "instruments/__init__.py": "",
      "instruments/timing.py": "time_step = 1\n"}, "a layer above it"),
    ({"lit/pretrain.py": "from neobert.instruments import kernel_profile\n", "instruments/__init__.py": "",
      "instruments/kernel_profile.py": "x = 1\n"}, "a layer above it"),
])
def test_the_check_catches_planted_violations(tmp_path, files, expected):
    problems = layering_violations(_plant(tmp_path, files))
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize("text,module", [
    ("from neobert.eval.metrics import score\n", "neobert.eval.metrics"),
    ("from neobert.data import corpus\n", "neobert.data"),
    ("import neobert\n", "neobert"),
    ("def main():\n    import torch  # the work, in the parser\n", "torch"),
])
def test_the_experiments_check_catches_planted_imports(tmp_path, text, module):
    package = _plant(tmp_path, {})
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "planted.py").write_text(text)
    assert [(name, target) for name, _, target in experiment_violations(tmp_path / "experiments", package)] == \
        [("planted.py", module)]


def test_the_experiments_check_accepts_jobs_base_and_the_standard_library(tmp_path):
    package = _plant(tmp_path, {"jobs/__init__.py": "", "jobs/run.py": "def run():\n    pass\n",
                                "config/__init__.py": "load_config = 1\n", "errors.py": "UserInputError = 1\n"})
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "run.py").write_text(
        "from __future__ import annotations\n\nimport argparse\nimport sys\n\nfrom neobert.config import load_config\n"
        "from neobert.errors import UserInputError\nfrom neobert.jobs.run import run\n")
    assert experiment_violations(tmp_path / "experiments", package) == []


def test_the_check_accepts_downward_and_explained_lazy_imports(tmp_path):
    package = _plant(tmp_path, {
        "lit/a.py": "from neobert.model.b import x\n\n\ndef f():\n    import matplotlib  # heavy: only for plots\n",
        "model/b.py": "x = 1\n"})
    assert layering_violations(package) == []
