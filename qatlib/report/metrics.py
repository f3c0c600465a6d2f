"""The report's numbers and its DVC outputs: `recovery` (the one definition; ``benchmarks/quality.py``
uses it too), the evaluation rows, ``metrics.json`` keys and the ``plots/*.csv`` files.

Recovery = share of PTQ's loss that QAT (or the exported model) wins back,
``(PTQ - x) / (PTQ - BF16)``: 1 = back to BF16, 0 = no better than PTQ. The same formula serves
lower-is-better (perplexity) and higher-is-better (accuracy) scores. It is flagged as noise when

- PTQ is not worse than BF16 by at least ``min_gap`` (perplexity: `MIN_REL_GAP` of BF16's;
  task scores in [0, 1]: `MIN_ABS_GAP`, raised to 2 standard errors of the gap when the
  evaluation reports them): PTQ already matches BF16 and the ratio would be noise;
- or, when per-window NLLs are given (the benchmark keeps them), the ratio's paired standard
  error over windows is unknown or above `MAX_SE`.

The report shows a noisy recovery as n/a (with the reason) and exports it as null.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import analysis
from ..checkpoint.layout import write_text
from ..scores import is_score, paired_diff_se

MIN_REL_GAP = 0.005  # |PTQ - BF16| / BF16 for perplexities (and other lower-is-better scores)
MIN_ABS_GAP = 0.005  # |PTQ - BF16| for task scores in [0, 1]; raised to 2 standard errors when known
MAX_SE = 0.2  # recovery standard error above 20 points (0.2 as a fraction): noise


# =========================================================================== recovery
@dataclass(frozen=True)
class Recovery:
    """``value``: the recovered fraction (None when a value is missing or PTQ == BF16), computed
    even when it is noise; ``se``: its paired standard error (per-window NLLs given);
    ``noise``: the noise rule of the module docstring; ``reason``: why, for a noisy one."""

    value: float | None
    se: float | None = None
    noise: bool = True
    reason: str = ""

    @property
    def shown(self) -> float | None:
        """The value, or None when it is noise (what the report shows / exports)."""
        return None if self.noise else self.value


def _floats(xs: Any) -> list[float]:
    return [float(x) for x in (xs.tolist() if hasattr(xs, "tolist") else xs)]


def paired_ratio_se(bf16: Any, ptq: Any, x: Any) -> float | None:
    """Standard error of the ratio estimator ``mean(p - x) / mean(p - b)`` over paired windows
    (per-window NLLs of BF16, PTQ and ``x``); None with fewer than 2 windows or no mean gap."""
    b, p, q = _floats(bf16), _floats(ptq), _floats(x)
    n = len(p)
    if n < 2 or not len(b) == len(q) == n:
        return None
    gap = math.fsum(pi - bi for pi, bi in zip(p, b)) / n
    if gap == 0:
        return None
    r = math.fsum(pi - qi for pi, qi in zip(p, q)) / n / gap
    resid = [(pi - qi) - r * (pi - bi) for pi, qi, bi in zip(p, q, b)]
    mean = math.fsum(resid) / n
    sd = math.sqrt(math.fsum((e - mean) ** 2 for e in resid) / (n - 1))
    return sd / math.sqrt(n) / abs(gap)


def recovery(
    bf16: float | None,
    ptq: float | None,
    x: float | None,
    *,
    min_gap: float,
    higher_is_better: bool = False,
    nll: tuple[Any, Any, Any] | None = None,
    max_se: float = MAX_SE,
) -> Recovery:
    """Recovery ``(PTQ - x) / (PTQ - BF16)`` of ``x`` and whether it is noise (module docstring).

    ``min_gap``: how much worse than BF16 PTQ must be, in the score's units. ``nll``: per-window
    NLLs ``(bf16, ptq, x)`` (sequences or tensors) for the paired standard error."""
    if bf16 is None or ptq is None or x is None:
        return Recovery(None, reason="a value is missing")
    gap = ptq - bf16
    value = (ptq - x) / gap if gap != 0 else None
    se = paired_ratio_se(*nll) if nll is not None else None
    worse = -gap if higher_is_better else gap
    if worse < min_gap or gap == 0:
        if abs(gap) < min_gap or gap == 0:
            why = f"|PTQ - BF16| = {abs(gap):.4g} is below {min_gap:.4g}: PTQ already matches BF16"
        else:
            why = f"PTQ is better than BF16 by {abs(gap):.4g}: there is no loss to recover"
        return Recovery(value, se, True, why + ", the ratio would be noise")
    if nll is not None and (se is None or se > max_se):
        why = "unknown" if se is None else f"{se:.3g} > {max_se:.3g}"
        return Recovery(value, se, True, f"the paired standard error of the ratio is {why}")
    return Recovery(value, se, False)


# =========================================================================== evaluation rows
def task_metrics(evals: Mapping[str, dict]) -> list[tuple[str, str]]:
    """(task, metric) pairs with a score in any variant, stderr columns excluded."""
    seen: dict[tuple[str, str], None] = {}
    for data in evals.values():
        for task, metrics in (data.get("tasks") or {}).items():
            if not isinstance(metrics, dict):
                continue
            for m, val in metrics.items():
                # is_score also drops bookkeeping in eval JSONs written before the harness did
                if "stderr" not in m and is_score(m, val):
                    seen[(task, m)] = None
    return sorted(seen)


def num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def ppl_value(entry: Any) -> float | None:
    """``{"ppl": x, ...}`` (the documented form) or a bare number."""
    return num(entry.get("ppl")) if isinstance(entry, Mapping) else num(entry)


def _rel_gap(bf: float | None) -> float:
    return MIN_REL_GAP * abs(bf) if bf is not None else math.inf


# The variants whose recovery the report shows; ``deployed`` (the export through the runtime
# emulator) is the one a user gets, ``served`` the same export in vLLM's own engine.
RECOVERY_VARIANTS = ("qat", "export", "deployed", "served")


def eval_rows(evals: Mapping[str, dict]) -> list[dict[str, Any]]:
    """One row per (kind, name, metric): the value per variant, ``min_gap`` and the `Recovery` of
    the QAT / export / deployed / served variants present (skipped results left out)."""
    from .inputs import evaluated

    evals = evaluated(evals)
    rows = []
    datasets = sorted({ds for d in evals.values() for ds in (d.get("ppl") or {})})
    for ds in datasets:
        vals = {v: ppl_value((evals[v].get("ppl") or {}).get(ds)) for v in evals}
        rows.append(
            {
                "kind": "ppl",
                "name": ds,
                "metric": "ppl",
                "values": vals,
                "min_gap": _rel_gap(vals.get("bf16")),
                "lower_better": True,
            }
        )
    for task, m in task_metrics(evals):
        tasks = {v: (evals[v].get("tasks") or {}).get(task) or {} for v in evals}
        vals = {v: num(tasks[v].get(m)) for v in evals}
        lower = "perplexity" in m or "bits_per_byte" in m
        if lower:
            min_gap = _rel_gap(vals.get("bf16"))
        else:
            se = [num(tasks.get(v, {}).get(f"{m}_stderr")) for v in ("bf16", "ptq")]
            paired = paired_diff_se(*(tasks.get(v, {}).get(f"{m}_windows") for v in ("bf16", "ptq")))
            min_gap = MIN_ABS_GAP
            if paired is not None:  # scored on the same windows: the paired error is the one
                min_gap = max(min_gap, 2.0 * paired)
            elif all(s is not None for s in se):
                min_gap = max(min_gap, 2.0 * math.hypot(*se))
        rows.append(
            {
                "kind": "task",
                "name": task,
                "metric": m,
                "values": vals,
                "min_gap": min_gap,
                "lower_better": lower,
            }
        )
    for r in rows:
        vals = r["values"]
        r["recovery"] = {
            v: recovery(
                vals.get("bf16"),
                vals.get("ptq"),
                vals.get(v),
                min_gap=r["min_gap"],
                higher_is_better=not r["lower_better"],
            )
            for v in RECOVERY_VARIANTS
            if v in vals
        }
    return rows


def metrics_summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """Flat DVC metrics: ``ppl/<dataset>/<variant>``, ``tasks/<task>/<metric>/<variant>``,
    ``recovery_pct/<variant>/ppl/<dataset>`` (and ``.../tasks/<task>/<metric>``); null = n/a."""
    out: dict[str, float | None] = {}
    for r in rows:
        base = f"ppl/{r['name']}" if r["kind"] == "ppl" else f"tasks/{r['name']}/{r['metric']}"
        for v, x in r["values"].items():
            out[f"{base}/{v}"] = x
        for v, rec in r["recovery"].items():
            out[f"recovery_pct/{v}/{base}"] = None if rec.shown is None else 100.0 * rec.shown
    return out


# =========================================================================== training, SQNR
def loss_keys(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The loss components logged: lm_loss, kd/* (the KD loss first, then the KL diagnostics),
    total_loss; the Trainer's plain ``loss`` when none of them is there."""
    present = {k for r in rows for k, v in r.items() if isinstance(v, (int, float))}
    kd = sorted(k for k in present if k.startswith("kd/"))
    kd = [k for k in kd if k not in ("kd/forward_kl", "kd/backward_kl")] + [
        k for k in ("kd/forward_kl", "kd/backward_kl") if k in present
    ]
    keys = [k for k in ("lm_loss",) if k in present] + kd + [k for k in ("total_loss",) if k in present]
    return keys or (["loss"] if "loss" in present else [])


def mean_finite(vals: Iterable[Any]) -> float | None:
    xs = [float(v) for v in vals if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(xs) / len(xs) if xs else None


def sqnr_metrics(rows: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """Mean finite per-layer weight SQNR vs BF16 (`qatlib.analysis.checkpoint_sqnr`) per variant."""
    return {
        "sqnr_mean_db/ptq": mean_finite(r["ptq_db"] for r in rows),
        "sqnr_mean_db/qat": mean_finite(r["qat_db"] for r in rows),
    }


# =========================================================================== DVC outputs
class DvcOutputs:
    """What the report hands DVC: ``plots/<name>.csv`` files (written as sections find their data)
    and the flat ``metrics.json`` (written last, with the HTML)."""

    def __init__(self, plots_dir: Path) -> None:
        self.plots_dir = plots_dir
        self.plots: list[str] = []
        self.metrics: dict[str, Any] = {}  # numbers, and the hash/* and cpu/* strings
        plots_dir.mkdir(parents=True, exist_ok=True)  # always there: the workflow declares it as an output

    def plot(
        self, name: str, rows: Iterable[Mapping[str, Any]], columns: Sequence[str] | None = None
    ) -> None:
        analysis.write_csv(rows, self.plots_dir / name, columns)
        self.plots.append(name)

    def metrics_json(self, rows: Sequence[Mapping[str, Any]]) -> str:
        """``metrics.json``: the evaluation rows' `metrics_summary` plus the sections' metrics."""
        metrics = {**metrics_summary(rows), **self.metrics}
        return json.dumps(metrics, indent=2, sort_keys=True, allow_nan=False) + "\n"


def atomic_write(path: Path, text: str) -> None:
    """`qatlib.checkpoint.layout.write_text` (owned temporary + rename)."""
    write_text(path, text)
