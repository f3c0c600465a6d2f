"""Stage `report`: the self-contained HTML report of one experiment (+ DVC metrics.json, plots/).

    python scripts/report.py -c config/experiments/tiny-qwen3-moe.yaml \
        --exp-dir results/tiny-qwen3-moe --out results/tiny-qwen3-moe/report.html

Writes the effective experiment config (the YAML with every ``--set``, as validated) to
``--config-out`` (default ``<exp-dir>/config.yaml``) and shows it in the report. Timings of the
shared stages (``--shared-timings``: corpus, local tasks, base model) join the report's wall-time
table so it covers the whole DAG. A missing input is an error (exit status 2) before anything is
written.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import _common


def _products(cfg) -> dict:
    """The inputs made outside the experiment folder, for the report's content hashes."""
    data = cfg.dataset.data_path
    return {
        "corpus": Path(data).parent if data else None,
        "tokenizer": cfg.model.model_path,
        "base_model": cfg.model.model_path,
    }


def _local(path) -> Path | None:
    """``path`` when it is on this machine (a hub id is not: the report downloads nothing)."""
    return Path(path) if path and Path(path).exists() else None


def main(argv=None) -> int:
    ap = _common.parser(__doc__, save=False, model=False)
    ap.add_argument("--exp-dir", required=True, help="results/<exp>")
    ap.add_argument("--out", default=None, help="report HTML (default <exp-dir>/report.html)")
    ap.add_argument(
        "--config-out", default=None, help="effective config YAML (default <exp-dir>/config.yaml)"
    )
    ap.add_argument("--shared-timings", nargs="*", default=[], help="timing JSONs of shared stages")
    ap.add_argument("--title", default=None)
    ap.add_argument("--bench-dir", default=None, help="benchmark *.json (default <exp-dir>/../bench)")
    ap.add_argument(
        "--base-weights",
        default=None,
        help="the BF16 weights of the SQNR computed without analysis/sqnr.csv (default: model.model_path, if local)",
    )
    args = ap.parse_args(argv)
    cfg = _common.load_experiment(args)
    exp = Path(args.exp_dir)
    out = Path(args.out or exp / "report.html")
    config_out = Path(args.config_out or exp / "config.yaml")

    from qatlib.report import ReportError, build_report
    from qatlib.report.inputs import require_files

    try:  # before anything is written (build_report checks it again: the API's own contract)
        require_files(args.shared_timings, "--shared-timings: timing file(s)")
    except ReportError as e:
        ap.error(str(e))

    with _common.stage("report", args):
        import yaml

        effective = cfg.model_dump(mode="json", by_alias=True, exclude_unset=True)
        header = f"# Effective config of {exp.name}: {args.config}" + "".join(
            f"\n#   --set {s}" for s in args.overrides
        )
        # the YAML's leading comment says what the experiment is for: keep it in the report
        lines = Path(args.config).read_text(encoding="utf-8").splitlines()
        intro = list(itertools.takewhile(lambda ln: ln.startswith("#"), lines))
        header += "".join(f"\n{ln}" for ln in intro)
        config_out.parent.mkdir(parents=True, exist_ok=True)
        config_out.write_text(header + "\n" + yaml.safe_dump(effective, sort_keys=False))
        try:
            build_report(
                exp,
                out,
                title=args.title,
                bench_dir=args.bench_dir,
                config=config_out,
                base_weights=args.base_weights or _local(cfg.model.model_path),
                extra_timings=args.shared_timings,
                products=_products(cfg),
            )
        except ReportError as e:
            ap.exit(2, f"error: {e}\n")
        print(f"report: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
