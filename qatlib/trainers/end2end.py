"""End-to-end QAT on the HF Trainer, single process or DeepSpeed ZeRO-3 (``torchrun``).

`QATTrainer` is a `transformers.Trainer` that

- owns its optimizer: AdamW over the tensors the ``learnable`` switches select
  (`qatlib.trainers.params`), scales at ``learning_rate``, LWC clip factors at ``lwc_lr``, norms
  at ``norm_lr``; everything else is frozen; with ``scale_update="log"`` the scales step in log
  space, ``learning_rate`` then being a relative step (`qatlib.trainers.log_scale`). Works under DeepSpeed (HF hands our optimizer to
  ``deepspeed.initialize``; a DeepSpeed config with its own ``optimizer`` section is refused,
  because transformers would silently replace ours and lose the groups);
- computes the QAT objective itself (`qatlib.losses.qat_loss`): LM cross-entropy plus an
  optional distillation term against a teacher that is, by default, the same model run inside
  `quantization_disabled` under ``torch.no_grad`` (no second copy). ``kd_loss_weight == 0`` (or
  ``loss_type: origin``) means no teacher forward at all;
- normalises by the number of valid tokens of the whole accumulated batch (HF's
  ``num_items_in_batch``, counted over the shifted labels and summed over ranks), so gradient
  accumulation and data parallelism give the mean over all valid tokens, not a mean of means;
- logs ``lm_loss``, ``kd/<loss_type>``, ``kd/forward_kl``, ``kd/backward_kl`` and ``total_loss``
  into the Trainer's log dict, token-weighted over each logging interval and summed over ranks,
  and appends one JSON line per logging step to ``<output_dir>/train_log.jsonl``.

One line of ``train_log.jsonl`` (rank 0 writes; a resumed run first drops the lines of steps it
will log again, so each step appears once)::

    {"step": 20, "loss": 2.08, "grad_norm": 0.41, "learning_rate": 1e-05,
     "lm_loss": 1.23, "kd/cakld": 0.0075, "kd/forward_kl": 0.0075, "kd/backward_kl": 0.0074,
     "total_loss": 1.24, "tokens": 81920, "epoch": 0.03}

``loss`` is the HF Trainer's (mean over the optimizer steps of the interval); the components are
means over every valid token of the interval on all ranks (``tokens``), so ``total_loss ==
lm_loss_weight * lm_loss + kd_loss_weight * kd/<loss_type>`` exactly. ``lm_loss`` appears only
with ``lm_loss_weight > 0``, the ``kd/*`` keys only when distillation is on.

`train_end2end` drives it from an `ExperimentConfig`: training arguments, data collator, lazy
activation-scale initialisation, resume (HF checkpoint or a ``fake`` save) and ``do_train``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from transformers import Seq2SeqTrainingArguments, Trainer, TrainerCallback, TrainingArguments

from ..checkpoint.layout import TRAIN_LOG_FILE
from ..data import PadCollator
from ..device import use_cpu
from ..losses import LossConfig, qat_loss
from ..quant import quantization_disabled
from ..quant.calibration import calibrate_activations, static_quantizers
from ..surgery.frozen_linear import use_frozen_head
from ..surgery.moe import recompute_experts_one_by_one
from ..zero3.io import PARTITION_BYTES, check_leaf_modules, model_is_zero3
from ..zero3.vocab_parallel import partition_vocab
from .guard import TrainingGuard
from .log_scale import install_log_space_steps
from .params import (
    Learnable,
    TrainableParams,
    apply_learnable,
    freeze_all_but,
    param_groups,
    select_trainable,
)
from .weight_units import WEIGHT_UPDATES, install_weight_unit_steps, weight_units

log = logging.getLogger(__name__)

LOG_FILE = TRAIN_LOG_FILE


def _dist_world() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def _vocab(model: nn.Module) -> int | None:
    """The width of the model's logits (its output embedding's rows; ZeRO-3 keeps ``out_features``)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return getattr(head, "out_features", None) or getattr(getattr(model, "config", None), "vocab_size", None)


def _check_teacher_vocab(teacher: nn.Module, model: nn.Module) -> None:
    """KD compares logits token by token: a teacher with another vocabulary would fail at the first
    step's loss with a shape error (or, padded alike, compare unrelated tokens). Refused here."""
    t, s = _vocab(teacher), _vocab(model)
    if t is not None and s is not None and t != s:
        raise ValueError(
            f"teacher vocabulary ({t} logits, teacher config vocab_size "
            f"{getattr(teacher.config, 'vocab_size', '?')}) differs from the student's ({s}, model.model_path's "
            "vocab_size): KD needs the same tokenizer; use a teacher of the same model family"
        )


class _PartitionedVocab(TrainerCallback):
    """`qatlib.zero3.vocab_parallel.partition_vocab` for the span of ``train()``: installed once the
    DeepSpeed engine exists (``on_train_begin`` comes after the Trainer wraps the model), the
    original modules put back at ``on_train_end``. ``swapped`` says which were."""

    def __init__(self, block_bytes: int | None, output_requires_grad: bool) -> None:
        self.block_bytes, self.output_requires_grad = block_bytes, output_requires_grad
        self.swapped: list[str] = []
        self._restore = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.block_bytes is None or model is None or self._restore or not model_is_zero3(model):
            return
        self.swapped, self._restore = partition_vocab(
            model, block_bytes=self.block_bytes, output_requires_grad=self.output_requires_grad
        )
        if self.swapped:
            log.info(
                "ZeRO-3: %s embeddings computed from the partitions (never gathered whole)", self.swapped
            )

    def on_train_end(self, args, state, control, **kwargs):
        if self._restore is not None:
            self._restore()
            self._restore = None


class QATTrainer(Trainer):
    """HF Trainer for QAT (see the module docstring).

    Keyword arguments beyond the Trainer's: ``loss_config`` (`LossConfig`), ``learnable``
    (`Learnable`, default weight scales only) or an explicit ``trainable`` selection, ``lwc_lr``,
    ``norm_lr``, ``weight_lr``, ``weight_update`` (``"additive"``, or ``"relative"``: ``weight_lr``
    in units of each weight tensor's size, `qatlib.trainers.weight_units`), ``scale_update``
    (``"additive"``, or ``"log"``: `qatlib.trainers.log_scale`), ``e8m0_scale_lr`` (MXFP4's E8M0 scales; None:
    `qatlib.trainers.log_scale.e8m0_lr` of ``learning_rate``), ``subgroup_lr`` (FOCUS's sub-group
    scale logits; None: ``learning_rate``), ``teacher`` (a separate teacher model; None = the model itself with quantization
    disabled), ``log_file`` (default ``<output_dir>/train_log.jsonl``; False = none),
    ``vocab_block_bytes`` (under ZeRO-3, an embedding / head above this many bytes is computed from
    the partitions a block of rows this large at a time, never gathered whole:
    `qatlib.zero3.vocab_parallel`; None = DeepSpeed gathers it).
    """

    def __init__(
        self,
        model: nn.Module,
        args: TrainingArguments,
        *,
        loss_config: LossConfig,
        learnable: Learnable | None = None,
        trainable: TrainableParams | None = None,
        lwc_lr: float | None = None,
        norm_lr: float | None = None,
        weight_lr: float | None = None,
        weight_update: str = "additive",
        scale_update: str = "additive",
        e8m0_scale_lr: float | None = None,
        subgroup_lr: float | None = None,
        teacher: nn.Module | None = None,
        log_file: str | os.PathLike | bool | None = None,
        vocab_block_bytes: int | None = PARTITION_BYTES,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("optimizers", (None, None))[0] is not None:
            raise ValueError(
                "QATTrainer builds its own optimizer from the learnable selection; do not pass optimizers"
            )
        _refuse_deepspeed_optimizer(args)
        if weight_update not in WEIGHT_UPDATES:
            raise ValueError(f"weight_update must be one of {WEIGHT_UPDATES}; got {weight_update!r}")
        if trainable is None:
            trainable = apply_learnable(model, learnable or Learnable())
        else:
            freeze_all_but(model, trainable)
        self.trainable = trainable
        if model_is_zero3(model):  # before DeepSpeed hooks the gradients (its engine is built in train)
            hf_ds = getattr(args, "hf_deepspeed_config", None)
            ds = hf_ds.config if hf_ds is not None else None
            check_leaf_modules(model, ds, weights_train=bool(trainable.weight))
        if use_frozen_head(model):  # the frozen head's input gradient, fast on AVX2-only CPUs
            log.info("output head: FrozenLinear (its input gradient in fp32 chunks on the CPU)")
        self.loss_config = loss_config
        self.lwc_lr = lwc_lr
        self.norm_lr = norm_lr
        self.weight_lr = weight_lr
        self.weight_update = weight_update
        self.scale_update = scale_update
        self.e8m0_scale_lr = e8m0_scale_lr
        self.subgroup_lr = subgroup_lr
        self.teacher = teacher
        if teacher is not None:
            _check_teacher_vocab(teacher, model)
            teacher.eval()
            teacher.requires_grad_(False)
        self.teacher_forwards = 0
        self.guard = TrainingGuard(model, [np for _, ps in trainable.items() for np in ps])
        checkpointing = getattr(args, "activation_checkpointing", None) or getattr(
            args, "gradient_checkpointing", False
        )
        self.vocab = _PartitionedVocab(vocab_block_bytes, output_requires_grad=bool(checkpointing))
        kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), self.guard, self.vocab]
        super().__init__(model=model, args=args, **kwargs)
        self.guard.trainer = self
        # We compute the loss ourselves from num_items_in_batch: make the Trainer count it (over the
        # shifted labels, as our loss does) and not divide our loss by the accumulation steps again.
        self.model_accepts_loss_kwargs = True
        self._loss_shifts_labels = True
        if teacher is not None and not any(hasattr(p, "ds_id") for p in teacher.parameters()):
            teacher.to(self.args.device)  # a plain teacher is replicated on every rank
        if checkpointing and hasattr(model, "enable_input_require_grads"):
            # Every model weight is frozen: without this, checkpointed blocks see inputs that do not
            # require grad and the scales get no gradient (upstream hit the same).
            model.enable_input_require_grads()
        ckpt_kwargs = getattr(args, "activation_checkpointing_kwargs", None) or getattr(
            args, "gradient_checkpointing_kwargs", None
        )
        reentrant = bool((ckpt_kwargs or {}).get("use_reentrant", False))  # transformers' default: False
        if checkpointing and not reentrant:
            # a layer's recompute no longer gathers all of its experts at once (its docstring)
            recompute_experts_one_by_one(model)
        self._acc_keys = loss_config.log_keys()
        self._acc = torch.zeros(len(self._acc_keys) + 1, dtype=torch.float64)
        if log_file is False:
            self.log_file = None
        else:
            self.log_file = Path(log_file) if log_file else Path(args.output_dir) / LOG_FILE
        self._log_file_started = False
        log.info("QAT trainable tensors %s (%d elements)", trainable.counts(), trainable.numel())

    # ------------------------------------------------------------------ optimizer
    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            units = None
            if self.weight_update == "relative" and self.trainable.weight:
                # collective under ZeRO-3 (one all-reduce): every rank builds its optimizer here
                units = weight_units([p for _, p in self.trainable.weight])
            groups = param_groups(
                self.trainable,
                lr=self.args.learning_rate,
                lwc_lr=self.lwc_lr,
                norm_lr=self.norm_lr,
                weight_lr=self.weight_lr,
                weight_decay=self.args.weight_decay,
                scale_update=self.scale_update,
                e8m0_scale_lr=self.e8m0_scale_lr,
                subgroup_lr=self.subgroup_lr,
                weight_units=units,
            )
            if not groups:
                raise ValueError("QAT optimizer has no trainable parameters")
            self.optimizer = install_weight_unit_steps(
                install_log_space_steps(
                    torch.optim.AdamW(
                        groups,
                        lr=self.args.learning_rate,
                        betas=(self.args.adam_beta1, self.args.adam_beta2),
                        eps=self.args.adam_epsilon,
                    )
                )
            )
            log.info(
                "QAT optimizer groups: %s",
                ", ".join(f"{g['name']}: {len(g['params'])} tensors @ lr {g['lr']:g}" for g in groups),
            )
        return self.optimizer

    # ------------------------------------------------------------------ loss
    @torch.no_grad()
    def teacher_logits(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """Teacher logits for ``inputs``: the separate teacher, or ``model`` unquantized."""
        self.teacher_forwards += 1
        if self.teacher is not None:
            return self.teacher(**inputs, use_cache=False).logits.detach()
        was_training = self.model.training
        with quantization_disabled(self.model):
            self.model.eval()  # no dropout in the teacher
            try:
                out = model(**inputs, use_cache=False)
            finally:
                self.model.train(was_training)
        return out.logits.detach()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        cfg = self.loss_config
        labels = inputs["labels"]
        fwd = {k: v for k, v in inputs.items() if k != "labels"}
        t_logits = self.teacher_logits(model, fwd) if cfg.kd_enabled else None
        outputs = model(**fwd, use_cache=False)
        denom = None
        if num_items_in_batch is not None:
            denom = num_items_in_batch.item() if torch.is_tensor(num_items_in_batch) else num_items_in_batch
            denom = max(float(denom), 1.0)
        out = qat_loss(outputs.logits, labels, cfg, t_logits, denominator=denom)
        loss = out.loss
        if model.training:  # every rank, every micro-batch: a NaN stops all ranks here, named
            self.guard.check_loss(loss, self.state.global_step + 1, fwd)
        if denom is not None and self.args.average_tokens_across_devices:
            # num_items_in_batch counts every rank's tokens, and data-parallel backends average
            # gradients over ranks: scale back up, exactly as the HF Trainer does.
            loss = loss * self.accelerator.num_processes
        # Our loss is normalised over the accumulated batch iff we got its token count.
        self.loss_is_scaled_for_ga = denom is not None
        if model.training:
            vals = [out.sums.get(k, 0.0) for k in self._acc_keys] + [float(out.n_tokens)]
            self._acc += torch.tensor(vals, dtype=torch.float64)
        return (loss, outputs) if return_outputs else loss

    # ------------------------------------------------------------------ logging
    def _interval_components(self) -> dict[str, float]:
        acc = self._acc.clone()
        self._acc.zero_()
        if _dist_world() > 1:
            t = acc.to(self.args.device)
            torch.distributed.all_reduce(t)
            acc = t.cpu()
        n = acc[-1].item()
        if n <= 0:
            return {}
        out = {k: acc[i].item() / n for i, k in enumerate(self._acc_keys)}
        out["tokens"] = int(n)
        return out

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        training_log = "loss" in logs and not any(k.startswith("eval_") for k in logs)
        if training_log:
            logs.update(self._interval_components())
        super().log(logs, start_time)
        if training_log and self.log_file is not None and self.is_world_process_zero():
            self._append_log_line({"step": self.state.global_step, **logs})

    def _append_log_line(self, rec: dict[str, Any]) -> None:
        path = self.log_file
        path.parent.mkdir(parents=True, exist_ok=True)
        if not self._log_file_started:
            # A resumed run re-logs the steps after its checkpoint: drop those (and, for a fresh run
            # into an old output_dir, everything) so the file has one line per logging step.
            keep = []
            if path.exists():
                for line in path.read_text().splitlines():
                    with contextlib.suppress(ValueError):
                        if json.loads(line).get("step", math.inf) < rec["step"]:
                            keep.append(line)
            path.write_text("".join(line + "\n" for line in keep))
            self._log_file_started = True
        with path.open("a") as f:
            f.write(json.dumps(rec, default=float) + "\n")


def _refuse_deepspeed_optimizer(args: TrainingArguments) -> None:
    ds = getattr(args, "hf_deepspeed_config", None)
    cfg = getattr(ds, "config", None) if ds is not None else None
    if cfg is None and isinstance(args.deepspeed, dict):
        cfg = args.deepspeed
    if isinstance(cfg, dict) and "optimizer" in cfg:
        raise ValueError(
            "the DeepSpeed config has an 'optimizer' section: transformers would replace the QAT optimizer "
            "(and its scale / LWC / norm groups) with it. Remove it; QAT builds AdamW itself."
        )


def read_log(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The JSON-lines training log (one dict per logging step)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# --------------------------------------------------------------------------- lazy init
def lazy_init_activation_scales(
    model: nn.Module,
    dataset: Dataset,
    collator,
    *,
    num_samples: int,
    batch_size: int = 1,
) -> int:
    """Calibrate static activation scales on the first ``num_samples`` training samples (upstream's
    ``lazy_init_samples``), when no PTQ checkpoint provided them. Non-ZeRO only. Returns the
    number of batches seen (0 when the scheme has no static activation quantizer)."""
    if not static_quantizers(model):
        return 0
    n = min(num_samples, len(dataset))
    loader = DataLoader(
        torch.utils.data.Subset(dataset, range(n)), batch_size=batch_size, collate_fn=collator
    )
    report = calibrate_activations(model, loader)
    log.info("lazy activation-scale init on %d batches (%d tokens)", report.num_batches, report.num_tokens)
    return report.num_batches


# --------------------------------------------------------------------------- config driver
def training_arguments(cfg, **overrides: Any) -> Seq2SeqTrainingArguments:
    """``Seq2SeqTrainingArguments`` from ``cfg.hf_training_args()`` (output_dir, seed, DeepSpeed
    path resolved there) plus ``overrides``. On `qatlib.device`'s CPU path ``use_cpu`` defaults to True (DeepSpeed on
    the CPU needs it); ``report_to`` defaults to none."""
    kw = dict(cfg.hf_training_args()) if hasattr(cfg, "hf_training_args") else dict(cfg)
    kw.update(overrides)
    if use_cpu():
        kw.setdefault("use_cpu", True)
    kw.setdefault("report_to", "none")
    return Seq2SeqTrainingArguments(**kw)


def base_model_teacher(cfg, zero3=None) -> nn.Module:
    """The unquantized original model (``model.model_path``) as a separate KD teacher.

    Needed when the student's weights are not the original's: trained in this run
    (``quant_config.weight_lr``) or resumed from a run that trained them (a blockwise phase with
    ``weight_lr > 0``). The default teacher, the student with its quantizers off, would then be
    those trained weights, which are fitted to be good only after quantization, not to match the
    original model unquantized: the run would distil toward a moving target (#12: end-to-end after
    blockwise lost most of blockwise's gain).

    One process: a plain second copy. ZeRO-3 (``zero3``, the run's `Zero3Context`): built empty and
    partitioned and streamed in like the student (`qatlib.zero3.load.load_model`), then wrapped in
    an inference-only DeepSpeed engine (no optimizer), which gathers each layer's weights for its
    forward as the training engine does: the teacher costs each rank M / world more, not M."""
    from ..models import load_model, resolve_model_dir

    if getattr(cfg, "zero3_enabled", False) and zero3 is None:
        raise ValueError(
            "a separate KD teacher under ZeRO-3 is built partitioned: pass the run's Zero3Context "
            "(train_end2end(..., zero3_ctx=ctx))"
        )
    m = cfg.model
    path = resolve_model_dir(m.model_path, cache_dir=m.cache_dir)
    if zero3 is None:
        return load_model(path, torch_dtype=m.torch_dtype, trust_remote_code=m.trust_remote_code)
    import deepspeed

    from ..zero3.io import inference_ds_config

    teacher = load_model(path, torch_dtype=m.torch_dtype, trust_remote_code=m.trust_remote_code, zero3=zero3)
    engine, *_ = deepspeed.initialize(model=teacher, config=inference_ds_config(zero3))
    engine.eval()
    return engine


def train_end2end(
    cfg,
    model: nn.Module,
    tokenizer,
    train_dataset: Dataset,
    *,
    teacher: nn.Module | None = None,
    scales_loaded: bool = False,
    args_overrides: dict[str, Any] | None = None,
    callbacks: Sequence[Any] | None = None,
    scheme=None,
    zero3_ctx=None,
) -> QATTrainer:
    """Run end-to-end QAT as ``cfg`` says, on a prepared model (QuantLinear layers in place).

    ``scales_loaded``: the scales came from a PTQ checkpoint (``from_ptq_ckpt``), so no lazy
    activation init. ``quant_config.weight_lr``: the linear weights train too, at that rate, and
    the KD teacher is the original model (`base_model_teacher`; under ZeRO-3 ``zero3_ctx``, the run's
    `Zero3Context`, is then needed to build it partitioned). ``compression.QAT.resume_ckpt_dir`` may name an HF checkpoint (a
    ``checkpoint-N`` folder, or an output dir holding them: the last one is used) or a saved model
    with scales (a ``fake`` export or a consolidated save, `qatlib.resume.load_saved_model`); when
    that save's weights were trained, the KD teacher is the original model (`base_model_teacher`).
    Returns the trainer (trained when ``do_train``).
    """
    from ..checkpoint.layout import weights_dir
    from ..resume import check_resume_world_size, classify_resume_dir, load_saved_model

    qat = cfg.qat
    qc = qat.plugin_config.quant_config
    loss_cfg = cfg.loss_config()
    args = training_arguments(cfg, **(args_overrides or {}))
    collator = PadCollator.for_tokenizer(tokenizer)
    zero3 = bool(getattr(cfg, "zero3_enabled", False))

    resume_from = None
    if qat.resume_ckpt_dir:
        kind, path = classify_resume_dir(qat.resume_ckpt_dir)
        if kind == "hf":
            check_resume_world_size(path, args.world_size)
            resume_from = str(path)
        else:
            rep = load_saved_model(model, path, scheme)
            scales_loaded = True
            if loss_cfg.kd_enabled and not rep["kept_base_weights"] and teacher is None:
                teacher = base_model_teacher(cfg, zero3_ctx)
                log.info(
                    "resume_ckpt_dir %s holds trained weights (e.g. a blockwise phase): the KD "
                    "teacher is the original model from model.model_path, loaded separately",
                    path,
                )
    if not scales_loaded and resume_from is None:
        if zero3:
            raise ValueError(
                "under ZeRO-3 activation scales come from compression.QAT.from_ptq_ckpt (no lazy init)"
            )
        lazy_init_activation_scales(
            model,
            train_dataset,
            collator,
            num_samples=qc.lazy_init_samples,
            batch_size=args.per_device_train_batch_size,
        )
    if (
        scales_loaded
        and qat.from_ptq_ckpt
        and loss_cfg.kd_enabled
        and teacher is None
        and weights_dir(qat.from_ptq_ckpt)
    ):
        # the student starts from the PTQ checkpoint's own weights (GPTQ, `models.load_prepared`):
        # with its quantizers off it is GPTQ's model, not the original one the KD must aim at
        teacher = base_model_teacher(cfg, zero3_ctx)
        log.info(
            "%s carries its own weights (GPTQ): the KD teacher is model.model_path's model", qat.from_ptq_ckpt
        )
    learnable = cfg.learnable()
    pick: dict[str, Any] = {"learnable": learnable}
    if qc.weight_lr:
        pick = {
            "trainable": select_trainable(model, learnable, weights=True),
            "weight_lr": qc.weight_lr,
            "weight_update": qc.weight_update,
        }
    # trained weights or norms change the model with its quantizers off too: that is no longer the
    # original model, so it cannot be the teacher (it would drift with the student)
    if (qc.weight_lr or learnable.norm) and loss_cfg.kd_enabled and teacher is None:
        teacher = base_model_teacher(cfg, zero3_ctx)
        what = "weights" if qc.weight_lr else "norms"
        log.info("the %s train: the KD teacher is model.model_path's model, a separate copy", what)
    trainer = QATTrainer(
        model,
        args,
        loss_config=loss_cfg,
        **pick,
        lwc_lr=qc.lwc.lwc_lr if qc.lwc.enable_lwc else None,
        scale_update=cfg.scale_update,
        e8m0_scale_lr=qc.e8m0_scale_lr,
        subgroup_lr=qc.learnable.quant_max_scale_lr,
        teacher=teacher,
        train_dataset=train_dataset,
        data_collator=collator,
        processing_class=tokenizer,
        callbacks=list(callbacks or []),
    )
    if qat.do_train:
        if zero3:
            from ..zero3 import heap

            log.info("heap during training: %s", heap.configure_training(model, args.device.type))
        if qc.frozen_codes:  # before train(): a resumed run's codes are the start's, not the checkpoint's
            from ..quant.codes import freeze_codes, release_codes
            from ..zero3.io import gathered_param_if_zero3 as gather

            log.info("frozen codes: %d weight quantizers", freeze_codes(model, gather))
        trainer.train(resume_from_checkpoint=resume_from)
        if qc.frozen_codes:
            release_codes(model, gather)  # the weights become codes * trained scale: what save / export see
    return trainer
