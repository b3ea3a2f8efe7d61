"""The docs a user reads stay short and about the product: docs/benchmarks.md holds current results in under 500
lines, no README line is over 200 characters, and the project's text (docs, package, scripts, command lines) says how
a figure was measured by machine, versions, date and command only, never in the project's own working words."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT_SUFFIXES = {".md", ".py", ".sh", ".yaml", ".yml", ".txt", ".cfg", ".toml", ".ipynb", ".json"}
SCANNED = ("docs", "neobert", "scripts", "experiments")
# The word and its plural, whole words only ("release", "please" pass); spelt in two pieces so that this file, were
# it scanned, would not match itself.
WORKING_WORD = re.compile(r"\b" + "lea" + r"ses?\b", re.IGNORECASE)


def text_files(folder: Path):
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.suffix in TEXT_SUFFIXES and "__pycache__" not in path.parts:
            yield path


def test_benchmarks_md_is_under_500_lines():
    lines = (ROOT / "docs" / "benchmarks.md").read_text().splitlines()
    assert len(lines) < 500, f"docs/benchmarks.md has {len(lines)} lines: keep current results only (git keeps the rest)"


def test_no_readme_line_is_over_200_characters():
    long = [(number, len(line)) for number, line in enumerate((ROOT / "README.md").read_text().splitlines(), 1)
            if len(line) > 200]
    assert not long, f"README.md lines over 200 characters (line, length): {long}"


def test_the_working_word_appears_nowhere_in_the_project_text():
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}"
             for folder in SCANNED for path in text_files(ROOT / folder)
             for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
             if WORKING_WORD.search(line)]
    assert not found, "\n".join(found)


def test_the_pattern_matches_the_word_and_not_its_neighbours():
    word = "lea" + "se"
    for text in (word, word + "s", f"a {word}'s steps", word.capitalize()):
        assert WORKING_WORD.search(text), text
    for text in ("re" + word, "p" + word, "re" + word + "s"):
        assert not WORKING_WORD.search(text), text
