"""The code a stage runs: its script and every repository module the script imports, transitively.

Why computed: Snakemake re-runs a job whose input files changed, and a script called from
`shell:` is only tracked if it is listed as an input. A hand-kept table of "which qatlib files
each stage runs" went stale three times (the report missed `eval/harness.py`, QAT `ptq.py`, the
local task `corpus.py`); reading the imports follows every move of a module.

The walk is static (`ast`): `import a.b`, `from a import b` (a module or a name), relative
imports and imports inside functions (the scripts import qatlib lazily) all count, also those
under `if TYPE_CHECKING:` (a superset only costs a re-run). A qatlib module counts whole. The
script's sibling helpers (`scripts/_common.py`) count by the functions the script uses: every
script uses `_common.parser`, but only the config-reading ones run `_common.load_experiment`,
which imports `qatlib.config`; counted whole, an edit of the config code would re-run the corpus
and the base model's pre-training. Data files beside a package's `__init__.py` (the report's
`template.html`) count with the package.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from functools import cache
from pathlib import Path

__all__ = ["imported_files", "stage_code"]

_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _module_file(name: str, root: Path) -> Path | None:
    """The file that defines module ``name`` under ``root`` (``a/b.py`` or ``a/b/__init__.py``)."""
    base = root.joinpath(*name.split("."))
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def _imported_names(nodes: Iterable[ast.AST], package: str) -> Iterator[str]:
    """Dotted names imported anywhere in ``nodes``, relative ones made absolute against
    ``package``; ``from a import b`` yields ``a`` and ``a.b`` (b may be a submodule)."""
    for node in (n for top in nodes for n in ast.walk(top)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".") if package else []
                base = ".".join([*parts[: len(parts) - node.level + 1], *filter(None, [node.module])])
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names if alias.name != "*")


def _used_part(tree: ast.Module, used: set[str]) -> list[ast.stmt]:
    """The statements of a helper module that running ``used`` (top-level names) may execute:
    everything but the definitions, plus the definitions reached from ``used`` by name."""
    defs = {n.name: n for n in tree.body if isinstance(n, _DEFS)}
    keep = [n for n in tree.body if not isinstance(n, _DEFS)]
    todo, seen = [u for u in used if u in defs], set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += [n.id for n in ast.walk(defs[name]) if isinstance(n, ast.Name) and n.id in defs]
    return keep + [defs[n] for n in sorted(seen)]


def _names_used_of(tree: ast.Module, module: str) -> set[str]:
    """Top-level names of sibling ``module`` the script uses (``module.x`` or ``from module import x``)."""
    aliases = {
        a.asname or a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.Import)
        for a in n.names
        if a.name == module
    }
    used = {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in aliases
    }
    used |= {
        a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module == module and not n.level
        for a in n.names
    }
    return used


def imported_files(script: Path, root: Path, packages: tuple[str, ...] = ("qatlib",)) -> list[Path]:
    """The files of ``packages`` (under ``root``) and of the script's sibling modules that running
    ``script`` may execute, with every package ``__init__.py`` on the way; sorted, script excluded."""
    script, root = script.resolve(), root.resolve()
    script_tree = ast.parse(script.read_text(encoding="utf-8"), str(script))
    found: set[Path] = set()
    todo = [(script, script.stem, script_tree.body)]
    while todo:
        path, module, nodes = todo.pop()
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for name in _imported_names(nodes, package):
            parts = name.split(".")
            search = root if parts[0] in packages else script.parent
            for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__, a/b/__init__
                sub = ".".join(parts[:i])
                f = _module_file(sub, search)
                if f is None:
                    break
                if f in found or f == script:
                    continue
                found.add(f)
                tree = ast.parse(f.read_text(encoding="utf-8"), str(f))
                if search != root and path == script:  # a helper beside the script: what it uses
                    todo.append((f, sub, _used_part(tree, _names_used_of(script_tree, sub))))
                else:
                    todo.append((f, sub, tree.body))
    data = {
        p
        for f in found
        if f.name == "__init__.py"
        for p in f.parent.iterdir()
        if p.is_file() and p.suffix not in (".py", ".pyc")
    }
    return sorted(found | data)


@cache
def stage_code(root: Path, script: str) -> list[str]:
    """A rule's `code` input: ``scripts/<script>`` first (the rule runs ``{input.code[0]}``), then
    the files it imports (`imported_files`), as paths under ``root`` (the repository root as the
    workflow spells it, relative to the working directory)."""
    path = root / "scripts" / script
    top = root.resolve()
    return [str(path), *(str(root / f.relative_to(top)) for f in imported_files(path, root))]
