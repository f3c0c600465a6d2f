"""Which quantizer parameters are out of range: non-finite, or a scale not in (0, inf).

One check for the two places that refuse such a model: the training guard
(`qatlib.trainers.guard`, after every step) and export (`qatlib.export`, before writing).
ZeRO-3 parameters are read on this rank's partition (``ds_tensor``): no gather.
"""

from __future__ import annotations

import torch
from torch import nn

from .linear import quantizers


def dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's share of a parameter: the valid part of its ZeRO-3 partition (the last ranks'
    partitions are padded: a 1-element scale's partition on rank 1 is all padding, uninitialised
    memory), else the tensor itself."""
    if not hasattr(p, "ds_tensor"):
        return p
    part = p.ds_tensor.view(-1)
    start = torch.distributed.get_rank() * part.numel() if dist_ready() else 0
    return part[: max(0, min(part.numel(), p.ds_numel - start))]


def describe_non_finite(t: torch.Tensor) -> str:
    t = t.detach().float()
    bad = ~torch.isfinite(t)
    kinds = [k for k, m in (("nan", torch.isnan(t)), ("inf", torch.isinf(t))) if bool(m.any())]
    return f"{int(bad.sum())} of {t.numel()} values {'/'.join(kinds) or 'non-finite'}"


def bad_quant_params(model: nn.Module) -> list[str]:
    """``"<param>: <what>"`` for each quantizer parameter (this rank's share) that is not finite, and
    each scale that is 0 (``x / s``: the arithmetic breaks)."""
    out = []
    for name, p, is_scale in _params(model):
        if not bool(torch.isfinite(p).all()):
            out.append(f"{name}: {describe_non_finite(p)}")
        elif is_scale and not bool((p != 0).all()):
            out.append(f"{name}: {int((p == 0).sum())} of {p.numel()} values 0")
    return out


def negative_scales(model: nn.Module) -> list[str]:
    """Scales (this rank's share) below 0. Not an error: a symmetric grid with scale ``-s`` is the
    grid of ``s`` with the codes negated, and the export stores the codes the trained (negative)
    scale gives, so the runtime's ``q * s`` reproduces the trained arithmetic. Measured: the default
    experiment's QAT (Adam, lr 1e-3, scales ~1e-2) takes 43 of its 112 scales through zero; the
    guard reports them instead of stopping (a positive parametrisation would keep them > 0)."""
    out = []
    for name, p, is_scale in _params(model):
        if is_scale and bool(torch.isfinite(p).all()) and not bool((p >= 0).all()):
            out.append(f"{name}: {int((p < 0).sum())} of {p.numel()} values < 0 (min {p.min().item():g})")
    return out


def _params(model: nn.Module):
    for qname, q in quantizers(model):
        for pname, p in q.named_parameters(recurse=False):
            t = _local(p).detach()
            if t.numel():
                yield f"{qname}.{pname}", t, p is q.scale
