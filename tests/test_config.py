"""Tests of qatlib.config: upstream YAMLs load unchanged, every mistake names FILE and key.

The bad cases are the point: each one is a mistake the upstream toolkit accepts and then fails on
(or silently ignores) hours into a GPU job.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from qatlib.config import (
    ConfigError,
    ExperimentConfig,
    config_json_schema,
    load_config,
    load_yaml,
    parse_config,
)
from qatlib.config.__main__ import main
from qatlib.losses import LOSS_PATTERN, LossConfig
from qatlib.quant.linear import PrepareOptions
from qatlib.quant.spec import PRESETS, Granularity, QuantScheme, QuantSpec, SpecError
from qatlib.trainers.blockwise import BlockwiseSettings
from qatlib.trainers.params import Learnable

DATA = Path(__file__).parent / "data" / "configs"
QC = "compression.QAT.plugin_config.quant_config"

# --------------------------------------------------------------------------------------------
# Upstream configs (verbatim layout, comments included)
# --------------------------------------------------------------------------------------------

# qat-zero3.md "示例 yaml 关键片段", completed with the model/dataset/global sections of the
# upstream 4B ZeRO-3 config (device_map: None is the upstream spelling).
ZERO3_YAML = """\
global:
  save_path: ./output

model:
  name: Qwen
  model_path: Qwen/Qwen3-4B
  trust_remote_code: true
  torch_dtype: auto
  device_map: None
  low_cpu_mem_usage: true
  use_cache: false

compression:
  name: QAT
  quantization:
    name: fp8_static
    quant_method:
      weight: per-tensor
      activation: per-tensor
    ignore_layers: ["lm_head", "embed_tokens", "gate.weight"]
  QAT:
    hf_dataset: null
    from_ptq_ckpt: ./output_ptq_30b/qwen3-a3b_fp8_static
    training_mode: end2end
    dist_mode: hf
    save_format: real
    loss_type: cakld
    lm_loss_weight: 1.0
    kd_loss_weight: 1.0
    plugin_config:
      enable_scale: true
      quant_config:
        use_weight_quant: true
        use_activation_quant: true
        weight_scale_init_value: 0.1
        activation_scale_init_value: 0.1
        learnable:
          act_scale: false
          weight_scale: true
          kv_scale: false
          norm: false
          lwc: false
    hf_args:
      bf16: true
      per_device_train_batch_size: 1
      learning_rate: 1.0e-6
      gradient_checkpointing: true
      deepspeed: ds_config_zero3.json

dataset:
  name: TextDataset
  data_path: ./dataset/sharegpt.jsonl
  max_seq_length: 2048
  num_samples: 256
  batch_size: 1
"""

DS_ZERO3 = {
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3,
        "stage3_gather_16bit_weights_on_model_save": True,
        "overlap_comm": True,
        "contiguous_gradients": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _zero3_files(tmp_path: Path, stage: int = 3) -> Path:
    (tmp_path / "ds_config_zero3.json").write_text(
        json.dumps({**DS_ZERO3, "zero_optimization": {"stage": stage}})
    )
    return _write(tmp_path, "zero3.yaml", ZERO3_YAML)


# --------------------------------------------------------------------------------------------
# Good configs
# --------------------------------------------------------------------------------------------


def test_upstream_zero3_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path / "..")  # the ds json is found next to the YAML, not in the CWD
    cfg = load_config(_zero3_files(tmp_path))
    assert isinstance(cfg, ExperimentConfig)
    assert cfg.model.device_map is None  # the string "None" is normalised
    assert cfg.model.trust_remote_code is True and cfg.model.use_cache is False
    assert cfg.compression.name == "QAT"
    assert cfg.quantization.ignore_layers == ["lm_head", "embed_tokens", "gate.weight"]
    q = cfg.qat
    assert q.from_ptq_ckpt == "./output_ptq_30b/qwen3-a3b_fp8_static"
    assert q.hf_dataset is None and q.save_format == "real"
    loss = cfg.loss_config()
    assert loss == LossConfig(loss_type="cakld", lm_loss_weight=1.0, kd_loss_weight=1.0)
    assert loss.kind == "cakld" and loss.kd_enabled and loss.lm_enabled and loss.topk is None
    qc = q.plugin_config.quant_config
    assert qc.weight_scale_init_value == 0.1 and qc.activation_scale_init_value == 0.1
    assert qc.learnable.weight_scale and not qc.learnable.act_scale
    assert q.hf_args["learning_rate"] == 1e-6 and q.hf_args["bf16"] is True
    assert cfg.zero3_enabled is True
    assert cfg.deepspeed_config["zero_optimization"]["stage"] == 3
    assert cfg.deepspeed_config_path == (tmp_path / "ds_config_zero3.json").resolve()
    assert cfg.source == str(tmp_path / "zero3.yaml")
    args = cfg.hf_training_args()
    # the file's content plus qatlib's ZeRO-3 default: one expert per gather (qatlib.zero3.ds_config)
    expert_leaf = {"leaf_module": {"classes": ["qatlib.surgery.moe.ExpertMLP"]}}
    assert args["deepspeed"] == {**DS_ZERO3, "zero_optimization": {"stage": 3, **expert_leaf}}
    assert cfg.deepspeed_config == args["deepspeed"]
    assert args["output_dir"] == "./output" and args["seed"] == 42
    assert cfg.global_.save_path == "./output" and cfg.global_.seed == 42
    scheme = cfg.quant_scheme()
    assert scheme.weight == PRESETS["fp8_static"].weight
    assert scheme.input == QuantSpec("fp8", Granularity.TENSOR)
    assert scheme.name == "fp8_static" and scheme.k is None and not scheme.fp8_attn


def test_experts_sharing_a_scale_with_training_weights_gather_whole_layers(tmp_path: Path) -> None:
    """fp8_static under deploy.target vllm ties every expert's input scale of a layer into one; with
    the weights training too (weight_lr) one expert per ZeRO-3 gather fails in DeepSpeed
    (`qatlib.zero3.ds_config.expert_leaf_issue`): the default becomes a whole layer's experts, and a JSON
    that names ExpertMLP is refused naming the file and the field. Scales alone keep one expert."""
    yaml_path = _zero3_files(tmp_path)
    wlr = {"compression.QAT.plugin_config.quant_config.weight_lr": 1e-5}
    cfg = load_config(yaml_path, wlr)
    layer = {"classes": ["qatlib.surgery.moe.LinearizedMoeExperts"]}
    assert cfg.deepspeed_config["zero_optimization"]["leaf_module"] == layer
    cfg = load_config(yaml_path, {**wlr, "deploy.target": "none"})  # nothing tied: one expert
    assert cfg.deepspeed_config["zero_optimization"]["leaf_module"] == {
        "classes": ["qatlib.surgery.moe.ExpertMLP"]
    }
    own = {"zero_optimization": {"stage": 3, "leaf_module": {"classes": ["qatlib.surgery.moe.ExpertMLP"]}}}
    (tmp_path / "own.json").write_text(json.dumps(own))
    with pytest.raises(ConfigError) as e:
        load_config(yaml_path, {**wlr, "compression.QAT.hf_args.deepspeed": str(tmp_path / "own.json")})
    msg = str(e.value)
    assert "compression.QAT.hf_args.deepspeed" in msg and "own.json" in msg
    assert "qatlib.surgery.moe.LinearizedMoeExperts" in msg
    cfg = load_config(yaml_path, {"compression.QAT.hf_args.deepspeed": str(tmp_path / "own.json")})
    assert cfg.deepspeed_config == own  # scales only: the user's list stands


def test_deepspeed_path_cwd_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    yaml_path = _zero3_files(tmp_path, stage=3)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "ds_config_zero3.json").write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    monkeypatch.chdir(cwd)
    cfg = load_config(yaml_path)
    assert cfg.deepspeed_config_path == (cwd / "ds_config_zero3.json").resolve()
    assert cfg.zero3_enabled is False  # stage 2: no from_ptq_ckpt requirement either


def test_deepspeed_inline_dict(tmp_path: Path) -> None:
    p = _write(tmp_path, "c.yaml", ZERO3_YAML)
    cfg = load_config(p, {"compression.QAT.hf_args.deepspeed": {"zero_optimization": {"stage": 3}}})
    assert cfg.zero3_enabled and cfg.deepspeed_config_path is None
    leaf = {"classes": ["qatlib.surgery.moe.ExpertMLP"]}
    assert cfg.hf_training_args()["deepspeed"] == {"zero_optimization": {"stage": 3, "leaf_module": leaf}}


def test_deepspeed_json_with_its_own_leaf_list_is_passed_as_the_file(tmp_path: Path) -> None:
    """A JSON that names its own ``leaf_module`` owns the choice: nothing is added, and the Trainer
    gets the file itself; a stage-2 config gets no ZeRO-3 default either."""
    yaml_path = _zero3_files(tmp_path)
    own = {"zero_optimization": {"stage": 3, "leaf_module": {"classes": []}}}
    (tmp_path / "own.json").write_text(json.dumps(own))
    cfg = load_config(yaml_path, {"compression.QAT.hf_args.deepspeed": str(tmp_path / "own.json")})
    assert cfg.deepspeed_config == own
    assert cfg.hf_training_args()["deepspeed"] == str((tmp_path / "own.json").resolve())
    (tmp_path / "s2.json").write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    cfg = load_config(yaml_path, {"compression.QAT.hf_args.deepspeed": str(tmp_path / "s2.json")})
    assert cfg.deepspeed_config == {"zero_optimization": {"stage": 2}}


def test_deepspeed_optimizer_block_refused_scheduler_allowed(tmp_path: Path) -> None:
    """The parse-time rule (docs/reference/config.md): qatlib owns the optimizer (its scale / LWC groups), so a DeepSpeed
    config with an ``optimizer`` block is an error at hf_args.deepspeed; ``scheduler`` is fine."""
    p = _write(tmp_path, "c.yaml", ZERO3_YAML)
    ds = "compression.QAT.hf_args.deepspeed"
    cfg = load_config(p, {ds: {**DS_ZERO3, "scheduler": {"type": "WarmupLR"}}})
    assert cfg.zero3_enabled and cfg.deepspeed_config["scheduler"] == {"type": "WarmupLR"}
    (tmp_path / "ds_opt.json").write_text(json.dumps({**DS_ZERO3, "optimizer": {"type": "AdamW"}}))
    with pytest.raises(ConfigError) as ei:
        load_config(p, {ds: "ds_opt.json"})
    assert ei.value.issues == [(ds, ei.value.issues[0][1])]  # this one problem only
    msg = str(ei.value)
    assert msg.startswith(f"{p}: {ds}: DeepSpeed config ") and "ds_opt.json" in msg
    assert "has an 'optimizer' block (AdamW)" in msg


def test_upstream_int4_end2end() -> None:
    """Upstream's int4 config has no quantization.name: the weight override defines the format."""
    cfg = load_config(DATA / "qwen3-4b_int4_weight_only_end2end.yaml")
    assert cfg.qat.training_mode == "end2end" and cfg.qat.save_format == "fake"
    assert cfg.qat.hf_args == {}  # `hf_args:` followed by comments only is YAML null
    assert cfg.qat.hf_dataset == "Salesforce/wikitext,wikitext-2-raw-v1"
    assert cfg.zero3_enabled is False and cfg.deepspeed_config is None
    scheme = cfg.quant_scheme()
    assert scheme.weight == QuantSpec("int4", Granularity.GROUP, group_size=128, symmetric=True)
    assert scheme.input is None  # use_activation_quant: false
    assert scheme.q is scheme.k is scheme.v is None


def test_upstream_blockwise() -> None:
    cfg = load_config(DATA / "qwen3-4b_int4_weight_only_blockwise.yaml")
    bw = cfg.qat.block_wise_config
    assert cfg.qat.training_mode == "blockwise"
    assert (bw.epochs, bw.batch_size, bw.train_size, bw.training_seqlen) == (10, 2, 4096, 2048)
    assert bw.val_size == 64  # default
    # upstream writes `quant_lr: 1e-4`, a *string* for a YAML 1.1 parser; we read a float
    assert isinstance(bw.quant_lr, float) and bw.quant_lr == 1e-4 and bw.weight_lr == 1e-4
    assert bw.min_lr_factor == 20.0 and bw.wd == 0.0
    assert cfg.quant_scheme().weight.describe() == "int4 per-group g128 sym static"


def test_upstream_w4a8_fp8_qkv_fp8attn() -> None:
    cfg = load_config(DATA / "qwen3-4b_w4a8_fp8_end2end_qkv_fp8attn.yaml")
    s = cfg.quant_scheme()
    assert s.name == "w4a8_fp8"
    assert s.weight == QuantSpec("int4", Granularity.GROUP, group_size=128, fp8_recast=True)
    assert s.input == QuantSpec("fp8", Granularity.TENSOR, dynamic=False)
    assert s.q == QuantSpec("fp8", Granularity.TOKEN, dynamic=True)
    assert s.k == s.v == QuantSpec("fp8", Granularity.HEAD)
    assert s.fp8_attn is True
    assert cfg.qat.plugin_config.quant_config.learnable.act_scale is True
    assert cfg.qat.save_format == "save_kvcache_only"


def test_overview_weight_override_group_size_ignored_unless_per_group(tmp_path: Path) -> None:
    """qat-overview.md's override example: int8 per-tensor with group_size 128 (ignored, as upstream)."""
    cfg = load_config(
        DATA / "qwen3-4b_w4a8_fp8_end2end_qkv_fp8attn.yaml",
        {
            f"{QC}.weight": {"qtype": "int8", "granularity": "per-tensor", "group_size": 128, "is_sym": True},
            f"{QC}.activation": {
                "qtype": "int8",
                "granularity": "per-tensor",
                "is_sym": True,
                "dynamic": False,
            },
        },
    )
    s = cfg.quant_scheme()
    assert s.weight == QuantSpec("int8", Granularity.TENSOR, fp8_recast=True)
    assert s.input == QuantSpec("int8", Granularity.TENSOR)


@pytest.mark.parametrize(
    ("overrides", "weight", "inp"),
    [
        # quantization.group_size overrides the preset's 128
        (
            ["compression.quantization.quant_method.group_size=64"],
            QuantSpec("int4", "per-group", 64, fp8_recast=True),
            "fp8",
        ),
        # weight -> fp8 drops the int4->fp8 recast; activation goes dynamic per-token
        (
            [
                f"{QC}.weight={{qtype: fp8, granularity: per-channel}}",
                f"{QC}.activation={{granularity: per-token}}",
                f"{QC}.learnable.act_scale=false",  # a dynamic input has no scale to learn
            ],
            QuantSpec("fp8", "per-channel"),
            QuantSpec("fp8", "per-token", dynamic=True),
        ),
        # asymmetric int weights, group size from the override block
        (
            [f"{QC}.weight={{qtype: int3, is_sym: false, group_size: 32}}"],
            QuantSpec("int3", "per-group", 32, symmetric=False, fp8_recast=True),
            "fp8",
        ),
        ([f"{QC}.use_weight_quant=false"], None, "fp8"),
    ],
)
def test_scheme_overrides(overrides: list[str], weight: Any, inp: Any) -> None:
    cfg = load_config(DATA / "qwen3-4b_w4a8_fp8_end2end_qkv_fp8attn.yaml", overrides)
    s = cfg.quant_scheme()
    assert s.weight == weight
    assert s.input == (QuantSpec("fp8", "per-tensor") if inp == "fp8" else inp)


def test_scheme_from_bits_and_presets(tmp_path: Path) -> None:
    base = DATA / "qwen3-4b_int4_weight_only_end2end.yaml"
    drop = {f"{QC}.weight": None, f"{QC}.use_activation_quant": True}
    s = load_config(base, {**drop, "compression.quantization.bits": 4}).quant_scheme()
    assert s.weight == QuantSpec("int4") and s.input == QuantSpec("int4")
    s = load_config(
        base,
        {
            **drop,
            "compression.quantization.quant_method": {"weight": "per-channel", "activation": "per-token"},
        },
    ).quant_scheme()
    assert s.weight == QuantSpec("int8", "per-channel") and s.input == QuantSpec(
        "int8", "per-token", dynamic=True
    )
    for name in ("fp8_dynamic", "int8", "w8a8", "int2_weight_only"):
        s = load_config(base, {**drop, "compression.quantization.name": name}).quant_scheme()
        assert s == PRESETS[name]
    s = load_config(base, {**drop, "compression.quantization.name": "fp8_static", "compression.name": "PTQ"})
    assert s.compression.name == "PTQ" and s.quant_scheme() == PRESETS["fp8_static"]


def test_loss_config_built_from_yaml(tmp_path: Path) -> None:
    base = DATA / "qwen3-4b_int4_weight_only_end2end.yaml"
    kd = {"compression.QAT.kd_loss_weight": 0.5}
    loss = load_config(base, {**kd, "compression.QAT.loss_type": "kl_top_1000"}).loss_config()
    assert (loss.topk, loss.kind, loss.kd_loss_weight, loss.kd_enabled) == (1000, "kl_top", 0.5, True)
    loss = load_config(
        base, {**kd, "compression.QAT.loss_type": "r_kl_top", "compression.QAT.loss_topk": 50}
    ).loss_config()
    assert (loss.topk, loss.kind, loss.loss_topk) == (50, "r_kl_top", 50)
    loss = load_config(
        base, {**kd, "compression.QAT.loss_type": "r_kl_top_10", "compression.QAT.loss_topk": 20}
    ).loss_config()
    assert loss.topk == 20  # loss_topk overrides the inline K (upstream semantics)
    cfg = load_config(
        base,
        {
            **kd,
            "compression.QAT.loss_type": "kd",
            "compression.QAT.kd_temperature": 2,
            "compression.QAT.kd_alpha": 0,
        },
    )
    q = cfg.qat
    assert q.kd_temperature == 2.0 and isinstance(q.kd_temperature, float) and q.kd_alpha == 0.0
    assert cfg.loss_config() == LossConfig(
        loss_type="kd", kd_temperature=2.0, kd_alpha=0.0, lm_loss_weight=1.0, kd_loss_weight=0.5
    )
    loss = load_config(base).loss_config()
    assert loss == LossConfig() and (loss.kind, loss.kd_enabled, loss.topk) == ("origin", False, None)


def test_runtime_objects_built_from_yaml() -> None:
    """learnable() / blockwise() / prepare_options() carry the YAML's values into the library objects."""
    cfg = load_config(DATA / "qwen3-4b_int4_weight_only_blockwise.yaml")
    assert cfg.blockwise() == BlockwiseSettings(
        epochs=10,
        batch_size=2,
        train_size=4096,
        val_size=64,
        training_seqlen=2048,
        quant_lr=1e-4,
        weight_lr=1e-4,
    )
    assert cfg.learnable() == Learnable()  # no learnable section: the defaults (weight scales)
    cfg = load_config(DATA / "qwen3-4b_w4a8_fp8_end2end_qkv_fp8attn.yaml")
    assert cfg.learnable() == Learnable(act_scale=True, weight_scale=False)
    cfg = load_config(
        DATA / "qwen3-4b_w4a8_fp8_end2end_qkv_fp8attn.yaml",
        {
            f"{QC}.learnable": {"weight_scale": False, "kv_scale": True, "norm": True, "lwc": True},
            f"{QC}.lwc": {"enable_lwc": True, "lwc_init_value": 3.0},
            f"{QC}.weight_scale_init_value": 0.25,
            "compression.QAT.block_wise_config": {
                "epochs": 3,
                "wd": 0.1,
                "min_lr_factor": 5,
                "loss": "token_relative",
            },
        },
    )
    assert cfg.learnable() == Learnable(
        act_scale=False, weight_scale=False, kv_scale=True, norm=True, lwc=True
    )
    bw = cfg.blockwise()
    assert (bw.epochs, bw.wd, bw.min_lr_factor, bw.quant_lr, bw.loss) == (
        3,
        0.1,
        5.0,
        BlockwiseSettings.quant_lr,
        "token_relative",
    )
    opts = cfg.prepare_options()
    assert isinstance(opts, PrepareOptions) and (opts.weight_init_value, opts.lwc_init) == (0.25, 3.0)


def test_yaml_defaults_are_the_library_defaults() -> None:
    """A YAML that sets nothing builds exactly the library's default objects (declared once)."""
    cfg = parse_config(
        {"model": {"model_path": "m"}, "compression": {"name": "QAT"}, "dataset": {"data_path": "d"}}
    )
    assert cfg.loss_config() == LossConfig()
    assert cfg.learnable() == Learnable()
    assert cfg.blockwise() == BlockwiseSettings()


def test_overrides_mapping_and_strings(tmp_path: Path) -> None:
    base = DATA / "qwen3-4b_int4_weight_only_end2end.yaml"
    cfg = load_config(
        base,
        {"compression.QAT.hf_args.learning_rate": 1e-4, "global.seed": 7, "evaluation.ppl": ["wikitext2"]},
    )
    assert cfg.qat.hf_args == {"learning_rate": 1e-4}  # created under the YAML-null hf_args
    assert cfg.global_.seed == 7 and cfg.evaluation.ppl == ["wikitext2"]
    assert cfg.evaluation.max_seq_length == 2048 and cfg.evaluation.limit is None
    cfg = load_config(
        base,
        [
            "compression.QAT.hf_args.learning_rate=1e-5",  # YAML-parsed: a float, not a string
            "compression.QAT.hf_args.num_train_epochs=2",
            "model.device_map=",  # empty value = null
            "evaluation={tasks: [piqa, ./tasks/mine], limit: 100}",
        ],
    )
    assert cfg.qat.hf_args == {"learning_rate": 1e-5, "num_train_epochs": 2}
    assert cfg.model.device_map is None
    assert cfg.evaluation.tasks == ["piqa", "./tasks/mine"] and cfg.evaluation.limit == 100
    # the file on disk and the caller's mapping are untouched
    assert load_config(base).global_.seed == 42


def test_override_errors(tmp_path: Path) -> None:
    base = DATA / "qwen3-4b_int4_weight_only_end2end.yaml"
    with pytest.raises(ConfigError, match=r"model\.name: override 'model\.name\.x'"):
        load_config(base, ["model.name.x=1"])
    with pytest.raises(ConfigError, match="expected 'dotted.key=value'"):
        load_config(base, ["global.seed"])
    with pytest.raises(ConfigError) as ei:
        load_config(base, ["global.seed=yes"])
    assert "global.seed: expected an integer, got bool True (set by override 'global.seed')" in str(ei.value)


def test_parse_config_dict_and_error_collection() -> None:
    data = load_yaml(DATA / "qwen3-4b_int4_weight_only_end2end.yaml")
    before = copy.deepcopy(data)
    cfg = parse_config(data)
    assert cfg.source is None and data == before
    bad = copy.deepcopy(data)
    bad["model"]["use_cache"] = "false"
    bad["dataset"]["num_samples"] = "256"
    bad["compression"]["QAT"]["plugin_config"]["quant_config"]["learnable"] = {"lwcc": True}
    with pytest.raises(ConfigError) as ei:
        parse_config(bad, source="exp.yaml")
    err = ei.value
    assert isinstance(err, ValueError)
    paths = sorted(p for p, _ in err.issues)
    assert paths == sorted(["model.use_cache", f"{QC}.learnable.lwcc", "dataset.num_samples"])
    lines = str(err).splitlines()
    assert len(lines) == 3 and all(line.startswith("exp.yaml: ") for line in lines)
    assert f"exp.yaml: {QC}.learnable.lwcc: unknown key; did you mean 'lwc'?" in str(err)


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: QuantSpec("int16"), "qtype"),
        (lambda: QuantSpec("int4", "per-row"), "granularity"),
        (lambda: QuantSpec("int4", "per-group"), "group_size"),
        (lambda: QuantSpec("int4", "per-channel", group_size=32), "group_size"),
        (lambda: QuantSpec("fp8", symmetric=False), "symmetric"),
        (lambda: QuantSpec("int8", "per-head", num_heads=0), "num_heads"),
        (lambda: QuantSpec("fp8", fp8_recast=True), "fp8_recast"),
        (lambda: QuantScheme(weight=QuantSpec("int8", "per-token")), "granularity"),
        (lambda: QuantScheme(weight=QuantSpec("int8", dynamic=True)), "dynamic"),
        (lambda: QuantScheme(input=QuantSpec("int8", "per-channel")), "granularity"),
        (lambda: QuantScheme(k=QuantSpec("fp8", "per-group", group_size=8)), "granularity"),
    ],
)
def test_spec_errors_name_their_field(build: Any, field: str) -> None:
    """spec.py says which field is at fault (the config maps it to the YAML key that set it)."""
    with pytest.raises(SpecError) as ei:
        build()
    assert ei.value.field == field and isinstance(ei.value, ValueError)


def test_json_schema(tmp_path: Path) -> None:
    schema = config_json_schema()
    for name in (
        "qwen3-4b_int4_weight_only_end2end.yaml",
        "qwen3-4b_int4_weight_only_blockwise.yaml",
        "qwen3-4b_w4a8_fp8_end2end_qkv_fp8attn.yaml",
    ):
        jsonschema.validate(load_yaml(DATA / name), schema)
    jsonschema.validate(yaml.load(ZERO3_YAML, Loader=yaml.SafeLoader), schema)
    # the loss vocabulary in the schema is losses.py's
    assert schema["$defs"]["QATConfig"]["properties"]["loss_type"]["pattern"] == LOSS_PATTERN
    for loss, ok in (
        ("cakld", True),
        ("kl_top_5", True),
        ("r_kl_top", True),
        ("kl_top_0", False),
        ("klx", False),
    ):
        data = load_yaml(DATA / "qwen3-4b_int4_weight_only_end2end.yaml")
        data["compression"]["QAT"]["loss_type"] = loss
        if ok:
            jsonschema.validate(data, schema)
        else:
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(data, schema)
    bad = load_yaml(DATA / "qwen3-4b_int4_weight_only_end2end.yaml")
    bad["compression"]["QAT"]["plugin_config"]["quant_config"]["learnable"] = {"lwcc": True}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    bad = load_yaml(DATA / "qwen3-4b_int4_weight_only_end2end.yaml")
    bad["compression"]["QAT"]["hf_args"] = {"learnin_rate": 1.0}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    out = tmp_path / "sub" / "schema.json"
    assert main(["--schema", str(out)]) == 0
    assert json.loads(out.read_text()) == schema
    assert main([str(DATA / "qwen3-4b_int4_weight_only_end2end.yaml")]) == 0
    assert main([str(DATA / "qwen3-4b_int4_weight_only_end2end.yaml"), "--set", "global.seed=x"]) == 1


def test_json_schema_with_snakemake_validate(tmp_path: Path) -> None:
    """Snakemake fills schema defaults in place; the filled config must still be valid for us."""
    pytest.importorskip("snakemake")
    from snakemake.utils import validate

    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(config_json_schema()))
    for name in ("qwen3-4b_int4_weight_only_blockwise.yaml", "qwen3-4b_w4a8_fp8_end2end_qkv_fp8attn.yaml"):
        data = load_yaml(DATA / name)  # (Snakemake's own loader would read `1e-4` as a string)
        validate(data, str(schema_file))
        assert data["model"]["device_map"] == "auto" and "evaluation" in data  # defaults were filled
        assert parse_config(data).quant_scheme() == load_config(DATA / name).quant_scheme()


# --------------------------------------------------------------------------------------------
# Bad configs: each must name the file and the dotted key
# --------------------------------------------------------------------------------------------

DEL = object()  # marker: remove the key

# A ZeRO-3 variant of the w4a8 config that is valid; the ZeRO-3 cases each break one thing.
ZERO3_OK = {
    "compression.QAT.hf_args": {"deepspeed": "ds3.json", "bf16": True},
    "compression.QAT.from_ptq_ckpt": "./ptq_out",
    "compression.QAT.save_format": "real",
    "model.device_map": "None",
}


def _set(data: dict[str, Any], key: str, value: Any) -> None:
    """Test-side dotted-key edit (independent of the override code under test)."""
    *parents, last = key.split(".")
    for p in parents:
        if not isinstance(data.get(p), dict):
            data[p] = {}
        data = data[p]
    if value is DEL:
        data.pop(last, None)
    else:
        data[last] = copy.deepcopy(value)


# (id, edits applied to the w4a8 upstream config or raw YAML text, expected dotted path)
BAD_CASES: list[tuple[str, dict[str, Any] | str, str]] = [
    ("unknown-key-deep", {f"{QC}.learnable.lwcc": True}, f"{QC}.learnable.lwcc"),
    ("frozen-codes-weights", {f"{QC}.frozen_codes": True, f"{QC}.weight_lr": 1e-5}, f"{QC}.frozen_codes"),
    ("frozen-codes-lwc", {f"{QC}.frozen_codes": True, f"{QC}.lwc.enable_lwc": True}, f"{QC}.frozen_codes"),
    ("weight-update-without-weights", {f"{QC}.weight_update": "relative"}, f"{QC}.weight_update"),
    ("weight-update-unknown", {f"{QC}.weight_update": "log", f"{QC}.weight_lr": 1e-5}, f"{QC}.weight_update"),
    ("unknown-section", {"modle": {"name": "x"}}, "modle"),
    ("unknown-key-model", {"model.cache_dirr": "/x"}, "model.cache_dirr"),
    (
        "unknown-key-blockwise",
        {"compression.QAT.block_wise_config.epoch": 3},
        "compression.QAT.block_wise_config.epoch",
    ),
    (
        "blockwise-loss-unknown",
        {"compression.QAT.block_wise_config.loss": "l1"},
        "compression.QAT.block_wise_config.loss",
    ),
    ("unknown-key-qkv", {f"{QC}.k": {"qtype": "fp8", "granularity": "per-head", "sym": True}}, f"{QC}.k.sym"),
    ("bool-as-string", {"compression.QAT.do_train": "true"}, "compression.QAT.do_train"),
    (
        "int-as-string",
        {"compression.QAT.block_wise_config.epochs": "10"},
        "compression.QAT.block_wise_config.epochs",
    ),
    ("int-as-bool", {"dataset.batch_size": True}, "dataset.batch_size"),
    ("float-as-string", {f"{QC}.weight_scale_init_value": "0.1"}, f"{QC}.weight_scale_init_value"),
    (
        "list-as-string",
        {"compression.quantization.ignore_layers": "lm_head"},
        "compression.quantization.ignore_layers",
    ),
    (
        "list-item-type",
        {"compression.quantization.ignore_layers": ["lm_head", 3]},
        "compression.quantization.ignore_layers[1]",
    ),
    ("str-as-int", {"model.model_path": 123}, "model.model_path"),
    ("section-not-mapping", {"global": "out"}, "global"),
    ("missing-required", {"model.model_path": DEL}, "model.model_path"),
    ("missing-section", {"compression": DEL}, "compression"),
    ("bad-dtype", {"model.torch_dtype": "half"}, "model.torch_dtype"),
    ("bad-training-mode", {"compression.QAT.training_mode": "layerwise"}, "compression.QAT.training_mode"),
    ("bad-dist-mode", {"compression.QAT.dist_mode": "fsdp"}, "compression.QAT.dist_mode"),
    ("bad-save-format", {"compression.QAT.save_format": "safetensors"}, "compression.QAT.save_format"),
    ("bad-compression-name", {"compression.name": "Cache"}, "compression.name"),
    ("bad-qtype", {f"{QC}.weight": {"qtype": "int16"}}, f"{QC}.weight.qtype"),
    (
        "bad-granularity",
        {"compression.quantization.quant_method.weight": "per-row"},
        "compression.quantization.quant_method.weight",
    ),
    (
        "bad-bits",
        {"compression.quantization.name": DEL, "compression.quantization.bits": 9},
        "compression.quantization.bits",
    ),
    (
        "negative-group-size",
        {"compression.quantization.group_size": -5},
        "compression.quantization.group_size",
    ),
    ("loss-type-unknown", {"compression.QAT.loss_type": "kl_topx"}, "compression.QAT.loss_type"),
    (
        "loss-type-k-zero",
        {"compression.QAT.loss_type": "kl_top_0", "compression.QAT.kd_loss_weight": 1},
        "compression.QAT.loss_type",
    ),
    (
        "loss-topk-wrong-loss",
        {
            "compression.QAT.loss_type": "kl",
            "compression.QAT.kd_loss_weight": 1,
            "compression.QAT.loss_topk": 5,
        },
        "compression.QAT.loss_topk",
    ),
    (
        "loss-topk-negative",
        {
            "compression.QAT.loss_type": "kl_top",
            "compression.QAT.kd_loss_weight": 1,
            "compression.QAT.loss_topk": -1,
        },
        "compression.QAT.loss_topk",
    ),
    (
        "topk-without-k",
        {"compression.QAT.loss_type": "r_kl_top", "compression.QAT.kd_loss_weight": 1},
        "compression.QAT.loss_type",
    ),
    (
        "kd-temperature-zero",
        {
            "compression.QAT.loss_type": "kd",
            "compression.QAT.kd_loss_weight": 1,
            "compression.QAT.kd_temperature": 0,
        },
        "compression.QAT.kd_temperature",
    ),
    (
        "kd-alpha-range",
        {
            "compression.QAT.loss_type": "kd",
            "compression.QAT.kd_loss_weight": 1,
            "compression.QAT.kd_alpha": 1.5,
        },
        "compression.QAT.kd_alpha",
    ),
    (
        "kd-temperature-not-kd",
        {
            "compression.QAT.loss_type": "kl",
            "compression.QAT.kd_loss_weight": 1,
            "compression.QAT.kd_temperature": 2.0,
        },
        "compression.QAT.kd_temperature",
    ),
    ("kd-alpha-not-kd", {"compression.QAT.kd_alpha": 0.9}, "compression.QAT.kd_alpha"),
    ("weights-both-zero", {"compression.QAT.lm_loss_weight": 0}, "compression.QAT.lm_loss_weight"),
    ("weight-negative", {"compression.QAT.kd_loss_weight": -1.0}, "compression.QAT.kd_loss_weight"),
    ("kd-loss-weight-zero", {"compression.QAT.loss_type": "cakld"}, "compression.QAT.kd_loss_weight"),
    ("origin-with-kd-weight", {"compression.QAT.kd_loss_weight": 1.0}, "compression.QAT.loss_type"),
    (
        "zero3-no-ptq-ckpt",
        {**ZERO3_OK, "compression.QAT.from_ptq_ckpt": DEL},
        "compression.QAT.from_ptq_ckpt",
    ),
    (
        "zero3-empty-ptq-ckpt",
        {**ZERO3_OK, "compression.QAT.from_ptq_ckpt": ""},
        "compression.QAT.from_ptq_ckpt",
    ),
    (
        "zero3-blockwise",
        {**ZERO3_OK, "compression.QAT.training_mode": "blockwise"},
        "compression.QAT.training_mode",
    ),
    ("zero3-device-map", {**ZERO3_OK, "model.device_map": "auto"}, "model.device_map"),
    (
        "zero3-no-bf16",
        {**ZERO3_OK, "compression.QAT.hf_args": {"deepspeed": "ds3.json"}},
        "compression.QAT.hf_args.bf16",
    ),
    (
        "deepspeed-missing-file",
        {**ZERO3_OK, "compression.QAT.hf_args.deepspeed": "nope.json"},
        "compression.QAT.hf_args.deepspeed",
    ),
    (
        "deepspeed-bad-json",
        {**ZERO3_OK, "compression.QAT.hf_args.deepspeed": "broken.json"},
        "compression.QAT.hf_args.deepspeed",
    ),
    (
        "deepspeed-optimizer-block",
        {**ZERO3_OK, "compression.QAT.hf_args.deepspeed": "ds3_optimizer.json"},
        "compression.QAT.hf_args.deepspeed",
    ),
    (
        "deepspeed-optimizer-inline-no-zero3",
        {"compression.QAT.hf_args": {"deepspeed": {"optimizer": {"type": "AdamW"}}}},
        "compression.QAT.hf_args.deepspeed",
    ),
    (
        "hf-args-unknown",
        {"compression.QAT.hf_args": {"learnin_rate": 1e-5}},
        "compression.QAT.hf_args.learnin_rate",
    ),
    (
        "hf-args-output-dir",
        {"compression.QAT.hf_args": {"output_dir": "/x"}},
        "compression.QAT.hf_args.output_dir",
    ),
    ("hf-args-seed-conflict", {"compression.QAT.hf_args": {"seed": 1}}, "compression.QAT.hf_args.seed"),
    ("lwc-learnable-not-enabled", {f"{QC}.learnable.lwc": True}, f"{QC}.learnable.lwc"),
    (
        "lwc-without-weight-quant",
        {f"{QC}.lwc.enable_lwc": True, f"{QC}.use_weight_quant": False},
        f"{QC}.lwc.enable_lwc",
    ),
    ("fp8-attn-not-eager", {"model.attn_implementation": "sdpa"}, f"{QC}.fp8_attn"),
    (
        "per-group-no-size",
        {
            "compression.quantization.name": "fp8_static",
            "compression.quantization.quant_method.group_size": DEL,
        },
        "compression.quantization.group_size",
    ),
    (
        "per-group-override-size-none",
        {f"{QC}.weight": {"granularity": "per-group", "group_size": -1}},
        f"{QC}.weight.group_size",
    ),
    (
        "group-size-conflict",
        {"compression.quantization.group_size": 64},
        "compression.quantization.group_size",
    ),
    ("unknown-preset", {"compression.quantization.name": "int4_awq"}, "compression.quantization.name"),
    ("fp8-asymmetric", {f"{QC}.activation": {"is_sym": False}}, f"{QC}.activation.is_sym"),
    ("weight-dynamic", {f"{QC}.weight": {"dynamic": True}}, f"{QC}.weight.dynamic"),
    (
        "activation-per-channel",
        {f"{QC}.activation": {"granularity": "per-channel"}},
        f"{QC}.activation.granularity",
    ),
    (
        "weight-per-token",
        {"compression.quantization.quant_method.weight": "per-token"},
        "compression.quantization.quant_method.weight",
    ),
    (
        "k-per-group",
        {f"{QC}.k": {"qtype": "fp8", "granularity": "per-group", "group_size": 64}},
        f"{QC}.k.granularity",
    ),
    (
        "kv-scale-without-kv",
        {f"{QC}.learnable.kv_scale": True, f"{QC}.k": DEL, f"{QC}.v": DEL},
        f"{QC}.learnable.kv_scale",
    ),
    ("act-scale-dynamic", {f"{QC}.activation": {"dynamic": True}}, f"{QC}.learnable.act_scale"),
    (
        "nothing-quantized",
        {
            f"{QC}.use_weight_quant": False,
            f"{QC}.use_activation_quant": False,
            f"{QC}.q": DEL,
            f"{QC}.k": DEL,
            f"{QC}.v": DEL,
            f"{QC}.fp8_attn": False,
        },
        QC,
    ),
    (
        "rotation",
        {"compression.QAT.plugin_config.enable_rotation": True},
        "compression.QAT.plugin_config.enable_rotation",
    ),
    (
        "blockwise-kd",
        {
            "compression.QAT.training_mode": "blockwise",
            "compression.QAT.loss_type": "kl",
            "compression.QAT.kd_loss_weight": 1,
        },
        "compression.QAT.loss_type",
    ),
    ("no-data", {"compression.QAT.hf_dataset": None, "dataset": DEL}, "dataset"),
    ("eval-limit", {"evaluation": {"ppl": ["wikitext2"], "limit": 0}}, "evaluation.limit"),
    ("eval-unknown", {"evaluation": {"ppl_datasets": ["c4"]}}, "evaluation.ppl_datasets"),
    ("eval-empty-task", {"evaluation": {"tasks": [""]}}, "evaluation.tasks[0]"),
    ("global-alias-only", {"global_": {"seed": 1}}, "global_"),
    ("duplicate-key", "model:\n  name: a\n  model_path: x\n  model_path: y\n", "model.model_path"),
]

# text-level failures: only the file can be named (no path exists yet)
BAD_FILES = [
    ("invalid-yaml", "model:\n  name: [unclosed\n", "invalid YAML at line"),
    ("top-level-list", "- model\n- compression\n", "top level must be a mapping"),
    ("empty-file", "# nothing\n", "top level must be a mapping"),
    ("tab-indent", "model:\n\tname: x\n", "invalid YAML"),
]


@pytest.fixture(scope="module")
def w4a8_raw() -> dict[str, Any]:
    return load_yaml(DATA / "qwen3-4b_w4a8_fp8_end2end_qkv_fp8attn.yaml")


@pytest.mark.parametrize(("case", "edit", "path"), BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_config(tmp_path: Path, w4a8_raw: dict[str, Any], case: str, edit: Any, path: str) -> None:
    (tmp_path / "ds3.json").write_text(json.dumps(DS_ZERO3))
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "ds3_optimizer.json").write_text(
        json.dumps({**DS_ZERO3, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    )
    if isinstance(edit, str):
        text = edit
    else:
        data = copy.deepcopy(w4a8_raw)
        for key, value in edit.items():
            _set(data, key, value)
        text = yaml.safe_dump(data, sort_keys=False)
    cfg_file = _write(tmp_path, f"{case}.yaml", text)
    with pytest.raises(ConfigError) as ei:
        load_config(cfg_file)
    msg = str(ei.value)
    assert f"{cfg_file}: {path}:" in msg, msg
    assert path in [p for p, _ in ei.value.issues]


@pytest.mark.parametrize(("case", "text", "expect"), BAD_FILES, ids=[c[0] for c in BAD_FILES])
def test_bad_file(tmp_path: Path, case: str, text: str, expect: str) -> None:
    cfg_file = _write(tmp_path, f"{case}.yaml", text)
    with pytest.raises(ConfigError, match=expect) as ei:
        load_config(cfg_file)
    assert str(ei.value).startswith(f"{cfg_file}: ")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"missing\.yaml: config file not found"):
        load_config(tmp_path / "missing.yaml")


def test_bad_cases_are_valid_without_the_edit(tmp_path: Path, w4a8_raw: dict[str, Any]) -> None:
    """The base of the bad cases (and its ZeRO-3 variant) is valid: each case fails for its edit."""
    (tmp_path / "ds3.json").write_text(json.dumps(DS_ZERO3))
    data = copy.deepcopy(w4a8_raw)
    for key, value in ZERO3_OK.items():
        _set(data, key, value)
    cfg = load_config(_write(tmp_path, "ok.yaml", yaml.safe_dump(data)))
    assert cfg.zero3_enabled and cfg.model.device_map is None
    assert load_config(DATA / "qwen3-4b_w4a8_fp8_end2end_qkv_fp8attn.yaml").zero3_enabled is False
    # save_format is the export stage's, which reads the consolidated QAT checkpoint in one process:
    # a `fake` export after ZeRO-3 QAT is fine (upstream FOCUS's *_zero3.yaml ask for it)
    _set(data, "compression.QAT.save_format", "fake")
    fake = load_config(_write(tmp_path, "fake.yaml", yaml.safe_dump(data)))
    assert fake.zero3_enabled and fake.qat.save_format == "fake"


def test_raw_is_the_validated_mapping_with_its_overrides(tmp_path):
    """`ExperimentConfig.raw` is what `qatlib.plan` reads (e.g. `qatlib.plan.streamed` in the stage
    scripts): the YAML's own keys with the overrides applied, no defaults filled in, a copy."""
    from qatlib.config import load_config
    from qatlib.plan import streamed

    exp = Path(__file__).parents[1] / "config/experiments/smollm2-135m.yaml"
    cfg = load_config(exp, ["compression.quantization.name=int4_gptq"])
    raw = cfg.raw
    assert raw["compression"]["quantization"]["name"] == "int4_gptq"
    assert "deploy" not in raw or raw["deploy"] == load_yaml(exp).get("deploy")  # not filled with defaults
    assert streamed(raw, "ptq_calibrate") is False and streamed(load_config(exp).raw, "ptq_calibrate") is True
    raw["compression"]["quantization"]["name"] = "x"
    assert cfg.raw["compression"]["quantization"]["name"] == "int4_gptq"


def test_nvfp4_input_global_scale_is_a_learnable_activation_scale(monkeypatch):
    """NVFP4's inputs are dynamic per group of 16 under a static per-tensor global scale, which the
    trainer learns with ``learnable.act_scale`` (`qatlib.trainers.params.select_trainable`); MXFP4's
    inputs have no static scale at all, so there the key is refused by name."""
    repo = Path(__file__).parents[1]
    monkeypatch.chdir(repo)  # the DeepSpeed JSON path is relative to the repository
    exp = repo / "config/experiments/smollm2-135m-nvfp4.yaml"
    cfg = load_config(exp)
    assert cfg.qat.plugin_config.quant_config.learnable.act_scale is True
    scheme = cfg.quant_scheme()
    assert scheme.input.dynamic and scheme.input.has_global_scale
    with pytest.raises(ConfigError, match=r"quant_config.learnable.act_scale: there is no static activation"):
        load_config(exp, ["compression.quantization.name=mxfp4"])


def test_two_phase_mode_is_one_process_starts_from_its_own_phase_and_keeps_its_kd_loss(
    tmp_path: Path,
) -> None:
    """``training_mode: two_phase``: its end-to-end phase distils (the KD loss blockwise alone
    refuses is accepted), ZeRO-3 is refused (phase 1 is one process), and so is a resume_ckpt_dir
    (phase 2 starts from phase 1), each naming the field."""
    p = _write(tmp_path, "c.yaml", ZERO3_YAML)
    mode = {"compression.QAT.training_mode": "two_phase"}
    with pytest.raises(ConfigError) as ei:
        load_config(p, {**mode, "compression.QAT.hf_args.deepspeed": DS_ZERO3})
    assert ("compression.QAT.training_mode",) == tuple(f for f, _ in ei.value.issues if "two_phase" in _)
    one = {**mode, "compression.QAT.hf_args.deepspeed": None, "compression.QAT.loss_type": "kl"}
    cfg = load_config(p, {**one, "compression.QAT.kd_loss_weight": 1.0})
    assert cfg.qat.training_mode == "two_phase" and cfg.loss_config().kd_enabled and not cfg.zero3_enabled
    with pytest.raises(ConfigError, match=r"compression\.QAT\.resume_ckpt_dir: two_phase starts"):
        load_config(p, {**one, "compression.QAT.resume_ckpt_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match=r"compression\.QAT\.loss_type: blockwise training fits"):
        load_config(
            p, {**one, "compression.QAT.training_mode": "blockwise", "compression.QAT.kd_loss_weight": 1.0}
        )
