"""What qatlib needs to know of a transformers causal LM at every layer of the library: where its
decoder blocks live (`decoder_layers`) and what a dtype name means (`resolve_dtype`).

Why a module of its own: the streaming stages (`qatlib.zero3.onload`), the heap policy
(`qatlib.zero3.heap`), ZeRO-3 start-up and the trainers all need these two answers, and the loaders
(`qatlib.models`) sit above all of them; here they sit below.
"""

from __future__ import annotations

import torch
from torch import nn

DTYPES = {
    "auto": "auto",
    "fp16": torch.float16,
    "float16": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
}
# Where a model keeps its decoder blocks, for models without ``get_decoder().layers``.
_LAYER_PATHS = ("model.layers", "model.decoder.layers", "transformer.h", "layers")


def resolve_dtype(name: str | torch.dtype | None):
    """A torch dtype for ``name`` (``bf16``, ``bfloat16``, ``fp32`` ...), or ``"auto"``."""
    if name is None or isinstance(name, torch.dtype):
        return name or "auto"
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"model.torch_dtype must be one of {', '.join(DTYPES)}; got {name!r}") from None


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """``(path, blocks)``: the model's own list of decoder blocks (``get_decoder().layers``, else the
    first non-empty `ModuleList` at a known path: ``model.layers`` for the Llama / Qwen families)."""
    dec = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(dec, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers):
        for name, mod in model.named_modules():
            if mod is layers:
                return name, layers
    for path in _LAYER_PATHS:
        try:
            m = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(m, nn.ModuleList) and len(m):
            return path, m
    raise ValueError(
        f"cannot find the decoder layers of {type(model).__name__} (looked for get_decoder().layers, "
        f"{', '.join(_LAYER_PATHS)})"
    )
