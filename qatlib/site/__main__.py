"""``python -m qatlib.site [--check] | record [EXP_DIR] | screenshot``: the documentation's generated parts.

python -m qatlib.site                  # rewrite the generated blocks of README.md and docs/
python -m qatlib.site --check          # exit 1 naming each stale block (tests/test_site.py)
python -m qatlib.site record results/smollm2-135m   # -> results/bench/default_experiment.json
python -m qatlib.site screenshot       # results/smollm2-135m/report.html -> docs/img/report.png
"""

from __future__ import annotations

import argparse
import sys

from . import REPO, generate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m qatlib.site",
        description=__doc__.splitlines()[0].split(": ", 1)[1],
        epilog="\n".join(__doc__.splitlines()[2:]) + "\nexample: python -m qatlib.site --check",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when a block is stale")
    ap.add_argument("--only", metavar="PATH", help="only the blocks of files whose path contains PATH")
    sub = ap.add_subparsers(dest="command")
    rec = sub.add_parser("record", help="copy a finished default DAG's figures into results/bench/")
    rec.add_argument("exp_dir", nargs="?", default="results/smollm2-135m")
    rec.add_argument("--out", default="results/bench")
    shot = sub.add_parser("screenshot", help="render the report to a PNG with headless Chromium")
    shot.add_argument("--report", default="results/smollm2-135m/report.html")
    shot.add_argument("--out", default="docs/img/report.png")
    args = ap.parse_args(argv)

    if args.command == "record":
        from .record import RecordError, record

        try:
            print(f"wrote {record(args.exp_dir, args.out)}")
        except RecordError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    if args.command == "screenshot":
        from .screenshot import screenshot

        try:
            print(f"wrote {screenshot(args.report, args.out)}")
        except (FileNotFoundError, RuntimeError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    stale = generate(REPO, write=not args.check, only=args.only)
    for t in stale:
        verb = "stale" if args.check else "rewrote"
        print(f"{verb}: {t.path} (block {t.block})")
    if args.check and stale:
        print("run: python -m qatlib.site", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
