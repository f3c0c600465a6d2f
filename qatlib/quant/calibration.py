"""Observer calibration of a prepared model: static activation scales from the ranges seen on
calibration batches, with the MoE sibling-expert fallback.

Shared by RTN PTQ (`qatlib.ptq`), GPTQ (`qatlib.ptq.gptq`), the end-to-end trainer's lazy init and
blockwise training (`qatlib.trainers`); `check_prepared_matches` is also export's first check.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from .functional import qparams_from_range
from .linear import PrepareOptions, QuantLinear, prepare, quant_linears
from .quantizer import Quantizer
from .spec import Granularity, QuantScheme, QuantSpec

log = logging.getLogger(__name__)

_EXPERT_RE = re.compile(r"^(?P<pre>.*\.experts)\.(?P<idx>\d+)\.(?P<post>.+)$")


@dataclass
class CalibrationReport:
    """What a calibration saw; stored in quant_scheme.json under ``calibration``."""

    num_batches: int = 0
    num_tokens: int = 0
    weight_quantizers: int = 0
    static_activation_quantizers: int = 0
    # quantizers of MoE experts that received no calibration token: name -> how the scale was set
    fallbacks: dict[str, str] = field(default_factory=dict)
    algorithm: str = "rtn"
    # the scheme actually calibrated (``kv=`` adds k / v); not part of the JSON record
    scheme: QuantScheme | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("scheme", None)
        return d


def kv_spec(kv: str | QuantSpec | None) -> QuantSpec | None:
    """``kv=`` shorthand: ``"per-tensor"`` / ``"per-head"`` = static FP8 k/v-cache scales."""
    if kv is None or isinstance(kv, QuantSpec):
        return kv
    gran = Granularity(kv)
    if gran not in (Granularity.TENSOR, Granularity.HEAD):
        raise ValueError(f"kv-cache scales are per-tensor or per-head; got {kv!r}")
    return QuantSpec("fp8", gran)


def prepared_mismatch(model: nn.Module, scheme: QuantScheme) -> str | None:
    """Why the weight / input quantizers of ``model``'s `QuantLinear` layers are not ``scheme``'s
    (None when they are)."""
    for name, ql in quant_linears(model):
        for role, attr in (("weight", "weight_quantizer"), ("input", "input_quantizer")):
            spec, q = getattr(scheme, role), getattr(ql, attr)
            if (spec is None) != (q is None) or (q is not None and q.spec != spec):
                return (
                    f"{name}.{attr} ({'none' if q is None else q.spec.describe()}) does not match the scheme "
                    f"({'none' if spec is None else spec.describe()}): the model was prepared with another scheme"
                )
    return None


def check_prepared_matches(model: nn.Module, scheme: QuantScheme) -> None:
    """ValueError when ``model`` was prepared with another scheme than ``scheme``."""
    problem = prepared_mismatch(model, scheme)
    if problem is not None:
        raise ValueError(problem)


def static_quantizers(module: nn.Module) -> list[tuple[str, Quantizer]]:
    """The static activation quantizers (input, q/k/v output) of ``module``'s `QuantLinear`
    layers, named relative to ``module``: the ones calibration sets. NVFP4 inputs count: their
    group scales are dynamic, their global input scale is static."""
    out = []
    for name, ql in module.named_modules():
        if isinstance(ql, QuantLinear):
            for role in ("input_quantizer", "output_quantizer"):
                q = getattr(ql, role)
                if q is not None and (not q.spec.dynamic or q.global_scale is not None):
                    out.append((f"{name}.{role}", q))
    return out


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch


def batch_inputs(model: nn.Module, batch: Any) -> tuple[dict[str, Any], int]:
    """Model inputs of one calibration batch (a LongTensor of input ids or a dict of model inputs;
    ``labels`` dropped) on the model's device, and the number of tokens it holds (the attention
    mask's ones when given). Padding positions are observed too: calibrate on unpadded batches."""
    device = next(model.parameters()).device
    batch = _to_device(batch, device)
    if isinstance(batch, torch.Tensor):
        batch = {"input_ids": batch}
    if not isinstance(batch, Mapping) or ("input_ids" not in batch and "inputs_embeds" not in batch):
        raise TypeError("a calibration batch is a LongTensor of input ids or a dict with 'input_ids'")
    kwargs = {k: v for k, v in batch.items() if k != "labels"}
    mask = kwargs.get("attention_mask")
    if mask is not None:
        return kwargs, int(mask.sum())
    ids = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    return kwargs, int(ids.shape[0] * ids.shape[1])


def run_batch(model: nn.Module, batch: Any) -> int:
    """Forward one calibration batch (no KV cache); returns its number of tokens."""
    kwargs, n = batch_inputs(model, batch)
    model(**kwargs, use_cache=False)
    return n


def _sibling_key(name: str) -> str | None:
    """``...mlp.experts.3.up_proj.input_quantizer`` -> ``...mlp.experts.*.up_proj.input_quantizer``."""
    m = _EXPERT_RE.match(name)
    return None if m is None else f"{m['pre']}.*.{m['post']}"


def _range_from_qparams(scale: torch.Tensor, zp: torch.Tensor | None, spec: QuantSpec):
    """The representable range of stored qparams (exactly the observed range for symmetric
    formats' absmax; the clipped min/max for asymmetric ones)."""
    z = torch.zeros_like(scale) if zp is None else zp
    return (spec.qmin - z) * scale, (spec.qmax - z) * scale


@torch.no_grad()
def merge_tied_observations(qs: Iterable[Quantizer]) -> int:
    """Quantizers that share one scale (`qatlib.quant.tying`: what the runtime fuses) observe as one:
    each member's range becomes the union of the group's, so the tied scale is the max of the
    scales the members would get alone (the runtime's own collapse rule) and an expert that got no
    token needs no fallback. Returns the number of merged groups."""
    by_id: dict[int, list[Quantizer]] = {}
    for q in qs:
        if q.scale is not None:
            by_id.setdefault(id(q.scale), []).append(q)
    n = 0
    for group in by_id.values():
        obs = [q._obs for q in group if q._obs is not None]
        if len(group) < 2 or not obs:
            continue
        merged = (torch.stack([o[0] for o in obs]).amin(0), torch.stack([o[1] for o in obs]).amax(0))
        for q in group:
            q._obs = merged
        n += 1
    return n


@torch.no_grad()
def finish_with_fallback(named: list[tuple[str, Quantizer]], report: CalibrationReport) -> None:
    """finish_calibration on every quantizer (tied ones on the union of their group's ranges,
    `merge_tied_observations`); a quantizer that saw no data (an MoE expert no token was routed to) takes the union of the ranges of its sibling experts (for symmetric formats:
    the max of their scales)."""
    merge_tied_observations([q for _, q in named])
    missing = []
    for name, q in named:
        try:
            q.finish_calibration()
        except RuntimeError:
            missing.append((name, q))
    if not missing:
        return
    by_key: dict[str, list[Quantizer]] = {}
    seen = {name for name, _ in named} - {name for name, _ in missing}
    for name, q in named:
        key = _sibling_key(name)
        if key is not None and name in seen:
            by_key.setdefault(key, []).append(q)
    unresolved = []
    for name, q in missing:
        key = _sibling_key(name)
        sibs = by_key.get(key or "", [])
        if not sibs:
            unresolved.append(name)
            continue
        if q.scale is None:  # NVFP4 input: the smallest global scale (largest range) of the siblings
            with torch.no_grad():
                q.global_scale.copy_(torch.stack([s.global_scale for s in sibs]).amin(0))
            q.initialized.fill_(True)
            report.fallbacks[name] = f"min global scale over {len(sibs)} sibling experts ({key})"
            continue
        lo, hi = zip(*(_range_from_qparams(s.scale, s.zero_point, s.spec) for s in sibs))
        xmin = torch.stack(lo).amin(0)
        xmax = torch.stack(hi).amax(0)
        scale, zp = qparams_from_range(xmin, xmax, q.spec)
        q.set_qparams(scale, zp)
        report.fallbacks[name] = f"max over {len(sibs)} sibling experts ({key})"
    if report.fallbacks:
        log.warning(
            "calibration: %d quantizer(s) of MoE experts saw no token; their scale is the max over the sibling "
            "experts of the same projection: %s",
            len(report.fallbacks),
            ", ".join(list(report.fallbacks)[:5]) + (" ..." if len(report.fallbacks) > 5 else ""),
        )
    if unresolved:
        raise RuntimeError(
            f"calibration saw no data for {len(unresolved)} static quantizer(s) and no sibling expert to borrow "
            f"a scale from: {', '.join(unresolved[:5])}. Give more (or longer) calibration batches."
        )


def prepare_for_calibration(
    model: nn.Module,
    scheme: QuantScheme,
    *,
    ignore: Sequence[str],
    kv: str | QuantSpec | None,
    options: PrepareOptions | None,
) -> QuantScheme:
    """The scheme with ``kv`` added; ``model`` prepared with it unless it already holds matching
    `QuantLinear` layers (then checked). Shared by RTN calibration and GPTQ."""
    kvs = kv_spec(kv)
    if kvs is not None:
        scheme = scheme.replace(k=kvs, v=kvs)
    if not any(True for _ in quant_linears(model)):
        prepare(model, scheme, ignore=ignore, options=options or PrepareOptions())
    else:
        check_prepared_matches(model, scheme)
        if kvs is not None and not any(ql.output_quantizer is not None for _, ql in quant_linears(model)):
            raise ValueError(
                "kv= needs output quantizers: pass an unprepared model (or prepare with scheme.k/v set)"
            )
    return scheme


def calibrate_activations(
    module: nn.Module,
    batches: Iterable[Any],
    *,
    forward: Callable[[nn.Module, Any], int | None] = run_batch,
    only_uninitialized: bool = False,
    quantize_weights: bool = True,
    report: CalibrationReport | None = None,
    prefix: str = "",
) -> CalibrationReport:
    """Set the static activation scales of ``module`` (a model, or one decoder block) from the
    ranges its quantizers observe over ``batches``, in place.

    ``forward(module, batch)`` runs one batch and returns its token count or None (default
    `run_batch`: model inputs). ``only_uninitialized``: leave quantizers whose ``initialized`` flag is set (a
    checkpoint gave them a value). Ranges are observed with the weights fake-quantized (what the
    deployed model computes) unless ``quantize_weights`` is False. Experts that get no token take
    their sibling experts' range (logged and recorded in the report under ``prefix`` + the
    quantizer's name in ``module``). Nothing runs when there is nothing to calibrate.
    """
    report = report if report is not None else CalibrationReport()
    statics = [(prefix + n, q) for n, q in static_quantizers(module)]
    if only_uninitialized:
        statics = [(n, q) for n, q in statics if not bool(q.initialized)]
    report.static_activation_quantizers += len(statics)
    if not statics:
        return report
    was_training = module.training
    module.eval()
    weight_qs = [ql.weight_quantizer for _, ql in quant_linears(module) if ql.weight_quantizer is not None]
    before = [q.enabled for q in weight_qs]
    try:
        if not quantize_weights:
            for q in weight_qs:
                q.enabled = False
        for _, q in statics:
            q.start_calibration()
        n_batches = 0
        with torch.no_grad():
            for batch in batches:
                n = forward(module, batch)
                report.num_tokens += n if isinstance(n, int) else 0
                report.num_batches += 1
                n_batches += 1
        if n_batches == 0:
            raise ValueError("calibrate: no calibration batch, but the scheme has static activation scales")
        finish_with_fallback(statics, report)
    finally:
        for _, q in statics:
            q.calibrating = False
        for q, b in zip(weight_qs, before):
            q.enabled = b
        module.train(was_training)
    return report
