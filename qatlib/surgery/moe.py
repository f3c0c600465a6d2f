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
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

_FUSED_ATTRS = ("gate_up_proj", "down_proj", "num_experts", "hidden_dim", "intermediate_dim", "act_fn")


def is_fused_experts(module: nn.Module) -> bool:
    """Duck-typed: a fused experts module named like Qwen3-MoE's (``hidden_dim`` /
    ``intermediate_dim`` / ``act_fn``), the names the checkpoint key mapping
    (`qatlib.checkpoint.conversion`) reads. Every fused layout, GPT-OSS's included, is found by
    `experts_layout`."""
    return all(hasattr(module, a) for a in _FUSED_ATTRS) and isinstance(module.gate_up_proj, nn.Parameter)


def _shape(p: torch.Tensor) -> tuple[int, ...]:
    # ZeRO-3 partitioned parameters keep their full shape in ``ds_shape``.
    return tuple(getattr(p, "ds_shape", p.shape))


def _is_3d(module: nn.Module, attr: str) -> bool:
    p = getattr(module, attr, None)
    return isinstance(p, nn.Parameter) and len(_shape(p)) == 3


@dataclass(frozen=True)
class ExpertsLayout:
    """How one fused experts module stores its experts: transformers'
    ``use_experts_implementation`` flags (set on the module) and the shapes.

    Qwen3-MoE's layout (every flag False): ``gate_up_proj [E, 2I, H]`` with gate rows before up
    rows, ``down_proj [E, H, I]``, no biases, ``act(gate) * up``. GPT-OSS's: ``transposed``
    (``[E, H, 2I]`` / ``[E, I, H]``, applied as ``x @ W``), ``interleaved`` (gate and up columns
    alternate: ``[..., ::2]`` / ``[..., 1::2]``), ``bias`` (``gate_up_proj_bias [E, 2I]``,
    ``down_proj_bias [E, H]``) and a ``custom_gate`` (its clamped SwiGLU ``_apply_gate``)."""

    num_experts: int
    hidden: int
    inter: int
    transposed: bool = False
    interleaved: bool = False
    bias: bool = False
    custom_gate: bool = False

    def gate_up_index(self) -> tuple[slice, slice]:
        """The gate and up positions along ``gate_up_proj``'s output dimension."""
        if self.interleaved:
            return slice(0, None, 2), slice(1, None, 2)
        return slice(0, self.inter), slice(self.inter, 2 * self.inter)

    def describe(self) -> str:
        parts = [n for n in ("transposed", "interleaved", "bias", "custom_gate") if getattr(self, n)]
        return ", ".join(parts) or "concatenated [E, 2I, H]"


def experts_layout(module: nn.Module) -> ExpertsLayout | None:
    """The `ExpertsLayout` of a fused experts module (3-D ``gate_up_proj`` or ``up_proj`` and
    ``down_proj`` parameters), None for any other module. Sizes come from the shapes (families
    name them ``hidden_dim`` / ``hidden_size``, ``intermediate_dim`` / ``intermediate_size``);
    `layout_problems` checks them against what the module declares."""
    if not _is_3d(module, "down_proj") or not (_is_3d(module, "gate_up_proj") or _is_3d(module, "up_proj")):
        return None
    transposed = bool(getattr(module, "is_transposed", False))
    e, a, b = _shape(module.down_proj)
    hidden, inter = (b, a) if transposed else (a, b)
    apply_gate = getattr(type(module), "_apply_gate", None)
    custom = apply_gate is not None and getattr(apply_gate, "__name__", "") != "_default_apply_gate"
    return ExpertsLayout(
        num_experts=e,
        hidden=hidden,
        inter=inter,
        transposed=transposed,
        interleaved=not getattr(module, "is_concatenated", True),
        bias=bool(getattr(module, "has_bias", False)) or hasattr(module, "gate_up_proj_bias"),
        custom_gate=custom,
    )


def layout_problems(module: nn.Module, layout: ExpertsLayout) -> list[str]:
    """What `linearize_moe_experts` cannot reproduce exactly in this fused experts module (empty:
    it can). The streamed checkpoint loader (`qatlib.checkpoint.conversion`) places every layout
    found here through `expert_slices`, so a ZeRO-3 / skeleton model has no further limit."""
    problems = []
    if not getattr(module, "has_gate", True) or not _is_3d(module, "gate_up_proj"):
        problems.append("no gate projection (up_proj only)")
    if getattr(module, "has_post_expert_norm", False):
        problems.append("a post-expert norm")
    if not layout.custom_gate and not callable(getattr(module, "act_fn", None)):
        problems.append("no act_fn and no _apply_gate")
    if layout.bias and not all(_is_2d(module, f"{p}_bias") for p in ("gate_up_proj", "down_proj")):
        problems.append("has_bias but no gate_up_proj_bias / down_proj_bias parameters (expert biases)")
    e, h, i = layout.num_experts, layout.hidden, layout.inter
    want_gu, want_dn = ((e, h, 2 * i), (e, i, h)) if layout.transposed else ((e, 2 * i, h), (e, h, i))
    if _is_3d(module, "gate_up_proj"):
        gu, dn = _shape(module.gate_up_proj), _shape(module.down_proj)
        sizes = {
            "num_experts": e,
            "hidden_dim": h,
            "hidden_size": h,
            "intermediate_dim": i,
            "intermediate_size": i,
        }
        wrong = [
            n
            for n, v in sizes.items()
            if isinstance(d := getattr(module, n, None), int) and not isinstance(d, bool) and d != v
        ]
        if gu != want_gu or dn != want_dn or wrong:
            problems.append(
                f"gate_up_proj {gu} / down_proj {dn} instead of {want_gu} / {want_dn}"
                + (f" (declared {', '.join(wrong)} differ)" if wrong else "")
                + (" (transposed weights)" if layout.transposed else "")
            )
    return problems


def _is_2d(module: nn.Module, attr: str) -> bool:
    p = getattr(module, attr, None)
    return isinstance(p, nn.Parameter) and len(_shape(p)) == 2


def _check_layout(name: str, module: nn.Module) -> ExpertsLayout:
    """The module's `ExpertsLayout`, or NotImplementedError naming it and every problem."""
    layout = experts_layout(module)
    assert layout is not None
    problems = layout_problems(module, layout)
    if problems:
        raise NotImplementedError(
            f"cannot linearise the fused experts {name} ({type(module).__name__}): {'; '.join(problems)}"
        )
    return layout


@dataclass(frozen=True)
class ModuleGate:
    """A fused module's own gate (``_apply_gate``, e.g. GPT-OSS's ``clamp`` + ``alpha`` / ``limit``
    SwiGLU), fed the gate and up outputs rejoined in the module's layout: the family's own function,
    not a re-implementation, so a new family's gate needs no code here. The cost is one copy of the
    expert's intermediate activations."""

    apply_gate: Callable[[torch.Tensor], torch.Tensor]
    interleaved: bool

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.interleaved:
            return self.apply_gate(torch.stack((gate, up), dim=-1).flatten(-2))
        return self.apply_gate(torch.cat((gate, up), dim=-1))


class ExpertMLP(nn.Module):
    """One expert: ``down(act(gate(x)) * up(x))`` (or ``down(gate_fn(gate(x), up(x)))`` with the
    fused module's own gate, `ModuleGate`), times the tokens' routing weights when given.
    ``bias``: each projection carries its expert's bias (GPT-OSS).

    The weighting is inside the module so that, under ZeRO-3, the module's output is the first
    node its backward meets: DeepSpeed's pre-backward hook gathers the expert's weights and makes
    it the running backward module BEFORE a per-expert checkpoint recomputes it
    (`recompute_experts_one_by_one`); then what the recompute gathers is released with this
    expert's backward, not the layer's."""

    def __init__(
        self,
        hidden: int,
        inter: int,
        act_fn: Callable | None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = False,
        gate_fn: ModuleGate | None = None,
    ) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias, dtype=dtype)
        self.up_proj = nn.Linear(hidden, inter, bias=bias, dtype=dtype)
        self.down_proj = nn.Linear(inter, hidden, bias=bias, dtype=dtype)
        self.act_fn = act_fn
        self.gate_fn = gate_fn

    def forward(self, x: torch.Tensor, routing_weights: torch.Tensor | None = None) -> torch.Tensor:
        if self.gate_fn is None:
            h = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
        else:
            h = self.gate_fn(self.gate_proj(x), self.up_proj(x))
        y = self.down_proj(h)
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
        self,
        num_experts: int,
        hidden: int,
        inter: int,
        act_fn: Callable | None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = False,
        gate_fn: ModuleGate | None = None,
    ):
        super().__init__(
            [ExpertMLP(hidden, inter, act_fn, dtype, bias=bias, gate_fn=gate_fn) for _ in range(num_experts)]
        )
        self.num_experts = num_experts
        self.hidden_dim = hidden
        self.intermediate_dim = inter
        self.recompute_per_expert = False  # `recompute_experts_one_by_one` sets it
        # the fused layout these experts were linearised from (`linearize_moe_experts`), if any: what a
        # checkpoint key mapping needs to place that layout's fused tensors into these linears
        self.source_layout: ExpertsLayout | None = None

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

    Every layout is checked before anything is replaced (`layout_problems`): one that cannot be
    reproduced exactly is a NotImplementedError naming the module, so no run starts with experts
    left in bf16. Transposed, interleaved and biased layouts (GPT-OSS) are copied with
    `expert_weights`; a custom ``_apply_gate`` is called as the module defines it (`ModuleGate`).

    ``copy_weights`` copies the fused tensors into the new linears (plain models), one layer at a
    time, and drops each fused tensor as soon as its per-expert linears hold the copy: the peak
    adds one layer's experts, not a second copy of every expert (issue #16: +58 GB on a 61 GB
    Qwen3-30B-A3B). The new linears are allocated uninitialised on the fused tensors' device
    (their random init would be overwritten; with a non-default ``init_context`` they are built
    inside it as before). The ZeRO-3 path passes ``copy_weights=False`` and
    ``init_context=zero.Init`` so the new linears are partitioned at creation and later filled
    by the streaming loader, which places every layout through `expert_slices`.
    """
    targets = [name for name, m in model.named_modules() if experts_layout(m) is not None]
    layouts = {name: _check_layout(name, model.get_submodule(name)) for name in targets}
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        fused = getattr(parent, child)
        layout = layouts[name]
        # the module's own gate, bound to the (emptied) fused module that holds its alpha / limit / act_fn
        gate_fn = ModuleGate(fused._apply_gate, layout.interleaved) if layout.custom_gate else None
        args = (layout.num_experts, layout.hidden, layout.inter, getattr(fused, "act_fn", None))
        kw = dict(bias=layout.bias, gate_fn=gate_fn)
        dtype, device = fused.gate_up_proj.dtype, fused.gate_up_proj.device
        if copy_weights and init_context is contextlib.nullcontext:
            with torch.device("meta"):
                lin = LinearizedMoeExperts(*args, dtype, **kw)
            lin.to_empty(device=device)
        else:
            with init_context():
                lin = LinearizedMoeExperts(*args, dtype, **kw)
        if copy_weights:
            _copy_experts(fused, layout, lin)
            lin.to(device)
        lin.source_layout = layout
        setattr(parent, child, lin)
        # drop the fused tensors now: the module may still be referenced (hooks, a caller, its gate)
        for attr in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
            if hasattr(fused, attr):
                delattr(fused, attr)
        del fused
    return len(targets)


@torch.no_grad()
def _copy_experts(fused: nn.Module, layout: ExpertsLayout, lin: LinearizedMoeExperts) -> None:
    # a function of its own: the views of the fused tensors die with its frame, so each fused
    # tensor is freed as soon as the caller drops it (a loop variable would keep the last alive)
    for e, expert in enumerate(lin):
        for proj, (w, b) in expert_weights(fused, layout, e).items():
            getattr(expert, proj).weight.copy_(w)
            if b is not None:
                getattr(expert, proj).bias.copy_(b)


@dataclass(frozen=True)
class ExpertSlice:
    """Where one tensor of a linearised expert (``gate_proj.weight``, ``down_proj.bias`` ...) is in
    its fused module: ``getattr(fused, source)[index].permute(perm)`` (``perm`` None: as read).
    ``index`` holds ints and slices, strided for interleaved gate / up (GPT-OSS)."""

    source: str
    index: tuple
    perm: tuple[int, ...] | None = None


def expert_slices(layout: ExpertsLayout, e: int) -> dict[str, ExpertSlice]:
    """Expert ``e``'s tensors (``<proj>.weight`` ``[out, in]``, ``<proj>.bias``) as slices of the
    fused tensors of ``layout``: the one place the layouts' arithmetic is written. The in-memory
    copy (`expert_weights`) and the streamed checkpoint loader (`qatlib.checkpoint.conversion`,
    which reads a layer's fused tensor once and copies these slices into the linears) both use it."""
    g, u = layout.gate_up_index()
    whole = slice(None)
    t = (1, 0) if layout.transposed else None
    out = {}
    for proj, idx in (("gate_proj", g), ("up_proj", u)):
        out[f"{proj}.weight"] = ExpertSlice(
            "gate_up_proj", (e, whole, idx) if layout.transposed else (e, idx, whole), t
        )
        if layout.bias:
            out[f"{proj}.bias"] = ExpertSlice("gate_up_proj_bias", (e, idx))
    out["down_proj.weight"] = ExpertSlice("down_proj", (e, whole, whole), t)
    if layout.bias:
        out["down_proj.bias"] = ExpertSlice("down_proj_bias", (e, whole))
    return out


def fused_shapes(layout: ExpertsLayout) -> dict[str, tuple[int, ...]]:
    """The shapes of the fused tensors of ``layout`` (what `expert_slices` index)."""
    e, h, i = layout.num_experts, layout.hidden, layout.inter
    out = {
        "gate_up_proj": (e, h, 2 * i) if layout.transposed else (e, 2 * i, h),
        "down_proj": (e, i, h) if layout.transposed else (e, h, i),
    }
    if layout.bias:
        out.update(gate_up_proj_bias=(e, 2 * i), down_proj_bias=(e, h))
    return out


def expert_weights(
    fused: nn.Module, layout: ExpertsLayout, e: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Expert ``e``'s ``gate_proj`` / ``up_proj`` / ``down_proj`` (weight ``[out, in]``, bias or
    None) as views of the fused tensors (`expert_slices`)."""
    views = {}
    for local, sl in expert_slices(layout, e).items():
        v = getattr(fused, sl.source)[sl.index]
        views[local] = v if sl.perm is None else v.permute(sl.perm)
    return {
        proj: (views[f"{proj}.weight"], views.get(f"{proj}.bias"))
        for proj in ("gate_proj", "up_proj", "down_proj")
    }
