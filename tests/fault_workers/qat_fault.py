"""2-rank ZeRO-3 QAT worker for tests/test_faults.py: a few QAT steps and a consolidated save, with
faults reached through test hooks (never timing luck).

Usage: torchrun --standalone --nproc_per_node=2 qat_fault.py SPEC.json

SPEC: {"out", "model", "ptq", "ds_config", "scheme", "data" (list of {"input_ids", "labels"}),
"steps", "timeout_s"} and optional:
- "pause": {"rank", "step", "file"}: that rank, in the forward of step ``step`` (a pre-hook on the
  second decoder layer, so it is mid-step and its peer is inside the step's gathers), writes its pid
  to ``file`` and sleeps: the test SIGKILLs or SIGSTOPs it;
- "nan": {"step", "what": "scale" | "activation", "rank"}: at that step (1-based) poison a weight
  scale of ``layers.0.mlp.down_proj`` (on every rank: the partitions) or that layer's output on
  ``rank``: the guard must stop the run there, naming the layer;
- "save_steps": HF checkpoints every that many steps (the resumable state).
Rank 0 writes the consolidated save ``{out}/saved``. Errors end the worker like a stage script:
``error: <message>`` and exit status 1.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    from qatlib.trainers.guard import GuardError
    from qatlib.zero3 import io as z
    from qatlib.zero3.peers import CollectiveFailure

    ctx = z.init_zero3(json.loads(Path(spec["ds_config"]).read_text()), timeout_s=spec["timeout_s"])
    try:
        with ctx:
            run(spec, z, ctx)
    except (CollectiveFailure, GuardError) as e:
        sys.exit(f"error: {e}")


def run(spec, z, ctx) -> None:
    import torch
    from transformers import TrainerCallback, TrainingArguments

    from qatlib.data import PadCollator
    from qatlib.losses import LossConfig
    from qatlib.quant import QuantScheme
    from qatlib.trainers.end2end import QATTrainer
    from qatlib.trainers.params import Learnable
    from qatlib.zero3 import save as zs

    scheme = QuantScheme.from_dict(spec["scheme"])
    from qatlib.zero3 import load as zl

    model = zl.build_qat_model(spec["model"], ctx, scheme, from_ptq_ckpt=spec["ptq"])
    out = Path(spec["out"])
    rank = z.get_rank()
    step = [0]  # the step being computed (1-based)
    layer = model.model.layers[0].mlp.down_proj

    pause = spec.get("pause")
    if pause and pause["rank"] == rank:

        def stop_here(module, args):
            if step[0] == pause["step"]:
                Path(pause["file"]).write_text(str(os.getpid()))
                while True:
                    time.sleep(1)

        model.model.layers[1].register_forward_pre_hook(stop_here)

    nan = spec.get("nan")
    if nan and nan["what"] == "activation" and nan.get("rank", rank) == rank:

        def poison(module, args, output):
            if step[0] == nan["step"] and module.training:
                return output * float("nan")
            return None

        layer.register_forward_hook(poison)

    class Hooks(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            step[0] = state.global_step + 1
            if nan and nan["what"] == "scale" and step[0] == nan["step"]:
                with torch.no_grad():
                    for p in (layer.weight_quantizer.scale,):
                        local = p.ds_tensor if hasattr(p, "ds_tensor") else p
                        local.data.fill_(float("nan"))

    args = TrainingArguments(
        output_dir=str(out / "trainer"),
        max_steps=spec["steps"],
        per_device_train_batch_size=1,
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="steps" if spec.get("save_steps") else "no",
        save_steps=spec.get("save_steps") or 500,
        max_grad_norm=0.0,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        deepspeed=ctx.ds_config,
        train_sampling_strategy="sequential",
        seed=0,
    )
    trainer = QATTrainer(
        model,
        args,
        loss_config=LossConfig(loss_type="cakld", lm_loss_weight=1.0, kd_loss_weight=1.0),
        learnable=Learnable(weight_scale=True),
        train_dataset=spec["data"],
        data_collator=PadCollator(0),
        callbacks=[Hooks()],
    )
    trainer.train()
    zs.save_consolidated(model, out / "saved", scheme=scheme)
    print(f"[rank{rank}] WORKER OK", flush=True)


if __name__ == "__main__":
    main()
