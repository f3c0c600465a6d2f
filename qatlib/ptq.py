"""Post-training quantization (round-to-nearest): calibrate a model's quantizers and save the PTQ
checkpoint.

`calibrate` prepares the model (if needed), sets every static weight scale from the weight
(absmax / min-max per tensor, channel or group, docs/design.md) and every static activation scale
(linear inputs, k/v projection outputs) from the ranges seen on calibration batches
(`qatlib.quant.calibration`). Dynamic quantizers need nothing. `save_ptq_checkpoint` writes the
directory QAT warm-starts from: ``quant_scheme.json`` + ``scales.safetensors`` with the keys of
`qatlib.checkpoint.keys`; a GPTQ run (`qatlib.gptq`) also writes its updated weights as a
loadable HF checkpoint beside them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from . import __version__
from .checkpoint.keys import scale_state_dict
from .checkpoint.layout import SCALES_FILE, SCHEME_FILE, WEIGHTS_FILE, AtomicDir, write_json
from .quant import QuantScheme, QuantSpec, quant_linears
from .quant.calibration import CalibrationReport, calibrate_activations, prepare_for_calibration
from .quant.linear import PrepareOptions, weight_readable
from .quant.quantizer import Quantizer
from .quant.tying import retie_weights

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
) -> Path:
    """Write the PTQ checkpoint of docs/design.md to ``out_dir`` (atomically).

    ``quant_scheme.json`` holds ``scheme.to_dict()`` plus ``qatlib_version``, ``calibration``
    and ``weights`` (null, or the file holding the model's updated weights). ``save_weights``
    (GPTQ, which changes the weights) also writes the model with ``save_pretrained`` so the
    directory is a loadable HF checkpoint whose weights QAT must start from.
    """
    if not any(True for _ in quant_linears(model)):
        raise ValueError(
            "save_ptq_checkpoint: the model has no QuantLinear layers (calibrate or prepare it first)"
        )
    target = AtomicDir(out_dir, overwrite=overwrite)
    target.check()
    scales = scale_state_dict(model)
    calib = calibration.to_dict() if isinstance(calibration, CalibrationReport) else dict(calibration or {})
    meta = scheme.to_dict()
    meta.update(
        qatlib_version=__version__,
        calibration=calib,
        weights=WEIGHTS_FILE if save_weights else None,
    )
    with target as tmp:
        save_file(scales, str(tmp / SCALES_FILE), metadata={"format": "pt", "qatlib": "ptq-scales"})
        if save_weights:
            if not hasattr(model, "save_pretrained"):
                save_file(weights_state_dict(model), str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
            else:
                model.save_pretrained(str(tmp), state_dict=weights_state_dict(model))
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
