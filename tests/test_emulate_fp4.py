"""FP4 in the runtime emulator (qatlib.runtime.emulate_fp4) and NVFP4 global-scale tying
(qatlib.quant.tying) under ``deploy.target``.

Bounds (max |logit difference|, tiny fp32 models, logits ~0.6):
- EQUAL = 1e-5: the runtime computes what was trained; measured 1.8e-7 .. 2.7e-7 (fp32 rounding
  order: the kernels apply the global scales after the GEMM, training inside the weight);
- MISMATCH = 5e-3: an untied NVFP4 model differs from its deployed self by more (measured W4A16
  dense 0.028, W4A4 dense 0.075), as does a W4A4 model served weight-only below SM100 (0.11-0.15).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_model, tiny_qwen3_config, tiny_qwen3_moe_config
from safetensors.torch import load_file

from qatlib.export import export
from qatlib.ptq import calibrate
from qatlib.quant import PrepareOptions, preset, quant_linears
from qatlib.quant import functional as F
from qatlib.runtime import emulate as E
from qatlib.runtime import emulate_fp4 as E4
from qatlib.runtime.fusion import FusedGroup, GroupKind
from qatlib.runtime.tying import tie_for

EQUAL, MISMATCH = 1e-5, 5e-3
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _batches(n=2, b=2, t=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (b, t), generator=g) for _ in range(n)]


IDS = _batches(n=1, b=2, t=20, seed=11)[0]


def _diff(a, b):
    with torch.no_grad():
        return (a(IDS).logits.float() - b(IDS).logits.float()).abs().max().item()


# --------------------------------------------------------------------------- by hand
def _st(gs, igs=None):
    return E4.StoredFP4(
        torch.tensor([[1.0, -6.0]]), torch.tensor([[2.0]]), torch.tensor(gs), igs and torch.tensor(igs), 2
    )


def test_global_scale_collapse_by_hand():
    """q/k/v at global scales 100 / 200 / 50: all take 200, codes and group scales as stored, so q's
    weight 1 * 2 / 100 = 0.02 is served as 1 * 2 / 200 = 0.01; input global scales 3 / 5 / 4 -> 5.
    An expert's gate/up pair takes the gate's (7), not the max (9)."""
    st = {"q": _st(100.0, 3.0), "k": _st(200.0, 5.0), "v": _st(50.0, 4.0), "g": _st(7.0), "u": _st(9.0)}
    groups = [FusedGroup(GroupKind.QKV, "a", ("q", "k", "v")), FusedGroup(GroupKind.GATE_UP, "e", ("g", "u"))]
    assert E4.collapse_global_scales(st, groups, experts={"g", "u"}) == 2
    assert [st[m].global_scale.item() for m in "qkvgu"] == [200.0, 200.0, 200.0, 7.0, 7.0]
    assert [st[m].input_global_scale.item() for m in "qkv"] == [5.0] * 3
    assert torch.equal(st["q"].codes, torch.tensor([[1.0, -6.0]])) and st["q"].scale.item() == 2.0
    lin = E4.DeployedFP4Linear(st["q"], None, "nvfp4", act_quant=False, out_dtype=torch.float32)
    assert lin(torch.tensor([[1.0, 0.0]])).item() == pytest.approx(0.01, rel=1e-6)
    # tied (equal) global scales: nothing changes
    same = {m: _st(100.0) for m in "qkv"}
    assert E4.collapse_global_scales(same, groups[:1], experts=set()) == 0


def test_nvfp4_activation_by_hand():
    """16 values with amax 3 at input global scale 448*6/3 = 896: the E4M3 group scale is
    e4m3(896 * 3 / 6) = 448, effective 448/896 = 0.5; codes x/0.5: 3 -> 6, 1.3 -> 2.6 -> 3 (E2M1
    steps by 1 in [2, 4)), 0.2 -> 0.4 -> 0.5, -0.7 -> -1.4 -> -1.5; returned code * 448."""
    x = torch.zeros(16)
    x[:4] = torch.tensor([3.0, 1.3, 0.2, -0.7])
    got = E4.nvfp4_act_codes(x, torch.tensor(896.0))
    want = torch.zeros(16)
    want[:4] = torch.tensor([6.0, 3.0, 0.5, -1.5]) * 448
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_mxfp4_scales_read_as_powers_of_two():
    """E8M0 exponents 127 / 125 are 2**0 / 2**-2; a code 1.5 in the second group is 0.375."""
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8

    codes = torch.cat([torch.full((1, 32), 1.0), torch.full((1, 32), 1.5)], dim=1)
    t = {
        "l.weight_packed": pack_fp4_to_uint8(codes),
        "l.weight_scale": torch.tensor([[127, 125]], dtype=torch.uint8),
    }
    s = E4.read_fp4(t, "l", "mxfp4")
    assert s.scale.tolist() == [[1.0, 0.25]] and s.global_scale is None and s.group_size == 32
    w = E4.DeployedFP4Linear(s, None, "mxfp4", act_quant=False, out_dtype=torch.float32).weight
    assert w[0, 0].item() == 1.0 and w[0, 40].item() == 0.375


# --------------------------------------------------------------------------- real tiny exports
def _export(tmp_path, name, *, tied, moe=False):
    model = build_model(tiny_qwen3_moe_config() if moe else tiny_qwen3_config())
    opts = PrepareOptions(deploy=tie_for("vllm" if tied else "none"))
    rep = calibrate(model, preset(name), _batches(), options=opts)
    d = tmp_path / f"{name}-{'t' if tied else 'u'}"
    export(model, rep.scheme, d, "real")
    return model, d


def test_tied_nvfp4_export_has_one_global_scale_per_fused_group(tmp_path):
    """Under deploy.target vllm q/k/v (and gate/up) share ONE global scale Parameter, calibrated as
    the union of their ranges: fp4_global_scale(max over the shards' amax) = 448*6/max|w| (by hand);
    the export writes that one value for every shard."""
    model = build_model(tiny_qwen3_config())
    attn = model.model.layers[0].self_attn
    amax = max(getattr(attn, p).weight.detach().abs().max().item() for p in ("q_proj", "k_proj", "v_proj"))
    rep = calibrate(
        model, preset("nvfp4_weight_only"), _batches(), options=PrepareOptions(deploy=tie_for("vllm"))
    )
    qs = [getattr(attn, p).weight_quantizer for p in ("q_proj", "k_proj", "v_proj")]
    assert all(q.global_scale is qs[0].global_scale for q in qs)
    assert qs[0].global_scale.item() == pytest.approx(448 * 6 / amax, rel=1e-6)
    export(model, rep.scheme, tmp_path / "e", "real")
    t = load_file(tmp_path / "e" / "model.safetensors")
    for layer in range(len(model.model.layers)):
        for group in (("self_attn", "q_proj", "k_proj", "v_proj"), ("mlp", "gate_proj", "up_proj")):
            vals = {t[f"model.layers.{layer}.{group[0]}.{p}.weight_global_scale"].item() for p in group[1:]}
            assert len(vals) == 1, (layer, group, vals)
    # each shard's group scales are relative to the shared global scale: export -> codes round trip
    for _, ql in quant_linears(model):
        torch.testing.assert_close(
            ql.fake_quant_weight(),
            F.dequantize(*ql.codes(), ql.weight_quantizer.spec, global_scale=ql.weight_global_scale()),
            rtol=0,
            atol=0,
        )
    info = json.loads((tmp_path / "e" / "qatlib_export.json").read_text())
    assert info["deployment"]["vllm 0.33.0"]["scales_tied"] is True


@pytest.mark.parametrize("name", ["nvfp4_weight_only", "nvfp4"])
def test_nvfp4_deployed_equals_trained_when_tied_not_untied(tmp_path, name):
    tied, dt = _export(tmp_path, name, tied=True)
    untied, du = _export(tmp_path, name, tied=False)
    assert _diff(E.emulate_export(dt, "vllm").model, tied) <= EQUAL
    assert _diff(E.emulate_export(du, "vllm").model, untied) > MISMATCH


def test_nvfp4_moe_tied_deploys_as_trained(tmp_path):
    model, d = _export(tmp_path, "nvfp4", tied=True, moe=True)
    dep = E.emulate_export(d, "vllm")
    assert isinstance(dep.model.model.layers[0].mlp.experts[0].up_proj, E4.DeployedFP4Linear)
    assert _diff(dep.model, model) <= EQUAL


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
def test_w4a4_below_sm100_is_served_weight_only(tmp_path, name):
    """On SM90 a W4A4 export runs weight-only: the deployed model is the trained one with its
    input quantizers off (and differs from the trained W4A4 model); on SM100 it is W4A4."""
    model, d = _export(tmp_path, name, tied=True)
    assert _diff(E.emulate_export(d, "vllm", capability="10.0").model, model) <= EQUAL
    hopper = E.emulate_export(d, "vllm", capability="9.0")
    assert any("below SM100" in a for a in hopper.applied)
    assert _diff(hopper.model, model) > MISMATCH
    for _, ql in quant_linears(model):
        ql.input_quantizer.enabled = False
    assert _diff(hopper.model, model) <= EQUAL


def test_mxfp4_weight_only_deploys_as_trained(tmp_path):
    model, d = _export(tmp_path, "mxfp4_weight_only", tied=False)  # nothing to tie: no global scale
    assert _diff(E.emulate_export(d, "vllm").model, model) <= EQUAL


def test_sglang_w4a16_refuses_untied_global_scales_and_loads_tied(tmp_path):
    _, du = _export(tmp_path, "nvfp4_weight_only", tied=False)
    with pytest.raises(
        E.RuntimeRefusal, match=r"torch.unique\(global_scale\) has one value: model.layers.0.self_attn"
    ):
        E.emulate_export(du, "sglang")
    model, dt = _export(tmp_path, "nvfp4_weight_only", tied=True)
    assert _diff(E.emulate_export(dt, "sglang").model, model) <= EQUAL


@pytest.mark.parametrize(
    ("name", "bound"), [("nvfp4_weight_only", 0.1), ("mxfp4_weight_only", 0.1), ("nvfp4", 0.6)]
)
def test_fp4_export_variant_reloads_in_bf16_and_computes_the_trained_model(tmp_path, name, bound):
    """The ``export`` variant (transformers + compressed-tensors, run compressed) of an fp32 FP4
    model: compressed-tensors unpacks the E2M1 weights to bf16 whatever the model's dtype, so
    `load_variant` loads it in bf16 (in fp32 every linear failed: float != BFloat16). Its logits'
    mean distance to the trained model's, as a share of the unquantized model's distance to it:
    measured 0.04 weight-only (bf16 rounding), 0.45 for W4A4 (bf16 inputs flip activation codes at
    rounding boundaries, as in a bf16 runtime); an fp8 export keeps the checkpoint's own dtype."""
    from types import SimpleNamespace

    from qatlib.eval.variants import export_dtype, load_variant

    model, d = _export(tmp_path, name, tied=True)
    assert export_dtype(d) is torch.bfloat16
    cfg = SimpleNamespace(model=SimpleNamespace(trust_remote_code=False))
    reloaded, record = load_variant(cfg, "export", str(d), None)
    assert record["dtype"] == "bfloat16"
    with torch.no_grad():
        trained = model(IDS).logits.float()
        got = reloaded(IDS).logits.float()
        for _, ql in quant_linears(model):
            for q in (ql.weight_quantizer, ql.input_quantizer):
                if q is not None:
                    q.enabled = False
        unquantized = model(IDS).logits.float()
    share = (got - trained).abs().mean() / (unquantized - trained).abs().mean()
    assert share.item() <= bound, share
    _, di = _export(tmp_path, "fp8_static", tied=False)
    assert export_dtype(di) is None
