"""workflow/lib/, the plain Python the Snakemake rules are built on (no Snakemake needed).

experiment.py: the effective experiment (one YAML reader, overrides as the scripts apply them,
schema errors naming the file and key), which stage re-runs for which key, path resolution, the
`--set` arguments, single-process vs torchrun QAT. code_deps.py: a stage's code inputs, checked
against what Python really imports.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # workflow/lib is not an installed package
    sys.path.insert(0, str(REPO))

from qatlib.yamlio import ConfigError, apply_overrides, load_yaml, normalise_overrides  # noqa: E402
from workflow.lib import experiment as xp  # noqa: E402
from workflow.lib.code_deps import imported_files, stage_code  # noqa: E402

SCHEMA = REPO / "workflow/schemas/experiment.schema.json"
LR = "compression.QAT.hf_args.learning_rate"


def experiments(tmp_path, overrides=None, edit=None, active="tiny-test", **kw) -> xp.Experiments:
    """The .test experiments (optionally edited) in tmp_path, seen from the repository root."""
    d = tmp_path / "experiments"
    shutil.copytree(REPO / ".test/config/experiments", d, dirs_exist_ok=True)
    shutil.copy(REPO / "config/experiments/tiny-qwen3.yaml", d)
    if edit:
        p = d / "tiny-test.yaml"
        p.write_text(edit(p.read_text()))
    return xp.Experiments(REPO, "res", str(d), active, overrides, SCHEMA, **kw)


# ----------------------------------------------------------------------------- experiment.py
def test_importing_the_workflow_lib_imports_no_torch_pydantic_or_qatlib_config():
    code = (
        "import sys; import workflow.lib.experiment, workflow.lib.code_deps; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'pydantic') "
        "or m.startswith('qatlib.config')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_snakefile_imports_only_qatlib_yamlio():
    files = [REPO / "Snakefile", *sorted((REPO / "workflow/rules").glob("*.smk"))]
    imported = {
        m for f in files for m in re.findall(r"^\s*(?:from|import) (qatlib[\w.]*)", f.read_text(), re.M)
    }
    assert imported == {"qatlib.yamlio"}


def test_override_items_are_the_scripts_set_pairs():
    items = xp.override_items(
        {
            "compression": {"QAT": {"hf_args": {"learning_rate": "1e-4", "bf16": "true"}}},
            "evaluation": {"ppl": ["1", "x"], "limit": 3},
            "model": {},
        }
    )
    assert items == [
        ("compression.QAT.hf_args.learning_rate", 1e-4),
        ("compression.QAT.hf_args.bf16", True),
        ("evaluation.ppl", [1, "x"]),
        ("evaluation.limit", 3),
    ]
    assert isinstance(items[0][1], float)


def test_overrides_apply_to_the_active_experiment_only(tmp_path):
    exps = experiments(tmp_path, {"compression": {"QAT": {"hf_args": {"learning_rate": "3e-4"}}}})
    assert xp.section(exps.get("tiny-test"), LR) == 3e-4
    assert xp.section(exps.get("tiny-qwen3"), LR) == 2e-4
    assert xp.section(load_yaml(exps.yaml_path("tiny-test")), LR) == 1e-4


def test_the_workflow_and_the_script_see_the_same_experiment(tmp_path):
    """The report stage reads every section: its `--set` arguments, applied by the script's
    reader to the YAML, give the experiment the workflow built its DAG from."""
    ov = {"compression": {"QAT": {"hf_args": {"learning_rate": "3e-4"}}}, "evaluation": {"limit": "7"}}
    exps = experiments(tmp_path, ov)
    sets = [a.removeprefix("--set=") for a in shlex.split(exps.cli_sets("tiny-test", "report"))]
    script = load_yaml(exps.yaml_path("tiny-test"))
    apply_overrides(script, normalise_overrides(sets, "cli"), "cli")
    ds = "compression.QAT.hf_args.deepspeed"
    assert xp.section(script, ds) == str(REPO / "config/deepspeed/zero3_cpu.json")  # resolved
    # from_ptq_ckpt: the DAG's own PTQ output, under the configured results folder ("res")
    assert xp.section(script, "compression.QAT.from_ptq_ckpt") == "res/tiny-test/ptq"
    wf = exps.get("tiny-test")
    script["compression"]["QAT"]["hf_args"]["deepspeed"] = xp.section(wf, ds)
    script["compression"]["QAT"]["from_ptq_ckpt"] = xp.section(wf, "compression.QAT.from_ptq_ckpt")
    assert script == wf
    assert xp.section(wf, LR) == 3e-4 and wf["evaluation"]["limit"] == 7


def test_a_schema_violation_names_the_file_and_the_key(tmp_path):
    exps = experiments(tmp_path, edit=lambda s: s.replace("      max_steps: 10\n", "      max_step: 10\n"))
    with pytest.raises(ConfigError) as e:
        exps.get("tiny-test")
    assert "tiny-test.yaml" in str(e.value) and "max_step" in str(e.value)
    assert e.value.issues and all(path.startswith("compression.QAT.hf_args") for path, _ in e.value.issues)
    with pytest.raises(ConfigError, match="no-such.yaml does not exist .*tiny-test"):
        exps.get("no-such")


def test_an_override_is_validated_too_and_the_error_type_is_the_callers(tmp_path):
    class Stop(Exception):
        pass

    exps = experiments(tmp_path, {"dataset": {"num_samples": "many"}}, error=Stop)
    with pytest.raises(Stop, match=r"params.yaml overrides dataset.num_samples='many'.*dataset.num_samples"):
        exps.get("tiny-test")
    assert exps.get("tiny-qwen3")  # not the active experiment: no overrides, valid


def test_yaml_1e_minus_4_is_a_number(tmp_path):
    exps = experiments(tmp_path, edit=lambda s: s.replace("learning_rate: 1.0e-4", "learning_rate: 1e-4"))
    assert xp.section(exps.get("tiny-test"), LR) == 1e-4


def test_each_stage_config_changes_only_with_the_sections_it_reads(tmp_path):
    base = experiments(tmp_path / "a").get("tiny-test")

    def changed(edit):
        raw = experiments(tmp_path / "b", edit=edit).get("tiny-test")
        return {s for s in xp.STAGE_SECTIONS if xp.stage_config(raw, s) != xp.stage_config(base, s)}

    assert changed(lambda s: s.replace("learning_rate: 1.0e-4", "learning_rate: 2.0e-4")) == {
        "zero3_qat",
        "report",
    }
    # training-only keys inside sections PTQ, export and evaluation read
    assert changed(lambda s: s.replace("          norm: false", "          norm: true")) == {
        "zero3_qat",
        "report",
    }
    for key in ("scale_update: log", "weight_lr: 1.0e-5"):  # how and what QAT trains
        edit = lambda s, k=key: s.replace(  # noqa: E731
            "        weight_scale_init_value: 0.1", f"        weight_scale_init_value: 0.1\n        {k}"
        )
        assert changed(edit) == {"zero3_qat", "report"}, key
    assert changed(lambda s: s.replace("  num_samples: 40 ", "  num_samples: 32 ")) == {
        "ptq_calibrate",
        "zero3_qat",
        "report",
    }
    assert changed(lambda s: s.replace("  limit: 40 ", "  limit: 30 ")) == {
        "evaluate",
        "evaluate_quant",
        "evaluate_deployed",
        "report",
    }
    # (the deployed evaluation reads the export, which changes: it re-runs through its input)
    assert changed(lambda s: s.replace("group_size: 32", "group_size: 16")) == set(xp.STAGE_SECTIONS) - {
        "evaluate",
        "evaluate_deployed",
    }


def test_a_stage_gets_only_the_overrides_it_reads(tmp_path):
    ov = {
        "compression": {
            "QAT": {
                "hf_args": {"learning_rate": 2e-4},
                "plugin_config": {"quant_config": {"learnable": {"norm": True}}},
            }
        },
        "dataset": {"num_samples": 8},
    }
    exps = experiments(tmp_path, ov)
    assert exps.stage_overrides("tiny-test", "ptq_calibrate") == {"dataset.num_samples": 8}
    assert set(exps.stage_overrides("tiny-test", "zero3_qat")) == {
        LR,
        "compression.QAT.plugin_config.quant_config.learnable.norm",
        "dataset.num_samples",
    }
    assert exps.stage_overrides("tiny-test", "evaluate") == {}
    assert exps.stage_overrides("tiny-qwen3", "zero3_qat") == {}


def test_paths_are_products_local_files_or_hub_ids(tmp_path):
    exps = experiments(tmp_path)
    assert exps.product("results/corpus/train.txt") == "res/corpus/train.txt"
    assert exps.product("results/base/x/") == "res/base/x"
    assert exps.product("config/x") is None
    assert exps.resolve("Qwen/Qwen3-4B") == "Qwen/Qwen3-4B" and exps.as_input("Qwen/Qwen3-4B") is None
    assert exps.as_input("data/sharegpt.jsonl") == str(REPO / "data/sharegpt.jsonl")  # a data file, missing
    assert exps.as_input("config/deepspeed") == str(REPO / "config/deepspeed")  # exists
    assert exps.as_input("/abs/model") == "/abs/model"
    assert exps.model_path("tiny-test") == "res/base/tiny-test"
    assert exps.eval_inputs("tiny-test") == ["res/corpus/test.txt", "res/corpus/tasks/qat_local_mc"]
    assert exps.products("tiny-test") == [
        "res/corpus/train.txt",
        "res/base/tiny-test",
        "res/corpus/test.txt",
        "res/corpus/tasks/qat_local_mc",
    ]
    sets = exps.cli_sets("tiny-test", "evaluate", "evaluation.ppl", "evaluation.tasks")
    assert '--set=evaluation.ppl=["res/corpus/test.txt"]' in shlex.split(sets)


def test_qat_is_distributed_only_end_to_end_under_zero3(tmp_path):
    ds = "deepspeed: config/deepspeed/zero3_cpu.json"
    cases = {
        "zero3_json": (ds, ds, True),
        "blockwise": ("training_mode: end2end", "training_mode: blockwise", False),
        "no_deepspeed": (ds, "deepspeed: null", False),
        "zero2_inline": (ds, "deepspeed: {zero_optimization: {stage: 2}}", False),
        "zero3_inline": (ds, "deepspeed: {zero_optimization: {stage: 3}}", True),
        "stage_true": (ds, "deepspeed: {zero_optimization: {stage: true}}", False),
    }
    for name, (old, new, expected) in cases.items():
        exps = experiments(tmp_path / name, edit=lambda s, old=old, new=new: s.replace(old, new))
        assert exps.distributed("tiny-test") is expected, name
    # params.yaml can switch it off as well
    exps = experiments(tmp_path / "override", {"compression": {"QAT": {"training_mode": "blockwise"}}})
    assert not exps.distributed("tiny-test") and exps.distributed("tiny-qwen3")


def test_zero3_rule_agrees_with_qatlib_config(tmp_path, monkeypatch):
    from qatlib.config import load_config

    monkeypatch.chdir(REPO)
    path = REPO / ".test/config/experiments/tiny-test.yaml"
    for stage in (3, 2):
        ds = {"zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
        cfg = load_config(path, [f"compression.QAT.hf_args.deepspeed={json.dumps(ds)}"])
        assert cfg.zero3_enabled is xp.zero3_enabled(ds) is (stage == 3)


# ----------------------------------------------------------------------------- code_deps.py
def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_import_walk_follows_relative_lazy_and_parent_package_imports(tmp_path):
    write(
        tmp_path,
        {
            "scripts/run.py": "import json\nimport _helper\n\ndef main():\n    _helper.used()\n"
            "    from pkg.a.b import thing\n    from pkg import c\n",
            "scripts/_helper.py": "import os\n\ndef used():\n    return inner()\n\ndef inner():\n"
            "    import pkg.d\n\ndef unused():\n    import pkg.e\n",
            "pkg/__init__.py": "",
            "pkg/a/__init__.py": "",
            "pkg/a/template.html": "<html>",
            "pkg/a/b.py": "from . import sib\nfrom ..deep.x import y\n\ndef f():\n    from .. import late\n",
            "pkg/a/sib.py": "",
            "pkg/deep/__init__.py": "",
            "pkg/deep/x.py": "import torch\n",
            "pkg/late.py": "",
            "pkg/c.py": "",
            "pkg/d.py": "",
            "pkg/e.py": "",
            "pkg/never.py": "",
        },
    )
    got = {
        str(f.relative_to(tmp_path)) for f in imported_files(tmp_path / "scripts/run.py", tmp_path, ("pkg",))
    }
    assert got == {
        "scripts/_helper.py",
        "pkg/__init__.py",
        "pkg/a/__init__.py",
        "pkg/a/template.html",
        "pkg/a/b.py",
        "pkg/a/sib.py",
        "pkg/deep/__init__.py",
        "pkg/deep/x.py",
        "pkg/late.py",
        "pkg/c.py",
        "pkg/d.py",
    }


def stage_scripts() -> list[str]:
    """The scripts the rules run: every `code("x.py")` in workflow/rules."""
    names = {
        m
        for f in (REPO / "workflow/rules").glob("*.smk")
        for m in re.findall(r'code\("(\w+\.py)"\)', f.read_text())
    }
    assert len(names) >= 9
    return sorted(names)


# One process imports the heavy third-party packages once; a forked child per script imports the
# script (without running main) and the qatlib modules it names, then every module of its closure.
_REAL_IMPORTS = r"""
import importlib, importlib.util, json, os, re, sys
repo, scripts = sys.argv[1], json.loads(sys.argv[2])
sys.path[:0] = [os.path.join(repo, "scripts"), repo]
for heavy in ("torch", "transformers", "transformers.trainer", "transformers.modeling_utils", "deepspeed",
              "datasets", "accelerate", "safetensors.torch", "compressed_tensors", "yaml", "pydantic"):
    try: importlib.import_module(heavy)
    except ImportError: pass
qatlib_dir = os.path.join(repo, "qatlib") + os.sep

def loaded():
    return sorted({os.path.relpath(m.__file__, repo) for m in list(sys.modules.values())
                   if getattr(m, "__file__", None) and m.__file__.startswith(qatlib_dir)})

def module(rel):
    return rel[:-3].replace("/", ".").removesuffix(".__init__")

out = {}
for script, closure in scripts.items():
    r, w = os.pipe()
    if os.fork() == 0:
        os.close(r)
        path = os.path.join(repo, "scripts", script)
        spec = importlib.util.spec_from_file_location("stage_script", path)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
        for m in re.findall(r"^\s*(?:from|import) (qatlib[\w.]*)(?: import ([\w, ]+))?", open(path).read(), re.M):
            importlib.import_module(m[0])
            for name in filter(None, (n.strip() for n in m[1].split(","))):
                if importlib.util.find_spec(m[0]) and importlib.util.find_spec(m[0]).submodule_search_locations:
                    try: importlib.import_module(f"{m[0]}.{name}")
                    except ModuleNotFoundError: pass
        direct = loaded()
        for rel in closure:
            if rel.endswith(".py"):
                importlib.import_module(module(rel))
        os.write(w, json.dumps({"direct": direct, "all": loaded()}).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 1 << 16):
        data += chunk
    os.wait()
    out[script] = json.loads(data)
print(json.dumps(out))
"""


def test_code_inputs_cover_what_python_really_imports():
    """For each stage: the script's qatlib imports, imported for real, load only files of the
    computed closure (which must therefore hold their transitive imports); importing every
    module of the closure loads nothing outside it; and it names only qatlib / scripts files."""
    closures = {}
    for script in stage_scripts():
        files = stage_code(Path("."), script)
        assert files[0] == f"scripts/{script}"
        assert all((REPO / f).is_file() and f.startswith(("qatlib/", "scripts/")) for f in files), files
        closures[script] = [f for f in files if f.startswith("qatlib/")]
    proc = subprocess.run(
        [sys.executable, "-c", _REAL_IMPORTS, str(REPO), json.dumps(closures)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    real = json.loads(proc.stdout.splitlines()[-1])
    for script, closure in closures.items():
        assert len(real[script]["direct"]) > 1, script  # the script's own imports were loaded
        assert set(real[script]["direct"]) <= set(closure), (
            script,
            set(real[script]["direct"]) - set(closure),
        )
        assert set(real[script]["all"]) <= set(closure), (script, set(real[script]["all"]) - set(closure))


def test_helper_functions_a_script_does_not_call_are_not_its_code():
    corpus = stage_code(Path("."), "corpus.py")  # no experiment config: _common.load_experiment unused
    assert "scripts/_common.py" in corpus and not any("config" in f for f in corpus), corpus
    assert any(f.startswith("qatlib/config") for f in stage_code(Path("."), "ptq.py"))
