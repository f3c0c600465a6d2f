"""Fused-MoE linearisation: fused 3-D expert tensors -> one ``nn.Linear`` per expert projection.

transformers 5 stores Qwen3-MoE experts fused (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``),
which no per-layer quantizer can see: tools that only swap ``nn.Linear`` silently leave most of
an MoE model unquantized. Here each expert becomes ``gate_proj`` / ``up_proj`` / ``down_proj``
linears named exactly like the per-expert keys ``save_pretrained`` writes
(``mlp.experts.{e}.gate_proj.weight``), so checkpoint keys and module names agree.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

_FUSED_ATTRS = ("gate_up_proj", "down_proj", "num_experts", "hidden_dim", "intermediate_dim", "act_fn")


def is_fused_experts(module: nn.Module) -> bool:
    """Duck-typed: any module with the fused-expert attributes (Qwen3-MoE and its relatives)."""
    return all(hasattr(module, a) for a in _FUSED_ATTRS) and isinstance(module.gate_up_proj, nn.Parameter)


def _check_layout(name: str, module: nn.Module) -> None:
    """Refuse fused layouts the copy below would scramble silently.

    transformers' ``use_experts_implementation`` records the layout on the module; the copy in
    `linearize_moe_experts` assumes Qwen3-MoE's: ``gate_up_proj [E, 2I, H]`` with gate rows before
    up rows, ``down_proj [E, H, I]``, no biases, and ``act(gate) * up`` as the gate."""
    problems = []
    if getattr(module, "is_transposed", False):
        problems.append("transposed weights")
    if not getattr(module, "is_concatenated", True):
        problems.append("interleaved gate/up rows")
    if getattr(module, "has_bias", False) or hasattr(module, "gate_up_proj_bias"):
        problems.append("expert biases")
    if not getattr(module, "has_gate", True):
        problems.append("no gate projection")
    if getattr(module, "has_post_expert_norm", False):
        problems.append("a post-expert norm")
    apply_gate = getattr(type(module), "_apply_gate", None)
    if apply_gate is not None and getattr(apply_gate, "__name__", "") != "_default_apply_gate":
        problems.append(f"a custom gate function ({type(module).__name__}._apply_gate)")
    e, h, i = module.num_experts, module.hidden_dim, module.intermediate_dim
    # ZeRO-3 partitioned parameters keep their full shape in ``ds_shape``.
    gu, dn = (tuple(getattr(p, "ds_shape", p.shape)) for p in (module.gate_up_proj, module.down_proj))
    if gu != (e, 2 * i, h) or dn != (e, h, i):
        problems.append(f"gate_up_proj {gu} / down_proj {dn} instead of {(e, 2 * i, h)} / {(e, h, i)}")
    if problems:
        raise NotImplementedError(
            f"cannot linearise the fused experts {name} ({type(module).__name__}): {'; '.join(problems)}"
        )


class ExpertMLP(nn.Module):
    """One expert: ``down(act(gate(x)) * up(x))``, times the tokens' routing weights when given.

    The weighting is inside the module so that, under ZeRO-3, the module's output is the first
    node its backward meets: DeepSpeed's pre-backward hook gathers the expert's weights and makes
    it the running backward module BEFORE a per-expert checkpoint recomputes it
    (`recompute_experts_one_by_one`); then what the recompute gathers is released with this
    expert's backward, not the layer's."""

    def __init__(self, hidden: int, inter: int, act_fn: Callable, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden, inter, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(inter, hidden, bias=False, dtype=dtype)
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor, routing_weights: torch.Tensor | None = None) -> torch.Tensor:
        y = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return y if routing_weights is None else y * routing_weights[:, None]


class LinearizedMoeExperts(nn.ModuleList):
    """Drop-in replacement of a fused experts module with the same forward signature.

    Every expert MODULE is called on every call, also with zero tokens: under ZeRO-3 each call
    gathers its parameters (per expert, or per layer when this module is a leaf) and its scales
    get a gradient, and ranks whose routing differs must still issue the same collectives in the
    same order, or they deadlock. A zero-token call computes nothing (`fq_linear` skips the
    weight fake-quant of an empty input and returns zero scale gradients).

    The tokens are grouped by expert with one sort and one bincount per layer; the counts reach
    the host once (``tolist``), not once per expert (a ``torch.where`` per expert syncs each time).
    Within an expert the tokens keep their order, so the result equals a per-expert loop bit for bit.
    """

    def __init__(
        self, num_experts: int, hidden: int, inter: int, act_fn: Callable, dtype: torch.dtype | None = None
    ):
        super().__init__([ExpertMLP(hidden, inter, act_fn, dtype) for _ in range(num_experts)])
        self.num_experts = num_experts
        self.hidden_dim = hidden
        self.intermediate_dim = inter
        self.recompute_per_expert = False  # `recompute_experts_one_by_one` sets it

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        per_expert = self.recompute_per_expert and torch.is_grad_enabled()
        # Saved normally (by reference) here, not by the enclosing layer's checkpoint: see
        # `recompute_experts_one_by_one`.
        with (
            torch.autograd.graph.saved_tensors_hooks(_same, _same) if per_expert else contextlib.nullcontext()
        ):
            out = torch.zeros_like(hidden_states)
            flat = top_k_index.reshape(-1)
            order = torch.argsort(flat, stable=True)  # (token, k) pairs grouped by expert, in token order
            counts = torch.bincount(flat, minlength=len(self)).tolist()  # the layer's one host sync
            token_idx = order // top_k_index.shape[-1]
            w_sorted = top_k_weights.reshape(-1)[order]
            start = 0
            for expert, n in zip(self, counts):
                rows = slice(start, start + n)
                start += n
                args = (expert, hidden_states, token_idx[rows], w_sorted[rows])
                y = (
                    checkpoint(_weighted_expert, *args, use_reentrant=False)
                    if per_expert
                    else _weighted_expert(*args)
                )
                out.index_add_(0, token_idx[rows], y.to(out.dtype))
        return out


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _weighted_expert(
    expert: ExpertMLP, hidden: torch.Tensor, idx: torch.Tensor, w: torch.Tensor
) -> torch.Tensor:
    """One expert's routing-weighted output for the tokens ``idx`` (one call, so one checkpoint
    saves only the layer input it shares with every expert, the indices and the weights)."""
    return expert(hidden[idx], w)


def recompute_experts_one_by_one(model: nn.Module) -> int:
    """Under non-reentrant activation checkpointing of decoder layers, recompute each expert inside
    its own backward instead of all of a layer's experts at the start of the layer's backward.

    Why: a layer's recompute would gather every expert's frozen weights, and DeepSpeed ZeRO-3
    (0.19) keeps frozen parameters gathered in a checkpoint recompute until the module whose
    backward triggered it finishes (``update_recompute_parameters``): with one expert per gather
    (qatlib's default, `qatlib.zero3.ds_config`) a rank then holds a whole layer of experts (1.2 GB for
    Qwen3-30B-A3B) through that backward, the step's peak (issue #16). With this on, the experts
    block saves its tensors outside the layer's checkpoint (so the layer's recompute stops, by
    PyTorch's early stop, at the router, before any expert) and each expert is its own
    checkpoint, recomputed when its backward starts: one expert's weights are gathered at a time.
    What is kept per layer: the experts' shared input, the routing indices and weights, the
    output; the same arithmetic, bit for bit. Returns how many experts blocks were set."""
    blocks = [m for m in model.modules() if isinstance(m, LinearizedMoeExperts)]
    for m in blocks:
        m.recompute_per_expert = True
    return len(blocks)


def linearize_moe_experts(
    model: nn.Module,
    *,
    copy_weights: bool = True,
    init_context: Callable[[], ContextManager] = contextlib.nullcontext,
) -> int:
    """Replace every fused experts module in ``model`` in place; returns how many were replaced.

    ``copy_weights`` copies the fused tensors into the new linears (plain models), one layer at a
    time, and drops each fused tensor as soon as its per-expert linears hold the copy: the peak
    adds one layer's experts, not a second copy of every expert (issue #16: +58 GB on a 61 GB
    Qwen3-30B-A3B). The new linears are allocated uninitialised on the fused tensors' device
    (their random init would be overwritten; with a non-default ``init_context`` they are built
    inside it as before). The ZeRO-3 path passes ``copy_weights=False`` and
    ``init_context=zero.Init`` so the new linears are partitioned at creation and later filled
    by the streaming loader.
    """
    targets = [name for name, m in model.named_modules() if is_fused_experts(m)]
    for name in targets:
        _check_layout(name, model.get_submodule(name))
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        fused = getattr(parent, child)
        args = (fused.num_experts, fused.hidden_dim, fused.intermediate_dim, fused.act_fn)
        dtype, device = fused.gate_up_proj.dtype, fused.gate_up_proj.device
        if copy_weights and init_context is contextlib.nullcontext:
            with torch.device("meta"):
                lin = LinearizedMoeExperts(*args, dtype)
            lin.to_empty(device=device)
        else:
            with init_context():
                lin = LinearizedMoeExperts(*args, dtype)
        if copy_weights:
            inter = fused.intermediate_dim
            with torch.no_grad():
                for e, expert in enumerate(lin):
                    expert.gate_proj.weight.copy_(fused.gate_up_proj[e, :inter])
                    expert.up_proj.weight.copy_(fused.gate_up_proj[e, inter:])
                    expert.down_proj.weight.copy_(fused.down_proj[e])
            lin.to(device)
        setattr(parent, child, lin)
        # drop the fused tensors now: the module may still be referenced (hooks, a caller)
        for attr in ("gate_up_proj", "down_proj"):
            delattr(fused, attr)
        del fused
    return len(targets)
