"""Fused-MoE linearisation (qatlib.surgery.moe) on a tiny Qwen3-MoE."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import build_model, tiny_qwen3_moe_config
from torch import nn

from qatlib.quant import PRESETS, prepare
from qatlib.surgery.moe import ExpertMLP, LinearizedMoeExperts, is_fused_experts, linearize_moe_experts


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


# --------------------------------------------------------------------------- issue #16
def _per_expert_loop(lin, x, idx, w):
    """The former forward: one torch.where (a host sync) per expert."""
    out = torch.zeros_like(x)
    for e, expert in enumerate(lin):
        token_idx, k_pos = torch.where(idx == e)
        y = expert(x[token_idx]) * w[token_idx, k_pos, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out


class _DataDependentOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts ops whose result the host must wait for (output shape or value read back)."""

    SYNCING = {"nonzero", "_local_scalar_dense", "bincount", "masked_select", "unique", "_unique2"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket.__name__ in self.SYNCING
        return func(*args, **(kwargs or {}))


def test_experts_forward_one_sync_per_layer_and_equal_to_per_expert_loop():
    cfg = tiny_qwen3_moe_config(num_experts=8)
    model = build_model(cfg)
    linearize_moe_experts(model)
    lin = model.model.layers[0].mlp.experts
    x = torch.randn(30, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    idx, w = _routing(30, 6, cfg.num_experts_per_tok, seed=2)  # experts 6, 7 get no token
    with torch.no_grad():
        ref = _per_expert_loop(lin, x, idx, w)
        with _DataDependentOps() as ops:
            out = lin(x, idx, w)
        with _DataDependentOps() as old_ops:
            _per_expert_loop(lin, x, idx, w)
    assert torch.equal(out, ref)  # same tokens in the same order per expert: bit-equal
    assert ops.count == 1 and old_ops.count == cfg.num_experts


def test_starved_experts_skip_the_fake_quant_but_get_zero_scale_gradients(monkeypatch):
    """Zero-token experts still run (same modules, same parameter use on every rank) but compute no
    fake-quantized weight; their scales get a zero gradient, not None (ZeRO-3 reduces them too)."""
    from qatlib.quant import QuantLinear, fq_linear

    cfg = tiny_qwen3_moe_config(num_experts=8, num_hidden_layers=1)
    model = build_model(cfg)
    prepare(model, PRESETS["fp8_static"])
    lin = model.model.layers[0].mlp.experts
    computed = []
    orig = fq_linear._fake_quant_parts
    monkeypatch.setattr(
        fq_linear, "_fake_quant_parts", lambda w, *a, **k: computed.append(w) or orig(w, *a, **k)
    )
    for p in model.parameters():
        p.requires_grad_(False)
    for ql in (m for m in lin.modules() if isinstance(m, QuantLinear)):
        ql.weight_quantizer.scale.requires_grad_(True)
    x = torch.randn(30, cfg.hidden_size, generator=torch.Generator().manual_seed(3), requires_grad=True)
    idx, w = _routing(30, 6, cfg.num_experts_per_tok, seed=2)
    lin(x, idx, w).square().sum().backward()
    weights = {
        id(m.weight): e for e, ex in enumerate(lin) for m in ex.modules() if isinstance(m, QuantLinear)
    }
    used = {weights[id(t)] for t in computed}
    assert used == set(range(6))  # forward + backward recompute, only for experts with tokens
    assert len(computed) == 2 * 3 * 6
    for e, ex in enumerate(lin):
        for ql in (ex.gate_proj, ex.up_proj, ex.down_proj):
            g = ql.weight_quantizer.scale.grad
            assert g is not None
            assert (g.abs().sum() == 0) == (e >= 6), (e, g)


def test_linearize_in_place_adds_at_most_one_layer(monkeypatch):
    """Measured with the profiler's allocation events (every CPU alloc / free, in order): the
    running sum of live bytes during linearisation never exceeds the start by more than one
    layer's experts, and ends where it started (the fused copies are gone)."""
    from torch.profiler import ProfilerActivity, profile

    cfg = tiny_qwen3_moe_config(num_hidden_layers=3, num_experts=8, hidden_size=128, moe_intermediate_size=64)
    marker = 777_777  # bytes of a tensor allocated just before the call: where the count starts
    # the model is built inside the profile: frees of blocks allocated before it starts are not recorded
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = build_model(cfg)
        experts = model.model.layers[0].mlp.experts
        layer_bytes = sum(p.numel() * p.element_size() for p in (experts.gate_up_proj, experts.down_proj))
        del experts
        start = torch.empty(marker, dtype=torch.uint8)
        linearize_moe_experts(model)
        del start
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    first = next(i for i, (_, n) in enumerate(events) if n == marker)
    live, peak = 0, 0
    for _, n in events[first + 1 :]:
        if n == -marker:
            break
        live += n
        peak = max(peak, live)
    assert (
        layer_bytes * 3 > 2 * layer_bytes + 100_000
    )  # three layers: the old peak is clearly above the bound
    assert peak <= layer_bytes * 1.02, (peak, layer_bytes)
    assert abs(live) <= 0.02 * layer_bytes, live
    assert all(isinstance(m.mlp.experts, LinearizedMoeExperts) for m in model.model.layers)


def test_checkpointed_layers_recompute_each_expert_in_its_own_backward():
    """`recompute_experts_one_by_one` under transformers' (non-reentrant) layer checkpointing: the
    layer's recompute stops before the experts, and each expert is recomputed when its own backward
    starts, so during the backward the experts run in reverse order, one at a time (what bounds a
    ZeRO-3 rank to one expert's gathered weights; the layer-wide recompute runs them 0..E-1 first).
    Loss and every gradient equal the plain layer checkpoint's bit for bit."""
    from qatlib.surgery.moe import recompute_experts_one_by_one

    torch.manual_seed(0)
    model = build_model(tiny_qwen3_moe_config(num_hidden_layers=1, num_experts=4, num_experts_per_tok=4))
    linearize_moe_experts(model)
    model.train().activation_checkpointing_enable()  # transformers' default: use_reentrant=False
    experts = model.model.layers[0].mlp.experts
    calls: list[int] = []
    for e, ex in enumerate(experts):
        ex.register_forward_pre_hook(
            lambda m, a, e=e: calls.append(e) if torch._C._current_graph_task_id() != -1 else None
        )
    ids = _ids(3)

    def run() -> tuple[torch.Tensor, dict[str, torch.Tensor], list[int]]:
        model.zero_grad()
        calls.clear()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return (
            loss.detach(),
            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            list(calls),
        )

    loss0, grads0, order0 = run()
    assert order0 == [0, 1, 2, 3]  # the layer's recompute: every expert, in forward order
    assert recompute_experts_one_by_one(model) == 1
    loss1, grads1, order1 = run()
    assert order1 == [3, 2, 1, 0]  # each expert inside its own backward (the last one's comes first)
    assert torch.equal(loss0, loss1)
    assert grads0.keys() == grads1.keys() and any("experts.0.down_proj" in n for n in grads1)
    for n in grads0:
        assert torch.equal(grads0[n], grads1[n]), n
