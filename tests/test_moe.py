"""Fused-MoE linearisation (qatlib.moe) on a tiny Qwen3-MoE."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import build_model, tiny_qwen3_moe_config
from torch import nn

from qatlib.moe import ExpertMLP, LinearizedMoeExperts, is_fused_experts, linearize_moe_experts
from qatlib.quant import PRESETS, prepare


def _ids(seed: int, batch: int = 2, seq: int = 12) -> torch.Tensor:
    return torch.randint(0, 512, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _routing(n_tok: int, n_exp: int, top_k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n_tok, n_exp, generator=g)
    w, idx = torch.softmax(logits, -1).topk(top_k, dim=-1)
    return idx, w / w.sum(-1, keepdim=True)


def test_linearize_copies_weights_and_names(tiny_qwen3_moe):
    cfg = tiny_qwen3_moe.config
    fused = [m for m in tiny_qwen3_moe.modules() if is_fused_experts(m)]
    assert len(fused) == cfg.num_hidden_layers
    gate_up = [f.gate_up_proj.detach().clone() for f in fused]
    down = [f.down_proj.detach().clone() for f in fused]
    assert linearize_moe_experts(tiny_qwen3_moe) == cfg.num_hidden_layers
    assert linearize_moe_experts(tiny_qwen3_moe) == 0  # idempotent
    inter = cfg.moe_intermediate_size
    for layer in range(cfg.num_hidden_layers):
        experts = tiny_qwen3_moe.model.layers[layer].mlp.experts
        assert isinstance(experts, LinearizedMoeExperts) and len(experts) == cfg.num_experts
        for e, ex in enumerate(experts):
            assert isinstance(ex, ExpertMLP)
            assert type(ex.gate_proj) is nn.Linear and ex.gate_proj.bias is None
            assert torch.equal(ex.gate_proj.weight, gate_up[layer][e, :inter])
            assert torch.equal(ex.up_proj.weight, gate_up[layer][e, inter:])
            assert torch.equal(ex.down_proj.weight, down[layer][e])
            assert ex.gate_proj.weight.shape == (inter, cfg.hidden_size)
            assert ex.down_proj.weight.shape == (cfg.hidden_size, inter)


def test_linearized_names_equal_saved_checkpoint_keys(tiny_qwen3_moe, tmp_path):
    """transformers 5 writes per-expert keys on save; the linearised module names are the same."""
    from safetensors import safe_open

    tiny_qwen3_moe.save_pretrained(tmp_path)
    with safe_open(os.path.join(tmp_path, "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    linearize_moe_experts(tiny_qwen3_moe)
    names = set(tiny_qwen3_moe.state_dict())
    assert names == saved
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_experts_forward_matches_fused(impl):
    """Max abs difference <= 1e-6 (not exact: one fused gate_up matmul vs two separate matmuls)."""
    model = build_model(tiny_qwen3_moe_config())
    model.config._experts_implementation = impl
    fused = model.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, model.config.hidden_size, generator=g)
    # route over experts 0..2 only: the last expert gets no token at all
    idx, w = _routing(20, model.config.num_experts - 1, model.config.num_experts_per_tok, seed=1)
    with torch.no_grad():
        ref = fused(x, idx, w)
        linearize_moe_experts(model)
        lin = model.model.layers[0].mlp.experts
        calls = []
        hooks = [ex.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0])) for ex in lin]
        out = lin(x, idx, w)
    for h in hooks:
        h.remove()
    assert (out - ref).abs().max() <= 1e-6
    assert len(calls) == model.config.num_experts and calls[-1] == 0  # every expert runs, even with 0 tokens


def test_model_forward_matches_fused():
    model = build_model(tiny_qwen3_moe_config())
    ids = _ids(0)
    with torch.no_grad():
        ref = model(ids).logits
        linearize_moe_experts(model)
        out = model(ids).logits
    diff = (out - ref).abs().max()
    assert diff <= 1e-6, diff


def test_linearized_bf16_and_gradients():
    model = build_model(tiny_qwen3_moe_config()).to(torch.bfloat16)
    linearize_moe_experts(model)
    ex = model.model.layers[0].mlp.experts[0]
    assert ex.gate_proj.weight.dtype == torch.bfloat16
    model.train()
    model(_ids(1)).logits.float().sum().backward()
    grads = [ex.gate_proj.weight.grad for ex in model.model.layers[0].mlp.experts]
    assert any(g is not None and g.abs().sum() > 0 for g in grads)


def test_copy_weights_false_keeps_structure():
    model = build_model(tiny_qwen3_moe_config())
    linearize_moe_experts(model, copy_weights=False)
    assert isinstance(model.model.layers[0].mlp.experts, LinearizedMoeExperts)


def _fake_fused(**attrs):
    class FakeExperts(nn.Module):
        def __init__(self):
            super().__init__()
            self.num_experts, self.hidden_dim, self.intermediate_dim = 2, 8, 4
            self.gate_up_proj = nn.Parameter(torch.zeros(2, 8, 8))
            self.down_proj = nn.Parameter(torch.zeros(2, 8, 4))
            self.act_fn = nn.SiLU()
            for k, v in attrs.items():
                setattr(self, k, v)

    return nn.Sequential(FakeExperts())


@pytest.mark.parametrize(
    "attrs,match",
    [
        (dict(is_transposed=True), "transposed"),
        (dict(is_concatenated=False), "interleaved"),
        (dict(has_bias=True), "biases"),
        (dict(has_post_expert_norm=True), "post-expert norm"),
        (dict(intermediate_dim=3), "instead of"),
    ],
)
def test_unsupported_fused_layouts_are_refused(attrs, match):
    m = _fake_fused(**attrs)
    assert is_fused_experts(m[0])
    with pytest.raises(NotImplementedError, match=match):
        linearize_moe_experts(m)
    with pytest.raises(NotImplementedError, match=match):
        prepare(m, PRESETS["fp8_dynamic"])


def test_supported_fake_layout_is_linearised():
    m = _fake_fused()
    assert linearize_moe_experts(m) == 1 and isinstance(m[0], LinearizedMoeExperts)
