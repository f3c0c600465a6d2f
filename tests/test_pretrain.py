"""Tiny base-model pre-training: config, expert implementation, schedule, a smoke run."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import intra_op_threads, local_texts

from qatlib.offline import base_model as pt

TINY = dict(
    vocab_size=384,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    intermediate_size=64,
    max_position_embeddings=128,
)


pytestmark = pytest.mark.usefixtures("single_thread")


def test_default_model_size_and_grouped_mm():
    m = pt.build_model()
    assert m.config.model_type == "qwen3_moe"
    assert m.config._experts_implementation == "grouped_mm"
    n = pt.count_params(m)["total"]
    assert 2.5e6 < n < 3.1e6
    dense = pt.build_model({"arch": "qwen3", **TINY})
    assert dense.config.model_type == "qwen3"
    with pytest.raises(ValueError):
        pt.model_config({"arch": "llama"})


def test_tokenizer_training_is_deterministic():
    from qatlib.offline.tokenizer import train_tokenizer

    texts = local_texts(120)
    a = train_tokenizer(texts, vocab_size=400)
    b = train_tokenizer(texts, vocab_size=400)
    assert a.get_vocab() == b.get_vocab()
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()


def test_lr_schedule():
    cfg = pt.TrainConfig(token_budget=100 * 8 * 256, lr=1e-3, warmup_fraction=0.1, min_lr_ratio=0.1)
    assert cfg.steps == 100
    lrs = [pt.lr_at(s, cfg.steps, cfg) for s in range(cfg.steps)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[-1] == pytest.approx(1e-4, rel=0.05)
    with pytest.raises(ValueError):
        pt.TrainConfig.from_dict({"bogus": 1})


def test_moe_training_gives_the_same_weights_twice_on_two_threads():
    """A Qwen3-MoE at SmolLM2's width with top-7 of 8 experts, on 2 threads: without
    `deterministic_training`, ``grouped_mm``'s gather backward summed duplicate token indices in a
    run-dependent order (three passes, three gradients). Two trainings must end bit-equal."""
    spec = dict(
        hidden_size=576,
        num_hidden_layers=1,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=7,
        moe_intermediate_size=192,
        vocab_size=512,
    )
    ids = torch.randint(0, 512, (8 * 256,), generator=torch.Generator().manual_seed(0))
    cfg = pt.TrainConfig(token_budget=2 * 4 * 256, batch_size=4, warmup_fraction=0.0)
    runs = []
    with intra_op_threads(2):  # the workflow's threads: the parallel kernel needs more than one
        for _ in range(2):
            net = pt.build_model(spec, seed=0)
            pt.train_model(net, ids, cfg, progress=False)
            runs.append(net.state_dict())
    assert not torch.are_deterministic_algorithms_enabled()  # restored after training
    assert not torch.equal(
        runs[0]["model.layers.0.mlp.gate.weight"],
        pt.build_model(spec).state_dict()["model.layers.0.mlp.gate.weight"],
    )
    for k in runs[0]:
        assert torch.equal(runs[0][k], runs[1][k]), k


def test_pretrain_smoke_lowers_loss_and_saves(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = local_texts(200)
    cut = len(texts) * 4 // 5
    (corpus / "train.txt").write_text("\n\n".join(texts[:cut]))
    (corpus / "test.txt").write_text("\n\n".join(texts[cut:]))
    out = tmp_path / "model"
    train = dict(token_budget=60 * 4 * 64, seq_len=64, batch_size=4, lr=5e-3, eval_windows=4, log_every=5)
    stats = pt.pretrain(corpus, out, model=TINY, train=train, progress=False)
    assert stats["steps"] == 60 and stats["tokens"] == 60 * 4 * 64
    assert stats["experts_implementation"] == "grouped_mm"
    first = stats["history"][0]["loss"]
    assert stats["final_loss_mean_last_logs"] < first - 1.0
    assert stats["test"]["windows"] >= 1
    assert json.loads((out / "pretrain_stats.json").read_text())["steps"] == 60
    assert not list(tmp_path.glob(".model.tmp-*"))

    from qatlib.models import load_model, load_tokenizer

    m = load_model(out, torch_dtype="fp32")
    tok = load_tokenizer(out)
    assert len(tok) <= TINY["vocab_size"] and tok.eos_token == "<|im_end|>"
    ids = torch.tensor([tok("Return the value of the argument.")["input_ids"]])
    assert torch.isfinite(m(ids).logits).all()
