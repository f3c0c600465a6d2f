"""``compression.QAT.training_mode`` -> the trainer that runs it: the QAT stage's one call, so the
stage script holds no mode logic (`blockwise`, `end2end`, `two_phase`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from ..checkpoint.layout import BLOCKWISE_LOG_FILE, TRAIN_LOG_FILE
from .blockwise import train_blockwise
from .end2end import train_end2end
from .two_phase import train_two_phase

# the records each mode writes into its run folder, copied into the QAT checkpoint: only its own,
# so a run folder reused after a mode change does not carry the other mode's stale log along
LOG_FILES = {
    "end2end": (TRAIN_LOG_FILE,),
    "blockwise": (TRAIN_LOG_FILE,),
    "two_phase": (BLOCKWISE_LOG_FILE, TRAIN_LOG_FILE),
}


def train(
    cfg,
    model: nn.Module,
    tokenizer,
    data,
    *,
    run_dir: Path,
    scales_loaded: bool,
    args_overrides: dict[str, Any],
    scheme=None,
    zero3_ctx=None,
) -> dict[str, int]:
    """Train ``model`` in place as ``cfg.qat.training_mode`` says, the records under ``run_dir``
    (the end-to-end Trainer's output_dir is ``args_overrides["output_dir"]``); returns what was done
    (``{"blocks": n}``, ``{"steps": n}`` or both)."""
    mode = cfg.qat.training_mode
    if mode == "blockwise":
        res = train_blockwise(
            cfg, model, data, scales_loaded=scales_loaded, log_file=run_dir / TRAIN_LOG_FILE
        )
        return {"blocks": res.blocks}
    if mode == "two_phase":
        two = train_two_phase(
            cfg,
            model,
            tokenizer,
            data,
            scales_loaded=scales_loaded,
            blockwise_log=run_dir / BLOCKWISE_LOG_FILE,
            args_overrides=args_overrides,
            scheme=scheme,
        )
        return {"blocks": two.blockwise.blocks, "steps": two.trainer.state.global_step}
    trainer = train_end2end(
        cfg,
        model,
        tokenizer,
        data,
        scales_loaded=scales_loaded,
        args_overrides=args_overrides,
        scheme=scheme,
        zero3_ctx=zero3_ctx,
    )
    return {"steps": trainer.state.global_step}
