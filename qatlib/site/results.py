"""The results page (docs/results.md) and the README's results table, from the committed JSON.

Every figure shown is read from a file under ``results/bench/`` (the benchmarks' `write_result`
JSON, and ``default_experiment.json`` that `qatlib.site.record` copies from the default DAG's
`metrics.json`); each table says which run made it: date, commit, CPU, settings and the command.
A figure no JSON backs is not shown. Known benchmarks get a table of their own (their renderers here
and in `qatlib.site.served`, listed in `qatlib.site.page.RENDERERS`); any other JSON gets its targets
(met / not met), which every benchmark writes."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qatlib.scores import not_applied_sentence

GIB = 2**30
VARIANTS = ("bf16", "ptq", "qat", "export", "deployed", "served_ptq", "served")
LABELS = dict(
    zip(
        VARIANTS,
        ("BF16", "PTQ", "QAT", "export", "deployed", "served PTQ (vLLM engine)", "served (vLLM engine)"),
    )
)


@dataclass(frozen=True)
class Result:
    """One benchmark JSON: its name, file (relative to the repository) and content."""

    name: str
    path: str
    doc: Mapping[str, Any]

    @property
    def machine(self) -> Mapping[str, Any]:
        return self.doc.get("machine") or {}

    @property
    def settings(self) -> Mapping[str, Any]:
        return self.doc.get("settings") or {}


def load(bench_dir: Path, repo: Path) -> list[Result]:
    """Every ``*.json`` of ``bench_dir`` (sorted; ``*.partial.json`` left out)."""
    out = []
    for p in sorted(bench_dir.glob("*.json")):
        if p.name.endswith(".partial.json"):
            continue
        doc = json.loads(p.read_text())
        name = doc.get("benchmark", p.stem) if isinstance(doc, dict) else p.stem
        out.append(Result(str(name), p.relative_to(repo).as_posix(), doc if isinstance(doc, dict) else {}))
    return out


# --------------------------------------------------------------------------- provenance
def _date(m: Mapping[str, Any]) -> str:
    d = str(m.get("date_utc") or "")
    return d[:10] if d else "date not recorded"


def _commit(m: Mapping[str, Any]) -> str:
    g = m.get("git") or {}
    c = str(g.get("commit") or "")
    if not c:
        return "commit not recorded"
    return f"`{c[:7]}`" + (" + uncommitted changes" if g.get("dirty") else "")


def _cpu(m: Mapping[str, Any]) -> str:
    parts = []
    if m.get("cpu_model"):
        parts.append(str(m["cpu_model"]))
    n = m.get("cpu_affinity") or m.get("cpu_count")
    if n:
        parts.append(f"{n} cores")
    isa = (m.get("cpu_arithmetic") or {}).get("aten_capability")
    if isa:
        parts.append(f"ATen {isa}")
    if m.get("cuda"):
        parts.append("CUDA")
    return ", ".join(parts) or "CPU not recorded"


def run_cell(r: Result) -> str:
    """date, commit, CPU of the run (the README table's column)."""
    return f"{_date(r.machine)}, {_commit(r.machine)}, {_cpu(r.machine)}"


def _command(m: Mapping[str, Any]) -> str | None:
    argv = m.get("argv")
    if not argv:
        return None
    argv = re.sub(r"^\S*?/benchmarks/(\w+)\.py", r"python -m benchmarks.\1", str(argv))
    return argv


def _settings_text(s: Mapping[str, Any]) -> str:
    items = [
        f"{k} {json.dumps(v) if isinstance(v, list | dict) else v}"
        for k, v in s.items()
        if v not in (None, [], {})
    ]
    return "; ".join(items) or "none recorded"


def provenance(r: Result) -> list[str]:
    m = r.machine
    lines = [
        f"Run {_date(m)} (UTC), commit {_commit(m)}, {_cpu(m)}"
        + (f", torch {m['versions']['torch']}" if (m.get("versions") or {}).get("torch") else "")
        + (f", load average {m['load_avg_1m']}" if m.get("load_avg_1m") is not None else "")
        + f". Source: `{r.path}`.",
        "",
        f"Settings: {_settings_text(r.settings)}.",
    ]
    cmd = _command(m)
    if cmd:
        lines += ["", f"Command: `{cmd}`"]
    return lines


def _f(x: Any, digits: int = 3) -> str:
    return "n/a" if not isinstance(x, int | float) else f"{x:.{digits}f}"


def _gib(x: Any) -> str:
    return "n/a" if not isinstance(x, int | float) else f"{x / GIB:.2f} GiB"


# --------------------------------------------------------------------------- the default experiment
def _ppl_sets(metrics: Mapping[str, Any]) -> list[str]:
    """The perplexity sets of ``ppl/<set>/<variant>`` keys (a set's name may hold ``/``)."""
    return sorted({k.removeprefix("ppl/").rsplit("/", 1)[0] for k in metrics if k.startswith("ppl/")})


def _task_metrics(metrics: Mapping[str, Any]) -> list[str]:
    """``tasks/<task>/<metric>`` bases with a bf16 value (stderr / window keys left out)."""
    return sorted(
        k.removesuffix("/bf16")
        for k in metrics
        if k.startswith("tasks/") and k.endswith("/bf16") and "_stderr" not in k
    )


def default_experiment(r: Result) -> list[str]:
    met = r.doc.get("metrics") or {}
    intro = [
        f"`snakemake` (the default target, `results/{r.settings.get('experiment', '<experiment>')}/report.html`), "
        "recorded by `python -m qatlib.site record`: perplexity and next-token accuracy on the held-out "
        "test windows, recovery = the share of PTQ's loss won back.",
        "",
    ]
    cols = [v for v in VARIANTS if any(k.endswith(f"/{v}") for k in met)]
    lines = intro + [
        "| score | " + " | ".join(LABELS[v] for v in cols) + " | QAT recovery | deployed recovery |",
        "|---" * (len(cols) + 3) + "|",
    ]
    for base in [f"ppl/{s}" for s in _ppl_sets(met)] + _task_metrics(met):
        label = (
            f"perplexity ({base.removeprefix('ppl/')})"
            if base.startswith("ppl/")
            else base.removeprefix("tasks/")
        )
        cells = [_f(met.get(f"{base}/{v}")) for v in cols]
        recs = []
        for v in ("qat", "deployed"):
            pct = met.get(f"recovery_pct/{v}/{base}")
            recs.append("n/a" if pct is None else f"{pct:.1f}%")
        lines.append(f"| {label} | " + " | ".join(cells) + " | " + " | ".join(recs) + " |")
    walls = r.doc.get("stage_wall_s") or {}
    if walls:
        total = sum(walls.values())
        lines += [
            "",
            "Wall time per stage: "
            + ", ".join(f"{k} {v:.0f} s" for k, v in walls.items())
            + f"; {total / 60:.1f} min in all (whatever else ran on the machine at the time counts in them).",
        ]
    hashes = {k.removeprefix("hash/"): v for k, v in met.items() if k.startswith("hash/")}
    if hashes:
        short = {k: str(v).split(":", 1)[-1][:12] for k, v in hashes.items()}
        lines += [
            "",
            "Content hashes (sha256, first 12 digits): "
            + ", ".join(f"{k} `{v}`" for k, v in short.items())
            + ".",
        ]
    return lines


def default_experiment_headline(r: Result) -> tuple[str, str]:
    met = r.doc.get("metrics") or {}
    s = r.settings
    sets = _ppl_sets(met)
    if not sets:
        return "default experiment", "no perplexity recorded"
    base = f"ppl/{sets[0]}"
    vals = [f"{LABELS[v]} {_f(met[f'{base}/{v}'])}" for v in VARIANTS if f"{base}/{v}" in met]
    rec = met.get(f"recovery_pct/qat/{base}")
    knobs = ", ".join(
        f"{k} {s[k]}" for k in ("format", "group_size", "max_steps", "train_tokens_per_sample") if k in s
    )
    what = f"Default experiment `{s.get('experiment', '?')}` ({knobs}): test perplexity"
    return what, ", ".join(vals) + ("" if rec is None else f" (QAT recovers {rec:.1f}% of PTQ's loss)")


# --------------------------------------------------------------------------- plan rehearsal
def plan_rehearsal(r: Result) -> list[str]:
    stages = r.doc.get("stages") or {}
    lines = [
        "| stage | measured peak per rank | plan per rank (rank 0) | measured / plan | within ±25% | "
        "#36 bound | wall |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, st in stages.items():
        if not isinstance(st, dict) or "peak_rss_per_rank" not in st:
            continue
        pred = st.get("predicted") or {}
        ratio = ", ".join(_f(x, 2) for x in st.get("measured_over_predicted") or [])
        bound = (
            "-"
            if "bound" not in st
            else f"{_gib(st['bound'])} ({'met' if st.get('meets_bound') else 'not met'})"
        )
        lines.append(
            f"| {name} | {', '.join(_gib(x) for x in st['peak_rss_per_rank'])} | "
            f"{_gib(pred.get('per_rank'))} ({_gib(pred.get('rank0'))}) | {ratio} | "
            f"{'yes' if st.get('within_25pct') else 'no'} | {bound} | {_f(st.get('wall_s'), 0)} s |"
        )
    if isinstance(stages.get("model_bytes"), int | float):
        lines += ["", f"Model weights M = {_gib(stages['model_bytes'])} (bf16)."]
    return lines


def plan_rehearsal_headline(r: Result) -> tuple[str, str]:
    stages = {
        k: v for k, v in (r.doc.get("stages") or {}).items() if isinstance(v, dict) and "within_25pct" in v
    }
    s = r.settings
    what = (
        f"Memory plan vs measured peak per rank (`{s.get('experiment', '?')}`, {s.get('layers', '?')} layers, "
        f"{s.get('ranks', '?')} CPU ranks)"
    )
    ratios = "; ".join(
        f"{k} {', '.join(_f(x, 2) for x in v['measured_over_predicted'])}" for k, v in stages.items()
    )
    ok = sum(1 for v in stages.values() if v["within_25pct"])
    return what, f"measured / plan: {ratios} ({ok} of {len(stages)} stages within ±25%)"


# --------------------------------------------------------------------------- quality, default model
def quality_default(r: Result) -> list[str]:
    d = r.doc
    lines = [
        f"BF16 perplexity {_f(d.get('bf16_ppl'))}, RTN PTQ {_f(d.get('rtn_ppl'))}, on {d.get('eval_windows', '?')} "
        f"test windows; {d.get('train_tokens', '?')} training tokens per row.",
        "",
        "| row | QAT perplexity | recovery of RTN's loss | ± SE | train time |",
        "|---|---|---|---|---|",
    ]
    for row in d.get("rows") or []:
        lines.append(
            f"| {row.get('variant')} | {_f(row.get('qat_ppl'))} | {_f(row.get('recovery'))} | "
            f"{_f(row.get('recovery_se'))} | {_f(row.get('train_s'), 0)} s |"
        )
    t = d.get("target")
    if isinstance(t, dict):
        by = t.get("beats_plain_by")
        lines += [
            "",
            f"Target: recovery ≥ {t.get('min')}: {'met' if t.get('met') else 'not met'}"
            + ("" if by is None else f"; qatlib's recipe beats the plain scale-only QAT by {by:.3f}")
            + ".",
        ]
    return lines


def quality_default_headline(r: Result) -> tuple[str, str]:
    rows = {row.get("variant"): row for row in r.doc.get("rows") or []}
    parts = [f"{v} {_f(x.get('recovery'))} ± {_f(x.get('recovery_se'))}" for v, x in rows.items()]
    return "Quality at a fixed QAT budget (default model): recovery of RTN's loss", ", ".join(parts)


# --------------------------------------------------------------------------- format rows
def quality_formats(r: Result) -> list[str]:
    """`benchmarks.quality`'s per-format rows (RTN PTQ, QAT at the same budget and recipe)."""
    d = r.doc
    bf16 = (d.get("bf16") or {}).get("ppl")
    lines = [
        f"BF16 perplexity {_f(bf16)}; recovery = (RTN - QAT) / (RTN - BF16) of the test loss, with its "
        "paired standard error over the test windows. Each row's recovery is against its own RTN start; "
        "across rows of the same format compare the QAT perplexity.",
        "",
        "| format | bits / weight | RTN perplexity | QAT perplexity | recovery | ± SE | train time |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in d.get("formats") or []:
        lines.append(
            f"| `{row.get('format')}`: {row.get('description', '')} | {_f(row.get('bits_per_weight'), 2)} | "
            f"{_f(row.get('rtn_ppl'))} | {_f(row.get('qat_ppl'))} | {_f(row.get('recovery_vs_rtn'))} | "
            f"{_f(row.get('recovery_vs_rtn_se'))} | {_f(row.get('qat_train_s'), 0)} s |"
        )
    return lines


def quality_formats_headline(r: Result) -> tuple[str, str]:
    parts = [
        f"{row.get('format')} {_f(row.get('recovery_vs_rtn'))} ± {_f(row.get('recovery_vs_rtn_se'))}"
        for row in r.doc.get("formats") or []
    ]
    return "4-bit floats and FOCUS at a fixed QAT budget (default model): recovery of RTN's loss", ", ".join(
        parts
    )


# --------------------------------------------------------------------------- 3- and 2-bit weights
def _pm(value: Any, se: Any) -> str:
    return f"{_f(value)} ± {_f(se)}"


def quality_low_bits(r: Result) -> list[str]:
    """`benchmarks.quality_low_bits`: per format, RTN / GPTQ / end-to-end / blockwise / two-phase,
    as trained and as deployed (the export through the runtime emulator)."""
    d = r.doc
    tokens = d.get("train_tokens") or {}
    lines = [
        f"BF16 perplexity {_f(d.get('bf16_ppl'))} on {d.get('eval_windows', '?')} test windows; training tokens: "
        f"end-to-end {tokens.get('end_to_end', '?')}, two-phase {tokens.get('two_phase', '?')}. Recovery = "
        "(RTN - x) / (RTN - BF16) of the test perplexity ± its paired standard error (degenerate where RTN is "
        "orders of magnitude off: see the note), and of the test loss (log-perplexity, what the targets read); "
        "deployed: the real export as vLLM computes it, against RTN as deployed.",
    ]
    return lines + format_tables(r)


def format_tables(r: Result) -> list[str]:
    """Per format of a rows benchmark (`benchmarks.quality_low_bits.RowTable`'s rows): its note,
    one table of the rows as trained and as deployed, and the targets."""
    d = r.doc
    lines: list[str] = []
    if d.get("note"):
        lines += ["", str(d["note"])]
    for f in d.get("formats") or []:
        runtimes = "; ".join(f"{k}: {v}" for k, v in (f.get("runtimes") or {}).items())
        # the test-loss recovery beside the perplexity one where the rows record it (quality_low_bits)
        keys = ["recovery", "loss_recovery"][: 1 + any("loss_recovery" in x for x in f.get("rows") or [])]
        h, dh = (" | ".join(p + k.replace("_", " ") for k in keys) for p in ("", "deployed "))
        lines += [
            "",
            f"**`{f.get('format')}`** (RTN {_f(f.get('rtn_ppl'))}, GPTQ {_f(f.get('gptq_ppl'))}; {runtimes})",
            "",
            f"| row | perplexity | {h} | deployed perplexity | {dh} | train time |",
            "|---" * (4 + 2 * len(keys)) + "|",
        ]
        for row in f.get("rows") or []:
            dep = _f(row.get("deployed_ppl"))
            if isinstance(dv := row.get("deployed"), dict):
                dep = f"refused: {str(dv.get('refused'))[:80]}"
            rec = " | ".join(_pm(row.get(k), row.get(f"{k}_se")) for k in keys)
            dep_rec = " | ".join(_pm(row.get(f"deployed_{k}"), row.get(f"deployed_{k}_se")) for k in keys)
            lines.append(
                f"| {row.get('variant')} | {_f(row.get('ppl'))} | {rec} | {dep} | {dep_rec} | {_f(row.get('train_s'), 0)} s |"
            )
    return lines + ["", *targets(r)]


def quality_low_bits_headline(r: Result) -> tuple[str, str]:
    """Per format, the row its target reads (``settings.targets``' third field): its recovery of RTN's
    test loss as deployed, and its perplexity against GPTQ's."""
    named = {str(tg[0]): str(tg[-1]) for tg in (r.doc.get("settings") or {}).get("targets") or []}
    parts = []
    for f in r.doc.get("formats") or []:
        prefix = named.get(str(f.get("format")), "two-phase")
        row = next((x for x in f.get("rows") or [] if str(x.get("variant")).startswith(prefix)), {})
        value, se = (row.get(f"deployed_{k}", row.get(k)) for k in ("loss_recovery", "loss_recovery_se"))
        parts.append(
            f"{f.get('format')}: {prefix} {_pm(value, se)}"
            f" (GPTQ {_f(f.get('gptq_ppl'))} vs {_f(row.get('deployed_ppl', row.get('ppl')))} PPL)"
        )
    title = (
        "3- and 2-bit weights (default model): recovery of RTN's test-loss (log-perplexity) gap, as deployed"
    )
    return title, "; ".join(parts)


# --------------------------------------------------------------------------- W4A4 4-bit floats
def quality_w4a4(r: Result) -> list[str]:
    """`benchmarks.quality_w4a4`: per format, RTN and the trained rows the run measured (QAT of
    the scales, of scales and weights, two-phase), as trained and as deployed."""
    d = r.doc
    lines = [
        f"BF16 perplexity {_f(d.get('bf16_ppl'))} on {d.get('eval_windows', '?')} test windows; "
        f"{d.get('train_tokens', '?')} training tokens per QAT row. Recovery = (RTN - x) / (RTN - BF16) of the "
        "test perplexity ± its paired standard error; deployed: the real export as vLLM computes it, "
        "against RTN as deployed.",
    ]
    alpha = (d.get("settings") or {}).get("smooth_alpha")
    if alpha is not None:  # the rows start from SmoothQuant + RTN; the baseline is plain RTN
        lines += ["", f"RTN here is SmoothQuant (alpha {alpha}) + RTN; against plain RTN:", ""]
        lines += [
            "| format | variant | plain RTN | recovery of its gap, as deployed | ± SE |",
            "|---|---|---|---|---|",
        ]
        for f in d.get("formats") or []:
            for x in f.get("rows") or []:
                lines.append(
                    f"| {f.get('format')} | {x.get('variant')} | {_f(x.get('plain_rtn_ppl'))} | "
                    f"{_f(x.get('deployed_plain_rtn_recovery'))} | {_f(x.get('deployed_plain_rtn_recovery_se'))} |"
                )
        lines.append("")
    return lines + format_tables(r)


def quality_w4a4_headline(r: Result) -> tuple[str, str]:
    parts = []
    for f in r.doc.get("formats") or []:
        best = max(
            (x for x in f.get("rows") or [] if x.get("variant") != "rtn"),
            key=lambda x: x.get("deployed_recovery", x.get("recovery")) or float("-inf"),
            default={},
        )
        if "deployed_plain_rtn_recovery" in best:  # a SmoothQuant start: the gap of plain RTN
            parts.append(
                f"{f.get('format')}: SmoothQuant + {best.get('variant')} "
                f"{_pm(best['deployed_plain_rtn_recovery'], best.get('deployed_plain_rtn_recovery_se'))} of plain "
                f"RTN's gap ({_f(best.get('deployed_ppl'))} PPL, plain RTN {_f(best.get('plain_rtn_ppl'))})"
            )
            continue
        parts.append(
            f"{f.get('format')}: {best.get('variant')} "
            f"{_pm(best.get('deployed_recovery', best.get('recovery')), best.get('deployed_recovery_se', best.get('recovery_se')))}"
            f" ({_f(best.get('deployed_ppl', best.get('ppl')))} PPL, RTN {_f(f.get('rtn_ppl'))})"
        )
    return "W4A4 4-bit floats (default model): recovery of RTN's perplexity gap, as deployed", "; ".join(
        parts
    )


# --------------------------------------------------------------------------- the upcycled MoE
def moe_experiment(r: Result) -> list[str]:
    """`benchmarks.moe_experiment`: finished workflow experiments' whole DAG (the upcycled real-weight
    MoE's, per format; the two-phase NVFP4 recipe's)."""
    lines = [str(r.doc["note"]), ""] if r.doc.get("note") else []
    for e in r.doc.get("experiments") or []:
        s = e.get("settings") or {}
        up = e.get("upcycled_base_model") or {}
        ppl = e.get("ppl") or {}
        wall = e.get("stage_wall_s") or {}
        mode = s.get("training_mode") or "end2end"
        how = f"{s.get('max_steps')} steps, {s.get('deepspeed') or 'one process'}"
        if mode == "two_phase":
            bw = s.get("block_wise_config") or {}
            how = f"two_phase: blockwise on {bw.get('train_size')} windows, then {how}"
        if s.get("quant_helpers"):
            how += f"; PTQ helpers {', '.join(s['quant_helpers'])} (smooth_alpha {s.get('smooth_alpha')})"
        bp = e.get("baseline_ptq")
        base_cols = bp is not None
        base = (
            f" Base model: SmolLM2 {_f(up.get('dense_ppl'))}, upcycled {_f(up.get('initial_ppl'))} before / "
            f"{_f(up.get('upcycled_ppl'))} after router training."
            if up
            else ""
        )
        cols = [v for v in VARIANTS if v in ppl]  # a record without the served column shows none
        lines += [
            f"**`{e.get('experiment')}`**: `{s.get('format')}`, QAT on {s.get('train_samples')} x "
            f"{s.get('train_tokens_per_sample')} tokens ({how}); "
            f"{e.get('eval_windows', '?')} test windows.{base}",
            "",
            "| " + " | ".join(LABELS[v] for v in cols) + " |",
            "|" + "---|" * len(cols),
            "| " + " | ".join(_f(ppl.get(v)) for v in cols) + " |",
            "",
        ]
        if base_cols:
            lines += [f"Baseline PTQ (`{bp.get('source')}`, the same windows): {_f(bp.get('ppl'))} PPL.", ""]
        lines += [
            "| variant | recovery of the PTQ gap | ± SE |"
            + (" of the baseline PTQ's gap | ± SE |" if base_cols else ""),
            "|---|---|---|" + ("---|---|" if base_cols else ""),
        ]
        for row in e.get("rows") or []:
            extra = (
                f" {_f(row.get('baseline_recovery'))} | {_f(row.get('baseline_recovery_se'))} |"
                if base_cols
                else ""
            )
            lines.append(
                f"| {row.get('variant')} | {_f(row.get('recovery'))} | {_f(row.get('recovery_se'))} |" + extra
            )
        for row in e.get("rows") or []:
            if row.get("not_applied"):  # the export row without it is read as the runtime's number
                lines += ["", not_applied_sentence(str(row.get("variant")), row["not_applied"])]
        lines += [
            "",
            "Stage wall times: "
            + ", ".join(f"{k} {_f(v, 0)} s" for k, v in wall.items() if v is not None)
            + ".",
            "",
        ]
    return lines + targets(r)


def moe_experiment_headline(
    r: Result, what: str = "Upcycled real-weight MoE, whole DAG (2-rank ZeRO-3 QAT)", label: str = "format"
):
    """``label``: each experiment named by its format (``"format"``) or its training mode."""
    parts = []
    for e in r.doc.get("experiments") or []:
        dep = next((x for x in e.get("rows") or [] if x.get("variant") == "deployed"), {})
        ppl = e.get("ppl") or {}
        name = (e.get("settings") or {}).get(label) or "end2end"
        bp = e.get("baseline_ptq")
        of_base = (
            f"; of the baseline PTQ's {_f(bp.get('ppl'))}: {_pm(dep.get('baseline_recovery'), dep.get('baseline_recovery_se'))}"
            if bp
            else ""
        )
        parts.append(
            f"{name}: BF16 {_f(ppl.get('bf16'))}, PTQ {_f(ppl.get('ptq'))}, "
            f"deployed {_f(ppl.get('deployed'))} (recovery {_pm(dep.get('recovery'), dep.get('recovery_se'))}{of_base})"
        )
    return what, "; ".join(parts)


def nvfp4_two_phase_headline(r: Result) -> tuple[str, str]:
    return moe_experiment_headline(r, "NVFP4 W4A4 recipes, whole DAG (default model)", label="training_mode")


# --------------------------------------------------------------------------- any other benchmark
def targets(r: Result) -> list[str]:
    ts = r.doc.get("targets") or []
    if r.doc.get("error"):
        return [f"The benchmark failed: `{str(r.doc['error'])[:200]}`."]
    if not ts:
        return ["No targets recorded: see the JSON."]
    lines = ["| target | value | met |", "|---|---|---|"]
    for t in ts:
        met = {True: "met", False: "not met", None: "not measurable"}[t.get("met")]
        v = t.get("value")
        lines.append(f"| {t.get('target')} | {_f(v) if isinstance(v, float) else v} | {met} |")
    return lines


def targets_headline(r: Result) -> tuple[str, str]:
    ts = r.doc.get("targets") or []
    met = sum(1 for t in ts if t.get("met") is True)
    return f"Benchmark `{r.name}`", f"{met} of {len(ts)} targets met" if ts else "no targets recorded"
