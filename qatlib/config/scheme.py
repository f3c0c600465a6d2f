"""The YAML's quantization layers resolved into one `QuantScheme`, naming the key at fault.

Resolution order: ``PRESETS[quantization.name]`` (or int``bits`` without a name) ->
``quant_method.weight/activation`` granularity and ``group_size`` -> ``quant_config.weight /
activation`` overrides (upstream FOCUS's ``mxfp4_rceil`` and sub-group keys included) -> ``q / k /
v`` output specs -> ``fp8_attn`` -> the ``use_weight_quant`` / ``use_activation_quant`` switches ->
``quantization.save_name`` (the checkpoint format). Each layer remembers which key set which `QuantSpec` field, so
an invalid combination (a `SpecError` from spec.py, which names its field) is reported at the
YAML key that caused it (``...quant_config.weight.dynamic``), not as a bare error from spec.py.
"""

from __future__ import annotations

from typing import Any

from qatlib.quant.spec import FP4_FORMATS, PRESETS, Granularity, QuantScheme, QuantSpec, ScaleRule, SpecError

from . import upstream
from .errors import Violation
from .sections import (
    CompressionConfig,
    OutputQuantConfig,
    QuantMethodConfig,
    TensorQuantOverride,
    norm_group_size,
)

__all__ = ["build_quant_scheme", "resolve_name"]


def resolve_name(name: str) -> upstream.Algorithm | str | None:
    """``quantization.name`` -> its `upstream.Algorithm`, a refusal message, or None (unknown)."""
    return upstream.resolve_algorithm(name, PRESETS)


_ROLES = ("weight", "input", "q", "k", "v")

# QuantSpec field -> upstream YAML key
_YAML_KEYS = {
    "qtype": "qtype",
    "granularity": "granularity",
    "group_size": "group_size",
    "symmetric": "is_sym",
    "dynamic": "dynamic",
}


class _SchemeBuilder:
    """Applies the YAML layers to a preset, remembering which key set each field of each role."""

    def __init__(self) -> None:
        self.specs: dict[str, QuantSpec | None] = dict.fromkeys(_ROLES)
        self.origin: dict[str, str] = {}  # role -> block that last touched it
        self.paths: dict[str, dict[str, str]] = {r: {} for r in _ROLES}  # role -> field -> key

    def fault(self, role: str, e: SpecError) -> Violation:
        """``e`` at the key that set its field (else at the block that last touched the role)."""
        default = self.origin.get(role, "compression.quantization")
        return Violation(self.paths[role].get(e.field, default), str(e))

    def set(self, role: str, spec: QuantSpec | None, block: str, paths: dict[str, str]) -> None:
        self.specs[role] = spec
        self.origin[role] = block
        self.paths[role].update(paths)

    def apply(
        self,
        role: str,
        block: str,
        changes: dict[str, Any],
        paths: dict[str, str],
        fallback_group_size: int | None = None,
    ) -> None:
        """Override fields of ``role``'s spec. ``changes`` holds only the keys the YAML set."""
        spec = self.specs[role]
        if spec is None:
            raise Violation(block, f"the base scheme does not quantize the {role}; set qtype to add it")
        self.origin[role] = block
        self.paths[role].update(paths)
        qtype = changes.get("qtype", spec.qtype)
        gran = Granularity(changes.get("granularity", spec.granularity))
        kw: dict[str, Any] = {"qtype": qtype, "granularity": gran}
        if gran is Granularity.GROUP:
            if "group_size" in changes:
                gs = changes["group_size"]
            else:
                gs = spec.group_size if spec.group_size is not None else fallback_group_size
            if gs is None:
                raise Violation(
                    paths.get("group_size", f"{block}.group_size"),
                    "per-group quantization needs a positive group_size",
                )
            kw["group_size"] = gs
        else:
            kw["group_size"] = None  # group_size only means something per-group (as upstream)
        if "symmetric" in changes:
            kw["symmetric"] = changes["symmetric"]
        if "dynamic" in changes:
            kw["dynamic"] = changes["dynamic"]
        if qtype == "fp8" or qtype in FP4_FORMATS:
            kw["fp8_recast"] = False  # recasting to fp8 is what an *integer* weight does in W4A8-FP8
            kw.setdefault("symmetric", True)  # fp8 / fp4 are symmetric by construction
        for key in ("scale_rule", "subgroups"):  # upstream FOCUS (`_override_changes`)
            if key in changes:
                kw[key] = changes[key]
        try:
            self.specs[role] = spec.replace(**kw)
        except SpecError as e:
            raise self.fault(role, e) from None

    def new(self, role: str, block: str, cfg: OutputQuantConfig) -> None:
        keys = cfg.model_fields_set
        paths = {f: f"{block}.{k}" for f, k in _YAML_KEYS.items() if k in keys}
        self.origin[role] = block
        self.paths[role] = paths
        gs = norm_group_size(cfg.group_size)
        if cfg.granularity == Granularity.GROUP.value and gs is None:
            raise Violation(f"{block}.group_size", "per-group quantization needs a positive group_size")
        try:
            spec = QuantSpec(
                cfg.qtype,
                Granularity(cfg.granularity),
                group_size=gs if cfg.granularity == Granularity.GROUP.value else None,
                symmetric=cfg.is_sym,
                dynamic=cfg.dynamic,
            )
        except SpecError as e:
            raise self.fault(role, e) from None
        self.specs[role] = spec


def _override_changes(block: str, o: TensorQuantOverride) -> tuple[dict[str, Any], dict[str, str]]:
    changes: dict[str, Any] = {}
    paths: dict[str, str] = {}
    for field, key in _YAML_KEYS.items():
        if key not in o.model_fields_set:
            continue
        value = getattr(o, key)
        if value is None and key != "group_size":
            continue  # explicit null = keep the base value
        changes[field] = norm_group_size(value) if key == "group_size" else value
        paths[field] = f"{block}.{key}"
    # upstream FOCUS: mxfp4_rceil is qtype mxfp4 with the ceil scale rule; any other qtype the
    # compressed-tensors rule. use_subgroup_scale (with num_sub, upstream's default 4) -> subgroups
    if "qtype" in changes:
        qtype, rule = upstream.FP4_QTYPES.get(
            changes["qtype"], (changes["qtype"], ScaleRule.COMPRESSED_TENSORS)
        )
        changes["qtype"], changes["scale_rule"] = qtype, ScaleRule(rule)
        paths["scale_rule"] = paths["qtype"]
    if o.use_subgroup_scale:
        changes["subgroups"] = o.num_sub if o.num_sub is not None else upstream.UPSTREAM_NUM_SUB
        paths["subgroups"] = f"{block}.{'num_sub' if o.num_sub is not None else 'use_subgroup_scale'}"
    return changes, paths


def build_quant_scheme(comp: CompressionConfig) -> QuantScheme:
    """Resolve ``compression`` into a QuantScheme; `Violation` at the key at fault."""
    QP = "compression.quantization"
    QC = "compression.QAT.plugin_config.quant_config"
    q = comp.quantization
    qc = comp.qat.plugin_config.quant_config
    qm = q.quant_method or QuantMethodConfig()

    gs_top, gs_qm = norm_group_size(q.group_size), norm_group_size(qm.group_size)
    if gs_top is not None and gs_qm is not None and gs_top != gs_qm:
        raise Violation(f"{QP}.group_size", f"{gs_top} conflicts with {QP}.quant_method.group_size={gs_qm}")
    level_gs = gs_top if gs_top is not None else gs_qm
    level_gs_path = (
        f"{QP}.quant_method.group_size" if gs_top is None and gs_qm is not None else f"{QP}.group_size"
    )

    b = _SchemeBuilder()
    if q.name is not None:
        algo = resolve_name(q.name)
        if isinstance(algo, str):
            raise Violation(f"{QP}.name", algo)
        if algo is None:
            known = sorted({*PRESETS, *upstream.ALGORITHMS})
            raise Violation(
                f"{QP}.name", f"unknown quantization name {q.name!r}; choose one of {', '.join(known)}"
            )
        base = PRESETS[algo.preset]
        name, fp8_attn = base.name, base.fp8_attn
        for role in _ROLES:
            b.set(role, getattr(base, role), f"{QP}.name", {})
    else:
        # No preset: integer weights and activations of `bits` bits, per-tensor unless quant_method
        # says otherwise (upstream's QuantizationConfig defaults); the plugin overrides refine it.
        bits = q.bits if q.bits is not None else 8
        name, fp8_attn = "custom", False
        where = f"{QP}.bits" if q.bits is not None else QP
        b.set("weight", QuantSpec(f"int{bits}"), where, {"qtype": where})
        b.set("input", QuantSpec(f"int{bits}"), where, {"qtype": where})

    # upstream FOCUS's FP4 keys, before anything is built from them (qatlib.config.upstream)
    for role, key in (("weight", "weight"), ("input", "activation")):
        o = getattr(qc, key)
        if o is None:
            continue
        values = {k: getattr(o, k) for k in o.model_fields_set}
        base = b.specs[role]
        qtype = values.get("qtype") or (base.qtype if base is not None else None)
        qtype = upstream.FP4_QTYPES.get(qtype, (qtype,))[0]
        issues = upstream.fp4_key_issues(
            f"{QC}.{key}", values, qtype in FP4_FORMATS, activation=role == "input"
        )
        if issues:
            raise Violation(*issues[0])

    # per-block is the FP4 formats' block spelling (quant.spec); anywhere else it is upstream's
    # block-scaled FP8, which qatlib does not run.
    fp4 = {r: (sp := b.specs.get(r)) is not None and sp.qtype in FP4_FORMATS for r in ("weight", "input")}
    for key, role in (("weight", "weight"), ("activation", "input")):
        if getattr(qm, key) == "per-block" and not fp4[role]:
            raise Violation(
                f"{QP}.quant_method.{key}",
                upstream.unsupported_message("per-block granularity (block-scaled NVFP4 / FP8)"),
            )

    # 1) quantization.quant_method granularities, zero_point and quantization.group_size
    w_changes: dict[str, Any] = {}
    w_paths: dict[str, str] = {}
    if qm.zero_point is not None:
        w_changes["symmetric"] = not qm.zero_point
        w_paths["symmetric"] = f"{QP}.quant_method.zero_point"
    overrides = {r: getattr(qc, k) for r, k in (("weight", "weight"), ("input", "activation"))}

    def plugin_sets_granularity(role: str) -> bool:
        """Upstream's quantizer reads only the plugin block's granularity when it has one; applying
        quant_method's first could build an invalid interim spec (NVFP4 inputs per-tensor)."""
        o = overrides[role]
        return o is not None and o.granularity is not None

    if qm.weight is not None and not plugin_sets_granularity("weight"):
        w_changes["granularity"] = qm.weight
        w_paths["granularity"] = f"{QP}.quant_method.weight"
    w_paths["group_size"] = level_gs_path  # where a missing per-group size belongs
    if level_gs is not None:
        w_changes["group_size"] = level_gs
    if b.specs["weight"] is not None and w_changes:
        b.apply("weight", f"{QP}.quant_method", w_changes, w_paths, fallback_group_size=level_gs)
    # quant_method.activation only re-grains an activation format the preset already has: it
    # names no qtype (upstream's defaults carry `activation: per-tensor` even for weight-only).
    if qm.activation is not None and b.specs["input"] is not None and not plugin_sets_granularity("input"):
        b.apply(
            "input",
            f"{QP}.quant_method.activation",
            {"granularity": qm.activation},
            {"granularity": f"{QP}.quant_method.activation"},
        )

    # 2) plugin_config.quant_config.weight / activation overrides
    for role, key in (("weight", "weight"), ("input", "activation")):
        o: TensorQuantOverride | None = getattr(qc, key)
        if o is None:
            continue
        block = f"{QC}.{key}"
        changes, paths = _override_changes(block, o)
        if b.specs[role] is None:
            if "qtype" not in changes:
                raise Violation(block, f"the base scheme does not quantize the {role}; set qtype to add it")
            b.set(role, QuantSpec(changes["qtype"]), block, {})
        b.apply(role, block, changes, paths, fallback_group_size=level_gs)

    # 3) q / k / v projection outputs (upstream's use_qkv_quant switches them)
    for role in ("q", "k", "v"):
        o_cfg: OutputQuantConfig | None = getattr(qc, role)
        if o_cfg is not None:
            b.new(role, f"{QC}.{role}", o_cfg)
    if qc.use_qkv_quant and all(b.specs[r] is None for r in ("q", "k", "v")):
        # upstream quietly quantizes nothing here
        raise Violation(
            f"{QC}.use_qkv_quant", "is true but no q / k / v quantization is set (quant_config.q/k/v)"
        )
    qkv_on = qc.use_qkv_quant is not False

    # 4) each role on its own, so a QuantScheme-level error names the key that set it
    for role in _ROLES:
        spec = b.specs[role]
        if spec is None:
            continue
        try:
            QuantScheme(**{role: spec})
        except SpecError as e:
            raise b.fault(role, e) from None

    # a plugin block that turns the preset's weights into another format (upstream FOCUS's MXFP4
    # files name w4a8_fp8) makes a scheme of no preset: named as one without a preset
    pw, w = PRESETS[resolve_name(q.name).preset].weight if q.name else None, b.specs["weight"]
    if pw is not None and w is not None and pw.qtype != w.qtype:
        name = "custom"

    # 5) switches: validated formats above, then dropped if disabled
    weight = b.specs["weight"] if qc.use_weight_quant else None
    inp = b.specs["input"] if qc.use_activation_quant else None
    scheme = QuantScheme(
        name=name,
        weight=weight,
        input=inp,
        q=b.specs["q"] if qkv_on else None,
        k=b.specs["k"] if qkv_on else None,
        v=b.specs["v"] if qkv_on else None,
        fp8_attn=fp8_attn or qc.fp8_attn,
    )
    if all(getattr(scheme, r) is None for r in _ROLES):
        raise Violation(
            QC, "nothing is quantized (use_weight_quant and use_activation_quant are false, no q/k/v)"
        )
    # 6) the checkpoint format the export writes (upstream's save_name)
    try:
        return scheme.replace(checkpoint_format=q.save_name)
    except SpecError as e:
        raise Violation(f"{QP}.save_name", str(e)) from None
