"""Fake quantization: specs, arithmetic, quantizer modules and the prepare / convert verbs."""

from .functional import compute_qparams, dequantize, fake_quantize, quantize
from .linear import (
    PrepareOptions,
    QDQLinear,
    QuantLinear,
    convert,
    prepare,
    quant_linears,
    quantization_disabled,
    quantizers,
)
from .quantizer import ROLE_LWC, ROLE_SCALE, Quantizer
from .spec import PRESETS, Granularity, QuantScheme, QuantSpec, preset

__all__ = [
    "PRESETS",
    "ROLE_LWC",
    "ROLE_SCALE",
    "Granularity",
    "PrepareOptions",
    "QDQLinear",
    "QuantLinear",
    "QuantScheme",
    "QuantSpec",
    "Quantizer",
    "compute_qparams",
    "convert",
    "dequantize",
    "fake_quantize",
    "prepare",
    "preset",
    "quant_linears",
    "quantization_disabled",
    "quantize",
    "quantizers",
]
