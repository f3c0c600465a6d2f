"""Train what will be deployed: the scales a runtime merges are ONE learnable parameter.

vLLM / SGLang load q/k/v, gate/up and a layer's experts as fused modules (`qatlib.runtime.fusion`)
and collapse their static per-tensor scales at load time (`qatlib.runtime.facts`): the max over
the shards' weight and input scales, the max over every expert's input scale. A model trained with
independent scales is then not the model served. Under a ``deploy.target`` (`apply_target`, called
by `qatlib.quant.prepare`) every such group of quantizers shares one ``scale`` Parameter (and zero
point), so QAT learns, PTQ calibrates (`qatlib.quant.calibration`: the union of the members'
observed ranges, i.e. the max of their scales) and the checkpoint stores the one value the runtime
will use. The same step sets the runtime's forward arithmetic on each quantizer's spec
(`deploy_spec`: per-token dynamic inputs of dense layers, scales in the model dtype, the W4A8
kernel's scale path).

Checkpoint keys stay one per linear (compressed-tensors and both runtimes read each shard's scale):
the shared value is written under every member's key. A checkpoint whose tied keys disagree (an
untied PTQ run) loads with the runtime's rule, the max (`checkpoint_max`); this never changes what
the runtime would serve from that checkpoint.

``deploy.target: none`` calls nothing here: the model is bit-for-bit the untied one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..runtime.facts import DENSE_ONLY, TARGETS, Layout, Transform, layout_of, transforms
from ..runtime.fusion import GroupKind, fused_groups
from .functional import qparams_from_range
from .quantizer import Quantizer
from .spec import Granularity, QuantScheme, QuantSpec

log = logging.getLogger(__name__)

_PAIRS = (GroupKind.QKV, GroupKind.GATE_UP)
_EXPERTS = (GroupKind.EXPERTS_W13, GroupKind.EXPERTS_W2)
# load-time transformation -> (the fused groups it merges, the quantizer of each member it merges)
_TIES: dict[Transform, tuple[tuple[GroupKind, ...], str]] = {
    Transform.WEIGHT_SCALE_MAX: (_PAIRS, "weight_quantizer"),
    Transform.INPUT_SCALE_MAX: (_PAIRS, "input_quantizer"),
    Transform.INPUT_SCALE_LAST: (_PAIRS, "input_quantizer"),  # equal scales: "last shard wins" is moot
    Transform.EXPERT_INPUT_SCALE_MAX: (_EXPERTS, "input_quantizer"),
}
# NVFP4: the runtime collapses the shards' global scales (not their group scales) to one
_GLOBAL_TIES: dict[Transform, tuple[tuple[GroupKind, ...], tuple[str, ...]]] = {
    Transform.FP4_GLOBAL_SCALE_MAX: (_PAIRS, ("weight_quantizer", "input_quantizer")),
    Transform.FP4_GLOBAL_SCALE_MUST_MATCH: (_PAIRS, ("weight_quantizer",)),
    Transform.EXPERT_W13_GLOBAL_SCALE: ((GroupKind.GATE_UP,), ("weight_quantizer",)),
}
TIED_KINDS = frozenset({"scale", "zero_point", "global_scale"})


@dataclass(frozen=True)
class TiedGroup:
    """One set of quantizers (``names``, qualified) that share their ``scale`` (and zero point)."""

    kind: GroupKind
    parent: str
    names: tuple[str, ...]
    param: str = "scale"  # "global_scale": NVFP4's per-tensor global scale (group scales stay per shard)


def _quantizer_of(model_modules: Mapping[str, nn.Module], linear: str, attr: str) -> Quantizer | None:
    q = getattr(model_modules.get(linear), attr, None)
    return q if isinstance(q, Quantizer) else None


def _tieable(q: Quantizer | None) -> bool:
    """A static, stored, per-tensor scale: the only kind the runtimes collapse (channel / group
    scales are concatenated per shard, dynamic ones are computed per call)."""
    return (
        q is not None
        and not q.spec.dynamic
        and not q.uses_lwc
        and q.scale is not None
        and q.spec.granularity is Granularity.TENSOR
    )


def tie_plan(model: nn.Module, target: str, layout: Layout) -> list[TiedGroup]:
    """The quantizer groups ``target`` merges at load for an export of ``layout`` (the groups whose
    members all have a tieable scale; nothing for ``none``)."""
    if target not in TARGETS:
        return []
    wanted = [_TIES[t] for t, _ in transforms(target, layout) if t in _TIES]
    mods = dict(model.named_modules())
    out: list[TiedGroup] = []
    seen: set[tuple[str, str, GroupKind]] = set()
    for g in fused_groups(model):
        for kinds, attr in wanted:
            if g.kind not in kinds or (g.parent, attr, g.kind) in seen:
                continue
            qs = [_quantizer_of(mods, m, attr) for m in g.members]
            if len(qs) > 1 and all(_tieable(q) for q in qs):
                seen.add((g.parent, attr, g.kind))
                out.append(TiedGroup(g.kind, g.parent, tuple(f"{m}.{attr}" for m in g.members)))
    # an expert's gate/up input pair lies inside its layer's w13 group: keep the larger group only
    sets = [frozenset(g.names) for g in out]
    out = [g for g, s in zip(out, sets) if not any(s < t for t in sets)]
    return out + _global_plan(model, target, layout, mods)


def _global_plan(model, target, layout, mods) -> list[TiedGroup]:
    """The NVFP4 global-scale groups: q/k/v and gate/up (dense and each expert's) weight global
    scales, and for W4A4 the input global scales of the same groups."""
    attrs = {a for t, _ in transforms(target, layout) if t in _GLOBAL_TIES for a in _GLOBAL_TIES[t][1]}
    out: list[TiedGroup] = []
    for g in fused_groups(model):
        if g.kind not in _PAIRS:
            continue
        for attr in sorted(attrs):
            qs = [_quantizer_of(mods, m, attr) for m in g.members]
            if len(qs) > 1 and all(q is not None and q.global_scale is not None for q in qs):
                out.append(
                    TiedGroup(g.kind, g.parent, tuple(f"{m}.{attr}" for m in g.members), "global_scale")
                )
    return out


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


def tie(model: nn.Module, groups: Iterable[TiedGroup]) -> list[TiedGroup]:
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
def _tie_global(model: nn.Module, g: TiedGroup, qs: list[Quantizer]) -> None:
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


# --------------------------------------------------------------------------- deployed arithmetic
def deploy_spec(spec: QuantSpec, target: str, layout: Layout, *, role: str, expert: bool, dtype: torch.dtype):
    """``spec`` with the deployment fields of what ``target`` computes for it (`QuantSpec`):
    ``role`` is ``"weight"`` / ``"input"``, ``expert`` whether the linear is an MoE expert (dense-only
    transformations skip it), ``dtype`` the model dtype."""
    ts = {t for t, _ in transforms(target, layout) if not (expert and t in DENSE_ONLY)}
    changes: dict = {}
    if role == "input" and Transform.DYNAMIC_PER_TOKEN in ts and spec.dynamic:
        changes["dynamic_granularity"] = Granularity.TOKEN
    if role == "input" and layout is Layout.W4A8 and spec.granularity is not Granularity.TOKEN:
        # the W4A8-FP8 kernel quantizes its input per token, dynamically, whatever was calibrated
        # (vLLM CT compressed_tensors.py:648-654 `_is_fp8_w4a8_sm90`); the export writes that too
        changes["dynamic_granularity"] = Granularity.TOKEN
    if role == "input" and spec.is_fp8:  # vLLM QuantFP8: x * (1/s) (input_quant_fp8.py:216-220)
        changes["scale_reciprocal"] = True
    if role == "weight" and Transform.W4A8_FP8_GROUP_SCALES in ts:
        changes.update(w4a8_kernel=True, scale_dtype="bfloat16")  # the kernel needs a bf16 model
    elif role == "weight" and Transform.SCALE_MODEL_DTYPE in ts and dtype in (torch.bfloat16, torch.float16):
        changes["scale_dtype"] = str(dtype).removeprefix("torch.")
    return spec.replace(**changes) if changes else spec


def apply_target(model: nn.Module, scheme: QuantScheme, target: str) -> list[TiedGroup]:
    """Make a freshly prepared ``model`` compute what ``target`` serves: each quantizer's spec gets
    the runtime's arithmetic (`deploy_spec`), then the groups the runtime merges are tied (`tie`).
    ``none``: nothing changes. Returns the tied groups."""
    if target not in TARGETS:
        return []
    from .linear import QuantLinear

    layout = layout_of(scheme)
    experts = {m for g in fused_groups(model) if g.kind is GroupKind.MOE_LAYER for m in g.members}
    for name, ql in model.named_modules():
        if not isinstance(ql, QuantLinear):
            continue
        dtype = ql.weight.dtype
        for attr, role in (("weight_quantizer", "weight"), ("input_quantizer", "input")):
            q = getattr(ql, attr)
            if q is not None:
                q.spec = deploy_spec(q.spec, target, layout, role=role, expert=name in experts, dtype=dtype)
    groups = tie(model, tie_plan(model, target, layout))
    if groups:
        log.info(
            "deploy.target %s: %d quantizer groups share one scale (%s)", target, len(groups), layout.value
        )
    return groups


# --------------------------------------------------------------------------- inspection (emulator hook)
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


def untied_groups(model: nn.Module, target: str) -> list[TiedGroup]:
    """The groups ``target`` merges whose members do NOT share one Parameter (empty: fully tied)."""
    from .linear import prepared_scheme

    scheme = prepared_scheme(model)
    if scheme is None:
        return []
    mods = dict(model.named_modules())
    return [
        g
        for g in tie_plan(model, target, layout_of(scheme))
        if len({id(getattr(mods[n], g.param)) for n in g.names}) > 1
    ]


def scales_agree(tensors: Mapping[str, torch.Tensor], key_groups: Iterable[Iterable[str]]) -> bool:
    """Do the exported scales under each group of keys agree (a tied export)? For an export the
    emulator reads: ``key_groups`` from `key_groups`."""
    for keys in key_groups:
        vals = [tensors[k] for k in keys if k in tensors]
        if any(not torch.equal(vals[0], v) for v in vals[1:]):
            return False
    return True


def key_groups(model: nn.Module, target: str) -> list[list[str]]:
    """The checkpoint keys (`qatlib.checkpoint.keys`) of each group ``target`` merges, for a prepared
    ``model`` (tied or not): per group, one ``scale`` key list (and one ``zero_point`` list)."""
    from ..checkpoint.keys import scale_keys
    from .linear import prepared_scheme

    scheme = prepared_scheme(model)
    if scheme is None:
        return []
    keys = scale_keys(model)
    out = []
    for g in tie_plan(model, target, layout_of(scheme)):
        for kind in [g.param] if g.param == "global_scale" else sorted(TIED_KINDS - {"global_scale"}):
            ks = [keys[f"{n}.{kind}"] for n in g.names if f"{n}.{kind}" in keys]
            if len(ks) > 1:
                out.append(ks)
    return out


# --------------------------------------------------------------------------- checkpoint load
def param_aliases(model: nn.Module) -> dict[str, str]:
    """Tied quantizer parameter names -> the name ``named_parameters`` gives the shared tensor."""
    canon = {id(p): n for n, p in model.named_parameters()}
    return {
        n: canon[id(p)]
        for n, p in model.named_parameters(remove_duplicate=False)
        if canon[id(p)] != n and n.rpartition(".")[2] in TIED_KINDS
    }


@torch.no_grad()
def checkpoint_max(
    model: nn.Module, read: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """For a tied ``model`` and the checkpoint values of its tied keys (``read``: key -> tensor),
    the value each shared scale takes when its keys disagree: the runtime's rule, the max (the
    union of ranges with zero points). Returns ``({canonical param name: value}, [disagreeing
    groups])``; groups whose keys agree (a tied checkpoint) need nothing."""
    from ..checkpoint.keys import scale_keys

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
    from ..checkpoint.keys import scale_keys

    keys = scale_keys(model)
    aliases = param_aliases(model)
    names = set(aliases) | set(aliases.values())
    return sorted({keys[n] for n in names if n in keys})


def export_is_tied(export_dir, target: str = "vllm") -> bool | None:
    """Was the model exported to ``export_dir`` trained with ``target``'s merged scales tied (the
    ``scales_tied`` that `qatlib.runtime.differences` records in ``qatlib_export.json``)? None when
    the export records nothing for ``target`` (an older export, or a runtime that cannot load it).
    The emulator's hook: a tied export is served as trained; an untied one is not."""
    import json
    from pathlib import Path

    from ..export import EXPORT_INFO_FILE

    try:
        info = json.loads((Path(export_dir) / EXPORT_INFO_FILE).read_text())
    except (OSError, ValueError):
        return None
    rt = TARGETS.get(target)
    entry = (info.get("deployment") or {}).get(str(rt)) if rt is not None else None
    return None if not entry or "scales_tied" not in entry else bool(entry["scales_tied"])
