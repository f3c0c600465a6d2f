"""Experiment configuration: the upstream AngelSlim YAML layout, validated up front.

Why this module exists: the upstream toolkit reads its YAML into plain dataclasses and dicts, so a
typo (``learnable: {lwcc: true}``), a string where a bool belongs (``do_train: "false"`` is
truthy) or an inconsistent combination (a KD ``loss_type`` with ``kd_loss_weight: 0`` silently
trains on CE only; ZeRO-3 without ``from_ptq_ckpt`` dies in ``before_train`` after the model is
already sharded) surfaces hours into a GPU job, or never. Here every such mistake is a
`ConfigError` at load time that names the file and the dotted key, so a Snakemake rule or a CLI
call fails in a second on a CPU.

Layout: the upstream sections ``model``, ``compression`` (``quantization`` and ``QAT``),
``dataset`` and ``global`` are accepted unchanged, plus the qatlib extension ``evaluation``.
Every section forbids unknown keys; scalars are strict (``"true"`` is not a bool, ``"8"`` is not
an int) except that an int is accepted where a float is expected.

The one place where the YAML becomes a quantization format is `ExperimentConfig.quant_scheme`:
the named preset, then ``quant_method`` / ``group_size``, then the ``plugin_config.quant_config``
overrides, resolved into a `qatlib.quant.spec.QuantScheme`. Downstream modules use that object,
never the raw strings.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import json
import os
import re
import sys
import types
import typing
from collections.abc import Iterable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from qatlib.quant.spec import PRESETS, QTYPES, Granularity, QuantScheme, QuantSpec
from qatlib.yamlio import (
    ConfigError,
    apply_overrides,
    format_issues,
    join_path,
    load_yaml,
    normalise_overrides,
)

__all__ = [
    "BlockwiseConfig",
    "CompressionConfig",
    "ConfigError",
    "DatasetConfig",
    "EvaluationConfig",
    "ExperimentConfig",
    "GlobalConfig",
    "LearnableConfig",
    "LwcConfig",
    "ModelConfig",
    "OutputQuantConfig",
    "PluginConfig",
    "QATConfig",
    "QuantConfig",
    "QuantMethodConfig",
    "QuantizationConfig",
    "TensorQuantOverride",
    "check_group_size",
    "config_json_schema",
    "load_config",
    "load_yaml",
    "parse_config",
]


class _Violation(Exception):
    """Internal: one rule violation at a dotted path (turned into a ConfigError by the caller)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


# Error type used by validators that report several problems, each at its own sub-path. The
# formatter expands ``ctx["issues"]`` (pairs of path relative to the error's loc, message).
_ISSUES_ERROR = "qatlib_config_rules"


def _issues_error(issues: list[tuple[str, str]]) -> PydanticCustomError:
    summary = "; ".join(f"{p}: {m}" if p else m for p, m in issues)
    return PydanticCustomError(_ISSUES_ERROR, "{summary}", {"summary": summary, "issues": tuple(issues)})


# --------------------------------------------------------------------------------------------
# Vocabulary
# --------------------------------------------------------------------------------------------

QType = Literal[QTYPES]  # int2 .. int8, fp8 (spec.py is the single source)
GranularityName = Literal[tuple(g.value for g in Granularity)]
TorchDtype = Literal["auto", "fp16", "bf16", "fp32", "float16", "bfloat16", "float32"]
_DTYPE_CANONICAL = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}

# loss_type vocabulary (upstream end2end trainer). kl_top / r_kl_top take K inline or via loss_topk.
_PLAIN_LOSSES = ("origin", "kl", "rkl", "mse", "kd", "cakld")
_LOSS_RE = re.compile(r"^(?:(origin|kl|rkl|mse|kd|cakld)|(r_kl_top|kl_top)(?:_([1-9][0-9]*))?)$")
_LOSS_PATTERN = r"^(origin|kl|rkl|mse|kd|cakld|(r_)?kl_top(_[1-9][0-9]*)?)$"
_LOSS_VOCAB = "origin, kl, rkl, mse, kd, cakld, kl_top, kl_top_<K>, r_kl_top, r_kl_top_<K> (K a positive int)"

_KD_TEMPERATURE_DEFAULT = 1.0
_KD_ALPHA_DEFAULT = 0.5


def _group_size_value(v: int | None) -> int | None:
    """Upstream writes ``-1`` for "no groups"; anything else must be a positive group size."""
    if v is None or v == -1 or v > 0:
        return v
    raise ValueError(f"group_size must be a positive int, or -1 for none; got {v}")


def _norm_group_size(v: int | None) -> int | None:
    return None if v is None or v == -1 else v


def _empty_to_none(v: Any) -> Any:
    # Upstream examples write `resume_ckpt_dir: ""` for "unset"; treat it as null, not as the CWD.
    return None if isinstance(v, str) and not v.strip() else v


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


class _Section(BaseModel):
    """Base of every section: unknown keys are errors, scalars are strict, objects are frozen.

    Frozen because a validated config is a record of what ran: changing it afterwards would
    bypass the cross-field rules. Use `load_config(..., overrides=...)` instead.
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ModelConfig(_Section):
    """``model``: what to load and how (arguments of ``from_pretrained``)."""

    name: str | None = None
    model_path: str
    trust_remote_code: bool = False
    torch_dtype: TorchDtype = "auto"
    device_map: str | None = "auto"
    low_cpu_mem_usage: bool = True
    use_cache: bool = False
    attn_implementation: str | None = None
    cache_dir: str | None = None  # upstream field: HF download cache for from_pretrained

    @field_validator("device_map", mode="after")
    @classmethod
    def _device_map_none(cls, v: str | None) -> str | None:
        # Upstream ZeRO-3 configs write `device_map: None`, which YAML reads as the *string* "None";
        # passed to from_pretrained it would be a device name. Normalise it (upstream's engine does too).
        if v is not None and v.strip().lower() in ("none", "null", ""):
            return None
        return v

    @property
    def torch_dtype_name(self) -> str:
        """Canonical torch dtype name (``auto``, ``float16``, ``bfloat16``, ``float32``)."""
        return _DTYPE_CANONICAL.get(self.torch_dtype, self.torch_dtype)


class QuantMethodConfig(_Section):
    """``compression.quantization.quant_method``: granularities applied on top of the preset.

    ``group_size`` is accepted here too because upstream's shipped configs put it here.
    """

    weight: GranularityName | None = None
    activation: GranularityName | None = None
    group_size: int | None = None

    _gs = field_validator("group_size")(_group_size_value)


class QuantizationConfig(_Section):
    """``compression.quantization``: the named format (a key of ``qatlib.quant.spec.PRESETS``).

    Without ``name`` the format is built from ``bits`` (default 8, integer) and ``quant_method``,
    which is what upstream does for configs that only set ``plugin_config.quant_config.weight``.
    With a ``name``, ``bits`` is ignored (upstream's w4a8_fp8 configs carry ``bits: 8``).
    ``group_size`` only applies to per-group weights (upstream ignores it otherwise).
    """

    name: str | None = None
    bits: int | None = Field(None, ge=2, le=8)
    quant_method: QuantMethodConfig | None = None
    group_size: int | None = None
    ignore_layers: list[str] = Field(default_factory=list)

    _gs = field_validator("group_size")(_group_size_value)


class TensorQuantOverride(_Section):
    """``quant_config.weight`` / ``quant_config.activation``: per-field overrides of the preset.

    A missing field keeps the preset's value. ``is_sym`` is the upstream spelling of
    ``QuantSpec.symmetric``; ``group_size: -1`` means no groups.
    """

    qtype: QType | None = None
    granularity: GranularityName | None = None
    group_size: int | None = None
    is_sym: bool | None = None
    dynamic: bool | None = None

    _gs = field_validator("group_size")(_group_size_value)


class OutputQuantConfig(_Section):
    """``quant_config.q`` / ``k`` / ``v``: quantization of a projection's *output*.

    k / v simulate a quantized KV cache (exported as ``k_cache.scale`` / ``v_cache.scale``).
    These are complete formats (there is no preset to override), so ``qtype`` is required.
    """

    qtype: QType
    granularity: GranularityName = "per-tensor"
    group_size: int | None = None
    is_sym: bool = True
    dynamic: bool = False

    _gs = field_validator("group_size")(_group_size_value)


class LearnableConfig(_Section):
    """``quant_config.learnable``: which parameter groups train (model weights never do)."""

    act_scale: bool = False
    weight_scale: bool = True
    kv_scale: bool = False
    norm: bool = False
    lwc: bool = False


class LwcConfig(_Section):
    """``quant_config.lwc``: learnable weight clipping. ``enable_lwc`` creates the clip factors;
    ``learnable.lwc`` decides whether they train (so learnable.lwc without enable_lwc is a no-op)."""

    enable_lwc: bool = False
    lwc_init_value: float = 4.0
    lwc_lr: float = Field(0.5, ge=0)


class QuantConfig(_Section):
    """``compression.QAT.plugin_config.quant_config``: the learnable-scale plugin's settings."""

    use_weight_quant: bool = True
    use_activation_quant: bool = True
    lazy_init_samples: int = Field(10, gt=0)
    weight_scale_init_value: float = Field(1.0, gt=0)
    activation_scale_init_value: float = Field(1.0, gt=0)
    learnable: LearnableConfig = Field(default_factory=LearnableConfig)
    lwc: LwcConfig = Field(default_factory=LwcConfig)
    weight: TensorQuantOverride | None = None
    activation: TensorQuantOverride | None = None
    fp8_attn: bool = False
    # not upstream: run the fake-quant ops through torch.compile (needs a C++ compiler on CPU);
    # measured 0.85x the QAT step for FP8 formats on CPU, no gain for integer ones
    compile_fake_quant: bool = False
    q: OutputQuantConfig | None = None
    k: OutputQuantConfig | None = None
    v: OutputQuantConfig | None = None

    @model_validator(mode="after")
    def _lwc_consistency(self) -> QuantConfig:
        if self.learnable.lwc and not self.lwc.enable_lwc:
            # Upstream silently trains nothing: the clip factors are only created with enable_lwc.
            raise _issues_error(
                [("learnable.lwc", "is true but lwc.enable_lwc is false: there are no clip factors to learn")]
            )
        return self


class PluginConfig(_Section):
    """``compression.QAT.plugin_config``."""

    enable_scale: bool = True
    enable_rotation: bool = False
    quant_config: QuantConfig = Field(default_factory=QuantConfig)

    @field_validator("enable_rotation")
    @classmethod
    def _no_rotation(cls, v: bool) -> bool:
        if v:
            # Experimental upstream and not implemented here: refuse rather than silently skip it.
            raise ValueError("the learnable-rotation plugin is not implemented in qatlib; set it to false")
        return v


class BlockwiseConfig(_Section):
    """``compression.QAT.block_wise_config``: per-transformer-block training (single process)."""

    epochs: int = Field(20, gt=0)
    batch_size: int = Field(1, gt=0)
    train_size: int = Field(128, gt=0)
    val_size: int = Field(64, ge=0)
    training_seqlen: int = Field(2048, gt=0)
    quant_lr: float = Field(1e-4, ge=0)
    weight_lr: float = Field(1e-3, ge=0)
    min_lr_factor: float = Field(20.0, gt=0)
    wd: float = Field(0.0, ge=0)


@lru_cache(maxsize=1)
def _hf_training_arg_names() -> frozenset[str]:
    """Keys `transformers.Seq2SeqTrainingArguments` accepts (imported lazily: it pulls in torch)."""
    from transformers import Seq2SeqTrainingArguments

    return frozenset(f.name for f in dataclasses.fields(Seq2SeqTrainingArguments) if f.init)


class QATConfig(_Section):
    """``compression.QAT``: training mode, losses, data, HF Trainer arguments, plugin settings."""

    training_mode: Literal["end2end", "blockwise"] = "end2end"
    dist_mode: Literal["hf"] = "hf"
    do_train: bool = True
    save_format: Literal["fake", "real", "save_kvcache_only", "real_and_kvcache"] | None = None
    resume_ckpt_dir: str | None = None
    from_ptq_ckpt: str | None = None
    hf_dataset: str | None = None
    hf_cache_dir: str | None = None
    loss_type: str = Field("origin", json_schema_extra={"pattern": _LOSS_PATTERN})
    loss_topk: int | None = Field(None, gt=0)
    kd_temperature: float = Field(_KD_TEMPERATURE_DEFAULT, gt=0)
    kd_alpha: float = Field(_KD_ALPHA_DEFAULT, ge=0, le=1)
    lm_loss_weight: float = Field(1.0, ge=0)
    kd_loss_weight: float = Field(0.0, ge=0)
    hf_args: dict[str, Any] | None = Field(default_factory=dict)
    block_wise_config: BlockwiseConfig = Field(default_factory=BlockwiseConfig)
    plugin_config: PluginConfig = Field(default_factory=PluginConfig)

    _paths = field_validator("resume_ckpt_dir", "from_ptq_ckpt", "hf_dataset", "hf_cache_dir")(_empty_to_none)

    @field_validator("loss_type")
    @classmethod
    def _loss_vocab(cls, v: str) -> str:
        m = _LOSS_RE.match(v)
        if m is None:
            raise ValueError(f"unknown loss_type {v!r}; choose one of {_LOSS_VOCAB}")
        return v

    @field_validator("hf_args", mode="after")
    @classmethod
    def _hf_arg_keys(cls, v: dict[str, Any] | None) -> dict[str, Any]:
        # upstream's `hf_args:` with only comments below it is YAML null: no arguments.
        if not v:
            return {}
        known = _hf_training_arg_names()
        issues = []
        for key in v:
            if key == "output_dir":
                issues.append((key, "is set from global.save_path; set that instead"))
            elif key not in known:
                close = difflib.get_close_matches(key, sorted(known), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                issues.append(
                    (key, f"unknown key (not a field of transformers.Seq2SeqTrainingArguments){hint}")
                )
        if issues:
            raise _issues_error(issues)
        return dict(v)

    @model_validator(mode="after")
    def _loss_rules(self) -> QATConfig:
        """Upstream's documented loss constraints, plus the silent-no-op cases of the weights."""
        issues: list[tuple[str, str]] = []
        m = _LOSS_RE.match(self.loss_type)
        assert m is not None  # checked by _loss_vocab
        is_topk = m.group(2) is not None
        if self.loss_topk is not None and not is_topk:
            issues.append(
                ("loss_topk", f"only applies to kl_top / r_kl_top losses, not loss_type {self.loss_type!r}")
            )
        if is_topk and m.group(3) is None and self.loss_topk is None:
            issues.append(
                ("loss_type", f"{self.loss_type!r} needs K: write {self.loss_type}_<K> or set loss_topk")
            )
        if self.loss_type != "kd":
            if self.kd_temperature != _KD_TEMPERATURE_DEFAULT:
                issues.append(("kd_temperature", f"only applies to loss_type 'kd', not {self.loss_type!r}"))
            if self.kd_alpha != _KD_ALPHA_DEFAULT:
                issues.append(("kd_alpha", f"only applies to loss_type 'kd', not {self.loss_type!r}"))
        if self.lm_loss_weight == 0 and self.kd_loss_weight == 0:
            issues.append(
                ("lm_loss_weight", "lm_loss_weight and kd_loss_weight are both 0: nothing to train on")
            )
        elif self.loss_type != "origin" and self.kd_loss_weight == 0:
            # Upstream computes no KD term when kd_loss_weight is 0 and trains on CE only.
            issues.append(
                (
                    "kd_loss_weight",
                    f"is 0, so loss_type {self.loss_type!r} would be ignored; set kd_loss_weight > 0",
                )
            )
        elif self.loss_type == "origin" and self.kd_loss_weight > 0:
            issues.append(
                (
                    "loss_type",
                    "'origin' has no distillation term but kd_loss_weight > 0; choose a KD loss_type",
                )
            )
        if issues:
            raise _issues_error(issues)
        return self

    # -- typed accessors ------------------------------------------------------------------------
    @property
    def is_topk_loss(self) -> bool:
        return self.loss_type.startswith(("kl_top", "r_kl_top"))

    @property
    def topk(self) -> int | None:
        """K of a top-k KL loss: ``loss_topk`` if set (upstream: it overrides), else the inline K."""
        if not self.is_topk_loss:
            return None
        if self.loss_topk is not None:
            return self.loss_topk
        m = _LOSS_RE.match(self.loss_type)
        return int(m.group(3)) if m and m.group(3) else None

    @property
    def kd_loss_name(self) -> str | None:
        """The distillation variant without its K (``kl``, ``kl_top``, ``cakld`` ...); None = no KD."""
        if self.loss_type == "origin" or self.kd_loss_weight == 0:
            return None
        m = _LOSS_RE.match(self.loss_type)
        assert m is not None
        return m.group(1) or m.group(2)

    @property
    def uses_teacher(self) -> bool:
        """Whether a teacher forward is needed (only a positive-weight KD term needs one)."""
        return self.kd_loss_name is not None

    @property
    def uses_lm_loss(self) -> bool:
        return self.lm_loss_weight > 0


class CompressionConfig(_Section):
    """``compression``: ``name`` selects the pipeline; QAT settings live under ``QAT``.

    The ``QAT`` section is allowed with ``name: PTQ`` so one YAML can drive both stages and the
    PTQ checkpoint gets exactly the QAT run's `QuantScheme` (a mismatch is refused at warm start).
    """

    name: Literal["QAT", "PTQ"]
    quantization: QuantizationConfig = Field(default_factory=QuantizationConfig)
    qat: QATConfig = Field(default_factory=QATConfig, alias="QAT")


class DatasetConfig(_Section):
    """``dataset``: training / calibration data (``compression.QAT.hf_dataset`` overrides it)."""

    name: str = "TextDataset"
    data_path: str | None = None
    max_seq_length: int = Field(2048, gt=0)
    num_samples: int = Field(256, gt=0)
    batch_size: int = Field(1, gt=0)


class GlobalConfig(_Section):
    """``global``: where results go and the seed of the whole run."""

    save_path: str = "./output"
    seed: int = Field(42, ge=0)


_NonEmptyStr = Annotated[str, Field(min_length=1)]


class EvaluationConfig(_Section):
    """``evaluation`` (qatlib extension): what to measure after training.

    ppl: dataset ids (``wikitext2``, ``c4``) or local text files; tasks: lm-eval task names or
    local task directories. Upstream used command-line flags instead, which left results
    unreproducible from the YAML alone.
    """

    ppl: list[_NonEmptyStr] = Field(default_factory=list)
    tasks: list[_NonEmptyStr] = Field(default_factory=list)
    max_seq_length: int = Field(2048, gt=0)
    batch_size: int = Field(1, gt=0)
    num_fewshot: int = Field(0, ge=0)
    limit: int | None = Field(None, gt=0)


# --------------------------------------------------------------------------------------------
# QuantScheme resolution
# --------------------------------------------------------------------------------------------

_ROLES = ("weight", "input", "q", "k", "v")


def _field_for_message(msg: str) -> str | None:
    """Which QuantSpec field a spec.py ValueError is about (so the error names the YAML key)."""
    if "fp8_recast" in msg or "qtype" in msg:
        return "qtype"
    if "symmetric" in msg:
        return "symmetric"
    if "group_size" in msg:
        return "group_size"
    if "granularity" in msg or "cannot be quantized" in msg:
        return "granularity"
    if "dynamic" in msg or "static" in msg:
        return "dynamic"
    return None


class _SchemeBuilder:
    """Applies the YAML layers to a preset, remembering which key set each field of each role.

    The provenance is what lets an invalid combination be reported at the key that caused it
    (``...quant_config.weight.dynamic``) rather than as a bare ValueError from spec.py.
    """

    def __init__(self) -> None:
        self.specs: dict[str, QuantSpec | None] = dict.fromkeys(_ROLES)
        self.origin: dict[str, str] = {}  # role -> block that last touched it
        self.paths: dict[str, dict[str, str]] = {r: {} for r in _ROLES}  # role -> field -> key

    def where(self, role: str, msg: str) -> str:
        field = _field_for_message(msg)
        default = self.origin.get(role, "compression.quantization")
        return self.paths[role].get(field, default) if field else default

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
            raise _Violation(block, f"the base scheme does not quantize the {role}; set qtype to add it")
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
                raise _Violation(
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
        if qtype == "fp8":
            kw["fp8_recast"] = False  # recasting to fp8 is what an *integer* weight does in W4A8-FP8
            kw.setdefault("symmetric", True)  # fp8 is symmetric by construction
        try:
            self.specs[role] = spec.replace(**kw)
        except ValueError as e:
            raise _Violation(self.where(role, str(e)), str(e)) from None

    def new(self, role: str, block: str, cfg: OutputQuantConfig) -> None:
        keys = cfg.model_fields_set
        paths = {f: f"{block}.{k}" for f, k in _YAML_KEYS.items() if k in keys}
        self.origin[role] = block
        self.paths[role] = paths
        gs = _norm_group_size(cfg.group_size)
        if cfg.granularity == Granularity.GROUP.value and gs is None:
            raise _Violation(f"{block}.group_size", "per-group quantization needs a positive group_size")
        try:
            spec = QuantSpec(
                cfg.qtype,
                Granularity(cfg.granularity),
                group_size=gs if cfg.granularity == Granularity.GROUP.value else None,
                symmetric=cfg.is_sym,
                dynamic=cfg.dynamic,
            )
        except ValueError as e:
            raise _Violation(self.where(role, str(e)), str(e)) from None
        self.specs[role] = spec


# QuantSpec field -> upstream YAML key
_YAML_KEYS = {
    "qtype": "qtype",
    "granularity": "granularity",
    "group_size": "group_size",
    "symmetric": "is_sym",
    "dynamic": "dynamic",
}


def _override_changes(block: str, o: TensorQuantOverride) -> tuple[dict[str, Any], dict[str, str]]:
    changes: dict[str, Any] = {}
    paths: dict[str, str] = {}
    for field, key in _YAML_KEYS.items():
        if key not in o.model_fields_set:
            continue
        value = getattr(o, key)
        if value is None and key != "group_size":
            continue  # explicit null = keep the base value
        changes[field] = _norm_group_size(value) if key == "group_size" else value
        paths[field] = f"{block}.{key}"
    return changes, paths


def _build_quant_scheme(comp: CompressionConfig) -> QuantScheme:
    """Resolve ``compression`` into a QuantScheme (see `ExperimentConfig.quant_scheme`)."""
    QP = "compression.quantization"
    QC = "compression.QAT.plugin_config.quant_config"
    q = comp.quantization
    qc = comp.qat.plugin_config.quant_config
    qm = q.quant_method or QuantMethodConfig()

    gs_top, gs_qm = _norm_group_size(q.group_size), _norm_group_size(qm.group_size)
    if gs_top is not None and gs_qm is not None and gs_top != gs_qm:
        raise _Violation(f"{QP}.group_size", f"{gs_top} conflicts with {QP}.quant_method.group_size={gs_qm}")
    level_gs = gs_top if gs_top is not None else gs_qm
    level_gs_path = (
        f"{QP}.quant_method.group_size" if gs_top is None and gs_qm is not None else f"{QP}.group_size"
    )

    b = _SchemeBuilder()
    if q.name is not None:
        if q.name not in PRESETS:
            raise _Violation(
                f"{QP}.name",
                f"unknown quantization name {q.name!r}; choose one of {', '.join(sorted(PRESETS))}",
            )
        base = PRESETS[q.name]
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

    # 1) quantization.quant_method granularities and quantization.group_size
    w_changes: dict[str, Any] = {}
    w_paths: dict[str, str] = {}
    if qm.weight is not None:
        w_changes["granularity"] = qm.weight
        w_paths["granularity"] = f"{QP}.quant_method.weight"
    w_paths["group_size"] = level_gs_path  # where a missing per-group size belongs
    if level_gs is not None:
        w_changes["group_size"] = level_gs
    if b.specs["weight"] is not None and w_changes:
        b.apply("weight", f"{QP}.quant_method", w_changes, w_paths, fallback_group_size=level_gs)
    # quant_method.activation only re-grains an activation format the preset already has: it
    # names no qtype (upstream's defaults carry `activation: per-tensor` even for weight-only).
    if qm.activation is not None and b.specs["input"] is not None:
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
                raise _Violation(block, f"the base scheme does not quantize the {role}; set qtype to add it")
            b.set(role, QuantSpec(changes["qtype"]), block, {})
        b.apply(role, block, changes, paths, fallback_group_size=level_gs)

    # 3) q / k / v projection outputs
    for role in ("q", "k", "v"):
        o_cfg: OutputQuantConfig | None = getattr(qc, role)
        if o_cfg is not None:
            b.new(role, f"{QC}.{role}", o_cfg)

    # 4) each role on its own, so a QuantScheme-level error names the key that set it
    for role in _ROLES:
        spec = b.specs[role]
        if spec is None:
            continue
        try:
            QuantScheme(**{role: spec})
        except ValueError as e:
            raise _Violation(b.where(role, str(e)), str(e)) from None

    # 5) switches: validated formats above, then dropped if disabled
    weight = b.specs["weight"] if qc.use_weight_quant else None
    inp = b.specs["input"] if qc.use_activation_quant else None
    scheme = QuantScheme(
        name=name,
        weight=weight,
        input=inp,
        q=b.specs["q"],
        k=b.specs["k"],
        v=b.specs["v"],
        fp8_attn=fp8_attn or qc.fp8_attn,
    )
    if all(getattr(scheme, r) is None for r in _ROLES):
        raise _Violation(
            QC, "nothing is quantized (use_weight_quant and use_activation_quant are false, no q/k/v)"
        )
    return scheme


# --------------------------------------------------------------------------------------------
# DeepSpeed
# --------------------------------------------------------------------------------------------

_DS_PATH = "compression.QAT.hf_args.deepspeed"


def _resolve_deepspeed(value: Any, config_dir: Path | None) -> tuple[dict[str, Any] | None, Path | None]:
    """Load ``hf_args.deepspeed``: an inline mapping or a JSON file.

    A relative path is tried against the CWD first (what HF Trainer itself does at run time),
    then against the YAML's folder (so a config next to its ds_config works from anywhere).
    """
    if value is None:
        return None, None
    if isinstance(value, dict):
        return value, None
    if not isinstance(value, str | os.PathLike):
        raise _Violation(
            _DS_PATH, f"expected a DeepSpeed JSON file path or a mapping; got {type(value).__name__}"
        )
    raw = Path(value).expanduser()
    candidates = (
        [raw] if raw.is_absolute() else [Path.cwd() / raw] + ([config_dir / raw] if config_dir else [])
    )
    for cand in candidates:
        if cand.is_file():
            try:
                data = json.loads(cand.read_text())
            except (OSError, ValueError) as e:
                raise _Violation(_DS_PATH, f"cannot read DeepSpeed config {str(cand)!r}: {e}") from None
            if not isinstance(data, dict):
                raise _Violation(_DS_PATH, f"DeepSpeed config {str(cand)!r} is not a JSON object")
            return data, cand.resolve()
    looked = ", ".join(str(c) for c in candidates)
    raise _Violation(_DS_PATH, f"DeepSpeed config file {str(value)!r} not found (looked in: {looked})")


def _zero_stage(ds: dict[str, Any] | None) -> int | None:
    if not ds:
        return None
    zo = ds.get("zero_optimization")
    if not isinstance(zo, dict):
        return None
    stage = zo.get("stage")
    return stage if isinstance(stage, int) and not isinstance(stage, bool) else None


# --------------------------------------------------------------------------------------------
# The experiment
# --------------------------------------------------------------------------------------------


class ExperimentConfig(_Section):
    """A whole experiment: one upstream AngelSlim YAML (+ ``evaluation``), fully validated.

    Build it with `load_config` (from a file) or `parse_config` (from a dict); both run the
    cross-section rules below and resolve the QuantScheme, so an object that exists is runnable.
    """

    model: ModelConfig
    compression: CompressionConfig
    dataset: DatasetConfig | None = None
    global_: GlobalConfig = Field(default_factory=GlobalConfig, alias="global")
    evaluation: EvaluationConfig | None = None

    _source: str | None = PrivateAttr(None)
    _config_dir: Path | None = PrivateAttr(None)
    _scheme: QuantScheme | None = PrivateAttr(None)
    _ds_config: dict[str, Any] | None = PrivateAttr(None)
    _ds_path: Path | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _cross_section_rules(self, info: ValidationInfo) -> ExperimentConfig:
        """Rules that need more than one section (and the YAML's folder, from the context)."""
        ctx = info.context or {}
        self._source = ctx.get("source")
        self._config_dir = ctx.get("config_dir")
        issues: list[tuple[str, str]] = []
        qat = self.compression.qat
        P = "compression.QAT"
        QC = f"{P}.plugin_config.quant_config"
        qc = qat.plugin_config.quant_config

        try:
            self._scheme = _build_quant_scheme(self.compression)
        except _Violation as v:
            issues.append((v.path, v.message))

        try:
            self._ds_config, self._ds_path = _resolve_deepspeed(
                qat.hf_args.get("deepspeed"), self._config_dir
            )
        except _Violation as v:
            issues.append((v.path, v.message))

        if self.zero3_enabled:
            why = "with ZeRO-3 (hf_args.deepspeed has zero_optimization.stage 3)"
            if not qat.from_ptq_ckpt:
                issues.append(
                    (
                        f"{P}.from_ptq_ckpt",
                        f"is required {why}: scales cannot be calibrated on sharded weights; run PTQ first",
                    )
                )
            if qat.training_mode == "blockwise":
                issues.append(
                    (f"{P}.training_mode", f"blockwise training is single-process; not possible {why}")
                )
            if self.model.device_map is not None:
                issues.append(("model.device_map", f"must be None {why}: DeepSpeed places the shards"))
            if qat.save_format == "fake":
                issues.append(
                    (f"{P}.save_format", f"'fake' saves one process's state_dict; not possible {why}")
                )
            mixed = qat.hf_args.get("bf16") is True or qat.hf_args.get("fp16") is True
            if not mixed and self.model.torch_dtype_name != "float32":
                # DeepSpeed's linear wrapper autocasts to fp16 unless told otherwise: bf16 weights then
                # meet fp16 inputs (upstream's documented pitfall).
                issues.append((f"{P}.hf_args.bf16", f"set bf16: true (or fp16: true) {why}"))

        if qc.fp8_attn and self.model.attn_implementation != "eager":
            issues.append(
                (
                    f"{QC}.fp8_attn",
                    "simulates FP8 attention probabilities inside eager attention; "
                    f"set model.attn_implementation: eager (got {self.model.attn_implementation!r})",
                )
            )
        scheme = self._scheme
        if scheme is not None:
            if qc.learnable.act_scale and (scheme.input is None or scheme.input.dynamic):
                issues.append(
                    (
                        f"{QC}.learnable.act_scale",
                        "there is no static activation scale to learn (input is dynamic or off)",
                    )
                )
            if qc.learnable.kv_scale and scheme.k is None and scheme.v is None:
                issues.append(
                    (
                        f"{QC}.learnable.kv_scale",
                        "there is no k/v output quantization (set quant_config.k / v)",
                    )
                )
            if qc.lwc.enable_lwc and scheme.weight is None:
                issues.append(
                    (f"{QC}.lwc.enable_lwc", "weight clipping needs weight quantization (use_weight_quant)")
                )

        if qat.training_mode == "blockwise" and qat.uses_teacher:
            issues.append(
                (
                    f"{P}.loss_type",
                    "blockwise training fits each block's output by MSE; a KD loss_type would be ignored",
                )
            )
        if self.compression.name == "QAT" and qat.do_train and not qat.hf_dataset:
            if self.dataset is None or not self.dataset.data_path:
                issues.append(
                    (
                        "dataset",
                        "QAT training needs data: set dataset.data_path or compression.QAT.hf_dataset",
                    )
                )
        hf_seed = qat.hf_args.get("seed")
        if hf_seed is not None and hf_seed != self.global_.seed:
            issues.append(
                (
                    f"{P}.hf_args.seed",
                    f"{hf_seed!r} conflicts with global.seed={self.global_.seed}; set global.seed",
                )
            )
        if issues:
            raise _issues_error(issues)
        return self

    # -- typed accessors ------------------------------------------------------------------------
    @property
    def qat(self) -> QATConfig:
        """``compression.QAT`` (defaults when the YAML has no QAT section)."""
        return self.compression.qat

    @property
    def quantization(self) -> QuantizationConfig:
        return self.compression.quantization

    @property
    def source(self) -> str | None:
        """The YAML file this came from (None for `parse_config` without a source)."""
        return self._source

    @property
    def config_dir(self) -> Path | None:
        return self._config_dir

    @property
    def deepspeed_config(self) -> dict[str, Any] | None:
        """The DeepSpeed config (loaded from ``hf_args.deepspeed``), or None without DeepSpeed."""
        return self._ds_config

    @property
    def deepspeed_config_path(self) -> Path | None:
        """Absolute path of the DeepSpeed JSON (None when inline or absent)."""
        return self._ds_path

    @property
    def zero3_enabled(self) -> bool:
        """ZeRO-3 is on iff the DeepSpeed config has ``zero_optimization.stage == 3``."""
        return _zero_stage(self._ds_config) == 3

    def quant_scheme(self) -> QuantScheme:
        """The `QuantScheme` this experiment trains / calibrates / exports.

        Resolution order: ``PRESETS[quantization.name]`` (or int``bits`` without a name) ->
        ``quant_method.weight/activation`` granularity and ``group_size`` -> ``quant_config.weight /
        activation`` overrides -> ``q / k / v`` output specs -> ``fp8_attn`` -> the
        ``use_weight_quant`` / ``use_activation_quant`` switches. Resolved once at validation.
        """
        if self._scheme is None:  # only reachable for objects built bypassing validation
            try:
                self._scheme = _build_quant_scheme(self.compression)
            except _Violation as v:
                raise ConfigError(
                    format_issues([(v.path, v.message)], self._source), [(v.path, v.message)]
                ) from None
        return self._scheme

    @property
    def ignore_layers(self) -> list[str]:
        """``compression.quantization.ignore_layers`` (``lm_head`` when the list is empty): the
        one list every stage that builds a prepared model uses, so their module trees match."""
        return list(self.quantization.ignore_layers) or ["lm_head"]

    def prepare_options(self):
        """`PrepareOptions` from ``compression.QAT.plugin_config.quant_config`` (init values, LWC,
        compiled fake quantization), shared by PTQ, QAT, export and evaluation."""
        from qatlib.quant.linear import PrepareOptions

        qc = self.qat.plugin_config.quant_config
        return PrepareOptions(
            weight_init_value=qc.weight_scale_init_value,
            act_init_value=qc.activation_scale_init_value,
            lwc_init=qc.lwc.lwc_init_value if qc.lwc.enable_lwc else None,
            compile_fake_quant=qc.compile_fake_quant,
        )

    def hf_training_args(self) -> dict[str, Any]:
        """``hf_args`` ready for ``Seq2SeqTrainingArguments``.

        ``output_dir`` comes from ``global.save_path`` and ``seed`` from ``global.seed`` (one source
        of truth); a DeepSpeed file is passed as its resolved absolute path, because HF resolves a
        relative path against the CWD of the training process, which may not be the one that
        validated the config.
        """
        args = dict(self.qat.hf_args)
        args["output_dir"] = self.global_.save_path
        args.setdefault("seed", self.global_.seed)
        if self._ds_path is not None:
            args["deepspeed"] = str(self._ds_path)
        return args


_TYPE_WORDS = {
    "bool_type": "expected true or false",
    "int_type": "expected an integer",
    "float_type": "expected a number",
    "string_type": "expected a string",
    "dict_type": "expected a mapping",
    "model_type": "expected a mapping",
    "model_attributes_type": "expected a mapping",
    "list_type": "expected a list",
}


def _short(value: Any) -> str:
    r = repr(value)
    return r if len(r) <= 80 else r[:77] + "..."


def _section_class(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model class at ``loc`` (for listing the keys an unknown key could have meant)."""
    cls: type[BaseModel] = ExperimentConfig
    for part in loc:
        if isinstance(part, int):
            return None
        field = next((f for n, f in cls.model_fields.items() if (f.alias or n) == part), None)
        if field is None:
            return None
        ann = field.annotation
        candidates = (
            typing.get_args(ann)
            if isinstance(ann, types.UnionType) or typing.get_origin(ann) is typing.Union
            else (ann,)
        )
        nxt = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if nxt is None:
            return None
        cls = nxt
    return cls


def _describe(err: Mapping[str, Any]) -> str:
    kind = err["type"]
    loc = tuple(err["loc"])
    if kind == "extra_forbidden":
        cls = _section_class(loc[:-1])
        if cls is None:
            return "unknown key"
        allowed = [f.alias or n for n, f in cls.model_fields.items()]
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"unknown key{hint} (allowed: {', '.join(allowed)})"
    if kind == "missing":
        return "required key missing"
    if kind in _TYPE_WORDS:
        return f"{_TYPE_WORDS[kind]}, got {type(err['input']).__name__} {_short(err['input'])}"
    if kind == "literal_error":
        return f"must be one of {err['ctx']['expected']}; got {_short(err['input'])}"
    msg = str(err["msg"])
    if kind == "value_error":
        return msg.removeprefix("Value error, ")
    return f"{msg[0].lower()}{msg[1:]}; got {_short(err['input'])}"


def _issues_from(err: ValidationError, overridden: Iterable[str]) -> list[tuple[str, str]]:
    issues: list[tuple[str, str]] = []
    for e in err.errors():
        loc = tuple(e["loc"])
        if e["type"] == _ISSUES_ERROR:
            base = join_path(loc)
            for sub, msg in e["ctx"]["issues"]:
                issues.append((f"{base}.{sub}" if base and sub else (base or sub), msg))
        else:
            issues.append((join_path(loc), _describe(e)))
    overridden = list(overridden)
    out = []
    for path, msg in issues:
        ov = next(
            (o for o in overridden if path == o or path.startswith(o + ".") or o.startswith(path + ".")), None
        )
        out.append((path, f"{msg} (set by override {ov!r})" if ov else msg))
    return out


def parse_config(
    data: Any,
    *,
    source: str | None = None,
    config_dir: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, Any] | Iterable[str] | None = None,
) -> ExperimentConfig:
    """Validate an already-loaded config mapping (what `load_config` does after reading YAML).

    ``source`` names the origin in error messages; ``config_dir`` is where relative DeepSpeed
    paths are looked up after the CWD. ``data`` is not modified.
    """
    label = source or "<config>"
    if not isinstance(data, Mapping):
        got = "an empty document" if data is None else f"a {type(data).__name__}"
        raise ConfigError(
            f"{label}: the top level must be a mapping of sections, not {got}", [("", "not a mapping")]
        )
    raw = copy.deepcopy(dict(data))
    items = normalise_overrides(overrides, label)
    apply_overrides(raw, items, label)
    ctx = {"source": source, "config_dir": Path(config_dir).resolve() if config_dir is not None else None}
    try:
        return ExperimentConfig.model_validate(raw, context=ctx)
    except ValidationError as e:
        issues = _issues_from(e, [k for k, _ in items])
        raise ConfigError(format_issues(issues, label), issues) from None


def load_config(
    path: str | os.PathLike[str],
    overrides: Mapping[str, Any] | Iterable[str] | None = None,
) -> ExperimentConfig:
    """Load and validate an experiment YAML.

    overrides: ``{"compression.QAT.hf_args.learning_rate": 1e-4}`` or ``["global.seed=1", ...]``
    (values YAML-parsed), applied to the raw YAML before validation so they obey every rule.
    Raises ConfigError (``FILE: dotted.path: message`` per problem) for a missing file, invalid
    YAML, a non-mapping top level, unknown keys, wrong types and violated rules.
    """
    source = str(path)
    data = load_yaml(path)
    return parse_config(data, source=source, config_dir=Path(path).parent, overrides=overrides)


# --------------------------------------------------------------------------------------------
# Checks that need the model, and the JSON schema
# --------------------------------------------------------------------------------------------


def check_group_size(scheme: QuantScheme, layer_in_features: Mapping[str, int]) -> None:
    """Refuse layers whose ``in_features`` is not a multiple of the weight group size.

    Only known once the model is: a per-group scale is ``[out, in // g]``, so a remainder would
    leave columns without a scale (upstream crashes in a reshape mid-training). The fix is to
    ignore those layers or pick another group size, hence the list.
    """
    w = scheme.weight
    if w is None or w.granularity is not Granularity.GROUP or not w.group_size:
        return
    g = w.group_size
    bad = [(name, n) for name, n in layer_in_features.items() if n % g]
    if bad:
        shown = ", ".join(f"{name} (in_features={n})" for name, n in bad[:20])
        more = f" and {len(bad) - 20} more" if len(bad) > 20 else ""
        msg = (
            f"weight group_size {g} does not divide in_features of {len(bad)} layer(s): {shown}{more}; "
            "add them to compression.quantization.ignore_layers or choose another group_size"
        )
        raise ConfigError(
            f"compression.quantization.group_size: {msg}", [("compression.quantization.group_size", msg)]
        )


def _null_branch_first(node: Any) -> None:
    """Put ``{"type": "null"}`` first in every ``anyOf`` (same meaning, different evaluation order).

    Snakemake's ``validate(..., set_default=True)`` fills defaults by calling ``setdefault`` on
    every instance a ``properties`` schema is tried against; for an optional section that is
    null, trying the object branch first crashes it (AttributeError on None). anyOf stops at the
    first branch that matches, so with null first the object branch is never tried on None.
    """
    if isinstance(node, dict):
        branches = node.get("anyOf")
        if isinstance(branches, list):
            branches.sort(key=lambda b: not (isinstance(b, dict) and b.get("type") == "null"))
        for value in node.values():
            _null_branch_first(value)
    elif isinstance(node, list):
        for value in node:
            _null_branch_first(value)


def config_json_schema() -> dict[str, Any]:
    """JSON schema of the YAML layout (keys by alias), for Snakemake's ``validate``.

    It checks keys and types; the cross-field rules need `load_config`. ``hf_args`` keys are
    restricted to the fields of ``transformers.Seq2SeqTrainingArguments``.
    """
    schema = ExperimentConfig.model_json_schema(by_alias=True)
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}
    _null_branch_first(schema)
    hf_args = schema["$defs"]["QATConfig"]["properties"]["hf_args"]
    names = sorted(_hf_training_arg_names() - {"output_dir"})
    for branch in hf_args.get("anyOf", [hf_args]):
        if branch.get("type") == "object":
            branch["propertyNames"] = {"enum": names}
    return schema


def main(argv: list[str] | None = None) -> int:
    """``python -m qatlib.config --schema OUT.json`` | ``python -m qatlib.config CONFIG [--set k=v]``."""
    ap = argparse.ArgumentParser(prog="python -m qatlib.config", description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", help="experiment YAML to validate")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--schema", metavar="OUT.json", help="write the JSON schema of the config layout")
    args = ap.parse_args(argv)
    if not args.schema and not args.config:
        ap.error("give a CONFIG to validate and/or --schema OUT.json")
    if args.schema:
        out = Path(args.schema)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(config_json_schema(), indent=2) + "\n")
    if args.config:
        try:
            cfg = load_config(args.config, args.overrides)
        except ConfigError as e:
            print(e, file=sys.stderr)
            return 1
        print(
            json.dumps({"quant_scheme": cfg.quant_scheme().to_dict(), "zero3": cfg.zero3_enabled}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
