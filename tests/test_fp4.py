"""NVFP4 / MXFP4: E2M1 / E4M3 / E8M0 rounding, global scales and fake quantization against a
hand-written reference and against compressed-tensors' own quantize / dequantize; gradients;
presets; the key table; export -> reload in transformers + compressed-tensors."""

from __future__ import annotations

import math

import pytest
import torch
from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake_quantize
from compressed_tensors.quantization.quant_args import FP4_E2M1_DATA
from compressed_tensors.quantization.quant_scheme import MXFP4, NVFP4
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales
from conftest import build_model, tiny_qwen3_config
from transformers import AutoModelForCausalLM

from qatlib.checkpoint.keys import parse_key, scale_keys, scale_state_dict
from qatlib.export import ExportError, compressed_tensors_format, export
from qatlib.ptq import calibrate, save_ptq_checkpoint
from qatlib.quant import QuantScheme, QuantSpec, prepare, preset, quant_linears
from qatlib.quant import functional as F
from qatlib.quant.calibration import calibrate_activations
from qatlib.quant.spec import Granularity, SpecError
from qatlib.zero3.load import stream_load_scales

pytestmark = pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")
CT_ARGS = {"nvfp4": NVFP4, "mxfp4": MXFP4}


# --------------------------------------------------------------------------- E2M1
def test_e2m1_every_value_ties_and_saturation():
    vals = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    for v in vals:  # every representable value maps to itself, both signs
        x = torch.tensor([v, -v])
        assert F.round_e2m1(x).tolist() == [v, -v]
    # ties to the even mantissa (hand table), then just off the tie
    ties = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0}
    for t, want in ties.items():
        assert F.round_e2m1(torch.tensor([t, -t])).tolist() == [want, -want], t
        lo, hi = F.round_e2m1(torch.tensor([t - 1e-3, t + 1e-3])).tolist()
        below = max(v for v in vals if v < t)
        above = min(v for v in vals if v > t)
        assert (lo, hi) == (below, above), t
    # saturation at +-6
    assert F.round_e2m1(torch.tensor([6.1, 100.0, -7.0, -1e30])).tolist() == [6.0, 6.0, -6.0, -6.0]


def test_e2m1_matches_compressed_tensors_cast():
    x = torch.cat([torch.linspace(-7, 7, 2801), torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])])
    ours = F.round_e2m1(x)
    theirs = FP4_E2M1_DATA.cast_to_fp4(torch.clamp(x.clone(), -6, 6))
    assert torch.equal(ours, theirs)


# --------------------------------------------------------------------------- scales
def test_e4m3_scale_rounding():
    s = torch.tensor([0.0, 1e-9, 0.3, 1.0625, 17.0, 447.0, 1000.0])
    r = F.round_e4m3(s)
    # hand values: zero / underflow -> 0.125 (compressed-tensors' eps); 0.3 -> 0.3125 (0.3 lies
    # between E4M3 0.28125 and 0.3125, nearer the latter); 1.0625 is a tie between 1.0 and 1.125
    # -> 1.0 (even); 17 -> 16 (a tie between 16 and 18 -> even mantissa 16); 447 -> 448; >448 saturates
    assert r.tolist() == [0.125, 0.125, 0.3125, 1.0, 16.0, 448.0, 448.0]


def test_e8m0_scale_from_amax_hand_and_compressed_tensors():
    amax = torch.tensor([6.0, 4.0, 1.0, 1.7 * 4, 1.75 * 4, 0.01, 0.0])
    got = F.mx_scale_from_amax(amax)
    # hand: scale = 2**(floor(log2(amax)) - 2), the exponent bumped once the mantissa reaches 1.75
    want = [2.0**0, 2.0**0, 2.0**-2, 2.0**0, 2.0**1, 2.0 ** (math.floor(math.log2(0.01)) - 2), 2.0**-127]
    assert got.tolist() == want
    ct = generate_mx_scales(amax[:-1])  # E8M0 exponents (bias 127)
    assert torch.equal(got[:-1], torch.exp2(ct - 127))
    # a learned scale rounds to the nearest power of two in log2; exact powers stay put
    assert F.round_e8m0(torch.tensor([0.25, 0.3, 0.36, 3.0])).tolist() == [0.25, 0.25, 0.5, 4.0]


def test_global_scale_convention():
    w = torch.tensor([[0.5, -3.0], [1.0, 2.0]])
    assert F.fp4_global_scale(w.abs().amax()).tolist() == [pytest.approx(448 * 6 / 3.0)]
    assert torch.equal(F.fp4_global_scale(w.abs().amax()), generate_gparam(w.min(), w.max()))
    assert F.fp4_global_scale(torch.tensor(0.0)).tolist() == [1.0]


# --------------------------------------------------------------------------- fake quant
def _hand_nvfp4(w: torch.Tensor) -> torch.Tensor:
    """Hand-written NVFP4 reference (per element loops over groups)."""
    gs = 2688.0 / w.abs().max().item()
    out = torch.empty_like(w)
    for r in range(w.shape[0]):
        for g in range(w.shape[1] // 16):
            blk = w[r, g * 16 : (g + 1) * 16]
            s8 = torch.tensor(gs * (blk.abs().max().item() / 6.0)).to(torch.float8_e4m3fn).float().item()
            s8 = s8 if s8 != 0 else 0.125
            eff = torch.tensor(s8) / torch.tensor(gs)
            out[r, g * 16 : (g + 1) * 16] = F.round_e2m1(torch.clamp(blk / eff, -6, 6)) * eff
    return out


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(8, 64, generator=g) * 0.05
    w[0, :16] = 0.0  # an all-zero group
    w[1, :4] = torch.tensor([1e-9, 0.3, -2.0, 0.7])  # the tensor max sits here
    return w


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
def test_weight_fake_quant_matches_compressed_tensors(name):
    w = _weights()
    spec = preset(name).weight
    gs = F.fp4_global_scale(w.abs().amax()) if spec.has_global_scale else None
    scale, zp = F.compute_qparams(w, spec, gs)
    out = F.fake_quantize(w, scale, zp, spec, global_scale=gs)
    args = CT_ARGS[name]["weights"]
    grouped = w.reshape(8, -1, spec.group_size)
    ct_gs = generate_gparam(w.min(), w.max()) if gs is not None else None
    ct_scale, _ = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args, global_scale=ct_gs)
    assert torch.equal(scale, ct_scale.float())
    assert torch.equal(out, ct_fake_quantize(w, ct_scale, None, args, global_scale=ct_gs))
    assert torch.equal(
        out, F.dequantize(F.quantize(w, scale, zp, spec, gs), scale, zp, spec, global_scale=gs)
    )
    if name == "nvfp4":
        assert torch.equal(out, _hand_nvfp4(w))
    assert out[0, :16].abs().sum() == 0


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
def test_dynamic_activation_matches_compressed_tensors(name):
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    spec = preset(name).input
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    gs = torch.tensor([2688.0 / 2.5]) if spec.has_global_scale else None  # calibrated on a smaller range
    out = F.dynamic_fake_quantize(x, spec, global_scale=gs)
    args = CT_ARGS[name]["input_activations"]
    s, z = compute_dynamic_scales_and_zp(x, args, torch.nn.Module(), global_scale=gs)
    ref = ct_fake_quantize(x, s, None, args, global_scale=gs)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)


def test_gradients_finite_differences():
    spec = preset("nvfp4").weight
    w = _weights()
    gs0 = F.fp4_global_scale(w.abs().amax())
    scale, _ = F.compute_qparams(w, spec, gs0)
    # a global scale 4x too large (effective group scales 4x too small) saturates most elements:
    # there out = +-6 * s8 / gs, a smooth function of gs (finite differences are defined), and
    # x gets no gradient (clamped)
    gs = (gs0 * 4).requires_grad_(True)
    x = w.clone().requires_grad_(True)
    eff = F.round_e4m3(scale).repeat_interleave(16, -1) / gs.detach()
    clipped = (w / eff).abs() > 6
    assert clipped.float().mean() > 0.3
    out = F.fake_quantize(x, scale, None, spec, global_scale=gs)
    (out * clipped).sum().backward()
    h = gs.item() * 1e-4

    def f(g):
        with torch.no_grad():
            return (F.fake_quantize(w, scale, None, spec, global_scale=g).double() * clipped).sum().item()

    fd = (f(gs.detach() + h) - f(gs.detach() - h)) / (2 * h)
    assert fd != 0 and gs.grad.item() == pytest.approx(fd, rel=1e-3)
    assert (x.grad[clipped] == 0).all()
    # inside the range the input gradient is the straight-through identity
    x.grad = None
    F.fake_quantize(x, scale, None, spec, global_scale=gs0).sum().backward()
    inside = (w / (F.round_e4m3(scale).repeat_interleave(16, -1) / gs0)).abs() < 6
    assert (x.grad[inside] == 1).all()
    # the group-scale master gets the LSQ gradient through the E4M3 rounding (straight-through):
    # d out / d s8 = (q - x / eff) / gs inside the range, q / gs where clipped (by hand)
    s = scale.clone().requires_grad_(True)
    F.fake_quantize(w, s, None, spec, global_scale=gs0).sum().backward()
    effh = F.round_e4m3(scale).repeat_interleave(16, -1) / gs0
    q = F.round_e2m1(torch.clamp(w / effh, -6, 6))
    r = w / effh
    lsq = (torch.where(r.abs() <= 6, q - r, q) / gs0).reshape(8, -1, 16).sum(-1)
    torch.testing.assert_close(s.grad, lsq, rtol=1e-4, atol=1e-9)
    assert s.grad.abs().sum() > 0


# --------------------------------------------------------------------------- spec / presets
def test_presets_and_spec_errors():
    assert preset("nvfp4").input.dynamic and preset("nvfp4_weight_only").input is None
    assert preset("mxfp4").weight.group_size == 32 and preset("nvfp4").weight.group_size == 16
    assert QuantSpec("nvfp4", "per-block").granularity is Granularity.GROUP  # upstream spelling
    assert preset("nvfp4").weight.bits_per_element == 4.5
    assert preset("mxfp4").weight.bits_per_element == 4.25
    with pytest.raises(SpecError) as e:
        QuantSpec("nvfp4", Granularity.GROUP, group_size=32)
    assert e.value.field == "group_size"
    with pytest.raises(SpecError) as e:
        QuantSpec("int4", "per-block")
    assert e.value.field == "granularity"
    with pytest.raises(SpecError) as e:
        QuantScheme(weight=preset("nvfp4").weight, input=preset("nvfp4").input.replace(dynamic=False))
    assert e.value.field == "dynamic"
    with pytest.raises(SpecError):
        QuantSpec("mxfp4", Granularity.TENSOR)


def test_upstream_nvfp4_ptq_yaml_resolves(tmp_path):
    from qatlib.config.scheme import build_quant_scheme
    from qatlib.config.sections import CompressionConfig

    comp = CompressionConfig.model_validate(
        {
            "name": "PTQ",
            "quantization": {
                "name": "nvfp4",
                "bits": 4,
                "quant_method": {"weight": "per-block", "activation": "per-block", "group_size": 16},
                "ignore_layers": ["lm_head"],
            },
        }
    )
    assert build_quant_scheme(comp) == preset("nvfp4")


# --------------------------------------------------------------------------- model level
def _batches(n=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (2, 24), generator=g) for _ in range(n)]


def _calibrated(name, dtype=None):
    model = build_model(tiny_qwen3_config())
    if dtype is not None:
        model.to(dtype)
    return model, calibrate(model, preset(name), _batches()).scheme


def test_calibration_sets_global_scales_and_key_table_round_trip(tmp_path):
    model, scheme = _calibrated("nvfp4")
    ql = dict(quant_linears(model))["model.layers.0.mlp.down_proj"]
    assert ql.input_quantizer.global_scale.item() != 1.0 and bool(ql.input_quantizer.initialized)
    assert ql.weight_quantizer.global_scale.item() == pytest.approx(2688.0 / ql.weight.abs().max().item())
    sd = scale_state_dict(model)
    for role in ("weight", "input"):
        key = f"model.layers.0.mlp.down_proj.{role}_global_scale"
        assert key in sd and parse_key(key) == ("model.layers.0.mlp.down_proj", role, "global_scale")
    assert set(scale_keys(model).values()) == set(sd)
    save_ptq_checkpoint(model, scheme, tmp_path / "ptq")
    fresh = build_model(tiny_qwen3_config())
    prepare(fresh, scheme)
    for _, q in quant_linears(fresh):  # scramble the init so the load must set every value
        if q.input_quantizer.global_scale is not None:
            q.input_quantizer.global_scale.data.fill_(3.0)
    report = stream_load_scales(fresh, tmp_path / "ptq", scheme)
    assert report["misses"] == 0
    got = scale_state_dict(fresh)
    assert set(got) == set(sd) and all(torch.equal(got[k], sd[k]) for k in sd)
    # the warm start marks every quantizer initialised, the dynamic NVFP4 inputs too (their only
    # parameter is the global scale), so the blockwise trainer's calibration leaves them alone
    assert all(bool(q.initialized) for _, ql in quant_linears(fresh) for _, q in ql.quantizers())
    again = calibrate_activations(fresh, _batches(1, seed=9), only_uninitialized=True)
    assert again.static_activation_quantizers == 0
    assert all(torch.equal(v, sd[k]) for k, v in scale_state_dict(fresh).items())
    x = _batches(1, seed=5)[0]
    with torch.no_grad():
        assert torch.equal(fresh(x).logits, model(x).logits)


@pytest.mark.parametrize("name", ["nvfp4_weight_only", "mxfp4_weight_only"])
def test_weight_only_export_reloads_exactly(tmp_path, name):
    """fp32 model, dequantizing reload: compressed-tensors' FP4 decompression returns bf16 weights
    (`unpack_fp4_from_uint8`), so the reference is our fake-quant weight rounded to bf16: exact."""
    from transformers.utils.quantization_config import CompressedTensorsConfig

    model, scheme = _calibrated(name)
    out = export(model, scheme, tmp_path / name, "real")
    assert compressed_tensors_format(scheme).format == (
        "nvfp4-pack-quantized" if name.startswith("nv") else "mxfp4-pack-quantized"
    )
    reloaded = AutoModelForCausalLM.from_pretrained(
        out, quantization_config=CompressedTensorsConfig(dequantize=True)
    ).eval()
    ref = build_model(tiny_qwen3_config())
    with torch.no_grad():
        for n, ql in quant_linears(model):
            ref.get_submodule(n).weight.copy_(ql.fake_quant_weight().to(torch.bfloat16).float())
    x = _batches(1, seed=11)[0]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x).logits, ref(x).logits, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "nvfp4_weight_only"])
def test_export_reload_layers_bitwise(tmp_path, name):
    """bf16 model, compressed-tensors' own forward (FP4 codes, scales, global scales and the dynamic
    per-group activation quantization): every quantized linear's output equals ours bit for bit."""
    model, scheme = _calibrated(name, torch.bfloat16)
    out = export(model, scheme, tmp_path / name, "real")
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    x = _batches(1, seed=3)[0]
    with torch.no_grad():
        reloaded(x)  # compressed-tensors decompresses the weights on the first forward
        g = torch.Generator().manual_seed(2)
        for n, ql in quant_linears(model):
            m = reloaded.get_submodule(n)
            xi = (torch.randn(4, ql.in_features, generator=g) * 3).to(torch.bfloat16)
            assert torch.equal(ql(xi), m(xi)), n
            if scheme.input is not None and scheme.input.has_global_scale:
                assert torch.equal(m.input_global_scale.float(), ql.input_quantizer.global_scale.detach())


def test_fp4_export_refuses_mixed_formats():
    with pytest.raises(ExportError, match="no compressed-tensors"):
        compressed_tensors_format(QuantScheme("x", weight=preset("nvfp4").weight, input=QuantSpec("fp8")))
    with pytest.raises(SpecError):
        QuantScheme("x", weight=preset("nvfp4").weight, input=preset("mxfp4").input)


# --------------------------------------------------------------------------- upstream FOCUS FP4 keys
FOCUS = "configs/qwen3/fp4/qwen3-4b_focus_{}_w4a4_zero3.yaml"
QC = "compression.QAT.plugin_config.quant_config"
# qatlib's ZeRO-3 rules (not FP4 keys): a PTQ checkpoint to start from, the real export
ZERO3_FIX = {"compression.QAT.from_ptq_ckpt": "/local/ptq", "compression.QAT.save_format": "real"}


def _upstream_e2m1(x: torch.Tensor, mode: str) -> torch.Tensor:
    """Upstream's `_quant_fp4_element` (angelslim/compressor/qat/modules/quantizer.py l.91-118,
    ebits 2, mbits 3, max_norm 6), forward only, re-typed here to check "even" / "nearest"."""
    exp = torch.floor(torch.log2(x.abs() + (x == 0).float())).clip(min=0.0)
    t = x / 2.0**exp * 2.0
    a = t.abs()
    if mode == "even":
        t = torch.sign(t) * (torch.floor(a + 0.5) - ((a - 0.5) % 2 == 0).float())
    elif mode == "nearest":
        t = torch.sign(t) * torch.round(a)
    else:  # floor
        t = torch.sign(t) * torch.floor(a)
    return torch.clamp(t / 2.0 * 2.0**exp, -6, 6)


def test_upstream_mantissa_roundings_are_qatlibs_e2m1():
    x = torch.cat([torch.linspace(-6, 6, 4801), torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])])
    for mode in ("even", "nearest"):
        assert torch.equal(_upstream_e2m1(x, mode), F.round_e2m1(x)), mode
    # floor truncates (0.9 -> 0.5, 5.9 -> 4): another rounding, refused below
    assert _upstream_e2m1(torch.tensor([0.9, 5.9]), "floor").tolist() == [0.5, 4.0]
    assert F.round_e2m1(torch.tensor([0.9, 5.9])).tolist() == [1.0, 6.0]


def test_upstream_focus_configs_with_honoured_keys_load():
    """Upstream's FOCUS YAMLs (byte-identical copies) without their FOCUS features (sub-group scales
    off, qtype mxfp4 for mxfp4_rceil: tests/test_focus.py runs them as written) are qatlib's own FP4
    recipes: NVFP4 the nvfp4 preset (mantissa_rounding nearest, num_sub and quant_max_scale_lr
    accepted); MXFP4 (over the w4a8_fp8 base upstream names) the mxfp4 preset's weight and input,
    fp8_recast dropped."""
    import upstream_compat as uc

    nv = uc.load(FOCUS.format("nvfp4"), **{f"{QC}.weight.use_subgroup_scale": False}, **ZERO3_FIX)
    assert nv.quant_scheme() == preset("nvfp4") and nv.zero3_enabled
    assert nv.learnable().weight_scale and not nv.learnable().act_scale
    mx = uc.load(
        FOCUS.format("mxfp4"),
        **{
            f"{QC}.weight.use_subgroup_scale": False,
            f"{QC}.weight.qtype": "mxfp4",
            f"{QC}.activation.qtype": "mxfp4",
        },
        **ZERO3_FIX,
    )
    s = mx.quant_scheme()
    assert (s.weight, s.input) == (preset("mxfp4").weight, preset("mxfp4").input)
    # "even" (the MXFP4 file's) and "nearest" (the NVFP4 file's) give the same scheme
    nv_even = uc.load(
        FOCUS.format("nvfp4"),
        **{f"{QC}.weight.use_subgroup_scale": False, f"{QC}.weight.mantissa_rounding": "even"},
        **ZERO3_FIX,
    )
    assert nv_even.quant_scheme() == nv.quant_scheme()


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("weight.mantissa_rounding", "floor", "upstream AngelSlim feature mantissa_rounding 'floor'"),
        ("activation.mantissa_rounding", "up", "'up' is not one of upstream's values (even, nearest, floor)"),
        ("weight.num_sub", 0, "must be a positive integer (got 0)"),
        ("activation.use_subgroup_scale", True, "has no effect: upstream creates FOCUS's sub-group scales"),
        ("weight.num_sub", 3, "subgroups must be a positive divisor of the group size 16; got 3"),
        ("weight.qtype", "int4", "sub-group scales (FOCUS) apply to the FP4 formats, not to int4"),
        ("activation.num_sub", -2, "must be a positive integer (got -2)"),
    ],
)
def test_upstream_fp4_keys_refused_by_name(key, value, fragment):
    import upstream_compat as uc

    from qatlib.config import ConfigError

    keep_subgroups = key in ("weight.num_sub", "weight.qtype")
    with pytest.raises(ConfigError) as ei:
        uc.load(
            FOCUS.format("nvfp4"),
            **{f"{QC}.weight.use_subgroup_scale": keep_subgroups, f"{QC}.{key}": value},
            **ZERO3_FIX,
        )
    path, msg = ei.value.issues[0]
    # a sub-group error names num_sub (the file sets it)
    want = f"{QC}.weight.num_sub" if key == "weight.qtype" else f"{QC}.{key}"
    assert path == want and fragment in msg, (path, msg)
    assert "unknown key" not in msg and "did you mean" not in msg


# --------------------------------------------------------------------------- runtime facts
def test_fp4_layouts_and_load_refusals(tmp_path):
    """Each FP4 preset has its own runtime layout (before: NVFP4 W4A16 was taken for int WNA16 and
    W4A4 for int8 dynamic); SGLang 0.5.23 refuses MXFP4 W4A4 (dense and MoE), at parse time too."""
    import json

    from qatlib.config import ConfigError, parse_config
    from qatlib.runtime.facts import Layout, layout_of, load_refusal

    want = {
        "nvfp4": Layout.NVFP4,
        "nvfp4_weight_only": Layout.NVFP4_A16,
        "mxfp4": Layout.MXFP4,
        "mxfp4_weight_only": Layout.MXFP4_A16,
    }
    for name, layout in want.items():
        assert layout_of(preset(name)) is layout
        for moe in (False, True):
            assert load_refusal("vllm", layout, moe=moe) is None
            refused = load_refusal("sglang", layout, moe=moe)
            assert (refused is not None) == (layout is Layout.MXFP4), (name, moe)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    data = {
        "model": {"model_path": str(tmp_path)},
        "compression": {"name": "PTQ", "quantization": {"name": "mxfp4"}},
    }
    with pytest.raises(ConfigError) as e:
        parse_config({**data, "deploy": {"target": "sglang"}})
    assert e.value.issues[0][0] == "deploy.target" and "NVFP4 layout" in e.value.issues[0][1]
    parse_config({**data, "deploy": {"target": "vllm"}})


def test_fp4_global_scale_facts_count_the_fused_groups():
    """vLLM / SGLang keep one NVFP4 weight global scale per fused linear (q/k/v, gate/up): the
    deployment report counts the fused groups whose shards' global scales differ (every one after
    PTQ: each projection's is 448 * 6 / its own absmax), and none once they are made equal."""
    from qatlib.runtime.differences import deployment_differences
    from qatlib.runtime.facts import Transform

    model, scheme = _calibrated("nvfp4_weight_only")
    n_groups = 2 * tiny_qwen3_config().num_hidden_layers  # q/k/v and gate/up per layer

    def lines(target):
        d = deployment_differences(model, scheme)
        return [ln for k, v in d.items() if k.startswith(target) for ln in v["differences"]]

    vl = [ln for ln in lines("vllm") if ln.startswith(Transform.FP4_GLOBAL_SCALE_MAX.value)]
    assert len(vl) == 1 and vl[0].endswith(
        f"{n_groups} of {n_groups} fused groups have different weight global scales, 0 different input ones"
    )
    sg = [ln for ln in lines("sglang") if ln.startswith(Transform.FP4_GLOBAL_SCALE_MUST_MATCH.value)]
    assert len(sg) == 1 and f"{n_groups} of {n_groups} fused groups" in sg[0]
    with torch.no_grad():
        for layer in model.model.layers:
            for group in (
                (layer.self_attn, ("q_proj", "k_proj", "v_proj")),
                (layer.mlp, ("gate_proj", "up_proj")),
            ):
                mods = [getattr(group[0], n) for n in group[1]]
                shared = torch.stack([m.weight_quantizer.global_scale for m in mods]).amin(0)
                for m in mods:
                    m.weight_quantizer.global_scale.copy_(shared)
    vl = [ln for ln in lines("vllm") if ln.startswith(Transform.FP4_GLOBAL_SCALE_MAX.value)]
    assert vl[0].endswith(
        f"0 of {n_groups} fused groups have different weight global scales, 0 different input ones"
    )
