"""The HTML block mini-language of the report: cell formatting and the block dicts the Jinja
template (``template.html``) renders (``table``, ``p``, ``h3``, ``img``, ``pre``, ``unavailable``),
plus `json_tables` for any JSON document (the benchmark results)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def fmt(v: Any, digits: int = 4) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return f"{v:.{digits}f}" if 1e-3 <= abs(v) < 1e5 or v == 0 else f"{v:.{digits}g}"
    if isinstance(v, (list, tuple)) and all(not isinstance(x, (dict, list)) for x in v):
        return ", ".join(fmt(x, digits) for x in v)
    if isinstance(v, (dict, list)):
        return json.dumps(v, default=str)[:500]
    return str(v)


def nbytes(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return fmt(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def seconds(s: Any) -> str:
    if not isinstance(s, (int, float)):
        return fmt(s)
    m, sec = divmod(float(s), 60)
    h, m = divmod(int(m), 60)
    return f"{h}:{m:02d}:{sec:04.1f}" if h else f"{m}:{sec:04.1f}" if m else f"{sec:.1f} s"


def cell(v: str, cls: str = "", title: str = "") -> dict[str, str]:
    return {"v": v, "cls": cls, "title": title}


def table(
    columns: Sequence[str], rows: Iterable[Sequence[Any]], caption: str = "", text_cols: int = 1
) -> dict:
    return {
        "kind": "table",
        "columns": list(columns),
        "rows": [list(r) for r in rows],
        "caption": caption,
        "text_cols": text_cols,
    }


def para(text: str) -> dict:
    return {"kind": "p", "text": text}


def h3(text: str) -> dict:
    return {"kind": "h3", "text": text}


def img(fig: Any, alt: str) -> dict:
    from .figures import png_base64

    return {"kind": "img", "b64": png_base64(fig), "alt": alt}


def unavailable(text: str) -> dict:
    return {"kind": "unavailable", "text": text}


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, f"{key}."))
        else:
            out[key] = v
    return out


def json_tables(data: Any, caption: str) -> list[dict]:
    """A generic JSON document as table blocks: a list of objects -> one row each; an object of
    objects -> one row per key; any other object -> key / value rows (nested keys dotted)."""
    if isinstance(data, list) and data and all(isinstance(x, Mapping) for x in data):
        flat = [_flatten(x) for x in data]
        cols = list(dict.fromkeys(k for r in flat for k in r))
        return [table(cols, [[fmt(r.get(c)) for c in cols] for r in flat], caption, 0)]
    if isinstance(data, Mapping):
        if data and all(isinstance(v, Mapping) for v in data.values()):
            flat = {k: _flatten(v) for k, v in data.items()}
            cols = list(dict.fromkeys(c for r in flat.values() for c in r))
            return [
                table(["", *cols], [[k, *[fmt(r.get(c)) for c in cols]] for k, r in flat.items()], caption)
            ]
        scalars = {
            k: v for k, v in data.items() if not (isinstance(v, list) and v and isinstance(v[0], Mapping))
        }
        blocks = (
            [table(["key", "value"], [[k, fmt(v)] for k, v in _flatten(scalars).items()], caption, 2)]
            if scalars
            else []
        )
        for k, v in data.items():
            if k not in scalars:
                blocks += json_tables(v, f"{caption}: {k}")
        return blocks
    return [table(["value"], [[fmt(data)]], caption, 1)]


def pre(text: str) -> dict:
    return {"kind": "pre", "text": text}
