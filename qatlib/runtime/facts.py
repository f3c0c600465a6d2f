"""What each deployment runtime does with a qatlib export: which layouts load, and the load-time
transformations it applies to the trained scales.

Read from the releases named in `TARGETS` (not run; no GPU here): /work/shared/design/runtime-contract.md
has the full audit. Each fact carries the source file:line of that release. ``vLLM CT`` is
``vllm/model_executor/layers/quantization/compressed_tensors/``, ``SG CT`` is
``sglang/srt/layers/quantization/compressed_tensors/``.

A scheme is first classified into an export `Layout` (`layout_of`), the unit both runtimes
dispatch on; the facts are tables keyed by layout, so adding a runtime version is adding rows.
"""

from __future__ import annotations

import enum

from .cpu_int8 import NO_VNNI as CPU_INT8_NO_VNNI  # what a CPU kernel computes: beside its model
from .layouts import _GPU_SELECT as _GPU_SELECT
from .layouts import _NO_SGLANG as _NO_SGLANG
from .layouts import SGLANG as SGLANG
from .layouts import TARGET_NAMES as TARGET_NAMES
from .layouts import TARGETS as TARGETS
from .layouts import VLLM as VLLM
from .layouts import Fact as Fact
from .layouts import Layout as Layout
from .layouts import Runtime as Runtime
from .layouts import layout_of as layout_of

# --------------------------------------------------------------------------- load refusals
# (target, layout, moe) -> why the runtime refuses it at load. moe None: dense and MoE alike.
_REFUSALS: dict[tuple[str, Layout, bool | None], Fact] = {
    ("vllm", Layout.FP8_STATIC_CHANNEL, True): Fact(
        "fused MoE fp8 takes (tensor weight, tensor input) or (channel weight, token-dynamic input) only: "
        "AssertionError at load",
        "vLLM CT compressed_tensors_moe/compressed_tensors_moe_w8a8_fp8.py:66-76",
        checked_by="CompressedTensorsW8A8Fp8MoEMethod.__init__ through initialize_model; "
        "oracle refuses_fp8_static_channel_moe",
    ),
    ("sglang", Layout.FP8_STATIC_CHANNEL, True): Fact(
        "fused MoE fp8 asserts (tensor, tensor) or (channel, token): AssertionError at load",
        "SG CT schemes/w8a8_fp8_moe.py:56-70",
        checked_by=_NO_SGLANG,
    ),
    ("vllm", Layout.FP8_DYNAMIC_TENSOR, True): Fact(
        "fused MoE maps a dynamic per-tensor fp8 input to kFp8Dynamic128Sym, which no default MoE backend "
        "(Triton) implements; use per-token dynamic activations (granularity per-token)",
        "vLLM CT compressed_tensors_moe/compressed_tensors_moe_w8a8_fp8.py:94-98, experts/triton_moe.py:159-179",
        checked_by=_GPU_SELECT,
    ),
    ("vllm", Layout.FP8_WEIGHT_ONLY, True): Fact(
        "fp8 weight-only experts: AttributeError reading input_quant None (per-tensor) or 'only pack-quantized' "
        "ValueError (per-channel)",
        "vLLM CT compressed_tensors_moe/compressed_tensors_moe.py:90-103,173",
        checked_by="read only: on CPU the dense W8A16-FP8 layers find no kernel before the experts are built",
    ),
    ("sglang", Layout.FP8_WEIGHT_ONLY, True): Fact(
        "fp8 weight-only experts: AttributeError in _is_dynamic_token_w4a8(w, None)",
        "SG CT compressed_tensors.py:431-436,994",
        checked_by=_NO_SGLANG,
    ),
    ("vllm", Layout.INT8_STATIC, True): Fact(
        "int8 static-input experts: 'Unsupported FusedMoe scheme'",
        "vLLM CT compressed_tensors_moe.py:198-201",
        checked_by="CompressedTensorsMoEMethod.get_moe_method through initialize_model; oracle refuses_int8_static_moe",
    ),
    ("sglang", Layout.INT8_STATIC, True): Fact(
        "int8 static-input experts: no fused-MoE scheme",
        "SG CT compressed_tensors.py:980-996",
        checked_by=_NO_SGLANG,
    ),
    ("sglang", Layout.INT8_DYNAMIC, True): Fact(
        "int8 W8A8 fused MoE is implemented only for NPU",
        "SG CT compressed_tensors.py:980-986",
        checked_by=_NO_SGLANG,
    ),
    ("sglang", Layout.WNA16_ASYM, True): Fact(
        "asymmetric WNA16 experts: zero points are allocated (E, G, 2I/8) in AWQ layout, the export's "
        "[N/8, G] compressed-tensors zero points hit a shape mismatch",
        "SG CT schemes/wNa16_moe.py:193-216, moe/fused_moe_triton/layer.py:788-879",
        checked_by=_NO_SGLANG,
    ),
    ("sglang", Layout.WNA16_ODD_BITS, None): Fact(
        "WNA16 with 2/3/5/6/7 bits: ImportError / ValueError (Marlin is 4/8-bit only)",
        "SG CT compressed_tensors.py:737-751, schemes/wNa16_moe.py:83-91",
        checked_by=_NO_SGLANG,
    ),
    ("vllm", Layout.W4A8_STATIC, None): Fact(
        "no compressed-tensors scheme matches int4 weights with a static fp8 input",
        "vLLM CT compressed_tensors.py:783-950",
        checked_by="CompressedTensorsConfig._get_scheme_from_parts through initialize_model; "
        "oracle refuses_w4a8_static",
    ),
    ("sglang", Layout.W4A8_STATIC, None): Fact(
        "no compressed-tensors scheme matches int4 weights with a static fp8 input",
        "SG CT compressed_tensors.py:721-862",
        checked_by=_NO_SGLANG,
    ),
    # MXFP4 W4A4: the dense linears (attention at least) find no scheme, MoE or not
    ("sglang", Layout.MXFP4, None): Fact(
        "activation-quantized float4 only in the NVFP4 layout (tensor_group, group 16): NotImplementedError "
        "for MXFP4 W4A4 dense linears (MXFP4 experts alone would take Mxfp4MoEMethod)",
        "SG CT compressed_tensors.py:786-799 (experts :231-242)",
        checked_by=_NO_SGLANG,
    ),
    ("sglang", Layout.W4A8, None): Fact(
        "no dense compressed-tensors W4A8-FP8 scheme (the attention linears fail: 'No compressed-tensors "
        "compatible scheme')",
        "SG CT compressed_tensors.py:721-862",
        checked_by=_NO_SGLANG,
    ),
}

# (target, layout) -> the compute capabilities it needs (None: any the runtime supports).
_CAPABILITY: dict[tuple[str, Layout], tuple[tuple[str, ...], Fact]] = {
    ("vllm", Layout.W4A8): (
        ("9.0",),
        Fact(
            "the W4A8-FP8 CUTLASS kernel is selected on exactly SM90; elsewhere NotImplementedError",
            "vLLM CT compressed_tensors.py:648-654,817,947",
            checked_by="read only: the capability predicate needs a GPU; the oracle reports 9.0 to reach the scheme",
        ),
    ),
}


def load_refusal(
    target: str, layout: Layout, *, moe: bool | None, capability: str | None = None
) -> Fact | None:
    """Why ``target`` cannot load ``layout`` (None: it loads). ``moe`` None: not known yet (only
    refusals that hold for dense and MoE alike are reported); ``capability``: ``"9.0"`` style, None
    = not checked."""
    if target not in TARGETS:
        return None
    for key in ((target, layout, None), (target, layout, moe) if moe is not None else None):
        if key is not None and key in _REFUSALS:
            return _REFUSALS[key]
    need = _CAPABILITY.get((target, layout))
    if need is not None and capability is not None and capability not in need[0]:
        fact = need[1]
        return Fact(f"{fact.what} (deploy.capability is {capability})", fact.source, fact.checked_by)
    return None


# The CUTLASS W4A8 kernel's shape / dtype limits (vLLM 0.33 kernels/linear/mixed_precision/cutlass.py
# ``can_implement``, :29-55; MoE: compressed_tensors_moe_w4a8_fp8.py:69-73). Not a parse-time check:
# they depend on the model's sizes and dtype.
W4A8_KERNEL = Fact(
    "CUTLASS W4A8 needs group_size 128, K and N divisible by 128 and a bfloat16 model "
    "(MoE: hidden and intermediate divisible by 256)",
    "kernels/linear/mixed_precision/cutlass.py:29-55, compressed_tensors_moe_w4a8_fp8.py:69-73",
    checked_by="read only: CutlassW4A8LinearKernel.can_implement also requires CUDA SM90; the oracle's W4A8 "
    "path only meets the limits",
)


def w4a8_kernel_refusal(target: str, shapes, group_size: int, dtype, expert_shapes=()) -> Fact | None:
    """Why ``target``'s W4A8 kernel cannot run the quantized linears of ``shapes`` (``[N, K]`` each;
    ``expert_shapes``: the MoE experts') with ``group_size`` in a model of ``dtype`` (None: it
    can): vLLM's CUTLASS limits."""
    import torch

    if target != "vllm":
        return None
    bad = [f"group_size {group_size}"] if group_size != 128 else []
    if dtype != torch.bfloat16:
        bad.append(f"model dtype {str(dtype).removeprefix('torch.')}")
    odd = sorted({tuple(s) for s in shapes if s[0] % 128 or s[1] % 128})
    if odd:
        bad.append(f"linears shaped {', '.join(map(str, odd[:3]))}")
    odd = sorted({tuple(s) for s in expert_shapes if s[0] % 256 or s[1] % 256})
    if odd:
        bad.append(f"experts shaped {', '.join(map(str, odd[:3]))}")
    if not bad:
        return None
    return Fact(
        f"{W4A8_KERNEL.what}; this export has {'; '.join(bad)}", W4A8_KERNEL.source, W4A8_KERNEL.checked_by
    )


# vLLM's fused-MoE weight loader keeps ONE w13 input scale per expert and refuses a checkpoint whose
# gate (w1) and up (w3) input scales of one expert differ (found by the oracle, not in the reading:
# QAT that does not tie them makes an export vLLM cannot load)
EXPERT_W13_INPUT_TOLERANCE = 1e-5  # absolute, ``(param - loaded).abs() > 1e-5``
EXPERT_W13_INPUT_SCALES = Fact(
    "fused-MoE fp8 static: an expert's gate (w1) and up (w3) input_scale must agree within 1e-5 (absolute): "
    "ValueError 'input_scales of w1 and w3 of a layer must be equal' at load (within it the last loaded wins)",
    "fused_moe/routed_experts.py:826-862 (RoutedExperts.weight_loader)",
    checked_by="RoutedExperts.weight_loader through Qwen3MoeForCausalLM.load_weights; oracle "
    "fp8_static_moe_w13_apart (an export with them apart: vLLM and the emulator both refuse it)",
)


def expert_input_scale_refusal(target: str, layout: Layout, pairs) -> Fact | None:
    """Why ``target`` refuses a MoE export whose experts' ``(name, gate input scale, up input
    scale)`` ``pairs`` differ (None: it loads them)."""
    if target != "vllm" or layout not in (
        Layout.FP8_STATIC_TENSOR,
        Layout.FP8_STATIC_CHANNEL,
        Layout.FP8_NATIVE_STATIC,
    ):
        return None
    apart = [n for n, g, u in pairs if abs(float(g) - float(u)) > EXPERT_W13_INPUT_TOLERANCE]
    if not apart:
        return None
    more = f" and {len(apart) - 3} more" if len(apart) > 3 else ""
    fact = EXPERT_W13_INPUT_SCALES
    return Fact(f"{fact.what}; apart in {', '.join(apart[:3])}{more}", fact.source, fact.checked_by)


NATIVE_FP8_DTYPES = {  # the fp8 format's Fp8Config.get_supported_act_dtypes (compressed-tensors': float32 too)
    "vllm": Fact(
        "quant_method fp8 (Fp8Config) serves bfloat16 / float16 models only: ValueError '<dtype> is not supported "
        "for quantization method fp8' while the config is built",
        "fp8.py:141-143, config/vllm.py:937-943",
        checked_by="VllmConfig (quant_config.get_supported_act_dtypes); oracle refuses_fp8_native_fp32",
    ),
    "sglang": Fact(
        "quant_method fp8 (Fp8Config) serves bfloat16 / float16 models only",
        "fp8.py:326-327",
        checked_by=_NO_SGLANG,
    ),
}


def dtype_refusal(target: str, layout: Layout, dtype) -> Fact | None:
    """Why ``target`` refuses an export of ``layout`` for a model of ``dtype`` (None: it loads)."""
    half = str(dtype).removeprefix("torch.") in ("bfloat16", "float16")
    if half or target not in NATIVE_FP8_DTYPES or layout not in _NATIVE:
        return None
    return NATIVE_FP8_DTYPES[target]


# --------------------------------------------------------------------------- load-time transformations
class Transform(enum.Enum):
    """What a runtime does to the checkpoint's scales at load / run time."""

    WEIGHT_SCALE_MAX = "fused shards' per-tensor weight scales -> their max; shards requantized to it"
    EXPERT_WEIGHT_SCALE_MAX = (
        "each expert's gate / up (w1 / w3) weight scales -> their max; requantized to it"
    )
    INPUT_SCALE_MAX = "fused shards' static input scales -> their max"
    INPUT_SCALE_LAST = "fused shards' static input scale -> the last-loaded shard's"
    EXPERT_INPUT_SCALE_MAX = "every expert's static input scale of one MoE layer -> the max over experts"
    DYNAMIC_PER_TOKEN = "dynamic per-tensor fp8 input -> quantized per token"
    SCALE_MODEL_DTYPE = "weight scales stored in the model dtype (bf16 / fp16), not fp32"
    W4A8_FP8_GROUP_SCALES = (
        "int4 group scales -> model dtype -> fp8 per output row with an fp32 channel factor"
    )
    FP4_GLOBAL_SCALE_MAX = (
        "fused shards' NVFP4 global scales (weight; input for W4A4) -> their max, one per fused linear: a "
        "shard with another weight global scale dequantizes off by its ratio to the max"
    )
    FP4_GLOBAL_SCALE_MUST_MATCH = (
        "fused shards must share one NVFP4 weight global scale: ValueError at load when they differ"
    )
    EXPERT_W13_GLOBAL_SCALE = "each expert's w3 (up) NVFP4 weight global scale -> its w1's (gate's)"
    FP4_ACTIVATIONS_UNQUANTIZED = (
        "below SM100 (no FP4 tensor cores) a W4A4 FP4 checkpoint is served weight-only (Marlin W4A16): "
        "activations are not quantized, the trained input global scales are dropped"
    )


_FP8_STATIC = (Layout.FP8_STATIC_TENSOR, Layout.FP8_STATIC_CHANNEL)
_NATIVE = (Layout.FP8_NATIVE_STATIC, Layout.FP8_NATIVE_DYNAMIC)  # quant_method: fp8 (their Fp8Config)
# (target, transform) -> (layouts it applies to, moe: None both / True MoE layers / False dense, fact)
_TRANSFORMS: list[tuple[str, Transform, tuple[Layout, ...], Fact]] = [
    (
        "vllm",
        Transform.WEIGHT_SCALE_MAX,
        (Layout.FP8_STATIC_TENSOR, Layout.FP8_DYNAMIC_TENSOR),
        Fact(
            "requantize_with_max_scale over q/k/v, gate/up and each expert's w1/w3",
            "fp8_utils.py:1454-1476,1537-1567",
            checked_by="CompressedTensorsW8A8Fp8.process_weights_after_loading (requantize_with_max_scale), "
            "CompressedTensorsW8A8Fp8MoEMethod.process_weights_after_loading (process_fp8_weight_tensor_strategy_moe); "
            "oracle fp8_static_dense, fp8_dynamic_dense, fp8_static_moe",
        ),
    ),
    (
        "vllm",
        Transform.INPUT_SCALE_MAX,
        _FP8_STATIC,
        Fact(
            "input_scale.max() over shards",
            "vLLM CT schemes/w8a8_fp8.py:185-186",
            checked_by="CompressedTensorsW8A8Fp8.process_weights_after_loading; oracle fp8_static_dense",
        ),
    ),
    (
        "vllm",
        Transform.INPUT_SCALE_LAST,
        (Layout.INT8_STATIC,),
        Fact(
            "input_scale is a BasevLLMParameter(1): each shard overwrites it",
            "vLLM CT schemes/w8a8_int8.py:86-97, parameter.py:91-107",
            checked_by="BasevLLMParameter.load_qkv_weight / load_merged_column_weight, then "
            "CutlassInt8ScaledMMLinearKernel.process_weights_after_loading; oracle int8_static_dense",
        ),
    ),
    (
        "vllm",
        Transform.EXPERT_INPUT_SCALE_MAX,
        _FP8_STATIC,
        Fact(
            "w13/w2 input scales: max over all experts",
            "fp8_utils.py:1570-1585",
            checked_by="CompressedTensorsW8A8Fp8MoEMethod.process_weights_after_loading "
            "(process_fp8_input_tensor_strategy_moe); oracle fp8_static_moe",
        ),
    ),
    (
        "vllm",
        Transform.DYNAMIC_PER_TOKEN,
        (Layout.FP8_DYNAMIC_TENSOR,),
        Fact(
            "dynamic fp8 input always uses kFp8DynamicTokenSym (dense layers)",
            "vLLM CT schemes/w8a8_fp8.py:45-49",
            checked_by="CompressedTensorsW8A8Fp8.activation_quant_key (kFp8DynamicTokenSym) through QuantFP8.forward_native; "
            "oracle fp8_dynamic_dense",
        ),
    ),
    (
        "vllm",
        Transform.SCALE_MODEL_DTYPE,
        (Layout.WNA16, Layout.WNA16_ASYM, Layout.WNA16_ODD_BITS, Layout.W4A8),
        Fact(
            "weight_scale allocated in params_dtype",
            "vLLM CT schemes/compressed_tensors_wNa16.py:188-196, w4a8_fp8.py:129-136",
            checked_by="CompressedTensorsWNA16.create_weights + weight loading + apply_weights (batch-invariant dequantization "
            "in the scale dtype); oracle wna16_int4_group (W4A8: w4a8_fp8_dense)",
        ),
    ),
    (
        "vllm",
        Transform.W4A8_FP8_GROUP_SCALES,
        (Layout.W4A8,),
        Fact(
            "convert_packed_uint4b8_to_signed_int4 + group scales to fp8 per row",
            "quant_utils.py:931-973, kernels/linear/mixed_precision/cutlass.py:66-85",
            checked_by="CutlassW4A8LinearKernel.process_weights_after_loading (convert_bf16_scales_to_fp8, "
            "convert_packed_uint4b8_to_signed_int4_inplace) and its QuantFP8 per-token input; oracle w4a8_fp8_dense",
        ),
    ),
    # FP4 (vLLM 0.33; schemes/compressed_tensors_w4a4_nvfp4.py serves both NVFP4 W4A4 and W4A16)
    (
        "vllm",
        Transform.FP4_GLOBAL_SCALE_MAX,
        (Layout.NVFP4, Layout.NVFP4_A16),
        Fact(
            "weight_global_scale.max() / input_global_scale.max() over the fused shards (warns when they differ)",
            "vLLM CT schemes/compressed_tensors_w4a4_nvfp4.py:100-135",
            checked_by="CompressedTensorsW4A4Fp4.process_weights_after_loading, dequantize_to_dtype, ref_nvfp4_quant_dequant; "
            "oracle nvfp4_dense",
        ),
    ),
    (
        "vllm",
        Transform.EXPERT_W13_GLOBAL_SCALE,
        (Layout.NVFP4, Layout.NVFP4_A16),
        Fact(
            "a single w13 gscale: w13_weight_global_scale[:, 0] (warns unless w1's == w3's)",
            "vLLM CT compressed_tensors_moe/compressed_tensors_moe_w4a4_nvfp4.py:223-231",
            checked_by="CompressedTensorsW4A4Nvfp4MoEMethod.process_weights_after_loading, dequantize_to_dtype; "
            "oracle nvfp4_moe",
        ),
    ),
    (
        "vllm",
        Transform.FP4_ACTIVATIONS_UNQUANTIZED,
        (Layout.NVFP4, Layout.MXFP4),
        Fact(
            "NVFP4: CUTLASS / FlashInfer FP4 GEMMs need SM100+, then the weight-only Marlin fallback (SM75+) is "
            "picked; MXFP4: FlashInfer needs SM100+, else Marlin (warns, activations unquantized) or emulation",
            "kernels/linear/__init__.py:592-608,625-632, kernels/linear/mxfp4/flashinfer.py:26-30, "
            "kernels/linear/mxfp4/marlin.py:16-30, quantization/utils/marlin_utils_fp4.py:34-35",
            checked_by=_GPU_SELECT,
        ),
    ),
    # the runtimes' own fp8 format (quant_method: fp8): layers/quantization/fp8.py of each (their Fp8Config)
    (
        "vllm",
        Transform.WEIGHT_SCALE_MAX,
        _NATIVE,
        Fact(
            "Fp8LinearMethod: process_fp8_weight_tensor_strategy over q/k/v, gate/up; Fp8MoEMethod: "
            "process_fp8_weight_tensor_strategy_moe over each expert's w1/w3",
            "fp8.py:383-409,751-761, fp8_utils.py:1454-1476,1537-1567",
            checked_by="Fp8LinearMethod / Fp8MoEMethod.process_weights_after_loading; oracle fp8_native_dense, "
            "fp8_native_moe",
        ),
    ),
    (
        "vllm",
        Transform.INPUT_SCALE_MAX,
        (Layout.FP8_NATIVE_STATIC,),
        Fact(
            "input_scale.max() over shards",
            "fp8.py:403-405",
            checked_by="Fp8LinearMethod.process_weights_after_loading; oracle fp8_native_dense",
        ),
    ),
    (
        "vllm",
        Transform.EXPERT_INPUT_SCALE_MAX,
        (Layout.FP8_NATIVE_STATIC,),
        Fact(
            "w13/w2 input scales: max over all experts",
            "fp8.py:740-750, fp8_utils.py:1570-1585",
            checked_by="Fp8MoEMethod.process_weights_after_loading (process_fp8_input_tensor_strategy_moe); "
            "oracle fp8_native_moe",
        ),
    ),
    (
        "vllm",
        Transform.DYNAMIC_PER_TOKEN,
        (Layout.FP8_NATIVE_DYNAMIC,),
        Fact(
            "dense layers quantize a dynamic input per token where CUTLASS fp8 runs (cutlass_fp8_supported: CUDA "
            "SM89+), per tensor elsewhere; fused-MoE experts per tensor (kFp8DynamicTensorSym)",
            "fp8.py:273-280,509-519, utils/w8a8_utils.py:11-18",
            checked_by=_GPU_SELECT,
        ),
    ),
    (
        "sglang",
        Transform.INPUT_SCALE_MAX,
        (Layout.FP8_NATIVE_STATIC,),
        Fact(
            "input_scale.max() over shards; the weight scales go channelwise (convert_to_channelwise: each shard "
            "keeps its own, no requantization) and a dynamic input stays per tensor on the CUTLASS path",
            "fp8.py:1205-1216,1259-1272",
            checked_by=_NO_SGLANG,
        ),
    ),
    (
        "sglang",
        Transform.EXPERT_INPUT_SCALE_MAX,
        (Layout.FP8_NATIVE_STATIC,),
        Fact("w13/w2 input scales: max over the experts", "fp8.py:2651-2670", checked_by=_NO_SGLANG),
    ),
    (
        "sglang",
        Transform.EXPERT_WEIGHT_SCALE_MAX,
        _NATIVE,
        Fact(
            "each expert's w13 shards requantized to their max scale",
            "fp8.py:2704-2723",
            checked_by=_NO_SGLANG,
        ),
    ),
    (
        "sglang",
        Transform.FP4_GLOBAL_SCALE_MAX,
        (Layout.NVFP4,),
        Fact(
            "input_global_scale.max() / weight_global_scale.max() over fused shards (SM100 W4A4 path)",
            "SG CT schemes/compressed_tensors_w4a4_nvfp4.py:95-99",
            checked_by=_NO_SGLANG,
        ),
    ),
    (
        "sglang",
        Transform.FP4_GLOBAL_SCALE_MUST_MATCH,
        (Layout.NVFP4, Layout.NVFP4_A16),
        Fact(
            "CompressedTensorsW4A16Fp4 (weight-only, and W4A4 below SM100) raises unless torch.unique(global_scale) "
            "has one value",
            "SG CT schemes/compressed_tensors_w4a16_nvfp4.py:205-214",
            checked_by=_NO_SGLANG,
        ),
    ),
    (
        "sglang",
        Transform.FP4_ACTIVATIONS_UNQUANTIZED,
        (Layout.NVFP4,),
        Fact(
            "CompressedTensorsW4A4Fp4 needs SM100; below it (or with --fp4-gemm-backend marlin) the dense "
            "linears are served by CompressedTensorsW4A16Fp4 (FP4 Marlin, SM80+), input_global_scale dropped",
            "SG CT compressed_tensors.py:757-782, schemes/compressed_tensors_w4a4_nvfp4.py:37-38, "
            "schemes/compressed_tensors_w4a16_nvfp4.py:135-137",
            checked_by=_NO_SGLANG,
        ),
    ),
    (
        "sglang",
        Transform.WEIGHT_SCALE_MAX,
        (Layout.FP8_STATIC_TENSOR, Layout.FP8_DYNAMIC_TENSOR),
        Fact(
            "requantize_with_max_scale over fused shards",
            "SG CT schemes/w8a8_fp8.py:149",
            checked_by=_NO_SGLANG,
        ),
    ),
    (
        "sglang",
        Transform.INPUT_SCALE_MAX,
        (*_FP8_STATIC, Layout.INT8_STATIC),
        Fact(
            "PerTensorScaleParameter then max",
            "SG CT schemes/w8a8_fp8.py:234-235, w8a8_int8.py",
            checked_by=_NO_SGLANG,
        ),
    ),
    (
        "sglang",
        Transform.EXPERT_INPUT_SCALE_MAX,
        _FP8_STATIC,
        Fact("input max over experts", "SG CT schemes/w8a8_fp8_moe.py:242-260", checked_by=_NO_SGLANG),
    ),
    (
        "sglang",
        Transform.DYNAMIC_PER_TOKEN,
        (Layout.FP8_DYNAMIC_TENSOR,),
        Fact(
            "use_per_token_if_dynamic=True (dense layers; MoE keeps per-tensor)",
            "SG CT schemes/w8a8_fp8.py:258",
            checked_by=_NO_SGLANG,
        ),
    ),
    (
        "sglang",
        Transform.SCALE_MODEL_DTYPE,
        (Layout.WNA16, Layout.WNA16_ASYM),
        Fact("weight_scale allocated in params_dtype", "SG CT schemes/wNa16.py:55-58", checked_by=_NO_SGLANG),
    ),
]

# Transforms that only touch dense (non-expert) layers / only MoE experts.
DENSE_ONLY = frozenset({Transform.DYNAMIC_PER_TOKEN, Transform.INPUT_SCALE_LAST})
EXPERTS_ONLY = frozenset(
    {Transform.EXPERT_INPUT_SCALE_MAX, Transform.EXPERT_W13_GLOBAL_SCALE, Transform.EXPERT_WEIGHT_SCALE_MAX}
)


def transform_key(target: str, t: Transform, layout: Layout) -> str:
    """The facts-table key of ``target``'s ``t`` for ``layout``: ``<target>:<name>``, the fp8
    format's own rows suffixed ``_FP8_FORMAT`` (both formats have a WEIGHT_SCALE_MAX)."""
    return f"{target}:{t.name}" + ("_FP8_FORMAT" if layout in _NATIVE else "")


def transforms(target: str, layout: Layout) -> list[tuple[Transform, Fact]]:
    """The load-time transformations ``target`` applies to an export of ``layout``, in order."""
    return [(t, f) for tg, t, layouts, f in _TRANSFORMS if tg == target and layout in layouts]


# --------------------------------------------------------------------------- KV cache
# What vLLM's attention holds after loading a per-tensor fp8 kv_cache_scheme (checked, not a difference)
KV_SCALES = Fact(
    "per-tensor <attn>.k_scale / v_scale load as exported (remapped to <attn>.attn.*); q_scale stays 1.0",
    "vLLM CT compressed_tensors.py:1093-1166, layers/quantization/kv_cache.py (BaseKVCacheMethod)",
    checked_by="Qwen3ForCausalLM.load_weights + CompressedTensorsKVCacheMethod.process_weights_after_loading "
    "(_k_scale_float / _v_scale_float / _q_scale_float); oracle fp8_static_dense",
)
KV_QUERY_FA3 = Fact(
    "queries are quantized to fp8 with q_scale 1.0 under FlashAttention 3 (training does not model it)",
    "layers/attention/attention.py:470-526",
    checked_by="read only: FlashAttention 3 is a GPU backend (the oracle checks that q_scale loads as 1.0)",
)
KV_PER_HEAD = Fact(
    "per-head k/v scales need FlashAttention >= 3; other backends use the max over heads",
    "v1/attention/backends/flash_attn.py:411-414, compressed_tensors.py:1257-1267",
    checked_by=_GPU_SELECT,
)
SGLANG_KV_PER_HEAD = Fact(
    "a per-head kv_cache_scheme is ignored with a warning: the KV cache stays bf16, scales dropped",
    "SG CT compressed_tensors.py:212-224",
    checked_by=_NO_SGLANG,
)


def kv_facts(target: str, *, per_head: bool, moe: bool) -> list[Fact]:
    """What ``target`` does with exported fp8 KV scales (empty: used as trained)."""
    if target == "vllm":
        return [KV_QUERY_FA3, KV_PER_HEAD] if per_head else [KV_QUERY_FA3]
    if target == "sglang" and per_head:
        return [SGLANG_KV_PER_HEAD]
    return []


# --------------------------------------------------------------------------- every fact
def all_facts():
    """Every fact of this module as ``(key, Fact)``, keys ``"<runtime>:<name>"`` (the transforms'
    ``Transform`` names; refusals ``REFUSES_<layout>[_MOE|_DENSE]``): the rows of
    docs/runtime-oracle.md and of ``python -m qatlib.runtime.check``."""
    for (target, layout, moe), fact in _REFUSALS.items():
        yield f"{target}:REFUSES_{layout.name}{'' if moe is None else '_MOE' if moe else '_DENSE'}", fact
    for (target, layout), (_, fact) in _CAPABILITY.items():
        yield f"{target}:CAPABILITY_{layout.name}", fact
    yield "vllm:W4A8_KERNEL_LIMITS", W4A8_KERNEL
    for target, fact in NATIVE_FP8_DTYPES.items():
        yield f"{target}:FP8_NATIVE_DTYPES", fact
    yield "vllm:EXPERT_W13_INPUT_SCALES_EQUAL", EXPERT_W13_INPUT_SCALES
    for target, t, layouts, fact in _TRANSFORMS:
        yield transform_key(target, t, layouts[0]), fact
    yield "vllm:KV_SCALES", KV_SCALES
    yield "vllm:KV_QUERY_FA3", KV_QUERY_FA3
    yield "vllm:KV_PER_HEAD", KV_PER_HEAD
    yield "sglang:KV_PER_HEAD_IGNORED", SGLANG_KV_PER_HEAD
    yield "vllm:CPU_INT8_GEMM_NO_VNNI", CPU_INT8_NO_VNNI
