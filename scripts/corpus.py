"""Stage `corpus`: the offline English corpus (train / calib / test splits, manifest).

    python scripts/corpus.py --out-dir results/corpus --config-json '{"packages": ["numpy"]}'

The corpus is docstrings and docs of installed packages (`qatlib.offline.corpus`): no download.
"""

from __future__ import annotations

import json

import _common


def main(argv=None) -> int:
    ap = _common.parser(__doc__, config=False, model=False, save=False)
    ap.add_argument("--out-dir", required=True, help="corpus folder (train.txt, calib.txt, test.txt, ...)")
    ap.add_argument("--config-json", default="{}", help="the `corpus` section of config/config.yaml, as JSON")
    ap.add_argument("--workers", type=int, default=None, help="processes parsing source files")
    args = ap.parse_args(argv)
    cfg = json.loads(args.config_json)

    from qatlib.offline.corpus import build_corpus

    with _common.stage("corpus", args) as record:
        manifest = build_corpus(args.out_dir, workers=args.workers, progress=not args.no_progress, **cfg)
        for split, info in manifest["splits"].items():
            print(f"{split}: {info['documents']} documents, {info['words']} words")
        record["content_hash"] = manifest["content_hash"]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
