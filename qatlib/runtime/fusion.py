"""Which linears a deployment runtime fuses into one kernel, found by model structure.

vLLM and SGLang load q/k/v into one ``qkv_proj``, gate/up into one ``gate_up_proj`` (dense MLPs and
each expert's ``w13``), and all experts of an MoE layer into one fused-experts module (``w13`` /
``w2``). A fused module has ONE quantization scheme (so a checkpoint must quantize all its shards
or none of them) and, for static per-tensor scales, the runtime collapses the shards' scales into
one (`qatlib.runtime.facts`). The groups here are what the export's ignore check, the runtime
emulator and scale tying share, so all three agree on what "fused" means.

Selection is structural (``q_proj`` / ``k_proj`` / ``v_proj`` children of one module, ``gate_proj`` +
``up_proj`` children of one module, an ``experts`` module list beside a router ``gate``), like
`qatlib.quant.linear.attention_role` / `is_router`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from torch import nn


class GroupKind(enum.Enum):
    QKV = "qkv"  # one attention's q/k/v -> qkv_proj
    GATE_UP = "gate_up"  # one MLP's (or one expert's) gate/up -> gate_up_proj / w13[e]
    EXPERTS_W13 = "experts_w13"  # every expert's gate/up of one MoE layer -> w13 (one input scale)
    EXPERTS_W2 = "experts_w2"  # every expert's down of one MoE layer -> w2 (one input scale)
    MOE_LAYER = "moe_layer"  # every expert projection of one MoE layer: one scheme (vLLM reads expert 0)


@dataclass(frozen=True)
class FusedGroup:
    """``members``: the module names (in load order) the runtime fuses; ``parent``: their owner."""

    kind: GroupKind
    parent: str
    members: tuple[str, ...]


def _join(prefix: str, child: str) -> str:
    return f"{prefix}.{child}" if prefix else child


def _experts(module: nn.Module) -> nn.ModuleList | None:
    """The linearised expert list of an MoE block (`qatlib.surgery.moe.LinearizedMoeExperts`), else None."""
    experts = getattr(module, "experts", None)
    if isinstance(experts, nn.ModuleList) and len(experts) and hasattr(module, "gate"):
        if all(all(hasattr(e, p) for p in ("gate_proj", "up_proj", "down_proj")) for e in experts):
            return experts
    return None


def fused_groups(model: nn.Module) -> list[FusedGroup]:
    """Every fused group of ``model`` (prepared or not), in module order."""
    out: list[FusedGroup] = []
    for name, module in model.named_modules():
        if all(isinstance(getattr(module, a, None), nn.Module) for a in ("q_proj", "k_proj", "v_proj")):
            out.append(
                FusedGroup(GroupKind.QKV, name, tuple(_join(name, a) for a in ("q_proj", "k_proj", "v_proj")))
            )
        if all(isinstance(getattr(module, a, None), nn.Module) for a in ("gate_proj", "up_proj")):
            out.append(
                FusedGroup(GroupKind.GATE_UP, name, (_join(name, "gate_proj"), _join(name, "up_proj")))
            )
        experts = _experts(module)
        if experts is not None:
            base = _join(name, "experts")
            n = len(experts)
            w13 = tuple(_join(f"{base}.{e}", p) for e in range(n) for p in ("gate_proj", "up_proj"))
            w2 = tuple(f"{base}.{e}.down_proj" for e in range(n))
            out.append(FusedGroup(GroupKind.EXPERTS_W13, base, w13))
            out.append(FusedGroup(GroupKind.EXPERTS_W2, base, w2))
            out.append(FusedGroup(GroupKind.MOE_LAYER, base, w13 + w2))
    return out


def has_experts(model: nn.Module) -> bool:
    return any(g.kind is GroupKind.MOE_LAYER for g in fused_groups(model))


def split_groups(model: nn.Module, is_quantized) -> list[str]:
    """A description of every fused group whose members are partly quantized (``is_quantized(module)``):
    a runtime refuses such a checkpoint (vLLM "different quantization schemes for the shards",
    "All MoE projections need to have same quantization scheme") or, for experts other than
    expert 0, silently applies expert 0's scheme to all of them."""
    mods = dict(model.named_modules())
    bad = []
    for g in fused_groups(model):
        if g.kind in (GroupKind.EXPERTS_W13, GroupKind.EXPERTS_W2):
            continue  # covered by MOE_LAYER
        q = [m for m in g.members if is_quantized(mods[m])]
        if q and len(q) != len(g.members):
            plain = [m for m in g.members if m not in q]
            bad.append(f"{g.kind.value} group {g.parent}: quantized {_short(q)}, unquantized {_short(plain)}")
    return bad


def _short(names: list[str], k: int = 4) -> str:
    return ", ".join(names[:k]) + (f" and {len(names) - k} more" if len(names) > k else "")
