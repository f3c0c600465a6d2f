"""Stage `convert_export`: the QAT checkpoint -> a deployable checkpoint, by ``save_format``.

    python scripts/export.py -c config/experiments/tiny-qwen3-moe.yaml \
        --model-path results/tiny-qwen3-moe/qat --save-path results/tiny-qwen3-moe/export

``--model-path`` is the QAT checkpoint (an HF model folder with its scales beside the weights);
the model is rebuilt with the experiment's scheme, the trained scales are loaded
(`qatlib.models.load_prepared`; a quantizer without a trained value is an error), and
`qatlib.export.export` writes ``compression.QAT.save_format`` (default ``real``: compressed-tensors,
loadable by vLLM / SGLang / transformers).
Host memory: one decoder layer + one output shard at a time (`qatlib.plan.streamed`: the same
tensors as the in-memory export); ``--whole-model`` loads the model instead.
"""

from __future__ import annotations

import _common


def main(argv=None) -> int:
    ap = _common.parser(__doc__.splitlines()[0])
    ap.add_argument(
        "--save-format", default=None, help="overrides compression.QAT.save_format (default real)"
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
        ap.error("--model-path (the QAT checkpoint) is required")
    save_format = args.save_format or cfg.qat.save_format or "real"

    with _common.stage("convert_export", args) as record:
        from qatlib.export import export
        from qatlib.models import load_prepared, load_tokenizer
        from qatlib.plan import streamed

        scheme = cfg.quant_scheme()
        layerwise = streamed(cfg.raw, "convert_export") and not args.whole_model
        model, loaded = load_prepared(
            cfg, args.model_path, scales=args.model_path, complete=True, skeleton=layerwise
        )
        onload = None
        if layerwise:  # host memory: one layer + one output shard, never the model
            from qatlib.onload import Onloader

            onload = Onloader.from_checkpoint(model, args.model_path)
        tok = load_tokenizer(args.model_path, trust_remote_code=cfg.model.trust_remote_code)
        out = export(
            model,
            scheme,
            cfg.global_.save_path,
            save_format,
            tokenizer=tok,
            overwrite=args.overwrite,
            ignore=cfg.quantization.ignore_layers,
            onload=onload,
        )
        record.update(
            save_format=save_format, scheme=scheme.name, scales_loaded=loaded.get("hits"), streamed=layerwise
        )
        print(f"exported {scheme.name} ({save_format}): {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
