"""``python -m qatlib.config CONFIG [--set k=v]`` | ``python -m qatlib.config --schema OUT.json``.

Validates an experiment YAML (prints its resolved `QuantScheme` and whether ZeRO-3 is on; exit
status 1 with ``FILE: dotted.path: message`` lines otherwise) and/or writes the JSON schema that
Snakemake validates against (``workflow/schemas/experiment.schema.json``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import ConfigError, config_json_schema, load_config


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m qatlib.config",
        description="check an experiment config",
        epilog="example: python -m qatlib.config config/experiments/smollm2-135m.yaml --set dataset.num_samples=64",
        formatter_class=argparse.RawDescriptionHelpFormatter,  # the example stays one line
    )
    ap.add_argument("config", nargs="?", help="experiment YAML to validate")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--schema", metavar="OUT.json", help="write the JSON schema of the config layout")
    args = ap.parse_args(argv)
    if not args.schema and not args.config:
        ap.error("give a CONFIG to validate and/or --schema OUT.json")
    if args.schema:
        out = Path(args.schema)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(config_json_schema(), indent=2) + "\n")
    if args.config:
        try:
            cfg = load_config(args.config, args.overrides)
        except ConfigError as e:
            print(e, file=sys.stderr)
            return 1
        print(
            json.dumps({"quant_scheme": cfg.quant_scheme().to_dict(), "zero3": cfg.zero3_enabled}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
