"""Faults at scale (issue 17): real processes, real signals, faults reached through test hooks.

- a rank SIGKILLed or SIGSTOPped mid-step ends every rank of a 2-rank ZeRO-3 QAT within the
  collective timeout plus a margin, with a non-zero exit naming that rank and no output;
- the training guard stops at the step of a NaN (a poisoned scale, a poisoned activation) on every
  rank, naming the layer; export refuses non-finite / non-positive scales by name;
- saves killed half-way leave the previous output intact and the orphan is removed by the next run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT, VOCAB, build_model, one_thread, tiny_qwen3_config

from qatlib import zero3_io as z
from qatlib.quant import Granularity, QuantScheme, QuantSpec, prepare

WORKERS = Path(__file__).parent / "fault_workers"
DS_TEST = REPO_ROOT / "config" / "deepspeed" / "zero3_cpu_test.json"
SCHEME = QuantScheme("w4g16", weight=QuantSpec("int4", Granularity.GROUP, group_size=16, symmetric=False))
TIMEOUT_S = 20
# torchrun's agent gives the surviving workers 30 s between SIGTERM and SIGKILL (a stopped worker
# ignores SIGTERM), plus our 2.5 s heartbeat probe and process exit: 45 s over the timeout.
MARGIN_S = 45


def _env() -> dict:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }


def launch(worker: Path, spec: dict, tmp: Path) -> subprocess.Popen:
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [str(worker), str(spec_path)]
    return subprocess.Popen(
        cmd,
        env=_env(),
        cwd=tmp,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def wait_for(path: Path, proc: subprocess.Popen, limit: float = 240) -> int:
    t0 = time.monotonic()
    while not path.exists() or not path.read_text():
        if proc.poll() is not None:
            raise AssertionError(f"worker ended before the hook: {proc.stdout.read()[-4000:]}")
        if time.monotonic() - t0 > limit:
            raise AssertionError("hook never reached")
        time.sleep(0.2)
    return int(path.read_text())


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny dense base model and its PTQ checkpoint (a plain consolidated save: scales + scheme)."""
    tmp = tmp_path_factory.mktemp("faults")
    model = build_model(tiny_qwen3_config(), seed=1)
    model.save_pretrained(tmp / "base")
    with one_thread():
        prepare(model, SCHEME)
        z.save_consolidated(model, tmp / "ptq", scheme=SCHEME)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (8, 16), generator=g).tolist()
    data = [{"input_ids": x, "labels": x} for x in ids]
    return {"tmp": tmp, "base": tmp / "base", "ptq": tmp / "ptq", "data": data}


def qat_spec(ckpt, out: Path, steps: int = 4, **kw) -> dict:
    return {
        "out": str(out),
        "model": str(ckpt["base"]),
        "ptq": str(ckpt["ptq"]),
        "ds_config": str(DS_TEST),
        "scheme": SCHEME.to_dict(),
        "data": ckpt["data"],
        "steps": steps,
        "timeout_s": TIMEOUT_S,
        **kw,
    }


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_rank_death_or_hang_ends_every_rank_naming_it(ckpt, tmp_path, sig):
    out = tmp_path / "out"
    hook = tmp_path / "paused.pid"
    proc = launch(
        WORKERS / "qat_fault.py",
        qat_spec(ckpt, out, pause={"rank": 1, "step": 2, "file": str(hook)}),
        tmp_path,
    )
    pid = wait_for(hook, proc)
    time.sleep(0.5)  # rank 0 is inside step 2's gathers, waiting on rank 1
    t0 = time.monotonic()
    os.kill(pid, getattr(signal, sig))
    try:
        text, _ = proc.communicate(timeout=TIMEOUT_S + MARGIN_S + 30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"{sig}: the job still runs {TIMEOUT_S + MARGIN_S + 30} s later") from None
    seconds = time.monotonic() - t0
    assert proc.returncode != 0
    assert seconds < TIMEOUT_S + MARGIN_S, (seconds, text[-3000:])
    assert not _alive(pid)
    if sig == "SIGSTOP":  # rank 0 waited out the timeout, then named the silent rank
        assert seconds >= TIMEOUT_S - 1, seconds
        assert "error: a collective failed on rank 0" in text, text[-4000:]
        assert f"rank 1 (pid {pid} on" in text and "stopped answering (its process is stopped" in text
    else:  # torchrun saw the death and named it as the root cause
        assert "rank      : 1" in text or "rank: 1" in text, text[-4000:]
        assert "SIGKILL" in text
    assert not out.joinpath("saved").exists()
    assert not [p for p in out.glob("*") if p.name.startswith(".saved")]
    print(f"{sig}: job ended {seconds:.1f} s after the signal")
