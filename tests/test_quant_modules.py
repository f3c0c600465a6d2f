"""Quantizer, QuantLinear, prepare / convert / quantization_disabled and fp8 attention on tiny
Qwen3 and Qwen3-MoE models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as TF
from conftest import build_model, tiny_qwen3_config, tiny_qwen3_moe_config
from torch import nn

from qatlib.quant import (
    PRESETS,
    ROLE_LWC,
    ROLE_SCALE,
    Granularity,
    QDQLinear,
    Quantizer,
    QuantLinear,
    QuantScheme,
    QuantSpec,
    compute_qparams,
    convert,
    fake_quantize,
    prepare,
    quant_linears,
    quantization_disabled,
    quantizers,
)
from qatlib.quant.attention import FP8_ATTN_IMPL, enable_fp8_attention, fp8_eager_attention_forward
from qatlib.quant.linear import matches_any
from qatlib.quant.quantizer import PARAM_ROLES, role_parameters

FP8 = torch.float8_e4m3fn
VOCAB = 512


def _ids(seed: int, batch: int = 2, seq: int = 12) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _with_group(scheme: QuantScheme, group_size: int, **weight_changes) -> QuantScheme:
    return scheme.replace(weight=scheme.weight.replace(group_size=group_size, **weight_changes))


@torch.no_grad()
def _logits(model, ids):
    return model(ids).logits


@torch.no_grad()
def calibrate_activations(model, batches) -> None:
    """Static activation / output scales from data (what PTQ does before QAT)."""
    qs = [q for name, q in quantizers(model) if q.scale is not None and not name.endswith("weight_quantizer")]
    for q in qs:
        q.start_calibration()
    for ids in batches:
        model(ids)
    for q in qs:
        q.finish_calibration()


# =========================================================================== Quantizer
def test_static_quantizer_params_stay_fp32_through_model_casts():
    model = nn.Sequential(nn.Linear(8, 8))
    q = Quantizer(QuantSpec("int4", Granularity.GROUP, group_size=4, symmetric=False), (8, 8))
    model.add_module("q", q)
    with torch.no_grad():
        q.scale.fill_(1.2345678e-3)
        q.zero_point.fill_(-3.0)
    scale_obj = q.scale
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.float()):
        cast(model)
        assert q.scale is scale_obj
        assert q.scale.dtype == torch.float32 and q.zero_point.dtype == torch.float32
        # the fp32 master value itself survives (a bf16 round trip would give 1.2359619e-3)
        assert q.scale[0, 0].item() == torch.tensor(1.2345678e-3).item()
    assert model[0].weight.dtype == torch.float32
    # the same with a gradient attached (a bf16 .grad on an fp32 param would break the next backward)
    q(torch.randn(8, 8)).sum().backward()
    model.to(torch.bfloat16)
    assert q.scale.grad.dtype == torch.float32
    q(torch.randn(8, 8, dtype=torch.bfloat16)).sum().backward()


def test_dynamic_quantizer_has_no_params():
    for spec in (
        QuantSpec("int8", Granularity.TOKEN),
        QuantSpec("fp8", dynamic=True),
        QuantSpec("int8", Granularity.HEAD, num_heads=2, dynamic=True, symmetric=False),
    ):
        q = Quantizer(spec)
        assert list(q.parameters()) == []
        x = torch.randn(3, 4, 8)
        assert torch.equal(q(x), fake_quantize(x, *compute_qparams(x, spec), spec))
        with pytest.raises(ValueError):
            q.qparams()
    with pytest.raises(ValueError, match="LWC"):
        Quantizer(QuantSpec("int8", Granularity.TOKEN), lwc_init=4.0)
    with pytest.raises(ValueError, match="shape"):
        Quantizer(QuantSpec("int8"))


def test_static_quantizer_params_and_roles():
    q = Quantizer(QuantSpec("int4", Granularity.CHANNEL, symmetric=False), (6, 8), init_value=0.5)
    assert dict(q.named_parameters()).keys() == {"scale", "zero_point"}
    assert q.scale.shape == (6, 1) and torch.equal(q.scale, torch.full((6, 1), 0.5))
    roles = {n: r for n, r in ((n, PARAM_ROLES[n]) for n, _ in q.named_parameters())}
    assert roles == {"scale": ROLE_SCALE, "zero_point": ROLE_SCALE}
    with pytest.raises(ValueError, match="does not match"):
        q.set_qparams(torch.ones(6), torch.zeros(6))
    with pytest.raises(ValueError, match="zero point"):
        q.set_qparams(torch.ones(6, 1))
    x = torch.randn(6, 8)
    q.enabled = False
    assert q(x) is x


@pytest.mark.parametrize(
    "spec_kw",
    [dict(granularity=Granularity.TENSOR), dict(granularity=Granularity.HEAD, num_heads=4)],
    ids=["tensor", "head"],
)
@pytest.mark.parametrize("qtype,sym", [("int8", True), ("int8", False), ("int4", False), ("fp8", True)])
def test_calibration_equals_qparams_of_concatenated_data(qtype, sym, spec_kw):
    spec = QuantSpec(qtype, symmetric=sym, **spec_kw)
    q = Quantizer(spec, (16,))
    g = torch.Generator().manual_seed(0)
    batches = [
        torch.randn(2, 5, 16, generator=g) * 3,
        torch.randn(1, 3, 16, generator=g) + 2,
        torch.randn(4, 1, 16, generator=g),
    ]
    batches[1][..., 4:8] -= 10  # one head far negative
    q.start_calibration()
    for x in batches:
        assert q(x) is x  # calibration forwards pass through unquantized
    q.finish_calibration()
    assert not q.calibrating and bool(q.initialized)
    cat = torch.cat([b.reshape(-1, 16) for b in batches])
    scale, zp = compute_qparams(cat, spec)
    assert torch.equal(q.scale.data, scale)
    if not sym:
        assert torch.equal(q.zero_point.data, zp)
    assert q.scale.shape == ((4,) if spec_kw["granularity"] is Granularity.HEAD else (1,))
    # then quantizes with those scales
    x = batches[0]
    assert torch.equal(q(x), fake_quantize(x, scale, zp, spec))


def test_calibration_without_data_raises():
    q = Quantizer(QuantSpec("fp8"), (4,))
    q.start_calibration()
    q(torch.empty(0, 4))
    with pytest.raises(RuntimeError, match="no data"):
        q.finish_calibration()


@pytest.mark.parametrize("sym", [True, False])
def test_lwc_scale_at_init_and_gradients(sym):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 16, generator=g)
    spec = QuantSpec("int4", Granularity.GROUP, group_size=8, symmetric=sym)
    q = Quantizer(spec, (4, 16), lwc_init=4.0)
    assert dict(q.named_parameters()).keys() == {"clip_factor_w_max", "clip_factor_w_min"}
    assert (
        q.uses_lwc
        and q.scale is None
        and [n for n, _ in role_parameters(q, ROLE_LWC)] == ["clip_factor_w_max", "clip_factor_w_min"]
    )
    assert q.clip_factor_w_max.shape == (4, 2)

    scale, zp = q.qparams(w)
    wg = w.reshape(4, 2, 8)
    mx, mn = wg.amax(-1).clamp(min=0), wg.amin(-1).clamp(max=0)
    sig4 = torch.sigmoid(torch.tensor(4.0))
    if sym:
        expect = sig4 * torch.maximum(mx, -mn) / 7
        assert zp is None
    else:
        expect = sig4 * (mx - mn) / 15
        torch.testing.assert_close(zp, torch.round(-8 - sig4 * mn / expect).clamp(-8, 7), rtol=0, atol=0)
    torch.testing.assert_close(scale, expect, rtol=1e-6, atol=0)
    assert torch.equal(q(w), fake_quantize(w, scale, zp, spec))

    # gradients reach the clip factors, and equal the chain rule dL/ds * ds/dc
    up = torch.randn(4, 16, generator=g)
    (q(w) * up).sum().backward()
    assert q.clip_factor_w_max.grad.abs().sum() > 0
    s_leaf = scale.detach().clone().requires_grad_(True)
    (fake_quantize(w, s_leaf, zp, spec) * up).sum().backward()
    dsig = sig4 * (1 - sig4)
    if sym:
        use_max = mx >= -mn
        exp_max = torch.where(use_max, s_leaf.grad * dsig * mx / 7, 0.0)
        exp_min = torch.where(use_max, 0.0, s_leaf.grad * dsig * (-mn) / 7)
    else:
        exp_max = s_leaf.grad * dsig * mx / 15
        exp_min = -s_leaf.grad * dsig * mn / 15
    torch.testing.assert_close(q.clip_factor_w_max.grad, exp_max, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(q.clip_factor_w_min.grad, exp_min, rtol=1e-4, atol=1e-7)


def test_lwc_scale_is_what_convert_stores():
    torch.manual_seed(0)
    lin = nn.Linear(16, 4, bias=False)
    scheme = QuantScheme("lwc", weight=QuantSpec("int4", Granularity.GROUP, group_size=8, symmetric=False))
    ql = QuantLinear(lin, scheme, lwc_init=4.0)
    with torch.no_grad():
        ql.weight_quantizer.clip_factor_w_max.add_(torch.randn(4, 2))
    scale, zp = ql.weight_quantizer.qparams(ql.weight)
    qdq = QDQLinear(ql)
    assert torch.equal(qdq.weight_scale, scale) and torch.equal(qdq.weight_zero_point, zp)
    x = torch.randn(3, 16)
    assert torch.equal(qdq(x), ql(x))


# =========================================================================== QuantLinear
def test_quant_linear_identity_and_forward():
    torch.manual_seed(0)
    lin = nn.Linear(16, 8)
    scheme = QuantScheme(
        "t",
        weight=QuantSpec("int4", Granularity.GROUP, group_size=4),
        input=QuantSpec("fp8"),
        k=QuantSpec("fp8"),
    )
    ql = QuantLinear(
        lin, scheme, output_spec=QuantSpec("int8", Granularity.HEAD, num_heads=2), act_init_value=0.05
    )
    assert ql.weight is lin.weight and ql.bias is lin.bias
    ws, _ = compute_qparams(lin.weight, scheme.weight)
    assert torch.equal(ql.weight_quantizer.scale.data, ws)  # initialised from the weight
    assert ql.output_quantizer.scale.shape == (2,)
    x = torch.randn(2, 3, 16) * 4
    xq = fake_quantize(x, torch.tensor([0.05]), None, scheme.input)
    ref = TF.linear(xq, fake_quantize(lin.weight, ws, None, scheme.weight), lin.bias)
    ref = fake_quantize(ref, torch.full((2,), 0.05), None, ql.output_quantizer.spec)
    assert torch.equal(ql(x), ref)
    # gradients reach the shared weight Parameter and every scale
    ql(x).sum().backward()
    assert lin.weight.grad is not None and ql.weight_quantizer.scale.grad is not None
    assert ql.input_quantizer.scale.grad is not None and ql.output_quantizer.scale.grad is not None


def test_prepare_keeps_parameter_objects():
    model = build_model(tiny_qwen3_config())
    before = {n: p for n, p in model.named_parameters()}
    prepare(model, _with_group(PRESETS["int4_weight_only"], 32))
    after = dict(model.named_parameters())
    for n, p in before.items():
        assert after[n] is p, n  # same names, same objects (optimizer / ZeRO-3 references survive)
    extra = set(after) - set(before)
    assert extra and all(n.endswith("weight_quantizer.scale") for n in extra)


# =========================================================================== selection
def test_matches_any_patterns():
    name = "model.layers.0.mlp.gate"
    assert (
        matches_any(name, ["gate"])
        and matches_any(name, ["mlp.gate"])
        and matches_any(name, ["mlp.gate.weight"])
    )
    assert not matches_any("model.layers.0.mlp.gate_proj", ["gate"])
    assert not matches_any("model.layers.0.mlp.gate_proj", ["mlp.gate.weight"])
    assert not matches_any("model.layers.0.mlp.experts.3.gate_proj", ["gate", "gate.weight"])
    assert matches_any("lm_head", ["lm_head"]) and not matches_any("model.lm_head_extra", ["lm_head"])
    assert matches_any("model.layers.1.self_attn.k_proj", [r"re:model\.layers\.1\..*"])
    assert not matches_any("model.layers.11.self_attn.k_proj", [r"re:model\.layers\.1\..*_proj"])
    assert not matches_any("model.layers.1.self_attn.k_proj", ["re:layers"])  # full match, not search


def test_prepare_ignore_patterns_dense():
    scheme = PRESETS["int8"]
    model = prepare(build_model(tiny_qwen3_config()), scheme)
    names = {n for n, _ in quant_linears(model)}
    assert "lm_head" not in names and type(model.lm_head) is nn.Linear  # ignored by default
    assert len(names) == 2 * 7

    model = prepare(build_model(tiny_qwen3_config()), scheme, ignore=["gate"])
    assert isinstance(model.model.layers[0].mlp.gate_proj, QuantLinear)  # "gate" is not "gate_proj"

    ignore = ["lm_head", "down_proj.weight", r"re:model\.layers\.1\.self_attn\..*"]
    model = prepare(build_model(tiny_qwen3_config()), scheme, ignore=ignore)
    names = {n for n, _ in quant_linears(model)}
    assert not any(n.endswith("down_proj") for n in names)
    assert not any(n.startswith("model.layers.1.self_attn") for n in names)
    assert "model.layers.0.self_attn.o_proj" in names and "model.layers.1.mlp.up_proj" in names
    assert len(names) == 2 * 7 - 2 - 4

    model = prepare(build_model(tiny_qwen3_config()), scheme, ignore=[])
    assert isinstance(model.lm_head, QuantLinear)


def test_router_gate_linear_never_swapped():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(8, 4, bias=False)
            self.experts = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])
            self.shared = nn.Module()
            self.shared.gate = nn.Linear(8, 8)  # a "gate" that is not a router (no experts sibling)

    m = prepare(nn.Sequential(Block()), PRESETS["int8"])
    assert type(m[0].gate) is nn.Linear
    assert all(isinstance(e, QuantLinear) for e in m[0].experts)
    assert isinstance(m[0].shared.gate, QuantLinear)


def test_moe_experts_linearised_and_quantized(tiny_qwen3_moe):
    cfg = tiny_qwen3_moe.config
    router = tiny_qwen3_moe.model.layers[0].mlp.gate
    router_w = router.weight
    prepare(tiny_qwen3_moe, PRESETS["fp8_dynamic"])
    names = [n for n, _ in quant_linears(tiny_qwen3_moe)]
    assert len(names) == cfg.num_hidden_layers * (4 + 3 * cfg.num_experts)
    for layer in range(cfg.num_hidden_layers):
        for e in range(cfg.num_experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert f"model.layers.{layer}.mlp.experts.{e}.{proj}" in names
    mlp = tiny_qwen3_moe.model.layers[0].mlp
    assert mlp.gate is router and mlp.gate.weight is router_w  # router untouched, not quantized
    assert not any(n.endswith(".mlp.gate") for n in names)
    assert not any(hasattr(m, "gate_up_proj") for m in tiny_qwen3_moe.modules())


# =========================================================================== prepare -> convert
SCHEMES = {
    "fp8_static": PRESETS["fp8_static"],
    "w4a8_fp8_g32": _with_group(PRESETS["w4a8_fp8"], 32),
    "int4_g32_sym": _with_group(PRESETS["int4_weight_only"], 32),
    "int4_g32_asym": _with_group(PRESETS["int4_weight_only"], 32, symmetric=False),
    "w8a8": PRESETS["int8"],
    "fp8_dynamic": PRESETS["fp8_dynamic"],
    "int3_channel_asym_kv_head": QuantScheme(
        "custom",
        weight=QuantSpec("int3", Granularity.CHANNEL, symmetric=False),
        input=QuantSpec("int8", Granularity.TENSOR, symmetric=False),
        k=QuantSpec("fp8", Granularity.HEAD),
        v=QuantSpec("int8", Granularity.HEAD, symmetric=False),
    ),
}


@pytest.mark.parametrize("arch", ["dense", "moe"])
@pytest.mark.parametrize("name", list(SCHEMES))
def test_prepare_convert_parity(name, arch, device):
    """convert replaces fake-quant by stored codes + scales; the logits must not move by one bit:
    both paths run the same fp32 ops (fake_quantize == dequantize(quantize))."""
    cfg = tiny_qwen3_config() if arch == "dense" else tiny_qwen3_moe_config()
    scheme = SCHEMES[name]
    for seed in range(3 if arch == "dense" else 2):
        model = build_model(cfg, seed=seed).to(device)
        ids = _ids(seed).to(device)
        ref = _logits(model, ids)
        prepare(model, scheme)
        calibrate_activations(model, [_ids(seed + 100, 4, 16).to(device)])
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():  # move the scales / zero points as training would
            for _, q in quantizers(model):
                if q.scale is not None:
                    q.scale.mul_((0.9 + 0.2 * torch.rand(q.scale.shape, generator=g)).to(device))
                if q.zero_point is not None:
                    q.zero_point.add_((torch.rand(q.zero_point.shape, generator=g) - 0.5).to(device))
        fq = _logits(model, ids)
        assert not torch.equal(fq, ref)
        n = len(list(quant_linears(model)))
        convert(model)
        assert not list(quant_linears(model))
        qdq = [m for m in model.modules() if isinstance(m, QDQLinear)]
        assert len(qdq) == n
        for m in qdq:
            codes = m.weight
            assert codes.dtype == (FP8 if scheme.weight.is_fp8 else torch.int8)
            if not scheme.weight.is_fp8:
                assert codes.min() >= scheme.weight.qmin and codes.max() <= scheme.weight.qmax
            assert m.weight_scale.dtype == torch.float32
            if m.weight_zero_point is not None:  # stored zero points are integers (design.md)
                assert torch.equal(m.weight_zero_point, m.weight_zero_point.round())
        out = _logits(model, ids)
        assert torch.equal(out, fq), (name, arch, seed, (out - fq).abs().max())


def test_convert_parity_bf16_model():
    model = build_model(tiny_qwen3_config()).to(torch.bfloat16)
    prepare(model, _with_group(PRESETS["w4a8_fp8"], 32))
    calibrate_activations(model, [_ids(5, 4, 16)])
    ids = _ids(0)
    fq = _logits(model, ids)
    assert fq.dtype == torch.bfloat16
    convert(model)
    assert torch.equal(_logits(model, ids), fq)


def test_convert_unprepared_raises():
    with pytest.raises(ValueError, match="no QuantLinear"):
        convert(build_model(tiny_qwen3_config()))


def test_quantization_disabled_gives_unquantized_logits(device):
    model = build_model(tiny_qwen3_config()).to(device)
    ids = _ids(1).to(device)
    ref = _logits(model, ids)
    prepare(model, _with_group(PRESETS["w4a8_fp8"], 32))
    calibrate_activations(model, [ids])
    fq = _logits(model, ids)
    assert not torch.equal(fq, ref)
    with quantization_disabled(model):
        assert torch.equal(_logits(model, ids), ref)  # exact: disabled quantizers return x itself
    assert torch.equal(_logits(model, ids), fq)  # and switched back on
    # a quantizer disabled by the user stays disabled afterwards
    q = model.model.layers[0].self_attn.q_proj.weight_quantizer
    q.enabled = False
    with quantization_disabled(model):
        pass
    assert q.enabled is False


def test_quantization_disabled_moe_matches_fused_model():
    model = build_model(tiny_qwen3_moe_config())
    ids = _ids(2)
    ref = _logits(model, ids)
    prepare(model, PRESETS["fp8_dynamic"])
    with quantization_disabled(model):
        out = _logits(model, ids)
    # not bit-exact: separate gate / up matmuls vs the fused gate_up matmul round differently
    assert (out - ref).abs().max() <= 1e-6


def test_group_size_must_divide_in_features():
    model = build_model(tiny_qwen3_config())
    with pytest.raises(
        ValueError,
        match=r"group_size 48 does not divide in_features of: model\.layers\.0\.self_attn\.q_proj \(in_features=64\)",
    ):
        prepare(model, _with_group(PRESETS["int4_weight_only"], 48))
    assert not list(quant_linears(model))  # nothing swapped before the error
    with pytest.raises(ValueError) as err:
        prepare(model, PRESETS["int4_weight_only"])  # g128: 6 of the 7 linears per layer (not down_proj)
    msg = str(err.value)
    assert "model.layers.0.mlp.up_proj (in_features=64)" in msg and "down_proj" not in msg
    assert msg.endswith("and 2 more")  # 12 layers listed as 10 + a count


def test_scales_fp32_under_bf16_model():
    model = build_model(tiny_qwen3_config()).to(torch.bfloat16)
    scheme = _with_group(PRESETS["w4a8_fp8"], 32, symmetric=False, fp8_recast=False).replace(
        k=QuantSpec("fp8", Granularity.HEAD), v=QuantSpec("int8", Granularity.HEAD, symmetric=False)
    )
    prepare(model, scheme)
    calibrate_activations(model, [_ids(0)])
    params = [(f"{qn}.{pn}", p) for qn, q in quantizers(model) for pn, p in q.named_parameters()]
    assert params and all(p.dtype == torch.float32 for _, p in params)
    snapshot = {id(p): p.detach().clone() for _, p in params}
    model.to(torch.bfloat16)
    assert all(p.dtype == torch.float32 and torch.equal(p, snapshot[id(p)]) for _, p in params)
    out = _logits(model, _ids(0))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    # and a backward in bf16 gives fp32 scale gradients
    model.train()
    model(_ids(0)).logits.float().sum().backward()
    q = model.model.layers[0].self_attn.k_proj
    assert q.weight_quantizer.scale.grad.dtype == torch.float32
    assert q.output_quantizer.scale.grad.dtype == torch.float32


def test_per_head_output_quantizers_get_head_counts():
    cfg = tiny_qwen3_config()
    scheme = PRESETS["fp8_static"].replace(
        q=QuantSpec("fp8", Granularity.HEAD, dynamic=True),
        k=QuantSpec("fp8", Granularity.HEAD),
        v=QuantSpec("int8", Granularity.HEAD, symmetric=False),
    )
    model = prepare(build_model(cfg), scheme)
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.output_quantizer.spec.num_heads == cfg.num_key_value_heads == 2
    assert attn.v_proj.output_quantizer.spec.num_heads == cfg.num_key_value_heads
    assert attn.q_proj.output_quantizer.spec.num_heads == cfg.num_attention_heads == 4
    assert attn.k_proj.output_quantizer.scale.shape == (2,)
    assert attn.v_proj.output_quantizer.zero_point.shape == (2,)
    assert list(attn.q_proj.output_quantizer.parameters()) == []
    assert attn.o_proj.output_quantizer is None and model.model.layers[0].mlp.up_proj.output_quantizer is None

    # calibration: per-head scales over every token of every batch, of the keys the attention
    # kernel / KV cache sees (after k_norm and RoPE), recomputed here from the layer's input
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    seen, pre_rope = [], []

    def hook(mod, args, kwargs, out):
        h = kwargs["hidden_states"]
        cos, sin = kwargs["position_embeddings"]
        b, t, _ = h.shape
        k = TF.linear(h, mod.k_proj.fake_quant_weight(), mod.k_proj.bias)
        pre_rope.append(k.detach().reshape(b * t, -1))
        k = mod.k_norm(k.view(b, t, -1, mod.head_dim)).transpose(1, 2)
        _, k = apply_rotary_pos_emb(k, k, cos, sin)
        seen.append(k.detach().transpose(1, 2).reshape(b * t, -1))

    handle = attn.register_forward_hook(hook, with_kwargs=True)
    calibrate_activations(model, [_ids(0, 2, 7), _ids(1, 3, 5)])
    handle.remove()
    scale, _ = compute_qparams(torch.cat(seen), attn.k_proj.output_quantizer.spec)
    torch.testing.assert_close(attn.k_proj.output_quantizer.scale.data, scale, rtol=1e-6, atol=0)
    # ... which is not what the k_proj output would have given
    wrong, _ = compute_qparams(torch.cat(pre_rope), attn.k_proj.output_quantizer.spec)
    assert not torch.allclose(wrong, scale, rtol=0.05)


# =========================================================================== fp8 attention
def test_fp8_attention_function_matches_hand_reference(device):
    torch.manual_seed(0)
    b, h, kv, t, d = 2, 4, 2, 6, 8

    class M(nn.Module):
        num_key_value_groups = h // kv

    module = M().eval()
    q, k, v = (
        x.to(device) for x in (torch.randn(b, h, t, d), torch.randn(b, kv, t, d), torch.randn(b, kv, t, d))
    )
    mask = torch.zeros(b, 1, t, t, device=device)
    mask[:, :, torch.triu(torch.ones(t, t, dtype=torch.bool, device=device), 1)] = torch.finfo(
        torch.float32
    ).min
    mask[1, :, :, 0] = torch.finfo(torch.float32).min  # a padded first token in batch 1
    mask[1, :, 0, 0] = 0
    scaling = d**-0.5
    out, probs = fp8_eager_attention_forward(module, q, k, v, mask, scaling)
    ref = torch.zeros(b, t, h, d, device=device)
    for bi in range(b):
        for hi in range(h):
            kvh = hi // (h // kv)
            s = (q[bi, hi] @ k[bi, kvh].T) * scaling + mask[bi, 0]
            p = torch.softmax(s, dim=-1).to(FP8).float()
            ref[bi, :, hi] = p @ v[bi, kvh]
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    assert set(probs.unique().tolist()) <= set(probs.unique().to(FP8).float().tolist())
    # switched off on the module: plain eager attention
    module.qatlib_fp8_attn = False
    out2, _ = fp8_eager_attention_forward(module, q, k, v, mask, scaling)
    assert not torch.allclose(out2, out, atol=1e-4)


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def _layer_inputs(model, b: int, t: int):
    """Hidden states, RoPE cos / sin and an additive causal mask for one attention layer."""
    hs = torch.randn(b, t, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    cos, sin = model.model.rotary_emb(hs, torch.arange(t)[None].expand(b, t))
    mask = torch.zeros(b, 1, t, t)
    mask[:, :, torch.triu(torch.ones(t, t, dtype=torch.bool), 1)] = torch.finfo(torch.float32).min
    return hs, cos, sin, mask


def test_fp8_attention_layer_matches_hand_reference():
    cfg = tiny_qwen3_config(attn_implementation="eager")
    model = build_model(cfg)
    prepare(model, QuantScheme("fp8_attn_only", fp8_attn=True))
    assert model.config._attn_implementation == FP8_ATTN_IMPL
    attn = model.model.layers[0].self_attn
    b, t, nh, nkv, d = 2, 5, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    hs, cos, sin, mask = _layer_inputs(model, b, t)
    with torch.no_grad():
        out, _ = attn(hs, (cos, sin), mask)
        q = _rope(attn.q_norm(attn.q_proj(hs).view(b, t, nh, d)).transpose(1, 2), cos[:, None], sin[:, None])
        k = _rope(attn.k_norm(attn.k_proj(hs).view(b, t, nkv, d)).transpose(1, 2), cos[:, None], sin[:, None])
        v = attn.v_proj(hs).view(b, t, nkv, d).transpose(1, 2)
        ctx = torch.zeros(b, t, nh, d)
        plain = torch.zeros(b, t, nh, d)
        for bi in range(b):
            for hi in range(nh):
                kvh = hi // (nh // nkv)
                p = torch.softmax((q[bi, hi] @ k[bi, kvh].T) * d**-0.5 + mask[bi, 0], dim=-1)
                ctx[bi, :, hi] = p.to(FP8).float() @ v[bi, kvh]
                plain[bi, :, hi] = p @ v[bi, kvh]
        ref = attn.o_proj(ctx.reshape(b, t, nh * d))
        ref_plain = attn.o_proj(plain.reshape(b, t, nh * d))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert (out - ref_plain).abs().max() > 1e-4  # the FP8 cast is visible


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_kv_quantizers_act_on_post_rope_states(impl):
    """k / v quantizers fake-quantize the key / value states the attention kernel receives (after
    k_norm and RoPE), per KV head; the projections' own outputs are left alone. Hand reference:
    per-head int8 keys (static scales) and per-tensor fp8 values through plain causal attention."""
    cfg = tiny_qwen3_config(attn_implementation=impl)
    model = build_model(cfg)
    k_spec, v_spec = QuantSpec("int8", Granularity.HEAD), QuantSpec("fp8")
    prepare(model, QuantScheme("kv_only", k=k_spec, v=v_spec))
    assert model.config._attn_implementation == f"qatlib_qkv_{impl}"
    attn = model.model.layers[0].self_attn
    b, t, nh, nkv, d = 2, 5, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    k_scale, v_scale = torch.tensor([0.011, 0.023]), torch.tensor([0.004])
    with torch.no_grad():
        attn.k_proj.output_quantizer.scale.copy_(k_scale)
        attn.v_proj.output_quantizer.scale.copy_(v_scale)
    hs, cos, sin, mask = _layer_inputs(model, b, t)
    with torch.no_grad():
        out, _ = attn(hs, (cos, sin), mask)
        kp, vp = attn.k_proj(hs), attn.v_proj(hs)
        assert torch.equal(kp, TF.linear(hs, attn.k_proj.weight))  # not quantized in the projection
        q = _rope(attn.q_norm(attn.q_proj(hs).view(b, t, nh, d)).transpose(1, 2), cos[:, None], sin[:, None])
        k = _rope(attn.k_norm(kp.view(b, t, nkv, d)).transpose(1, 2), cos[:, None], sin[:, None])
        v = vp.view(b, t, nkv, d).transpose(1, 2)
        kq = (
            torch.clamp(torch.round(k / k_scale[None, :, None, None]), -128, 127)
            * k_scale[None, :, None, None]
        )
        vq = (v / v_scale).clamp(-448, 448).to(FP8).float() * v_scale
        ctx = torch.zeros(b, t, nh, d)
        plain = torch.zeros(b, t, nh, d)
        for bi in range(b):
            for hi in range(nh):
                kvh = hi // (nh // nkv)
                p = torch.softmax((q[bi, hi] @ kq[bi, kvh].T) * d**-0.5 + mask[bi, 0], dim=-1)
                ctx[bi, :, hi] = p @ vq[bi, kvh]
                p0 = torch.softmax((q[bi, hi] @ k[bi, kvh].T) * d**-0.5 + mask[bi, 0], dim=-1)
                plain[bi, :, hi] = p0 @ v[bi, kvh]
        ref = attn.o_proj(ctx.reshape(b, t, nh * d))
        ref_plain = attn.o_proj(plain.reshape(b, t, nh * d))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert (out - ref_plain).abs().max() > 1e-4  # the quantization is visible
    with quantization_disabled(model), torch.no_grad():
        torch.testing.assert_close(attn(hs, (cos, sin), mask)[0], ref_plain, rtol=1e-5, atol=1e-6)


def test_fp8_attention_changes_logits_slightly_and_stays_causal():
    ids = _ids(3, 2, 16)
    scheme = PRESETS["int8"]  # per-token activations: a later token cannot change an earlier one's scale
    # two config objects: switching the attention implementation writes to the model's config
    base = prepare(build_model(tiny_qwen3_config(attn_implementation="eager")), scheme)
    fp8a = prepare(build_model(tiny_qwen3_config(attn_implementation="eager")), scheme.replace(fp8_attn=True))
    assert base.config._attn_implementation == "eager"
    a, b = _logits(base, ids), _logits(fp8a, ids)
    diff = (a - b).abs().max()
    assert 0 < diff < 0.05 * a.abs().max()
    # causal: the last token does not change earlier logits (transformers builds no mask at all for
    # an attention implementation without a registered mask function)
    ids2 = ids.clone()
    ids2[:, -1] = (ids2[:, -1] + 1) % VOCAB
    b2 = _logits(fp8a, ids2)
    torch.testing.assert_close(b2[:, :-1], b[:, :-1], rtol=0, atol=1e-6)
    assert (b2[:, -1] - b[:, -1]).abs().max() > 1e-3
    # padding mask respected: left-padded row == unpadded row
    am = torch.ones_like(ids)
    am[0, :3] = 0
    with torch.no_grad():
        padded = fp8a(ids, attention_mask=am).logits[0, 3:]
        alone = fp8a(ids[:1, 3:]).logits[0]
    torch.testing.assert_close(padded, alone, rtol=1e-5, atol=1e-5)


def test_fp8_attention_off_in_quantization_disabled():
    cfg = tiny_qwen3_config(attn_implementation="eager")
    model = build_model(cfg)
    ids = _ids(4)
    ref = _logits(model, ids)
    prepare(model, PRESETS["fp8_dynamic"].replace(fp8_attn=True))
    on = _logits(model, ids)
    with quantization_disabled(model):
        assert torch.equal(_logits(model, ids), ref)  # the KD teacher is the unquantized model
    assert torch.equal(_logits(model, ids), on)


def test_fp8_attention_needs_eager():
    model = build_model(tiny_qwen3_config(attn_implementation="sdpa"))
    with pytest.raises(ValueError, match="eager"):
        enable_fp8_attention(model)
    with pytest.raises(ValueError, match="config"):
        enable_fp8_attention(nn.Linear(2, 2))


@pytest.mark.parametrize(
    "spec",
    [
        QuantSpec("fp8", "per-tensor", dynamic=True),
        QuantSpec("int8", "per-token"),
        QuantSpec("fp8", "per-head", num_heads=2, dynamic=True),
    ],
    ids=lambda s: s.describe(),
)
def test_dynamic_quantizer_passes_empty_input(spec):
    """A zero-token MoE expert still runs; its dynamic input quantizer must not crash on [0, K]."""
    q = Quantizer(spec)
    x = torch.zeros(0, 8, requires_grad=True)
    y = q(x)
    assert y.shape == (0, 8)
    y.sum().backward()
    assert x.grad.shape == (0, 8)


def test_fp8_dynamic_moe_forward_with_idle_expert():
    """fp8_dynamic on an MoE whose routing leaves an expert without tokens (every expert runs)."""
    model = build_model(tiny_qwen3_moe_config(num_experts=8, num_experts_per_tok=1))
    prepare(model, PRESETS["fp8_dynamic"])
    ids = torch.zeros(1, 2, dtype=torch.long)  # two identical tokens reach at most 1 expert per layer
    out = model(ids).logits
    assert torch.isfinite(out).all()


def test_incompatible_scheme_message_names_values():
    a = PRESETS["int4_weight_only"]
    b = a.replace(weight=a.weight.replace(granularity="per-channel", group_size=None))
    msg = "; ".join(a.compatible_with(b))
    assert "weight.granularity: configured 'per-group', checkpoint 'per-channel'" in msg


def test_roles_survive_deepcopy():
    """Roles come from the Quantizer attribute, so a deep-copied model keeps its trainable scales."""
    import copy

    model = build_model(tiny_qwen3_config())
    prepare(model, PRESETS["int4_weight_only"].replace(weight=QuantSpec("int4", "per-group", group_size=32)))
    n = len(list(role_parameters(model, ROLE_SCALE)))
    assert n > 0 and len(list(role_parameters(copy.deepcopy(model), ROLE_SCALE))) == n


def _inductor_available() -> bool:
    """torch.compile on CPU needs a C++ compiler; without one the compiled path cannot run."""
    import shutil

    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


@pytest.mark.skipif(not _inductor_available(), reason="torch.compile (inductor) needs a C++ compiler")
@pytest.mark.parametrize("name", ["fp8_static", "w4a8_fp8", "fp8_dynamic"])
def test_compiled_fake_quant_matches_eager(name, monkeypatch):
    """``compile_fake_quant`` runs the same arithmetic: outputs bit-identical, gradients to the
    input, weight and every scale equal to eager within fp32 reduction-order noise. The compiled
    run really goes through `functional.compiled` (counted), the eager one never does."""
    from qatlib.quant import functional as F

    used: list = []
    real = F.compiled
    monkeypatch.setattr(F, "compiled", lambda fn: used.append(fn) or real(fn))
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    x = torch.randn(2, 5, 64)

    def run(compile: bool):
        scheme = PRESETS[name]
        if scheme.weight.group_size:
            scheme = _with_group(scheme, 32)
        ql = QuantLinear(lin, scheme, compile_fake_quant=compile)
        if ql.input_quantizer is not None and ql.input_quantizer.scale is not None:
            with torch.no_grad():
                ql.input_quantizer.scale.fill_(x.abs().max().item() / 448)
        xi = x.clone().requires_grad_(True)
        out = ql(xi)
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        grads = {n: p.grad.clone() for n, p in ql.named_parameters() if p.grad is not None}
        lin.zero_grad(set_to_none=True)
        return out.detach(), xi.grad, grads, [q.compile_fake_quant for _, q in ql.quantizers()]

    out_e, gx_e, g_e, flags_e = run(False)
    assert used == []
    out_c, gx_c, g_c, flags_c = run(True)
    assert flags_c and all(flags_c) and not any(flags_e)
    assert len(used) >= len(flags_c)  # every quantizer called the compiled function
    assert torch.equal(out_c, out_e)
    torch.testing.assert_close(gx_c, gx_e, rtol=1e-5, atol=1e-6)
    assert g_c.keys() == g_e.keys()
    assert PRESETS[name].weight.dynamic or "weight_quantizer.scale" in g_e
    for k in g_e:
        torch.testing.assert_close(g_c[k], g_e[k], rtol=1e-4, atol=1e-6, msg=k)


def test_compile_fake_quant_flag_reaches_every_quantizer(tmp_path):
    """``quant_config.compile_fake_quant`` -> `PrepareOptions` -> every `Quantizer` of `prepare`."""
    from qatlib.config import load_config

    cfg_path = tmp_path / "exp.yaml"
    (tmp_path / "train.jsonl").write_text('{"text": "hello"}\n')
    cfg_path.write_text(
        "model: {name: Qwen, model_path: /nonexistent}\n"
        "dataset: {name: TextDataset, data_path: train.jsonl}\n"
        "compression:\n  name: QAT\n  quantization: {name: fp8_static}\n"
        "  QAT:\n    plugin_config:\n      quant_config: {compile_fake_quant: true}\n"
    )
    cfg = load_config(cfg_path)
    opts = cfg.prepare_options()
    assert opts.compile_fake_quant is True
    model = prepare(
        build_model(tiny_qwen3_config()), cfg.quant_scheme(), ignore=cfg.ignore_layers, options=opts
    )
    flags = [q.compile_fake_quant for _, q in quantizers(model)]
    assert flags and all(flags)
    default = load_config(cfg_path, ["compression.QAT.plugin_config.quant_config.compile_fake_quant=false"])
    assert default.prepare_options().compile_fake_quant is False


# --------------------------------------------------------------------------- frozen codes
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_frozen_codes_linear_is_codes_times_scale(symmetric):
    """fake_quant_linear(frozen_at=(s0, z0)): value and gradients of ``x @ ((q - round(z)) * s)^T``
    with ``q = clamp(round(w / s0) + round(z0))`` held fixed (round(z) straight-through), against
    autograd on that formula by hand, at a scale (and zero point) far enough from the frozen ones
    that re-rounding there would change many codes."""
    from qatlib.quant.fq_linear import fake_quant_linear

    spec = QuantSpec("int4", Granularity.GROUP, group_size=16, symmetric=symmetric)
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(6, 32, generator=g), torch.randn(5, 32, generator=g)
    s0 = w.reshape(6, 2, 16).abs().amax(-1) / 7
    z0 = None if symmetric else torch.full((6, 2), 1.0)
    codes = torch.round(w.reshape(6, 2, 16) / s0[..., None]) + (0.0 if symmetric else 1.0)
    codes = torch.clamp(codes, spec.qmin, spec.qmax)

    def leaf(t):
        return None if t is None else t.clone().requires_grad_(True)

    s, z = leaf(s0 * 1.3), leaf(None if symmetric else z0 + 2.2)
    y = fake_quant_linear(x, w, None, s, z, spec, frozen_at=(s0, z0))
    s_ref, z_ref = leaf(s0 * 1.3), leaf(None if symmetric else z0 + 2.2)
    zr = 0.0 if symmetric else (z_ref + (torch.round(z_ref) - z_ref).detach())[..., None]
    ref = x @ ((codes - zr) * s_ref[..., None]).reshape(6, 32).T
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6)
    gy = torch.randn(5, 6, generator=g)
    y.backward(gy)
    ref.backward(gy)
    torch.testing.assert_close(s.grad, s_ref.grad, rtol=1e-5, atol=1e-5)
    if not symmetric:
        torch.testing.assert_close(z.grad, z_ref.grad, rtol=1e-5, atol=1e-5)
    # without the frozen codes the same scale re-rounds the weight: another value (LSQ's start)
    plain = fake_quant_linear(x, w, None, s.detach(), None if z is None else z.detach(), spec)
    assert not torch.allclose(plain, ref.detach(), atol=1e-3)


def test_freeze_release_codes_keeps_the_codes_through_a_scale_change():
    """freeze_codes -> the scales move (as training would) -> the model computes codes * new scale;
    release_codes writes exactly that into the weights: an ordinary prepared model with the same
    output whose round-to-nearest at the new scales gives back the frozen codes."""
    from qatlib.ptq import calibrate
    from qatlib.quant.codes import freeze_codes, release_codes

    G16 = QuantSpec("int4", Granularity.GROUP, group_size=16)
    model = build_model(tiny_qwen3_config())
    calibrate(model, QuantScheme("int4", weight=G16), [])
    qls = list(quant_linears(model))
    before = {n: fake_quantize(ql.weight, ql.weight_quantizer.scale, None, G16) for n, ql in qls}
    codes = {
        n: torch.round(before[n].reshape(-1, 16) / ql.weight_quantizer.scale.reshape(-1, 1)) for n, ql in qls
    }
    assert freeze_codes(model) == len(qls)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, ql in qls:
            ql.weight_quantizer.scale.mul_(
                0.7 + 0.6 * torch.rand(ql.weight_quantizer.scale.shape, generator=g)
            )
    ids = _ids(0)
    with torch.no_grad():
        frozen = model(ids).logits
    assert release_codes(model) == len(qls)
    for n, ql in qls:
        s = ql.weight_quantizer.scale.reshape(-1, 1)
        assert ql.weight_quantizer.frozen_at is None
        torch.testing.assert_close(ql.weight.reshape(-1, 16), codes[n] * s, rtol=0, atol=0)
        torch.testing.assert_close(torch.round(ql.weight.reshape(-1, 16) / s), codes[n], rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, frozen, rtol=1e-6, atol=1e-6)


E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _e2m1_nearest(v: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value by search over the grid (no tie in these random draws)."""
    a = v.clamp(-6, 6)
    idx = (a.abs()[..., None] - E2M1_GRID).abs().argmin(-1)
    return E2M1_GRID[idx] * a.sign()


def test_frozen_codes_nvfp4_train_both_scale_levels():
    """NVFP4 frozen codes: the codes are held at the code scale of the freeze (E4M3-rounded group
    scale over the FP32 global scale: ``q = e2m1(w / (e4m3(s0) / g0))``), the weight is
    ``q * e4m3(s) / g`` with the current group scales and global scale (E4M3 rounding straight
    through), and both levels get their gradients: value and grads against autograd on that
    formula, E4M3 by torch's float8 cast, at scales far enough from the frozen ones that
    re-rounding there would change many codes."""
    from qatlib.quant.fq_linear import fake_quant_linear

    spec = PRESETS["nvfp4"].weight
    assert spec.has_global_scale and spec.group_size == 16
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(6, 32, generator=g), torch.randn(5, 32, generator=g)
    g0 = 448 * 6 / w.abs().amax()
    s0 = w.reshape(6, 2, 16).abs().amax(-1) / 6 * g0
    code_s0 = s0.to(torch.float8_e4m3fn).float() / g0
    codes = _e2m1_nearest(w.reshape(6, 2, 16) / code_s0[..., None])

    def leaf(t):
        return t.clone().requires_grad_(True)

    s, gs = leaf(s0 * 1.3), leaf(g0.reshape(1) * 0.9)
    y = fake_quant_linear(x, w, None, s, None, spec, global_scale=gs, frozen_at=(code_s0, None))
    s_ref, g_ref = leaf(s0 * 1.3), leaf(g0.reshape(1) * 0.9)
    s_r = s_ref + (s_ref.detach().to(torch.float8_e4m3fn).float() - s_ref.detach())
    ref = x @ (codes * (s_r / g_ref)[..., None]).reshape(6, 32).T
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6)
    gy = torch.randn(5, 6, generator=g)
    y.backward(gy)
    ref.backward(gy)
    torch.testing.assert_close(s.grad, s_ref.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gs.grad, g_ref.grad, rtol=1e-5, atol=1e-9)
    plain = fake_quant_linear(x, w, None, s.detach(), None, spec, global_scale=gs.detach())
    assert not torch.allclose(plain, ref.detach(), atol=1e-3)  # re-rounding: another weight


@pytest.mark.parametrize("fmt", ["nvfp4_weight_only", "mxfp4_weight_only"])
def test_freeze_release_fp4_codes_through_a_scale_change(fmt):
    """FP4 freeze -> the group scales (and NVFP4's global scales) move -> release: the released
    model computes what the frozen one did, its weights are ``codes * code scale`` and re-round to
    the frozen codes, and the frozen model's first output is the calibrated model's (the codes are
    held at the ROUNDED scale: E8M0 for MXFP4, a raw scale off its grid would give other codes)."""
    from qatlib.ptq import calibrate
    from qatlib.quant import functional as F
    from qatlib.quant.codes import freeze_codes, release_codes

    scheme = PRESETS[fmt]
    model = build_model(tiny_qwen3_config())
    calibrate(model, scheme, [])
    qls = list(quant_linears(model))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # scales off their E4M3 / E8M0 grid, as training leaves them
        for _, ql in qls:
            sc = ql.weight_quantizer.scale
            sc.mul_(0.9 + 0.2 * torch.rand(sc.shape, generator=g))
        calibrated = model(_ids(0)).logits
    assert freeze_codes(model) == len(qls)
    with torch.no_grad():
        torch.testing.assert_close(model(_ids(0)).logits, calibrated, rtol=0, atol=0)

    def code_scale(ql):
        wq = ql.weight_quantizer
        return F.code_scale(wq.scale, wq.spec, wq.global_scale)

    codes = {n: ql.weight_quantizer.frozen_at[0] for n, ql in qls}
    codes = {
        n: _e2m1_nearest(ql.weight.reshape(-1, ql.weight_quantizer.spec.group_size) / codes[n].reshape(-1, 1))
        for n, ql in qls
    }
    with torch.no_grad():
        for _, ql in qls:
            wq = ql.weight_quantizer
            wq.scale.mul_(0.7 + 0.6 * torch.rand(wq.scale.shape, generator=g))
            if wq.global_scale is not None:
                wq.global_scale.mul_(1.25)
        frozen = model(_ids(0)).logits
    assert not torch.allclose(frozen, calibrated)
    assert release_codes(model) == len(qls)
    for n, ql in qls:
        gsz = ql.weight_quantizer.spec.group_size
        s = code_scale(ql).reshape(-1, 1)
        assert ql.weight_quantizer.frozen_at is None
        torch.testing.assert_close(ql.weight.reshape(-1, gsz), codes[n] * s, rtol=0, atol=0)
        torch.testing.assert_close(_e2m1_nearest(ql.weight.reshape(-1, gsz) / s), codes[n], rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(model(_ids(0)).logits, frozen, rtol=1e-6, atol=1e-6)


def test_frozen_codes_release_under_the_w4a8_fp8_recast():
    """W4A8-FP8 recasts the dequantized int4 weight to FP8 at every forward: release_codes writes
    the grid values before the recast, so the released model computes what the frozen one did."""
    from qatlib.ptq import calibrate
    from qatlib.quant.codes import freeze_codes, release_codes

    scheme = PRESETS["w4a8_fp8"].replace(name="w4a8_g16")
    scheme = scheme.replace(weight=scheme.weight.replace(group_size=16))
    assert scheme.weight.fp8_recast
    model = build_model(tiny_qwen3_config())
    calibrate(model, scheme, [_ids(1)])
    assert freeze_codes(model) == len(list(quant_linears(model)))
    with torch.no_grad():
        for _, ql in quant_linears(model):
            ql.weight_quantizer.scale.mul_(1.2)  # 7 * 1.2: re-rounding would change the large codes
        frozen = model(_ids(0)).logits
    release_codes(model)
    with torch.no_grad():
        torch.testing.assert_close(model(_ids(0)).logits, frozen, rtol=0, atol=0)
