"""Pipeline: wall time per stage of the default workflow, read from the stages' own records.

Every workflow rule writes ``{"stage", "wall_s", ...}`` when it succeeds: the shared stages into
``results/timings/`` (``corpus.json``, ``local_task-<task>.json``, ``base_model-<name>.json``;
only those the experiment uses are counted), the experiment's into
``results/<exp>/timings/`` (``ptq_calibrate``, ``zero3_qat``, ``convert_export``,
``evaluate-<variant>``, ``sqnr``, ``report``). This benchmark runs nothing: it collects those
records in workflow order, with each stage's share of the total (a record copied into both
folders is counted once). A missing stage is listed as
missing (the DAG has not run, or not that far).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SHARED = ("corpus", "local_task", "base_model")
STAGES = ("ptq_calibrate", "zero3_qat", "convert_export", "evaluate", "sqnr", "report")
EVAL_VARIANTS = ("bf16", "ptq", "qat", "export")


def _order(stem: str) -> tuple[int, str]:
    order = SHARED + STAGES
    for i, st in enumerate(order):
        if stem == st or stem.startswith((f"{st}-", f"{st}_")):
            return i, stem
    return len(order), stem


def _read(path: Path) -> dict[str, Any]:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return d if isinstance(d, dict) else {"error": "not a JSON object"}


def expected(experiment: str, uses: dict[str, list[str]]) -> list[str]:
    stems = ["corpus"] + [f"local_task-{t}" for t in uses["local_tasks"]]
    stems += [f"base_model-{b}" for b in uses["base_models"]]
    stems += ["ptq_calibrate", "zero3_qat", "convert_export"]
    stems += [f"evaluate-{v}" for v in EVAL_VARIANTS] + ["sqnr", "report"]
    return stems


def _shared_uses(experiment: str) -> dict[str, list[str]]:
    """The workflow-made base model and local tasks the experiment's YAML points at."""
    from .common import REPO

    uses: dict[str, list[str]] = {"base_models": [], "local_tasks": []}
    try:
        import yaml

        cfg = yaml.safe_load((REPO / "config" / "experiments" / f"{experiment}.yaml").read_text())
    except (OSError, ValueError):
        return uses
    cfg = cfg if isinstance(cfg, dict) else {}
    path = str((cfg.get("model") or {}).get("model_path", ""))
    if path.startswith("results/base/"):
        uses["base_models"].append(Path(path).name)
    for t in (cfg.get("evaluation") or {}).get("tasks") or []:
        if isinstance(t, str) and t.startswith("results/corpus/tasks/"):
            uses["local_tasks"].append(Path(t).name)
    return uses


def run(*, results: str = "results", experiment: str = "tiny-qwen3-moe") -> dict[str, Any]:
    res = Path(results)
    uses = _shared_uses(experiment)
    want = expected(experiment, uses)
    dirs = [("shared", res / "timings"), ("experiment", res / experiment / "timings")]
    rows = []
    seen: dict[str, str] = {}
    copies = []
    for scope, d in dirs:
        for path in sorted(d.glob("*.json")) if d.is_dir() else []:
            if scope == "shared" and path.stem not in want:
                continue  # another experiment's base model or task
            rec = _read(path)
            key = json.dumps(rec, sort_keys=True)
            if "error" not in rec and key in seen:
                # the experiment folder may hold copies of the shared stages' records: count once
                copies.append({"file": str(path), "same_as": seen[key]})
                continue
            seen[key] = str(path)
            rows.append(
                {
                    "stage": path.stem,
                    "scope": scope,
                    "wall_s": rec.get("wall_s"),
                    "world_size": rec.get("world_size"),
                    "torch_threads": rec.get("torch_threads"),
                    "file": str(path),
                    **({"error": rec["error"]} if "error" in rec else {}),
                }
            )
    rows.sort(key=lambda r: _order(r["stage"]))
    total = sum(r["wall_s"] for r in rows if isinstance(r.get("wall_s"), (int, float)))
    for r in rows:
        w = r.get("wall_s")
        r["share"] = round(w / total, 4) if isinstance(w, (int, float)) and total else None
    have = {r["stage"] for r in rows}
    missing = [s for s in want if s not in have]
    out: dict[str, Any] = {
        "experiment": experiment,
        "results": str(res),
        "status": "complete" if not missing else ("not run" if not rows else "partial"),
        "total_wall_s": round(total, 1),
        "stages": rows,
        "missing_stages": missing,
        "duplicate_records_skipped": copies,
    }
    if not rows:
        out["note"] = (
            f"no timing records under {res}/timings or {res}/{experiment}/timings: run the workflow "
            "(`snakemake`) first"
        )
    return out
