"""The documentation's generated parts: what the code and the committed JSON say, never typed.

    python -m qatlib.site            # rewrite every generated block
    python -m qatlib.site --check    # list the stale ones (exit 1); tests/test_site.py runs it

=====================  ====================================================================
``config_reference``   docs/reference/config.md: every key of the experiment schema, with
                       type, default, allowed values, origin (upstream / qatlib), meaning
``formats``            the formats x runtimes table (README, docs/reference/formats.md), from
                       `qatlib.runtime.facts`
``plans``              the memory plan of the Qwen3-30B-A3B recipes on 8 GPUs (`qatlib.plan`)
``families``           docs/reference/families.md: the supported-families table, from
                       results/bench/families.json (``python -m benchmarks.families``)
``upstream totals``    the README's copy of docs/upstream-compat.md's ``Totals:`` line (that
                       page is tests/upstream_compat.py's)
``results``            docs/results.md and the README's results table, from results/bench/*.json
``record``             results/bench/default_experiment.json from a finished default DAG
``screenshot``         docs/img/report.png: the report rendered by headless Chromium
``blocks``             the ``<!-- generated:NAME -->`` markers the generated text lives between
=====================  ====================================================================

A top-layer consumer like `qatlib.report`: it imports the library, nothing in the library imports
it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import blocks

REPO = Path(__file__).resolve().parents[2]
BENCH_DIR = "results/bench"


@dataclass(frozen=True)
class Target:
    """One generated block: the file (relative to the repository) and the block's name in it."""

    path: str
    block: str


def _config_keys() -> str:
    from qatlib.config import config_json_schema

    from .config_reference import render

    return render(config_json_schema())


def _formats_detailed() -> str:
    from .formats import render_detailed

    return render_detailed()


def _formats_compact() -> str:
    from .formats import render

    return render()


def _plans(repo: Path) -> Callable[[], str]:
    def make() -> str:
        from .plans import render

        return render(repo)

    return make


def _families(repo: Path) -> Callable[[], str]:
    def make() -> str:
        from .families import render

        return render(repo)

    return make


def _upstream_totals(repo: Path) -> Callable[[], str]:
    def make() -> str:
        page = repo / "docs/upstream-compat.md"
        lines = [line for line in page.read_text().splitlines() if line.startswith("Totals: ")]
        if len(lines) != 1:
            raise ValueError(f"{page}: expected one 'Totals: ' line, found {len(lines)}")
        return lines[0]

    return make


def _results(kind: str, repo: Path) -> Callable[[], str]:
    def make() -> str:
        from . import page, results

        found = results.load(repo / BENCH_DIR, repo)
        return page.render_page(found) if kind == "page" else page.render_readme(found)

    return make


def targets(repo: Path = REPO) -> dict[Target, Callable[[], str]]:
    """Every generated block and the function that makes its body."""
    return {
        Target("docs/reference/config.md", "config-keys"): _config_keys,
        Target("docs/reference/formats.md", "formats"): _formats_detailed,
        Target("README.md", "formats"): _formats_compact,
        Target("docs/how-to/memory-plan.md", "plan-qwen3-30b"): _plans(repo),
        Target("docs/reference/families.md", "families"): _families(repo),
        Target("docs/results.md", "results"): _results("page", repo),
        Target("README.md", "results"): _results("readme", repo),
        Target("README.md", "upstream-totals"): _upstream_totals(repo),
    }


def generate(repo: Path = REPO, *, write: bool = True, only: str | None = None) -> list[Target]:
    """Regenerate every block (``only``: the targets whose path contains it); returns the stale ones
    (written unless ``write`` is false). Raises `blocks.BlockError` for a file that lacks a block."""
    stale = []
    texts: dict[str, str] = {}
    for t, make in targets(repo).items():
        if only and only not in t.path:
            continue
        path = repo / t.path
        text = texts.get(t.path) or path.read_text()
        new = blocks.replace(text, t.block, make(), where=t.path)
        if new != text:
            stale.append(t)
        texts[t.path] = new
    if write:
        for rel, text in texts.items():
            if (repo / rel).read_text() != text:
                (repo / rel).write_text(text)
    return stale
