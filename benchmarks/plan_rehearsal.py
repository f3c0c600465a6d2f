"""The real-width rehearsal, measured against the memory plan (#16): peak RSS per rank per stage
beside `qatlib.plan`'s prediction, as ratios, in one run.

    python -m benchmarks.plan_rehearsal --layers 2 --stages ptq_calibrate,zero3_qat,convert_export
        [--experiment qwen3-30b-a3b-width] [--also-deepspeed UPSTREAM_JSON] [--limit-gb 5.5]
        [--out results/bench] [--set KEY=VALUE ...]

Writes a random Qwen3-30B-A3B-width model (`qatlib.offline.width_model`, ``--layers`` layers) and a
small text corpus from the repository's own docs (train / calibration text and the tokenizer's),
then runs each stage's script as the workflow does (``scripts/ptq.py``; ``torchrun`` with 2 ranks
for ``scripts/qat.py``; ``scripts/export.py``; ``scripts/evaluate.py --variant qat``), sampling every process's RSS (psutil, 0.2 s). A
stage whose process tree passes ``--limit-gb`` is stopped and recorded as such (a shared machine:
never let one run take the others' memory). Each stage's record: measured peak per rank, the
plan's per-rank (and rank 0) prediction, measured / predicted (target: within +-25%), and issue
#36's bound for the path a user runs (no flags; M = the model's bytes): PTQ <= 1.1 M + 0.5 GiB,
QAT <= 0.6 M + 1.5 GiB per rank, export <= 0.8 M + 1 GiB.

``--also-deepspeed JSON`` (repeatable) runs the ZeRO-3 stage again with that DeepSpeed file instead
of the experiment's (e.g. upstream AngelSlim's ``ds_config_zero3.json``, unchanged), recorded as
``zero3_qat@<file>``, each against the plan for that JSON.

``--before-ref REF`` also runs the ZeRO-3 stage with the code at ``REF`` (``git archive`` of its
``qatlib``, ``scripts`` and ``config``) on the same model, PTQ checkpoint and text, right after this
checkout's, and records both steps' time (HF's ``train_runtime``) and their ratio: issue #16's
"step >= 5x faster" as a ratio in one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import REPO, log, machine, write_result

STAGES = ("ptq_calibrate", "zero3_qat", "convert_export", "evaluate")
TARGET = 0.25
UPSTREAM_DS = "tests/data/upstream/configs/qwen3/qat/fp8_static/learn_scale/ds_config_zero3.json"
# issue #36's bounds on the path a user runs, per rank: (x M, + GiB)
BOUNDS = {"ptq_calibrate": (1.1, 0.5), "zero3_qat": (0.6, 1.5), "convert_export": (0.8, 1.0)}


def model_bytes(model_dir: Path) -> int:
    """M: the bytes of the model's weights (its safetensors files)."""
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))


def _hwm(pid: int) -> int:
    """The kernel's peak resident set of ``pid`` (VmHWM): no spike between two samples is missed."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _rss_file(pid: int) -> int:
    """The file-backed part of ``pid``'s resident set now (RssFile: mapped file pages, e.g. an
    mmap'ed safetensors shard; page cache the kernel can drop, unlike RssAnon)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssFile:"))


def watch(
    cmd: list[str], limit: int, env: dict[str, str], log_path: Path, cwd: Path = REPO
) -> dict[str, Any]:
    """Run ``cmd``: each process's peak RSS (VmHWM, by pid), the tree stopped once its current RSS
    passes ``limit`` bytes."""
    import psutil

    t0 = time.perf_counter()
    peaks: dict[int, tuple[int, str]] = {}
    file_peak: dict[int, int] = {}  # sampled: the largest RssFile seen per pid
    killed = False
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=logf, stderr=subprocess.STDOUT)
        top = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                tree = [top, *top.children(recursive=True)]
                now = 0
                for p in tree:
                    now += p.memory_info().rss
                    name = peaks.get(p.pid, (0, ""))[1] or " ".join(p.cmdline())  # the first name
                    peaks[p.pid] = (max(_hwm(p.pid), peaks.get(p.pid, (0,))[0]), name)
                    file_peak[p.pid] = max(_rss_file(p.pid), file_peak.get(p.pid, 0))
            except (psutil.Error, OSError, StopIteration):  # a process ending between two reads
                time.sleep(0.2)
                continue
            if now > limit:
                killed = True
                for p in reversed(tree):
                    with contextlib.suppress(psutil.Error):
                        p.kill()
            time.sleep(0.2)
    # the ranks: the processes that run the script (torchrun's own launcher process excluded)
    script = Path(next(c for c in cmd if c.startswith("scripts/"))).name
    rank_pids = [pid for pid, (_, c) in peaks.items() if script in c and "torch.distributed.run" not in c]
    ranks = sorted((peaks[pid][0] for pid in rank_pids), reverse=True)
    return {
        "rc": proc.returncode,
        "killed_at_limit": killed,
        "wall_s": time.perf_counter() - t0,
        "peak_rss_per_rank": ranks,
        "peak_rss_file_per_rank": sorted((file_peak.get(pid, 0) for pid in rank_pids), reverse=True),
        "log": str(log_path),
    }


def corpus(d: Path) -> Path:
    """train.txt / test.txt from the repository's documentation (no download, a few 100 kB)."""
    text = "\n\n".join(
        p.read_text(encoding="utf-8") for p in sorted(REPO.glob("**/*.md")) if ".git" not in p.parts
    )
    d.mkdir(parents=True, exist_ok=True)
    (d / "train.txt").write_text(text, encoding="utf-8")
    (d / "test.txt").write_text(text[: len(text) // 4], encoding="utf-8")
    return d


def predicted(exp: Path, sets: list[str], model_dir: Path) -> dict[str, Any]:
    from qatlib import plan as qp
    from qatlib.config import load_config

    cfg = load_config(exp, sets)  # the DeepSpeed config as the run resolves it (qatlib's defaults)
    raw, ds = cfg.raw, cfg.deepspeed_config
    mcfg = qp.find_model_config(str(model_dir))
    stages = qp.plan(
        qp.ModelShape.from_config(mcfg), qp.from_experiment(raw, ds), qp.Run(gpus=0, cpu_ranks=2)
    )
    return {
        s.stage: {"per_rank": s.host_per_rank, "rank0": s.host_rank0, "node": s.host_peak} for s in stages
    }


def step_seconds(log_path: Path) -> float | None:
    """The QAT stage's training time (HF Trainer's ``train_runtime``, printed by rank 0)."""
    m = re.search(r"'train_runtime': '?([0-9.]+)", log_path.read_text(errors="replace"))
    return None if m is None else float(m.group(1))


def extract(ref: str, work: Path) -> Path:
    """The code at git ``ref`` (``qatlib``, ``scripts``, ``config``) in a folder of ``work``,
    written whole or not at all (a reused folder is never a half-extracted one). A ``ref`` that
    is not a commit stops before any stage runs."""
    from qatlib.checkpoint.layout import AtomicDir

    rev = subprocess.run(
        ["git", "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if rev.returncode != 0:
        raise SystemExit(f"--before-ref {ref!r}: not a commit of {REPO}")
    sha = rev.stdout.strip()
    dest = work / f"before-{sha[:12]}"
    if not (dest / "qatlib").is_dir():
        with AtomicDir(dest, overwrite=True) as tmp:
            tar = subprocess.run(
                ["git", "archive", sha, "qatlib", "scripts", "config"],
                cwd=REPO,
                capture_output=True,
                check=True,
            )
            subprocess.run(["tar", "-x", "-C", str(tmp)], input=tar.stdout, check=True)
    return dest


def run(
    layers: int,
    stages: list[str],
    experiment: str,
    limit_gb: float,
    work: Path,
    extra: list[str] = (),
    before: Path | None = None,
    also_ds: list[str] = (),
) -> dict[str, Any]:
    from qatlib.offline.width_model import write_random_model

    exp = REPO / f"config/experiments/{experiment}.yaml"
    text = corpus(work / "corpus")
    model = work / f"model-{layers}l"
    if not (model / "config.json").is_file():
        log(f"writing a {layers}-layer width model to {model}")
        write_random_model(
            REPO / "config/models/Qwen--Qwen3-30B-A3B/config.json",
            model,
            num_hidden_layers=layers,
            corpus_dir=text,
        )
    sets = [
        f"dataset.data_path={text / 'train.txt'}",
        f"evaluation.ppl=[{text / 'test.txt'}]",
        f"model.model_path={model}",
        f"compression.QAT.from_ptq_ckpt={work / 'ptq'}",
        *extra,
    ]
    plan = predicted(exp, sets, model)
    m_bytes = model_bytes(model)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    base = ["-c", str(exp), *(f"--set={s}" for s in sets), "--no-progress"]
    cmds = {
        "ptq_calibrate": [
            sys.executable,
            "scripts/ptq.py",
            *base,
            "--save-path",
            str(work / "ptq"),
            "--overwrite",  # streamed by default, as the plan models it
        ],
        "zero3_qat": [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "scripts/qat.py",
            *base,
            "--from-ptq-ckpt",
            str(work / "ptq"),
            "--save-path",
            str(work / "qat"),
            "--run-dir",
            str(work / "qat_run"),
            "--threads",
            "1",
        ],
        "convert_export": [
            sys.executable,
            "scripts/export.py",
            *base,
            "--model-path",
            str(work / "qat"),
            "--save-path",
            str(work / "export"),
            "--overwrite",
        ],
        # the qat variant: the whole model resident, fake-quantized (the plan's peak over the variants)
        "evaluate": [
            sys.executable,
            "scripts/evaluate.py",
            *base,
            "--variant",
            "qat",
            "--model-path",
            str(work / "qat"),
            "--scales",
            str(work / "qat"),
            "--out",
            str(work / "eval_qat.json"),
        ],
    }
    runs = [(stage, stage, cmds[stage], plan[stage]) for stage in stages]
    if "zero3_qat" in stages:  # the same stage with each other DeepSpeed JSON, right after it
        at = next(i for i, r in enumerate(runs) if r[0] == "zero3_qat") + 1
        for path in also_ds:
            ds_set = f"compression.QAT.hf_args.deepspeed={Path(path).resolve()}"
            cmd = [*cmds["zero3_qat"], f"--set={ds_set}"]
            p = predicted(exp, [*sets, ds_set], model)["zero3_qat"]
            runs.insert(at, (f"zero3_qat@{Path(path).name}", "zero3_qat", cmd, p))
            at += 1
    out: dict[str, Any] = {"model_bytes": m_bytes}
    for name, stage, cmd, p in runs:
        log(f"{name} ...")
        m = watch(cmd, int(limit_gb * 2**30), env, work / f"{name}.log")
        # rank 0 also holds the consolidated save's buffer (the plan's "rank0" figure): the largest
        # peak is taken as rank 0's (peaks are sorted, not by rank), the others against "per_rank"
        want = [p["rank0"]] + [p["per_rank"]] * (len(m["peak_rss_per_rank"]) - 1)
        ratio = [r / w for r, w in zip(m["peak_rss_per_rank"], want, strict=True)]
        ok = m["rc"] == 0 and all(abs(x - 1) <= TARGET for x in ratio)
        out[name] = {**m, "predicted": p, "measured_over_predicted": ratio, "within_25pct": ok}
        if stage in BOUNDS:
            k, gib = BOUNDS[stage]
            bound = k * m_bytes + gib * 2**30
            out[name].update(bound=bound, meets_bound=m["rc"] == 0 and max(m["peak_rss_per_rank"]) <= bound)
        log(
            f"{name}: rc {m['rc']}, peaks {[round(r / 2**30, 2) for r in m['peak_rss_per_rank']]} GiB, "
            f"predicted {p['per_rank'] / 2**30:.2f} GiB/rank (rank 0 {p['rank0'] / 2**30:.2f})"
            + (f", bound {out[name]['bound'] / 2**30:.2f} GiB" if "bound" in out[name] else "")
        )
        if stage == "zero3_qat":
            out[name]["step_s"] = step_seconds(work / f"{name}.log")
        (work / "plan_rehearsal.partial.json").write_text(json.dumps(out, indent=2))  # a kill loses little
        if m["rc"] != 0:
            break  # the next stage needs this one's output
    if before is not None and out.get("zero3_qat", {}).get("rc") == 0:
        # the same stage, model, PTQ checkpoint and text with the older code (its own experiment file)
        cmd = list(cmds["zero3_qat"])
        cmd[cmd.index("-c") + 1] = str(before / f"config/experiments/{experiment}.yaml")
        for flag, name in (("--save-path", "qat_before"), ("--run-dir", "qat_run_before")):
            cmd[cmd.index(flag) + 1] = str(work / name)
        log(f"zero3_qat with the code at {before.name} ...")
        m = watch(cmd, int(limit_gb * 2**30), {**env, "PYTHONPATH": str(before)}, work / "before.log", before)
        after_s, before_s = out["zero3_qat"]["step_s"], step_seconds(work / "before.log")
        out["zero3_qat_before"] = {**m, "code": before.name, "step_s": before_s}
        out["step_speedup"] = None if not (after_s and before_s) else before_s / after_s
        log(f"step {before_s} s before, {after_s} s now: {out['step_speedup']}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--experiment", default="qwen3-30b-a3b-width")
    ap.add_argument("--limit-gb", type=float, default=5.5, help="stop a stage whose process tree passes this")
    ap.add_argument("--work", default=None, help="working folder (default: a temporary one)")
    ap.add_argument("--out", default="results/bench")
    ap.add_argument(
        "--set", action="append", default=[], help="experiment override (all stages and the plan)"
    )
    ap.add_argument("--before-ref", help="git ref whose ZeRO-3 stage is timed against this checkout's")
    ap.add_argument(
        "--also-deepspeed",
        action="append",
        default=[],
        metavar="JSON",
        help=f"run the ZeRO-3 stage again with this DeepSpeed file (e.g. upstream's {UPSTREAM_DS})",
    )
    args = ap.parse_args(argv)
    for path in args.also_deepspeed:
        if not Path(path).is_file():
            ap.error(f"--also-deepspeed: {path} is not a file")
    stages = [s for s in args.stages.split(",") if s]
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        ap.error(f"--stages: unknown {unknown} (choose from {', '.join(STAGES)})")
    work = Path(args.work or tempfile.mkdtemp(prefix="plan-rehearsal-"))
    before = extract(args.before_ref, work) if args.before_ref else None
    results = run(
        args.layers, stages, args.experiment, args.limit_gb, work, args.set, before, args.also_deepspeed
    )
    settings = {"layers": args.layers, "experiment": args.experiment, "limit_gb": args.limit_gb, "ranks": 2}
    settings["before_ref"] = args.before_ref
    settings["overrides"] = args.set
    settings["also_deepspeed"] = args.also_deepspeed
    path = write_result(
        args.out, "plan_rehearsal", {"machine": machine(), "settings": settings, "stages": results}
    )
    log(f"wrote {path}")
    ran = [r for r in results.values() if isinstance(r, dict) and "within_25pct" in r]
    return 0 if all(r["within_25pct"] and r.get("meets_bound", True) for r in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
