"""What the 2-rank error workers share: run each failure case on every rank, catch its error.

Imported by the sibling workers (torchrun puts a script's folder first on ``sys.path``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def run_cases(
    cases: dict[str, Callable[[], object]],
    error: type[Exception],
    say: Callable[[str], None] | None = None,
) -> dict:
    """``{name: {"error": message or None, "seconds": wall}}`` for each case, run in order. Every
    rank runs every case and meets a barrier after it: a case whose error ended one rank but left
    the other waiting would hang here (the test's timeout), not pass."""
    results = {}
    for name, fn in cases.items():
        t0 = time.perf_counter()
        try:
            fn()
            results[name] = {"error": None}
        except error as e:
            results[name] = {"error": str(e)}
            if say is not None:
                say(f"CASE {name}: {str(e).splitlines()[0]}")
        results[name]["seconds"] = round(time.perf_counter() - t0, 3)
        torch.distributed.barrier()  # still in step after the error
    return results
