"""Stop QAT at the first non-finite loss, gradient or scale, on every rank, naming step and layer.

Without it a NaN surfaces hours later at evaluation, or at export as a misleading "round trip
changed the weight (nan)". Three checks, each one boolean all-reduced (MAX) so that every rank
raises the same `GuardError` at the same step (no rank is left waiting in a collective):

- the loss of every micro-batch (before its backward); when it is not finite every rank scans its
  quantizer parameters and re-runs the micro-batch's forward (no grad) with hooks that record the
  first module whose output is not finite: the message names that layer, the poisoned scale and
  the ranks;
- the gradients of the trainable parameters before the optimizer step (plain models; under
  DeepSpeed the engine steps inside backward, so its global gradient norm is checked after it);
- every quantizer parameter after the step: finite, and every scale in (0, inf)
  (`qatlib.quant.health.bad_quant_params`); a scale the update took to 0 or below names the
  tensor and its layer and says to lower the scales' learning rate (Adam moves each element by
  about the learning rate per step, whatever its size).

The check after the step runs before the Trainer's checkpoint of that step, so the last
checkpoint written is the last good one (the resumable state). ZeRO-3 parameters are checked on
their local partitions (``ds_tensor``): no gather.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator

import torch
from torch import nn
from transformers import TrainerCallback

from ..quant.health import bad_quant_params, describe_non_finite, layer_of

log = logging.getLogger(__name__)


class GuardError(RuntimeError):
    """Training produced a non-finite loss / gradient / quantizer parameter or a scale <= 0 (named)."""


def _dist() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _any_rank(flag: bool, device: torch.device | str = "cpu") -> bool:
    if not _dist():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item() > 0)


def _gather(obj) -> list:
    if not _dist():
        return [obj]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


@contextlib.contextmanager
def first_non_finite_output(model: nn.Module) -> Iterator[list[str]]:
    """Forward hooks recording, in execution order, the modules whose output is not finite."""
    found: list[str] = []
    handles = []

    def hook(name):
        def fn(module, args, output):
            t = output[0] if isinstance(output, (tuple, list)) else getattr(output, "logits", output)
            if torch.is_tensor(t) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
                found.append(name)

        return fn

    for name, m in model.named_modules():
        if name:  # forward hooks fire innermost first: found[0] is the deepest, earliest culprit
            handles.append(m.register_forward_hook(hook(name)))
    try:
        yield found
    finally:
        for h in handles:
            h.remove()


def _ranked(per_rank: list) -> list[str]:
    lines = []
    for r, items in enumerate(per_rank):
        lines += [f"{x} (rank {r})" for x in items]
    return lines


class TrainingGuard(TrainerCallback):
    """The checks of this module for one `QATTrainer` (``trainer.guard``)."""

    def __init__(self, model: nn.Module, trainable_params: list[tuple[str, torch.Tensor]]) -> None:
        self.model = model
        self.trainable = trainable_params
        self.step = 0  # the optimizer step being computed, 1-based (the train log's numbering)
        self.trainer = None  # set by QATTrainer: its ``model_wrapped`` is the DeepSpeed engine

    def _device(self):
        return next(self.model.parameters()).device

    # ------------------------------------------------------------------ loss
    def check_loss(self, loss: torch.Tensor, step: int, forward_inputs: dict) -> None:
        """Called on every rank after each training micro-batch's loss, before its backward."""
        self.step = step
        bad = not bool(torch.isfinite(loss.detach()).all())
        if not _any_rank(bad, self._device()):
            return
        with torch.no_grad(), first_non_finite_output(self.model) as found:
            self.model(**forward_inputs, use_cache=False)
        diag = {
            "loss": loss.detach().float().item(),
            "outputs": found[:1],
            "params": bad_quant_params(self.model),
        }
        ranks = _gather(diag)
        losses = ", ".join(f"rank {r}: {d['loss']}" for r, d in enumerate(ranks))
        layer = _ranked([d["outputs"] for d in ranks])
        params = _ranked([d["params"] for d in ranks])
        msg = f"step {step}: non-finite loss ({losses})"
        msg += f"; first layer with a non-finite output: {'; '.join(layer) if layer else 'none (the loss itself)'}"
        if params:
            msg += f"; quantizer parameters: {'; '.join(params[:5])}"
        raise GuardError(msg + ". No checkpoint of this step was written: resume from the last one.")

    # ------------------------------------------------------------------ gradients / scales
    def on_pre_optimizer_step(self, args, state, control, **kw):
        # Plain models: the gradients exist now (under DeepSpeed the engine already stepped).
        bad = []
        for name, p in self.trainable:
            if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
                bad.append(f"{name}.grad: {describe_non_finite(p.grad)}")
        if _any_rank(bool(bad), self._device()):
            lines = _ranked(_gather(bad))
            raise GuardError(
                f"step {state.global_step + 1}: non-finite gradient: {'; '.join(lines[:5])}. The step was not "
                "applied and no checkpoint of it was written: resume from the last one."
            )
        # A parameter already out of range when this step's gradients exist (set from outside, or by
        # a forward that does not propagate it: the fused fake-quant clamps a zero scale's codes to
        # finite values): stop before the update can hide it (Adam would move a 0 to +-lr).
        if getattr(self.trainer, "is_deepspeed_enabled", False):
            return  # the engine has already stepped: `on_step_end` names it, with the lr advice
        bad = bad_quant_params(self.model)
        if _any_rank(bool(bad), self._device()):
            lines = _ranked(_gather(bad))
            raise GuardError(
                f"step {state.global_step + 1}: quantizer parameters out of range before the update: "
                f"{'; '.join(lines[:5])}. The step was not applied and no checkpoint of it was written: "
                "resume from the last one."
            )

    def on_step_end(self, args, state, control, **kw):
        step = state.global_step
        grad_norm = None
        engine = getattr(self.trainer, "model_wrapped", None)
        if engine is not None and hasattr(engine, "get_global_grad_norm"):
            grad_norm = engine.get_global_grad_norm()
            grad_norm = None if grad_norm is None else float(grad_norm)
        bad = bad_quant_params(self.model)
        norm_bad = grad_norm is not None and not math.isfinite(grad_norm)
        if _any_rank(bool(bad) or norm_bad, self._device()):
            per_rank = _gather(bad)
            lines = _ranked(per_rank)
            layers = sorted({layer_of(x) for items in per_rank for x in items})
            what = f"non-finite gradient (global norm {grad_norm}); " if norm_bad else ""
            msg = f"step {step}: {what}quantizer parameters left their range after the update: "
            msg += f"{'; '.join(lines[:5]) or 'none named'}"
            if layers:
                msg += f" (layers: {', '.join(layers[:5])}{', ...' if len(layers) > 5 else ''})"
            if any("<= 0" in x for x in lines):
                lr = getattr(args, "learning_rate", None)
                msg += (
                    f". A scale <= 0: the update was too large for it; lower the scales' learning rate "
                    f"(compression.QAT.hf_args.learning_rate, now {lr}; Adam moves every element by "
                    "about the learning rate per step, so keep it well below the smallest scale; or set "
                    "compression.QAT.plugin_config.quant_config.scale_update: log, where the learning "
                    "rate is a relative step and no scale can reach 0)"
                )
            raise GuardError(msg + ". No checkpoint of this step was written: resume from the last one.")
