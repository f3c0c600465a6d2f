"""Two-phase QAT (``compression.QAT.training_mode: two_phase``): EfficientQAT's Block-AP, then its
E2E-QP, in one process.

Phase 1 is `blockwise.train_blockwise` (``block_wise_config``: each decoder block's weights and
scales fitted to the unquantized block's output); phase 2 is `end2end.train_end2end` from phase 1's
model (``hf_args``, the loss, ``quant_config``; with ``frozen_codes`` the scales train on phase 1's
codes held, EfficientQAT's E2E-QP). Measured on SmolLM2-135M NVFP4 W4A4 at 100 x 256 tokens:
recovery of RTN's gap 0.780 as deployed, against 0.676 end to end alone (`benchmarks.quality_w4a4`, its best NVFP4 row).

The rule between the phases lives here: when phase 1 trained the weights (``block_wise_config.
weight_lr > 0``), phase 2's KD teacher is the original model (`end2end.base_model_teacher`), not
the student with its quantizers off, whose weights phase 1 fitted to be good after quantization
(distilling toward them lost most of phase 1's gain, #12).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from torch import nn

from .blockwise import BlockwiseResult, train_blockwise
from .end2end import QATTrainer, base_model_teacher, train_end2end

log = logging.getLogger(__name__)


@dataclass
class TwoPhaseResult:
    blockwise: BlockwiseResult
    trainer: QATTrainer


def phase1_trains_weights(cfg) -> bool:
    """Whether phase 1 changes the linear weights (and so phase 2 needs the original model as
    teacher): ``block_wise_config.weight_lr > 0``."""
    return cfg.blockwise().weight_lr > 0


def train_two_phase(
    cfg,
    model: nn.Module,
    tokenizer,
    train_dataset,
    *,
    scales_loaded: bool = False,
    blockwise_log: str | os.PathLike | None = None,
    args_overrides: dict[str, Any] | None = None,
    scheme=None,
) -> TwoPhaseResult:
    """Phase 1 (blockwise, records to ``blockwise_log``) then phase 2 (end to end, the Trainer's
    ``train_log.jsonl`` in its output_dir) on ``model``, in place. ``scales_loaded``: the PTQ
    checkpoint's scales are on the model (phase 1 calibrates the missing activation scales
    otherwise; phase 2 starts from phase 1's)."""
    res = train_blockwise(cfg, model, train_dataset, scales_loaded=scales_loaded, log_file=blockwise_log)
    log.info("two-phase: phase 1 trained %d blocks in %.1f s", res.blocks, res.seconds)
    teacher = None
    if cfg.loss_config().kd_enabled and phase1_trains_weights(cfg):
        teacher = base_model_teacher(cfg)
        log.info("two-phase: phase 1 trained the weights; phase 2's KD teacher is model.model_path's model")
    trainer = train_end2end(
        cfg,
        model,
        tokenizer,
        train_dataset,
        teacher=teacher,
        scales_loaded=True,
        args_overrides=args_overrides,
        scheme=scheme,
    )
    return TwoPhaseResult(res, trainer)
