"""Stage `upcycle_model`: a Qwen3-MoE upcycled from a dense base model's pretrained weights.

    python scripts/upcycle_model.py --name smollm2-moe --source results/base/smollm2-135m \
        --corpus results/corpus --save-path results/base/smollm2-moe [--spec-json '{"upcycle": {...}}']

The experts are the dense MLP's neurons split (or copied), the router is initialised from
calibration data and trained on the corpus by distillation with everything else frozen, for the
token budget of its config/base_models.yaml entry (`qatlib.offline.upcycle`). Writes the hub
folder, its tokenizer and upcycle_stats.json (dense and upcycled test perplexity).
"""

from __future__ import annotations

import json

import _common


def main(argv=None) -> int:
    ap = _common.parser(__doc__, config=False, model=False)
    _common.base_model_args(ap, "{upcycle: {...}}")
    ap.add_argument(
        "--source", required=True, help="the dense model's folder (results/base/<upcycle.source>)"
    )
    ap.add_argument("--corpus", required=True, help="corpus folder (train.txt, calib.txt, test.txt)")
    args = ap.parse_args(argv)
    spec = _common.base_model_spec(ap, args)
    if sorted(spec) != ["upcycle"]:
        ap.error(f"base model {args.name!r}: expected exactly the key 'upcycle', got {sorted(spec)}")

    from qatlib.offline.upcycle import UpcycleSpec, upcycle

    try:
        up = UpcycleSpec.from_dict(spec["upcycle"], where=f"{args.base_models}: {args.name}.upcycle")
    except (TypeError, ValueError) as e:
        ap.error(str(e))
    with _common.stage("upcycle_model", args) as record:
        stats = upcycle(args.source, args.save_path, up, args.corpus, progress=not args.no_progress)
        summary = {
            "dense_ppl": stats["dense"]["ppl"],
            "initial_ppl": stats["initial"]["ppl"],
            "upcycled_ppl": stats["upcycled"]["ppl"],
            "ppl_ratio": stats["ppl_ratio"],
            "router_steps": stats["router_training"]["steps"],
            "params": stats["params"]["moe"],
        }
        print(json.dumps(summary, indent=2))
        record.update(name=args.name, **summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
