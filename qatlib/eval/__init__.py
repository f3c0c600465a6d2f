"""Evaluation: perplexity over fixed windows and lm-eval-harness glue (upstream or local tasks).

Local task folders (the offline stand-in for the upstream suite) are built by
`qatlib.offline.mc_task`; evaluation only reads them.

Importing this package does not import lm-eval (the harness imports it on first use).
"""

from .harness import UPSTREAM_TASKS, evaluate_tasks, flatten_results
from .perplexity import load_eval_text, make_windows, perplexity, perplexity_of_ids, tokenize_text

__all__ = [
    "UPSTREAM_TASKS",
    "evaluate_tasks",
    "flatten_results",
    "load_eval_text",
    "make_windows",
    "perplexity",
    "perplexity_of_ids",
    "tokenize_text",
]
