"""FP8 attention-probability simulation (``fp8_attn``).

Registered through transformers' public ``AttentionInterface`` rather than by monkey-patching the
model's attention forward (as the upstream toolkit does): the function is eager attention with the
softmax output cast to FP8 E4M3 and back (straight-through), which is what an FP8 attention kernel
does to the probabilities before the PV matmul.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

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
    key_states = _repeat_kv(key, module.num_key_value_groups)
    value_states = _repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32)
    if getattr(module, FP8_ATTN_FLAG, True):
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
        raise ValueError(f"fp8_attn simulates eager attention; the model uses {impl!r} (set model.attn_implementation: eager)")
    for m in model.modules():
        if all(hasattr(m, a) for a in ("q_proj", "k_proj", "v_proj")):
            setattr(m, FP8_ATTN_FLAG, True)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(FP8_ATTN_IMPL)
    else:
        cfg._attn_implementation = FP8_ATTN_IMPL
