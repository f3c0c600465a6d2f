"""Quantizers that share one scale: the mechanics, whatever decides which.

A runtime that fuses linears (vLLM / SGLang: q/k/v, gate/up, a layer's experts) merges their
static per-tensor scales at load time, so qatlib trains such a group with ONE ``scale`` Parameter
(and zero point): `tie` makes the members share the first member's Parameters, set to the
group's `merged_qparams` (the max of the scales; for asymmetric formats the qparams of the union
of the ranges), and `retie_weights` repeats that max after each member initialised its own scale
from its weight. Which groups a runtime merges, and the runtime's arithmetic, are
`qatlib.runtime.tying`'s (it knows the runtimes; this package does not): it reaches `prepare`
as ``PrepareOptions.deploy``. `shared_groups` / `is_tied` / `param_aliases` inspect a tied model;
`qatlib.checkpoint.tied` loads tied scales from a checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
from torch import nn

from .functional import qparams_from_range
from .quantizer import Quantizer

TIED_KINDS = frozenset({"scale", "zero_point", "global_scale"})


class SharedScales(Protocol):
    """One group of quantizers (``names``, qualified) to share their ``param``: ``"scale"`` (and the
    zero point) or ``"global_scale"`` (NVFP4's per-tensor global scale; group scales stay per
    shard). `qatlib.runtime.tying.TiedGroup` is one."""

    names: tuple[str, ...]
    param: str


def _readable(p: torch.Tensor) -> bool:
    return not hasattr(p, "ds_id") and p.device.type != "meta" and p.numel() > 0


@torch.no_grad()
def merged_qparams(qs: list[Quantizer]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The one ``(scale, zero_point)`` of a group: the runtime's max of the scales (symmetric), or
    for asymmetric formats the qparams of the union of the members' ranges."""
    if qs[0].zero_point is None:
        return torch.stack([q.scale.detach() for q in qs]).amax(0), None
    spec = qs[0].spec
    lo = torch.stack([(spec.qmin - q.zero_point) * q.scale for q in qs]).amin(0)
    hi = torch.stack([(spec.qmax - q.zero_point) * q.scale for q in qs]).amax(0)
    return qparams_from_range(lo, hi, spec)


def tie(model: nn.Module, groups: Iterable[SharedScales]) -> list[SharedScales]:
    """Make each group's quantizers share the first member's ``scale`` / ``zero_point`` Parameter,
    set (when readable: not a ZeRO-3 shard) to the group's `merged_qparams`. Returns the groups."""
    mods = dict(model.named_modules())
    groups = list(groups)
    for g in groups:
        qs = [mods[n] for n in g.names]
        first = qs[0]
        if g.param == "global_scale":
            _tie_global(model, g, qs)
            continue
        if all(_readable(q.scale) for q in qs):
            scale, zp = merged_qparams(qs)
            with torch.no_grad():
                first.scale.copy_(scale)
                if zp is not None:
                    first.zero_point.copy_(zp)
        # a meta skeleton's flags are unreadable (and not yet initialised): `onload.realize_quantizers`
        init = any(bool(q.initialized) for q in qs if not q.initialized.is_meta)
        for q in qs[1:]:
            q.scale = first.scale
            if first.zero_point is not None:
                q.zero_point = first.zero_point
        for q in qs:
            q.initialized.fill_(init)
    return groups


@torch.no_grad()
def _tie_global(model: nn.Module, g: SharedScales, qs: list[Quantizer]) -> None:
    """Share the first member's ``global_scale`` and, when readable, set it to the union of the
    members' ranges (``fp4_global_scale(max amax)``, i.e. the smallest of their own global scales:
    no shard's group scales saturate E4M3), then re-derive each weight member's group scales
    relative to it (`init_from` on its own weight would overwrite the shared value)."""
    first = qs[0]
    for q in qs[1:]:
        q.global_scale = first.global_scale
    if g.names[0].endswith("weight_quantizer"):  # inputs: calibration sets it (one shared input)
        _reset_global(model, g.names, qs)


@torch.no_grad()
def _reset_global(model: nn.Module, names, qs: list[Quantizer]) -> None:
    from .functional import compute_qparams, fp4_global_scale

    owners = [_owner_weight(model, n) for n in names]
    if any(w is None or not _readable(w) for w in owners) or not _readable(qs[0].global_scale):
        return
    if any(q.uses_lwc or q.scale is None for q in qs):
        return
    gs = fp4_global_scale(torch.stack([w.detach().float().abs().amax() for w in owners]).amax())
    qs[0].global_scale.copy_(gs.reshape(qs[0].global_scale.shape))
    for q, w in zip(qs, owners):
        scale, zp = compute_qparams(w, q.spec, qs[0].global_scale)
        q.set_qparams(scale, zp)


def shared_global_groups(model: nn.Module) -> list[list[tuple[str, Quantizer]]]:
    """Quantizers that share one NVFP4 ``global_scale`` Parameter (by identity), in module order."""
    by_id: dict[int, list[tuple[str, Quantizer]]] = {}
    for name, m in model.named_modules():
        if isinstance(m, Quantizer) and m.global_scale is not None:
            by_id.setdefault(id(m.global_scale), []).append((name, m))
    return [g for g in by_id.values() if len(g) > 1]


@torch.no_grad()
def retie_weights(model: nn.Module) -> None:
    """After per-linear weight initialisation (`Quantizer.init_from` on each member overwrites the
    shared scale: the last member would win), set every tied weight scale to the max over its
    members' own from-weight scales. Untied models: no-op."""
    for group in shared_groups(model):
        qs = [q for _, q in group]
        owners = [_owner_weight(model, n) for n, _ in group]
        if any(w is None or not _readable(w) for w in owners) or not all(_readable(q.scale) for q in qs):
            continue
        from .functional import compute_qparams

        scales = [compute_qparams(w, q.spec)[0] for q, w in zip(qs, owners)]
        qs[0].scale.copy_(torch.stack(scales).amax(0))
    for group in shared_global_groups(model):
        if group[0][0].endswith("weight_quantizer"):
            _reset_global(model, [n for n, _ in group], [q for _, q in group])


def _owner_weight(model: nn.Module, quantizer_name: str) -> torch.Tensor | None:
    linear, _, attr = quantizer_name.rpartition(".")
    if attr != "weight_quantizer":
        return None
    return getattr(model.get_submodule(linear), "weight", None)


def shared_groups(model: nn.Module) -> list[list[tuple[str, Quantizer]]]:
    """Quantizers that share one ``scale`` Parameter (by identity), each list in module order."""
    by_id: dict[int, list[tuple[str, Quantizer]]] = {}
    for name, m in model.named_modules():
        if isinstance(m, Quantizer) and m.scale is not None:
            by_id.setdefault(id(m.scale), []).append((name, m))
    return [g for g in by_id.values() if len(g) > 1]


def is_tied(model: nn.Module) -> bool:
    """Does ``model`` share scales between quantizers (prepared under a ``deploy.target``)?"""
    return bool(shared_groups(model)) or bool(shared_global_groups(model))


def param_aliases(model: nn.Module) -> dict[str, str]:
    """Tied quantizer parameter names -> the name ``named_parameters`` gives the shared tensor."""
    canon = {id(p): n for n, p in model.named_parameters()}
    return {
        n: canon[id(p)]
        for n, p in model.named_parameters(remove_duplicate=False)
        if canon[id(p)] != n and n.rpartition(".")[2] in TIED_KINDS
    }
