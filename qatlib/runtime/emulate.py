"""The runtime emulator: the model vLLM / SGLang compute from an export, in plain PyTorch on CPU.

A transformers + compressed-tensors reload is not what a runtime serves: at load time the runtime
collapses fused shards' scales, quantizes activations at its own granularity, keeps scales in the
model dtype, re-encodes W4A8 group scales, maps KV scales (`qatlib.runtime.facts`). The emulator
reads the export's codes and scales from disk, applies exactly the transformations
`facts.transforms(target, layout)` lists (each a small function below naming the runtime line it
mirrors) and replaces every quantized linear with a `DeployedLinear` that computes with the
deployed codes, scales and activation quantization, MoE experts included (the transformers reload
fuses the experts and skips their activation quantization).

The skeleton (embeddings, norms, router, lm_head) is the transformers reload with
``CompressedTensorsConfig(dequantize=True)``; the quantized linears' weights are rebuilt from the
stored codes (compressed-tensors' own ``unpack_from_int32`` for packed formats), never from the
dequantized reload, so the requantization sees the exact fp8 / int codes the runtime loads.

FP4 exports: `qatlib.runtime.emulate_fp4`. The runtimes' own fp8 format (``quant_method: fp8``,
upstream's ``save_name: fp8``: `facts.Layout.FP8_NATIVE_STATIC` / ``_DYNAMIC``) holds the
compressed-tensors fp8 tensors and takes its own facts (dense inputs per token where CUTLASS fp8
runs, the experts' per tensor).

Not emulated (recorded in `DeployedModel.not_emulated`): kernel accumulation order, the CUTLASS W4A8
kernel's in-register product precision, SGLang fused-MoE per-tensor dynamic activations being
taken over the whole layer input (emulated per expert), the int8 asymmetric zero-point truncation
(runtime-contract D9).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as TF
from torch import nn

from ..quant.spec import FP4_FORMATS, CheckpointFormat, QuantScheme
from .cpu_int8 import INT8_GEMMS, NO_VNNI, Int8Gemm, int8_linear
from .facts import (
    TARGETS,
    Layout,
    Transform,
    dtype_refusal,
    expert_input_scale_refusal,
    kv_facts,
    layout_of,
    load_refusal,
    transforms,
    w4a8_kernel_refusal,
)
from .fusion import DENSE_FUSED, FusedGroup, GroupKind, fused_groups

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
# vLLM input_quant_fp8.py:25: the smallest dynamic scale (an all-zero token still gets one)
FP8_MIN_SCALING_FACTOR = 1.0 / (FP8_MAX * 512.0)


class RuntimeRefusal(ValueError):
    """The target runtime would refuse this export at load (the message names the runtime line)."""


# --------------------------------------------------------------------------- activation quantizers
def fp8_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Static fp8 quant-dequant: ``x * (1/s)`` saturated to ±448, cast to E4M3, times ``s``
    (vLLM ``QuantFP8.forward_native`` static path, input_quant_fp8.py:212-221; the KV cache write
    ``scaled_convert`` saturates the same way). ``scale``: a scalar, or per head broadcastable."""
    s = scale.float()
    return ((x.float() * s.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * s).to(x.dtype)


def fp8_per_token(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token fp8: scale ``amax(token) / 448`` clamped at ``1/(448*512)``
    (vLLM input_quant_fp8.py:203-221, ``kFp8DynamicTokenSym``)."""
    s = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=FP8_MIN_SCALING_FACTOR)
    return fp8_static(x, s)


def fp8_per_tensor_dynamic(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-tensor fp8 (input_quant_fp8.py:209-211): one scale over the whole call's input."""
    s = (x.abs().amax().float() / FP8_MAX).clamp(min=FP8_MIN_SCALING_FACTOR)
    return fp8_static(x, s)


def int8_codes(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None = None) -> torch.Tensor:
    """Static int8 codes: ``round(x / s) + z`` clamped to [-128, 127] (round half to even, CUDA
    ``float_to_int8_rn``; vLLM ``scaled_int8_quant``, _custom_ops.py), as float."""
    z = 0.0 if zero_point is None else zero_point.float()
    return (torch.round(x.float() / scale.float()) + z).clamp(-128, 127)


def int8_static(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None = None) -> torch.Tensor:
    """Static int8 quant-dequant: `int8_codes` less ``z``, times ``s``."""
    z = 0.0 if zero_point is None else zero_point.float()
    return ((int8_codes(x, scale, zero_point) - z) * scale.float()).to(x.dtype)


def int8_token_scale(x: torch.Tensor) -> torch.Tensor:
    """The dynamic per-token symmetric int8 scale ``amax(token) / 127`` (1 for an all-zero token)."""
    s = x.abs().amax(dim=-1, keepdim=True).float() / 127.0
    return torch.where(s == 0, torch.ones_like(s), s)


def int8_per_token(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token symmetric int8 at `int8_token_scale` (vLLM ``scaled_int8_quant`` with
    ``scale=None``, the ``kInt8DynamicTokenSym`` path of schemes/w8a8_int8.py)."""
    return int8_static(x, int8_token_scale(x))


# --------------------------------------------------------------------------- weights
def requantize_with_max_scale(codes: list[torch.Tensor], scales: list[torch.Tensor]) -> list[torch.Tensor]:
    """Fused fp8 shards at ONE scale, the max: each shard dequantized in fp16 (``per_tensor_dequantize``)
    and re-quantized at the max (``scaled_fp8_quant``). Mirrors vLLM w8a8_utils.py:75-106
    (``requantize_with_max_scale``, dense q/k/v, gate/up) and fp8_utils.py:1537-1567 (each expert's
    w1/w3); SGLang SG CT schemes/w8a8_fp8.py:149. Returns the new fp8 codes (as float)."""
    top = torch.stack([s.float().reshape(()) for s in scales]).max()
    out = []
    for c, s in zip(codes, scales):
        dq = c.to(torch.float16) * s.float().reshape(())  # fp16 x fp32 0-d -> fp16, as vLLM
        out.append((dq.float() * top.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(FP8).float())
    return out


def w4a8_group_scales(scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The effective int4 group scales of vLLM's CUTLASS W4A8 kernel: the scale is held in the
    model dtype (``params_dtype``, w4a8_fp8.py:129-136), then quantized to fp8 per output row by
    ``QuantFP8`` per-token (channel factor ``c = amax(row)/448``), divided by 8 and cast to fp8
    again, ``c`` times 8 (``convert_bf16_scales_to_fp8``, quant_utils.py:931-954; called from
    kernels/linear/mixed_precision/cutlass.py:80-85). Returns ``fp8_scale * chan_scale`` in fp32."""
    s = scales.to(dtype)
    c = (s.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=FP8_MIN_SCALING_FACTOR)
    q = (s.float() * c.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    q = (q.float() / 8.0).to(FP8)
    return q.float() * (c * 8.0)


def _expand(scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A [1] / [N,1] / [N,G] scale (or zero point) broadcast to the weight's [N,K]."""
    n, k = shape
    s = scale.float()
    if s.numel() == 1:
        return s.reshape(1, 1)
    if s.dim() == 2 and s.shape[1] > 1:
        return s.repeat_interleave(-(-k // s.shape[1]), dim=1)[:, :k]
    return s.reshape(n, 1)


@dataclass
class Stored:
    """One quantized linear as stored: codes (float, exact), scale, zero point, static input qparams."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None
    input_zero_point: torch.Tensor | None = None
    weight_dtype: torch.dtype | None = (
        None  # dequantize in this dtype (WNA16: Marlin runs in the model dtype)
    )


def _read_stored(t: dict[str, torch.Tensor], name: str, wargs: dict) -> Stored:
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    if f"{name}.weight_packed" in t:
        shape = torch.Size(t[f"{name}.weight_shape"].tolist())
        bits = int(wargs["num_bits"])
        codes = unpack_from_int32(t[f"{name}.weight_packed"], bits, shape).float()
        zp = t.get(f"{name}.weight_zero_point")
        if zp is not None and zp.dtype == torch.int32:
            groups = t[f"{name}.weight_scale"].shape[-1]
            zp = unpack_from_int32(zp, bits, torch.Size((shape[0], groups)), packed_dim=0)
    else:
        codes = t[f"{name}.weight"].float()
        zp = t.get(f"{name}.weight_zero_point")
    return Stored(
        codes=codes,
        scale=t[f"{name}.weight_scale"].float(),
        zero_point=None if zp is None else zp.float(),
        input_scale=t.get(f"{name}.input_scale"),
        input_zero_point=t.get(f"{name}.input_zero_point"),
    )


class DeployedLinear(nn.Module):
    """A linear as the runtime computes it: ``act(x)`` against the deployed weight
    ``(codes - z) * s``, output in the model dtype. ``act``: one of the activation functions above,
    or None (weight-only). The GEMM runs in the weight's dtype: fp32 for the fp8 / int8 / W4A8
    kernels (exact products of codes, fp32 accumulation and scaling), the model dtype for WNA16
    (Marlin / Machete: a bf16 MMA with fp32 accumulation, as torch's bf16 CPU GEMM)."""

    def __init__(
        self,
        w: torch.Tensor,
        bias: torch.Tensor | None,
        act,
        out_dtype: torch.dtype,
        *,
        weight_scale: torch.Tensor | None = None,
        input_scale: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.register_buffer("weight", w)
        # the deployed scales the weight and ``act`` were built from (read by `qatlib.runtime.check`)
        self.weight_scale, self.input_scale = weight_scale, input_scale
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.act = act
        self.out_dtype = out_dtype
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self.output_quantizer = None  # KV / query fp8 (applied inside attention, `quant.attention`)
        self.output_in_attention = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if self.act is not None:
            # an fp32 kernel applies the activation scale in its fp32 epilogue: x_deq not rounded
            x = self.act(x.to(w.dtype) if w.dtype == torch.float32 else x)
        b = None if self.bias is None else self.bias.to(w.dtype)
        return TF.linear(x.to(w.dtype), w, b).to(self.out_dtype)


class Int8DeployedLinear(DeployedLinear):
    """A W8A8-INT8 linear computed from codes with ``int8_gemm`` (`qatlib.runtime.cpu_int8`): the
    activation codes (per token, or at the static input scale / zero point) against the stored
    weight codes, ``(fp32(acc) * w_s) * x_s`` (+ bias), vLLM-CPU's oneDNN epilogue order."""

    def __init__(self, s: Stored, bias, out_dtype: torch.dtype, int8_gemm: Int8Gemm, static: bool) -> None:
        if s.zero_point is not None:
            raise RuntimeRefusal("int8_gemm: the int8 GEMM models symmetric weights only")
        super().__init__(
            deployed_weight(s), bias, None, out_dtype, weight_scale=s.scale,
            input_scale=s.input_scale if static else None,
        )  # fmt: skip
        self.register_buffer("codes", s.codes)
        self.input_zero_point = s.input_zero_point if static else None
        self.int8_gemm = int8_gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).float()
        z = None if self.input_zero_point is None else self.input_zero_point.float().reshape(())
        s = int8_token_scale(x2) if self.input_scale is None else self.input_scale.float().reshape(())
        y = int8_linear(int8_codes(x2, s, z), s, self.codes, self.weight_scale, self.int8_gemm, z)
        y = y if self.bias is None else y + self.bias.float()
        return y.reshape(*x.shape[:-1], -1).to(self.out_dtype)


class StaticFP8(nn.Module):
    """fp8 quant-dequant of ``[B, T, H*D]`` attention states at a per-tensor or per-head scale."""

    def __init__(self, scale: torch.Tensor, heads: int) -> None:
        super().__init__()
        self.register_buffer("scale", scale.float().reshape(-1))
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale.numel() == 1:
            return fp8_static(x, self.scale.reshape(()))
        b, t, hd = x.shape
        y = fp8_static(x.reshape(b, t, self.heads, hd // self.heads), self.scale.reshape(-1, 1))
        return y.reshape(b, t, hd)


# --------------------------------------------------------------------------- the transformations
def _apply_weight_scale_max(stored: dict[str, Stored], groups: list[FusedGroup]) -> int:
    n = 0
    for g in groups:
        if g.kind in DENSE_FUSED and all(m in stored for m in g.members):
            members = [stored[m] for m in g.members]
            if any(s.scale.numel() != 1 for s in members):
                continue
            new = requantize_with_max_scale([s.codes for s in members], [s.scale for s in members])
            top = torch.stack([s.scale.reshape(()) for s in members]).max().reshape(1)
            for s, c in zip(members, new):
                s.codes, s.scale = c, top.clone()
            n += 1
    return n


def _apply_input_scale(stored: dict[str, Stored], groups: list[FusedGroup], kinds: set, pick: str) -> int:
    """One static input scale per fused group: the max over members (vLLM CT w8a8_fp8.py:185-186,
    experts fp8_utils.py:1570-1585; SG CT w8a8_fp8.py:234-235, w8a8_fp8_moe.py:242-260) or the
    last-loaded shard's (vLLM int8, ``BasevLLMParameter(1)``, parameter.py:91-107)."""
    n = 0
    for g in groups:
        if g.kind not in kinds or not all(
            m in stored and stored[m].input_scale is not None for m in g.members
        ):
            continue
        members = [stored[m] for m in g.members]
        if pick == "max":
            s = torch.stack([m.input_scale.float().reshape(()) for m in members]).max().reshape(1)
            zp = None
        else:
            s, zp = members[-1].input_scale.float().reshape(1), members[-1].input_zero_point
        for m in members:
            m.input_scale = s.clone()
            if pick != "max":
                m.input_zero_point = zp
        n += 1
    return n


def _apply_scale_dtype(stored: dict[str, Stored], dtype: torch.dtype) -> int:
    """Weight scales held in the model dtype (vLLM CT compressed_tensors_wNa16.py:188-196,
    w4a8_fp8.py:129-136; SG CT wNa16.py:55-58): WNA16 also dequantizes in that dtype (Marlin)."""
    for s in stored.values():
        s.scale = s.scale.to(dtype).float()
        s.weight_dtype = dtype
    return len(stored)


def _apply_w4a8_scales(stored: dict[str, Stored], dtype: torch.dtype) -> int:
    for s in stored.values():
        s.scale = w4a8_group_scales(s.scale, dtype)
        s.weight_dtype = None  # the kernel multiplies in fp32 after the fp8 scale path
    return len(stored)


def deployed_weight(s: Stored) -> torch.Tensor:
    """``(codes - z) * s`` in fp32, or rounded to ``s.weight_dtype`` (Marlin / Machete dequantize
    to the model dtype in registers before the MMA)."""
    z = 0.0 if s.zero_point is None else _expand(s.zero_point, s.codes.shape)
    w = (s.codes - z) * _expand(s.scale, s.codes.shape)
    return w.float() if s.weight_dtype is None else w.to(s.weight_dtype)


# --------------------------------------------------------------------------- the model
@dataclass
class DeployedModel:
    """``model``: what ``target`` computes; ``applied``: each transformation with the count of
    groups / layers it touched and its source; ``not_emulated``: what the emulator leaves out."""

    model: nn.Module
    target: str
    layout: Layout
    applied: list[str] = field(default_factory=list)
    not_emulated: list[str] = field(default_factory=list)


def _read_tensors(d: Path) -> dict[str, torch.Tensor]:
    """The export's tensors, read by qatlib's reader (plain file reads, no mapped file)."""
    from ..checkpoint.safetensors import read_all

    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{d}: no *.safetensors (not an export folder)")
    return read_all(files)


def _skeleton(d: Path) -> nn.Module:
    """The model of ``config.json`` with the checkpoint's unquantized tensors (embeddings, norms,
    routers, lm_head) and MoE experts linearised to the per-expert names the checkpoint uses.

    Not ``from_pretrained``: transformers 5.24 fuses the per-expert keys on load and cannot fuse
    int-quantized ones (``torch.cat(): expected a non-empty list`` on an int8 W8A8 Qwen3-MoE export);
    the quantized linears are rebuilt from their codes below anyway. Every parameter the model has
    and that is not a quantized linear's weight must be in the checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..surgery.moe import linearize_moe_experts

    config = AutoConfig.from_pretrained(d)
    config.quantization_config = None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, torch_dtype=config.dtype).eval()
    linearize_moe_experts(model)
    sd = _read_tensors(d)
    plain = {k: v for k, v in sd.items() if v.is_floating_point() and v.dtype != FP8}
    missing, _ = model.load_state_dict(plain, strict=False)
    quantized = {k.removesuffix("_scale") for k in sd if k.endswith(".weight_scale")}
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
        quantized.add("lm_head.weight")
    missing = [k for k in missing if k not in quantized]
    if missing:
        more = " ..." if len(missing) > 4 else ""
        raise RuntimeRefusal(f"{d}: the checkpoint lacks {', '.join(missing[:4])}{more}")
    return model


def _config_args(qc: dict) -> tuple[dict, dict | None]:
    """(weight args, input args) of a compressed-tensors header; the runtimes' own fp8 format
    (``quant_method: fp8``) has none: its tensors are unpacked."""
    if qc.get("quant_method") == CheckpointFormat.FP8.value:
        return {}, None
    groups = list(qc.get("config_groups", {}).values())
    if len(groups) != 1:
        raise RuntimeRefusal(f"quantization_config.config_groups: expected one group, found {len(groups)}")
    return groups[0]["weights"], groups[0].get("input_activations")


def _export_layout(d: Path, qc: dict) -> tuple[Layout, QuantScheme]:
    from ..checkpoint.layout import EXPORT_INFO_FILE

    info_path = d / EXPORT_INFO_FILE
    if not info_path.is_file():
        raise FileNotFoundError(f"{info_path}: missing (the emulator reads the trained scheme from it)")
    scheme = QuantScheme.from_dict(json.loads(info_path.read_text())["scheme"])
    if (qc.get("quant_method") == CheckpointFormat.FP8.value) != (
        scheme.checkpoint_format is CheckpointFormat.FP8
    ):
        raise RuntimeRefusal(
            f"{d}: config.json's quant_method {qc.get('quant_method')!r} is not the scheme's format"
        )
    _, act = _config_args(qc)
    runtime_act = act is not None and act.get("dynamic") is True and act.get("strategy") == "token"
    return layout_of(scheme, w4a8_activation="runtime" if runtime_act else "trained"), scheme


_FP8_STATIC = (Layout.FP8_STATIC_TENSOR, Layout.FP8_STATIC_CHANNEL, Layout.FP8_NATIVE_STATIC)
_STATIC_INPUT = (*_FP8_STATIC, Layout.INT8_STATIC)


def _activation(layout: Layout, s: Stored, per_token: bool):
    """The runtime's activation quantization of one linear (None: weight-only)."""
    if layout in _FP8_STATIC:
        scale = s.input_scale.float().reshape(())
        return lambda x: fp8_static(x, scale)
    if layout in (Layout.FP8_DYNAMIC_TENSOR, Layout.FP8_NATIVE_DYNAMIC):
        return fp8_per_token if per_token else fp8_per_tensor_dynamic
    if layout in (Layout.FP8_DYNAMIC_TOKEN, Layout.W4A8):
        return fp8_per_token
    if layout is Layout.INT8_DYNAMIC:
        return int8_per_token
    if layout is Layout.INT8_STATIC:
        scale, zp = s.input_scale.float().reshape(()), s.input_zero_point
        return lambda x: int8_static(x, scale, None if zp is None else zp.float().reshape(()))
    return None


def emulate_export(
    export_dir: str | Path,
    target: str,
    *,
    fa3: bool = True,
    capability: str | None = None,
    int8_gemm: Int8Gemm = "exact",
) -> DeployedModel:
    """The model ``target`` (``vllm`` / ``sglang``) computes from ``export_dir``.

    ``fa3``: vLLM's attention backend is FlashAttention 3 (Hopper), which also quantizes the
    queries to fp8 when the KV cache is fp8. ``capability`` (``"9.0"``, ``deploy.capability``): the
    GPU's; below ``"10.0"`` an FP4 W4A4 export runs weight-only; None: not checked (FP4: the
    native SM100 path). ``int8_gemm`` (W8A8-INT8 exports): ``"exact"`` int32 arithmetic (GPU,
    VNNI CPUs) or ``"pair_saturating"``, vllm-cpu's oneDNN GEMM on a CPU without int8 VNNI
    (`cpu_int8.NO_VNNI`, `cpu_int8.engine_int8_gemm`). Raises `RuntimeRefusal` for an export the target
    refuses at load (`facts.load_refusal`, the W4A8 kernel limits, SGLang's differing FP4 global scales)."""
    from ..quant.attention import enable_qkv_quantization

    if target not in TARGETS:
        raise ValueError(f"target must be one of {', '.join(TARGETS)}; got {target!r}")
    if int8_gemm not in INT8_GEMMS:
        raise ValueError(f"int8_gemm must be one of {', '.join(INT8_GEMMS)}; got {int8_gemm!r}")
    d = Path(export_dir)
    cfg = json.loads((d / "config.json").read_text())
    qc = cfg.get("quantization_config")
    if qc is None:  # a `fake` export / plain checkpoint: the runtime serves it unquantized
        model = _skeleton(d)
        return DeployedModel(model, target, Layout.OTHER, ["unquantized checkpoint: computed as stored"])
    layout, scheme = _export_layout(d, qc)
    fp4 = scheme.weight is not None and scheme.weight.qtype in FP4_FORMATS
    moe = any(k in cfg for k in ("num_experts", "num_local_experts"))
    refusal = load_refusal(target, layout, moe=moe, capability=capability)
    model_dtype = getattr(torch, str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"))
    refusal = refusal or dtype_refusal(target, layout, model_dtype)
    if refusal is not None:  # before anything is loaded
        raise RuntimeRefusal(
            f"{TARGETS[target]} cannot load {d} ({layout.value}): {refusal.what} [{refusal.source}]"
        )
    model = _skeleton(d)
    tensors = _read_tensors(d)
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    wargs, _ = _config_args(qc)
    mods = dict(model.named_modules())
    groups = fused_groups(model)
    experts = {m for g in groups if g.kind is GroupKind.MOE_LAYER for m in g.members}
    if fp4:  # emulate_fp4 (it imports nothing from here)
        from .emulate_fp4 import NOT_EMULATED, replace_fp4_linears

        out = DeployedModel(model, target, layout, not_emulated=list(NOT_EMULATED))
        try:
            out.applied = replace_fp4_linears(
                model, tensors, scheme.weight.qtype, layout, transforms(target, layout), groups, experts,
                capability, dtype,
            )  # fmt: skip
        except ValueError as e:  # SGLang W4A16: the shards' global scales differ
            raise RuntimeRefusal(f"{TARGETS[target]} cannot load {d} ({layout.value}): {e}") from None
        return out
    stored = {
        n: _read_stored(tensors, n, wargs)
        for n, m in mods.items()
        if isinstance(m, nn.Linear) and f"{n}.weight_scale" in tensors
    }
    if layout is Layout.W4A8:
        shapes = [s.codes.shape for n, s in stored.items() if n not in experts]
        eshapes = [s.codes.shape for n, s in stored.items() if n in experts]
        group = int(wargs.get("group_size") or -1)
        refusal = w4a8_kernel_refusal(target, shapes, group, dtype, eshapes)
        if refusal is not None:
            raise RuntimeRefusal(
                f"{TARGETS[target]} cannot run {d} ({layout.value}): {refusal.what} [{refusal.source}]"
            )
    pairs = [
        (g.parent, stored[g.members[0]].input_scale, stored[g.members[1]].input_scale)
        for g in groups
        if g.kind is GroupKind.GATE_UP
        and g.members[0] in experts
        and all(m in stored and stored[m].input_scale is not None for m in g.members)
    ]
    refusal = expert_input_scale_refusal(target, layout, pairs)
    if refusal is not None:
        raise RuntimeRefusal(
            f"{TARGETS[target]} cannot load {d} ({layout.value}): {refusal.what} [{refusal.source}]"
        )
    out = DeployedModel(model, target, layout)
    per_token = False
    for t, fact in transforms(target, layout):
        if t is Transform.WEIGHT_SCALE_MAX:
            n = _apply_weight_scale_max(stored, groups)
        elif t is Transform.EXPERT_WEIGHT_SCALE_MAX:
            n = _apply_weight_scale_max(stored, [g for g in groups if g.members[0] in experts])
        elif t is Transform.INPUT_SCALE_MAX:
            n = _apply_input_scale(stored, groups, set(DENSE_FUSED), "max")
        elif t is Transform.INPUT_SCALE_LAST:
            n = _apply_input_scale(stored, groups, set(DENSE_FUSED), "last")
        elif t is Transform.EXPERT_INPUT_SCALE_MAX:
            n = _apply_input_scale(stored, groups, {GroupKind.EXPERTS_W13, GroupKind.EXPERTS_W2}, "max")
        elif t is Transform.DYNAMIC_PER_TOKEN:
            per_token, n = True, sum(1 for m in stored if m not in experts)
        elif t is Transform.SCALE_MODEL_DTYPE:
            n = _apply_scale_dtype(stored, dtype)
        else:  # Transform.W4A8_FP8_GROUP_SCALES
            n = _apply_w4a8_scales(stored, dtype)
        out.applied.append(f"{t.value}: {n} [{fact.source}]")
    from_codes = int8_gemm != "exact" and layout in (Layout.INT8_DYNAMIC, Layout.INT8_STATIC)
    for name, s in stored.items():
        lin = mods[name]
        # vLLM / SGLang: dynamic per-token on dense layers only; SGLang's fused MoE keeps per-tensor
        act = _activation(layout, s, per_token and name not in experts)
        parent, _, child = name.rpartition(".")
        static = s.input_scale if layout in _STATIC_INPUT else None
        if from_codes:
            deployed = Int8DeployedLinear(s, lin.bias, dtype, int8_gemm, static is not None)
        else:
            deployed = DeployedLinear(
                deployed_weight(s), lin.bias, act, dtype, weight_scale=s.scale, input_scale=static
            )
        setattr(mods[parent], child, deployed)
    if from_codes:
        out.applied.append(f"int8 GEMM {int8_gemm}: {len(stored)} linears [{NO_VNNI.source}]")
    out.applied += _kv_cache(model, cfg, qc, tensors, target, moe, fa3)
    if any(getattr(m, "output_in_attention", False) for m in model.modules()):
        enable_qkv_quantization(model)
    out.not_emulated = [
        "GEMM accumulation order (fp32 here)",
        "the CUTLASS W4A8 kernel's in-register int4 x fp8-scale product (exact here)",
        "SGLang fused-MoE dynamic per-tensor scales over the whole layer input (per expert call here)",
        "int8 asymmetric static zero point truncated by the runtime (runtime-contract D9)",
        "an expert's gate / up input scales within vLLM's 1e-5 tolerance: vLLM keeps the last loaded (up) "
        "before the max over experts (the max of both here)",
    ]
    return out


def _kv_cache(model, cfg, qc, tensors, target, moe, fa3) -> list[str]:
    """fp8 KV cache at the exported k/v scales (and vLLM's FA3 query quantization), as ``target``
    maps them; returns what was applied. Facts: `facts.kv_facts`."""
    kv = qc.get("kv_cache_scheme")
    if not kv:
        return []
    per_head = kv.get("strategy") == "attn_head"
    if target == "sglang" and per_head:  # SG CT compressed_tensors.py:212-224: ignored, cache bf16
        return [f"KV cache: {f.what} [{f.source}]" for f in kv_facts(target, per_head=True, moe=moe)]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    applied, n = [], 0
    for name, attn in model.named_modules():
        key = f"{name}.attn.k_scale"
        if not hasattr(attn, "k_proj") or f"{name}.k_scale" not in tensors:
            continue
        for r in "kv":
            # SGLang Qwen3-MoE finds only `<attn>.attn.k_scale` (qwen3_moe.py:1157-1270, no remap);
            # without it the fp8 cache runs at 1.0 (layers/quantization/kv_cache.py:59-63)
            k = key.replace("k_scale", f"{r}_scale")
            scale = tensors.get(k) if (target == "sglang" and moe) else tensors.get(f"{name}.{r}_scale")
            scale = torch.ones(1) if scale is None else scale
            _attach(getattr(attn, f"{r}_proj"), StaticFP8(scale, kv_heads if scale.numel() > 1 else 1))
        if target == "vllm" and fa3:  # attention.py:470-526: q at q_scale (default 1.0) under FA3
            q = tensors.get(f"{name}.q_scale", torch.ones(1))
            _attach(attn.q_proj, StaticFP8(q, heads if q.numel() > 1 else 1))
        n += 1
    applied.append(f"KV cache fp8 ({kv.get('strategy')}) at the exported k/v scales: {n} attention layers")
    applied += [f"KV cache: {f.what} [{f.source}]" for f in kv_facts(target, per_head=per_head, moe=moe)]
    return applied


def _attach(proj: nn.Module, quant: nn.Module) -> None:
    proj.output_quantizer = quant
    proj.output_in_attention = True
