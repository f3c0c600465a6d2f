"""The fused fake-quant prototype the speed benchmark measures (`benchmarks.speed`): a PROPOSAL for
`qatlib.quant.functional.fake_quantize`, not used by qatlib.

The same values bit for bit, with the straight-through / LSQ gradients written out in one
autograd.Function instead of being derived by autograd through ~15 elementwise ops (the
``x - x.detach()`` STE terms, the fp8 recast, the dtype casts). The forward saves what the backward
needs (the in-range mask and dOut/dScale per element: 5 bytes / element) so the backward is 2-3
kernels and never repeats the FP8 cast. Checked against `fake_quantize` in `check_fused`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from qatlib.quant import functional as QF
from qatlib.quant.spec import FP8_E4M3_MAX

_FP8 = torch.float8_e4m3fn
_FAKE_QUANTIZE = QF.fake_quantize  # qatlib's, also while `fake_quantize_swapped` has replaced it


@contextlib.contextmanager
def fake_quantize_swapped(fn: Callable) -> Iterator[None]:
    """Make `qatlib.quant.functional.fake_quantize` (which `Quantizer` and `dynamic_fake_quantize`
    look up at call time) be ``fn`` inside the block. Benchmark-only: qatlib is not modified."""
    orig = QF.fake_quantize
    QF.fake_quantize = fn
    try:
        yield
    finally:
        QF.fake_quantize = orig


class _FusedFakeQuant(torch.autograd.Function):
    """Fake quantization with hand-written STE / LSQ gradients (the module docstring).

    Per element, with ``v = x / s`` and codes ``q`` (``zr`` the rounded zero point):
    ``dOut/dx = inside`` (``1`` with clamp_grad="pass"), ``dOut/ds = (q - zr) - inside * v``,
    ``dOut/dz = -s * (1 - inside)``; the FP8 recast of W4A8-FP8 is straight-through (identity).
    """

    @staticmethod
    def forward(ctx, x, scale, zero_point, spec, pass_grad):
        need = any(ctx.needs_input_grad[:3])
        xg = QF._grouped(x.float(), spec)
        s = QF._expand(scale.float(), spec)
        v = xg / s
        zr = None
        if spec.is_fp8:
            q = torch.clamp(v, -FP8_E4M3_MAX, FP8_E4M3_MAX).to(_FP8).float()
            inside = (v >= -FP8_E4M3_MAX) & (v <= FP8_E4M3_MAX) if need else None
        else:
            r = torch.round(v)
            if zero_point is not None:
                zr = torch.round(QF._expand(zero_point.float(), spec))
                r = r + zr
            inside = (r >= spec.qmin) & (r <= spec.qmax) if need else None
            q = torch.clamp(r, spec.qmin, spec.qmax)
        qz = q - zr if zr is not None else q
        out = (qz * s).reshape(x.shape)
        d = qz - torch.where(inside, v, 0.0) if ctx.needs_input_grad[1] else None
        if spec.fp8_recast:
            s2 = (out.abs().amax() / FP8_E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
            out = (out / s2).to(_FP8).float() * s2
        ctx.spec, ctx.pass_grad, ctx.x_shape, ctx.x_dtype = spec, pass_grad, x.shape, x.dtype
        ctx.save_for_backward(inside, d, scale, zero_point)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        inside, d, scale, zero_point = ctx.saved_tensors
        spec = ctx.spec
        gg = QF._grouped(g.float(), spec)
        gx = gs = gz = None
        if ctx.needs_input_grad[0]:
            gx = (gg if ctx.pass_grad else gg * inside).reshape(ctx.x_shape).to(ctx.x_dtype)
        if ctx.needs_input_grad[1] or (zero_point is not None and ctx.needs_input_grad[2]):
            s = QF._expand(scale.float(), spec)
            if ctx.needs_input_grad[1]:
                gs = (gg * d).sum_to_size(s.shape).reshape(scale.shape).to(scale.dtype)
            if zero_point is not None and ctx.needs_input_grad[2]:
                gz = (gg * torch.where(inside, 0.0, -s)).sum_to_size(s.shape)
                gz = gz.reshape(zero_point.shape).to(zero_point.dtype)
        return gx, gs, gz, None, None


def fused_fake_quantize(
    x, scale, zero_point, spec, *, clamp_grad="mask", global_scale=None, subgroup_scale=None
):
    """Drop-in for `qatlib.quant.functional.fake_quantize` (same signature and values); the
    prototype covers the int / fp8 formats, FP4 (a global scale, FOCUS's sub-group scales) goes
    to qatlib's own."""
    if clamp_grad not in ("mask", "pass"):
        raise ValueError(f"clamp_grad must be 'mask' or 'pass', got {clamp_grad!r}")
    if global_scale is not None or subgroup_scale is not None:
        return _FAKE_QUANTIZE(
            x,
            scale,
            zero_point,
            spec,
            clamp_grad=clamp_grad,
            global_scale=global_scale,
            subgroup_scale=subgroup_scale,
        )
    return _FusedFakeQuant.apply(x, scale, zero_point, spec, clamp_grad == "pass")


def check_fused(specs, *, shape=(64, 128), seed: int = 0) -> dict[str, Any]:
    """Max relative gradient error and value equality of the prototype vs `fake_quantize`."""
    worst, exact = 0.0, True
    for spec in specs:
        for clamp_grad in ("mask", "pass"):
            for dt in (torch.float32, torch.bfloat16):
                g = torch.Generator().manual_seed(seed)
                x = (torch.randn(*shape, generator=g) * 0.05).to(dt).requires_grad_(True)
                sc, zp = QF.compute_qparams(x, spec)
                sc = (sc * 0.7).requires_grad_(True)  # some elements clip
                zp = None if zp is None else (zp + 0.3).requires_grad_(True)
                gout = torch.randn(*shape, generator=g).to(dt)
                grads = []
                for fn in (QF.fake_quantize, fused_fake_quantize):
                    for t in (x, sc, zp):
                        if t is not None:
                            t.grad = None
                    out = fn(x, sc, zp, spec, clamp_grad=clamp_grad)
                    out.backward(gout)
                    grads.append((out.detach(), [t.grad.clone() for t in (x, sc, zp) if t is not None]))
                (ref, rg), (got, fg) = grads
                exact &= torch.equal(ref, got)
                for a, b in zip(rg, fg):
                    worst = max(worst, ((a - b).abs().max() / a.abs().max().clamp_min(1e-12)).item())
    return {"values_bit_exact": exact, "max_rel_grad_error": worst}
