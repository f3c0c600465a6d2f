"""The host-heap policy of CPU training (`qatlib.zero3.heap`): the trim gives freed heap pages back to
the OS, only above its limit; the layer hooks run it at every decoder-layer boundary; a model
whose decoder layer passes the limit trains without heap reuse. What it buys at width is measured
in benchmarks/plan_rehearsal.py (benchmarks/README.md at 2faaa77, Memory plan vs measured)."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model, tiny_qwen3_config

from qatlib.zero3 import heap

pytestmark = pytest.mark.skipif(heap._libc() is None, reason="glibc only")


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def test_trim_gives_freed_heap_pages_back_only_above_its_limit():
    heap.mmap_large_allocations()  # 200 kB blocks come from the heap, as a CPU rank's would
    blocks = [torch.ones(50_000) for _ in range(600)]  # 600 x 200 kB, touched
    del blocks[::2]  # 60 MB freed between live blocks: glibc keeps it (no top to trim)
    assert heap.free_heap_bytes() >= 50e6
    assert heap.trim_freed_memory(limit=1 << 40) is False  # under the limit: nothing runs
    before = _rss()
    assert heap.trim_freed_memory(limit=1 << 20) is True
    assert before - _rss() >= 40e6  # most of the 60 MB went back
    assert all(bool((b == 1).all()) for b in blocks)  # the live blocks are untouched


def test_layer_trims_run_at_every_decoder_layer_boundary():
    model = build_model(tiny_qwen3_config(num_hidden_layers=3))
    calls = []
    handles = heap.install_layer_trims(model, trim=lambda: calls.append(1))
    assert len(handles) == 6
    with torch.no_grad():
        model(input_ids=torch.arange(8)[None])
    assert len(calls) == 6  # before and after each of the 3 layers
    for h in handles:
        h.remove()


def test_a_layer_above_the_limit_trains_without_heap_reuse():
    from transformers import LlamaConfig, LlamaForCausalLM

    small = build_model(tiny_qwen3_config())
    assert heap.layer_bytes(small) < heap.TRIM_LIMIT
    rec = heap.configure_training(small, "cpu")
    assert rec["reuse"] is True and rec["layer_trims"] == 2
    assert heap.configure_training(small, "cuda")["layer_trims"] == 0
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=1, vocab_size=32)
    with torch.device("meta"):
        big = LlamaForCausalLM(cfg)
    # 4 x 4096^2 attention + 3 x 4096 x 11008 MLP + 2 norms, fp32
    assert heap.layer_bytes(big) == 4 * (4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096)
    assert heap.configure_training(big, "cpu")["reuse"] is False
