"""Matplotlib figures of the report (and the scale notebook), built without pyplot.

Each function returns a `matplotlib.figure.Figure` drawn on the Agg canvas: no global pyplot state,
no display needed. `png_base64` turns one into the string embedded in the HTML.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..analysis import type_order

PTQ_COLOR = "#d95f02"
QAT_COLOR = "#1b9e77"


def _figure(w: float, h: float, nrows: int = 1) -> Figure:
    # Fixed margins instead of a layout engine: constrained layout triples the drawing time.
    fig = Figure(figsize=(w, h), dpi=90)
    FigureCanvasAgg(fig)
    fig.subplots_adjust(
        left=0.8 / w,
        right=1 - 0.15 / w,
        bottom=0.5 / h,
        top=1 - 0.35 / h,
        wspace=0.3,
        hspace=0.75 if nrows > 1 else 0.2,
    )
    return fig


def png_base64(fig: Figure) -> str:
    """The figure as base64 PNG, without metadata (same inputs -> same bytes)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _grid(n: int, ncols: int = 3) -> tuple[int, int]:
    ncols = max(1, min(ncols, n))
    return math.ceil(n / ncols), ncols


def loss_curves(rows: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> Figure:
    """One panel per loss key (value vs step), plus the learning rate when logged."""
    panels = list(keys) + (["learning_rate"] if any("learning_rate" in r for r in rows) else [])
    nrows, ncols = _grid(len(panels))
    fig = _figure(4.2 * ncols, 2.8 * nrows, nrows)
    axes = fig.subplots(nrows, ncols, squeeze=False).flatten()
    for ax, key in zip(axes, panels):
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and "step" in r]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(
                xs,
                ys,
                marker="." if len(xs) < 50 else None,
                color=QAT_COLOR if key != "learning_rate" else "#7570b3",
            )
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    return fig


def _log10(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().double().abs()
    return torch.log10(t[t > 0])


def scale_histograms(
    before: Mapping[str, torch.Tensor],
    after: Mapping[str, torch.Tensor],
    *,
    labels: tuple[str, str] = ("PTQ", "QAT"),
    bins: int = 50,
    ncols: int = 3,
) -> Figure:
    """Overlaid histograms of log10(scale), one panel per layer type.

    ``before`` / ``after``: layer type -> all scale values of that type
    (`qatlib.analysis.values_by_type`); either may lack a type."""
    types = sorted(set(before) | set(after), key=type_order)
    nrows, ncols = _grid(max(len(types), 1), ncols)
    fig = _figure(4.2 * ncols, 2.8 * nrows, nrows)
    axes = fig.subplots(nrows, ncols, squeeze=False).flatten()
    for ax, t in zip(axes, types):
        series = [(labels[0], before.get(t), PTQ_COLOR), (labels[1], after.get(t), QAT_COLOR)]
        vals = [_log10(v) for _, v, _ in series if v is not None and v.numel()]
        if not vals or not any(v.numel() for v in vals):
            ax.set_title(f"{t} (no positive scales)")
            continue
        lo = min(v.min().item() for v in vals if v.numel())
        hi = max(v.max().item() for v in vals if v.numel())
        if hi - lo < 1e-9:
            lo, hi = lo - 0.5, hi + 0.5
        pad = 1e-6 * (hi - lo)
        edges = torch.linspace(lo - pad, hi + pad, bins + 1, dtype=torch.float64).tolist()
        for label, v, color in series:
            if v is not None and v.numel():
                ax.hist(
                    _log10(v).numpy(),
                    bins=edges,
                    histtype="stepfilled",
                    alpha=0.5,
                    color=color,
                    label=f"{label} (n={v.numel()})",
                )
        ax.set_title(t)
        ax.set_xlabel("log10(scale)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    for ax in axes[len(types) :]:
        ax.set_visible(False)
    return fig


def value_histograms(
    series: Mapping[str, torch.Tensor], xlabel: str, *, bins: int = 50, ncols: int = 3
) -> Figure:
    """One histogram panel per key (e.g. `qatlib.analysis.ratio_by_type`)."""
    keys = sorted(series, key=type_order)
    nrows, ncols = _grid(max(len(keys), 1), ncols)
    fig = _figure(4.2 * ncols, 2.8 * nrows, nrows)
    axes = fig.subplots(nrows, ncols, squeeze=False).flatten()
    for ax, k in zip(axes, keys):
        v = series[k].detach().double()
        v = v[torch.isfinite(v)]
        if v.numel():
            ax.hist(v.numpy(), bins=bins, histtype="stepfilled", color=QAT_COLOR, alpha=0.7)
        ax.set_title(f"{k} (n={v.numel()})")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    for ax in axes[len(keys) :]:
        ax.set_visible(False)
    return fig


def sqnr_per_layer(rows: Sequence[Mapping[str, Any]]) -> Figure:
    """PTQ and QAT weight SQNR vs BF16 (dB, `qatlib.analysis.checkpoint_sqnr`) per layer, in layer
    order; infinite values are not drawn."""
    fig = _figure(max(6.0, min(0.06 * len(rows) + 4, 16.0)), 3.4)
    ax = fig.subplots()
    xs = list(range(len(rows)))

    def finite(col: str) -> tuple[list[int], list[float]]:
        pts = [
            (i, float(r[col]))
            for i, r in zip(xs, rows)
            if isinstance(r.get(col), (int, float)) and math.isfinite(r[col])
        ]
        return ([p[0] for p in pts], [p[1] for p in pts]) if pts else ([], [])

    for col, label, color in (("ptq_db", "PTQ vs BF16", PTQ_COLOR), ("qat_db", "QAT vs BF16", QAT_COLOR)):
        x, y = finite(col)
        ax.plot(x, y, ".", color=color, label=label, markersize=4)
    ax.set_xlabel("layer (name order)")
    ax.set_ylabel("weight SQNR vs BF16 (dB)")
    ax.legend()
    ax.grid(alpha=0.3)
    return fig
