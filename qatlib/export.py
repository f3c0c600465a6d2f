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
  ====================================  ==================  =====================================

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
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file
from torch import nn

from . import __version__
from .checkpoint.keys import kv_role, parse_key, scale_state_dict
from .checkpoint.layout import (
    EXPORT_KV_SCALES_FILE,
    FAKE_EXPORT_SCALES_FILE,
    KV_SCALES_FILE,
    SCHEME_FILE,
    AtomicDir,
    write_json,
)
from .checkpoint.st_write import save_tensors
from .export_format import CTFormat, ExportError, compressed_tensors_format
from .quant import QuantLinear, QuantScheme, quant_linears
from .quant import functional as F
from .quant.calibration import prepared_mismatch
from .quant.health import bad_quant_params
from .quant.linear import attention_role, is_router, weight_readable
from .quant.quantizer import Quantizer
from .quant.spec import Granularity

if TYPE_CHECKING:
    from .onload import Onloader

log = logging.getLogger(__name__)

SAVE_FORMATS = ("real", "fake", "save_kvcache_only", "real_and_kvcache")
EXPORT_INFO_FILE = "qatlib_export.json"


@dataclass(frozen=True)
class ExportJob:
    """What `export` settled before writing anything (format checked, target directory checked,
    ``qatlib_export.json``'s content): the inputs the in-memory and the streaming writer
    (`qatlib.export_stream`) share."""

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
    from .runtime.ignore import ignore_problems

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

    ``onload`` (a `qatlib.onload.Onloader` over a skeleton model, `qatlib.models.load_prepared`
    with ``skeleton=True``): the streaming export (`qatlib.export_stream`). Each decoder layer is onloaded in turn, its codes
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
        from .runtime.differences import deployment_differences

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
        from .export_stream import export_streaming

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
        if fmt is not None:
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
