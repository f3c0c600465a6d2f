"""The trained-vs-deployed differences of an export, per runtime, measured on the model.

`qatlib.export` writes them to ``qatlib_export.json`` (``deployment``): for every load-time
transformation a target applies (`qatlib.runtime.facts.transforms`), how many groups / layers of
THIS model it actually changes (a transformation that meets equal, tied scales changes nothing and
is reported with a zero count), plus the KV-cache facts. A user reads there whether the model a
runtime serves is the model that was trained.

A transformation the model was trained with (``deploy.target``: tied scales, the runtime's dynamic
granularity, scale dtype and W4A8 scale path; `qatlib.runtime.tying`) is no difference: it is listed
under ``trained_as_deployed`` instead, and ``scales_tied`` says whether every group that runtime
merges shares one trained scale.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..quant.linear import QuantLinear
from ..quant.spec import Granularity, QuantScheme
from ..quant.tying import shared_groups
from . import tying
from .facts import (
    DENSE_ONLY,
    TARGETS,
    Transform,
    dtype_refusal,
    expert_input_scale_refusal,
    kv_facts,
    layout_of,
    load_refusal,
    transforms,
)
from .fusion import DENSE_FUSED, GroupKind, fused_groups, has_experts


def _static_scale(ql: QuantLinear | None, role: str) -> torch.Tensor | None:
    q = None if ql is None else getattr(ql, f"{role}_quantizer", None)
    if q is None or q.scale is None or q.spec.dynamic or q.scale.numel() == 0:
        return None
    return q.scale.detach().float().cpu()


def _global_scale(ql: QuantLinear | None, role: str) -> torch.Tensor | None:
    """NVFP4's weight / input global scale of ``ql`` (None for other formats)."""
    if ql is None:
        return None
    if role == "weight":
        gs = ql.weight_global_scale() if ql.weight_quantizer is not None else None
    else:
        gs = None if ql.input_quantizer is None else ql.input_quantizer.global_scale
    return None if gs is None else gs.detach().float().cpu().reshape(1)


def _differing(
    model: nn.Module, kinds: set[GroupKind], role: str, scale_of=None, experts: set[str] | None = None
) -> tuple[int, int]:
    """``(groups whose members' scales differ, groups with such scales)`` over ``kinds`` (only the
    groups of ``experts``, when given)."""
    scale_of = scale_of or _static_scale
    mods = dict(model.named_modules())
    n = bad = 0
    for g in fused_groups(model):
        if g.kind not in kinds or (experts is not None and g.members[0] not in experts):
            continue
        scales = [
            scale_of(mods.get(m) if isinstance(mods.get(m), QuantLinear) else None, role) for m in g.members
        ]
        if any(s is None or s.numel() != 1 for s in scales):
            continue
        n += 1
        bad += not all(torch.equal(scales[0], s) for s in scales[1:])
    return bad, n


def _expert_names(model: nn.Module) -> set[str]:
    return {m for g in fused_groups(model) if g.kind is GroupKind.MOE_LAYER for m in g.members}


def _measure(model: nn.Module, t: Transform, dtype: torch.dtype) -> str:
    if t is Transform.WEIGHT_SCALE_MAX:
        bad, n = _differing(model, set(DENSE_FUSED), "weight")
        return f"{bad} of {n} fused groups have different weight scales (their shards are re-rounded)"
    if t is Transform.EXPERT_WEIGHT_SCALE_MAX:
        bad, n = _differing(model, {GroupKind.GATE_UP}, "weight", experts=_expert_names(model))
        return f"{bad} of {n} experts have different gate / up weight scales (re-rounded)"
    if t in (Transform.INPUT_SCALE_MAX, Transform.INPUT_SCALE_LAST):
        bad, n = _differing(model, set(DENSE_FUSED), "input")
        return f"{bad} of {n} fused groups have different input scales"
    if t is Transform.EXPERT_INPUT_SCALE_MAX:
        bad, n = _differing(model, {GroupKind.EXPERTS_W13, GroupKind.EXPERTS_W2}, "input")
        return f"{bad} of {n} expert groups (w13 / w2 per layer) have different input scales"
    if t in (Transform.FP4_GLOBAL_SCALE_MAX, Transform.FP4_GLOBAL_SCALE_MUST_MATCH):
        bad, n = _differing(model, set(DENSE_FUSED), "weight", _global_scale)
        bad_in, _ = _differing(model, set(DENSE_FUSED), "input", _global_scale)
        return f"{bad} of {n} fused groups have different weight global scales, {bad_in} different input ones"
    if t in (Transform.EXPERT_W13_GLOBAL_SCALE, Transform.FP4_ACTIVATIONS_UNQUANTIZED):
        return "not counted"
    if t is Transform.DYNAMIC_PER_TOKEN:
        experts = _expert_names(model)
        n = sum(1 for name, m in model.named_modules() if isinstance(m, QuantLinear) and name not in experts)
        return f"{n} non-expert linears"
    if t is Transform.SCALE_MODEL_DTYPE:
        if dtype == torch.float32:
            return "model dtype float32: no change"
        changed = total = 0
        for _, m in model.named_modules():
            s = _static_scale(m, "weight") if isinstance(m, QuantLinear) else None
            if s is not None:
                total += 1
                changed += not torch.equal(s.to(dtype).float(), s)
        return f"{changed} of {total} weight-scale tensors change when rounded to {str(dtype).removeprefix('torch.')}"
    return "every quantized linear"


_COLLAPSES = {
    Transform.WEIGHT_SCALE_MAX,
    Transform.EXPERT_WEIGHT_SCALE_MAX,
    Transform.INPUT_SCALE_MAX,
    Transform.INPUT_SCALE_LAST,
    Transform.EXPERT_INPUT_SCALE_MAX,
}


def _quantizers(model: nn.Module, attr: str, *, dense_only: bool = False):
    experts = _expert_names(model) if dense_only else set()
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear) and name not in experts and getattr(m, attr) is not None:
            yield getattr(m, attr)


def trained_as_deployed(
    model: nn.Module, target: str, t: Transform, dtype: torch.dtype, scheme: QuantScheme | None = None
) -> bool:
    """Was ``model`` trained with ``target``'s transformation ``t`` (so it changes nothing)? Read
    from the model's structure and specs alone (shared Parameters, `QuantSpec` deployment fields),
    so it holds for a ZeRO-3 model whose scales are partitioned."""
    if t in _COLLAPSES:
        return bool(shared_groups(model)) and not tying.untied_groups(model, target, scheme)
    if t is Transform.DYNAMIC_PER_TOKEN:
        qs = [q for q in _quantizers(model, "input_quantizer", dense_only=True) if q.spec.dynamic]
        return bool(qs) and all(q.spec.dynamic_granularity is Granularity.TOKEN for q in qs)
    if t is Transform.SCALE_MODEL_DTYPE:
        want = str(dtype).removeprefix("torch.")
        qs = list(_quantizers(model, "weight_quantizer"))
        return bool(qs) and all(q.spec.scale_dtype == want for q in qs)
    if t is Transform.W4A8_FP8_GROUP_SCALES:
        qs = list(_quantizers(model, "weight_quantizer"))
        return bool(qs) and all(q.spec.w4a8_kernel for q in qs)
    return False


def deployment_differences(
    model: nn.Module, scheme: QuantScheme, *, w4a8_activation: str = "runtime", measure: bool = True
) -> dict[str, Any]:
    """``{"<runtime> <version>": {"loads": bool, "refusal": ..., "differences": [...]}}`` for each
    target. ``measure=False`` (ZeRO-3 streaming export: the scales are partitioned) lists the
    transformations without counting what they change."""
    moe = has_experts(model)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    layout = layout_of(scheme, w4a8_activation=w4a8_activation)
    out: dict[str, Any] = {}
    for target, rt in TARGETS.items():
        refusal = load_refusal(target, layout, moe=moe) or dtype_refusal(target, layout, dtype)
        if refusal is None and moe and measure:
            refusal = expert_input_scale_refusal(target, layout, _expert_input_pairs(model))
        entry: dict[str, Any] = {"layout": layout.value, "loads": refusal is None}
        if refusal is not None:
            entry["refusal"] = f"{refusal.what} ({refusal.source})"
        diffs, matched = [], []
        for t, fact in transforms(target, layout):
            if t in DENSE_ONLY and moe and not _has_dense_quantized(model):
                continue
            line = f"{t.value} [{fact.source}]"
            if trained_as_deployed(model, target, t, dtype, scheme):
                matched.append(line)
                continue
            if measure:
                line += f": {_measure(model, t, dtype)}"
            diffs.append(line)
        entry["scales_tied"] = bool(tying.tie_plan(model, target, layout)) and not tying.untied_groups(
            model, target, scheme
        )
        entry["trained_as_deployed"] = matched
        k = scheme.k
        if k is not None and k.is_fp8 and not k.dynamic:
            per_head = k.granularity is Granularity.HEAD
            diffs += [
                f"KV cache: {f.what} [{f.source}]" for f in kv_facts(target, per_head=per_head, moe=moe)
            ]
        entry["differences"] = diffs
        out[str(rt)] = entry
    return out


def _expert_input_pairs(model: nn.Module) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(expert, gate input scale, up input scale)`` of every expert with static scalar ones."""
    mods = dict(model.named_modules())
    experts = _expert_names(model)
    out = []
    for g in fused_groups(model):
        if g.kind is GroupKind.GATE_UP and g.members[0] in experts:
            s = [
                _static_scale(mods.get(m) if isinstance(mods.get(m), QuantLinear) else None, "input")
                for m in g.members
            ]
            if all(x is not None and x.numel() == 1 for x in s):
                out.append((g.parent, s[0], s[1]))
    return out


def _has_dense_quantized(model: nn.Module) -> bool:
    experts = _expert_names(model)
    return any(isinstance(m, QuantLinear) and n not in experts for n, m in model.named_modules())
