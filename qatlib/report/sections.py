"""The report's sections: each turns its inputs (`qatlib.report.inputs`) and numbers
(`qatlib.report.metrics`) into a ``{"id", "title", "blocks", "unavailable"}`` dict of HTML blocks
(`qatlib.report.blocks`) and hands its plot CSVs / metrics to `metrics.DvcOutputs`. Every section but
the evaluation table is optional: a missing input renders as "not available"."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .. import analysis
from ..checkpoint.keys import load_scales
from ..checkpoint.layout import EXPORT_INFO_FILE, TRAIN_LOG_FILE
from ..scores import not_applied_sentence
from . import inputs
from .blocks import cell, fmt, h3, img, json_tables, nbytes, para, pre, seconds, table, unavailable
from .metrics import MIN_ABS_GAP, MIN_REL_GAP, RECOVERY_VARIANTS, DvcOutputs, loss_keys, sqnr_metrics

VARIANT_LABELS = {
    "bf16": "BF16",
    "ptq": "PTQ",
    "qat": "QAT",
    "export": "export",
    "deployed": "deployed",
    "served_ptq": "served PTQ",
    "served": "served",
}
# Compute per-layer SQNR in the report only when each weight source (BF16, PTQ, QAT) is at most this large.
SQNR_MAX_BYTES = 1 << 30


def eval_section(evals: Mapping[str, dict], rows: Sequence[Mapping[str, Any]]) -> dict:
    """The evaluation table (`metrics.eval_rows` ``rows``): values, deltas vs BF16, recoveries."""
    skipped = {v: d["skipped"] for v, d in evals.items() if d.get("skipped")}
    evals = inputs.evaluated(evals)
    variants = [v for v in inputs.VARIANTS if v in evals]
    deltas = [v for v in variants if v != "bf16"]
    rec_vs = [v for v in RECOVERY_VARIANTS if v in evals]
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
        cells: list[Any] = [label] + [fmt(vals.get(v)) for v in variants]
        bf = vals.get("bf16")
        for v in deltas:
            x = vals.get(v)
            if x is None or bf is None:
                cells.append(cell("n/a", "na"))
                continue
            d = x - bf
            rel = f" ({100 * d / bf:+.2f}%)" if bf else ""
            worse = d > 0 if r["lower_better"] else d < 0
            cells.append(cell(f"{d:+.4f}{rel}", "bad" if worse and d else "good" if d else ""))
        for v in rec_vs:
            rec = r["recovery"][v]
            if rec.shown is None:
                any_na = True
                cells.append(cell("n/a", "na", rec.reason))
            else:
                text = f"{100.0 * rec.shown:.1f}%"
                cells.append(cell("0.0%" if text == "-0.0%" else text, "", "(PTQ - x) / (PTQ - BF16)"))
        table_rows.append(cells)
    caption = "Perplexity and task scores"
    served = (evals.get("served") or {}).get("label")
    if served:  # the engine that computed the served column (`qatlib.serve.ServedResult.label` + dtype)
        caption += f"; served = {served}"
    blocks = [table(columns, table_rows, caption)]
    blocks.append(
        para(
            "Recovery = share of PTQ's loss that QAT (or the exported model) wins back: "
            "(PTQ − QAT) / (PTQ − BF16) for perplexity, (QAT − PTQ) / (BF16 − PTQ) for accuracy. "
            "100% = back to BF16, 0% = no better than PTQ. "
            "It is n/a when PTQ is not worse than BF16 by more than noise (perplexity: PTQ − BF16 < "
            f"{MIN_REL_GAP:.1%} of BF16; task scores: a gap < {MIN_ABS_GAP} or 2 standard errors when "
            "reported)."
        )
    )
    if any_na:
        blocks.append(
            para(
                "n/a recovery cells: PTQ loses too little against BF16 for the ratio to mean anything "
                "(hover a cell for the numbers)."
            )
        )
    if "deployed" in evals:
        blocks.append(
            para(
                "deployed = the export as the deployment runtime computes it (eval/deployed.json "
                f"names the runtime and each load-time transformation): its recovery ("
                f"{_headline(rows)}) is what a user of the runtime gets."
            )
        )
    if "served" in evals:
        note = evals["served"].get("dtype_note")
        blocks.append(
            para(
                f"served = the export as vLLM's own engine serves it ({served or 'engine unknown'}; "
                "eval/served.json), on the same windows; perplexity only, its recovery against the "
                "emulated BF16 and PTQ" + (f". {note[0].upper()}{note[1:]}." if note else ".")
            )
        )
    blocks += [para(t) for t in served_sentences(evals)]
    unused = (evals.get("export") or {}).get("not_applied")
    if unused:  # `qatlib.scores.not_applied`: the export row is not the runtime's number
        blocks.append(para(not_applied_sentence("export", unused)))
    for v, why in skipped.items():
        blocks.append(para(f"{VARIANT_LABELS.get(v, v)} not evaluated: {why}"))
    missing = [v for v in inputs.VARIANTS if v not in evals and v not in skipped]
    if missing:
        blocks.append(para(f"Not evaluated: {', '.join(missing)} (eval/{missing[0]}.json absent)."))
    return {"id": "eval", "title": "Accuracy", "blocks": blocks}


def served_sentences(evals: Mapping[str, dict]) -> list[str]:
    """What the engine says beyond the served column: QAT's gain over PTQ as served (both exports in
    the engine: eval/served_ptq.json, eval/served.json) and, per served export, how far the engine's
    per-window NLL is from qatlib's emulation of it on the same CPU (the ``emulated`` entry
    `qatlib.pipeline.serve.run_serve_evaluate` writes)."""
    out = []
    qat, ptq = evals.get("served"), evals.get("served_ptq")
    for ds, q in ((qat or {}).get("ppl") or {}).items():
        p = ((ptq or {}).get("ppl") or {}).get(ds)
        if p and not ptq.get("skipped") and not qat.get("skipped"):
            out.append(
                f"QAT's gain over PTQ as served, PPL {ds}: served PTQ {p['ppl']:.4f} -> served QAT "
                f"{q['ppl']:.4f} ({q['ppl'] - p['ppl']:+.4f}; mean NLL {q['nll'] - p['nll']:+.5f} nats/token), "
                "both exports in the same engine on the same windows."
            )
    for v in ("served_ptq", "served"):
        emu = (evals.get(v) or {}).get("emulated") or {}
        if emu.get("skipped"):
            out.append(f"{VARIANT_LABELS[v]}: not compared with the emulator: {emu['skipped']}.")
        for ds, e in (emu.get("ppl") or {}).items():
            out.append(
                f"{VARIANT_LABELS[v]} vs qatlib's emulation of the same export ({e.get('ppl', 0):.4f}, "
                f"{emu.get('dtype')}, int8 GEMM {emu.get('int8_gemm')}), PPL {ds}: per-window |ΔNLL| "
                f"max {e['max_abs_dnll']:.1e}, mean {e['mean_abs_dnll']:.1e} nats."
            )
    return out


def _headline(rows: Sequence[Mapping[str, Any]]) -> str:
    """The deployed recovery of every row, ``name: x%`` (n/a with the noise rule)."""
    parts = []
    for r in rows:
        rec = r["recovery"].get("deployed")
        if rec is not None:
            label = f"PPL {r['name']}" if r["kind"] == "ppl" else f"{r['name']} {r['metric']}"
            parts.append(f"{label} {'n/a' if rec.shown is None else f'{100.0 * rec.shown:.1f}%'}")
    return ", ".join(parts) or "n/a"


def training_section(exp: Path, out: DvcOutputs) -> dict:
    from .figures import loss_curves

    sec = {"id": "training", "title": "Training", "blocks": []}
    path = inputs.find_train_log(exp)
    if path is None:
        sec["unavailable"] = f"Training curves not available: no {TRAIN_LOG_FILE} in {exp / 'qat'}."
        return sec
    rows = [r for r in inputs.read_train_log(path) if "step" in r]
    keys = loss_keys(rows)
    if not rows or not keys:
        sec["unavailable"] = f"Training curves not available: {path} has no logged loss."
        return sec
    cols = ["step", *keys] + (["learning_rate"] if any("learning_rate" in r for r in rows) else [])
    out.plot("loss.csv", rows, cols)
    sec["blocks"].append(img(loss_curves(rows, keys), "training curves"))
    first, last = rows[0], rows[-1]
    sec["blocks"].append(
        table(
            ["series", f"step {first['step']}", f"step {last['step']}", "min"],
            [
                [
                    k,
                    fmt(first.get(k)),
                    fmt(last.get(k)),
                    fmt(min((r[k] for r in rows if isinstance(r.get(k), (int, float))), default=None)),
                ]
                for k in cols[1:]
            ],
            f"{len(rows)} logging steps ({path.name})",
        )
    )
    return sec


def scales_section(exp: Path, out: DvcOutputs) -> dict:
    from .figures import scale_histograms, value_histograms

    sec = {"id": "scales", "title": "Scales", "blocks": []}
    loaded = {}
    for v in ("ptq", "qat"):
        try:
            loaded[v] = load_scales(exp / v)
        except FileNotFoundError as e:
            sec["blocks"].append(unavailable(f"{VARIANT_LABELS[v]} scales not available: {e}"))
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
        sec["blocks"].append(h3(f"{what}: log10 histogram per layer type, PTQ (before) vs QAT (after)"))
        sec["blocks"].append(img(scale_histograms(b, a), f"{what} histograms"))
    if before and after:
        ratios = analysis.ratio_by_type(before, after, "weight")
        if ratios:
            sec["blocks"].append(h3("Weight-scale change per element: log2(QAT / PTQ), per layer type"))
            sec["blocks"].append(
                img(value_histograms(ratios, "log2(s_QAT / s_PTQ)"), "scale ratio histograms")
            )
        changes = analysis.scale_changes(before, after)
        out.plot("scale_changes.csv", changes)
        summary = analysis.summarize(changes, ["rel_change_mean", "rel_change_max"], by="layer_type")
        sec["blocks"].append(
            table(
                ["layer type", "tensors", "mean |Δs|/s", "mean of per-tensor max |Δs|/s"],
                [
                    [r["layer_type"], r["count"], fmt(r["rel_change_mean"]), fmt(r["rel_change_max"])]
                    for r in summary
                ],
                "Relative scale change QAT vs PTQ, per layer type",
            )
        )
        sec["blocks"].append(
            table(
                ["key", "numel", "mean PTQ", "mean QAT", "mean |Δs|/s", "max |Δs|/s"],
                [
                    [
                        r["key"],
                        r["numel"],
                        fmt(r["mean_before"]),
                        fmt(r["mean_after"]),
                        fmt(r["rel_change_mean"]),
                        fmt(r["rel_change_max"]),
                    ]
                    for r in changes[:15]
                ],
                "Largest relative changes (top 15)",
            )
        )
        only = sorted(set(before) ^ set(after))
        if only:
            sec["blocks"].append(
                para(f"{len(only)} keys are in only one checkpoint, e.g. {', '.join(only[:5])}.")
            )
    return sec


def sqnr_section(exp: Path, out: DvcOutputs, base_weights: Path | None) -> dict:
    from .figures import sqnr_per_layer

    sec = {"id": "sqnr", "title": "Per-layer SQNR", "blocks": []}
    csv_path = exp / inputs.SQNR_CSV
    if csv_path.is_file():
        rows = inputs.read_sqnr_csv(csv_path)
        source = f"from {inputs.SQNR_CSV}"
    else:
        try:
            rows, notes = analysis.checkpoint_sqnr(
                exp / "ptq", exp / "qat", base_weights, max_bytes=SQNR_MAX_BYTES
            )
        except analysis.SqnrError as e:
            sec["unavailable"] = f"Per-layer SQNR not available: no {inputs.SQNR_CSV}, and {e}."
            return sec
        source = "computed from the checkpoint weights"
        sec["blocks"] += [para(n) for n in notes]
    if not rows:
        sec["unavailable"] = "Per-layer SQNR not available: no weight-quantized layer."
        return sec
    out.plot("sqnr.csv", rows, analysis.SQNR_COLUMNS)
    out.metrics.update(sqnr_metrics(rows))
    summary = analysis.summarize(rows, ["ptq_db", "qat_db", "delta_db"])
    sec["blocks"].append(
        para(
            "Weight SQNR vs BF16 = 10·log10(‖W_bf16‖² / ‖W_bf16 − W_q‖²), W_q the dequantized weight "
            f"each variant deploys (qatlib.analysis.checkpoint_sqnr), {source}; higher is closer to BF16."
        )
    )
    sec["blocks"].append(img(sqnr_per_layer(rows), "per-layer SQNR vs BF16"))
    sec["blocks"].append(
        table(
            ["layer type", "layers", "PTQ vs BF16 (dB)", "QAT vs BF16 (dB)", "Δ QAT − PTQ (dB)"],
            [
                [
                    r["layer_type"],
                    r["count"],
                    fmt(r["ptq_db"], 2),
                    fmt(r["qat_db"], 2),
                    fmt(r["delta_db"], 2),
                ]
                for r in summary
            ],
            "Mean SQNR vs BF16 per layer type",
        )
    )
    return sec


def scale_load_section(exp: Path) -> dict:
    sec = {"id": "scale-load", "title": "Scale warm start", "blocks": []}
    path = inputs.qat_file(exp, "scale_load.json")
    if path is None:
        sec["unavailable"] = f"Scale hit/miss counts not available: no {exp / 'qat' / 'scale_load.json'}."
        return sec
    data = inputs.read_json(path)
    counts = [(k, data[k]) for k in ("hits", "misses", "unused_keys", "ignored_keys", "seconds") if k in data]
    sec["blocks"].append(
        para(
            "hits: quantizer parameters loaded from the PTQ checkpoint; misses: parameters that "
            "kept their initial value; unused: scale keys matching no quantizer; ignored: other "
            "tensors (weights)."
        )
    )
    sec["blocks"].append(table(["", "count"], [[k, fmt(v)] for k, v in counts], f"{path.relative_to(exp)}"))
    other = [(k, v) for k, v in data.items() if k not in dict(counts) and not isinstance(v, list)]
    if other:
        sec["blocks"].append(table(["", "value"], [[k, fmt(v)] for k, v in other], text_cols=2))
    for k, what in (("missed_params", "Missed parameters"), ("unused_key_names", "Unused scale keys")):
        names = data.get(k) or []
        if names:
            more = f" (first 25 of {len(names)})" if len(names) > 25 else ""
            sec["blocks"].append(h3(f"{what}{more}"))
            sec["blocks"].append(pre("\n".join(map(str, names[:25]))))
    return sec


def _zero3_blocks(meta: Mapping[str, Any]) -> list[dict]:
    facts = [
        ("world size", fmt(meta.get("world_size"))),
        ("ZeRO stage", fmt(meta.get("zero_stage"))),
        ("parameters (tensors)", fmt(meta.get("n_params"))),
        ("persistent parameters", fmt(meta.get("n_persistent_params"))),
        ("parameter bytes (whole model)", nbytes(meta.get("param_bytes_total"))),
        ("peak RSS (max over ranks)", nbytes(meta.get("peak_rss_bytes_max"))),
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
            facts.append((k, nbytes(v) if k.endswith("_bytes") else fmt(v)))
    blocks = [
        table(["", "value"], [f for f in facts if f[1] != "n/a"], "ZeRO-3 run (qat/run_metadata.json)", 2)
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
            return nbytes(v) if k.endswith("_bytes") else fmt(v)

        blocks.append(
            table(
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
                        fmt(r.get("rank")),
                        nbytes(r.get("param_bytes_held")),
                        share(r),
                        fmt(r.get("share_min")),
                    ]
                    + [fmt(r.get("share_max")), nbytes(r.get("peak_rss_bytes"))]
                    + [value(k, r.get(k)) for k in extra]
                    for r in ranks
                ],
                "Per rank (share min / max: the smallest / largest fraction of any one parameter held)",
            )
        )
    return blocks


def metadata_section(
    exp: Path,
    commit: str,
    config: Path | None,
    evals: Mapping[str, dict],
    extra_timings: Sequence[Path] = (),
    hashes: Mapping[str, str] | None = None,
    cpu: Mapping[str, Any] | None = None,
) -> dict:
    sec = {"id": "run", "title": "Run metadata", "blocks": []}
    sec["blocks"].append(
        table(
            ["", "value"],
            [["experiment", exp.name], ["git commit", commit], ["python", sys.version.split()[0]]],
            "Code",
            2,
        )
    )
    sec["blocks"].append(
        table(["package", "version"], inputs.package_versions().items(), "Package versions", 2)
    )
    if hashes:
        sec["blocks"].append(
            table(
                ["product", "content hash"],
                list(hashes.items()),
                "Content hashes (qatlib.checkpoint.hashes: the first that differs between two runs is "
                "where they diverged)",
            )
        )
    if cpu:
        sec["blocks"].append(table(["setting", "value"], list(cpu.items()), "CPU arithmetic", 2))
    timings = inputs.read_timings(exp, extra_timings)
    if timings:
        total = sum(w for _, w, _ in timings if isinstance(w, (int, float)))
        rows = [[s, seconds(w) if isinstance(w, (int, float)) else w, fmt(n)] for s, w, n in timings]
        sec["blocks"].append(
            table(
                ["stage", "wall time", "processes"],
                rows + [["total", seconds(total), ""]],
                "Wall time per stage (timings/*.json)",
            )
        )
    else:
        sec["blocks"].append(unavailable(f"Stage timings not available: no {exp / 'timings'}/*.json."))
    ev = [[VARIANT_LABELS[v], seconds(d.get("wall_s"))] for v, d in evals.items() if "wall_s" in d]
    if ev:
        sec["blocks"].append(table(["variant", "wall time"], ev, "Evaluation wall time (eval/*.json)"))

    meta_path = inputs.qat_file(exp, "run_metadata.json")
    if meta_path is None:
        sec["blocks"].append(
            unavailable(f"ZeRO-3 facts not available: no {exp / 'qat' / 'run_metadata.json'}.")
        )
    else:
        sec["blocks"] += _zero3_blocks(inputs.read_json(meta_path))

    cfg = inputs.find_config(exp, config)
    if cfg is None or not cfg.is_file():
        where = cfg if cfg is not None else exp / "config.yaml"
        sec["blocks"].append(unavailable(f"Experiment config not available: no {where}."))
    else:
        sec["blocks"].append(h3(f"Experiment config ({cfg.name})"))
        sec["blocks"].append(pre(cfg.read_text()))
    return sec


def coverage_rows(coverage: Sequence[Mapping[str, Any]]) -> list[list[Any]]:
    """The rows of the export coverage table: one per (module type, kept reason); a type with
    nothing kept gets one row with an empty reason. Notes (what the runtime reads differently)
    go into the reason column of the type's first row."""
    rows = []
    for r in coverage:
        kept = dict(r.get("kept", {}))
        notes = "; ".join(r.get("notes", []))
        first = True
        for reason, n in (kept or {"": 0}).items():
            why = "; ".join(x for x in (reason, notes if first else "") if x)
            rows.append(
                [
                    r["module_type"],
                    fmt(r["quantized"]) if first else "",
                    fmt(n) if reason else "0",
                    cell(why, "text"),
                ]
            )
            first = False
    return rows


def export_section(exp: Path) -> dict:
    """What the export quantized and kept, per module type (``export/qatlib_export.json``'s
    ``coverage``, `qatlib.export.coverage`)."""
    sec = {"id": "export", "title": "Export coverage", "blocks": []}
    path = exp / "export" / EXPORT_INFO_FILE
    if not path.is_file():
        sec["unavailable"] = f"Export coverage not available: no {path}."
        return sec
    coverage = inputs.read_json(path).get("coverage")
    if not coverage:
        sec["unavailable"] = f"Export coverage not available: {path} has no coverage record."
        return sec
    q = sum(r["quantized"] for r in coverage)
    k = sum(sum(r.get("kept", {}).values()) for r in coverage)
    sec["blocks"].append(para(f"{q} module(s) quantized, {k} kept in high precision ({path.name})."))
    sec["blocks"].append(
        table(
            ["module type", "quantized", "kept", "why kept"],
            coverage_rows(coverage),
            "Quantized and kept modules per type (qatlib.export.coverage)",
        )
    )
    return sec


def bench_section(bench_dir: Path | None) -> dict:
    sec = {"id": "bench", "title": "Benchmarks", "blocks": []}
    files = sorted(bench_dir.glob("*.json")) if bench_dir is not None and bench_dir.is_dir() else []
    if not files:
        sec["unavailable"] = "Benchmarks not available: " + (
            f"no *.json in {bench_dir}." if bench_dir is not None else "no benchmark directory."
        )
        return sec
    for path in files:
        try:
            sec["blocks"] += json_tables(inputs.read_json(path), path.name)
        except ValueError as e:
            sec["blocks"].append(unavailable(str(e)))
    return sec
