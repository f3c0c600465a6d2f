"""Every loss against a direct float64 reference on random logits with masked positions."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import compute_device

from benchmarks.memory import kd_memory_probe
from qatlib.losses import (
    IGNORE_INDEX,
    LOSS_TYPES,
    LossConfig,
    LossType,
    LossTypeError,
    parse_loss_type,
    qat_loss,
)

B, T, V = 3, 11, 37
pytestmark = pytest.mark.device_aware  # `_data` puts every tensor on `compute_device`


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(B, T, V, generator=g) * 2
    t = torch.randn(B, T, V, generator=g) * 2
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, :5] = IGNORE_INDEX  # a prompt
    labels[1, 7:] = IGNORE_INDEX  # padding
    labels[2, 3] = IGNORE_INDEX  # a hole
    dev = compute_device()  # drawn on the CPU, computed where the suite runs (a GPU if there is one)
    return s.to(dev), t.to(dev), labels.to(dev)


def _valid(s, t, labels):
    """Reference selection: shift like HF, keep label != -100, as float64 rows."""
    ss, tt, yy = s[:, :-1].double(), t[:, :-1].double(), labels[:, 1:]
    m = yy != IGNORE_INDEX
    return ss[m], tt[m], yy[m]


def _ref_kl(p_logits, q_logits):
    """KL(softmax(p) || softmax(q)) per row, written out."""
    p = torch.softmax(p_logits, -1)
    return (p * (torch.log(p) - torch.log_softmax(q_logits, -1))).sum(-1)


def reference(loss_type: str, s, t, labels, *, k=None, temp=1.0, alpha=0.5):
    S, Tt, y = _valid(s, t, labels)
    ce = -torch.log_softmax(S, -1).gather(-1, y[:, None]).squeeze(-1)
    fkl, bkl = _ref_kl(Tt, S), _ref_kl(S, Tt)
    if loss_type == "kl":
        kd = fkl
    elif loss_type == "rkl":
        kd = bkl
    elif loss_type == "mse":
        kd = ((S - Tt) ** 2).mean(-1)
    elif loss_type == "kd":
        kd = alpha * temp**2 * _ref_kl(Tt / temp, S / temp) + (1 - alpha) * ce
    elif loss_type == "cakld":
        conf = torch.softmax(Tt, -1).gather(-1, y[:, None]).squeeze(-1)
        kd = conf * bkl + (1 - conf) * fkl
    elif loss_type.startswith(("kl_top", "r_kl_top")):
        idx = Tt.topk(k, -1).indices
        ts, sk = Tt.gather(-1, idx), S.gather(-1, idx)
        # renormalised over the teacher's top-K set
        pt, ps = torch.softmax(ts, -1), torch.softmax(sk, -1)
        if loss_type.startswith("kl_top"):
            kd = (pt * (pt.log() - ps.log())).sum(-1)
        else:
            kd = (ps * (ps.log() - pt.log())).sum(-1)
    else:
        raise AssertionError(loss_type)
    return {"lm": ce.mean(), "kd": kd.mean(), "fkl": fkl.mean(), "bkl": bkl.mean(), "n": len(y)}


CASES = [
    ("kl", {}),
    ("rkl", {}),
    ("mse", {}),
    ("kd", {"kd_temperature": 2.0, "kd_alpha": 0.3}),
    ("cakld", {}),
    ("kl_top_5", {}),
    ("r_kl_top_5", {}),
    ("kl_top", {"loss_topk": 7}),
    ("r_kl_top", {"loss_topk": 7}),
]


@pytest.mark.parametrize("loss_type,kw", CASES)
@pytest.mark.parametrize("chunk_size", [4, 1024])
def test_kd_losses_match_reference(loss_type, kw, chunk_size):
    s, t, labels = _data()
    cfg = LossConfig(loss_type=loss_type, lm_loss_weight=0.7, kd_loss_weight=1.3, chunk_size=chunk_size, **kw)
    ref = reference(loss_type, s, t, labels, k=cfg.topk, temp=cfg.kd_temperature, alpha=cfg.kd_alpha)
    out = qat_loss(s.clone().requires_grad_(), labels, cfg, t)
    means = out.means()
    assert out.n_tokens == ref["n"]
    tol = dict(rel=1e-5, abs=1e-6)
    assert means["lm_loss"] == pytest.approx(ref["lm"].item(), **tol)
    assert means[f"kd/{loss_type}"] == pytest.approx(ref["kd"].item(), **tol)
    assert means["kd/forward_kl"] == pytest.approx(ref["fkl"].item(), **tol)
    assert means["kd/backward_kl"] == pytest.approx(ref["bkl"].item(), **tol)
    total = 0.7 * ref["lm"] + 1.3 * ref["kd"]
    assert means["total_loss"] == pytest.approx(total.item(), **tol)
    assert out.loss.item() == pytest.approx(total.item(), **tol)


@pytest.mark.parametrize("loss_type,kw", [("cakld", {}), ("kl_top_5", {}), ("kd", {"kd_temperature": 2.0})])
def test_chunked_gradients_equal_unchunked(loss_type, kw):
    s, t, labels = _data(1)
    cfg = LossConfig(loss_type=loss_type, kd_loss_weight=1.0, chunk_size=5, **kw)
    grads = []
    for chunked in (True, False):
        x = s.clone().requires_grad_()
        qat_loss(x, labels, cfg, t, chunked=chunked).loss.backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)
    # masked positions get no gradient; the last position never predicts anything
    _, _, y = labels, None, labels[:, 1:]
    masked = torch.zeros(B, T, dtype=torch.bool, device=labels.device)
    masked[:, :-1] = y == IGNORE_INDEX
    masked[:, -1] = True
    assert grads[0][masked].abs().max() == 0
    assert grads[0][~masked].abs().sum() > 0


def test_lm_loss_equals_hf_cross_entropy():
    s, _, labels = _data(2)
    out = qat_loss(s, labels, LossConfig())
    ref = torch.nn.functional.cross_entropy(
        s[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX
    )
    assert out.loss.item() == pytest.approx(ref.item(), rel=1e-6)
    assert set(out.sums) == {"lm_loss", "total_loss"}


def test_masked_logits_do_not_matter():
    s, t, labels = _data(3)
    cfg = LossConfig(loss_type="cakld", kd_loss_weight=1.0)
    a = qat_loss(s, labels, cfg, t).loss
    s2, t2 = s.clone(), t.clone()
    s2[0, :4] = 100.0  # positions whose next label is masked
    t2[1, 6:] = -50.0
    b = qat_loss(s2, labels, cfg, t2).loss
    assert a.item() == pytest.approx(b.item(), rel=1e-6)


def test_cakld_confidence_weighting_extremes():
    """A teacher sure of the label (conf -> 1) gives reverse KL; one that is wrong gives forward KL."""
    s, t, labels = _data(4)
    S, _, y = _valid(s, t, labels)
    rows, cols = torch.nonzero(labels[:, 1:] != IGNORE_INDEX, as_tuple=True)
    sure = t.clone()
    sure[rows, cols, y] = 60.0  # conf ~ 1 on every valid label
    unsure = t.clone()
    unsure[rows, cols, y] = -60.0  # conf ~ 0
    for teacher, key in ((sure, "kd/backward_kl"), (unsure, "kd/forward_kl")):
        m = qat_loss(s, labels, LossConfig(loss_type="cakld", kd_loss_weight=1.0), teacher).means()
        assert m["kd/cakld"] == pytest.approx(m[key], rel=1e-4)


def test_kd_temperature_squared_scaling():
    """alpha=1: kd == T^2 * KL of the softened distributions (Hinton); T=1 gives plain forward KL."""
    s, t, labels = _data(5)
    S, Tt, _ = _valid(s, t, labels)
    for temp in (1.0, 4.0):
        m = qat_loss(
            s, labels, LossConfig(loss_type="kd", kd_loss_weight=1.0, kd_alpha=1.0, kd_temperature=temp), t
        ).means()
        ref = temp**2 * _ref_kl(Tt / temp, S / temp).mean()
        assert m["kd/kd"] == pytest.approx(ref.item(), rel=1e-5)
        if temp == 1.0:
            assert m["kd/kd"] == pytest.approx(m["kd/forward_kl"], rel=1e-6)


def test_topk_with_full_vocab_equals_plain_kl():
    s, t, labels = _data(6)
    full = qat_loss(s, labels, LossConfig(loss_type=f"kl_top_{V}", kd_loss_weight=1.0), t).means()
    assert full[f"kd/kl_top_{V}"] == pytest.approx(full["kd/forward_kl"], rel=1e-5)


def test_denominator_and_empty_batch():
    s, t, labels = _data(7)
    cfg = LossConfig(loss_type="kl", kd_loss_weight=1.0)
    out = qat_loss(s, labels, cfg, t)
    out2 = qat_loss(s, labels, cfg, t, denominator=2 * out.n_tokens)
    assert out2.loss.item() == pytest.approx(out.loss.item() / 2, rel=1e-6)
    empty = torch.full_like(labels, IGNORE_INDEX)
    x = s.clone().requires_grad_()
    e = qat_loss(x, empty, cfg, t)
    assert e.n_tokens == 0 and e.loss.item() == 0.0
    e.loss.backward()  # graph stays connected
    assert x.grad is not None


def test_config_validation_and_origin():
    with pytest.raises(ValueError, match="loss_type"):
        LossConfig(loss_type="jsd")
    with pytest.raises(ValueError, match="positive K"):
        LossConfig(loss_type="kl_top", kd_loss_weight=1.0)
    with pytest.raises(ValueError, match="only applies"):
        LossConfig(loss_type="kl", loss_topk=3, kd_loss_weight=1.0)
    with pytest.raises(ValueError, match="nothing to optimise"):
        LossConfig(loss_type="kl", lm_loss_weight=0.0, kd_loss_weight=0.0)
    assert LossConfig(loss_type="kl_top_10", loss_topk=4, kd_loss_weight=1).topk == 4  # loss_topk wins
    origin = LossConfig(loss_type="origin", kd_loss_weight=1.0)
    assert not origin.kd_enabled and origin.log_keys() == ["lm_loss", "total_loss"]
    with pytest.raises(ValueError, match="teacher"):
        qat_loss(*_data()[::2], LossConfig(loss_type="kl", kd_loss_weight=1.0))


@pytest.mark.parametrize(
    ("loss_type", "loss_topk", "expect"),
    [
        ("cakld", None, LossType("cakld", None)),
        ("origin", None, LossType("origin", None)),
        ("kl_top_100", None, LossType("kl_top", 100)),
        ("r_kl_top", 5, LossType("r_kl_top", 5)),
        ("kl_top_10", 4, LossType("kl_top", 4)),  # loss_topk wins over the inline K
        ("kl_topx", None, "loss_type"),
        ("kl_top_0", None, "loss_type"),  # K is a positive int
        ("kl_top_010", None, "loss_type"),  # without a leading zero
        ("r_kl_top", None, "loss_type"),  # no K at all
        ("KL", None, "loss_type"),  # the vocabulary is lower case (LossConfig lowercases first)
        ("kl", 3, "loss_topk"),  # K only for top-K losses
        ("kl_top", 0, "loss_topk"),
    ],
)
def test_parse_loss_type(loss_type, loss_topk, expect):
    """The one loss vocabulary: a family and a K, or an error naming the field at fault."""
    if isinstance(expect, LossType):
        assert parse_loss_type(loss_type, loss_topk) == expect
    else:
        with pytest.raises(LossTypeError) as ei:
            parse_loss_type(loss_type, loss_topk)
        assert ei.value.field == expect and isinstance(ei.value, ValueError)


def test_every_loss_type_has_a_term():
    """Each member of LOSS_TYPES builds a LossConfig and a finite KD term (no silent fallthrough)."""
    s, t, labels = _data()
    assert set(LOSS_TYPES) == {"origin", "kl", "rkl", "mse", "kd", "cakld", "kl_top", "r_kl_top"}
    for lt in LOSS_TYPES:
        cfg = LossConfig(loss_type=lt, loss_topk=3 if lt.endswith("kl_top") else None, kd_loss_weight=1.0)
        assert cfg.kind == lt
        out = qat_loss(s, labels, cfg, t).means()
        assert (f"kd/{lt}" in out) == (lt != "origin")
        assert all(math.isfinite(v) for v in out.values())


def test_bf16_logits_close_to_fp32():
    s, t, labels = _data(8)
    cfg = LossConfig(loss_type="cakld", kd_loss_weight=1.0)
    a = qat_loss(s, labels, cfg, t).means()
    b = qat_loss(s.bfloat16(), labels, cfg, t.bfloat16()).means()
    assert math.isclose(a["kd/cakld"], b["kd/cakld"], rel_tol=0.05)


def test_memory_probe_chunked_uses_less():
    r = kd_memory_probe(n_tokens=512, vocab=2048, chunk_size=64, dtype=torch.float32)
    assert r["chunked_peak"] < 0.5 * r["full_peak"]
    # chunked: about the logits' gradient plus one chunk's workspace, not several fp32 copies
    assert r["chunked_peak"] < 4 * r["fp32_logits_bytes"]


def test_default_chunk_follows_an_element_budget():
    """Rows per chunk = CHUNK_ELEMENTS // vocab (1024 rows at 32k, 220 at Qwen3's 151,936)."""
    from qatlib.losses import CHUNK_ELEMENTS

    assert CHUNK_ELEMENTS == 1 << 25
    cfg = LossConfig()
    assert cfg.rows_per_chunk(32768) == 1024
    assert cfg.rows_per_chunk(151936) == 220
    assert cfg.rows_per_chunk(1 << 26) == 1
    assert LossConfig(chunk_size=7).rows_per_chunk(151936) == 7
    with pytest.raises(ValueError, match="chunk_size"):
        LossConfig(chunk_size=0)


def test_default_chunk_memory(monkeypatch):
    """The budget sets the peak: several chunks -> well under the plain formulation; one chunk
    covering every row -> the plain formulation itself (no extra gradient buffer)."""
    import qatlib.losses as L

    one = kd_memory_probe(n_tokens=512, vocab=2048, dtype=torch.float32)
    assert one["chunk_size"] == (1 << 25) // 2048
    assert one["chunked_peak"] <= 1.02 * one["full_peak"]
    monkeypatch.setattr(L, "CHUNK_ELEMENTS", 64 * 2048)
    many = kd_memory_probe(n_tokens=512, vocab=2048, dtype=torch.float32)
    assert many["chunk_size"] == 64
    assert many["chunked_peak"] < 0.5 * many["full_peak"]
