"""Typed description of a quantization format.

One `QuantSpec` says everything about how one tensor is quantized; one `QuantScheme` says which
tensors of a linear layer are quantized and how. An invalid combination raises `SpecError` (a
ValueError) naming the field at fault. Every other module dispatches on these types,
never on algorithm-name strings (the upstream toolkit's `if "fp8" in algo` chains).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0


class SpecError(ValueError):
    """An invalid quantization format; ``field`` is the `QuantSpec` / `QuantScheme` field at fault
    (so the experiment config can name the YAML key that set it, without reading the message)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class Granularity(str, enum.Enum):
    TENSOR = "per-tensor"
    CHANNEL = "per-channel"
    GROUP = "per-group"
    TOKEN = "per-token"
    HEAD = "per-head"
    # upstream AngelSlim's spelling for the 1-D blocks of the FP4 formats (``configs/qwen3/ptq/nvfp4``):
    # accepted for nvfp4 / mxfp4 only, where it means per-group of the format's block size.
    BLOCK = "per-block"


class ScaleFormat(str, enum.Enum):
    """The number format a stored scale is rounded to (in the forward, straight-through)."""

    FP32 = "fp32"
    E4M3 = "e4m3"  # NVFP4 group scales: FP8 E4M3, times a per-tensor fp32 global scale
    E8M0 = "e8m0"  # MX group scales: a power of two (8-bit exponent, no mantissa)


class ScaleRule(str, enum.Enum):
    """How an MX (E8M0) group scale is derived from the group's absolute max: at calibration, at
    initialisation and for dynamic activations. A learned scale is rounded to the nearest power of
    two in log2 either way (`functional.round_e8m0`)."""

    # compressed-tensors' rule (`functional.mx_scale_from_amax`): 2 ** (floor(log2 amax) - 2), one
    # up from mantissa 1.75; what vLLM applies to MXFP4 activations at run time
    COMPRESSED_TENSORS = "compressed-tensors"
    # 2 ** ceil(log2(amax / 6)): the group max never clips; upstream FOCUS's ``mxfp4_rceil``
    # (angelslim/compressor/qat/modules/quantizer.py `_fake_quant_mxfp4`)
    CEIL = "ceil"


class CheckpointFormat(str, enum.Enum):
    """The checkpoint format an export writes (upstream's ``quantization.save_name``)."""

    COMPRESSED_TENSORS = "compressed-tensors"
    # vLLM / SGLang's own FP8 format (``quant_method: fp8``, their ``Fp8Config``): per-tensor FP8
    # weights and a static or dynamic per-tensor FP8 input; the tensors compressed-tensors writes
    # for that scheme, another ``quantization_config`` (and, for MoE, another runtime path)
    FP8 = "fp8"


@dataclass(frozen=True)
class FP4Format:
    """An E2M1 (FP4) element format: its group size, group-scale format and whether a per-tensor
    fp32 global scale sits above the group scales (compressed-tensors ``tensor_group``)."""

    group_size: int
    scale_format: ScaleFormat
    global_scale: bool


# NVFP4: E2M1 values, one E4M3 scale per 16 elements, one fp32 global scale per tensor.
# MXFP4 (OCP MX): E2M1 values, one E8M0 scale per 32 elements.
FP4_FORMATS: dict[str, FP4Format] = {
    "nvfp4": FP4Format(16, ScaleFormat.E4M3, True),
    "mxfp4": FP4Format(32, ScaleFormat.E8M0, False),
}
INT_QTYPES = tuple(f"int{b}" for b in range(2, 9))
QTYPES = (*INT_QTYPES, "fp8", *FP4_FORMATS)


_DEPLOY_FIELDS = ("scale_dtype", "w4a8_kernel", "dynamic_granularity", "scale_reciprocal")
# written only when set (records of specs without them stay as they were)
_OPTIONAL_FIELDS = {"subgroups": None, "scale_rule": ScaleRule.COMPRESSED_TENSORS}


@dataclass(frozen=True)
class QuantSpec:
    """How one tensor is quantized.

    qtype: ``int2`` .. ``int8`` (signed codes), ``fp8`` (E4M3, ±448), or an FP4 (E2M1, ±6) format:
        ``nvfp4`` (E4M3 scale per 16 + fp32 global scale) / ``mxfp4`` (E8M0 scale per 32).
    granularity: which elements share a scale (see docs/design.md for the scale shapes). FP4
        formats are per-group of their block size (``per-block`` is accepted as upstream's name).
    group_size: elements per group for ``per-group``.
    symmetric: no zero point; ``fp8`` is always symmetric.
    dynamic: scales computed from each input at run time (``per-token`` is always dynamic).
    num_heads: heads for ``per-head`` (the last dim is split into ``num_heads`` equal parts).
    fp8_recast: after dequantization, recast the tensor to FP8 with a per-tensor scale, as the
        W4A8-FP8 deployment kernels do (int4 weights are expanded to FP8 before the FP8 GEMM).
    scale_rule: how MXFP4's E8M0 group scale is derived from a group max (`ScaleRule`): ``ceil``
        is upstream FOCUS's ``mxfp4_rceil`` (``2 ** ceil(log2(amax / 6))``).
    subgroups: FOCUS's learned sub-group scales (upstream ``use_subgroup_scale`` / ``num_sub``),
        FP4 weights only: each group of ``group_size`` elements is split into ``subgroups`` runs
        of ``group_size / subgroups``, each with a factor ``c = sigmoid(logit)`` in (0, 1) that
        divides the weight before rounding but not the codes after:
        ``w_q = s * e2m1(clamp(w / (s * c), -6, 6))``. The stored codes and group scales are
        all a runtime needs (the factor is folded into the codes): deployed == trained.

    The deployment fields below are set by `qatlib.runtime.tying.deploy_spec` for a ``deploy.target``;
    they change what the forward computes to what that runtime computes, not the export layout, so
    they take no part in equality (a checkpoint trained for one target loads for another):

    scale_dtype: the static scale is rounded to this torch dtype (``"bfloat16"``) in the forward and
        in the checkpoint (straight-through), as runtimes that keep scales in the model dtype do.
    w4a8_kernel: int group scales take vLLM's CUTLASS W4A8 path (`functional.w4a8_kernel_scale`:
        int4 codes exact, group scales to fp8 per output row); replaces ``fp8_recast``.
    dynamic_granularity: the quantizer runs dynamic at this granularity (vLLM runs every dynamic
        per-tensor fp8 input of a dense layer per token, and the W4A8 kernel's input per token even
        when the scheme calibrates a static one).
    scale_reciprocal: fp8 codes are ``x * (1/s)``, not ``x / s``: vLLM's ``QuantFP8`` multiplies by
        the reciprocal (input_quant_fp8.py:216-220); the two differ at exact ties between fp8
        codes, which bf16 activations hit often under a per-token scale ``amax / 448``.
    """

    qtype: str = "int8"
    granularity: Granularity = Granularity.TENSOR
    group_size: int | None = None
    symmetric: bool = True
    dynamic: bool = False
    num_heads: int | None = None
    fp8_recast: bool = False
    scale_rule: ScaleRule = ScaleRule.COMPRESSED_TENSORS
    subgroups: int | None = None
    scale_dtype: str | None = field(default=None, compare=False)
    w4a8_kernel: bool = field(default=False, compare=False)
    dynamic_granularity: Granularity | None = field(default=None, compare=False)
    scale_reciprocal: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        if self.qtype not in QTYPES:
            raise SpecError("qtype", f"qtype must be one of {', '.join(QTYPES)}; got {self.qtype!r}")
        try:
            gran = Granularity(self.granularity)
        except ValueError:
            choices = ", ".join(g.value for g in Granularity)
            raise SpecError(
                "granularity", f"granularity must be one of {choices}; got {self.granularity!r}"
            ) from None
        fp4 = FP4_FORMATS.get(self.qtype)
        if gran is Granularity.BLOCK:
            if fp4 is None:
                raise SpecError(
                    "granularity",
                    f"per-block granularity is the FP4 formats' block spelling (nvfp4 / mxfp4), not {self.qtype}; "
                    "use per-group",
                )
            gran = Granularity.GROUP
            if self.group_size in (None, -1, 0):
                object.__setattr__(self, "group_size", fp4.group_size)
        object.__setattr__(self, "granularity", gran)
        if fp4 is not None:
            if gran is not Granularity.GROUP:
                raise SpecError(
                    "granularity", f"{self.qtype} is quantized per-group (per-block), not {gran.value}"
                )
            if self.group_size != fp4.group_size:
                raise SpecError(
                    "group_size",
                    f"{self.qtype} has one scale per {fp4.group_size} elements (the format and its kernels fix it); "
                    f"got group_size={self.group_size}",
                )
            if not self.symmetric:
                raise SpecError("symmetric", f"{self.qtype} is symmetric only (set is_sym/symmetric: true)")
        if gran is Granularity.GROUP:
            if self.group_size is None or self.group_size <= 0:
                raise SpecError(
                    "group_size",
                    f"per-group quantization needs a positive group_size; got {self.group_size!r}",
                )
        elif self.group_size not in (None, -1, 0):
            raise SpecError(
                "group_size",
                f"group_size={self.group_size} is only valid with per-group granularity, not {gran.value}",
            )
        else:
            object.__setattr__(self, "group_size", None)
        if gran is Granularity.TOKEN and not self.dynamic:
            # per-token scales depend on the tokens of each call: they cannot be static.
            object.__setattr__(self, "dynamic", True)
        if self.is_fp8 and not self.symmetric:
            raise SpecError("symmetric", "fp8 quantization is symmetric only (set is_sym/symmetric: true)")
        if gran is Granularity.HEAD and self.num_heads is not None and self.num_heads <= 0:
            raise SpecError("num_heads", f"per-head quantization needs num_heads > 0; got {self.num_heads}")
        if self.dynamic_granularity is not None:
            object.__setattr__(self, "dynamic_granularity", Granularity(self.dynamic_granularity))
        if self.scale_dtype not in (None, "bfloat16", "float16"):
            raise SpecError("scale_dtype", f"scale_dtype is bfloat16 or float16; got {self.scale_dtype!r}")
        if self.w4a8_kernel and (self.is_float or gran is not Granularity.GROUP):
            raise SpecError("w4a8_kernel", "the W4A8 kernel scale path applies to per-group int weights")
        if self.fp8_recast and self.is_float:
            raise SpecError(
                "fp8_recast", f"fp8_recast applies to integer weight formats (W4A8-FP8), not to {self.qtype}"
            )
        self._check_fp4_options()

    def _check_fp4_options(self) -> None:
        try:
            rule = ScaleRule(self.scale_rule)
        except ValueError:
            choices = ", ".join(r.value for r in ScaleRule)
            raise SpecError(
                "scale_rule", f"scale_rule must be one of {choices}; got {self.scale_rule!r}"
            ) from None
        object.__setattr__(self, "scale_rule", rule)
        if rule is ScaleRule.CEIL and self.scale_format is not ScaleFormat.E8M0:
            raise SpecError(
                "scale_rule", f"the ceil rule derives MXFP4's E8M0 scales (mxfp4_rceil), not {self.qtype}'s"
            )
        n = self.subgroups
        if n is None:
            return
        if not self.is_fp4:
            raise SpecError(
                "subgroups", f"sub-group scales (FOCUS) apply to the FP4 formats, not to {self.qtype}"
            )
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0 or self.group_size % n:
            raise SpecError(
                "subgroups",
                f"subgroups must be a positive divisor of the group size {self.group_size}; got {n!r}",
            )
        if self.dynamic:
            raise SpecError(
                "subgroups",
                "sub-group scales are learned parameters of a static (weight) quantizer, not dynamic",
            )

    # -- derived properties -------------------------------------------------
    @property
    def is_fp8(self) -> bool:
        return self.qtype == "fp8"

    @property
    def fp4(self) -> FP4Format | None:
        """The FP4 element format (nvfp4 / mxfp4), None for int and fp8."""
        return FP4_FORMATS.get(self.qtype)

    @property
    def is_fp4(self) -> bool:
        return self.qtype in FP4_FORMATS

    @property
    def is_float(self) -> bool:
        return self.is_fp8 or self.is_fp4

    @property
    def scale_format(self) -> ScaleFormat:
        return ScaleFormat.FP32 if self.fp4 is None else self.fp4.scale_format

    @property
    def has_global_scale(self) -> bool:
        return self.fp4 is not None and self.fp4.global_scale

    @property
    def bits(self) -> int:
        if self.is_fp4:
            return 4
        return 8 if self.is_fp8 else int(self.qtype[3:])

    @property
    def bits_per_element(self) -> float:
        """Storage bits per element including the group scales (16-bit scales for int groups,
        as the WNA16 kernels store them; 8-bit E4M3 / E8M0 for the FP4 formats)."""
        if self.granularity is not Granularity.GROUP:
            return float(self.bits)
        scale_bits = 16 if self.scale_format is ScaleFormat.FP32 else 8
        return self.bits + scale_bits / self.group_size

    @property
    def qmin(self) -> float:
        return -self.qmax if self.is_float else float(-(2 ** (self.bits - 1)))

    @property
    def qmax(self) -> float:
        if self.is_fp4:
            return FP4_E2M1_MAX
        return FP8_E4M3_MAX if self.is_fp8 else float(2 ** (self.bits - 1) - 1)

    @property
    def has_zero_point(self) -> bool:
        return not self.symmetric

    def replace(self, **changes: Any) -> QuantSpec:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["granularity"] = self.granularity.value
        if self.dynamic_granularity is not None:
            d["dynamic_granularity"] = self.dynamic_granularity.value
        for k in _DEPLOY_FIELDS:  # written only when set: records of untied runs stay as they were
            if not d[k]:
                del d[k]
        for k, default in _OPTIONAL_FIELDS.items():
            if d[k] == default:
                del d[k]
        if "scale_rule" in d:
            d["scale_rule"] = self.scale_rule.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QuantSpec:
        return cls(**d)

    def describe(self) -> str:
        parts = [self.qtype, self.granularity.value]
        if self.group_size:
            parts.append(f"g{self.group_size}")
        parts.append("sym" if self.symmetric else "asym")
        parts.append("dynamic" if self.dynamic else "static")
        if self.scale_rule is ScaleRule.CEIL:
            parts.append("ceil-scales")
        if self.subgroups:
            parts.append(f"{self.subgroups}-subgroups")
        if self.w4a8_kernel:
            parts.append("w4a8-kernel-scales")
        elif self.fp8_recast:
            parts.append("fp8-recast")
        if self.scale_dtype:
            parts.append(f"{self.scale_dtype}-scales")
        if self.dynamic_granularity is not None:
            parts.append(f"runs {self.dynamic_granularity.value}")
        return " ".join(parts)


@dataclass(frozen=True)
class QuantScheme:
    """Which tensors of a linear layer are quantized, and how.

    weight / input: the layer's weight and input activation (None = not quantized).
    q / k / v: the outputs of the attention projections (KV-cache simulation); k and v are
        exported as ``k_cache.scale`` / ``v_cache.scale``.
    fp8_attn: simulate FP8 attention probabilities (eager attention only).
    checkpoint_format: what the export writes (`CheckpointFormat`); ``fp8`` takes per-tensor fp8
        weights and a per-tensor fp8 input and nothing else. It changes the runtime's load path,
        not the trained arithmetic: no part of equality.
    """

    name: str = "custom"
    weight: QuantSpec | None = None
    input: QuantSpec | None = None
    q: QuantSpec | None = None
    k: QuantSpec | None = None
    v: QuantSpec | None = None
    fp8_attn: bool = False
    checkpoint_format: CheckpointFormat = field(default=CheckpointFormat.COMPRESSED_TENSORS, compare=False)
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        self._check_checkpoint_format()
        if self.weight is not None and self.weight.granularity in (Granularity.TOKEN, Granularity.HEAD):
            raise SpecError("granularity", f"weights cannot be quantized {self.weight.granularity.value}")
        if self.weight is not None and self.weight.dynamic:
            raise SpecError("dynamic", "weight quantization is static (dynamic applies to activations)")
        if self.weight is not None and self.weight.is_fp4 and self.input is not None:
            if self.input.is_fp4 and self.input.qtype != self.weight.qtype:
                raise SpecError(
                    "qtype", f"{self.weight.qtype} weights with {self.input.qtype} activations have no kernel"
                )
        if self.input is not None and self.input.is_fp4:
            if not self.input.dynamic:
                # the group scales of FP4 activations are computed per token group at run time by
                # every runtime (vLLM, compressed-tensors); only NVFP4's global scale is static.
                raise SpecError(
                    "dynamic", f"{self.input.qtype} activations are dynamic per group (set dynamic: true)"
                )
        elif self.input is not None and self.input.granularity in (Granularity.CHANNEL, Granularity.GROUP):
            raise SpecError(
                "granularity",
                f"input activations cannot be quantized {self.input.granularity.value}; "
                "use per-tensor (static or dynamic) or per-token",
            )
        for role in ("q", "k", "v"):
            spec = getattr(self, role)
            if spec is not None and spec.is_fp4:
                raise SpecError("qtype", f"{role} output cannot be quantized {spec.qtype} (no FP4 KV cache)")
            if spec is not None and spec.granularity in (Granularity.CHANNEL, Granularity.GROUP):
                raise SpecError("granularity", f"{role} output cannot be quantized {spec.granularity.value}")

    def _check_checkpoint_format(self) -> None:
        try:
            fmt = CheckpointFormat(self.checkpoint_format)
        except ValueError:
            choices = ", ".join(f.value for f in CheckpointFormat)
            raise SpecError(
                "checkpoint_format",
                f"checkpoint format must be one of {choices}; got {self.checkpoint_format!r}",
            ) from None
        object.__setattr__(self, "checkpoint_format", fmt)
        if fmt is not CheckpointFormat.FP8:
            return
        w, a = self.weight, self.input
        tensor = Granularity.TENSOR
        why = []
        if w is None or not w.is_fp8 or w.granularity is not tensor:
            why.append(f"weights {'none' if w is None else w.describe()} (it stores fp8 per-tensor)")
        if a is None or not a.is_fp8 or a.granularity is not tensor:
            why.append(f"input {'none' if a is None else a.describe()} (fp8 per-tensor, static or dynamic)")
        if any(getattr(self, r) is not None for r in ("q", "k", "v")):
            why.append("q / k / v output quantization (not exported in this format)")
        if why:
            raise SpecError(
                "checkpoint_format",
                "the fp8 checkpoint format (quant_method: fp8) holds fp8 per-tensor weights and a per-tensor fp8 "
                f"input only; this scheme has {'; '.join(why)}: use compressed-tensors",
            )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "fp8_attn": self.fp8_attn}
        for role in ("weight", "input", "q", "k", "v"):
            spec = getattr(self, role)
            out[role] = None if spec is None else spec.to_dict()
        if self.checkpoint_format is not CheckpointFormat.COMPRESSED_TENSORS:  # records of others unchanged
            out["checkpoint_format"] = self.checkpoint_format.value
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QuantScheme:
        kw: dict[str, Any] = {"name": d.get("name", "custom"), "fp8_attn": bool(d.get("fp8_attn", False))}
        if "checkpoint_format" in d:
            kw["checkpoint_format"] = d["checkpoint_format"]
        for role in ("weight", "input", "q", "k", "v"):
            v = d.get(role)
            kw[role] = None if v is None else QuantSpec.from_dict(v)
        return cls(**kw)

    def replace(self, **changes: Any) -> QuantScheme:
        return dataclasses.replace(self, **changes)

    def compatible_with(self, other: QuantScheme) -> list[str]:
        """Differences that make scales of ``other`` unusable for ``self`` (empty = compatible).

        Static scales only depend on qtype/granularity/group/symmetry; dynamic quantizers store no
        scale, so their static/dynamic flag matters too.
        """
        problems = []
        for role in ("weight", "input", "k", "v", "q"):
            a, b = getattr(self, role), getattr(other, role)
            if a is None or b is None:
                continue
            attrs = ("qtype", "granularity", "group_size", "symmetric", "dynamic", "num_heads", "scale_rule")
            for attr in attrs:
                va, vb = getattr(a, attr), getattr(b, attr)
                if va != vb:
                    va, vb = (v.value if isinstance(v, enum.Enum) else v for v in (va, vb))
                    problems.append(f"{role}.{attr}: configured {va!r}, checkpoint {vb!r}")
        return problems


def _fp8_tensor(dynamic: bool = False) -> QuantSpec:
    return QuantSpec("fp8", Granularity.TENSOR, dynamic=dynamic)


def _fp4(qtype: str, dynamic: bool = False) -> QuantSpec:
    return QuantSpec(qtype, Granularity.GROUP, group_size=FP4_FORMATS[qtype].group_size, dynamic=dynamic)


# Named presets for the upstream algorithm names (compression.quantization.name).
PRESETS: dict[str, QuantScheme] = {
    "fp8_static": QuantScheme("fp8_static", weight=_fp8_tensor(), input=_fp8_tensor()),
    "fp8_dynamic": QuantScheme("fp8_dynamic", weight=_fp8_tensor(), input=_fp8_tensor(dynamic=True)),
    "w4a8_fp8": QuantScheme(
        "w4a8_fp8",
        weight=QuantSpec("int4", Granularity.GROUP, group_size=128, fp8_recast=True),
        input=_fp8_tensor(),
    ),
    "int4_weight_only": QuantScheme(
        "int4_weight_only", weight=QuantSpec("int4", Granularity.GROUP, group_size=128)
    ),
    "int8": QuantScheme(
        "int8",
        weight=QuantSpec("int8", Granularity.CHANNEL),
        input=QuantSpec("int8", Granularity.TOKEN, dynamic=True),
    ),
}
PRESETS["w8a8"] = PRESETS["int8"].replace(name="w8a8")
# FP4: W4A4 (activations dynamic per group; NVFP4 keeps a static per-tensor global input scale)
# and NVFP4 weight-only (W4A16: what vLLM runs on pre-Blackwell GPUs through Marlin).
PRESETS["nvfp4"] = QuantScheme("nvfp4", weight=_fp4("nvfp4"), input=_fp4("nvfp4", dynamic=True))
PRESETS["nvfp4_weight_only"] = QuantScheme("nvfp4_weight_only", weight=_fp4("nvfp4"))
PRESETS["mxfp4"] = QuantScheme("mxfp4", weight=_fp4("mxfp4"), input=_fp4("mxfp4", dynamic=True))
PRESETS["mxfp4_weight_only"] = QuantScheme("mxfp4_weight_only", weight=_fp4("mxfp4"))
for _b in range(2, 9):
    PRESETS.setdefault(
        f"int{_b}_weight_only",
        QuantScheme(f"int{_b}_weight_only", weight=QuantSpec(f"int{_b}", Granularity.GROUP, group_size=128)),
    )


def preset(name: str) -> QuantScheme:
    try:
        return PRESETS[name]
    except KeyError:
        raise SpecError(
            "name", f"unknown quantization name {name!r}; choose one of {', '.join(sorted(PRESETS))}"
        ) from None
