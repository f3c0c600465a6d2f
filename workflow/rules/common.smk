# Wildcards, resources and input functions of the rules. They stand on workflow/lib/ (plain
# Python, tests/test_workflow_lib.py): experiment.py (the effective experiment, each stage's
# `params.config` = what re-runs it, paths, `--set` arguments) and code_deps.py (a stage's code
# inputs: its script and what that imports). The experiment YAML itself is not an input.

import json
import re
import shlex
import sys
import time

from snakemake.exceptions import WorkflowError

# the repository root first: its qatlib (qatlib.yamlio and the torch-free qatlib.plan are imported) and workflow/lib
sys.path.insert(0, workflow.basedir)

from qatlib.yamlio import load_yaml
from workflow.lib import experiment as xp
from workflow.lib.code_deps import stage_code
from workflow.lib.launch import LaunchError, QatLaunch, pin_cpu_arithmetic

# the same CPU kernels for every job, whatever CPU runs it (workflow/lib/launch.py says why)
pin_cpu_arithmetic()

RESULTS = config["results"]
EXP = config["experiment"]
VARIANTS = config["variants"]
# The engine-served evaluations of serve_evaluate, eval/<name>.json, and the export each serves
SERVED_EXPORTS = {"served": "export", "served_ptq": "export-ptq"}
STARTED_AT = time.time()
EXPERIMENTS = xp.Experiments(
    REPO,
    RESULTS,
    config["experiments_dir"],
    EXP,
    config.get("overrides"),
    # absolute: the working directory may be elsewhere (--directory)
    os.path.join(workflow.basedir, "workflow/schemas/experiment.schema.json"),
    error=WorkflowError,
)


wildcard_constraints:
    exp=r"[A-Za-z0-9][A-Za-z0-9._-]*",
    name=r"[A-Za-z0-9][A-Za-z0-9._-]*",
    task=r"[A-Za-z0-9_]+",
    variant="|".join(re.escape(v) for v in VARIANTS),
    served="|".join(SERVED_EXPORTS),


def report_html(exp):
    return f"{RESULTS}/{exp}/report.html"


def companions(exp):
    """The experiments `snakemake` builds beside `exp` (config.yaml companions; none: no companion)."""
    table = config.get("companions")
    return table.get(exp, []) if isinstance(table, dict) else []


def code(script):
    """The `code` input of a rule: scripts/<script> (first) and the repository code it imports."""
    return stage_code(REPO, script)


# ----------------------------------------------------------------------------- resources
def mem_mb(stage):
    """Host RAM (MB) of a rule's job: the memory plan's for the model stages (workflow/lib/
    experiment.py `resources`: qatlib.plan from the model's config.json), else config.yaml's.
    """
    if stage not in xp.PLANNED:
        return config["mem_mb"].get(stage, 4000)
    return lambda wc: EXPERIMENTS.resources(wc.exp, stage, config)["mem_mb"]


def runtime(stage, default=240):
    """Wall-clock minutes of a rule's job: the memory plan's estimate (x2 margin), else `default`."""
    return lambda wc: EXPERIMENTS.resources(wc.exp, stage, config).get(
        "runtime", default
    )


def gpus(n=1):
    """GPUs a job asks for: `n` GPUs when config["gpus"] is on, else none (CPU run)."""
    return n if config["gpus"] else 0


def progress_flag():
    return "" if config["progress"] else "--no-progress"


def qat_launch(wc):
    """How the QAT job starts its ranks (workflow/lib/launch.py): python, torchrun --standalone on
    one node, or srun + torchrun with c10d rendezvous over config["nodes"] nodes."""
    try:
        return QatLaunch.from_config(config, EXPERIMENTS.distributed(wc.exp))
    except LaunchError as e:
        raise WorkflowError(str(e)) from None


def qat_procs(wc):
    """(processes, threads each) of the QAT job on one node."""
    launch = qat_launch(wc)
    return launch.procs_per_node, launch.threads_per_rank


def qat_launcher(wc):
    """The launcher before scripts/qat.py (each rank's BLAS pool pinned to its threads)."""
    return qat_launch(wc).command()


def qat_resource(name, default=0):
    """One Slurm resource of the QAT job (nodes, tasks, cpus_per_task, gres, mpi)."""
    return lambda wc: qat_launch(wc).resources().get(name, default)


def announce_reports():
    """Say where the reports are: the last lines of a successful `snakemake`."""
    fresh = sorted(
        str(p)
        for p in Path(RESULTS).glob("*/report.html")
        if p.stat().st_mtime >= STARTED_AT
    )
    default = report_html(EXP)
    if not fresh and Path(default).is_file():
        fresh = [default]
    for html in fresh:
        print(f"\nReport: {html}  (self-contained HTML: open it in a browser)")
