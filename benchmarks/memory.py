"""Memory: the KD loss computed per token chunk vs over the full vocabulary at once, and the
ZeRO-3 load peak.

``kd_loss``
    For each (vocabulary, tokens) configuration: peak memory of one forward + backward of the
    QAT objective (LM + KD, `qatlib.losses.qat_loss`) on random ``[1, tokens, vocab]`` student and
    teacher logits, chunked (``chunk_size`` valid rows at a time, the default) vs the plain
    autograd formulation over all rows. Two independent measurements:

    - ``tracker_*``: `kd_memory_probe` below (torch's dispatch-level ``MemTracker``: the
      peak of live tensors above the inputs);
    - ``rss_*``: a fresh subprocess per variant, the peak growth of its resident set
      (sampled from ``/proc/self/statm``) above its size once the inputs exist: what the OS
      sees, allocator slack included.

    A configuration whose estimated need exceeds half of the memory available right now is
    skipped (recorded as such), so the benchmark never pushes a shared machine into the OOM killer.
``zero3_load``
    Read from ``results/bench/zero3_load.json`` (written by ``benchmarks/zero3_load.py``: peak
    RSS per rank of the ZeRO-3 streaming loader vs ``from_pretrained``), or "not run".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .common import REPO, RssSampler, _meminfo, log, rss_now

if TYPE_CHECKING:
    import torch


@dataclass
class MemorySettings:
    # (vocab, tokens, chunk_size): a 32k vocabulary (Llama-2 class) and Qwen3's 151,936, each with
    # qatlib's default chunk (None: CHUNK_ELEMENTS // vocab rows, 1024 and 220 here) and a fixed one.
    configs: tuple[tuple[int, int, int | None], ...] = (
        (32768, 4096, None),
        (32768, 4096, 256),
        (151936, 1024, None),
        (151936, 1024, 1024),
    )
    loss_type: str = "cakld"
    dtype: str = "bfloat16"
    rss: bool = True
    max_fraction_of_available: float = 0.5


QUICK = MemorySettings(configs=((8192, 512, 128),))


def _estimate_full_bytes(vocab: int, tokens: int) -> int:
    """Rough need of the unchunked path: measured ~17x one bf16 logits tensor, plus the inputs."""
    return 20 * 2 * vocab * tokens


# --------------------------------------------------------------------------- tracker probe
def kd_memory_probe(
    n_tokens: int = 4096,
    vocab: int = 32768,
    *,
    loss_type: str = "cakld",
    chunk_size: int | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> dict[str, float]:
    """Peak memory (bytes) of one forward + backward of the KD objective, chunked vs unchunked.

    Builds random ``[1, n_tokens, vocab]`` student / teacher logits (``dtype``, default bf16), all
    tokens valid, and measures the peak of tensors alive during ``qat_loss(...).loss.backward()``,
    above the inputs themselves. CUDA: the caching allocator's peak; CPU: torch's dispatch-level
    tracker (``torch.distributed._tools.mem_tracker.MemTracker``). Returns ``chunked_peak``,
    ``full_peak``, ``logits_bytes`` (one model-dtype logits tensor) and ``fp32_logits_bytes``.
    """
    import torch

    from qatlib.losses import TOPK_LOSSES, LossConfig, qat_loss

    device = torch.device(device)
    dtype = torch.bfloat16 if dtype is None else dtype
    cfg_kw: dict[str, Any] = dict(loss_type=loss_type, kd_loss_weight=1.0, lm_loss_weight=1.0)
    if loss_type in TOPK_LOSSES:  # a top-K family without its inline K
        cfg_kw["loss_topk"] = 64
    g = torch.Generator(device="cpu").manual_seed(seed)
    s0 = torch.randn(1, n_tokens, vocab, generator=g).to(device=device, dtype=dtype)
    t0 = torch.randn(1, n_tokens, vocab, generator=g).to(device=device, dtype=dtype)
    labels = torch.randint(0, vocab, (1, n_tokens), generator=g).to(device)

    def run(chunked: bool) -> int:
        cfg = LossConfig(chunk_size=chunk_size, **cfg_kw)
        s = s0.clone().requires_grad_(True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            qat_loss(s, labels, cfg, t0, chunked=chunked).loss.backward()
            torch.cuda.synchronize(device)
            return torch.cuda.max_memory_allocated(device) - base
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        with tracker:
            qat_loss(s, labels, cfg, t0, chunked=chunked).loss.backward()
        snap = tracker.get_tracker_snapshot("peak")
        return int(sum(v.get("Total", 0) for v in snap.values()))

    out = {"chunked_peak": float(run(True)), "full_peak": float(run(False))}
    out["logits_bytes"] = float(s0.numel() * s0.element_size())
    out["fp32_logits_bytes"] = float(s0.numel() * 4)
    out["n_tokens"], out["vocab"] = float(n_tokens), float(vocab)
    out["chunk_size"] = float(LossConfig(chunk_size=chunk_size, **cfg_kw).rows_per_chunk(vocab))
    return out


# --------------------------------------------------------------------------- RSS worker
def _worker(
    vocab: int, tokens: int, loss_type: str, chunk_size: int | None, dtype: str, chunked: bool
) -> dict:
    """Runs in a fresh process: growth of the resident set during one loss forward + backward."""
    import torch

    from qatlib.losses import LossConfig, qat_loss

    torch.set_num_threads(1)
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    s = torch.randn(1, tokens, vocab, generator=g, dtype=dt).requires_grad_(True)
    t = torch.randn(1, tokens, vocab, generator=g, dtype=dt)
    labels = torch.randint(0, vocab, (1, tokens), generator=g)
    cfg = LossConfig(loss_type=loss_type, kd_loss_weight=1.0, lm_loss_weight=1.0, chunk_size=chunk_size)
    # warm the code paths on a tiny problem so that one-off allocations do not count (2-row chunks:
    # 4 rows in one chunk would take the plain path)
    qat_loss(
        s[:, :4].detach().clone().requires_grad_(True),
        labels[:, :4],
        dataclasses.replace(cfg, chunk_size=2),
        t[:, :4],
        chunked=chunked,
    ).loss.backward()
    before = rss_now()
    with RssSampler() as rs:
        qat_loss(s, labels, cfg, t, chunked=chunked).loss.backward()
    return {
        "rss_growth": rs.peak - before,
        "rss_before": before,
        "grad_bytes": s.grad.numel() * s.grad.element_size(),
    }


def rss_probe(
    vocab: int, tokens: int, *, loss_type: str, chunk_size: int | None, dtype: str, chunked: bool
) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.memory",
        "--worker",
        json.dumps(
            {
                "vocab": vocab,
                "tokens": tokens,
                "loss_type": loss_type,
                "chunk_size": chunk_size,
                "dtype": dtype,
                "chunked": chunked,
            }
        ),
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"memory worker failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- driver
def kd_rows(s: MemorySettings) -> list[dict[str, Any]]:
    import torch

    from qatlib.losses import LossConfig

    rows = []
    for vocab, tokens, chunk in s.configs:
        row: dict[str, Any] = {
            "vocab": vocab,
            "tokens": tokens,
            "dtype": s.dtype,
            "loss_type": s.loss_type,
            "chunk_size": chunk,  # None: qatlib's default (CHUNK_ELEMENTS // vocab rows)
            "chunk_rows": LossConfig(chunk_size=chunk).rows_per_chunk(vocab),
            "logits_bytes": vocab * tokens * torch.finfo(getattr(torch, s.dtype)).bits // 8,
        }
        need = _estimate_full_bytes(vocab, tokens)
        avail = _meminfo().get("MemAvailable")
        if avail is not None and need > s.max_fraction_of_available * avail:
            row["skipped"] = (
                f"estimated need {need / 2**30:.1f} GiB > {s.max_fraction_of_available:.0%} of available {avail / 2**30:.1f} GiB"
            )
            rows.append(row)
            continue
        log(f"memory: KD loss vocab {vocab} x {tokens} tokens, chunk {chunk} (tracker)")
        p = kd_memory_probe(
            tokens, vocab, loss_type=s.loss_type, chunk_size=chunk, dtype=getattr(torch, s.dtype)
        )
        row["tracker_chunked_peak_bytes"] = int(p["chunked_peak"])
        row["tracker_full_peak_bytes"] = int(p["full_peak"])
        row["tracker_chunked_over_full"] = round(p["chunked_peak"] / p["full_peak"], 4)
        row["tracker_chunked_over_logits"] = round(p["chunked_peak"] / row["logits_bytes"], 3)
        row["tracker_full_over_logits"] = round(p["full_peak"] / row["logits_bytes"], 3)
        if s.rss:
            log(f"memory: KD loss vocab {vocab} x {tokens} tokens, chunk {chunk} (RSS, subprocesses)")
            kw = dict(loss_type=s.loss_type, chunk_size=chunk, dtype=s.dtype)
            c = rss_probe(vocab, tokens, chunked=True, **kw)
            f = rss_probe(vocab, tokens, chunked=False, **kw)
            row["rss_chunked_growth_bytes"] = c["rss_growth"]
            row["rss_full_growth_bytes"] = f["rss_growth"]
            row["rss_chunked_over_full"] = round(c["rss_growth"] / max(f["rss_growth"], 1), 4)
        rows.append(row)
    return rows


def zero3_section(bench_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(bench_dir) / "zero3_load.json"
    if not path.is_file():
        return {
            "status": "not run",
            "how": "python benchmarks/zero3_load.py (writes results/bench/zero3_load.json)",
        }
    d = json.loads(path.read_text())
    out: dict[str, Any] = {
        "status": "read",
        "source": str(path),
        "model_bytes": d.get("model", {}).get("bytes"),
        "world_size": d.get("world_size"),
        "target_rss_increment": d.get("target_rss_increment"),
        "target_formula": d.get("target_formula"),
    }
    loaders = []
    for name, ld in (d.get("loaders") or {}).items():
        loaders.append(
            {
                "loader": name,
                "max_rss_increment_bytes": ld.get("max_rss_increment"),
                "max_rss_peak_bytes": ld.get("max_rss_peak"),
                "within_target": ld.get("within_target"),
                "increment_over_model_bytes": round(ld["max_rss_increment"] / out["model_bytes"], 3)
                if ld.get("max_rss_increment") and out["model_bytes"]
                else None,
            }
        )
    out["loaders"] = loaders
    return out


def run(
    settings: MemorySettings | None = None,
    *,
    results: str = "results",
    bench_dir: str | os.PathLike = "results/bench",
) -> dict[str, Any]:
    s = settings or MemorySettings()
    rows = kd_rows(s)
    z3 = zero3_section(bench_dir)
    tg = []
    for ld in z3.get("loaders", []):
        if ld["loader"] != "qatlib":  # the others (from_pretrained, default glibc) are references
            continue
        tg.append(
            {
                "target": f"ZeRO-3 load peak RSS increment per rank <= {z3.get('target_formula')}",
                "value": ld["max_rss_increment_bytes"],
                "met": ld["within_target"],
                "note": f"limit {z3.get('target_rss_increment'):.0f} B; from zero3_load.json (see zero3_loaders)",
            }
        )
    loaders = z3.pop("loaders", [])
    return {"settings": asdict(s), "kd_loss": rows, "zero3_load": z3, "zero3_loaders": loaders, "targets": tg}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="memory benchmark worker (use benchmarks.run)")
    ap.add_argument("--worker", required=True, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    print(json.dumps(_worker(**json.loads(a.worker))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
