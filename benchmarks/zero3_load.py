"""Peak RSS per rank while loading a ~1 GB Qwen3 checkpoint under ZeRO-3 on 2 CPU ranks:
qatlib's streaming loader (`zero3_load.load_model`) vs transformers' ``from_pretrained`` under ZeRO-3.

    python benchmarks/zero3_load.py [--size-gb 1.0] [--out results/bench/zero3_load.json]

Builds a random bf16 Qwen3 from a config (once; reused from --workdir), saves it in shards, then
launches ``torchrun --nproc_per_node=2`` once per loader (this same file with ``--worker``), so each
loader's peak is measured in fresh processes. Each rank records ``ru_maxrss`` before and after the
load; the increment is compared with the target ``1.2 * model_bytes / world + largest tensor``
(and with ``world * model_bytes``, what a full per-rank state dict would cost).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DS_CONFIG = ROOT / "config" / "deepspeed" / "zero3_cpu_test.json"
# qatlib: zero3_load.load_model; qatlib_glibc_default: the same without init_zero3's mmap threshold;
# hf: AutoModelForCausalLM.from_pretrained under the registered ZeRO-3 config.
MODES = ("qatlib", "qatlib_glibc_default", "hf")


def qwen3_config(size_gb: float):
    from transformers import Qwen3Config

    hidden, inter, vocab = 1024, 3072, 32000
    per_layer = (
        2 * hidden * hidden + 2 * hidden * 512 + 3 * hidden * inter + 4 * hidden
    )  # q,o + k,v + mlp + norms
    layers = max(1, round((size_gb * 1e9 / 2 - 2 * vocab * hidden) / per_layer))
    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )


def make_checkpoint(model_dir: Path, size_gb: float) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    if (model_dir / "model.safetensors.index.json").is_file():
        return
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(qwen3_config(size_gb), dtype=torch.bfloat16)
    model.save_pretrained(model_dir, max_shard_size="300MB")


def worker(mode: str, model_dir: Path, out: Path) -> None:
    import torch

    from benchmarks.common import warmup_qwen3_config  # the parent puts the repo on PYTHONPATH
    from qatlib.zero3 import io as z
    from qatlib.zero3 import load as zl

    cfg = json.loads(DS_CONFIG.read_text())
    cfg["bf16"] = {"enabled": True}  # both loaders build bf16 partitions (from_pretrained reads this config)
    ctx = z.init_zero3(cfg, timeout_s=600, return_freed_memory=mode != "qatlib_glibc_default")
    rank = z.get_rank()
    # Warm-up: build a tiny model of the same class, so the baseline holds the modules both loaders
    # import on first use (~0.13 GiB) and the increment is the weights' cost alone.
    zl.build_empty_model(warmup_qwen3_config(), ctx)
    torch.distributed.barrier()
    before = z.peak_rss_bytes()
    t0 = time.perf_counter()
    if mode.startswith("qatlib"):
        model = zl.load_model(model_dir, ctx)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    seconds = time.perf_counter() - t0
    after = z.peak_rss_bytes()
    held = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in model.parameters())
    # a spot check that both loaders produced the same (full) weights
    w = model.model.layers[0].mlp.down_proj.weight
    with z.gathered_param_if_zero3(w):
        checksum = float(w.float().sum())
    rec = {
        "rank": rank,
        "rss_before": before,
        "rss_peak": after,
        "rss_increment": after - before,
        "seconds": round(seconds, 2),
        "param_bytes_held": held,
        "checksum": checksum,
    }
    everyone = [None] * z.get_world_size()
    torch.distributed.all_gather_object(everyone, rec)
    if rank == 0:
        out.write_text(json.dumps(everyone))
    del ctx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument(
        "--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "qatlib_zero3_bench"
    )
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "bench" / "zero3_load.json")
    ap.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    model_dir = args.workdir / f"qwen3_{args.size_gb:g}gb"
    if args.worker:
        worker(args.worker, model_dir, args.worker_out)
        return

    import deepspeed
    import torch
    import transformers

    from qatlib.checkpoint import safetensors as st
    from qatlib.checkpoint.layout import weight_files

    args.workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    make_checkpoint(model_dir, args.size_gb)
    build_s = time.perf_counter() - t0
    # run as a file, this process cannot import `benchmarks` (its workers can): `common.tensor_bytes`'s lines
    sizes = [i.end - i.start for f in weight_files(model_dir) for i in st.read_header(f)]
    model_bytes, largest = sum(sizes), max(sizes)
    world = 2
    target = 1.2 * model_bytes / world + largest
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    loaders = {}
    for mode in MODES:
        wout = args.workdir / f"{mode}.json"
        wout.unlink(missing_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={world}",
            __file__,
            "--size-gb",
            str(args.size_gb),
            "--workdir",
            str(args.workdir),
            "--worker",
            mode,
            "--worker-out",
            str(wout),
        ]
        t1 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            sys.exit(f"{mode} loader failed:\n{proc.stderr[-4000:]}")
        ranks = json.loads(wout.read_text())
        loaders[mode] = {
            "launch_seconds": round(time.perf_counter() - t1, 1),
            "ranks": ranks,
            "max_rss_increment": max(r["rss_increment"] for r in ranks),
            "max_rss_peak": max(r["rss_peak"] for r in ranks),
            "within_target": max(r["rss_increment"] for r in ranks) <= target,
        }
    result = {
        "model": {
            "dir": str(model_dir),
            "config": {
                k: v
                for k, v in qwen3_config(args.size_gb).to_dict().items()
                if k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")
            },
            "bytes": model_bytes,
            "largest_tensor_bytes": largest,
            "dtype": "bfloat16",
            "build_and_save_seconds": round(build_s, 1),
        },
        "world_size": world,
        "target_rss_increment": target,
        "target_formula": "1.2 * model_bytes / world + largest_tensor_bytes",
        "world_times_model_bytes": world * model_bytes,
        "loaders": loaders,
        "same_weights": loaders["qatlib"]["ranks"][0]["checksum"] == loaders["hf"]["ranks"][0]["checksum"],
        "env": {
            "cpu_count": os.cpu_count(),
            "omp_num_threads_per_rank": 1,
            "torch_threads_parent": torch.get_num_threads(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "deepspeed": deepspeed.__version__,
            "ds_config": str(DS_CONFIG.relative_to(ROOT)),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    gib = 2**30
    print(
        f"model {model_bytes / gib:.2f} GiB, largest tensor {largest / 2**20:.0f} MiB, target increment "
        f"{target / gib:.2f} GiB/rank, world x model {world * model_bytes / gib:.2f} GiB"
    )
    for mode, r in loaders.items():
        print(
            f"{mode:20s}: peak RSS increment per rank "
            + ", ".join(f"{x['rss_increment'] / gib:.2f}" for x in r["ranks"])
            + f" GiB (peak {r['max_rss_peak'] / gib:.2f} GiB), load {max(x['seconds'] for x in r['ranks']):.1f} s, "
            f"within target: {r['within_target']}"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
