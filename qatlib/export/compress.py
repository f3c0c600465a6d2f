"""What an export writes, tensor by tensor: each `QuantLinear` compressed by compressed-tensors'
own compressor from qatlib's codes and scales (and checked by decompressing it again), the other
tensors as they are, the checkpoint's ``quantization_config`` and ignore list, and the side files
(`write_side_files`). `qatlib.export.export` (the verb: validation, the in-memory path) and
`qatlib.export.stream` (the streamed path) both write through these; see `qatlib.export` for
the format mapping.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file
from torch import nn

from ..checkpoint.keys import kv_role, parse_key, scale_state_dict
from ..checkpoint.layout import (
    EXPORT_INFO_FILE,
    EXPORT_KV_SCALES_FILE,
    FAKE_EXPORT_SCALES_FILE,
    KV_SCALES_FILE,
    SCHEME_FILE,
    AtomicDir,
    write_json,
)
from ..checkpoint.st_write import save_tensors
from ..quant import QuantLinear, QuantScheme
from ..quant import functional as F
from ..quant.linear import is_router, weight_readable
from ..quant.quantizer import Quantizer
from ..quant.spec import CheckpointFormat, Granularity
from .format import CTFormat, ExportError

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExportJob:
    """What `export` settled before writing anything (format checked, target directory checked,
    ``qatlib_export.json``'s content): the inputs the in-memory and the streaming writer
    (`qatlib.export.stream`) share."""

    model: nn.Module
    scheme: QuantScheme
    save_format: str
    fmt: CTFormat | None  # None: no compressed-tensors weights (fake / kv-cache only)
    target: AtomicDir
    info: dict[str, Any]
    tokenizer: Any = None
    ignore: tuple[str, ...] = ()
    verify: bool = True

    @property
    def weights(self) -> str | None:
        """What the checkpoint tensors are: ``real`` (compressed), ``fake`` or None (none written)."""
        return {"real": "real", "real_and_kvcache": "real", "fake": "fake"}.get(self.save_format)

    @property
    def want_kv(self) -> bool:
        return self.save_format in ("save_kvcache_only", "real_and_kvcache")


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


def export_tensors(
    model: nn.Module,
    weights: str | None,
    fmt: CTFormat | None = None,
    *,
    kv: bool = False,
    modules: Iterable[tuple[str, nn.Module]] | None = None,
    verify: bool = True,
    keep: bool = True,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(checkpoint tensors, kv-cache scales)`` of an export, on CPU.

    ``weights``: ``"real"`` (compressed-tensors tensors, needs ``fmt``; static k/v output scales
    become ``<attn>.k_scale`` / ``v_scale`` when ``fmt.kv_cache`` is set), ``"fake"`` (fake-quant
    weights) or None (no checkpoint tensors). ``kv``: also collect ``<attn>.k_cache.scale`` /
    ``v_cache.scale``. ``modules`` yields ``(name, module)`` units covering ``model`` (default
    ``model.named_modules()``); a unit's parameters must be readable while it is yielded, a
    `QuantLinear` together with its quantizers (ZeRO-3: ``iter_gathered_modules``).
    ``keep=False`` (non-main ranks) walks the units without computing anything.
    """
    kv_scales: dict[str, torch.Tensor] = {}
    state = dict(
        iter_export_tensors(
            model,
            weights,
            fmt,
            kv_scales=kv_scales if kv else None,
            modules=modules,
            verify=verify,
            keep=keep,
        )
    )
    return state, kv_scales


def iter_export_tensors(
    model: nn.Module,
    weights: str | None,
    fmt: CTFormat | None = None,
    *,
    kv_scales: dict[str, torch.Tensor] | None = None,
    resume_scales: dict[str, torch.Tensor] | None = None,
    modules: Iterable[tuple[str, nn.Module]] | None = None,
    verify: bool = True,
    keep: bool = True,
    skip: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """`export_tensors` one tensor at a time, in module order (what the streaming export writes
    shard by shard). ``kv_scales`` / ``resume_scales`` (dicts) collect the KV-cache scales / the
    PTQ-key scales of each `QuantLinear` while it is yielded. ``skip(name)``: parameters not to
    write (the alias names of tied weights on a streamed model)."""
    if weights not in ("real", "fake", None):
        raise ExportError(f"weights must be 'real', 'fake' or None, not {weights!r}")
    if weights == "real" and fmt is None:
        raise ExportError("a 'real' export needs the compressed-tensors format (compressed_tensors_format)")
    seen: set[int] = set()
    for name, module in model.named_modules() if modules is None else modules:
        if not keep or isinstance(module, Quantizer):
            continue  # quantizers are read with their QuantLinear
        prefix = f"{name}." if name else ""
        if not isinstance(module, QuantLinear):
            if weights is not None:
                for k, t in _own_tensors(module, prefix).items():
                    # tied weights once: by name when ``skip`` is given (a streamed tensor is freed
                    # once written, so its id may come back), else by tensor identity
                    if skip is not None:
                        if not skip(k):
                            yield k, t.cpu().contiguous()
                    elif id(t) not in seen:
                        seen.add(id(t))
                        yield k, t.cpu().contiguous()
            continue
        role = kv_role(name, model)
        if resume_scales is not None:
            resume_scales.update(scale_state_dict(model, linears=[(name, module)]))
        if kv_scales is not None and role is not None:
            kv_scales.update(
                {
                    k: v
                    for k, v in scale_state_dict(model, linears=[(name, module)]).items()
                    if (p := parse_key(k)) is not None and p.role == "output" and p.kind == "scale"
                }
            )
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


def ignore_list(model: nn.Module, extra: Sequence[str] = ()) -> list[str]:
    """Module names compressed-tensors / vLLM must leave unquantized: every plain linear (e.g.
    ``lm_head``), embedding and MoE router gate, by resolved name only.

    ``extra`` (the user's ``ignore_layers``: names or ``re:`` regexes, qatlib's matching) is checked
    (`check_ignore`), never copied: a runtime reads ``re:`` entries with ``re.match`` (prefix;
    compressed-tensors utils/match.py `match_name`, vLLM quantization/utils, SGLang CT utils.py),
    so ``re:model.layers.1`` would unquantize every layer-1 linear there. Every module the
    patterns select is a plain linear of the model, hence already named here."""
    check_ignore(model, extra)
    names = []
    mods = dict(model.named_modules())
    for name, m in mods.items():
        if not name or isinstance(m, (QuantLinear, Quantizer)):
            continue
        parent_name, _, child = name.rpartition(".")
        if isinstance(m, (nn.Linear, nn.Embedding)) or is_router(mods.get(parent_name), child):
            names.append(name)
    return names


def check_ignore(model: nn.Module, patterns: Sequence[str]) -> None:
    """`ExportError` for an ignore set a runtime would read differently (`qatlib.runtime.ignore`)."""
    from ..runtime.ignore import ignore_problems

    problem = ignore_problems(model, patterns)
    if problem:
        raise ExportError(problem)


def quantization_config(model: nn.Module, fmt: CTFormat, *, ignore: Sequence[str] = ()):
    """The compressed-tensors `QuantizationConfig` (status ``compressed``) for ``config.json``."""
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    return QuantizationConfig(
        config_groups={"group_0": fmt.scheme},
        kv_cache_scheme=fmt.kv_cache,
        format=fmt.format,
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=ignore_list(model, ignore),
    )


def fp8_native_config(model: nn.Module, scheme: QuantScheme, *, ignore: Sequence[str] = ()) -> dict[str, Any]:
    """``config.json``'s ``quantization_config`` in vLLM's / SGLang's own fp8 format
    (`CheckpointFormat.FP8`, upstream's ``save_name: fp8``: angelslim/compressor/quant/core/save.py
    l.292-315): ``quant_method``, ``activation_scheme`` and ``ignored_layers`` (`ignore_list`; vLLM
    matches them exactly, ``Fp8Config.get_quant_method``)."""
    return {
        "quant_method": CheckpointFormat.FP8.value,
        "activation_scheme": "dynamic" if scheme.input.dynamic else "static",
        "ignored_layers": ignore_list(model, ignore),
    }


# --------------------------------------------------------------------------- entry point
def write_side_files(
    tmp: Path,
    job: ExportJob,
    kv: dict[str, torch.Tensor] | None,
    resume_scales: dict[str, torch.Tensor] | None,
) -> None:
    """Everything of an export but the weight files: the config's quantization_config, the
    tokenizer, the KV-cache and resume scales, ``qatlib_export.json``."""
    model, scheme, fmt, weights = job.model, job.scheme, job.fmt, job.weights
    if weights is not None:
        if fmt is not None and scheme.checkpoint_format is CheckpointFormat.FP8:
            cfg_file = tmp / "config.json"
            cfg = json.loads(cfg_file.read_text())
            cfg["quantization_config"] = fp8_native_config(model, scheme, ignore=job.ignore)
            write_json(cfg_file, cfg)
        elif fmt is not None:
            from compressed_tensors.compressors import ModelCompressor

            ModelCompressor(
                quantization_config=quantization_config(model, fmt, ignore=job.ignore)
            ).update_config(str(tmp))
        if job.tokenizer is not None:
            job.tokenizer.save_pretrained(str(tmp))
    if kv is not None:
        kv_file = tmp / (KV_SCALES_FILE if weights is None else EXPORT_KV_SCALES_FILE)
        kv_file.parent.mkdir(exist_ok=True)
        save_file(kv, str(kv_file), metadata={"format": "pt"})
    if resume_scales:
        (tmp / FAKE_EXPORT_SCALES_FILE).parent.mkdir(exist_ok=True)
        meta = {"format": "pt", "qatlib": "fake-export-scales"}
        save_tensors(resume_scales, tmp / FAKE_EXPORT_SCALES_FILE, metadata=meta)
        write_json(tmp / SCHEME_FILE, scheme.to_dict())
    write_json(tmp / EXPORT_INFO_FILE, job.info, sort_keys=True)
