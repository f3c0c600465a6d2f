"""Pipeline: wall time per stage of the default workflow, read from the stages' own records.

Every workflow rule writes ``{"stage", "wall_s", ...}`` when it succeeds: the shared stages into
``results/timings/`` (``corpus.json``, ``base_model-<name>.json``), the experiment's into
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

SHARED = ("corpus", "base_model")
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


def expected(experiment: str, base_model: str | None) -> list[str]:
    stems = ["corpus"] + ([f"base_model-{base_model}"] if base_model else [])
    stems += ["ptq_calibrate", "zero3_qat", "convert_export"]
    stems += [f"evaluate-{v}" for v in EVAL_VARIANTS] + ["sqnr", "report"]
    return stems


def _base_model_of(experiment: str) -> str | None:
    from .common import REPO

    try:
        import yaml

        cfg = yaml.safe_load((REPO / "config" / "experiments" / f"{experiment}.yaml").read_text())
        path = str(cfg["model"]["model_path"])
    except (OSError, KeyError, TypeError, ValueError):
        return None
    return Path(path).name if path.startswith("results/base/") else None


def run(*, results: str = "results", experiment: str = "tiny-qwen3-moe") -> dict[str, Any]:
    res = Path(results)
    dirs = [("shared", res / "timings"), ("experiment", res / experiment / "timings")]
    rows = []
    seen: dict[str, str] = {}
    copies = []
    for scope, d in dirs:
        for path in sorted(d.glob("*.json")) if d.is_dir() else []:
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
    want = expected(experiment, _base_model_of(experiment))
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
