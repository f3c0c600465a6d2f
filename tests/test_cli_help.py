"""Every command-line entry point answers ``--help`` with a one-line example of itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (REPO / "scripts").glob("*.py") if not p.name.startswith("_"))
MODULES = ["qatlib.config", "qatlib.plan", "benchmarks.run"]


def _example(cmd: list[str]) -> str:
    r = subprocess.run(
        [sys.executable, *cmd, "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [line for line in r.stdout.splitlines() if line.startswith("example: ")]
    assert len(lines) == 1, r.stdout[-2000:]
    return lines[0].removeprefix("example: ")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_each_script_shows_its_example(script):
    assert f"scripts/{script.name}" in _example([str(script.relative_to(REPO))]).split()


@pytest.mark.parametrize("module", MODULES)
def test_each_module_cli_shows_its_example(module):
    assert _example(["-m", module]).startswith(f"python -m {module} ")
