"""What quantization does inside attention: FP8 attention probabilities (``fp8_attn``) and the
q / k / v quantizers applied to the tensors the attention kernel (and the KV cache) sees.

Both are registered through transformers' public ``AttentionInterface`` rather than by
monkey-patching the model's attention forward (as the upstream toolkit does):

- ``fp8_attn``: eager attention with the softmax output cast to FP8 E4M3 and back
  (straight-through), which is what an FP8 attention kernel does to the probabilities before the
  PV matmul;
- q / k / v quantizers (``scheme.q/k/v``): they live on the ``q_proj`` / ``k_proj`` / ``v_proj``
  `QuantLinear` (so checkpoint keys stay ``<attn>.k_proj.output_*``), but are applied by a wrapper
  around the model's attention function to the query / key / value states it receives, i.e. after
  ``q_norm`` / ``k_norm`` and RoPE. Those are the tensors a runtime's KV cache stores and its
  ``k_scale`` / ``v_scale`` scale; quantizing the projection outputs instead (upstream) trains and
  calibrates the key scale on a different tensor than the one it is deployed on.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .functional import fp8_cast_ste

FP8_ATTN_IMPL = "qatlib_fp8_eager"
# Per-attention-module switch read by the attention function: `quantization_disabled` turns it off
# so the unquantized (KD teacher) forward does not cast the probabilities either.
FP8_ATTN_FLAG = "qatlib_fp8_attn"


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


def fp8_eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
):
    """transformers' eager attention + FP8 cast of the attention probabilities."""
    return _eager(
        module, query, key, value, attention_mask, scaling, dropout, getattr(module, FP8_ATTN_FLAG, True)
    )


def _eager(module, query, key, value, attention_mask, scaling, dropout, fp8: bool):
    """Eager attention (transformers' ``eager_attention_forward``), optionally with FP8 probabilities."""
    key_states = _repeat_kv(key, module.num_key_value_groups)
    value_states = _repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32)
    if fp8:
        attn_weights = fp8_cast_ste(attn_weights)
    attn_weights = attn_weights.to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous()
    return attn_output, attn_weights


AttentionInterface.register(FP8_ATTN_IMPL, fp8_eager_attention_forward)
# The mask too: transformers builds NO mask at all (not even the causal one) for an attention
# implementation without a registered mask function, so without this line the model would attend
# to future tokens.
AttentionMaskInterface.register(FP8_ATTN_IMPL, ALL_MASK_ATTENTION_FUNCTIONS["eager"])


def enable_fp8_attention(model: nn.Module) -> None:
    """Switch ``model`` to the FP8-simulating eager attention (needs an eager-capable model)."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        raise ValueError("fp8_attn needs a transformers model with a config")
    impl = getattr(cfg, "_attn_implementation", None)
    if impl not in (None, "eager", FP8_ATTN_IMPL):
        raise ValueError(
            f"fp8_attn simulates eager attention; the model uses {impl!r} (set model.attn_implementation: eager)"
        )
    for m in model.modules():
        if all(hasattr(m, a) for a in ("q_proj", "k_proj", "v_proj")):
            setattr(m, FP8_ATTN_FLAG, True)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(FP8_ATTN_IMPL)
    else:
        cfg._attn_implementation = FP8_ATTN_IMPL


# --------------------------------------------------------------------------- q / k / v quantizers
QKV_IMPL_PREFIX = "qatlib_qkv_"
_PROJ = (("q_proj", 0), ("k_proj", 1), ("v_proj", 2))


def _quantize_heads(quantizer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Apply ``quantizer`` to ``[B, H, T, D]`` states in the projection-output layout ``[B, T, H*D]``
    its per-head / per-token / per-tensor scales are defined on."""
    b, h, t, d = x.shape
    y = quantizer(x.transpose(1, 2).reshape(b, t, h * d))
    return y.reshape(b, t, h, d).transpose(1, 2)


def quantize_qkv_states(module: nn.Module, query, key, value):
    """The attention inputs with the q / k / v quantizers of ``module``'s projections applied."""
    states = [query, key, value]
    for proj, i in _PROJ:
        ql = getattr(module, proj, None)
        oq = getattr(ql, "output_quantizer", None)
        if oq is not None and getattr(ql, "output_in_attention", False):
            states[i] = _quantize_heads(oq, states[i])
    return tuple(states)


def _qkv_attention(inner: str):
    def forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        query, key, value = quantize_qkv_states(module, query, key, value)
        if inner == "eager":  # not in ALL_ATTENTION_FUNCTIONS: the modeling file's own function
            return _eager(module, query, key, value, attention_mask, scaling, dropout, False)
        fn = ALL_ATTENTION_FUNCTIONS[inner]
        return fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)

    forward.__doc__ = f"q/k/v quantizers on the attention inputs, then {inner!r} attention."
    return forward


def enable_qkv_quantization(model: nn.Module) -> str:
    """Route ``model``'s attention through a wrapper of its current implementation (eager, sdpa,
    flash, or the FP8 one) that applies the q / k / v quantizers first; returns the new name."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        raise ValueError("q/k/v quantization needs a transformers model with a config")
    inner = getattr(cfg, "_attn_implementation", None) or "eager"
    if inner.startswith(QKV_IMPL_PREFIX):
        return inner
    if inner != "eager" and inner not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(f"q/k/v quantization cannot wrap the attention implementation {inner!r}")
    name = QKV_IMPL_PREFIX + inner
    AttentionInterface.register(name, _qkv_attention(inner))
    mask = ALL_MASK_ATTENTION_FUNCTIONS[inner if inner in ALL_MASK_ATTENTION_FUNCTIONS else "eager"]
    AttentionMaskInterface.register(name, mask)  # without one, transformers builds no causal mask
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        cfg._attn_implementation = name
    return name
