"""Stage `report`: the self-contained HTML report of one experiment (+ DVC metrics.json, plots/).

    python scripts/report.py -c config/experiments/tiny-qwen3-moe.yaml \
        --exp-dir results/tiny-qwen3-moe --out results/tiny-qwen3-moe/report.html

Writes the effective experiment config (the YAML with every ``--set``, as validated) to
``--config-out`` (default ``<exp-dir>/config.yaml``) and shows it in the report. Timings of the
shared stages (``--shared-timings``: corpus, local tasks, base model) join the report's wall-time
table so it covers the whole DAG.
"""

from __future__ import annotations

from pathlib import Path

import _common


def main(argv=None) -> int:
    ap = _common.parser(__doc__.splitlines()[0], save=False, model=False)
    ap.add_argument("--exp-dir", required=True, help="results/<exp>")
    ap.add_argument("--out", default=None, help="report HTML (default <exp-dir>/report.html)")
    ap.add_argument(
        "--config-out", default=None, help="effective config YAML (default <exp-dir>/config.yaml)"
    )
    ap.add_argument("--shared-timings", nargs="*", default=[], help="timing JSONs of shared stages")
    ap.add_argument("--title", default=None)
    args = ap.parse_args(argv)
    cfg = _common.load_experiment(args)
    exp = Path(args.exp_dir)
    out = Path(args.out or exp / "report.html")
    config_out = Path(args.config_out or exp / "config.yaml")
    missing = [t for t in args.shared_timings if not Path(t).is_file()]
    if missing:  # before anything is written
        ap.error(f"--shared-timings: not found: {', '.join(missing)}")

    with _common.stage("report", args):
        import yaml

        from qatlib.report import ReportError, build_report

        effective = cfg.model_dump(mode="json", by_alias=True, exclude_unset=True)
        header = f"# Effective config of {exp.name}: {args.config}" + "".join(
            f"\n#   --set {s}" for s in args.overrides
        )
        config_out.parent.mkdir(parents=True, exist_ok=True)
        config_out.write_text(header + "\n" + yaml.safe_dump(effective, sort_keys=False))
        try:
            build_report(exp, out, title=args.title, config=config_out, extra_timings=args.shared_timings)
        except ReportError as e:
            raise SystemExit(f"error: {e}") from None
        print(f"report: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
