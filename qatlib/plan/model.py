"""The plan's inputs: a model's sizes (`qatlib.plan.shape`, from config.json), the experiment
values the plan reads, and the terms / stage results it returns (dataclasses, no torch)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from qatlib.patterns import matches_any
from qatlib.yamlio import section
from qatlib.zero3.ds_config import gathers_whole_layers

from .shape import ModelShape, PlanError  # noqa: F401 (the plan's model sizes, re-exported)

DTYPE_BYTES = {
    "bf16": 2,
    "bfloat16": 2,
    "fp16": 2,
    "float16": 2,
    "half": 2,
    "fp32": 4,
    "float32": 4,
    "float": 4,
}


@dataclass(frozen=True)
class WeightFormat:
    """How a quantized weight is stored: code bits and the elements that share one scale."""

    bits: int
    granularity: str = "tensor"  # tensor | channel | group
    group_size: int = 0
    subgroups: int = 0  # FOCUS's learned sub-group scales per group (QuantSpec.subgroups)

    def scales(self, out: int, inp: int) -> int:
        """The trainable quantizer elements of an ``[out, inp]`` weight (sub-group logits included)."""
        if self.granularity == "group":
            return out * math.ceil(inp / self.group_size) * (1 + self.subgroups)
        return out if self.granularity == "channel" else 1


@dataclass(frozen=True)
class PlanInputs:
    """What the plan reads from an experiment (`from_experiment`): every value here comes from the
    YAML through `qatlib.config`'s field names and defaults (checked in tests/test_plan.py)."""

    dtype_bytes: int = 2
    seq_len: int = 2048
    micro_batch: int = 8  # transformers' per_device_train_batch_size default
    grad_ckpt: bool = False
    ckpt_reentrant: bool = False  # use_reentrant in the checkpointing kwargs (transformers' default: False)
    kd: bool = True
    train_samples: int = 256
    epochs: float = 1.0
    max_steps: int = -1
    calib: bool = True  # static activation scales: PTQ runs calibration batches
    calib_samples: int = 256
    calib_batch: int = 1
    gptq: bool = False
    smooth: bool = False  # quant_helpers: [smooth]: PTQ changes the weights on the loaded model
    ptq_streamed: bool = True  # `streamed(raw, "ptq_calibrate")`: scripts/ptq.py streams by default
    eval_seq: int = 2048
    eval_batch: int = 1
    weight: WeightFormat = field(default_factory=lambda: WeightFormat(8))
    act_quant: bool = True
    train_scales: bool = True
    train_weights: bool = False  # quant_config.weight_lr: the weights train (their optimizer state)
    # trained weights or norms: the KD teacher is the original model, a second (partitioned) copy
    separate_teacher: bool = False
    zero3: bool = True
    blockwise: bool = False
    offload_optimizer: bool = False
    offload_param: bool = False
    persistence_threshold: int | None = None  # None: DeepSpeed "auto" (10 x hidden)
    model_persistence: int | None = None  # stage3_model_persistence_threshold; None: no cap
    prefetch: int | None = None  # stage3_prefetch_bucket_size; None: "auto" (0.9 x hidden^2)
    # one expert gathers at a time, not a whole layer's experts: qatlib's default leaf module
    # (`qatlib.zero3.ds_config`), unless the DeepSpeed JSON lists a whole-layer class itself
    expert_leaf: bool = True
    eager_attention: bool = False
    eval_sources: int = 1  # evaluation.ppl + evaluation.tasks
    eval_limit: int | None = None


@dataclass
class Term:
    name: str
    bytes: int
    note: str = ""


@dataclass
class StagePlan:
    """One stage's prediction. ``host`` is ONE rank's host RAM (every rank of the node holds it),
    ``node`` what one rank holds on top (rank 0's save buffer); a node's host RAM is
    ``ranks_per_node x host + node``."""

    stage: str
    ranks_per_node: int
    device: list[Term]  # one rank (empty: a CPU stage or a CPU run)
    host: list[Term]  # one rank
    node: list[Term]  # rank 0, once per node
    device_capacity: int
    host_capacity: int  # one node
    runtime_min: int
    notes: list[str] = field(default_factory=list)
    # terms of the model the plan could not compute (`ModelShape.not_computed`): counted as zero
    # (top-k: every expert), so the stage's figures are a lower bound by that much
    not_computed: list[str] = field(default_factory=list)

    @property
    def device_peak(self) -> int:
        return sum(t.bytes for t in self.device)

    @property
    def host_per_rank(self) -> int:
        return sum(t.bytes for t in self.host)

    @property
    def host_rank0(self) -> int:
        return self.host_per_rank + sum(t.bytes for t in self.node)

    @property
    def host_peak(self) -> int:
        """One node's host RAM."""
        return self.ranks_per_node * self.host_per_rank + sum(t.bytes for t in self.node)

    @property
    def fits(self) -> bool:
        return self.device_peak <= self.device_capacity and self.host_peak <= self.host_capacity

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            device_peak=self.device_peak,
            host_per_rank=self.host_per_rank,
            host_rank0=self.host_rank0,
            host_peak=self.host_peak,
            fits=self.fits,
        )
        return d


# ----------------------------------------------------------------------------- experiment -> inputs
def _weight_format(quant: dict[str, Any], plugin_weight: dict[str, Any] | None = None) -> WeightFormat:
    """Code bits and scale granularity of the weights, from ``compression.quantization`` as
    `qatlib.config.scheme` resolves it (a torch-free mirror; tests compare it with
    ``ExperimentConfig.quant_scheme()`` for every experiment file); ``plugin_weight``
    (``quant_config.weight``): an FP4 qtype there (upstream FOCUS) and its sub-group scales."""
    name = str(quant.get("name") or f"int{quant.get('bits', 8)}").lower()
    method = quant.get("quant_method") or {}
    gran = str(method.get("weight") or "").replace("per-", "")
    gs = method.get("group_size") or quant.get("group_size")
    pw = plugin_weight or {}
    if "fp4" in str(pw.get("qtype") or ""):
        name, gs = str(pw["qtype"]), pw.get("group_size") or gs
    if "fp4" in name:
        sub = int(pw.get("num_sub") or 4) if pw.get("use_subgroup_scale") else 0  # upstream's default 4
        return WeightFormat(4, "group", gs or (16 if "nvfp4" in name else 32), sub)
    bits = 8 if "fp8" in name and "w4" not in name else 4 if ("int4" in name or "w4" in name) else 8
    if name.startswith("int") and name[3:4].isdigit():
        bits = int(name[3])
    gran = gran or ("group" if bits == 4 else "tensor" if "fp8" in name else "channel")
    return WeightFormat(bits, gran, int(gs or 128) if gran == "group" else 0)


STREAMED_STAGES = ("ptq_calibrate", "convert_export")
HEAD = "lm_head"  # the output head's module name (Llama / Qwen families)


# presets whose input is quantized per token at run time (`qatlib.quant.spec.PRESETS`: int8 and its
# alias w8a8); tests/test_plan.py holds the two readings equal for every shipped experiment
DYNAMIC_INPUT_PRESETS = ("int8", "w8a8")


def _static_input(raw: dict[str, Any]) -> bool:
    """A static input (activation) scale on every quantized linear, as `qatlib.config.scheme`
    resolves ``compression.quantization`` (tests/test_plan.py checks it for every experiment)."""
    qc = section(raw, "compression.QAT.plugin_config.quant_config") or {}
    name = str(section(raw, "compression.quantization.name") or "")
    use_act = bool(qc.get("use_activation_quant", True)) and "weight_only" not in name
    # MXFP4 inputs: an E8M0 scale per 32 from each input, nothing static (NVFP4 keeps a static
    # per-tensor input global scale, which PTQ calibrates)
    act = qc.get("activation") or {}
    qtype = str(act.get("qtype") or name)
    # dynamic: as the YAML sets it, else the preset's (fp8_dynamic; int8 / w8a8: per-token dynamic)
    dynamic = bool(act["dynamic"]) if "dynamic" in act else "dynamic" in name or name in DYNAMIC_INPUT_PRESETS
    return use_act and not dynamic and "mxfp4" not in qtype


def _gptq(raw: dict[str, Any]) -> bool:
    """PTQ by GPTQ (upstream's ``int4_gptq``; `qatlib.config.ExperimentConfig.ptq_algorithm`)."""
    return "gptq" in str(section(raw, "compression.quantization.name") or "").lower()


def _smooth(raw: dict[str, Any]) -> bool:
    """SmoothQuant before PTQ (`qatlib.config.ExperimentConfig.smooth_alpha`)."""
    return "smooth" in (section(raw, "compression.quantization.quant_helpers") or [])


def streamed(raw: dict[str, Any], stage: str) -> bool:
    """Whether ``stage`` runs streamed, one decoder layer at a time, for the experiment ``raw``
    (raw, validated config: `ExperimentConfig.raw`). The one owner of that choice: scripts/ptq.py
    and scripts/export.py stream by default exactly when this is true (``--whole-model`` opts
    out), whoever calls them (the workflow's rules pass no flag), and the plan
    (`from_experiment`, `qatlib.plan.stages`) and the DAG's resources model the stage that runs.

    ``convert_export``: always. The streamed export (`qatlib.export.stream`) writes
    the same tensors as the in-memory export for every ``save_format`` (real, fake,
    real_and_kvcache, save_kvcache_only), dense and MoE, tied embeddings included (the same bytes
    for a model within one 5 GiB shard; tests/test_export.py, tests/test_workflow.py).

    ``ptq_calibrate``: streamed (`qatlib.ptq.calibrate_from_checkpoint`:
    the same scales bit for bit, tests/test_ptq.py), except
      - GPTQ: it changes the weights, so it runs on the loaded model;
      - a static input scale on the output head (a static-activation format with ``lm_head`` not
        in ``ignore_layers``): the streamed calibration runs the decoder layers only and refuses
        it (`qatlib.ptq.calibrate_layerwise`); the whole-model forward calibrates it.
    Other stages: never (``evaluate --layerwise`` is the evaluation's own choice).
    `not_streamed` says why a stage is not.
    """
    return not_streamed(raw, stage) is None


def not_streamed(raw: dict[str, Any], stage: str) -> str | None:
    """Why ``stage`` does not run streamed for the experiment ``raw`` (None: it does; `streamed`
    has the rules). What a stage asked for streaming (upstream's ``low_memory: true``) and cannot
    have says, before any work (`qatlib.pipeline.run_ptq`)."""
    if stage == "convert_export":
        return None
    if stage != "ptq_calibrate":
        return f"{stage} runs on the whole model"
    if _gptq(raw):
        return (
            "GPTQ changes the weights, each layer's from the outputs of the layers it already rounded, so it "
            "runs on the loaded model (one decoder layer on the device at a time), not from the shards"
        )
    if _smooth(raw):
        return (
            "quant_helpers: [smooth] changes the weights (SmoothQuant folds each norm's factors into the "
            "linears that read it) on the loaded model before calibrating, and saves them"
        )
    ignore = list(section(raw, "compression.quantization.ignore_layers") or []) or [HEAD]
    if _static_input(raw) and not matches_any(HEAD, ignore):
        return (
            f"a static input scale on {HEAD} (not in ignore_layers): the streamed calibration runs the decoder "
            "layers only; the head's input is calibrated by the whole model's forward"
        )
    return None


# `qatlib.trainers.blockwise.BlockwiseSettings.weight_lr`'s default (not imported: the plan runs
# without torch; tests/test_plan.py checks the equality)
BW_WEIGHT_LR = 1e-3


def from_experiment(
    raw: dict[str, Any], ds: dict[str, Any] | None, model_dtype: str | None = None
) -> PlanInputs:
    """`PlanInputs` of an experiment's raw (validated) config and its DeepSpeed config content
    (``model_dtype``: config.json's ``torch_dtype``, for ``torch_dtype: auto``).
    Defaults are `qatlib.config.sections`' (tests/test_plan.py checks the equality)."""
    g = lambda key, default=None: v if (v := section(raw, key)) is not None else default  # noqa: E731
    hf = g("compression.QAT.hf_args", {}) or {}
    qc = g("compression.QAT.plugin_config.quant_config", {}) or {}
    learn = qc.get("learnable") or {}
    quant = g("compression.quantization", {}) or {}
    dtype = str(g("model.torch_dtype", "auto")).lower()
    if dtype == "auto":  # the checkpoint's own dtype (config.json), as transformers loads it
        dtype = str(model_dtype or "bf16").lower()
    loss, kd_w = str(g("compression.QAT.loss_type", "origin")), float(g("compression.QAT.kd_loss_weight", 0))
    use_act = bool(qc.get("use_activation_quant", True)) and "weight_only" not in str(quant.get("name", ""))
    zo = section(ds, "zero_optimization") or {}
    threshold = zo.get("stage3_param_persistence_threshold")
    mode = g("compression.QAT.training_mode", "end2end")
    return PlanInputs(
        dtype_bytes=DTYPE_BYTES.get(dtype, 2),
        seq_len=int(g("dataset.max_seq_length", 2048)),
        micro_batch=int(hf.get("per_device_train_batch_size", 8)),
        # transformers 5: activation_checkpointing; gradient_checkpointing its deprecated alias
        grad_ckpt=bool(hf.get("activation_checkpointing", hf.get("gradient_checkpointing")) or False),
        ckpt_reentrant=bool(
            (hf.get("activation_checkpointing_kwargs") or hf.get("gradient_checkpointing_kwargs") or {}).get(
                "use_reentrant", False
            )
        ),
        kd=loss != "origin" and kd_w > 0,
        train_samples=int(g("dataset.num_samples", 256)),
        epochs=float(hf.get("num_train_epochs", 3.0)),
        max_steps=int(hf.get("max_steps", -1)),
        calib=_static_input(raw),
        calib_samples=int(g("dataset.num_samples", 256)),
        calib_batch=int(g("dataset.batch_size", 1)),
        gptq=_gptq(raw),
        smooth=_smooth(raw),
        ptq_streamed=streamed(raw, "ptq_calibrate"),
        eval_seq=int(g("evaluation.max_seq_length", 2048)),
        eval_batch=int(g("evaluation.batch_size", 1)),
        weight=_weight_format(quant, qc.get("weight")),
        act_quant=use_act,
        train_scales=bool(learn.get("weight_scale", True)) or bool(learn.get("act_scale", False)),
        train_weights=bool(qc.get("weight_lr")),
        # two_phase: a phase 1 that trained the weights (`qatlib.trainers.two_phase`) too
        separate_teacher=bool(qc.get("weight_lr"))
        or bool(learn.get("norm", False))
        # a PTQ checkpoint with its own weights (GPTQ, SmoothQuant): KD aims at model.model_path's
        # model (`qatlib.trainers.end2end`), loaded beside the student
        or (loss != "origin" and kd_w > 0 and (_gptq(raw) or _smooth(raw)))
        or (
            mode == "two_phase" and float(g("compression.QAT.block_wise_config.weight_lr", BW_WEIGHT_LR)) > 0
        ),
        zero3=section(ds, "zero_optimization.stage") == 3,
        blockwise=mode != "end2end",  # blockwise or two_phase: one process
        offload_optimizer=str(section(zo, "offload_optimizer.device") or "none") == "cpu",
        offload_param=str(section(zo, "offload_param.device") or "none") == "cpu",
        persistence_threshold=int(threshold) if isinstance(threshold, int | float) else None,
        model_persistence=int(cap)
        if isinstance(cap := zo.get("stage3_model_persistence_threshold"), int | float)
        else None,
        prefetch=int(pf) if isinstance(pf := zo.get("stage3_prefetch_bucket_size"), int | float) else None,
        expert_leaf=not gathers_whole_layers(ds),
        eager_attention=g("model.attn_implementation") == "eager",
        eval_sources=len(g("evaluation.ppl", []) or []) + len(g("evaluation.tasks", []) or []),
        eval_limit=g("evaluation.limit"),
    )
