"""``python -m qatlib.plan EXPERIMENT.yaml --gpus N [--nodes M] [--json]``: the memory plan.

Exit status 0 when every stage fits, 3 when one does not (the table says which term), 1 for a
config error (``FILE: dotted.path: message``). A model term the plan cannot compute (a family or
a key `qatlib.plan.families` does not know) is a warning naming the term and the key looked for,
in the table and the JSON (``model.not_computed``, each stage's ``not_computed``); it never
changes the exit status by itself.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from . import (
    GIB,
    PlanError,
    Run,
    find_model_config,
    from_experiment,
    not_computed_warnings,
    plan,
    zero3_setting_warnings,
)
from .model import ModelShape, WeightFormat


def weight_format(scheme) -> WeightFormat:
    """The owner's resolved weight spec (`qatlib.quant.spec.QuantSpec`) as a `WeightFormat`."""
    w = scheme.weight
    if w is None:
        return WeightFormat(16)
    bits = 8 if w.qtype == "fp8" else 4 if "fp4" in w.qtype else int(w.qtype[3:])
    gran = w.granularity.value.replace("per-", "")
    return WeightFormat(bits, gran if gran in ("group", "channel") else "tensor", w.group_size or 0)


def build(args) -> tuple[ModelShape, list, list[str]]:
    from qatlib.config import load_config  # the owner of every config value (validates first)

    cfg = load_config(args.config, args.overrides)
    raw = cfg.raw  # the YAML + overrides, as the stage scripts read it
    if args.model_config:
        with open(args.model_config, encoding="utf-8") as f:
            mcfg = json.load(f)
    else:
        mcfg = find_model_config(cfg.model.model_path)
    shape = ModelShape.from_config(mcfg, args.model_config or f"{cfg.model.model_path}: config.json")
    x = from_experiment(raw, cfg.deepspeed_config, mcfg.get("torch_dtype") or mcfg.get("dtype"))
    x = replace(x, weight=weight_format(cfg.quant_scheme()))
    run = Run(
        args.gpus,
        args.nodes,
        args.ranks,
        int(args.gpu_mem_gib * GIB),
        int(args.node_mem_gib * GIB),
        args.threads,
    )
    dtype = mcfg.get("torch_dtype") or mcfg.get("dtype")
    warnings = not_computed_warnings(shape) + zero3_setting_warnings(
        shape, raw, cfg.deepspeed_config, run, dtype
    )
    return shape, plan(shape, x, run), warnings


def _gib(b: int) -> str:
    return f"{b / GIB:9.2f} GiB"


def render(shape: ModelShape, stages: list) -> str:
    lines = [
        f"model: {shape.total_params / 1e9:.2f} B params ({shape.layers} layers), "
        f"{shape.active_params / 1e9:.2f} B active per token"
    ]
    for s in stages:
        cap = f" of {s.device_capacity / GIB:.0f}" if s.device else ""
        n = s.ranks_per_node
        lines.append(
            f"\n{s.stage} ({n} process{'es' if n > 1 else ''}/node, ~{s.runtime_min} min): "
            f"device/rank {_gib(s.device_peak).strip()}{cap}, host/rank {_gib(s.host_per_rank).strip()}, "
            f"host/node {_gib(s.host_peak).strip()} of {s.host_capacity / GIB:.0f}  "
            + ("fits" if s.fits else "DOES NOT FIT")
        )
        for where, terms in (("device/rank", s.device), ("host/rank", s.host), ("host rank 0", s.node)):
            for t in terms:
                lines.append(f"  {where:11} {_gib(t.bytes)}  {t.name}" + (f"  [{t.note}]" if t.note else ""))
        lines += [f"  note: {x}" for x in s.notes]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m qatlib.plan",
        description=__doc__.splitlines()[0],
        epilog="example: python -m qatlib.plan config/experiments/qwen3-30b.yaml --gpus 8 --nodes 2",
        formatter_class=argparse.RawDescriptionHelpFormatter,  # the example stays one line
    )
    ap.add_argument("config", help="experiment YAML")
    ap.add_argument("--gpus", type=int, default=0, help="GPUs (= ranks) per node; 0: a CPU run")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--ranks", type=int, default=2, help="ranks per node of a CPU run (--gpus 0)")
    ap.add_argument("--gpu-mem-gib", type=float, default=80.0)
    ap.add_argument("--node-mem-gib", type=float, default=1024.0)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (runtime estimate of a CPU run)")
    ap.add_argument("--model-config", help="the model's config.json (default: found from model.model_path)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--json", action="store_true", help="JSON instead of the table")
    args = ap.parse_args(argv)
    if args.gpus < 0 or args.nodes < 1 or args.ranks < 1:
        ap.error("--gpus must be >= 0, --nodes and --ranks >= 1")
    try:
        shape, stages, warnings = build(args)
    except (PlanError, OSError, ValueError) as e:  # ConfigError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        out = {
            "model": {
                "total_params": shape.total_params,
                "active_params": shape.active_params,
                "layers": shape.layers,
                "model_type": shape.model_type,
                "not_computed": list(shape.not_computed),
            },
            "stages": [s.to_dict() for s in stages],
            "warnings": warnings,
        }
        print(json.dumps(out, indent=2))
    else:
        print(render(shape, stages))
        for w in warnings:
            print(f"warning: {w}")
    return 0 if all(s.fits for s in stages) else 3


if __name__ == "__main__":
    sys.exit(main())
