"""`ExperimentConfig`: a whole experiment, its cross-section rules, and the runtime objects it builds.

The rules here need more than one section (ZeRO-3 needs ``from_ptq_ckpt``, ``fp8_attn`` needs
eager attention, ...) or the YAML's folder (the DeepSpeed JSON is resolved and read at parse
time). The builders (`quant_scheme`, `prepare_options`, `loss_config`, `learnable`, `blockwise`,
`hf_training_args`) are how every stage gets its settings: the library objects, built from the
validated YAML, never a second copy of its fields.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from pathlib import Path
from typing import Any

from pydantic import Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from qatlib.losses import LossConfig
from qatlib.quant.linear import PrepareOptions
from qatlib.quant.spec import QuantScheme
from qatlib.runtime.tying import tie_for, ties_across_experts
from qatlib.trainers.blockwise import BlockwiseSettings
from qatlib.trainers.params import Learnable
from qatlib.yamlio import ConfigError, config_file_candidates, format_issues
from qatlib.zero3.ds_config import expert_leaf_issue, with_defaults, zero_stage

from . import upstream
from .deploy import deploy_issues, local_model_dtype, local_model_is_moe
from .errors import Violation, issues_error
from .scheme import build_quant_scheme, resolve_name
from .sections import (
    CompressionConfig,
    DatasetConfig,
    DeployConfig,
    EvaluationConfig,
    GlobalConfig,
    ModelConfig,
    QATConfig,
    QuantizationConfig,
    Section,
)

__all__ = ["ExperimentConfig"]

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------
# DeepSpeed
# --------------------------------------------------------------------------------------------

_DS_PATH = "compression.QAT.hf_args.deepspeed"


def _resolve_deepspeed(value: Any, config_dir: Path | None) -> tuple[dict[str, Any] | None, Path | None]:
    """Load ``hf_args.deepspeed``: an inline mapping or a JSON file.

    A relative path is tried against the CWD first (what HF Trainer itself does at run time),
    then against the YAML's folder (so a config next to its ds_config works from anywhere), then
    against the folders above it: upstream's configs write the path from the root of their
    repository (``deepspeed: configs/qwen3/qat/.../ds_config_zero3.json``).
    """
    if value is None:
        return None, None
    if isinstance(value, dict):
        return value, None
    if not isinstance(value, str | os.PathLike):
        raise Violation(
            _DS_PATH, f"expected a DeepSpeed JSON file path or a mapping; got {type(value).__name__}"
        )
    candidates = config_file_candidates(value, Path.cwd(), config_dir)
    for cand in candidates:
        if cand.is_file():
            try:
                data = json.loads(cand.read_text())
            except (OSError, ValueError) as e:
                raise Violation(_DS_PATH, f"cannot read DeepSpeed config {str(cand)!r}: {e}") from None
            if not isinstance(data, dict):
                raise Violation(_DS_PATH, f"DeepSpeed config {str(cand)!r} is not a JSON object")
            return data, cand.resolve()
    looked = ", ".join(str(c) for c in candidates[:3]) + (
        " and the folders above" if len(candidates) > 3 else ""
    )
    raise Violation(_DS_PATH, f"DeepSpeed config file {str(value)!r} not found (looked in: {looked})")


def _auto_adamw(opt: Any) -> bool:
    """Upstream's own block: ``{"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}``,
    i.e. AdamW with the Trainer's learning_rate / weight_decay: what qatlib's optimizer is."""
    if not isinstance(opt, dict) or str(opt.get("type", "")).lower() not in ("adamw", "adam"):
        return False
    params = opt.get("params", {})
    return isinstance(params, dict) and "lr" in params and all(v == "auto" for v in params.values())


def _check_deepspeed(ds: dict[str, Any], path: Path | None) -> dict[str, Any]:
    """Refuse an ``optimizer`` block (a ``scheduler`` block is allowed); returns the config to use.

    qatlib owns the optimizer (torch AdamW with separate scale / LWC / norm groups). With an
    ``optimizer`` block transformers builds DeepSpeed's optimizer from it instead, silently losing
    the groups (and on CPU compiles ``fused_adam``, ~100 s). Upstream's ds_config_zero3.json has
    an all-``auto`` AdamW block: that is AdamW at hf_args' learning_rate / weight_decay, which
    qatlib's optimizer already is, so that block is dropped (logged) instead of refused.
    """
    if "optimizer" in ds and _auto_adamw(ds["optimizer"]):
        log.info("DeepSpeed config %s: its all-'auto' AdamW block is qatlib's own optimizer; dropped", path)
        return {k: v for k, v in ds.items() if k != "optimizer"}
    if "optimizer" in ds:
        opt = ds["optimizer"]
        kind = opt.get("type", "?") if isinstance(opt, dict) else "?"
        where = f"DeepSpeed config {str(path)!r}" if path else "the inline DeepSpeed config"
        raise Violation(
            _DS_PATH,
            f"{where} has an 'optimizer' block ({kind}): qatlib builds the optimizer itself (AdamW with "
            "separate scale / LWC learning rates) and transformers would replace it and lose those groups; "
            "remove the block and set the learning rates in the experiment config",
        )
    return ds


# --------------------------------------------------------------------------------------------
# The experiment
# --------------------------------------------------------------------------------------------


class ExperimentConfig(Section):
    """A whole experiment: one upstream AngelSlim YAML (+ ``evaluation``), fully validated.

    Build it with `load_config` (from a file) or `parse_config` (from a dict); both run the
    cross-section rules below and resolve the QuantScheme, so an object that exists is runnable.
    """

    model: ModelConfig
    compression: CompressionConfig
    dataset: DatasetConfig | None = None
    global_: GlobalConfig = Field(default_factory=GlobalConfig, alias="global")
    evaluation: EvaluationConfig | None = None
    deploy: DeployConfig = Field(default_factory=DeployConfig)

    _source: str | None = PrivateAttr(None)
    _config_dir: Path | None = PrivateAttr(None)
    _scheme: QuantScheme | None = PrivateAttr(None)
    _ds_config: dict[str, Any] | None = PrivateAttr(None)
    _ds_path: Path | None = PrivateAttr(None)
    _ds_changed: bool = PrivateAttr(False)
    _raw: dict[str, Any] | None = PrivateAttr(None)

    # upstream feature key (SpinQuant rotations): refused when present
    transform: dict[str, Any] | None = None

    @field_validator("transform")
    @classmethod
    def _no_transform(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v:
            name = v.get("name", "?")
            raise upstream.unsupported(
                f"transform ({name}: weight rotations)", "remove the transform section"
            )
        return v

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
            self._scheme = build_quant_scheme(self.compression)
        except Violation as v:
            issues.append((v.path, v.message))

        try:
            self._ds_config, self._ds_path = _resolve_deepspeed(
                qat.hf_args.get("deepspeed"), self._config_dir
            )
            if self._ds_config is not None:
                # the file minus an all-auto optimizer block, plus qatlib's ZeRO-3 defaults (a whole
                # layer's experts per gather where they share a scale and train their weights)
                shared = self._scheme is not None and ties_across_experts(self.deploy.target, self._scheme)
                shared = shared and qc.weight_lr is not None
                effective = with_defaults(
                    _check_deepspeed(self._ds_config, self._ds_path), whole_layer_experts=shared
                )
                self._ds_changed = effective is not self._ds_config
                self._ds_config = effective
                if shared and local_model_is_moe(self.model.model_path) is not False:
                    if why_not := expert_leaf_issue(effective):
                        where = self._ds_path or "the inline DeepSpeed config"
                        issues.append((f"{P}.hf_args.deepspeed", f"{where}: {why_not}"))
        except Violation as v:
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
            if qat.training_mode != "end2end":
                issues.append(
                    (
                        f"{P}.training_mode",
                        f"{qat.training_mode} training is single-process (blockwise); not possible {why}",
                    )
                )
            if self.model.device_map is not None:
                issues.append(("model.device_map", f"must be None {why}: DeepSpeed places the shards"))
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
            inp = scheme.input
            # NVFP4's inputs are dynamic per group under a static per-tensor global scale: that one learns
            if qc.learnable.act_scale and (inp is None or (inp.dynamic and not inp.has_global_scale)):
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

            dtype = local_model_dtype(self.model.model_path, self.model.torch_dtype_name)
            issues += deploy_issues(self.deploy, scheme, local_model_is_moe(self.model.model_path), dtype)

        if self.smooth_alpha is not None and self.ptq_algorithm == "gptq":
            issues.append(
                (
                    "compression.quantization.quant_helpers",
                    "smooth runs before round-to-nearest calibration; GPTQ (int4_gptq) sets its own "
                    "weights (upstream skips the helper there too): remove 'smooth'",
                )
            )
        if qat.training_mode == "two_phase" and qat.resume_ckpt_dir:
            issues.append(
                (
                    f"{P}.resume_ckpt_dir",
                    "two_phase starts its end-to-end phase from its blockwise phase; resume a "
                    "two-phase run's second phase as an end2end experiment instead",
                )
            )
        if qat.training_mode == "blockwise" and self.loss_config().kd_enabled:
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
            raise issues_error(issues)
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
    def raw(self) -> dict[str, Any]:
        """The mapping this config was validated from (the YAML with its overrides applied, no
        defaults filled in): what `qatlib.plan` reads, so a stage script and the plan decide from
        the same keys (e.g. `qatlib.plan.streamed`). A copy: changing it changes nothing here."""
        return copy.deepcopy(self._raw if self._raw is not None else self.model_dump(by_alias=True))

    @property
    def deepspeed_config(self) -> dict[str, Any] | None:
        """The DeepSpeed config the run uses: ``hf_args.deepspeed``'s, with qatlib's ZeRO-3 defaults
        filled in (`qatlib.zero3.ds_config.with_defaults`), or None without DeepSpeed."""
        return self._ds_config

    @property
    def deepspeed_config_path(self) -> Path | None:
        """Absolute path of the DeepSpeed JSON (None when inline or absent)."""
        return self._ds_path

    @property
    def zero3_enabled(self) -> bool:
        """ZeRO-3 is on iff the DeepSpeed config has ``zero_optimization.stage == 3``."""
        return zero_stage(self._ds_config) == 3

    @property
    def ignore_layers(self) -> list[str]:
        """``compression.quantization.ignore_layers`` (``lm_head`` when the list is empty): the
        one list every stage that builds a prepared model uses, so their module trees match."""
        return list(self.quantization.ignore_layers) or ["lm_head"]

    # -- the runtime objects --------------------------------------------------------------------
    def quant_scheme(self) -> QuantScheme:
        """The `QuantScheme` this experiment trains / calibrates / exports (`qatlib.config.scheme`
        gives the resolution order). Resolved once at validation."""
        if self._scheme is None:  # only reachable for objects built bypassing validation
            try:
                self._scheme = build_quant_scheme(self.compression)
            except Violation as v:
                raise ConfigError(
                    format_issues([(v.path, v.message)], self._source), [(v.path, v.message)]
                ) from None
        return self._scheme

    def prepare_options(self) -> PrepareOptions:
        """`PrepareOptions` from ``compression.QAT.plugin_config.quant_config`` (init values, LWC,
        compiled fake quantization) and ``deploy`` (``target``: the scales that runtime merges are
        tied, `qatlib.runtime.tying.tie_for`; ``int8_gemm``: the int8 GEMM trained against), shared
        by PTQ, QAT, export and evaluation."""
        qc = self.qat.plugin_config.quant_config
        return PrepareOptions(
            weight_init_value=qc.weight_scale_init_value,
            act_init_value=qc.activation_scale_init_value,
            lwc_init=qc.lwc.lwc_init_value if qc.lwc.enable_lwc else None,
            compile_fake_quant=qc.compile_fake_quant,
            strict_ignore=self.quantization.strict_ignore_layers,
            deploy=tie_for(self.deploy.target),
            int8_gemm=self.deploy.int8_gemm,
        )

    def loss_config(self) -> LossConfig:
        """The QAT objective: `LossConfig` from ``compression.QAT``'s loss fields."""
        q = self.qat
        return LossConfig(
            loss_type=q.loss_type,
            loss_topk=q.loss_topk,
            kd_temperature=q.kd_temperature,
            kd_alpha=q.kd_alpha,
            lm_loss_weight=q.lm_loss_weight,
            kd_loss_weight=q.kd_loss_weight,
        )

    @property
    def scale_update(self) -> str:
        """How the optimizer moves the scales (`qatlib.trainers.log_scale`): ``quant_config.scale_update``,
        else upstream's meaning: ``log`` for FP4 weights (upstream learns their scale as a multiplier
        of the group max, ``max_scale`` at 1: an additive step on it is a relative step on the
        scale, angelslim/compressor/qat/modules/quantizer.py `_fake_quant_mxfp4` / `_nvfp4`), else
        ``additive`` (AdamW on the scale itself)."""
        explicit = self.qat.plugin_config.quant_config.scale_update
        if explicit is not None:
            return explicit
        w = self.quant_scheme().weight
        return "log" if w is not None and w.is_fp4 else "additive"

    def learnable(self) -> Learnable:
        """Which parameter groups train: `Learnable` from ``quant_config.learnable``."""
        return Learnable(**self.qat.plugin_config.quant_config.learnable.model_dump())

    def blockwise(self) -> BlockwiseSettings:
        """`BlockwiseSettings` from ``compression.QAT.block_wise_config``."""
        return BlockwiseSettings(**self.qat.block_wise_config.model_dump())

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
        if self._ds_changed:  # the file minus its optimizer block / plus qatlib's ZeRO-3 defaults
            args["deepspeed"] = copy.deepcopy(self._ds_config or {})
        elif self._ds_path is not None:
            args["deepspeed"] = str(self._ds_path)
        return args

    # -- upstream keys -------------------------------------------------------------------------
    @property
    def ptq_algorithm(self) -> str:
        """How PTQ sets the weights: ``rtn`` (round-to-nearest) or ``gptq`` (upstream ``int4_gptq``)."""
        name = self.quantization.name
        algo = resolve_name(name) if name is not None else None
        return algo.ptq if isinstance(algo, upstream.Algorithm) else "rtn"

    @property
    def smooth_alpha(self) -> float | None:
        """SmoothQuant's migration strength when ``quant_helpers`` has ``smooth`` (the PTQ stage
        smooths before calibrating: `qatlib.pipeline.run_ptq`), else None."""
        q = self.quantization
        return q.smooth_alpha if "smooth" in q.quant_helpers else None

    @property
    def ptq_saves_weights(self) -> bool:
        """Whether the PTQ checkpoint carries its own weights (GPTQ rounds them, SmoothQuant
        rescales them): every later stage loads the model from it, and a KD teacher is then
        ``model.model_path``'s model (`qatlib.trainers.end2end`)."""
        return self.ptq_algorithm == "gptq" or self.smooth_alpha is not None

    @property
    def export_format(self) -> str:
        """The export's checkpoint format (upstream ``quantization.save_name``)."""
        return self.quantization.save_name

    @property
    def strict_ignore_layers(self) -> bool:
        return self.quantization.strict_ignore_layers
