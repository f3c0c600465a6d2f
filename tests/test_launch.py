"""workflow/lib/launch.py: the zero3_qat launch and Slurm resources of a real 8-GPU node and a
2 x 8-GPU job, the CPU run, and the rendered Snakemake job (dry run, shell command printed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from workflow.lib.launch import FIRST_NODE, LaunchError, QatLaunch, shell_words  # noqa: E402

BASE = {"ranks": 2, "threads_per_rank": 1, "threads": 2, "nodes": 1, "gpus_per_node": 0}


def launch(distributed=True, **kw) -> QatLaunch:
    return QatLaunch.from_config({**BASE, **kw}, distributed)


def test_one_8_gpu_node_is_torchrun_standalone_with_8_ranks():
    la = launch(gpus_per_node=8, threads_per_rank=8)
    assert la.world_size == 8
    words = shell_words(la.command())
    assert words == [
        "OMP_NUM_THREADS=8",
        "MKL_NUM_THREADS=8",
        "torchrun",
        "--standalone",
        "--nproc_per_node=8",
    ]
    assert la.resources() == {"nodes": 1, "tasks": 1, "cpus_per_task": 64, "gres": "gpu:8"}


def test_two_8_gpu_nodes_are_srun_one_torchrun_per_node_with_c10d_rendezvous():
    la = launch(gpus_per_node=8, nodes=2, threads_per_rank=8)
    assert la.world_size == 16
    cmd = la.command()
    words = shell_words(cmd)
    assert words[2:8] == [
        "srun",
        "--nodes=2",
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        "torchrun",
    ]
    flags = words[8:]
    assert "--standalone" not in flags
    assert flags[:3] == ["--nnodes=2", "--nproc_per_node=8", "--rdzv_backend=c10d"]
    assert flags[3] == f"--rdzv_endpoint={FIRST_NODE.replace(chr(34), '')}:29500"  # shlex drops the quotes
    assert flags[4] == "--rdzv_id=$SLURM_JOB_ID"
    # the endpoint is evaluated inside the job by the shell: the first host of the allocation
    assert '$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in cmd
    assert la.resources() == {"nodes": 2, "tasks": 2, "cpus_per_task": 64, "gres": "gpu:8", "mpi": "srun"}


def test_cpu_run_keeps_ranks_and_one_process_stays_python():
    la = launch()
    assert la.command() == "OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2"
    assert la.resources() == {"nodes": 1, "tasks": 1, "cpus_per_task": 2}
    one = launch(distributed=False, threads=4)
    assert (one.command(), one.world_size, one.resources()["cpus_per_task"]) == ("python", 1, 4)


@pytest.mark.parametrize(
    "kw, distributed, match",
    [
        ({"nodes": 2}, True, "nodes=2 with gpus_per_node=0"),
        ({"nodes": 2, "gpus_per_node": 8}, False, "nodes=2, but this experiment's QAT runs in one process"),
        ({"nodes": 0}, True, "nodes=0"),
        ({"gpus_per_node": -1}, True, "gpus_per_node=-1"),
    ],
)
def test_impossible_launches_name_the_key(kw, distributed, match):
    with pytest.raises(LaunchError, match=match):
        launch(distributed, **kw)


SNAKEMAKE = [sys.executable, "-m", "snakemake"]


def _dry_qat(tmp_path, *config) -> str:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [*SNAKEMAKE, "-s", str(REPO / "Snakefile"), "--directory", str(tmp_path), "-n", "-p"]
    cmd += ["results/tiny-qwen3-moe/qat", "--config", *config]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout + out.stderr


@pytest.mark.parametrize("nodes", [1, 2])
def test_snakemake_renders_the_8_gpu_and_2x8_gpu_qat_job(tmp_path, nodes):
    """The job Snakemake hands to Slurm (dry run): its resources and its exact launcher."""
    pytest.importorskip("snakemake")
    out = _dry_qat(tmp_path, "gpus=1", "gpus_per_node=8", "threads_per_rank=8", f"nodes={nodes}")
    job = out[out.index("rule zero3_qat:") :]
    res = next(line for line in job.splitlines() if line.strip().startswith("resources:"))
    expected = QatLaunch.from_config(
        {**BASE, "gpus_per_node": 8, "threads_per_rank": 8, "nodes": nodes}, True
    )
    for k, v in expected.resources().items():
        assert f"{k}={v}" in res, (k, res)
    if nodes == 1:
        assert "mpi=srun" not in res  # the executor's own srun wraps the one torchrun
    shell = next(line for line in job.splitlines() if line.startswith("Shell command:"))
    assert shell.removeprefix("Shell command: ").startswith(expected.command() + " ")
    assert "scripts/qat.py -c" in shell
