"""``deploy.target``: an export the target runtime cannot load is a ConfigError at parse time,
naming ``deploy.target`` and the runtime's reason (qatlib.runtime.facts). One case per refused
(target, layout, dense/MoE, capability) combination; MoE-ness is read from a local model folder's
config.json."""

from __future__ import annotations

import json

import pytest

from qatlib.config import parse_config
from qatlib.config.deploy import check_deploy_for_model, local_model_is_moe
from qatlib.yamlio import ConfigError

FP8_CHANNEL_STATIC = {"name": "fp8_static", "quant_method": {"weight": "per-channel"}}
INT4_ASYM = {
    "name": "int4_weight_only",
    "quant_method": {"weight": "per-group"},
}


def _cfg(model_path, quantization, deploy=None, plugin=None):
    data = {
        "model": {"model_path": str(model_path)},
        "compression": {"name": "PTQ", "quantization": quantization},
    }
    if plugin:
        data["compression"]["QAT"] = {"plugin_config": {"quant_config": plugin}}
    if deploy is not None:
        data["deploy"] = deploy
    return parse_config(data)


@pytest.fixture
def moe_dir(tmp_path):
    d = tmp_path / "moe"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 4}))
    return d


@pytest.fixture
def dense_dir(tmp_path):
    d = tmp_path / "dense"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    return d


# (target, quantization, quant_config overrides, moe, capability, words of the runtime's reason)
REFUSED = {
    "vllm-moe-fp8-channel-static": ("vllm", FP8_CHANNEL_STATIC, None, True, None, "AssertionError"),
    "sglang-moe-fp8-channel-static": ("sglang", FP8_CHANNEL_STATIC, None, True, None, "AssertionError"),
    "vllm-moe-fp8-dynamic-tensor": ("vllm", {"name": "fp8_dynamic"}, None, True, None, "kFp8Dynamic128Sym"),
    "vllm-moe-fp8-weight-only": (
        "vllm",
        {"name": "fp8_static"},
        {"use_activation_quant": False},
        True,
        None,
        "weight-only experts",
    ),
    "sglang-moe-fp8-weight-only": (
        "sglang",
        {"name": "fp8_static"},
        {"use_activation_quant": False},
        True,
        None,
        "weight-only experts",
    ),
    "vllm-moe-int8-static": (
        "vllm",
        {"name": "int8"},
        {"activation": {"granularity": "per-tensor", "dynamic": False}},
        True,
        None,
        "Unsupported FusedMoe",
    ),
    "sglang-moe-int8-static": (
        "sglang",
        {"name": "int8"},
        {"activation": {"granularity": "per-tensor", "dynamic": False}},
        True,
        None,
        "static-input experts",
    ),
    "sglang-moe-int8-dynamic": ("sglang", {"name": "int8"}, None, True, None, "only for NPU"),
    "sglang-moe-int4-asym": ("sglang", INT4_ASYM, {"weight": {"is_sym": False}}, True, None, "AWQ layout"),
    "sglang-int3": ("sglang", {"name": "int3_weight_only"}, None, False, None, "Marlin is 4/8-bit only"),
    "sglang-w4a8": ("sglang", {"name": "w4a8_fp8"}, None, False, None, "no dense compressed-tensors W4A8"),
    "vllm-w4a8-sm89": ("vllm", {"name": "w4a8_fp8"}, None, False, "8.9", "exactly SM90"),
    "vllm-w4a8-sm100": ("vllm", {"name": "w4a8_fp8"}, None, True, "10.0", "exactly SM90"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_deploy_target_refuses_at_parse_time(case, moe_dir, dense_dir):
    target, quant, plugin, moe, cap, why = REFUSED[case]
    deploy = {"target": target} | ({"capability": cap} if cap else {})
    path = moe_dir if moe else dense_dir
    with pytest.raises(ConfigError) as e:
        _cfg(path, quant, deploy, plugin)
    assert [p for p, _ in e.value.issues] == ["deploy.target"]
    msg = e.value.issues[0][1]
    assert why in msg and ("0.33.0" in msg if target == "vllm" else "0.5.23" in msg)
    # the same format on the other model kind / with the target off parses
    _cfg(path, quant, {"target": "none"}, plugin)
    if moe and cap is None:
        _cfg(dense_dir, quant, {"target": target}, plugin)


def test_default_target_is_vllm_and_loadable_formats_parse(moe_dir, dense_dir):
    assert _cfg(moe_dir, {"name": "fp8_static"}).deploy.target == "vllm"
    with pytest.raises(ConfigError, match="deploy.target: vllm 0.33.0 cannot load"):
        _cfg(moe_dir, {"name": "fp8_dynamic"})  # the default target applies
    for quant in ({"name": "fp8_static"}, {"name": "int4_weight_only"}, {"name": "int8"}):
        for path in (moe_dir, dense_dir):
            _cfg(path, quant, {"target": "vllm"})
    _cfg(dense_dir, {"name": "w4a8_fp8"}, {"target": "vllm", "capability": "9.0"})
    with pytest.raises(ConfigError, match="deploy.capability"):
        _cfg(dense_dir, {"name": "w4a8_fp8"}, {"target": "vllm", "capability": "sm90"})
    with pytest.raises(ConfigError, match="deploy.target"):
        _cfg(dense_dir, {"name": "fp8_static"}, {"target": "tensorrt"})


def test_moe_unknown_at_parse_time_is_checked_when_the_model_config_is_known(tmp_path):
    """A hub id (or a folder not built yet): MoE-only refusals wait for the model's config."""
    assert local_model_is_moe("Qwen/Qwen3-30B-A3B") is None
    cfg = _cfg("Qwen/Qwen3-30B-A3B", {"name": "fp8_dynamic"})
    with pytest.raises(ConfigError, match="MoE model.*kFp8Dynamic128Sym"):
        check_deploy_for_model(
            cfg.deploy, cfg.quant_scheme(), {"model_type": "qwen3_moe", "num_experts": 128}
        )
    check_deploy_for_model(cfg.deploy, cfg.quant_scheme(), {"model_type": "qwen3"})
    with pytest.raises(ConfigError, match="any model.*no dense compressed-tensors W4A8"):
        _cfg("Qwen/Qwen3-30B-A3B", {"name": "w4a8_fp8"}, {"target": "sglang"})
