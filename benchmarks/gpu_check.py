"""The GPU check: one command, under 8 minutes on ONE GPU, that exercises what only a GPU shows.

    python -m benchmarks.gpu_check                 # -> results/bench/gpu_check.json + a summary

On a machine without CUDA it says so and exits 0 (nothing to check). With CUDA it runs, in order:

``tests``
    The device-aware test subset (``pytest -m device_aware``: the tests taking the ``device``
    fixture, ``tests/test_device.py``, the losses, the multi-rank ones) with ``pytest``: the
    single-process ones run on this GPU; the multi-rank ones need >= 2 GPUs and are left out on one.
``pipeline``
    ZeRO-3 at world size 1 over NCCL, PTQ -> QAT -> export -> reload, on a random Qwen3-MoE at the
    true Qwen3-30B-A3B width (hidden 2048, 32 / 4 heads, head_dim 128, 128 experts top-8,
    moe_intermediate 768, vocab 151936) with ``--layers`` (default 1) layers, bf16, gradient
    checkpointing, every weight frozen: RTN PTQ on the GPU -> `qatlib.zero3.load.build_qat_model`
    (empty partitioned build, streamed weights and scales) -> ``--qat-steps`` DeepSpeed steps ->
    consolidated save -> compressed-tensors export -> ``from_pretrained`` reload, whose logits
    are compared with the fake-quant model's. Peak GPU memory of each phase beside the plan
    (the bf16 parameter bytes + fp32 scales the run metadata counts).
``step``
    For fp8_static, w4a8_fp8 and int4 g128: the QAT step (quantizers on) vs the same step with
    quantizers off (`benchmarks.speed.TrainerStep`: the default experiment's `QATTrainer` step, KD
    teacher, frozen codes, AdamW on the weight scales),
    ``--tokens`` (>= 4096) tokens per step, eager and with ``compile_fake_quant``; target <= 1.10x.
``fake_quant``
    The weight fake-quant op alone (forward, and forward + scale gradient) on a 8192^2 bf16
    tensor, as GB/s moved, and as a share of ``clone`` (the achievable copy bandwidth) and of the
    GPU's nominal memory bandwidth (memory clock x bus width, when torch reports them).

The GPU machine has torch and transformers but no deepspeed / compressed-tensors and no network.
Carry their wheels (and pure-Python deps that are missing there) from a machine with network::

    pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --platform manylinux_2_17_x86_64 -d .whl deepspeed==0.19.8 compressed-tensors==0.20.1 \\
        einops hjson msgpack ninja psutil py-cpuinfo \\
        loguru pydantic==2.13.4 pydantic-core==2.46.4 annotated-types typing-inspection
    # on the GPU machine:
    pip install --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=$PWD:/tmp/site python -m benchmarks.gpu_check

(deepspeed 0.19.8 ships a universal wheel; set ``--python-version`` to the GPU machine's Python.)
A missing module is reported by name with this recipe, before any work starts.

``--device cpu --tiny`` runs the same building blocks on a tiny model on the CPU (gloo, fp32
timing without synchronisation): only the tests use it, so that the code here is exercised
without a GPU; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from .common import (
    DEFAULT_OUT,
    QWEN3_30B_A3B_WIDTH,
    REPO,
    format_scheme,
    interleaved,
    log,
    machine,
    paired_ratio,
    target,
    write_result,
)

NEEDED = ("transformers", "deepspeed", "compressed_tensors", "safetensors")
CARRY_HINT = (
    "carry the wheels (see `python -m benchmarks.gpu_check --help` / benchmarks/README.md, GPU check)"
)
WIDTH = dict(QWEN3_30B_A3B_WIDTH, num_experts=128)  # Qwen3-30B-A3B
TINY = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    intermediate_size=128,
    vocab_size=512,
)
FORMATS = ("fp8_static", "w4a8_fp8_g128", "int4_g128")
TARGET_STEP = 1.10


def formats(tiny: bool) -> tuple[str, ...]:
    """The checked formats; groups of 16 on the tiny model (128 does not divide its widths)."""
    return tuple(f.replace("g128", "g16") for f in FORMATS) if tiny else FORMATS


scheme_of = format_scheme  # every checked format is one of `common.FORMATS`


def missing_modules() -> list[str]:
    return [m for m in NEEDED if importlib.util.find_spec(m) is None]


def synced(fn, dev: torch.device):
    """``fn`` then a CUDA synchronise, so wall-clock timings cover the kernels."""
    if dev.type != "cuda":
        return fn
    return lambda: (fn(), torch.cuda.synchronize(dev))


def peak_gib(dev: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(dev) / 2**30, 3) if dev.type == "cuda" else None


# --------------------------------------------------------------------------- tests
def run_tests(timeout_s: int) -> dict[str, Any]:
    # every test marked device_aware (tests/conftest.py marks those taking the `device` fixture and
    # the multi-rank ones), plus the device decisions themselves
    # the device decisions themselves; multi-rank tests need one GPU per rank, so on one GPU they are
    # left out (they would skip, or run on the CPU, taking minutes of the 8)
    marks = "device_aware" if torch.cuda.device_count() >= 2 else "device_aware and not multirank"
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-m", marks, "tests/"]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
        rc, tail = p.returncode, (p.stdout + p.stderr)[-4000:]
    except subprocess.TimeoutExpired as e:
        rc, tail = 124, f"timed out after {timeout_s}s: {str(e.stdout or '')[-2000:]}"
    summary = next((ln for ln in reversed(tail.splitlines()) if " in " in ln and "=" in ln), tail[-200:])
    return {
        "cmd": " ".join(cmd),
        "rc": rc,
        "summary": summary.strip("= "),
        "wall_s": round(time.perf_counter() - t0, 1),
    }


# --------------------------------------------------------------------------- pipeline
def model_config(tiny: bool, layers: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **(TINY if tiny else WIDTH),
        num_hidden_layers=layers,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_rank_env() -> None:
    """World size 1 without a launcher: what torchrun would set for one process."""
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def ds_config(tiny: bool) -> dict:
    return {
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0 if tiny else 100000},
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


def run_pipeline(work: Path, dev: torch.device, *, tiny: bool, layers: int, tokens: int, steps: int) -> dict:
    """PTQ -> ZeRO-3 QAT (world 1) -> save -> export -> reload; see the module docstring."""
    import deepspeed
    from transformers import AutoModelForCausalLM

    from qatlib.export import export
    from qatlib.ptq import calibrate, save_ptq_checkpoint
    from qatlib.quant import prepare, quantization_disabled
    from qatlib.trainers.params import Learnable, param_groups, select_trainable
    from qatlib.zero3 import io as z
    from qatlib.zero3 import load as zl
    from qatlib.zero3 import save as zs

    scheme = scheme_of(formats(tiny)[1])
    res: dict[str, Any] = {"scheme": scheme.name, "layers": layers, "tokens_per_step": tokens}
    seq = min(tokens, 2048)
    g = torch.Generator().manual_seed(0)
    cfg = model_config(tiny, layers)
    batch = torch.randint(0, cfg.vocab_size, (max(tokens // seq, 1), seq), generator=g)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    base.save_pretrained(work / "model")
    res["n_params"] = sum(p.numel() for p in base.parameters())
    with torch.no_grad():
        base.to(dev)
        calibrate(base, scheme, [batch[:1].to(dev)], ignore=("lm_head", "embed_tokens", "gate"))
        save_ptq_checkpoint(base.cpu(), scheme, work / "ptq")
    del base
    res["ptq_s"], res["ptq_peak_gib"] = round(time.perf_counter() - t0, 1), peak_gib(dev)

    t0 = time.perf_counter()
    single_rank_env()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    ctx = z.init_zero3(ds_config(tiny), timeout_s=600)
    res["backend"] = torch.distributed.get_backend()
    model = zl.build_qat_model(work / "model", ctx, scheme, from_ptq_ckpt=work / "ptq")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    trainable = select_trainable(model, Learnable(weight_scale=True, act_scale=True))
    # fp8 scales are ~amax/448 (1e-5..1e-4 on random models): an lr above them takes them below 0,
    # which the export refuses; the check measures memory and speed, not what QAT learns
    lr = 1e-6 if any(sp is not None and sp.is_fp8 for sp in (scheme.weight, scheme.input)) else 1e-4
    opt = torch.optim.AdamW(param_groups(trainable, lr=lr), lr=lr)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(tiny))
    engine.train()
    losses, step_s = [], []
    x = batch.to(dev)
    for _ in range(steps):
        t1 = time.perf_counter()
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(round(loss.item(), 4))
        step_s.append(round(time.perf_counter() - t1, 3))
    res.update(qat_losses=losses, qat_step_s=step_s, qat_peak_gib=peak_gib(dev))
    meta = z.run_metadata(model)
    res["plan_param_gib"] = round(meta["param_bytes_total"] / 2**30, 3)
    zs.save_consolidated(model, work / "qat", scheme=scheme)
    del engine, model, opt
    ctx.close()
    del ctx  # drops the HfDeepSpeedConfig: the reloads below are plain models, not zero.Init ones
    import gc

    from transformers.integrations import is_deepspeed_zero3_enabled

    gc.collect()
    assert not is_deepspeed_zero3_enabled(), "HF still sees a ZeRO-3 config"
    res["qat_s"] = round(time.perf_counter() - t0, 1)

    t0 = time.perf_counter()
    fq = AutoModelForCausalLM.from_pretrained(work / "qat", dtype=torch.bfloat16)
    prepare(fq, scheme, ignore=("lm_head",))
    zl.stream_load_scales(fq, work / "qat", scheme)
    export(fq, scheme, work / "export", "real")
    probe = batch[:1, :64].to(dev)
    with torch.no_grad():
        want = fq.to(dev)(input_ids=probe).logits.float()
        with quantization_disabled(fq):
            bf16 = fq(input_ids=probe).logits.float()
    del fq
    got_model = AutoModelForCausalLM.from_pretrained(work / "export", dtype=torch.bfloat16).to(dev).eval()
    with torch.no_grad():
        got = got_model(input_ids=probe).logits.float()
    err = ((got - want).norm() / want.norm()).item()
    res.update(
        export_s=round(time.perf_counter() - t0, 1),
        reload_rel_err_vs_fake_quant=round(err, 5),
        fake_quant_rel_err_vs_bf16=round(((want - bf16).norm() / bf16.norm()).item(), 5),
        reload_finite=bool(torch.isfinite(got).all()),
    )
    return res


# --------------------------------------------------------------------------- step and op
def run_steps(dev: torch.device, *, tiny: bool, tokens: int, repeats: int, compile_fq: bool) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from .speed import TrainerStep, experiment_config

    exp = experiment_config()  # the default experiment's trainer step (benchmarks.speed)
    cfg = model_config(tiny, 1)
    seq = min(tokens, 2048)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).to(dev)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    x = torch.randint(0, cfg.vocab_size, (max(tokens // seq, 1), seq), device=dev)
    rows = []
    for name in formats(tiny):
        with tempfile.TemporaryDirectory(prefix="gpu-check-step-") as d:
            sb = TrainerStep(base, name, exp, x, d)
            fns = {"qat": sb.qat, "plain": sb.plain}
            if compile_fq:
                fns["qat_compiled"] = sb.compiled
            t = interleaved({k: synced(f, dev) for k, f in fns.items()}, repeats=repeats, warmup=1)
        row = {"format": name, "tokens": int(x.numel()), "qat_vs_plain": paired_ratio(t["qat"], t["plain"])}
        if compile_fq:
            row["qat_compiled_vs_plain"] = paired_ratio(t["qat_compiled"], t["plain"])
        row["peak_gib"] = peak_gib(dev)
        rows.append(row)
        del sb
    return rows


def nominal_bandwidth(dev: torch.device) -> float | None:
    """Bytes/s from the memory clock (kHz, double data rate) and bus width (bits), if reported."""
    if dev.type != "cuda":
        return None
    p = torch.cuda.get_device_properties(dev)
    clock, bus = getattr(p, "memory_clock_rate", None), getattr(p, "memory_bus_width", None)
    return 2 * clock * 1e3 * bus / 8 if clock and bus else None


def run_fake_quant(dev: torch.device, *, tiny: bool, n: int, repeats: int) -> list[dict]:
    from qatlib.quant import functional as F

    x = (torch.randn(n, n, device=dev) * 0.02).to(torch.bfloat16)
    nbytes = 2 * x.numel() * x.element_size()
    peak = nominal_bandwidth(dev)
    g = torch.ones_like(x)
    rows = []
    for name in formats(tiny):
        spec = scheme_of(name).weight
        scale, zp = F.compute_qparams(x, spec)
        scale = scale.clone().requires_grad_(True)

        def fwd(spec=spec, scale=scale, zp=zp):
            with torch.no_grad():
                F.fake_quantize(x, scale, zp, spec)

        def fwd_bwd(spec=spec, scale=scale, zp=zp):
            scale.grad = None
            F.fake_quantize(x, scale, zp, spec).backward(g)

        fns = {"clone": x.clone, "fq_fwd": fwd, "fq_fwd_bwd": fwd_bwd}
        t = interleaved({k: synced(f, dev) for k, f in fns.items()}, repeats=repeats, warmup=1)
        row: dict[str, Any] = {"format": name, "shape": f"{n}x{n}", "dtype": "bfloat16"}
        for k, v in t.items():
            gbps = nbytes / sorted(v)[len(v) // 2] / 1e9
            row[f"{k}_GBps"] = round(gbps, 2)
            if peak:
                row[f"{k}_share_of_nominal"] = round(gbps * 1e9 / peak, 4)
        row["fq_fwd_share_of_clone"] = round(row["fq_fwd_GBps"] / row["clone_GBps"], 4)
        rows.append(row)
    return rows


def step_targets(rows: list[dict]) -> dict[str, dict]:
    """Per `run_steps` row (eager, and compiled where measured): the QAT step over the plain one
    against `TARGET_STEP`, its `paired_ratio` compared unrounded."""
    return {
        f"{r['format']}{suffix}": target(
            f"QAT step / quantizers off, {r['format']}{suffix}",
            r[key]["ratio"],
            TARGET_STEP,
            higher_is_better=False,
        )
        for r in rows
        for key, suffix in (("qat_vs_plain", ""), ("qat_compiled_vs_plain", " compiled"))
        if key in r
    }


# --------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=DEFAULT_OUT, help="folder of gpu_check.json")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="tiny model (the CPU smoke test)")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--qat-steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--fq-size", type=int, default=8192)
    ap.add_argument("--no-compile", action="store_true", help="skip the compile_fake_quant variant")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--tests-timeout", type=int, default=240)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"gpu_check: no CUDA device here (torch {torch.__version__}, CUDA build {torch.version.cuda}); nothing to check"
        )
        return 0
    missing = missing_modules()
    if missing:
        print(f"gpu_check: missing module(s) {', '.join(missing)}: {CARRY_HINT}", file=sys.stderr)
        return 2
    if args.device == "cpu":
        os.environ["QATLIB_DEVICE"] = "cpu"
    from qatlib import device

    dev = device.bind().device
    out: dict[str, Any] = {"machine": machine(), "device": str(dev), "settings": vars(args)}
    if dev.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(dev)
    t_all = time.perf_counter()
    if not args.skip_tests:
        log("gpu_check: tests")
        out["tests"] = run_tests(args.tests_timeout)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        log("gpu_check: PTQ -> ZeRO-3 QAT -> export -> reload")
        out["pipeline"] = run_pipeline(
            Path(work), dev, tiny=args.tiny, layers=args.layers, tokens=args.tokens, steps=args.qat_steps
        )
    compile_fq = not args.no_compile and (dev.type == "cuda" or bool(os.environ.get("CXX") or _have_cxx()))
    log("gpu_check: QAT step vs quantizers off")
    out["step"] = run_steps(
        dev, tiny=args.tiny, tokens=args.tokens, repeats=args.repeats, compile_fq=compile_fq
    )
    log("gpu_check: fake-quant op")
    out["fake_quant"] = run_fake_quant(dev, tiny=args.tiny, n=args.fq_size, repeats=args.repeats)
    out["targets"] = step_targets(out["step"])
    out["wall_s"] = round(time.perf_counter() - t_all, 1)
    path = write_result(args.out, "gpu_check", out)
    print(summary(out))
    print(f"gpu_check: {path}")
    return 0 if out.get("tests", {}).get("rc", 0) == 0 else 1


def _have_cxx() -> bool:
    import shutil

    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


def summary(out: dict) -> str:
    p = out["pipeline"]
    lines = [f"gpu_check on {out.get('gpu', out['device'])} in {out['wall_s']} s"]
    if "tests" in out:
        lines.append(f"  tests: rc {out['tests']['rc']}: {out['tests']['summary']}")
    lines.append(
        f"  ZeRO-3 world 1 ({p['backend']}), {p['n_params'] / 1e9:.2f}B params, {p['scheme']}: losses {p['qat_losses']}, "
        f"peak {p['qat_peak_gib']} GiB (params {p['plan_param_gib']} GiB), export reload rel err "
        f"{p['reload_rel_err_vs_fake_quant']} (fake-quant vs bf16 {p['fake_quant_rel_err_vs_bf16']})"
    )
    for r in out["step"]:
        c = f", compiled {r['qat_compiled_vs_plain']['ratio']}x" if "qat_compiled_vs_plain" in r else ""
        lines.append(
            f"  step {r['format']} @ {r['tokens']} tokens: {r['qat_vs_plain']['ratio']}x{c} (target <= {TARGET_STEP})"
        )
    for r in out["fake_quant"]:
        share = r.get("fq_fwd_share_of_nominal")
        lines.append(
            f"  fake-quant {r['format']} {r['shape']}: fwd {r['fq_fwd_GBps']} GB/s "
            f"({r['fq_fwd_share_of_clone']:.0%} of clone{f', {share:.0%} of nominal' if share else ''})"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        raise SystemExit(main())
