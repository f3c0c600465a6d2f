"""Fused experts of every layout transformers 5.24 ships (`qatlib.surgery.moe`): each experts class
decorated with ``use_experts_implementation`` is built tiny from its own config, run on random
tokens and routing, linearised, and run again; then prepared, and every expert weight must sit in a
`QuantLinear`. Layouts that cannot be reproduced are refused by name before anything is replaced.

Reference: the family's own fused forward (eager). Not bit-exact: the fused module computes
``gate_up`` in one [2I, H] GEMM (plus a separate bias add for GPT-OSS), the linearised expert two
[I, H] GEMMs with the bias fused in ``addmm``; fp32 accumulation order differs, so the bound is fp32
rounding of the output's magnitude: 8 fp32 ulps of the largest output (measured: at most 3.8e-6 on
outputs of magnitude ~37, about one ulp).
"""

from __future__ import annotations

import importlib
import inspect
import os
import re

import pytest
import torch
import transformers
from torch import nn

from qatlib.quant import QuantLinear, prepare, preset
from qatlib.surgery.moe import ExpertMLP, LinearizedMoeExperts, experts_layout, linearize_moe_experts

_MODELS = os.path.join(os.path.dirname(transformers.__file__), "models")
# ernie4_5_vl_moe: its config's moe_intermediate_size is a per-modality list, which the tiny sizes
# below cannot set; its experts class has ernie4_5_moe's (tested) layout.
_NOT_BUILT = {"ernie4_5_vl_moe"}
# layouts qatlib refuses, and the words its error names them with
REFUSED = {"nemotron_h": "no gate projection", "muse_spark": "post-expert norm"}


def _experts_classes() -> list[tuple[str, str]]:
    out = []
    for fam in sorted(os.listdir(_MODELS)):
        path = os.path.join(_MODELS, fam, f"modeling_{fam}.py")
        if fam in _NOT_BUILT or not os.path.exists(path):
            continue
        with open(path) as f:
            out += [
                (fam, c) for c in re.findall(r"@use_experts_implementation[^\n]*\nclass (\w+)\(", f.read())
            ]
    return out


FAMILIES = _experts_classes()
FP32_ROUNDING = 8 * torch.finfo(torch.float32).eps
SMALL = dict(
    hidden_size=24,
    hidden_dim=24,
    intermediate_size=20,
    moe_intermediate_size=20,
    expert_intermediate_size=20,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    moe_num_experts=4,
    num_experts_per_tok=2,
)


def build_experts(fam: str, cls_name: str) -> nn.Module:
    """The family's experts module from the first of its configs that builds at the tiny sizes."""
    mod = importlib.import_module(f"transformers.models.{fam}.modeling_{fam}")
    cfgmod = importlib.import_module(f"transformers.models.{fam}.configuration_{fam}")
    errors = []
    for name, c in inspect.getmembers(cfgmod, inspect.isclass):
        if not name.endswith("Config") or c.__module__ != cfgmod.__name__:
            continue
        try:
            cfg = c()
            cfg = cfg.get_text_config()
            for k, v in SMALL.items():
                if hasattr(cfg, k):
                    setattr(cfg, k, v)
            torch.manual_seed(0)
            m = getattr(mod, cls_name)(cfg)
        except Exception as e:  # noqa: BLE001 - try the next config class of the family
            errors.append(f"{name}: {e}")
            continue
        assert sum(p.numel() for p in m.parameters()) < 2e6, f"{fam}: tiny sizes not applied"
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(p.numel()))
        return m
    raise AssertionError(f"{fam}.{cls_name} builds from none of its configs: {errors}")


def _inputs(n_exp: int, n_tok: int = 16, hidden: int = 24):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n_tok, hidden, generator=g)
    idx = torch.stack([torch.randperm(n_exp, generator=g)[:2] for _ in range(n_tok)])
    return x, idx, torch.rand(n_tok, 2, generator=g)


def test_every_experts_class_is_found():
    """The families the issue names are among the ones tested here."""
    fams = {f for f, _ in FAMILIES}
    named = {"gpt_oss", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "glm4_moe", "qwen3_next"}
    named |= {"qwen3_5_moe", "olmoe", "hunyuan_v1_moe", "minimax_m2", "glm_moe_dsa"}
    assert named <= fams and len(FAMILIES) >= 60


@pytest.mark.parametrize("fam,cls_name", FAMILIES, ids=[f"{f}-{c}" for f, c in FAMILIES])
def test_linearised_experts_equal_fused_and_are_quantized(fam, cls_name):
    fused = build_experts(fam, cls_name)
    layout = experts_layout(fused)
    assert layout is not None
    holder = nn.Sequential(fused)
    if fam in REFUSED:
        with pytest.raises(NotImplementedError, match=rf"0 \({cls_name}\).*{REFUSED[fam]}"):
            linearize_moe_experts(holder)
        assert holder[0] is fused  # nothing replaced
        return
    x, idx, w = _inputs(layout.num_experts, hidden=layout.hidden)
    with torch.no_grad():
        ref = fused(x, idx, w)
        assert linearize_moe_experts(holder) == 1
        out = holder[0](x, idx, w)
    assert isinstance(holder[0], LinearizedMoeExperts) and len(holder[0]) == layout.num_experts
    torch.testing.assert_close(out, ref, rtol=0, atol=FP32_ROUNDING * float(ref.abs().max()))
    prepare(holder, preset("fp8_dynamic"))
    lin = [m for ex in holder[0] for m in (ex.gate_proj, ex.up_proj, ex.down_proj)]
    assert len(lin) == 3 * layout.num_experts and all(type(m) is QuantLinear for m in lin)
    assert not [n for n, p in holder.named_parameters() if p.dim() >= 3]


def test_gpt_oss_expert_weights_are_the_deinterleaved_transposed_slices():
    """GPT-OSS stores [E, H, 2I] with gate / up columns alternating, and biases: expert e's
    gate_proj is gate_up_proj[e][:, ::2].T with bias gate_up_proj_bias[e][::2] (the module's own
    ``_apply_gate`` reads gate_up[..., ::2] as the gate), down_proj is down_proj[e].T."""
    fused = build_experts("gpt_oss", "GptOssExperts")
    gu, gub = fused.gate_up_proj.detach().clone(), fused.gate_up_proj_bias.detach().clone()
    dn, dnb = fused.down_proj.detach().clone(), fused.down_proj_bias.detach().clone()
    holder = nn.Sequential(fused)
    linearize_moe_experts(holder)
    for e, ex in enumerate(holder[0]):
        assert isinstance(ex, ExpertMLP)
        assert torch.equal(ex.gate_proj.weight, gu[e][:, 0::2].T) and torch.equal(
            ex.gate_proj.bias, gub[e][0::2]
        )
        assert torch.equal(ex.up_proj.weight, gu[e][:, 1::2].T) and torch.equal(ex.up_proj.bias, gub[e][1::2])
        assert torch.equal(ex.down_proj.weight, dn[e].T) and torch.equal(ex.down_proj.bias, dnb[e])


def _tiny_gpt_oss():
    from transformers import AutoModelForCausalLM, GptOssConfig

    cfg = GptOssConfig(
        vocab_size=128,
        hidden_size=48,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".experts." in n or ".router." in n:
                p.normal_(0, 0.5)
    return model


def test_gpt_oss_model_linearised_equals_fused_and_every_expert_is_quantized():
    model = _tiny_gpt_oss()
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
        assert linearize_moe_experts(model) == 2
        out = model(ids).logits
    torch.testing.assert_close(out, ref, rtol=0, atol=FP32_ROUNDING * float(ref.abs().max()))
    prepare(model, preset("fp8_dynamic"))
    experts = [n for n, m in model.named_modules() if type(m) is QuantLinear and ".experts." in n]
    assert len(experts) == 2 * 4 * 3
    assert not [n for n, p in model.named_parameters() if p.dim() >= 3]
