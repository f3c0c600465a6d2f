"""benchmarks.gpu_check on a CPU machine: the no-CUDA exit, the missing-wheel error, and every
building block (PTQ -> ZeRO-3 QAT world 1 -> export -> reload, the step ratios, the fake-quant op)
run on a tiny model on the CPU (``--device cpu --tiny``, the mode only this test uses)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check

REPO = Path(__file__).resolve().parents[1]


def _run(args, tmp_path, timeout=600):
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--out", str(tmp_path / "out"), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_says_so_and_exits_0(tmp_path):
    p = _run([], tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "no CUDA device here" in p.stdout
    assert not (tmp_path / "out").exists()  # nothing measured, nothing written


def test_missing_wheel_is_named_before_any_work(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(gpu_check, "NEEDED", ("deepspeed", "no_such_module_xyz"))
    assert gpu_check.main(["--device", "cpu", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no_such_module_xyz" in err and "deepspeed" not in err.split("module(s)")[1].split(":")[0]
    assert "carry the wheels" in err
    assert not any(tmp_path.iterdir())


def test_formats_are_the_issue_s_at_true_width():
    assert gpu_check.FORMATS == ("fp8_static", "w4a8_fp8_g128", "int4_g128")
    w4a8, int4 = gpu_check.scheme_of("w4a8_fp8_g128"), gpu_check.scheme_of("int4_g128")
    assert (w4a8.weight.group_size, int4.weight.group_size) == (128, 128)
    assert w4a8.input is not None and int4.input is None  # W4A8 quantizes activations, int4 is weight-only
    cfg = gpu_check.model_config(False, 2)
    got = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    assert got == (2048, 32, 4, 128)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.vocab_size) == (
        128,
        8,
        768,
        151936,
    )


@pytest.mark.slow
def test_tiny_cpu_smoke_runs_every_building_block(tmp_path):
    steps = 2
    p = _run(
        ["--device", "cpu", "--tiny", "--skip-tests", "--tokens", "64", "--qat-steps", str(steps)]
        + ["--repeats", "2", "--fq-size", "256", "--no-compile"],
        tmp_path,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    out = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    pipe = out["pipeline"]
    assert out["device"] == "cpu" and pipe["backend"] == "gloo"
    assert len(pipe["qat_losses"]) == steps and all(math.isfinite(x) for x in pipe["qat_losses"])
    assert pipe["reload_finite"]
    # the reloaded export is the fake-quant model (up to W4A8's dynamic per-token activations at
    # deployment): closer to it than the unquantized model is
    assert pipe["reload_rel_err_vs_fake_quant"] < pipe["fake_quant_rel_err_vs_bf16"]
    assert pipe["fake_quant_rel_err_vs_bf16"] > 0  # quantization did something
    assert [r["format"] for r in out["step"]] == list(gpu_check.formats(True))
    assert all(r["tokens"] == 64 and r["qat_vs_plain"]["ratio"] > 0 for r in out["step"])
    assert set(out["targets"]) == set(gpu_check.formats(True))
    assert all(r["clone_GBps"] > 0 and r["fq_fwd_bwd_GBps"] > 0 for r in out["fake_quant"])
    assert "gpu_check on cpu" in p.stdout and "ZeRO-3 world 1 (gloo)" in p.stdout
