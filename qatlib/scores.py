"""What counts as a score in an evaluation result (``results/<exp>/eval/<variant>.json``,
docs/design.md): the one definition, shared by its writer (`qatlib.eval.harness.flatten_results`)
and its reader (`qatlib.report`, which also reads files written before the harness filtered), so
that neither imports the other. Imports nothing.
"""

from __future__ import annotations

from typing import Any

# lm-eval bookkeeping that sits among a task's metrics (numbers, but not scores).
NON_METRICS = frozenset({"sample_len", "sample_count", "samples"})


def is_score(key: str, value: Any) -> bool:
    """A task-result entry that is a number (not a bool) and not bookkeeping; ``key`` is
    ``metric`` or lm-eval's ``metric,filter``. Standard errors (``acc_stderr``) count."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and key.partition(",")[0] not in NON_METRICS
    )
