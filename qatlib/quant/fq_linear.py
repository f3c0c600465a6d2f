"""Weight fake-quantization + linear as one autograd Function that keeps no fake-quantized weight.

Autograd through `functional.fake_quantize` keeps ~5 fp32 copies of every weight for backward
(``x.float()``, ``x / s``, the codes, the STE terms) and a model-dtype copy of the result for the
matmul. On a Qwen3-30B-A3B layer (384 expert weights) that is more than the layer itself, per rank,
for the whole forward: it defeats ZeRO-3's partitioning (issue #16). Here the forward saves only
the tensors it was given (the input, the weight Parameter itself, the scale / zero point / global
scale: no new storage) and the backward recomputes the fake-quantized weight from them, one weight
at a time, with the straight-through / LSQ gradients written out:

with ``v = w / s`` (grouped view, fp32), codes ``q``, rounded zero point ``zr`` and ``inside`` the
elements where the clamp is inactive (inclusive bounds, as ``torch.clamp``'s gradient):
``dW_q/dw = inside`` (``1`` with ``clamp_grad="pass"``), ``dW_q/ds = (q - zr) - inside * v``,
``dW_q/dz = -s * (1 - inside)``; FP4 group scales are rounded straight-through and (NVFP4) divided
by the global scale, ``ds_eff/dgs = -s_eff / gs``; the W4A8 FP8 recast is straight-through.
FOCUS's sub-group factors ``c`` (`functional.code_divisor`: ``v = w / (s c)``, ``W_q = q * s``):
``dW_q/dw = inside / c`` (``1`` where clamped with ``"pass"``), ``dW_q/ds`` as above and
``dW_q/dc = -inside * v * s / c``.
These are exactly the gradients autograd derives through `fake_quantize` (tests compare both and
finite differences); values are those of `fake_quantize` bit for bit.

A call with no rows (an MoE expert that got no token) computes nothing and returns zero gradients
for the scales (the true value: a sum over no tokens), never None, so every rank's parameters get
a gradient in the same order under ZeRO-3 whatever the routing.
"""

from __future__ import annotations

import functools
import threading

import torch

from ..surgery.frozen_linear import (  # fp32 where the CPU lacks half GEMMs
    grad_input,
    grad_weight,
    linear_output,
)
from . import functional as F
from .spec import FP4_E2M1_MAX, FP8_E4M3_MAX, Granularity, QuantSpec

_FP8 = torch.float8_e4m3fn


_EXPONENT_BITS = 0x7F800000


def _e4m3_values(c: torch.Tensor) -> torch.Tensor:
    """``c.to(float8_e4m3fn).float()`` for fp32 ``c`` already clamped to +-448, in fp32 arithmetic,
    IN PLACE on ``c``: each value is rounded (half to even, ``torch.round``) to its E4M3 quantum,
    ``2 ** (floor(log2 |c|) - 3)``, at least ``2 ** -9`` (the subnormal step). Every step is exact
    (power-of-two scaling, an integer rounding), so the values are the cast's bit for bit (tests
    sweep every binade); written by hand because torch's fp8 casts run ~8x slower than an
    elementwise fp32 op on the CPU (53 ms vs 6 ms for a 768 x 2048 expert weight)."""
    quantum = (c.view(torch.int32) & _EXPONENT_BITS).view(torch.float32).mul(0.125).clamp_(min=2.0**-9)
    return c.div_(quantum).round_().mul_(quantum)


# A table costs one `_fake_quant_parts` call on 65,536 values (~0.3 ms on one CPU thread): worth
# it from a few times that many elements (an expert weight of Qwen3-30B-A3B has 1.57 M).
_TABLE_MIN_ELEMENTS = 1 << 18


@functools.cache
def _every_value(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every 16-bit pattern of ``dtype`` in the order of its uint16 view: the input whose results
    make a table indexed by `_table_index`."""
    return torch.arange(65536, dtype=torch.int32, device=device).to(torch.int16).view(dtype)


def _table_index(w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Each element's 16 bits as an int32 row of the table (one conversion pass: 8x cheaper than
    an int16 view plus an offset); into ``out`` when given."""
    bits = w.reshape(-1).view(torch.uint16)
    return bits.to(torch.int32) if out is None else out.copy_(bits)


# Buffers the table path gathers into, reused from call to call (CPU, weights up to this size: a
# Qwen3-30B-A3B expert is 1.57 M elements, ~17 MB of buffers per thread). Why: under ZeRO-3 on
# the CPU every allocation above 1 MiB is a fresh mapping (`qatlib.zero3.heap.configure_training`, which
# keeps the resident set at the live tensors), so each call's index and results were zero-filled
# page by page: index + two gathers of a 768 x 2048 weight 9.2 ms fresh against 2.0 ms into reused
# buffers (one thread, AVX-512 EPYC), a third of the rehearsal's ZeRO-3 step. Not a wider heap
# policy: letting such sizes reuse the heap fragmented it by +1.9 GB per rank (`qatlib.zero3.heap`); these
# few buffers are reused whole. On GPUs the caching allocator already reuses memory.
_SCRATCH_MAX_ELEMENTS = 1 << 22
_scratch_local = threading.local()


def _scratch(key: str, n: int, dtype: torch.dtype) -> torch.Tensor:
    """A reused CPU buffer of ``n`` elements for ``key`` (this thread's; grown, never shrunk). Its
    contents last until the next call with the same key: only for values used and dropped inside
    one forward or backward."""
    if not hasattr(_scratch_local, "buffers"):
        _scratch_local.buffers = {}
    buffers = _scratch_local.buffers
    buf = buffers.get(key)
    if buf is None or buf.numel() < n or buf.dtype != dtype:
        buf = buffers[key] = torch.empty(n, dtype=dtype)
    return buf[:n]


def _by_table(w: torch.Tensor, spec: QuantSpec, *qparams: torch.Tensor | None) -> bool:
    """Whether the fake-quantization of ``w`` is one function of each element's bits: a 16-bit
    float weight under one scale (and zero point) for the whole tensor, large enough to pay for
    the table. The FP8 recast (a per-tensor amax of the result) and the W4A8 kernel (group
    scales) are not elementwise."""
    return (
        w.dtype in (torch.bfloat16, torch.float16)
        and w.numel() >= _TABLE_MIN_ELEMENTS
        and spec.granularity is Granularity.TENSOR
        and not spec.fp8_recast
        and not spec.w4a8_kernel
        and all(t is None or t.numel() == 1 for t in qparams)
    )


def _fake_quant_parts(
    w: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    spec: QuantSpec,
    global_scale: torch.Tensor | None,
    *,
    with_grad_terms: bool,
    frozen_at: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    keep_inside: bool = True,
    scratch: bool = False,
    subgroup_scale: torch.Tensor | None = None,
):
    """``(wq, inside, d, s_eff, sub)``: the fake-quantized weight in ``w.dtype`` (the value of
    `F.fake_quantize`: the same fp32 ops in the same order, without the STE terms, which add an
    exact 0), and with ``with_grad_terms`` the backward's per-element terms (grouped view):
    ``inside`` (clamp inactive) and ``d = dW_q / ds_eff``. Temporaries are fp32 (``w / s``
    rounded to bf16 would move codes) and updated in place where the value is not needed again.
    ``keep_inside=False``: the caller does not use ``inside`` (None may come back).
    ``scratch=True``: the table path may return views of reused buffers (`_scratch`), valid until
    the next such call: for `_FakeQuantLinear`, which uses the results and drops them at once.
    ``subgroup_scale`` (FOCUS): ``sub`` is ``(c, dW_q/dc)`` in the sub-group view ``[..., G, n,
    g / n]`` (``c``: ``[..., G, n, 1]``) with ``with_grad_terms``, else None.

    A 16-bit weight under one scale (`_by_table`) has at most 65,536 distinct values and each
    result is a function of the element alone, so the results are computed once for every value
    and gathered: bit for bit the elementwise values, in ~3 memory passes instead of ~10 (a
    768 x 2048 bf16 expert weight of Qwen3-30B-A3B: 13-17 ms -> 1.6 ms on one CPU thread, 16 ms ->
    3 ms with the backward's terms; issue #16's step time)."""
    frozen = () if frozen_at is None else frozen_at
    if _by_table(w, spec, scale, zero_point, global_scale, *frozen):
        every = _every_value(w.dtype, w.device)
        wq, inside, d, s, _ = _fake_quant_parts(
            every, scale, zero_point, spec, global_scale, with_grad_terms=with_grad_terms, frozen_at=frozen_at
        )
        n = w.numel()
        reuse = scratch and w.device.type == "cpu" and n <= _SCRATCH_MAX_ELEMENTS
        idx = _table_index(w, _scratch("index", n, torch.int32) if reuse else None)

        def gather(key: str, table: torch.Tensor | None) -> torch.Tensor | None:
            if table is None:
                return None
            out = _scratch(key, n, table.dtype) if reuse else None
            return torch.index_select(table.reshape(-1), 0, idx, out=out).view(w.shape)

        return gather("wq", wq), gather("inside", inside) if keep_inside else None, gather("d", d), s, None
    v = F._grouped(w.float(), spec)
    s = F._effective_scale(scale.detach(), spec, None if global_scale is None else global_scale.detach())
    # frozen codes (`qatlib.quant.codes`): rounded at the scale / zero point they were frozen at,
    # dequantized with the current ones
    if frozen_at is None:
        c = None if subgroup_scale is None else subgroup_scale.detach()
        v = F.code_divisor(v, s, c, spec)  # a new tensor
    else:
        v = v / F._expand(frozen_at[0].float(), spec)
    inside = sub = None
    if spec.is_fp4 or spec.is_fp8:
        lim = FP4_E2M1_MAX if spec.is_fp4 else FP8_E4M3_MAX
        q = torch.clamp(v, -lim, lim)
        if with_grad_terms:
            inside = v.abs() <= lim
        q = F.round_e2m1(q) if spec.is_fp4 else _e4m3_values(q)
    else:
        if zero_point is not None:
            zr = torch.round(F._expand(zero_point.detach().float(), spec))
            zc = zr if frozen_at is None else torch.round(F._expand(frozen_at[1].float(), spec))
            r = torch.round(v).add_(zc)
        else:
            zr, r = None, torch.round(v)
        if with_grad_terms:
            inside = (r >= spec.qmin) & (r <= spec.qmax)
        q = r.clamp_(spec.qmin, spec.qmax)
        if zr is not None:
            q = q.sub_(zr)  # q - zr: codes minus the rounded zero point
    d = None
    if with_grad_terms:  # dW_q/ds = (q - zr) - inside * v; with frozen codes W_q = (q - zr) * s
        vin = torch.where(inside, v, 0.0) if frozen_at is None else None
        d = q.clone() if frozen_at is not None else q - vin
        if subgroup_scale is not None:  # dW_q/dc = -inside * v * s / c, per sub-group run
            n = spec.subgroups
            runs = (*v.shape[:-1], n, v.shape[-1] // n)
            c = subgroup_scale.detach().float().reshape(*runs[:-1], 1)
            sub = (c, vin.mul_(s).neg_().reshape(runs).div_(c))
    del v
    out = q.mul_(s).reshape(w.shape)
    if spec.fp8_recast and not spec.w4a8_kernel:  # the kernel scale path replaces the recast
        s2 = (out.abs().amax() / FP8_E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
        out = _e4m3_values(out.div_(s2)).mul_(s2)
    # vLLM's CUTLASS W4A8 kernel multiplies the exact int4 x fp8-scale products in fp32 (fp32
    # accumulation, token / channel scales in the epilogue): its weight is not rounded to bf16
    return (out if spec.w4a8_kernel else out.to(w.dtype)), inside, d, s, sub


def _fold(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _FakeQuantLinear(torch.autograd.Function):
    """``linear(x, fake_quantize(weight), bias)``; see the module docstring for the gradients."""

    @staticmethod
    def forward(
        ctx, x, weight, bias, scale, zero_point, global_scale, subgroup_scale, spec, pass_grad, frozen_at
    ):
        ctx.spec, ctx.pass_grad, ctx.frozen_at = spec, pass_grad, frozen_at  # buffers: no grad
        ctx.save_for_backward(x, weight, bias, scale, zero_point, global_scale, subgroup_scale)
        if x.numel() == 0:
            return x.new_empty(*x.shape[:-1], weight.shape[0])
        with torch.no_grad():
            wq, *_ = _fake_quant_parts(
                weight,
                scale,
                zero_point,
                spec,
                global_scale,
                with_grad_terms=False,
                frozen_at=frozen_at,
                scratch=True,
                subgroup_scale=subgroup_scale,
            )
            return linear_output(x, wq, None if bias is None else bias.to(wq.dtype))

    @staticmethod
    def backward(ctx, g):
        x, weight, bias, scale, zero_point, global_scale, subgroup_scale = ctx.saved_tensors
        frozen_at = ctx.frozen_at
        spec = ctx.spec
        nx, nw, nb, ns, nz, ngs, nc = ctx.needs_input_grad[:7]
        gx = gw = gb = gs = gz = ggs = gc = None
        if x.numel() == 0:  # no rows: every gradient is a sum over nothing
            gx = torch.zeros_like(x) if nx else None
            gw = torch.zeros_like(weight) if nw else None
            gb = torch.zeros_like(bias) if nb else None
            gs = torch.zeros_like(scale) if ns else None
            gz = torch.zeros_like(zero_point) if nz else None
            ggs = torch.zeros_like(global_scale) if ngs else None
            gc = torch.zeros_like(subgroup_scale) if nc else None
            return gx, gw, gb, gs, gz, ggs, gc, None, None, None
        need_terms = nw or ns or nz or ngs or nc
        wq, inside, d, s, sub = _fake_quant_parts(
            weight,
            scale,
            zero_point,
            spec,
            global_scale,
            with_grad_terms=need_terms,
            frozen_at=frozen_at,
            keep_inside=nz or nw,
            scratch=True,
            subgroup_scale=subgroup_scale,
        )
        g2 = _fold(g)
        if nx:
            gx = grad_input(g2, wq).reshape(x.shape)
        del wq
        if nb:
            gb = g2.sum(0).to(bias.dtype)
        if not need_terms:
            return gx, gw, gb, gs, gz, ggs, gc, None, None, None
        if not (nw or nz) and spec.granularity is Granularity.TENSOR:
            # only the scale of a frozen weight: sum(G_q * d) with G_q = g^T x is sum(g * (x d^T)),
            # a [tokens, out] product instead of the [out, in] G_q (an expert weight at 8 tokens:
            # one fp32 GEMM instead of a GEMM, two casts and a product over 1.57 M elements).
            # G_q is not rounded to the model dtype here: the exact sum, in fp32.
            xd = _fold(x).float().mm(d.reshape(weight.shape).t())
            gq, gs_eff = None, (g2.float() * xd).sum().reshape(s.shape)
        else:
            # dL/dWq in the model dtype, as autograd computes it ((x^T g)^T), then fp32
            gq = F._grouped(grad_weight(g2, _fold(x)).float(), spec)
            gs_eff = (gq * d).sum_to_size(s.shape) if ns or ngs else None  # dL/ds_eff, per scale
        if nc:
            gc = (gq.reshape(sub[1].shape) * sub[1]).sum(-1).reshape(subgroup_scale.shape)
        if nw:
            g = gq if ctx.pass_grad else gq * inside
            if sub is not None:  # d/dw = 1 / c inside the range (`pass`: 1 where clamped)
                c, runs = sub[0], sub[1].shape
                g = g.reshape(runs) / c
                if ctx.pass_grad:
                    g = torch.where(inside.reshape(runs), g, gq.reshape(runs))
            gw = g.reshape(weight.shape).to(weight.dtype)
        if ns or ngs:
            if ns:
                t = gs_eff
                if spec.has_global_scale:
                    t = t / global_scale.detach().float().reshape(())
                gs = t.reshape(scale.shape).to(scale.dtype)
            if ngs:
                gsv = global_scale.detach().float().reshape(())
                ggs = (-(gs_eff * s).sum() / gsv).reshape(global_scale.shape).to(global_scale.dtype)
        if nz:
            # W_q = (q - zr) * s: -s everywhere with frozen codes, only where clamped otherwise
            gz = (gq * (-s if frozen_at is not None else torch.where(inside, 0.0, -s))).sum_to_size(s.shape)
            gz = gz.reshape(zero_point.shape).to(zero_point.dtype)
        return gx, gw, gb, gs, gz, ggs, gc, None, None, None


def fake_quant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    spec: QuantSpec,
    *,
    clamp_grad: str = "mask",
    global_scale: torch.Tensor | None = None,
    frozen_at: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    subgroup_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``TF.linear(x, F.fake_quantize(weight, ...), bias)`` with the same value and gradients,
    keeping no fake-quantized weight for backward (recomputed there). ``x`` in ``weight.dtype``.

    ``frozen_at`` (`qatlib.quant.codes.freeze_codes`): ``(s0, zero_point)`` the codes are held
    at, ``q = clamp(round(weight / s0) + round(z0))`` with ``s0`` the code scale then
    (`functional.code_scale`: for NVFP4 the rounded group scale over the global scale); the weight
    is ``(q - round(z)) * s`` with the current code scale and zero point, so ``dW_q / ds = q - zr``
    and ``dW_q / dz = -s`` (EfficientQAT's end-to-end training of the step sizes on fixed codes),
    and for NVFP4 both scale levels train through ``s = round(scale) / global``."""
    if clamp_grad not in ("mask", "pass"):
        raise ValueError(f"clamp_grad must be 'mask' or 'pass', got {clamp_grad!r}")
    if spec.dynamic:
        raise ValueError("fake_quant_linear quantizes a static weight; a dynamic spec has no stored scale")
    if frozen_at is not None and spec.subgroups:
        raise ValueError(f"frozen codes: {spec.describe()} has sub-group scales; not supported")
    if bool(spec.subgroups) != (subgroup_scale is not None):
        raise ValueError(f"{spec.describe()}: sub-group scales given {subgroup_scale is not None}")
    return _FakeQuantLinear.apply(
        x,
        weight,
        bias,
        scale,
        zero_point,
        global_scale,
        subgroup_scale,
        spec,
        clamp_grad == "pass",
        frozen_at,
    )
