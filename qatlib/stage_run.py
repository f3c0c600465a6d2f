"""A stage as a process: what every stage CLI (``scripts/``) does around its work.

Why in the library and not beside the scripts: the timing record ``timings/<stage>.json``
(``{stage, wall_s, world_size, cpu_count, torch_threads, ...}``) is read by the report
(`qatlib.report.inputs`) and the results site (`qatlib.site.record`), so its writer is a contract
with one owner, here; and the rest (rank-prefixed logging, binding the rank's device before any
collective, which failures end a stage in one line) is the same for a stage driven from Python.
``scripts/_common.py`` keeps the argument parsing and turns the flags into these arguments.

It imports only `device`, `checkpoint` and `zero3.peers`, never the config: a stage that reads
no experiment config (the corpus, the base model) must not count the config code as its own (the
workflow's code inputs, ``workflow/lib/code_deps.py``, take a qatlib module whole).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator

import torch

from . import device
from .checkpoint.layout import CheckpointError, write_json
from .zero3.peers import CollectiveFailure

log = logging.getLogger("qatlib.scripts")  # the name the stage CLIs' lines have always carried


def rank() -> int:
    """This process's rank as the launcher set it (``RANK``; 0 without torchrun)."""
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    """The launcher's number of ranks (``WORLD_SIZE``; 1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


# The errors that end a stage with their message alone, no traceback: a `CheckpointError` (a
# missing or unfit PTQ / QAT checkpoint, the file named) and a `CollectiveFailure` (a rank died or
# hung, the rank named). The message is the whole diagnosis; any other error is a bug and keeps
# its traceback.
EXPECTED_FAILURES = (CheckpointError, CollectiveFailure)


def setup(*, threads: int | None = None, progress: bool = True) -> None:
    """Logging (rank-prefixed under torchrun), the rank's device, torch threads, progress bars on/off."""
    prefix = f"[rank {rank()}] " if world_size() > 1 else ""
    logging.basicConfig(
        level=logging.INFO if rank() == 0 else logging.WARNING,
        format=f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )
    if not progress:
        os.environ["TQDM_DISABLE"] = "1"
    dev = device.bind()  # this rank's GPU (LOCAL_RANK), before any model, tensor or collective
    log.info("device %s (backend %s)", dev.device, dev.backend)
    if threads:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def timed_stage(
    name: str, *, timing: str | None = None, threads: int | None = None, progress: bool = True
) -> Iterator[dict]:
    """Run stage ``name``: `setup`, time it, and (rank 0) write the timing record to ``timing``
    when it succeeds. Yields a dict whose entries are added to the record; an error propagates
    and writes no record."""
    setup(threads=threads, progress=progress)
    extra: dict = {}
    t0 = time.perf_counter()
    log.info("stage %s: start", name)
    yield extra
    wall = time.perf_counter() - t0
    log.info("stage %s: done in %.1f s", name, wall)
    if timing and rank() == 0:
        record = dict(stage=name, wall_s=round(wall, 3), world_size=world_size(), cpu_count=os.cpu_count())
        record.update(torch_threads=torch.get_num_threads(), **extra)
        write_json(timing, record, sort_keys=True)
