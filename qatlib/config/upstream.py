"""Upstream AngelSlim keys and algorithm names: what each means here, or why qatlib refuses it.

Why a module of its own: users bring their AngelSlim YAML unchanged. A key that upstream defines
must never be reported as a typo ("unknown key; did you mean ..."): it either gets its upstream
meaning (``warmup_ratio``, ``use_qkv_quant``, ``is_sft_data``, ``zero_point``, ``save_name``,
``low_memory``, the algorithm names below) or, where qatlib has no such feature (AWQ,
SmoothQuant, SpinQuant, LeptoQuant, ...), a `unsupported` error that names the upstream feature
and the key. A feature key at its "off" value (``quant_helpers: []``, ``mse_range: false``) is
accepted: it asks for nothing. The meanings were read from upstream's own code at commit
67394ce (``angelslim/utils/config_parser.py``, ``angelslim/compressor/quant/core/config.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "ALGORITHMS",
    "NOT_SUPPORTED",
    "Algorithm",
    "resolve_algorithm",
    "unsupported",
    "unsupported_message",
]

NOT_SUPPORTED = "is not supported by qatlib"


def unsupported_message(feature: str, hint: str = "") -> str:
    """The one wording of a refusal: ``upstream feature X is not supported by qatlib[; hint]``."""
    return f"upstream AngelSlim feature {feature} {NOT_SUPPORTED}" + (f"; {hint}" if hint else "")


def unsupported(feature: str, hint: str = "") -> ValueError:
    return ValueError(unsupported_message(feature, hint))


@dataclass(frozen=True)
class Algorithm:
    """A PTQ algorithm name of ``compression.quantization.name`` resolved: the qatlib preset
    (a key of ``qatlib.quant.spec.PRESETS``) and how PTQ sets the weights (``rtn`` or ``gptq``)."""

    preset: str
    ptq: str = "rtn"


# Upstream algorithm names (QuantizationMethod in config_parser.py) that qatlib runs.
ALGORITHMS: dict[str, Algorithm] = {
    "int4_gptq": Algorithm("int4_weight_only", "gptq"),
    "int8_dynamic": Algorithm("int8"),
}

# Upstream algorithm names qatlib does not run -> the feature, as the refusal names it.
_REFUSED_ALGORITHMS: dict[str, str] = {
    "int4_awq": "AWQ (int4_awq: activation-aware weight scaling)",
    "int4_gptaq": "GPTAQ (int4_gptaq: GPTQ with asymmetric calibration)",
    "fp8_lepto": "LeptoQuant (fp8_lepto)",
    "fp8_blockwise": "block-wise FP8 (fp8_blockwise)",
    "daq": "DAQ (daq)",
    "w4a8i8": "W4A8-INT8 (w4a8i8)",
}


def resolve_algorithm(name: str, presets: Any) -> Algorithm | str | None:
    """``name`` -> an `Algorithm`, or the refusal message, or None (not an upstream name either)."""
    if name in presets:
        return Algorithm(name)
    if name in ALGORITHMS:
        return ALGORITHMS[name]
    if name in _REFUSED_ALGORITHMS:
        return unsupported_message(_REFUSED_ALGORITHMS[name], "choose a format qatlib runs (see the README)")
    return None


# Upstream keys of a section that name a feature qatlib lacks: key -> (off value, feature).
# The key is accepted at its off value and refused with `unsupported` otherwise.
QUANTIZATION_FEATURES: dict[str, tuple[Any, str]] = {
    "quant_helpers": ([], "quant_helpers (SmoothQuant and the other PTQ helpers)"),
    "smooth_alpha": (0.5, "smooth_alpha (SmoothQuant migration strength)"),
    "cpu_convert": (False, "cpu_convert (conversion on the CPU)"),
    "modules_to_quantize": ([], "modules_to_quantize (quantizing by module type)"),
    "quant_analyse": (False, "quant_analyse (the quantization-analysis report)"),
    "quant_vit": (False, "quant_vit (vision tower quantization)"),
    "quant_talker": (False, "quant_talker (Qwen3-Omni talker quantization)"),
}
QUANT_METHOD_FEATURES: dict[str, tuple[Any, str]] = {
    "mse_range": (False, "mse_range (AWQ's MSE clipping-range search)"),
}
COMPRESSION_FEATURES: dict[str, tuple[Any, str]] = {
    "quant_analyse": (False, "quant_analyse (the quantization-analysis report)"),
}
TOP_LEVEL_FEATURES: dict[str, tuple[Any, str]] = {
    "transform": (None, "transform (SpinQuant / Hadamard rotations)"),
}


def feature_issues(data: Any, features: dict[str, tuple[Any, str]]) -> list[tuple[str, str]]:
    """``(key, message)`` for each feature key of ``data`` set to something other than its off value."""
    if not isinstance(data, dict):
        return []
    out = []
    for key, (off, feature) in features.items():
        if key in data and data[key] != off and not (off is None and data[key] in ({}, [])):
            out.append((key, unsupported_message(feature, f"remove the key (got {data[key]!r})")))
    return out
