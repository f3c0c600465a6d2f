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
head); ``--whole-model`` loads the model instead. Upstream's ``low_memory: true`` asks for that
streaming: where it is impossible the stage refuses before any work, naming why. The stage is
`qatlib.pipeline.run_ptq`.
"""

from __future__ import annotations

import _common


def main(argv=None) -> int:
    ap = _common.parser(__doc__)
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
        from qatlib.pipeline import StageInputError, run_ptq

        try:
            kw = dict(whole_model=args.whole_model, overwrite=args.overwrite, progress=not args.no_progress)
            record.update(run_ptq(cfg, **kw))
        except StageInputError as e:
            raise SystemExit(f"error: {e}") from None
        print(f"PTQ checkpoint ({record['scheme']}): {cfg.global_.save_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
