"""Evaluation: perplexity over fixed windows and lm-eval-harness glue (upstream or local tasks).

Importing this package does not import lm-eval (the harness imports it on first use).
"""

from .harness import UPSTREAM_TASKS, evaluate_tasks, flatten_results
from .perplexity import load_eval_text, make_windows, perplexity, perplexity_of_ids, tokenize_text
from .tasks import build_local_mc_task, make_mc_items

__all__ = [
    "UPSTREAM_TASKS",
    "build_local_mc_task",
    "evaluate_tasks",
    "flatten_results",
    "load_eval_text",
    "make_mc_items",
    "make_windows",
    "perplexity",
    "perplexity_of_ids",
    "tokenize_text",
]
