"""Scale tying under ``deploy.target`` (qatlib.runtime.tying, qatlib.quant.tying): the quantizers vLLM / SGLang merge at
load share one Parameter, train as one, calibrate to the max, export one equal value per key, and
reload with the runtime's max rule; plus the runtime's forward arithmetic (per-token dynamic
inputs, model-dtype scales, the W4A8 kernel's scale path). ``deploy.target: none`` is untouched."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_model, fp8_static_channel, tiny_qwen3_config, tiny_qwen3_moe_config
from safetensors.torch import load_file

from qatlib.export import export
from qatlib.ptq import calibrate, save_ptq_checkpoint
from qatlib.quant import (
    Granularity,
    PrepareOptions,
    QuantScheme,
    QuantSpec,
    prepare,
    preset,
    quant_linears,
    tying,
)
from qatlib.quant import functional as F
from qatlib.quant.quantizer import role_parameters
from qatlib.runtime import tying as rt_tying
from qatlib.runtime.tying import tie_for
from qatlib.zero3.load import stream_load_scales

pytestmark = pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")
FP8 = preset("fp8_static")
VLLM = PrepareOptions(deploy=tie_for("vllm"))


def _batches(n=2, b=2, t=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (b, t), generator=g) for _ in range(n)]


def _q(model, name):
    return model.get_submodule(name)


def _prepared(moe=False, target="vllm", scheme=FP8, seed=0):
    model = build_model(tiny_qwen3_moe_config() if moe else tiny_qwen3_config(), seed=seed)
    return prepare(model, scheme, options=PrepareOptions(deploy=tie_for(target)))


# --------------------------------------------------------------------------- sharing
def test_prepare_under_vllm_shares_one_parameter_dense():
    model = _prepared()
    a = "model.layers.0.self_attn."
    m = "model.layers.0.mlp."
    for role in ("weight_quantizer", "input_quantizer"):
        qkv = [_q(model, f"{a}{p}.{role}").scale for p in ("q_proj", "k_proj", "v_proj")]
        assert qkv[0] is qkv[1] is qkv[2]
        gu = [_q(model, f"{m}{p}.{role}").scale for p in ("gate_proj", "up_proj")]
        assert gu[0] is gu[1] and gu[0] is not qkv[0]
        assert _q(model, f"{a}o_proj.{role}").scale is not qkv[0]  # o_proj / down_proj are not fused
        assert _q(model, f"{m}down_proj.{role}").scale is not gu[0]
    assert tying.is_tied(model) and rt_tying.untied_groups(model, "vllm") == []
    # the tied weight scale is the max of the members' own absmax / 448 (the runtime's collapse rule)
    ws = [_q(model, f"{a}{p}").weight.detach().abs().amax() / 448 for p in ("q_proj", "k_proj", "v_proj")]
    assert torch.equal(
        _q(model, f"{a}q_proj.weight_quantizer").scale.detach().reshape(()), torch.stack(ws).max()
    )
    # an optimizer sees each shared tensor once
    names = [n for n, _ in role_parameters(model)]
    assert len(names) == len({id(p) for _, p in role_parameters(model)})
    assert f"{a}k_proj.weight_quantizer.scale" not in names


def test_fp8_channel_weights_tie_only_the_inputs_dense():
    """vLLM concatenates per-channel weight scales of fused shards (nothing to tie) but still takes
    the max of their static input scales: only the input quantizers share a Parameter."""
    model = _prepared(scheme=fp8_static_channel())
    a = "model.layers.0.self_attn."
    ins = [_q(model, f"{a}{p}.input_quantizer").scale for p in ("q_proj", "k_proj", "v_proj")]
    assert ins[0] is ins[1] is ins[2]
    ws = [_q(model, f"{a}{p}.weight_quantizer").scale for p in ("q_proj", "k_proj", "v_proj")]
    assert len({id(w) for w in ws}) == 3
    w = _q(model, f"{a}k_proj").weight.detach()
    assert ws[1].detach().reshape(-1).shape == (w.shape[0],)  # one scale per output row, its own
    assert torch.allclose(ws[1].detach().reshape(-1), (w.abs().amax(1) / 448).to(ws[1].dtype))


def test_prepare_under_vllm_ties_expert_inputs_moe():
    model = _prepared(moe=True)
    e = "model.layers.1.mlp.experts."
    w13 = [_q(model, f"{e}{i}.{p}.input_quantizer").scale for i in range(4) for p in ("gate_proj", "up_proj")]
    w2 = [_q(model, f"{e}{i}.down_proj.input_quantizer").scale for i in range(4)]
    assert all(s is w13[0] for s in w13) and all(s is w2[0] for s in w2) and w13[0] is not w2[0]
    # weight scales: gate/up of one expert tied (w13[e] max), experts independent, down untied
    w = [_q(model, f"{e}{i}.{p}.weight_quantizer").scale for i in range(4) for p in ("gate_proj", "up_proj")]
    assert w[0] is w[1] and w[2] is w[3] and w[0] is not w[2]
    assert len({id(_q(model, f"{e}{i}.down_proj.weight_quantizer").scale) for i in range(4)}) == 4
    # the layers' experts are not tied across layers
    assert _q(model, "model.layers.0.mlp.experts.0.down_proj.input_quantizer").scale is not w2[0]


def test_none_keeps_untied_bit_for_bit():
    """``deploy.target: none`` is today's model: no shared parameter, every weight scale its own
    absmax / 448, and the same logits as the default options; vllm's logits differ."""
    ids = _batches(1)[0]
    none = _prepared(target="none")
    default = prepare(build_model(tiny_qwen3_config()), FP8)
    assert not tying.is_tied(none)
    for (name, ql), (_, ref) in zip(quant_linears(none), quant_linears(default)):
        want = ql.weight.detach().abs().amax().reshape(1) / 448
        assert torch.equal(ql.weight_quantizer.scale.detach(), want), name
        assert torch.equal(ql.weight_quantizer.scale, ref.weight_quantizer.scale)
        assert ql.weight_quantizer.spec.describe() == ref.weight_quantizer.spec.describe()
    with torch.no_grad():
        a, b, c = (m(ids).logits for m in (none, default, _prepared()))
    assert torch.equal(a, b) and not torch.equal(a, c)


# --------------------------------------------------------------------------- training
def test_training_step_keeps_tied_equal_and_sums_member_gradients():
    torch.manual_seed(0)
    tied = _prepared()
    untied = _prepared(target="none")
    # the untied copy starts from the tied values, so both compute the same forward
    with torch.no_grad():
        for (_, a), (_, b) in zip(quant_linears(tied), quant_linears(untied)):
            for attr in ("weight_quantizer", "input_quantizer"):
                getattr(b, attr).scale.copy_(getattr(a, attr).scale)
    ids = _batches(1)[0]
    for m in (tied, untied):
        m.train()
        m(ids, labels=ids).loss.backward()
    a = "model.layers.0.self_attn."
    shared = _q(tied, f"{a}q_proj.weight_quantizer").scale
    member_grads = [_q(untied, f"{a}{p}.weight_quantizer").scale.grad for p in ("q_proj", "k_proj", "v_proj")]
    torch.testing.assert_close(shared.grad, sum(member_grads), rtol=1e-5, atol=0)
    assert not torch.equal(member_grads[0], member_grads[1])  # the members' own gradients differ
    opt = torch.optim.SGD([p for _, p in role_parameters(tied)], lr=1e-3)
    before = shared.detach().clone()
    opt.step()
    vals = [_q(tied, f"{a}{p}.weight_quantizer").scale.detach() for p in ("q_proj", "k_proj", "v_proj")]
    assert (
        not torch.equal(vals[0], before) and torch.equal(vals[0], vals[1]) and torch.equal(vals[0], vals[2])
    )


# --------------------------------------------------------------------------- PTQ
def test_ptq_tied_scale_is_max_of_untied():
    """Calibrated on the float activations (weights unquantized, so both models see the same
    tensors), every tied scale equals the max of the scales the untied members get."""
    batches = _batches(3, seed=1)
    tied = build_model(tiny_qwen3_moe_config())
    untied = build_model(tiny_qwen3_moe_config())
    calibrate(tied, FP8, batches, options=VLLM, quantize_weights_during_calibration=False)
    calibrate(untied, FP8, batches, quantize_weights_during_calibration=False)
    groups = tying.shared_groups(tied)
    assert len(groups) == 16  # 2 layers x (qkv w, qkv in, w13 in, w2 in, 4 experts' gate/up w)
    for group in groups:
        names = [n for n, _ in group]
        hand = max(_q(untied, n).scale.item() for n in names)
        assert group[0][1].scale.item() == hand, names[0]
    spread = [len({_q(untied, n).scale.item() for n, _ in g}) > 1 for g in groups]
    assert sum(spread) >= 8  # the untied scales really differ (weights, experts' inputs)


# --------------------------------------------------------------------------- export + collapse
def _collapse_to_max(tensors: dict, key_groups) -> dict:
    """The runtime's load: each fused group's per-tensor scales replaced by their max (vLLM
    fp8_utils.py:1454-1476 requantize_with_max_scale, w8a8_fp8.py:185-186, fp8_utils.py:1570-1585)."""
    out = dict(tensors)
    for keys in key_groups:
        m = torch.stack([tensors[k].float().reshape(()) for k in keys]).max()
        for k in keys:
            out[k] = m.reshape(tensors[k].shape).to(tensors[k].dtype)
    return out


@pytest.mark.parametrize("target", ["vllm", "none"])
def test_export_writes_equal_values_and_collapse_changes_only_untied(tmp_path, target):
    model = build_model(tiny_qwen3_moe_config())
    calibrate(model, FP8, _batches(), options=PrepareOptions(deploy=tie_for(target)))
    out = export(model, FP8, tmp_path / target, "real")
    sd = load_file(str(out / "model.safetensors"))
    groups = rt_tying.key_groups(model, "vllm")
    assert len(groups) == 16 and all(k in sd for ks in groups for k in ks)
    collapsed = _collapse_to_max(sd, groups)
    changed = [ks[0] for ks in groups if any(not torch.equal(collapsed[k], sd[k]) for k in ks)]
    info = json.loads((out / "qatlib_export.json").read_text())["deployment"]["vllm 0.33.0"]
    collapses = (
        "fused shards' per-tensor weight",
        "fused shards' static input",
        "every expert's static input",
    )
    if target == "vllm":
        assert changed == [] and rt_tying.scales_agree(sd, groups)
        assert rt_tying.export_is_tied(out) is True and info["scales_tied"]
        assert not any(d.startswith(collapses) for d in info["differences"])  # tying removed them
        assert sum(d.startswith(collapses) for d in info["trained_as_deployed"]) == 3
    else:
        assert len(changed) >= 8 and not rt_tying.scales_agree(sd, groups)
        assert rt_tying.export_is_tied(out) is False and info["trained_as_deployed"] == []
        assert sum(d.startswith(collapses) for d in info["differences"]) == 3


# --------------------------------------------------------------------------- checkpoint load
def test_untied_checkpoint_loads_with_the_max_rule(tmp_path):
    untied = build_model(tiny_qwen3_config())
    calibrate(untied, FP8, _batches())
    ptq_dir = save_ptq_checkpoint(untied, FP8, tmp_path / "untied")
    fresh = prepare(
        build_model(tiny_qwen3_config()),
        FP8,
        options=PrepareOptions(init_from_weight=False, deploy=tie_for("vllm")),
    )
    report = stream_load_scales(fresh, ptq_dir, FP8)
    assert report["misses"] == 0 and report["unused_keys"] == 0
    assert len(report["tied_disagreeing"]) >= 4  # the weight scales of q/k/v and gate/up per layer
    for group in tying.shared_groups(fresh):
        hand = max(_q(untied, n).scale.item() for n, _ in group)
        assert group[0][1].scale.item() == hand, group[0][0]
    # a tied checkpoint reloads exactly, with nothing to resolve
    tied_dir = save_ptq_checkpoint(fresh, FP8, tmp_path / "tied")
    again = prepare(
        build_model(tiny_qwen3_config()),
        FP8,
        options=PrepareOptions(init_from_weight=False, deploy=tie_for("vllm")),
    )
    report = stream_load_scales(again, tied_dir, FP8)
    assert report["tied_disagreeing"] == [] and report["misses"] == 0
    # every member of a tied group counts as loaded (export warned of "never initialised" ones)
    static = [q for _, ql in quant_linears(again) for _, q in ql.quantizers() if q.scale is not None]
    assert static and all(bool(q.initialized) for q in static)
    for (_, a), (_, b) in zip(quant_linears(fresh), quant_linears(again)):
        assert torch.equal(a.weight_quantizer.scale, b.weight_quantizer.scale)
        assert torch.equal(a.input_quantizer.scale, b.input_quantizer.scale)


# --------------------------------------------------------------------------- runtime arithmetic
def test_fp8_dynamic_runs_per_token_on_vllm_dense():
    model = _prepared(scheme=preset("fp8_dynamic"))
    ql = model.get_submodule("model.layers.0.mlp.down_proj")
    x = torch.randn(2, 5, ql.in_features) * torch.linspace(0.1, 10, 5).reshape(1, 5, 1)
    got = ql.input_quantizer(x)
    amax = x.abs().amax(-1, keepdim=True) / 448  # one scale per token, by hand
    want = (x / amax).clamp(-448, 448).to(torch.float8_e4m3fn).float() * amax
    assert torch.equal(got, want)
    untied = _prepared(target="none", scheme=preset("fp8_dynamic")).get_submodule(
        "model.layers.0.mlp.down_proj"
    )
    assert not torch.equal(untied.input_quantizer(x), want)  # per-tensor: what `none` trains


def test_weight_scales_rounded_to_bf16_for_wna16():
    scheme = QuantScheme("int4_g16", weight=QuantSpec("int4", Granularity.GROUP, group_size=16))
    model = build_model(tiny_qwen3_config()).to(torch.bfloat16)
    prepare(model, scheme, options=VLLM)
    ql = model.get_submodule("model.layers.0.self_attn.o_proj")
    raw = ql.weight_quantizer.scale.detach()
    assert raw.dtype == torch.float32 and not torch.equal(raw.to(torch.bfloat16).float(), raw)
    _, scale, _ = ql.codes()
    assert torch.equal(scale, raw.to(torch.bfloat16).float())  # what the runtime's params_dtype holds
    w = ql.weight.float()
    s = scale.repeat_interleave(16, dim=1)
    want = (torch.round(w / s).clamp(-8, 7) * s).to(torch.bfloat16)
    assert torch.equal(ql.fake_quant_weight(), want)
    # the export record: the scale-dtype transformation is trained, not a difference; untied it is
    from qatlib.runtime.differences import deployment_differences

    entry = deployment_differences(model, scheme)["vllm 0.33.0"]
    assert any(d.startswith("weight scales stored in the model dtype") for d in entry["trained_as_deployed"])
    assert not any(d.startswith("weight scales stored in the model dtype") for d in entry["differences"])
    plain = prepare(build_model(tiny_qwen3_config()).to(torch.bfloat16), scheme)
    entry = deployment_differences(plain, scheme)["vllm 0.33.0"]
    assert entry["trained_as_deployed"] == [] and not entry["scales_tied"]
    assert any("weight-scale tensors change when rounded to bfloat16" in d for d in entry["differences"])


def test_w4a8_kernel_scale_path_by_hand():
    """vLLM's convert_bf16_scales_to_fp8 on a 2-row example: per row c = amax/448, fp8(s/c),
    then fp8(that/8) and c*8 (quant_utils.py:931-954)."""
    s = torch.tensor([[0.0123, 0.0456, 0.0011], [1.5, 0.25, 3.0]])
    b = s.to(torch.bfloat16).float()
    rows = []
    for r in b:
        c = r.abs().max() / 448
        q8 = torch.tensor([float(torch.tensor(v / float(c)).to(torch.float8_e4m3fn)) for v in r.tolist()])
        q8 = (q8 / 8).to(torch.float8_e4m3fn).float()
        rows.append(q8 * (c * 8))
    assert torch.equal(F.w4a8_kernel_scale(s), torch.stack(rows))
    assert not torch.equal(F.w4a8_kernel_scale(s), s)


def test_w4a8_under_vllm_simulates_the_kernel_and_exports_exact_codes():
    scheme = preset("w4a8_fp8")
    scheme = scheme.replace(weight=scheme.weight.replace(group_size=32))
    model = build_model(tiny_qwen3_config()).to(torch.bfloat16)
    prepare(model, scheme, options=VLLM)
    ql = model.get_submodule("model.layers.0.mlp.down_proj")
    spec = ql.weight_quantizer.spec
    assert spec.w4a8_kernel and spec.scale_dtype == "bfloat16"
    codes, scale, _ = ql.codes()
    assert codes.dtype == torch.int8 and int(codes.min()) >= -8 and int(codes.max()) <= 7
    eff = F.w4a8_kernel_scale(scale).repeat_interleave(32, dim=1)
    # trained weight == int4 codes x the kernel's scales; codes are round(w / kernel scale)
    assert torch.equal(ql.fake_quant_weight().float(), (codes.float() * eff).to(torch.bfloat16).float())
    assert torch.equal(codes.float(), torch.round(ql.weight.float() / eff).clamp(-8, 7))
    # the kernel's input is fp8 per-token dynamic, though the preset calibrates a static scale
    x = torch.randn(3, ql.in_features) * torch.tensor([[0.1], [1.0], [30.0]])
    amax = x.abs().amax(-1, keepdim=True) / 448
    want = (x / amax).clamp(-448, 448).to(torch.float8_e4m3fn).float() * amax
    assert torch.equal(ql.input_quantizer(x), want)


@pytest.mark.parametrize("target", ["vllm", "sglang", "none"])
def test_config_deploy_target_reaches_prepare(tmp_path, target):
    from qatlib.config import parse_config

    data = {
        "model": {"model_path": str(tmp_path)},
        "compression": {"name": "PTQ", "quantization": {"name": "fp8_static"}},
    }
    cfg = parse_config(data | {"deploy": {"target": target}})
    assert cfg.prepare_options().deploy == tie_for(target)
    assert parse_config(data).prepare_options().deploy == tie_for("vllm")  # the default target
