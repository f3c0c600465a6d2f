"""lm-eval-harness glue: evaluate an in-memory model (plain or fake-quantized) on tasks.

Real runs use the upstream zero-shot suite (`UPSTREAM_TASKS`, data from the hub). Offline runs
use local task folders (built by `qatlib.offline.mc_task.build_local_mc_task`) loaded with
``TaskManager(include_path=..., include_defaults=False)`` (scanning lm-eval's thousands of
built-in YAMLs is skipped when only local tasks are asked for).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from ..scores import flatten_results, split_tasks

UPSTREAM_TASKS = ("piqa", "arc_easy", "arc_challenge", "hellaswag", "winogrande")

__all__ = ["UPSTREAM_TASKS", "evaluate_tasks", "flatten_results", "split_tasks"]


def set_hf_home(hf_home: str | Path) -> None:
    """Point the HF caches (the json loader writes Arrow files) into a project folder, also when
    ``datasets`` is already imported."""
    home = Path(hf_home).resolve()
    home.mkdir(parents=True, exist_ok=True)
    os.environ["HF_HOME"] = str(home)
    os.environ["HF_DATASETS_CACHE"] = str(home / "datasets")
    import sys

    cfg = sys.modules.get("datasets.config")
    if cfg is not None:
        cfg.HF_DATASETS_CACHE = home / "datasets"


def evaluate_tasks(
    model,
    tokenizer,
    tasks: Sequence[str],
    *,
    num_fewshot: int | None = 0,
    limit: int | float | None = None,
    batch_size: int | str = 1,
    include_path: str | Path | Sequence[str | Path] | None = None,
    include_defaults: bool | None = None,
    hf_home: str | Path | None = None,
    output_path: str | Path | None = None,
    max_length: int | None = None,
    seed: int = 1234,
) -> dict[str, dict[str, float]]:
    """Run ``tasks`` through ``lm_eval.simple_evaluate`` on ``model`` (an in-memory HF model).

    ``include_path``: folder(s) of local task YAMLs. ``include_defaults``: also index lm-eval's
    built-in tasks (default: only when no ``include_path`` is given). ``hf_home``: HF cache
    folder for this run. ``output_path``: where the full lm-eval result is JSON-dumped
    (``default=str``: the config holds a torch dtype). Returns `flatten_results` of it.
    """
    if hf_home is not None:
        set_hf_home(hf_home)
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    if include_defaults is None:
        include_defaults = include_path is None
    if isinstance(include_path, (str, Path)):
        include_path = str(include_path)
    elif include_path is not None:
        include_path = [str(p) for p in include_path]
    tm = TaskManager(include_path=include_path, include_defaults=include_defaults)
    device = next(model.parameters()).device
    lm = HFLM(
        pretrained=model,
        tokenizer=tokenizer,
        batch_size=batch_size,
        max_length=max_length,
        device=str(device),
    )
    was_training = model.training
    model.eval()
    try:
        out = simple_evaluate(
            model=lm,
            tasks=list(tasks),
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=tm,
            log_samples=False,
            bootstrap_iters=1000,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
        )
    finally:
        model.train(was_training)
    if out is None:  # non-zero rank under accelerate
        return {}
    if output_path is not None:
        p = Path(output_path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(out, indent=2, default=str) + "\n")
    return flatten_results(out["results"])
