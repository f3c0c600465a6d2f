"""What an export quantized and what it kept in high precision, per module type, and why.

``qatlib_export.json``'s ``coverage`` (`ExportPlan.record`): no weight a runtime could quantize
is left in bf16 without a word. Every module holding a weight matrix is counted once, by type
and role (``<parent type>.<attribute>`` for a linear, e.g. ``ExpertMLP.gate_proj``,
``Qwen3MoeAttention.q_proj``; the class name otherwise), as quantized (a `QuantLinear`) or kept,
with one reason per kept group (`REASONS`). Selection is by module structure, like
`qatlib.quant.linear.is_router`, never by name substrings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from ..patterns import matches_any
from ..quant.linear import QuantLinear, is_router, kept_plain
from ..quant.quantizer import Quantizer
from ..surgery.moe import LinearizedMoeExperts, experts_layout, layout_problems

# why a module holding a weight matrix was kept unquantized
REASONS = {
    "ignore": "ignore list (ignore_layers)",
    "router": "router: vLLM keeps it unquantized",
    "embedding": "embedding: vLLM keeps it unquantized",
    "vllm_plain": "vLLM builds it unquantized (quant_config=None)",
    "plain": "plain linear not prepared (prepare's default ignore, e.g. lm_head)",
    "refused": "refused layout: fused experts not linearised",
    "other": "not a linear: no quantized form in compressed-tensors",
}

# Interleaved gate/up experts (GPT-OSS) are written as vLLM 0.33's gpt_oss loader reads streamed
# experts (`qatlib.export.experts`: ``experts.<e>.gate_up_proj`` interleaved, ``experts.<e>.down_proj``;
# checked against vLLM's load, tests/test_gpt_oss.py). transformers 5.24 has no checkpoint conversion
# for gpt_oss: measured, ``from_pretrained`` of such an export reports these keys unexpected and the
# fused experts missing, i.e. left at their random init, without an error. qatlib's reader
# (`qatlib.export.experts.unfused_expert_tensors`) reads them back.
VLLM_INTERLEAVED_EXPERTS = (
    "interleaved gate/up experts (gpt_oss) written per expert as vLLM 0.33's gpt_oss loader reads them "
    "(experts.<e>.gate_up_proj: gate/up interleaved, transposed; experts.<e>.down_proj): vLLM loads them; "
    "transformers 5.24 from_pretrained does NOT (no gpt_oss conversion: the fused experts stay at their "
    "random init, the keys reported unexpected); reload with qatlib.export.experts.unfused_expert_tensors"
)


# a QuantLinear where the runtime builds a plain linear (`kept_plain`): a model prepared before
# prepare() kept these plain
VLLM_PLAIN_BUT_QUANTIZED = (
    "vLLM 0.33 builds this linear unquantized (quant_config=None, qatlib.quant.linear.kept_plain); "
    "this one was quantized, so the checkpoint does not load there"
)


def _dims(p: nn.Parameter) -> tuple[int, ...]:
    # a ZeRO-3 partitioned parameter keeps its full shape in ``ds_shape``
    return tuple(getattr(p, "ds_shape", p.shape))


def is_router_like(parent: nn.Module | None, child: str, module: nn.Module) -> bool:
    """A router: the ``gate`` linear beside ``experts`` (`is_router`), or any sibling of an experts
    module whose weight has one row per expert (GPT-OSS's ``router``, DeepSeek-V3's
    ``DeepseekV3TopkRouter`` with its ``e_score_correction_bias``)."""
    if is_router(parent, child):
        return True
    experts = getattr(parent, "experts", None) if parent is not None else None
    if experts is None or module is experts:
        return False
    n = len(experts) if isinstance(experts, LinearizedMoeExperts) else getattr(experts, "num_experts", None)
    w = getattr(module, "weight", None)
    return isinstance(w, nn.Parameter) and len(_dims(w)) == 2 and _dims(w)[0] == n


def _holds_matrix(module: nn.Module) -> bool:
    return any(len(_dims(p)) >= 2 for p in module.parameters(recurse=False))


def export_coverage(model: nn.Module, ignore: Sequence[str] = ()) -> list[dict[str, Any]]:
    """One row per module type: ``{"module_type", "quantized", "kept": {reason: count}}`` (and
    ``"notes"`` where the deployment runtime reads the layout differently), sorted by type.
    ``ignore``: the user's ``ignore_layers`` (qatlib's matching, `qatlib.patterns.matches_any`)."""
    mods = dict(model.named_modules())
    rows: dict[str, dict[str, Any]] = {}

    def row(kind: str) -> dict[str, Any]:
        return rows.setdefault(kind, {"module_type": kind, "quantized": 0, "kept": {}})

    def keep(kind: str, reason: str) -> None:
        kept = row(kind)["kept"]
        kept[reason] = kept.get(reason, 0) + 1

    inside_fused: set[str] = set()
    for name, m in mods.items():
        if not name or isinstance(m, Quantizer) or any(name.startswith(f + ".") for f in inside_fused):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = mods.get(parent_name) if parent_name else model
        role = f"{type(parent).__name__}.{child}"
        if isinstance(m, QuantLinear):
            row(role)["quantized"] += 1
            gate_fn = getattr(parent, "gate_fn", None)
            if gate_fn is not None and gate_fn.interleaved:
                row(role).setdefault("notes", [VLLM_INTERLEAVED_EXPERTS])
            if kept_plain(parent, child, m):
                row(role).setdefault("notes", [VLLM_PLAIN_BUT_QUANTIZED])
        elif (layout := experts_layout(m)) is not None:
            inside_fused.add(name)
            problems = layout_problems(m, layout) or [layout.describe()]
            keep(type(m).__name__, f"{REASONS['refused']} ({'; '.join(problems)})")
        elif is_router_like(parent, child, m):
            keep(type(m).__name__ if not isinstance(m, nn.Linear) else role, REASONS["router"])
        elif isinstance(m, nn.Embedding):
            keep(type(m).__name__, REASONS["embedding"])
        elif isinstance(m, nn.Linear):
            if ignore and matches_any(name, ignore):
                keep(role, REASONS["ignore"])
            else:
                keep(role, REASONS["vllm_plain"] if kept_plain(parent, child, m) else REASONS["plain"])
        elif _holds_matrix(m):
            keep(type(m).__name__, REASONS["other"])
    return [rows[k] for k in sorted(rows)]
