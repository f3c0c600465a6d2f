"""Every model family users bring (`benchmarks.families.FAMILIES`: one tiny random model per
transformers model_type, sharded by ``save_pretrained``) through the project's own stage scripts:
scripts/ptq.py fp8_static -> scripts/export.py -> reload with transformers + compressed-tensors ->
vLLM 0.33's own load (`qatlib.runtime.load`) -> the memory plan.

References are independent of the code under test: each fp8 weight against the base checkpoint's
tensor divided by the exported scale and cast by torch; the quantized set against the base
checkpoint's keys; vLLM's fused modules against its own ``packed_modules_mapping``; the reload
against the base model's logits. The 2-rank ZeRO-3 QAT runs for the families whose expert layout
or key conversion differs (`QAT_CI`); ``python -m benchmarks.families`` runs it for all of them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import multirank_device

from benchmarks import families as F

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    """Scratch folder, calibration text and tokenizer shared by the module's families."""
    work = tmp_path_factory.mktemp("families")
    (work / "train.txt").write_text("\n\n".join(F._texts(40)))
    return work, F.tokenizer(work / "tokenizer")


@pytest.fixture(scope="module")
def results(suite):
    """model_type -> its `FamilyResult` (PTQ-model export), run once per family on first use."""
    cache: dict[str, F.FamilyResult] = {}

    def get(model_type: str) -> F.FamilyResult:
        if model_type not in cache:
            work, tok = suite
            n = torch.get_num_threads()
            torch.set_num_threads(1)  # a shared 2-core machine (conftest.single_thread)
            try:
                cache[model_type] = F.run_family(model_type, work, tok, qat=False)
            finally:
                torch.set_num_threads(n)
        return cache[model_type]

    return get


def _assert_exported(r: F.FamilyResult) -> None:
    assert r.error is None, r.error
    assert r.stage_reached == "reload"
    e = r.export
    # every linear / expert weight quantized (under its checkpoint key), or named in the ignore
    # list / export record (routers, shared-expert gates, indexer wk / weights_proj: vLLM keeps them)
    assert e["exceptions_unnamed"] == [], e["exceptions_unnamed"][:6]
    named = e["exceptions_named"]
    assert e["fraction_quantized"] >= 0.99 or named, e["fraction_quantized"]
    # every fp8 weight is the base weight quantized with the exported scale, bit for bit
    assert e["codes_inexact"] == [] and e["codes_exact"] == e["weights"]["quantized"] > 0
    assert e["untied_fused"] == []  # each group vLLM fuses carries one trained scale
    assert not e["head_quantized"]  # the experiment ignores lm_head
    rl = r.reload
    if r.model_type in F.RELOAD_LIMITS:  # said in the export record, and only the fused experts
        record = (Path(r.folder) / "export" / "qatlib_export.json").read_text()
        assert F.RELOAD_LIMITS[r.model_type] in record
        assert rl["missing_keys"] and all(".mlp.experts." in k for k in rl["missing_keys"]), rl
    else:
        assert rl["finite"] and "missing_keys" not in rl, rl
        assert rl["logits_sqnr_db"] > 10.0, rl  # fp8 error only (a wrong tensor is ~0 dB)
    assert r.plan["rc"] in (0, 3) and r.plan.get("stages"), r.plan  # the plan describes the model


@pytest.mark.parametrize("model_type", list(F.FAMILIES))
def test_family_ptq_export_reload(results, model_type):
    """PTQ fp8_static -> export -> transformers reload of each family: >= 99% of its linear and
    expert weights in fp8, each exception named, fp8 codes exact, fused groups tied, plan runs."""
    _assert_exported(results(model_type))


def test_vllm_loads_every_family_it_implements(results):
    """vLLM 0.33's own load (``DefaultModelLoader.load_model``) of every family's export; the
    layers it keeps unquantized are the embeddings, the head and the ones the export's ignore list
    names (routers, shared-expert gates): nothing vLLM reads as quantized was left out, nothing it
    builds unquantized was quantized; and every module vLLM fuses (its ``packed_modules_mapping``)
    is a group qatlib ties (`qatlib.runtime.fusion.PACKED`). A family vLLM cannot load on a CPU
    (`ORACLE_CPU_LIMITS`) must fail with exactly that reason."""
    pytest.importorskip("vllm")
    from qatlib.runtime.fusion import PACKED
    from qatlib.runtime.load import vllm_module_names

    runs = {t: results(t) for t in F.FAMILIES}
    done = {t: r for t, r in runs.items() if r.stage_reached == "reload"}
    exports = {t: Path(r.folder) / "export" for t, r in done.items()}
    loads = F.oracle_loads(list(exports.values()))
    packed = {tuple(m) for m in PACKED.values()}
    bad = {}
    for t, d in exports.items():
        o = loads[str(d)]
        if t in F.ORACLE_CPU_LIMITS:
            assert not o["loaded"] and F.ORACLE_CPU_LIMITS[t] in o["error"], (t, o.get("error"))
            continue
        if not o.get("loaded"):
            bad[t] = o.get("error")
            continue
        # vLLM's unquantized layers: the ignore list's, or no linear in the checkpoint (embeddings,
        # the linear-attention conv1d vLLM runs as a linear)
        # every fp8 weight vLLM reads is the export's code x scale (a skipped key would differ)
        # (a family exported in another scheme, `SCHEMES`, is read back by its own test:
        # tests/test_gpt_oss.py compares every expert tensor vLLM holds with qatlib's codes)
        assert o["weights"]["differ"] == [] and (o["weights"]["equal"] > 0 or t in F.SCHEMES), (
            t,
            o["weights"],
        )
        allowed = set(runs[t].export["ignore"]) | F.not_linear_modules(t)
        allowed = vllm_module_names(o["architecture"], allowed)  # as vLLM names its modules
        kept = set(o["unquantized"])
        assert kept <= allowed, (t, kept - allowed)
        for fused, members in o["packed_modules_mapping"].items():
            if len(members) > 1:
                assert tuple(members) in packed, (t, fused, members)
    assert bad == {}, bad


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("model_type", F.QAT_CI)
def test_family_zero3_qat(suite, model_type):
    """PTQ -> scripts/qat.py on 2 gloo ranks under ZeRO-3 (as the workflow runs it) -> export ->
    reload, for the families whose expert layout or checkpoint keys differ from Qwen3-MoE's. QAT
    trains scales only: the exported fp8 weights are still the base weights' codes, exactly."""
    if multirank_device() != "cpu":
        pytest.skip("the family suite's QAT runs on CPU ranks (GPU: benchmarks.gpu_check)")
    work, tok = suite
    (work / "qat").mkdir(exist_ok=True)
    (work / "qat" / "train.txt").write_text((work / "train.txt").read_text())
    r = F.run_family(model_type, work / "qat", tok, qat=True)
    assert r.stage_reached == "reload", r.error
    _assert_exported(r)


def test_the_families_page_is_made_from_the_json(tmp_path):
    """docs/reference/families.md's table (`qatlib.site.families`) says what families.json says,
    row by row: a failed family with its stage and error, an unnamed kept weight in bold."""
    import json

    from qatlib.site.families import BENCH, render

    doc = {"command": "python -m benchmarks.families", "transformers": "5.24.0", "vllm": "0.33.0",
           "scheme": "fp8_static", "qat": "2-rank ZeRO-3 (gloo), 2 steps", "families": [
               {"model_type": "llama", "architecture": "LlamaForCausalLM", "stage_reached": "oracle",
                "export": {"fraction_quantized": 1.0, "exceptions_named": [], "exceptions_unnamed": [],
                           "codes_exact": 14, "codes_inexact": []}, "oracle": {"loaded": True},
                "plan": {"rc": 0, "warnings": []}, "error": None},
               {"model_type": "mixtral", "architecture": "MixtralForCausalLM", "stage_reached": "ptq",
                "export": {}, "oracle": {}, "plan": {"rc": 1, "error": "x\nconfig.json: bad"},
                "error": "export: RuntimeError: missing keys\nmore"},
               {"model_type": "olmoe", "architecture": "OlmoeForCausalLM", "stage_reached": "reload",
                "export": {"fraction_quantized": 0.5, "exceptions_named": ["model.layers.0.mlp.gate.weight"],
                           "exceptions_unnamed": ["a.b.weight"], "codes_exact": 3, "codes_inexact": ["c"]},
                "oracle": {"loaded": False, "error": "ValueError: no module"}, "plan": {"rc": 0}},
           ]}  # fmt: skip
    (tmp_path / BENCH).parent.mkdir(parents=True)
    (tmp_path / BENCH).write_text(json.dumps(doc))
    rows = [ln for ln in render(tmp_path).splitlines() if ln.startswith("| `")]
    assert rows == [
        "| `llama` | LlamaForCausalLM | oracle | 100.0% | none | 14 exact | loads | runs |  |",
        "| `mixtral` | MixtralForCausalLM | ptq | - | none | - | - | refused: config.json: bad | "
        "export: RuntimeError: missing keys |",
        "| `olmoe` | OlmoeForCausalLM | reload | 50.0% | 1 named (gate); **1 unnamed** | 3 exact, **1 not** | "
        "refused: ValueError: no module | runs |  |",
    ]
    assert "1 of 3 families reach vLLM's load" in render(tmp_path)
