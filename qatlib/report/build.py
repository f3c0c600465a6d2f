"""Build the self-contained HTML report of one experiment (``results/<exp>/``), plus the DVC
``metrics.json`` and ``plots/*.csv`` beside it.

Inputs (docs/design.md, results layout; read by `qatlib.report.inputs`), relative to the
experiment directory:

- ``eval/{bf16,ptq,qat}.json`` (required), ``eval/export.json`` and ``eval/deployed.json`` (optional;
  deployed: the export through the runtime emulator, or ``{"skipped": reason}`` under
  ``deploy.target: none``):
  ``{"variant", "ppl": {dataset: {ppl, ...}}, "tasks": {task: {acc, acc_norm, ...}}, "wall_s"}``;
- ``qat/train_log.jsonl``: one JSON object per logging
  step (``step``, ``lm_loss``, ``kd/<type>``, ``kd/forward_kl``, ``kd/backward_kl``,
  ``total_loss``, ``learning_rate``);
- ``ptq/`` and ``qat/`` checkpoints (scales, `qatlib.checkpoint.keys.load_scales`);
- ``analysis/sqnr.csv`` (``layer, layer_type, ptq_db, qat_db``: each variant's weight SQNR vs
  BF16), else that SQNR computed from the checkpoint and base weights
  (`qatlib.analysis.checkpoint_sqnr`) when they are small enough;
- ``qat/scale_load.json``, ``qat/run_metadata.json``, ``timings/*.json``, the experiment YAML,
  and the benchmark JSONs of ``bench_dir``.
- ``export/qatlib_export.json``'s ``coverage`` (`qatlib.export.coverage`): what the export quantized
  and kept, and why, per module type (the section is left out when there is no ``export/``).

Every section but the evaluation table is optional: a missing input renders as "not available".
Nothing in the HTML points outside the file (figures are base64 PNG, CSS is inline), so it opens
offline; the output carries no timestamp, so the same inputs give the same file. The numbers
(recovery and its noise rule) are `qatlib.report.metrics`'; the command line is
``scripts/report.py``.
"""

from __future__ import annotations

import importlib.resources
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2

from . import inputs, sections
from .inputs import ReportError
from .metrics import DvcOutputs, atomic_write, eval_rows

log = logging.getLogger(__name__)

__all__ = ["ReportError", "build_report"]


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
    products: Mapping[str, str | os.PathLike | None] | None = None,
) -> Path:
    """Write the report of ``exp_dir`` to ``out_html``, and ``metrics.json`` + ``plots/*.csv`` beside it.

    ``bench_dir``: benchmark JSONs (default: ``<exp_dir>/bench`` or ``<exp_dir>/../bench`` when one
    exists). ``config``: the experiment YAML shown in the report (default: ``<exp_dir>/config.yaml``
    or the single ``*.yaml`` there). ``base_weights``: the BF16 (base model) weights, the
    reference of the SQNR computed when ``analysis/sqnr.csv`` is absent
    (`qatlib.analysis.checkpoint_sqnr`). ``extra_timings``: timing JSONs of stages shared between
    experiments (corpus, base model), listed in the wall-time table with the experiment's own.
    ``products``: ``{label: path}`` of the inputs made outside ``exp_dir`` (``corpus``,
    ``tokenizer``, ``base_model``); their content hashes and those of ``exp_dir``'s ``ptq``,
    ``qat`` and ``export`` (`qatlib.checkpoint.hashes`) go into ``metrics.json`` (``hash/<label>``)
    and the metadata, with the CPU arithmetic settings (``cpu/*``) that decide the last bits.
    Raises `ReportError` (before anything is written) when the experiment directory, a required
    ``eval/*.json`` or a file of ``extra_timings`` is missing.
    """
    exp = Path(exp_dir)
    if not exp.is_dir():
        raise ReportError(f"experiment directory {exp} does not exist")
    inputs.require_files(extra_timings, "timing file(s)")
    evals = inputs.load_eval(exp)
    out = Path(out_html)
    dvc = DvcOutputs(out.parent / "plots")
    bench = inputs.find_bench_dir(exp, bench_dir)
    cfg = Path(config) if config is not None else None
    base = Path(base_weights) if base_weights is not None else None
    timings = [Path(t) for t in extra_timings]
    commit = inputs.git_commit()
    hashes = inputs.stage_hashes(exp, products or {})
    cpu = inputs.cpu_arithmetic()
    dvc.metrics.update({f"hash/{k}": v for k, v in hashes.items()})
    dvc.metrics.update({f"cpu/{k}": v for k, v in cpu.items()})

    rows = eval_rows(evals)
    secs = [
        sections.eval_section(evals, rows),
        _optional("Training", "training", lambda: sections.training_section(exp, dvc)),
        _optional("Scales", "scales", lambda: sections.scales_section(exp, dvc)),
        _optional("Per-layer SQNR", "sqnr", lambda: sections.sqnr_section(exp, dvc, base)),
        _optional("Scale warm start", "scale-load", lambda: sections.scale_load_section(exp)),
        _optional(
            "Run metadata",
            "run",
            lambda: sections.metadata_section(exp, commit, cfg, evals, timings, hashes, cpu),
        ),
        _optional("Benchmarks", "bench", lambda: sections.bench_section(bench)),
    ]
    if (exp / "export").is_dir():  # an experiment without an export stage has no coverage to show
        secs.insert(-2, _optional("Export coverage", "export", lambda: sections.export_section(exp)))
    for s in secs:
        s.setdefault("unavailable", "")
    html = _render(
        {
            "title": title or f"QAT report: {exp.name}",
            "experiment": exp.name,
            "commit": commit,
            "sections": secs,
        }
    )
    atomic_write(out.parent / "metrics.json", dvc.metrics_json(rows))
    atomic_write(out, html)
    log.info("report written to %s (metrics.json, plots: %s)", out, ", ".join(dvc.plots) or "none")
    return out
