"""Post-training quantization: calibrate a model's quantizers and save the PTQ checkpoint.

`calibrate` prepares the model (if needed), sets every static weight scale from the weight
(absmax / min-max per tensor, channel or group, docs/design.md) and every static activation scale
(linear inputs, k/v projection outputs) from the ranges seen on calibration batches. Dynamic
quantizers need nothing. `save_ptq_checkpoint` writes the directory QAT warm-starts from:
``quant_scheme.json`` + ``scales.safetensors`` with the keys of docs/design.md (read back by
``qatlib.zero3_io.stream_load_scales``); a GPTQ run (`qatlib.gptq`) also writes its updated
weights as a loadable HF checkpoint beside them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from . import __version__
from .quant import QuantLinear, QuantScheme, QuantSpec, prepare, quant_linears
from .quant.functional import qparams_from_range
from .quant.linear import PrepareOptions, weight_readable
from .quant.quantizer import Quantizer
from .quant.spec import Granularity

log = logging.getLogger(__name__)

SCHEME_FILE = "quant_scheme.json"
SCALES_FILE = "scales.safetensors"
WEIGHTS_FILE = "model.safetensors"
NESTED_DIR = "final_quant_checkpoint"

_EXPERT_RE = re.compile(r"^(?P<pre>.*\.experts)\.(?P<idx>\d+)\.(?P<post>.+)$")


# --------------------------------------------------------------------------- output directories
@contextlib.contextmanager
def atomic_output_dir(out_dir: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary directory beside ``out_dir``; rename it to ``out_dir`` on success.

    An existing non-empty ``out_dir`` is an error (checked before anything is written) unless
    ``overwrite``; then it is replaced only once the new content is complete. On any exception the
    temporary directory is removed and ``out_dir`` is left as it was: no partial output, ever.
    """
    out = Path(out_dir)
    check_output_dir(out, overwrite=overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
        tmp.rename(out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_output_dir(out_dir: str | os.PathLike, *, overwrite: bool = False) -> None:
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"output path {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"output directory {out} is not empty (pass overwrite=True to replace it)")


# --------------------------------------------------------------------------- calibration
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


def check_prepared_matches(model: nn.Module, scheme: QuantScheme) -> None:
    for name, ql in quant_linears(model):
        for role, attr in (("weight", "weight_quantizer"), ("input", "input_quantizer")):
            spec, q = getattr(scheme, role), getattr(ql, attr)
            if (spec is None) != (q is None) or (q is not None and q.spec != spec):
                raise ValueError(
                    f"{name}.{attr} is {'absent' if q is None else q.spec.describe()} but the scheme says "
                    f"{'none' if spec is None else spec.describe()}: the model was prepared with another scheme"
                )


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
def finish_with_fallback(named: list[tuple[str, Quantizer]], report: CalibrationReport) -> None:
    """finish_calibration on every quantizer; a quantizer that saw no data (an MoE expert no token
    was routed to) takes the union of the ranges of its sibling experts (for symmetric formats:
    the max of their scales)."""
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


def calibrate(
    model: nn.Module,
    scheme: QuantScheme,
    batches: Iterable[Any],
    *,
    ignore: Sequence[str] = ("lm_head",),
    kv: str | QuantSpec | None = None,
    options: PrepareOptions | None = None,
    quantize_weights_during_calibration: bool = True,
) -> CalibrationReport:
    """Round-to-nearest PTQ: set every static scale of ``model`` for ``scheme``, in place.

    ``model`` is prepared with ``scheme`` (and ``ignore``) unless it already holds `QuantLinear`
    layers of that scheme. ``kv`` adds static k/v-cache quantizers (``"per-tensor"``,
    ``"per-head"`` or a `QuantSpec`) to the scheme. ``batches`` yields input-id tensors or dicts of
    model inputs; activation ranges are observed with the weights already fake-quantized (what the
    deployed model computes) unless ``quantize_weights_during_calibration`` is False. Experts that
    get no token take their sibling experts' range (logged and recorded in the report).
    """
    scheme = prepare_for_calibration(model, scheme, ignore=ignore, kv=kv, options=options)
    report = CalibrationReport(scheme=scheme)
    statics: list[tuple[str, Quantizer]] = []
    for name, ql in quant_linears(model):
        wq = ql.weight_quantizer
        if wq is not None:
            if not weight_readable(ql.weight):
                raise ValueError(f"calibrate: weight of {name} is not readable (ZeRO-3 shard or meta)")
            wq.init_from(ql.weight)
            report.weight_quantizers += 1
        for role in ("input_quantizer", "output_quantizer"):
            q = getattr(ql, role)
            if q is not None and not q.spec.dynamic:
                statics.append((f"{name}.{role}", q))
    report.static_activation_quantizers = len(statics)
    was_training = model.training
    model.eval()
    weight_qs = [ql.weight_quantizer for _, ql in quant_linears(model) if ql.weight_quantizer is not None]
    before = [q.enabled for q in weight_qs]
    try:
        if not quantize_weights_during_calibration:
            for q in weight_qs:
                q.enabled = False
        for _, q in statics:
            q.start_calibration()
        with torch.no_grad():
            for batch in batches:
                report.num_tokens += run_batch(model, batch)
                report.num_batches += 1
        if statics and report.num_batches == 0:
            raise ValueError("calibrate: no calibration batch, but the scheme has static activation scales")
        finish_with_fallback(statics, report)
    finally:
        for _, q in statics:
            q.calibrating = False
        for q, b in zip(weight_qs, before):
            q.enabled = b
        model.train(was_training)
    log.info(
        "calibrated %d weight and %d static activation quantizers on %d batches (%d tokens)",
        report.weight_quantizers,
        report.static_activation_quantizers,
        report.num_batches,
        report.num_tokens,
    )
    return report


# --------------------------------------------------------------------------- checkpoint
def _attn_of(name: str) -> tuple[str, str] | None:
    """``model.layers.0.self_attn.k_proj`` -> (``model.layers.0.self_attn``, ``k``)."""
    parent, _, child = name.rpartition(".")
    if child in ("k_proj", "v_proj"):
        return parent, child[0]
    return None


@torch.no_grad()
def scale_state_dict(
    model: nn.Module, *, linears: Iterable[tuple[str, QuantLinear]] | None = None
) -> dict[str, torch.Tensor]:
    """The scale keys of docs/design.md for every `QuantLinear` (fp32, CPU, contiguous).

    ``L.weight_scale`` / ``L.weight_zero_point`` (LWC: the clipped scale of the current weight),
    ``L.input_scale`` / ``L.input_zero_point`` (static inputs only), ``<attn>.k_cache.scale`` /
    ``<attn>.v_cache.scale`` for static k/v outputs, and ``L.output_scale`` /
    ``L.output_zero_point`` for any other static output quantizer (q).
    """
    out: dict[str, torch.Tensor] = {}

    def put(key: str, t: torch.Tensor | None) -> None:
        if t is not None:
            out[key] = t.detach().float().cpu().contiguous().clone()

    for name, ql in quant_linears(model) if linears is None else linears:
        wq = ql.weight_quantizer
        if wq is not None:
            if wq.uses_lwc and not weight_readable(ql.weight):
                raise ValueError(f"the LWC scale of {name} needs its full weight (ZeRO-3: gather it first)")
            s, z = wq.qparams(ql.weight if wq.uses_lwc else None)
            put(f"{name}.weight_scale", s)
            put(f"{name}.weight_zero_point", None if z is None else torch.round(z))
        iq = ql.input_quantizer
        if iq is not None and not iq.spec.dynamic:
            put(f"{name}.input_scale", iq.scale)
            put(f"{name}.input_zero_point", iq.zero_point)
        oq = ql.output_quantizer
        if oq is not None and not oq.spec.dynamic:
            attn = _attn_of(name)
            if attn is not None:
                put(f"{attn[0]}.{attn[1]}_cache.scale", oq.scale)
                if oq.zero_point is not None:
                    put(f"{attn[0]}.{attn[1]}_cache.zero_point", oq.zero_point)
            else:
                put(f"{name}.output_scale", oq.scale)
                put(f"{name}.output_zero_point", oq.zero_point)
    return out


def weights_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's own tensors under HF checkpoint names (no quantizer parameters), for GPTQ
    checkpoints; MoE experts appear per expert (``mlp.experts.{e}.gate_proj.weight``)."""
    quantizer_prefixes = tuple(f"{n}." for n, m in model.named_modules() if isinstance(m, Quantizer))
    return {
        k: v.detach().cpu().contiguous()
        for k, v in model.state_dict().items()
        if not k.startswith(quantizer_prefixes)
    }


def save_ptq_checkpoint(
    model: nn.Module,
    scheme: QuantScheme,
    out_dir: str | os.PathLike,
    *,
    calibration: CalibrationReport | Mapping[str, Any] | None = None,
    save_weights: bool = False,
    tokenizer: Any = None,
    overwrite: bool = False,
) -> Path:
    """Write the PTQ checkpoint of docs/design.md to ``out_dir`` (atomically).

    ``quant_scheme.json`` holds ``scheme.to_dict()`` plus ``qatlib_version``, ``calibration``
    and ``weights`` (null, or the file holding the model's updated weights). ``save_weights``
    (GPTQ, which changes the weights) also writes the model with ``save_pretrained`` so the
    directory is a loadable HF checkpoint whose weights QAT must start from.
    """
    if not any(True for _ in quant_linears(model)):
        raise ValueError(
            "save_ptq_checkpoint: the model has no QuantLinear layers (calibrate or prepare it first)"
        )
    check_output_dir(out_dir, overwrite=overwrite)
    scales = scale_state_dict(model)
    calib = calibration.to_dict() if isinstance(calibration, CalibrationReport) else dict(calibration or {})
    meta = scheme.to_dict()
    meta.update(
        qatlib_version=__version__,
        calibration=calib,
        weights=WEIGHTS_FILE if save_weights else None,
    )
    with atomic_output_dir(out_dir, overwrite=overwrite) as tmp:
        save_file(scales, str(tmp / SCALES_FILE), metadata={"format": "pt", "qatlib": "ptq-scales"})
        if save_weights:
            if not hasattr(model, "save_pretrained"):
                save_file(weights_state_dict(model), str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
            else:
                model.save_pretrained(str(tmp), state_dict=weights_state_dict(model))
                if tokenizer is not None:
                    tokenizer.save_pretrained(str(tmp))
        (tmp / SCHEME_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    log.info(
        "saved PTQ checkpoint (%d scale tensors%s) to %s",
        len(scales),
        ", weights" if save_weights else "",
        out_dir,
    )
    return Path(out_dir)


def resolve_ptq_dir(path: str | os.PathLike) -> Path:
    """The directory holding ``quant_scheme.json``: ``path`` or its ``final_quant_checkpoint/``."""
    p = Path(path)
    for d in (p, p / NESTED_DIR):
        if (d / SCHEME_FILE).is_file():
            return d
    raise FileNotFoundError(f"no {SCHEME_FILE} in {p} or {p / NESTED_DIR}: not a PTQ checkpoint")


def load_ptq_metadata(path: str | os.PathLike) -> dict[str, Any]:
    return json.loads((resolve_ptq_dir(path) / SCHEME_FILE).read_text())


def load_ptq_scheme(path: str | os.PathLike) -> QuantScheme:
    """The `QuantScheme` a PTQ checkpoint was made with (extra metadata keys are ignored)."""
    return QuantScheme.from_dict(load_ptq_metadata(path))
