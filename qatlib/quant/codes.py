"""Frozen codes: train the weight scales with the integer (FP8, FP4) codes held fixed.

EfficientQAT's second phase (E2E-QP) trains the step sizes end to end on fixed codes. qatlib's
default QAT moves the scales of a continuous weight instead (LSQ: ``round(w / s)`` re-rounds as
``s`` moves, and ``dW_q / ds = q - w / s``), which is what an RTN start wants. A start whose
codes already carry a solution (GPTQ's error compensation, blockwise training's rounding)
loses it when the scales re-round the weights: GPTQ-initialised QAT ended worse than
RTN-initialised QAT on SmolLM2 (int4 g64, w4a8; benchmarks/README.md at 2faaa77). With the codes frozen the
quantized weight is ``codes * s`` and ``dW_q / ds = codes``: the scales can only improve on the start.

`freeze_codes` records each weight quantizer's current scale and zero point (the codes are
``clamp(round(w / s0) + round(z0))`` from then on, in `fq_linear`); `release_codes` writes ``codes * scale`` into the
weights and drops the record, so that every later step (evaluation, save, export) sees an ordinary
prepared model whose weights round to exactly those codes at the trained scales.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager as ContextManager

import torch
from torch import nn

from . import functional as F
from .fq_linear import _fake_quant_parts
from .linear import quant_linears

# ``gather(params, modifier_rank=None)``: a context in which ``params`` are whole on every rank (ZeRO-3:
# `qatlib.zero3.io.gathered_param_if_zero3`, passed down by the trainer; quant knows nothing of ZeRO-3)
Gather = Callable[..., ContextManager]


def _no_gather(params: Sequence[torch.Tensor | None], modifier_rank: int | None = None) -> ContextManager:
    if any(hasattr(p, "ds_id") for p in params if p is not None):  # a partitioned DeepSpeed parameter
        raise ValueError(
            "frozen codes on ZeRO-3 parameters: pass gather=qatlib.zero3.io.gathered_param_if_zero3"
        )
    return contextlib.nullcontext()


def _frozen_candidates(model: nn.Module):
    for name, ql in quant_linears(model):
        wq = ql.weight_quantizer
        if wq is None or wq.spec.dynamic:
            continue
        if wq.scale is None or wq.uses_lwc:
            raise ValueError(f"frozen codes: {name} has no stored weight scale (LWC or uncalibrated)")
        if wq.spec.subgroups:
            raise ValueError(f"frozen codes: {name} ({wq.spec.describe()}) has sub-group scales")
        yield name, ql, wq


@torch.no_grad()
def freeze_codes(model: nn.Module, gather: Gather = _no_gather) -> int:
    """Hold the codes of every static weight quantizer of ``model`` at their current values while
    the scales train; returns how many. Undo with `release_codes` before saving or exporting.
    ``gather``: under ZeRO-3 the gathering context (every rank records the whole scale)."""
    n = 0
    for _, ql, wq in _frozen_candidates(model):
        with gather([wq.scale, wq.zero_point, wq.global_scale]):
            z = None if wq.zero_point is None else wq.zero_point.detach().clone()
            # the code scale (FP4: rounded, NVFP4: over the global scale): the codes the model
            # computed until now, whatever the raw scale between two grid points
            wq.frozen_at = (F.code_scale(wq.scale.detach(), wq.spec, _global(ql, wq)).clone(), z)
        n += 1
    return n


def _global(ql, wq) -> torch.Tensor | None:
    gs = wq.global_scale_for(ql.weight)
    return None if gs is None else gs.detach()


@torch.no_grad()
def release_codes(model: nn.Module, gather: Gather = _no_gather) -> int:
    """Write ``codes * scale`` (the quantized weight the training ended with) into each frozen
    linear's weight and unfreeze it; returns how many. The weight then lies on the grid of its
    trained scale, so round-to-nearest there gives back the frozen codes. ``gather``: as in
    `freeze_codes`."""
    n = 0
    for name, ql, wq in _frozen_candidates(model):
        if wq.frozen_at is None:
            continue
        # the grid values before W4A8's FP8 recast: the recast is a function of them, applied again
        # at every forward (re-rounding recast values at the scale could move a code at a tie)
        spec = wq.spec.replace(fp8_recast=False) if wq.spec.fp8_recast else wq.spec
        # ZeRO-3: every rank gathers and computes the same; rank 0's weight is re-partitioned
        with gather([ql.weight, wq.scale, wq.zero_point, wq.global_scale], modifier_rank=0):
            gs = _global(ql, wq)
            wqv, *_ = _fake_quant_parts(
                ql.weight, wq.scale, wq.zero_point, spec, gs, with_grad_terms=False, frozen_at=wq.frozen_at
            )
            ql.weight.copy_(wqv)
            again = _fake_quant_parts(ql.weight, wq.scale, wq.zero_point, spec, gs, with_grad_terms=False)[0]
        wq.frozen_at = None
        if not torch.equal(again, wqv):  # e.g. int8 codes near 127 in a bf16 weight (every rank)
            raise ValueError(
                f"frozen codes: {name}'s {ql.weight.dtype} weight cannot hold codes * scale exactly"
            )
        n += 1
    return n
