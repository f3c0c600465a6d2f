"""Readers of the ``results/<exp>/`` layout (docs/design.md) for the report: where each input is,
how it is read, and `ReportError` for a required one that is missing. Nothing here renders."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import math
import os
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .. import analysis
from ..checkpoint.hashes import product_hashes
from ..checkpoint.layout import NESTED_DIR, TRAIN_LOG_FILE

# served_ptq / served (optional, like export and deployed): the PTQ model's export and the QAT export
# in vLLM's own engine (rule serve_evaluate)
VARIANTS = ("bf16", "ptq", "qat", "export", "deployed", "served_ptq", "served")
REQUIRED_VARIANTS = ("bf16", "ptq", "qat")
PACKAGES = ("torch", "transformers", "deepspeed", "compressed-tensors", "lm-eval", "snakemake", "dvc")
STAGES = (
    "corpus",
    "base_model",
    "ptq_calibrate",
    "zero3_qat",
    "convert_export",
    "evaluate",
    "sqnr",
    "bench",
    "report",
)
SQNR_CSV = Path("analysis") / "sqnr.csv"
# The products of one experiment, in workflow order (``exp_dir/<name>``); corpus, tokenizer and
# base model come from outside it (build_report's ``products``).
STAGE_PRODUCTS = ("ptq", "qat", "export")
PRODUCT_ORDER = ("corpus", "tokenizer", "base_model", *STAGE_PRODUCTS)
# The environment that picks the CPU kernels (workflow/lib/launch.py pins it for every stage).
CPU_ENV = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


class ReportError(RuntimeError):
    """A required input of the report is missing or unreadable."""


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from None


def first_file(dirs: Iterable[Path], names: Iterable[str]) -> Path | None:
    names = list(names)
    for d in dirs:
        for n in names:
            if (d / n).is_file():
                return d / n
    return None


def qat_file(exp: Path, *names: str) -> Path | None:
    """The first of ``names`` in ``qat/`` or its nested checkpoint folder."""
    return first_file([exp / "qat", exp / "qat" / NESTED_DIR], names)


def require_files(paths: Sequence[str | os.PathLike], what: str) -> None:
    """`ReportError` naming every path of ``paths`` that is not a file (checked before any output
    is written)."""
    missing = [str(t) for t in paths if not Path(t).is_file()]
    if missing:
        raise ReportError(f"{what} not found: {', '.join(missing)}")


# =========================================================================== evaluation
def load_eval(exp_dir: str | os.PathLike) -> dict[str, dict]:
    """``eval/<variant>.json`` for every variant present; a missing required one is an error. A
    result with ``skipped`` (the deployed variant under ``deploy.target: none``, the served one where
    the engine refuses the format) is kept: `evaluated` drops it, the report names the reason."""
    exp = Path(exp_dir)
    out = {}
    for v in VARIANTS:
        path = exp / "eval" / f"{v}.json"
        if not path.is_file():
            if v in REQUIRED_VARIANTS:
                raise ReportError(
                    f"required evaluation result missing: {path} (variant {v!r}; run the evaluate stage)"
                )
            continue
        data = read_json(path)
        if not isinstance(data, dict):
            raise ReportError(f"{path}: expected a JSON object, got {type(data).__name__}")
        out[v] = data
    return out


def evaluated(evals: Mapping[str, dict]) -> dict[str, dict]:
    """The results that were evaluated (not ``skipped``)."""
    return {v: d for v, d in evals.items() if not d.get("skipped")}


# =========================================================================== training
def find_train_log(exp_dir: str | os.PathLike) -> Path | None:
    return qat_file(Path(exp_dir), TRAIN_LOG_FILE)


def read_train_log(path: str | os.PathLike) -> list[dict[str, Any]]:
    """JSON lines -> dicts (blank lines skipped); a bad line is an error naming the line."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: invalid JSON ({e})") from None
    return out


# =========================================================================== SQNR
def read_sqnr_csv(path: Path) -> list[dict[str, Any]]:
    """``analysis/sqnr.csv`` rows (``layer, ptq_db, qat_db`` required; ``layer_type`` and
    ``delta_db`` filled in when absent)."""
    rows = analysis.read_csv(path)
    need = {"layer", "ptq_db", "qat_db"}
    if rows and not need <= set(rows[0]):
        raise ValueError(f"{path}: needs columns {sorted(need)}, has {sorted(rows[0])}")
    for r in rows:
        r.setdefault("layer_type", analysis.layer_type(str(r["layer"])))
        if "delta_db" not in r:
            p, q = r["ptq_db"], r["qat_db"]
            r["delta_db"] = q - p if isinstance(p, float) and isinstance(q, float) else math.nan
    return rows


# =========================================================================== run metadata
def stage_order(path: Path) -> tuple[int, str]:
    """Workflow order (STAGES; ``evaluate-bf16`` sorts with ``evaluate``), unknown stages last."""
    stem = path.stem
    idx = next(
        (i for i, st in enumerate(STAGES) if stem == st or stem.startswith((f"{st}-", f"{st}_"))), len(STAGES)
    )
    return idx, path.stem


def read_timings(exp: Path, extra_timings: Sequence[Path] = ()) -> list[tuple[str, Any, Any]]:
    """``(label, wall_s, world_size)`` per timing file, in workflow order; the label is the file
    name (evaluate-bf16, ...), an unreadable file gives its error text as ``wall_s``.

    The experiment's own ``timings/*.json`` plus shared ones (corpus, base model) that live outside
    ``exp``; a shared record also present in ``exp/timings`` (older runs copied them there) is
    listed once."""
    own = list((exp / "timings").glob("*.json"))
    names = {p.stem for p in own}
    shared = [p for p in extra_timings if p.stem.split("-")[0] not in names]
    out = []
    for path in sorted(own + shared, key=stage_order):
        try:
            t = read_json(path)
        except ValueError as e:
            out.append((path.stem, str(e), None))
            continue
        t = t if isinstance(t, dict) else {}
        out.append((path.stem, t.get("wall_s"), t.get("world_size")))
    return out


def stage_hashes(exp: Path, products: Mapping[str, Any]) -> dict[str, str]:
    """Content hashes (`qatlib.checkpoint.hashes.content_hash`) of ``products`` and of the
    experiment's own products that exist, in workflow order."""
    paths = {**dict(products), **{n: exp / n for n in STAGE_PRODUCTS}}
    hashes = product_hashes(paths)
    order = {k: i for i, k in enumerate(PRODUCT_ORDER)}
    return dict(sorted(hashes.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])))


def cpu_arithmetic() -> dict[str, Any]:
    """What decides the last bits of CPU arithmetic in this process (the same launcher env as
    every stage): the ATen kernel level torch picked, the kernel-selecting env vars, the threads."""
    import torch

    out: dict[str, Any] = {"aten_capability": torch.backends.cpu.get_cpu_capability()}
    for k in CPU_ENV:
        out[k.lower()] = os.environ.get(k, "unset")
    out["torch_threads"] = torch.get_num_threads()
    return out


def git_commit(cwd: str | os.PathLike | None = None) -> str:
    """``git rev-parse HEAD`` (+ ``-dirty`` with uncommitted changes); ``unknown`` outside git."""
    for d in ([cwd] if cwd else []) + [os.getcwd(), Path(__file__).resolve().parent]:
        try:
            head = subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=d, capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            continue
        dirty = ""
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            status = subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=d,
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout
            dirty = "-dirty" if status.strip() else ""
        return head + dirty
    return "unknown"


def package_versions(names: Iterable[str] = PACKAGES) -> dict[str, str]:
    out = {}
    for n in names:
        try:
            out[n] = importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            out[n] = "not installed"
    return out


def find_config(exp: Path, config: Path | None) -> Path | None:
    """``config``, else ``<exp>/config.yaml``, the single ``<exp>/*.yaml``, or
    ``config/experiments/<exp name>.yaml`` under the working directory."""
    if config is not None:
        return config
    for name in ("config.yaml", "config.yml"):
        if (exp / name).is_file():
            return exp / name
    ymls = sorted(exp.glob("*.yaml")) + sorted(exp.glob("*.yml"))
    if len(ymls) == 1:
        return ymls[0]
    repo = Path("config") / "experiments" / f"{exp.name}.yaml"
    return repo if repo.is_file() else None


def find_bench_dir(exp: Path, bench_dir: str | os.PathLike | None) -> Path | None:
    """``bench_dir``, else ``<exp>/bench`` or ``<exp>/../bench`` when one exists."""
    if bench_dir is not None:
        return Path(bench_dir)
    return next((d for d in (exp / "bench", exp.parent / "bench") if d.is_dir()), None)
