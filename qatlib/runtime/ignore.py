"""Is the ignore set of a prepared model one vLLM / SGLang read as qatlib trained it?

Two ways it is not: the user's patterns select layers the model quantizes (the model was prepared
with another ignore set: the checkpoint would tell the runtime to drop trained scales), or the set
quantizes only part of a group the runtime fuses (`qatlib.runtime.fusion`): vLLM then refuses the
checkpoint ("different quantization schemes for the shards", vllm 0.33 CT utils.py:65-69) or, for
a layer's experts, applies expert 0's scheme to all of them (compressed_tensors_moe.py:36-58).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ..patterns import matches_any
from ..quant.linear import QuantLinear, quant_linears
from .fusion import split_groups


def ignore_problems(model: nn.Module, patterns: Sequence[str]) -> str | None:
    """The problem with ``model``'s ignore set (``patterns``: the user's ``ignore_layers``), or None."""
    hit = [n for n, _ in quant_linears(model) if patterns and matches_any(n, patterns)]
    if hit:
        return (
            f"ignore patterns {list(patterns)} select {len(hit)} quantized layer(s) of the model, e.g. "
            f"{', '.join(hit[:4])}: the model was prepared with a different ignore set"
        )
    split = split_groups(model, lambda m: isinstance(m, QuantLinear))
    if split:
        return (
            "the ignore set splits groups that vLLM / SGLang fuse into one kernel (all members must be quantized "
            "or all ignored): " + "; ".join(split)
        )
    return None
