"""Stage `zero3_qat`: end-to-end QAT, under DeepSpeed ZeRO-3 when the config says so.

    torchrun --standalone --nproc_per_node=2 scripts/qat.py -c config/experiments/tiny-qwen3-moe.yaml \
        --model-path results/base/tiny-qwen3-moe --from-ptq-ckpt results/tiny-qwen3-moe/ptq \
        --save-path results/tiny-qwen3-moe/qat

ZeRO-3 (``compression.QAT.hf_args.deepspeed`` with stage 3): every rank builds the model empty and
partitioned, rank 0 streams the weights and the PTQ scales in, the HF Trainer trains the scales
(LM + KD losses), and the consolidated checkpoint is saved by rank 0 (it loads without
DeepSpeed). Without DeepSpeed the same runs in one process (scales from the PTQ checkpoint, or
lazily calibrated on the first training samples).

``--save-path`` receives the QAT checkpoint (docs/design.md): the HF model folder, the scales +
``quant_scheme.json``, ``run_metadata.json``, ``train_log.jsonl`` and ``scale_load.json``. The
Trainer's own output (checkpoints for resuming, its log) goes to ``--run-dir``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import _common


def main(argv=None) -> int:
    ap = _common.parser(__doc__.splitlines()[0])
    ap.add_argument(
        "--from-ptq-ckpt", default=None, help="PTQ checkpoint (overrides compression.QAT.from_ptq_ckpt)"
    )
    ap.add_argument("--run-dir", default=None, help="the Trainer's output_dir (default: <save-path>_run)")
    args = ap.parse_args(argv)
    extra = [f"compression.QAT.from_ptq_ckpt={json.dumps(args.from_ptq_ckpt)}"] if args.from_ptq_ckpt else []
    cfg = _common.load_experiment(args, extra)
    save = Path(cfg.global_.save_path)
    run_dir = Path(args.run_dir) if args.run_dir else save.with_name(save.name + "_run")
    if cfg.qat.training_mode != "end2end":
        ap.error(
            "this stage runs end-to-end QAT; blockwise training is `python -m qatlib.trainers.blockwise`"
        )

    with _common.stage("zero3_qat", args) as record:
        import torch

        from qatlib.data import load_training_data
        from qatlib.models import load_model, load_tokenizer
        from qatlib.trainers.end2end import LOG_FILE, train_end2end
        from qatlib.zero3_io import get_rank, save_consolidated

        scheme = cfg.quant_scheme()
        ptq = cfg.qat.from_ptq_ckpt
        model_dir = _common.resolve_model_dir(cfg.model.model_path, cache_dir=cfg.model.cache_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        scale_report = run_dir / "scale_load.json"
        common = dict(
            trust_remote_code=cfg.model.trust_remote_code, attn_implementation=cfg.model.attn_implementation
        )
        if cfg.zero3_enabled:
            from qatlib.zero3_io import build_qat_model, init_zero3

            # first: deepspeed.comm and the HF DeepSpeed config, before any TrainingArguments / model
            ctx = init_zero3(cfg.deepspeed_config, dtype=_common.torch_dtype(cfg))
            model = build_qat_model(
                model_dir,
                ctx,
                scheme,
                from_ptq_ckpt=ptq,
                ignore=cfg.ignore_layers,
                options=cfg.prepare_options(),
                scales_report_path=scale_report,
                **common,
            )
        else:
            from qatlib.quant import prepare
            from qatlib.zero3_io import stream_load_scales

            model = load_model(model_dir, torch_dtype=cfg.model.torch_dtype, **common)
            prepare(model, scheme, ignore=cfg.ignore_layers, options=cfg.prepare_options())
            if ptq:
                stream_load_scales(model, ptq, scheme, report_path=scale_report)
        tok = load_tokenizer(model_dir, trust_remote_code=cfg.model.trust_remote_code)
        ds = cfg.dataset
        data = load_training_data(
            cfg.qat.hf_dataset or ds.data_path,
            tok,
            ds.max_seq_length,
            ds.num_samples,
            hf_cache_dir=cfg.qat.hf_cache_dir,
        )
        overrides = {"output_dir": str(run_dir)}
        if args.no_progress:
            overrides["disable_tqdm"] = True
        trainer = train_end2end(
            cfg, model, tok, data, scales_loaded=bool(ptq), args_overrides=overrides, scheme=scheme
        )
        save_consolidated(model, save, scheme=scheme)
        if get_rank() == 0:
            tok.save_pretrained(str(save))
            for src, dst in ((run_dir / LOG_FILE, "train_log.jsonl"), (scale_report, "scale_load.json")):
                if src.is_file():
                    shutil.copyfile(src, save / dst)
            state = trainer.state
            record.update(
                steps=state.global_step, samples=len(data), scheme=scheme.name, zero3=cfg.zero3_enabled
            )
            print(f"QAT checkpoint ({scheme.name}, {state.global_step} steps): {save}")
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
