"""What every stage script shares: its flags, and turning them into the library's arguments.

Config flags follow the upstream ``tools/run.py``: ``-c/--config`` (the experiment YAML),
``--model-path`` (overrides ``model.model_path``), ``--save-path`` (the stage's output folder),
plus ``--set dotted.key=value`` (repeatable, values read as YAML) for any other key; everything
is validated by `qatlib.config.load_config` before any work starts. The run flags
(``--threads``, ``--timing``, ``--no-progress``) go to `qatlib.stage_run`, which owns what a stage
does as a process (logging, device, ``timings/<stage>.json``, one-line failures).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator, Sequence

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


@contextlib.contextmanager
def stage(name: str, args: argparse.Namespace) -> Iterator[dict]:
    """`qatlib.stage_run.timed_stage` with the run flags (``--timing``, ``--threads``,
    ``--no-progress``); an expected failure (`qatlib.stage_run.EXPECTED_FAILURES`: an unfit
    checkpoint, a dead rank) exits with its message. Yields the timing record's extra entries."""
    from qatlib.stage_run import EXPECTED_FAILURES, timed_stage

    kw = dict(timing=args.timing, threads=args.threads, progress=not args.no_progress)
    try:
        with timed_stage(name, **kw) as extra:
            yield extra
    except EXPECTED_FAILURES as e:
        sys.exit(f"error: {e}")
