"""QAT for vLLM on a CPU without int8 VNNI (``deploy.int8_gemm: pair_saturating``): the saturating
int8 GEMM (`qatlib.quant.int8_gemm`, the one owner of that arithmetic) by hand, a prepared
`QuantLinear` computing what the emulator serves for that kernel (forward) with the fake-quant
linear's gradients (backward), prepare / convert parity, and the config rule.

Broken by hand once each (2026-12-07): the clamp dropped from `pair_saturation` (the hand cases and
the layer-vs-emulator tests fail), the correction left off in `_linear` (the layer tests fail), the
correction not detached (the gradient test fails), the config rule removed (the config test fails).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import build_model, tiny_llama_config
from torch import nn

from qatlib.quant import PrepareOptions, QuantScheme, QuantSpec, convert, prepare, preset
from qatlib.quant import int8_gemm as gemm
from qatlib.quant.int8_gemm import pair_saturation, saturating_int8_matmul
from qatlib.quant.linear import QuantLinear

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

INT8_STATIC = QuantScheme("int8_static", weight=QuantSpec("int8", "per-channel"), input=QuantSpec("int8"))


# --------------------------------------------------------------------------- the arithmetic
def test_saturating_pairs_by_hand():
    """K = 4, two output columns, activation codes x = [120, 110, -128, 50] (u = x + 128 =
    [248, 238, 0, 178]).

    Column 0, w = [90, 80, -100, -60]: pair 0 = 248*90 + 238*80 = 22320 + 19040 = 41360 -> 32767;
    pair 1 = 0*(-100) + 178*(-60) = -10680 (|w| sum 160 > 128, yet no clip); compensation
    128 * (90 + 80 - 100 - 60) = 1280: accumulator 32767 - 10680 - 1280 = 20807, the exact product
    10800 + 8800 + 12800 - 3000 = 29400, the clip costs 41360 - 32767 = 8593.

    Column 1, w = [-127, -127, 5, 5]: pair 0 = -127 * (248 + 238) = -61722 -> -32768; pair 1 =
    178*5 = 890; compensation 128 * (-254 + 10) = -31232: accumulator -32768 + 890 + 31232 = -646,
    exact -15240 - 13970 - 640 + 250 = -29600 (the clip adds 28954)."""
    x = torch.tensor([[120, 110, -128, 50]], dtype=torch.int8)
    w = torch.tensor([[90, 80, -100, -60], [-127, -127, 5, 5]], dtype=torch.int8)
    assert (x.long() @ w.long().t()).tolist() == [[29400, -29600]]
    assert saturating_int8_matmul(x, w).tolist() == [[20807, -646]]
    assert pair_saturation(x, w).tolist() == [[-8593, 28954]]
    # float codes (the training path's) give the same integers
    assert saturating_int8_matmul(x.float(), w.float()).tolist() == [[20807, -646]]


def test_chunking_changes_nothing(monkeypatch):
    """`pair_saturation` bounds its memory by chunks of pairs: integer sums, so any chunk size
    gives the same accumulator (one row's chunk: 7 pairs)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-128, 128, (5, 33), generator=g)
    w = torch.randint(-127, 128, (12, 33), generator=g)
    whole = saturating_int8_matmul(x, w)
    assert not torch.equal(whole, x @ w.t())
    monkeypatch.setattr(gemm, "_CHUNK_ELEMENTS", 5 * 7)
    assert torch.equal(saturating_int8_matmul(x, w), whole)


def test_runtime_reexports_the_one_function():
    """The emulator's module computes with the very function training uses."""
    from qatlib.runtime import cpu_int8

    assert cpu_int8.saturating_int8_matmul is saturating_int8_matmul
    assert cpu_int8.INT8_GEMMS == gemm.INT8_GEMMS


# --------------------------------------------------------------------------- one layer
def _layer(scheme: QuantScheme, int8_gemm: str, seed: int = 0) -> QuantLinear:
    """K = 64 -> N = 16, weights uniform in ±1 per row: per-channel codes spread over [-127, 127],
    so many adjacent pairs can clip. The same weight and bias for every ``int8_gemm``."""
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(64, 16)
    with torch.no_grad():
        lin.weight.copy_(torch.rand(16, 64, generator=g) * 2 - 1)
        lin.bias.copy_(torch.rand(16, generator=g) - 0.5)
    ql = QuantLinear(lin, scheme, int8_gemm=int8_gemm)
    if scheme.input is not None and not scheme.input.dynamic:
        ql.input_quantizer.set_qparams(torch.tensor([3.0 / 127]))
    return ql


def _input(seed: int = 1) -> torch.Tensor:
    """Tokens with large positive activations: u = x + 128 near 255, pair sums past int16."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(2, 6, 64, generator=g) * 3.5 - 0.5).requires_grad_(True)


def _served(ql: QuantLinear, x: torch.Tensor, int8_gemm: str) -> torch.Tensor:
    """What the emulator's `Int8DeployedLinear` computes from the layer's stored codes (the
    runtime's own activation quantization, `qatlib.runtime.emulate`)."""
    from qatlib.runtime.cpu_int8 import int8_linear
    from qatlib.runtime.emulate import int8_codes, int8_token_scale

    codes, scale, _ = ql.codes()
    x2 = x.detach().reshape(-1, 64).float()
    if ql.input_quantizer.spec.dynamic:
        s = int8_token_scale(x2)
    else:
        s = ql.input_quantizer.scale.detach().reshape(())
    y = int8_linear(int8_codes(x2, s), s, codes, scale, int8_gemm) + ql.bias.detach()
    return y.reshape(*x.shape[:-1], -1)


@pytest.mark.parametrize("scheme", [preset("int8"), INT8_STATIC], ids=["dynamic", "static"])
def test_layer_forward_is_the_served_kernel(scheme):
    """``pair_saturating``: the layer's output equals the emulator's pair-saturating int8 linear
    on the same codes to fp32 rounding, and parts from the exact one on these saturating inputs;
    ``exact`` matches the exact kernel."""
    x = _input()
    sat, exact = _layer(scheme, "pair_saturating"), _layer(scheme, "exact")
    with torch.no_grad():
        y_sat, y_exact = sat(x), exact(x)
    want_sat, want_exact = _served(sat, x, "pair_saturating"), _served(exact, x, "exact")
    torch.testing.assert_close(y_sat, want_sat, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y_exact, want_exact, rtol=1e-5, atol=1e-5)
    assert (want_sat - want_exact).abs().max() > 0.1  # the clipping shows at this size
    assert (y_sat - y_exact).abs().max() > 0.1


def test_gradients_are_the_fake_quant_linears():
    """Straight-through: the pair-saturating layer's gradients (input, weight, static input scale,
    weight scale, bias) equal the exact fake-quant layer's, bit for bit, though the outputs differ."""
    grads = {}
    for mode in ("exact", "pair_saturating"):
        ql = _layer(INT8_STATIC, mode)
        x = _input()
        out = ql(x)
        g = torch.Generator().manual_seed(3)
        (out * torch.randn(out.shape, generator=g)).sum().backward()
        params = dict(ql.named_parameters())
        assert all(p.grad is not None for p in params.values())
        grads[mode] = {"x": x.grad, **{k: p.grad for k, p in params.items()}}
    assert grads["exact"].keys() == grads["pair_saturating"].keys()
    for k, g in grads["exact"].items():
        assert torch.equal(g, grads["pair_saturating"][k]), k


def test_quantization_off_computes_no_saturation():
    """A disabled quantizer (the KD teacher: `quantization_disabled`) or calibration runs the
    plain linear: nothing to saturate."""
    from qatlib.quant import quantization_disabled

    ql = _layer(preset("int8"), "pair_saturating")
    model = nn.Sequential(ql)
    x = _input()
    with torch.no_grad(), quantization_disabled(model):
        torch.testing.assert_close(model(x), nn.functional.linear(x, ql.weight, ql.bias))


def test_a_scheme_it_cannot_model_is_refused():
    with pytest.raises(ValueError, match="int8_gemm"):
        _layer(preset("fp8_static"), "pair_saturating")
    with pytest.raises(ValueError, match="int8_gemm"):
        _layer(preset("int8"), "saturating")
    model = build_model(tiny_llama_config())
    with pytest.raises(ValueError, match="int8_gemm"):
        prepare(model, preset("int4_weight_only"), options=PrepareOptions(int8_gemm="pair_saturating"))
    assert not any(isinstance(m, QuantLinear) for m in model.modules())  # refused before any swap


# --------------------------------------------------------------------------- a model, prepared and served
def _outlier_model():
    """tests/test_runtime_cpu_int8.py's tiny Llama: 1/8 of each decoder linear's rows uniform in
    ±0.26, so adjacent weight-code pairs past 128 are common."""
    from test_runtime_cpu_int8 import _outlier_rows_model

    return _outlier_rows_model()


def test_prepared_model_is_the_emulated_export(tmp_path):
    """A model calibrated with ``int8_gemm="pair_saturating"`` (under deploy.target vllm) gives the
    logits the emulator serves its export with on that kernel, and its converted form the same;
    the exact setting does not."""
    from test_serve import _calibration

    from qatlib.export import export
    from qatlib.ptq import calibrate
    from qatlib.runtime.emulate import emulate_export
    from qatlib.runtime.tying import tie_for

    model = _outlier_model()
    opts = PrepareOptions(deploy=tie_for("vllm"), int8_gemm="pair_saturating")
    scheme = calibrate(model, preset("int8"), _calibration(), options=opts).scheme
    assert {m.int8_gemm for m in model.modules() if isinstance(m, QuantLinear)} == {"pair_saturating"}
    ids = torch.randint(0, 512, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trained = model(ids).logits
        converted = convert(copy.deepcopy(model))(ids).logits
    export(model, scheme, tmp_path / "int8", "real")
    with torch.no_grad():
        served = emulate_export(tmp_path / "int8", "vllm", int8_gemm="pair_saturating").model(ids).logits
        exact = emulate_export(tmp_path / "int8", "vllm").model(ids).logits
    gap = (served - exact).abs().max().item()
    assert gap > 1e-2
    assert (trained - served).abs().max().item() < gap / 100
    torch.testing.assert_close(converted, trained, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- the config
def test_config_key():
    """``deploy.int8_gemm`` reaches `prepare` (`prepare_options`); on a scheme it cannot model or
    a target other than vllm it is a config error naming the key, at parse time."""
    from pathlib import Path

    from qatlib.config import ConfigError, load_config

    base = Path(__file__).parent / "data" / "configs" / "qwen3-4b_int4_weight_only_end2end.yaml"
    qc = "compression.QAT.plugin_config.quant_config"
    int8 = {f"{qc}.weight": None, f"{qc}.use_activation_quant": True, "compression.quantization.name": "int8"}
    assert load_config(base, int8).prepare_options().int8_gemm == "exact"
    cfg = load_config(base, {**int8, "deploy.int8_gemm": "pair_saturating"})
    assert cfg.prepare_options().int8_gemm == "pair_saturating"
    with pytest.raises(ConfigError, match=r"deploy\.int8_gemm: pair_saturating models an int8 x int8 GEMM"):
        load_config(base, {"deploy.int8_gemm": "pair_saturating"})  # int4 weight-only
    with pytest.raises(ConfigError, match=r"deploy\.int8_gemm: .*deploy.target is 'sglang'"):
        load_config(base, {**int8, "deploy.int8_gemm": "pair_saturating", "deploy.target": "sglang"})
