"""The files under config/ are doors, not lab notebooks: an experiment YAML opens with a short
comment saying what it is for and what a user would change (scripts/report.py copies that comment
into the report), and no file under config/ carries dated or commit-stamped measurement notes.
Figures and their history live in results/bench/*.json, the results page and docs/concepts/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "config"
EXPERIMENTS = sorted((CONFIG / "experiments").glob("*.yaml"))
CONFIG_FILES = sorted(p for p in CONFIG.rglob("*") if p.is_file())

MAX_HEADER_LINES = 10
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
# a git commit (7 to 40 hex digits, at least one letter and one digit): a "measured at" stamp
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")


def header_lines(text: str) -> list[str]:
    """The lines before the first YAML content line (comments, and blank lines between them)."""
    out = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            break
        out.append(line)
    return out


def notebook_notes(text: str) -> list[str]:
    """Lines that carry a date or a commit hash."""
    return [ln for ln in text.splitlines() if DATE.search(ln) or COMMIT.search(ln)]


def test_the_checks_see_something():
    assert len(EXPERIMENTS) >= 10
    assert len(CONFIG_FILES) > len(EXPERIMENTS)
    assert all(header_lines(p.read_text(encoding="utf-8")) for p in EXPERIMENTS), (
        "an experiment has no header"
    )


def test_the_checkers_catch_a_notebook():
    eleven = "".join(f"# line {i}\n" for i in range(11)) + "global:\n  seed: 42  # a key\n"
    assert len(header_lines(eleven)) == 11
    assert len(header_lines("# one\n\n# two\nglobal: {}\n")) == 3  # a blank line does not end it
    assert notebook_notes("# recovery 0.906 (measured 2026-12-06)\n")
    assert notebook_notes("# 0.859 (benchmarks/README.md at 2faaa77)\n")
    assert not notebook_notes("steps_per_print: 1000000\nlr: 1.0e-3  # 3 warmup steps\n")
    assert not notebook_notes("sha256: " + "b1" * 32 + "\n")  # a pinned file hash is no commit


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.stem)
def test_experiment_header_is_short(path):
    head = header_lines(path.read_text(encoding="utf-8"))
    assert len(head) <= MAX_HEADER_LINES, (
        f"{path.relative_to(REPO)}: a {len(head)}-line header; say what the experiment is for and "
        f"what a user would change in at most {MAX_HEADER_LINES} lines, and move figures to "
        "results/bench/ or docs/concepts/recipes.md"
    )


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: str(p.relative_to(CONFIG)))
def test_no_dated_notes_under_config(path):
    notes = notebook_notes(path.read_text(encoding="utf-8"))
    assert not notes, f"{path.relative_to(REPO)}: dated or commit-stamped notes: {notes}"
