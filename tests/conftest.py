"""Shared fixtures: tiny Qwen3 / Qwen3-MoE models built from configs, an offline tokenizer, and
the multi-rank torchrun launcher of the ZeRO-3 tests (device-aware through `qatlib.device`).

Everything is built locally in seconds; nothing touches the hub.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

VOCAB = 512


def tiny_qwen3_config(**kw):
    from transformers import Qwen3Config

    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    base.update(kw)
    return Qwen3Config(**base)


def tiny_qwen3_moe_config(**kw):
    from transformers import Qwen3MoeConfig

    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    base.update(kw)
    return Qwen3MoeConfig(**base)


def tiny_llama_config(**kw):
    """SmolLM2's architecture (Llama, tied embeddings, no q/k norms) at the tiny size."""
    from transformers import LlamaConfig

    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    base.update(kw)
    return LlamaConfig(**base)


def build_model(config, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def fp8_static_channel():
    """fp8_static with one weight scale per output row (vLLM's dense W8A8-FP8 channel scheme; the
    benchmarks' ``fp8_static_ch``; a config gets it with ``quant_method.weight: per-channel``)."""
    from qatlib.quant import Granularity, preset

    s = preset("fp8_static")
    return s.replace(name="fp8_static_ch", weight=s.weight.replace(granularity=Granularity.CHANNEL))


def local_texts(n_docs: int = 200) -> list[str]:
    """English prose available offline: docstrings of the Python standard library."""
    import collections
    import functools
    import itertools
    import json
    import os.path
    import re
    import string
    import textwrap

    docs = []
    for mod in (collections, functools, itertools, json, os.path, re, string, textwrap, inspect):
        for _, obj in inspect.getmembers(mod):
            d = inspect.getdoc(obj)
            if d and len(d) > 80:
                docs.append(d)
    docs = sorted(set(docs))
    return docs[:n_docs]


def stage_inputs(tmp_path: Path, checkpoint: Path, tokenizer, scheme: list[str]) -> tuple[Path, list[str]]:
    """A user's model folder (``checkpoint`` copied to ``tmp_path/base`` with ``tokenizer``), a short
    training text, and the ``--set`` overrides a stage test runs ``scheme`` with on it."""
    base = tmp_path / "base"
    shutil.copytree(checkpoint, base)
    tokenizer.save_pretrained(base)
    (tmp_path / "train.txt").write_text("\n\n".join(local_texts(20)))
    data = [
        f"dataset.data_path={tmp_path / 'train.txt'}",
        "dataset.num_samples=3",
        "dataset.max_seq_length=32",
    ]
    return base, [*scheme, *data, f"model.model_path={base}"]


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    from qatlib.offline.tokenizer import train_tokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    return train_tokenizer(local_texts(), vocab_size=VOCAB, out_dir=out)


@pytest.fixture
def tiny_qwen3():
    return build_model(tiny_qwen3_config())


@pytest.fixture
def tiny_qwen3_moe():
    return build_model(tiny_qwen3_moe_config())


def stage_script(name: str):
    """``scripts/<name>.py`` imported as a module, so a test calls a stage's ``main(argv)`` as the
    workflow's rule runs it. The stage CLIs import their sibling ``_common`` at module level, so
    scripts/ is on ``sys.path`` only while they import (later calls use the bound modules)."""
    folder = str(Path(__file__).resolve().parents[1] / "scripts")
    sys.path.insert(0, folder)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(folder)


# --------------------------------------------------------------------------- multi-rank
REPO_ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def intra_op_threads(count: int):
    """torch's intra-op thread count inside the block, restored after it."""
    n = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def one_thread():
    """torchrun workers run with OMP_NUM_THREADS=1; match it so reductions run in the same order."""
    return intra_op_threads(1)


@pytest.fixture
def single_thread():
    """One intra-op thread for the test: on a shared 2-core machine, 2 spinning OpenMP threads per
    process made tiny-model steps ~50x slower (measured), while one thread loses little."""
    with one_thread():
        yield


def compute_device() -> torch.device:
    """The device single-process tests compute on: `qatlib.device`'s choice for this process
    (``cuda:0`` on a CUDA machine, else the CPU; ``QATLIB_DEVICE=cpu`` forces the CPU). Random data
    is drawn on the CPU (seeded generators are per device) and moved, so a test sees the same
    numbers on either device; only the arithmetic moves."""
    from qatlib import device

    return device.resolve().device


@pytest.fixture
def device() -> torch.device:
    """`compute_device` as a fixture (a test that takes it is marked ``device_aware``)."""
    return compute_device()


def pytest_collection_modifyitems(config, items):
    """Tests that take the ``device`` fixture and the multi-rank ones compute where the machine
    can: mark them ``device_aware`` so ``benchmarks.gpu_check`` selects them with ``-m``."""
    for item in items:
        if "device" in getattr(item, "fixturenames", ()) or item.get_closest_marker("multirank"):
            item.add_marker(pytest.mark.device_aware)


def multirank_device(nproc: int = 2) -> str:
    """The device type the ``nproc`` ranks of a multi-rank test run on (`qatlib.device`'s choice:
    one GPU per rank on a CUDA machine, else the CPU); skips the test, with the reason, on a CUDA
    machine with fewer GPUs than ranks (set QATLIB_DEVICE=cpu to run it on the CPU there)."""
    from qatlib import device

    rd = device.resolve()
    if rd.is_cuda and torch.cuda.device_count() < nproc:
        pytest.skip(
            f"multi-rank test needs {nproc} GPUs (one per rank), this machine has "
            f"{torch.cuda.device_count()}; QATLIB_DEVICE=cpu runs it on the CPU"
        )
    return rd.device.type


def torchrun(
    worker: Path, spec: dict, tmp: Path, timeout: float = 300, nproc: int = 2
) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``worker spec.json`` on ``nproc`` ranks (1 thread each, offline); (process, seconds).
    The ranks take their device from `qatlib.device` (CPU + gloo here; one GPU each + NCCL on a
    CUDA machine with enough GPUs, else the test is skipped: `multirank_device`)."""
    multirank_device(nproc)
    spec_path = tmp / f"{Path(worker).stem}_spec.json"
    spec_path.write_text(json.dumps(spec))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += [str(worker), str(spec_path)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp)
    return proc, time.perf_counter() - t0


# In CI (CI=true) a skipped test fails the run: CI installs nothing beyond install.sh (the README's
# test command), so a skip there means an install step is missing for users too, and a green run
# would hide it. Only what a CPU-only machine lacks by design may skip: CUDA / GPU tests.
HARDWARE_SKIP_WORDS = ("CUDA", "GPU")


def unexpected_skips(reports) -> list[str]:
    """The node ids and reasons of skips that no hardware explains."""
    out = []
    for r in reports:
        reason = r.longrepr[2] if isinstance(r.longrepr, tuple) else str(r.longrepr)
        if not any(w in reason for w in HARDWARE_SKIP_WORDS):
            out.append(f"{r.nodeid}: {reason}")
    return out


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("CI") != "true":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = unexpected_skips(reporter.stats.get("skipped", []) if reporter else [])
    if skipped:
        reporter.write_sep(
            "=", f"CI=true: {len(skipped)} skipped for want of something install.sh should install", red=True
        )
        for line in skipped[:50]:
            reporter.write_line("  " + line, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
