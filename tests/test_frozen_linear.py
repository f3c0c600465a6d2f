"""The frozen output head (`qatlib.surgery.frozen_linear`): the input gradient of a bf16 linear on a CPU
without native bf16 kernels computed in fp32 chunks (fast on AVX2-only CPUs), the same values and
gradients as ``nn.Linear`` otherwise, and the swap of a QAT model's head. Every test but the last
runs as on such a CPU (`slow_half`), whatever this machine has; the last as on one with kernels."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model, tiny_llama_config, tiny_qwen3_config
from torch import nn

import qatlib.surgery.frozen_linear as frozen_linear_module
from qatlib.surgery.frozen_linear import (
    FrozenLinear,
    frozen_linear,
    grad_input,
    grad_weight,
    half_gemm_is_native,
    linear_output,
    use_frozen_head,
)


@pytest.fixture(autouse=True)
def slow_half(request, monkeypatch):
    """As on a CPU without oneDNN half-precision kernels (AVX2 only), unless the test is marked
    ``native_half``."""
    native = request.node.get_closest_marker("native_half") is not None
    monkeypatch.setattr(frozen_linear_module, "half_gemm_is_native", lambda dtype: native)


def _case(dtype, rows=37, cols=24, tokens=(2, 5), seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g).to(dtype)
    x = torch.randn(*tokens, cols, generator=g).to(dtype)
    go = torch.randn(*tokens, rows, generator=g).to(dtype)
    return x, w, go


@pytest.mark.parametrize("chunk", [5, 37, 8192])
def test_grad_input_in_fp32_chunks_is_the_exact_product_rounded_once(chunk):
    """bf16 on the CPU: sum over row chunks of fp32 products, rounded once to bf16. Against the
    product in float64 rounded to bf16 (the best bf16 answer): at most one bf16 ulp away, and never
    further from the float64 value than autograd's bf16 product."""
    _, w, go = _case(torch.bfloat16)
    g2 = go.reshape(-1, go.shape[-1])
    got = grad_input(g2, w, chunk_rows=chunk)
    exact = g2.double() @ w.double()
    assert got.dtype is torch.bfloat16 and got.shape == (10, 24)
    torch.testing.assert_close(got, exact.to(torch.bfloat16), rtol=2**-7, atol=0)
    err, err_autograd = (got.double() - exact).abs(), ((g2 @ w).double() - exact).abs()
    assert err.max() <= err_autograd.max()
    if chunk >= w.shape[0]:  # one chunk: one fp32 product
        assert torch.equal(got, (g2.float() @ w.float()).to(torch.bfloat16))


def test_grad_input_fp32_is_the_plain_product():
    _, w, go = _case(torch.float32)
    g2 = go.reshape(-1, go.shape[-1])
    assert torch.equal(grad_input(g2, w, chunk_rows=5), g2.mm(w))


@pytest.mark.parametrize("chunk", [5, 37, 8192])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_output_in_fp32_chunks_is_the_exact_product_rounded_once(chunk, bias):
    """bf16 on the CPU: each output block an fp32 product (+ bias), rounded once. Against float64
    rounded to bf16: at most one ulp, never further from float64 than torch's bf16 linear; fp32:
    torch's linear bit for bit."""
    x, w, _ = _case(torch.bfloat16, rows=300, cols=200)
    b = torch.randn(w.shape[0]).bfloat16() if bias else None
    got = linear_output(x, w, b, chunk_rows=chunk)
    exact = x.double() @ w.double().t() + (0 if b is None else b.double())
    assert got.dtype is torch.bfloat16 and got.shape == (2, 5, 300)
    torch.testing.assert_close(got, exact.to(torch.bfloat16), rtol=2**-7, atol=0)
    err = (got.double() - exact).abs()
    err_torch = (torch.nn.functional.linear(x, w, b).double() - exact).abs()
    assert err.max() <= err_torch.max()
    # each block is its own fp32 product: the chunks cover every row once, in place
    part = x.float() @ w[chunk : 2 * chunk].float().t() + (0 if b is None else b[chunk : 2 * chunk].float())
    assert torch.equal(got[..., chunk : 2 * chunk], part.to(torch.bfloat16))
    x32, w32, _ = _case(torch.float32)
    assert torch.equal(linear_output(x32, w32, chunk_rows=5), torch.nn.functional.linear(x32, w32))


def test_grad_weight_is_the_exact_product_rounded_once():
    """``g.t() @ x`` (a weight gradient, reduced over tokens): bf16 on the CPU from one fp32
    product, rounded once; fp32: autograd's product bit for bit."""
    x, w, go = _case(torch.bfloat16, tokens=(3, 41))
    x2, g2 = x.reshape(-1, x.shape[-1]), go.reshape(-1, go.shape[-1])
    got = grad_weight(g2, x2)
    assert got.dtype is torch.bfloat16 and got.shape == w.shape
    assert torch.equal(got, (g2.float().t() @ x2.float()).to(torch.bfloat16))
    exact = g2.double().t() @ x2.double()
    torch.testing.assert_close(got, exact.to(torch.bfloat16), rtol=2**-7, atol=0)
    x, w, go = _case(torch.float32, tokens=(3, 41))
    x2, g2 = x.reshape(-1, x.shape[-1]), go.reshape(-1, go.shape[-1])
    assert torch.equal(grad_weight(g2, x2), x2.t().mm(g2).t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_frozen_linear_is_linear_with_its_gradients(dtype, bias):
    """Value bit for bit; input gradient: fp32 bit for bit, bf16 within one ulp (`grad_input`);
    weight and bias gradients (when asked) as autograd's."""
    x, w, go = _case(dtype)
    b = torch.randn(w.shape[0]).to(dtype) if bias else None

    def run(fn):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        bi = b.clone().requires_grad_() if bias else None
        out = fn(xi, wi, bi)
        out.backward(go)
        return out, xi.grad, wi.grad, (bi.grad if bias else None)

    ref, got = run(torch.nn.functional.linear), run(frozen_linear)
    if dtype is torch.float32:
        assert torch.equal(got[0], ref[0])
        assert torch.equal(got[1], ref[1])
    else:  # `linear_output` / `grad_input`: fp32 products rounded once, within one bf16 ulp
        torch.testing.assert_close(got[0], ref[0], rtol=2**-7, atol=1e-3)
        torch.testing.assert_close(got[1], ref[1], rtol=2**-7, atol=1e-3)
    torch.testing.assert_close(got[2], ref[2], rtol=1e-6 if dtype is torch.float32 else 2**-7, atol=1e-6)
    if bias:
        torch.testing.assert_close(got[3], ref[3], rtol=1e-6 if dtype is torch.float32 else 2**-7, atol=1e-6)


def test_frozen_head_saves_no_input_when_the_weight_is_frozen():
    """A frozen head keeps only its weight for backward, not the ``[tokens, hidden]`` input."""
    x, w, _ = _case(torch.bfloat16)
    xi = x.clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        frozen_linear(xi, w)
    assert len(saved) == 1 and saved[0] is w


@pytest.mark.parametrize("tied", [False, True])
def test_use_frozen_head_swaps_a_frozen_bf16_cpu_head_only(tied):
    """The swap keeps the head's Parameter (ties, state-dict keys) and the model's logits (within
    one bf16 ulp) and hidden-state gradients; it is skipped for fp32, for a training head, and on a second call."""
    cfg = tiny_llama_config() if tied else tiny_qwen3_config()
    model = build_model(cfg, seed=3).to(torch.bfloat16)
    for p in model.parameters():
        p.requires_grad_(False)
    head = model.lm_head
    keys = list(model.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))

    def step():
        emb = model.get_input_embeddings()(ids).detach().requires_grad_()
        logits = model(inputs_embeds=emb).logits
        logits.float().logsumexp(-1).sum().backward()
        return logits.detach(), emb.grad

    ref_logits, ref_grad = step()
    assert use_frozen_head(model)
    assert type(model.lm_head) is FrozenLinear and isinstance(model.lm_head, nn.Linear)
    assert model.lm_head.weight is head.weight
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == tied
    assert list(model.state_dict()) == keys
    logits, grad = step()
    torch.testing.assert_close(logits, ref_logits, rtol=2**-7, atol=1e-6)  # `linear_output`: <= 1 ulp
    torch.testing.assert_close(grad, ref_grad, rtol=2**-6, atol=2e-3 * ref_grad.abs().max().item())
    assert not use_frozen_head(model)  # already swapped

    fp32 = build_model(cfg, seed=3)
    for p in fp32.parameters():
        p.requires_grad_(False)
    assert not use_frozen_head(fp32) and type(fp32.lm_head) is nn.Linear
    trains = build_model(cfg, seed=3).to(torch.bfloat16)
    assert not use_frozen_head(trains) and type(trains.lm_head) is nn.Linear


def test_qat_trainer_swaps_the_head_and_the_scale_gradients_stay(tmp_path):
    """QATTrainer swaps a bf16 CPU model's frozen head; a QAT step's scale gradients through it
    match those through the plain head (a copy made before the swap) to bf16 rounding."""
    import copy

    from transformers import TrainingArguments

    from qatlib.losses import LossConfig
    from qatlib.quant import Granularity, QuantScheme, QuantSpec, prepare
    from qatlib.trainers.end2end import QATTrainer

    scheme = QuantScheme("w4", weight=QuantSpec("int4", Granularity.GROUP, group_size=16))
    model = build_model(tiny_qwen3_config(), seed=2).to(torch.bfloat16)
    prepare(model, scheme)
    plain = copy.deepcopy(model)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to="none", use_cpu=True)
    QATTrainer(model, args, loss_config=LossConfig(), log_file=False)
    assert type(model.lm_head) is FrozenLinear
    trains = {n for n, p in model.named_parameters() if p.requires_grad}
    for n, p in plain.named_parameters():  # the trainer's selection (scales), on the copy
        p.requires_grad_(n in trains)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(4))
    grads = []
    for m in (model, plain):
        m.train()
        m(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.requires_grad})
    assert type(plain.lm_head) is nn.Linear and grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    for n, g in grads[0].items():
        ref = grads[1][n]
        assert ref.abs().max() > 0, n
        torch.testing.assert_close(g, ref, rtol=0, atol=0.02 * ref.abs().max().item(), msg=n)


@pytest.mark.native_half
def test_cpus_with_half_kernels_keep_torch_products_and_the_plain_head():
    """Where the CPU has bf16 kernels the fp32 route would be 2-8x slower: every product is
    torch's own, bit for bit, and the head is not swapped."""
    x, w, go = _case(torch.bfloat16, rows=300, cols=200, tokens=(3, 41))
    b = torch.randn(w.shape[0]).bfloat16()
    x2, g2 = x.reshape(-1, x.shape[-1]), go.reshape(-1, go.shape[-1])
    assert torch.equal(linear_output(x, w, b, chunk_rows=7), torch.nn.functional.linear(x, w, b))
    assert torch.equal(grad_input(g2, w, chunk_rows=7), g2.mm(w))
    assert torch.equal(grad_weight(g2, x2), x2.t().mm(g2).t())
    model = build_model(tiny_qwen3_config(), seed=3).to(torch.bfloat16)
    for p in model.parameters():
        p.requires_grad_(False)
    assert not use_frozen_head(model) and type(model.lm_head) is nn.Linear


def test_half_gemm_is_native_reads_torch_own_check():
    """fp32 always counts as native; bf16 / fp16 as ATen's oneDNN device check says (the function
    under test is the real one, not the fixture's stand-in)."""
    native = half_gemm_is_native  # imported before the fixture patches the module
    assert native(torch.float32) is True
    assert native(torch.bfloat16) is bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert native(torch.float16) is bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
