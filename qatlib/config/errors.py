"""Config errors as a user reads them: ``FILE: dotted.path: message``, one line per problem.

Pydantic reports ``loc`` tuples and its own wording; here each error becomes a dotted path into
the YAML (aliases as written: ``global``, ``QAT``) and a short message: the expected type and the
value found, the allowed keys with a "did you mean" for an unknown key, and "(set by override
...)" when a ``--set`` override put the value there. Rules that find several problems at once
raise one `issues_error` carrying each problem at its own sub-path.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticCustomError

from qatlib.yamlio import join_path

__all__ = ["Violation", "issues_error", "issues_from"]


class Violation(Exception):
    """One rule violation at a dotted path (turned into a ConfigError by the caller)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


# Error type used by validators that report several problems, each at its own sub-path. The
# formatter expands ``ctx["issues"]`` (pairs of path relative to the error's loc, message).
_ISSUES_ERROR = "qatlib_config_rules"


def issues_error(issues: list[tuple[str, str]]) -> PydanticCustomError:
    """A validator's error for several ``(sub.path, message)`` problems (paths relative to it)."""
    summary = "; ".join(f"{p}: {m}" if p else m for p, m in issues)
    return PydanticCustomError(_ISSUES_ERROR, "{summary}", {"summary": summary, "issues": tuple(issues)})


_TYPE_WORDS = {
    "bool_type": "expected true or false",
    "int_type": "expected an integer",
    "float_type": "expected a number",
    "string_type": "expected a string",
    "dict_type": "expected a mapping",
    "model_type": "expected a mapping",
    "model_attributes_type": "expected a mapping",
    "list_type": "expected a list",
}


def _short(value: Any) -> str:
    r = repr(value)
    return r if len(r) <= 80 else r[:77] + "..."


def _section_class(root: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model class at ``loc`` under ``root`` (for listing the keys an unknown key could have meant)."""
    cls = root
    for part in loc:
        if isinstance(part, int):
            return None
        field = next((f for n, f in cls.model_fields.items() if (f.alias or n) == part), None)
        if field is None:
            return None
        ann = field.annotation
        candidates = (
            typing.get_args(ann)
            if isinstance(ann, types.UnionType) or typing.get_origin(ann) is typing.Union
            else (ann,)
        )
        nxt = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if nxt is None:
            return None
        cls = nxt
    return cls


def _describe(root: type[BaseModel], err: Mapping[str, Any]) -> str:
    kind = err["type"]
    loc = tuple(err["loc"])
    if kind == "extra_forbidden":
        cls = _section_class(root, loc[:-1])
        if cls is None:
            return "unknown key"
        allowed = [f.alias or n for n, f in cls.model_fields.items()]
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"unknown key{hint} (allowed: {', '.join(allowed)})"
    if kind == "missing":
        return "required key missing"
    if kind in _TYPE_WORDS:
        return f"{_TYPE_WORDS[kind]}, got {type(err['input']).__name__} {_short(err['input'])}"
    if kind == "literal_error":
        return f"must be one of {err['ctx']['expected']}; got {_short(err['input'])}"
    msg = str(err["msg"])
    if kind == "value_error":
        return msg.removeprefix("Value error, ")
    return f"{msg[0].lower()}{msg[1:]}; got {_short(err['input'])}"


def issues_from(
    err: ValidationError, overridden: Iterable[str], root: type[BaseModel]
) -> list[tuple[str, str]]:
    """``(dotted.path, message)`` per problem of ``err`` (validating ``root``); a problem at or
    under an ``overridden`` key says so."""
    issues: list[tuple[str, str]] = []
    for e in err.errors():
        loc = tuple(e["loc"])
        if e["type"] == _ISSUES_ERROR:
            base = join_path(loc)
            for sub, msg in e["ctx"]["issues"]:
                issues.append((f"{base}.{sub}" if base and sub else (base or sub), msg))
        else:
            issues.append((join_path(loc), _describe(root, e)))
    overridden = list(overridden)
    out = []
    for path, msg in issues:
        ov = next(
            (o for o in overridden if path == o or path.startswith(o + ".") or o.startswith(path + ".")), None
        )
        out.append((path, f"{msg} (set by override {ov!r})" if ov else msg))
    return out
