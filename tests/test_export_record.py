"""The export record's coverage (`qatlib.export.coverage`, ``qatlib_export.json``): per module type,
what was quantized and what was kept and why, against counts taken independently from the model's
modules; and the report's table of it (`qatlib.report.sections.export_section`)."""

from __future__ import annotations

import json
from collections import Counter

from conftest import build_model, tiny_qwen3_moe_config
from test_moe_layouts import _tiny_gpt_oss

from qatlib.export import export
from qatlib.export.coverage import (
    REASONS,
    VLLM_INTERLEAVED_EXPERTS,
    VLLM_PLAIN_BUT_QUANTIZED,
    export_coverage,
)
from qatlib.quant import QuantLinear, prepare, preset
from qatlib.report.sections import export_section


def _record(out):
    return {r["module_type"]: r for r in json.loads((out / "qatlib_export.json").read_text())["coverage"]}


def test_moe_export_record_counts_equal_the_models_modules(tmp_path):
    cfg = tiny_qwen3_moe_config()
    model = build_model(cfg)
    scheme = preset("fp8_dynamic")
    prepare(model, scheme, ignore=("lm_head", "model.layers.1.self_attn.o_proj"))
    out = export(model, scheme, tmp_path / "real", "real", ignore=("model.layers.1.self_attn.o_proj",))
    rec = _record(out)
    # independent count: every (parent class, attribute) holding a QuantLinear
    mods = dict(model.named_modules())
    want = Counter(
        f"{type(mods[n.rpartition('.')[0]]).__name__}.{n.rpartition('.')[2]}"
        for n, m in mods.items()
        if type(m) is QuantLinear
    )
    assert {k: r["quantized"] for k, r in rec.items() if r["quantized"]} == dict(want)
    layers, experts = cfg.num_hidden_layers, cfg.num_experts
    assert want["ExpertMLP.gate_proj"] == layers * experts and want["Qwen3MoeAttention.o_proj"] == layers - 1
    # kept: one embedding, one router per layer (a Qwen3MoeTopKRouter, not a linear), lm_head (prepare's default), the ignored o_proj
    assert rec["Embedding"]["kept"] == {REASONS["embedding"]: 1}
    assert rec["Qwen3MoeTopKRouter"]["kept"] == {REASONS["router"]: layers}
    assert rec["Qwen3MoeForCausalLM.lm_head"]["kept"] == {REASONS["plain"]: 1}
    assert rec["Qwen3MoeAttention.o_proj"]["kept"] == {REASONS["ignore"]: 1}
    total = sum(r["quantized"] + sum(r["kept"].values()) for r in rec.values())
    with_matrix = [n for n, m in mods.items() if any(p.dim() >= 2 for p in m.parameters(recurse=False))]
    assert total == len(with_matrix)  # every module holding a weight matrix counted once

    # the report shows the same numbers
    exp = tmp_path / "exp"
    (exp / "export").mkdir(parents=True)
    (exp / "export" / "qatlib_export.json").write_text((out / "qatlib_export.json").read_text())
    sec = export_section(exp)
    table = next(b for b in sec["blocks"] if b["kind"] == "table")
    rows = {(r[0], r[3]["v"]): r for r in table["rows"]}
    assert rows[("ExpertMLP.gate_proj", "")][1] == str(layers * experts)
    assert rows[("Qwen3MoeTopKRouter", REASONS["router"])][2] == str(layers)
    assert f"{sum(want.values())} module(s) quantized, {layers + 3} kept" in sec["blocks"][0]["text"]


def test_gpt_oss_record_keeps_router_and_names_vllm_expert_layout(tmp_path):
    model = _tiny_gpt_oss()
    scheme = preset("int8")  # what vLLM 0.33 loads for gpt_oss experts (qatlib.export.experts)
    prepare(model, scheme)
    out = export(model, scheme, tmp_path / "real", "real")
    rec = _record(out)
    assert rec["ExpertMLP.gate_proj"]["quantized"] == 2 * 4
    assert rec["ExpertMLP.gate_proj"]["notes"] == [VLLM_INTERLEAVED_EXPERTS]
    assert rec["GptOssTopKRouter"]["kept"] == {REASONS["router"]: 2}
    assert rec["GptOssAttention.q_proj"]["quantized"] == 2
    assert not any(p.dim() >= 3 for p in model.parameters())


def test_deepseek_v3_coverage_counts_shared_experts_and_keeps_the_bias_corrected_router():
    """DeepSeek-V3: a dense first layer, then routed experts + a shared expert, and a
    ``DeepseekV3TopkRouter`` (a weight [E, H] and an ``e_score_correction_bias``, not a linear)."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    cfg = DeepseekV3Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        max_position_embeddings=64,
    )
    model = AutoModelForCausalLM.from_config(cfg)
    prepare(model, preset("fp8_dynamic"))
    rec = {r["module_type"]: r for r in export_coverage(model)}
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
    assert rec["ExpertMLP.gate_proj"]["quantized"] == moe_layers * cfg.n_routed_experts
    # the dense layer's MLP and each MoE layer's shared expert are DeepseekV3MLPs
    assert rec["DeepseekV3MLP.down_proj"]["quantized"] == cfg.first_k_dense_replace + moe_layers
    assert rec["DeepseekV3TopkRouter"]["kept"] == {REASONS["router"]: moe_layers}
    assert sum(1 for n, _ in model.named_buffers() if n.endswith("e_score_correction_bias")) == moe_layers


def test_shared_expert_gate_is_kept_as_vllm_builds_it():
    """Qwen2-MoE's one-output ``shared_expert_gate`` is a plain linear in vLLM
    (`qatlib.quant.linear.kept_plain`): kept, with that reason; the shared expert itself is quantized.
    A model whose gate was quantized anyway gets the row's note."""
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    cfg = Qwen2MoeConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    model = AutoModelForCausalLM.from_config(cfg)
    prepare(model, preset("fp8_dynamic"))
    rec = {r["module_type"]: r for r in export_coverage(model)}
    assert rec["Qwen2MoeSparseMoeBlock.shared_expert_gate"]["kept"] == {REASONS["vllm_plain"]: 2}
    assert rec["Qwen2MoeMLP.gate_proj"]["quantized"] == 2 and "notes" not in rec["Qwen2MoeMLP.gate_proj"]
    block = model.model.layers[0].mlp
    block.shared_expert_gate = QuantLinear(block.shared_expert_gate, preset("fp8_dynamic"))
    rec = {r["module_type"]: r for r in export_coverage(model)}
    row = rec["Qwen2MoeSparseMoeBlock.shared_expert_gate"]
    assert row["quantized"] == 1 and row["kept"] == {REASONS["vllm_plain"]: 1}
    assert row["notes"] == [VLLM_PLAIN_BUT_QUANTIZED]


def test_fused_experts_left_in_place_are_recorded_as_a_refused_layout():
    """A fused experts module qatlib refuses (NemotronH: up_proj only, no gate) is never silently
    counted as quantized or skipped: its row names the refusal."""
    from test_moe_layouts import build_experts
    from torch import nn

    holder = nn.Sequential(build_experts("nemotron_h", "NemotronHExperts"))
    rec = {r["module_type"]: r for r in export_coverage(holder)}
    assert rec == {
        "NemotronHExperts": {
            "module_type": "NemotronHExperts",
            "quantized": 0,
            "kept": {f"{REASONS['refused']} (no gate projection (up_proj only))": 1},
        }
    }
