"""Scale statistics and per-layer weight SQNR for PTQ / QAT checkpoints.

Reads checkpoints through `qatlib.checkpoint` (docs/design.md): `load_scales` gives the scale keys
(``L.weight_scale``, ``L.input_scale``, ``<attn>.k_cache.scale``, ...) of a PTQ / QAT checkpoint,
`iter_weights` its weights one at a time.

Every ``*_rows`` function returns a list of flat dicts (one per layer or key): CSV-friendly
(`write_csv`) and easy to turn into a DataFrame. Used by the report (`qatlib.report`) and by
``notebooks/scale_distributions.ipynb``.
"""

from __future__ import annotations

import csv
import io
import math
import os
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .checkpoint import safetensors as st
from .checkpoint.keys import load_scales, parse_key
from .checkpoint.layout import read_scheme, weight_files, write_text
from .quant.functional import fake_quantize, subgroup_shape
from .quant.quantizer import SUBGROUP_LOGIT_INIT
from .quant.spec import QuantScheme, QuantSpec

Row = dict[str, Any]


# =========================================================================== names
def layer_type(name: str) -> str:
    """The kind of a linear from its module name (or a scale key of it).

    The last name component (``q_proj`` ... ``down_proj``, ``lm_head``), prefixed with
    ``expert.`` when the layer sits in a routed-expert list (``.experts.`` in the name):
    ``model.layers.3.mlp.experts.7.up_proj`` -> ``expert.up_proj``,
    ``model.layers.3.mlp.up_proj`` -> ``up_proj``, ``model.layers.0.self_attn.q_proj`` -> ``q_proj``.
    """
    parsed = parse_key(name)
    if parsed is not None:
        name = parsed.layer
    if name.endswith(".weight"):
        name = name[: -len(".weight")]
    last = name.rsplit(".", 1)[-1]
    return f"expert.{last}" if ".experts." in f".{name}." else last


_TYPE_ORDER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def natural_key(name: str) -> tuple:
    """``layers.2`` before ``layers.10``: digit runs compare as numbers."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def type_order(t: str) -> tuple[int, int, str]:
    """Sort key for layer types: attention q/k/v/o, dense MLP, experts, then anything else."""
    expert = t.startswith("expert.")
    base = t[len("expert.") :] if expert else t
    idx = _TYPE_ORDER.index(base) if base in _TYPE_ORDER else len(_TYPE_ORDER)
    return (int(expert), idx, t)


# =========================================================================== loading
def iter_weights(ckpt_dir: str | os.PathLike, layers: Iterable[str]) -> Iterable[tuple[str, torch.Tensor]]:
    """``(layer, weight)`` for the ``<layer>.weight`` tensors of a model folder (any number of
    ``*.safetensors`` files, `qatlib.checkpoint.layout.weight_files`), read one at a time; layers
    without a weight are skipped."""
    wanted = {f"{layer}.weight": layer for layer in layers}
    for path in weight_files(ckpt_dir):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if key in wanted:
                    yield wanted.pop(key), f.get_tensor(key)


def weight_bytes(ckpt_dir: str | os.PathLike, layers: Iterable[str]) -> int:
    """Bytes of the ``<layer>.weight`` tensors `iter_weights` would read (headers only, no data)."""
    wanted = {f"{layer}.weight" for layer in layers}
    return sum(
        i.end - i.start for path in weight_files(ckpt_dir) for i in st.read_header(path) if i.key in wanted
    )


# =========================================================================== statistics
def _meta(key: str) -> Row:
    p = parse_key(key)
    if p is None:
        return {"key": key, "layer": key, "layer_type": layer_type(key), "role": "", "kind": ""}
    return {"key": key, "layer": p.layer, "layer_type": layer_type(p.layer), "role": p.role, "kind": p.kind}


def scale_stats(scales: Mapping[str, torch.Tensor]) -> list[Row]:
    """One row per scale tensor (zero points skipped): key, layer, layer_type, role, numel,
    min / max / mean / median / std of the scale values (`natural_key` order)."""
    rows = []
    for key in sorted(scales, key=natural_key):
        meta = _meta(key)
        if meta["kind"] == "zero_point":
            continue
        t = scales[key].detach().double().flatten()
        rows.append(
            {
                **meta,
                "numel": t.numel(),
                "min": t.min().item(),
                "max": t.max().item(),
                "mean": t.mean().item(),
                "median": t.median().item(),
                "std": t.std().item() if t.numel() > 1 else 0.0,
            }
        )
    return rows


def scale_changes(before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor]) -> list[Row]:
    """Per scale key present in both (zero points skipped): how far ``after`` (QAT) moved from
    ``before`` (PTQ). ``rel_change_mean`` / ``rel_change_max``: mean / max of ``|a - b| / |b|``
    over the tensor's elements; ``mean_before`` / ``mean_after``. Sorted by ``rel_change_max``,
    largest first. Keys with different shapes get ``shape_mismatch`` and NaN changes."""
    rows = []
    for key in sorted(set(before) & set(after), key=natural_key):
        meta = _meta(key)
        if meta["kind"] == "zero_point":
            continue
        b, a = before[key].detach().double(), after[key].detach().double()
        row = {**meta, "numel": b.numel(), "mean_before": b.mean().item(), "mean_after": a.mean().item()}
        if b.shape != a.shape:
            row.update(
                rel_change_mean=math.nan,
                rel_change_max=math.nan,
                shape_mismatch=f"{tuple(b.shape)} vs {tuple(a.shape)}",
            )
        else:
            rel = (a - b).abs() / b.abs().clamp_min(torch.finfo(torch.float32).tiny)
            row.update(rel_change_mean=rel.mean().item(), rel_change_max=rel.max().item(), shape_mismatch="")
        rows.append(row)
    rows.sort(key=lambda r: -r["rel_change_max"] if not math.isnan(r["rel_change_max"]) else math.inf)
    return rows


def values_by_type(scales: Mapping[str, torch.Tensor], role: str = "weight") -> dict[str, torch.Tensor]:
    """All scale values of ``role`` concatenated per layer type (for histograms), sorted by type."""
    parts: dict[str, list[torch.Tensor]] = defaultdict(list)
    for key, t in scales.items():
        p = parse_key(key)
        if p is not None and p.kind == "scale" and p.role == role:
            parts[layer_type(p.layer)].append(t.detach().float().flatten())
    return {k: torch.cat(parts[k]) for k in sorted(parts, key=type_order)}


def ratio_by_type(
    before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor], role: str = "weight"
) -> dict[str, torch.Tensor]:
    """Element-wise ``log2(after / before)`` of the ``role`` scales, concatenated per layer type
    (keys in both with the same shape; 0 = unchanged, 1 = doubled)."""
    parts: dict[str, list[torch.Tensor]] = defaultdict(list)
    for key in set(before) & set(after):
        p = parse_key(key)
        b, a = before[key].detach().double(), after[key].detach().double()
        if p is None or p.kind != "scale" or p.role != role or b.shape != a.shape:
            continue
        ok = (a > 0) & (b > 0)
        parts[layer_type(p.layer)].append(torch.log2(a[ok] / b[ok]).flatten())
    return {k: torch.cat(parts[k]) for k in sorted(parts, key=type_order)}


# =========================================================================== SQNR
def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio ``10 log10(||x||^2 / ||x - x_hat||^2)`` in dB (float64).

    ``inf`` when the two are equal (no noise); ``-inf`` for a zero reference with non-zero noise."""
    x = reference.detach().double()
    noise = (x - approx.detach().double()).pow(2).sum().item()
    signal = x.pow(2).sum().item()
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def _weight_spec(scheme: QuantScheme | QuantSpec) -> QuantSpec | None:
    return scheme if isinstance(scheme, QuantSpec) else scheme.weight


@torch.no_grad()
def layer_sqnr(
    model_fp_weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    scheme: QuantScheme | QuantSpec,
    scales: Mapping[str, torch.Tensor],
) -> list[Row]:
    """Weight fake-quantization SQNR per layer with the given scales (no LWC: the stored scale is
    already the clipped one). ``model_fp_weights`` maps a layer (module name, or its
    ``<layer>.weight`` key) to its full-precision weight; layers without a ``weight_scale`` are
    skipped. Rows: layer, layer_type, numel, sqnr_db (in `natural_key` order of the layer)."""
    spec = _weight_spec(scheme)
    if spec is None:
        return []
    items = model_fp_weights.items() if isinstance(model_fp_weights, Mapping) else model_fp_weights
    rows = []
    for name, w in items:
        layer = name[: -len(".weight")] if name.endswith(".weight") else name
        s = scales.get(f"{layer}.weight_scale")
        if s is None:
            continue
        zp = scales.get(f"{layer}.weight_zero_point")
        x = w.detach().float()
        gs = scales.get(f"{layer}.weight_global_scale")  # NVFP4
        logit = scales.get(f"{layer}.weight_quantizer.subgroup_logit")  # FOCUS (a PTQ start: their init)
        if spec.subgroups and logit is None:
            logit = torch.full(subgroup_shape(x.shape, spec), SUBGROUP_LOGIT_INIT)
        fq = fake_quantize(
            x,
            s.float(),
            None if zp is None else zp.float(),
            spec,
            global_scale=None if gs is None else gs.float(),
            subgroup_scale=None if logit is None else torch.sigmoid(logit.float()),
        )
        rows.append(
            {"layer": layer, "layer_type": layer_type(layer), "numel": x.numel(), "sqnr_db": sqnr_db(x, fq)}
        )
    rows.sort(key=lambda r: natural_key(r["layer"]))
    return rows


def compare_sqnr(ptq_rows: Iterable[Row], qat_rows: Iterable[Row]) -> list[Row]:
    """Join two `layer_sqnr` results: layer, layer_type, ptq_db, qat_db, delta_db (QAT - PTQ)."""
    ptq = {r["layer"]: r for r in ptq_rows}
    qat = {r["layer"]: r for r in qat_rows}
    rows = []
    for layer in sorted(set(ptq) | set(qat), key=natural_key):
        p = ptq.get(layer, {}).get("sqnr_db", math.nan)
        q = qat.get(layer, {}).get("sqnr_db", math.nan)
        d = q - p if math.isfinite(p) and math.isfinite(q) else math.nan
        rows.append(
            {"layer": layer, "layer_type": layer_type(layer), "ptq_db": p, "qat_db": q, "delta_db": d}
        )
    return rows


def summarize(rows: Iterable[Row], columns: Iterable[str], by: str = "layer_type") -> list[Row]:
    """Mean of the numeric ``columns`` per ``by`` value (finite values only), with a count."""
    groups: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        groups[str(r[by])].append(r)
    out = []
    columns = list(columns)
    for g in sorted(groups, key=type_order if by == "layer_type" else None):
        row: Row = {by: g, "count": len(groups[g])}
        for c in columns:
            vals = [float(r[c]) for r in groups[g] if _is_number(r.get(c)) and math.isfinite(float(r[c]))]
            row[c] = sum(vals) / len(vals) if vals else math.nan
        out.append(row)
    return out


# =========================================================================== CSV
def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def write_csv(rows: Iterable[Row], path: str | os.PathLike, columns: Iterable[str] | None = None) -> Path:
    """Write rows as CSV (header = ``columns`` or the union of keys in first-seen order),
    atomically (`qatlib.checkpoint.layout.write_text`)."""
    rows = list(rows)
    if columns is None:
        columns = list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return write_text(path, buf.getvalue())


def read_csv(path: str | os.PathLike) -> list[Row]:
    """CSV rows with numeric-looking cells as floats (``inf`` / ``nan`` included)."""

    def conv(v: str) -> Any:
        try:
            return float(v)
        except ValueError:
            return v

    with Path(path).open(newline="") as f:
        return [{k: conv(v) for k, v in r.items()} for r in csv.DictReader(f)]


# =========================================================================== checkpoint SQNR
# the columns of `checkpoint_sqnr` rows and of analysis/sqnr.csv
SQNR_COLUMNS = ["layer", "layer_type", "ptq_db", "qat_db", "delta_db"]


class SqnrError(RuntimeError):
    """A checkpoint, or the weights behind its scales, is missing, incomplete or too large."""


def _sqnr_scales(ckpt: Path, what: str) -> tuple[QuantScheme, dict[str, torch.Tensor], list[str]]:
    try:
        scheme, scales = read_scheme(ckpt), load_scales(ckpt, own_names=True)
    except (FileNotFoundError, ValueError) as e:
        raise SqnrError(f"{what} checkpoint {ckpt}: {e}") from e
    layers = sorted({p.layer for k in scales if (p := parse_key(k)) and p.role == "weight"})
    return scheme, scales, layers


def checkpoint_sqnr(
    ptq_dir: str | os.PathLike,
    qat_dir: str | os.PathLike,
    base: str | os.PathLike | None = None,
    *,
    max_bytes: int | None = None,
) -> tuple[list[Row], list[str]]:
    """The per-layer weight SQNR table of a PTQ and a QAT checkpoint (`compare_sqnr` rows: layer,
    layer_type, ptq_db, qat_db, delta_db) and notes; the one computation behind ``scripts/sqnr.py``
    (``analysis/sqnr.csv``) and the report's fallback when that file is absent.

    Which full-precision weights each column quantizes, one rule for both callers:

    - QAT: the QAT checkpoint's own weights (the weights its scales were trained with);
    - PTQ: the PTQ checkpoint's own weights when it carries them (GPTQ changes the weights, so
      its scales belong to those, not to the base model's), else ``base`` (a model folder or
      ``.safetensors`` file: the weights PTQ calibrated on), else the QAT checkpoint's weights,
      with a note: exact when QAT trained the quantizer parameters alone (end-to-end QAT keeps
      the linear weights frozen), not after a run that trains weights (blockwise).

    The PTQ checkpoint's own weights come first because they are the only ones certain to be the
    weights its scales were computed on; ``base`` comes before the QAT weights because it is the
    model PTQ read, whatever QAT later did. A source is used when it holds any of the layers'
    weights, and must then hold all of them. Raises `SqnrError` for a missing checkpoint, a
    ``base`` without those weights, a source with only some of them, or one holding more than
    ``max_bytes`` of them (``None``: no limit).
    """
    ptq, qat = Path(ptq_dir), Path(qat_dir)
    per: dict[str, list[Row]] = {}
    notes: list[str] = []
    for what, ckpt in (("ptq", ptq), ("qat", qat)):
        scheme, scales, layers = _sqnr_scales(ckpt, what.upper())
        if what == "qat" or weight_bytes(ckpt, layers):
            src = ckpt
        elif base is not None:
            src = Path(base)
            if not src.exists() or not weight_bytes(src, layers):
                raise SqnrError(f"no weights for the PTQ scales in base weights {src}")
        else:
            src = qat
            notes.append(
                "PTQ SQNR uses the QAT checkpoint's weights (no base / PTQ weights found): exact only "
                "when QAT trained the quantizer parameters alone"
            )
        size = weight_bytes(src, layers)
        if size == 0 and layers:
            raise SqnrError(f"no weights for the {what.upper()} scales in {src}")
        if max_bytes is not None and size > max_bytes:
            raise SqnrError(
                f"{src} holds {size:,} bytes of weights (> {max_bytes:,}): too large to compute here; "
                "write analysis/sqnr.csv in an earlier stage"
            )
        rows = layer_sqnr(iter_weights(src, layers), scheme, scales)
        if len(rows) != len(layers):
            raise SqnrError(f"{src} has weights for {len(rows)} of the {len(layers)} layers of {ckpt}")
        per[what] = rows
    return compare_sqnr(per["ptq"], per["qat"]), notes
