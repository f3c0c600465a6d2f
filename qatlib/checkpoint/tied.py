"""Loading tied scales from a checkpoint: a model prepared with shared scales (`qatlib.quant.tying`)
reads one value per shared Parameter, but a checkpoint keeps one key per linear, and an untied
run's keys disagree. The rule is the runtime's: the max (the union of the ranges with zero
points), so loading never changes what a runtime would serve from that checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..quant.functional import qparams_from_range
from ..quant.tying import param_aliases
from .keys import scale_keys


@torch.no_grad()
def checkpoint_max(
    model: nn.Module, read: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """For a tied ``model`` and the checkpoint values of its tied keys (``read``: key -> tensor),
    the value each shared scale takes when its keys disagree: the runtime's rule, the max (the
    union of ranges with zero points). Returns ``({canonical param name: value}, [disagreeing
    groups])``; groups whose keys agree (a tied checkpoint) need nothing."""
    keys = scale_keys(model)
    aliases = param_aliases(model)
    members: dict[str, list[str]] = {}
    for alias, canon in aliases.items():
        members.setdefault(canon, [canon]).append(alias)
    fix: dict[str, torch.Tensor] = {}
    bad: list[str] = []
    for canon, names in members.items():
        if not canon.endswith((".scale", ".global_scale")):
            continue  # zero points are resolved with their scale
        vals = [read.get(keys.get(n, "")) for n in names]
        if any(v is None for v in vals) or all(torch.equal(vals[0].flatten(), v.flatten()) for v in vals[1:]):
            continue
        zname = canon.removesuffix(".scale") + ".zero_point"
        znames = [n.removesuffix(".scale") + ".zero_point" for n in names]
        zvals = [read.get(keys.get(z, "")) for z in znames]
        bad.append(f"{', '.join(keys[n] for n in names[:3])}{' ...' if len(names) > 3 else ''}")
        vals = [v.float().reshape(-1) for v in vals]
        if all(z is None for z in zvals) or canon.endswith(".global_scale"):
            # NVFP4 global scales: vLLM's max (its group scales stay as stored)
            fix[canon] = torch.stack(vals).amax(0)
            continue
        q = model.get_submodule(canon.rpartition(".")[0])
        spec = q.spec
        zs = [z.float().reshape(-1) for z in zvals]
        lo = torch.stack([(spec.qmin - z) * s for s, z in zip(vals, zs)]).amin(0)
        hi = torch.stack([(spec.qmax - z) * s for s, z in zip(vals, zs)]).amax(0)
        fix[canon], fix[zname] = qparams_from_range(lo, hi, spec)
    return fix, bad


def tied_checkpoint_keys(model: nn.Module) -> list[str]:
    """Every checkpoint key of a tied scale / zero point (what `checkpoint_max` needs read)."""
    keys = scale_keys(model)
    aliases = param_aliases(model)
    names = set(aliases) | set(aliases.values())
    return sorted({keys[n] for n in names if n in keys})
