"""The runtime emulator's FP4 family (NVFP4 / MXFP4 exports), split from `emulate` by format.

What vLLM 0.33 does at load and at run time with a compressed-tensors FP4 checkpoint:

- NVFP4 dense (schemes/compressed_tensors_w4a4_nvfp4.py:100-135): the fused shards' stored
  ``weight_global_scale`` values become ONE, their max; the codes and the E4M3 group scales stay
  as stored, so a shard whose own global scale was smaller dequantizes scaled by
  ``own / max`` (< 1). W4A4: ``input_global_scale`` likewise -> the max; the GEMM computes
  ``alpha * sum(x_code * x_e4m3 * w_code * w_e4m3)`` with ``alpha = 1 / (gs_in * gs_w)``.
- NVFP4 MoE (compressed_tensors_moe_w4a4_nvfp4.py:223-231): one w13 global scale per expert, the
  gate's (``w13_weight_global_scale[:, 0]``); the up shard takes it.
- MXFP4: E8M0 group scales, nothing collapses (no global scale).
- Below SM100 (``capability`` < 10.0) a W4A4 checkpoint is served weight-only by Marlin: the
  activations are not quantized (`facts.Transform.FP4_ACTIVATIONS_UNQUANTIZED`).

The products ``code * e4m3`` / ``code * 2**e`` are exact in fp32 (and in bf16), so the weights
are rebuilt exactly; the global scale is applied after the fp32 GEMM as the kernels' epilogue
does. Rounding primitives (E2M1, E4M3 scales, MX scales) are `qatlib.quant.functional`'s,
tested against compressed-tensors' own quantize / dequantize.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as TF
from torch import nn

from ..quant import functional as F
from .facts import Layout, Transform
from .fusion import DENSE_FUSED, FusedGroup

NATIVE_FP4 = 10.0  # SM100: the first compute capability with FP4 tensor cores (CUTLASS / FlashInfer)


@dataclass
class StoredFP4:
    """One FP4 linear as stored: E2M1 codes (fp32 values), group scales as fp32 values (E4M3 or
    ``2**e``), the NVFP4 weight / input global scales (compressed-tensors' ``448 * 6 / amax``)."""

    codes: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor | None
    input_global_scale: torch.Tensor | None
    group_size: int


def read_fp4(t: dict[str, torch.Tensor], name: str, qtype: str) -> StoredFP4:
    """The stored tensors of ``name`` (compressed-tensors' own unpacking of the E2M1 nibbles)."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    packed = t[f"{name}.weight_packed"]
    codes = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
    raw = t[f"{name}.weight_scale"]
    if qtype == "mxfp4":  # uint8 E8M0 exponents, bias 127
        scale = torch.exp2(raw.to(torch.int32).float() - 127.0)
    else:
        scale = raw.float()
    gs = t.get(f"{name}.weight_global_scale")
    igs = t.get(f"{name}.input_global_scale")
    return StoredFP4(
        codes,
        scale,
        None if gs is None else gs.float().reshape(()),
        None if igs is None else igs.float().reshape(()),
        codes.shape[1] // scale.shape[1],
    )


def collapse_global_scales(stored: dict[str, StoredFP4], groups: list[FusedGroup], experts: set[str]) -> int:
    """vLLM's max over the fused shards' weight (and input) global scales, codes and group scales
    untouched (compressed_tensors_w4a4_nvfp4.py:100-135). MoE experts: the gate's weight global
    scale for gate and up (compressed_tensors_moe_w4a4_nvfp4.py:223-231). Returns the groups changed
    (counted only where the members disagreed)."""
    n = 0
    for g in groups:
        if g.kind not in DENSE_FUSED or not all(m in stored for m in g.members):
            continue
        members = [stored[m] for m in g.members]
        if any(s.global_scale is None for s in members):
            continue
        if g.members[0] in experts:
            top = members[0].global_scale  # w13_weight_global_scale[:, 0]: the gate's
        else:
            top = torch.stack([s.global_scale for s in members]).max()
        changed = any(not torch.equal(s.global_scale, top) for s in members)
        for s in members:
            s.global_scale = top.clone()
        igs = [s.input_global_scale for s in members]
        if all(v is not None for v in igs):
            itop = torch.stack(igs).max()
            changed |= any(not torch.equal(v, itop) for v in igs)
            for s in members:
                s.input_global_scale = itop.clone()
        n += int(changed)
    return n


def nvfp4_act_codes(x: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """Dynamic NVFP4 input quantization at the input global scale ``gs``: per 16 elements an E4M3
    scale ``e4m3(gs * amax / 6)``, codes ``e2m1(x / (scale / gs))``; returns ``code * scale`` (the
    ``1 / gs`` goes to the GEMM's alpha), fp32."""
    xs = x.float().reshape(*x.shape[:-1], x.shape[-1] // 16, 16)
    s = F.round_e4m3(gs * (xs.abs().amax(-1, keepdim=True) / F.FP4_E2M1_MAX))
    q = F.round_e2m1(torch.clamp(xs / (s / gs), -F.FP4_E2M1_MAX, F.FP4_E2M1_MAX))
    return (q * s).reshape(x.shape)


def mxfp4_act(x: torch.Tensor) -> torch.Tensor:
    """Dynamic MXFP4 input quantization (per 32 elements, the E8M0 scale of the group max by
    compressed-tensors' rule, `functional.mx_scale_from_amax`), fp32 dequantized values."""
    xs = x.float().reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    s = F.mx_scale_from_amax(xs.abs().amax(-1, keepdim=True))
    q = F.round_e2m1(torch.clamp(xs / s, -F.FP4_E2M1_MAX, F.FP4_E2M1_MAX))
    return (q * s).reshape(x.shape)


class DeployedFP4Linear(nn.Module):
    """An FP4 linear as the runtime computes it: ``alpha * (act(x) @ (code * group_scale)^T)``,
    fp32, then the bias and the model dtype (``alpha = 1/gs_w`` weight-only, ``1/(gs_in*gs_w)``
    W4A4 NVFP4, 1 for MXFP4)."""

    def __init__(self, s: StoredFP4, bias, qtype: str, act_quant: bool, out_dtype: torch.dtype) -> None:
        super().__init__()
        w = s.codes * s.scale.repeat_interleave(s.group_size, dim=1)
        self.register_buffer("weight", w)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.qtype, self.act_quant, self.out_dtype = qtype, act_quant, out_dtype
        self.global_scale = s.global_scale  # the deployed weight global scale (after the collapse)
        alpha = torch.ones(())
        if s.global_scale is not None:
            alpha = alpha / s.global_scale
        self.input_global_scale = s.input_global_scale if act_quant else None
        if self.input_global_scale is not None:
            alpha = alpha / self.input_global_scale
        self.register_buffer("alpha", alpha)
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self.output_quantizer = None
        self.output_in_attention = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self.act_quant:
            xf = mxfp4_act(xf) if self.qtype == "mxfp4" else nvfp4_act_codes(xf, self.input_global_scale)
        y = TF.linear(xf, self.weight) * self.alpha
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(self.out_dtype)


def fp4_transforms_applied(
    layout: Layout, capability: str | None, transforms: list[Transform]
) -> tuple[bool, list[Transform]]:
    """(are activations quantized, the transforms that apply at ``capability``): below SM100 a W4A4
    checkpoint runs weight-only (`Transform.FP4_ACTIVATIONS_UNQUANTIZED`); ``capability`` None =
    an SM100+ GPU (the native FP4 path)."""
    w4a4 = layout in (Layout.NVFP4, Layout.MXFP4)
    native = capability is None or float(capability) >= NATIVE_FP4
    out = [t for t in transforms if t is not Transform.FP4_ACTIVATIONS_UNQUANTIZED or not native]
    return w4a4 and native, out


def replace_fp4_linears(
    model: nn.Module,
    tensors: dict[str, torch.Tensor],
    qtype: str,
    layout: Layout,
    target_transforms: list,
    groups: list[FusedGroup],
    experts: set[str],
    capability: str | None,
    dtype: torch.dtype,
) -> list[str]:
    """Swap every FP4 linear of ``model`` for a `DeployedFP4Linear` after ``target``'s load-time
    transformations (``target_transforms``: `facts.transforms` pairs); returns what was applied.
    Raises ValueError where the runtime raises at load (SGLang W4A16: shards' global scales differ)."""
    mods = dict(model.named_modules())
    stored = {
        n: read_fp4(tensors, n, qtype)
        for n, m in mods.items()
        if isinstance(m, nn.Linear) and f"{n}.weight_packed" in tensors
    }
    act, kept = fp4_transforms_applied(layout, capability, [t for t, _ in target_transforms])
    applied = []
    for t, fact in target_transforms:
        if t not in kept or (t is Transform.FP4_GLOBAL_SCALE_MUST_MATCH and act):
            continue  # SGLang's must-match is its W4A16 scheme's (weight-only, W4A4 below SM100)
        if t is Transform.FP4_GLOBAL_SCALE_MUST_MATCH:
            bad = [
                g.parent
                for g in groups
                if g.kind in DENSE_FUSED
                and all(m in stored for m in g.members)
                and len({float(stored[m].global_scale) for m in g.members}) > 1
            ]
            if bad:
                raise ValueError(f"{fact.what}: {', '.join(bad[:3])} [{fact.source}]")
            n = 0
        elif t in (Transform.FP4_GLOBAL_SCALE_MAX, Transform.EXPERT_W13_GLOBAL_SCALE):
            # where the runtime has its own expert rule, each transform collapses its own groups
            # (dense q/k/v, gate/up: FP4_GLOBAL_SCALE_MAX; experts' gate/up: EXPERT_W13_GLOBAL_SCALE)
            if Transform.EXPERT_W13_GLOBAL_SCALE in kept:
                mine = t is Transform.EXPERT_W13_GLOBAL_SCALE
                sel = [g for g in groups if (g.members[0] in experts) == mine]
            else:
                sel = groups
            n = collapse_global_scales(stored, sel, experts)
        else:  # FP4_ACTIVATIONS_UNQUANTIZED (below SM100)
            n = len(stored)
        applied.append(f"{t.value}: {n} [{fact.source}]")
    for name, s in stored.items():
        parent, _, child = name.rpartition(".")
        setattr(mods[parent], child, DeployedFP4Linear(s, mods[name].bias, qtype, act, dtype))
    return applied


# what `emulate.emulate_export` records as not emulated for an FP4 export
NOT_EMULATED = (
    "GEMM accumulation order (fp32 here)",
    "FlashInfer's MXFP4 activation scale rounding (compressed-tensors' rule here)",
    "NVFP4 W4A4 MoE: the input global scale per expert (max of its gate/up, FlashInfer CUTLASS, "
    "flashinfer_fp4_moe.py:397); the TRT-LLM and emulation backends take one max over all experts "
    "(fused_moe/oracle/nvfp4.py:491-507)",
)
