"""The upstream AngelSlim configs, unchanged: each loads or is refused with its own message; the QAT
ones (and one PTQ config per algorithm) run their first stage, ``scripts/ptq.py``, on a tiny local
model of their architecture. The claims are `upstream_compat`'s, which also renders the README's
compatibility table (docs/upstream-compat.md), checked fresh here."""

from __future__ import annotations

import hashlib
import json
import logging

import pytest
import torch
import upstream_compat as uc
from conftest import build_model, local_texts, stage_script, tiny_qwen3_config, tiny_qwen3_moe_config
from safetensors.torch import load_file

from qatlib.config import ConfigError, load_config, parse_config
from qatlib.config.upstream import NOT_SUPPORTED

FILES = uc.yaml_files()


def test_copies_are_upstream_bytes():
    sums = dict(
        reversed(line.split("  ", 1)) for line in (uc.UPSTREAM / "SHA256SUMS").read_text().splitlines()
    )
    on_disk = sorted(str(p.relative_to(uc.UPSTREAM)) for p in uc.UPSTREAM.glob("configs/**/*") if p.is_file())
    assert sorted(sums) == on_disk
    assert len([f for f in FILES if "/qat/" in f]) == 9 and len([f for f in FILES if "/ptq/" in f]) == 67
    for rel, digest in sums.items():
        assert hashlib.sha256((uc.UPSTREAM / rel).read_bytes()).hexdigest() == digest, rel
    assert "Apache License" in (uc.UPSTREAM / "LICENSE").read_text()


@pytest.mark.parametrize("rel", FILES, ids=[f.removeprefix("configs/") for f in FILES])
def test_upstream_config_loads_or_is_refused_by_name(rel):
    if rel not in uc.REFUSED:
        cfg = uc.load(rel)
        assert cfg.quant_scheme() is not None
        return
    path, fragment = uc.REFUSED[rel]
    with pytest.raises(ConfigError) as ei:
        uc.load(rel)
    assert ei.value.issues[0][0] == path
    msg = ei.value.issues[0][1]
    assert fragment in msg
    assert "unknown key" not in msg and "did you mean" not in msg  # never called a typo


def test_table_is_fresh():
    assert uc.TABLE.read_text() == uc.render(), "run: python3 tests/upstream_compat.py"


def test_readme_quotes_the_tables_totals():
    readme = (uc.REPO / "README.md").read_text()
    section = readme[readme.index("## Upstream configs") :].split("\n## ", 1)[0]
    assert "docs/upstream-compat.md" in section
    assert f"Totals: {uc.totals()}" in " ".join(section.split()), (
        "README: copy the totals of docs/upstream-compat.md"
    )


# --------------------------------------------------------------------------- meanings
def _qat(
    rel="configs/qwen3/qat/fp8_static/learn_scale/qwen3-30b-a3b_fp8_static_end2end_learn_scale_zero3.yaml",
):
    return rel


def test_headline_config_meanings():
    cfg = uc.load(_qat())
    assert cfg.zero3_enabled
    args = cfg.hf_training_args()
    assert args["warmup_steps"] == 0.0 and "warmup_ratio" not in args  # transformers 5's ratio form
    # upstream's all-'auto' AdamW block is qatlib's own optimizer: dropped, not refused
    assert isinstance(args["deepspeed"], dict) and "optimizer" not in args["deepspeed"]
    assert args["deepspeed"]["zero_optimization"]["stage"] == 3
    assert cfg.quant_scheme().k is None and cfg.ptq_algorithm == "rtn"
    from transformers import Seq2SeqTrainingArguments

    ta = Seq2SeqTrainingArguments(**{**args, "deepspeed": None, "use_cpu": True, "report_to": "none"})
    assert ta.warmup_steps == 0.0
    half = uc.load(_qat(), **{"compression.QAT.hf_args.warmup_ratio": 0.5})
    assert half.hf_training_args()["warmup_steps"] == 0.5
    with pytest.raises(ConfigError, match="warmup_ratio: and warmup_steps are both set"):
        uc.load(_qat(), **{"compression.QAT.hf_args.warmup_steps": 3})
    with pytest.raises(ConfigError, match=r"warmup_ratio: must be a number in \[0, 1\)"):
        uc.load(_qat(), **{"compression.QAT.hf_args.warmup_ratio": 1.5})


def test_deepspeed_optimizer_other_than_auto_adamw_still_refused(tmp_path):
    ds = json.loads(
        (uc.UPSTREAM / "configs/qwen3/qat/fp8_static/learn_scale/ds_config_zero3.json").read_text()
    )
    ds["optimizer"]["params"]["lr"] = 1e-3
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    with pytest.raises(ConfigError, match="has an 'optimizer' block"):
        uc.load(_qat(), **{"compression.QAT.hf_args.deepspeed": str(tmp_path / "ds.json")})


W4A8 = "configs/qwen3/qat/w4a8_fp8/learn_scale/qwen3-4b_w4a8_fp8_end2end_learn_scale_{}.yaml"


def test_use_qkv_quant_switches_the_qkv_quantizers():
    on = uc.load(W4A8.format("lwc_qkv_fp8attn")).quant_scheme()  # use_qkv_quant: true, q/k/v set
    assert on.q.granularity.value == "per-token" and on.k.granularity.value == "per-head" and on.v is not None
    with pytest.raises(ConfigError, match="learnable.kv_scale: there is no k/v output quantization"):
        uc.load(W4A8.format("lwc_qkv_fp8attn"), **{QC + ".use_qkv_quant": False})
    off = uc.load(
        W4A8.format("lwc_qkv_fp8attn"), **{QC + ".use_qkv_quant": False, QC + ".learnable.kv_scale": False}
    )
    assert off.quant_scheme().q is None and off.quant_scheme().k is None and off.quant_scheme().v is None
    with pytest.raises(ConfigError, match="use_qkv_quant: is true but no q / k / v quantization is set"):
        uc.load(W4A8.format("lwc"), **{QC + ".use_qkv_quant": True})


QC = "compression.QAT.plugin_config.quant_config"
AWQ = "configs/qwen3/ptq/int4_awq/qwen3-0_6b_int4_awq.yaml"


def test_zero_point_means_asymmetric_weights():
    # the AWQ file with the algorithm swapped for GPTQ: its quant_method.zero_point: true
    cfg = uc.load(AWQ, **{"compression.quantization.name": "int4_gptq"})
    assert cfg.quant_scheme().weight.symmetric is False and cfg.ptq_algorithm == "gptq"
    sym = uc.load(
        AWQ,
        **{
            "compression.quantization.name": "int4_gptq",
            "compression.quantization.quant_method.zero_point": False,
        },
    )
    assert sym.quant_scheme().weight.symmetric is True
    with pytest.raises(ConfigError) as ei:
        uc.load(AWQ, **{"compression.quantization.name": "fp8_static"})
    assert ei.value.issues[0][0] == "compression.quantization.quant_method.zero_point"


def test_algorithm_names_map_to_qatlib_algorithms():
    int8 = uc.load("configs/qwen3/ptq/int8_dynamic/qwen3-0_6b_int8_dynamic.yaml").quant_scheme()
    assert (int8.weight.qtype, int8.weight.granularity.value) == ("int8", "per-channel")
    assert int8.input.dynamic and int8.input.granularity.value == "per-token"
    gptq = uc.load("configs/qwen3/ptq/int4_gptq/qwen3-0_6b_int4_gptq.yaml")
    assert gptq.ptq_algorithm == "gptq" and gptq.quant_scheme().weight.group_size == 128


@pytest.mark.parametrize(
    "key,value,fragment",
    [
        ("compression.quantization.quant_method.mse_range", True, "mse_range (AWQ's MSE"),
        ("compression.quantization.cpu_convert", True, "cpu_convert"),
        ("compression.quantization.quant_analyse", True, "quant_analyse"),
        ("compression.quantization.quant_helpers", ["awq"], "quant_helpers 'awq'"),
        ("compression.quantization.quant_method.weight", "per-block", "per-block granularity"),
        ("compression.quantization.name", "fp8_blockwise", "block-wise FP8"),
    ],
)
def test_other_upstream_features_refused_by_name(key, value, fragment):
    with pytest.raises(ConfigError) as ei:
        uc.load("configs/qwen3/ptq/fp8_static/qwen3-0_6b_fp8_static.yaml", **{key: value})
    path, msg = ei.value.issues[0]
    assert path == key and fragment in msg and NOT_SUPPORTED in msg and "did you mean" not in msg


def test_feature_keys_at_their_off_value_are_accepted():
    cfg = uc.load(
        "configs/qwen3/ptq/fp8_static/qwen3-0_6b_fp8_static.yaml",
        **{
            "compression.quantization.quant_helpers": [],
            "compression.quantization.quant_method.mse_range": False,
        },
    )
    assert cfg.quant_scheme().name == "fp8_static"


def test_smooth_is_upstream_s_helper_with_its_alpha():
    """``quant_helpers: [smooth]`` with ``smooth_alpha`` (upstream's only PTQ helper) is accepted;
    an alpha outside [0, 1] and the helper with GPTQ (which upstream skips it for) are refused,
    each naming its key."""
    rel = "configs/qwen3/ptq/smooth_int8/qwen3-0_6b_int8_dynamic_smooth.yaml"
    assert uc.load(rel).smooth_alpha == 0.5  # upstream's default
    assert uc.load(rel, **{"compression.quantization.smooth_alpha": 0.8}).smooth_alpha == 0.8
    assert uc.load("configs/qwen3/ptq/fp8_static/qwen3-0_6b_fp8_static.yaml").smooth_alpha is None
    for key, value, fragment in (
        ("compression.quantization.smooth_alpha", 1.5, "less than or equal to 1"),
        ("compression.quantization.name", "int4_gptq", "GPTQ (int4_gptq) sets its own weights"),
    ):
        with pytest.raises(ConfigError) as ei:
            uc.load(rel, **{key: value})
        path, msg = ei.value.issues[0]
        assert fragment in msg, msg
        assert path == (key if key.endswith("alpha") else "compression.quantization.quant_helpers")


def test_a_real_typo_is_still_a_typo():
    with pytest.raises(ConfigError, match="did you mean 'low_memory'"):
        uc.load(
            "configs/qwen3/ptq/fp8_static/qwen3-0_6b_fp8_static.yaml",
            **{"compression.quantization.low_memroy": True},
        )


def test_is_sft_data_selects_the_supervision(tiny_tokenizer, tmp_path):
    from qatlib.data import training_data_from_config

    tok = tiny_tokenizer
    if tok.chat_template is None:
        tok.chat_template = (
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        )
    data = tmp_path / "chat.jsonl"
    rec = {
        "messages": [
            {"role": "user", "content": "what is a list"},
            {"role": "assistant", "content": "a sequence"},
        ]
    }
    data.write_text(json.dumps(rec) + "\n")
    rel = "configs/qwen3/qat/fp8_static/learn_scale/qwen3-4b_fp8_static_end2end_learn_scale_zero3.yaml"
    sft = training_data_from_config(
        uc.load(rel, **{"dataset.data_path": str(data)}), tok
    )  # is_sft_data: true
    full = training_data_from_config(
        uc.load(rel, **{"dataset.data_path": str(data), "dataset.is_sft_data": False}), tok
    )
    s, f = sft[0], full[0]
    assert s["input_ids"] == f["input_ids"]
    text = tok.apply_chat_template(rec["messages"][:1], add_generation_prompt=True, tokenize=False)
    prompt = len(tok(text, add_special_tokens=False)["input_ids"])
    assert 0 < prompt < len(s["input_ids"])
    assert s["labels"][:prompt] == [-100] * prompt and s["labels"][prompt:] == s["input_ids"][prompt:]
    assert f["labels"] == f["input_ids"]


def test_unmatched_ignore_layers_warn_or_fail_under_strict(caplog):
    from qatlib.quant import prepare
    from qatlib.quant.linear import unmatched_ignores

    dense, moe = build_model(tiny_qwen3_config()), build_model(tiny_qwen3_moe_config())
    pats = ["lm_head", "embed_tokens", "gate.weight", "mlp.router"]
    # qatlib matches dotted suffixes with .weight dropped: gate.weight is MoE's router mlp.gate
    assert unmatched_ignores(moe, pats) == ["mlp.router"]
    assert unmatched_ignores(dense, pats) == ["gate.weight", "mlp.router"]
    cfg = uc.load(_qat())
    with caplog.at_level(logging.WARNING, logger="qatlib.quant.linear"):
        prepare(dense, cfg.quant_scheme(), ignore=cfg.ignore_layers, options=cfg.prepare_options())
    assert [r.getMessage() for r in caplog.records if "match no module" in r.getMessage()] == [
        "ignore_layers entries that match no module of the model (Qwen3ForCausalLM): 'gate.weight'; they have no effect"
    ]
    strict = uc.load(_qat(), **{"compression.quantization.strict_ignore_layers": True})
    assert strict.prepare_options().strict_ignore
    with pytest.raises(ValueError, match=r"match no module .*'gate\.weight'.*strict_ignore_layers"):
        prepare(
            build_model(tiny_qwen3_config()),
            strict.quant_scheme(),
            ignore=strict.ignore_layers,
            options=strict.prepare_options(),
        )


def test_transform_refused_and_upstream_nvfp4_resolves_via_parse_config():
    base = {
        "model": {"model_path": "m"},
        "compression": {"name": "PTQ", "quantization": {"name": "fp8_static"}},
    }
    with pytest.raises(ConfigError, match=r"transform: upstream AngelSlim feature transform \(SpinQuant"):
        parse_config({**base, "transform": {"name": "SpinQuant"}})
    # upstream's nvfp4 spelling (per-block, group 16) is qatlib's nvfp4 preset
    q = {
        "name": "nvfp4",
        "quant_method": {"weight": "per-block", "activation": "per-block", "group_size": 16},
    }
    scheme = parse_config({**base, "compression": {"name": "PTQ", "quantization": q}}).quant_scheme()
    assert (scheme.weight.qtype, scheme.weight.group_size) == ("nvfp4", 16)
    assert (scheme.input.qtype, scheme.input.group_size, scheme.input.dynamic) == ("nvfp4", 16, True)
    # per-block on a non-FP4 format is upstream's block-scaled FP8: refused by name
    q8 = {"name": "fp8_static", "quant_method": {"weight": "per-block"}}
    with pytest.raises(ConfigError, match=r"quant_method.weight: upstream AngelSlim feature per-block"):
        parse_config({**base, "compression": {"name": "PTQ", "quantization": q8}})


# --------------------------------------------------------------------------- first stage runs
# in_features divisible by upstream's group_size 128; positions for its max_seq_length 4096
GROUPABLE = dict(hidden_size=128, head_dim=32, max_position_embeddings=4096)


def _tiny_hy3_config():
    from transformers import HYV3Config

    return HYV3Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2, num_shared_experts=1,
        moe_intermediate_size=128, max_position_embeddings=4096, tie_word_embeddings=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def local_models(tiny_tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("upstream_models")
    makers = {
        "qwen3": lambda: tiny_qwen3_config(**GROUPABLE, intermediate_size=256),
        "qwen3_moe": lambda: tiny_qwen3_moe_config(**GROUPABLE, moe_intermediate_size=128),
        "hy_v3": _tiny_hy3_config,
    }
    dirs = {}
    for arch, make in makers.items():
        d = root / arch
        build_model(make()).save_pretrained(d)
        tiny_tokenizer.save_pretrained(d)
        dirs[arch] = str(d)
    data = root / "calib.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in local_texts(60)))
    return dirs, str(data)


@pytest.fixture(scope="module")
def ptq_script():
    return stage_script("ptq")


@pytest.mark.parametrize("rel", uc.RUNS, ids=[f.rsplit("/", 1)[-1] for f in uc.RUNS])
def test_first_stage_runs_on_local_model(rel, local_models, ptq_script, tmp_path, single_thread):
    dirs, data = local_models
    arch = uc.architecture(rel)
    sets = {**uc.local_overrides(rel, dirs[arch], data, str(tmp_path / "ptq")), "dataset.num_samples": 2}
    if arch == "hy_v3":
        with pytest.raises(ConfigError, match="configs/hunyuan/.*not found"):
            load_config(uc.UPSTREAM / rel, sets)
        sets["compression.QAT.hf_args.deepspeed"] = str(
            uc.UPSTREAM / "configs/Hy3/qat/fp8_static/learn_scale/ds_config_zero3.json"
        )
    if rel in uc.VLLM_CANNOT_LOAD:
        with pytest.raises(ConfigError, match="deploy.target: vllm 0.33.0 cannot load"):
            load_config(uc.UPSTREAM / rel, sets)
        sets["deploy.target"] = "none"
    if rel == FP8_FORMAT:  # the fp8 format serves half precision: the tiny model's float32 is refused
        with pytest.raises(ConfigError, match="model.torch_dtype: vllm 0.33.0 cannot load .* float32 model"):
            load_config(uc.UPSTREAM / rel, sets)
        sets["model.torch_dtype"] = "bfloat16"  # upstream's Qwen3-30B-A3B is bf16 (torch_dtype: auto)
    cfg = load_config(uc.UPSTREAM / rel, sets)
    argv = ["-c", str(uc.UPSTREAM / rel), "--save-path", str(tmp_path / "ptq"), "--no-progress"]
    argv += [f"--set={k}={json.dumps(v)}" if v is not None else f"--set={k}=null" for k, v in sets.items()]
    assert ptq_script.main(_split(argv)) == 0
    out = tmp_path / "ptq"
    meta = json.loads((out / "quant_scheme.json").read_text())
    assert meta["name"] == cfg.quant_scheme().name
    scales = load_file(out / "scales.safetensors")
    weight_scales = [k for k in scales if k.endswith(".weight_scale")]
    assert weight_scales and all(
        torch.isfinite(scales[k]).all() and (scales[k] > 0).all() for k in weight_scales
    )
    assert not any("lm_head" in k or k.endswith("mlp.gate.weight_scale") for k in scales)  # ignored / router
    scheme = cfg.quant_scheme()
    static_in = scheme.input is not None and not scheme.input.dynamic
    assert any(k.endswith(".input_scale") for k in scales) == static_in
    assert (meta["calibration"]["num_batches"] > 0) == (
        static_in or cfg.ptq_algorithm == "gptq" or scheme.k is not None
    )
    if scheme.k is not None and not scheme.k.dynamic:
        assert any(k.endswith("k_cache.scale") for k in scales)
    if cfg.ptq_algorithm == "gptq":
        assert meta["weights"] and (out / "config.json").is_file()
    if arch != "qwen3":
        assert any(".experts.3." in k for k in scales)  # every expert quantized


def _split(argv: list[str]) -> list[str]:
    out = []
    for a in argv:
        if a.startswith("--set="):
            out += ["--set", a.removeprefix("--set=")]
        else:
            out.append(a)
    return out


# --------------------------------------------------------------------------- low_memory, save_name: fp8
LOW_MEM = "configs/qwen3/ptq/fp8_static/qwen3-a22b_fp8_static_low_memroy.yaml"
FP8_FORMAT = "configs/qwen3/ptq/fp8_dynamic/qwen3-a3b_fp8_dynamic.yaml"


def test_low_memory_is_the_streamed_calibration_or_refused_naming_why(local_models, tmp_path):
    """``low_memory: true`` asks for what qatlib's PTQ does by default (`qatlib.plan.streamed`); where
    it cannot stream, the stage refuses before any work, naming why (`qatlib.plan.not_streamed`)."""
    from qatlib.pipeline import StageInputError, run_ptq

    dirs, data = local_models
    save = tmp_path / "ptq"
    sets = {**uc.local_overrides(LOW_MEM, dirs["qwen3_moe"], data, "unused"), "dataset.num_samples": 2}
    sets["global.save_path"] = str(save)
    cfg = load_config(uc.UPSTREAM / LOW_MEM, sets)
    assert cfg.quantization.low_memory and cfg.quant_scheme().input.dynamic is False
    refusals = {
        "--whole-model asks for the whole model": (cfg, {"whole_model": True}),
        "a static input scale on lm_head (not in ignore_layers)": (
            load_config(
                uc.UPSTREAM / LOW_MEM, {**sets, "compression.quantization.ignore_layers": ["embed_tokens"]}
            ),
            {},
        ),
        "GPTQ changes the weights": (
            load_config(uc.UPSTREAM / LOW_MEM, {**sets, "compression.quantization.name": "int4_gptq"}),
            {},
        ),
    }
    for why, (c, kw) in refusals.items():
        with pytest.raises(StageInputError, match="compression.quantization.low_memory") as e:
            run_ptq(c, progress=False, **kw)
        assert why in str(e.value) and "remove low_memory" in str(e.value)
        assert not save.exists()  # before any work
    assert run_ptq(cfg, progress=False)["streamed"] is True
    assert (save / "scales.safetensors").is_file()


def test_save_name_fp8_exports_the_runtimes_fp8_format(tmp_path, tiny_tokenizer):
    """``save_name: fp8`` (upstream's Qwen3-30B-A3B fp8_dynamic file): vLLM's / SGLang's own format,
    ``quant_method: fp8``, with the fp8 per-tensor tensors. On an MoE model it is the one vLLM serves:
    its Fp8MoEMethod quantizes the experts' input per tensor, as trained, while compressed-tensors'
    dynamic per-tensor layout has no vLLM MoE kernel (refused; the oracle's fp8_native_dynamic_moe
    path loads this format in vLLM itself)."""
    from safetensors.torch import load_file

    from qatlib.eval.variants import export_skipped_reason
    from qatlib.export import export
    from qatlib.ptq import calibrate
    from qatlib.quant.spec import CheckpointFormat
    from qatlib.runtime.emulate import RuntimeRefusal, emulate_export
    from qatlib.runtime.facts import Layout

    model_dir = tmp_path / "moe"
    build_model(tiny_qwen3_moe_config(**GROUPABLE, moe_intermediate_size=128)).to(
        torch.bfloat16
    ).save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    cfg = load_config(
        uc.UPSTREAM / FP8_FORMAT, uc.local_overrides(FP8_FORMAT, str(model_dir), "unused", "unused")
    )
    scheme = cfg.quant_scheme()
    assert scheme.checkpoint_format is CheckpointFormat.FP8 and scheme.input.dynamic
    assert scheme.to_dict()["checkpoint_format"] == "fp8"
    ct = uc.load(FP8_FORMAT, **{"compression.quantization.save_name": "compressed-tensors"})
    assert ct.quant_scheme() == scheme  # the same trained arithmetic, another checkpoint format
    with pytest.raises(ConfigError, match="deploy.target: vllm 0.33.0 cannot load"):  # the CT twin, on MoE
        load_config(
            uc.UPSTREAM / FP8_FORMAT,
            {
                **uc.local_overrides(FP8_FORMAT, str(model_dir), "unused", "unused"),
                "compression.quantization.save_name": "compressed-tensors",
            },
        )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    calibrate(model, scheme, [], ignore=cfg.ignore_layers, options=cfg.prepare_options())
    out = export(model, scheme, tmp_path / "export", "real", ignore=cfg.quantization.ignore_layers)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (
        qc["quant_method"] == "fp8"
        and qc["activation_scheme"] == "dynamic"
        and set(qc)
        == {
            "quant_method",
            "activation_scheme",
            "ignored_layers",
        }
    )
    assert {"lm_head", "model.embed_tokens", "model.layers.0.mlp.gate"} <= set(qc["ignored_layers"])
    t = load_file(out / "model.safetensors")
    w = "model.layers.0.mlp.experts.1.up_proj"
    assert t[f"{w}.weight"].dtype == torch.float8_e4m3fn and t[f"{w}.weight_scale"].shape == (1,)
    assert not any(k.endswith("input_scale") for k in t)
    info = json.loads((out / "qatlib_export.json").read_text())
    vllm = info["deployment"]["vllm 0.33.0"]
    assert vllm["loads"] and vllm["layout"] == Layout.FP8_NATIVE_DYNAMIC.value
    assert any("quant_method fp8" in n for n in info["compressed_tensors"]["runtime_notes"])
    dep = emulate_export(out, "vllm")
    assert dep.layout is Layout.FP8_NATIVE_DYNAMIC
    lin = dict(dep.model.named_modules())
    x = torch.randn(3, 128) * torch.logspace(-2, 1, 128)
    for name, per_token in ((w, False), ("model.layers.0.self_attn.q_proj", True)):
        act = lin[name].act  # experts: per tensor (Fp8MoEMethod); dense: per token (CUTLASS fp8)
        assert torch.equal(act(x)[:1], act(x[:1])) == per_token  # one row alone: the same iff per token
    assert "transformers" in export_skipped_reason(out)
    # a float32 model: the format's Fp8Config serves half precision only
    model32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    calibrate(model32, scheme, [], ignore=cfg.ignore_layers, options=cfg.prepare_options())
    out32 = export(model32, scheme, tmp_path / "export32", "real", ignore=cfg.quantization.ignore_layers)
    assert not json.loads((out32 / "qatlib_export.json").read_text())["deployment"]["vllm 0.33.0"]["loads"]
    with pytest.raises(RuntimeRefusal, match="bfloat16 / float16 models only"):
        emulate_export(out32, "vllm")
    # the format holds fp8 per-tensor weights and inputs only; other save names are refused by name
    with pytest.raises(ConfigError) as e:
        uc.load(
            "configs/qwen3/ptq/int8_dynamic/qwen3-0_6b_int8_dynamic.yaml",
            **{"compression.quantization.save_name": "fp8"},
        )
    assert (
        e.value.issues[0][0] == "compression.quantization.save_name" and "per-tensor" in e.value.issues[0][1]
    )
    with pytest.raises(ConfigError) as e:
        uc.load(FP8_FORMAT, **{"compression.quantization.save_name": "trtllm"})
    assert "upstream AngelSlim feature save_name 'trtllm'" in e.value.issues[0][1]
