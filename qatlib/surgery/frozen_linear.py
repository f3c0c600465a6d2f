"""A linear layer's input gradient, ``grad @ W``, computed in a form the CPU runs fast; and the
frozen output head that uses it.

Why: PyTorch's bf16 / fp16 GEMM on a CPU without oneDNN kernels for the dtype (bf16: no AVX-512,
e.g. AVX2 only) is fast only when both operands are contiguous along the reduction. A linear's
forward (``x @ W.t()``) is; its input gradient (``[tokens, out] @ [out, in]``, reducing over W's
rows) is not, and runs ~30x slower: for a tenth of Qwen3-30B-A3B's 151,936-row head at 64 tokens,
14.4 s against 0.43 s for the forward (one thread, 2-core AMD EPYC); 52 ms against 2.5 ms for one
768 x 2048 expert weight. The same product in fp32 is fast. qatlib's own linears
(`qatlib.quant.fq_linear`) take `grad_input`; the output head is not quantized, so its backward was
DeepSpeed's ``LinearFunctionForZeroStage3.backward`` (or autograd's mm backward), the one product
that made the real-width rehearsal's ZeRO-3 step take tens of minutes on such CPUs.
`use_frozen_head` routes the head through `frozen_linear` instead. On GPUs and on CPUs with
native kernels for the dtype (`half_gemm_is_native`) nothing changes: the head is left alone there,
and every function here is the plain product; forcing fp32 there would cost 2-8x (AVX-512-BF16
EPYC: an expert's forward 0.32 ms in bf16 against 1.54 ms via fp32, a tenth of the head 21 against
135 ms).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as TF
from torch import nn

# Rows of W per fp32 product: bounds the fp32 copies (2048-wide: 64 MiB) for a 151,936-row head.
GRAD_CHUNK_ROWS = 8192


@functools.cache
def half_gemm_is_native(dtype: torch.dtype) -> bool:
    """Whether this CPU's bf16 / fp16 matmuls run on oneDNN kernels for the dtype: what ATen itself
    checks before it routes a half-precision CPU matmul to oneDNN (``mkldnn_bf16_device_check``:
    AVX-512 or newer for bf16, AVX-512-FP16 / AMX-FP16 for fp16); without them it runs its slow
    reference GEMM. torch exposes the check only as these ops."""
    check = {
        torch.bfloat16: "_is_mkldnn_bf16_supported",
        torch.float16: "_is_mkldnn_fp16_supported",
    }.get(dtype)
    if check is None:
        return True
    try:
        return bool(getattr(torch.ops.mkldnn, check)())
    except (AttributeError, RuntimeError):  # a build without oneDNN: the reference GEMM
        return False


def _slow_half_on_cpu(t: torch.Tensor) -> bool:
    return (
        t.device.type == "cpu"
        and t.dtype in (torch.bfloat16, torch.float16)
        and not half_gemm_is_native(t.dtype)
    )


def grad_input(g2: torch.Tensor, w: torch.Tensor, chunk_rows: int = GRAD_CHUNK_ROWS) -> torch.Tensor:
    """``g2 @ w`` (``g2`` ``[tokens, out]``, ``w`` ``[out, in]``) as autograd's mm backward computes
    it, except for bf16 / fp16 on a CPU without native kernels for them: there it is computed in
    fp32, ``chunk_rows`` rows of ``w`` at a time, and rounded once to the model dtype: within one
    model-dtype ulp of autograd's value, never less accurate (see the module docstring for why)."""
    if not _slow_half_on_cpu(g2):
        return g2.mm(w)
    out = None
    for i in range(0, w.shape[0], chunk_rows):
        part = g2[:, i : i + chunk_rows].float().mm(w[i : i + chunk_rows].float())
        out = part if out is None else out.add_(part)
    return out.to(g2.dtype)


def linear_output(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, chunk_rows: int = GRAD_CHUNK_ROWS
) -> torch.Tensor:
    """``F.linear(x, w, bias)``'s value, except for bf16 / fp16 on a CPU without native kernels for
    them: there the products are fp32, ``chunk_rows`` rows of ``w`` at a time, each output block
    rounded once to the model dtype (the fp32 accumulation a bf16 GEMM does, in another order:
    within one model-dtype ulp). Even the forward layout runs 2-3x slower in bf16 than converting to
    fp32 on such CPUs: a tenth of Qwen3-30B-A3B's head at 64 tokens 196 ms vs 73 ms with the
    conversions, one 768 x 2048 expert weight at 8 tokens 2.3 ms vs 1.0 ms (one thread, 2-core AMD
    EPYC, AVX2). Values only: callers are autograd Functions that write their own backward."""
    if not _slow_half_on_cpu(x) or w.dtype != x.dtype:
        return TF.linear(x, w, bias)
    x2 = x.reshape(-1, x.shape[-1]).float()
    out = x.new_empty(x2.shape[0], w.shape[0])
    for i in range(0, w.shape[0], chunk_rows):
        part = x2.mm(w[i : i + chunk_rows].float().t())
        if bias is not None:
            part.add_(bias[i : i + chunk_rows].float())
        out[:, i : i + chunk_rows] = part  # rounds once
    return out.reshape(*x.shape[:-1], w.shape[0])


def grad_weight(g2: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """``g2.t() @ x2`` (``[out, tokens] @ [tokens, in]``: a linear's weight gradient) in the model
    dtype, as autograd's mm backward computes it, except for bf16 / fp16 on a CPU without native
    kernels for them: there the product is fp32, rounded once (an expert weight at 8 tokens:
    4.8 ms in bf16, 0.6 ms so; the reduction runs over tokens, not contiguous in either operand)."""
    if not _slow_half_on_cpu(g2):
        return x2.t().mm(g2).t()
    return g2.float().t().mm(x2.float()).to(g2.dtype)


class _FrozenLinear(torch.autograd.Function):
    """``linear(x, weight, bias)``; the input gradient by `grad_input`. Saves ``x`` only when the
    weight needs a gradient (a frozen head needs none)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight, bias)
        return linear_output(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        # under ZeRO-3 the weight is gathered here by DeepSpeed's hooks on the module, as for
        # `qatlib.quant.fq_linear`
        x, weight, bias = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = grad_input(g2, weight).reshape(*g.shape[:-1], weight.shape[1])
        if ctx.needs_input_grad[1]:
            gw = grad_weight(g2, x.reshape(-1, x.shape[-1]))
        if bias is not None and ctx.needs_input_grad[2]:
            gb = g2.sum(0)
        return gx, gw, gb


def frozen_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the same value and gradients; the input gradient computed
    by `grad_input`."""
    return _FrozenLinear.apply(x, weight, bias)


class FrozenLinear(nn.Linear):
    """An ``nn.Linear`` (same class checks, same ``weight`` / ``bias`` Parameter objects, so ZeRO-3
    partitions, ties and state-dict keys survive the swap) whose forward is `frozen_linear`."""

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)  # not nn.Linear.__init__: it would allocate a new weight
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return frozen_linear(x, self.weight, self.bias)


def use_frozen_head(model: nn.Module) -> bool:
    """Swap the model's output head for a `FrozenLinear` when its backward would be the slow
    product: a plain ``nn.Linear`` head with bf16 / fp16 weights on a CPU without native kernels for
    them (`half_gemm_is_native`) that does not train (QAT never trains it). Call before DeepSpeed
    wraps the model (it hooks the modules it finds). Returns whether it swapped."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    if type(head) is not nn.Linear or head.weight.requires_grad or not _slow_half_on_cpu(head.weight):
        return False
    if head.bias is not None and head.bias.requires_grad:
        return False
    model.set_output_embeddings(FrozenLinear(head))
    return True
