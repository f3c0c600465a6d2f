"""Load the model and tokenizer an experiment config names (plain, single-process path).

The ZeRO-3 path (empty model under ``deepspeed.zero.Init`` + streaming load) lives in
`qatlib.zero3_io`; `load_model` dispatches to it so callers never branch themselves.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

if TYPE_CHECKING:
    from .zero3_io import Zero3Context

DTYPES = {
    "auto": "auto",
    "fp16": torch.float16,
    "float16": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
}


def resolve_dtype(name: str | torch.dtype | None):
    if name is None or isinstance(name, torch.dtype):
        return name or "auto"
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"model.torch_dtype must be one of {', '.join(DTYPES)}; got {name!r}") from None


def load_tokenizer(path: str | Path, *, trust_remote_code: bool = False):
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)


def load_model(
    path: str | Path,
    *,
    torch_dtype: str | torch.dtype | None = "auto",
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    device_map: str | None = None,
    zero3: Zero3Context | None = None,
):
    """A causal LM from a local folder or hub id, in eval mode with ``use_cache`` off.

    With ``zero3`` (from `qatlib.zero3_io.init_zero3`, which fixes the dtype) the model is built empty
    under ``deepspeed.zero.Init`` and streamed from ``path`` (a local folder) instead.
    """
    if zero3 is not None:
        from . import zero3_io

        if device_map not in (None, "None", "none", "cpu"):
            raise ValueError(
                f"device_map={device_map!r} cannot be combined with ZeRO-3 (DeepSpeed places the shards)"
            )
        dtype = resolve_dtype(torch_dtype)
        if dtype != "auto" and dtype != zero3.dtype:
            raise ValueError(
                f"model dtype {dtype} differs from the ZeRO-3 context's {zero3.dtype} (set at init_zero3)"
            )
        return zero3_io.load_model(
            path, zero3, trust_remote_code=trust_remote_code, attn_implementation=attn_implementation
        )
    kwargs = {"dtype": resolve_dtype(torch_dtype), "trust_remote_code": trust_remote_code}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if device_map not in (None, "None", "none", "cpu"):
        kwargs["device_map"] = device_map
    model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    model.config.use_cache = False
    return model.eval()
