"""vLLM's own engine (qatlib.serve: the offline ``LLM`` in the serving environment ``.venv-serve``)
against transformers and against qatlib's emulator of it (qatlib.runtime.emulate), on tiny Llama
models built, calibrated (qatlib.ptq.calibrate) and exported (qatlib.export.export) here.

The models: Llama, hidden 128, ONE decoder layer, 4 heads of 32 (vLLM-CPU's attention wants
head_dim % 32 == 0), vocab 512, weights drawn with std 0.15 (logits large enough that quantization
moves the NLL: an untrained std-0.02 model scores log(512) whatever its weights); 16 windows of 128
random token ids (`qatlib.eval.perplexity.make_windows`). One decoder layer, because quantized
models are chaotic where an activation code sits on a rounding boundary: a 1e-7 relative change of
the embeddings moves the emulator's own per-window NLL by up to ~3e-4 (int8 dynamic, fp8) with one
layer, and by 1e-3 .. 2e-3 with two (std 0.1), against a quantization effect of 1.7e-2 (int8) /
3.5e-2 (fp8): with one layer a bound can be 17-40x below the effect it must detect.

Bounds (max |served - reference| over the windows' mean NLL, nats), measured 2026-12-07 on a 2-core
AMD EPYC with AVX-512 BF16 + VNNI, no AMX (vllm-cpu 0.32.0 loads its ``_C`` library, ISA
``avx512_bf16+vnni``), one OpenMP thread:

- fp32 base vs transformers: measured 7.5e-7 (two-layer variant 6.4e-7); bound 1e-5.
- W8A8-INT8, dynamic per-token input (the ``int8`` preset), ``CPUInt8ScaledMMLinearKernel`` (oneDNN;
  exact here: its per-token codes equal round(x / (amax/127)) and its GEMM equals int32 arithmetic
  on them to 7e-8 of the largest output): measured 3.2e-4, bound 1e-3 (quantization effect 1.7e-2).
- W8A8-INT8, static per-tensor input (no preset: built here), same kernel: measured 4.2e-4, bound
  1.25e-3 (effect 2.4e-2).
- FP8, per-channel weights + dynamic per-token input (no preset: built here),
  ``ChannelWiseTorchFP8ScaledMMLinearKernel`` (torch ``_scaled_mm``): measured 2.8e-4, bound 8.5e-4
  (effect 3.5e-2).
Each quantized bound was checked to fail when set below the measured value. Each quantized test
also checks that its bound is below the quantization effect (served quantized vs transformers
base), so a served model that ignored quantization would fail it.

On a CPU without int8 VNNI (AVX2; AVX-512 without VNNI) oneDNN's int8 GEMM saturates adjacent
K-pair sums at int16 (issue 60: +0.026 nats mean on the default experiment; `qatlib.runtime.cpu_int8`):
there the int8 references are the emulator with ``int8_gemm="pair_saturating"``
(`cpu_int8.engine_int8_gemm`: no ``avx512_vnni`` / ``avx_vnni`` in /proc/cpuinfo, or
``ONEDNN_MAX_CPU_ISA`` below VNNI). With ``ONEDNN_MAX_CPU_ISA=AVX2`` on the machine above the int8
figures are: dynamic 1.9e-4, static 7.2e-4 (same bounds; measured 2026-12-07); against the exact
emulation they would be 4.9e-2 and 2.6e-2.

Engine time: one worker serves the four models (~40 s: vLLM imported once, ~3-5 s engine start per
model); two error paths run their own short workers (~15 s each), the timeout one 2 s.
"""

from __future__ import annotations

import ast
import json
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import build_model, tiny_llama_config

from qatlib.eval.perplexity import make_windows, perplexity_of_ids
from qatlib.export import export
from qatlib.ptq import calibrate
from qatlib.quant import Granularity, QuantScheme, QuantSpec, preset
from qatlib.runtime.cpu_int8 import engine_int8_gemm
from qatlib.runtime.emulate import emulate_export
from qatlib.serve import ServeError, ServeJob, classify, serve_perplexities, serve_perplexity, serve_python
from qatlib.serve import engine as serve_engine
from qatlib.serve import env as serve_env

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SEQ, WINDOWS = 128, 16
CONFIG = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    initializer_range=0.15,
)
BASE_BOUND = 1e-5  # measured 7.5e-7
# name: (scheme, measured max |served - emulated| per window, bound = 3x measured, the CPU kernel
# vLLM picks). Measured on avx512_bf16+vnni (see the module docstring): 16 windows, most agree within
# 1e-6; 2 to 9 of them differ by 1e-5 .. 4e-4 with either sign (one activation code on a rounding
# boundary flipping, as the emulator's own 1e-7 perturbation does): not a systematic difference.
FORMATS = {
    "int8_dynamic": (preset("int8"), 3.2e-4, 1.0e-3, "CPUInt8ScaledMMLinearKernel"),
    "int8_static": (
        QuantScheme(
            "int8_static",
            weight=QuantSpec("int8", Granularity.CHANNEL),
            input=QuantSpec("int8", Granularity.TENSOR),
        ),
        4.2e-4,
        1.25e-3,
        "CPUInt8ScaledMMLinearKernel",
    ),
    "fp8_channel_token": (
        QuantScheme(
            "fp8_channel_token",
            weight=QuantSpec("fp8", Granularity.CHANNEL),
            input=QuantSpec("fp8", Granularity.TOKEN, dynamic=True),
        ),
        2.8e-4,
        8.5e-4,
        "ChannelWiseTorchFP8ScaledMMLinearKernel",
    ),
}


# the int8 GEMM vllm-cpu runs on this CPU (exact with int8 VNNI, else pair-saturating)
INT8_GEMM = engine_int8_gemm()


def _ids() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 512, (WINDOWS * SEQ,), generator=g)


def _calibration() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 512, (2, 64), generator=g) for _ in range(2)]


def _window_nll(model, ids) -> list[float]:
    return perplexity_of_ids(model, ids, seq_len=SEQ, progress=False)["window_nll"]


def _export(scheme: QuantScheme, out: Path) -> Path:
    model = build_model(tiny_llama_config(**CONFIG))
    rep = calibrate(model, scheme, _calibration())
    export(model, rep.scheme, out, "real")
    return out


def _need_serving_env() -> Path:
    try:
        return serve_python()
    except ServeError as e:  # in CI a skip fails the run (conftest): install.sh makes the env
        pytest.skip(f"the serving environment is missing, so vLLM's engine cannot run here: {e}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Every model built and exported, all served by ONE worker, then its reference NLLs computed
    (the int8 GEMM of the emulator: `INT8_GEMM` where vLLM runs on the CPU, exact on CUDA)."""
    _need_serving_env()
    root = tmp_path_factory.mktemp("serve")
    ids = _ids()
    base = build_model(tiny_llama_config(**CONFIG))
    base.save_pretrained(root / "base")
    refs = {"base": _window_nll(base, ids)}
    dirs = {"base": root / "base"}
    for name, (scheme, *_) in FORMATS.items():
        dirs[name] = _export(scheme, root / name)
    windows = make_windows(ids, SEQ)
    t0 = time.perf_counter()
    results = serve_perplexities([ServeJob(d, windows) for d in dirs.values()])
    seconds = time.perf_counter() - t0
    print(f"\nserved {len(dirs)} models in {seconds:.1f} s: {results[0].engine.get('isa')}")
    gemm = INT8_GEMM if results[0].engine["device"] == "cpu" else "exact"
    for name in FORMATS:
        refs[name] = _window_nll(emulate_export(dirs[name], "vllm", int8_gemm=gemm).model, ids)
    return {"dirs": dirs, "refs": refs, "results": dict(zip(dirs, results)), "root": root}


def _max_diff(a, b) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


# --------------------------------------------------------------------------- the engine's numbers
@pytest.mark.slow
def test_fp32_base_served_equals_transformers(served):
    """vLLM's fp32 forward and prompt log-probabilities equal transformers' per window within
    1e-5 nats (measured 7.5e-7: fp32 summation order)."""
    r = served["results"]["base"]
    assert r.tokens == (SEQ - 1,) * WINDOWS
    assert _max_diff(r.nll, served["refs"]["base"]) < BASE_BOUND
    ref = served["refs"]["base"]
    assert r.ppl == pytest.approx(torch.tensor(ref).mean().exp().item(), rel=1e-5)  # equal windows
    e = r.engine
    assert e["vllm_version"] and e["package"] in ("vllm-cpu", "vllm") and e["device"] in ("cpu", "cuda")
    assert e["isa"] and e["kernels"] == [] and e["start_s"] > 0 and e["score_s"] > 0
    assert e["peak_rss_bytes"] > 100 << 20
    assert "vLLM " in r.label and e["isa"] in r.label


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FORMATS))
def test_served_equals_emulated(served, name):
    """The emulated deployed model (qatlib.runtime.emulate) and the engine agree per window within
    the format's bound (`FORMATS`: measured figure, bound, kernel), and the bound is below the
    quantization effect (so it can tell)."""
    _, measured, bound, kernel = FORMATS[name]
    r = served["results"][name]
    e = r.engine
    worst = _max_diff(r.nll, served["refs"][name])
    effect = _max_diff(r.nll, served["refs"]["base"])
    print(f"{name}: max |served - emulated| {worst:.3g}, quantization effect {effect:.3g}, {r.label}")
    quantized = e["linears"]
    assert len(quantized) == 4 * CONFIG["num_hidden_layers"]  # qkv, o, gate_up, down (lm_head is not)
    if e["device"] == "cpu":
        assert all(v["kernels"] == [kernel] for v in quantized.values()), quantized
    assert effect > bound, (
        f"the bound {bound} cannot tell this format from the unquantized model ({effect:.3g})"
    )
    assert worst < bound, (
        f"served and emulated (CPU int8 GEMM {INT8_GEMM}) part: {worst:.3g} >= {bound} "
        f"(measured {measured} on avx512_bf16+vnni)"
    )


# --------------------------------------------------------------------------- failures, classified
@pytest.mark.slow
def test_missing_weights_is_bad_export_and_writes_nothing(served, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(served["dirs"]["int8_dynamic"], broken)
    for f in broken.glob("*.safetensors"):
        f.unlink()
    out = tmp_path / "served.json"
    with pytest.raises(ServeError) as err:
        serve_engine.run_worker([ServeJob(broken, make_windows(_ids(), SEQ))], out)
    assert err.value.kind == "bad_export" and err.value.model_dir == str(broken.resolve())
    assert "Cannot find any model weights" in str(err.value) and "\n" not in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken"]  # no output, no temp file


@pytest.mark.slow
def test_fp8_per_tensor_dynamic_is_refused_by_the_cpu_build(served, tmp_path):
    """The project's ``fp8_dynamic`` export (per-tensor weights, dynamic per-tensor input): vllm-cpu
    0.32 requantizes fused shards to their max scale with ``static_scaled_fp8_quant``, an op its
    CPU build registers without an implementation: no kernel here."""
    if served["results"]["base"].engine["device"] != "cpu":
        pytest.skip("vLLM on CUDA has the op; this checks the CPU build's refusal")
    d = _export(preset("fp8_dynamic"), tmp_path / "fp8_dynamic")
    with pytest.raises(ServeError) as err:
        serve_perplexity(d, make_windows(_ids(), SEQ)[:2])
    assert err.value.kind == "no_kernel" and "static_scaled_fp8_quant" in err.value.detail


@pytest.mark.slow
def test_timeout_kills_the_worker(served):
    t0 = time.perf_counter()
    with pytest.raises(ServeError) as err:
        serve_perplexity(served["dirs"]["base"], make_windows(_ids(), SEQ)[:2], timeout_s=2)
    assert err.value.kind == "timeout" and time.perf_counter() - t0 < 30


def test_an_environment_without_vllm_is_no_env(tmp_path):
    """A python that runs but has no vLLM (a bare venv): the worker's import fails -> ``no_env``."""
    import subprocess

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    with pytest.raises(ServeError) as err:
        (tmp_path / "config.json").write_text("{}")
        serve_perplexity(tmp_path, [[1, 2, 3]], python=tmp_path / "venv/bin/python")
    assert err.value.kind == "no_env" and "No module named 'vllm'" in err.value.detail


def test_a_missing_serving_python_is_no_env(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ServeError) as err:
        serve_perplexity(tmp_path, [[1, 2, 3]], python=tmp_path / "nonexistent/python")
    assert err.value.kind == "no_env" and "install.sh" in str(err.value)
    monkeypatch.setenv(serve_env.ENV_VAR, str(tmp_path / "nope"))
    with pytest.raises(ServeError, match=r"^no_env: .*QATLIB_SERVE_PYTHON"):
        serve_python()


def test_a_folder_without_config_is_bad_export_before_any_engine(tmp_path):
    with pytest.raises(ServeError) as err:
        serve_perplexity(tmp_path / "nothing", [[1, 2, 3]], python="/nonexistent")
    assert err.value.kind == "bad_export"


def _log(error: str, model: str = "/m") -> str:
    return (
        f"noise\nqatlib-serve-worker: serving {model}\nTraceback ...\nqatlib-serve-worker: error: {error}\n"
    )


@pytest.mark.parametrize(
    "error, kind",
    [
        (
            "RuntimeError: _C::static_scaled_fp8_quant() expected at most 0 argument(s) but received 4",
            "no_kernel",
        ),
        ("AttributeError: '_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16'", "no_kernel"),
        ("ValueError: Failed to find a kernel that can implement the WNA16 linear layer.", "no_kernel"),
        ("RuntimeError: operator torchvision::nms does not exist", "no_env"),
        ("ModuleNotFoundError: No module named 'vllm'", "no_env"),
        ("MemoryError: MemoryError", "oom"),
        ("RuntimeError: [enforce fail] out of memory", "oom"),
        ("RuntimeError: Cannot find any model weights with `/m`", "bad_export"),
        ("ValueError: No compressed-tensors compatible scheme was found for layer_name='x'", "unsupported"),
        ("NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX.", "unsupported"),
        ("RuntimeError: Engine core initialization failed.", "engine_died"),
    ],
)
def test_classify_the_engines_own_messages(error, kind):
    assert classify(_log(error), 1) == (kind, error, "/m")


def test_classify_signals():
    assert classify("qatlib-serve-worker: serving /m\nloading", -9)[:1] == ("oom",)
    k, detail, model = classify("qatlib-serve-worker: serving /m\nterminate called", -6)
    assert (k, model) == ("engine_died", "/m") and "signal 6" in detail and "terminate called" in detail


def test_worker_imports_only_stdlib_torch_and_vllm():
    """The worker runs in the serving environment, which has no qatlib deps: stdlib, torch, vllm only."""
    src = Path(serve_engine.WORKER).read_text()
    roots = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "no relative imports in the worker"
            roots.add(node.module.split(".")[0])
    assert roots - set(sys.stdlib_module_names) <= {"torch", "vllm"}
    assert f'MARK = "{serve_engine.MARK}"' in src


def test_serve_job_spec(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    spec = ServeJob(tmp_path, torch.arange(6).view(2, 3)).spec()
    assert spec["windows"] == [[0, 1, 2], [3, 4, 5]] and spec["dtype"] == "float32"
    json.dumps(spec)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        ServeJob(tmp_path, [[1]]).spec()
