"""Scale statistics and per-layer weight SQNR against the BF16 weights for PTQ / QAT checkpoints
(the metric: `checkpoint_sqnr`).

Reads checkpoints through `qatlib.checkpoint` (docs/design.md): `load_scales` gives the scale keys
(``L.weight_scale``, ``L.input_scale``, ``<attn>.k_cache.scale``, ...) of a PTQ / QAT checkpoint,
`WeightReader` its weights (or a base model's) one at a time.

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
class WeightReader(Mapping[str, torch.Tensor]):
    """The ``<layer>.weight`` tensors of a model folder or ``.safetensors`` file
    (`qatlib.checkpoint.layout.weight_files`) for the given layers, keyed by layer.

    Found from the file headers (a key in several files: the first); each tensor is read when it is
    looked up, with plain file reads (`qatlib.checkpoint.safetensors.read_tensor`), and not kept, so
    a reader holds no weight. Iterates in storage order; layers without a weight there are absent.
    ``nbytes``: what reading every one of them reads."""

    def __init__(self, path: str | os.PathLike, layers: Iterable[str]) -> None:
        self.path = Path(path)
        wanted = {f"{layer}.weight": layer for layer in layers}
        self._infos: dict[str, st.TensorInfo] = {}
        for file in weight_files(self.path):
            for info in st.read_header(file):
                layer = wanted.pop(info.key, None)
                if layer is not None:
                    self._infos[layer] = info

    def __getitem__(self, layer: str) -> torch.Tensor:
        info = self._infos[layer]
        with open(info.file, "rb") as fh:
            return st.read_tensor(fh, info)

    def __iter__(self):
        return iter(self._infos)

    def __len__(self) -> int:
        return len(self._infos)

    @property
    def nbytes(self) -> int:
        return sum(i.end - i.start for i in self._infos.values())


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


def deployed_weight(
    layer: str, w: torch.Tensor, spec: QuantSpec, scales: Mapping[str, torch.Tensor]
) -> torch.Tensor | None:
    """The dequantized weight a variant deploys for ``layer``: ``w`` fake-quantized
    (`qatlib.quant.functional.fake_quantize`) with the variant's stored ``weight_scale`` (and zero
    point, NVFP4 global scale, FOCUS sub-group logits: their initial value when absent, a PTQ start),
    in fp32. No LWC on top: a stored scale is already the clipped one. None without a
    ``weight_scale``."""
    s = scales.get(f"{layer}.weight_scale")
    if s is None:
        return None
    zp = scales.get(f"{layer}.weight_zero_point")
    x = w.detach().float()
    gs = scales.get(f"{layer}.weight_global_scale")  # NVFP4
    logit = scales.get(f"{layer}.weight_quantizer.subgroup_logit")  # FOCUS
    if spec.subgroups and logit is None:
        logit = torch.full(subgroup_shape(x.shape, spec), SUBGROUP_LOGIT_INIT)
    return fake_quantize(
        x,
        s.float(),
        None if zp is None else zp.float(),
        spec,
        global_scale=None if gs is None else gs.float(),
        subgroup_scale=None if logit is None else torch.sigmoid(logit.float()),
    )


def _layer_name(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


@torch.no_grad()
def layer_sqnr(
    weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    scheme: QuantScheme | QuantSpec,
    scales: Mapping[str, torch.Tensor],
    reference: Mapping[str, torch.Tensor] | None = None,
) -> list[Row]:
    """Per layer with a ``weight_scale`` in ``scales``: `sqnr_db` of ``reference``'s weight of the
    layer against the layer's `deployed_weight` (``weights``' weight fake-quantized with
    ``scales``). ``weights`` maps a layer (module name, or its ``<layer>.weight`` key) to the weight
    the scales quantize, or is an iterable of such pairs; a Mapping is read only for the layers with
    a scale. ``reference`` maps a layer (or its ``.weight`` key) to the weight measured against
    (`checkpoint_sqnr`: the BF16 weights); None: the quantized weight itself. Rows: layer,
    layer_type, numel, sqnr_db (in `natural_key` order of the layer)."""
    spec = _weight_spec(scheme)
    if spec is None:
        return []
    if isinstance(weights, Mapping):
        pairs = ((n, weights[n]) for n in weights if f"{_layer_name(n)}.weight_scale" in scales)
    else:
        pairs = iter(weights)
    rows = []
    for name, w in pairs:
        layer = _layer_name(name)
        fq = deployed_weight(layer, w, spec, scales)
        if fq is None:
            continue
        # the same source: one read
        ref = w if reference is None or reference is weights else _reference_weight(reference, layer)
        if ref.shape != fq.shape:
            raise ValueError(f"{layer}: reference weight {tuple(ref.shape)}, quantized {tuple(fq.shape)}")
        rows.append(
            {
                "layer": layer,
                "layer_type": layer_type(layer),
                "numel": fq.numel(),
                "sqnr_db": sqnr_db(ref, fq),
            }
        )
    rows.sort(key=lambda r: natural_key(r["layer"]))
    return rows


def _reference_weight(reference: Mapping[str, torch.Tensor], layer: str) -> torch.Tensor:
    for key in (layer, f"{layer}.weight"):
        if key in reference:
            return reference[key]
    raise ValueError(f"{layer}: no reference weight")


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


def _weights(
    src: Path, layers: list[str], scales: str, max_bytes: int | None, *, kind: str = "", required: bool = True
) -> WeightReader | None:
    """The weights of ``layers`` (those of the ``scales``) in ``src``: all of them, or None when it
    holds none and they are not ``required``; `SqnrError` for some but not all, none when
    required, or more than ``max_bytes`` of them."""
    reader = WeightReader(src, layers)
    if not reader and not required:
        return None
    if not reader and layers:
        raise SqnrError(f"no {kind}weights for the {scales} in {src}")
    if len(reader) != len(layers):
        raise SqnrError(f"{src} has weights for {len(reader)} of the {len(layers)} layers of the {scales}")
    if max_bytes is not None and reader.nbytes > max_bytes:
        raise SqnrError(
            f"{src} holds {reader.nbytes:,} bytes of weights (> {max_bytes:,}): too large to compute "
            "here; write analysis/sqnr.csv in an earlier stage"
        )
    return reader


def checkpoint_sqnr(
    ptq_dir: str | os.PathLike,
    qat_dir: str | os.PathLike,
    base: str | os.PathLike | None = None,
    *,
    max_bytes: int | None = None,
) -> tuple[list[Row], list[str]]:
    """The per-layer weight SQNR of a PTQ and a QAT checkpoint, both against the BF16 weights
    (`compare_sqnr` rows: layer, layer_type, ptq_db, qat_db, delta_db) and notes; the one
    computation behind ``scripts/sqnr.py`` (``analysis/sqnr.csv``) and the report's fallback.

    The metric, defined here and only here: per weight-quantized linear,
    ``SQNR_dB = 10 log10(sum(W_bf16^2) / sum((W_bf16 - W_q)^2))`` (`sqnr_db`, float64), how far the
    weight a variant deploys is from the original. ``W_bf16`` is the layer's weight in the base
    (unquantized) model; ``W_q`` the dequantized weight the variant deploys (`deployed_weight`:
    fake-quantized with the variant's stored scales):

    - ``ptq_db``: ``W_q = Q(W, PTQ scales)``, ``W`` the PTQ checkpoint's own weights when it carries
      them (GPTQ changes the weights and deploys those), else ``W_bf16``;
    - ``qat_db``: ``W_q = Q(W_qat, QAT scales)``, ``W_qat`` the QAT checkpoint's weights: ``W_bf16``
      after QAT of the scales alone, ``codes x scale`` with frozen codes (`qatlib.quant.codes`:
      already on the grid, so ``W_q = W_qat``), the trained weights when the weights trained;
    - ``delta_db``: ``qat_db - ptq_db``.

    A column is ``inf`` (the report's n/a) only where ``W_q`` equals ``W_bf16``.

    ``W_bf16`` is read from ``base`` (the base model's folder or ``.safetensors`` file). Without it
    the QAT checkpoint's weights stand in, with a note: exact only when QAT trained the scales
    alone on the base weights (no frozen codes, no trained weights, no GPTQ start); a second note
    when every QAT weight lies on its own grid (frozen codes), where they cannot be the BF16 ones.

    Weights are read one tensor at a time (`WeightReader`). A source is used when it holds any of
    the layers' weights, and must then hold all of them. Raises `SqnrError` for a missing
    checkpoint, a ``base`` without those weights, a source with only some of them, or one holding
    more than ``max_bytes`` of them (``None``: no limit).
    """
    ptq, qat = Path(ptq_dir), Path(qat_dir)
    ptq_scheme, ptq_scales, ptq_layers = _sqnr_scales(ptq, "PTQ")
    qat_scheme, qat_scales, qat_layers = _sqnr_scales(qat, "QAT")
    every = sorted(set(ptq_layers) | set(qat_layers), key=natural_key)
    notes: list[str] = []
    qat_w = _weights(qat, qat_layers, "QAT scales", max_bytes)
    if base is not None:
        bf16 = _weights(Path(base), every, "PTQ and QAT scales", max_bytes, kind="BF16 ")
    else:
        bf16 = _weights(qat, every, "PTQ and QAT scales", max_bytes)
        notes.append(
            "no BF16 weights given (the base model's): the QAT checkpoint's weights stand in for "
            "them, exact only when QAT trained the scales alone on the base model's weights"
        )
    ptq_w = _weights(ptq, ptq_layers, "PTQ scales", max_bytes, required=False) or bf16
    try:
        ptq_rows = layer_sqnr(ptq_w, ptq_scheme, ptq_scales, bf16)
        qat_rows = layer_sqnr(qat_w, qat_scheme, qat_scales, bf16)
    except ValueError as e:
        raise SqnrError(str(e)) from e
    if base is None and qat_rows and all(r["sqnr_db"] == math.inf for r in qat_rows):
        notes.append(
            "every QAT weight lies on its own quantization grid (frozen codes: the QAT checkpoint "
            "holds codes x scale), so it is no BF16 weight: give the base weights to measure "
            "either column against BF16"
        )
    return compare_sqnr(ptq_rows, qat_rows), notes
