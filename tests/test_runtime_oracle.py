"""vLLM's own code as the oracle of the deployment emulator (qatlib.runtime.check / oracle).

Each oracle path builds a tiny qatlib export, emulates it (qatlib.runtime.emulate, target vLLM) and
loads it in vLLM 0.33.0 itself on CPU: ``ModelConfig`` of the export folder, the model class,
``DefaultModelLoader.load_model`` (``load_weights`` of the checkpoint, ``process_weights_after_loading``
of every quantization method). Where the GPU path needs a compiled op, the nearest pure-torch function
below it runs instead (`qatlib.runtime.oracle.SUBSTITUTIONS`): ``ops.scaled_fp8_quant`` ->
``QuantFP8.forward_native`` (fp8 requantization of fused shards, W4A8 scale conversion); Marlin's WNA16
repack -> the scheme's batch-invariant dequantization; the NVFP4 FP4 GEMM -> vLLM's emulation kernel
(``dequantize_to_dtype`` / ``ref_nvfp4_quant``); the CUTLASS W4A8 layout reorders -> identity.

Bounds: every tensor bit-exact (``torch.equal``) except the NVFP4 effective weights, rtol 2**-22: vLLM
scales each E4M3 group scale by the inverted global scale before multiplying the code (two fp32
roundings), the emulator multiplies code x group scale (exact) and applies 1 / global scale once.

The vLLM tests skip (like ``pytest.importorskip``) where vLLM is not installed (``pip install --no-deps -r
requirements/runtime-oracle.txt``, as install.sh does); the facts / docs tests always run.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import tiny_qwen3_config, tiny_qwen3_moe_config
from transformers import AutoModelForCausalLM

from qatlib.export import export
from qatlib.ptq import calibrate
from qatlib.quant import Granularity, QuantLinear, QuantSpec, preset
from qatlib.runtime import check as C
from qatlib.runtime import facts as FT
from qatlib.runtime import oracle  # sets VLLM_TARGET_DEVICE=cpu before vLLM is imported
from qatlib.runtime.facts import Layout, Transform
from qatlib.runtime.fusion import GroupKind, fused_groups

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
BY_NAME = {p.name: p for p in C.PATHS}
DOCS = Path(__file__).resolve().parents[1] / "docs" / "runtime-oracle.md"

# what each path must check (fact keys with at least one comparison)
MUST_CHECK = {
    "fp8_static_dense": ("vllm:WEIGHT_SCALE_MAX", "vllm:INPUT_SCALE_MAX", "vllm:KV_SCALES"),
    "fp8_dynamic_dense": ("vllm:WEIGHT_SCALE_MAX", "vllm:DYNAMIC_PER_TOKEN"),
    "fp8_static_moe": ("vllm:WEIGHT_SCALE_MAX", "vllm:EXPERT_INPUT_SCALE_MAX"),
    "fp8_static_moe_w13_apart": ("vllm:EXPERT_W13_INPUT_SCALES_EQUAL",),
    "int8_static_dense": ("vllm:INPUT_SCALE_LAST",),
    "wna16_int4_group": ("vllm:SCALE_MODEL_DTYPE",),
    "wna16_int4_asym": ("vllm:SCALE_MODEL_DTYPE",),
    "nvfp4_dense": ("vllm:FP4_GLOBAL_SCALE_MAX",),
    "nvfp4_moe": ("vllm:EXPERT_W13_GLOBAL_SCALE", "vllm:FP4_GLOBAL_SCALE_MAX"),
    "w4a8_fp8_dense": ("vllm:W4A8_FP8_GROUP_SCALES",),
    "refuses_fp8_static_channel_moe": ("vllm:REFUSES_FP8_STATIC_CHANNEL_MOE",),
    "refuses_int8_static_moe": ("vllm:REFUSES_INT8_STATIC_MOE",),
    "refuses_w4a8_static": ("vllm:REFUSES_W4A8_STATIC",),
    "fp8_native_dense": ("vllm:WEIGHT_SCALE_MAX_FP8_FORMAT", "vllm:INPUT_SCALE_MAX_FP8_FORMAT"),
    "fp8_native_moe": ("vllm:WEIGHT_SCALE_MAX_FP8_FORMAT", "vllm:EXPERT_INPUT_SCALE_MAX_FP8_FORMAT"),
    "fp8_native_dynamic_moe": ("vllm:WEIGHT_SCALE_MAX_FP8_FORMAT",),
    "refuses_fp8_native_fp32": ("vllm:FP8_NATIVE_DTYPES",),
}


# --------------------------------------------------------------------------- the exports
def _edit(scheme, edit: str):
    """``scheme`` changed into a layout no preset has (`OraclePath.edit`)."""
    if edit == "asym":
        return scheme.replace(weight=scheme.weight.replace(symmetric=False))
    if edit == "weight_channel":
        return scheme.replace(weight=scheme.weight.replace(granularity=Granularity.CHANNEL))
    if edit == "native":  # the fp8 format (quant_method: fp8, upstream's save_name: fp8)
        return scheme.replace(checkpoint_format="fp8")
    if edit == "int8_static":
        return scheme.replace(
            weight=QuantSpec("int8", Granularity.CHANNEL), input=QuantSpec("int8", Granularity.TENSOR)
        )
    assert not edit, edit
    return scheme


def _spread_scales(model, *, expert_gate_up: bool = False) -> None:
    """Move the static input scales (and NVFP4 input global scales) of fused shards and experts
    apart, as QAT does: member i of q/k/v or gate/up times (1 + i/4), expert e's times (1 + e/8).
    The calibrated ones are equal (one input), so vLLM's max over them would change nothing. An
    expert's gate and up stay equal (vLLM refuses them apart, `facts.EXPERT_W13_INPUT_SCALES`)
    unless ``expert_gate_up``."""
    mods = dict(model.named_modules())
    factor: dict[str, float] = {}
    for g in fused_groups(model):
        if g.kind in (GroupKind.QKV, GroupKind.GATE_UP):
            expert = g.parent.rpartition(".experts.")[2]
            for i, name in enumerate(g.members):
                step = 0.0 if expert.isdigit() and not expert_gate_up else i / 4
                factor[name] = (1.0 + int(expert) / 8 if expert.isdigit() else 1.0) * (1.0 + step)
        elif g.kind is GroupKind.EXPERTS_W2:
            for e, name in enumerate(g.members):
                factor[name] = 1.0 + e / 8
    with torch.no_grad():
        for name, f in factor.items():
            q = mods[name].input_quantizer if isinstance(mods[name], QuantLinear) else None
            for p in () if q is None else (None if q.spec.dynamic else q.scale, q.global_scale):
                if p is not None and p.numel() == 1:
                    p.mul_(f)


def build_export(path: C.OraclePath, out_dir: Path) -> Path:
    """The tiny export of oracle path ``path`` in ``out_dir`` (seeded: the same tensors every run)."""
    scheme = _edit(preset(path.preset), path.edit)
    if path.group_size is not None:
        scheme = scheme.replace(weight=scheme.weight.replace(group_size=path.group_size))
    config = (tiny_qwen3_moe_config if path.moe else tiny_qwen3_config)(**dict(path.sizes))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=path.dtype).eval()
    if path.wide_groups:
        group = scheme.weight.group_size
        with torch.no_grad():
            for name, m in model.named_modules():
                if isinstance(m, torch.nn.Linear) and ".layers." in name and m.in_features > group:
                    m.weight[:, :group] *= 1e-4
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 512, (2, 24), generator=g) for _ in range(2)]
    report = calibrate(model, scheme, batches, kv=path.kv)
    _spread_scales(model, expert_gate_up=path.refused == "vllm:EXPERT_W13_INPUT_SCALES_EQUAL")
    fmt = "real_and_kvcache" if report.scheme.k is not None else "real"
    export(model, report.scheme, out_dir, fmt, overwrite=True, w4a8_activation=path.w4a8_activation)
    return out_dir


# --------------------------------------------------------------------------- without vLLM
def test_docs_page_is_generated_from_the_facts():
    """docs/runtime-oracle.md is `check.docs_page()` (regenerate: python -m qatlib.runtime.check --docs)."""
    assert DOCS.read_text() == C.docs_page()


def test_every_fact_names_its_check_or_why_not():
    paths = set(C.PATH_NAMES)
    keys = [k for k, _ in FT.all_facts()]
    assert len(keys) == len(set(keys))
    for key, fact in FT.all_facts():
        assert fact.checked_by, key
        if fact.read_only:
            assert fact.checked_by.startswith("read only: ") and len(fact.checked_by) > 20, key
        else:  # names the vLLM function and the oracle path that runs it
            named = fact.checked_by.rpartition("oracle ")[2]
            assert "oracle " in fact.checked_by and any(p in named for p in paths), key
    assert set(MUST_CHECK) == paths and set(BREAKS) == paths


def test_cli_help_and_missing_vllm(monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        C.main(["--help"])
    assert (
        e.value.code == 0 and "example: python -m qatlib.runtime.check --exports" in capsys.readouterr().out
    )
    monkeypatch.setattr(oracle, "vllm_version", lambda: None)
    said = []
    assert C.main([], say=said.append) == 2
    assert said == [
        "vllm is not installed: pip install --no-deps -r requirements/runtime-oracle.txt (see its header)"
    ]
    monkeypatch.setattr(oracle, "vllm_version", lambda: "0.33.0")
    monkeypatch.delenv(C.EXPORTS_ENV, raising=False)
    said.clear()
    assert C.main([], say=said.append) == 2 and said[0].startswith("no exports: QATLIB_ORACLE_EXPORTS=DIR")


# --------------------------------------------------------------------------- against vLLM
@pytest.fixture(scope="module")
def vllm():
    """Skips without vLLM; imported only inside `oracle.vllm_loaded`, which restores the process
    state vLLM changes (environment, multiprocessing start method) for the tests after these."""
    if oracle.vllm_version() is None:
        pytest.skip("vllm is not installed (pip install --no-deps -r requirements/runtime-oracle.txt)")
    return oracle.vllm_version()


@pytest.fixture(scope="module")
def exports(vllm, tmp_path_factory):
    """Every oracle export, in ``$QATLIB_ORACLE_EXPORTS`` when set (kept for ``python -m
    qatlib.runtime.check --exports``), else a temporary folder."""
    keep = os.environ.get(C.EXPORTS_ENV)
    root = Path(keep) if keep else tmp_path_factory.mktemp("oracle")
    return {p.name: build_export(p, root / p.name) for p in C.PATHS}


@pytest.fixture(scope="module")
def results(exports):
    return {
        name: C.compare_export(name, d, BY_NAME[name].refused, BY_NAME[name].vllm_says)
        for name, d in exports.items()
    }


@pytest.mark.parametrize("path", C.PATH_NAMES)
def test_emulator_agrees_with_vllm(results, path):
    """Every tensor of the path agrees (bit-exact or the NVFP4 bound) and the path checks its facts."""
    cmps = results[path]
    bad = [f"{c.what}: max |diff| {c.max_abs:.3g} ({c.bound})" for c in cmps if not c.ok]
    assert not bad, "\n".join(bad)
    checked = {c.fact for c in cmps}
    assert set(MUST_CHECK[path]) <= checked, (path, checked)


def test_every_checked_fact_is_compared(results):
    statuses = C.fact_statuses([c for cmps in results.values() for c in cmps])
    assert not [s.key for s in statuses if s.status in ("not run", "NO LONGER HOLDS")]
    assert {s.key for s in statuses if s.status == "OK"} == {k for k, f in FT.all_facts() if not f.read_only}


def test_the_exports_exercise_the_merges(exports):
    """The oracle's exports have fused shards / experts whose scales differ, so a dropped merge shows."""
    from safetensors.torch import load_file

    t = load_file(exports["fp8_static_dense"] / "model.safetensors")
    attn = "model.layers.0.self_attn"
    for kind in ("input_scale", "weight_scale"):
        assert len({t[f"{attn}.{p}_proj.{kind}"].item() for p in "qkv"}) == 3, kind
    t = load_file(exports["fp8_static_moe"] / "model.safetensors")
    moe = "model.layers.0.mlp.experts"
    assert len({t[f"{moe}.{e}.gate_proj.input_scale"].item() for e in range(4)}) == 4
    assert all(
        torch.equal(t[f"{moe}.{e}.gate_proj.input_scale"], t[f"{moe}.{e}.up_proj.input_scale"])
        for e in range(4)
    )
    t = load_file(exports["nvfp4_moe"] / "model.safetensors")
    assert any(
        not torch.equal(
            t[f"{moe}.{e}.gate_proj.weight_global_scale"], t[f"{moe}.{e}.up_proj.weight_global_scale"]
        )
        for e in range(4)
    )


def _drop(monkeypatch, transform: Transform) -> None:
    """A deliberately wrong reading: vLLM no longer applies ``transform`` (facts._TRANSFORMS)."""
    rows = [r for r in FT._TRANSFORMS if not (r[0] == "vllm" and r[1] is transform)]
    monkeypatch.setattr(FT, "_TRANSFORMS", rows)


def _experts_take_the_max(monkeypatch):
    """A deliberately wrong reading: an expert's w1 / w3 NVFP4 global scale -> their max, not w1's."""
    from qatlib.runtime import emulate_fp4 as E4

    real = E4.collapse_global_scales
    monkeypatch.setattr(
        E4, "collapse_global_scales", lambda stored, groups, experts: real(stored, groups, set())
    )


def _forget(monkeypatch, layout, moe):
    """A deliberately wrong reading: vLLM loads what it refuses."""
    monkeypatch.delitem(FT._REFUSALS, ("vllm", layout, moe))


# one wrong fact per path, and the comparison it must break
BREAKS = {
    "fp8_static_dense": (lambda m: _drop(m, Transform.INPUT_SCALE_MAX), "input scale"),
    "fp8_dynamic_dense": (lambda m: _drop(m, Transform.DYNAMIC_PER_TOKEN), "input quant-dequant"),
    "fp8_static_moe": (lambda m: _drop(m, Transform.EXPERT_INPUT_SCALE_MAX), "input scale"),
    "fp8_static_moe_w13_apart": (lambda m: m.setattr(FT, "EXPERT_W13_INPUT_TOLERANCE", 1.0), "refusal"),
    "int8_static_dense": (lambda m: _drop(m, Transform.INPUT_SCALE_LAST), "input scale"),
    "wna16_int4_group": (lambda m: _drop(m, Transform.SCALE_MODEL_DTYPE), "effective weight"),
    "wna16_int4_asym": (lambda m: _drop(m, Transform.SCALE_MODEL_DTYPE), "effective weight"),
    "nvfp4_dense": (lambda m: _drop(m, Transform.FP4_GLOBAL_SCALE_MAX), "effective weight"),
    "nvfp4_moe": (_experts_take_the_max, "effective weight"),
    "w4a8_fp8_dense": (lambda m: _drop(m, Transform.W4A8_FP8_GROUP_SCALES), "effective weight"),
    "refuses_fp8_static_channel_moe": (lambda m: _forget(m, Layout.FP8_STATIC_CHANNEL, True), "refusal"),
    "refuses_int8_static_moe": (lambda m: _forget(m, Layout.INT8_STATIC, True), "refusal"),
    "refuses_w4a8_static": (lambda m: _forget(m, Layout.W4A8_STATIC, None), "refusal"),
    "fp8_native_dense": (lambda m: _drop(m, Transform.INPUT_SCALE_MAX), "input scale"),
    "fp8_native_moe": (lambda m: _drop(m, Transform.EXPERT_INPUT_SCALE_MAX), "input scale"),
    "fp8_native_dynamic_moe": (lambda m: _drop(m, Transform.WEIGHT_SCALE_MAX), "effective weight"),
    "refuses_fp8_native_fp32": (lambda m: m.setattr(FT, "NATIVE_FP8_DTYPES", {}), "refusal"),
}


@pytest.mark.parametrize("path", sorted(BREAKS))
def test_a_wrong_fact_fails_the_oracle(monkeypatch, exports, path):
    """The oracle has teeth: with one fact of the path made wrong, its comparisons fail."""
    make_wrong, what = BREAKS[path]
    make_wrong(monkeypatch)
    cmps = C.compare_export(path, exports[path], BY_NAME[path].refused, BY_NAME[path].vllm_says)
    bad = [c for c in cmps if not c.ok]
    assert bad and any(what in c.what for c in bad), [c.what for c in cmps][:5]


def test_cli_runs_one_path(exports):
    said = []
    root = exports["fp8_static_dense"].parent
    assert C.main(["--exports", str(root), "--path", "fp8_static_dense"], say=said.append) == 0
    assert "fp8_static_dense: 48 of 48 tensors agree (W8A8-FP8 static + fp8 KV cache)" in said
    assert any(line.startswith("vllm:INPUT_SCALE_MAX") and "OK" in line for line in said)
    assert said[-1] == "every checked fact holds"
