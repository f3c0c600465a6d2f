"""The shape of the code: qatlib's import graph has no cycle (function-local imports included,
as grimp reads every import statement), the layers contract of ``.importlinter`` holds (what
``lint-imports`` checks in CI), and the house size limits (docs/design.md, "Layers")."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def cycles(package: str) -> list[list[str]]:
    """The strongly connected components of more than one module in ``package``'s import graph."""
    import grimp

    sys.path.insert(0, str(REPO))
    try:
        graph = grimp.build_graph(package, cache_dir=None)
    finally:
        sys.path.remove(str(REPO))
    adj = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm, recursive: the graphs have ~100 modules
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in adj[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for m in sorted(adj):
        if m not in index:
            visit(m)
    return out


def test_cycle_finder_finds_a_cycle(tmp_path, monkeypatch):
    """The finder itself, on a three-module package with a function-local import closing a cycle."""
    pkg = tmp_path / "cyc"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from . import c\n")
    (pkg / "c.py").write_text("from . import a\n")
    (pkg / "d.py").write_text("from . import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cycles("cyc") == [["cyc.a", "cyc.b", "cyc.c"]]


def test_no_import_cycle_in_qatlib():
    assert cycles("qatlib") == []


@pytest.mark.skipif(shutil.which("lint-imports") is None, reason="import-linter not installed")
def test_layers_contract_holds():
    r = subprocess.run(["lint-imports"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_house_size_limits():
    """Small modules with one job: no qatlib module over 600 lines, no file of scripts/ over 120
    (the shared ``_*.py`` too: what the scripts share beyond their flags belongs in qatlib), and
    workflow/rules/common.smk at most 200."""
    big = {str(p.relative_to(REPO)): n for p in REPO.glob("qatlib/**/*.py") if (n := _lines(p)) > 600}
    assert big == {}
    long_scripts = {p.name: n for p in REPO.glob("scripts/*.py") if (n := _lines(p)) > 120}
    assert long_scripts == {}
    assert _lines(REPO / "workflow/rules/common.smk") <= 200
