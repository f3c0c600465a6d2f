"""Build the self-contained HTML report of one experiment (``results/<exp>/``), plus the DVC
``metrics.json`` and ``plots/*.csv`` beside it.

Inputs (docs/design.md, results layout), relative to the experiment directory:

- ``eval/{bf16,ptq,qat}.json`` (required) and ``eval/export.json`` (optional):
  ``{"variant", "ppl": {dataset: {ppl, ...}}, "tasks": {task: {acc, acc_norm, ...}}, "wall_s"}``;
- ``qat/train_log.jsonl`` (or the trainer's ``qat/qat_log.jsonl``): one JSON object per logging
  step (``step``, ``lm_loss``, ``kd/<type>``, ``kd/forward_kl``, ``kd/backward_kl``,
  ``total_loss``, ``learning_rate``);
- ``ptq/`` and ``qat/`` checkpoints (scales, `qatlib.analysis.load_scales`);
- ``analysis/sqnr.csv`` (``layer, layer_type, ptq_db, qat_db``), else SQNR computed from the
  checkpoint weights when they are small enough;
- ``qat/scale_load.json``, ``qat/run_metadata.json``, ``timings/*.json``, the experiment YAML,
  and the benchmark JSONs of ``bench_dir``.

Every section but the evaluation table is optional: a missing input renders as "not available".
Nothing in the HTML points outside the file (figures are base64 PNG, CSS is inline), so it opens
offline; the output carries no timestamp, so the same inputs give the same file.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.resources
import json
import logging
import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2

from .. import analysis
from ..eval.harness import NON_METRICS

log = logging.getLogger(__name__)

VARIANTS = ("bf16", "ptq", "qat", "export")
REQUIRED_VARIANTS = ("bf16", "ptq", "qat")
VARIANT_LABELS = {"bf16": "BF16", "ptq": "PTQ", "qat": "QAT", "export": "export"}
PACKAGES = ("torch", "transformers", "deepspeed", "compressed-tensors", "lm-eval", "snakemake", "dvc")
STAGES = (
    "corpus",
    "base_model",
    "ptq_calibrate",
    "zero3_qat",
    "convert_export",
    "evaluate",
    "sqnr",
    "bench",
    "report",
)
LOG_FILES = ("train_log.jsonl", "qat_log.jsonl")
LOSS_KEYS = ("lm_loss", "total_loss")

# Recovery = share of the PTQ gap that QAT closes. Below these gaps the ratio is noise -> n/a.
PPL_MIN_REL_GAP = 0.005  # |PTQ - BF16| / BF16 for perplexities (and other lower-is-better scores)
TASK_MIN_ABS_GAP = 0.005  # |PTQ - BF16| for task scores in [0, 1]; raised to 2 standard errors when known
# Compute per-layer SQNR in the report only when each weight source is at most this large.
SQNR_MAX_BYTES = 1 << 30


class ReportError(RuntimeError):
    """A required input of the report is missing or unreadable."""


# =========================================================================== small helpers
def _fmt(v: Any, digits: int = 4) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return f"{v:.{digits}f}" if 1e-3 <= abs(v) < 1e5 or v == 0 else f"{v:.{digits}g}"
    if isinstance(v, (list, tuple)) and all(not isinstance(x, (dict, list)) for x in v):
        return ", ".join(_fmt(x, digits) for x in v)
    if isinstance(v, (dict, list)):
        return json.dumps(v, default=str)[:500]
    return str(v)


def _bytes(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return _fmt(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _seconds(s: Any) -> str:
    if not isinstance(s, (int, float)):
        return _fmt(s)
    m, sec = divmod(float(s), 60)
    h, m = divmod(int(m), 60)
    return f"{h}:{m:02d}:{sec:04.1f}" if h else f"{m}:{sec:04.1f}" if m else f"{sec:.1f} s"


def _cell(v: str, cls: str = "", title: str = "") -> dict[str, str]:
    return {"v": v, "cls": cls, "title": title}


def _table(
    columns: Sequence[str], rows: Iterable[Sequence[Any]], caption: str = "", text_cols: int = 1
) -> dict:
    return {
        "kind": "table",
        "columns": list(columns),
        "rows": [list(r) for r in rows],
        "caption": caption,
        "text_cols": text_cols,
    }


def _p(text: str) -> dict:
    return {"kind": "p", "text": text}


def _h3(text: str) -> dict:
    return {"kind": "h3", "text": text}


def _img(fig: Any, alt: str) -> dict:
    from .figures import png_base64

    return {"kind": "img", "b64": png_base64(fig), "alt": alt}


def _unavailable(text: str) -> dict:
    return {"kind": "unavailable", "text": text}


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from None


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def _first_file(dirs: Iterable[Path], names: Iterable[str]) -> Path | None:
    names = list(names)
    for d in dirs:
        for n in names:
            if (d / n).is_file():
                return d / n
    return None


def _qat_dirs(exp: Path) -> list[Path]:
    return [exp / "qat", exp / "qat" / analysis.NESTED_DIR]


# =========================================================================== evaluation
def load_eval(exp_dir: str | os.PathLike) -> dict[str, dict]:
    """``eval/<variant>.json`` for every variant present; a missing required one is an error."""
    exp = Path(exp_dir)
    out = {}
    for v in VARIANTS:
        path = exp / "eval" / f"{v}.json"
        if not path.is_file():
            if v in REQUIRED_VARIANTS:
                raise ReportError(
                    f"required evaluation result missing: {path} (variant {v!r}; run the evaluate stage)"
                )
            continue
        data = _read_json(path)
        if not isinstance(data, dict):
            raise ReportError(f"{path}: expected a JSON object, got {type(data).__name__}")
        out[v] = data
    return out


def _task_metrics(evals: Mapping[str, dict]) -> list[tuple[str, str]]:
    """(task, metric) pairs with a numeric value in any variant, stderr columns excluded."""
    seen: dict[tuple[str, str], None] = {}
    for data in evals.values():
        for task, metrics in (data.get("tasks") or {}).items():
            if not isinstance(metrics, dict):
                continue
            for m, val in metrics.items():
                if "stderr" in m or not isinstance(val, (int, float)) or isinstance(val, bool):
                    continue
                if m.partition(",")[0] in NON_METRICS:  # eval JSONs written before the filter
                    continue
                seen[(task, m)] = None
    return sorted(seen)


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def _ppl_value(entry: Any) -> float | None:
    """``{"ppl": x, ...}`` (the documented form) or a bare number."""
    return _num(entry.get("ppl")) if isinstance(entry, Mapping) else _num(entry)


def recovery(
    bf16: float | None, ptq: float | None, x: float | None, *, min_gap: float
) -> tuple[float | None, str]:
    """Share (in %) of PTQ's gap to BF16 that ``x`` closes: ``(PTQ - x) / (PTQ - BF16)``.

    The same formula serves lower-is-better (perplexity) and higher-is-better (accuracy) scores:
    ``(x - PTQ) / (BF16 - PTQ)`` is the same number. Returns ``(None, reason)`` when an input is
    missing or ``|PTQ - BF16| < min_gap`` (PTQ already matches BF16: the ratio would be noise).
    """
    if bf16 is None or ptq is None or x is None:
        return None, "a value is missing"
    gap = ptq - bf16
    if abs(gap) < min_gap or gap == 0:
        return (
            None,
            f"|PTQ - BF16| = {abs(gap):.4g} is below {min_gap:.4g}: PTQ already matches BF16, the ratio would be noise",
        )
    return 100.0 * (ptq - x) / gap, ""


def eval_rows(evals: Mapping[str, dict]) -> list[dict[str, Any]]:
    """One row per (kind, name, metric): the value per variant, deltas vs BF16 and recoveries."""
    rows = []
    datasets = sorted({ds for d in evals.values() for ds in (d.get("ppl") or {})})
    for ds in datasets:
        vals = {v: _ppl_value((evals[v].get("ppl") or {}).get(ds)) for v in evals}
        bf = vals.get("bf16")
        min_gap = PPL_MIN_REL_GAP * abs(bf) if bf is not None else math.inf
        rows.append(
            {
                "kind": "ppl",
                "name": ds,
                "metric": "ppl",
                "values": vals,
                "min_gap": min_gap,
                "lower_better": True,
            }
        )
    for task, m in _task_metrics(evals):
        tasks = {v: (evals[v].get("tasks") or {}).get(task) or {} for v in evals}
        vals = {v: _num(tasks[v].get(m)) for v in evals}
        lower = "perplexity" in m or "bits_per_byte" in m
        if lower:
            bf = vals.get("bf16")
            min_gap = PPL_MIN_REL_GAP * abs(bf) if bf is not None else math.inf
        else:
            se = [_num(tasks.get(v, {}).get(f"{m}_stderr")) for v in ("bf16", "ptq")]
            min_gap = TASK_MIN_ABS_GAP
            if all(s is not None for s in se):
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
        r["recovery"] = {}
        for v in ("qat", "export"):
            if v in vals:
                r["recovery"][v] = recovery(
                    vals.get("bf16"), vals.get("ptq"), vals.get(v), min_gap=r["min_gap"]
                )
    return rows


def metrics_summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """Flat DVC metrics: ``ppl/<dataset>/<variant>``, ``tasks/<task>/<metric>/<variant>``,
    ``recovery_pct/<variant>/ppl/<dataset>`` (and ``.../tasks/<task>/<metric>``); null = n/a."""
    out: dict[str, float | None] = {}
    for r in rows:
        base = f"ppl/{r['name']}" if r["kind"] == "ppl" else f"tasks/{r['name']}/{r['metric']}"
        for v, x in r["values"].items():
            out[f"{base}/{v}"] = x
        for v, (rec, _) in r["recovery"].items():
            out[f"recovery_pct/{v}/{base}"] = rec
    return out


def _eval_section(evals: Mapping[str, dict]) -> tuple[dict, list[dict]]:
    rows = eval_rows(evals)
    variants = [v for v in VARIANTS if v in evals]
    deltas = [v for v in variants if v != "bf16"]
    rec_vs = [v for v in ("qat", "export") if v in evals]
    columns = (
        ["score"]
        + [VARIANT_LABELS[v] for v in variants]
        + [f"Δ {VARIANT_LABELS[v]} vs BF16" for v in deltas]
        + [f"{VARIANT_LABELS[v]} recovery" for v in rec_vs]
    )
    table_rows = []
    any_na = False
    for r in rows:
        label = f"PPL {r['name']}" if r["kind"] == "ppl" else f"{r['name']} {r['metric']}"
        vals = r["values"]
        cells: list[Any] = [label] + [_fmt(vals.get(v)) for v in variants]
        bf = vals.get("bf16")
        for v in deltas:
            x = vals.get(v)
            if x is None or bf is None:
                cells.append(_cell("n/a", "na"))
                continue
            d = x - bf
            rel = f" ({100 * d / bf:+.2f}%)" if bf else ""
            worse = d > 0 if r["lower_better"] else d < 0
            cells.append(_cell(f"{d:+.4f}{rel}", "bad" if worse and d else "good" if d else ""))
        for v in rec_vs:
            rec, why = r["recovery"][v]
            if rec is None:
                any_na = True
                cells.append(_cell("n/a", "na", why))
            else:
                text = f"{rec:.1f}%"
                cells.append(_cell("0.0%" if text == "-0.0%" else text, "", "(PTQ - x) / (PTQ - BF16)"))
        table_rows.append(cells)
    blocks = [_table(columns, table_rows, "Perplexity and task scores")]
    blocks.append(
        _p(
            "Recovery = share of PTQ's loss that QAT (or the exported model) wins back: "
            "(PTQ − QAT) / (PTQ − BF16) for perplexity, (QAT − PTQ) / (BF16 − PTQ) for accuracy. "
            "100% = back to BF16, 0% = no better than PTQ. "
            f"It is n/a when PTQ is already within noise of BF16 (perplexity: |PTQ − BF16| < {PPL_MIN_REL_GAP:.1%} "
            f"of BF16; task scores: |PTQ − BF16| < {TASK_MIN_ABS_GAP} or 2 standard errors when reported)."
        )
    )
    if any_na:
        blocks.append(
            _p(
                "n/a recovery cells: the PTQ gap is too small for the ratio to mean anything "
                "(hover a cell for the numbers)."
            )
        )
    missing = [v for v in VARIANTS if v not in evals]
    if missing:
        blocks.append(_p(f"Not evaluated: {', '.join(missing)} (eval/{missing[0]}.json absent)."))
    return {"id": "eval", "title": "Accuracy", "blocks": blocks}, rows


# =========================================================================== training
def find_train_log(exp_dir: str | os.PathLike) -> Path | None:
    return _first_file(_qat_dirs(Path(exp_dir)), LOG_FILES)


def read_train_log(path: str | os.PathLike) -> list[dict[str, Any]]:
    """JSON lines -> dicts (blank lines skipped); a bad line is an error naming the line."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: invalid JSON ({e})") from None
    return out


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


def _training_section(exp: Path, plots: Path, outputs: dict[str, Any]) -> dict:
    from .figures import loss_curves

    sec = {"id": "training", "title": "Training", "blocks": []}
    path = find_train_log(exp)
    if path is None:
        sec["unavailable"] = f"Training curves not available: no {' or '.join(LOG_FILES)} in {exp / 'qat'}."
        return sec
    rows = [r for r in read_train_log(path) if "step" in r]
    keys = loss_keys(rows)
    if not rows or not keys:
        sec["unavailable"] = f"Training curves not available: {path} has no logged loss."
        return sec
    cols = ["step", *keys] + (["learning_rate"] if any("learning_rate" in r for r in rows) else [])
    analysis.write_csv(rows, plots / "loss.csv", cols)
    outputs["plots"].append("loss.csv")
    sec["blocks"].append(_img(loss_curves(rows, keys), "training curves"))
    first, last = rows[0], rows[-1]
    sec["blocks"].append(
        _table(
            ["series", f"step {first['step']}", f"step {last['step']}", "min"],
            [
                [
                    k,
                    _fmt(first.get(k)),
                    _fmt(last.get(k)),
                    _fmt(min((r[k] for r in rows if isinstance(r.get(k), (int, float))), default=None)),
                ]
                for k in cols[1:]
            ],
            f"{len(rows)} logging steps ({path.name})",
        )
    )
    return sec


# =========================================================================== scales
def _scales_section(exp: Path, plots: Path, outputs: dict[str, Any]) -> dict:
    from .figures import scale_histograms, value_histograms

    sec = {"id": "scales", "title": "Scales", "blocks": []}
    loaded = {}
    for v in ("ptq", "qat"):
        try:
            loaded[v] = analysis.load_scales(exp / v)
        except FileNotFoundError as e:
            sec["blocks"].append(_unavailable(f"{VARIANT_LABELS[v]} scales not available: {e}"))
    if not loaded:
        return sec
    before, after = loaded.get("ptq", {}), loaded.get("qat", {})
    for role, what in (
        ("weight", "Weight scales"),
        ("input", "Input-activation scales"),
        ("output", "Output (q/k/v, KV-cache) scales"),
    ):
        b, a = analysis.values_by_type(before, role), analysis.values_by_type(after, role)
        if not b and not a:
            continue
        sec["blocks"].append(_h3(f"{what}: log10 histogram per layer type, PTQ (before) vs QAT (after)"))
        sec["blocks"].append(_img(scale_histograms(b, a), f"{what} histograms"))
    if before and after:
        ratios = analysis.ratio_by_type(before, after, "weight")
        if ratios:
            sec["blocks"].append(_h3("Weight-scale change per element: log2(QAT / PTQ), per layer type"))
            sec["blocks"].append(
                _img(value_histograms(ratios, "log2(s_QAT / s_PTQ)"), "scale ratio histograms")
            )
        changes = analysis.scale_changes(before, after)
        analysis.write_csv(changes, plots / "scale_changes.csv")
        outputs["plots"].append("scale_changes.csv")
        summary = analysis.summarize(changes, ["rel_change_mean", "rel_change_max"], by="layer_type")
        sec["blocks"].append(
            _table(
                ["layer type", "tensors", "mean |Δs|/s", "mean of per-tensor max |Δs|/s"],
                [
                    [r["layer_type"], r["count"], _fmt(r["rel_change_mean"]), _fmt(r["rel_change_max"])]
                    for r in summary
                ],
                "Relative scale change QAT vs PTQ, per layer type",
            )
        )
        sec["blocks"].append(
            _table(
                ["key", "numel", "mean PTQ", "mean QAT", "mean |Δs|/s", "max |Δs|/s"],
                [
                    [
                        r["key"],
                        r["numel"],
                        _fmt(r["mean_before"]),
                        _fmt(r["mean_after"]),
                        _fmt(r["rel_change_mean"]),
                        _fmt(r["rel_change_max"]),
                    ]
                    for r in changes[:15]
                ],
                "Largest relative changes (top 15)",
            )
        )
        only = sorted(set(before) ^ set(after))
        if only:
            sec["blocks"].append(
                _p(f"{len(only)} keys are in only one checkpoint, e.g. {', '.join(only[:5])}.")
            )
    return sec


# =========================================================================== SQNR
def _weights_source(
    exp: Path, v: str, layers: list[str], base_weights: Path | None
) -> tuple[Path | None, str]:
    """Where the full-precision weights behind ``v``'s scales are, and a note when it is a stand-in."""
    qat = next((d for d in _qat_dirs(exp) if d.is_dir() and analysis.weight_bytes(d, layers)), None)
    if v == "qat":
        return qat, ""
    for cand in (base_weights, exp / "ptq"):
        if cand is not None and cand.exists() and analysis.weight_bytes(cand, layers):
            return cand, ""
    note = (
        "PTQ SQNR uses the QAT checkpoint's weights (no base / PTQ weights found): exact only when "
        "QAT trained the quantizer parameters alone"
    )
    return qat, note if qat is not None else ""


def compute_sqnr(
    exp_dir: str | os.PathLike,
    *,
    base_weights: str | os.PathLike | None = None,
    max_bytes: int = SQNR_MAX_BYTES,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Per-layer weight SQNR of the PTQ and QAT checkpoints (`qatlib.analysis.compare_sqnr` rows)
    and notes. Raises FileNotFoundError when a checkpoint or its weights are missing, and
    RuntimeError when the weights exceed ``max_bytes`` (write analysis/sqnr.csv upstream then)."""
    exp = Path(exp_dir)
    base = Path(base_weights) if base_weights is not None else None
    per, notes = {}, []
    for v in ("ptq", "qat"):
        scheme = analysis.load_scheme(exp / v)
        scales = analysis.load_scales(exp / v)
        layers = sorted({p.layer for k in scales if (p := analysis.parse_key(k)) and p.role == "weight"})
        src, note = _weights_source(exp, v, layers, base)
        if src is None:
            raise FileNotFoundError(
                f"no weights for the {v} scales (looked in {exp / 'qat'}"
                f"{', ' + str(exp / 'ptq') if v == 'ptq' else ''})"
            )
        size = analysis.weight_bytes(src, layers)
        if size > max_bytes:
            raise RuntimeError(
                f"{src} holds {_bytes(size)} of weights (> {_bytes(max_bytes)}): too large to "
                "compute here; write analysis/sqnr.csv in an earlier stage"
            )
        if note:
            notes.append(note)
        per[v] = analysis.layer_sqnr(analysis.iter_weights(src, layers), scheme, scales)
    return analysis.compare_sqnr(per["ptq"], per["qat"]), notes


def _sqnr_section(exp: Path, plots: Path, outputs: dict[str, Any], base_weights: Path | None) -> dict:
    from .figures import sqnr_per_layer

    sec = {"id": "sqnr", "title": "Per-layer SQNR", "blocks": []}
    csv_path = exp / "analysis" / "sqnr.csv"
    if csv_path.is_file():
        rows = analysis.read_csv(csv_path)
        need = {"layer", "ptq_db", "qat_db"}
        if rows and not need <= set(rows[0]):
            raise ValueError(f"{csv_path}: needs columns {sorted(need)}, has {sorted(rows[0])}")
        for r in rows:
            r.setdefault("layer_type", analysis.layer_type(str(r["layer"])))
            if "delta_db" not in r:
                p, q = r["ptq_db"], r["qat_db"]
                r["delta_db"] = q - p if isinstance(p, float) and isinstance(q, float) else math.nan
        source = f"from {csv_path.relative_to(exp)}"
    else:
        try:
            rows, notes = compute_sqnr(exp, base_weights=base_weights)
        except (FileNotFoundError, RuntimeError) as e:
            sec["unavailable"] = f"Per-layer SQNR not available: no {csv_path.relative_to(exp)}, and {e}."
            return sec
        source = "computed from the checkpoint weights"
        sec["blocks"] += [_p(n) for n in notes]
    if not rows:
        sec["unavailable"] = "Per-layer SQNR not available: no weight-quantized layer."
        return sec
    analysis.write_csv(rows, plots / "sqnr.csv", ["layer", "layer_type", "ptq_db", "qat_db", "delta_db"])
    outputs["plots"].append("sqnr.csv")
    summary = analysis.summarize(rows, ["ptq_db", "qat_db", "delta_db"])
    outputs["metrics"]["sqnr_mean_db/ptq"] = _mean_finite(r["ptq_db"] for r in rows)
    outputs["metrics"]["sqnr_mean_db/qat"] = _mean_finite(r["qat_db"] for r in rows)
    sec["blocks"].append(
        _p(f"Weight fake-quantization SQNR = 10·log10(‖W‖² / ‖W − Q(W)‖²), {source}; higher is better.")
    )
    sec["blocks"].append(_img(sqnr_per_layer(rows), "per-layer SQNR"))
    sec["blocks"].append(
        _table(
            ["layer type", "layers", "PTQ dB", "QAT dB", "Δ dB"],
            [
                [
                    r["layer_type"],
                    r["count"],
                    _fmt(r["ptq_db"], 2),
                    _fmt(r["qat_db"], 2),
                    _fmt(r["delta_db"], 2),
                ]
                for r in summary
            ],
            "Mean SQNR per layer type",
        )
    )
    return sec


def _mean_finite(vals: Iterable[Any]) -> float | None:
    xs = [float(v) for v in vals if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(xs) / len(xs) if xs else None


# =========================================================================== scale load
def _scale_load_section(exp: Path) -> dict:
    sec = {"id": "scale-load", "title": "Scale warm start", "blocks": []}
    path = _first_file(_qat_dirs(exp), ["scale_load.json"])
    if path is None:
        sec["unavailable"] = f"Scale hit/miss counts not available: no {exp / 'qat' / 'scale_load.json'}."
        return sec
    data = _read_json(path)
    counts = [(k, data[k]) for k in ("hits", "misses", "unused_keys", "ignored_keys", "seconds") if k in data]
    sec["blocks"].append(
        _p(
            "hits: quantizer parameters loaded from the PTQ checkpoint; misses: parameters that "
            "kept their initial value; unused: scale keys matching no quantizer; ignored: other "
            "tensors (weights)."
        )
    )
    sec["blocks"].append(_table(["", "count"], [[k, _fmt(v)] for k, v in counts], f"{path.relative_to(exp)}"))
    other = [(k, v) for k, v in data.items() if k not in dict(counts) and not isinstance(v, list)]
    if other:
        sec["blocks"].append(_table(["", "value"], [[k, _fmt(v)] for k, v in other], text_cols=2))
    for k, what in (("missed_params", "Missed parameters"), ("unused_key_names", "Unused scale keys")):
        names = data.get(k) or []
        if names:
            more = f" (first 25 of {len(names)})" if len(names) > 25 else ""
            sec["blocks"].append(_h3(f"{what}{more}"))
            sec["blocks"].append({"kind": "pre", "text": "\n".join(map(str, names[:25]))})
    return sec


# =========================================================================== run metadata
def git_commit(cwd: str | os.PathLike | None = None) -> str:
    """``git rev-parse HEAD`` (+ ``-dirty`` with uncommitted changes); ``unknown`` outside git."""
    for d in ([cwd] if cwd else []) + [os.getcwd(), Path(__file__).resolve().parent]:
        try:
            head = subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=d, capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            continue
        dirty = ""
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            status = subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=d,
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout
            dirty = "-dirty" if status.strip() else ""
        return head + dirty
    return "unknown"


def package_versions(names: Iterable[str] = PACKAGES) -> dict[str, str]:
    out = {}
    for n in names:
        try:
            out[n] = importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            out[n] = "not installed"
    return out


def find_config(exp: Path, config: Path | None) -> Path | None:
    """``config``, else ``<exp>/config.yaml``, the single ``<exp>/*.yaml``, or
    ``config/experiments/<exp name>.yaml`` under the working directory."""
    if config is not None:
        return config
    for name in ("config.yaml", "config.yml"):
        if (exp / name).is_file():
            return exp / name
    ymls = sorted(exp.glob("*.yaml")) + sorted(exp.glob("*.yml"))
    if len(ymls) == 1:
        return ymls[0]
    repo = Path("config") / "experiments" / f"{exp.name}.yaml"
    return repo if repo.is_file() else None


def _zero3_blocks(meta: Mapping[str, Any]) -> list[dict]:
    facts = [
        ("world size", _fmt(meta.get("world_size"))),
        ("ZeRO stage", _fmt(meta.get("zero_stage"))),
        ("parameters (tensors)", _fmt(meta.get("n_params"))),
        ("persistent parameters", _fmt(meta.get("n_persistent_params"))),
        ("parameter bytes (whole model)", _bytes(meta.get("param_bytes_total"))),
        ("peak RSS (max over ranks)", _bytes(meta.get("peak_rss_bytes_max"))),
    ]
    known = {
        "world_size",
        "zero_stage",
        "n_params",
        "n_persistent_params",
        "param_bytes_total",
        "peak_rss_bytes_max",
        "ranks",
        "versions",
    }
    for k, v in meta.items():
        if k not in known and not isinstance(v, (dict, list)):
            facts.append((k, _bytes(v) if k.endswith("_bytes") else _fmt(v)))
    blocks = [
        _table(["", "value"], [f for f in facts if f[1] != "n/a"], "ZeRO-3 run (qat/run_metadata.json)", 2)
    ]
    ranks = [r for r in meta.get("ranks") or [] if isinstance(r, Mapping)]
    if ranks:
        total = meta.get("param_bytes_total")
        known = ("rank", "param_bytes_held", "share_min", "share_max", "share_mean", "peak_rss_bytes")
        extra = [k for k in dict.fromkeys(k for r in ranks for k in r) if k not in known]

        def share(r: Mapping[str, Any]) -> str:
            held = r.get("param_bytes_held")
            return f"{100 * held / total:.1f}%" if total and isinstance(held, (int, float)) else "n/a"

        def value(k: str, v: Any) -> str:
            return _bytes(v) if k.endswith("_bytes") else _fmt(v)

        blocks.append(
            _table(
                [
                    "rank",
                    "param bytes held",
                    "share of model",
                    "param share min",
                    "param share max",
                    "peak RSS",
                ]
                + extra,
                [
                    [
                        _fmt(r.get("rank")),
                        _bytes(r.get("param_bytes_held")),
                        share(r),
                        _fmt(r.get("share_min")),
                    ]
                    + [_fmt(r.get("share_max")), _bytes(r.get("peak_rss_bytes"))]
                    + [value(k, r.get(k)) for k in extra]
                    for r in ranks
                ],
                "Per rank (share min / max: the smallest / largest fraction of any one parameter held)",
            )
        )
    return blocks


def _stage_order(path: Path) -> tuple[int, str]:
    """Workflow order (STAGES; ``evaluate-bf16`` sorts with ``evaluate``), unknown stages last."""
    stem = path.stem
    idx = next(
        (i for i, st in enumerate(STAGES) if stem == st or stem.startswith((f"{st}-", f"{st}_"))), len(STAGES)
    )
    return idx, path.stem


def _metadata_section(
    exp: Path, commit: str, config: Path | None, evals: Mapping[str, dict], extra_timings: Sequence[Path] = ()
) -> dict:
    sec = {"id": "run", "title": "Run metadata", "blocks": []}
    sec["blocks"].append(
        _table(
            ["", "value"],
            [["experiment", exp.name], ["git commit", commit], ["python", sys.version.split()[0]]],
            "Code",
            2,
        )
    )
    sec["blocks"].append(_table(["package", "version"], package_versions().items(), "Package versions", 2))

    timings = []  # (label, wall_s, world_size); the label is the file name: evaluate-bf16, evaluate-qat, ...
    # the experiment's own stages plus shared ones (corpus, base model) that live outside exp/;
    # a shared record also present in exp/timings (older runs copied them there) is shown once
    own = list((exp / "timings").glob("*.json"))
    names = {p.stem for p in own}
    shared = [p for p in extra_timings if p.stem.split("-")[0] not in names]
    for path in sorted(own + shared, key=_stage_order):
        try:
            t = _read_json(path)
        except ValueError as e:
            timings.append((path.stem, str(e), None))
            continue
        t = t if isinstance(t, Mapping) else {}
        timings.append((path.stem, t.get("wall_s"), t.get("world_size")))
    if timings:
        total = sum(w for _, w, _ in timings if isinstance(w, (int, float)))
        rows = [[s, _seconds(w) if isinstance(w, (int, float)) else w, _fmt(n)] for s, w, n in timings]
        sec["blocks"].append(
            _table(
                ["stage", "wall time", "processes"],
                rows + [["total", _seconds(total), ""]],
                "Wall time per stage (timings/*.json)",
            )
        )
    else:
        sec["blocks"].append(_unavailable(f"Stage timings not available: no {exp / 'timings'}/*.json."))
    ev = [[VARIANT_LABELS[v], _seconds(d.get("wall_s"))] for v, d in evals.items() if "wall_s" in d]
    if ev:
        sec["blocks"].append(_table(["variant", "wall time"], ev, "Evaluation wall time (eval/*.json)"))

    meta_path = _first_file(_qat_dirs(exp), ["run_metadata.json"])
    if meta_path is None:
        sec["blocks"].append(
            _unavailable(f"ZeRO-3 facts not available: no {exp / 'qat' / 'run_metadata.json'}.")
        )
    else:
        sec["blocks"] += _zero3_blocks(_read_json(meta_path))

    cfg = find_config(exp, config)
    if cfg is None or not cfg.is_file():
        where = cfg if cfg is not None else exp / "config.yaml"
        sec["blocks"].append(_unavailable(f"Experiment config not available: no {where}."))
    else:
        sec["blocks"].append(_h3(f"Experiment config ({cfg.name})"))
        sec["blocks"].append({"kind": "pre", "text": cfg.read_text()})
    return sec


# =========================================================================== benchmarks
def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, f"{key}."))
        else:
            out[key] = v
    return out


def json_tables(data: Any, caption: str) -> list[dict]:
    """A generic JSON document as table blocks: a list of objects -> one row each; an object of
    objects -> one row per key; any other object -> key / value rows (nested keys dotted)."""
    if isinstance(data, list) and data and all(isinstance(x, Mapping) for x in data):
        flat = [_flatten(x) for x in data]
        cols = list(dict.fromkeys(k for r in flat for k in r))
        return [_table(cols, [[_fmt(r.get(c)) for c in cols] for r in flat], caption, 0)]
    if isinstance(data, Mapping):
        if data and all(isinstance(v, Mapping) for v in data.values()):
            flat = {k: _flatten(v) for k, v in data.items()}
            cols = list(dict.fromkeys(c for r in flat.values() for c in r))
            return [
                _table(["", *cols], [[k, *[_fmt(r.get(c)) for c in cols]] for k, r in flat.items()], caption)
            ]
        scalars = {
            k: v for k, v in data.items() if not (isinstance(v, list) and v and isinstance(v[0], Mapping))
        }
        blocks = (
            [_table(["key", "value"], [[k, _fmt(v)] for k, v in _flatten(scalars).items()], caption, 2)]
            if scalars
            else []
        )
        for k, v in data.items():
            if k not in scalars:
                blocks += json_tables(v, f"{caption}: {k}")
        return blocks
    return [_table(["value"], [[_fmt(data)]], caption, 1)]


def _bench_section(bench_dir: Path | None) -> dict:
    sec = {"id": "bench", "title": "Benchmarks", "blocks": []}
    files = sorted(bench_dir.glob("*.json")) if bench_dir is not None and bench_dir.is_dir() else []
    if not files:
        sec["unavailable"] = "Benchmarks not available: " + (
            f"no *.json in {bench_dir}." if bench_dir is not None else "no benchmark directory."
        )
        return sec
    for path in files:
        try:
            sec["blocks"] += json_tables(_read_json(path), path.name)
        except ValueError as e:
            sec["blocks"].append(_unavailable(str(e)))
    return sec


# =========================================================================== assembly
def _optional(title: str, sec_id: str, fn: Callable[[], dict]) -> dict:
    """Run a section builder; an unreadable input renders as a note instead of failing the report."""
    try:
        return fn()
    except FileNotFoundError as e:
        return {"id": sec_id, "title": title, "blocks": [], "unavailable": f"{title} not available: {e}"}
    except Exception as e:  # an optional section must never break the report
        log.warning("report section %r failed", title, exc_info=True)
        return {
            "id": sec_id,
            "title": title,
            "blocks": [],
            "unavailable": f"{title} could not be rendered: {type(e).__name__}: {e}",
        }


def _render(context: Mapping[str, Any]) -> str:
    src = importlib.resources.files("qatlib.report").joinpath("template.html").read_text(encoding="utf-8")
    env = jinja2.Environment(
        autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True
    )
    return env.from_string(src).render(**context)


def build_report(
    exp_dir: str | os.PathLike,
    out_html: str | os.PathLike,
    *,
    title: str | None = None,
    bench_dir: str | os.PathLike | None = None,
    config: str | os.PathLike | None = None,
    base_weights: str | os.PathLike | None = None,
    extra_timings: Sequence[str | os.PathLike] = (),
) -> Path:
    """Write the report of ``exp_dir`` to ``out_html``, and ``metrics.json`` + ``plots/*.csv`` beside it.

    ``bench_dir``: benchmark JSONs (default: ``<exp_dir>/bench`` or ``<exp_dir>/../bench`` when one
    exists). ``config``: the experiment YAML shown in the report (default: ``<exp_dir>/config.yaml``
    or the single ``*.yaml`` there). ``base_weights``: the full-precision weights behind the PTQ
    scales, for computing SQNR when ``analysis/sqnr.csv`` is absent (default: weights in ``ptq/``,
    else the QAT checkpoint's). ``extra_timings``: timing JSONs of stages shared between
    experiments (corpus, base model), listed in the wall-time table with the experiment's own. Raises `ReportError` when a required ``eval/*.json`` is missing.
    """
    exp = Path(exp_dir)
    if not exp.is_dir():
        raise ReportError(f"experiment directory {exp} does not exist")
    missing = [str(t) for t in extra_timings if not Path(t).is_file()]
    if missing:
        raise ReportError(f"timing file(s) not found: {', '.join(missing)}")
    out = Path(out_html)
    plots = out.parent / "plots"
    plots.mkdir(parents=True, exist_ok=True)  # always there: the workflow declares it as an output
    evals = load_eval(exp)
    if bench_dir is None:
        bench = next((d for d in (exp / "bench", exp.parent / "bench") if d.is_dir()), None)
    else:
        bench = Path(bench_dir)
    cfg = Path(config) if config is not None else None
    base = Path(base_weights) if base_weights is not None else None
    commit = git_commit()

    outputs: dict[str, Any] = {"plots": [], "metrics": {}}
    eval_sec, rows = _eval_section(evals)
    sections = [
        eval_sec,
        _optional("Training", "training", lambda: _training_section(exp, plots, outputs)),
        _optional("Scales", "scales", lambda: _scales_section(exp, plots, outputs)),
        _optional("Per-layer SQNR", "sqnr", lambda: _sqnr_section(exp, plots, outputs, base)),
        _optional("Scale warm start", "scale-load", lambda: _scale_load_section(exp)),
        _optional("Run metadata", "run", lambda: _metadata_section(exp, commit, cfg, evals, [Path(t) for t in extra_timings])),
        _optional("Benchmarks", "bench", lambda: _bench_section(bench)),
    ]
    for s in sections:
        s.setdefault("unavailable", "")
    metrics = {**metrics_summary(rows), **outputs["metrics"]}
    html = _render(
        {
            "title": title or f"QAT report: {exp.name}",
            "experiment": exp.name,
            "commit": commit,
            "sections": sections,
        }
    )
    _atomic_write(
        out.parent / "metrics.json", json.dumps(metrics, indent=2, sort_keys=True, allow_nan=False) + "\n"
    )
    _atomic_write(out, html)
    log.info("report written to %s (metrics.json, plots: %s)", out, ", ".join(outputs["plots"]) or "none")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qatlib.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("exp_dir", help="experiment results directory (results/<exp>)")
    ap.add_argument("--out", default=None, help="output HTML (default: EXP_DIR/report.html)")
    ap.add_argument("--title", default=None)
    ap.add_argument(
        "--bench-dir", default=None, help="directory of benchmark *.json (default: EXP_DIR/../bench)"
    )
    ap.add_argument("--config", default=None, help="experiment YAML to show (default: EXP_DIR/config.yaml)")
    ap.add_argument(
        "--base-weights", default=None, help="full-precision weights behind the PTQ scales (SQNR)"
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    out = args.out or str(Path(args.exp_dir) / "report.html")
    try:
        build_report(
            args.exp_dir,
            out,
            title=args.title,
            bench_dir=args.bench_dir,
            config=args.config,
            base_weights=args.base_weights,
        )
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0
