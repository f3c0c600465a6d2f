"""The default experiment's ZeRO-3 QAT step at 1 and at 2 ranks on the same global batch: what
sharding costs on this machine (`benchmarks.speed`'s ``zero3`` section).

Each world size runs in fresh processes (``torchrun --standalone --nproc_per_node=W`` on this
file with ``--worker``), which do what the ``zero3_qat`` stage does (`scripts/qat.py`: ZeRO-3
init, `qatlib.models.load_prepared` from the PTQ checkpoint, `qatlib.trainers.end2end.train_end2end`
with the default experiment's config), with ``max_steps`` = warm-up + timed steps and a
`StepTimer` callback: the wall time of each trainer step (forward, backward, optimizer step,
ZeRO-3 gathers and reduce-scatters), after the warm-up. Global batch ``tokens / seq`` sequences:
all on one rank, or half per rank. Not interleaved (one process group at a time): the ratio of
medians, with both spreads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENT = ROOT / "config" / "experiments" / "smollm2-135m.yaml"


def _overrides(world: int, tokens: int, seq: int, steps: int, save: str) -> list[str]:
    per_rank = tokens // seq // world
    return [
        f"global.save_path={save}",
        f"compression.QAT.hf_args.max_steps={steps}",
        f"compression.QAT.hf_args.per_device_train_batch_size={per_rank}",
        "compression.QAT.hf_args.gradient_accumulation_steps=1",
        f"compression.QAT.hf_args.logging_steps={steps}",
        "compression.QAT.hf_args.warmup_steps=0",
        "compression.QAT.hf_args.disable_tqdm=true",
        f"dataset.num_samples={steps * per_rank * world}",
        f"dataset.max_seq_length={seq}",
    ]


def worker(args: argparse.Namespace) -> None:
    """One rank: the ``zero3_qat`` stage's steps (scripts/qat.py), each timed by a callback."""
    import torch
    from transformers import TrainerCallback

    from qatlib.config import load_config
    from qatlib.data import training_data_from_config
    from qatlib.models import load_prepared, load_tokenizer, resolve_model_dir
    from qatlib.surgery.modeling import resolve_dtype
    from qatlib.trainers.end2end import train_end2end
    from qatlib.zero3 import io as z

    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, overrides=json.loads(args.overrides))
    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

    ctx = z.init_zero3(cfg.deepspeed_config, dtype=resolve_dtype(cfg.model.torch_dtype))
    with ctx:
        model_dir = resolve_model_dir(cfg.model.model_path, cache_dir=cfg.model.cache_dir)
        model, _ = load_prepared(cfg, model_dir, scales=cfg.qat.from_ptq_ckpt, zero3=ctx)
        tok = load_tokenizer(model_dir, trust_remote_code=cfg.model.trust_remote_code)
        data = training_data_from_config(cfg, tok)
        train_end2end(
            cfg,
            model,
            tok,
            data,
            scales_loaded=True,
            args_overrides={"output_dir": str(Path(cfg.global_.save_path) / "run")},
            callbacks=[StepTimer()],
            zero3_ctx=ctx,
        )
        if z.get_rank() == 0:
            Path(args.worker_out).write_text(json.dumps({"world": z.get_world_size(), "step_s": times}))


def run_world(world: int, tokens: int, seq: int, warmup: int, repeats: int, threads: int) -> dict[str, Any]:
    """One torchrun of ``world`` ranks; the timed steps' seconds (rank 0's clock)."""
    with tempfile.TemporaryDirectory(prefix="bench-zero3-") as d:
        out = Path(d) / "times.json"
        ov = _overrides(world, tokens, seq, warmup + repeats, str(Path(d) / "qat"))
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={world}",
            str(Path(__file__).resolve()),
            "--worker",
            "--config",
            str(EXPERIMENT),
            "--overrides",
            json.dumps(ov),
            "--worker-out",
            str(out),
            "--threads",
            str(threads),
        ]
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        t0 = time.perf_counter()
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
        wall = time.perf_counter() - t0
        if r.returncode != 0 or not out.is_file():
            return {"world": world, "failed": f"rc {r.returncode}: {r.stderr[-1500:]}"}
        rec = json.loads(out.read_text())
    steps = rec["step_s"][warmup:]
    return {
        "world": world,
        "per_rank_batch": tokens // seq // world,
        "step_s_median": round(statistics.median(steps), 3),
        "step_s_min": round(min(steps), 3),
        "step_s_max": round(max(steps), 3),
        "steps_timed": len(steps),
        "warmup_steps": warmup,
        "process_wall_s": round(wall, 1),
    }


def zero3_rows(s, results: str = "results") -> dict[str, Any]:
    """``{"one", "two", "two_over_one", ...}``: the default experiment's ZeRO-3 step at 1 and 2
    ranks, ``s.zero3_tokens`` tokens per step (sequences of ``s.seq``)."""
    from .common import log

    ptq = Path(results) / "smollm2-135m" / "ptq"
    if not (ptq / "quant_scheme.json").is_file():
        return {"skipped": f"no {ptq}: run the default DAG's ptq_calibrate first"}
    rows = {}
    for world in (1, 2):
        log(f"speed: ZeRO-3 step, {world} rank(s), {s.zero3_tokens} tokens per step")
        rows[world] = run_world(world, s.zero3_tokens, s.seq, 1, s.zero3_repeats, s.threads or 1)
    one, two = rows[1], rows[2]
    ratio = None
    if "step_s_median" in one and "step_s_median" in two:
        ratio = round(two["step_s_median"] / one["step_s_median"], 4)
    return {
        "experiment": str(EXPERIMENT.relative_to(ROOT)),
        "tokens_per_step": s.zero3_tokens,
        "threads_per_rank": s.threads or 1,
        "one": one,
        "two": two,
        "two_over_one": ratio,
        "note": "the global batch is the same; 2 ranks use both cores (one thread each), 1 rank one "
        "core: the ratio is the step time, not the CPU time. Not interleaved: separate process groups",
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--config")
    ap.add_argument("--overrides")
    ap.add_argument("--worker-out")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.worker:
        worker(args)


if __name__ == "__main__":
    main()
