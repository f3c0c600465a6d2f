"""The export plan (`qatlib.export.plan`) of real cases, against expectations derived by hand from
the model's structure and from what vLLM 0.33 does at load (shared/design/runtime-contract.md: for
fp8 per-tensor weights and static per-tensor inputs it takes the max of the fused q/k/v and gate/up
shards' weight and input scales, of each expert's w1/w3 weight scales, and of every expert's input
scale per fused-MoE layer); then the export writes what its plan says."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_model, tiny_qwen3_config, tiny_qwen3_moe_config

from qatlib.export import ExportError, export, plan_export
from qatlib.ptq import calibrate
from qatlib.quant import PrepareOptions, preset
from qatlib.runtime.tying import tie_for

FP8 = preset("fp8_static")
VLLM = PrepareOptions(deploy=tie_for("vllm"))
ATTN = ("q_proj", "k_proj", "v_proj")


def _batches(n=2, b=2, t=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (b, t), generator=g) for _ in range(n)]


def _calibrated(cfg, scheme=FP8, **kw):
    model = build_model(cfg)
    return model, calibrate(model, scheme, _batches(), options=VLLM, **kw).scheme


def _groups(plan, runtime="vllm"):
    return {frozenset(g.names) for g in plan.ties[runtime]}


def _q(prefix, projs, role):
    return frozenset(f"{prefix}.{p}.{role}_quantizer" for p in projs)


def test_dense_qwen3_fp8_static_vllm_plan():
    """2 decoder layers: per layer, q/k/v share one input and one weight scale, gate/up another
    pair; o_proj / down_proj are never fused. Nothing else is merged."""
    model, scheme = _calibrated(tiny_qwen3_config())
    plan = plan_export(model, scheme, "real")
    want = set()
    for i in range(2):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        for role in ("input", "weight"):
            want |= {_q(a, ATTN, role), _q(m, ("gate_proj", "up_proj"), role)}
    assert _groups(plan) == want
    assert not any("o_proj" in n or "down_proj" in n for g in want for n in g)
    assert _groups(plan, "sglang") == want  # SGLang takes the same maxima on dense layers
    # the unquantized modules, by name: the embedding and the (default-ignored) lm_head
    assert plan.ignore == ("model.embed_tokens", "lm_head")
    assert plan.fmt.format == "float-quantized"
    assert plan.quantization_config.ignore == ["model.embed_tokens", "lm_head"]
    assert dict(plan.kv_roles) == {
        f"model.layers.{i}.self_attn.{p}_proj": p for i in range(2) for p in ("k", "v")
    }
    assert plan.aliases == frozenset() and plan.kv_file is None and plan.resume_file is None
    vllm = plan.deployment["vllm 0.33.0"]
    assert vllm["loads"] and vllm["scales_tied"]  # trained as vLLM serves it: nothing collapses
    assert not any("fused groups have different" in d for d in vllm["differences"])


def test_moe_qwen3_fp8_static_vllm_plan():
    """Qwen3-MoE (2 layers, 4 experts, every MLP sparse): per layer q/k/v (input, weight), the
    layer's w13 inputs (8 quantizers) and w2 inputs (4), each expert's gate/up weights; the router
    gates and lm_head stay unquantized and are listed by name."""
    model, scheme = _calibrated(tiny_qwen3_moe_config())
    plan = plan_export(model, scheme, "real")
    want = set()
    for i in range(2):
        a, ex = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp.experts"
        want |= {_q(a, ATTN, "input"), _q(a, ATTN, "weight")}
        want.add(
            frozenset(f"{ex}.{e}.{p}.input_quantizer" for e in range(4) for p in ("gate_proj", "up_proj"))
        )
        want.add(frozenset(f"{ex}.{e}.down_proj.input_quantizer" for e in range(4)))
        want |= {_q(f"{ex}.{e}", ("gate_proj", "up_proj"), "weight") for e in range(4)}
    assert _groups(plan) == want
    assert set(plan.ignore) == {
        "model.embed_tokens",
        "lm_head",
        "model.layers.0.mlp.gate",
        "model.layers.1.mlp.gate",
    }
    assert plan.deployment["vllm 0.33.0"]["scales_tied"]


def test_plan_of_side_files_and_tied_embeddings():
    model, scheme = _calibrated(tiny_qwen3_config(tie_word_embeddings=True), kv="per-tensor")
    both = plan_export(model, scheme, "real_and_kvcache")
    assert both.kv_file == "qatlib/kv_cache_scales.safetensors" and both.resume_file is None
    assert both.aliases == {"lm_head.weight"}  # written once, as model.embed_tokens.weight
    only = plan_export(model, scheme, "save_kvcache_only")
    assert only.kv_file == "kv_cache_scales.safetensors" and only.weights is None
    assert only.fmt is None and only.ignore == () and not only.deployment and not only.ties
    fake = plan_export(model, scheme, "fake")
    assert fake.resume_file == "qatlib/scales.safetensors" and fake.kv_file is None
    with pytest.raises(ExportError, match="save_format"):
        plan_export(model, scheme, "pt")


def test_export_writes_its_plan(tmp_path):
    model, scheme = _calibrated(tiny_qwen3_moe_config(), kv="per-tensor")
    plan = plan_export(model, scheme, "real_and_kvcache")
    out = export(model, scheme, tmp_path / "e", "real_and_kvcache")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == list(plan.ignore)
    assert json.loads((out / "qatlib_export.json").read_text()) == json.loads(json.dumps(plan.record()))
    from safetensors import safe_open

    with safe_open(out / plan.kv_file, "pt") as f:
        keys = set(f.keys())
    assert keys == {f"model.layers.{i}.self_attn.{p}_cache.scale" for i in range(2) for p in "kv"}
