"""2-rank ZeRO-3 worker (torchrun): GPT-OSS QAT with its experts quantized.

Usage: torchrun --standalone --nproc_per_node=2 gpt_oss.py SPEC.json

SPEC: {"out": dir, "ds_config": file, "model": checkpoint dir, "ptq": PTQ dir, "scheme": QuantScheme
dict, "steps": int, "lr": float, "data": file (torch.save'd [steps, 2, B, T] token ids)}.
`qatlib.zero3.load.build_qat_model` (empty partitioned build, experts linearised from GPT-OSS's
transposed / interleaved / biased layout, weights streamed, PTQ scales loaded), then ``steps``
DeepSpeed steps training every scale. Rank 0 writes ``{out}/gpt_oss.pt``: the gathered weights and
quantizer parameters after the build and after the steps, both ranks' losses, the expert linears.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import torch

logging.basicConfig(level=logging.INFO, format=f"[rank{os.environ.get('RANK', '?')}] %(name)s: %(message)s")


def gathered(model, zs) -> dict[str, torch.Tensor]:
    out = {}
    for name, m in zs.iter_gathered_modules(model, unit_types=()):
        for pname, p in m.named_parameters(recurse=False):
            out[f"{name}.{pname}" if name else pname] = p.data.detach().cpu().clone()
    return out


def main(spec_path: str) -> None:
    import deepspeed

    from qatlib.quant import QuantLinear, QuantScheme
    from qatlib.quant.quantizer import role_parameters
    from qatlib.zero3 import io as z
    from qatlib.zero3 import load as zl
    from qatlib.zero3 import save as zs

    spec = json.loads(Path(spec_path).read_text())
    ctx = z.init_zero3(json.loads(Path(spec["ds_config"]).read_text()), timeout_s=120)
    rank, world = z.get_rank(), z.get_world_size()
    scheme = QuantScheme.from_dict(spec["scheme"])
    model = zl.build_qat_model(spec["model"], ctx, scheme, from_ptq_ckpt=spec["ptq"], chunk_bytes=4096)
    experts = sorted(n for n, m in model.named_modules() if isinstance(m, QuantLinear) and ".experts." in n)
    before = gathered(model, zs)
    scale_ids = {id(p) for _, p in role_parameters(model)}
    for p in model.parameters():
        p.requires_grad_(id(p) in scale_ids)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=spec["lr"])
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ctx.ds_config)
    engine.train()
    data = torch.load(spec["data"])
    losses = []
    for step in range(spec["steps"]):
        x = data[step, rank]
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        both = [None] * world
        torch.distributed.all_gather_object(both, loss.item())
        losses.append(both)
    after = gathered(model, zs)
    if rank == 0:
        torch.save(
            {"experts": experts, "before": before, "after": after, "losses": losses},
            Path(spec["out"]) / "gpt_oss.pt",
        )
    torch.distributed.barrier()
    print("WORKER OK", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
