"""The workflow's streamed stages: `qatlib.plan.streamed` decides where ``ptq_calibrate`` /
``convert_export`` run one decoder layer at a time, the scripts stream by default exactly there
(the DAG passes no flag; ``--whole-model`` opts out),
the torch-free decision agrees with what the scripts refuse (`qatlib.config`), and the streamed
scripts write what the whole-model ones write, tensor by tensor, for the experiments' own formats
and architectures (SmolLM2's tied Llama, the tiny Qwen3-MoE)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import build_model, local_texts, stage_script, tiny_llama_config, tiny_qwen3_moe_config

from qatlib import plan as qp
from qatlib.yamlio import apply_overrides, load_yaml, yaml_value

REPO = Path(__file__).resolve().parents[1]
EXPS = REPO / "config/experiments"
ENV_KEYS = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
STAGES = {"ptq_calibrate": "scripts/ptq.py", "convert_export": "scripts/export.py"}

# (experiment, --set overrides) -> whether PTQ streams (convert_export always does)
VARIANTS = [
    ("smollm2-135m", [], True),
    ("tiny-qwen3-moe", [], True),
    ("tiny-qwen3-moe", ["compression.quantization.name=int4_gptq"], False),  # GPTQ changes the weights
    ("tiny-qwen3-moe", ["compression.quantization.quant_helpers=[smooth]"], False),  # so does SmoothQuant
    # a static input scale on the head: the streamed calibration never runs it
    ("qwen3-4b", ['compression.quantization.ignore_layers=["embed_tokens"]'], False),
    ("qwen3-4b", [], True),  # fp8_static with lm_head ignored
    ("qwen3-4b", ["compression.quantization.ignore_layers=[]"], True),  # empty: lm_head by default
    ("qwen3-4b", ['compression.quantization.ignore_layers=["re:lm_h.*"]'], True),
    # the head quantized, but weight-only / dynamic: nothing static to calibrate on it
    ("tiny-qwen3-moe", ['compression.quantization.ignore_layers=["gate"]'], True),
]


def _raw(exp: str, sets: list[str]) -> dict:
    raw = load_yaml(EXPS / f"{exp}.yaml")
    apply_overrides(raw, [(k, yaml_value(v)) for k, v in (s.split("=", 1) for s in sets)], "test")
    return raw


@pytest.mark.parametrize("exp,sets,ptq", VARIANTS, ids=lambda v: v if isinstance(v, str) else None)
def test_streamed_is_what_the_scripts_can_stream(exp, sets, ptq):
    """The torch-free rule against `qatlib.config` (the owner of the config's meaning) and the
    refusals of scripts/ptq.py (GPTQ) and `qatlib.ptq.calibrate_layerwise` (a static input
    quantizer outside the decoder layers, i.e. on an unignored lm_head)."""
    from qatlib.config import load_config
    from qatlib.quant.linear import matches_any

    raw = _raw(exp, sets)
    assert qp.streamed(raw, "ptq_calibrate") is ptq
    assert qp.streamed(raw, "convert_export") is True
    assert qp.streamed(raw, "evaluate") is False
    cfg = load_config(EXPS / f"{exp}.yaml", [*sets, "compression.QAT.from_ptq_ckpt=/tmp/ptq"])
    s = cfg.quant_scheme()
    static_head = (
        s.input is not None and not s.input.dynamic and not matches_any("lm_head", cfg.ignore_layers)
    )
    assert ptq is (cfg.ptq_algorithm != "gptq" and cfg.smooth_alpha is None and not static_head)
    # the plan models the stage the rule runs
    x = qp.from_experiment(raw, None)
    assert x.ptq_streamed is ptq
    m = qp.ModelShape.from_config(tiny_qwen3_moe_config().to_dict())
    names = {t.name for t in qp.plan(m, x, qp.Run())[0].device + qp.plan(m, x, qp.Run())[0].host}
    assert ("the model, loaded whole (not streamed)" in names) is not ptq
    assert any(n.startswith("one decoder layer") for n in names) is ptq


# ----------------------------------------------------------------------------- the DAG
def _shells(args: list[str], workdir: Path) -> dict[str, str]:
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(workdir)]
    res = subprocess.run(
        [*cmd, "-n", "-p", *args], cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, **ENV_KEYS},
    )  # fmt: skip
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    out = {}
    for line in res.stdout.splitlines():
        for stage, script in STAGES.items():
            if line.startswith("Shell command: python ") and f"{script} -c" in line:
                exp = re.search(r"-c \S*/(\S+)\.yaml", line).group(1)
                out[f"{exp}/{stage}"] = line
    return out


@pytest.mark.skipif(shutil.which("snakemake") is None, reason="snakemake not installed")
def test_the_dag_passes_layerwise_exactly_where_streamed_says(tmp_path):
    from workflow.lib import experiment as xp

    exps = ("smollm2-135m", "tiny-qwen3-moe")
    shells = _shells([f"results/{e}/export" for e in exps], tmp_path / "wd")
    e = xp.Experiments(
        REPO, "results", "config/experiments", "x", None, REPO / "workflow/schemas/experiment.schema.json"
    )
    assert set(shells) == {f"{x}/{s}" for x in exps for s in STAGES}
    for key, shell in shells.items():
        exp, stage = key.split("/")
        assert e.streamed(exp, stage) is True  # both stream every stage
        assert "--layerwise" not in shell and "--whole-model" not in shell, shell  # the script decides
    # where the PTQ cannot stream (GPTQ), its job runs the whole model; the export still streams
    d = tmp_path / "experiments"
    shutil.copytree(REPO / ".test/config/experiments", d)
    p = d / "tiny-test.yaml"
    p.write_text(p.read_text().replace("name: int3_weight_only", "name: int4_gptq"))
    cfg = ["--configfile", str(REPO / ".test/config/config.yaml"), "--config", f"experiments_dir={d}"]
    shells = _shells(["results/tiny-test/export", *cfg], tmp_path / "wd2")
    e = xp.Experiments(REPO, "results", str(d), "x", None, REPO / "workflow/schemas/experiment.schema.json")
    assert e.streamed("tiny-test", "ptq_calibrate") is False
    for stage in ("ptq_calibrate", "convert_export"):
        assert "--layerwise" not in shells[f"tiny-test/{stage}"]


# ----------------------------------------------------------------------------- the scripts
@pytest.fixture(scope="module")
def scripts():
    return stage_script("ptq"), stage_script("export")


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")) + sorted(path.glob("qatlib/*.safetensors")):
        out.update({f"{f.relative_to(path)}:{k}": v for k, v in load_file(f).items()})
    return out


def _same_output(a: Path, b: Path) -> int:
    """Every file of ``a`` is in ``b``; safetensors: the same tensors bit for bit and the same
    bytes; JSON: equal. Returns the number of tensors compared."""
    fa = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    fb = sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
    assert fa == fb
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys() and ta
    bad = [k for k in ta if ta[k].dtype != tb[k].dtype or not torch.equal(ta[k], tb[k])]
    assert bad == [], bad[:5]
    for f in fa:  # the files themselves, byte for byte
        if f.endswith(".safetensors"):
            assert (a / f).read_bytes() == (b / f).read_bytes(), f"{f} differs"

    for f in fa:
        if f.endswith(".json"):
            assert json.loads((a / f).read_text()) == json.loads((b / f).read_text()), f
    return len(ta)


@pytest.mark.parametrize(
    "exp,config,sets",
    [
        ("smollm2-135m", tiny_llama_config, []),  # int4 g64, tied embeddings (Llama)
        ("tiny-qwen3-moe", tiny_qwen3_moe_config, []),  # int3 g32, MoE
        # static activation scales (calibration batches carried layer to layer), k/v untouched
        ("tiny-qwen3-moe", tiny_qwen3_moe_config, ["compression.quantization.name=fp8_static",
                                                   "compression.quantization.quant_method.weight=per-tensor",
                                                   "compression.QAT.plugin_config.quant_config.use_activation_quant=true"]),
    ],
    ids=["smollm2-int4-tied", "moe-int3", "moe-fp8_static"],
)  # fmt: skip
def test_streamed_scripts_write_the_whole_model_outputs(
    scripts, tmp_path, tiny_tokenizer, single_thread, exp, config, sets
):
    """scripts/ptq.py and scripts/export.py as a user runs them (no flag: streamed, what the DAG
    runs) against the same scripts with --whole-model: the same PTQ checkpoint and the same
    export, byte for byte; each run's timing record says which path ran. The library verbs
    (`qatlib.pipeline.run_ptq` / `run_export`) called from Python take the same default path."""
    ptq, export = scripts
    assert qp.streamed(_raw(exp, sets), "ptq_calibrate") and qp.streamed(_raw(exp, sets), "convert_export")
    base = tmp_path / "base"
    build_model(config()).save_pretrained(base)
    tiny_tokenizer.save_pretrained(base)
    (tmp_path / "train.txt").write_text("\n\n".join(local_texts(20)))
    sets = [*sets, f"dataset.data_path={tmp_path / 'train.txt'}", "dataset.num_samples=3",
            "dataset.max_seq_length=32", f"compression.QAT.from_ptq_ckpt={tmp_path / 'ptq'}"]  # fmt: skip
    common = ["-c", str(EXPS / f"{exp}.yaml"), "--no-progress", *(f"--set={s}" for s in sets)]
    for mode, flag in (("whole", ["--whole-model"]), ("layerwise", [])):
        argv = [*common, "--model-path", str(base), "--save-path", str(tmp_path / f"ptq-{mode}"), *flag]
        argv += ["--timing", str(tmp_path / f"ptq-{mode}.json")]
        assert ptq.main(argv) == 0
        assert json.loads((tmp_path / f"ptq-{mode}.json").read_text())["streamed"] is (mode == "layerwise")
    n = _same_output(tmp_path / "ptq-whole", tmp_path / "ptq-layerwise")
    static = any("input_scale" in k for k in _tensors(tmp_path / "ptq-whole"))
    assert static is ("fp8_static" in str(sets)) and n > 0  # the calibration batches ran where they must
    # a QAT checkpoint: the weights beside (perturbed, as if trained) scales
    qat = tmp_path / "qat"
    shutil.copytree(base, qat)
    from safetensors.torch import load_file, save_file

    scales = load_file(tmp_path / "ptq-whole/scales.safetensors")
    g = torch.Generator().manual_seed(0)
    scales = {k: v * (1 + 0.05 * torch.rand(v.shape, generator=g)) if v.is_floating_point() else v
              for k, v in scales.items()}  # fmt: skip
    save_file(scales, str(qat / "scales.safetensors"), metadata={"format": "pt"})
    shutil.copy(tmp_path / "ptq-whole/quant_scheme.json", qat)
    for mode, flag in (("whole", ["--whole-model"]), ("layerwise", [])):
        argv = [*common, "--model-path", str(qat), "--save-path", str(tmp_path / f"export-{mode}"), *flag]
        argv += ["--timing", str(tmp_path / f"export-{mode}.json")]
        assert export.main(argv) == 0
        assert json.loads((tmp_path / f"export-{mode}.json").read_text())["streamed"] is (mode == "layerwise")
    n = _same_output(tmp_path / "export-whole", tmp_path / "export-layerwise")
    assert n > 0
    # the library verbs from Python, no flag: the scripts' default path, the same bytes
    from qatlib.config import load_config
    from qatlib.pipeline import run_export, run_ptq

    cfg = load_config(
        EXPS / f"{exp}.yaml", [*sets, f"model.model_path={base}", f"global.save_path={tmp_path / 'ptq-py'}"]
    )
    assert run_ptq(cfg, progress=False)["streamed"]
    _same_output(tmp_path / "ptq-layerwise", tmp_path / "ptq-py")
    cfg = load_config(
        EXPS / f"{exp}.yaml",
        [*sets, f"model.model_path={base}", f"global.save_path={tmp_path / 'export-py'}"],
    )
    assert run_export(cfg, qat)["streamed"]
    _same_output(tmp_path / "export-layerwise", tmp_path / "export-py")
    # the PTQ model's export (the workflow's export_ptq): the base model with ``--scales`` of the PTQ
    # checkpoint, the same bytes as the export of a checkpoint holding the base weights and exactly
    # PTQ's scales
    as_qat = tmp_path / "ptq-as-qat"
    shutil.copytree(base, as_qat)
    for f in ("scales.safetensors", "quant_scheme.json"):
        shutil.copy(tmp_path / "ptq-whole" / f, as_qat)
    assert export.main([*common, "--model-path", str(as_qat), "--save-path", str(tmp_path / "xa")]) == 0
    argv = [
        "--model-path",
        str(base),
        "--scales",
        str(tmp_path / "ptq-whole"),
        "--save-path",
        str(tmp_path / "xb"),
    ]
    assert export.main([*common, *argv]) == 0
    assert _same_output(tmp_path / "xa", tmp_path / "xb") > 0


@pytest.mark.parametrize("frozen", [False, True], ids=["lsq", "frozen_codes"])
def test_a_gptq_checkpoint_is_the_model_its_scales_belong_to(
    scripts, tmp_path, tiny_tokenizer, single_thread, frozen
):
    """scripts/ptq.py with GPTQ saves the weights GPTQ rounded beside its scales; the prepared model
    of every later stage (`qatlib.models.load_prepared`: QAT, the ptq evaluation) loads those weights,
    not the original ones (GPTQ's scales on the original weights are neither GPTQ nor RTN), and the
    QAT's KD teacher is then the original model, not the student with its quantizers off. With
    ``frozen_codes`` the QAT ends with GPTQ's codes at its trained scales, in the weights."""
    from safetensors.torch import load_file

    from qatlib.config import load_config
    from qatlib.data import load_training_data
    from qatlib.models import load_prepared
    from qatlib.quant import quant_linears, quantize
    from qatlib.trainers.end2end import train_end2end

    ptq, _ = scripts
    base = tmp_path / "base"
    build_model(tiny_qwen3_moe_config()).save_pretrained(base)
    tiny_tokenizer.save_pretrained(base)
    (tmp_path / "train.txt").write_text("\n\n".join(local_texts(20)))
    sets = ["compression.quantization.name=int4_gptq", f"dataset.data_path={tmp_path / 'train.txt'}",
            "dataset.num_samples=3", "dataset.max_seq_length=32", f"model.model_path={base}",
            f"compression.QAT.from_ptq_ckpt={tmp_path / 'ptq'}", "compression.QAT.hf_args.max_steps=1", "compression.QAT.hf_args.deepspeed=null",
            "compression.QAT.hf_args.learning_rate=0.05", "compression.QAT.hf_args.warmup_steps=0",
            "compression.QAT.plugin_config.quant_config.scale_update=log",
            f"compression.QAT.plugin_config.quant_config.frozen_codes={str(frozen).lower()}",
            f"global.save_path={tmp_path / 'run'}"]  # fmt: skip
    exp = EXPS / "tiny-qwen3-moe.yaml"
    argv = [
        "-c",
        str(exp),
        "--no-progress",
        *(f"--set={s}" for s in sets[:-1]),
        "--save-path",
        str(tmp_path / "ptq"),
    ]
    assert ptq.main(argv) == 0
    saved, original = load_file(tmp_path / "ptq/model.safetensors"), load_file(base / "model.safetensors")
    cfg = load_config(exp, sets)
    model, report = load_prepared(cfg, base, scales=tmp_path / "ptq", complete=True)
    assert report["misses"] == 0
    qls = dict(quant_linears(model))
    assert len(qls) > 10
    for name, ql in qls.items():
        assert torch.equal(ql.weight, saved[f"{name}.weight"]), name
    moved = [n for n in qls if not torch.equal(saved[f"{n}.weight"], original[f"{n}.weight"])]
    assert len(moved) == len(qls)  # GPTQ changed every weight it quantized
    s0 = {n: ql.weight_quantizer.scale.detach().clone() for n, ql in qls.items()}
    spec = next(iter(qls.values())).weight_quantizer.spec
    codes0 = {n: quantize(ql.weight.detach(), s0[n], None, spec) for n, ql in qls.items()}
    trainer = train_end2end(
        cfg,
        model,
        tiny_tokenizer,
        load_training_data(tmp_path / "train.txt", tiny_tokenizer, 32, num_samples=3),
        scales_loaded=True,
    )
    moved = [n for n, ql in qls.items() if not torch.equal(ql.weight_quantizer.scale, s0[n])]
    assert len(moved) > 0.9 * len(qls)  # the scales trained
    for n, ql in qls.items():
        s1 = ql.weight_quantizer.scale.detach()
        if frozen:  # the weights are GPTQ's codes at the trained scales, exactly
            assert ql.weight_quantizer.frozen_at is None
            assert torch.equal(quantize(ql.weight.detach(), s1, None, spec), codes0[n]), n
            torch.testing.assert_close(ql.weight.detach(), ql.fake_quant_weight().detach(), rtol=0, atol=0)
        else:  # the weights did not train
            assert torch.equal(ql.weight, saved[f"{n}.weight"]), n
    if frozen:
        assert sum(not torch.equal(ql.weight, saved[f"{n}.weight"]) for n, ql in qls.items()) == len(moved)
    t = trainer.teacher
    assert t is not None and t is not model
    tw = dict(t.named_parameters())
    attn = [n for n in qls if ".self_attn." in n]  # the teacher's experts stay fused (other names)
    assert len(attn) >= 8
    for name in attn:
        assert torch.equal(tw[f"{name}.weight"].float(), original[f"{name}.weight"].float()), name
