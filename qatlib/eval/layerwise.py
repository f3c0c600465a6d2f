"""Evaluation of a model larger than one device (or than host RAM): ``scripts/evaluate.py
--layerwise``.

The variant's model is a skeleton (`qatlib.models.load_prepared` with ``skeleton=True``: every
weight on the meta device, the scales real and loaded) and its perplexity is computed layer by
layer (`qatlib.eval.perplexity.layerwise_logits`), each decoder layer's weights streamed from the
checkpoint folder by a `qatlib.zero3.onload.Onloader` onto the evaluation device: one layer's weights
plus the embeddings / head and the hidden states of the evaluated windows are resident, never the
model. Same perplexity as the whole-model evaluation (`test_layerwise_evaluation_is_the_whole_model_one`).

Only the variants whose weights are the base checkpoint's can be streamed this way: ``bf16``,
``ptq``, ``qat`` (fake quantization from the loaded scales). ``export`` / ``deployed`` hold
compressed-tensors codes that transformers decompresses while loading the whole model, and
lm-eval tasks run the whole-model forward: both are refused by name before anything is loaded.
"""

from __future__ import annotations

from typing import Any

from torch import nn

LAYERWISE_VARIANTS = ("bf16", "ptq", "qat")


def layerwise_problem(variant: str, tasks) -> str | None:
    """Why ``--layerwise`` cannot evaluate ``variant`` with ``evaluation.tasks`` (None: it can)."""
    if variant not in LAYERWISE_VARIANTS:
        return (
            f"--layerwise evaluates the variants {', '.join(LAYERWISE_VARIANTS)} (weights streamed from the "
            f"base checkpoint), not {variant!r}: its compressed weights are decompressed by a whole-model load"
        )
    if tasks:
        return "--layerwise computes perplexity only: evaluation.tasks (lm-eval) needs the whole model; set it to []"
    return None


def load_layerwise(cfg, variant: str, model_path: str, scales: str | None) -> tuple[nn.Module, Any, dict]:
    """``(skeleton, onloader, record)`` of ``variant`` for `qatlib.eval.perplexity.perplexity`'s
    ``onload``: the model prepared with the experiment's scheme and the scales loaded (``ptq`` /
    ``qat``; none missing) or unprepared (``bf16``), weights onloaded from ``model_path`` one layer
    at a time onto the evaluation device (`qatlib.device.current`)."""
    from .. import device
    from ..models import load_prepared
    from ..zero3.onload import Onloader, load_skeleton

    problem = layerwise_problem(variant, ())
    if problem:
        raise ValueError(problem)
    m = cfg.model
    if variant == "bf16":
        kw = dict(trust_remote_code=m.trust_remote_code, attn_implementation=m.attn_implementation)
        model = load_skeleton(model_path, torch_dtype=m.torch_dtype, **kw)
    else:
        if not scales:
            raise ValueError(f"--layerwise --variant {variant} needs --scales")
        model = load_prepared(cfg, model_path, scales=scales, complete=True, skeleton=True)[0]
    loader = Onloader.from_checkpoint(model.eval(), model_path, device=device.current())
    return model, loader, {"layerwise": True}
