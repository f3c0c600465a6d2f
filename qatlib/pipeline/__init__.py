"""The PTQ and export stages as functions of an experiment config: what ``scripts/ptq.py`` and
``scripts/export.py`` run, callable from Python with the same defaults (`run_ptq`, `run_export`);
`qatlib.pipeline.serve` is the serve_evaluate stage (the export in vLLM's own engine), a module of
its own so that the code of PTQ and export, which every later stage depends on, is not this one.

Why here and not in the scripts: a user who calls the library instead of the CLI must get the
path the memory plan sizes, not the whole-model one. PTQ and export stream one decoder layer at a
time wherever `qatlib.plan.streamed` (the one owner of that choice) says the streamed path
writes the same bytes; ``whole_model=True`` opts out. Each returns a record of what ran (the
scripts add it to ``timings/<stage>.json``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .. import device
from ..plan import not_streamed, streamed

log = logging.getLogger(__name__)


class StageInputError(ValueError):
    """The experiment lacks what the stage needs (the message names the key)."""


def _calibration_batches(cfg, tok, progress: bool) -> Iterable:
    """The PTQ's calibration batches (``dataset`` / ``compression.QAT.hf_dataset``)."""
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm

    from ..data import PadCollator, load_training_data

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
    from ..checkpoint.layout import CheckpointError
    from ..models import load_model, load_tokenizer, resolve_model_dir
    from ..ptq import calibrate, calibrate_from_checkpoint, save_ptq_checkpoint

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
        from ..ptq.gptq import gptq as run_gptq

        # latent: the saved weights are the ones GPTQ rounded (the same PTQ model; QAT's start)
        report = run_gptq(model, scheme, batches, latent=True, **kw)
    elif layerwise:  # the model is never loaded: its layers are streamed from the shards
        try:
            model, report, scales = calibrate_from_checkpoint(
                model_dir, scheme, batches, device=device.current(), **kw, **common
            )
        except CheckpointError as e:
            # The streamed reader places keys by transformers' conversion mapping, slice by slice
            # (`qatlib.checkpoint.conversion`); a converter with no slice reading (Interleave,
            # PermuteForRope, custom ops) is refused there and the checkpoint is read whole.
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
        from ..quant.smoothing import smooth_model

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
    scales: str | Path | None = None,
    save_format: str | None = None,
    whole_model: bool = False,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Export the QAT checkpoint ``qat_dir`` (an HF model folder with its trained scales) as
    ``save_format`` (default ``compression.QAT.save_format``, else ``real``: compressed-tensors)
    into ``global.save_path``. Streamed (one decoder layer and one output tensor in memory, the
    same tensors as the in-memory export) unless ``whole_model``.

    ``scales``: a checkpoint whose scales to deploy instead of ``qat_dir``'s own, e.g. the PTQ
    checkpoint on the base model (the workflow's ``export_ptq``: PTQ served by the engine beside QAT,
    so that QAT's gain is measured as served); a checkpoint carrying its own weights (GPTQ) is then
    the model too (`qatlib.models.load_prepared`)."""
    from ..checkpoint.layout import weights_dir
    from ..export import export
    from ..models import load_prepared, load_tokenizer
    from ..zero3.onload import Onloader

    scheme = cfg.quant_scheme()
    save_format = save_format or cfg.qat.save_format or "real"
    layerwise = streamed(cfg.raw, "convert_export") and not whole_model
    scales = scales or qat_dir
    weights = weights_dir(scales) or qat_dir
    model, loaded = load_prepared(cfg, qat_dir, scales=scales, complete=True, skeleton=layerwise)
    onload = Onloader.from_checkpoint(model, weights) if layerwise else None
    tok = load_tokenizer(weights, trust_remote_code=cfg.model.trust_remote_code)
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
