"""The model each evaluation variant evaluates (`scripts/evaluate.py`):

- ``bf16``: the model as it is; ``ptq`` / ``qat``: prepared with the experiment's scheme and the
  scales loaded (fake quantization in memory); ``export``: the export reloaded by transformers +
  compressed-tensors;
- ``deployed``: the export as the experiment's ``deploy.target`` computes it.

For ``deployed``, `qatlib.runtime.emulate` rebuilds the model the runtime serves from the export folder; this module
is the evaluation's side of it: which model to evaluate and what to record beside its scores (the
runtime, every load-time transformation applied, what the emulator leaves out). Under
``deploy.target: none`` there is no runtime to emulate: the result is a ``skipped`` record with
the reason, which the report shows instead of a column. The ``export`` record names the checkpoint
tensors transformers' reload left unused (`qatlib.scores.not_applied`: an FP8 MoE's expert input scales).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..scores import not_applied


def skipped_reason(target: str) -> str | None:
    """Why the deployed variant is not evaluated (None: it is)."""
    if target == "none":
        return "deploy.target is none: no runtime to emulate (set deploy.target: vllm or sglang)"
    return None


def export_skipped_reason(export_dir: str | Path) -> str | None:
    """Why the ``export`` variant (a transformers reload) is not evaluated (None: it is): the
    runtimes' own fp8 format (upstream's ``save_name: fp8``), which transformers 5.24 reads as its
    block-wise FineGrainedFP8 (``weight_scale_inv``), not as the per-tensor layout it is."""
    import json

    from ..quant.spec import CheckpointFormat

    try:
        qc = json.loads((Path(export_dir) / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError):
        return None
    if qc.get("quant_method") == CheckpointFormat.FP8.value:
        return (
            "quant_method fp8 (vLLM's / SGLang's Fp8Config, upstream's save_name: fp8): transformers reads it as "
            "its block-wise FineGrainedFP8 and cannot reload it; the deployed variant evaluates the export"
        )
    return None


FP4_EXPORT_BF16 = (
    "compressed-tensors runs an FP4 export compressed and unpacks its E2M1 weights to bfloat16 "
    "(unpack_fp4_from_uint8's default dtype) whatever the model's dtype: an fp32 model would meet "
    "bf16 weights in every linear, so the FP4 export is evaluated in bfloat16, as a runtime serves it"
)


def export_dtype(export_dir: str | Path) -> torch.dtype | None:
    """The dtype the ``export`` variant loads in: bfloat16 for an NVFP4 / MXFP4 export
    (`FP4_EXPORT_BF16`), else None (the checkpoint's own)."""
    import json

    try:
        qc = json.loads((Path(export_dir) / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError):
        return None
    formats = {qc.get("format")} | {g.get("format") for g in (qc.get("config_groups") or {}).values()}
    return torch.bfloat16 if formats & {"nvfp4-pack-quantized", "mxfp4-pack-quantized"} else None


def load_variant(cfg, variant: str, model_path: str, scales: str | None) -> tuple[nn.Module, dict[str, Any]]:
    """``(model, record)`` of ``variant`` from ``model_path`` (the export folder for ``export`` /
    ``deployed``); ``record``: what goes into the result JSON beside the scores. ``deployed`` that
    cannot be evaluated: ``(None, {"skipped": reason, ...})`` (``deploy.target: none``, or a
    runtime refusal only the exported model shows, such as the W4A8 kernel's shape limits: the
    parse-time check already stopped every format the target cannot load at all); ``export`` of a
    checkpoint transformers cannot reload likewise (`export_skipped_reason`)."""
    from .. import device
    from ..checkpoint.layout import weight_files
    from ..models import load_model, load_prepared
    from ..zero3.onload import load_skeleton, load_whole

    m, device_map = cfg.model, device.device_map()
    if variant == "deployed":
        from ..runtime.emulate import RuntimeRefusal

        target = cfg.deploy.target
        why = skipped_reason(target)
        if why:
            return None, {"skipped": why, "target": target}
        try:
            model, record = load_deployed(model_path, target, getattr(cfg.deploy, "capability", None))
        except RuntimeRefusal as e:
            return None, {"skipped": str(e), "target": target}
        return model.to(device.current()), record
    if variant == "export":  # compressed-tensors decompresses and quantizes activations itself
        from transformers import AutoModelForCausalLM

        why = export_skipped_reason(model_path)
        if why:
            return None, {"skipped": why}

        kw = dict(trust_remote_code=m.trust_remote_code, device_map=device_map)
        dtype = export_dtype(model_path)
        if dtype is not None:  # eager attention: torch's CPU SDPA has no bf16 kernel without AVX512-BF16
            kw.update(dtype=dtype, attn_implementation="eager")
        record = {} if dtype is None else {"dtype": str(dtype).removeprefix("torch."), "why": FP4_EXPORT_BF16}
        model, info = AutoModelForCausalLM.from_pretrained(model_path, output_loading_info=True, **kw)
        unused = not_applied(info.get("unexpected_keys") or ())
        if unused:
            record["not_applied"] = unused
        return model.eval(), record
    # the model fits one device (always on the CPU path): qatlib's reader, the model once in memory
    # (`qatlib.zero3.onload.load_whole`, no mapped file); else accelerate spreads it over the GPUs and the
    # host (`from_pretrained` with a device_map)
    nbytes = sum(f.stat().st_size for f in weight_files(model_path))
    whole = device_map is None or device.fits_current(nbytes)
    if scales:
        kw = dict(read_onto=device.current()) if whole else dict(device_map=device_map)
        model = load_prepared(cfg, model_path, scales=scales, complete=True, **kw)[0]
        return model.eval(), {"weights_fake_quantized_once": bake_weight_fake_quant(model)}
    kw = dict(trust_remote_code=m.trust_remote_code, attn_implementation=m.attn_implementation)
    if whole:
        return load_whole(
            load_skeleton(model_path, torch_dtype=m.torch_dtype, **kw), model_path, device.current()
        ), {}
    return load_model(model_path, torch_dtype=m.torch_dtype, device_map=device_map, **kw), {}


@torch.no_grad()
def bake_weight_fake_quant(model: nn.Module) -> int:
    """Evaluation only: store each enabled static weight quantizer's fake-quantized weight in place
    of the weight and switch that quantizer off; returns how many. Why: a prepared model
    fake-quantizes every weight again at every forward (it is built for training, where the
    scales move); an evaluation runs ~10 forwards with frozen scales, and re-quantizing the
    ~106M SmolLM2 weights each time was most of a ptq / qat evaluation's extra cost over bf16.
    The values are the same: the fused training forward (`qatlib.quant.fq_linear`) and
    `QuantLinear.fake_quant_weight` both compute `qatlib.quant.fake_quantize` bit for bit, and the
    linear then runs on that weight either way. Input / output quantizers stay as they are. The
    model keeps no original weight afterwards: never export or train it."""
    from ..quant import quant_linears

    n = 0
    for _, ql in quant_linears(model):
        wq = ql.weight_quantizer
        if wq is None or not wq.enabled or wq.calibrating:
            continue
        ql.weight.data = ql.fake_quant_weight().detach().to(ql.weight.dtype)
        wq.enabled = False
        n += 1
    return n


def load_deployed(
    export_dir: str | Path, target: str, capability: str | None = None
) -> tuple[nn.Module, dict[str, Any]]:
    """``(model, record)``: the emulated runtime model of ``export_dir`` and the facts for the
    result JSON. Raises `qatlib.runtime.emulate.RuntimeRefusal` where the runtime refuses it."""
    from ..runtime.emulate import emulate_export
    from ..runtime.facts import TARGETS

    dep = emulate_export(export_dir, target, capability=capability)
    record = {
        "runtime": str(TARGETS[target]),
        "layout": dep.layout.value,
        "applied": dep.applied,
        "not_emulated": dep.not_emulated,
    }
    return dep.model, record
