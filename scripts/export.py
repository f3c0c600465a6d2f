"""Stage `convert_export`: the QAT checkpoint -> a deployable checkpoint, by ``save_format``.

    python scripts/export.py -c config/experiments/tiny-qwen3-moe.yaml \
        --model-path results/tiny-qwen3-moe/qat --save-path results/tiny-qwen3-moe/export

``--model-path`` is the QAT checkpoint (an HF model folder with its scales beside the weights);
the model is rebuilt with the experiment's scheme, the trained scales are loaded
(`qatlib.models.load_prepared`; a quantizer without a trained value is an error), and
`qatlib.export.export` writes ``compression.QAT.save_format`` (default ``real``: compressed-tensors,
loadable by vLLM / SGLang / transformers).
Host memory: one decoder layer + one output tensor at a time (`qatlib.plan.streamed`: the same
tensors as the in-memory export); ``--whole-model`` loads the model instead. The stage is
`qatlib.pipeline.run_export`.
"""

from __future__ import annotations

import _common


def main(argv=None) -> int:
    ap = _common.parser(__doc__)
    ap.add_argument(
        "--save-format", default=None, help="overrides compression.QAT.save_format (default real)"
    )
    ap.add_argument(
        "--scales",
        default=None,
        help="deploy this checkpoint's scales instead of --model-path's own (the PTQ checkpoint on the base "
        "model: the workflow's export_ptq)",
    )
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --save-path")
    ap.add_argument(
        "--whole-model",
        action="store_true",
        help="load the whole model instead of streaming one decoder layer at a time and writing shard "
        "by shard (the default: the same tensors, qatlib.plan.streamed)",
    )
    args = ap.parse_args(argv)
    cfg = _common.load_experiment(args)
    if not args.model_path:
        ap.error("--model-path (the QAT checkpoint, or with --scales the base model) is required")

    with _common.stage("convert_export", args) as record:
        from qatlib.pipeline import run_export

        kw = dict(save_format=args.save_format, whole_model=args.whole_model, overwrite=args.overwrite)
        kw["scales"] = args.scales
        record.update(run_export(cfg, args.model_path, **kw))
        print(f"exported {record['scheme']} ({record['save_format']}): {record.pop('out')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
