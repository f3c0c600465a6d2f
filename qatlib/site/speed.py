"""Renderer of `benchmarks.speed` (results/bench/speed.json) for the results page: what QAT costs.

The QAT step (as `QATTrainer` runs it) over the same step with quantizers off, per model, format
and tokens per step (median over interleaved rounds, min-max beside it); the fake-quant op's
GB/s against the copy bandwidth measured in the same run; the ZeRO-3 step at 1 vs 2 ranks; the
default DAG's QAT tokens/s; and each target with its bound and, when missed, its reason.
"""

from __future__ import annotations

from typing import Any

from .results import Result, _f


def _step_table(rows: list[dict[str, Any]]) -> list[str]:
    tokens = sorted({r["tokens_per_step"] for r in rows})
    lines = [
        "| model | format | " + " | ".join(f"{n} tok" for n in tokens) + " |",
        "|---|---|" + "---|" * len(tokens),
    ]
    by: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
    for r in rows:
        by.setdefault((r["model"], r["format"]), {})[r["tokens_per_step"]] = r
    for (model, fmt), cells in by.items():
        out = []
        for n in tokens:
            c = cells.get(n)
            out.append(
                "–"
                if c is None
                else f"x{_f(c.get('qat_over_plain'), 2)} ({_f(c.get('min'), 2)}–{_f(c.get('max'), 2)})"
            )
        lines.append(f"| {model} | `{fmt}` | " + " | ".join(out) + " |")
    return lines


def speed(r: Result) -> list[str]:
    d = r.doc
    lines = [
        "QAT step / the same trainer step with quantizers off (`QATTrainer.training_step` + optimizer "
        "step: KD teacher forward, student forward and backward, AdamW on the scales), median over "
        "interleaved rounds (min–max). torch threads "
        f"{d.get('torch_threads_used')}; load average {d.get('load_avg_start')} → {d.get('load_avg_end')}.",
        "",
        *_step_table(d.get("step") or []),
    ]
    for name, m in (d.get("models") or {}).items():
        extra = f"; reduced: {m['reduced']}" if m.get("reduced") else ""
        lines.append(f"\n`{name}`: {m.get('source')} ({m.get('params'):,} parameters{extra}).")
    fq = d.get("fake_quant") or []
    if fq:
        lines += [
            "",
            "Weight fake-quant op (forward) vs a copy of the same fp32 weight, same rounds:",
            "",
            "| format | weight | fake-quant GB/s | copy GB/s | fraction of copy |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| `{x['format']}` | {x.get('shape')} {x.get('dtype')} | {_f(x.get('fake_quant_GBps'), 2)} "
            f"| {_f(x.get('copy_GBps'), 2)} | {_f(x.get('fraction_of_copy'), 3)} |"
            for x in fq
        ]
    z = d.get("zero3") or {}
    if z.get("skipped"):
        lines += ["", f"ZeRO-3 1 vs 2 ranks: not measured ({z['skipped']})."]
    elif z:
        parts = []
        for k in ("one", "two"):
            w = z.get(k) or {}
            if "failed" in w:
                parts.append(f"{w.get('world')} rank(s) failed")
            else:
                parts.append(
                    f"{w.get('world')} rank(s): {_f(w.get('step_s_median'), 2)} s/step "
                    f"({_f(w.get('step_s_min'), 2)}–{_f(w.get('step_s_max'), 2)})"
                )
        lines += [
            "",
            f"ZeRO-3 step, {z.get('tokens_per_step')} tokens per global batch: {'; '.join(parts)}; "
            f"2 ranks / 1 rank x{_f(z.get('two_over_one'), 2)}.",
        ]
    dag = d.get("dag_qat") or {}
    if dag.get("tokens_per_s") is not None:
        lines += [
            "",
            f"The default DAG's QAT stage (`{dag.get('timing_file')}`): {dag.get('trained_tokens')} tokens "
            f"in {dag.get('wall_s')} s on {dag.get('world_size')} ranks = {dag['tokens_per_s']} tokens/s "
            "(the whole stage, load and save included).",
        ]
    elif dag.get("skipped"):
        lines += ["", f"The default DAG's QAT stage: {dag['skipped']}."]
    ts = d.get("targets") or []
    if ts:
        lines += ["", "| target | value | bound | met | reason if missed |", "|---|---|---|---|---|"]
        for t in ts:
            met = {True: "met", False: "not met", None: "not measured"}[t.get("met")]
            lines.append(
                f"| {t.get('name')} | {_f(t.get('value'), 3)} | {t.get('op', '')} {t.get('bound')} "
                f"| {met} | {t.get('reason', '')} |"
            )
    return lines


def speed_headline(r: Result) -> tuple[str, str]:
    ts = r.doc.get("targets") or []
    met = sum(1 for t in ts if t.get("met") is True)
    big = [
        row
        for row in r.doc.get("step") or []
        if row.get("tokens_per_step") == max(x.get("tokens_per_step", 0) for x in r.doc.get("step") or [{}])
    ]
    figs = ", ".join(f"{row['format']} x{_f(row.get('qat_over_plain'), 2)}" for row in big[:5])
    return (
        "What QAT costs: QAT step / plain step",
        f"at {big[0]['tokens_per_step'] if big else 'n/a'} tokens: {figs or 'n/a'}; {met} of {len(ts)} targets met",
    )
