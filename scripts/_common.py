"""What every stage script shares: config flags, threads, logging, progress, ``timings/<stage>.json``.

Config flags follow the upstream ``tools/run.py``: ``-c/--config`` (the experiment YAML),
``--model-path`` (overrides ``model.model_path``), ``--save-path`` (the stage's output folder),
plus ``--set dotted.key=value`` (repeatable, values read as YAML) for any other key; everything
is validated by `qatlib.config.load_config` before any work starts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence

log = logging.getLogger("qatlib.scripts")
_SET_HELP = "override a config key (dotted path, value read as YAML); repeatable"


def example(doc: str) -> str:
    """The script's example command: its docstring's first indented line (a ``\\`` line break in
    a docstring joins the lines), spaces collapsed."""
    return " ".join(next(ln for ln in doc.splitlines() if ln.startswith("    ") and ln.strip()).split())


def parser(
    doc: str, *, config: bool = True, model: bool = True, save: bool = True
) -> argparse.ArgumentParser:
    """An argument parser with the shared flags (run flags always; config flags on request):
    ``doc`` is the script's docstring, whose first line describes it and whose first indented
    block is the example ``--help`` shows."""
    ap = argparse.ArgumentParser(
        description=doc.splitlines()[0],
        epilog=f"example: {example(doc)}",
        formatter_class=argparse.RawDescriptionHelpFormatter,  # the example stays one line
    )
    if config:
        ap.add_argument("-c", "--config", required=True, help="experiment YAML (upstream AngelSlim layout)")
        ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V", help=_SET_HELP)
    if model:
        ap.add_argument("--model-path", default=None, help="model folder or hub id (sets model.model_path)")
    if save:
        ap.add_argument("--save-path", default=None, help="output folder (overrides global.save_path)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--timing", default=None, help="write {stage, wall_s, ...} JSON here when done")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    return ap


def load_experiment(args: argparse.Namespace, extra: Sequence[str] = ()):
    """The validated `ExperimentConfig` of ``args.config`` with ``--set``, ``--model-path``,
    ``--save-path`` and ``extra`` (``key=value`` strings) applied; exits with the config error."""
    from qatlib.config import ConfigError, load_config

    sets = list(args.overrides)
    if getattr(args, "model_path", None):
        sets.append(f"model.model_path={json.dumps(str(args.model_path))}")
    if getattr(args, "save_path", None):
        sets.append(f"global.save_path={json.dumps(str(args.save_path))}")
    sets += list(extra)
    try:
        return load_config(args.config, sets)
    except ConfigError as e:
        sys.exit(f"error: {e}")


def base_model_args(ap: argparse.ArgumentParser, what: str) -> None:
    """The options every base-model stage shares: which model (``--name``), and its definition
    (``--spec-json``, as the workflow passes it, else ``--base-models``' entry). ``what``: the
    definition's keys, for the help text."""
    ap.add_argument("--name", required=True, help="base model name (a key of --base-models)")
    ap.add_argument("--spec-json", default=None, help=f"the model's definition as JSON ({what})")
    ap.add_argument("--base-models", default="config/base_models.yaml", help="definitions of the base models")


def base_model_spec(ap: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """The base model's definition (`base_model_args`), after checking ``--save-path``; a missing
    name is a usage error naming the file."""
    if not args.save_path:
        ap.error("--save-path is required")
    if args.spec_json:
        return json.loads(args.spec_json)
    from qatlib.yamlio import load_yaml

    models = load_yaml(args.base_models)
    if args.name not in models:
        ap.error(f"no base model {args.name!r} in {args.base_models}")
    return models[args.name]


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def setup(args: argparse.Namespace) -> None:
    """Logging (rank-prefixed under torchrun), the rank's device, torch threads, progress bars on/off."""
    prefix = f"[rank {rank()}] " if world_size() > 1 else ""
    logging.basicConfig(
        level=logging.INFO if rank() == 0 else logging.WARNING,
        format=f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )
    if args.no_progress:
        os.environ["TQDM_DISABLE"] = "1"
    from qatlib import device

    dev = device.bind()  # this rank's GPU (LOCAL_RANK), before any model, tensor or collective
    log.info("device %s (backend %s)", dev.device, dev.backend)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)


@contextlib.contextmanager
def stage(name: str, args: argparse.Namespace) -> Iterator[dict]:
    """Run a stage: set up, time it, and (rank 0) write ``args.timing`` when it succeeds.

    Yields a dict whose entries are added to the timing record. A `CheckpointError` (a missing or
    unfit PTQ / QAT checkpoint) or a `CollectiveFailure` (a rank died or hung: it is named) ends the
    stage with its message."""
    from qatlib.checkpoint.layout import CheckpointError
    from qatlib.zero3.peers import CollectiveFailure

    setup(args)
    extra: dict = {}
    t0 = time.perf_counter()
    log.info("stage %s: start", name)
    try:
        yield extra
    except (CheckpointError, CollectiveFailure) as e:
        sys.exit(f"error: {e}")
    wall = time.perf_counter() - t0
    log.info("stage %s: done in %.1f s", name, wall)
    if args.timing and rank() == 0:
        import torch

        from qatlib.checkpoint.layout import write_json

        record = dict(stage=name, wall_s=round(wall, 3), world_size=world_size(), cpu_count=os.cpu_count())
        record.update(torch_threads=torch.get_num_threads(), **extra)
        write_json(args.timing, record, sort_keys=True)
