"""The README's two set-up commands run what CI runs: `.ci/run` installs nothing beyond
`install.sh`, and the README's test command is `bash install.sh && python3 -m pytest`, which
`.ci/run` calls (with the linters added); and in CI a skipped test fails the run
(`conftest.unexpected_skips`), so a missing install step cannot hide behind a skip."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

from conftest import unexpected_skips

REPO = Path(__file__).resolve().parents[1]
INSTALLERS = re.compile(r"\b(pip|apt-get|apt|conda|mamba|npm)\b[^\n]*\binstall\b")


def _commands(text: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def test_ci_installs_nothing_beyond_install_sh():
    ci = _commands((REPO / ".ci/run").read_text())
    assert "bash install.sh" in ci
    assert [c for c in ci if INSTALLERS.search(c)] == []
    install = (REPO / "install.sh").read_text()
    # what CI needs for its tests is installed by install.sh: the vLLM oracle and a browser
    assert "requirements/runtime-oracle.txt" in install
    assert "chromium" in install


def test_readme_test_command_is_what_ci_runs():
    readme = (REPO / "README.md").read_text()
    assert "bash install.sh && python3 -m pytest" in readme
    assert any(c.startswith("python3 -m pytest") for c in _commands((REPO / ".ci/run").read_text()))


def test_installer_pattern_sees_an_install_line():
    """The check above is not vacuous: the pattern finds the lines it must refuse."""
    assert INSTALLERS.search("python3 -m pip install -q --no-deps -r requirements/runtime-oracle.txt")
    assert INSTALLERS.search("(apt-get update -qq && apt-get install -y -qq chromium) >/dev/null")
    assert not INSTALLERS.search("bash install.sh")


def _skip(nodeid: str, reason: str):
    return SimpleNamespace(nodeid=nodeid, longrepr=("tests/x.py", 3, f"Skipped: {reason}"))


def test_unexpected_skips_keeps_only_the_install_ones():
    reports = [
        _skip("tests/a.py::t1", "vllm is not installed (pip install --no-deps -r ...)"),
        _skip("tests/b.py::t2", "multi-rank test needs 2 GPUs (one per rank), this machine has 1"),
        _skip("tests/c.py::t3", "this machine has CUDA"),
        _skip("tests/d.py::t4", "no chromium"),
    ]
    assert unexpected_skips(reports) == [
        "tests/a.py::t1: Skipped: vllm is not installed (pip install --no-deps -r ...)",
        "tests/d.py::t4: Skipped: no chromium",
    ]
