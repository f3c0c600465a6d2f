"""2-rank ZeRO-3 worker (torchrun): hub-layout MoE checkpoints (Mixtral / MiniMax-M2's
``block_sparse_moe.experts.{e}.w1|w2|w3.weight``) streamed into the partitioned, linearised model.

Usage: torchrun --standalone --nproc_per_node=2 key_conversion.py SPEC.json

SPEC: {"out": dir, "ds_config": file, "models": {name: checkpoint dir}, "chunk_bytes": int, "save": bool}.
Per model: `qatlib.zero3.load.load_model` (the ZeRO-3 QAT's load: empty build under zero.Init,
experts linearised, weights streamed by transformers' key conversion), then every parameter and
persistent buffer gathered; rank 0 writes ``{out}/{name}.pt`` (name -> tensor) and both ranks'
partition sizes. ``save``: then the expert weights changed (`_train_experts`), gathered again
(``trained``) and `qatlib.zero3.save.save_consolidated` writes ``{out}/{name}-saved`` (the QAT
checkpoint).
No reference here: the test compares with ``from_pretrained`` (+ linearisation).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import torch

logging.basicConfig(level=logging.INFO, format=f"[rank{os.environ.get('RANK', '?')}] %(name)s: %(message)s")


def _train_experts(model) -> None:
    """Every linearised expert weight ``w <- w * 1.5 + 0.25`` (rank 0 modifies, the partitions are
    rewritten): the values a save must write are the model's, not the loaded checkpoint's."""
    import deepspeed

    from qatlib.surgery.moe import LinearizedMoeExperts

    for m in model.modules():
        if isinstance(m, LinearizedMoeExperts):
            params = list(m.parameters())
            with deepspeed.zero.GatheredParameters(params, modifier_rank=0), torch.no_grad():
                for p in params:
                    p.mul_(1.5).add_(0.25)


def _gathered(model) -> dict[str, torch.Tensor]:
    from qatlib.zero3 import save as zs

    tensors = {}
    for mname, m in zs.iter_gathered_modules(model, unit_types=()):
        for pname, p in m.named_parameters(recurse=False):
            tensors[f"{mname}.{pname}" if mname else pname] = p.data.detach().cpu().clone()
    return tensors


def main(spec_path: str) -> None:
    from qatlib.zero3 import io as z
    from qatlib.zero3 import load as zl
    from qatlib.zero3 import save as zs

    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    ctx = z.init_zero3(json.loads(Path(spec["ds_config"]).read_text()), timeout_s=120)
    for name, model_dir in spec["models"].items():
        model = zl.load_model(model_dir, ctx, chunk_bytes=spec["chunk_bytes"])
        partitioned = all(z.is_zero3_param(p) for p in model.parameters())
        held = sum(p.ds_tensor.numel() for p in model.parameters())
        tensors = _gathered(model)
        buffers = {n: b.detach().cpu().clone() for n, b in model.named_buffers()}
        everyone = [None] * z.get_world_size()
        torch.distributed.all_gather_object(everyone, {"partitioned": partitioned, "held": held})
        trained = None
        if spec.get("save"):  # "trained" experts (no longer the checkpoint's), the QAT checkpoint writer
            _train_experts(model)
            trained = _gathered(model)
            zs.save_consolidated(model, out / f"{name}-saved")
        if z.get_rank() == 0:
            torch.save(
                {"params": tensors, "buffers": buffers, "ranks": everyone, "trained": trained},
                out / f"{name}.pt",
            )
        del model
    ctx.close()
    print("WORKER OK", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
