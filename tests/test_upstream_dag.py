"""The upstream AngelSlim QAT configs as experiments of the workflow, each YAML unchanged.

The experiments dir is the folder of the byte-identical copy under tests/data/upstream/ and the
experiment its file name; params.yaml's `overrides` (here a Snakemake config file) point only
``model.model_path`` / ``dataset.data_path`` (clearing ``hf_dataset``) at local files, add the
qatlib-only ``evaluation`` section, and for the real runs shrink steps / sequence length / sample
counts. ``from_ptq_ckpt`` is not overridden: the workflow replaces the YAML's folder with its
own PTQ output. Fast: a dry run of every QAT file builds the full DAG with the right QAT launcher.
Slow: the headline Qwen3-30B-A3B FP8 ZeRO-3 file on a tiny Qwen3-MoE (2 CPU ranks) and the
blockwise int4 file on a tiny Qwen3, for real, through the report and a reload of the export.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import upstream_compat as uc
import yaml
from conftest import build_model, local_texts, tiny_qwen3_config, tiny_qwen3_moe_config
from test_workflow import job_counts, needs_snakemake, snakemake

QAT_FILES = uc.qat_files()
HEADLINE, BLOCKWISE = uc.DAG_RUNS  # the table's "DAG runs": the slow tests below
HY3 = uc.HY3
# the JSON beside the Hy3 file (upstream's own path, configs/hunyuan/..., does not exist)
HY3_DS = uc.UPSTREAM / "configs/Hy3/qat/fp8_static/learn_scale/ds_config_zero3.json"
FULL_DAG = {
    "ptq_calibrate": 1,
    "zero3_qat": 1,
    "convert_export": 1,
    "export_ptq": 1,
    "evaluate": 5,
    "serve_evaluate": 2,
    "sqnr": 1,
    "report": 1,
}
VARIANTS = ("bf16", "ptq", "qat", "export")


def exp_name(rel: str) -> str:
    return Path(rel).stem


def nest(flat: dict[str, object]) -> dict[str, object]:
    """Dotted keys -> the nested mapping params.yaml's `overrides` holds."""
    out: dict[str, object] = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def local_paths(rel: str, model: Path, data: Path, text: Path) -> dict[str, object]:
    """The overrides every run gets: local model / data (uc.local_overrides minus
    from_ptq_ckpt, which the workflow sets), a local perplexity text, Hy3's DeepSpeed JSON."""
    flat = uc.local_overrides(rel, str(model), str(data), "unused")
    flat.pop("compression.QAT.from_ptq_ckpt", None)
    flat["evaluation.ppl"] = [str(text)]
    if rel == HY3:
        flat["compression.QAT.hf_args.deepspeed"] = str(HY3_DS)
    return flat


def dag_config(tmp: Path, rel: str, overrides: dict[str, object]) -> Path:
    """A Snakemake config file: the upstream YAML's folder as experiments_dir, its name as the
    experiment, `overrides` as params.yaml's; 2 ZeRO-3 ranks of 1 thread, 2 threads otherwise."""
    cfg = {
        "experiment": exp_name(rel),
        "experiments_dir": str((uc.UPSTREAM / rel).parent),
        "overrides": nest(overrides),
        "ranks": 2,
        "threads_per_rank": 1,
        "threads": 2,
        "progress": False,
    }
    path = tmp / "dag_config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def qat_shell(out: str) -> str:
    return next(line for line in out.splitlines() if "scripts/qat.py -c" in line).removeprefix(
        "Shell command: "
    )


def zero3(rel: str) -> bool:
    """What the file says about itself: upstream names its ZeRO-3 configs ``*_zero3.yaml``."""
    return rel.endswith("_zero3.yaml")


def make_placeholders(root: Path) -> tuple[Path, Path, Path]:
    """Existing (empty) local paths: a dry run needs its inputs to exist, not to be real."""
    model, data, text = root / "model", root / "data.jsonl", root / "test.txt"
    model.mkdir(parents=True)
    data.touch()
    text.touch()
    return model, data, text


@pytest.fixture
def placeholders(tmp_path):
    return make_placeholders(tmp_path / "local")


def dry_run(root: Path, rel: str, overrides: dict[str, object], check: bool = True) -> tuple[int, str]:
    cfg = dag_config(root, rel, overrides)
    target = f"results/{exp_name(rel)}/report.html"
    return snakemake(["-n", "-p", target, "--configfile", str(cfg)], workdir=root / "wd", check=check)


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory) -> dict[str, str]:
    """The dry run of every upstream QAT file, started together (each is a Snakemake process that
    mostly waits on imports: 9 in parallel take about a third of 9 in a row on 2 cores)."""
    from concurrent.futures import ThreadPoolExecutor

    # the folders first, in this thread: pytest's mktemp is not thread-safe (its numbered folders
    # and their "current" links race)
    roots = {rel: tmp_path_factory.mktemp(exp_name(rel)[:40]) for rel in QAT_FILES}

    def one(rel: str) -> str:
        root = roots[rel]
        return dry_run(root, rel, local_paths(rel, *make_placeholders(root / "local")))[1]

    with ThreadPoolExecutor(max_workers=len(QAT_FILES)) as pool:
        return dict(zip(QAT_FILES, pool.map(one, QAT_FILES), strict=True))


# --------------------------------------------------------------------------- fast: dry runs
@needs_snakemake
@pytest.mark.parametrize("rel", QAT_FILES, ids=[Path(f).stem for f in QAT_FILES])
def test_upstream_qat_config_builds_the_full_dag(rel, dry_runs):
    assert len(QAT_FILES) == 13  # configs/*/qat and FOCUS's configs/qwen3/fp4
    exp, out = exp_name(rel), dry_runs[rel]
    assert job_counts(out) == FULL_DAG
    shell = qat_shell(out)
    # the file itself is the experiment: the scripts read the upstream copy with -c
    assert f"-c {uc.UPSTREAM / rel} " in shell
    if zero3(rel):
        assert re.match(
            r"OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 ", shell
        )
        # upstream's repository-relative JSON path, found as qatlib finds it (above the YAML)
        name = Path(
            yaml.safe_load((uc.UPSTREAM / rel).read_text())["compression"]["QAT"]["hf_args"]["deepspeed"]
        ).name
        ds = HY3_DS if rel == HY3 else (uc.UPSTREAM / rel).parent / name
        assert f"--set=compression.QAT.hf_args.deepspeed={json.dumps(str(ds))}" in shell
    else:
        assert re.match(r"python \S*scripts/qat\.py ", shell) and "torchrun" not in shell, shell
        assert "hf_args.deepspeed" not in shell
    # the YAML's ./output_ptq_* folder (or none) is replaced by the DAG's own PTQ output, in every stage
    ptq = f"--set=compression.QAT.from_ptq_ckpt={json.dumps(f'results/{exp}/ptq')}"
    assert f"--from-ptq-ckpt results/{exp}/ptq " in shell and ptq in shell
    assert out.count(ptq) == sum(FULL_DAG.values()) - 1  # every job but sqnr
    if uc.local_overrides(rel, "m", "d", "p").get("compression.QAT.hf_dataset", 1) is None:
        # upstream's hub dataset cleared, also for PTQ calibration (whose sections lack hf_dataset)
        ptq_shell = next(line for line in out.splitlines() if "scripts/ptq.py -c" in line)
        assert "--set=compression.QAT.hf_dataset=null" in shell and "hf_dataset=null" in ptq_shell


# upstream PTQ files whose keys qatlib now honours: low_memory (the streamed calibration) and
# save_name: fp8 (the runtimes' own fp8 format); as an experiment each builds the full DAG
HONOURED_PTQ = (
    "configs/qwen3/ptq/fp8_static/qwen3-a22b_fp8_static_low_memroy.yaml",
    "configs/qwen3/ptq/fp8_dynamic/qwen3-a3b_fp8_dynamic.yaml",
)


@needs_snakemake
@pytest.mark.parametrize("rel", HONOURED_PTQ, ids=[Path(f).stem for f in HONOURED_PTQ])
def test_upstream_ptq_file_with_honoured_keys_builds_the_full_dag(rel, tmp_path, placeholders):
    _, out = dry_run(tmp_path, rel, local_paths(rel, *placeholders))
    assert job_counts(out) == FULL_DAG
    ptq_shell = next(line for line in out.splitlines() if "scripts/ptq.py -c" in line)
    assert f"-c {uc.UPSTREAM / rel} " in ptq_shell and "--whole-model" not in ptq_shell  # streamed


@needs_snakemake
def test_hy3_as_shipped_fails_the_dag_naming_its_deepspeed_path(tmp_path, placeholders):
    flat = local_paths(HY3, *placeholders)
    flat.pop("compression.QAT.hf_args.deepspeed")
    code, out = dry_run(tmp_path, HY3, flat, check=False)
    assert code != 0
    assert "compression.QAT.hf_args.deepspeed: DeepSpeed config file" in out
    assert "configs/hunyuan/qat/fp8_static/learn_scale/ds_config_zero3.json' not found" in out


@needs_snakemake
def test_upstream_file_without_evaluation_fails_the_dag_before_any_job(tmp_path, placeholders):
    flat = local_paths(HEADLINE, *placeholders)
    flat.pop("evaluation.ppl")  # upstream's YAMLs have no `evaluation` section
    code, out = dry_run(tmp_path, HEADLINE, flat, check=False)
    assert code != 0 and "evaluation: no ppl / tasks to evaluate" in out and "Job stats" not in out


# --------------------------------------------------------------------------- slow: real runs
# in_features divisible by the int4 file's group_size 128
GROUPABLE = dict(hidden_size=128, head_dim=32, max_position_embeddings=512)
EVAL = {"evaluation.max_seq_length": 64, "evaluation.limit": 4, "evaluation.batch_size": 4}


def local_run_files(root: Path, tokenizer, config) -> tuple[Path, Path, Path]:
    model = root / "model"
    build_model(config).save_pretrained(model)
    tokenizer.save_pretrained(model)
    texts = local_texts(80)
    data, text = root / "train.jsonl", root / "test.txt"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:60]))
    text.write_text("\n\n".join(texts[60:]))
    return model, data, text


def run_dag(tmp_path: Path, rel: str, overrides: dict[str, object]) -> tuple[Path, Path]:
    cfg = dag_config(tmp_path, rel, overrides)
    exp = exp_name(rel)
    wd = tmp_path / "wd"
    _, out = snakemake([f"results/{exp}/report.html", "--configfile", str(cfg)], workdir=wd, timeout=900)
    assert f"Report: results/{exp}/report.html" in out
    return wd / "results" / exp, cfg


def check_results(exp: Path) -> dict[str, float]:
    """The report is built, every variant has a finite perplexity, the export reloads from disk
    with plain transformers and its logits are finite; returns perplexity by variant."""
    import torch
    from transformers import AutoModelForCausalLM

    html = (exp / "report.html").read_text()
    assert "<html" in html.lower() and "QAT" in html
    ppl = {}
    for v in VARIANTS:
        res = json.loads((exp / f"eval/{v}.json").read_text())
        (value,) = [r["ppl"] for r in res["ppl"].values()]
        assert math.isfinite(value) and value > 1, (v, value)
        ppl[v] = value
    deployed = exp / "eval/deployed.json"  # the runtime emulator's (a reason when skipped)
    if deployed.exists() and "skipped" not in (res := json.loads(deployed.read_text())):
        (ppl["deployed"],) = [r["ppl"] for r in res["ppl"].values()]
    metrics = json.loads((exp / "metrics.json").read_text())
    assert all(math.isfinite(x) for k, x in metrics.items() if k.startswith("ppl/"))
    model = AutoModelForCausalLM.from_pretrained(str(exp / "export"))
    with torch.no_grad():
        logits = model(torch.arange(1, 17).unsqueeze(0)).logits
    assert torch.isfinite(logits).all()
    return ppl


def assert_export_is_the_qat_model(ppl: dict[str, float]) -> None:
    """The export reloaded from disk computes what the fake-quantized QAT model does: their
    perplexities agree far closer than either does with the unquantized model's (a random tiny
    model moves little under quantization, so a relative bound alone would not tell them apart)."""
    assert ppl["qat"] != ppl["bf16"], ppl
    # under deploy.target (vllm by default) QAT trained the runtime's arithmetic (tied scales,
    # per-token dynamic inputs, expert input quantization), which the runtime emulator applies and a
    # transformers reload does not: compare what the runtime serves
    served = ppl["deployed"] if isinstance(ppl.get("deployed"), float) else ppl["export"]
    assert abs(served - ppl["qat"]) < 0.2 * abs(ppl["qat"] - ppl["bf16"]), ppl


@pytest.mark.slow
@needs_snakemake
def test_headline_zero3_config_runs_the_dag_on_a_tiny_qwen3_moe(tmp_path, tiny_tokenizer):
    files = local_run_files(tmp_path, tiny_tokenizer, tiny_qwen3_moe_config(max_position_embeddings=512))
    shrink = {"dataset.max_seq_length": 64, "dataset.num_samples": 8, **EVAL}  # max_steps: 3 as shipped
    exp, _ = run_dag(tmp_path, HEADLINE, {**local_paths(HEADLINE, *files), **shrink})
    ppl = check_results(exp)
    # QAT really ran under ZeRO-3 on 2 ranks, warm-started from the DAG's own PTQ scales
    meta = json.loads((exp / "qat/run_metadata.json").read_text())
    assert meta["world_size"] == 2 and meta["zero_stage"] == 3, meta
    assert all(r["param_bytes_held"] < meta["param_bytes_total"] for r in meta["ranks"])  # partitioned
    assert json.loads((exp / "qat/scale_load.json").read_text())["misses"] == 0
    assert "quantization_config" in json.loads((exp / "export/config.json").read_text())
    assert_export_is_the_qat_model(ppl)


@pytest.mark.slow
@needs_snakemake
def test_blockwise_int4_config_runs_the_dag_on_a_tiny_qwen3(tmp_path, tiny_tokenizer):
    files = local_run_files(tmp_path, tiny_tokenizer, tiny_qwen3_config(**GROUPABLE, intermediate_size=256))
    bw = "compression.QAT.block_wise_config"
    shrink = {
        f"{bw}.epochs": 1,
        f"{bw}.train_size": 4,
        f"{bw}.val_size": 2,  # qatlib's (default 64): held-out windows for the block loss
        f"{bw}.training_seqlen": 64,
        f"{bw}.batch_size": 2,
        "dataset.max_seq_length": 64,
        "dataset.num_samples": 8,
        **EVAL,
    }
    exp, _ = run_dag(tmp_path, BLOCKWISE, {**local_paths(BLOCKWISE, *files), **shrink})
    assert json.loads((exp / "qat/run_metadata.json").read_text())["world_size"] == 1  # one process
    assert_export_is_the_qat_model(check_results(exp))
