"""2-rank ZeRO-3 end-to-end QAT worker: zero3_io build + streamed load + PTQ scales -> QATTrainer
(HF Trainer + DeepSpeed) with LM + cakld distillation -> consolidated save.

Usage: torchrun --standalone --nproc_per_node=2 e2e_zero3.py SPEC.json

SPEC: {"out", "model", "ptq", "ds_config", "scheme", "data" (list of {"input_ids", "labels"}),
"steps", "lr", optional "eps" (Adam's), "weight_lr" (the linear weights train too; the KD teacher
is then the original model as an inference-only ZeRO-3 engine, `base_model_teacher`) with
"weight_update" (`qatlib.trainers.weight_units`), "save_steps", "crash_at" (raise after that optimizer step, on every rank:
a killed run; its state at that moment is first saved to ``{out}/at_kill``), "gradient_checkpointing" (+ "use_reentrant"), "moe" (a Qwen3-MoE model; "others_gathered"
in result.json: the most other experts of a block gathered while one is recomputed), "save_every_step" (the
consolidated save after each optimizer step k in ``{out}/steps/k``), "resume_from" (a checkpoint
directory) and "deploy" (a runtime whose merged scales are tied, `qatlib.runtime.tying`), "vocab_block_bytes" (QATTrainer's; "vocab_swapped" and "vocab_gathered" in
result.json: which embeddings it computed from the partitions, and whether DeepSpeed's fetch
gathered the embedding or head weights during training)}. Rank 0 writes ``{out}/result.json`` (log history, teacher forwards, trainable counts) and
the consolidated save ``{out}/saved``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

logging.basicConfig(
    level=logging.WARNING, format=f"[rank{os.environ.get('RANK', '?')}] %(name)s: %(message)s"
)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    from qatlib.zero3 import io as z
    from qatlib.zero3 import load as zl
    from qatlib.zero3 import save as zs

    ds_config = json.loads(Path(spec["ds_config"]).read_text())
    ctx = z.init_zero3(ds_config, timeout_s=120)  # before TrainingArguments (NOTES-platform)

    from transformers import TrainerCallback, TrainingArguments

    from qatlib import device
    from qatlib.data import PadCollator
    from qatlib.losses import LossConfig
    from qatlib.quant import PrepareOptions, QuantScheme, quantizers
    from qatlib.quant import functional as F
    from qatlib.trainers.end2end import QATTrainer
    from qatlib.trainers.params import Learnable

    # count calls of the compiled fake-quant, so the test sees the compiled path really ran
    compiled_calls = [0]
    real_compiled = F.compiled

    def counting_compiled(fn):
        compiled_calls[0] += 1
        return real_compiled(fn)

    F.compiled = counting_compiled
    scheme = QuantScheme.from_dict(spec["scheme"])
    from qatlib.runtime.tying import tie_for

    options = PrepareOptions(
        compile_fake_quant=bool(spec.get("compile", False)), deploy=tie_for(spec.get("deploy", "none"))
    )
    model = zl.build_qat_model(spec["model"], ctx, scheme, from_ptq_ckpt=spec["ptq"], options=options)
    assert z.model_is_zero3(model)
    assert all(q.compile_fake_quant == options.compile_fake_quant for _, q in quantizers(model))
    # forwards of the first decoder layer's attention: a checkpointed step runs it again in backward
    # (transformers checkpoints the layer's forward, so hooks on the layer itself run once)
    layer0_forwards = [0]
    attn0 = model.model.layers[0].self_attn
    attn0.register_forward_hook(lambda *a: layer0_forwards.__setitem__(0, layer0_forwards[0] + 1))
    # MoE: at each expert forward inside a backward (a recompute), how many OTHER experts of the
    # same block hold gathered weights; the largest seen is what the recompute keeps resident
    others_gathered = [0]
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from qatlib.surgery.moe import LinearizedMoeExperts

    def gathered(expert) -> bool:
        return expert.down_proj.weight.ds_status == ZeroParamStatus.AVAILABLE

    for block in (m for m in model.modules() if isinstance(m, LinearizedMoeExperts)):
        for ex in block:

            def probe(mod, _args, block=block):
                import torch

                if torch._C._current_graph_task_id() != -1:
                    n = sum(gathered(o) for o in block if o is not mod)
                    others_gathered[0] = max(others_gathered[0], n)

            ex.register_forward_pre_hook(probe)
    # DeepSpeed's fetch of a module's parameters goes through the first one's
    # ``all_gather_coalesced``: record, during the training steps, whether the vocabulary matrices were fetched
    vocab_ids = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    vocab_gathered, training = [False], [False]
    for p in model.parameters():

        def fetch(params, *a, _real=p.all_gather_coalesced, **k):
            if training[0] and any(id(q) in vocab_ids for q in params):
                vocab_gathered[0] = True
            return _real(params, *a, **k)

        p.all_gather_coalesced = fetch
    out = Path(spec["out"])
    args = TrainingArguments(
        output_dir=str(out / "trainer"),
        max_steps=spec["steps"],
        per_device_train_batch_size=1,
        gradient_accumulation_steps=spec.get("ga", 1),
        learning_rate=spec["lr"],
        adam_epsilon=spec.get("eps", 1e-8),
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="steps" if spec.get("save_steps") else "no",
        save_steps=spec.get("save_steps") or 500,
        max_grad_norm=0.0,
        report_to="none",
        use_cpu=device.use_cpu(),  # the rank's device: GPU LOCAL_RANK on CUDA, else the CPU
        disable_tqdm=True,
        deepspeed=ctx.ds_config,  # as qatlib resolved it (its leaf default where the JSON has none)
        gradient_checkpointing=bool(spec.get("gradient_checkpointing", False)),
        gradient_checkpointing_kwargs={"use_reentrant": bool(spec.get("use_reentrant", False))},
        train_sampling_strategy="sequential",
        seed=0,
    )

    class Crash(TrainerCallback):
        """Per-step saves (collective: every rank runs on_step_end) and the kill."""

        def on_step_begin(self, args, state, control, **kw):
            training[0] = True  # the step's forwards and backward (not the saves below)

        def on_step_end(self, args, state, control, **kw):
            training[0] = False
            if spec.get("save_every_step"):
                zs.save_consolidated(model, out / "steps" / str(state.global_step), scheme=scheme)
            if state.global_step == spec.get("crash_at"):
                zs.save_consolidated(model, out / "at_kill", scheme=scheme)
                raise SystemExit(f"killed at step {state.global_step}")

    learnable = Learnable(weight_scale=True, act_scale=True)
    pick = {"learnable": learnable}
    if spec.get("weight_lr"):
        from types import SimpleNamespace

        from qatlib.trainers.end2end import base_model_teacher
        from qatlib.trainers.params import select_trainable

        mcfg = SimpleNamespace(
            model_path=spec["model"], cache_dir=None, torch_dtype="float32", trust_remote_code=False
        )
        pick = {
            "trainable": select_trainable(model, learnable, weights=True),
            "weight_lr": spec["weight_lr"],
            "weight_update": spec.get("weight_update", "additive"),
            "teacher": base_model_teacher(SimpleNamespace(model=mcfg), ctx),
        }
    if "vocab_block_bytes" in spec:
        pick["vocab_block_bytes"] = spec["vocab_block_bytes"]
    trainer = QATTrainer(
        model,
        args,
        loss_config=LossConfig(loss_type="cakld", lm_loss_weight=1.0, kd_loss_weight=1.0),
        **pick,
        train_dataset=spec["data"],
        data_collator=PadCollator(0),
        callbacks=[Crash()],
    )
    trainer.train(resume_from_checkpoint=spec.get("resume_from"))
    saved = zs.save_consolidated(model, out / "saved", scheme=scheme)
    rank = z.get_rank()
    if spec.get("weight_lr"):  # the teacher after training, on the first sample (a collective forward)
        import torch

        with torch.no_grad():
            x = torch.tensor([spec["data"][0]["input_ids"]], device=device.current())
            t_logits = trainer.teacher(input_ids=x).logits.cpu()
        if rank == 0:
            torch.save(t_logits, out / "teacher_logits.pt")
    if rank == 0:
        assert saved is not None
        (out / "result.json").write_text(
            json.dumps(
                {
                    "log_history": trainer.state.log_history,
                    "teacher_forwards": trainer.teacher_forwards,
                    "trainable": trainer.trainable.counts(),
                    "world": z.get_world_size(),
                    "compiled_calls": compiled_calls[0],
                    "layer0_forwards": layer0_forwards[0],
                    "others_gathered": others_gathered[0],
                    "vocab_swapped": trainer.vocab.swapped,
                    "vocab_gathered": vocab_gathered[0],
                    "checkpointing": bool(getattr(model, "is_gradient_checkpointing", False)),
                    "teacher": type(trainer.teacher).__name__,
                    "groups": [g.get("name") for g in trainer.optimizer.param_groups],
                    "teacher_partitioned": trainer.teacher is not None
                    and all(hasattr(p, "ds_id") for p in trainer.teacher.parameters()),
                }
            )
        )
    ctx.close()  # stops the heartbeat, barrier, process-group teardown
    print(f"[rank{rank}] WORKER OK", flush=True)


if __name__ == "__main__":
    main()
