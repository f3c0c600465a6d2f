"""Stage `convert_export`: the QAT checkpoint -> a deployable checkpoint, by ``save_format``.

    python scripts/export.py -c config/experiments/tiny-qwen3-moe.yaml \
        --model-path results/tiny-qwen3-moe/qat --save-path results/tiny-qwen3-moe/export

``--model-path`` is the QAT checkpoint (an HF model folder with its scales beside the weights);
the model is rebuilt with the experiment's scheme, the trained scales are loaded, and
`qatlib.export.export` writes ``compression.QAT.save_format`` (default ``real``: compressed-tensors,
loadable by vLLM / SGLang / transformers).
"""

from __future__ import annotations

import _common


def main(argv=None) -> int:
    ap = _common.parser(__doc__.splitlines()[0])
    ap.add_argument(
        "--save-format", default=None, help="overrides compression.QAT.save_format (default real)"
    )
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --save-path")
    args = ap.parse_args(argv)
    cfg = _common.load_experiment(args)
    if not args.model_path:
        ap.error("--model-path (the QAT checkpoint) is required")
    save_format = args.save_format or cfg.qat.save_format or "real"

    with _common.stage("convert_export", args) as record:
        from qatlib.export import export
        from qatlib.models import load_model, load_tokenizer
        from qatlib.quant import prepare
        from qatlib.zero3_io import stream_load_scales

        scheme = cfg.quant_scheme()
        model = load_model(
            args.model_path,
            torch_dtype=cfg.model.torch_dtype,
            trust_remote_code=cfg.model.trust_remote_code,
            attn_implementation=cfg.model.attn_implementation,
        )
        prepare(model, scheme, ignore=cfg.ignore_layers, options=cfg.prepare_options())
        loaded = stream_load_scales(model, args.model_path, scheme)
        if loaded.get("misses"):
            raise SystemExit(
                f"error: {args.model_path}: {loaded['misses']} quantizer parameters have no "
                "trained value in the QAT checkpoint; refusing to export init values"
            )
        tok = load_tokenizer(args.model_path, trust_remote_code=cfg.model.trust_remote_code)
        out = export(
            model,
            scheme,
            cfg.global_.save_path,
            save_format,
            tokenizer=tok,
            overwrite=args.overwrite,
            ignore=cfg.quantization.ignore_layers,
        )
        record.update(save_format=save_format, scheme=scheme.name, scales_loaded=loaded.get("hits"))
        print(f"exported {scheme.name} ({save_format}): {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
