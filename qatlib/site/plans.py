"""The memory plan of the shipped Qwen3-30B-A3B recipes on one node of 8 x 80 GB GPUs
(docs/how-to/memory-plan.md): `qatlib.plan`'s arithmetic, run here, so the page says what
``python -m qatlib.plan config/experiments/<name>.yaml --gpus 8`` prints today."""

from __future__ import annotations

import argparse
from pathlib import Path

EXPERIMENTS = ("qwen3-30b", "qwen3-30b-w4a8", "qwen3-30b-int4")
GPUS = 8
GPU_MEM_GIB = 80.0
NODE_MEM_GIB = 1024.0
GIB = 2**30


def _plan(repo: Path, experiment: str):
    from qatlib.plan.__main__ import build  # the CLI's own assembly: config -> shape -> stages

    args = argparse.Namespace(
        config=str(repo / "config/experiments" / f"{experiment}.yaml"),
        overrides=[],
        model_config=None,
        gpus=GPUS,
        nodes=1,
        ranks=2,
        gpu_mem_gib=GPU_MEM_GIB,
        node_mem_gib=NODE_MEM_GIB,
        threads=2,
    )
    _, stages, _ = build(args)
    return stages


def _cell(s) -> str:
    host = f"{s.host_peak / GIB:.1f} GiB host/node"
    if not s.device:
        return host
    per = "GPU" if s.ranks_per_node == 1 else "GPU/rank"
    return f"{s.device_peak / GIB:.1f} GiB {per}, {host}" + ("" if s.fits else " **DOES NOT FIT**")


def render(repo: Path) -> str:
    plans = {e: _plan(repo, e) for e in EXPERIMENTS}
    stages = [s.stage for s in plans[EXPERIMENTS[0]]]
    lines = [
        "| stage | " + " | ".join(f"`{e}`" for e in EXPERIMENTS) + " |",
        "|---" * (1 + len(EXPERIMENTS)) + "|",
    ]
    for i, name in enumerate(stages):
        n = plans[EXPERIMENTS[0]][i].ranks_per_node
        label = f"{name} ({n} rank{'s' if n > 1 else ''})"
        lines.append(f"| {label} | " + " | ".join(_cell(plans[e][i]) for e in EXPERIMENTS) + " |")
    return "\n".join(lines)
