"""The results page's table of contents: which renderer draws each benchmark JSON, under which
title, in which order (`RENDERERS`), and the two generated blocks made from them (`render_page`:
docs/results.md; `render_readme`: the README's table). The renderers live in `qatlib.site.results`
(the workflow and quality benchmarks), `qatlib.site.served` (vLLM's engine) and `qatlib.site.speed`
(what a QAT step costs)."""

from __future__ import annotations

from collections.abc import Callable

from .families import body as families
from .families import body_headline as families_headline
from .results import (
    Result,
    default_experiment,
    default_experiment_headline,
    moe_experiment,
    moe_experiment_headline,
    nvfp4_two_phase_headline,
    plan_rehearsal,
    plan_rehearsal_headline,
    provenance,
    quality_default,
    quality_default_headline,
    quality_formats,
    quality_formats_headline,
    quality_low_bits,
    quality_low_bits_headline,
    quality_w4a4,
    quality_w4a4_headline,
    run_cell,
    targets,
    targets_headline,
)
from .served import serve_moe, serve_moe_headline, serve_speed, serve_speed_headline, served, served_headline
from .speed import speed, speed_headline

TITLES = {
    "default_experiment": "The default experiment",
    "plan_rehearsal": "Memory plan vs measured (real-width rehearsal)",
    "quality_default": "Quality at a fixed QAT budget (default model)",
    "quality_fp4": "4-bit floats: qatlib's and upstream FOCUS's recipes (default model)",
    "quality_low_bits": "3- and 2-bit weights (default model)",
    "quality_w4a4": "W4A4 4-bit floats at the issue's budget (default model)",
    "quality_w4a4_two_phase": "W4A4 4-bit floats: the two-phase recipe (default model)",
    "quality_w4a4_smooth": "W4A4 4-bit floats: SmoothQuant, then the two-phase recipe (default model)",
    "moe_experiment": "The upcycled real-weight MoE, whole DAG",
    "nvfp4_two_phase_experiment": "NVFP4 W4A4: the end-to-end and two-phase recipes, whole DAG (default model)",
    "served": "Served by vLLM's engine, per format (default DAG)",
    "serve_moe": "The upcycled MoE's architecture through vLLM-CPU's fused-MoE path",
    "serve_speed": "What deployment buys: tokens/s and memory in vLLM's engine",
    "speed": "What QAT costs: the training step against a plain step and the machine's limit",
    "families": "Every model family: PTQ -> ZeRO-3 QAT -> export -> vLLM's load",
    "zero3_load_moe": "A hub-layout MoE checkpoint (Mixtral's keys) under the streamed ZeRO-3 load",
}
RENDERERS: dict[str, tuple[Callable[[Result], list[str]], Callable[[Result], tuple[str, str]]]] = {
    "default_experiment": (default_experiment, default_experiment_headline),
    "plan_rehearsal": (plan_rehearsal, plan_rehearsal_headline),
    "quality_default": (quality_default, quality_default_headline),
    "quality_fp4": (quality_formats, quality_formats_headline),
    "quality_low_bits": (quality_low_bits, quality_low_bits_headline),
    "quality_w4a4": (quality_w4a4, quality_w4a4_headline),
    "quality_w4a4_two_phase": (quality_w4a4, quality_w4a4_headline),
    "quality_w4a4_smooth": (quality_w4a4, quality_w4a4_headline),
    "moe_experiment": (moe_experiment, moe_experiment_headline),
    "nvfp4_two_phase_experiment": (moe_experiment, nvfp4_two_phase_headline),
    "served": (served, served_headline),
    "serve_moe": (serve_moe, serve_moe_headline),
    "serve_speed": (serve_speed, serve_speed_headline),
    "speed": (speed, speed_headline),
    "families": (families, families_headline),
}
ORDER = tuple(RENDERERS)


def _sorted(results: list[Result]) -> list[Result]:
    rank = {n: i for i, n in enumerate(ORDER)}
    return sorted(results, key=lambda r: (rank.get(r.name, len(rank)), r.name))


def render_page(results: list[Result]) -> str:
    """The body of docs/results.md: one section per JSON."""
    if not results:
        return "No result JSON under `results/bench/` yet."
    lines: list[str] = []
    for r in _sorted(results):
        body, _ = RENDERERS.get(r.name, (targets, targets_headline))
        lines += [f"## {TITLES.get(r.name, f'Benchmark `{r.name}`')}", "", *provenance(r), "", *body(r), ""]
    return "\n".join(lines).rstrip("\n")


def render_readme(results: list[Result]) -> str:
    """The README's one results table: the headline of each JSON, with its run."""
    lines = ["| result | figures | run (date, commit, CPU) |", "|---|---|---|"]
    for r in _sorted(results):
        _, head = RENDERERS.get(r.name, (targets, targets_headline))
        what, figures = head(r)
        lines.append(f"| {what} | {figures} | {run_cell(r)} |")
    return "\n".join(lines)
