"""Stage `ptq_calibrate`: PTQ calibration -> the PTQ checkpoint QAT warm-starts from.

    python scripts/ptq.py -c config/experiments/tiny-qwen3-moe.yaml \
        --model-path results/base/tiny-qwen3-moe --save-path results/tiny-qwen3-moe/ptq

Weight scales are set from the weights (round-to-nearest), or by GPTQ for upstream's
``int4_gptq`` (layer by layer; the updated weights are saved with the scales); static activation
scales (input, q / k / v outputs) are calibrated on the experiment's ``dataset`` (``num_samples``
samples of ``max_seq_length`` tokens, ``batch_size`` per forward; ``compression.QAT.hf_dataset``
wins over ``dataset.data_path``). Round-to-nearest weight-only and dynamic-activation schemes
read no data.
Host memory: one decoder layer at a time, read from the shards, wherever `qatlib.plan.streamed`
says the streamed calibration gives the same scales (all but GPTQ and a static input scale on the
head); ``--whole-model`` loads the model instead.
"""

from __future__ import annotations

import _common


def main(argv=None) -> int:
    ap = _common.parser(__doc__.splitlines()[0])
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --save-path")
    ap.add_argument(
        "--whole-model",
        action="store_true",
        help="load the whole model instead of streaming one decoder layer at a time (the default "
        "wherever qatlib.plan.streamed says the streamed PTQ writes the same scales)",
    )
    args = ap.parse_args(argv)
    cfg = _common.load_experiment(args)
    if cfg.dataset is None and not cfg.qat.hf_dataset:
        ap.error(
            f"{args.config}: PTQ calibrates on `dataset` (or compression.QAT.hf_dataset); neither is set"
        )

    with _common.stage("ptq_calibrate", args) as record:
        from torch.utils.data import DataLoader

        from qatlib import device
        from qatlib.data import PadCollator, load_training_data
        from qatlib.models import load_model, load_tokenizer, resolve_model_dir
        from qatlib.plan import streamed
        from qatlib.ptq import calibrate, save_ptq_checkpoint

        scheme = cfg.quant_scheme()
        model_dir = resolve_model_dir(cfg.model.model_path, cache_dir=cfg.model.cache_dir)
        gptq = cfg.ptq_algorithm == "gptq"
        # The one owner of the choice (the plan and the DAG's resources model the same): streamed
        # unless GPTQ (it changes the weights) or a static input scale on the head; upstream's
        # `low_memory` asks for what is already the default.
        layerwise = streamed(cfg.raw, "ptq_calibrate") and not args.whole_model
        m = cfg.model
        common = dict(
            torch_dtype=m.torch_dtype,
            trust_remote_code=m.trust_remote_code,
            attn_implementation=m.attn_implementation,
        )
        device_map = device.device_map(m.device_map)
        model = None if layerwise else load_model(model_dir, device_map=device_map, **common)
        tok = load_tokenizer(model_dir, trust_remote_code=cfg.model.trust_remote_code)
        # Weight scales come from the weights; only static activation scales need calibration data.
        static_act = [
            r for r in ("input", "q", "k", "v") if (sp := getattr(scheme, r)) is not None and not sp.dynamic
        ]
        batches = []
        if static_act or gptq:
            ds_cfg = cfg.dataset
            source = cfg.qat.hf_dataset or (ds_cfg.data_path if ds_cfg else None)
            if not source:
                raise SystemExit(
                    f"error: {args.config}: {scheme.name} ({cfg.ptq_algorithm}) needs calibration data "
                    "(dataset.data_path or compression.QAT.hf_dataset)"
                )
            data = load_training_data(
                source,
                tok,
                ds_cfg.max_seq_length if ds_cfg else 2048,
                ds_cfg.num_samples if ds_cfg else 128,
                hf_cache_dir=cfg.qat.hf_cache_dir,
            )
            loader = DataLoader(
                data, batch_size=ds_cfg.batch_size if ds_cfg else 1, collate_fn=PadCollator.for_tokenizer(tok)
            )
            from tqdm.auto import tqdm

            batches = tqdm(loader, desc="PTQ calibration", disable=args.no_progress, mininterval=2.0)
        else:
            print(f"{scheme.name}: no static activation scale, weight scales need no calibration data")
        if gptq:
            from qatlib.gptq import gptq as run_gptq

            # latent: the saved weights are the ones GPTQ rounded (the same PTQ model; QAT's start)
            report = run_gptq(
                model, scheme, batches, ignore=cfg.ignore_layers, options=cfg.prepare_options(), latent=True
            )
        elif layerwise:  # the model is never loaded: its layers are streamed from the shards
            from qatlib.checkpoint.layout import CheckpointError
            from qatlib.ptq import calibrate_from_checkpoint

            try:
                model, report, scales = calibrate_from_checkpoint(
                    model_dir, scheme, batches, device=device.current(), ignore=cfg.ignore_layers,
                    options=cfg.prepare_options(), **common,
                )  # fmt: skip
            except CheckpointError as e:
                # The streamed reader maps the shards' keys one to one onto the model's names; a
                # checkpoint whose keys transformers renames while loading (its conversion mapping,
                # e.g. HunYuan v3's router / shared_mlp) is read whole, as --whole-model would.
                print(
                    f"warning: {model_dir}: not streamed ({str(e).splitlines()[0]}); loading the whole model"
                )
                layerwise = False
                model = load_model(model_dir, device_map=device_map, **common)
        if not gptq and not layerwise:
            report = calibrate(
                model, scheme, batches, ignore=cfg.ignore_layers, options=cfg.prepare_options()
            )
        save_ptq_checkpoint(
            model,
            scheme,
            cfg.global_.save_path,
            calibration=report,
            save_weights=gptq,
            tokenizer=tok,
            overwrite=args.overwrite,
            scales=scales if layerwise else None,
        )
        record.update(
            scheme=scheme.name, batches=report.num_batches, tokens=report.num_tokens, streamed=layerwise
        )
        print(f"PTQ checkpoint ({scheme.name}): {cfg.global_.save_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
