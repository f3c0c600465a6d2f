"""The supported-families table (docs/reference/families.md, and its section of the results page),
made from ``results/bench/families.json`` (``python -m benchmarks.families``): per transformers
model_type, the stage it reached, the share of its linear and expert weights quantized (fp8, or int8 where `SCHEMES` says), the kept
weights the export names, whether the codes are exact, vLLM's load, the memory plan, the error.
Nothing here is typed by hand: a family the benchmark did not run is not in the table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .results import Result

BENCH = "results/bench/families.json"


def _frac(e: dict[str, Any]) -> str:
    f = e.get("fraction_quantized")
    return "-" if f is None else f"{100 * f:.1f}%"


def _kept(e: dict[str, Any]) -> str:
    named, unnamed = e.get("exceptions_named") or [], e.get("exceptions_unnamed") or []
    parts = []
    if named:
        leaves = sorted({k.removesuffix(".weight").rpartition(".")[2] for k in named})
        parts.append(f"{len(named)} named ({', '.join(leaves)})")
    if unnamed:
        parts.append(f"**{len(unnamed)} unnamed**")
    return "; ".join(parts) or "none"


def _exact(e: dict[str, Any]) -> str:
    if "codes_exact" not in e:
        return "-"
    bad = len(e.get("codes_inexact") or [])
    return f"{e['codes_exact']} exact" + (f", **{bad} not**" if bad else "")


def _oracle(o: dict[str, Any]) -> str:
    if not o:
        return "-"
    if o.get("loaded"):
        return "loads"
    return "refused: " + str(o.get("error") or "").splitlines()[0][:90].replace("|", "/")


def _plan(p: dict[str, Any]) -> str:
    if not p:
        return "-"
    if p.get("rc") in (0, 3):
        w = p.get("warnings") or []
        return "runs" + (f" ({len(w)} warning{'s' if len(w) > 1 else ''})" if w else "")
    return "refused: " + str(p.get("error") or "").splitlines()[-1][:90].replace("|", "/")


def _error(r: dict[str, Any]) -> str:
    err = r.get("error")
    return str(err).splitlines()[0][:120].replace("|", "/") if err else ""


def table(doc: dict[str, Any]) -> list[str]:
    """The per-family rows of a ``families.json`` document."""
    lines = [
        "| family (model_type) | architecture | stage reached | quantized share | kept weights | codes exact | "
        "vLLM load | memory plan | error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc.get("families", []):
        e = r.get("export") or {}
        lines.append(
            f"| `{r['model_type']}` | {r.get('architecture') or '-'} | {r.get('stage_reached') or '-'} | "
            f"{_frac(e)} | {_kept(e)} | {_exact(e)} | {_oracle(r.get('oracle') or {})} | "
            f"{_plan(r.get('plan') or {})} | {_error(r)} |"
        )
    return lines


def headline(doc: dict[str, Any]) -> str:
    fams = doc.get("families", [])
    ok = sum(1 for r in fams if r.get("stage_reached") == "oracle")
    return f"{ok} of {len(fams)} families reach vLLM's load"


def body(r: Result) -> list[str]:
    """The results page's section (`qatlib.site.page.RENDERERS`)."""
    return [headline(r.doc) + ".", "", *table(r.doc)]


def body_headline(r: Result) -> tuple[str, str]:
    return "Model families", f"{headline(r.doc)} (QAT: {r.doc.get('qat', 'not recorded')})"


def render(repo: Path) -> str:
    """The generated block of docs/reference/families.md."""
    path = repo / BENCH
    if not path.is_file():
        return f"No `{BENCH}` yet: run `python -m benchmarks.families`."
    doc = json.loads(path.read_text())
    intro = (
        f"From `{BENCH}` (`{doc.get('command', 'python -m benchmarks.families')}`; transformers "
        f"{doc.get('transformers')}, vLLM {doc.get('vllm')}; {doc.get('scheme')}; QAT: {doc.get('qat')}). "
        f"{headline(doc)}."
    )
    return "\n".join([intro, "", *table(doc)])
