"""2-rank ZeRO-3 worker (torchrun): build -> load -> QAT steps -> gather -> save, per phase.

Usage: torchrun --standalone --nproc_per_node=2 qat_roundtrip.py SPEC.json

SPEC: {"out": dir, "scheme": QuantScheme dict, "data": file (torch.save'd {"train": [S, 2, B, T],
"eval": [B, T]}), "lr": float, "phases": [{"name", "ds_config", "model", "ptq", "compare_ckpt",
"also_load", "leaf": bool, "steps": int, "skewed_routing": bool, "scheme": a phase's own scheme
(default: the spec's), "deploy_target": tie the scales that runtime merges (qatlib.runtime.tying),
"scale_update": "additive" | "log" (qatlib.trainers.log_scale), "lr": a phase's own lr,
"checkpointing": layer checkpointing with each expert recomputed in its own backward}]}.
Rank 0 writes ``{out}/{name}.pt`` (losses, quantizer params after the build and after the steps,
eval logits, checks) and the consolidated save ``{out}/{name}_saved``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path

import torch

logging.basicConfig(level=logging.INFO, format=f"[rank{os.environ.get('RANK', '?')}] %(name)s: %(message)s")


def _quant_ids(model):
    from qatlib.quant.quantizer import role_parameters

    return {id(p) for _, p in role_parameters(model)}


def checkpoint_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    sd = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    return sd


def gathered_equals(model, sd, zero3_save) -> list[str]:
    """Names of non-quantizer parameters whose gathered value differs from ``sd`` (every rank)."""
    bad = []
    for name, m in zero3_save.iter_gathered_modules(model, unit_types=()):
        for pname, p in m.named_parameters(recurse=False):
            full = f"{name}.{pname}" if name else pname
            if ".weight_quantizer." in full or ".input_quantizer." in full or ".output_quantizer." in full:
                continue
            ref = sd.get(full)
            if ref is None and full == "lm_head.weight" and model.config.tie_word_embeddings:
                ref = sd.get("model.embed_tokens.weight")  # tied: saved once, under the embedding
            if ref is None or not torch.equal(ref.to(p.device, p.dtype), p.data):
                bad.append(full)
    return bad


def run_phase(ph: dict, spec: dict, data: dict) -> None:
    import deepspeed

    from qatlib.device import current as current_device
    from qatlib.models import load_model
    from qatlib.quant import PrepareOptions, Quantizer, QuantScheme, tying
    from qatlib.runtime.tying import tie_for
    from qatlib.surgery.moe import LinearizedMoeExperts
    from qatlib.trainers.log_scale import install_log_space_steps
    from qatlib.trainers.params import Learnable, param_groups, select_trainable
    from qatlib.zero3 import io as z
    from qatlib.zero3 import load as zl
    from qatlib.zero3 import save as zs

    out = Path(spec["out"])
    scheme = QuantScheme.from_dict(ph.get("scheme", spec["scheme"]))
    ds_config = json.loads(Path(ph["ds_config"]).read_text())
    ds_config.update(ph.get("ds_overrides", {}))
    ds_config["zero_optimization"].update(ph.get("zero_overrides", {}))
    if not ph.get("leaf", True):
        ds_config["zero_optimization"]["leaf_module"] = {"classes": []}
    ctx = z.init_zero3(ds_config, timeout_s=60)  # binds the rank's device (qatlib.device)
    rank, world = z.get_rank(), z.get_world_size()
    dev = current_device()
    checks: dict = {}

    model = zl.build_qat_model(
        ph["model"],
        ctx,
        scheme,
        from_ptq_ckpt=ph["ptq"],
        chunk_bytes=ph.get("chunk_bytes", 64 << 20),
        scales_report_path=out / f"{ph['name']}_scales.json",
        options=PrepareOptions(deploy=tie_for(ph.get("deploy_target", "none"))),
    )
    # quantizers sharing one (partitioned) scale Parameter: one list per group
    checks["shared"] = [[n for n, _ in g] for g in tying.shared_groups(model)]
    checks["shared_global"] = [[n for n, _ in g] for g in tying.shared_global_groups(model)]
    # each rank holds ceil(n / world) elements of every parameter (its half, padded)
    checks["bad_shares"] = [
        n for n, p in model.named_parameters() if p.ds_tensor.numel() != math.ceil(p.ds_numel / world)
    ]
    checks["n_params"] = sum(1 for _ in model.parameters())
    checks["scale_dtypes"] = sorted(
        {str(p.ds_tensor.dtype) for p in model.parameters() if id(p) in _quant_ids(model)}
    )
    checks["weight_dtypes"] = sorted(
        {str(p.ds_tensor.dtype) for p in model.parameters() if id(p) not in _quant_ids(model)}
    )
    checks["gathered_mismatch"] = gathered_equals(model, checkpoint_tensors(Path(ph["compare_ckpt"])), zs)
    for other in ph.get("also_load", []):  # e.g. the fused-key layout of the same weights
        m2 = load_model(other, zero3=ctx)  # through qatlib.models' dispatch
        checks[f"gathered_mismatch[{Path(other).name}]"] = gathered_equals(
            m2, checkpoint_tensors(Path(ph["compare_ckpt"])), zs
        )
        del m2
    meta_before = z.run_metadata(model)
    # the warm start's values before any step, and quantizers it left uninitialised (every rank)
    init_quant = {k: v for k, v in zs.consolidated_state_dict(model).items() if "_quantizer." in k}
    checks["uninitialized"] = sorted(
        n for n, q in model.named_modules() if isinstance(q, Quantizer) and not bool(q.initialized)
    )

    for p in model.parameters():
        p.requires_grad_(id(p) in _quant_ids(model))
    # every scale trains (weight, input, k/v outputs), in the trainers' own groups
    every_scale = Learnable(act_scale=True, weight_scale=True, kv_scale=True)
    lr = ph.get("lr", spec["lr"])
    groups = param_groups(
        select_trainable(model, every_scale), lr=lr, scale_update=ph.get("scale_update", "additive")
    )
    checks["groups"] = [[g["name"], g["lr"], bool(g.get("log_space"))] for g in groups]
    opt = install_log_space_steps(torch.optim.AdamW(groups, lr=lr, eps=spec["eps"]))
    if ph.get("frozen_codes"):  # quant_config.frozen_codes, as train_end2end runs it
        from qatlib.quant.codes import freeze_codes

        freeze_codes(model, z.gathered_param_if_zero3)  # ZeRO-3: the gather passed down
    if ph.get("checkpointing"):  # as the end-to-end trainer sets it up (non-reentrant)
        from qatlib.surgery.moe import recompute_experts_one_by_one

        model.activation_checkpointing_enable()
        model.enable_input_require_grads()
        checks["experts_recomputed_one_by_one"] = recompute_experts_one_by_one(model)
    # the run's config as qatlib resolved it (`init_zero3`: qatlib's leaf default where the JSON has none)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ctx.ds_config)
    # what gathers as one unit (ZeRO-3 leaf modules), after DeepSpeed applied the config's list
    checks["leaf_classes"] = sorted(
        {type(m).__name__ for m in model.modules() if getattr(m, "_z3_leaf", False)}
    )
    engine.train()
    losses = []
    for step in range(ph["steps"]):
        x = data["train"][step, rank].to(dev)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        both = [None] * world
        torch.distributed.all_gather_object(both, loss.item())
        losses.append(both)

    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=data["eval"].to(dev)).logits.cpu()

    if ph.get("skewed_routing"):
        # rank 1 feeds one repeated token: its router picks the same top-k experts for every token,
        # so the other experts get zero tokens there while rank 0 routes to all of them.
        counts: dict[str, torch.Tensor] = {}

        def hook(mod, args):
            idx = args[1]
            counts.setdefault(mod._qat_name, torch.zeros(len(mod), dtype=torch.long))
            counts[mod._qat_name] += torch.bincount(idx.flatten(), minlength=len(mod)).cpu()

        # which expert weights get fake-quantized (forward, backward recompute): only experts with
        # tokens on this rank, while every expert module still runs and gathers (issue #16)
        from qatlib.quant import fq_linear

        expert_of: dict[int, tuple[str, int]] = {}
        for n, mod in model.named_modules():
            if isinstance(mod, LinearizedMoeExperts):
                mod._qat_name = n
                mod.register_forward_pre_hook(hook)
                for e, ex in enumerate(mod):
                    for lin in (ex.gate_proj, ex.up_proj, ex.down_proj):
                        expert_of[id(lin.weight)] = (n, e)
        fq_computed: set[tuple[str, int]] = set()
        orig_parts = fq_linear._fake_quant_parts

        def counting_parts(w, *a, **k):
            if id(w) in expert_of:
                fq_computed.add(expert_of[id(w)])
            return orig_parts(w, *a, **k)

        fq_linear._fake_quant_parts = counting_parts
        x = (data["eval"] if rank == 0 else torch.full_like(data["eval"], 7)).to(dev)
        engine.train()
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)  # the backward gathers expert params again: hooks must match across ranks
        with torch.no_grad():
            engine.eval()
            engine(input_ids=x)
        fq_linear._fake_quant_parts = orig_parts
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, {k: v.tolist() for k, v in counts.items()})
        checks["expert_token_counts"] = gathered
        checks["fake_quantized_experts"] = sorted(fq_computed)

    if ph.get("frozen_codes"):
        from qatlib.quant.codes import release_codes

        release_codes(model, z.gathered_param_if_zero3)
    part = ph.get("save_partition_bytes", z.PARTITION_BYTES)
    sd = zs.consolidated_state_dict(model, partition_bytes=part)
    saved = zs.save_consolidated(model, out / f"{ph['name']}_saved", scheme=scheme, partition_bytes=part)
    meta = z.run_metadata(model)
    all_checks = [None] * world
    torch.distributed.all_gather_object(all_checks, checks)
    if rank == 0:
        assert saved is not None
        torch.save(
            {
                "losses": losses,
                "quant_params": {k: v for k, v in sd.items() if "_quantizer." in k},
                "weights": {k: v for k, v in sd.items() if "_quantizer." not in k},
                "init_quant_params": init_quant,
                "n_state": len(sd),
                "logits": logits,
                "checks": all_checks,
                "meta_before": meta_before,
                "meta": meta,
                "engine_bf16": engine.bfloat16_enabled(),
            },
            out / f"{ph['name']}.pt",
        )
    else:
        assert saved is None and sd == {}
    del engine, model, opt


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    data = torch.load(spec["data"])
    torch.manual_seed(0)
    for ph in spec["phases"]:
        run_phase(ph, spec, data)
    from qatlib.zero3.io import shutdown

    shutdown()
    print(f"[rank{os.environ.get('RANK')}] WORKER OK", flush=True)


if __name__ == "__main__":
    main()
