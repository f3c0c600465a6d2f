"""Stage `zero3_qat`: QAT by ``compression.QAT.training_mode``: end-to-end (under DeepSpeed ZeRO-3
when the config says so) or blockwise (always one process).

    torchrun --standalone --nproc_per_node=2 scripts/qat.py -c config/experiments/tiny-qwen3-moe.yaml \
        --model-path results/base/tiny-qwen3-moe --from-ptq-ckpt results/tiny-qwen3-moe/ptq \
        --save-path results/tiny-qwen3-moe/qat

ZeRO-3 (``compression.QAT.hf_args.deepspeed`` with stage 3): every rank builds the model empty and
partitioned, rank 0 streams the weights and the PTQ scales in, the HF Trainer trains the scales
(LM + KD losses), and the consolidated checkpoint is saved by rank 0 (it loads without
DeepSpeed). Without DeepSpeed the same runs in one process (scales from the PTQ checkpoint, or
lazily calibrated on the first training samples). Blockwise (``training_mode: blockwise``) trains
decoder block by decoder block in one process (``python scripts/qat.py ...``, no torchrun);
``two_phase`` runs blockwise, then end-to-end from its result, in one process
(`qatlib.trainers.two_phase`; phase 1's records in ``blockwise_log.jsonl``).

``--save-path`` receives the QAT checkpoint (docs/design.md): the HF model folder, the scales +
``quant_scheme.json``, ``run_metadata.json``, ``train_log.jsonl`` and ``scale_load.json``. The
trainer's own output (checkpoints for resuming, its log) goes to ``--run-dir``.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import _common


def main(argv=None) -> int:
    ap = _common.parser(__doc__)
    ap.add_argument(
        "--from-ptq-ckpt", default=None, help="PTQ checkpoint (overrides compression.QAT.from_ptq_ckpt)"
    )
    ap.add_argument("--run-dir", default=None, help="the trainer's output_dir (default: <save-path>_run)")
    args = ap.parse_args(argv)
    extra = [f"compression.QAT.from_ptq_ckpt={json.dumps(args.from_ptq_ckpt)}"] if args.from_ptq_ckpt else []
    cfg = _common.load_experiment(args, extra)
    save = Path(cfg.global_.save_path)
    run_dir = Path(args.run_dir) if args.run_dir else save.with_name(save.name + "_run")
    mode = cfg.qat.training_mode
    if mode != "end2end" and cfg.zero3_enabled:
        ap.error(f"{mode} QAT runs in one process: remove the ZeRO-3 DeepSpeed config (hf_args.deepspeed)")
    from qatlib.data import DataError, check_samples_for_ranks
    from qatlib.resume import ResumeError, check_resume_world_size
    from qatlib.stage_run import rank, world_size

    try:  # before any model is loaded
        if (ds := cfg.dataset) is not None:
            check_samples_for_ranks(ds.num_samples, ds.data_path or "the training set", ds.num_samples)
        if cfg.qat.resume_ckpt_dir:
            check_resume_world_size(cfg.qat.resume_ckpt_dir, world_size())
    except (DataError, ResumeError) as e:
        ap.error(str(e))

    with _common.stage("zero3_qat", args) as record:
        from qatlib.checkpoint.layout import SCALE_LOAD_FILE
        from qatlib.data import training_data_from_config
        from qatlib.models import load_prepared, load_tokenizer, resolve_model_dir
        from qatlib.surgery.modeling import resolve_dtype
        from qatlib.trainers.modes import LOG_FILES, train
        from qatlib.zero3 import io as zero3_io
        from qatlib.zero3 import save as zero3_save

        ptq = cfg.qat.from_ptq_ckpt
        model_dir = resolve_model_dir(cfg.model.model_path, cache_dir=cfg.model.cache_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        scale_report = run_dir / SCALE_LOAD_FILE
        if cfg.zero3_enabled and rank() == 0:  # keys of the user's JSON that cost memory
            from qatlib.plan import run_warnings

            warns = run_warnings(cfg.raw, cfg.deepspeed_config, model_dir, world_size())
            for w in warns:
                print(f"warning: {cfg.deepspeed_config_path or 'hf_args.deepspeed'}: {w}", flush=True)
            record["plan_warnings"] = warns  # in the stage's timing record (what the plan could not size)
        # first: deepspeed.comm and the HF DeepSpeed config, before any TrainingArguments / model
        kw = dict(dtype=resolve_dtype(cfg.model.torch_dtype), timeout_s=cfg.global_.collective_timeout_s)
        ctx = zero3_io.init_zero3(cfg.deepspeed_config, **kw) if cfg.zero3_enabled else None
        with ctx or contextlib.nullcontext():  # ZeRO-3: barrier + process-group teardown at the end
            scheme = cfg.quant_scheme()
            model, _ = load_prepared(cfg, model_dir, scales=ptq, zero3=ctx, report_path=scale_report)
            tok = load_tokenizer(model_dir, trust_remote_code=cfg.model.trust_remote_code)
            data = training_data_from_config(cfg, tok)
            overrides = {"output_dir": str(run_dir)}
            if args.no_progress:
                overrides["disable_tqdm"] = True
            done = train(
                cfg,
                model,
                tok,
                data,
                run_dir=run_dir,
                scales_loaded=bool(ptq),
                args_overrides=overrides,
                scheme=scheme,
                zero3_ctx=ctx,
            )

            def add_files(tmp: Path) -> None:  # in the save's temporary folder: one atomic commit
                tok.save_pretrained(str(tmp))
                for name in (*LOG_FILES[cfg.qat.training_mode], SCALE_LOAD_FILE):
                    if (run_dir / name).is_file():
                        shutil.copyfile(run_dir / name, tmp / name)

            zero3_save.save_consolidated(model, save, scheme=scheme, add_files=add_files)
            if zero3_io.get_rank() == 0:
                record.update(done, samples=len(data), scheme=scheme.name, zero3=cfg.zero3_enabled)
                what = ", ".join(f"{v} {k}" for k, v in done.items())
                print(f"QAT checkpoint ({cfg.qat.training_mode}, {scheme.name}, {what}): {save}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
