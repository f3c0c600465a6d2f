"""The vocabulary of `qatlib.runtime.facts`: the runtimes, the export layouts they tell apart
(`layout_of`, from the scheme and its checkpoint format) and a `Fact` (one runtime behaviour with
its source line). `qatlib.runtime.facts` (the tables) re-exports every name.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..quant.spec import CheckpointFormat, Granularity, QuantScheme


@dataclass(frozen=True)
class Runtime:
    name: str
    version: str

    def __str__(self) -> str:
        return f"{self.name} {self.version}"


VLLM = Runtime("vllm", "0.33.0")
SGLANG = Runtime("sglang", "0.5.23")
TARGETS: dict[str, Runtime] = {"vllm": VLLM, "sglang": SGLANG}
TARGET_NAMES = (*TARGETS, "none")


class Layout(enum.Enum):
    """The export layouts the runtimes tell apart (`qatlib.export.format.compressed_tensors_format`)."""

    FP8_STATIC_TENSOR = "fp8 weight per-tensor + static per-tensor input"
    FP8_STATIC_CHANNEL = "fp8 weight per-channel + static per-tensor input"
    FP8_DYNAMIC_TENSOR = "fp8 weight + dynamic per-tensor input"
    FP8_DYNAMIC_TOKEN = "fp8 weight + dynamic per-token input"
    FP8_WEIGHT_ONLY = "fp8 weight only"
    W4A8 = "int4 weight + fp8 per-token dynamic input (W4A8-FP8)"
    W4A8_STATIC = "int4 weight + static fp8 input (w4a8_activation: trained)"
    WNA16 = "int4/int8 weight only, symmetric"
    WNA16_ASYM = "int4/int8 weight only, asymmetric"
    WNA16_ODD_BITS = "int2/3/5/6/7 weight only"
    INT8_DYNAMIC = "int8 weight + int8 dynamic per-token input"
    INT8_STATIC = "int8 weight + static per-tensor int8 input"
    NVFP4 = "nvfp4 weight + dynamic nvfp4 input (W4A4, static input global scale)"
    NVFP4_A16 = "nvfp4 weight only (W4A16)"
    MXFP4 = "mxfp4 weight + dynamic mxfp4 input (W4A4)"
    MXFP4_A16 = "mxfp4 weight only (W4A16)"
    # the runtimes' own fp8 format (quant_method: fp8, `CheckpointFormat.FP8`): their Fp8Config
    FP8_NATIVE_STATIC = "fp8 per-tensor weight + static per-tensor input, quant_method fp8 (Fp8Config)"
    FP8_NATIVE_DYNAMIC = "fp8 per-tensor weight + dynamic fp8 input, quant_method fp8 (Fp8Config)"
    OTHER = "other"


def layout_of(scheme: QuantScheme, *, w4a8_activation: str = "runtime") -> Layout:
    """The export layout of ``scheme`` (what `compressed_tensors_format` writes for it)."""
    w, a = scheme.weight, scheme.input
    if w is None:
        return Layout.OTHER
    if scheme.checkpoint_format is CheckpointFormat.FP8:  # QuantScheme checked: fp8 tensor + fp8 tensor input
        return Layout.FP8_NATIVE_DYNAMIC if a.dynamic else Layout.FP8_NATIVE_STATIC
    if w.is_fp4:  # quant.spec allows FP4 weights with the same FP4 input format or none
        if w.has_global_scale:
            return Layout.NVFP4 if a is not None else Layout.NVFP4_A16
        return Layout.MXFP4 if a is not None else Layout.MXFP4_A16
    if w.is_fp8:
        if a is None:
            return Layout.FP8_WEIGHT_ONLY
        if not a.is_fp8:
            return Layout.OTHER
        if a.dynamic:
            return (
                Layout.FP8_DYNAMIC_TOKEN if a.granularity is Granularity.TOKEN else Layout.FP8_DYNAMIC_TENSOR
            )
        return Layout.FP8_STATIC_CHANNEL if w.granularity is Granularity.CHANNEL else Layout.FP8_STATIC_TENSOR
    if a is None:
        if w.bits not in (4, 8):
            return Layout.WNA16_ODD_BITS
        return Layout.WNA16 if w.symmetric else Layout.WNA16_ASYM
    if a.is_fp8:
        runtime_act = w4a8_activation == "runtime" or (a.granularity is Granularity.TOKEN and a.dynamic)
        return Layout.W4A8 if runtime_act else Layout.W4A8_STATIC
    return Layout.INT8_DYNAMIC if a.dynamic else Layout.INT8_STATIC


@dataclass(frozen=True)
class Fact:
    """One runtime behaviour: ``what`` it does, ``source`` the release file:line it is read from,
    ``checked_by`` the runtime function `qatlib.runtime.check` runs to check it (with the oracle
    path), or ``"read only: <why>"``."""

    what: str
    source: str
    checked_by: str = ""

    @property
    def read_only(self) -> bool:
        return self.checked_by.startswith("read only")


# why the facts of a kind remain a reading
_NO_SGLANG = "read only: no SGLang oracle (SGLang 0.5.23 is not installed by requirements/runtime-oracle.txt)"
_GPU_SELECT = "read only: decided by which GPU kernels / backends exist (capability, compiled ops); the CPU oracle cannot see it"
