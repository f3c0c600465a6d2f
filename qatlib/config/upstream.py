"""Upstream AngelSlim keys and algorithm names: what each means here, or why qatlib refuses it.

Why a module of its own: users bring their AngelSlim YAML unchanged. A key that upstream defines
must never be reported as a typo ("unknown key; did you mean ..."): it either gets its upstream
meaning (``warmup_ratio``, ``use_qkv_quant``, ``is_sft_data``, ``zero_point``, ``save_name``,
``low_memory``, FOCUS's FP4 keys, the algorithm names below) or, where qatlib has no such feature (AWQ,
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
        return unsupported_message(
            _REFUSED_ALGORITHMS[name], "choose a format qatlib runs (docs/reference/formats.md)"
        )
    return None


# Upstream keys of a section that name a feature qatlib lacks: key -> (off value, feature).
# The key is accepted at its off value and refused with `unsupported` otherwise.
QUANTIZATION_FEATURES: dict[str, tuple[Any, str]] = {
    "cpu_convert": (False, "cpu_convert (conversion on the CPU)"),
    "modules_to_quantize": ([], "modules_to_quantize (quantizing by module type)"),
    "quant_analyse": (False, "quant_analyse (the quantization-analysis report)"),
    "quant_vit": (False, "quant_vit (vision tower quantization)"),
    "quant_talker": (False, "quant_talker (Qwen3-Omni talker quantization)"),
}
# ``compression.quantization.quant_helpers`` entries qatlib runs (upstream's only one, ``smooth``:
# angelslim/compressor/quant/ptq.py; `qatlib.quant.smoothing`)
PTQ_HELPERS = ("smooth",)
QUANT_METHOD_FEATURES: dict[str, tuple[Any, str]] = {
    "mse_range": (False, "mse_range (AWQ's MSE clipping-range search)"),
}
COMPRESSION_FEATURES: dict[str, tuple[Any, str]] = {
    "quant_analyse": (False, "quant_analyse (the quantization-analysis report)"),
}
TOP_LEVEL_FEATURES: dict[str, tuple[Any, str]] = {
    "transform": (None, "transform (SpinQuant / Hadamard rotations)"),
}


# Upstream FOCUS's FP4 keys of ``quant_config.weight / activation`` (read from
# angelslim/compressor/qat/modules/quantizer.py at 67394ce: `_apply_settings` l.197-218 reads them,
# `_quant_fp4_element` l.91-118 rounds, `_fake_quant_mxfp4` / `_fake_quant_nvfp4` l.796-891 scale).
# Upstream parses any qtype containing "mxfp" / "nvfp" as its MXFP4 / NVFP4 (`_parse_bits_and_dtype`).
# upstream qtype spelling -> (qatlib qtype, `qatlib.quant.spec.ScaleRule` value)
FP4_QTYPES: dict[str, tuple[str, str]] = {
    # MXFP4 with ceil-rounded E8M0 scales, 2 ** ceil(log2(amax / 6)) (upstream's only MX rule; qatlib's
    # qtype mxfp4 keeps compressed-tensors' rule, the one vLLM applies to the activations at run time)
    "mxfp4_rceil": ("mxfp4", "ceil"),
}
# upstream's default ``num_sub`` (`_apply_settings`): the sub-groups per group with use_subgroup_scale
UPSTREAM_NUM_SUB = 4
# "nearest" is torch.round (ties to even) on the scaled mantissa, "even" an explicit ties-to-even:
# both are qatlib's E2M1 rounding (round to nearest, ties to even, as compressed-tensors and vLLM).
MANTISSA_ROUNDING_HONOURED = ("even", "nearest")
MANTISSA_ROUNDING_VALUES = ("even", "nearest", "floor")


def fp4_key_issues(
    block: str, values: dict[str, Any], role_is_fp4: bool, *, activation: bool = False
) -> list[tuple[str, str]]:
    """``(key path, message)`` for each upstream FOCUS key of one ``quant_config.weight /
    activation`` block (``values``: the keys the YAML set) that qatlib cannot honour. Honoured:
    ``mantissa_rounding`` even / nearest (and any value on a non-FP4 role, where upstream never
    reads it), ``use_subgroup_scale`` with ``num_sub`` on FP4 weights (`qatlib.quant.spec.QuantSpec`
    ``subgroups``), ``num_sub`` without it (read only with sub-group scales). On an activation
    block ``use_subgroup_scale: true`` is refused: upstream creates sub-group scales for weight
    quantizers only, so there it changes nothing."""
    out = []
    mr = values.get("mantissa_rounding")
    if mr is not None and role_is_fp4 and mr not in MANTISSA_ROUNDING_HONOURED:
        if mr in MANTISSA_ROUNDING_VALUES:
            msg = unsupported_message(
                f"mantissa_rounding {mr!r} (E2M1 values truncated toward zero)",
                "compressed-tensors and vLLM's FP4 kernels round to nearest, ties to even: use 'even' or 'nearest'",
            )
        else:
            msg = f"{mr!r} is not one of upstream's values ({', '.join(MANTISSA_ROUNDING_VALUES)})"
        out.append((f"{block}.mantissa_rounding", msg))
    if activation and values.get("use_subgroup_scale"):
        out.append(
            (
                f"{block}.use_subgroup_scale",
                "has no effect: upstream creates FOCUS's sub-group scales for weight quantizers only "
                "(an activation quantizer computes its scales from each input); remove it",
            )
        )
    num_sub = values.get("num_sub")
    if num_sub is not None and (not isinstance(num_sub, int) or num_sub <= 0):
        out.append((f"{block}.num_sub", f"must be a positive integer (got {num_sub!r})"))
    return out


def feature_issues(data: Any, features: dict[str, tuple[Any, str]]) -> list[tuple[str, str]]:
    """``(key, message)`` for each feature key of ``data`` set to something other than its off value."""
    if not isinstance(data, dict):
        return []
    out = []
    for key, (off, feature) in features.items():
        if key in data and data[key] != off and not (off is None and data[key] in ({}, [])):
            out.append((key, unsupported_message(feature, f"remove the key (got {data[key]!r})")))
    return out
