"""What an export writes, tensor by tensor, following its `ExportPlan` (`qatlib.export.plan`):
each `QuantLinear` compressed by compressed-tensors' own compressor from qatlib's codes and
scales (and checked by decompressing it again), the other tensors as they are, then the side
files (`write_side_files`: config.json's header, tokenizer, KV-cache and resume scales,
``qatlib_export.json``). `qatlib.export.export` (the in-memory path) and `qatlib.export.stream`
(the streamed path) both write through these; see `qatlib.export` for the format mapping.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from ..checkpoint.keys import key_of, scale_state_dict
from ..checkpoint.layout import EXPORT_INFO_FILE, SCHEME_FILE, write_json
from ..checkpoint.st_write import save_tensors
from ..quant import QuantLinear
from ..quant import functional as F
from ..quant.linear import weight_readable
from ..quant.quantizer import Quantizer
from ..quant.spec import CheckpointFormat, Granularity
from .experts import check_format, fused_expert_tensors, is_interleaved_expert
from .format import CTFormat, ExportError
from .plan import ExportPlan

log = logging.getLogger(__name__)


def _zp_dtype(args) -> torch.dtype:
    return args.zp_dtype if args.zp_dtype is not None else args.pytorch_dtype()


@torch.no_grad()
def compress_linear(
    ql: QuantLinear, fmt: CTFormat, *, name: str = "", verify: bool = True
) -> dict[str, torch.Tensor]:
    """The compressed-tensors tensors of one `QuantLinear` (local names: ``weight`` or
    ``weight_packed`` + ``weight_shape``, ``weight_scale``, ``weight_zero_point``, ``input_scale``,
    ``input_zero_point``, ``bias``), made by the library's compressor from our codes and scales.

    ``verify`` decompresses the result with the library and requires it to equal our dequantized
    weight bit for bit (guards against a header / packing that does not match the tensors).
    """
    from compressed_tensors.compressors import BaseCompressor

    if not weight_readable(ql.weight):
        raise ExportError(
            f"weight of {name or 'a QuantLinear'} is not readable (ZeRO-3 shard or meta): gather it first"
        )
    if ql.weight_quantizer is None:
        raise ExportError(f"{name or 'this QuantLinear'} quantizes no weight")
    spec = ql.weight_quantizer.spec
    codes, scale, zp = ql.codes()
    # Our dequantized weight (no fp8_recast / W4A8 kernel scales: the kernel applies them). Fed
    # to the compressor, its re-quantization with the same scales gives back exactly our codes.
    gs = ql.weight_global_scale()  # NVFP4: compressed-tensors' `weight_global_scale` (448 * 6 / amax)
    deq = F.dequantize(
        codes, scale, zp, spec.replace(fp8_recast=False, w4a8_kernel=False), torch.float32, global_scale=gs
    )
    sd: dict[str, torch.Tensor] = {"weight": deq, "weight_scale": scale}
    if gs is not None:
        sd["weight_global_scale"] = gs
    wargs = fmt.scheme.weights
    if zp is not None:
        sd["weight_zero_point"] = zp.to(_zp_dtype(wargs))
    aargs = fmt.scheme.input_activations
    iq = ql.input_quantizer
    if aargs is not None and iq is not None and iq.global_scale is not None:
        sd["input_global_scale"] = iq.global_scale.detach().float().reshape(1).clone()
    if aargs is not None and not aargs.dynamic:
        if iq is None or iq.scale is None:
            raise ExportError(f"{name}: the export scheme has a static input scale but the layer has none")
        sd["input_scale"] = iq.scale.detach().float().reshape(1).clone()
        if iq.zero_point is not None:
            sd["input_zero_point"] = (
                torch.round(iq.zero_point.detach().float()).reshape(1).to(_zp_dtype(aargs))
            )
    compressor = BaseCompressor.get_value_from_registry(fmt.format)
    out = dict(compressor.compress(sd, fmt.scheme))
    if verify and spec.is_fp4:
        _verify_fp4(out, codes, scale, gs, compressor, name=name or "a QuantLinear")
    elif verify:
        back = compressor.decompress(dict(out), fmt.scheme)["weight"]
        if back.shape != deq.shape or not torch.equal(back.float(), deq):
            bad = (back.float() - deq).abs().max().item() if back.shape == deq.shape else float("nan")
            raise ExportError(
                f"{name}: compressed-tensors {fmt.format} round trip changed the weight (max |diff| {bad:g}); "
                "refusing to write a checkpoint whose weights differ from the trained ones"
            )
    if ql.bias is not None:
        out["bias"] = ql.bias.detach()
    return {k: v.detach().cpu().contiguous() for k, v in out.items()}


def _verify_fp4(out, codes, scale, gs, compressor, *, name: str) -> None:
    """The FP4 round trip checked exactly on what is stored: the library's unpacked E2M1 codes,
    its decompressed group scales and the global scale equal ours. (Its decompressed weight is
    bf16 by construction, `unpack_fp4_from_uint8`, so comparing that would hide a difference
    below bf16's resolution.)"""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    packed = out["weight_packed"]
    back = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
    problems = []
    if not torch.equal(back, codes.float()):
        problems.append(f"{int((back != codes.float()).sum())} E2M1 codes")
    if not torch.equal(compressor._decompress_scale(out["weight_scale"], torch.float32), scale):
        problems.append("group scales (not representable in the scale format)")
    if gs is not None and not torch.equal(out["weight_global_scale"].float(), gs):
        problems.append("weight_global_scale")
    if problems:
        raise ExportError(
            f"{name}: compressed-tensors {compressor.__name__} round trip changed the {', '.join(problems)}; "
            "refusing to write a checkpoint whose weights differ from the trained ones"
        )


def _ct_kv_scale(oq: Quantizer) -> torch.Tensor:
    s = oq.scale.detach().float().cpu()
    if oq.spec.granularity is Granularity.HEAD:
        return s.reshape(-1, 1, 1).contiguous()  # compressed-tensors attn_head shape (H, 1, 1)
    return s.reshape(1).contiguous()


def _own_tensors(module: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    out = {}
    for k, p in module._parameters.items():
        if p is not None:
            out[f"{prefix}{k}"] = p.detach()
    for k, b in module._buffers.items():
        if b is not None and k not in module._non_persistent_buffers_set:
            out[f"{prefix}{k}"] = b.detach()
    return out


def iter_export_tensors(
    model: nn.Module,
    plan: ExportPlan,
    *,
    kv_scales: dict[str, torch.Tensor] | None = None,
    resume_scales: dict[str, torch.Tensor] | None = None,
    modules: Iterable[tuple[str, nn.Module]] | None = None,
    verify: bool = True,
    keep: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint tensors of ``plan`` (``plan.weights``: compressed-tensors tensors, with
    ``<attn>.k_scale`` / ``v_scale`` for a ``kv_cache_scheme``; fake-quant weights; or none), one
    at a time, on CPU, in module order: what the in-memory export collects and the streamed one
    writes shard by shard. ``kv_scales`` / ``resume_scales`` (dicts) collect the KV-cache scales
    (``<attn>.k_cache.scale``) / the PTQ-key scales of each `QuantLinear` while it is yielded.

    ``modules`` yields ``(name, module)`` units covering ``model`` (default
    ``model.named_modules()``); a unit's parameters must be readable while it is yielded, a
    `QuantLinear` together with its quantizers (ZeRO-3: ``iter_gathered_modules``; streamed:
    ``iter_onloaded_modules``). ``keep=False`` (non-main ranks) walks the units without computing
    anything."""
    weights, fmt = plan.weights, plan.fmt
    fused: list[str] = []  # interleaved experts written whole (`qatlib.export.experts`)
    interleaved = (
        {f"{n}." for n, m in model.named_modules() if is_interleaved_expert(m)}
        if weights == "real"
        else set()
    )
    for name, module in model.named_modules() if modules is None else modules:
        if not keep or isinstance(module, Quantizer):
            continue  # quantizers are read with their QuantLinear
        prefix = f"{name}." if name else ""
        if fused and name.startswith(fused[-1]):
            continue  # a linear of an interleaved expert, written with it
        if interleaved and f"{name.rpartition('.')[0]}." in interleaved:
            raise ExportError(
                f"{name}: a linear of an interleaved gate/up expert reached the export without its expert "
                "module (a module walk that hands over linears one at a time): the expert is written whole"
            )
        if weights == "real" and is_interleaved_expert(module):
            check_format(fmt, name)
            fused.append(prefix)
            linears = [(f"{prefix}{p}", getattr(module, p)) for p in ("gate_proj", "up_proj", "down_proj")]
            if resume_scales is not None:
                resume_scales.update(scale_state_dict(model, linears=linears))
            parts = [compress_linear(ql, fmt, name=n, verify=verify) for n, ql in linears]
            yield from fused_expert_tensors(name, *parts).items()
            continue
        if not isinstance(module, QuantLinear):
            if weights is not None:
                for k, t in _own_tensors(module, prefix).items():
                    if k not in plan.aliases:  # a tied tensor once, under its first name
                        yield k, t.cpu().contiguous()
            continue
        role = plan.kv_roles.get(name)
        kv_key = key_of(name, "output", "scale", role) if kv_scales is not None and role is not None else None
        if resume_scales is not None or kv_key is not None:
            scales = scale_state_dict(model, linears=[(name, module)])
            if resume_scales is not None:
                resume_scales.update(scales)
            if kv_key in scales:
                kv_scales[kv_key] = scales[kv_key]
        if weights == "fake":
            if not weight_readable(module.weight):
                raise ExportError(f"weight of {name} is not readable (ZeRO-3 shard or meta): gather it first")
            with torch.no_grad():
                yield (
                    f"{prefix}weight",
                    module.fake_quant_weight().detach().to(module.weight.dtype).cpu().contiguous(),
                )
            if module.bias is not None:
                yield f"{prefix}bias", module.bias.detach().cpu().contiguous()
        elif weights == "real":
            yield from (
                (f"{prefix}{k}", v) for k, v in compress_linear(module, fmt, name=name, verify=verify).items()
            )
            oq = module.output_quantizer
            if fmt.kv_cache is not None and oq is not None and role is not None:
                # compressed-tensors' own key ``<attn>.k_scale`` (vLLM's cache-scale mapper and
                # SGLang's dense Qwen3 remap it), and the runtimes' parameter name
                # ``<attn>.attn.k_scale``, which SGLang's Qwen3-MoE loader needs (it never remaps:
                # sglang 0.5.23 models/qwen3_moe.py:1157-1270) and both vLLM loaders take as is
                # (vllm 0.33 weight_utils.py:1743 `if name in params_dict`, base_config.py:249
                # `(?<!\.attn)`). Both hold the same values; the runtime loads one parameter.
                attn = name.rpartition(".")[0]
                ks = _ct_kv_scale(oq)
                yield f"{attn}.{role}_scale", ks
                yield f"{attn}.attn.{role}_scale", ks.clone()


# --------------------------------------------------------------------------- side files
def write_side_files(
    tmp: Path,
    plan: ExportPlan,
    *,
    tokenizer: Any = None,
    kv_scales: dict[str, torch.Tensor] | None = None,
    resume_scales: dict[str, torch.Tensor] | None = None,
) -> None:
    """Everything of an export but the weight files, into the folder ``tmp`` holding them:
    config.json's ``quantization_config`` (``plan.quantization_config``), the tokenizer, the
    KV-cache scales (``plan.kv_file``) and resume scales (``plan.resume_file``, with
    ``quant_scheme.json``), ``qatlib_export.json`` (`ExportPlan.record`)."""
    if plan.weights is not None:
        if plan.quantization_config is not None and plan.scheme.checkpoint_format is CheckpointFormat.FP8:
            cfg_file = tmp / "config.json"
            cfg = json.loads(cfg_file.read_text())
            cfg["quantization_config"] = plan.quantization_config
            write_json(cfg_file, cfg)
        elif plan.quantization_config is not None:
            from compressed_tensors.compressors import ModelCompressor

            ModelCompressor(quantization_config=plan.quantization_config).update_config(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
    if plan.kv_file is not None:
        kv_file = tmp / plan.kv_file
        kv_file.parent.mkdir(exist_ok=True)
        save_file(kv_scales, str(kv_file), metadata={"format": "pt"})
    if plan.resume_file is not None and resume_scales:
        (tmp / plan.resume_file).parent.mkdir(exist_ok=True)
        meta = {"format": "pt", "qatlib": "fake-export-scales"}
        save_tensors(resume_scales, tmp / plan.resume_file, metadata=meta)
        write_json(tmp / SCHEME_FILE, plan.scheme.to_dict())
    write_json(tmp / EXPORT_INFO_FILE, plan.record(), sort_keys=True)
