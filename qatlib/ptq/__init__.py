"""Post-training quantization (round-to-nearest): calibrate a model's quantizers and save the PTQ
checkpoint.

`calibrate` prepares the model (if needed), sets every static weight scale from the weight
(absmax / min-max per tensor, channel or group, docs/design.md) and every static activation scale
(linear inputs, k/v projection outputs) from the ranges seen on calibration batches
(`qatlib.quant.calibration`). Dynamic quantizers need nothing. `save_ptq_checkpoint` writes the
directory QAT warm-starts from: ``quant_scheme.json`` + ``scales.safetensors`` with the keys of
`qatlib.checkpoint.keys`; a GPTQ run (`qatlib.ptq.gptq`) also writes its updated weights as a
loadable HF checkpoint beside them.

`calibrate_layerwise` is the same calibration one decoder layer at a time (`qatlib.zero3.onload`): the
layer's weights onloaded, its inputs carried from the previous layer, its scales taken, the layer
offloaded; `calibrate_from_checkpoint` runs it on a checkpoint folder without ever holding the
model (PTQ of a model larger than the device, or than host RAM). Same scales, bit for bit.

The package is the PTQ wing: this module (round-to-nearest calibration, the verb the PTQ stage
runs) and `qatlib.ptq.gptq` (GPTQ, the error-compensating baseline), which imports nothing of it.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from .. import __version__
from ..checkpoint.keys import scale_state_dict
from ..checkpoint.layout import SCALES_FILE, SCHEME_FILE, WEIGHTS_FILE, AtomicDir, write_json
from ..checkpoint.saved_keys import expert_names
from ..checkpoint.st_write import save_tensors
from ..quant import QuantScheme, QuantSpec, quant_linears
from ..quant.calibration import (
    CalibrationReport,
    calibrate_activations,
    prepare_for_calibration,
    static_quantizers,
)
from ..quant.linear import PrepareOptions, weight_readable
from ..quant.quantizer import Quantizer
from ..quant.tying import retie_weights

log = logging.getLogger(__name__)


def calibrate(
    model: nn.Module,
    scheme: QuantScheme,
    batches: Iterable[Any],
    *,
    ignore: Sequence[str] = ("lm_head",),
    kv: str | QuantSpec | None = None,
    options: PrepareOptions | None = None,
    quantize_weights_during_calibration: bool = True,
) -> CalibrationReport:
    """Round-to-nearest PTQ: set every static scale of ``model`` for ``scheme``, in place.

    ``model`` is prepared with ``scheme`` (and ``ignore``) unless it already holds `QuantLinear`
    layers of that scheme. ``kv`` adds static k/v-cache quantizers (``"per-tensor"``,
    ``"per-head"`` or a `QuantSpec`) to the scheme. ``batches`` yields input-id tensors or dicts of
    model inputs; activation ranges are observed with the weights already fake-quantized (what the
    deployed model computes) unless ``quantize_weights_during_calibration`` is False. Experts that
    get no token take their sibling experts' range (logged and recorded in the report).
    """
    scheme = prepare_for_calibration(model, scheme, ignore=ignore, kv=kv, options=options)
    report = CalibrationReport(scheme=scheme)
    for name, ql in quant_linears(model):
        wq = ql.weight_quantizer
        if wq is not None:
            if not weight_readable(ql.weight):
                raise ValueError(f"calibrate: weight of {name} is not readable (ZeRO-3 shard or meta)")
            wq.init_from(ql.weight)
            report.weight_quantizers += 1
    retie_weights(model)  # tied weight scales (deploy.target): the max over their members, not the last
    calibrate_activations(model, batches, quantize_weights=quantize_weights_during_calibration, report=report)
    log.info(
        "calibrated %d weight and %d static activation quantizers on %d batches (%d tokens)",
        report.weight_quantizers,
        report.static_activation_quantizers,
        report.num_batches,
        report.num_tokens,
    )
    return report


# --------------------------------------------------------------------------- layer by layer
def _init_weight_scales(name: str, ql, report: CalibrationReport) -> None:
    wq = ql.weight_quantizer
    if wq is not None:
        if not weight_readable(ql.weight):
            raise ValueError(f"calibrate: weight of {name} is not readable (ZeRO-3 shard or meta)")
        wq.init_from(ql.weight)
        report.weight_quantizers += 1


def calibrate_layerwise(
    model: nn.Module,
    scheme: QuantScheme,
    batches: Iterable[Any],
    loader,
    *,
    ignore: Sequence[str] = ("lm_head",),
    kv: str | QuantSpec | None = None,
    options: PrepareOptions | None = None,
    quantize_weights_during_calibration: bool = True,
) -> tuple[CalibrationReport, dict[str, torch.Tensor]]:
    """`calibrate`, one decoder layer on ``loader``'s device at a time; returns the report and the
    scale tensors (`scale_state_dict`, taken while each layer is onloaded: an LWC scale needs its
    weight). ``loader``: a `qatlib.zero3.onload.Onloader` over ``model`` (a skeleton from
    `qatlib.zero3.onload.load_skeleton`, or a model in host memory).

    Gives the scales of `calibrate` bit for bit: each layer computes on exactly the inputs the
    whole-model forward gives it (`qatlib.zero3.onload.capture_layer_inputs`). With no static activation
    quantizer nothing runs forward and no batch is read. A static activation quantizer outside the
    decoder layers (an unignored ``lm_head`` with static inputs) is refused: the head is never run.
    """
    from ..surgery.modeling import decoder_layers
    from ..zero3.onload import capture_layer_inputs, carry, layer_prefix, realize_quantizers

    scheme = prepare_for_calibration(model, scheme, ignore=ignore, kv=kv, options=options)
    realize_quantizers(model, options)
    loader.refresh()
    report = CalibrationReport(scheme=scheme)
    _, layers = decoder_layers(model)
    inside = {id(m) for layer in layers for m in layer.modules()}
    outer = [(n, ql) for n, ql in quant_linears(model) if id(ql) not in inside]
    bad = [f"{n}.{r.lstrip('.')}" for n, ql in outer for r, _ in static_quantizers(ql)]
    if bad:
        raise ValueError(
            f"layer-by-layer calibration runs the decoder layers only; static activation quantizers outside them: "
            f"{', '.join(bad[:5])} (ignore those layers or calibrate the whole model)"
        )
    scales: dict[str, torch.Tensor] = {}
    inputs = None
    if static_quantizers(model):
        with loader.outer_onloaded():
            inputs, report.num_batches, report.num_tokens = capture_layer_inputs(
                model, batches, loader.device
            )
        if not inputs:
            raise ValueError("calibrate: no calibration batch, but the scheme has static activation scales")
    was_training = model.training
    model.eval()
    for li, layer in enumerate(layers):
        prefix = layer_prefix(model, li)
        with loader.onloaded(layer):
            qls = [(prefix + n, ql) for n, ql in quant_linears(layer)]
            for name, ql in qls:
                _init_weight_scales(name, ql, report)
            retie_weights(layer)  # as `calibrate`: a tied weight scale is its members' max, not the last's
            if inputs is not None:
                outputs: list = []
                seen = calibrate_activations(
                    layer,
                    inputs,
                    forward=functools.partial(carry, outputs),
                    quantize_weights=quantize_weights_during_calibration,
                    prefix=prefix,
                )
                report.static_activation_quantizers += seen.static_activation_quantizers
                report.fallbacks.update(seen.fallbacks)
                if not outputs:  # this layer has nothing to calibrate: it still feeds the next one
                    with torch.no_grad():
                        for batch in inputs:
                            carry(outputs, layer, batch)
                inputs = outputs
            scales.update(scale_state_dict(model, linears=qls))
        log.debug("calibrated layer %d/%d", li + 1, len(layers))
    for name, ql in outer:
        with loader.onloaded(ql):
            _init_weight_scales(name, ql, report)
            scales.update(scale_state_dict(model, linears=[(name, ql)]))
    model.train(was_training)
    if report.fallbacks:
        log.warning("calibration: %d quantizer(s) fell back (see report.fallbacks)", len(report.fallbacks))
    return report, scales


def calibrate_from_checkpoint(
    path: str | os.PathLike,
    scheme: QuantScheme,
    batches: Iterable[Any],
    *,
    device: torch.device | str = "cpu",
    torch_dtype: str | torch.dtype | None = "auto",
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    **kwargs: Any,
) -> tuple[nn.Module, CalibrationReport, dict[str, torch.Tensor]]:
    """`calibrate_layerwise` on the checkpoint folder ``path``, streamed: ``(skeleton model,
    report, scales)``; pass both to `save_ptq_checkpoint` (``scales=``). Host memory holds one
    decoder layer, the embeddings and the carried activations; never the model."""
    from ..zero3.onload import Onloader, load_skeleton

    model = load_skeleton(
        path,
        torch_dtype=torch_dtype,
        trust_remote_code=trust_remote_code,
        attn_implementation=attn_implementation,
    )
    loader = Onloader.from_checkpoint(model, path, device)
    report, scales = calibrate_layerwise(model, scheme, batches, loader, **kwargs)
    return model, report, scales


# --------------------------------------------------------------------------- checkpoint
def weights_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's own tensors under HF checkpoint names (no quantizer parameters), for GPTQ
    checkpoints; MoE experts appear per expert (``mlp.experts.{e}.gate_proj.weight``)."""
    quantizer_prefixes = tuple(f"{n}." for n, m in model.named_modules() if isinstance(m, Quantizer))
    return {
        k: v.detach().cpu().contiguous()
        for k, v in model.state_dict().items()
        if not k.startswith(quantizer_prefixes)
    }


def save_ptq_checkpoint(
    model: nn.Module,
    scheme: QuantScheme,
    out_dir: str | os.PathLike,
    *,
    calibration: CalibrationReport | Mapping[str, Any] | None = None,
    save_weights: bool = False,
    tokenizer: Any = None,
    overwrite: bool = False,
    scales: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Write the PTQ checkpoint of docs/design.md to ``out_dir`` (atomically).

    ``quant_scheme.json`` holds ``scheme.to_dict()`` plus ``qatlib_version``, ``calibration``
    and ``weights`` (null, or the file holding the model's updated weights). ``save_weights``
    (GPTQ, which changes the weights) also writes the model with ``save_pretrained`` so the
    directory is a loadable HF checkpoint whose weights QAT must start from. ``scales``: the
    scale tensors when the model no longer holds its weights (`calibrate_layerwise`).
    """
    if not any(True for _ in quant_linears(model)):
        raise ValueError(
            "save_ptq_checkpoint: the model has no QuantLinear layers (calibrate or prepare it first)"
        )
    target = AtomicDir(out_dir, overwrite=overwrite)
    target.check()
    if save_weights and scales is not None:
        raise ValueError(
            "save_ptq_checkpoint: save_weights needs the model's weights, not precomputed scales"
        )
    scales = scale_state_dict(model) if scales is None else dict(scales)
    calib = calibration.to_dict() if isinstance(calibration, CalibrationReport) else dict(calibration or {})
    meta = scheme.to_dict()
    meta.update(
        qatlib_version=__version__,
        calibration=calib,
        weights=WEIGHTS_FILE if save_weights else None,
    )
    with target as tmp:
        save_tensors(scales, tmp / SCALES_FILE, metadata={"format": "pt", "qatlib": "ptq-scales"})
        if save_weights:
            if not hasattr(model, "save_pretrained"):
                save_file(weights_state_dict(model), str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
            else:
                name_of = expert_names(model)  # linearised experts under the hub's keys (from_pretrained's)
                model.save_pretrained(
                    str(tmp), state_dict={name_of(k): v for k, v in weights_state_dict(model).items()}
                )
                if tokenizer is not None:
                    tokenizer.save_pretrained(str(tmp))
        write_json(tmp / SCHEME_FILE, meta, sort_keys=True)
    log.info(
        "saved PTQ checkpoint (%d scale tensors%s) to %s",
        len(scales),
        ", weights" if save_weights else "",
        out_dir,
    )
    return Path(out_dir)
