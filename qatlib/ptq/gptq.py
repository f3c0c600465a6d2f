"""GPTQ (Frantar et al., 2022): a strong PTQ baseline for the integer (and FP8) weight formats.

Sequential, one decoder layer at a time: the inputs of layer ``i`` are the outputs of the already
quantized layers ``< i``. For every `QuantLinear` of the layer the Hessian ``H = 2 X^T X / n`` of
its calibration inputs is accumulated, then its columns are quantized one by one (in blocks, with
lazy batch updates) and the rounding error of each column is spread over the not yet quantized
columns through the Cholesky factor of ``H^-1``. Group-wise scales are fixed from the group's
(already error-updated) weights when the first column of the group is reached, as in the paper;
with act-order (columns by decreasing ``diag(H)``) the group scales are fixed up front from the
original weights ("static groups"), so groups stay contiguous in the stored layout.

GPTQ changes the weights: the model's weights become the dequantized GPTQ weights and the
weight quantizers get the matching scales, so fake quantization reproduces the GPTQ codes.
Save with ``save_ptq_checkpoint(..., save_weights=True)``.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..quant import QuantLinear, QuantScheme, QuantSpec, quant_linears
from ..quant import functional as F
from ..quant.calibration import (
    CalibrationReport,
    calibrate_activations,
    prepare_for_calibration,
)
from ..quant.linear import PrepareOptions, weight_readable
from ..quant.spec import Granularity
from ..surgery.modeling import decoder_layers
from ..zero3.onload import Onloader, capture_layer_inputs, carry, run_layer

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- one weight matrix
def _column_spec(spec: QuantSpec) -> QuantSpec:
    """Spec for quantizing one column ``[out, 1]`` with a ``[out, 1]`` scale."""
    return spec.replace(granularity=Granularity.CHANNEL, group_size=None, fp8_recast=False)


def _qparams(w: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale / zero point of ``w`` ([out, k]) for one scale per row (group / channel) or per tensor."""
    if spec.granularity is Granularity.TENSOR:
        s, z = F.compute_qparams(w, spec)
        n = w.shape[0]
        return s.expand(n, 1).clone(), None if z is None else z.expand(n, 1).clone()
    return F.compute_qparams(w, _column_spec(spec))


@torch.no_grad()
def gptq_quantize_weight(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    spec: QuantSpec,
    *,
    block_size: int = 128,
    percdamp: float = 0.01,
    act_order: bool = False,
    fixed: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    latent: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """GPTQ one ``[out, in]`` weight given ``H = 2 X^T X / n``; returns ``(dequantized weight
    (fp32), scale, zero_point)`` with the scale / zero point in ``spec``'s stored shape.

    ``latent``: return instead the weight GPTQ rounded, each column as it stood when its turn came
    (the original plus the error compensation of the columns before it). It fake-quantizes to the
    same codes at the returned scales, so PTQ and export are unchanged; what differs is QAT from it:
    on the dequantized grid values the LSQ scale gradient ``round(w / s) - w / s`` is zero and the
    first scale step re-rounds nothing GPTQ meant, while the latent weight keeps where in its cell
    each value fell, as RTN's starting weight does.

    ``fixed``: a per-tensor ``(scale, zero_point)`` to quantize at instead of the weight's own (the
    one scale a runtime serves for all shards of a fused group, `shared_weight_qparams`)."""
    if spec.dynamic:
        raise ValueError("GPTQ needs a static weight format")
    if fixed is not None and spec.granularity is not Granularity.TENSOR:
        raise ValueError(f"GPTQ: a fixed scale is per-tensor; got {spec.granularity.value}")
    W = weight.detach().float().clone()
    rows, cols = W.shape
    H = hessian.detach().float().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0  # inputs never seen: plain rounding for those columns (weights kept)
    gs = spec.group_size if spec.granularity is Granularity.GROUP else None
    if gs is not None and cols % gs:
        raise ValueError(f"group_size {gs} does not divide in_features {cols}")
    perm = None
    if act_order:
        perm = torch.argsort(torch.diag(H), descending=True)
        H = H[perm][:, perm]
    damp = percdamp * torch.mean(torch.diag(H))
    H += damp * torch.eye(cols, dtype=H.dtype, device=H.device)
    L = torch.linalg.cholesky(H)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)

    # Per-column scales ([out, 1] each), indexed by ORIGINAL column.
    n_groups = cols // gs if gs else 1
    g_scale = torch.empty(rows, n_groups, device=W.device)
    g_zero = None if spec.symmetric else torch.empty(rows, n_groups, device=W.device)

    def set_group(g: int, w: torch.Tensor) -> None:
        s, z = _qparams(w, spec)
        g_scale[:, g : g + 1] = s
        if g_zero is not None:
            g_zero[:, g : g + 1] = z

    if fixed is not None:
        g_scale[:] = fixed[0].float().reshape(1, 1).to(W.device)
        if g_zero is not None:
            g_zero[:] = fixed[1].float().reshape(1, 1).to(W.device)
    elif gs is None:
        set_group(0, W)
    elif act_order:
        for g in range(n_groups):
            set_group(g, W[:, g * gs : (g + 1) * gs])
    if gs is not None and not act_order:
        block_size = gs * max(1, math.ceil(block_size / gs))  # groups never straddle blocks
    if perm is not None:
        W = W[:, perm]
    cspec = _column_spec(spec)
    Q = torch.zeros_like(W)  # the rounded columns, or (latent) each column as GPTQ rounded it
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        W1 = W[:, i1:i2].clone()
        Q1 = torch.zeros_like(W1)
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = int(perm[i1 + i]) if perm is not None else i1 + i
            g = col // gs if gs else 0
            if gs is not None and not act_order and col % gs == 0:
                set_group(g, W1[:, i : i + gs])
            s = g_scale[:, g : g + 1]
            z = None if g_zero is None else g_zero[:, g : g + 1]
            w = W1[:, i : i + 1]
            q = F.fake_quantize(w, s, z, cspec)
            d = Hinv1[i, i]
            Q1[:, i : i + 1] = w if latent else q  # w copied before the update turns it into q
            err = (w - q) / d
            W1[:, i:] -= err @ Hinv1[i : i + 1, i:]
            Err1[:, i : i + 1] = err
        Q[:, i1:i2] = Q1
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    if perm is not None:
        Q = Q[:, torch.argsort(perm)]
    if spec.granularity is Granularity.TENSOR:
        scale = g_scale[:1, 0].clone()
        zp = None if g_zero is None else g_zero[:1, 0].clone()
    else:
        scale, zp = g_scale, g_zero
    return Q, scale, zp


def shared_weight_qparams(layer: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """For the linears of ``layer`` whose weight quantizers share one scale (`qatlib.quant.tying`,
    under a ``deploy.target``): linear name -> the group's ``(scale, zero_point)``, computed from the
    float weights of all members BEFORE any of them is GPTQ-quantized: the qparams of the union of
    their ranges, i.e. for symmetric formats the max of the members' own scales (the rule PTQ's
    `tying.retie_weights` and the runtime's load-time max use). GPTQ then quantizes each member at
    that fixed scale; otherwise each member would set the shared Parameter and the last one would
    win for all of them. Untied layers: empty."""
    from ..quant.tying import shared_groups

    out: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for group in shared_groups(layer):
        names = [n.removesuffix(".weight_quantizer") for n, _ in group if n.endswith(".weight_quantizer")]
        if len(names) != len(group):
            continue  # input quantizers: calibrated from activations, not here
        spec = group[0][1].spec
        w = torch.cat([layer.get_submodule(n).weight.detach().float().reshape(-1) for n in names])
        scale, zp = F.compute_qparams(w, spec)
        out.update({n: (scale.clone(), None if zp is None else zp.clone()) for n in names})
    return out


# --------------------------------------------------------------------------- model driver
class _HessianHook:
    def __init__(self, n_in: int, device: torch.device) -> None:
        self.H = torch.zeros(n_in, n_in, device=device)
        self.n = 0

    def __call__(self, module: nn.Module, args: tuple) -> None:
        x = args[0].detach()
        x = x.reshape(-1, x.shape[-1]).float()
        t = x.shape[0]
        if t == 0:
            return
        self.H *= self.n / (self.n + t)
        self.n += t
        x = math.sqrt(2 / self.n) * x
        self.H += x.t() @ x


@torch.no_grad()
def gptq(
    model: nn.Module,
    scheme: QuantScheme,
    batches: Iterable[Any],
    *,
    ignore: Sequence[str] = ("lm_head",),
    kv: str | QuantSpec | None = None,
    options: PrepareOptions | None = None,
    block_size: int = 128,
    percdamp: float = 0.01,
    act_order: bool = False,
    min_tokens: int = 1,
    onload: Onloader | None = None,
    latent: bool = False,
) -> CalibrationReport:
    """GPTQ PTQ of ``model`` for ``scheme``, in place (prepares it if needed).

    Weights are GPTQ-quantized layer by layer; static activation scales of each layer are then
    calibrated (`qatlib.quant.calibration`) on that layer's inputs with its weights quantized.
    Linears that saw fewer than ``min_tokens`` tokens (MoE experts no token was routed to) are
    rounded to nearest instead (counted in the report's ``fallbacks``).

    ``onload`` (`qatlib.zero3.onload.Onloader.resident`): the model stays in host memory and each layer
    is moved to the loader's device while it is quantized (the layer inputs are captured and
    carried exactly as `qatlib.ptq.calibrate_layerwise` does). A checkpoint-streamed skeleton is
    refused: GPTQ changes the weights, and an offloaded layer would lose them.

    ``latent`` (`gptq_quantize_weight`): the weights left in the model are the ones GPTQ rounded,
    not the rounded ones: the same PTQ model, a better start for QAT.
    """
    if onload is not None and onload.source is not None:
        raise ValueError(
            "GPTQ changes the weights: onload from host memory (Onloader.resident), not a checkpoint"
        )
    loader = onload if onload is not None else Onloader.resident(model, None)  # nothing moves
    if scheme.weight is None:
        raise ValueError("GPTQ needs a weight format")
    scheme = prepare_for_calibration(model, scheme, ignore=ignore, kv=kv, options=options)
    for name, ql in quant_linears(model):
        if ql.weight_quantizer is not None and ql.weight_quantizer.uses_lwc:
            raise ValueError(f"GPTQ sets explicit scales; {name} uses LWC (prepare without lwc_init)")
        if not weight_readable(ql.weight):
            raise ValueError(f"GPTQ: weight of {name} is not readable (ZeRO-3 shard or meta)")
    report = CalibrationReport(algorithm="gptq", scheme=scheme)
    _, layers = decoder_layers(model)
    was_training = model.training
    model.eval()

    # 1. Inputs of the first layer, one entry per batch.
    with loader.outer_onloaded():
        inputs, report.num_batches, report.num_tokens = capture_layer_inputs(model, batches, loader.device)
    if not inputs:
        raise ValueError("GPTQ: no calibration batch")

    # Quantizers outside the decoder layers (none by default: lm_head is ignored) are RTN.
    in_layers = {id(m) for layer in layers for m in layer.modules()}
    for _, ql in quant_linears(model):
        if id(ql) not in in_layers and ql.weight_quantizer is not None:
            ql.weight_quantizer.init_from(ql.weight)
            report.weight_quantizers += 1

    for li, layer in enumerate(layers):
        with loader.onloaded(layer):
            inputs = _gptq_layer(
                li, layer, inputs, report, block_size, percdamp, act_order, min_tokens, latent
            )
        log.info("GPTQ: layer %d/%d done", li + 1, len(layers))
    model.train(was_training)
    if report.fallbacks:
        log.warning("GPTQ: %d quantizer(s) fell back (see report.fallbacks)", len(report.fallbacks))
    return report


def _gptq_layer(li, layer, inputs, report, block_size, percdamp, act_order, min_tokens, latent):
    """GPTQ of one (onloaded) decoder layer; returns the next layer's inputs."""
    qls = [(n, m) for n, m in layer.named_modules() if isinstance(m, QuantLinear)]
    # 2. Hessians from the float weights of this layer (inputs come from quantized layers).
    hooks = {}
    handles = []
    for n, ql in qls:
        hooks[n] = _HessianHook(ql.in_features, ql.weight.device)
        handles.append(ql.register_forward_pre_hook(hooks[n]))
    states = [(q, q.enabled) for _, ql in qls for _, q in ql.quantizers()]
    try:
        for q, _ in states:
            q.enabled = False
        for batch in inputs:
            run_layer(layer, batch)
    finally:
        for h in handles:
            h.remove()
        for q, e in states:
            q.enabled = e
    # 3. GPTQ every linear (the shards of a tied group at their one shared scale).
    shared = shared_weight_qparams(layer)
    for n, ql in qls:
        wq = ql.weight_quantizer
        if wq is None:
            continue
        report.weight_quantizers += 1
        hk = hooks[n]
        fixed = shared.get(n)
        if hk.n < min_tokens and fixed is not None:
            wq.set_qparams(*fixed)  # round to nearest at the shared scale (init_from would overwrite it)
            report.fallbacks[f"layers.{li}.{n}.weight_quantizer"] = (
                f"round-to-nearest at the tied scale ({hk.n} calibration tokens)"
            )
            continue
        if hk.n < min_tokens:
            wq.init_from(ql.weight)
            report.fallbacks[f"layers.{li}.{n}.weight_quantizer"] = (
                f"round-to-nearest ({hk.n} calibration tokens)"
            )
            continue
        Q, scale, zp = gptq_quantize_weight(
            ql.weight,
            hk.H,
            wq.spec,
            block_size=block_size,
            percdamp=percdamp,
            act_order=act_order,
            fixed=fixed,
            latent=latent,
        )
        ql.weight.data.copy_(Q.to(ql.weight.dtype))
        wq.set_qparams(scale.to(ql.weight.device), None if zp is None else zp.to(ql.weight.device))
    del hooks
    # 4. Static activation scales of this layer; the same pass gives the next layer's inputs.
    new_inputs: list[tuple[tuple, dict]] = []
    forward = functools.partial(carry, new_inputs)
    seen = calibrate_activations(layer, inputs, forward=forward, prefix=f"layers.{li}.")
    report.static_activation_quantizers += seen.static_activation_quantizers
    report.fallbacks.update(seen.fallbacks)
    if not new_inputs:  # nothing to calibrate: nothing ran
        for batch in inputs:
            forward(layer, batch)
    return new_inputs
