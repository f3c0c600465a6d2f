"""How the `zero3_qat` job starts its ranks, and what it asks the cluster for (plain Python, used by
workflow/rules/common.smk and qat.smk; tests/test_launch.py renders the 1 x 8 and 2 x 8 GPU jobs).

Three shapes, one decision (`QatLaunch.from_config`):

- one process (blockwise QAT, or no ZeRO-3): ``python``;
- one node: ``torchrun --standalone --nproc_per_node=<ranks per node>`` (rendezvous on localhost);
- several nodes (``nodes > 1``): ``srun`` starts ONE torchrun per node, and the torchruns meet via
  c10d rendezvous on the first node of the allocation (``--rdzv_backend=c10d
  --rdzv_endpoint=<first node>:<port> --rdzv_id=$SLURM_JOB_ID``), each starting ``gpus_per_node``
  ranks. The Snakemake rule then carries the ``mpi`` resource, which tells the Slurm executor's
  job step not to wrap the command in its own one-task ``srun``: ours starts the tasks.

Ranks per node are the GPUs per node on a GPU cluster (``gpus_per_node``; each rank binds
``cuda:LOCAL_RANK``, `qatlib.device`), else config ``ranks`` CPU processes (gloo).

Every stage's CPU kernels are pinned here too (`pin_cpu_arithmetic`, called once by the Snakefile
before any job starts; jobs inherit its environment): torch picks its ATen kernels (AVX-512 or
AVX2), MKL its GEMM code path and oneDNN its ISA from the CPU it runs on, and each choice changes
the last bits of a matmul. Measured on this repository's CI CPU (docs/reliability.md, Reproducibility): 20
pre-training steps give the same bytes twice and with ``ATEN_CPU_CAPABILITY=avx2`` (what torch
detects there), other bytes with ``default`` or with another ``MKL_CBWR`` branch. Pinning every
x86 machine to the AVX2 kernels (present on every x86 CPU since 2013) makes the choice the same
on all of them; the threads per job are already fixed by config ``threads`` / ``threads_per_rank``
(Snakemake exports them as ``OMP_NUM_THREADS``).

oneDNN's ISA (``ONEDNN_MAX_CPU_ISA``) is NOT pinned: torch runs no fp32 op of these models through
oneDNN (forward + backward of a tiny Qwen3 and Qwen3-MoE and an lm_head-shaped GEMM give the same
bytes with it at AVX2, at AVX512_CORE_AMX and unset, 1 and 2 threads), while bf16 / fp16 GEMMs
go through oneDNN, whose AVX2 path has no bf16 kernel: a bf16 ``32 x 15,193 @ 15,193 x 2,048``
took 12.4 s pinned vs 0.05 s unpinned on an AMX Xeon (250 x). That pin stalled the bf16
real-width rehearsal's ZeRO-3 step (issue #16: the lm_head backward, minutes per GEMM).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import shlex
from collections.abc import Mapping
from typing import Any

RDZV_PORT = 29500
# the first host of the Slurm allocation, evaluated inside the job (c10d rendezvous endpoint)
FIRST_NODE = '$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'


# The kernel choice of every stage on x86 (a value the user exported already wins); not oneDNN's
# (module docstring: it is on no fp32 path, and its AVX2 pin makes bf16 GEMMs 250 x slower).
CPU_ARITHMETIC_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2"}


def pin_cpu_arithmetic(environ: dict | None = None, machine: str | None = None) -> dict[str, str]:
    """Set `CPU_ARITHMETIC_ENV` in ``environ`` (default ``os.environ``) where unset, on x86-64 only
    (ATen and MKL pick other kernels on ARM; nothing to pin there). Returns what it set."""
    environ = os.environ if environ is None else environ
    if (machine or platform.machine()).lower() not in ("x86_64", "amd64"):
        return {}
    added = {k: v for k, v in CPU_ARITHMETIC_ENV.items() if k not in environ}
    environ.update(added)
    return added


class LaunchError(ValueError):
    """A launch setting that cannot run (names the config key)."""


@dataclasses.dataclass(frozen=True)
class QatLaunch:
    distributed: bool  # several processes (end-to-end ZeRO-3) or one
    nodes: int
    procs_per_node: int
    threads_per_rank: int
    gpus_per_node: int  # 0: CPU ranks (gloo)
    port: int = RDZV_PORT

    @classmethod
    def from_config(cls, config: Mapping[str, Any], distributed: bool) -> QatLaunch:
        """The launch of the QAT job from the Snakemake config (``nodes``, ``gpus_per_node``,
        ``ranks``, ``threads_per_rank``, ``threads``) and whether the experiment is distributed."""
        nodes = int(config.get("nodes", 1))
        gpn = int(config.get("gpus_per_node", 0))
        if nodes < 1:
            raise LaunchError(f"config nodes={nodes}: must be >= 1")
        if gpn < 0:
            raise LaunchError(f"config gpus_per_node={gpn}: must be >= 0 (0 = CPU ranks)")
        if not distributed:
            if nodes > 1:
                raise LaunchError(
                    f"config nodes={nodes}, but this experiment's QAT runs in one process (blockwise, or "
                    "no ZeRO-3 DeepSpeed config): set nodes: 1"
                )
            return cls(False, 1, 1, int(config.get("threads", 1)), min(gpn, 1))
        if nodes > 1 and gpn == 0:
            raise LaunchError(
                f"config nodes={nodes} with gpus_per_node=0: multi-node QAT runs one rank per GPU; set gpus_per_node"
            )
        per_node = gpn if gpn else int(config["ranks"])
        return cls(True, nodes, per_node, int(config["threads_per_rank"]), gpn)

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1

    def threads_per_node(self) -> int:
        return self.procs_per_node * self.threads_per_rank

    def command(self) -> str:
        """The launcher the rule's shell puts before ``scripts/qat.py ...``."""
        if not self.distributed:
            return "python"
        n = self.threads_per_rank
        env = f"OMP_NUM_THREADS={n} MKL_NUM_THREADS={n}"
        if not self.multi_node:
            return f"{env} torchrun --standalone --nproc_per_node={self.procs_per_node}"
        srun = f"srun --nodes={self.nodes} --ntasks={self.nodes} --ntasks-per-node=1 --kill-on-bad-exit=1"
        rdzv = (
            f"--nnodes={self.nodes} --nproc_per_node={self.procs_per_node} --rdzv_backend=c10d "
            f'--rdzv_endpoint="{FIRST_NODE}:{self.port}" --rdzv_id="$SLURM_JOB_ID"'
        )
        return f"{env} {srun} torchrun {rdzv}"

    def resources(self) -> dict[str, Any]:
        """The Snakemake resources of the job (snakemake-executor-plugin-slurm names): nodes,
        tasks, cpus per task, GPUs per node as ``gres`` (per node under Slurm, unlike a job-wide
        ``--gpus``), and ``mpi`` for the multi-node job (the rule's srun starts the tasks)."""
        res: dict[str, Any] = {
            "nodes": self.nodes,
            "tasks": self.nodes,  # one torchrun per node; it starts the ranks
            "cpus_per_task": self.threads_per_node(),
        }
        if self.gpus_per_node:
            res["gres"] = f"gpu:{self.gpus_per_node}"
        if self.multi_node:
            res["mpi"] = "srun"
        return res

    def describe(self) -> str:
        dev = f"{self.gpus_per_node} GPU(s)" if self.gpus_per_node else f"{self.procs_per_node} CPU rank(s)"
        return f"{self.nodes} node(s) x {dev}, world size {self.world_size}"


def shell_words(cmd: str) -> list[str]:
    """``cmd`` split as a POSIX shell would (the test checks flags one by one)."""
    return shlex.split(cmd)
