"""The DeepSpeed config a run uses: the user's JSON with qatlib's memory defaults filled in.

Why this module: what ZeRO-3 gathers as one unit decides a rank's peak, and a user brings
whichever JSON they have (the repository's, upstream AngelSlim's ``ds_config_zero3.json``, their
own), none of which knows qatlib's per-expert modules. DeepSpeed 0.19's own default leaf list
makes transformers' ``Qwen3MoeSparseMoeBlock`` one gather: a whole layer's experts (1.2 GB bf16
per Qwen3-30B-A3B layer) on every rank at once (issue #36: 4.78 GiB per rank instead of 3.05 on
the 2-layer width rehearsal). So a ZeRO-3 config that names no ``zero_optimization.leaf_module``
gets qatlib's: one expert (`qatlib.surgery.moe.ExpertMLP`) per gather. A JSON that names its own list
keeps it (the user owns the choice; `qatlib.plan.zero3_setting_warnings` says what it costs).

Every reader goes through `with_defaults`: `qatlib.config.ExperimentConfig.deepspeed_config`
(hence the HF Trainer's arguments and `qatlib.zero3.io.init_zero3`, which applies it again for a
config passed by hand) and `qatlib.plan.from_experiment`, so the run and its plan agree. Torch-free.
"""

from __future__ import annotations

import copy
from typing import Any

EXPERT_LEAF_CLASS = "qatlib.surgery.moe.ExpertMLP"
# a whole MoE layer's experts as one leaf: the default when the experts share a trained scale
EXPERTS_LEAF_CLASS = "qatlib.surgery.moe.LinearizedMoeExperts"
# DeepSpeed 0.19's leaf list when a config names none (runtime/zero/leaf_module_config.py
# DEFAULT_LEAF_MODULE_CLASSES; tests/test_zero3.py checks the mirror)
DEEPSPEED_DEFAULT_LEAVES = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)
# ZeRO-3 leaves that gather a whole MoE layer's experts at once: qatlib's linearised experts
# block, and the sparse blocks DeepSpeed's default list names (by class-name suffix)
WHOLE_LAYER_LEAVES = ("LinearizedMoeExperts", "SparseMoeBlock")


def zero_stage(ds: Any) -> int | None:
    """``zero_optimization.stage`` of a DeepSpeed config (None when absent or not an int)."""
    zo = ds.get("zero_optimization") if isinstance(ds, dict) else None
    stage = zo.get("stage") if isinstance(zo, dict) else None
    return stage if isinstance(stage, int) and not isinstance(stage, bool) else None


def with_defaults(ds: dict[str, Any] | None, *, whole_layer_experts: bool = False) -> dict[str, Any] | None:
    """``ds`` with qatlib's ZeRO-3 defaults where it says nothing: ``zero_optimization.leaf_module``
    = one `qatlib.surgery.moe.ExpertMLP` per gather, or with ``whole_layer_experts`` a whole layer's experts
    (`qatlib.surgery.moe.LinearizedMoeExperts`: what a run whose experts share a scale and train their
    weights needs, `expert_leaf_issue`). The same object when nothing is added (not ZeRO-3, or the
    JSON has its own list), else a copy; idempotent."""
    if zero_stage(ds) != 3 or "leaf_module" in ds["zero_optimization"]:
        return ds
    out = copy.deepcopy(ds)
    leaf = EXPERTS_LEAF_CLASS if whole_layer_experts else EXPERT_LEAF_CLASS
    out["zero_optimization"]["leaf_module"] = {"classes": [leaf]}
    return out


def expert_leaf_issue(ds: dict[str, Any] | None) -> str | None:
    """Why ``ds`` cannot train the weights of experts that share a scale; None when it can.

    DeepSpeed ZeRO-3 reduces a leaf module's gradients when that leaf's backward ends
    (``reduce_leaf_module_grads``) and files a parameter of several leaves under the last one. A
    scale every expert of a layer uses (vLLM's one static input scale per fused-MoE layer) is then
    reduced while other experts still add to it; with the experts' weights training too the late
    gradient is left on the parameter and the step fails in DeepSpeed's ``zero_grad``
    (``record_stream``: "unknown parameter type" on the CPU; measured on a 2-rank fp8_static MoE).
    Scales alone trained as one process here (tests/test_trainers.py), so only the weight-training
    case is refused. A leaf that holds the whole layer's experts has no such split."""
    if zero_stage(ds) != 3 or gathers_whole_layers(ds):
        return None
    classes = [c.rsplit(".", 1)[-1] for c in leaf_classes(ds)]
    if EXPERT_LEAF_CLASS.rsplit(".", 1)[-1] not in classes:
        return None  # no per-expert leaf: every parameter gets its own gradient hook
    return (
        "zero_optimization.leaf_module.classes makes each expert (qatlib.surgery.moe.ExpertMLP) a ZeRO-3 leaf, but "
        "the experts of a layer share one trained scale (the runtime's merged static input scale) and their "
        "weights train (weight_lr): DeepSpeed reduces the shared scale's gradient when one expert's backward "
        f"ends and the step then fails on the others'. Name {EXPERTS_LEAF_CLASS} instead (one layer's "
        "experts per gather), or leave leaf_module out (qatlib then picks it)"
    )


def leaf_classes(ds: dict[str, Any] | None) -> list[str]:
    """The class names DeepSpeed makes ZeRO-3 leaves under ``ds`` with qatlib's defaults (a
    config that still names none gets DeepSpeed's own default list)."""
    zo = (with_defaults(ds) or {}).get("zero_optimization") or {}
    if "leaf_module" not in zo:
        return list(DEEPSPEED_DEFAULT_LEAVES)
    leaf = zo["leaf_module"]
    if not isinstance(leaf, dict):
        return []
    classes = leaf.get("classes", [])
    return [str(c) for c in ([classes] if isinstance(classes, str) else classes)]


def gathers_whole_layers(ds: dict[str, Any] | None) -> bool:
    """Whether a MoE layer's experts are gathered together under ``ds`` (with qatlib's defaults):
    a class that holds a whole layer's experts is a leaf (DeepSpeed gathers a leaf's parameters
    at once, and the outermost leaf decides). False: one expert (`qatlib.surgery.moe.ExpertMLP`), or one
    linear when no class is a leaf."""
    names = [c.rsplit(".", 1)[-1] for c in leaf_classes(ds)]
    return any(n.endswith(w) for n in names for w in WHOLE_LAYER_LEAVES)
