"""Export a prepared (QAT-trained or PTQ-calibrated) model for deployment, by ``save_format``.

- ``real``: a compressed-tensors checkpoint (what vLLM / SGLang / transformers load), written with
  the compressed-tensors library: our `QuantScheme` is mapped to a compressed-tensors
  `QuantizationScheme` + compression format (`compressed_tensors_format`), each `QuantLinear` is
  compressed by the library's compressor from OUR codes and scales (the stored scales, or the
  LWC-clipped scale of the weight; docs/design.md: same convention, so they are exported
  unchanged), every compressed weight is decompressed again and checked bit-for-bit against our
  dequantized weight, and ``config.json`` gets the library's ``quantization_config``.
  The mapping (`compressed_tensors_format`; vLLM scheme in brackets):

  ====================================  ==================  =====================================
  qatlib scheme                         format              compressed-tensors scheme
  ====================================  ==================  =====================================
  fp8 weight (tensor/channel) + fp8 in  float-quantized     FP8 / FP8_DYNAMIC-like [W8A8Fp8]
  fp8 weight only                       float-quantized     W8A16-FP8 [W8A16Fp8, Marlin]
  intN weight only (tensor/chan/group)  pack-quantized      WNA16 (+packed zero points) [WNA16]
  int weight + int8 input               int-quantized       W8A8 int [W8A8Int8]
  int4 group weight + fp8 input         pack-quantized      W4AFP8, fp8 per-token dynamic
                                                            activations [W4A8Fp8, SM90, g128]
  nvfp4 weight (+ nvfp4 dynamic input)  nvfp4-pack-quantized  NVFP4A16 / NVFP4 (tensor_group, E4M3
                                                            scales + ``*_global_scale``)
                                                            [W4A16Nvfp4 Marlin / W4A4Nvfp4, SM100]
  mxfp4 weight (+ mxfp4 dynamic input)  mxfp4-pack-quantized  MXFP4A16 / MXFP4 (group 32, uint8
                                                            E8M0 exponents) [Mxfp4 W4A16 / W4A4]
  k / v output (static fp8)             kv_cache_scheme     ``<attn>.k_scale`` / ``v_scale``
  fp8 tensor weight + fp8 tensor input  float-quantized     the same tensors under vLLM's / SGLang's
  (``save_name: fp8``)                  tensors             own header, ``quant_method: fp8``
                                                            [Fp8LinearMethod / Fp8MoEMethod]
  ====================================  ==================  =====================================

  FOCUS's sub-group scales (``QuantSpec.subgroups``) are folded into the FP4 codes
  (`qatlib.quant.linear.QuantLinear.codes`): the runtime's ``codes x group scale`` is the trained
  weight.

- ``fake``: a plain HF checkpoint whose linears hold ``dequantize(quantize(W))`` (no quantization
  library needed to load it; activation quantization is not represented).
- ``save_kvcache_only``: ``kv_cache_scales.safetensors`` with ``<attn>.k_cache.scale`` /
  ``<attn>.v_cache.scale``; ``real_and_kvcache``: both, the KV file in the ``qatlib/`` side folder.

An export folder holds only files a runtime should load (vLLM / SGLang load every top-level
``*.safetensors``): qatlib's own side files (a `fake` export's resume scales, the PTQ-key KV
scales beside real weights) go to ``qatlib/`` (`qatlib.checkpoint.layout.EXPORT_SIDE_DIR`).
``config.json``'s ``ignore`` lists resolved module names only: compressed-tensors, vLLM and SGLang
match ``re:`` entries by prefix (``re.match``), qatlib's ``ignore_layers`` by full match, so a
pattern copied over would change meaning. An ignore set that quantizes part of a fused group
(q/k/v, gate/up, a layer's experts; `qatlib.runtime.fusion`) is refused. What the deployed
arithmetic still changes is recorded in ``qatlib_export.json`` (`qatlib.runtime.differences`).

Everything is validated before anything is written, and written to a temporary directory that is
renamed into place at the end. The pieces take a model plus an optional iterator of
``(name, module)`` so the ZeRO-3 path can hand over modules one at a time, gathered
(the ZeRO-3 module walk ``iter_gathered_modules``), with only the main process writing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from .. import __version__
from ..checkpoint.keys import kv_role, scale_state_dict
from ..checkpoint.layout import (
    AtomicDir,
)
from ..quant import QuantLinear, QuantScheme, quant_linears
from ..quant.calibration import prepared_mismatch
from ..quant.health import bad_quant_params
from ..quant.linear import attention_role
from ..quant.spec import Granularity
from .compress import ExportJob, check_ignore, export_tensors, write_side_files
from .format import ExportError, compressed_tensors_format

if TYPE_CHECKING:
    from ..zero3.onload import Onloader

log = logging.getLogger(__name__)

SAVE_FORMATS = ("real", "fake", "save_kvcache_only", "real_and_kvcache")


def _check_model(model: nn.Module, scheme: QuantScheme, save_format: str) -> list[tuple[str, QuantLinear]]:
    qls = list(quant_linears(model))
    if not qls:
        raise ExportError(
            "export: the model has no QuantLinear layers (prepare / calibrate / train it first)"
        )
    problem = prepared_mismatch(model, scheme)
    if problem is not None:
        raise ExportError(problem)
    mods = dict(model.named_modules())
    for name, ql in qls:
        parent, _, child = name.rpartition(".")
        oq, role = ql.output_quantizer, attention_role(mods.get(parent), child)
        ospec = getattr(scheme, role) if role is not None else None
        if (oq is None) != (ospec is None) or (
            oq is not None and oq.spec.replace(num_heads=None) != ospec.replace(num_heads=None)
        ):
            raise ExportError(
                f"{name}.output_quantizer ({'none' if oq is None else oq.spec.describe()}) does not match the scheme "
                f"({'none' if ospec is None else ospec.describe()})"
            )
        if (
            save_format != "fake"
            and ql.weight_quantizer is not None
            and ql.weight_quantizer.spec.granularity is Granularity.GROUP
        ):
            if ql.in_features % ql.weight_quantizer.spec.group_size:
                raise ExportError(
                    f"group_size {ql.weight_quantizer.spec.group_size} does not divide {name}.in_features"
                )
    if save_format in ("save_kvcache_only", "real_and_kvcache"):
        kv = [
            n
            for n, ql in qls
            if ql.output_quantizer is not None and kv_role(n, model) and not ql.output_quantizer.spec.dynamic
        ]
        if not kv:
            raise ExportError(
                f"save_format {save_format!r} needs static k/v output quantizers (scheme.k / scheme.v)"
            )
    # A NaN / inf / non-positive scale would only surface as "round trip changed the weight (nan)"
    # or a broken deployment: refuse it by name (`qatlib.trainers.guard`, this rank's share under ZeRO-3).
    bad = bad_quant_params(model)
    if bad:
        raise ExportError(f"export: {len(bad)} quantizer parameter(s) out of range: " + "; ".join(bad[:5]))
    uninit = [
        f"{n}.{r}"
        for n, ql in qls
        for r, q in ql.quantizers()
        if q.scale is not None and not bool(q.initialized)
    ]
    if uninit:
        log.warning(
            "export: %d static quantizer(s) were never initialised (scale = init value), e.g. %s",
            len(uninit),
            uninit[0],
        )
    return qls


def export(
    model: nn.Module,
    scheme: QuantScheme,
    out_dir: str | os.PathLike,
    save_format: str,
    *,
    tokenizer: Any = None,
    overwrite: bool = False,
    ignore: Sequence[str] = (),
    w4a8_activation: str = "runtime",
    modules: Iterable[tuple[str, nn.Module]] | None = None,
    is_main_process: bool = True,
    verify: bool = True,
    onload: Onloader | None = None,
    max_shard_size: int = 5 << 30,
) -> Path | None:
    """Export a prepared model by ``save_format`` (``real``, ``fake``, ``save_kvcache_only``,
    ``real_and_kvcache``) to ``out_dir``; returns the directory (None on non-main processes).

    Everything that can be checked is checked before writing: the format, that the model holds
    `QuantLinear` layers of ``scheme``, that compressed-tensors can represent the scheme
    (`compressed_tensors_format`), the target directory (non-empty is an error unless
    ``overwrite``). ``ignore`` adds entries to the checkpoint's ignore list (the unquantized
    linears, embeddings and routers are always listed). ``modules`` / ``is_main_process``: see
    `export_tensors`; every process iterates, only the main one writes.

    ``onload`` (a `qatlib.zero3.onload.Onloader` over a skeleton model, `qatlib.models.load_prepared`
    with ``skeleton=True``): the streaming export (`qatlib.export.stream`). Each decoder layer is onloaded in turn, its codes
    computed tensor by tensor and written into shards of at most ``max_shard_size`` bytes as they
    fill, so host memory holds one shard and one layer, never the model. Same tensors (and, for a
    model within one shard, the same bytes) as the in-memory export.
    """
    if save_format not in SAVE_FORMATS:
        raise ExportError(f"save_format must be one of {', '.join(SAVE_FORMATS)}; got {save_format!r}")
    _check_model(model, scheme, save_format)
    fmt = (
        compressed_tensors_format(scheme, w4a8_activation=w4a8_activation)
        if save_format in ("real", "real_and_kvcache")
        else None
    )
    if fmt is not None:
        check_ignore(model, ignore)
    target = AtomicDir(out_dir, overwrite=overwrite)
    if is_main_process:
        target.check()
    info: dict[str, Any] = {
        "qatlib_version": __version__,
        "save_format": save_format,
        "scheme": scheme.to_dict(),
    }
    if fmt is not None:
        import compressed_tensors

        for msg in fmt.changes:
            log.warning("export (%s): %s", scheme.name, msg)
        for msg in fmt.runtime_notes:
            log.warning("export (%s), deployment: %s", scheme.name, msg)
        info["compressed_tensors"] = {
            "version": compressed_tensors.__version__,
            "format": fmt.format,
            "changes": list(fmt.changes),
            "runtime_notes": list(fmt.runtime_notes),
        }
    if fmt is not None:
        from ..runtime.differences import deployment_differences

        # measured on the scales; a streamed skeleton holds every scale (only weights are offloaded)
        info["deployment"] = deployment_differences(
            model, scheme, w4a8_activation=w4a8_activation, measure=modules is None
        )
    if save_format == "fake":
        info["note"] = (
            "weights are dequantize(quantize(W)); activation / KV-cache quantization is not represented"
        )

    job = ExportJob(model, scheme, save_format, fmt, target, info, tokenizer, tuple(ignore), verify)
    if onload is not None:
        from .stream import export_streaming

        return export_streaming(job, onload, max_shard_size)
    # A `fake` save is also a warm-start / resume checkpoint (`resume_ckpt_dir`): it carries the
    # scales in the PTQ key format + quant_scheme.json. Plain in-memory models only: the ZeRO-3
    # path (`modules`) streams each layer once, for the weights.
    resume_scales = scale_state_dict(model) if save_format == "fake" and modules is None else None
    state, kv = export_tensors(
        model, job.weights, fmt, kv=job.want_kv, modules=modules, verify=verify, keep=is_main_process
    )
    if not is_main_process:
        return None
    with target as tmp:
        if job.weights is not None:
            model.save_pretrained(str(tmp), state_dict=state)
        write_side_files(tmp, job, kv if job.want_kv else None, resume_scales)
    log.info("exported %s (%s) to %s", scheme.name, save_format, out_dir)
    return Path(out_dir)
