"""SmoothQuant: move activation range into the weights, exactly, before quantizing.

Why: a pretrained LM's normed hidden states carry a few outlier channels; a 4-bit input group
(NVFP4's 16, MXFP4's 32) holding one rounds its other members to zero. Dividing channel ``j`` of a
norm's output by ``s_j`` and multiplying column ``j`` of every linear that reads it by ``s_j`` leaves
the unquantized model's function unchanged and trades input range for weight range:
``s_j = max|X_j| ** alpha / max|W_j| ** (1 - alpha)`` (Xiao et al., 2023), ``max|W_j|`` over all the
readers' columns. The division folds into the norm's weight, so the smoothed model is an ordinary
checkpoint: the runtime serves it as trained, with no kernel of its own.

Upstream's ``quant_helpers: [smooth]`` with ``smooth_alpha`` (AngelSlim's
``compressor/quant/modules/smooth/smooth.py``: the same rule, on the "first linears", q/k/v behind
the input norm and the MLP's input projections behind the post-attention norm). Written by hand:
llm-compressor's SmoothQuantModifier needs its recipe / session lifecycle, and this is ten lines of
arithmetic on the groups below.

Groups are found by structure: per decoder block (`qatlib.surgery.modeling.decoder_layers`) its
``input_layernorm`` feeds its attention's ``q_proj`` / ``k_proj`` / ``v_proj``, its
``post_attention_layernorm`` feeds every linear map of its ``mlp`` except the ``down_proj``s (the
gate / up projections, an MoE's router and every expert's (`qatlib.surgery.moe` linearised), a shared
expert's gate). A block of
another shape is refused, naming it, rather than smoothed wrongly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..surgery.modeling import decoder_layers
from ..surgery.moe import linearize_moe_experts
from .calibration import run_batch

_QKV = ("q_proj", "k_proj", "v_proj")
_NORMS = ("input_layernorm", "post_attention_layernorm")


@dataclass(frozen=True)
class SmoothGroup:
    """One norm (qualified ``name``) and the linears that read its output."""

    name: str
    norm: nn.Module
    linears: tuple[tuple[str, nn.Module], ...]  # each holds a 2-D ``weight`` (out, hidden)


def _attention(block: nn.Module) -> tuple[str, nn.Module] | None:
    for name, m in block.named_children():
        if all(isinstance(getattr(m, a, None), nn.Linear) for a in _QKV):
            return name, m
    return None


def _reads_input(m: nn.Module, hidden: int) -> bool:
    """A linear map of the hidden state: an ``nn.Linear`` or a router holding its own 2-D
    ``weight`` (transformers' ``*TopKRouter``) of ``hidden`` columns."""
    w = m._parameters.get("weight")
    return isinstance(w, nn.Parameter) and w.dim() == 2 and w.shape[1] == hidden


@torch.no_grad()
def _scales_with_weight(norm: nn.Module, hidden: int) -> bool:
    """Whether halving the norm's weight (and bias) halves its output, the fold `smooth` makes:
    true of RMSNorm / LayerNorm, false of a ``x * (1 + weight)`` norm (Gemma's). Checked on a probe
    vector, by what the module computes rather than by its class."""
    w = norm.weight
    x = torch.linspace(-2.0, 3.0, hidden, dtype=w.dtype, device=w.device)[None]
    y = norm(x)
    params = [q for q in (w, getattr(norm, "bias", None)) if isinstance(q, nn.Parameter)]
    kept = [q.detach().clone() for q in params]
    try:
        for q in params:
            q.mul_(0.5)
        y2 = norm(x)
    finally:
        for q, v in zip(params, kept):
            q.copy_(v)
    return bool(torch.allclose(y2.float(), 0.5 * y.float(), rtol=1e-3, atol=1e-6))


def smooth_groups(model: nn.Module) -> list[SmoothGroup]:
    """Every block's two groups, in model order; a ValueError naming the block where its structure
    is not the one described in the module docstring."""
    path, layers = decoder_layers(model)
    out: list[SmoothGroup] = []
    for i, block in enumerate(layers):
        where = f"{path}.{i}"
        attn = _attention(block)
        mlp = getattr(block, "mlp", None)
        norms = [getattr(block, n, None) for n in _NORMS]
        if (
            attn is None
            or mlp is None
            or any(not isinstance(getattr(n, "weight", None), nn.Parameter) for n in norms)
        ):
            raise ValueError(
                f"smoothing: {where} ({type(block).__name__}) is not a pre-norm block with "
                f"{' / '.join(_NORMS)}, an attention with {' / '.join(_QKV)} and an mlp"
            )
        hidden = norms[0].weight.shape[-1]
        for nname, n in zip(_NORMS, norms):
            if not _scales_with_weight(n, hidden):
                raise ValueError(
                    f"smoothing: {where}.{nname} ({type(n).__name__}) does not scale its output by its "
                    "weight (a 1 + weight norm?): the factors cannot fold into it"
                )
        qkv = tuple((f"{where}.{attn[0]}.{a}", getattr(attn[1], a)) for a in _QKV)
        readers = tuple(
            (f"{where}.mlp.{n}" if n else f"{where}.mlp", m)
            for n, m in mlp.named_modules()
            if _reads_input(m, hidden) and n.rsplit(".", 1)[-1] != "down_proj"
        )
        if not readers:
            raise ValueError(f"smoothing: {where}.mlp has no input projection")
        # every other matrix of the MLP must be a down_proj: a reader left out (fused experts'
        # 3-D gate_up_proj) would silently change the model's function
        seen = {id(m.weight) for _, m in readers}
        for n, prm in mlp.named_parameters():
            owner, _, leaf = n.rpartition(".")
            if prm.dim() >= 2 and id(prm) not in seen and "down_proj" not in (leaf, owner.rpartition(".")[2]):
                raise ValueError(
                    f"smoothing: {where}.mlp.{n} ({tuple(prm.shape)}) is neither a linear of the MLP's "
                    "input nor a down_proj (fused experts: linearise them first, `qatlib.surgery.moe.linearize_moe_experts`)"
                )
        out.append(SmoothGroup(f"{where}.{_NORMS[0]}", norms[0], qkv))
        out.append(SmoothGroup(f"{where}.{_NORMS[1]}", norms[1], readers))
    return out


@torch.no_grad()
def input_absmax(
    groups: Iterable[SmoothGroup], batches: Iterable[Any], forward: Callable[[Any], Any]
) -> dict[str, torch.Tensor]:
    """Per-channel ``max |x|`` (fp32) of each group's norm output over ``forward(batch)`` for every
    batch: what the group's linears read."""
    stats: dict[str, torch.Tensor] = {}
    hooks = []

    def observe(name: str):
        def hook(_m, _inp, out):
            a = out.detach().abs().reshape(-1, out.shape[-1]).amax(0).float()
            stats[name] = torch.maximum(stats[name], a) if name in stats else a

        return hook

    for g in groups:
        hooks.append(g.norm.register_forward_hook(observe(g.name)))
    try:
        for b in batches:
            forward(b)
    finally:
        for h in hooks:
            h.remove()
    return stats


def smoothing_factors(group: SmoothGroup, absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """``s_j = max|X_j| ** alpha / max|W_j| ** (1 - alpha)`` (fp32), 1 where either is 0."""
    w = torch.stack([lin.weight.detach().abs().amax(0).float() for _, lin in group.linears]).amax(0)
    s = absmax.float().clamp_min(0).pow(alpha) / w.pow(1 - alpha)
    return torch.where((absmax > 0) & (w > 0) & torch.isfinite(s), s, torch.ones_like(s))


@torch.no_grad()
def smooth(groups: Iterable[SmoothGroup], absmax: dict[str, torch.Tensor], alpha: float) -> int:
    """Fold each group's factors into its norm (divide) and readers (multiply columns), in place;
    the number of groups smoothed. ``alpha`` in [0, 1]."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"smooth_alpha must be in [0, 1]; got {alpha}")
    n = 0
    for g in groups:
        if g.name not in absmax:
            raise ValueError(f"smoothing: no activation statistics for {g.name} (no batch reached it)")
        s = smoothing_factors(g, absmax[g.name], alpha)
        w = g.norm.weight
        w.copy_((w.float() / s).to(w.dtype))
        if getattr(g.norm, "bias", None) is not None:
            g.norm.bias.copy_((g.norm.bias.float() / s).to(g.norm.bias.dtype))
        for _, lin in g.linears:
            lin.weight.copy_((lin.weight.float() * s).to(lin.weight.dtype))
        n += 1
    return n


def smooth_model(model: nn.Module, batches: Iterable[Any], alpha: float) -> int:
    """Upstream's ``quant_helpers: [smooth]`` on a loaded, unprepared ``model``: statistics from
    the calibration ``batches`` (`qatlib.quant.calibration.run_batch`), then `smooth`; the number
    of norms smoothed. The model's function is unchanged up to rounding to its dtype."""
    if not 0.0 <= alpha <= 1.0:  # before the forward passes
        raise ValueError(f"smooth_alpha must be in [0, 1]; got {alpha}")
    linearize_moe_experts(model)  # as `qatlib.quant.prepare` will: one linear per expert projection
    groups = smooth_groups(model)
    return smooth(groups, input_absmax(groups, batches, lambda b: run_batch(model, b)), alpha)
