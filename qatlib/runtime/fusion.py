"""Which linears a deployment runtime fuses into one kernel, found by model structure.

vLLM and SGLang load q/k/v into one ``qkv_proj``, gate/up into one ``gate_up_proj`` (dense MLPs and
each expert's ``w13``), and all experts of an MoE layer into one fused-experts module (``w13`` /
``w2``). A fused module has ONE quantization scheme (so a checkpoint must quantize all its shards
or none of them) and, for static per-tensor scales, the runtime collapses the shards' scales into
one (`qatlib.runtime.facts`). The groups here are what the export's ignore check, the runtime
emulator and scale tying share, so all three agree on what "fused" means.

Selection is structural (the children `PACKED` names, all of them under one module: ``q_proj`` /
``k_proj`` / ``v_proj``, ``gate_proj`` + ``up_proj``, MLA's ``q_a_proj`` + ``kv_a_proj_with_mqa``,
linear attention's ``in_proj_qkv`` + ``in_proj_z`` and ``in_proj_b`` + ``in_proj_a``; an ``experts``
module list beside a router ``gate``), like
`qatlib.quant.linear.attention_role` / `is_router`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from torch import nn


class GroupKind(enum.Enum):
    QKV = "qkv"  # one attention's q/k/v -> qkv_proj
    GATE_UP = "gate_up"  # one MLP's (or one expert's) gate/up -> gate_up_proj / w13[e]
    QKV_A = "qkv_a"  # MLA's q_a_proj / kv_a_proj_with_mqa -> fused_qkv_a_proj (DeepSeek-V3, GLM-5)
    QKVZ = "qkvz"  # gated-delta linear attention's in_proj_qkv / in_proj_z -> in_proj_qkvz (Qwen3.5)
    BA = "ba"  # its in_proj_b / in_proj_a -> in_proj_ba (Qwen3.5)
    EXPERTS_W13 = "experts_w13"  # every expert's gate/up of one MoE layer -> w13 (one input scale)
    EXPERTS_W2 = "experts_w2"  # every expert's down of one MoE layer -> w2 (one input scale)
    MOE_LAYER = "moe_layer"  # every expert projection of one MoE layer: one scheme (vLLM reads expert 0)


# The dense fused modules: vLLM 0.33's ``packed_modules_mapping`` (fused module -> the checkpoint
# modules it loads as its shards), one entry per kind: llama.py / qwen3.py ... (qkv_proj,
# gate_up_proj), deepseek_v2.py:1909 (fused_qkv_a_proj, set where ``q_lora_rank`` is not None;
# GlmMoeDsa inherits it), qwen3_5.py:315-316 (in_proj_qkvz, in_proj_ba). Qwen3-Next's checkpoint
# already holds in_proj_qkvz / in_proj_ba as single linears (qwen3_next.py:832-833: one shard
# each). tests/test_families.py checks this table against the mapping of each family's loaded vLLM
# model (`qatlib.runtime.load`), so a vLLM that fuses more is a failing test, not a silent split.
PACKED: dict[GroupKind, tuple[str, ...]] = {
    GroupKind.QKV: ("q_proj", "k_proj", "v_proj"),
    GroupKind.GATE_UP: ("gate_proj", "up_proj"),
    GroupKind.QKV_A: ("q_a_proj", "kv_a_proj_with_mqa"),
    GroupKind.QKVZ: ("in_proj_qkv", "in_proj_z"),
    GroupKind.BA: ("in_proj_b", "in_proj_a"),
}
DENSE_FUSED = tuple(PACKED)  # the kinds whose shards' per-tensor scales the runtime collapses to one


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
        for kind, members in PACKED.items():
            if all(isinstance(getattr(module, a, None), nn.Module) for a in members):
                out.append(FusedGroup(kind, name, tuple(_join(name, a) for a in members)))
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
