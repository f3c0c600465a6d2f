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

from .spec import FP8_E4M3_MAX, Granularity, QuantSpec

_FP8 = torch.float8_e4m3fn


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
    xmin: torch.Tensor, xmax: torch.Tensor, spec: QuantSpec
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (and zero point) for observed ranges; shared by observers, LWC and dynamic quant."""
    xmin = xmin.float()
    xmax = xmax.float()
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


def compute_qparams(x: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 ``(scale, zero_point)`` for ``x`` by absmax (symmetric) or min/max (asymmetric).

    zero_point is None for symmetric formats. Shapes follow docs/design.md.
    """
    return qparams_from_range(*observe_range(x, spec), spec)


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
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, spec: QuantSpec
) -> torch.Tensor:
    """Codes as fp32 (differentiable through STE), in the grouped view.

    The clamp is a plain ``torch.clamp``: zero gradient (to x, scale and zero point alike) where it
    is active, so the scale gradient of a clipped element is ``qmin`` / ``qmax`` (LSQ)."""
    xg = _grouped(x.float(), spec)
    s = _expand(scale.float(), spec)
    if spec.is_fp8:
        return _fp8_cast_ste(torch.clamp(xg / s, -FP8_E4M3_MAX, FP8_E4M3_MAX))
    q = _round_ste(xg / s)
    if zero_point is not None:
        q = q + _round_ste(_expand(zero_point.float(), spec))
    return torch.clamp(q, spec.qmin, spec.qmax)


def _clipped_mask(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, spec: QuantSpec
) -> torch.Tensor:
    """Elements (grouped view) where the clamp of `_codes_fp32` is active."""
    with torch.no_grad():
        xg = _grouped(x.float(), spec)
        s = _expand(scale.float(), spec)
        if spec.is_fp8:
            v = xg / s
            return (v < -FP8_E4M3_MAX) | (v > FP8_E4M3_MAX)
        q = torch.round(xg / s)
        if zero_point is not None:
            q = q + torch.round(_expand(zero_point.float(), spec))
        return (q < spec.qmin) | (q > spec.qmax)


def _dequant_fp32(
    q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, spec: QuantSpec
) -> torch.Tensor:
    s = _expand(scale.float(), spec)
    if zero_point is not None and not spec.is_fp8:
        q = q - _round_ste(_expand(zero_point.float(), spec))
    return q * s


def _fp8_recast(x: torch.Tensor) -> torch.Tensor:
    """Per-tensor FP8 recast of an already dequantized tensor (W4A8-FP8 GEMM input), with STE."""
    s = (x.detach().abs().amax() / FP8_E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return _fp8_cast_ste(x / s) * s


def quantize(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, spec: QuantSpec
) -> torch.Tensor:
    """Codes of ``x``: ``torch.int8`` for every int format (values in [qmin, qmax]) or
    ``torch.float8_e4m3fn`` for fp8. Same shape as ``x``."""
    with torch.no_grad():
        q = _codes_fp32(x, scale, zero_point, spec).reshape(x.shape)
    return q.to(_FP8) if spec.is_fp8 else q.to(torch.int8)


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    spec: QuantSpec,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``(q - z) * s`` (fp8: ``q * s``) computed in fp32, returned as ``dtype``.

    ``fp8_recast`` is applied here too, so ``dequantize`` is what the deployed kernel computes."""
    qg = _grouped(q.float(), spec)
    out = _dequant_fp32(qg, scale, zero_point, spec).reshape(q.shape)
    if spec.fp8_recast:
        out = _fp8_recast(out)
    return out.to(dtype)


def fake_quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    spec: QuantSpec,
    *,
    clamp_grad: str = "mask",
) -> torch.Tensor:
    """Differentiable ``dequantize(quantize(x))``, returned in ``x.dtype``.

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
    q = _codes_fp32(x, scale, zero_point, spec)
    out = _dequant_fp32(q, scale, zero_point, spec)
    if clamp_grad == "pass":
        # identity gradient to x where the clamp is active too; adds exactly 0 to the value and
        # leaves the scale / zero-point (LSQ) gradients as they are.
        clipped = _clipped_mask(x, scale, zero_point, spec)
        out = torch.where(clipped, out + _identity_grad(_grouped(x.float(), spec)), out)
    out = out.reshape(x.shape)
    if spec.fp8_recast:
        out = _fp8_recast(out)
    return out.to(x.dtype)


def dynamic_fake_quantize(x: torch.Tensor, spec: QuantSpec, *, clamp_grad: str = "mask") -> torch.Tensor:
    """Fake-quantize with qparams computed from ``x`` itself (dynamic activations).

    The qparams are detached: gradients flow through the rounding STE only, as at inference the
    scale is a function of the data, not a parameter.
    """
    if x.numel() == 0:
        # An MoE expert that got no tokens still runs (same collectives on every ZeRO-3 rank):
        # an empty input has no range to reduce and nothing to quantize.
        return x
    scale, zp = compute_qparams(x, spec)
    return fake_quantize(x, scale, zp, spec, clamp_grad=clamp_grad)


@functools.cache
def compiled(fn: Callable) -> Callable:
    """``torch.compile(fn)`` (inductor), made once per function: `Quantizer` calls it when
    ``compile_fake_quant`` is on.

    Fusing the elementwise chain of a fake-quant (scale, round / fp8 cast, clamp, rescale) into one
    kernel saves memory passes; on the CPU it measured 0.85x the QAT step for FP8 formats and
    no gain for integer ones (benchmarks/README.md). Values are bit-identical to eager. Every
    tensor shape and spec is a guard, and MoE experts see varying token counts, so the recompile
    limit is raised (dynamo's default of 8 would silently fall back to eager).
    """
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
    return torch.compile(fn, dynamic=None)


def fp8_cast_ste(x: torch.Tensor) -> torch.Tensor:
    """Cast to FP8 E4M3 and back (no scale), straight-through: FP8 attention-probability simulation."""
    return _fp8_cast_ste(x.float()).to(x.dtype)
