"""Load the model and tokenizer an experiment config names, and the one verb that gives the model
prepared for an experiment (`load_prepared`).

The ZeRO-3 path (empty model under ``deepspeed.zero.Init`` + streaming load) lives in
`qatlib.zero3.load`; `load_model` and `load_prepared` dispatch to it so callers never branch themselves.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from .surgery.modeling import resolve_dtype

if TYPE_CHECKING:
    from .zero3.io import Zero3Context

log = logging.getLogger(__name__)


def resolve_model_dir(path: str, *, cache_dir: str | None = None) -> str:
    """A local folder for ``path``: itself when it exists, else the hub snapshot of that id
    (downloaded once into the HF cache; the ZeRO-3 loader needs files on disk)."""
    if Path(path).exists():
        return path
    from huggingface_hub import snapshot_download

    log.info("%s is not a local folder: fetching the hub snapshot", path)
    return snapshot_download(
        path,
        cache_dir=cache_dir,
        allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.py"],
    )


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

    With ``zero3`` (from `qatlib.zero3.io.init_zero3`, which fixes the dtype) the model is built empty
    under ``deepspeed.zero.Init`` and streamed from ``path`` (a local folder) instead.
    """
    if zero3 is not None:
        from .zero3 import load as zero3_load

        _check_zero3(zero3, torch_dtype, device_map)
        return zero3_load.load_model(
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


def _check_zero3(zero3: Zero3Context, torch_dtype, device_map) -> None:
    if device_map not in (None, "None", "none", "cpu"):
        raise ValueError(
            f"device_map={device_map!r} cannot be combined with ZeRO-3 (DeepSpeed places the shards)"
        )
    dtype = resolve_dtype(torch_dtype)
    if dtype != "auto" and dtype != zero3.dtype:
        raise ValueError(
            f"model dtype {dtype} differs from the ZeRO-3 context's {zero3.dtype} (set at init_zero3)"
        )


def load_prepared(
    cfg,
    path: str | os.PathLike,
    *,
    scales: str | os.PathLike | None = None,
    zero3: Zero3Context | None = None,
    report_path: str | os.PathLike | None = None,
    complete: bool = False,
    device_map: str | None = None,
    skeleton: bool = False,
    read_onto: torch.device | str | None = None,
) -> tuple[nn.Module, dict[str, Any] | None]:
    """The model prepared for the experiment ``cfg``: loaded from ``path``, prepared with
    ``cfg.quant_scheme()``, its ignore layers and prepare options, and the quantizer parameters of
    the checkpoint ``scales`` (PTQ or QAT, docs/design.md) loaded. A ``scales`` checkpoint that
    carries its own weights (GPTQ, `qatlib.checkpoint.layout.weights_dir`) is loaded instead of
    ``path``: its scales were computed for those weights, not the original ones.

    Returns ``(model, scale-load report)`` (hits / misses; None without ``scales`` and under ZeRO-3,
    where the report goes to ``report_path`` only). ``complete``: a quantizer parameter the
    checkpoint has no value for is an error (evaluation and export never use init values). With
    ``zero3`` the model is built partitioned (`qatlib.zero3.load.build_qat_model`; ``scales`` required).
    ``skeleton``: the weights stay on the meta device (`qatlib.zero3.onload.load_skeleton`; the scales are
    real), for the layer-by-layer stages (`qatlib.zero3.onload.Onloader`). ``read_onto``: the whole
    model read onto that device by qatlib's reader instead of ``from_pretrained``
    (`qatlib.zero3.onload.load_whole`: the model once in memory, no file mapping).
    """
    from .checkpoint.layout import CheckpointError, weights_dir
    from .quant import prepare

    if read_onto is not None and (zero3 is not None or device_map not in (None, "None", "none", "cpu")):
        raise ValueError("read_onto reads the whole model onto one device: not with zero3 or a device_map")
    if scales is not None:  # a checkpoint that carries its own weights (GPTQ) is the model too
        path = weights_dir(scales) or path
    scheme = cfg.quant_scheme()
    m = cfg.model
    common = dict(trust_remote_code=m.trust_remote_code, attn_implementation=m.attn_implementation)
    if zero3 is not None:
        from .zero3 import load as zero3_load

        _check_zero3(zero3, m.torch_dtype, device_map)
        model = zero3_load.build_qat_model(
            path,
            zero3,
            scheme,
            from_ptq_ckpt=scales,
            ignore=cfg.ignore_layers,
            options=cfg.prepare_options(),
            scales_report_path=report_path,
            **common,
        )
        return model, None
    if skeleton or read_onto is not None:
        from .zero3.onload import load_skeleton, realize_quantizers

        model = load_skeleton(path, torch_dtype=m.torch_dtype, **common)
        prepare(model, scheme, ignore=cfg.ignore_layers, options=cfg.prepare_options())
        realize_quantizers(model, cfg.prepare_options())
    else:
        model = load_model(path, torch_dtype=m.torch_dtype, device_map=device_map, **common)
        prepare(model, scheme, ignore=cfg.ignore_layers, options=cfg.prepare_options())
    report = None
    if scales is not None:
        from .zero3.load import stream_load_scales  # the plan-then-execute loader, local without ZeRO-3

        report = stream_load_scales(model, scales, scheme, report_path=report_path)
        if complete and report.get("misses"):
            raise CheckpointError(
                f"{scales}: {report['misses']} quantizer parameters have no value there (e.g. "
                f"{report['missed_params'][0]}); refusing to use init values"
            )
    if read_onto is not None:  # the scales are in (a skeleton takes them): now the weights
        from .zero3.onload import load_whole

        load_whole(model, path, read_onto)
    return model, report
