"""SmoothQuant (`qatlib.quant.smoothing`, upstream's ``quant_helpers: [smooth]``): the factors
against the formula's limits computed by hand, the unquantized function kept exactly (dense and MoE,
the router included), and the PTQ stage that saves the smoothed weights every later stage loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import build_model, local_texts, stage_script, tiny_llama_config, tiny_qwen3_moe_config

from qatlib.quant.smoothing import input_absmax, smooth, smooth_groups, smooth_model

REPO = Path(__file__).resolve().parents[1]
EXPS = REPO / "config/experiments"


def _model(kind: str):
    """A tiny model whose norms are not all ones (as after pretraining) and whose normed inputs
    have outlier channels (one channel of the embeddings scaled up)."""
    from qatlib.surgery.moe import linearize_moe_experts

    m = build_model(tiny_llama_config() if kind == "dense" else tiny_qwen3_moe_config())
    if kind == "moe":
        linearize_moe_experts(m)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("layernorm.weight"):
                p.copy_(1 + 0.5 * torch.rand(p.shape, generator=g))
        m.get_input_embeddings().weight[:, 3] *= 20
    return m.eval()


def _ids(n: int = 3, t: int = 12) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, 256, (1, t), generator=g) for _ in range(n)]


def _logits(m, batches) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([m(b).logits for b in batches])


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_smoothing_keeps_the_unquantized_function(kind):
    """Every group's norm is divided and every reader's columns multiplied by the same factors:
    the logits are the original ones to fp32 rounding, while the weights did change. On the MoE the
    router reads the normed input too: leaving it out changes which experts are picked."""
    m = _model(kind)
    batches = _ids()
    ref = _logits(m, batches)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    groups = smooth_groups(m)
    assert len(groups) == 2 * 2  # two blocks, two norms each
    if kind == "moe":  # the MLP's readers: each expert's gate / up and the router, no down_proj
        names = [n for n, _ in groups[1].linears]
        assert names[-1] == "model.layers.0.mlp.gate" and len(names) == 2 * 4 + 1
        assert not any(n.endswith("down_proj") for n in names)
    assert smooth_model(m, batches, 0.5) == 4
    moved = [n for n, p in m.named_parameters() if not torch.equal(p, before[n])]
    assert any("layernorm" in n for n in moved) and any("q_proj" in n for n in moved)
    torch.testing.assert_close(_logits(m, batches), ref, rtol=1e-4, atol=1e-5)


def test_leaving_out_the_router_is_caught():
    """The exactness above is not vacuous: a group that misses one reader (the MoE router) changes
    the logits far beyond rounding."""
    from qatlib.quant.smoothing import SmoothGroup

    m = _model("moe")
    batches = _ids()
    ref = _logits(m, batches)
    groups = [
        SmoothGroup(g.name, g.norm, tuple((n, lin) for n, lin in g.linears if not n.endswith("mlp.gate")))
        for g in smooth_groups(m)
    ]
    smooth(groups, input_absmax(groups, batches, lambda b: m(b)), 0.5)
    assert (_logits(m, batches) - ref).abs().max() > 1e-3


def test_the_factors_at_the_formula_limits():
    """``s_j = max|X_j|^alpha / max|W_j|^(1-alpha)``: at alpha = 1 every channel of every norm's
    output peaks at exactly 1 afterwards (re-measured by a forward pass); at alpha = 0 every column
    of each group's readers peaks at 1 (the max over the readers); at alpha = 0.5 one group's
    factors equal sqrt(max|X| / max|W|) computed here from a forward pass and the weights."""
    batches = _ids()
    m = _model("dense")
    groups = smooth_groups(m)
    smooth(groups, input_absmax(groups, batches, lambda b: m(b)), 1.0)
    after = input_absmax(groups, batches, lambda b: m(b))
    for g in groups:
        torch.testing.assert_close(after[g.name], torch.ones_like(after[g.name]), rtol=1e-5, atol=0)

    m = _model("dense")
    groups = smooth_groups(m)
    smooth(groups, input_absmax(groups, batches, lambda b: m(b)), 0.0)
    for g in groups:
        col_max = torch.stack([lin.weight.abs().amax(0) for _, lin in g.linears]).amax(0)
        torch.testing.assert_close(col_max, torch.ones_like(col_max), rtol=1e-5, atol=0)

    m = _model("dense")
    attn = m.model.layers[1].self_attn
    norm = m.model.layers[1].input_layernorm
    with torch.no_grad():
        hidden = [m(b, output_hidden_states=True).hidden_states[1] for b in batches]  # block 1's input
        x_max = torch.stack([norm(h).abs().reshape(-1, h.shape[-1]).amax(0) for h in hidden]).amax(0)
    w_max = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).abs().amax(0)
    expected = (x_max / w_max).sqrt()
    w0 = norm.weight.detach().clone()
    groups = smooth_groups(m)
    smooth(groups, input_absmax(groups, batches, lambda b: m(b)), 0.5)
    torch.testing.assert_close(w0 / norm.weight.detach(), expected, rtol=1e-5, atol=0)


def test_a_block_of_another_shape_is_refused_by_name():
    m = _model("dense")
    del m.model.layers[1].post_attention_layernorm
    with pytest.raises(ValueError, match=r"model\.layers\.1 \(LlamaDecoderLayer\) is not a pre-norm block"):
        smooth_groups(m)
    with pytest.raises(ValueError, match="smooth_alpha must be in"):
        smooth_model(_model("dense"), _ids(), 1.5)
    # a norm computing x * (1 + weight) (Gemma's) cannot take the factors in its weight
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    g = Gemma3ForCausalLM(Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16))  # fmt: skip
    with pytest.raises(
        ValueError, match=r"model\.layers\.0\.input_layernorm \(Gemma3RMSNorm\) does not scale"
    ):
        smooth_groups(g)
    # transformers' fused experts read the normed input through a 3-D tensor: refused, not skipped
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj .*fused experts"):
        smooth_groups(build_model(tiny_qwen3_moe_config()))


# ----------------------------------------------------------------------------- the PTQ stage
@pytest.fixture(scope="module")
def ptq_script():
    return stage_script("ptq")


def test_the_ptq_stage_saves_the_smoothed_model_later_stages_load(
    ptq_script, tmp_path, tiny_tokenizer, single_thread
):
    """scripts/ptq.py with ``quant_helpers: [smooth]`` (the workflow's PTQ rule): not streamed (the
    plan says why), the smoothed weights saved beside the scales, and the prepared model of every
    later stage (`qatlib.models.load_prepared`) holds them: its norms are the base's divided by the
    factors, and with its quantizers off it computes the base model's logits."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from qatlib import plan as qp
    from qatlib.config import load_config
    from qatlib.models import load_prepared
    from qatlib.quant import quantization_disabled

    base = tmp_path / "base"
    m = build_model(tiny_qwen3_moe_config())
    with torch.no_grad():
        m.get_input_embeddings().weight[:, 3] *= 20
    m.save_pretrained(base)
    tiny_tokenizer.save_pretrained(base)
    (tmp_path / "train.txt").write_text("\n\n".join(local_texts(20)))
    sets = ["compression.quantization.quant_helpers=[smooth]", "compression.quantization.smooth_alpha=0.5",
            f"dataset.data_path={tmp_path / 'train.txt'}", "dataset.num_samples=3",
            "dataset.max_seq_length=32", f"model.model_path={base}"]  # fmt: skip
    exp = EXPS / "tiny-qwen3-moe.yaml"
    cfg = load_config(exp, sets)
    assert cfg.smooth_alpha == 0.5
    assert "smooth" in qp.model.not_streamed(cfg.raw, "ptq_calibrate")
    argv = ["-c", str(exp), "--no-progress", *(f"--set={s}" for s in sets)]
    argv += ["--save-path", str(tmp_path / "ptq"), "--timing", str(tmp_path / "t.json")]
    assert ptq_script.main(argv) == 0
    rec = json.loads((tmp_path / "t.json").read_text())
    assert rec["streamed"] is False and rec["smoothed"] == 4
    meta = json.loads((tmp_path / "ptq/quant_scheme.json").read_text())
    assert meta["weights"] and meta["calibration"]["smooth_alpha"] == 0.5
    saved, original = load_file(tmp_path / "ptq/model.safetensors"), load_file(base / "model.safetensors")
    norms = [k for k in original if k.endswith("input_layernorm.weight")]
    assert len(norms) == 2 and all(not torch.equal(saved[k], original[k]) for k in norms)

    model, report = load_prepared(cfg, base, scales=tmp_path / "ptq", complete=True)
    assert report["misses"] == 0
    for k in norms:
        assert torch.equal(model.get_parameter(k), saved[k]), k
    ids = torch.tensor(tiny_tokenizer("\n\n".join(local_texts(3)))["input_ids"][:48])[None]
    reference = AutoModelForCausalLM.from_pretrained(base).eval()
    with torch.no_grad(), quantization_disabled(model):
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)
