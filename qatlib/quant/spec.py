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


INT_QTYPES = tuple(f"int{b}" for b in range(2, 9))
QTYPES = (*INT_QTYPES, "fp8")


@dataclass(frozen=True)
class QuantSpec:
    """How one tensor is quantized.

    qtype: ``int2`` .. ``int8`` (signed codes) or ``fp8`` (E4M3, ±448).
    granularity: which elements share a scale (see docs/design.md for the scale shapes).
    group_size: elements per group for ``per-group``.
    symmetric: no zero point; ``fp8`` is always symmetric.
    dynamic: scales computed from each input at run time (``per-token`` is always dynamic).
    num_heads: heads for ``per-head`` (the last dim is split into ``num_heads`` equal parts).
    fp8_recast: after dequantization, recast the tensor to FP8 with a per-tensor scale, as the
        W4A8-FP8 deployment kernels do (int4 weights are expanded to FP8 before the FP8 GEMM).
    """

    qtype: str = "int8"
    granularity: Granularity = Granularity.TENSOR
    group_size: int | None = None
    symmetric: bool = True
    dynamic: bool = False
    num_heads: int | None = None
    fp8_recast: bool = False

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
        object.__setattr__(self, "granularity", gran)
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
        if self.fp8_recast and self.is_fp8:
            raise SpecError(
                "fp8_recast", "fp8_recast applies to integer weight formats (W4A8-FP8), not to fp8 itself"
            )

    # -- derived properties -------------------------------------------------
    @property
    def is_fp8(self) -> bool:
        return self.qtype == "fp8"

    @property
    def bits(self) -> int:
        return 8 if self.is_fp8 else int(self.qtype[3:])

    @property
    def qmin(self) -> float:
        return -FP8_E4M3_MAX if self.is_fp8 else float(-(2 ** (self.bits - 1)))

    @property
    def qmax(self) -> float:
        return FP8_E4M3_MAX if self.is_fp8 else float(2 ** (self.bits - 1) - 1)

    @property
    def has_zero_point(self) -> bool:
        return not self.symmetric

    def replace(self, **changes: Any) -> QuantSpec:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["granularity"] = self.granularity.value
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
        if self.fp8_recast:
            parts.append("fp8-recast")
        return " ".join(parts)


@dataclass(frozen=True)
class QuantScheme:
    """Which tensors of a linear layer are quantized, and how.

    weight / input: the layer's weight and input activation (None = not quantized).
    q / k / v: the outputs of the attention projections (KV-cache simulation); k and v are
        exported as ``k_cache.scale`` / ``v_cache.scale``.
    fp8_attn: simulate FP8 attention probabilities (eager attention only).
    """

    name: str = "custom"
    weight: QuantSpec | None = None
    input: QuantSpec | None = None
    q: QuantSpec | None = None
    k: QuantSpec | None = None
    v: QuantSpec | None = None
    fp8_attn: bool = False
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.weight is not None and self.weight.granularity in (Granularity.TOKEN, Granularity.HEAD):
            raise SpecError("granularity", f"weights cannot be quantized {self.weight.granularity.value}")
        if self.weight is not None and self.weight.dynamic:
            raise SpecError("dynamic", "weight quantization is static (dynamic applies to activations)")
        if self.input is not None and self.input.granularity in (Granularity.CHANNEL, Granularity.GROUP):
            raise SpecError(
                "granularity",
                f"input activations cannot be quantized {self.input.granularity.value}; "
                "use per-tensor (static or dynamic) or per-token",
            )
        for role in ("q", "k", "v"):
            spec = getattr(self, role)
            if spec is not None and spec.granularity in (Granularity.CHANNEL, Granularity.GROUP):
                raise SpecError("granularity", f"{role} output cannot be quantized {spec.granularity.value}")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "fp8_attn": self.fp8_attn}
        for role in ("weight", "input", "q", "k", "v"):
            spec = getattr(self, role)
            out[role] = None if spec is None else spec.to_dict()
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QuantScheme:
        kw: dict[str, Any] = {"name": d.get("name", "custom"), "fp8_attn": bool(d.get("fp8_attn", False))}
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
            for attr in ("qtype", "granularity", "group_size", "symmetric", "dynamic", "num_heads"):
                va, vb = getattr(a, attr), getattr(b, attr)
                if va != vb:
                    va, vb = (v.value if isinstance(v, Granularity) else v for v in (va, vb))
                    problems.append(f"{role}.{attr}: configured {va!r}, checkpoint {vb!r}")
        return problems


def _fp8_tensor(dynamic: bool = False) -> QuantSpec:
    return QuantSpec("fp8", Granularity.TENSOR, dynamic=dynamic)


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
