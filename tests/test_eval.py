"""Perplexity windows / arithmetic and the lm-eval glue on a local multiple-choice task."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import local_texts

from qatlib.eval.perplexity import make_windows, perplexity, perplexity_of_ids, tokenize_text
from qatlib.offline.mc_task import build_local_mc_task, make_mc_items

pytestmark = pytest.mark.usefixtures("single_thread")


def test_windows_counted_right():
    ids = torch.arange(100)
    w = make_windows(ids, 32)
    assert w.shape == (3, 32)
    assert torch.equal(w[1], torch.arange(32, 64))
    # limit: spread over the whole text (windows 0 and 1 of 3 -> 0 and 3 // 2 = 1; 2 of 4 -> 0, 2)
    assert torch.equal(make_windows(ids, 32, limit=2), torch.stack([torch.arange(32), torch.arange(32, 64)]))
    assert torch.equal(make_windows(ids, 25, limit=2), torch.stack([torch.arange(25), torch.arange(50, 75)]))
    assert torch.equal(make_windows(ids, 32, limit=7), w)  # limit above the count: all windows
    assert make_windows(ids, 25).shape == (4, 25)
    with pytest.raises(ValueError):
        make_windows(torch.arange(10), 32)


def test_perplexity_matches_hand_computation(tiny_qwen3, tiny_tokenizer, tmp_path):
    text = "\n\n".join(local_texts(40))
    f = tmp_path / "t.txt"
    f.write_text(text)
    seq = 48
    out = perplexity(tiny_qwen3, tiny_tokenizer, f, seq_len=seq, batch_size=3, limit=5, progress=False)
    ids = torch.tensor(tiny_tokenizer(text, add_special_tokens=False)["input_ids"])
    assert out["windows"] == 5 and out["tokens"] == 5 * (seq - 1)
    nlls, top1 = [], []
    n_all = ids.numel() // seq
    assert n_all > 5  # so limit=5 picks spread windows, not the head
    with torch.no_grad():
        for k in (i * n_all // 5 for i in range(5)):
            w = ids[k * seq : (k + 1) * seq]
            logp = torch.log_softmax(tiny_qwen3(w[None]).logits[0].double(), -1)
            nlls.append(-logp[torch.arange(seq - 1), w[1:]])
            top1.append(sum(int(logp[i].argmax() == w[i + 1]) for i in range(seq - 1)) / (seq - 1))
    nll = torch.cat(nlls).mean().item()
    assert out["nll"] == pytest.approx(nll, rel=1e-5)
    assert out["ppl"] == pytest.approx(math.exp(nll), rel=1e-5)
    # next-token top-1 per window, its mean and the standard error over the 5 windows
    assert out["window_nll"] == pytest.approx([x.mean().item() for x in nlls], rel=1e-5)
    assert out["window_top1"] == pytest.approx(top1)
    assert out["top1"] == pytest.approx(sum(top1) / 5)
    m = sum(top1) / 5
    assert out["top1_stderr"] == pytest.approx(math.sqrt(sum((t - m) ** 2 for t in top1) / 4 / 5))
    full = perplexity_of_ids(tiny_qwen3, ids, seq_len=seq, progress=False)
    assert full["windows"] == ids.numel() // seq


def test_perplexity_of_prepared_model(tiny_qwen3_moe, tiny_tokenizer):
    from qatlib.quant import Granularity, QuantScheme, QuantSpec, prepare

    ids = tokenize_text(tiny_tokenizer, "\n\n".join(local_texts(20)))
    base = perplexity_of_ids(tiny_qwen3_moe, ids, seq_len=32, limit=4, progress=False)
    prepare(tiny_qwen3_moe, QuantScheme("w2", weight=QuantSpec("int2", Granularity.CHANNEL)))
    q = perplexity_of_ids(tiny_qwen3_moe, ids, seq_len=32, limit=4, progress=False)
    assert math.isfinite(q["ppl"]) and q["ppl"] != base["ppl"]


def test_mc_items_are_sound():
    text = "\n\n".join(local_texts(120))
    items = make_mc_items(text, n=40, context_words=20, continuation_words=6, seed=3)
    assert items == make_mc_items(text, n=40, context_words=20, continuation_words=6, seed=3)
    assert items != make_mc_items(text, n=40, context_words=20, continuation_words=6, seed=4)
    labels = [it["label"] for it in items]
    assert len(set(labels)) > 1  # the answer position is not constant
    flat = " ".join(text.split())
    for it in items:
        assert len(it["choices"]) == 4 and len(set(it["choices"])) == 4
        assert len(it["context"].split()) == 20
        assert f"{it['context']} {it['choices'][it['label']]}" in flat
    assert len({it["context"] for it in items}) == len(items)
    near = make_mc_items(text, n=20, context_words=20, continuation_words=6, seed=3, neighborhood=2)
    assert len(near) == 20 and all(len(set(it["choices"])) == 4 for it in near)


def test_local_mc_task_runs_through_lm_eval(tiny_qwen3, tiny_tokenizer, tmp_path):
    from qatlib.eval.harness import evaluate_tasks

    text = "\n\n".join(local_texts(120))
    info = build_local_mc_task(text, tmp_path / "tasks", n=12, seed=0, context_words=16, continuation_words=6)
    assert sum(info["label_counts"]) == 12 and max(info["label_counts"]) < 12
    data_file = json.loads(json.dumps(info))["data_file"]
    assert data_file.startswith("/")
    res = evaluate_tasks(
        tiny_qwen3,
        tiny_tokenizer,
        [info["task"]],
        include_path=info["include_path"],
        limit=8,
        batch_size=4,
        hf_home=tmp_path / "hf",
        output_path=tmp_path / "res.json",
    )
    r = res[info["task"]]
    assert 0.0 <= r["acc"] <= 1.0 and 0.0 <= r["acc_norm"] <= 1.0
    assert "acc_stderr" in r
    task_files = sorted(p.name for p in (tmp_path / "tasks").iterdir())
    assert task_files == [f"{info['task']}.jsonl", f"{info['task']}.yaml"]  # the cache went to hf_home
    assert any((tmp_path / "hf").rglob("*.arrow"))
    dumped = json.loads((tmp_path / "res.json").read_text())
    assert info["task"] in dumped["results"]


def test_flatten_results_keeps_scores_only():
    """lm-eval's per-task dict -> scores without the ``,none`` filter suffix; ``alias`` (text) and
    ``sample_len`` (bookkeeping) dropped; a non-default filter keeps its suffix."""
    from qatlib.eval.harness import flatten_results

    raw = {
        "piqa": {
            "alias": "piqa",
            "acc,none": 0.75,
            "acc_stderr,none": 0.01,
            "acc_norm,none": 0.5,
            "sample_len": 200,
            "exact_match,strict": 0.25,
        }
    }
    assert flatten_results(raw) == {
        "piqa": {"acc": 0.75, "acc_stderr": 0.01, "acc_norm": 0.5, "exact_match,strict": 0.25}
    }


def test_layerwise_perplexity_is_the_whole_model_perplexity(tiny_tokenizer, tmp_path):
    """Evaluated one decoder layer at a time (weights streamed from the checkpoint folder, static
    fp8 scales real), the perplexity is exactly the whole-model one."""
    from conftest import build_model, tiny_qwen3_moe_config

    from qatlib.checkpoint.keys import scale_state_dict
    from qatlib.models import load_model
    from qatlib.ptq import calibrate
    from qatlib.quant import prepare, preset
    from qatlib.zero3.onload import Onloader, load_skeleton, realize_quantizers

    base = tmp_path / "base"
    build_model(tiny_qwen3_moe_config(tie_word_embeddings=True)).save_pretrained(base)
    ids = tokenize_text(tiny_tokenizer, "\n\n".join(local_texts(20)))
    model = load_model(base)
    calibrate(model, preset("fp8_static"), [ids[:64].view(2, 32)])
    whole = perplexity_of_ids(model, ids, seq_len=32, batch_size=3, limit=7, progress=False)
    skel = prepare(load_skeleton(base), preset("fp8_static"))
    realize_quantizers(skel)
    ref = scale_state_dict(model)
    for name, p in skel.named_parameters():  # the calibrated scales, by their module names
        if "quantizer" in name:
            p.data.copy_(dict(model.named_parameters())[name].data)
    assert scale_state_dict(skel).keys() == ref.keys()
    loader = Onloader.from_checkpoint(skel, base)
    streamed = perplexity_of_ids(skel, ids, seq_len=32, batch_size=3, limit=7, progress=False, onload=loader)
    assert streamed["nll"] == whole["nll"] and streamed["tokens"] == whole["tokens"] == 7 * 31
    assert all(p.is_meta for n, p in skel.named_parameters() if "quantizer" not in n)
    # and on the unquantized model held in host memory
    plain = load_model(base)
    a = perplexity_of_ids(plain, ids, seq_len=32, limit=4, progress=False)
    b = perplexity_of_ids(plain, ids, seq_len=32, limit=4, progress=False, onload=Onloader.resident(plain))
    assert a["nll"] == b["nll"] and a["nll"] != whole["nll"]


@pytest.mark.parametrize("fmt", ["int4_g32", "w4a8"])
def test_weights_fake_quantized_once_give_the_same_logits(tiny_qwen3, fmt):
    """The ptq / qat evaluation fake-quantizes each weight once (`bake_weight_fake_quant`) instead
    of at every forward: the logits must be those of the prepared model, bit for bit."""
    from qatlib.eval.variants import bake_weight_fake_quant
    from qatlib.quant import (
        Granularity,
        QuantScheme,
        QuantSpec,
        prepare,
        quant_linears,
        quantization_disabled,
    )

    w = QuantSpec("int4", Granularity.GROUP, group_size=32)
    act = QuantSpec("fp8", Granularity.TENSOR, dynamic=True) if fmt == "w4a8" else None
    prepare(tiny_qwen3, QuantScheme(fmt, weight=w, input=act))
    tiny_qwen3.eval()
    ids = torch.randint(0, tiny_qwen3.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = tiny_qwen3(input_ids=ids).logits
        with quantization_disabled(tiny_qwen3):
            plain = tiny_qwen3(input_ids=ids).logits
        n = bake_weight_fake_quant(tiny_qwen3)
        out = tiny_qwen3(input_ids=ids).logits
    assert n == len(list(quant_linears(tiny_qwen3))) > 0
    assert not torch.equal(ref, plain)  # the scheme does change the logits
    assert torch.equal(out, ref)
    if fmt == "w4a8":  # the input quantizers stay on
        assert all(ql.input_quantizer.enabled for _, ql in quant_linears(tiny_qwen3))


def test_top1_counts_the_true_next_tokens():
    """A model that predicts the true next token exactly at positions ``t % 3 == 0`` of window
    ``k`` (and at every position of window 0): top-1 per window is known by hand."""

    class Oracle(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.p = torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids, use_cache=False):
            b, t = input_ids.shape
            logits = torch.zeros(b, t, 50)
            nxt = torch.roll(input_ids, -1, dims=1)
            for r in range(b):
                for i in range(t - 1):
                    right = input_ids[r, 0] == 0 or i % 3 == 0
                    logits[r, i, nxt[r, i] if right else (nxt[r, i] + 1) % 50] = 5.0
            return type("Out", (), {"logits": logits})()

    ids = torch.cat([torch.zeros(1, dtype=torch.long), torch.arange(1, 40) % 49 + 1])  # 40 tokens
    out = perplexity_of_ids(Oracle(), ids, seq_len=10, batch_size=3, progress=False)
    # window 0 starts with token 0: all 9 right; windows 1..3: positions 0, 3, 6 of 9 right
    assert out["window_top1"] == pytest.approx([1.0, 3 / 9, 3 / 9, 3 / 9])
    assert out["top1"] == pytest.approx((1 + 3 * 3 / 9) / 4)
    m = out["top1"]
    se = math.sqrt(((1 - m) ** 2 + 3 * (1 / 3 - m) ** 2) / 3 / 4)
    assert out["top1_stderr"] == pytest.approx(se)


@pytest.mark.parametrize("tied", [False, True])
def test_the_evaluations_reader_loads_what_from_pretrained_loads(tmp_path, tiny_tokenizer, tied):
    """On one device the bf16 / ptq / qat evaluation reads the checkpoint with qatlib's reader
    (`qatlib.zero3.onload.load_whole`: no file mapping counted in the evaluation's memory, #16) instead
    of ``from_pretrained``: the same model, every tensor bit for bit and every tie, the same
    logits; with a PTQ checkpoint's scales (static fp8 inputs), the same prepared model."""
    from pathlib import Path

    from conftest import build_model, tiny_qwen3_moe_config

    from qatlib.config import load_config
    from qatlib.eval.variants import load_variant
    from qatlib.models import load_model, load_prepared
    from qatlib.ptq import calibrate, save_ptq_checkpoint
    from qatlib.surgery.moe import linearize_moe_experts

    base = tmp_path / "base"
    build_model(tiny_qwen3_moe_config(tie_word_embeddings=tied)).save_pretrained(base)
    exp = Path(__file__).resolve().parents[1] / "config/experiments/tiny-qwen3-moe.yaml"
    sets = ["compression.quantization.name=fp8_static", "deploy.target=none", f"model.model_path={base}"]
    cfg = load_config(exp, sets)
    ids = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(1))

    def same(a, b):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys()
        for k in sa:
            assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
        assert not any(p.is_meta for p in b.parameters())
        emb, head = b.get_input_embeddings().weight, b.get_output_embeddings().weight
        assert (emb is head) == tied
        with torch.no_grad():
            torch.testing.assert_close(b(input_ids=ids).logits, a(input_ids=ids).logits, rtol=0, atol=0)

    ref = load_model(base)
    fused_logits = ref(input_ids=ids).logits.detach()
    assert linearize_moe_experts(ref) > 0  # the reader builds the experts as qatlib's linears
    got, rec = load_variant(cfg, "bf16", str(base), None)
    assert rec == {}
    same(ref, got)
    torch.testing.assert_close(got(input_ids=ids).logits, fused_logits, rtol=1e-5, atol=1e-5)

    calibrate(ref, cfg.quant_scheme(), [ids])
    save_ptq_checkpoint(ref, cfg.quant_scheme(), tmp_path / "ptq")
    whole = load_prepared(cfg, base, scales=tmp_path / "ptq", complete=True)[0]
    read = load_prepared(cfg, base, scales=tmp_path / "ptq", complete=True, read_onto="cpu")[0]
    same(whole, read)
    with pytest.raises(ValueError, match="read_onto"):
        load_prepared(cfg, base, scales=tmp_path / "ptq", read_onto="cpu", device_map="auto")


def test_split_tasks_tells_local_folders_from_hub_names(tmp_path):
    """``evaluation.tasks``: a folder holding ``<name>.yaml`` is a local task (its name + the folder
    to include), a name is an lm-eval task from the hub; a folder without its YAML is refused
    naming the folder (scripts/evaluate.py checks this before loading any model)."""
    from qatlib.eval.harness import split_tasks

    (tmp_path / "mc").mkdir()
    (tmp_path / "mc/mc.yaml").write_text("task: mc\n")
    assert split_tasks([str(tmp_path / "mc"), "piqa"]) == (["mc", "piqa"], [str(tmp_path / "mc")], ["piqa"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty has no empty.yaml"):
        split_tasks([str(tmp_path / "empty")])


def test_window_perplexity_is_the_token_weighted_mean_nll():
    """One definition for the in-process and the served column (`qatlib.scores.window_perplexity`):
    windows of 3 and 1 predicted tokens with NLL sums 6 and 2 -> 8 / 4 = 2 nats per token; with
    sums 6 and 4: 10 / 4 = 2.5, where the mean of the window means would say (2 + 4) / 2 = 3."""
    import math

    from qatlib.scores import window_perplexity

    assert window_perplexity([6.0, 2.0], [3, 1]) == (2.0, math.exp(2.0))
    nll, ppl = window_perplexity([6.0, 4.0], [3, 1])
    assert nll == 2.5 and ppl == math.exp(2.5)  # the mean of window means would be (2 + 4) / 2 = 3
