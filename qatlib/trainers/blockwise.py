"""Blockwise QAT (EfficientQAT Block-AP / OmniQuant style), single process.

For each decoder block (`qatlib.surgery.modeling.decoder_layers`: ``model.model.layers``; dense or MoE), in order:

1. targets: the block run UNQUANTIZED (`quantization_disabled`) on the full-precision inputs
   (``fp_inps``) — computed before the block changes;
2. static activation scales of the block that no checkpoint provided are calibrated on the
   quantized inputs (``q_inps``);
3. train: the quantized block — weight AND activation fake-quant on — is fed ``q_inps`` and
   fitted to the targets by ``loss`` (`BLOCK_LOSSES`: upstream's MSE, or the per-token relative
   error that the next block's RMSNorm sees), AdamW with two groups: quantizer parameters
   selected by the ``learnable`` switches (scales / zero points / LWC) at ``quant_lr`` and, when
   ``weight_lr > 0``, the block's linear weights (and norms with ``learnable.norm``) at
   ``weight_lr``; each group's rate decays by a cosine to ``lr / min_lr_factor`` over ``epochs``
   passes. Validation loss on ``val_size`` held-out samples is logged every epoch;
4. bake: the block keeps its `QuantLinear` layers with the updated weights and scales (frozen);
5. propagate: the trained quantized block's outputs on ``q_inps`` become the next block's
   ``q_inps``; the targets become the next ``fp_inps``.

The first block's inputs (hidden states + the kwargs the model passes its layers: position
embeddings, attention mask, position ids) are captured by a pre-forward hook that raises to stop
the forward. Everything runs in the model's own dtype (upstream forced fp16 and a loss scaler).
Upstream read the wrong config key for activation quantization and so never trained with it on;
here the quantizers stay exactly as prepared (a test checks the activation quantizers fire).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint.layout import TRAIN_LOG_FILE
from ..quant import quantization_disabled
from ..quant.calibration import calibrate_activations
from ..surgery.modeling import decoder_layers
from .log_scale import SCALE_UPDATES, install_log_space_steps
from .params import Learnable, freeze_all_but, quantizer_groups, select_trainable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockwiseSettings:
    """``compression.QAT.block_wise_config`` (same fields and defaults)."""

    epochs: int = 20
    batch_size: int = 1
    train_size: int = 128
    val_size: int = 64
    training_seqlen: int = 2048
    quant_lr: float = 1e-4
    weight_lr: float = 1e-3
    min_lr_factor: float = 20.0
    wd: float = 0.0
    loss: str = "mse"  # a key of BLOCK_LOSSES; qatlib's addition (upstream always used MSE)


@dataclass
class BlockwiseResult:
    log: list[dict[str, Any]] = field(default_factory=list)
    blocks: int = 0
    seconds: float = 0.0


class _StopForward(Exception):
    pass


def blockwise_samples(dataset: Iterable[dict[str, Sequence[int]]], seqlen: int, n: int) -> list[torch.Tensor]:
    """``n`` token windows of ``seqlen``: the datasets' ``input_ids`` concatenated and cut (block
    reconstruction needs inputs, not labels). Raises if the data is too short."""
    buf: list[int] = []
    out: list[torch.Tensor] = []
    for s in dataset:
        buf.extend(int(t) for t in s["input_ids"])
        while len(buf) >= seqlen and len(out) < n:
            out.append(torch.tensor(buf[:seqlen], dtype=torch.long))
            buf = buf[seqlen:]
        if len(out) >= n:
            break
    if len(out) < n:
        raise ValueError(
            f"blockwise training needs {n} windows of {seqlen} tokens; the data gives {len(out)}"
        )
    return out


def _detach(x: Any) -> Any:
    if torch.is_tensor(x):
        return x.detach()
    if isinstance(x, (tuple, list)):
        return type(x)(_detach(v) for v in x)
    if isinstance(x, dict):
        return {k: _detach(v) for k, v in x.items()}
    return x


@torch.no_grad()
def capture_first_block_inputs(
    model: nn.Module, batches: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], list[dict]]:
    """Hidden states entering block 0 and the kwargs the model passes it, one entry per batch."""
    _, layers = decoder_layers(model)
    inps: list[torch.Tensor] = []
    kws: list[dict] = []

    def hook(module, args, kwargs):
        hs = args[0] if args else kwargs["hidden_states"]
        kw = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        kw.pop("cache", None)
        kw.pop("past_key_values", None)
        kw.pop("past_key_value", None)
        kw["use_cache"] = False
        inps.append(hs.detach())
        kws.append(_detach(kw))
        raise _StopForward

    handle = layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    device = next(model.parameters()).device
    try:
        for ids in batches:
            try:
                model(input_ids=ids.to(device), use_cache=False)
            except _StopForward:
                pass
    finally:
        handle.remove()
    if len(inps) != len(batches):
        raise RuntimeError("the capture hook on the first decoder layer did not fire for every batch")
    return inps, kws


def _block_out(block: nn.Module, x: torch.Tensor, kw: dict) -> torch.Tensor:
    out = block(x, **kw)
    return out[0] if isinstance(out, (tuple, list)) else out


def _calibrate_block(block: nn.Module, inps: list[torch.Tensor], kws: list[dict]) -> int:
    """Calibrate the block's not-yet-initialised static activation quantizers on ``inps``."""
    report = calibrate_activations(block, list(zip(inps, kws)), forward=_run_block, only_uninitialized=True)
    return report.static_activation_quantizers


def _run_block(block: nn.Module, batch: tuple[torch.Tensor, dict]) -> None:
    _block_out(block, *batch)


def block_mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Upstream's block loss: the mean squared error over every element of the block output."""
    return F.mse_loss(out.float(), target.float())


def token_relative_error(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of ``|out_t - target_t|^2 / |target_t|^2`` (norms over the hidden size).

    Why: in a pre-norm decoder the next block (and the final norm) sees each token's hidden state
    only after RMSNorm divides it by its own norm, so an error matters relative to its token. The
    element MSE weighs tokens by their squared norm instead, and a pretrained LM's residual stream
    is dominated by a few massive activations: on SmolLM2-135M (256-token windows) the first
    position holds 84-99% of the squared norm of the outputs of blocks 11-27 (measured), so MSE
    there mostly fits the attention-sink token. On that model's int4 g64 benchmark it lifts
    blockwise recovery from 0.850 (MSE) to 0.905 at weight lr 1e-3, level at 1e-4
    (benchmarks/README.md at 2faaa77). Not the default: upstream's YAML files mean upstream's MSE."""
    o, y = out.float(), target.float()
    err = (o - y).pow(2).sum(-1)
    ref = y.pow(2).sum(-1).clamp_min(torch.finfo(torch.float32).tiny)
    return (err / ref).mean()


# the block losses ``BlockwiseSettings.loss`` names (a dict, not a registry)
BLOCK_LOSSES = {"mse": block_mse, "token_relative": token_relative_error}


def _cosine_factor(step: int, total: int, min_lr_factor: float) -> float:
    floor = 1.0 / min_lr_factor
    t = min(step, total) / max(total, 1)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * t))


class BlockwiseTrainer:
    """Train a prepared model block by block (see the module docstring).

    ``learnable`` selects the quantizer parameters trained at ``quant_lr`` (the same switches as
    end-to-end; LWC factors count as quantizer parameters here). ``calibrate_activations``: set
    static activation scales of each block from its quantized inputs when no checkpoint did (a
    quantizer whose ``initialized`` flag is set is left alone). ``log_file``: JSON lines, one per
    block and epoch.
    """

    def __init__(
        self,
        model: nn.Module,
        settings: BlockwiseSettings,
        *,
        learnable: Learnable | None = None,
        calibrate_activations: bool = True,
        log_file: str | os.PathLike | None = None,
        seed: int = 0,
        scale_update: str = "additive",
        e8m0_scale_lr: float | None = None,
        subgroup_lr: float | None = None,
    ) -> None:
        if scale_update not in SCALE_UPDATES:
            raise ValueError(f"scale_update must be one of {SCALE_UPDATES}; got {scale_update!r}")
        if settings.loss not in BLOCK_LOSSES:
            raise ValueError(
                f"block_wise_config.loss must be one of {sorted(BLOCK_LOSSES)}; got {settings.loss!r}"
            )
        self.scale_update = scale_update
        self.e8m0_scale_lr = e8m0_scale_lr
        self.subgroup_lr = subgroup_lr  # FOCUS's sub-group logits (None: quant_lr)
        self.model = model
        self.settings = settings
        self.learnable = learnable or Learnable()
        self.calibrate_activations = calibrate_activations
        self.log_file = Path(log_file) if log_file else None
        self.seed = seed
        self.layers_path, self.layers = decoder_layers(model)

    # ------------------------------------------------------------------ pieces
    def _optimizer(self, block: nn.Module, block_name: str):
        """AdamW over the block's selected quantizer parameters (``quant_lr``) and, with
        ``weight_lr > 0``, its linear weights / biases plus norms when ``learnable.norm``
        (``weight_lr``); everything else in the block is frozen. None when nothing trains."""
        s = self.settings
        tp = select_trainable(
            self.model, self.learnable, modules=[(block_name, block)], weights=s.weight_lr > 0
        )
        if s.weight_lr <= 0:
            tp.norm = []
        if s.quant_lr <= 0:
            tp.scale, tp.lwc, tp.subgroup = [], [], []
        freeze_all_but(block, tp)
        # scales / LWC (log space: lr relative; E8M0 scales at their own lr): params.quantizer_groups
        groups = quantizer_groups(
            tp.scale + tp.lwc,
            lr=s.quant_lr,
            scale_update=self.scale_update,
            e8m0=tp.e8m0,
            e8m0_scale_lr=self.e8m0_scale_lr,
            weight_decay=s.wd,
            names=("quant", "quant_additive"),
        )
        if tp.subgroup:  # additive (logits), at upstream's quant_max_scale_lr
            lr = s.quant_lr if self.subgroup_lr is None else self.subgroup_lr
            groups.append(
                {"params": [p for _, p in tp.subgroup], "lr": lr, "weight_decay": s.wd, "name": "subgroup"}
            )
        if tp.weight or tp.norm:
            groups.append(
                {"params": [p for _, p in tp.weight + tp.norm], "lr": s.weight_lr, "name": "weight"}
            )
        if not groups:
            return None
        return install_log_space_steps(torch.optim.AdamW(groups, weight_decay=s.wd))

    def _emit(self, rec: dict[str, Any], result: BlockwiseResult) -> None:
        result.log.append(rec)
        log.info("blockwise %s", rec)
        if self.log_file is not None:
            with self.log_file.open("a") as f:
                f.write(json.dumps(rec) + "\n")

    # ------------------------------------------------------------------ main loop
    def train(self, samples: Sequence[torch.Tensor]) -> BlockwiseResult:
        """``samples``: ``train_size + val_size`` LongTensors of ``training_seqlen`` tokens (see
        `blockwise_samples`); the first ``train_size`` train, the rest validate."""
        s = self.settings
        block_loss = BLOCK_LOSSES[s.loss]
        if len(samples) < s.train_size + s.val_size:
            raise ValueError(
                f"need {s.train_size + s.val_size} samples (train_size + val_size); got {len(samples)}"
            )
        t0 = time.perf_counter()
        result = BlockwiseResult()
        if self.log_file is not None:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            self.log_file.write_text("")
        model = self.model
        was_training = model.training
        model.eval()  # no dropout; blocks are put in train mode one at a time below
        model.requires_grad_(False)

        def batches(xs):
            return [torch.stack(list(xs[i : i + s.batch_size])) for i in range(0, len(xs), s.batch_size)]

        train_b = batches(samples[: s.train_size])
        val_b = batches(samples[s.train_size : s.train_size + s.val_size])
        inps, kws = capture_first_block_inputs(model, train_b + val_b)
        fp_inps = inps
        q_inps = [x.clone() for x in inps]
        n_train = len(train_b)
        rng = random.Random(self.seed)
        for i, block in enumerate(self.layers):
            name = f"{self.layers_path}.{i}"
            with torch.no_grad(), quantization_disabled(block):
                targets = [_block_out(block, x, kw) for x, kw in zip(fp_inps, kws)]
            if self.calibrate_activations:
                _calibrate_block(block, q_inps[:n_train], kws[:n_train])
            opt = self._optimizer(block, name)
            if opt is not None:
                base = [g["lr"] for g in opt.param_groups]
                total = s.epochs * n_train
                step = 0
                block.train()
                for epoch in range(s.epochs):
                    order = list(range(n_train))
                    rng.shuffle(order)
                    tr_loss, tr_n = 0.0, 0
                    for j in order:
                        out = _block_out(block, q_inps[j], kws[j])
                        loss = block_loss(out, targets[j])
                        opt.zero_grad(set_to_none=True)
                        loss.backward()
                        opt.step()
                        step += 1
                        for g, lr in zip(opt.param_groups, base):
                            g["lr"] = lr * _cosine_factor(step, total, s.min_lr_factor)
                        tr_loss += loss.item()
                        tr_n += 1
                    block.eval()
                    rec = {
                        "block": i,
                        "epoch": epoch,
                        "loss": s.loss,
                        "train_loss": tr_loss / max(tr_n, 1),
                        "lr": {g["name"]: g["lr"] for g in opt.param_groups},
                    }
                    if val_b:
                        with torch.no_grad():
                            vals = [
                                block_loss(_block_out(block, q_inps[j], kws[j]), targets[j]).item()
                                for j in range(n_train, len(q_inps))
                            ]
                        rec["val_loss"] = sum(vals) / len(vals)
                    block.train()
                    self._emit(rec, result)
                block.eval()
                del opt
            # bake: keep the QuantLinear layers with their trained weights / scales, frozen
            block.requires_grad_(False)
            with torch.no_grad():
                q_inps = [_block_out(block, x, kw) for x, kw in zip(q_inps, kws)]
            fp_inps = targets
            result.blocks += 1
        model.train(was_training)
        result.seconds = time.perf_counter() - t0
        return result


def train_blockwise(
    cfg,
    model: nn.Module,
    train_dataset,
    *,
    scales_loaded: bool = False,
    log_file: str | os.PathLike | None | bool = True,
) -> BlockwiseResult:
    """Blockwise QAT as ``cfg`` says (``compression.QAT.block_wise_config``, ``learnable``), on a
    prepared model and a tokenized dataset. ``log_file``: True = ``<global.save_path>/
    train_log.jsonl``, a path, or None / False for none (the records are in the result).
    ZeRO-3 is not supported (single process)."""
    if getattr(cfg, "zero3_enabled", False):
        raise ValueError("blockwise QAT runs in a single process; it does not support ZeRO-3")
    settings = cfg.blockwise()
    samples = blockwise_samples(
        train_dataset, settings.training_seqlen, settings.train_size + settings.val_size
    )
    if log_file is True:
        log_file = Path(cfg.global_.save_path) / TRAIN_LOG_FILE
    trainer = BlockwiseTrainer(
        model,
        settings,
        learnable=cfg.learnable(),
        calibrate_activations=not scales_loaded,
        log_file=log_file or None,
        seed=cfg.global_.seed,
        scale_update=cfg.scale_update,
        e8m0_scale_lr=cfg.qat.plugin_config.quant_config.e8m0_scale_lr,
        subgroup_lr=cfg.qat.plugin_config.quant_config.learnable.quant_max_scale_lr,
    )
    torch.manual_seed(cfg.global_.seed)
    return trainer.train(samples)
