"""Interleaved gate/up experts (GPT-OSS) written the way their runtime reads them.

qatlib trains such experts linearised (`qatlib.surgery.moe`: ``experts.<e>.gate_proj`` /
``up_proj`` / ``down_proj``), names neither transformers 5.24 nor vLLM 0.33 loads for gpt_oss.
vLLM 0.33's gpt_oss loader (``models/gpt_oss.py``: ``hf_to_vllm_mapper``, then
``_get_streamed_expert_info`` / ``_try_load_streamed_expert``) reads per-expert keys
``...mlp.experts.<e>.gate_up_proj.{weight,weight_scale,bias}`` (-> ``w13_*``) and
``...mlp.experts.<e>.down_proj.*`` (-> ``w2_*``); for an fp8 / int8 weight (no packed format) it
goes through ``_load_unquantized_expert``, which transposes what it reads: so the fused gate/up
weight is written ``[H, 2I]`` with gate and up columns interleaved (gate ``::2``, up ``1::2``, the
layout of GPT-OSS's own ``gate_up_proj``), its per-channel scale ``[1, 2I]`` likewise, the bias
``[2I]`` interleaved (``_load_expert_bias``), and down ``[I, H]`` / scale ``[1, H]``.

Only the layout checked against vLLM's loader (`qatlib.runtime.oracle`, tests/test_gpt_oss.py) is
written (W8A8 int8: per-channel weights, per-token dynamic inputs); any other is an
`ExportError` naming what vLLM would drop or refuse: fp8 (compressed-tensors' fp8 MoE method has
no expert biases), a static input scale
(``w13_input_scale`` is no streamed suffix: vLLM skips it without a word), a per-tensor weight
scale (its ``[1]`` scale does not take the transposed per-expert path) and packed formats.
"""

from __future__ import annotations

import torch
from torch import nn

from ..surgery.moe import ExpertMLP
from .format import CTFormat, ExportError

FUSED_GATE_UP = "gate_up_proj"  # vLLM's per-expert key of the fused gate/up (-> w13)


def is_interleaved_expert(module: nn.Module) -> bool:
    """An expert whose fused module interleaved gate and up (its own gate rejoins them so)."""
    return isinstance(module, ExpertMLP) and module.gate_fn is not None and module.gate_fn.interleaved


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Rows ``gate[0], up[0], gate[1], ...``: GPT-OSS's ``[..., ::2]`` / ``[..., 1::2]``."""
    return torch.stack((gate, up), dim=1).flatten(0, 1)


def check_format(fmt: CTFormat, name: str) -> None:
    """Refuse, before anything is written, what vLLM 0.33 would not load for these experts."""
    w, a = fmt.scheme.weights, fmt.scheme.input_activations
    problems = []
    if fmt.format == "float-quantized":
        problems.append(
            "fp8 weights (compressed-tensors' fp8 MoE method, CompressedTensorsW8A8Fp8MoEMethod, creates "
            "no expert biases: the gpt_oss biases would fail to load; W8A8 int8 channel / token has them)"
        )
    elif fmt.format != "int-quantized":
        problems.append(f"format {fmt.format} (packed experts: vLLM reads them untransposed)")
    if w is not None and str(w.strategy) not in ("channel", "QuantizationStrategy.CHANNEL"):
        problems.append(f"weight strategy {w.strategy} (only per-channel scales take the transposed path)")
    if a is not None and not a.dynamic:
        problems.append("a static input scale (vLLM 0.33 skips the per-expert w13_input_scale key)")
    if problems:
        raise ExportError(
            f"{name}: interleaved gate/up experts (gpt_oss) cannot be exported for vLLM 0.33 with "
            + "; ".join(problems)
        )


def fused_expert_tensors(
    name: str, gate: dict[str, torch.Tensor], up: dict[str, torch.Tensor], down: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The keys of one interleaved expert from its three compressed linears (``compress_linear``'s
    local dicts); ``name``: the expert's module name."""
    if gate.keys() != up.keys():
        raise ExportError(f"{name}: gate_proj and up_proj compress to different tensors")
    out = {}
    for k in gate:
        g, u = gate[k], up[k]
        if k == "bias":
            out[f"{name}.{FUSED_GATE_UP}.bias"] = _interleave(g, u)
        elif k in ("weight", "weight_scale"):
            out[f"{name}.{FUSED_GATE_UP}.{k}"] = _interleave(g, u).t().contiguous()
        else:
            raise ExportError(f"{name}: no vLLM gpt_oss key for the expert tensor {k!r}")
    for k, t in down.items():
        out[f"{name}.down_proj.{k}"] = t if k == "bias" else t.t().contiguous()
    return out


def unfused_expert_tensors(tensors: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """qatlib's reader of one interleaved expert of an export (the inverse of
    `fused_expert_tensors`): ``{"gate_proj.weight": ..., "up_proj.weight_scale": ..., ...}`` in
    compressed-tensors' per-linear layout, from the export's ``tensors`` (key -> tensor).
    transformers 5.24 cannot reload these keys (`qatlib.export.coverage`), so a reload compares
    through this."""
    out = {}
    for k in ("weight", "weight_scale", "bias"):
        t = tensors.get(f"{name}.{FUSED_GATE_UP}.{k}")
        if t is not None:
            t = t if k == "bias" else t.t()
            out[f"gate_proj.{k}"], out[f"up_proj.{k}"] = t[0::2].contiguous(), t[1::2].contiguous()
        d = tensors.get(f"{name}.down_proj.{k}")
        if d is not None:
            out[f"down_proj.{k}"] = d if k == "bias" else d.t().contiguous()
    return out
