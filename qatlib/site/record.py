"""The default experiment's figures, as a committed JSON beside the benchmarks' (results/bench/).

    python -m qatlib.site record [results/smollm2-135m] [--out results/bench]

``results/<exp>/`` is git-ignored: a run's figures exist only on the machine that ran it. `record`
copies what the results page needs into ``results/bench/default_experiment.json``: the run's
`metrics.json` as it is, each stage's wall time (``timings/*.json``, the shared stages'
``results/timings/*.json`` that the experiment used), the settings that decide the figures (read
from the config the report saved, ``results/<exp>/config.yaml``) and the machine: the run's date
(the newest timing record's time), the commit checked out, the CPU. Nothing in it is the time
`record` ran, so recording the same run twice writes the same bytes.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
from pathlib import Path
from typing import Any

from qatlib.report.inputs import git_commit, package_versions, stage_order
from qatlib.yamlio import load_yaml, section

NAME = "default_experiment"
SCHEMA_VERSION = 1
# (label, dotted key of the experiment config): the settings the results page shows
SETTINGS = (
    ("format", "compression.quantization.name"),
    ("group_size", "compression.quantization.quant_method.group_size"),
    ("loss_type", "compression.QAT.loss_type"),
    ("scale_update", "compression.QAT.plugin_config.quant_config.scale_update"),
    ("frozen_codes", "compression.QAT.plugin_config.quant_config.frozen_codes"),
    ("learning_rate", "compression.QAT.hf_args.learning_rate"),
    ("max_steps", "compression.QAT.hf_args.max_steps"),
    ("deepspeed", "compression.QAT.hf_args.deepspeed"),
    ("train_tokens_per_sample", "dataset.max_seq_length"),
    ("train_samples", "dataset.num_samples"),
    ("eval_tokens_per_window", "evaluation.max_seq_length"),
    ("eval_windows", "evaluation.limit"),
    ("deploy_target", "deploy.target"),
)


class RecordError(FileNotFoundError):
    """The experiment folder lacks what the record needs."""


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else the platform's processor string."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _timings(exp: Path) -> dict[str, tuple[float, float]]:
    """``stage -> (wall_s, mtime)`` of the experiment's timing records and the shared ones it used."""
    files = sorted((exp / "timings").glob("*.json"))
    shared = exp.parent / "timings"
    base = section(load_yaml(exp / "config.yaml"), "model.model_path") or ""
    base_name = Path(str(base)).name
    for f in sorted(shared.glob("*.json")) if shared.is_dir() else []:
        if f.stem == "corpus" or f.stem.endswith(f"-{base_name}"):
            files.append(f)
    out = {}
    for f in files:
        rec = json.loads(f.read_text())
        if isinstance(rec, dict) and isinstance(rec.get("wall_s"), int | float):
            out[f.stem] = (float(rec["wall_s"]), f.stat().st_mtime)
    return out


def _qat_launch(exp: Path) -> dict[str, Any]:
    """Ranks and threads of the QAT stage, from its own timing record."""
    path = exp / "timings" / "zero3_qat.json"
    rec = json.loads(path.read_text()) if path.is_file() else {}
    keys = (("qat_ranks", "world_size"), ("qat_threads_per_rank", "torch_threads"), ("qat_zero3", "zero3"))
    return {label: rec[k] for label, k in keys if k in rec}


def record(exp_dir: str | os.PathLike, out_dir: str | os.PathLike = "results/bench") -> Path:
    """Write ``<out_dir>/default_experiment.json`` from the finished run in ``exp_dir``."""
    exp = Path(exp_dir)
    for need in ("metrics.json", "config.yaml", "report.html"):
        if not (exp / need).is_file():
            raise RecordError(f"{exp / need}: missing (run `snakemake` first: the report writes it)")
    metrics = json.loads((exp / "metrics.json").read_text())
    config = load_yaml(exp / "config.yaml")
    timings = _timings(exp)
    if not timings:
        raise RecordError(f"{exp / 'timings'}: no stage timing records")
    finished = max(t for _, t in timings.values())
    commit = git_commit()
    doc = {
        "benchmark": NAME,
        "schema_version": SCHEMA_VERSION,
        "machine": {
            "date_utc": dt.datetime.fromtimestamp(finished, dt.timezone.utc).isoformat(timespec="seconds"),
            "cpu_model": cpu_model(),
            "cpu_count": os.cpu_count(),
            "cpu_arithmetic": {k.removeprefix("cpu/"): v for k, v in metrics.items() if k.startswith("cpu/")},
            "python": platform.python_version(),
            "versions": package_versions(("torch", "transformers", "deepspeed", "compressed-tensors")),
            "git": {"commit": commit.removesuffix("-dirty"), "dirty": commit.endswith("-dirty")},
        },
        "settings": {
            "experiment": exp.name,
            **{label: v for label, key in SETTINGS if (v := section(config, key)) is not None},
            **_qat_launch(exp),
        },
        "stage_wall_s": {
            stage: round(timings[stage][0], 1)
            for stage in sorted(timings, key=lambda s: stage_order(Path(s)))
        },
        "metrics": metrics,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{NAME}.json"
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)
    return path
