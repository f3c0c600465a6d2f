"""Weight steps in units of each tensor's size (``quant_config.weight_update: relative``).

Why: Adam moves every element by about ``lr`` per step whatever its gradient, so one absolute
``weight_lr`` cannot serve linear weights whose sizes differ by orders of magnitude. On the
upcycled MoE (SmolLM2-135M's GGUF weights in Qwen3-MoE form) q / k / v / gate / up weights have an
RMS of ~0.2, the experts' down projections ~1.3 and o_proj ~1e5 (its input, the attention output,
is ~1e-5 of SmolLM2's: q_norm / k_norm / input norms run in their linear regime): at the weight_lr
that suits the first (6e-5, ~1/4 of an FP8 grid step there over 50 steps) o_proj never moves, and
its gradients (~1e-5 of the others') fall below Adam's ``eps`` besides. With ``relative``, each
weight tensor trains as ``theta = w / c`` with ``c`` the power of two nearest its RMS at the start:
``weight_lr`` is then a step in units of the tensor's own size (the same fraction of a grid step
for an int or a per-tensor FP8 grid), for every tensor.

How: the optimizer stays the stock ``torch.optim.AdamW`` (ZeRO-3 hands it flat fp32 partitions, one
param group at a time, so ``c`` is a property of a GROUP: the weights are grouped by their unit).
Stepping ``theta`` is the same as stepping ``w`` with (a) the gradient ``dL/dtheta = c * dL/dw``,
applied as autograd computes it by a gradient hook (so clipping and the ZeRO-3 reduction see the
gradient the optimizer steps on, and Adam's ``eps`` compares with it), (b) the group's lr
``weight_lr * c`` and (c) its decoupled weight decay ``weight_decay / c`` (AdamW multiplies decay
by the group's lr). ``c`` a power of two makes (a) exact in floating point. The checkpoint keeps the
weights themselves (layout unchanged).

No library does this: torch / DeepSpeed optimizers have one lr per group, and a reparametrised
Parameter (``torch.nn.utils.parametrize``) would change the checkpoint keys and ZeRO-3's
partitioning.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..device import collective_device
from ..zero3.io import is_zero3_param, sliced_evenly
from .grad_hook import set_gradient_hook

WEIGHT_UPDATES = ("additive", "relative")
WEIGHT_UNIT = "weight_unit"  # the param-group key holding its weights' unit c
# the attribute a weight keeps its gradient hook's handle in (`install_weight_unit_steps`)
_HOOK_ATTR = "_qatlib_weight_unit_hook"


def unit_of_rms(rms: float) -> float:
    """The power of two nearest ``rms`` in log scale (1.0 for an all-zero or non-finite tensor)."""
    if not math.isfinite(rms) or rms <= 0.0:
        return 1.0
    return 2.0 ** round(math.log2(rms))


def weight_units(params: Sequence[torch.Tensor]) -> list[float]:
    """Each tensor's unit (`unit_of_rms` of its RMS). A ZeRO-3 parameter's sum of squares is its
    local partition's (the padding is zero), summed over the ranks in ONE all-reduce for all of
    them: every rank gets the units of the unpartitioned tensors (collective: every rank calls it
    with the same parameters in the same order). A parameter partitioned otherwise than in plain
    slices over the whole world (hpZ, a smaller group: `zero3_io.sliced_evenly`) is refused."""
    zero3 = [is_zero3_param(p) for p in params]
    if any(zero3):
        if bad := [i for i, p in enumerate(params) if zero3[i] and not sliced_evenly(p)]:
            raise ValueError(
                f"weight_update relative: {len(bad)} weight(s) are not partitioned in plain slices over "
                "the whole world (hpZ / a smaller process group), so their size cannot be summed from the "
                "partitions; use weight_update: additive"
            )
    sq = torch.zeros(len(params), dtype=torch.float64)
    with torch.no_grad():
        for i, p in enumerate(params):
            local = p.ds_tensor if zero3[i] else p
            sq[i] = local.detach().to(torch.float64).pow(2).sum().cpu()
    if any(zero3):
        red = sq.to(collective_device())
        torch.distributed.all_reduce(red)
        sq = red.cpu()
    numel = [int(p.ds_numel) if z else p.numel() for p, z in zip(params, zero3)]
    return [unit_of_rms(math.sqrt(s / n)) if n else 1.0 for s, n in zip(sq.tolist(), numel)]


def unit_groups(
    params: Sequence[torch.nn.Parameter], units: Sequence[float], *, lr: float, weight_decay: float, name: str
) -> list[dict]:
    """AdamW groups for weights ``params`` with their ``units``: one group per unit c (named
    ``<name>@2^k``), lr ``lr * c``, weight decay ``weight_decay / c``, ``c`` under `WEIGHT_UNIT`."""
    by_unit: dict[float, list] = {}
    for p, c in zip(params, units):
        by_unit.setdefault(float(c), []).append(p)
    return [
        {
            "params": ps,
            "lr": float(lr * c),
            "weight_decay": float(weight_decay / c),
            "name": f"{name}@2^{int(math.log2(c))}",
            WEIGHT_UNIT: c,
        }
        for c, ps in sorted(by_unit.items())
    ]


def install_weight_unit_steps(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Give the weights of every `WEIGHT_UNIT` group the gradient ``c * dL/dw`` (and remove a hook an
    earlier optimizer installed on a parameter this one steps otherwise). Returns the optimizer."""
    for g in optimizer.param_groups:
        c = g.get(WEIGHT_UNIT)
        on = c is not None and c != 1.0
        if on and any(not p.requires_grad for p in g["params"]):
            raise ValueError(
                f"param group {g.get('name', '?')!r} steps in weight units but holds a parameter "
                "with requires_grad=False: unfreeze the weights before building the optimizer"
            )
        for p in g["params"]:
            set_gradient_hook(p, _HOOK_ATTR, _times(float(c)) if on else None)
    return optimizer


def _times(c: float):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        return grad * c  # d L / d theta = c * d L / d w, theta = w / c

    return hook
