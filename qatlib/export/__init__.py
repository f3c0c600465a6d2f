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
arithmetic still changes is recorded in ``qatlib_export.json`` (`qatlib.runtime.differences`), and
so is, per module type, what was quantized and what was kept in high precision and why
(``coverage``, `qatlib.export.coverage`: ignore list, router, embedding, a refused fused layout).

How an export runs, top to bottom (the package's modules, each importing only those below it):

1. plan (`qatlib.export.plan`, `plan_export`): the model is checked against the scheme, then each
   owner is asked once what the export needs: the compressed-tensors mapping
   (`qatlib.export.format`), the checked ignore set and config.json's ignore list and header, the
   KV cache's projections and the tied names (`qatlib.checkpoint`), what vLLM / SGLang merge and
   change at load (`qatlib.runtime`). One frozen `ExportPlan`; nothing is written yet.
2. validate the target: the output directory (non-empty is an error unless ``overwrite``); the
   plan's changes and runtime notes are logged.
3. write the tensors (`qatlib.export.compress`, following the plan): in memory (here: the model's
   tensors collected, then ``save_pretrained``) or streamed (`qatlib.export.stream`: a skeleton
   onloaded layer by layer, each tensor spilled into its shard), into a temporary directory.
4. write the side files (`qatlib.export.compress.write_side_files`): config.json's
   ``quantization_config``, the tokenizer, KV-cache / resume scales, ``qatlib_export.json``
   (`ExportPlan.record`); then the temporary directory is renamed into place.

The writers take a model plus an optional iterator of ``(name, module)`` so the ZeRO-3 path can
hand over modules one at a time, gathered (the ZeRO-3 module walk ``iter_gathered_modules``), with
only the main process writing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..checkpoint.layout import AtomicDir
from ..checkpoint.saved_keys import expert_names
from ..quant import QuantScheme
from ..zero3.io import is_zero3_param
from .compress import iter_export_tensors, write_side_files
from .format import ExportError, compressed_tensors_format
from .plan import SAVE_FORMATS, ExportPlan, log_plan, plan_export

if TYPE_CHECKING:
    from ..zero3.onload import Onloader

__all__ = [
    "SAVE_FORMATS",
    "ExportError",
    "ExportPlan",
    "compressed_tensors_format",
    "export",
    "plan_export",
]

log = logging.getLogger(__name__)


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

    Everything that can be checked is checked before writing (`plan_export`): the format, that the
    model holds `QuantLinear` layers of ``scheme``, that compressed-tensors can represent the scheme
    (`compressed_tensors_format`), the ignore set, then the target directory (non-empty is an error
    unless ``overwrite``). ``ignore`` is the user's ``ignore_layers``: checked, never copied (the
    unquantized linears, embeddings and routers are listed by name). ``modules`` /
    ``is_main_process``: see `iter_export_tensors`; every process iterates, only the main one writes.

    ``onload`` (a `qatlib.zero3.onload.Onloader` over a skeleton model, `qatlib.models.load_prepared`
    with ``skeleton=True``): the streaming export (`qatlib.export.stream`). Each decoder layer is
    onloaded in turn, its codes computed tensor by tensor and written into shards of at most
    ``max_shard_size`` bytes as they fill, so host memory holds one shard and one layer, never the
    model. Same tensors (and, for a model within one shard, the same bytes) as the in-memory export.
    """
    # 1. the plan. Scales are measured for the deployment record: a streamed skeleton holds every
    # scale (only weights are offloaded), a ZeRO-3 process only its share
    plan = plan_export(
        model, scheme, save_format, ignore=ignore, w4a8_activation=w4a8_activation, measure=modules is None
    )
    # 2. the target directory
    target = AtomicDir(out_dir, overwrite=overwrite)
    if is_main_process:
        target.check()
    log_plan(plan)
    # 3.-4. the tensors, then the side files: streamed ...
    if onload is not None:
        from .stream import export_streaming

        return export_streaming(
            model, plan, target, onload, max_shard_size=max_shard_size, tokenizer=tokenizer, verify=verify
        )
    # ... or in memory
    kv: dict[str, torch.Tensor] | None = {} if plan.kv_file is not None else None
    # A `fake` save is also a warm-start / resume checkpoint (`resume_ckpt_dir`): it carries the
    # scales in the PTQ key format + quant_scheme.json. Plain in-memory models only: the ZeRO-3
    # path (`modules`) streams each layer once, for the weights.
    resume: dict[str, torch.Tensor] | None = {} if plan.resume_file is not None and modules is None else None
    state = dict(
        iter_export_tensors(
            model,
            plan,
            kv_scales=kv,
            resume_scales=resume,
            modules=modules,
            verify=verify,
            keep=is_main_process,
        )
    )
    if not is_main_process:
        return None
    with target as tmp:
        if plan.weights is not None:
            # linearised experts under the hub's per-expert keys (vLLM's and from_pretrained's); the
            # rest reverse-converted by save_pretrained as ever
            name_of = expert_names(model, lambda p: p.ds_shape if is_zero3_param(p) else p.shape)
            model.save_pretrained(str(tmp), state_dict={name_of(k): v for k, v in state.items()})
        write_side_files(tmp, plan, tokenizer=tokenizer, kv_scales=kv, resume_scales=resume)
    log.info("exported %s (%s) to %s", scheme.name, save_format, out_dir)
    return Path(out_dir)
