"""Stage `base_model`: pre-train a tiny base model (and its tokenizer) on the offline corpus.

    python scripts/base_model.py --name tiny-qwen3-moe --corpus results/corpus \
        --save-path results/base/tiny-qwen3-moe [--spec-json '{"model": {...}, "train": {...}}']

Without --spec-json the definition is read from config/base_models.yaml (--base-models).
"""

from __future__ import annotations

import json

import _common


def main(argv=None) -> int:
    ap = _common.parser(__doc__, config=False, model=False)
    _common.base_model_args(ap, "model / train")
    ap.add_argument("--corpus", required=True, help="corpus folder (train.txt, test.txt)")
    args = ap.parse_args(argv)
    spec = _common.base_model_spec(ap, args)
    unknown = sorted(set(spec) - {"model", "train", "random"})
    if unknown:
        ap.error(f"base model {args.name!r}: unknown keys {unknown} (expected model, train or random)")
    if "random" in spec:  # a random-weight model at a real model's width (no training)
        from qatlib.offline.width_model import write_random_model

        r = dict(spec["random"])
        with _common.stage("base_model", args) as record:
            stats = write_random_model(
                r.pop("config"),
                args.save_path,
                corpus_dir=args.corpus,
                num_hidden_layers=r.pop("num_hidden_layers"),
                **r,
            )
            print(json.dumps(stats, indent=2))
            record.update(name=args.name, **stats)
        return 0

    from qatlib.offline.base_model import pretrain

    with _common.stage("base_model", args) as record:
        train = dict(spec.get("train") or {})
        if args.threads:
            train.setdefault("num_threads", args.threads)
        stats = pretrain(
            args.corpus, args.save_path, model=spec.get("model"), train=train, progress=not args.no_progress
        )
        summary = {k: stats.get(k) for k in ("steps", "tokens", "final_loss", "tokens_per_second")}
        if "test" in stats:
            summary["test_ppl"] = stats["test"]["ppl"]
        print(json.dumps(summary, indent=2))
        record.update(name=args.name, **summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
