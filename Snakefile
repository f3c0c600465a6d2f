# The QAT workflow: corpus -> base_model -> ptq_calibrate -> zero3_qat -> convert_export
#                    -> evaluate (bf16 / ptq / qat / export / deployed) + serve_evaluate (vLLM's
#                       engine, .venv-serve; --config serve=false skips it) + sqnr -> report
#
#   snakemake                                   # the default experiment (profiles/default sets cores)
#   snakemake results/qwen3-30b/report.html     # any config/experiments/<exp>.yaml
#   snakemake -n results/tiny-qwen3/report.html # dry run: what would run, and why
#
# config/config.yaml: how the workflow runs (ranks, threads, resources); params.yaml: which
# experiment, plus DVC's overrides of it; config/experiments/<exp>.yaml: the experiment itself
# (upstream AngelSlim layout, validated against workflow/schemas/experiment.schema.json, the
# schema `python -m qatlib.config --schema` exports). One thin script per stage in scripts/.
# Paths in config files are relative to this repository; results/ to the working directory.

import os
from pathlib import Path

from snakemake.utils import min_version, validate

min_version("9.0")

# The repository root, relative to the working directory (".", unless --directory moves it).
REPO = Path(os.path.relpath(workflow.basedir))


configfile: str(REPO / "config/config.yaml")
configfile: str(REPO / "params.yaml")


validate(config, os.path.join(workflow.basedir, "workflow/schemas/config.schema.yaml"))


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/inputs.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/ptq.smk"
include: "workflow/rules/qat.smk"
include: "workflow/rules/export.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/report.smk"


rule all:
    default_target: True
    input:
        report_html(EXP),
        [report_html(c) for c in companions(EXP)],
    localrule: True


onsuccess:
    announce_reports()
