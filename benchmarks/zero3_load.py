"""Peak RSS per rank while loading a ~1 GB Qwen3 checkpoint under ZeRO-3 on 2 CPU ranks:
qatlib's streaming loader (`zero3_load.load_model`) vs transformers' ``from_pretrained`` under ZeRO-3.

    python benchmarks/zero3_load.py [--size-gb 1.0] [--out results/bench/zero3_load.json]
    python -m benchmarks.zero3_load --moe [--size-gb 1.0]   # -> results/bench/zero3_load_moe.json

Builds a random bf16 Qwen3 from a config (once; reused from --workdir), saves it in shards, then
launches ``torchrun --nproc_per_node=2`` once per loader (this same file with ``--worker``), so each
loader's peak is measured in fresh processes. Each rank records ``ru_maxrss`` before and after the
load; the increment is compared with the target ``1.2 * model_bytes / world + largest tensor``
(and with ``world * model_bytes``, what a full per-rank state dict would cost).

``--moe``: the same measurement for qatlib's loader on two MoE checkpoints of the same shapes and
bytes: Qwen3-MoE (per-expert keys that are the linearised experts' own names) and Mixtral in the
hub layout (``block_sparse_moe.experts.{e}.w1|w2|w3.weight``, which the loader places through
transformers' key conversion, `qatlib.checkpoint.conversion`). The ratio of their per-rank peak
increments says whether the conversion costs memory (it should not: each tensor is read once,
into its own expert linear).
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


MOE_FAMILIES = ("qwen3_moe", "mixtral")


def moe_config(family: str, size_gb: float, warmup: bool = False):
    """Qwen3-MoE or Mixtral with the same tensors (16 experts of width 512, hidden 1024), layers for
    ``size_gb`` bf16; ``warmup``: a 1-layer tiny one of the same class."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    hidden, inter, experts, vocab = (64, 32, 4, 128) if warmup else (1024, 512, 16, 32000)
    per_layer = (
        experts * 3 * hidden * inter + 2 * hidden * hidden + 2 * hidden * hidden // 2 + experts * hidden
    )
    layers = 1 if warmup else max(1, round((size_gb * 1e9 / 2 - 2 * vocab * hidden) / per_layer))
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=16 if not warmup else 4,
        num_key_value_heads=8 if not warmup else 2,
        head_dim=hidden // (16 if not warmup else 4),
        num_experts_per_tok=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    if family == "qwen3_moe":
        return Qwen3MoeConfig(moe_intermediate_size=inter, num_experts=experts, **common)
    return MixtralConfig(intermediate_size=inter, num_local_experts=experts, **common)


def config_for(family: str, size_gb: float):
    return qwen3_config(size_gb) if family == "qwen3" else moe_config(family, size_gb)


def make_checkpoint(model_dir: Path, size_gb: float, family: str = "qwen3") -> None:
    import torch
    from transformers import AutoModelForCausalLM

    if (model_dir / "model.safetensors.index.json").is_file():
        return
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_for(family, size_gb), dtype=torch.bfloat16)
    model.save_pretrained(model_dir, max_shard_size="300MB")


def worker(mode: str, model_dir: Path, out: Path, family: str = "qwen3") -> None:
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
    zl.build_empty_model(
        warmup_qwen3_config() if family == "qwen3" else moe_config(family, 0, warmup=True), ctx
    )
    torch.distributed.barrier()
    before = z.peak_rss_bytes()
    t0 = time.perf_counter()
    built = None  # peak after the empty build, before any weight is read (qatlib's loader only)
    if mode.startswith("qatlib"):
        model = zl.build_empty_model(model_dir, ctx)  # = zl.load_model, in its two steps
        built = z.peak_rss_bytes()
        zl.stream_load_weights(model, model_dir)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    seconds = time.perf_counter() - t0
    after = z.peak_rss_bytes()
    held = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in model.parameters())
    # a spot check that both loaders produced the same (full) weights
    mlp = model.model.layers[0].mlp
    w = mlp.down_proj.weight if family == "qwen3" else mlp.experts[0].down_proj.weight
    with z.gathered_param_if_zero3(w):
        checksum = float(w.float().sum())
    rec = {
        "rank": rank,
        "rss_before": before,
        "rss_peak": after,
        "rss_increment": after - before,
        "rss_increment_build": None if built is None else built - before,
        "seconds": round(seconds, 2),
        "param_bytes_held": held,
        "checksum": checksum,
    }
    everyone = [None] * z.get_world_size()
    torch.distributed.all_gather_object(everyone, rec)
    if rank == 0:
        out.write_text(json.dumps(everyone))
    del model
    ctx.close()  # the process group ends before the interpreter: an open gloo group aborts at exit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument(
        "--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "qatlib_zero3_bench"
    )
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "bench" / "zero3_load.json")
    ap.add_argument("--moe", action="store_true", help="Qwen3-MoE vs Mixtral's hub layout (qatlib's loader)")
    ap.add_argument("--family", default="qwen3", choices=("qwen3", *MOE_FAMILIES), help=argparse.SUPPRESS)
    ap.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    model_dir = args.workdir / f"{args.family}_{args.size_gb:g}gb"
    if args.worker:
        worker(args.worker, model_dir, args.worker_out, args.family)
        return
    if args.moe:
        main_moe(args)
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


def _launch(args, mode: str, family: str, wout: Path) -> list[dict]:
    """One torchrun of this file's worker (fresh processes: each loader's own peak)."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    wout.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
           "--size-gb", str(args.size_gb), "--workdir", str(args.workdir), "--family", family,
           "--worker", mode, "--worker-out", str(wout)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"{family} {mode} loader failed:\n{proc.stderr[-4000:]}")
    return json.loads(wout.read_text())


def main_moe(args) -> None:
    """qatlib's streamed ZeRO-3 load of a Qwen3-MoE checkpoint and of a Mixtral hub-layout one of
    the same shapes: per-rank peak RSS increments and their ratio."""
    import torch
    import transformers

    from qatlib.checkpoint import safetensors as st
    from qatlib.checkpoint.layout import weight_files

    args.workdir.mkdir(parents=True, exist_ok=True)
    out = (
        args.out
        if args.out != ROOT / "results" / "bench" / "zero3_load.json"
        else ROOT / "results" / "bench" / "zero3_load_moe.json"
    )
    families = {}
    for family in MOE_FAMILIES:
        model_dir = args.workdir / f"{family}_{args.size_gb:g}gb"
        t0 = time.perf_counter()
        make_checkpoint(model_dir, args.size_gb, family)
        sizes = [i.end - i.start for f in weight_files(model_dir) for i in st.read_header(f)]
        keys = [i.key for f in weight_files(model_dir) for i in st.read_header(f)]
        ranks = _launch(args, "qatlib", family, args.workdir / f"{family}_qatlib.json")
        families[family] = {
            "dir": str(model_dir),
            "bytes": sum(sizes),
            "tensors": len(sizes),
            "largest_tensor_bytes": max(sizes),
            "expert_key_example": next(k for k in keys if ".experts.0." in k),
            "build_and_save_seconds": round(time.perf_counter() - t0, 1),
            "ranks": ranks,
            "max_rss_increment": max(r["rss_increment"] for r in ranks),
            "max_load_seconds": max(r["seconds"] for r in ranks),
        }
    q, m = families["qwen3_moe"], families["mixtral"]
    result = {
        "what": "qatlib's streamed ZeRO-3 load (zero3_load.load_model), 2 CPU ranks, gloo, bf16",
        "config": {
            k: v
            for k, v in moe_config("mixtral", args.size_gb).to_dict().items()
            if k
            in ("hidden_size", "intermediate_size", "num_local_experts", "num_hidden_layers", "vocab_size")
        },  # fmt: skip
        "families": families,
        "mixtral_over_qwen3_moe_peak_increment": round(m["max_rss_increment"] / q["max_rss_increment"], 4),
        "mixtral_over_qwen3_moe_load_seconds": round(m["max_load_seconds"] / q["max_load_seconds"], 3),
        "env": {
            "cpu_count": os.cpu_count(),
            "omp_num_threads_per_rank": 1,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "ds_config": str(DS_CONFIG.relative_to(ROOT)),
        },  # fmt: skip
    }
    from benchmarks.common import machine, target, write_result

    ratio = m["max_rss_increment"] / q["max_rss_increment"]
    result["machine"] = machine()
    result["command"] = "python -m benchmarks.zero3_load --moe" + (f" --size-gb {args.size_gb:g}")
    result["targets"] = [
        target(
            "Mixtral hub-layout load: peak RSS increment per rank / Qwen3-MoE's (same shapes)",
            ratio,
            1.05,
            higher_is_better=False,
            note="the key conversion reads each expert key whole into its linear, as Qwen3-MoE's",
        )
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out.parent, out.stem, result)
    gib = 2**30
    for family, r in families.items():
        print(f"{family:10s}: {r['bytes'] / gib:.2f} GiB, {r['tensors']} tensors ({r['expert_key_example']}); peak RSS "
              f"increment per rank " + ", ".join(f"{x['rss_increment'] / gib:.3f}" for x in r["ranks"])
              + f" GiB, load {r['max_load_seconds']:.1f} s")  # fmt: skip
    print(
        f"mixtral / qwen3_moe peak increment: {result['mixtral_over_qwen3_moe_peak_increment']}; wrote {out}"
    )


if __name__ == "__main__":
    main()
