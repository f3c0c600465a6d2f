"""2-rank ZeRO-3 worker (torchrun): every bad input must be the same clear error on both ranks.

Usage: torchrun --standalone --nproc_per_node=2 bad_inputs.py SPEC.json

Each case runs on both ranks; a `Zero3Error` is caught, printed as ``[rankN] CASE name: ...`` on
stderr and recorded, then a barrier proves the process group is still in step. Rank 0 writes
``{out}/bad_inputs.json``. The last case (``fatal``) is not caught: the run must end with a nonzero
status and both ranks' message on stderr, well before the 60 s collective timeout.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from cases import run_cases


def say(line: str) -> None:
    """One line to stderr in ONE write: both ranks share the pipe, and ``print`` writes the text and
    its newline separately, so the other rank's line could land in between (seen in CI)."""
    os.write(2, (line + "\n").encode())


def main() -> None:
    from qatlib.quant import QuantScheme
    from qatlib.zero3 import io as z
    from qatlib.zero3 import load as zl

    spec = json.loads(Path(sys.argv[1]).read_text())
    scheme = QuantScheme.from_dict(spec["scheme"])
    ctx = z.init_zero3(spec["ds_config"], timeout_s=60)
    rank = z.get_rank()
    model = zl.build_empty_model(spec["model"], ctx)
    state = {"prepared": False}

    def prepared():
        if not state["prepared"]:
            zl.prepare_zero3(model, scheme, ctx)
            state["prepared"] = True
        return model

    cases = {
        "missing_key": lambda: zl.stream_load_weights(model, spec["missing_key"]),
        "shape_mismatch": lambda: zl.stream_load_weights(model, spec["shape_mismatch"]),
        "unexpected_key": lambda: zl.stream_load_weights(model, spec["unexpected_key"]),
        "truncated": lambda: zl.stream_load_weights(model, spec["truncated"]),
        "ptq_other_format": lambda: zl.stream_load_scales(prepared(), spec["ptq_other_format"], scheme),
        "ptq_scale_shape": lambda: zl.stream_load_scales(prepared(), spec["ptq_scale_shape"], scheme),
        "ptq_missing_dir": lambda: zl.stream_load_scales(prepared(), spec["ptq_missing_dir"], scheme),
        "no_ptq_ckpt": lambda: zl.build_qat_model(spec["model"], ctx, scheme, from_ptq_ckpt=None),
        "ptq_other_format_build": lambda: zl.build_qat_model(
            spec["model"], ctx, scheme, from_ptq_ckpt=spec["ptq_other_format"]
        ),
        "optimizer_block": lambda: z.init_zero3(spec["ds_config_with_optimizer"]),
    }
    results = run_cases(cases, z.Zero3Error, say=lambda line: say(f"[rank{rank}] {line}"))
    everyone = [None] * z.get_world_size()
    torch.distributed.all_gather_object(everyone, results)
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps(everyone, indent=1))
    torch.distributed.barrier()
    say(f"[rank{rank}] CASES DONE")
    try:  # the uncaught one
        zl.stream_load_weights(
            model if not state["prepared"] else zl.build_empty_model(spec["model"], ctx), spec["truncated"]
        )
    except Exception as e:
        say(f"[rank{rank}] FATAL {type(e).__name__}: {str(e).splitlines()[0]}")
        # Both ranks hold the same verdict (rank 0 decides and broadcasts it); wait until both have
        # reported it, else torchrun may SIGTERM the slower rank as soon as the first one exits.
        if isinstance(e, z.Zero3Error):
            torch.distributed.barrier()
        raise
    print(f"[rank{rank}] UNEXPECTED: the truncated checkpoint loaded", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
