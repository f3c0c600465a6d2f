"""vLLM-CPU's W8A8-INT8 GEMM on a CPU without int8 VNNI: the fact, how to tell such a CPU, and
the arithmetic, so the emulator (`qatlib.runtime.emulate.emulate_export`, ``int8_gemm=
"pair_saturating"``) computes what that engine serves.

vllm-cpu 0.32.0 runs every W8A8-INT8 linear through ``CPUInt8ScaledMMLinearKernel``: oneDNN's s8 x s8
matmul. With int8 VNNI (``vpdpbusd``) the int32 accumulator is exact. Without it (AVX2-only CPUs,
AVX-512 without VNNI) oneDNN adds 128 to every activation code (u8), multiplies with ``vpmaddubsw``,
which adds each adjacent K pair ``u[2j]*w[2j] + u[2j+1]*w[2j+1]`` into an int16 **with saturation**,
then sums the pairs exactly into int32 and subtracts ``128 * sum_k w`` exactly. A pair can clip only
where ``|w[2j]| + |w[2j+1]| > 128``. Measured (issue 60): RTN W8A8 SmolLM2-135M, PPL 18.35 with the
exact GEMM and 18.89 with this one.

The arithmetic itself (`saturating_int8_matmul`, the instruction sequence in torch integer
arithmetic) is owned by `qatlib.quant.int8_gemm`, below this layer, so QAT for that target
(``deploy.int8_gemm: pair_saturating``) trains with the very function the emulator serves with;
it is re-exported here.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

import torch

from ..quant.int8_gemm import INT8_GEMMS, Int8Gemm, pair_saturation, saturating_int8_matmul
from .layouts import Fact

__all__ = [
    "INT8_GEMMS",
    "NO_VNNI",
    "Int8Gemm",
    "engine_int8_gemm",
    "int8_linear",
    "pair_saturation",
    "saturating_int8_matmul",
]

# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA / DNNL_MAX_CPU_ISA) below int8 VNNI
_NO_VNNI_CAPS = frozenset({"SSE41", "AVX", "AVX2", "AVX512_CORE"})

NO_VNNI = Fact(
    "vllm-cpu 0.32.0 CPUInt8ScaledMMLinearKernel (oneDNN matmul) on a CPU without int8 VNNI (cpuinfo flags "
    "avx512_vnni and avx_vnni both absent; ONEDNN_VERBOSE names gemm:jit or brg_matmul:avx512_core, not *_vnni): "
    "activation codes shifted to u8 (+128), adjacent K pairs summed by vpmaddubsw saturating at int16, "
    "128*sum(w) subtracted exactly; exact with VNNI. Modelled by qatlib.quant.int8_gemm.saturating_int8_matmul "
    "(emulate_export int8_gemm='pair_saturating'); QAT trains against it with deploy.int8_gemm: pair_saturating",
    "vllm kernels/linear/scaled_mm/cpu.py:136-143,208; oneDNN src/cpu/gemm/s8x8s32/simple_gemm_s8s8s32.cpp:119,174-177, "
    "src/cpu/x64/gemm/s8x8s32/jit_avx2_gemm_s8u8s32_kern.cpp:69-79 (AVX2), "
    "src/cpu/x64/brgemm/jit_brgemm_kernel.cpp:2102-2119,2274-2275 (AVX-512 without VNNI)",
    checked_by="read only: a kernel's arithmetic, which the load-time oracle does not run; vLLM's engine "
    "checks it (tests/test_runtime_cpu_int8.py serves W8A8-INT8 with ONEDNN_MAX_CPU_ISA=AVX2)",
)


def engine_int8_gemm(flags: Iterable[str] | None = None, env: Mapping[str, str] | None = None) -> Int8Gemm:
    """The int8 GEMM vllm-cpu's oneDNN runs here: ``"exact"`` with int8 VNNI (cpuinfo flag
    ``avx512_vnni`` or ``avx_vnni``) unless ``ONEDNN_MAX_CPU_ISA`` / ``DNNL_MAX_CPU_ISA`` caps it
    below VNNI, else ``"pair_saturating"``. ``flags``: the CPU flags (default ``/proc/cpuinfo``'s;
    none readable: taken as VNNI); ``env``: the engine's environment (default ``os.environ``)."""
    env = os.environ if env is None else env
    if flags is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                line = next((ln for ln in f if ln.startswith("flags")), "")
            flags = line.partition(":")[2].split() if line else ("avx512_vnni",)
        except OSError:
            flags = ("avx512_vnni",)
    cap = (env.get("ONEDNN_MAX_CPU_ISA") or env.get("DNNL_MAX_CPU_ISA") or "").upper()
    vnni = bool({"avx512_vnni", "avx_vnni"} & set(flags)) and cap not in _NO_VNNI_CAPS
    return "exact" if vnni else "pair_saturating"


def int8_linear(
    x_codes: torch.Tensor,
    x_scale: torch.Tensor,
    w_codes: torch.Tensor,
    w_scale: torch.Tensor,
    int8_gemm: Int8Gemm,
    x_zero_point: torch.Tensor | None = None,
) -> torch.Tensor:
    """vLLM-CPU's int8 linear from codes, fp32: ``(fp32(acc) * w_scale[n]) * x_scale`` (oneDNN
    applies the weight scale, vLLM's epilogue the activation scale; bit-exact order, issue 60).
    ``acc``: the int32 accumulator of ``int8_gemm``, less ``x_zero_point * sum_k w`` (asymmetric
    static input; that path is not checked against the engine)."""
    if int8_gemm == "pair_saturating":
        acc = saturating_int8_matmul(x_codes, w_codes)
    else:
        acc = (x_codes.double() @ w_codes.double().t()).long()
    if x_zero_point is not None:
        acc = acc - x_zero_point.to(torch.int64) * w_codes.to(torch.int64).sum(1)
    return (acc.float() * w_scale.float().reshape(1, -1)) * x_scale.float()
