"""vLLM's own load path, run on CPU, as the oracle of the deployment emulator (`qatlib.runtime.emulate`).

`vllm_loaded` builds vLLM's model class for an export (``ModelConfig`` / ``VllmConfig`` of the export
folder, vLLM's ``DefaultModelLoader.load_model``: ``initialize_model``, ``load_weights`` of the real
checkpoint, ``process_weights_after_loading`` of every quantization method). `vllm_linear` and
`vllm_kv` read back what vLLM would compute with: each quantized linear's effective weight, weight
scale and static input scale, and each attention's k / v / q scales, under qatlib's module names.

vLLM is imported, never copied. A CPU cannot run a few things on that path; each is replaced by the
nearest pure-torch function below it (`SUBSTITUTIONS`, also printed by ``python -m
qatlib.runtime.check``), and nothing else is touched.

Needs ``vllm`` installed (``requirements/runtime-oracle.txt``); importing this module does not.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import re
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

# vLLM picks its platform on first use: the CPU platform (no GPU here) builds a VllmConfig
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

VLLM_VERSION = "0.33.0"  # the release `qatlib.runtime.facts` reads; `check` reports another one

# (what vLLM calls on a GPU, what runs instead here, why). Scoped to `vllm_loaded`, restored after.
SUBSTITUTIONS: tuple[tuple[str, str, str], ...] = (
    (
        "vllm._custom_ops.scaled_fp8_quant (torch.ops._C static / dynamic fp8 quant)",
        "vllm QuantFP8(...).forward_native",
        "compiled CUDA op; forward_native is vLLM's own torch reference of it "
        "(x * (1/scale), clamp to +-448, cast to E4M3)",
    ),
    (
        "fused-MoE backend selection (select_fp8_moe_backend of compressed-tensors' and of the fp8 format's "
        "Fp8MoEMethod, select_int8_moe_backend, select_nvfp4_moe_backend)",
        "fp8: Fp8MoeBackend.TRITON; int8: Int8MoeBackend.TRITON; NVFP4: NvFp4MoeBackend.EMULATION",
        "the CPU has no fused-MoE backend; these need no load-time layout change (their input-scale "
        "handling is backend-specific and not compared for NVFP4 experts)",
    ),
    (
        "WNA16 Marlin / Machete repack and NVFP4 CUTLASS / FlashInfer kernels",
        "VLLM_BATCH_INVARIANT=1: WNA16 'dequantize + batch-invariant matmul', NVFP4 emulation kernel",
        "their repacks are compiled ops; these are vLLM's pure-torch kernels over the same loaded "
        "parameters (matmul_batch_invariant itself -> torch.matmul)",
    ),
    (
        "W4A8-FP8 on an SM90 GPU (capability 9.0, CutlassW4A8LinearKernel)",
        "capability reported as 9.0; the kernel's is_cuda asserts see CUDA-looking CPU tensors; "
        "ops.cutlass_encode_and_reorder_int4b / cutlass_pack_scale_fp8 -> identity",
        "the two ops only reorder for the CUTLASS kernel (no arithmetic); the scale conversion "
        "(convert_bf16_scales_to_fp8) and int4 sign conversion run as vLLM wrote them",
    ),
    (
        "int8 W8A8 scaled-mm kernel selection (choose_scaled_mm_linear_kernel)",
        "CutlassInt8ScaledMMLinearKernel (vLLM's CUDA int8 kernel; its is_supported CUDA check answered yes)",
        "the CPU picks its own int8 kernel, which repacks with a compiled op; the CUTLASS kernel's "
        "process_weights_after_loading (scales to channelwise, input scale) is torch",
    ),
    (
        "torch.accelerator.empty_cache / synchronize, CPU unquantized-GEMM prepacking",
        "no-ops",
        "memory housekeeping and a CPU-only repack of the unquantized embeddings / lm_head",
    ),
)


def vllm_version() -> str | None:
    """The installed vLLM's version, None when it is not installed."""
    try:
        from importlib.metadata import version

        return version("vllm")
    except Exception:
        return None


@contextlib.contextmanager
def _patched(obj, name: str, value) -> Iterator[None]:
    """``obj.name = value`` for the block (a class keeps its own descriptor, or inherits again)."""
    own = name in vars(obj) if isinstance(obj, type) else True
    old = vars(obj)[name] if isinstance(obj, type) and own else getattr(obj, name, None)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if own:
            setattr(obj, name, old)
        else:
            delattr(obj, name)


def _scaled_fp8_quant_native(
    input, scale=None, num_token_padding=None, scale_ub=None, use_per_token_if_dynamic=False, output=None,
    group_shape=None,
):  # fmt: skip
    """``vllm._custom_ops.scaled_fp8_quant`` by vLLM's ``QuantFP8.forward_native`` (per-tensor
    static, per-token or per-tensor dynamic: the cases the load path and W4A8 call)."""
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    if num_token_padding is not None or scale_ub is not None or output is not None:
        raise NotImplementedError("scaled_fp8_quant substitute: padding / scale_ub / output not used here")
    if scale is not None:
        if scale.numel() != 1:
            raise NotImplementedError("scaled_fp8_quant substitute: per-tensor static scales only")
        return QuantFP8(static=True, group_shape=GroupShape.PER_TENSOR).forward_native(input, scale)
    shape = GroupShape.PER_TOKEN if use_per_token_if_dynamic else GroupShape.PER_TENSOR
    return QuantFP8(static=False, group_shape=shape).forward_native(input)


class _CudaLooking(torch.Tensor):
    """A CPU tensor that answers ``is_cuda`` True (for asserts that only guard the device)."""

    @property
    def is_cuda(self) -> bool:
        return True


def _as_if_cuda(fn):
    def call(*args):
        out = fn(*(a.as_subclass(_CudaLooking) if isinstance(a, torch.Tensor) else a for a in args))
        if isinstance(out, tuple):
            return tuple(o.as_subclass(torch.Tensor) for o in out)
        return out.as_subclass(torch.Tensor)

    return call


@contextlib.contextmanager
def _distributed() -> Iterator[None]:
    """vLLM's parameters read the tensor-parallel rank: one gloo rank and its model-parallel
    groups (an MoE config adds the expert-parallel group), destroyed again on exit."""
    from vllm.distributed import parallel_state as ps

    if torch.distributed.is_initialized():
        raise RuntimeError("torch.distributed is already initialized: run the vLLM oracle in its own process")
    init = "file://" + tempfile.mktemp(prefix="qatlib-vllm-oracle-")
    ps.init_distributed_environment(
        world_size=1, rank=0, local_rank=0, distributed_init_method=init, backend="gloo"
    )
    try:
        ps.initialize_model_parallel(1, 1)
        yield
    finally:
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()


def _export_dtype(d: Path) -> torch.dtype:
    cfg = json.loads((d / "config.json").read_text())
    return getattr(torch, str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"))


def _substitutions(stack: contextlib.ExitStack, *, w4a8: bool, int8: bool, batch_invariant: bool) -> None:
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers import utils as layer_utils
    from vllm.model_executor.layers.fused_moe.experts.nvfp4_emulation_moe import (
        Nvfp4QuantizationEmulationTritonExperts,
    )
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend
    from vllm.model_executor.layers.fused_moe.oracle.int8 import Int8MoeBackend
    from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import NvFp4MoeBackend
    from vllm.model_executor.layers.quantization import fp8 as native_fp8
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_w4a4_nvfp4 as moe_nvfp4,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_w8a8_fp8 as moe_fp8,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_w8a8_int8 as moe_int8,
    )

    stack.enter_context(_patched(ops, "scaled_fp8_quant", _scaled_fp8_quant_native))
    triton = (Fp8MoeBackend.TRITON, TritonExperts)
    for module in (moe_fp8, native_fp8):  # compressed-tensors' and the fp8 format's (Fp8MoEMethod) MoE
        stack.enter_context(_patched(module, "select_fp8_moe_backend", lambda *a, **k: triton))
    int8_triton = (Int8MoeBackend.TRITON, TritonExperts)
    stack.enter_context(_patched(moe_int8, "select_int8_moe_backend", lambda *a, **k: int8_triton))
    emulation = (NvFp4MoeBackend.EMULATION, Nvfp4QuantizationEmulationTritonExperts)
    stack.enter_context(_patched(moe_nvfp4, "select_nvfp4_moe_backend", lambda *a, **k: emulation))
    stack.enter_context(_patched(torch.accelerator, "empty_cache", lambda: None))
    stack.enter_context(_patched(layer_utils, "dispatch_cpu_unquantized_gemm", lambda *a, **k: None))
    if batch_invariant:
        stack.enter_context(_patched(os, "environ", {**os.environ, "VLLM_BATCH_INVARIANT": "1"}))
    if int8:
        from vllm.model_executor import kernels
        from vllm.model_executor.kernels.linear.scaled_mm.cutlass import CutlassInt8ScaledMMLinearKernel

        kernel = CutlassInt8ScaledMMLinearKernel
        stack.enter_context(
            _patched(kernels.linear, "choose_scaled_mm_linear_kernel", lambda *a, **k: kernel)
        )
        stack.enter_context(_patched(kernel, "is_supported", classmethod(lambda cls, *a: (True, None))))
    if w4a8:
        from vllm.model_executor.kernels.linear.mixed_precision import cutlass
        from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
            compressed_tensors_w4a8_fp8 as w4a8_scheme,
        )
        from vllm.platforms import current_platform
        from vllm.platforms.interface import DeviceCapability

        sm90 = DeviceCapability(9, 0)
        stack.enter_context(_patched(current_platform, "get_device_capability", lambda device_id=0: sm90))
        kernel = cutlass.CutlassW4A8LinearKernel
        stack.enter_context(_patched(w4a8_scheme, "choose_mp_linear_kernel", lambda *a, **k: kernel))
        for fn in ("convert_bf16_scales_to_fp8", "convert_packed_uint4b8_to_signed_int4_inplace"):
            stack.enter_context(_patched(cutlass, fn, _as_if_cuda(getattr(cutlass, fn))))
        stack.enter_context(_patched(ops, "cutlass_encode_and_reorder_int4b", lambda t: t))
        stack.enter_context(_patched(ops, "cutlass_pack_scale_fp8", lambda t: t))
        stack.enter_context(_patched(torch.accelerator, "synchronize", lambda *a: None))


def _export_kind(d: Path) -> dict[str, bool]:
    """Which GPU kernel family vLLM picks for the export: what the substitutions stand in for."""
    qc = json.loads((d / "config.json").read_text()).get("quantization_config") or {}
    groups = list(qc.get("config_groups", {}).values())
    weights = [g.get("weights") or {} for g in groups]
    inputs = [g["input_activations"] for g in groups if g.get("input_activations")]
    w_int = [w for w in weights if w.get("type") == "int"]
    a_fp8 = any(a.get("type") == "float" and a.get("num_bits") == 8 for a in inputs)
    fp4 = any(w.get("type") == "float" and w.get("num_bits") == 4 for w in weights)
    return {
        "w4a8": any(w.get("num_bits") == 4 for w in w_int) and a_fp8,
        "int8": bool(w_int) and any(a.get("type") == "int" for a in inputs),
        "batch_invariant": (bool(w_int) and not inputs) or fp4,
    }


@contextlib.contextmanager
def _process_state_kept() -> Iterator[None]:
    """Undo what importing and running vLLM does to the process: ~14 environment variables
    (LD_PRELOAD, LOCAL_WORLD_SIZE, TORCHINDUCTOR_* ...), warning filters, the multiprocessing start
    method; so a test session that ran the oracle runs the rest (torchrun tests) as before."""
    env = dict(os.environ)
    method = multiprocessing.get_start_method(allow_none=True)
    with warnings.catch_warnings():
        try:
            yield
        finally:
            for k in set(os.environ) - set(env):
                del os.environ[k]
            os.environ.update(env)
            if multiprocessing.get_start_method(allow_none=True) != method:
                multiprocessing.set_start_method(method, force=True)


@contextlib.contextmanager
def vllm_loaded(export_dir: str | Path) -> Iterator[torch.nn.Module]:
    """vLLM's model of ``export_dir`` after ``load_weights`` and ``process_weights_after_loading``;
    vLLM's config context and `SUBSTITUTIONS` stay in force until the ``with`` block ends (vLLM's
    custom ops read the config), the process state vLLM changes is restored after it."""
    d = Path(export_dir)
    with _process_state_kept(), contextlib.ExitStack() as stack:
        from vllm.config import CompilationConfig, ModelConfig, VllmConfig, set_current_vllm_config
        from vllm.config.compilation import CompilationMode
        from vllm.model_executor.model_loader import get_model_loader

        model_config = ModelConfig(model=str(d), dtype=_export_dtype(d), skip_tokenizer_init=True)
        config = VllmConfig(
            model_config=model_config, compilation_config=CompilationConfig(mode=CompilationMode.NONE)
        )
        stack.enter_context(set_current_vllm_config(config))
        stack.enter_context(_distributed())
        _substitutions(stack, **_export_kind(d))
        yield get_model_loader(config.load_config).load_model(config, model_config)


# --------------------------------------------------------------------------- reading vLLM back
@dataclass
class VllmLinear:
    """One qatlib linear as vLLM holds it after loading: ``weight`` the effective ``[N, K]``
    weight it multiplies with (fp32, or the model dtype where vLLM dequantizes in it), the weight
    scale of this shard / expert after vLLM's processing, the static input scale (None: dynamic),
    and ``layer`` the vLLM module (with ``rows`` / ``expert``, where this linear sits in it)."""

    weight: torch.Tensor
    weight_scale: torch.Tensor | None
    input_scale: torch.Tensor | None
    layer: torch.nn.Module
    rows: slice
    expert: int | None = None


# qatlib's expert names, or the hub's Mixtral / MiniMax-M2 ones an export writes (w1 gate, w3 up, w2 down)
_EXPERT = re.compile(r"^(?P<moe>.+)\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)$")


def _locate(vmodel, name: str) -> tuple[torch.nn.Module, int, int | None, str | None]:
    """(vLLM module, shard index in it, expert, w13 / w2) of qatlib's linear ``name``."""
    mods = dict(vmodel.named_modules())
    m = _EXPERT.match(name)
    if m:
        layer = mods[f"{m['moe']}.experts.routed_experts"]
        shard = {"gate_proj": 0, "up_proj": 1, "down_proj": 0, "w1": 0, "w3": 1, "w2": 0}[m["proj"]]
        return layer, shard, int(m["e"]), "w2" if m["proj"] in ("down_proj", "w2") else "w13"
    parent, _, child = name.rpartition(".")
    for fused, members in getattr(vmodel, "packed_modules_mapping", {}).items():
        if child in members and f"{parent}.{fused}" in mods:
            return mods[f"{parent}.{fused}"], members.index(child), None, None
    return mods[name], 0, None, None


def _rows(layer, shard: int) -> slice:
    sizes = getattr(layer, "output_sizes", None) or [layer.output_size]
    start = sum(sizes[:shard])
    return slice(start, start + sizes[shard])


def _wna16_weight(layer) -> torch.Tensor:
    """WNA16's dequantized weight as its batch-invariant ``apply_weights`` builds it (the matmul
    is read back, not run)."""
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_wNa16 as wna16,
    )

    seen = []

    def matmul(x, w_t):
        seen.append(w_t.t())
        return torch.matmul(x, w_t)

    x = torch.zeros(1, layer.input_size_per_partition, dtype=layer.weight_scale.dtype)
    with _patched(wna16, "matmul_batch_invariant", matmul):
        layer.scheme.apply_weights(layer, x, None)
    return seen[0]


def _int4_signed(packed: torch.Tensor) -> torch.Tensor:
    """The CUTLASS W4A8 weight after vLLM's ``convert_packed_uint4b8_to_signed_int4_inplace``:
    two's-complement nibbles packed along the input dim (``[K/8, N]`` int32) -> ``[N, K]``."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import unpack_quantized_values_into_int32
    from vllm.scalar_type import scalar_types

    nib = unpack_quantized_values_into_int32(packed, scalar_types.int4, packed_dim=0)
    return torch.where(nib >= 8, nib - 16, nib).t().float()


def vllm_linear(vmodel, name: str) -> VllmLinear:
    """qatlib's quantized linear ``name`` (``model.layers.0.self_attn.q_proj``, an expert's
    ``...mlp.experts.3.up_proj``) in the loaded vLLM model ``vmodel``."""
    layer, shard, expert, which = _locate(vmodel, name)
    if expert is not None:  # fused MoE: [E, rows, ...] per expert, w13 = gate rows then up rows
        w = getattr(layer, f"{which}_weight")[expert]
        n = w.shape[0] // (2 if which == "w13" else 1)
        rows = slice(shard * n, (shard + 1) * n)
        s = getattr(layer, f"{which}_weight_scale")[expert]
        if hasattr(layer, f"{which}_weight_scale_2"):  # NVFP4: packed E2M1, E4M3 groups, 1 / global scale
            from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
                dequantize_to_dtype,
            )

            inv = getattr(layer, f"{which}_weight_scale_2")[expert]
            full = dequantize_to_dtype(w, s, inv, torch.float32, 16, swizzle=False)
            return VllmLinear(full[rows], inv, None, layer, rows, expert)
        # fp8 (CompressedTensorsW8A8Fp8MoEMethod / Fp8MoEMethod, Triton layout)
        return VllmLinear(
            w[rows].float() * s, s, getattr(layer, f"{which}_input_scale", None), layer, rows, expert
        )
    rows = _rows(layer, shard)
    # compressed-tensors' scheme, or the fp8 format's quant method (quant_method: fp8)
    scheme = type(getattr(layer, "scheme", layer.quant_method)).__name__
    if scheme in (
        "CompressedTensorsW8A8Fp8",
        "Fp8LinearMethod",
    ):  # weight [K, N] after processing, scalar scales
        s = layer.weight_scale
        return VllmLinear(
            layer.weight.t()[rows].float() * s, s, getattr(layer, "input_scale", None), layer, rows
        )
    if scheme == "CompressedTensorsW8A8Int8":  # CUTLASS layout: weight [K, N], channelwise scales
        s = layer.weight_scale[rows]
        return VllmLinear(
            layer.weight.t()[rows].float() * s, s, getattr(layer, "input_scale", None), layer, rows
        )
    if scheme == "CompressedTensorsWNA16":
        return VllmLinear(_wna16_weight(layer)[rows], layer.weight_scale[rows], None, layer, rows)
    if scheme == "CompressedTensorsW4A4Fp4":
        from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import dequantize_to_dtype

        w = dequantize_to_dtype(
            layer.weight, layer.weight_scale, layer.weight_global_scale, torch.float32, 16, swizzle=False
        )
        return VllmLinear(
            w[rows], layer.weight_global_scale, getattr(layer, "input_global_scale_inv", None), layer, rows
        )
    if scheme == "CompressedTensorsW4A8Fp8":  # [K/8, N] int4, [K/g, N] fp8, [N, 1] fp32 channel
        fp8 = layer.weight_scale.t().float()  # [N, K/g]
        group = layer.weight_packed.shape[0] * 8 // fp8.shape[1]
        s = fp8 * layer.weight_chan_scale  # fp8 group scale times the channel factor, fp32
        w = _int4_signed(layer.weight_packed) * s.repeat_interleave(group, dim=1)
        return VllmLinear(w[rows], s[rows], None, layer, rows)
    raise NotImplementedError(f"{name}: vLLM scheme {scheme} is not read back by the oracle")


def vllm_kv(vmodel, attn: str) -> dict[str, float]:
    """The k / v / q scales vLLM's attention ``<attn>.attn`` uses (``_k_scale_float`` ...)."""
    a = dict(vmodel.named_modules())[f"{attn}.attn"]
    return {r: float(getattr(a, f"_{r}_scale_float")) for r in ("k", "v", "q")}
