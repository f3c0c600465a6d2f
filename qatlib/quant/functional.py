"""Quantization arithmetic: qparams, quantize, dequantize and differentiable fake-quantization.

The convention (docs/design.md): ``q = clamp(round(x / s) + z, qmin, qmax)``, ``x ≈ (q - z) * s``;
FP8 E4M3 codes ``q = fp8(clamp(x / s, -448, 448))``, ``x ≈ q * s``. Every computation runs in fp32
whatever the input dtype, and ``fake_quantize(x) == dequantize(quantize(x))`` holds bit-for-bit,
because both run the same fp32 ops in the same order.

Written by hand rather than taken from compressed-tensors because QAT needs what that library's
forward-only helpers do not give: straight-through rounding, LSQ gradients for learnable scales and
zero points, and a selectable clamp gradient.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .spec import FP4_E2M1_MAX, FP8_E4M3_MAX, Granularity, QuantSpec, ScaleFormat, ScaleRule

_FP8 = torch.float8_e4m3fn
# The smallest E4M3 subnormal: compressed-tensors replaces a zero NVFP4 group scale by it
# (`_get_dtype_eps`), so an all-zero group still has a positive scale to divide by.
E4M3_ZERO_SCALE = 0.125
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# --------------------------------------------------------------------------- views
def _grouped(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """View ``x`` so that one scale broadcasts over the last dim of the view.

    per-tensor: x itself (scale [1]); per-channel / per-token: ``[..., K]`` (scale ``[..., 1]``);
    per-group: ``[..., K/g, g]`` (scale ``[..., K/g]`` + unsqueeze); per-head: ``[..., H, K/H]``.
    """
    g = spec.granularity
    if g is Granularity.GROUP:
        k = x.shape[-1]
        if k % spec.group_size:
            raise ValueError(
                f"group_size {spec.group_size} does not divide the last dim {k} of a {tuple(x.shape)} tensor"
            )
        return x.reshape(*x.shape[:-1], k // spec.group_size, spec.group_size)
    if g is Granularity.HEAD:
        h = spec.num_heads
        if h is None:
            raise ValueError("per-head quantization needs num_heads")
        k = x.shape[-1]
        if k % h:
            raise ValueError(f"num_heads {h} does not divide the last dim {k} of a {tuple(x.shape)} tensor")
        return x.reshape(*x.shape[:-1], h, k // h)
    return x


def _expand(scale: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Stored scale shape -> shape that broadcasts against ``_grouped(x)``."""
    if spec.granularity in (Granularity.GROUP, Granularity.HEAD):
        return scale.unsqueeze(-1)
    return scale


def _reduce_dims(xg: torch.Tensor, spec: QuantSpec) -> tuple[int, ...] | None:
    """Dims of ``_grouped(x)`` reduced to one scale; None = all (per-tensor)."""
    g = spec.granularity
    if g is Granularity.TENSOR:
        return None
    if g is Granularity.HEAD and not spec.dynamic:
        # static per-head: one scale per head over every token -> reduce all but the head dim.
        return tuple(d for d in range(xg.dim()) if d != xg.dim() - 2)
    return (xg.dim() - 1,)


def scale_shape(tensor_shape: tuple[int, ...] | torch.Size, spec: QuantSpec) -> tuple[int, ...]:
    """Shape of a STATIC scale for a tensor of ``tensor_shape`` (weights: ``[out, in]``)."""
    g = spec.granularity
    if g is Granularity.TENSOR:
        return (1,)
    if g is Granularity.CHANNEL:
        return (*tuple(tensor_shape)[:-1], 1)
    if g is Granularity.GROUP:
        k = tensor_shape[-1]
        if k % spec.group_size:
            raise ValueError(f"group_size {spec.group_size} does not divide {k}")
        return (*tuple(tensor_shape)[:-1], k // spec.group_size)
    if g is Granularity.HEAD:
        if spec.num_heads is None:
            raise ValueError("per-head quantization needs num_heads")
        return (spec.num_heads,)
    raise ValueError(f"{g.value} scales are dynamic: they have no static shape")


# --------------------------------------------------------------------------- qparams
def qparams_from_range(
    xmin: torch.Tensor, xmax: torch.Tensor, spec: QuantSpec, global_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (and zero point) for observed ranges; shared by observers, LWC and dynamic quant.
    FP4 formats: the stored group scale (`fp4_scale_from_amax`; NVFP4 needs ``global_scale``)."""
    xmin = xmin.float()
    xmax = xmax.float()
    if spec.is_fp4:
        return fp4_scale_from_amax(torch.maximum(xmin.abs(), xmax.abs()), spec, global_scale), None
    if spec.symmetric:
        absmax = torch.maximum(xmin.abs(), xmax.abs())
        scale = absmax / spec.qmax
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return scale, None
    xmin = torch.clamp(xmin, max=0.0)
    xmax = torch.clamp(xmax, min=0.0)
    scale = (xmax - xmin) / (spec.qmax - spec.qmin)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero_point = torch.clamp(torch.round(spec.qmin - xmin / scale), spec.qmin, spec.qmax)
    return scale, zero_point


def observe_range(x: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of ``x`` reduced per scale, in the stored scale shape."""
    xg = _grouped(x.detach().float(), spec)
    dims = _reduce_dims(xg, spec)
    if dims is None:
        return xg.amin().reshape(1), xg.amax().reshape(1)
    keep = spec.granularity is Granularity.CHANNEL or spec.granularity is Granularity.TOKEN
    xmin = xg.amin(dim=dims, keepdim=keep)
    xmax = xg.amax(dim=dims, keepdim=keep)
    return xmin, xmax


def compute_qparams(
    x: torch.Tensor, spec: QuantSpec, global_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 ``(scale, zero_point)`` for ``x`` by absmax (symmetric) or min/max (asymmetric).

    zero_point is None for symmetric formats. Shapes follow docs/design.md. NVFP4 group scales
    are relative to ``global_scale`` (default: `fp4_global_scale` of ``x`` itself).
    """
    if spec.has_global_scale and global_scale is None:
        global_scale = fp4_global_scale(x.detach().abs().amax())
    return qparams_from_range(*observe_range(x, spec), spec, global_scale)


# --------------------------------------------------------------------------- FP4 (E2M1) formats
# Hand-written: torch has no E2M1 cast on CPU (``float4_e2m1fn_x2`` is a packed storage type with
# no conversion), and compressed-tensors' own helpers are forward-only and in place.
def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives), ties to the
    even mantissa (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), saturating
    at +-6: the rounding of compressed-tensors' ``cast_to_fp4`` and of the Blackwell conversion
    instructions. Not differentiable (see `_fp4_round_ste`)."""
    a = x.abs()
    q = torch.where(a > 5.0, 6.0, 4.0)
    q = torch.where(a < 3.5, 3.0, q)
    q = torch.where(a <= 2.5, 2.0, q)
    q = torch.where(a < 1.75, 1.5, q)
    q = torch.where(a <= 1.25, 1.0, q)
    q = torch.where(a < 0.75, 0.5, q)
    q = torch.where(a <= 0.25, 0.0, q)
    return q * torch.sign(x)


def round_e4m3(s: torch.Tensor) -> torch.Tensor:
    """An NVFP4 group scale rounded to FP8 E4M3 (RNE, saturating at 448); a zero (or underflowed)
    scale becomes `E4M3_ZERO_SCALE`, as compressed-tensors' `calculate_qparams` does."""
    r = torch.clamp(s, -FP8_E4M3_MAX, FP8_E4M3_MAX).to(_FP8).float()
    return torch.where(r == 0, torch.full_like(r, E4M3_ZERO_SCALE), r)


def round_e8m0(s: torch.Tensor) -> torch.Tensor:
    """A learned MX group scale rounded to the nearest power of two in the log domain
    (``2 ** round(log2 s)``, exponent clamped to E8M0's [-127, 127]). A scale initialised by
    `mx_scale_from_amax` is a power of two already and stays exactly where it is."""
    e = torch.round(torch.log2(s.clamp_min(2.0**-127)))
    return torch.exp2(torch.clamp(e, -127.0, 127.0))


def mx_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """The MXFP4 scale of a group with absolute max ``amax``, as compressed-tensors computes it
    (`generate_mx_scales`): the amax is rounded to a power of two, up when its mantissa is
    >= 1.75 (a group max that would saturate far past 6 takes the next exponent), then
    ``scale = 2 ** (floor(log2(p2)) - 2)`` (2 = floor(log2(6)), E2M1's emax), clamped to E8M0.
    OCP MX v1.0 takes ``floor(log2(amax)) - 2`` without the round-up; the two differ only for
    mantissas in [1.75, 2), where OCP's choice clips the group max from >= 7 to 6."""
    a = amax.float().clamp_min(0.0)
    bits = a.view(torch.int32)
    # +0.25 in the mantissa's top bits (1 << (23 - 1 - 1)), then keep sign + exponent only
    p2 = ((bits + (1 << 21)) & torch.tensor(-(1 << 23), dtype=torch.int32)).view(torch.float32)
    e = torch.floor(torch.log2(p2)) - 2.0
    e = torch.clamp(torch.nan_to_num(e, nan=-127.0, neginf=-127.0), -127.0, 127.0)
    return torch.exp2(e)


def mx_ceil_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """The MXFP4 scale of a group with absolute max ``amax`` by upstream FOCUS's ``mxfp4_rceil``
    rule (`ScaleRule.CEIL`): ``2 ** ceil(log2(amax / 6))``, the smallest power of two at which the
    group max does not clip, exponent clamped to E8M0's [-127, 127] (a zero group: 2**-127).
    ``ceil(log2 m)`` is read from the binary exponent (``m = f * 2**e``, ``f`` in [0.5, 1): ``e``,
    or ``e - 1`` when ``f`` is 0.5), exact where ``torch.log2`` rounds a value just above a power of
    two onto it (upstream's ``ceil(log2(.))`` can then clip the group max by one ulp)."""
    m = amax.float().clamp_min(0.0) / FP4_E2M1_MAX
    f, e = torch.frexp(m)
    e = (e - (f == 0.5).to(e.dtype)).float()
    e = torch.where(m > 0, e, torch.full_like(e, -127.0))
    return torch.exp2(torch.clamp(e, -127.0, 127.0))


def fp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """NVFP4's per-tensor global scale, compressed-tensors' convention (`generate_gparam`):
    ``448 * 6 / amax`` (fp32, shape [1]), so that the largest group scale ``gs * amax_g / 6`` lands
    on E4M3's max; 1.0 where amax is 0 / not finite. The effective group scale is
    ``e4m3_scale / global_scale``; checkpoints store exactly this value as ``*_global_scale``."""
    a = torch.clamp(amax.float().reshape(1), min=torch.finfo(torch.float32).tiny)
    gs = FP8_E4M3_MAX * FP4_E2M1_MAX / a
    return torch.nan_to_num(gs, nan=1.0, posinf=1.0, neginf=1.0)


def fp4_scale_from_amax(
    amax: torch.Tensor, spec: QuantSpec, global_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """The stored group scale for group absolute maxima ``amax``: NVFP4 ``e4m3(gs * amax / 6)``
    (the FP8-domain value; divide by ``gs`` for the effective scale), MXFP4 `mx_scale_from_amax`
    (`mx_ceil_scale_from_amax` under `ScaleRule.CEIL`).
    Differentiable in ``amax`` (LWC) through a straight-through rounding."""
    if spec.scale_format is ScaleFormat.E8M0:
        rule = mx_ceil_scale_from_amax if spec.scale_rule is ScaleRule.CEIL else mx_scale_from_amax
        value = rule(amax.detach())
        # straight-through: the gradient of a scale proportional to amax around this value
        ratio = (value / amax.detach().clamp_min(torch.finfo(torch.float32).tiny)).detach()
        return value + (amax - amax.detach()) * ratio
    if global_scale is None:
        raise ValueError(f"{spec.qtype} group scales need the tensor's global scale")
    return _round_scale_ste(global_scale * (amax / FP4_E2M1_MAX), spec)


def _round_scale_ste(scale: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``scale`` rounded to the spec's scale format in the forward, identity gradient (the fp32
    master learns; the forward sees what the checkpoint will store)."""
    fmt = spec.scale_format
    if fmt is ScaleFormat.FP32:
        return scale
    s = scale.float()
    r = round_e4m3(s.detach()) if fmt is ScaleFormat.E4M3 else round_e8m0(s.detach())
    return r + (s - s.detach())


def round_scale(scale: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``scale`` as the checkpoint stores it (E4M3 / E8M0 values as fp32; int / fp8: unchanged)."""
    with torch.no_grad():
        return _round_scale_ste(scale.float(), spec).detach()


def _fp4_round_ste(x: torch.Tensor) -> torch.Tensor:
    return round_e2m1(x.detach()) + _identity_grad(x)


def code_scale(scale: torch.Tensor, spec: QuantSpec, global_scale: torch.Tensor | None) -> torch.Tensor:
    """The scale that multiplies the codes, in the scale parameter's shape: FP4 group scales
    rounded to their format and (NVFP4) divided by the global scale, in compressed-tensors' order
    (``scale / global_scale``, then ``x / that``); the W4A8 kernel's scale; else the scale in fp32.
    What frozen codes are held at (`qatlib.quant.codes`): the codes the model computed then."""
    if spec.w4a8_kernel:
        return w4a8_kernel_scale(scale)
    if not spec.is_fp4:
        return scale.float()
    s = _round_scale_ste(scale.float(), spec)
    if spec.has_global_scale:
        if global_scale is None:
            raise ValueError(f"{spec.qtype} needs its global scale")
        s = s / global_scale.float().reshape(())
    return s


def _effective_scale(scale: torch.Tensor, spec: QuantSpec, global_scale: torch.Tensor | None) -> torch.Tensor:
    """`code_scale` in the grouped view."""
    return _expand(code_scale(scale, spec, global_scale), spec)


def code_divisor(xg: torch.Tensor, s: torch.Tensor, subgroup_scale: torch.Tensor | None, spec: QuantSpec):
    """``xg / s``, the values the codes round (grouped view), or with FOCUS's sub-group scales
    (``spec.subgroups`` factors ``c`` per group, ``subgroup_scale`` shaped ``[..., K / g * n]``)
    ``xg / (s * c)``: each run of ``g / n`` elements divided by its own ``s * c`` (upstream's
    ``tensor / (scale * sigmoid(quant_max_scale))``). The codes are dequantized by ``s`` alone."""
    if subgroup_scale is None:
        if spec.subgroups:
            raise ValueError(f"{spec.describe()}: the sub-group scales are missing")
        return xg / s
    if not spec.subgroups:
        raise ValueError(f"{spec.describe()} has no sub-groups: got sub-group scales")
    n = spec.subgroups
    runs = xg.reshape(*xg.shape[:-1], n, xg.shape[-1] // n)
    c = subgroup_scale.float().reshape(*xg.shape[:-1], n, 1)
    return (runs / (s.unsqueeze(-1) * c)).reshape(xg.shape)


def subgroup_shape(tensor_shape: tuple[int, ...] | torch.Size, spec: QuantSpec) -> tuple[int, ...]:
    """Shape of FOCUS's sub-group scales for a weight of ``tensor_shape``: ``spec.subgroups`` per
    group, ``[out, in / group_size * subgroups]`` (upstream's ``quant_max_scale``)."""
    *lead, groups = scale_shape(tensor_shape, spec)
    return (*lead, groups * spec.subgroups)


# --------------------------------------------------------------------------- STE helpers
# ``value.detach() + (x - x.detach())`` has exactly the value of ``value`` (``x - x.detach()`` is 0)
# and the gradient of ``x``. The textbook ``x + (value - x).detach()`` is not exact once ``x`` is
# far larger than ``value`` (``1e10 + (7 - 1e10)`` is 0 in fp32), which would break
# ``fake_quantize == dequantize(quantize)`` for far out-of-range elements.
def _identity_grad(x: torch.Tensor) -> torch.Tensor:
    return x - x.detach()


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x).detach() + _identity_grad(x)


def _fp8_cast_ste(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to(_FP8).float() + _identity_grad(x)


# --------------------------------------------------------------------------- core ops
def _codes_fp32(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    spec: QuantSpec,
    global_scale: torch.Tensor | None = None,
    subgroup_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Codes as fp32 (differentiable through STE), in the grouped view.

    The clamp is a plain ``torch.clamp``: zero gradient (to x, scale and zero point alike) where it
    is active, so the scale gradient of a clipped element is ``qmin`` / ``qmax`` (LSQ)."""
    xg = _grouped(x.float(), spec)
    s = _effective_scale(scale, spec, global_scale)
    if spec.is_fp4:
        v = code_divisor(xg, s, subgroup_scale, spec)
        return _fp4_round_ste(torch.clamp(v, -FP4_E2M1_MAX, FP4_E2M1_MAX))
    if spec.is_fp8:
        v = xg * s.reciprocal() if spec.scale_reciprocal else xg / s
        return _fp8_cast_ste(torch.clamp(v, -FP8_E4M3_MAX, FP8_E4M3_MAX))
    q = _round_ste(xg / s)
    if zero_point is not None:
        q = q + _round_ste(_expand(zero_point.float(), spec))
    return torch.clamp(q, spec.qmin, spec.qmax)


def _clipped_mask(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    spec: QuantSpec,
    global_scale: torch.Tensor | None = None,
    subgroup_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Elements (grouped view) where the clamp of `_codes_fp32` is active."""
    with torch.no_grad():
        xg = _grouped(x.float(), spec)
        s = _effective_scale(scale, spec, global_scale)
        if spec.is_fp4:
            v = code_divisor(xg, s, subgroup_scale, spec)
            return (v < spec.qmin) | (v > spec.qmax)
        if spec.is_float:
            v = xg * s.reciprocal() if spec.scale_reciprocal else xg / s
            return (v < spec.qmin) | (v > spec.qmax)
        q = torch.round(xg / s)
        if zero_point is not None:
            q = q + torch.round(_expand(zero_point.float(), spec))
        return (q < spec.qmin) | (q > spec.qmax)


def _dequant_fp32(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    spec: QuantSpec,
    global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    s = _effective_scale(scale, spec, global_scale)
    if zero_point is not None and not spec.is_float:
        q = q - _round_ste(_expand(zero_point.float(), spec))
    return q * s


def w4a8_kernel_scale(scale: torch.Tensor) -> torch.Tensor:
    """The int4 group scales ``[N, K/g]`` as vLLM 0.33's CUTLASS W4A8 kernel applies them, with an
    identity gradient: bf16 (the model dtype the kernel requires), then fp8 per output row with an
    fp32 channel factor (``QuantFP8`` per-token: ``c = amax/448``), the fp8 values divided by 8 and
    re-cast, the factor times 8 (quant_utils.py:931-954 ``convert_bf16_scales_to_fp8``,
    kernels/linear/mixed_precision/cutlass.py:66-85). The int4 codes stay exact. Written here
    because no library computes it off-GPU."""
    s = scale.float()
    with torch.no_grad():
        b = s.detach().to(torch.bfloat16).float()
        c = (b.abs().amax(-1, keepdim=True) / FP8_E4M3_MAX).clamp_min(1.0 / (FP8_E4M3_MAX * 512.0))
        # x * (1/c), not x / c: QuantFP8 multiplies by the reciprocal (input_quant_fp8.py:216-220)
        q8 = torch.clamp(b * c.reciprocal(), -FP8_E4M3_MAX, FP8_E4M3_MAX).to(_FP8).float()
        eff = (q8 / 8.0).to(_FP8).float() * (c * 8.0)
    return eff + _identity_grad(s)


def _fp8_recast(x: torch.Tensor) -> torch.Tensor:
    """Per-tensor FP8 recast of an already dequantized tensor (W4A8-FP8 GEMM input), with STE."""
    s = (x.detach().abs().amax() / FP8_E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return _fp8_cast_ste(x / s) * s


def quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    spec: QuantSpec,
    global_scale: torch.Tensor | None = None,
    subgroup_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Codes of ``x``: ``torch.int8`` for every int format (values in [qmin, qmax]),
    ``torch.float8_e4m3fn`` for fp8, the E2M1 values as ``float32`` for nvfp4 / mxfp4 (torch has
    no unpacked FP4 dtype; compressed-tensors packs them at export). Same shape as ``x``.
    ``subgroup_scale``: FOCUS's sub-group factors (`code_divisor`), folded into the codes."""
    with torch.no_grad():
        q = _codes_fp32(x, scale, zero_point, spec, global_scale, subgroup_scale).reshape(x.shape)
    if spec.is_fp4:
        return q
    return q.to(_FP8) if spec.is_fp8 else q.to(torch.int8)


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    spec: QuantSpec,
    dtype: torch.dtype = torch.float32,
    global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(q - z) * s`` (fp8: ``q * s``; fp4: ``q * e4m3/e8m0(s) [/ global_scale]``) computed in
    fp32, returned as ``dtype``.

    ``fp8_recast`` is applied here too, so ``dequantize`` is what the deployed kernel computes."""
    qg = _grouped(q.float(), spec)
    out = _dequant_fp32(qg, scale, zero_point, spec, global_scale).reshape(q.shape)
    if spec.fp8_recast and not spec.w4a8_kernel:
        out = _fp8_recast(out)
    return out.to(dtype)


def fake_quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    spec: QuantSpec,
    *,
    clamp_grad: str = "mask",
    global_scale: torch.Tensor | None = None,
    subgroup_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Differentiable ``dequantize(quantize(x))``, returned in ``x.dtype``.

    FP4 formats: ``scale`` is the fp32 master of the group scale, rounded to E4M3 / E8M0 here
    (straight-through); NVFP4 divides it by ``global_scale`` (differentiable too). FOCUS's
    ``subgroup_scale`` factors ``c`` (``spec.subgroups`` per group) divide ``x`` before the
    rounding and not the codes after, ``s * e2m1(x / (s * c))`` (`code_divisor`): through the STE
    ``d/dx = 1 / c``, ``d/dc = -s * (x / (s c)) / c`` inside the range, 0 where clamped.

    Gradients: straight-through for round and the fp8 cast; for the scale and zero point the
    LSQ / LSQ+ gradients fall out of autograd through the STE (inside the range
    ``d/ds = round(x/s) - x/s``; clamped elements ``qmin`` or ``qmax`` (minus z)).
    ``clamp_grad="mask"`` zeroes the input gradient where the clamp is active (what a true
    quantizer does); ``"pass"`` passes it through everywhere (the upstream toolkit's behaviour).
    ``clamp_grad`` only changes the gradient to ``x``: scale / zero-point gradients are LSQ in both
    modes, and the value is the same bit for bit.
    """
    if clamp_grad not in ("mask", "pass"):
        raise ValueError(f"clamp_grad must be 'mask' or 'pass', got {clamp_grad!r}")
    q = _codes_fp32(x, scale, zero_point, spec, global_scale, subgroup_scale)
    out = _dequant_fp32(q, scale, zero_point, spec, global_scale)
    if clamp_grad == "pass":
        # identity gradient to x where the clamp is active too; adds exactly 0 to the value and
        # leaves the scale / zero-point (LSQ) gradients as they are.
        clipped = _clipped_mask(x, scale, zero_point, spec, global_scale, subgroup_scale)
        out = torch.where(clipped, out + _identity_grad(_grouped(x.float(), spec)), out)
    out = out.reshape(x.shape)
    if spec.fp8_recast and not spec.w4a8_kernel:
        out = _fp8_recast(out)
    return out.to(x.dtype)


def dynamic_fake_quantize(
    x: torch.Tensor,
    spec: QuantSpec,
    *,
    clamp_grad: str = "mask",
    global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fake-quantize with qparams computed from ``x`` itself (dynamic activations).

    The qparams are detached: gradients flow through the rounding STE only, as at inference the
    scale is a function of the data, not a parameter. NVFP4 activations: group scales relative to
    the static ``global_scale`` (the calibrated ``input_global_scale``, learnable), as
    compressed-tensors / vLLM compute them; without one, the global scale of ``x`` itself.
    """
    if x.numel() == 0:
        # An MoE expert that got no tokens still runs (same collectives on every ZeRO-3 rank):
        # an empty input has no range to reduce and nothing to quantize.
        return x
    gs = global_scale
    if spec.has_global_scale and gs is None:
        gs = fp4_global_scale(x.detach().abs().amax())
    with torch.no_grad():
        scale, zp = compute_qparams(x, spec, None if gs is None else gs.detach())
    return fake_quantize(x, scale, zp, spec, clamp_grad=clamp_grad, global_scale=gs)


@functools.cache
def compiled(fn: Callable) -> Callable:
    """``torch.compile(fn)`` (inductor), made once per function: `Quantizer` calls it when
    ``compile_fake_quant`` is on.

    Fusing the elementwise chain of a fake-quant (scale, round / fp8 cast, clamp, rescale) into one
    kernel saves memory passes; on the CPU it measured 0.85x the QAT step for FP8 formats and
    no gain for integer ones (benchmarks/README.md at 2faaa77). Values are bit-identical to eager. Every
    tensor shape and spec is a guard, and MoE experts see varying token counts, so the recompile
    limit is raised (dynamo's default of 8 would silently fall back to eager).
    """
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
    return torch.compile(fn, dynamic=None)


def fp8_cast_ste(x: torch.Tensor) -> torch.Tensor:
    """Cast to FP8 E4M3 and back (no scale), straight-through: FP8 attention-probability simulation."""
    return _fp8_cast_ste(x.float()).to(x.dtype)
