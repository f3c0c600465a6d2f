"""YAML as qatlib reads it, and dotted-key overrides: no torch, no pydantic.

Why a module of its own: the Snakefile must read experiment YAMLs the same way the scripts do
(``1e-4`` is a float, duplicate keys are an error, ``--set a.b=1`` overrides are YAML values)
while it builds the DAG, without importing torch. `qatlib.config` and `workflow/lib/` both call
this one reader; `ConfigError` lives here so the reader can raise the error every config caller
catches.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "ConfigError",
    "apply_overrides",
    "config_file_candidates",
    "deep_merge",
    "format_issues",
    "join_path",
    "load_yaml",
    "normalise_overrides",
    "parse_yaml_text",
    "yaml_value",
]


class ConfigError(ValueError):
    """A configuration problem, reported as ``FILE: dotted.path: what is wrong`` (one per line).

    ``issues`` holds the ``(dotted_path, message)`` pairs so callers (tests, a CLI) can inspect
    them without parsing the text.
    """

    def __init__(self, message: str, issues: Iterable[tuple[str, str]] = ()) -> None:
        super().__init__(message)
        self.issues: list[tuple[str, str]] = list(issues)


def format_issues(issues: Iterable[tuple[str, str]], source: str | None) -> str:
    prefix = f"{source}: " if source else ""
    return "\n".join(f"{prefix}{path}: {msg}" if path else f"{prefix}{msg}" for path, msg in issues)


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads ``1e-4`` as a float.

    PyYAML implements YAML 1.1, where a float needs a dot (``1.0e-4``); upstream configs write
    ``quant_lr: 1e-4``, which would otherwise arrive as the *string* "1e-4" and fail the strict
    float check (or, inside hf_args, reach the Trainer as a string).
    """


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def join_path(loc: Iterable[Any]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _duplicate_keys(node: yaml.Node, loc: tuple[Any, ...], seen: set[int]) -> Iterator[tuple[str, str]]:
    """PyYAML keeps the last of two equal keys silently; a config with both is ambiguous."""
    if id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        keys: dict[Any, int] = {}
        for k, v in node.value:
            if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                if k.value in keys:
                    yield (
                        join_path((*loc, k.value)),
                        f"duplicate key (lines {keys[k.value] + 1} and {k.start_mark.line + 1})",
                    )
                keys.setdefault(k.value, k.start_mark.line)
                yield from _duplicate_keys(v, (*loc, k.value), seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            yield from _duplicate_keys(item, (*loc, i), seen)


def _yaml_error(e: yaml.YAMLError) -> str:
    if isinstance(e, yaml.MarkedYAMLError) and e.problem_mark is not None:
        m = e.problem_mark
        ctx = f" ({e.context})" if e.context else ""
        return f"invalid YAML at line {m.line + 1}, column {m.column + 1}: {e.problem}{ctx}"
    return f"invalid YAML: {e}"


def load_yaml(path: str | os.PathLike[str]) -> Any:
    """Read a YAML file the way `load_config` does (1e-4 floats, duplicate keys refused).

    Raises ConfigError naming the file for a missing / unreadable file or invalid YAML.
    """
    source = str(path)
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{source}: config file not found", [("", "config file not found")]) from None
    except IsADirectoryError:
        raise ConfigError(f"{source}: is a directory, not a config file", [("", "is a directory")]) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{source}: cannot read config: {e}", [("", str(e))]) from None
    return parse_yaml_text(text, source)


def parse_yaml_text(text: str, source: str) -> Any:
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        dups = list(_duplicate_keys(node, (), set()))
        if dups:
            raise ConfigError(format_issues(dups, source), dups)
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        msg = _yaml_error(e)
        raise ConfigError(f"{source}: {msg}", [("", msg)]) from None
    finally:
        loader.dispose()


def normalise_overrides(
    overrides: Mapping[str, Any] | Iterable[str] | None, source: str
) -> list[tuple[str, Any]]:
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        return [(str(k), v) for k, v in overrides.items()]
    if isinstance(overrides, str):
        overrides = [overrides]
    items = []
    for item in overrides:
        if not isinstance(item, str) or "=" not in item:
            raise ConfigError(
                f"{source}: override {item!r}: expected 'dotted.key=value'", [("", "bad override")]
            )
        key, raw = item.split("=", 1)
        try:
            value = yaml.load(raw, Loader=_Loader) if raw.strip() else None  # noqa: S506 (safe loader)
        except yaml.YAMLError as e:
            raise ConfigError(
                f"{source}: override {item!r}: {_yaml_error(e)}", [(key, "bad override")]
            ) from None
        items.append((key.strip(), value))
    return items


def apply_overrides(data: dict[str, Any], items: list[tuple[str, Any]], source: str) -> None:
    """Set dotted keys in the raw YAML dict (before validation, so overrides are validated too)."""
    for key, value in items:
        parts = key.split(".")
        if not key or any(not p for p in parts):
            raise ConfigError(f"{source}: override {key!r}: empty key component", [(key, "bad override")])
        cur = data
        for i, part in enumerate(parts[:-1]):
            nxt = cur.get(part)
            if nxt is None:
                nxt = cur[part] = {}
            elif not isinstance(nxt, dict):
                where = ".".join(parts[: i + 1])
                msg = f"override {key!r}: {where} is a {type(nxt).__name__}, not a mapping"
                raise ConfigError(f"{source}: {where}: {msg}", [(where, msg)])
            cur = nxt
        cur[parts[-1]] = value


def yaml_value(text: str) -> Any:
    """A string read as a YAML value (``"1e-4"`` -> 1e-4, ``"true"`` -> True); unparsable text stays."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError:
        return text


def section(raw: Any, dotted: str) -> Any:
    """The value at ``dotted`` (``"compression.QAT.hf_args"``) in a raw config mapping, or None
    where a part is missing: the one lookup of a key path for the plan, the workflow, the site and
    the benchmarks."""
    cur = raw
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def deep_merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """`extra` merged into a copy of `base` (mappings recursively; anything else replaced)."""
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def config_file_candidates(value: str | os.PathLike[str], first: Path, config_dir: Path | None) -> list[Path]:
    """Where a file a config names (``hf_args.deepspeed``) is looked for, in order: absolute as
    is; else under ``first`` (the scripts: the CWD, as HF Trainer does; the workflow: the
    repository root), then the YAML's folder and every folder above it (upstream's configs
    write the path from the root of their repository: ``configs/qwen3/qat/.../ds_config_zero3.json``).
    One rule for `qatlib.config` and the workflow, so both find the same file."""
    raw = Path(value).expanduser()
    if raw.is_absolute():
        return [raw]
    return [first / raw] + ([d / raw for d in (config_dir, *config_dir.parents)] if config_dir else [])
