"""Train what will be deployed: the scales a runtime merges are ONE learnable parameter.

vLLM / SGLang load q/k/v, gate/up and a layer's experts as fused modules (`qatlib.runtime.fusion`)
and collapse their static per-tensor scales at load time (`qatlib.runtime.facts`): the max over
the shards' weight and input scales, the max over every expert's input scale. A model trained with
independent scales is then not the model served. Under a ``deploy.target`` (`apply_target`,
reaching `qatlib.quant.prepare` as ``PrepareOptions.deploy = tie_for(target)``) every such group
of quantizers shares one ``scale`` Parameter (and zero point; the mechanics are
`qatlib.quant.tying`'s), so QAT learns, PTQ calibrates (`qatlib.quant.calibration`: the union of
the members' observed ranges, i.e. the max of their scales) and the checkpoint stores the one
value the runtime will use. The same step sets the runtime's forward arithmetic on each
quantizer's spec (`deploy_spec`: per-token dynamic inputs of dense layers, scales in the model
dtype, the W4A8 kernel's scale path).

Checkpoint keys stay one per linear (compressed-tensors and both runtimes read each shard's scale):
the shared value is written under every member's key. A checkpoint whose tied keys disagree (an
untied PTQ run) loads with the runtime's rule, the max (`qatlib.checkpoint.tied.checkpoint_max`).

``deploy.target: none`` calls nothing here: the model is bit-for-bit the untied one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..checkpoint.keys import scale_keys
from ..checkpoint.layout import EXPORT_INFO_FILE
from ..quant.linear import QuantLinear, prepared_scheme
from ..quant.quantizer import Quantizer
from ..quant.spec import Granularity, QuantScheme, QuantSpec
from ..quant.tying import TIED_KINDS, tie
from .facts import DENSE_ONLY, EXPERTS_ONLY, TARGETS, Layout, Transform, layout_of, transforms
from .fusion import DENSE_FUSED, GroupKind, fused_groups

log = logging.getLogger(__name__)

_PAIRS = DENSE_FUSED  # q/k/v, gate/up, MLA's q_a / kv_a, linear attention's qkv / z and b / a
_EXPERTS = (GroupKind.EXPERTS_W13, GroupKind.EXPERTS_W2)
# load-time transformation -> (the fused groups it merges, the quantizer of each member it merges)
_TIES: dict[Transform, tuple[tuple[GroupKind, ...], str]] = {
    Transform.WEIGHT_SCALE_MAX: (_PAIRS, "weight_quantizer"),
    Transform.INPUT_SCALE_MAX: (_PAIRS, "input_quantizer"),
    Transform.INPUT_SCALE_LAST: (_PAIRS, "input_quantizer"),  # equal scales: "last shard wins" is moot
    Transform.EXPERT_INPUT_SCALE_MAX: (_EXPERTS, "input_quantizer"),
    Transform.EXPERT_WEIGHT_SCALE_MAX: ((GroupKind.GATE_UP,), "weight_quantizer"),  # experts' only
}
# NVFP4: the runtime collapses the shards' global scales (not their group scales) to one
_GLOBAL_TIES: dict[Transform, tuple[tuple[GroupKind, ...], tuple[str, ...]]] = {
    Transform.FP4_GLOBAL_SCALE_MAX: (_PAIRS, ("weight_quantizer", "input_quantizer")),
    Transform.FP4_GLOBAL_SCALE_MUST_MATCH: (_PAIRS, ("weight_quantizer",)),
    Transform.EXPERT_W13_GLOBAL_SCALE: ((GroupKind.GATE_UP,), ("weight_quantizer",)),
}


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


def ties_across_experts(target: str, scheme: QuantScheme) -> bool:
    """Does ``target`` merge a scale over a MoE layer's experts for ``scheme`` (vLLM's one static
    input scale per fused-MoE layer: the max over every expert's)? Such a tie makes one Parameter
    that every expert of the layer uses; ZeRO-3 then gathers a layer's experts together
    (`qatlib.zero3.ds_config.expert_leaf_issue` says why). Model-free: a dense model ties no experts."""
    if target not in TARGETS or scheme.input is None:
        return False
    inp = scheme.input
    if inp.dynamic or inp.granularity is not Granularity.TENSOR:
        return False  # `_tieable`: only a static per-tensor scale is merged
    return any(t is Transform.EXPERT_INPUT_SCALE_MAX for t, _ in transforms(target, layout_of(scheme)))


def tie_plan(model: nn.Module, target: str, layout: Layout) -> list[TiedGroup]:
    """The quantizer groups ``target`` merges at load for an export of ``layout`` (the groups whose
    members all have a tieable scale; nothing for ``none``)."""
    if target not in TARGETS:
        return []
    wanted = [(*_TIES[t], t in EXPERTS_ONLY) for t, _ in transforms(target, layout) if t in _TIES]
    mods = dict(model.named_modules())
    groups = fused_groups(model)
    experts = {m for g in groups if g.kind is GroupKind.MOE_LAYER for m in g.members}
    out: list[TiedGroup] = []
    seen: set[tuple[str, str, GroupKind]] = set()
    for g in groups:
        for kinds, attr, experts_only in wanted:
            if g.kind not in kinds or (g.parent, attr, g.kind) in seen:
                continue
            if experts_only and g.members[0] not in experts:
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


@dataclass(frozen=True)
class TieFor:
    """``PrepareOptions.deploy`` for one runtime: `apply_target` for ``target`` at the end of
    `qatlib.quant.prepare`. Why an object passed down: the quantization core knows no runtime
    (it sits below this package); the experiment config builds one (`tie_for`)."""

    target: str

    def __call__(self, model: nn.Module, scheme: QuantScheme) -> list[TiedGroup]:
        return apply_target(model, scheme, self.target)


def tie_for(target: str) -> TieFor | None:
    """The ``PrepareOptions.deploy`` of ``deploy.target``: None for ``none`` (nothing is tied: the
    model is bit for bit the untied one); an unknown target is a ValueError naming the known."""
    if target == "none":
        return None
    if target not in TARGETS:
        raise ValueError(f"deploy target {target!r}: one of none, {', '.join(TARGETS)}")
    return TieFor(target)


def untied_groups(model: nn.Module, target: str, scheme: QuantScheme | None = None) -> list[TiedGroup]:
    """The groups ``target`` merges whose members do NOT share one Parameter (empty: fully tied).
    ``scheme``: the experiment's (its checkpoint format decides the layout); default the one the
    model was prepared with (`prepared_scheme`: compressed-tensors)."""
    scheme = scheme or prepared_scheme(model)
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


def export_is_tied(export_dir, target: str = "vllm") -> bool | None:
    """Was the model exported to ``export_dir`` trained with ``target``'s merged scales tied (the
    ``scales_tied`` that `qatlib.runtime.differences` records in ``qatlib_export.json``)? None when
    the export records nothing for ``target`` (an older export, or a runtime that cannot load it).
    The emulator's hook: a tied export is served as trained; an untied one is not."""
    try:
        info = json.loads((Path(export_dir) / EXPORT_INFO_FILE).read_text())
    except (OSError, ValueError):
        return None
    rt = TARGETS.get(target)
    entry = (info.get("deployment") or {}).get(str(rt)) if rt is not None else None
    return None if not entry or "scales_tied" not in entry else bool(entry["scales_tied"])
