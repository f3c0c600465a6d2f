"""The memory plan describes every model family (`qatlib.plan.families`): for each family a tiny
config with odd widths is built by transformers' own config class, and the plan's counts are held
to the model transformers builds from it on the meta device (an independent reference): every
parameter, and the quantized linears' weights (nn.Linear modules, the head and routers left out,
plus the fused expert tensors). The table's keys and defaults are held to the config classes. A
family the table does not know, or a key it cannot find, is a warning naming the term and the
key, and the plan still runs."""

from __future__ import annotations

import json

import pytest

from qatlib import plan as qp
from qatlib.plan.families import FAMILIES, GENERIC, keys
from qatlib.plan.shape import ModelShape

# odd widths: hidden 20, 4 heads of 6 (q 24 != hidden), 2 kv heads, dense I 36, expert I 14,
# 5 experts top-2, vocab 97, 4 layers
BASE = dict(
    vocab_size=97,
    hidden_size=20,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=6,
    intermediate_size=36,
    tie_word_embeddings=False,
)
MOE = dict(moe_intermediate_size=14, num_experts_per_tok=2)
MLA = dict(q_lora_rank=10, kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5)
LINEAR = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=6,
    linear_value_head_dim=5,
    linear_conv_kernel_dim=3,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
)
TINY = {
    "llama": {**BASE, "attention_bias": True, "mlp_bias": True},
    "qwen3": {**BASE, "tie_word_embeddings": True},
    "gemma3_text": {**BASE, "layer_types": ["sliding_attention", "full_attention"] * 2},
    "phi3": {**{k: v for k, v in BASE.items() if k != "head_dim"}, "hidden_size": 24, "pad_token_id": 0},
    "qwen2_moe": {
        **BASE,
        **MOE,
        "num_experts": 5,
        "shared_expert_intermediate_size": 18,
        "mlp_only_layers": [1],
    },
    "qwen3_moe": {**BASE, **MOE, "num_experts": 5, "decoder_sparse_step": 2, "mlp_only_layers": [3]},
    "deepseek_v3": {
        **BASE,
        **MLA,
        **MOE,
        "n_routed_experts": 5,
        "n_shared_experts": 2,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "attention_bias": True,
    },
    "glm4_moe": {
        **BASE,
        **MOE,
        "n_routed_experts": 5,
        "n_shared_experts": 1,
        "first_k_dense_replace": 2,
        "n_group": 1,
        "topk_group": 1,
        "use_qk_norm": True,
        "attention_bias": True,
    },
    "qwen3_next": {
        **BASE,
        **MOE,
        **LINEAR,
        "num_experts": 5,
        "shared_expert_intermediate_size": 18,
        "mlp_only_layers": [3],
    },
    "qwen3_5_moe_text": {**BASE, **MOE, **LINEAR, "num_experts": 5, "shared_expert_intermediate_size": 18},
    "glm_moe_dsa": {
        **BASE,
        **MLA,
        **MOE,
        "n_routed_experts": 5,
        "n_shared_experts": 1,
        "mlp_layer_types": ["dense", "sparse", "dense", "sparse"],
        "index_head_dim": 8,
        "index_n_heads": 2,
        "index_topk": 4,
        "n_group": 1,
        "topk_group": 1,
    },
    "mixtral": {**BASE, "num_local_experts": 5, "num_experts_per_tok": 2},
    "minimax_m2": {**BASE, "num_local_experts": 5, "num_experts_per_tok": 2},
    "olmoe": {**BASE, "num_experts": 5, "num_experts_per_tok": 2},
    "hunyuan_v1_moe": {**BASE, "num_experts": 5, "moe_topk": [2, 3, 2, 2]},
    "gpt_oss": {**BASE, "num_local_experts": 5, "num_experts_per_tok": 2},
}


def _config(model_type: str):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **TINY[model_type])


def _meta_model(model_type: str):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(_config(model_type))


def _quantized(model, experts: int, hidden: int) -> tuple[int, int]:
    """What qatlib quantizes, counted by module type on the model: every nn.Linear but the head
    and the routers (a Linear hidden -> experts), plus the fused expert tensors (3-D parameters),
    as (weights, linears); a fused experts module becomes gate, up and down linears per expert
    (`qatlib.surgery.moe`'s linearisation)."""
    from torch import nn

    head = model.get_output_embeddings()
    weights = linears = 0
    for m in model.modules():
        router = (m.out_features, m.in_features) == (experts, hidden) if isinstance(m, nn.Linear) else False
        if isinstance(m, nn.Linear) and m is not head and not router:
            weights, linears = weights + m.weight.numel(), linears + 1
    fused = [p for p in model.parameters() if p.dim() == 3 and p.shape[0] == experts]
    return weights + sum(p.numel() for p in fused), linears + len(fused) // 2 * 3 * experts


def test_every_family_of_transformers_is_in_the_table_and_has_a_tiny_config():
    assert set(TINY) == set(FAMILIES)


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_plan_counts_every_parameter_of_each_family(model_type):
    cfg = _config(model_type).to_dict()  # the keys the config class writes
    shape = ModelShape.from_config(json.loads(json.dumps(cfg)))
    model = _meta_model(model_type)
    assert shape.model_type == model_type
    assert shape.total_params == sum(p.numel() for p in model.parameters())
    linears = sum(len(shape.layer_linears(moe, lin)) for lin, moe in shape.layer_kinds())
    assert (shape.quantized_params, linears) == _quantized(model, shape.experts, shape.hidden)
    # hunyuan's per-layer top-k: the largest, and the plan says so
    if model_type == "hunyuan_v1_moe":
        assert shape.top_k == 3 and any(
            "moe_topk/num_experts_per_tok differs per layer" in t for t in shape.not_computed
        )
    else:
        assert shape.not_computed == ()
    stages = qp.plan(shape, qp.PlanInputs(), qp.Run())
    assert [s.not_computed for s in stages] == [list(shape.not_computed)] * 4


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_plan_reads_the_aliases_a_config_json_may_be_written_with(model_type):
    """A config.json written with the attribute_map's alias (the hub's Qwen3-MoE says num_experts,
    transformers 5 writes num_local_experts) gives the same shape."""
    from transformers import AutoConfig

    cfg = _config(model_type).to_dict()
    amap = type(AutoConfig.for_model(model_type)).attribute_map
    aliased = {next((a for a, k2 in amap.items() if k2 == k), k): v for k, v in cfg.items()}
    assert ModelShape.from_config(aliased) == ModelShape.from_config(cfg)


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_table_keys_and_defaults_are_the_config_classes(model_type):
    """Each key the table names is one the class writes, its others the class's attribute_map
    aliases of it; each default equals the class's (a config.json may leave the key out)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    written, amap = config.to_dict(), type(config).attribute_map
    entry = FAMILIES[model_type]
    for term in ("experts", "top_k", "expert_width", "attn_bias", "shared", "qk_norm_flag", "mlp_bias"):
        value = entry.get(term)
        if term in ("attn_bias", "shared") and value:
            value = value[0] if term == "attn_bias" else value[1]
        names = keys(value)
        if names:
            assert names[0] in written, (term, names[0])
            assert all(amap.get(alias) == names[0] for alias in names[1:]), (term, names)
    groups = {"mla": "mla" in str(entry.get("attention")), "indexer": entry.get("attention") == "mla_dsa"}
    groups["linear"] = bool(entry.get("linear_attention"))
    for group in (g for g, used in groups.items() if used):
        assert all(k in written for k in keys(GENERIC[group])), group
    for key, default in (entry.get("defaults") or {}).items():
        if key == "full_attention_interval":  # a constructor argument only: the layer_types it makes
            made = AutoConfig.for_model(model_type, num_hidden_layers=8).layer_types
            assert made == [
                "full_attention" if (i + 1) % default == 0 else "linear_attention" for i in range(8)
            ]
        else:
            assert getattr(config, key) == default, key


@pytest.mark.parametrize(
    "model_type", ["deepseek_v3", "qwen3_next", "gemma3_text", "gpt_oss", "qwen3", "minimax_m2"]
)
def test_defaults_apply_where_config_json_leaves_a_key_out(model_type):
    """Keys left out of config.json take the class's default, as transformers builds the model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    drop = {
        "first_k_dense_replace",
        "q_lora_rank",
        "layer_types",
        "head_dim",
        "tie_word_embeddings",
        "attention_bias",
    }
    kw = {k: v for k, v in TINY[model_type].items() if k not in drop}
    cfg = {"model_type": model_type, **kw}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw))
    assert ModelShape.from_config(cfg).total_params == sum(p.numel() for p in model.parameters())


def test_unknown_family_warns_names_the_term_and_still_plans(capsys, tmp_path):
    cfg = {**BASE, "model_type": "brand_new_moe", "num_local_experts": 5}  # no width, no top-k
    shape = ModelShape.from_config(cfg)
    said = "\n".join(shape.not_computed)
    assert "brand_new_moe" in said and "qatlib/plan/families.py" in said
    assert (
        "expert width" in said
        and "moe_intermediate_size" in said
        and "intermediate_size (36) assumed" in said
    )
    assert "top_k" in said and "num_experts_per_tok/moe_topk" in said
    assert shape.top_k == shape.experts == 5  # every expert per token: an upper bound
    # the llama-like layer it assumes, by hand: attention q 24x20 + k, v 12x20 + o 20x24; 5 experts
    # of the dense width 36 (gate, up 36x20, down 20x36), the 5 x 20 router, 2 norms of 20
    layer = (480 + 240 + 240 + 480) + 5 * 3 * 36 * 20 + 5 * 20 + 2 * 20
    assert shape.total_params == 2 * 97 * 20 + 20 + 4 * layer
    # no width at all: the experts count zero, and the plan says so
    bare = ModelShape.from_config({k: v for k, v in cfg.items() if k != "intermediate_size"})
    assert bare.moe_intermediate == 0 and any(
        t == "expert width (one expert's MLP width): config.json has no integer moe_intermediate_size"
        for t in bare.not_computed
    )
    stages = qp.plan(shape, qp.PlanInputs(), qp.Run())
    assert all(s.not_computed == list(shape.not_computed) for s in stages)
    assert all(s.to_dict()["not_computed"] == list(shape.not_computed) for s in stages)
    # the CLI: warns, names the term in the table and the JSON, and exits 0 (it fits)
    from qatlib.plan.__main__ import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    exp = str(qp.REPO / "config/experiments/qwen3-30b.yaml")
    assert main([exp, "--gpus", "8", "--model-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "warning: memory plan: not computed: expert width" in out
    assert main([exp, "--gpus", "8", "--model-config", str(path), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    said = list(ModelShape.from_config(cfg, str(path)).not_computed)  # names the file
    assert got["model"]["not_computed"] == said and str(path) in said[1]
    assert any("expert width" in w for w in got["warnings"])
    assert all(s["not_computed"] == said for s in got["stages"])


def test_a_known_family_missing_a_key_warns_instead_of_refusing():
    cfg = {**_config("olmoe").to_dict()}
    del cfg["num_experts_per_tok"]  # OlmoeConfig writes it; a hand-written config.json may not
    shape = ModelShape.from_config(cfg)
    assert shape.top_k == 5 and shape.not_computed == (
        "top_k (experts per token; every expert is assumed): config.json has no integer "
        "num_experts_per_tok/moe_topk",
    )


def test_run_warnings_say_what_is_not_computed_and_never_raise(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mystery", "hidden_size": 8}))
    got = qp.run_warnings({}, None, str(tmp_path), 2)
    assert len(got) == 1 and "not computed: the whole model" in got[0] and "vocab_size" in got[0]
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "model_type": "mystery"}))
    got = qp.run_warnings({}, None, str(tmp_path), 2)
    assert got == [
        f"memory plan: not computed: {t}"
        for t in ModelShape.from_config({**BASE, "model_type": "mystery"}).not_computed
    ]
    assert "mystery" in got[0]


def test_multimodal_config_plans_its_text_config_and_says_what_it_left_out():
    text = _config("qwen3_5_moe_text").to_dict()
    shape = ModelShape.from_config({"model_type": "qwen3_5_moe", "text_config": text, "vision_config": {}})
    assert shape.total_params == ModelShape.from_config(text).total_params
    assert shape.not_computed == (
        "model_type 'qwen3_5_moe' outside text_config (e.g. a vision tower): not counted",
    )
