"""The compressed-tensors format a `QuantScheme` exports as: the one mapping, with runtime notes.

`compressed_tensors_format` maps qatlib's typed scheme onto compressed-tensors' own
`QuantizationArgs` / `QuantizationScheme` and compression format (the table in `qatlib.export`'s
docstring), or raises `ExportError` for what has no counterpart, and records where the deployed
arithmetic differs from the trained fake-quant model (`CTFormat.changes` / `runtime_notes`).
`qatlib.export` writes checkpoints with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..quant import QuantScheme, QuantSpec
from ..quant.spec import CheckpointFormat, Granularity, ScaleRule

W4A8_ACTIVATION_MODES = ("runtime", "trained")


class ExportError(ValueError):
    """The model / scheme / format combination cannot be exported (raised before writing)."""


# --------------------------------------------------------------------------- scheme mapping
@dataclass(frozen=True)
class CTFormat:
    """The compressed-tensors side of one `QuantScheme`.

    scheme: the `QuantizationScheme` every quantized linear gets (targets ``["Linear"]``).
    format: the compression format (``float-quantized``, ``pack-quantized``, ``int-quantized``).
    kv_cache: ``kv_cache_scheme`` for static k/v outputs (``<attn>.k_scale`` / ``v_scale``).
    changes: where the exported arithmetic differs from the trained fake-quant model.
    runtime_notes: why vLLM (the deployment target) may refuse or treat differently this layout.
    """

    scheme: Any
    format: str
    kv_cache: Any | None
    changes: tuple[str, ...] = ()
    runtime_notes: tuple[str, ...] = ()


def _strategy(spec: QuantSpec):
    from compressed_tensors.quantization import QuantizationStrategy as S

    return {
        Granularity.TENSOR: S.TENSOR,
        Granularity.CHANNEL: S.CHANNEL,
        Granularity.GROUP: S.GROUP,
        Granularity.TOKEN: S.TOKEN,
        Granularity.HEAD: S.ATTN_HEAD,
    }[spec.granularity]


def _ct_fp4_args(spec: QuantSpec):
    """NVFP4 / MXFP4 as compressed-tensors' own presets write them (``NVFP4``, ``MXFP4``,
    ``*A16`` in `quant_scheme.py`): NVFP4 ``tensor_group`` with E4M3 scales (activations
    ``dynamic: local``: group scales at run time, static ``input_global_scale``), MXFP4 ``group``
    32 with uint8 (E8M0 exponent) scales."""
    import torch as _t
    from compressed_tensors.quantization import (
        DynamicType,
        QuantizationArgs,
        QuantizationStrategy,
        QuantizationType,
    )

    nv = spec.has_global_scale
    dtype = _t.float8_e4m3fn if nv else _t.uint8
    dynamic: Any = False
    if spec.dynamic:
        dynamic = DynamicType.LOCAL if nv else True
    return QuantizationArgs(
        num_bits=4,
        type=QuantizationType.FLOAT,
        strategy=QuantizationStrategy.TENSOR_GROUP if nv else QuantizationStrategy.GROUP,
        symmetric=True,
        dynamic=dynamic,
        group_size=spec.group_size,
        scale_dtype=dtype,
        zp_dtype=dtype,
        **({"observer": "static_minmax"} if nv and spec.dynamic else {}),
    )


def ct_args(spec: QuantSpec):
    """Our `QuantSpec` as compressed-tensors `QuantizationArgs` (same scale convention)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationType

    if spec.is_fp4:
        return _ct_fp4_args(spec)
    return QuantizationArgs(
        num_bits=spec.bits,
        type=QuantizationType.FLOAT if spec.is_fp8 else QuantizationType.INT,
        symmetric=spec.symmetric,
        strategy=_strategy(spec),
        group_size=spec.group_size if spec.granularity is Granularity.GROUP else None,
        dynamic=spec.dynamic,
    )


def compressed_tensors_format(scheme: QuantScheme, *, w4a8_activation: str = "runtime") -> CTFormat:
    """Map ``scheme`` to compressed-tensors, or raise `ExportError` for what has no counterpart.

    W4A8-FP8 (int weights + FP8 activations) follows vLLM's ``CompressedTensorsW4A8Fp8`` layout
    (compressed-tensors preset ``W4AFP8``): packed int32 weights (``pack-quantized``) and FP8
    per-token dynamic activations, the only activation mode that kernel has. With
    ``w4a8_activation="runtime"`` (default) a static per-tensor FP8 input scale is therefore
    replaced by per-token dynamic quantization (recorded in ``changes``); ``"trained"`` keeps the
    trained static scale (transformers reproduces the trained model; vLLM has no kernel for it).
    """
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, QuantizationStrategy

    if w4a8_activation not in W4A8_ACTIVATION_MODES:
        raise ExportError(f"w4a8_activation must be one of {W4A8_ACTIVATION_MODES}; got {w4a8_activation!r}")
    w, a = scheme.weight, scheme.input
    if w is None:
        raise ExportError(
            f"scheme {scheme.name!r} quantizes no weight: a 'real' export needs weight quantization"
        )
    if scheme.q is not None:
        raise ExportError(
            f"scheme {scheme.name!r} quantizes the q projection output ({scheme.q.describe()}): qatlib does not export "
            "query scales (vLLM 0.33 loads a per-tensor <attn>.q_scale only for fp8 attention with FlashAttention 3, "
            "compressed_tensors.py:1160-1166); export without scheme.q (k/v map to the KV cache)"
        )
    if a is not None and a.granularity is Granularity.HEAD:
        raise ExportError(
            f"per-head input activations ({a.describe()}) have no compressed-tensors counterpart"
        )
    changes: list[str] = []
    notes: list[str] = []
    wargs = ct_args(w)
    aargs = None if a is None else ct_args(a)
    if w.is_fp4 or (a is not None and a.is_fp4):
        fmt = _fp4_format(w, a, notes)
        if a is not None and a.scale_rule is ScaleRule.CEIL:
            changes.append(MXFP4_CEIL_ACTIVATIONS)
        if w.subgroups:
            notes.append(
                f"FOCUS sub-group scales ({w.subgroups} per group of {w.group_size}) are folded into the E2M1 codes "
                "(upstream's export does the same): the runtime computes codes x group scale, the trained weight"
            )
    elif w.is_fp8:
        fmt = CompressionFormat.float_quantized
        if w.granularity is Granularity.GROUP:
            notes.append(
                "vLLM's FP8 linear kernels take per-tensor or per-channel weight scales, not per-group"
            )
        if a is not None and not a.is_fp8:
            raise ExportError(
                f"fp8 weights with {a.qtype} activations have no compressed-tensors / vLLM layout"
            )
        if a is None:
            notes.append("FP8 weight-only (W8A16-FP8): vLLM runs it with the Marlin FP8 kernel")
    elif a is None:
        fmt = CompressionFormat.pack_quantized
        if w.bits not in (4, 8):
            notes.append(
                f"vLLM's mainstream WNA16 kernels (Marlin / Machete) support 4 and 8 bits, not {w.bits} (vLLM 0.33 runs "
                "it only with the optional Humming kernel); SGLang 0.5.23 refuses it"
            )
        if w.granularity is Granularity.GROUP and w.group_size not in (32, 64, 128):
            notes.append(f"vLLM's Marlin WNA16 kernels support group sizes 32/64/128, not {w.group_size}")
        if w.granularity is Granularity.TENSOR:
            notes.append("vLLM's WNA16 kernels take per-channel or per-group weight scales, not per-tensor")
    elif a.is_fp8:
        # W4A8-FP8: vLLM CompressedTensorsW4A8Fp8 (packed int4 weights, FP8 per-token dynamic acts).
        fmt = CompressionFormat.pack_quantized
        runtime_act = QuantizationArgs(
            num_bits=8, type="float", strategy=QuantizationStrategy.TOKEN, symmetric=True, dynamic=True
        )
        if not (a.granularity is Granularity.TOKEN and a.dynamic):
            if w4a8_activation == "runtime":
                aargs = runtime_act
                changes.append(
                    f"input activations: trained {a.describe()}, exported as fp8 per-token dynamic (the only "
                    "activation mode of vLLM's W4A8-FP8 kernel); the trained input_scale is not used"
                )
            else:
                notes.append(
                    "vLLM's W4A8-FP8 kernel needs fp8 per-token dynamic activations, not " + a.describe()
                )
        if w.bits != 4 or w.granularity is not Granularity.GROUP or w.group_size != 128 or not w.symmetric:
            notes.append(
                f"vLLM's W4A8-FP8 kernel needs int4 symmetric weights with group size 128, not {w.describe()}"
            )
        notes.append(
            "vLLM 0.33's W4A8-FP8 kernel needs exactly SM90 (not SM89 / SM100: compressed_tensors.py:648-654), "
            "K and N % 128 and a bf16 model (cutlass.py:29-55), MoE hidden and per-TP intermediate sizes % 256 "
            "(compressed_tensors_moe_w4a8_fp8.py:69-73); it re-quantizes the group scales to FP8 per output row "
            "(quant_utils.py:931-954). SGLang 0.5.23 has no dense W4A8-FP8 scheme: it cannot load this export"
        )
    else:
        fmt = CompressionFormat.int_quantized
        if not (w.bits == 8 and a.bits == 8):
            notes.append(
                f"vLLM's integer W8A8 kernels need int8 weights and activations, not {w.qtype}/{a.qtype}"
            )
        if w.granularity not in (Granularity.TENSOR, Granularity.CHANNEL) or not w.symmetric:
            notes.append("vLLM's int8 W8A8 kernels need symmetric per-tensor or per-channel weights")
        if a.dynamic and a.symmetric:
            changes.append(
                "dynamic symmetric int activations: compressed-tensors' own (CPU) forward divides the absmax by "
                f"{(a.qmax - a.qmin) / 2:g}, qatlib and vLLM by {a.qmax:g} (scales are computed at run time)"
            )
    if w.fp8_recast:
        changes.append(
            "weights: the checkpoint holds the int4 codes and group scales; vLLM's W4A8-FP8 kernel keeps the codes "
            "and re-quantizes the scales to FP8 per output row (quant_utils.py:931-954). A model trained with "
            "deploy.target vllm computed exactly that (deployment.trained_as_deployed); one trained with "
            "fp8_recast (deploy.target none: a per-tensor FP8 recast of the dequantized weight) did not"
        )
    if scheme.fp8_attn:
        notes.append(
            "fp8_attn is a training-time simulation: FP8 attention is a runtime setting, not in the checkpoint"
        )

    kv = None
    k, v = scheme.k, scheme.v
    if k is not None or v is not None:
        if k is None or v is None or k.replace(num_heads=None) != v.replace(num_heads=None):
            raise ExportError(
                "compressed-tensors has one kv_cache_scheme for keys and values: scheme.k and scheme.v must both be "
                f"set and equal (got k={k and k.describe()}, v={v and v.describe()})"
            )
        if k.dynamic or k.granularity not in (Granularity.TENSOR, Granularity.HEAD):
            raise ExportError(
                f"KV-cache quantization exports static per-tensor or per-head scales, not {k.describe()}"
            )
        kv = ct_args(k.replace(num_heads=None))
        if not k.is_fp8:
            notes.append(f"vLLM's / SGLang's compressed-tensors KV cache is fp8, not {k.describe()}")
        elif k.granularity is Granularity.HEAD:
            notes.append(
                "per-head KV scales: vLLM 0.33 uses them with FlashAttention 3 (flash_attn.py:411-414), other "
                "backends take the max over heads; SGLang 0.5.23 ignores a per-head kv_cache_scheme (KV stays bf16)"
            )
    if scheme.checkpoint_format is CheckpointFormat.FP8:
        notes.append(FP8_NATIVE_NOTE)
    ct_scheme = QuantizationScheme(targets=["Linear"], weights=wargs, input_activations=aargs, format=fmt)
    return CTFormat(ct_scheme, fmt.value, kv, tuple(changes), tuple(notes))


# `CheckpointFormat.FP8` (upstream's save_name: fp8): compressed-tensors' own tensors, another header
FP8_NATIVE_NOTE = (
    "quant_method fp8 (upstream's save_name: fp8): the tensors compressed-tensors writes for fp8 per-tensor "
    "(weight, weight_scale, input_scale) under vLLM's / SGLang's own Fp8Config header (activation_scheme, "
    "ignored_layers). vLLM 0.33 quantizes a dynamic input per token on dense layers where CUTLASS fp8 runs "
    "(SM89+) and per tensor in the fused-MoE experts, which compressed-tensors' dynamic per-tensor layout has "
    "no MoE kernel for; transformers 5.24 reads quant_method fp8 as its block-wise FineGrainedFP8 and cannot "
    "reload this checkpoint (the export variant of the evaluation is skipped; the deployed variant emulates it)"
)


# Runtime facts for the FP4 exports (vLLM 0.33 / SGLang 0.5.23; /work/shared/design/runtime-contract.md).
NVFP4_NOTES = (
    "NVFP4 W4A4 runs natively (FP4 tensor cores) only on Blackwell: SM100 (B200/GB200) and SM120 "
    "(RTX 50xx / RTX PRO) through vLLM's CompressedTensorsW4A4Nvfp4 (CUTLASS / FlashInfer FP4 GEMM); "
    "on older GPUs vLLM falls back to Marlin W4A16 (weights only, activations stay 16-bit)",
    "NVFP4 MoE: vLLM's CompressedTensorsW4A4Nvfp4MoEMethod (CUTLASS / FlashInfer / TRT-LLM fused FP4 MoE) on "
    "SM100; Marlin MoE W4A16 before Blackwell; every expert's w1/w3 must share one weight_global_scale and "
    "input_global_scale (vLLM takes their max / one per expert), so per-projection global scales differ",
)
NVFP4A16_NOTES = (
    "NVFP4 weight-only (W4A16): vLLM's CompressedTensorsW4A16Fp4 runs it through the Marlin FP4 kernel on "
    "Ampere / Ada / Hopper (SM80+) and Blackwell, dense and MoE (Marlin MoE)",
)
MXFP4_NOTES = (
    "MXFP4: vLLM's compressed-tensors MXFP4 path (CompressedTensorsW4A16Mxfp4 / W4A4Mxfp4) runs W4A4 "
    "natively only on Blackwell (SM100, block-scaled FP4 MMA); earlier GPUs use the Marlin MXFP4 W4A16 "
    "kernel (activations 16-bit); MoE through Marlin / FlashInfer MXFP4 MoE; SGLang 0.5.23 loads "
    "compressed-tensors MXFP4 only on Blackwell",
)


# upstream FOCUS's mxfp4_rceil activations: a runtime computes MXFP4 activation scales with its own rule
MXFP4_CEIL_ACTIVATIONS = (
    "input activations: trained with ceil-rounded E8M0 group scales, 2**ceil(log2(amax / 6)) (upstream FOCUS's "
    "mxfp4_rceil); the checkpoint stores no activation scale and vLLM 0.33 quantizes MXFP4 activations at run "
    "time with its own rule (FlashInfer's mxfp4_quantize on SM100, kernels/linear/mxfp4/flashinfer.py:65; "
    "quark's qdq_mxfp4 in emulation, emulation.py:124), which the runtime emulator takes as compressed-tensors' "
    "2**(floor(log2 amax) - 2), one up from mantissa 1.75: the two differ for a group whose max has a "
    "mantissa in (1.5, 1.75), which the runtime quantizes at half the trained scale (its max clipped from "
    "6 < |x| / s < 7 to 6); the stored weights and their E8M0 scales deploy exactly as trained"
)


def _fp4_format(w: QuantSpec, a: QuantSpec | None, notes: list[str]):
    """The compression format of an FP4 scheme, or `ExportError` for a combination that has no
    compressed-tensors layout (FP4 weights need FP4 or no activation quantization, and back)."""
    from compressed_tensors.config import CompressionFormat

    if not w.is_fp4:
        raise ExportError(f"{a.qtype} activations need {a.qtype} weights, not {w.qtype}")
    if a is not None and a.qtype != w.qtype:
        raise ExportError(
            f"{w.qtype} weights with {a.qtype} activations have no compressed-tensors / vLLM layout"
        )
    if w.has_global_scale:
        notes.extend(NVFP4_NOTES if a is not None else NVFP4A16_NOTES)
        return CompressionFormat.nvfp4_pack_quantized
    notes.extend(MXFP4_NOTES)
    return CompressionFormat.mxfp4_pack_quantized


# --------------------------------------------------------------------------- per-module pieces
