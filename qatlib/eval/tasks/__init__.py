"""Local lm-eval tasks built from held-out text (the offline stand-ins for upstream benchmarks)."""

from .local_mc import build_local_mc_task, make_mc_items, task_yaml

__all__ = ["build_local_mc_task", "make_mc_items", "task_yaml"]
