"""What counts as a score in an evaluation result (``results/<exp>/eval/<variant>.json``,
docs/design.md), and its ``not_applied`` record: the one definition, shared by its writers (the
in-process harness `qatlib.eval.harness` and the engine-served one `qatlib.serve.tasks`, both through
`flatten_results` and `split_tasks`) and its reader (`qatlib.report`, which also reads files written
before the harness filtered), so that none imports another. Imports nothing but the standard library.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any


def window_perplexity(window_nll_sums: Sequence[float], window_tokens: Sequence[int]) -> tuple[float, float]:
    """``(nll, ppl)`` of scored windows: ``nll`` the mean NLL per predicted token over all windows
    (the windows' NLL sums added in order, over their token counts), ``ppl = exp(nll)``. The one
    definition of a perplexity figure, shared by the in-process evaluation
    (`qatlib.eval.perplexity`, where a window of n tokens scores tokens 1..n-1) and the engine's
    (`qatlib.serve`), so a served and an emulated column are the same quantity."""
    nll = sum(window_nll_sums) / sum(window_tokens)
    return nll, math.exp(nll)


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


EXPERT_INPUTS_UNQUANTIZED = (
    "transformers fuses an MoE layer's experts into one module on load, which compressed-tensors' "
    "Linear targets do not reach: the experts' input scales load into nothing and the experts run "
    "unquantized inputs (their weights are dequantized from the checkpoint). vLLM quantizes them "
    "(one scale per layer, the max over experts): the deployed column is what it computes"
)


def not_applied(unexpected: Iterable[str]) -> dict[str, Any] | None:
    """An evaluation result's ``not_applied`` (written by `qatlib.eval.variants` for the ``export``
    variant, read by the report and the results page): what the reload left out, from transformers' ``unexpected_keys``:
    ``{"tensors": n, "by_kind": {suffix: n}, "examples": [...], "why": ...}``, or None when every
    checkpoint tensor was used. Why recorded: an export row that is better than the deployed one
    for this reason (an FP8 MoE: experts' inputs left unquantized) must say so, or a reader takes
    transformers' number for the runtime's."""
    keys = sorted(unexpected)
    if not keys:
        return None
    by_kind: dict[str, int] = {}
    for k in keys:
        kind = k.rsplit(".", 1)[-1]
        by_kind[kind] = by_kind.get(kind, 0) + 1
    experts_inputs = all(".experts." in k and k.endswith(".input_scale") for k in keys)
    why = (
        EXPERT_INPUTS_UNQUANTIZED
        if experts_inputs
        else "checkpoint tensors transformers loaded into no parameter: the export variant runs without them"
    )
    return {"tensors": len(keys), "by_kind": by_kind, "examples": keys[:3], "why": why}


def not_applied_sentence(variant: str, record: Mapping[str, Any]) -> str:
    """The one sentence the report and the results page print for a `not_applied` record."""
    kinds = ", ".join(f"{n} {k}" for k, n in (record.get("by_kind") or {}).items())
    return f"{variant}: transformers left {record.get('tensors')} checkpoint tensors unused ({kinds}): {record.get('why')}."


def paired_diff_se(a: Any, b: Any) -> float | None:
    """Standard error of ``mean(a - b)`` over paired windows (``<metric>_windows`` of two variants
    scored on the same windows, e.g. next-token top-1); None unless both are lists of the same
    length >= 2. Paired, because the windows differ far more from each other (one is code, one
    prose) than two variants differ on one window: BF16 vs int4 PTQ top-1 on SmolLM2, 16 windows,
    0.042 apart with unpaired errors 0.020 / 0.021 but a paired error of 0.006."""
    if not isinstance(a, (list, tuple)) or not isinstance(b, (list, tuple)) or len(a) != len(b) or len(a) < 2:
        return None
    d = [float(x) - float(y) for x, y in zip(a, b)]
    m = sum(d) / len(d)
    return math.sqrt(sum((x - m) ** 2 for x in d) / (len(d) - 1) / len(d))


def split_tasks(tasks: Sequence[str]) -> tuple[list[str], list[str], list[str]]:
    """``(task names, include paths, hub task names)`` of ``evaluation.tasks``: a local task folder
    (``<dir>/<name>.yaml``, e.g. the corpus rule's multiple-choice task) gives its name and its
    folder to include; anything else is an lm-eval task name. A folder without its YAML is a
    ValueError naming it."""
    names, include, hub = [], [], []
    for t in tasks:
        p = Path(t)
        if p.is_dir():
            if not (p / f"{p.name}.yaml").is_file():
                raise ValueError(
                    f"evaluation.tasks: {p} has no {p.name}.yaml (a local task folder is named after its task)"
                )
            names.append(p.name)
            include.append(str(p))
        else:
            names.append(t)
            hub.append(t)
    return names, include, hub


def flatten_results(results: dict) -> dict[str, dict[str, float]]:
    """``{task: {acc, acc_stderr, acc_norm, acc_norm_stderr, ...}}`` from lm-eval's ``results``
    (the ``,none`` filter suffix dropped; non-numeric entries such as ``alias`` and bookkeeping
    such as ``sample_len`` skipped: `qatlib.scores.is_score`)."""
    flat: dict[str, dict[str, float]] = {}
    for task, metrics in results.items():
        row = {}
        for key, value in metrics.items():
            if not is_score(key, value):
                continue
            metric, _, filt = key.partition(",")
            name = metric if filt in ("", "none") else f"{metric},{filt}"
            row[name] = float(value)
        flat[task] = row
    return flat
