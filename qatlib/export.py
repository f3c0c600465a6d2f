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
  k / v output (static fp8)             kv_cache_scheme     ``<attn>.k_scale`` / ``v_scale``
  ====================================  ==================  =====================================

- ``fake``: a plain HF checkpoint whose linears hold ``dequantize(quantize(W))`` (no quantization
  library needed to load it; activation quantization is not represented).
- ``save_kvcache_only``: ``kv_cache_scales.safetensors`` with ``<attn>.k_cache.scale`` /
  ``<attn>.v_cache.scale``; ``real_and_kvcache``: both.

Everything is validated before anything is written, and written to a temporary directory that is
renamed into place at the end. The pieces take a model plus an optional iterator of
``(name, module)`` so the ZeRO-3 path can hand over modules one at a time, gathered
(the ZeRO-3 module walk ``iter_gathered_modules``), with only the main process writing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from . import __version__
from .checkpoint.keys import kv_role, parse_key, scale_state_dict
from .checkpoint.layout import KV_SCALES_FILE, SCALES_FILE, SCHEME_FILE, AtomicDir, write_json
from .quant import QuantLinear, QuantScheme, QuantSpec, quant_linears
from .quant import functional as F
from .quant.calibration import prepared_mismatch
from .quant.linear import attention_role, is_router, weight_readable
from .quant.quantizer import Quantizer
from .quant.spec import Granularity
from .trainers.guard import bad_quant_params

log = logging.getLogger(__name__)

SAVE_FORMATS = ("real", "fake", "save_kvcache_only", "real_and_kvcache")
EXPORT_INFO_FILE = "qatlib_export.json"
W4A8_ACTIVATION_MODES = ("runtime", "trained")


class ExportError(ValueError):
    """The model / scheme / format combination cannot be exported (raised before writing)."""


# --------------------------------------------------------------------------- scheme mapping
@dataclass(frozen=True)
class CTFormat:
    """The compressed-tensors side of one `QuantScheme`.

    scheme: the `QuantizationScheme` every quantized linear gets (targets ``["Linear"]``).
    format: the compression format (``float-quantized``, ``pack-quantized``, ``int-quantized``).
    kv_cache: ``kv_cache_scheme`` for static k/v outputs (``<attn>.k_scale`` / ``v_scale``).
    changes: where the exported arithmetic differs from the trained fake-quant model.
    runtime_notes: why vLLM (the deployment target) may refuse or treat differently this layout.
    """

    scheme: Any
    format: str
    kv_cache: Any | None
    changes: tuple[str, ...] = ()
    runtime_notes: tuple[str, ...] = ()


def _strategy(spec: QuantSpec):
    from compressed_tensors.quantization import QuantizationStrategy as S

    return {
        Granularity.TENSOR: S.TENSOR,
        Granularity.CHANNEL: S.CHANNEL,
        Granularity.GROUP: S.GROUP,
        Granularity.TOKEN: S.TOKEN,
        Granularity.HEAD: S.ATTN_HEAD,
    }[spec.granularity]


def ct_args(spec: QuantSpec):
    """Our `QuantSpec` as compressed-tensors `QuantizationArgs` (same scale convention)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationType

    return QuantizationArgs(
        num_bits=spec.bits,
        type=QuantizationType.FLOAT if spec.is_fp8 else QuantizationType.INT,
        symmetric=spec.symmetric,
        strategy=_strategy(spec),
        group_size=spec.group_size if spec.granularity is Granularity.GROUP else None,
        dynamic=spec.dynamic,
    )


def compressed_tensors_format(scheme: QuantScheme, *, w4a8_activation: str = "runtime") -> CTFormat:
    """Map ``scheme`` to compressed-tensors, or raise `ExportError` for what has no counterpart.

    W4A8-FP8 (int weights + FP8 activations) follows vLLM's ``CompressedTensorsW4A8Fp8`` layout
    (compressed-tensors preset ``W4AFP8``): packed int32 weights (``pack-quantized``) and FP8
    per-token dynamic activations, the only activation mode that kernel has. With
    ``w4a8_activation="runtime"`` (default) a static per-tensor FP8 input scale is therefore
    replaced by per-token dynamic quantization (recorded in ``changes``); ``"trained"`` keeps the
    trained static scale (transformers reproduces the trained model; vLLM has no kernel for it).
    """
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, QuantizationStrategy

    if w4a8_activation not in W4A8_ACTIVATION_MODES:
        raise ExportError(f"w4a8_activation must be one of {W4A8_ACTIVATION_MODES}; got {w4a8_activation!r}")
    w, a = scheme.weight, scheme.input
    if w is None:
        raise ExportError(
            f"scheme {scheme.name!r} quantizes no weight: a 'real' export needs weight quantization"
        )
    if scheme.q is not None:
        raise ExportError(
            f"scheme {scheme.name!r} quantizes the q projection output ({scheme.q.describe()}): compressed-tensors / "
            "vLLM have no query-quantization counterpart; export without scheme.q (k/v map to the KV cache)"
        )
    if a is not None and a.granularity is Granularity.HEAD:
        raise ExportError(
            f"per-head input activations ({a.describe()}) have no compressed-tensors counterpart"
        )
    changes: list[str] = []
    notes: list[str] = []
    wargs = ct_args(w)
    aargs = None if a is None else ct_args(a)
    if w.is_fp8:
        fmt = CompressionFormat.float_quantized
        if w.granularity is Granularity.GROUP:
            notes.append(
                "vLLM's FP8 linear kernels take per-tensor or per-channel weight scales, not per-group"
            )
        if a is not None and not a.is_fp8:
            raise ExportError(
                f"fp8 weights with {a.qtype} activations have no compressed-tensors / vLLM layout"
            )
        if a is None:
            notes.append("FP8 weight-only (W8A16-FP8): vLLM runs it with the Marlin FP8 kernel")
    elif a is None:
        fmt = CompressionFormat.pack_quantized
        if w.bits not in (4, 8):
            notes.append(f"vLLM's WNA16 kernels support 4 and 8 bits, not {w.bits}")
        if w.granularity is Granularity.GROUP and w.group_size not in (32, 64, 128):
            notes.append(f"vLLM's Marlin WNA16 kernels support group sizes 32/64/128, not {w.group_size}")
        if w.granularity is Granularity.TENSOR:
            notes.append("vLLM's WNA16 kernels take per-channel or per-group weight scales, not per-tensor")
    elif a.is_fp8:
        # W4A8-FP8: vLLM CompressedTensorsW4A8Fp8 (packed int4 weights, FP8 per-token dynamic acts).
        fmt = CompressionFormat.pack_quantized
        runtime_act = QuantizationArgs(
            num_bits=8, type="float", strategy=QuantizationStrategy.TOKEN, symmetric=True, dynamic=True
        )
        if not (a.granularity is Granularity.TOKEN and a.dynamic):
            if w4a8_activation == "runtime":
                aargs = runtime_act
                changes.append(
                    f"input activations: trained {a.describe()}, exported as fp8 per-token dynamic (the only "
                    "activation mode of vLLM's W4A8-FP8 kernel); the trained input_scale is not used"
                )
            else:
                notes.append(
                    "vLLM's W4A8-FP8 kernel needs fp8 per-token dynamic activations, not " + a.describe()
                )
        if w.bits != 4 or w.granularity is not Granularity.GROUP or w.group_size != 128 or not w.symmetric:
            notes.append(
                f"vLLM's W4A8-FP8 kernel needs int4 symmetric weights with group size 128, not {w.describe()}"
            )
        notes.append("vLLM's W4A8-FP8 kernel needs Hopper (SM90) and re-expresses group scales as FP8")
    else:
        fmt = CompressionFormat.int_quantized
        if not (w.bits == 8 and a.bits == 8):
            notes.append(
                f"vLLM's integer W8A8 kernels need int8 weights and activations, not {w.qtype}/{a.qtype}"
            )
        if w.granularity not in (Granularity.TENSOR, Granularity.CHANNEL) or not w.symmetric:
            notes.append("vLLM's int8 W8A8 kernels need symmetric per-tensor or per-channel weights")
        if a.dynamic and a.symmetric:
            changes.append(
                "dynamic symmetric int activations: compressed-tensors' own (CPU) forward divides the absmax by "
                f"{(a.qmax - a.qmin) / 2:g}, qatlib and vLLM by {a.qmax:g} (scales are computed at run time)"
            )
    if w.fp8_recast:
        changes.append(
            "weights: fp8_recast (per-tensor FP8 recast of the dequantized weight, the training-time model of the "
            "W4A8-FP8 kernel) is not stored; the checkpoint holds the int codes and scales, the kernel does its own "
            "FP8 conversion"
        )
    if scheme.fp8_attn:
        notes.append(
            "fp8_attn is a training-time simulation: FP8 attention is a runtime setting, not in the checkpoint"
        )

    kv = None
    k, v = scheme.k, scheme.v
    if k is not None or v is not None:
        if k is None or v is None or k.replace(num_heads=None) != v.replace(num_heads=None):
            raise ExportError(
                "compressed-tensors has one kv_cache_scheme for keys and values: scheme.k and scheme.v must both be "
                f"set and equal (got k={k and k.describe()}, v={v and v.describe()})"
            )
        if k.dynamic or k.granularity not in (Granularity.TENSOR, Granularity.HEAD):
            raise ExportError(
                f"KV-cache quantization exports static per-tensor or per-head scales, not {k.describe()}"
            )
        kv = ct_args(k.replace(num_heads=None))
        if not (k.is_fp8 and k.granularity is Granularity.TENSOR):
            notes.append(
                f"vLLM's compressed-tensors KV cache takes fp8 per-tensor scales, not {k.describe()}"
            )
    ct_scheme = QuantizationScheme(targets=["Linear"], weights=wargs, input_activations=aargs, format=fmt)
    return CTFormat(ct_scheme, fmt.value, kv, tuple(changes), tuple(notes))


# --------------------------------------------------------------------------- per-module pieces
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
    # Our dequantized weight (no fp8_recast: that is the kernel's business, see `changes`). Fed
    # to the compressor, its re-quantization with the same scales gives back exactly our codes.
    deq = F.dequantize(codes, scale, zp, spec.replace(fp8_recast=False), torch.float32)
    sd: dict[str, torch.Tensor] = {"weight": deq, "weight_scale": scale}
    wargs = fmt.scheme.weights
    if zp is not None:
        sd["weight_zero_point"] = zp.to(_zp_dtype(wargs))
    aargs = fmt.scheme.input_activations
    iq = ql.input_quantizer
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
    if verify:
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
    if weights not in ("real", "fake", None):
        raise ExportError(f"weights must be 'real', 'fake' or None, not {weights!r}")
    if weights == "real" and fmt is None:
        raise ExportError("a 'real' export needs the compressed-tensors format (compressed_tensors_format)")
    state: dict[str, torch.Tensor] = {}
    kv_scales: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, module in model.named_modules() if modules is None else modules:
        if not keep or isinstance(module, Quantizer):
            continue  # quantizers are read with their QuantLinear
        prefix = f"{name}." if name else ""
        if not isinstance(module, QuantLinear):
            if weights is not None:
                for k, t in _own_tensors(module, prefix).items():
                    if id(t) not in seen:  # tied weights once, under their first name
                        seen.add(id(t))
                        state[k] = t.cpu().contiguous()
            continue
        role = kv_role(name, model)
        if kv and role is not None:
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
                state[f"{prefix}weight"] = (
                    module.fake_quant_weight().detach().to(module.weight.dtype).cpu().contiguous()
                )
            if module.bias is not None:
                state[f"{prefix}bias"] = module.bias.detach().cpu().contiguous()
        elif weights == "real":
            state.update(
                {f"{prefix}{k}": v for k, v in compress_linear(module, fmt, name=name, verify=verify).items()}
            )
            oq = module.output_quantizer
            if fmt.kv_cache is not None and oq is not None and role is not None:
                # compressed-tensors' own key: ``<attn>.k_scale`` / ``v_scale``
                state[f"{name.rpartition('.')[0]}.{role}_scale"] = _ct_kv_scale(oq)
    return state, kv_scales


def ignore_list(model: nn.Module, extra: Sequence[str] = ()) -> list[str]:
    """Module names compressed-tensors / vLLM must leave unquantized: every plain linear (e.g.
    ``lm_head``), embedding and MoE router gate, plus ``extra`` entries (names or ``re:`` regexes)."""
    names = []
    mods = dict(model.named_modules())
    for name, m in mods.items():
        if not name or isinstance(m, (QuantLinear, Quantizer)):
            continue
        parent_name, _, child = name.rpartition(".")
        if isinstance(m, (nn.Linear, nn.Embedding)) or is_router(mods.get(parent_name), child):
            names.append(name)
    return names + [e for e in extra if e not in names]


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


# --------------------------------------------------------------------------- entry point
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
) -> Path | None:
    """Export a prepared model by ``save_format`` (``real``, ``fake``, ``save_kvcache_only``,
    ``real_and_kvcache``) to ``out_dir``; returns the directory (None on non-main processes).

    Everything that can be checked is checked before writing: the format, that the model holds
    `QuantLinear` layers of ``scheme``, that compressed-tensors can represent the scheme
    (`compressed_tensors_format`), the target directory (non-empty is an error unless
    ``overwrite``). ``ignore`` adds entries to the checkpoint's ignore list (the unquantized
    linears, embeddings and routers are always listed). ``modules`` / ``is_main_process``: see
    `export_tensors`; every process iterates, only the main one writes.
    """
    if save_format not in SAVE_FORMATS:
        raise ExportError(f"save_format must be one of {', '.join(SAVE_FORMATS)}; got {save_format!r}")
    _check_model(model, scheme, save_format)
    fmt = (
        compressed_tensors_format(scheme, w4a8_activation=w4a8_activation)
        if save_format in ("real", "real_and_kvcache")
        else None
    )
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
    if save_format == "fake":
        info["note"] = (
            "weights are dequantize(quantize(W)); activation / KV-cache quantization is not represented"
        )

    weights = {"real": "real", "real_and_kvcache": "real", "fake": "fake"}.get(save_format)
    want_kv = save_format in ("save_kvcache_only", "real_and_kvcache")
    # A `fake` save is also a warm-start / resume checkpoint (`resume_ckpt_dir`): it carries the
    # scales in the PTQ key format + quant_scheme.json. Plain in-memory models only: the ZeRO-3
    # path (`modules`) streams each layer once, for the weights.
    resume_scales = scale_state_dict(model) if save_format == "fake" and modules is None else None
    state, kv = export_tensors(
        model, weights, fmt, kv=want_kv, modules=modules, verify=verify, keep=is_main_process
    )
    if not is_main_process:
        return None
    with target as tmp:
        if weights is not None:
            model.save_pretrained(str(tmp), state_dict=state)
            if fmt is not None:
                from compressed_tensors.compressors import ModelCompressor

                ModelCompressor(
                    quantization_config=quantization_config(model, fmt, ignore=ignore)
                ).update_config(str(tmp))
            if tokenizer is not None:
                tokenizer.save_pretrained(str(tmp))
        if want_kv:
            save_file(kv, str(tmp / KV_SCALES_FILE), metadata={"format": "pt"})
        if resume_scales:
            save_file(
                resume_scales,
                str(tmp / SCALES_FILE),
                metadata={"format": "pt", "qatlib": "fake-export-scales"},
            )
            write_json(tmp / SCHEME_FILE, scheme.to_dict())
        write_json(tmp / EXPORT_INFO_FILE, info, sort_keys=True)
    log.info("exported %s (%s) to %s", scheme.name, save_format, out_dir)
    return Path(out_dir)
