"""Peak RSS of PTQ calibration and export of a ~1 GB bf16 Qwen3: whole model in memory (today's
path) vs layer by layer streamed from the checkpoint (`qatlib.zero3.onload`).

    python -m benchmarks.stream_memory [--size-gb 1.0] [--out results/bench/stream_memory.json]

The checkpoint is `benchmarks.zero3_load`'s (random bf16 Qwen3, 300 MB shards, built once in
--workdir). Each stage runs in a fresh process (this module with ``--worker``), which records
``ru_maxrss`` after its imports and a warm-up (the same stages on a tiny model of the same class:
the code first used, ~0.17 GiB, is not model data) and at the end; the increment is compared with the
issue's targets: PTQ <= model bytes + 1.5 x one decoder layer + calibration activations, export
<= largest output shard + 2 x one decoder layer. fp8_static (static input scales: a calibration
forward), 2 batches of 64 tokens.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from .common import rss_now, tensor_bytes, warmup_qwen3_config

MODES = ("ptq_whole", "ptq_stream", "export_whole", "export_stream")
SHARD = 300 << 20  # the streamed export's max_shard_size (the input checkpoint's shard size)


def _batches():
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 32000, (1, 64), generator=g) for _ in range(2)]


def _warm_up(scheme) -> None:
    """Calibrate and export (in memory and streamed) a tiny model of the same class, so the
    baseline holds the code every mode first runs (transformers' Qwen3 modules, accelerate,
    compressed-tensors: ~0.17 GiB measured) and the increment is the model data alone, as in
    `benchmarks.zero3_load`. Its cost is recorded (``rss_before - rss_before_warmup``)."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    from qatlib.export import export
    from qatlib.ptq import calibrate, calibrate_from_checkpoint, save_ptq_checkpoint
    from qatlib.quant import prepare
    from qatlib.zero3.load import stream_load_scales
    from qatlib.zero3.onload import Onloader, load_skeleton, realize_quantizers

    cfg = warmup_qwen3_config()
    batches = [torch.randint(0, 128, (1, 8))]
    with tempfile.TemporaryDirectory() as d:
        tiny = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        tiny.save_pretrained(f"{d}/m")
        calibrate(tiny, scheme, batches)
        export(tiny, scheme, f"{d}/e", "real")
        skel, report, scales = calibrate_from_checkpoint(f"{d}/m", scheme, batches)
        save_ptq_checkpoint(skel, scheme, f"{d}/p", calibration=report, scales=scales)
        skel = prepare(load_skeleton(f"{d}/m"), scheme)
        realize_quantizers(skel)
        stream_load_scales(skel, f"{d}/p", scheme)
        export(skel, scheme, f"{d}/s", "real", onload=Onloader.from_checkpoint(skel, f"{d}/m"))
    del tiny, skel


def worker(mode: str, model_dir: Path, work: Path, out: Path) -> None:
    import torch

    from qatlib.export import export
    from qatlib.models import load_model
    from qatlib.ptq import calibrate, calibrate_from_checkpoint, save_ptq_checkpoint
    from qatlib.quant import prepare, preset
    from qatlib.zero3.io import peak_rss_bytes
    from qatlib.zero3.load import stream_load_scales
    from qatlib.zero3.onload import Onloader, load_skeleton, realize_quantizers

    torch.set_num_threads(2)
    scheme = preset("fp8_static")
    cold = rss_now()
    _warm_up(scheme)
    before = rss_now()
    t0 = time.perf_counter()
    ptq_dir = work / "ptq"
    if mode == "ptq_whole":
        model = load_model(model_dir)
        calibrate(model, scheme, _batches())
    elif mode == "ptq_stream":
        skel, report, scales = calibrate_from_checkpoint(model_dir, scheme, _batches())
        save_ptq_checkpoint(skel, scheme, ptq_dir, calibration=report, scales=scales, overwrite=True)
    elif mode == "export_whole":
        model = prepare(load_model(model_dir), scheme)
        stream_load_scales(model, ptq_dir, scheme)
        export(model, scheme, work / "export_whole", "real", overwrite=True)
    else:
        skel = prepare(load_skeleton(model_dir), scheme)
        realize_quantizers(skel)
        stream_load_scales(skel, ptq_dir, scheme)
        loader = Onloader.from_checkpoint(skel, model_dir)
        export(
            skel, scheme, work / "export_stream", "real", overwrite=True, onload=loader, max_shard_size=SHARD
        )
    out.write_text(
        json.dumps(
            {
                "rss_before_warmup": cold,
                "rss_before": before,
                "rss_peak": peak_rss_bytes(),
                "seconds": time.perf_counter() - t0,
            }
        )
    )


def _sizes(model_dir: Path) -> dict[str, int]:
    sizes = tensor_bytes(model_dir)
    return {
        "model_bytes": sum(sizes.values()),
        "layer_bytes": sum(b for k, b in sizes.items() if k.startswith("model.layers.0.")),
        "embedding_bytes": sum(b for k, b in sizes.items() if "embed_tokens" in k),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--workdir", type=Path, default=Path("results/bench/stream_memory_work"))
    ap.add_argument("--out", type=Path, default=Path("results/bench/stream_memory.json"))
    ap.add_argument("--worker", choices=MODES)
    ap.add_argument("--record", type=Path)
    args = ap.parse_args()
    model_dir = args.workdir / "model"
    if args.worker:
        worker(args.worker, model_dir, args.workdir, args.record)
        return
    from .zero3_load import make_checkpoint

    model_dir.mkdir(parents=True, exist_ok=True)
    make_checkpoint(model_dir, args.size_gb)
    runs = {}
    for mode in ("ptq_stream", "ptq_whole", "export_whole", "export_stream"):  # ptq_stream writes the scales
        rec = args.workdir / f"{mode}.json"
        cmd = [sys.executable, "-m", "benchmarks.stream_memory", "--worker", mode, "--record", str(rec)]
        subprocess.run([*cmd, "--workdir", str(args.workdir)], check=True)
        r = json.loads(rec.read_text())
        r["rss_increment"] = r["rss_peak"] - r["rss_before"]
        r["warmup_code_bytes"] = r["rss_before"] - r["rss_before_warmup"]
        runs[mode] = r
        print(f"{mode}: +{r['rss_increment'] / 2**30:.2f} GiB in {r['seconds']:.0f}s", flush=True)
    sz = _sizes(model_dir)
    M, L, E = sz["model_bytes"], sz["layer_bytes"], sz["embedding_bytes"]
    acts = 2 * 64 * 1024 * 4 * 4  # 2 batches x 64 tokens x hidden, a few fp32 copies
    out_shards = sorted((args.workdir / "export_stream").glob("*.safetensors"))
    largest = max(p.stat().st_size for p in out_shards)
    ptq_target = M + 1.5 * L + acts
    exp_target = largest + 2 * L
    res = {
        "sizes": {**sz, "largest_export_shard_bytes": largest, "export_shards": len(out_shards)},
        "runs": runs,
        "ratios": {
            "ptq_stream_vs_whole": runs["ptq_stream"]["rss_increment"] / runs["ptq_whole"]["rss_increment"],
            "ptq_stream_vs_target": runs["ptq_stream"]["rss_increment"] / ptq_target,
            "ptq_whole_vs_target": runs["ptq_whole"]["rss_increment"] / ptq_target,
            "ptq_stream_vs_model": runs["ptq_stream"]["rss_increment"] / M,
            "ptq_stream_vs_layer_plus_embeddings": runs["ptq_stream"]["rss_increment"] / (L + E),
            "export_stream_vs_whole": runs["export_stream"]["rss_increment"]
            / runs["export_whole"]["rss_increment"],
            "export_stream_vs_target": runs["export_stream"]["rss_increment"] / exp_target,
            "export_whole_vs_target": runs["export_whole"]["rss_increment"] / exp_target,
            "export_stream_vs_model": runs["export_stream"]["rss_increment"] / M,
        },
        "targets": {"ptq_bytes": ptq_target, "export_bytes": exp_target},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    print(json.dumps(res["ratios"], indent=2))


if __name__ == "__main__":
    main()
