"""Which quantizer parameters are out of range: non-finite, or a scale not in (0, inf) (0 or below).

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
    each scale not in (0, inf): 0 breaks ``x / s``; below 0 the grid is mirrored, and a runtime
    that takes the stored scale as a magnitude (or a checkpoint reader that refuses it) no longer
    does what training did, so neither training nor export lets one through.

    Scales leave (0, inf) in QAT when Adam's step (~ the learning rate, whatever the gradient) is
    not small against the scale: lr 1e-3 on ~1e-2 scales took 43 of 112 scale tensors of the
    tiny-qwen3-moe experiment below 0 (moves up to 1.7x the element's size). The tiny recipes train
    scales at 2e-4 for that reason (config/experiments/tiny-qwen3-moe.yaml)."""
    out = []
    for name, p, is_scale in _params(model):
        if not bool(torch.isfinite(p).all()):
            out.append(f"{name}: {describe_non_finite(p)}")
        elif is_scale and not bool((p > 0).all()):
            out.append(f"{name}: {int((p <= 0).sum())} of {p.numel()} values <= 0 (min {p.min().item():g})")
    return out


def layer_of(param_name: str) -> str:
    """The QuantLinear a quantizer parameter name belongs to (``<layer>.<quantizer>.<param>``)."""
    return param_name.split(":", 1)[0].rsplit(".", 2)[0]


def _params(model: nn.Module):
    for qname, q in quantizers(model):
        for pname, p in q.named_parameters(recurse=False):
            t = _local(p).detach()
            if t.numel():
                yield f"{qname}.{pname}", t, p is q.scale
