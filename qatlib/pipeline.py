"""The PTQ, export and serve_evaluate stages as functions of an experiment config: what
``scripts/ptq.py``, ``scripts/export.py`` and ``scripts/serve_evaluate.py`` run, callable from
Python with the same defaults (`run_ptq`, `run_export`, `run_serve_evaluate`: the export in vLLM's
own engine, `qatlib.serve`, on the evaluate stage's windows).

Why here and not in the scripts: a user who calls the library instead of the CLI must get the
path the memory plan sizes, not the whole-model one. PTQ and export stream one decoder layer at a
time wherever `qatlib.plan.streamed` (the one owner of that choice) says the streamed path
writes the same bytes; ``whole_model=True`` opts out. Each returns a record of what ran (the
scripts add it to ``timings/<stage>.json``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from . import device
from .plan import not_streamed, streamed

log = logging.getLogger(__name__)


class StageInputError(ValueError):
    """The experiment lacks what the stage needs (the message names the key)."""


def _calibration_batches(cfg, tok, progress: bool) -> Iterable:
    """The PTQ's calibration batches (``dataset`` / ``compression.QAT.hf_dataset``)."""
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm

    from .data import PadCollator, load_training_data

    ds = cfg.dataset
    source = cfg.qat.hf_dataset or (ds.data_path if ds else None)
    if not source:
        raise StageInputError(
            f"{cfg.source}: {cfg.quant_scheme().name} ({cfg.ptq_algorithm}) needs calibration data "
            "(dataset.data_path or compression.QAT.hf_dataset)"
        )
    seq, n = (ds.max_seq_length, ds.num_samples) if ds else (2048, 128)
    data = load_training_data(source, tok, seq, n, hf_cache_dir=cfg.qat.hf_cache_dir)
    loader = DataLoader(
        data, batch_size=ds.batch_size if ds else 1, collate_fn=PadCollator.for_tokenizer(tok)
    )
    return tqdm(loader, desc="PTQ calibration", disable=not progress, mininterval=2.0)


LOW_MEMORY = "compression.quantization.low_memory"


def _low_memory_check(cfg, whole_model: bool) -> bool:
    """Upstream's ``low_memory: true`` asks for layer-by-layer calibration: qatlib's default
    wherever `qatlib.plan.streamed` says so. Where it is not, the stage refuses before any work,
    naming why (`qatlib.plan.not_streamed`). Returns whether the key is set."""
    if not cfg.quantization.low_memory:
        return False
    why = not_streamed(cfg.raw, "ptq_calibrate")
    if why is None and whole_model:
        why = "--whole-model asks for the whole model"
    if why is not None:
        raise StageInputError(
            f"{cfg.source}: {LOW_MEMORY}: layer-by-layer calibration is not possible here: {why}; "
            "remove low_memory to load the model whole (placed by model.device_map)"
        )
    return True


def run_ptq(
    cfg, *, whole_model: bool = False, overwrite: bool = False, progress: bool = True
) -> dict[str, Any]:
    """PTQ of ``cfg``'s model into ``global.save_path`` (the checkpoint QAT warm-starts from).

    Weight scales come from the weights (round-to-nearest), or from GPTQ for upstream's
    ``int4_gptq`` (the rounded weights are saved with the scales); static activation scales are
    calibrated on the experiment's data. ``quant_helpers: [smooth]`` smooths the loaded model first
    (`qatlib.quant.smoothing`) and saves its weights likewise. Streamed (the model never loaded)
    unless ``whole_model`` or `qatlib.plan.streamed` says otherwise (GPTQ, smoothing, a static
    input scale on the head)."""
    from .checkpoint.layout import CheckpointError
    from .models import load_model, load_tokenizer, resolve_model_dir
    from .ptq import calibrate, calibrate_from_checkpoint, save_ptq_checkpoint

    scheme, m = cfg.quant_scheme(), cfg.model
    low_memory = _low_memory_check(cfg, whole_model)
    model_dir = resolve_model_dir(m.model_path, cache_dir=m.cache_dir)
    gptq = cfg.ptq_algorithm == "gptq"
    layerwise = streamed(cfg.raw, "ptq_calibrate") and not whole_model
    common = dict(torch_dtype=m.torch_dtype, trust_remote_code=m.trust_remote_code)
    common["attn_implementation"] = m.attn_implementation
    device_map = device.device_map(m.device_map)
    model = None if layerwise else load_model(model_dir, device_map=device_map, **common)
    tok = load_tokenizer(model_dir, trust_remote_code=m.trust_remote_code)
    # weight scales come from the weights: only static activation scales (and GPTQ) read data; an
    # NVFP4 input's group scales are dynamic, its global scale static (`calibration.static_quantizers`)
    static_act = [
        r
        for r in ("input", "q", "k", "v")
        if (sp := getattr(scheme, r)) is not None and (not sp.dynamic or sp.has_global_scale)
    ]
    alpha = cfg.smooth_alpha  # SmoothQuant first (upstream's quant_helpers: [smooth]): it changes the weights
    needs_data = bool(static_act or gptq or alpha is not None)
    batches = _calibration_batches(cfg, tok, progress) if needs_data else []
    if not needs_data:
        log.info("%s: no static activation scale, weight scales need no calibration data", scheme.name)
    kw = dict(ignore=cfg.ignore_layers, options=cfg.prepare_options())
    scales = None
    if gptq:
        from .ptq.gptq import gptq as run_gptq

        # latent: the saved weights are the ones GPTQ rounded (the same PTQ model; QAT's start)
        report = run_gptq(model, scheme, batches, latent=True, **kw)
    elif layerwise:  # the model is never loaded: its layers are streamed from the shards
        try:
            model, report, scales = calibrate_from_checkpoint(
                model_dir, scheme, batches, device=device.current(), **kw, **common
            )
        except CheckpointError as e:
            # The streamed reader maps the shards' keys one to one onto the model's names; a
            # checkpoint whose keys transformers renames while loading (its conversion mapping,
            # e.g. HunYuan v3's router / shared_mlp) is read whole, as whole_model would.
            if low_memory:
                raise StageInputError(
                    f"{cfg.source}: {LOW_MEMORY}: the streamed calibration cannot read {model_dir} "
                    f"({str(e).splitlines()[0]}); remove low_memory to load the model whole"
                ) from None
            log.warning("%s: not streamed (%s); loading the whole model", model_dir, str(e).splitlines()[0])
            layerwise = False
            model = load_model(model_dir, device_map=device_map, **common)
    smoothed = None
    if alpha is not None:  # never streamed (`qatlib.plan.model.not_streamed`): the model is loaded
        from .quant.smoothing import smooth_model

        smoothed = smooth_model(model, batches, alpha)
        log.info("smoothed %d norms and their readers (smooth_alpha %s)", smoothed, alpha)
    if not gptq and not layerwise:
        report = calibrate(model, scheme, batches, **kw)
    save = cfg.global_.save_path
    save_ptq_checkpoint(
        model,
        scheme,
        save,
        calibration=report
        if smoothed is None
        else {**report.to_dict(), "smooth_alpha": alpha, "smoothed": smoothed},
        save_weights=cfg.ptq_saves_weights,  # the weights QAT must start from
        tokenizer=tok,
        overwrite=overwrite,
        scales=scales,
    )
    return dict(
        scheme=scheme.name,
        batches=report.num_batches,
        tokens=report.num_tokens,
        streamed=layerwise,
        smoothed=smoothed,
    )


def run_export(
    cfg,
    qat_dir: str | Path,
    *,
    save_format: str | None = None,
    whole_model: bool = False,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Export the QAT checkpoint ``qat_dir`` (an HF model folder with its trained scales) as
    ``save_format`` (default ``compression.QAT.save_format``, else ``real``: compressed-tensors)
    into ``global.save_path``. Streamed (one decoder layer and one output tensor in memory, the
    same tensors as the in-memory export) unless ``whole_model``."""
    from .export import export
    from .models import load_prepared, load_tokenizer
    from .zero3.onload import Onloader

    scheme = cfg.quant_scheme()
    save_format = save_format or cfg.qat.save_format or "real"
    layerwise = streamed(cfg.raw, "convert_export") and not whole_model
    model, loaded = load_prepared(cfg, qat_dir, scales=qat_dir, complete=True, skeleton=layerwise)
    onload = Onloader.from_checkpoint(model, qat_dir) if layerwise else None
    tok = load_tokenizer(qat_dir, trust_remote_code=cfg.model.trust_remote_code)
    out = export(
        model,
        scheme,
        cfg.global_.save_path,
        save_format,
        tokenizer=tok,
        overwrite=overwrite,
        ignore=cfg.quantization.ignore_layers,
        onload=onload,
    )
    return dict(
        save_format=save_format,
        scheme=scheme.name,
        scales_loaded=loaded.get("hits"),
        streamed=layerwise,
        out=str(out),
    )


# --------------------------------------------------------------------------- serve_evaluate
SERVE_OFF_ENV = "QATLIB_NO_SERVE"  # =1: no engine is launched (install.sh skips the environment too)
SERVE_DISABLED = "serving disabled (--config serve=false)"
SERVE_FATAL = ("no_env", "bad_export")  # the stage fails on these; any other kind is a skipped record
SERVE_FIX = {
    "no_env": "run bash install.sh, or --config serve=false",
    "bad_export": "re-make the export (snakemake --forcerun convert_export), or --config serve=false",
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
    from .eval.perplexity import load_eval_text, make_windows, ppl_label, tokenize_text
    from .models import load_tokenizer

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
    from .scores import window_perplexity

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

    A refusal of the format (`qatlib.serve.KINDS` but `SERVE_FATAL`) is a record
    ``{"variant": "served", "skipped": <one line>, "kind": ...}``, as is `serve_disabled`; a
    missing or broken serving environment or export raises `qatlib.serve.ServeError`."""
    from .config.deploy import local_model_dtype
    from .serve import ServeError, serve_perplexity

    record: dict[str, Any] = {"variant": "served", "model_path": str(export_dir)}
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
    return record
