"""The quality lab: one base model, its data and evaluator, and the quantization methods as
one-liners, each a call of qatlib's verb. `benchmarks.quality`, `benchmarks.quality_default` and
`benchmarks.deployed` measure with it; nothing here decides what a row is.

- ``rtn``: `qatlib.ptq.calibrate`; ``gptq``: `qatlib.ptq.gptq.gptq`;
- ``qat``: end-to-end QAT with the single-process HF trainer (`qatlib.trainers.end2end.QATTrainer`),
  warm-started from RTN (or any prepared model), the loss `qatlib.losses`;
- ``blockwise``: `qatlib.trainers.blockwise.BlockwiseTrainer`;
- ``deployed``: the real export (`qatlib.export.export`) loaded as the runtime deploys it
  (`qatlib.eval.variants.load_deployed`, `qatlib.runtime.emulate`);
- evaluation: perplexity of fixed test windows (`qatlib.eval.perplexity.perplexity_of_ids`,
  per-window NLLs kept so every difference gets a paired standard error) and the local
  multiple-choice task (`qatlib.eval.harness`);
- recovery ``(PTQ - QAT) / (PTQ - BF16)`` with its paired standard error and noise flag:
  `qatlib.report.metrics.recovery`, the report's definition.

"BF16" is the unquantized model; on the CPU it is evaluated in fp32, as the workflow does.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from qatlib.report.metrics import MIN_REL_GAP, recovery

from .common import FOCUS, IGNORE, load_base, rounded
from .lab_inputs import MC_TASK, QualitySettings, resolve_inputs

DEPLOY_TARGET = "vllm"  # the runtime the deployed rows are emulated for (`qatlib.runtime.facts.TARGETS`)


class Evaluator:
    """Perplexity on fixed test windows (per-window NLL kept) and the local MC task."""

    def __init__(
        self, tokenizer, test_text: str, s: QualitySettings, mc_task: str | None, hf_home: Path
    ) -> None:
        from qatlib.eval.perplexity import make_windows, tokenize_text

        self.tok = tokenizer
        self.ids = tokenize_text(tokenizer, test_text)
        self.windows = make_windows(self.ids, s.seq_len, s.eval_windows)
        self.s = s
        self.mc_task = mc_task
        self.hf_home = hf_home

    def __call__(self, model, *, mc: bool = True) -> dict[str, Any]:
        """``ppl`` / ``nll`` of the test windows (`qatlib.eval.perplexity.perplexity_of_ids`), the
        summed NLL of each window as ``_nll`` and, with ``mc``, the MC task's accuracy."""
        from qatlib.eval.perplexity import perplexity_of_ids

        t0 = time.perf_counter()
        r = perplexity_of_ids(
            model,
            self.ids,
            seq_len=self.s.seq_len,
            batch_size=self.s.eval_batch,
            limit=self.s.eval_windows,
            progress=False,
        )
        # qatlib returns each window's fp32 NLL sum divided by its tokens; times the tokens,
        # rounded to fp32, that is the sum again exactly (the float64 product is within 2^-52 of
        # it, fp32's spacing is 2^-24): the paired statistics see the same numbers as before
        tpw = self.windows.shape[1] - 1
        nll = (torch.tensor(r["window_nll"], dtype=torch.float64) * tpw).float().double()
        tokens = self.windows.shape[0] * tpw
        rec: dict[str, Any] = {
            "ppl": math.exp(nll.sum().item() / tokens),
            "nll": nll.sum().item() / tokens,
            "windows": int(self.windows.shape[0]),
            "tokens": int(tokens),
            "_nll": nll,
            "_qatlib_ppl": r["ppl"],  # qatlib's own total: `benchmarks.quality`'s eval_check
        }
        if mc and self.mc_task is not None:
            try:
                rec.update(self.mc(model))
            except Exception as e:  # recorded; the perplexity stands on its own
                traceback.print_exc()
                rec["mc_error"] = f"{type(e).__name__}: {e}"
        rec["eval_s"] = round(time.perf_counter() - t0, 2)
        return rec

    def mc(self, model) -> dict[str, Any]:
        from qatlib.eval.harness import evaluate_tasks

        with _quiet():
            r = evaluate_tasks(
                model,
                self.tok,
                [MC_TASK],
                include_path=self.mc_task,
                hf_home=self.hf_home,
                limit=self.s.mc_limit,
                batch_size=self.s.eval_batch,
            )[MC_TASK]
        return {
            "mc_acc": r.get("acc"),
            "mc_acc_stderr": r.get("acc_stderr"),
            "mc_acc_norm": r.get("acc_norm"),
        }


@contextlib.contextmanager
def _quiet():
    """Silence lm-eval's / transformers' INFO logging and progress bars for one call."""
    names = ("lm_eval", "lm-eval", "transformers", "datasets")
    old = {n: logging.getLogger(n).level for n in names}
    env = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"
    for n in names:
        logging.getLogger(n).setLevel(logging.WARNING)
    try:
        yield
    finally:
        for n, lv in old.items():
            logging.getLogger(n).setLevel(lv)
        if env is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = env


def paired(a: torch.Tensor, b: torch.Tensor, tokens_per_window: int) -> tuple[float, float]:
    """Mean per-token NLL difference ``a - b`` and its paired standard error (over windows)."""
    d = (a - b) / tokens_per_window
    return d.mean().item(), (d.std(unbiased=True).item() / math.sqrt(len(d)) if len(d) > 1 else float("nan"))


def recovery_record(bf16: dict, ptq: dict, qat: dict) -> dict[str, Any]:
    """``(PTQ - QAT) / (PTQ - BF16)`` in perplexity, its paired standard error over the test windows
    (per-window NLLs) and the noise flag: `qatlib.report.metrics.recovery`, the report's definition.
    The figures are `benchmarks.common.rounded`: recorded to 4 digits, compared by `target` unrounded."""
    rv = recovery(
        bf16["ppl"],
        ptq["ppl"],
        qat["ppl"],
        min_gap=MIN_REL_GAP * bf16["ppl"],
        nll=(bf16["_nll"], ptq["_nll"], qat["_nll"]),
    )
    return {
        "recovery": rounded(rv.value),
        "recovery_se": rounded(rv.se),
        "ptq_rel_gap": rounded((ptq["ppl"] - bf16["ppl"]) / bf16["ppl"], 5),
        "noise": rv.noise,
    }


def loss_recovery_record(bf16: dict, ptq: dict, qat: dict) -> dict[str, Any]:
    """``(PTQ - QAT) / (PTQ - BF16)`` in test loss (nats per token, log-perplexity) and its paired
    standard error: `qatlib.report.metrics.recovery` on the mean NLLs. Where PTQ is orders of
    magnitude off (int2 RTN: 7.2e6 PPL), the perplexity ratio of `recovery_record` calls any model of
    1e5 PPL a 0.99 recovery; in loss it is ~0.27. Both agree for small gaps (the log is linear there)."""
    rv = recovery(
        bf16["nll"],
        ptq["nll"],
        qat["nll"],
        min_gap=math.log1p(MIN_REL_GAP),  # the perplexity definition's floor, in nats
        nll=(bf16["_nll"], ptq["_nll"], qat["_nll"]),
    )
    return {"loss_recovery": rounded(rv.value), "loss_recovery_se": rounded(rv.se)}


# --------------------------------------------------------------------------- methods
def scale_lr(s: QualitySettings, scheme, scale_update: str, lr: float | None) -> float:
    """The scale learning rate of a QAT row: ``lr`` when given; in log space the relative ``s.lr``
    for every format (the trainer gives E8M0 scales `qatlib.trainers.log_scale.e8m0_lr` of it);
    additive, the per-format absolute values (fp8 ~1e-4 scales, FP4 scales in their own units)."""
    from qatlib.quant.spec import ScaleFormat

    if lr is not None:
        return lr
    if scale_update == "log":
        return s.lr
    if any(sp is not None and sp.is_fp8 and not sp.dynamic for sp in (scheme.weight, scheme.input)):
        return s.fp8_lr  # learnable fp8 scales (~1e-4: amax / 448) need the small lr
    if scheme.weight is not None and scheme.weight.is_fp4:
        e8m0 = scheme.weight.scale_format is ScaleFormat.E8M0
        return s.mxfp4_lr if e8m0 else s.nvfp4_lr
    return s.lr


class Lab:
    """The base model, data and evaluator, and the quantization methods as one-liners."""

    def __init__(
        self, s: QualitySettings, base_dir: str, corpus: str, mc_task: str | None, work: Path
    ) -> None:
        from qatlib.data import load_training_data
        from qatlib.eval.perplexity import make_windows, tokenize_text
        from qatlib.models import load_tokenizer

        self.s = s
        self.work = work
        self.tok = load_tokenizer(base_dir)
        self.base = load_base(base_dir)
        corpus = Path(corpus)
        self.eval = Evaluator(
            self.tok, (corpus / "test.txt").read_text(encoding="utf-8"), s, mc_task, work / "hf_home"
        )
        calib_ids = tokenize_text(self.tok, (corpus / "calib.txt").read_text(encoding="utf-8"))
        cw = make_windows(calib_ids, s.seq_len, s.calib_windows)
        self.calib = [cw[i : i + s.calib_batch] for i in range(0, cw.shape[0], s.calib_batch)]
        n_train = max(s.qat_steps * s.qat_batch, s.bw_train_size + s.bw_val_size)
        self.train = load_training_data(corpus / "train.txt", self.tok, s.seq_len, num_samples=n_train)

    def fresh(self):
        m = copy.deepcopy(self.base)
        m.eval()
        return m

    def rtn(self, scheme, *, lwc_init: float | None = None, deploy_target: str = "none", smooth: bool = True):
        """RTN PTQ; ``deploy_target`` ties the scales that runtime merges (`qatlib.runtime.tying`);
        SmoothQuant first (`qatlib.quant.smoothing.smooth_model`, the PTQ stage's) when the lab's
        ``smooth_alpha`` is set, unless ``smooth`` is False."""
        from qatlib.ptq import calibrate
        from qatlib.quant.linear import PrepareOptions
        from qatlib.quant.smoothing import smooth_model
        from qatlib.runtime.tying import tie_for

        m = self.fresh()
        if smooth and self.s.smooth_alpha is not None:
            smooth_model(m, self.calib, self.s.smooth_alpha)
        options = PrepareOptions(lwc_init=lwc_init, deploy=tie_for(deploy_target))
        calibrate(m, scheme, self.calib, ignore=IGNORE, options=options)
        return m

    def gap_parts(self, m) -> dict[str, float]:
        """Where a weight + activation format's RTN loss comes from: the test perplexity of the
        RTN model ``m`` with only its weight quantizers on, then only its input quantizers."""
        from qatlib.quant import quant_linears

        roles = ("weight_quantizer", "input_quantizer")
        qs = [(r, q) for _, ql in quant_linears(m) for r in roles if (q := getattr(ql, r)) is not None]
        out = {}
        try:
            for key, on in zip(("rtn_weights_only_ppl", "rtn_inputs_only_ppl"), roles):
                for r, q in qs:
                    q.enabled = r == on
                out[key] = self.eval(m, mc=False)["ppl"]
        finally:
            for _, q in qs:
                q.enabled = True
        return out

    def gptq(self, scheme, *, latent: bool = False):
        from qatlib.ptq.gptq import gptq

        m = self.fresh()
        gptq(m, scheme, self.calib, ignore=IGNORE, latent=latent)
        return m

    def qat(
        self,
        scheme,
        *,
        loss_type: str | None = None,
        steps: int | None = None,
        lwc: bool = False,
        lr: float | None = None,
        norm: bool = False,
        start=None,
        lm: float | None = None,
        weight_lr: float | None = None,
        act_scale: bool = True,
        teacher: str | None = None,
        scale_update: str | None = None,
        frozen_codes: bool = False,
    ):
        """RTN warm start (or the prepared model ``start``) + end-to-end QAT; returns (model, record).

        ``norm``: the RMSNorm weights learn too (upstream's ``learnable.norm``). ``weight_lr``: the
        linear weights learn too (straight-through), at that rate; the teacher is then the
        untouched base model (the student's own weights with quantizers off would move with it).
        ``teacher``: ``"base"`` (the untouched base model) or ``"self"`` (the student with its
        quantizers off); default base when weights train or ``start`` is given (a phase before
        may have trained them, `qatlib.trainers.end2end.base_model_teacher`), else self.
        ``scale_update``: ``"log"`` steps the scales in log space (``lr`` relative,
        `qatlib.trainers.log_scale`); default ``QualitySettings.scale_update``. ``frozen_codes``:
        the scales train on the start's codes held fixed (`qatlib.quant.codes`)."""
        from transformers import TrainingArguments
        from transformers.trainer_callback import PrinterCallback

        from qatlib.data import PadCollator
        from qatlib.losses import LossConfig
        from qatlib.trainers.end2end import QATTrainer
        from qatlib.trainers.params import Learnable, select_trainable

        s = self.s
        steps = steps or s.qat_steps
        loss_type = loss_type or s.loss_type
        scale_update = scale_update or s.scale_update
        lr = scale_lr(s, scheme, scale_update, lr)
        # FOCUS's sub-group logits at upstream's quant_max_scale_lr (additive, `common.FOCUS`)
        subgroup_lr = FOCUS.get(scheme.name, (None, None))[1]
        m = start if start is not None else self.rtn(scheme, lwc_init=s.lwc_init if lwc else None)
        args = TrainingArguments(
            output_dir=str(self.work / "trainer"),
            max_steps=steps,
            per_device_train_batch_size=s.qat_batch,
            learning_rate=lr,
            lr_scheduler_type=s.lr_scheduler,
            warmup_steps=min(s.warmup_steps, steps - 1),
            weight_decay=0.0,
            logging_steps=max(steps // 10, 1),
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=s.seed,
            data_seed=s.seed,
        )
        learnable = Learnable(act_scale=act_scale, weight_scale=True, lwc=lwc, norm=norm)
        pick = (
            {"trainable": select_trainable(m, learnable, weights=True), "weight_lr": weight_lr}
            if weight_lr
            else {"learnable": learnable}
        )
        teacher = teacher or ("base" if weight_lr or norm or start is not None else "self")
        if teacher not in ("base", "self"):
            raise ValueError(f"teacher must be 'base' or 'self'; got {teacher!r}")
        pick["teacher"] = self.base if teacher == "base" else None
        trainer = QATTrainer(
            m,
            args,
            # origin = the LM loss alone, whatever the main recipe's LM weight
            loss_config=LossConfig(
                loss_type=loss_type,
                lm_loss_weight=1.0 if loss_type == "origin" else (s.lm_loss_weight if lm is None else lm),
                kd_loss_weight=1.0,
            ),
            lwc_lr=s.lwc_lr if lwc else None,
            scale_update=scale_update,
            subgroup_lr=subgroup_lr,
            **pick,
            train_dataset=self.train,
            data_collator=PadCollator.for_tokenizer(self.tok),
            log_file=False,
        )
        trainer.remove_callback(PrinterCallback)  # the logs are kept in trainer.state, not printed
        t0 = time.perf_counter()
        if frozen_codes:
            from qatlib.quant.codes import freeze_codes, release_codes

            freeze_codes(m)
        with _quiet():
            trainer.train()
        if frozen_codes:
            release_codes(m)
        wall = time.perf_counter() - t0
        logs = [r for r in trainer.state.log_history if "total_loss" in r]
        rec = {
            "steps": steps,
            "train_s": round(wall, 2),
            "s_per_step": round(wall / steps, 4),
            "loss_type": loss_type,
            "lwc": lwc,
            "norm": norm,
            "lr": lr,
            "lr_groups": {g["name"]: g["lr"] for g in trainer.optimizer.param_groups},
            "weight_lr": weight_lr,
            "scale_update": scale_update,
            "teacher": teacher,
            "frozen_codes": frozen_codes,
            "first_total_loss": logs[0]["total_loss"] if logs else None,
            "last_total_loss": logs[-1]["total_loss"] if logs else None,
            "trainable": trainer.trainable.counts(),
        }
        m.eval()
        return m, rec

    def blockwise(self, scheme, *, deploy_target: str = "none"):
        from qatlib.trainers.blockwise import BlockwiseSettings, BlockwiseTrainer, blockwise_samples
        from qatlib.trainers.params import Learnable

        s = self.s
        m = self.rtn(scheme, deploy_target=deploy_target)
        bs = BlockwiseSettings(
            epochs=s.bw_epochs,
            batch_size=1,
            train_size=s.bw_train_size,
            val_size=s.bw_val_size,
            training_seqlen=s.seq_len,
            quant_lr=s.bw_quant_lr,
            weight_lr=s.bw_weight_lr,
            loss=s.bw_loss,
        )
        samples = blockwise_samples(self.train, s.seq_len, s.bw_train_size + s.bw_val_size)
        t0 = time.perf_counter()
        res = BlockwiseTrainer(
            m,
            bs,
            learnable=Learnable(act_scale=True, weight_scale=True, norm=s.bw_norm),
            calibrate_activations=False,
            seed=s.seed,
            scale_update=s.scale_update,
        ).train(samples)
        wall = time.perf_counter() - t0
        m.eval()
        return m, {
            "train_s": round(wall, 2),
            "blocks": res.blocks,
            "settings": asdict(bs),
            "last_val_loss": [r.get("val_loss") for r in res.log if r["epoch"] == bs.epochs - 1],
        }

    def two_phase(
        self,
        scheme,
        *,
        steps: int,
        lr: float,
        frozen_codes: bool = True,
        act_scale: bool = True,
        deploy_target: str = "none",
        phase2_target: str = "none",
    ):
        """EfficientQAT's two phases: `blockwise` (weights and scales; ``deploy_target`` as there),
        then the scales end to end (`qat`) from a copy of its result, tied for ``phase2_target`` at
        the max of phase 1's scales first (`qatlib.runtime.tying.apply_target`): ``steps`` steps in
        log space at the relative ``lr``, on phase 1's codes held with ``frozen_codes``
        (`qatlib.quant.codes`), the untouched base model as teacher. Returns ``(phase 1 model, its
        record, two-phase model, phase 2's record)``."""
        bm, brec = self.blockwise(scheme, deploy_target=deploy_target)
        start = copy.deepcopy(bm)
        if phase2_target != "none":
            from qatlib.runtime.tying import apply_target

            apply_target(start, scheme, phase2_target)
        kw = {"teacher": "base", "scale_update": "log", "frozen_codes": frozen_codes, "act_scale": act_scale}
        pm, prec = self.qat(scheme, start=start, steps=steps, lr=lr, **kw)
        return bm, brec, pm, prec

    def deployed(
        self, model, scheme, target: str = DEPLOY_TARGET, capability: str | None = None
    ) -> dict[str, Any]:
        """``{"ppl", "applied"}`` of ``model`` as the runtime deploys it (`deployed_eval`), or
        ``{"refused": why}`` where the runtime refuses the format."""
        rec = self.deployed_eval(model, scheme, target, capability)
        return rec if "refused" in rec else {"ppl": rec["ppl"], "applied": rec["applied"]}

    def deployed_eval(
        self, model, scheme, target: str = DEPLOY_TARGET, capability: str | None = None
    ) -> dict[str, Any]:
        """The evaluation record (per-window NLLs kept, as `__call__`'s) of ``model`` as the runtime
        deploys it: the real export (`qatlib.export.export`) loaded by
        `qatlib.eval.variants.load_deployed` (the runtime emulator), plus ``applied``; or
        ``{"refused": why}``."""
        from qatlib.eval.variants import load_deployed
        from qatlib.export import export
        from qatlib.runtime.emulate import RuntimeRefusal

        d = Path(tempfile.mkdtemp(dir=self.work))
        export(model, scheme, d, "real", ignore=list(IGNORE))
        try:
            dep, rec = load_deployed(d, target, capability)
        except RuntimeRefusal as e:
            return {"refused": str(e)}
        return {**self.eval(dep, mc=False), "applied": rec["applied"]}


@contextlib.contextmanager
def opened(s: QualitySettings, results: str, prefix: str) -> Iterator[tuple[Lab, dict[str, Any]]]:
    """``(lab, inputs)`` in a temporary working folder (``prefix``): the inputs resolved
    (`benchmarks.lab_inputs.resolve_inputs`) and the lab built on their snapshot."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        work = Path(tmp)
        inputs = resolve_inputs(s, results, work)
        yield Lab(s, inputs["base"], inputs["corpus_snapshot"], inputs.get("mc_task"), work), inputs
