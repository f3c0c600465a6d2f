"""Experiment configuration: the upstream AngelSlim YAML layout, validated up front.

Why this package exists: the upstream toolkit reads its YAML into plain dataclasses and dicts, so a
typo (``learnable: {lwcc: true}``), a string where a bool belongs (``do_train: "false"`` is
truthy) or an inconsistent combination (a KD ``loss_type`` with ``kd_loss_weight: 0`` silently
trains on CE only; ZeRO-3 without ``from_ptq_ckpt`` dies in ``before_train`` after the model is
already sharded) surfaces hours into a GPU job, or never. Here every such mistake is a
`ConfigError` at load time that names the file and the dotted key, so a Snakemake rule or a CLI
call fails in a second on a CPU.

Layout: the upstream sections ``model``, ``compression`` (``quantization`` and ``QAT``),
``dataset`` and ``global`` are accepted unchanged, plus the qatlib extension ``evaluation``.

=================  ==========================================================================
``sections``       one pydantic model per YAML section, and the rules inside one section
``scheme``         the quantization layers -> one `QuantScheme`, errors at the key at fault
``experiment``     `ExperimentConfig`: cross-section rules, and the runtime objects it builds
                   (``quant_scheme()``, ``prepare_options()``, ``loss_config()``, ``learnable()``,
                   ``blockwise()``, ``hf_training_args()``): downstream code uses those objects,
                   never the raw strings
``errors``         pydantic errors -> ``FILE: dotted.path: message`` with "did you mean"
``__main__``       ``python -m qatlib.config FILE [--set k=v] | --schema OUT.json``
=================  ==========================================================================

The YAML reader and ``--set`` overrides are `qatlib.yamlio`'s (also read by the workflow).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from qatlib.yamlio import ConfigError, apply_overrides, format_issues, load_yaml, normalise_overrides

from .errors import issues_from
from .experiment import ExperimentConfig
from .sections import (
    UPSTREAM_HF_ARGS,
    BlockwiseConfig,
    CompressionConfig,
    DatasetConfig,
    EvaluationConfig,
    GlobalConfig,
    LearnableConfig,
    LwcConfig,
    ModelConfig,
    OutputQuantConfig,
    PluginConfig,
    QATConfig,
    QuantConfig,
    QuantizationConfig,
    QuantMethodConfig,
    TensorQuantOverride,
    hf_training_arg_names,
)

__all__ = [
    "BlockwiseConfig",
    "CompressionConfig",
    "ConfigError",
    "DatasetConfig",
    "EvaluationConfig",
    "ExperimentConfig",
    "GlobalConfig",
    "LearnableConfig",
    "LwcConfig",
    "ModelConfig",
    "OutputQuantConfig",
    "PluginConfig",
    "QATConfig",
    "QuantConfig",
    "QuantMethodConfig",
    "QuantizationConfig",
    "TensorQuantOverride",
    "config_json_schema",
    "load_config",
    "load_yaml",
    "parse_config",
]


def parse_config(
    data: Any,
    *,
    source: str | None = None,
    config_dir: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, Any] | Iterable[str] | None = None,
) -> ExperimentConfig:
    """Validate an already-loaded config mapping (what `load_config` does after reading YAML).

    ``source`` names the origin in error messages; ``config_dir`` is where relative DeepSpeed
    paths are looked up after the CWD. ``data`` is not modified.
    """
    label = source or "<config>"
    if not isinstance(data, Mapping):
        got = "an empty document" if data is None else f"a {type(data).__name__}"
        raise ConfigError(
            f"{label}: the top level must be a mapping of sections, not {got}", [("", "not a mapping")]
        )
    raw = copy.deepcopy(dict(data))
    items = normalise_overrides(overrides, label)
    apply_overrides(raw, items, label)
    ctx = {"source": source, "config_dir": Path(config_dir).resolve() if config_dir is not None else None}
    try:
        cfg = ExperimentConfig.model_validate(raw, context=ctx)
    except ValidationError as e:
        issues = issues_from(e, [k for k, _ in items], ExperimentConfig)
        raise ConfigError(format_issues(issues, label), issues) from None
    cfg._raw = raw  # the validated mapping as written (+ overrides): what `qatlib.plan` reads
    return cfg


def load_config(
    path: str | os.PathLike[str],
    overrides: Mapping[str, Any] | Iterable[str] | None = None,
) -> ExperimentConfig:
    """Load and validate an experiment YAML.

    overrides: ``{"compression.QAT.hf_args.learning_rate": 1e-4}`` or ``["global.seed=1", ...]``
    (values YAML-parsed), applied to the raw YAML before validation so they obey every rule.
    Raises ConfigError (``FILE: dotted.path: message`` per problem) for a missing file, invalid
    YAML, a non-mapping top level, unknown keys, wrong types and violated rules.
    """
    source = str(path)
    data = load_yaml(path)
    return parse_config(data, source=source, config_dir=Path(path).parent, overrides=overrides)


def _null_branch_first(node: Any) -> None:
    """Put ``{"type": "null"}`` first in every ``anyOf`` (same meaning, different evaluation order).

    Snakemake's ``validate(..., set_default=True)`` fills defaults by calling ``setdefault`` on
    every instance a ``properties`` schema is tried against; for an optional section that is
    null, trying the object branch first crashes it (AttributeError on None). anyOf stops at the
    first branch that matches, so with null first the object branch is never tried on None.
    """
    if isinstance(node, dict):
        branches = node.get("anyOf")
        if isinstance(branches, list):
            branches.sort(key=lambda b: not (isinstance(b, dict) and b.get("type") == "null"))
        for value in node.values():
            _null_branch_first(value)
    elif isinstance(node, list):
        for value in node:
            _null_branch_first(value)


def config_json_schema() -> dict[str, Any]:
    """JSON schema of the YAML layout (keys by alias), for Snakemake's ``validate``.

    It checks keys and types; the cross-field rules need `load_config`. ``hf_args`` keys are
    restricted to the fields of ``transformers.Seq2SeqTrainingArguments`` plus the upstream ones
    qatlib translates (``warmup_ratio``).
    """
    schema = ExperimentConfig.model_json_schema(by_alias=True)
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}
    _null_branch_first(schema)
    hf_args = schema["$defs"]["QATConfig"]["properties"]["hf_args"]
    names = sorted((hf_training_arg_names() | UPSTREAM_HF_ARGS) - {"output_dir"})
    for branch in hf_args.get("anyOf", [hf_args]):
        if branch.get("type") == "object":
            branch["propertyNames"] = {"enum": names}
    return schema
