"""ZeRO-3 I/O (qatlib.zero3.io) on real DeepSpeed: 2 CPU ranks under torchrun, gloo, nothing mocked.

Two torchrun launches carry the multi-rank checks (start-up costs ~10 s each, so each batches
several checks): `qat_roundtrip.py` (dense + MoE + bf16: partitioning, exact streamed load, QAT steps
vs a single-process run, skewed MoE routing, consolidated save) and `bad_inputs.py` (every bad input
is the same clear error on both ranks, and the run ends fast). The single-process tests at the
bottom cover the same loaders on plain models (the non-ZeRO warm start).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import (
    VOCAB,
    build_model,
    one_thread,
    tiny_llama_config,
    tiny_qwen3_config,
    tiny_qwen3_moe_config,
    torchrun,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from qatlib import ptq as qptq
from qatlib.checkpoint.keys import key_of, scale_keys
from qatlib.checkpoint.layout import RUN_METADATA_FILE, SCALES_FILE, WEIGHTS_INDEX_FILE
from qatlib.ptq import calibrate as ptq_calibrate
from qatlib.ptq import save_ptq_checkpoint
from qatlib.quant import (
    Granularity,
    PrepareOptions,
    QuantLinear,
    QuantScheme,
    QuantSpec,
    prepare,
    preset,
    quantizers,
    tying,
)
from qatlib.runtime.tying import tie_for
from qatlib.trainers.log_scale import install_log_space_steps
from qatlib.trainers.params import Learnable, param_groups, select_trainable
from qatlib.zero3 import io as z
from qatlib.zero3 import load as zl
from qatlib.zero3 import save as zs

ROOT = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).parent / "zero3_workers"
DS_TEST = ROOT / "config" / "deepspeed" / "zero3_cpu_test.json"

SCHEME = QuantScheme(
    "test_w4g16_fp8",
    weight=QuantSpec("int4", Granularity.GROUP, group_size=16, symmetric=False),
    input=QuantSpec("fp8"),
    k=QuantSpec("int8", symmetric=False),
    v=QuantSpec("fp8"),
)
FP8_STATIC = preset("fp8_static")
STEPS, BATCH, SEQ, LR, EPS = 2, 2, 16, 1e-4, 1e-8
LOG_LR = 1e-2  # the log-space phase's relative step
# Tolerance of "ZeRO-3 == single process": both runs do the same fp32 ops except the order in which
# the two ranks' gradients are summed (ulp-level). Adam turns a nearly cancelling gradient's ulp
# error into up to ~1e-3 of a step (lr 1e-4 -> 1e-7), so scales agree within ATOL = 2e-7, losses
# and logits to 1e-5 relative. Once such a difference flips a rounding, the runs drift apart
# (an LSQ scale gradient jumps by a whole code): measured dense, 2 steps within 2e-7; 3 steps up to
# 7e-6 on MLP scales (moves of 3e-4) since the int8 key quantizer acts on the post-k_norm/RoPE keys,
# whose values crowd rounding boundaries. MoE diverges faster (fp8 roundings and router decisions
# flip: 2 steps: 3e-6 on scales, 2e-3 on logits), so MoE is compared after 1 step.
MOE_STEPS = 1
NVFP4 = preset("nvfp4")
MXFP4 = preset("mxfp4")
RTOL, ATOL = 1e-5, 2e-7
# Llama (tied embeddings): after 1 step one of 48 scales differed by 2.5e-7 (2.5e-3 of its 1e-4
# Adam step: the same nearly-cancelling-gradient effect), the others within ATOL; a wrong
# gradient moves a scale by a whole step (1e-4), far above this bound.
ATOL_LLAMA = 5e-7


# --------------------------------------------------------------------------- helpers
def load_plain(model_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.config.use_cache = False
    return model.eval()


def calibrate(model, x: torch.Tensor) -> None:
    """Activation scales from one forward (weight scales were set from the weights by prepare)."""
    acts = [q for n, q in quantizers(model) if not n.endswith("weight_quantizer")]
    for q in acts:
        q.start_calibration()
    with torch.no_grad():
        model(input_ids=x)
    for q in acts:
        q.finish_calibration()


def write_ptq_dir(model, out: Path, *, fused_experts: bool) -> None:
    """A PTQ-format checkpoint written by hand (docs/design.md keys), independent of zero3_io's own
    key mapping: two files, scalar input scales, int zero points, a stray weight key (ignored) and
    an unused scale key; with ``fused_experts`` the experts' scales use the fused layout."""
    a, b = {}, {}
    experts: dict[str, dict[str, list]] = {}
    for name, ql in model.named_modules():
        if not isinstance(ql, QuantLinear):
            continue
        wq, iq, oq = ql.weight_quantizer, ql.input_quantizer, ql.output_quantizer
        parent, _, child = name.rpartition(".")
        if fused_experts and ".experts." in name:
            prefix, e = parent.rsplit(".", 1)
            d = experts.setdefault(f"{prefix}|{child}", {"w": [], "z": [], "i": []})
            d["w"].append(wq.scale.detach().clone())
            d["z"].append(wq.zero_point.detach().clone())
            d["i"].append(iq.scale.detach().clone())
            continue
        a[f"{name}.weight_scale"] = wq.scale.detach().clone()
        a[f"{name}.weight_zero_point"] = wq.zero_point.detach().to(torch.int8)
        b[f"{name}.input_scale"] = iq.scale.detach().reshape(())  # scalar: fills the [1] scale
        if oq is not None:
            b[f"{parent}.{child[0]}_cache.scale"] = oq.scale.detach().clone()
            if oq.zero_point is not None:
                b[f"{parent}.{child[0]}_cache.zero_point"] = oq.zero_point.detach().clone()
    pairs = {}
    for key, d in experts.items():
        prefix, child = key.split("|")
        pairs.setdefault(prefix, {})[child] = d
    for prefix, projs in pairs.items():  # gate/up concatenated on the out dim: [E, 2I, H/g]
        a[f"{prefix}.gate_up_proj.weight_scale"] = torch.stack(
            [torch.cat([g, u]) for g, u in zip(projs["gate_proj"]["w"], projs["up_proj"]["w"])]
        )
        a[f"{prefix}.gate_up_proj.weight_zero_point"] = torch.stack(
            [torch.cat([g, u]) for g, u in zip(projs["gate_proj"]["z"], projs["up_proj"]["z"])]
        )
        b[f"{prefix}.gate_up_proj_input_scale"] = torch.stack(projs["gate_proj"]["i"]).reshape(-1)  # [E]
        a[f"{prefix}.down_proj_scale"] = torch.stack(projs["down_proj"]["w"])
        a[f"{prefix}.down_proj_zero_point"] = torch.stack(projs["down_proj"]["z"])
        b[f"{prefix}.down_proj.input_scale"] = torch.stack(projs["down_proj"]["i"])  # [E, 1]
    a["model.norm.weight"] = torch.ones(model.config.hidden_size)  # a weight of a full checkpoint: ignored
    b["lm_head.weight_scale"] = torch.ones(1)  # lm_head is not quantized here: unused
    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in a.items()}, str(out / "scales-a.safetensors"))
    save_file({k: v.contiguous() for k, v in b.items()}, str(out / "scales-b.safetensors"))
    (out / "quant_scheme.json").write_text(json.dumps(SCHEME.to_dict()))


def quant_params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "_quantizer." in n}


def prepared_from(model_dir: Path, ptq_dir: Path, scheme: QuantScheme = SCHEME, target: str = "none"):
    model = load_plain(model_dir)
    prepare(model, scheme, options=PrepareOptions(init_from_weight=False, deploy=tie_for(target)))
    report = zl.stream_load_scales(model, ptq_dir, scheme)
    return model, report


def reference_run(
    model_dir: Path,
    ptq_dir: Path,
    data: dict,
    steps: int,
    scheme: QuantScheme = SCHEME,
    target: str = "none",
    *,
    lr: float = LR,
    scale_update: str = "additive",
    frozen_codes: bool = False,
) -> dict:
    """The single-process QAT the ZeRO-3 run must equal: rank r's micro-batch r, the mean of the
    per-rank losses (what ZeRO-3's gradient averaging optimises), torch AdamW on the scales;
    ``frozen_codes``: on the start's codes (`qatlib.quant.codes`), released into the weights."""
    from qatlib.quant.codes import freeze_codes, release_codes

    with one_thread():
        model, report = prepared_from(model_dir, ptq_dir, scheme, target)
        init_params = quant_params(model)
        init_weights = {n: p.detach().clone() for n, p in model.named_parameters() if "_quantizer." not in n}
        if frozen_codes:
            freeze_codes(model)
        for p in model.parameters():
            p.requires_grad_(id(p) in _quant_ids(model))
        opt = scale_optimizer(model, lr, EPS, scale_update)
        model.train()
        losses = []
        for s in range(steps):
            per_rank = [model(input_ids=x, labels=x).loss for x in data["train"][s]]
            loss = sum(per_rank) / len(per_rank)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append([v.item() for v in per_rank])
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=data["eval"]).logits
        if frozen_codes:
            release_codes(model)
    return {
        "losses": losses,
        "weights": {n: p.detach().clone() for n, p in model.named_parameters() if "_quantizer." not in n},
        "quant_params": quant_params(model),
        "init_params": init_params,
        "init_weights": init_weights,
        "logits": logits,
        "report": report,
        "shared": [[n for n, _ in g] for g in tying.shared_groups(model)],
        "shared_global": [[n for n, _ in g] for g in tying.shared_global_groups(model)],
    }


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Tiny dense (sharded, with index) and MoE (single file; plus a fused-key copy) checkpoints,
    their PTQ dirs (MoE: fused expert scale keys, nested final_quant_checkpoint/) and references."""
    tmp = tmp_path_factory.mktemp("zero3")
    g = torch.Generator().manual_seed(0)
    data = {
        "train": torch.randint(0, VOCAB, (STEPS, 2, BATCH, SEQ), generator=g),
        "eval": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
    }
    torch.save(data, tmp / "data.pt")
    calib = torch.randint(0, VOCAB, (4, SEQ), generator=g)
    out = {"tmp": tmp, "data": data}
    for name, cfg, shard in (
        ("dense", tiny_qwen3_config(), "100KB"),
        ("moe", tiny_qwen3_moe_config(), None),
        ("llama", tiny_llama_config(), None),  # SmolLM2's architecture: Llama, tied embeddings
    ):
        model = build_model(cfg, seed=1)
        mdir = tmp / name
        model.save_pretrained(mdir, **({"max_shard_size": shard} if shard else {}))
        if name == "moe":  # the same weights with fused expert keys (the in-memory transformers layout)
            fdir = tmp / "moe_fused"
            fdir.mkdir()
            save_file(
                {k: v.contiguous() for k, v in model.state_dict().items()}, str(fdir / "model.safetensors")
            )
            model.config.save_pretrained(fdir)
            out["moe_fused"] = fdir
        with one_thread():
            pm = load_plain(mdir)
            prepare(pm, SCHEME)
            calibrate(pm, calib)
        ptq = tmp / f"{name}_ptq" / ("final_quant_checkpoint" if name == "moe" else "")
        write_ptq_dir(pm, ptq, fused_experts=name == "moe")
        out[name] = mdir
        out[f"{name}_ptq"] = tmp / f"{name}_ptq"
        out[f"{name}_calibrated"] = quant_params(pm)
        out[f"{name}_ref"] = reference_run(
            mdir, out[f"{name}_ptq"], data, STEPS if name == "dense" else MOE_STEPS
        )
    # NVFP4 (W4A4: E4M3 group scales + global weight scale, dynamic inputs with a static global
    # scale) through qatlib's own PTQ, the warm start (#14)
    with one_thread():
        pm = load_plain(out["dense"])
        qptq.calibrate(pm, NVFP4, [calib])
        qptq.save_ptq_checkpoint(pm, NVFP4, tmp / "nvfp4_ptq")
    out["nvfp4_ptq"] = tmp / "nvfp4_ptq"
    out["nvfp4_ref"] = reference_run(out["dense"], out["nvfp4_ptq"], data, STEPS, NVFP4)
    # NVFP4 under deploy.target vllm (q/k/v and gate/up share their global scales), from the untied
    # NVFP4 PTQ checkpoint, scales in log space (#14: a tied NVFP4 warm start on 2 ranks)
    out["nvfp4_tied_ref"] = reference_run(
        out["dense"], out["nvfp4_ptq"], data, STEPS, NVFP4, "vllm", lr=LOG_LR, scale_update="log"
    )
    # MXFP4 (W4A4: E8M0 group scales, dynamic inputs) in log space: its E8M0 scales step in their
    # own group at log_scale.e8m0_lr (5 x LOG_LR) on both ranks as in one process (#14)
    with one_thread():
        pm = load_plain(out["dense"])
        qptq.calibrate(pm, MXFP4, [calib])
        qptq.save_ptq_checkpoint(pm, MXFP4, tmp / "mxfp4_ptq")
    out["mxfp4_log_ref"] = reference_run(
        out["dense"], tmp / "mxfp4_ptq", data, STEPS, MXFP4, lr=LOG_LR, scale_update="log"
    )
    out["mxfp4_ptq"] = tmp / "mxfp4_ptq"
    # log-space scale steps (quant_config.scale_update: log) at a relative lr of 1%
    out["dense_log_ref"] = reference_run(
        out["dense"], out["dense_ptq"], data, STEPS, lr=LOG_LR, scale_update="log"
    )
    # ... and on the PTQ codes held fixed (quant_config.frozen_codes), released into the weights
    out["dense_frozen_ref"] = reference_run(
        out["dense"], out["dense_ptq"], data, STEPS, lr=LOG_LR, scale_update="log", frozen_codes=True
    )
    # deploy.target vllm on the MoE model: an UNTIED fp8 PTQ checkpoint (its tied keys disagree, so
    # the load takes the max), then QAT with q/k/v, each expert's gate/up and every expert input tied
    with one_thread():
        pm = load_plain(out["moe"])
        ptq_calibrate(pm, FP8_STATIC, [calib])
        save_ptq_checkpoint(pm, FP8_STATIC, tmp / "moe_fp8_ptq")
    out["moe_fp8_ptq"] = tmp / "moe_fp8_ptq"
    # the MoE model over every step: from the second forward on, DeepSpeed prefetches along its
    # recorded trace (the expert-leaf phase trains through it)
    out["moe_steps_ref"] = reference_run(out["moe"], out["moe_ptq"], data, STEPS)
    out["moe_tied_ref"] = reference_run(out["moe"], tmp / "moe_fp8_ptq", data, MOE_STEPS, FP8_STATIC, "vllm")
    return out


@pytest.fixture(scope="module")
def zero3_run(ckpts):
    tmp = ckpts["tmp"]
    phase = {"ds_config": str(DS_TEST), "steps": STEPS}
    dense_log = {
        **phase,
        "name": "dense_log",
        "model": str(ckpts["dense"]),
        "ptq": str(ckpts["dense_ptq"]),
        "compare_ckpt": str(ckpts["dense"]),
        "scale_update": "log",
        "lr": LOG_LR,
    }
    moe_tied = {
        **phase,
        "name": "moe_tied",
        "model": str(ckpts["moe"]),
        "ptq": str(ckpts["moe_fp8_ptq"]),
        "compare_ckpt": str(ckpts["moe"]),
        "steps": MOE_STEPS,
        "scheme": FP8_STATIC.to_dict(),
        "deploy_target": "vllm",
    }
    spec = {
        "out": str(tmp / "run"),
        "scheme": SCHEME.to_dict(),
        "data": str(tmp / "data.pt"),
        "lr": LR,
        "eps": EPS,
        "phases": [
            {
                **phase,
                "name": "dense",
                "model": str(ckpts["dense"]),
                "ptq": str(ckpts["dense_ptq"]),
                "compare_ckpt": str(ckpts["dense"]),
                # every tensor above 2 KB is read by rank 0 and sent partition by partition (a
                # Qwen3-30B-A3B embedding is past the 64 MB default), the rest gathered in chunks;
                # saved the other way round: assembled on rank 0 from the partitions
                "chunk_bytes": 2048,
                "save_partition_bytes": 2048,
            },
            {
                **phase,
                "name": "moe",
                "model": str(ckpts["moe"]),
                "ptq": str(ckpts["moe_ptq"]),
                "compare_ckpt": str(ckpts["moe"]),
                "also_load": [str(ckpts["moe_fused"])],
                "skewed_routing": True,
                "steps": MOE_STEPS,
            },
            # no leaf modules at all: every expert linear has its own gather hooks, so ranks with
            # different routing only stay in step because every expert runs on every rank. (Prefetch
            # off: with it, DeepSpeed 0.19.8 computes wrong MoE gradients without leaf modules.)
            {
                **phase,
                "name": "moe_noleaf",
                "model": str(ckpts["moe"]),
                "ptq": str(ckpts["moe_ptq"]),
                "compare_ckpt": str(ckpts["moe"]),
                "leaf": False,
                "steps": MOE_STEPS,
                "skewed_routing": True,
                "zero_overrides": {"stage3_prefetch_bucket_size": 0},
            },
            # one expert gathers at a time (the DeepSpeed config's own leaf list, prefetch on): the
            # memory-lean setting for wide MoE layers (config/deepspeed/zero3_cpu_lean.json)
            {
                **phase,
                "name": "moe_expertleaf",
                "model": str(ckpts["moe"]),
                "ptq": str(ckpts["moe_ptq"]),
                "compare_ckpt": str(ckpts["moe"]),
                "steps": STEPS,
                "skewed_routing": True,
                "zero_overrides": {"leaf_module": {"classes": ["qatlib.surgery.moe.ExpertMLP"]}},
            },
            {
                **phase,
                "name": "llama",
                "model": str(ckpts["llama"]),
                "ptq": str(ckpts["llama_ptq"]),
                "compare_ckpt": str(ckpts["llama"]),
                # 1 step, as MoE: after 2 an MLP scale differed by more than ATOL_LLAMA (magnitude
                # not measured; the losses of both steps matched)
                "steps": MOE_STEPS,
            },
            dense_log,
            {**dense_log, "name": "dense_frozen", "frozen_codes": True},
            {
                **phase,
                "name": "nvfp4_tied",
                "model": str(ckpts["dense"]),
                "ptq": str(ckpts["nvfp4_ptq"]),
                "compare_ckpt": str(ckpts["dense"]),
                "scheme": NVFP4.to_dict(),
                "deploy_target": "vllm",
                "scale_update": "log",
                "lr": LOG_LR,
            },
            {
                **phase,
                "name": "mxfp4_log",
                "model": str(ckpts["dense"]),
                "ptq": str(ckpts["mxfp4_ptq"]),
                "compare_ckpt": str(ckpts["dense"]),
                "scheme": MXFP4.to_dict(),
                "scale_update": "log",
                "lr": LOG_LR,
            },
            {
                **phase,
                "name": "nvfp4",
                "model": str(ckpts["dense"]),
                "ptq": str(ckpts["nvfp4_ptq"]),
                "compare_ckpt": str(ckpts["dense"]),
                "scheme": NVFP4.to_dict(),
            },
            moe_tied,
            # the same under layer checkpointing, one expert per gather: the tied expert input
            # scale is shared by every expert while each is recomputed in its own backward
            {
                **moe_tied,
                "name": "moe_tied_ckpt",
                "checkpointing": True,
                "zero_overrides": {"leaf_module": {"classes": ["qatlib.surgery.moe.ExpertMLP"]}},
            },
            {
                **phase,
                "name": "dense_bf16",
                "model": str(ckpts["dense"]),
                "ptq": str(ckpts["dense_ptq"]),
                "compare_ckpt": str(ckpts["dense"]),
                "steps": 1,
                "ds_overrides": {"bf16": {"enabled": True}},
            },
        ],
    }
    (tmp / "run").mkdir()
    proc, seconds = torchrun(WORKERS / "qat_roundtrip.py", spec, tmp, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.count("WORKER OK") == 2
    results = {
        ph["name"]: torch.load(tmp / "run" / f"{ph['name']}.pt", weights_only=False) for ph in spec["phases"]
    }
    return results, tmp / "run", seconds


# --------------------------------------------------------------------------- multi-rank tests
@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize(
    "name", ["dense", "moe", "moe_noleaf", "moe_expertleaf", "dense_bf16", "llama", "nvfp4"]
)
def test_partitioned_and_loaded_exactly(zero3_run, name):
    results, _, _ = zero3_run
    r = results[name]
    for rank_checks in r["checks"]:
        assert rank_checks["bad_shares"] == []  # every rank holds its half of every parameter
        assert rank_checks["gathered_mismatch"] == []  # gathered == checkpoint, bit for bit
        for key, val in rank_checks.items():
            if key.startswith("gathered_mismatch["):  # fused-key checkpoint -> same linearised weights
                assert val == [], key
        assert rank_checks["scale_dtypes"] == ["torch.float32"]
    want = "torch.bfloat16" if name == "dense_bf16" else "torch.float32"
    assert r["checks"][0]["weight_dtypes"] == [want]
    meta = r["meta_before"]
    assert meta["world_size"] == 2 and meta["zero_stage"] == 3 and len(meta["ranks"]) == 2
    assert 0.5 <= meta["ranks"][0]["share_min"] and meta["ranks"][0]["share_max"] <= 1.0
    assert all(rk["peak_rss_bytes"] > 0 for rk in meta["ranks"])


@pytest.mark.slow
@pytest.mark.multirank
def test_e8m0_scales_step_in_their_own_group_on_every_rank(zero3_run):
    """The ZeRO-3 optimizer's groups (DeepSpeed flattens each group separately): the MXFP4 phase's
    E8M0 weight scales alone, in log space at 5 x the relative lr; the int4 log phase has none."""
    results, _, _ = zero3_run
    for rank_checks in results["mxfp4_log"]["checks"]:
        assert rank_checks["groups"] == [["scale_e8m0", pytest.approx(5 * LOG_LR), True]]
    for rank_checks in results["dense_log"]["checks"]:
        assert [g[0] for g in rank_checks["groups"]] == ["scale", "zero_point"]


@pytest.mark.slow
@pytest.mark.multirank
def test_scales_report(zero3_run, ckpts):
    _, run_dir, _ = zero3_run
    for name in ("dense", "moe", "llama"):
        rep = json.loads((run_dir / f"{name}_scales.json").read_text())
        assert rep["misses"] == 0 and rep["hits"] == len(ckpts[f"{name}_calibrated"])
        assert rep["unused_key_names"] == ["lm_head.weight_scale"] and rep["ignored_keys"] == 1
    assert json.loads((run_dir / "moe_scales.json").read_text())["ptq_dir"].endswith("final_quant_checkpoint")


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize(
    "name",
    [
        "dense",
        "moe",
        "moe_noleaf",
        "moe_expertleaf",
        "llama",
        "nvfp4",
        "dense_log",
        "dense_frozen",
        "nvfp4_tied",
        "mxfp4_log",
    ],
)
def test_qat_steps_match_single_process(zero3_run, ckpts, name):
    results, _, _ = zero3_run
    ref_of = {"moe_noleaf": "moe", "moe_expertleaf": "moe_steps"}
    r, ref = results[name], ckpts[f"{ref_of.get(name, name)}_ref"]
    torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=ATOL)
    assert set(r["quant_params"]) == set(ref["quant_params"])
    moved = 0
    atol = ATOL_LLAMA if name == "llama" else ATOL
    for k, v in ref["quant_params"].items():
        torch.testing.assert_close(r["quant_params"][k], v, rtol=RTOL, atol=atol, msg=k)
        moved += not torch.equal(v, ref["init_params"][k])
    assert moved > len(ref["quant_params"]) // 2  # the steps did train the scales
    torch.testing.assert_close(r["logits"], ref["logits"], rtol=RTOL, atol=1e-5)


@pytest.mark.slow
@pytest.mark.multirank
def test_frozen_codes_release_into_the_partitioned_weights(zero3_run, ckpts):
    """quant_config.frozen_codes under ZeRO-3: each rank records the gathered scale, trains on the
    PTQ codes, and the release writes codes * trained scale into every partitioned weight: the
    consolidated weights are the single-process run's and round back to the PTQ's codes."""
    from qatlib.quant import quantize

    results, _, _ = zero3_run
    r, ref = results["dense_frozen"], ckpts["dense_frozen_ref"]
    assert set(r["weights"]) == set(ref["weights"])
    codes_kept = 0
    # a released weight is code x trained scale: the scales agree to ATOL (test above), so the
    # weights to |code| x ATOL, at most the format's largest code (seen here: 1.5e-6 on one CPU)
    qmax = max(abs(SCHEME.weight.qmin), SCHEME.weight.qmax)
    for k, v in ref["weights"].items():
        torch.testing.assert_close(r["weights"][k], v, rtol=RTOL, atol=ATOL * qmax, msg=k)
        sk = k.replace(".weight", ".weight_quantizer.scale")
        if sk in ref["quant_params"]:  # a quantized linear: its codes at the start and the end
            start = quantize(ref["init_weights"][k], ref["init_params"][sk], None, SCHEME.weight)
            assert torch.equal(
                quantize(r["weights"][k], r["quant_params"][sk], None, SCHEME.weight), start
            ), k
            codes_kept += 1
    assert codes_kept >= 7 * 2  # every linear of both layers


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("name", ["dense", "moe", "llama", "nvfp4"])
def test_consolidated_save_reloads_without_deepspeed(zero3_run, name):
    results, run_dir, _ = zero3_run
    saved = run_dir / f"{name}_saved"
    assert (saved / "config.json").is_file() and (saved / SCALES_FILE).is_file()
    assert json.loads((saved / RUN_METADATA_FILE).read_text())["world_size"] == 2
    with one_thread():
        model, report = prepared_from(saved, saved, NVFP4 if name == "nvfp4" else SCHEME)
        with torch.no_grad():
            logits = model(input_ids=torch.load(run_dir.parent / "data.pt")["eval"]).logits
    assert report["misses"] == 0
    assert torch.equal(logits, results[name]["logits"])  # identical, not merely close
    if name == "dense":  # above 2 KB (save_partition_bytes): assembled from partitions, a shard each
        index = json.loads((saved / WEIGHTS_INDEX_FILE).read_text())["weight_map"]
        files: dict[str, list[str]] = {}
        for key, f in index.items():
            files.setdefault(f, []).append(key)
        for key in ("model.embed_tokens.weight", "lm_head.weight"):  # one-parameter units
            w = results[name]["weights"][key]
            assert w.numel() * w.element_size() > 2048 and files[index[key]] == [key]
            # streamed in 2 KB pieces (a partition is 32 of them); == the whole-tensor path
            with safe_open(str(saved / index[key]), framework="pt") as f:
                assert f.metadata() == {"format": "pt"} and torch.equal(f.get_tensor(key), w)
        assert max(len(keys) for keys in files.values()) > 1  # the rest are gathered, several a shard


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("name", ["moe_tied", "moe_tied_ckpt"])
def test_tied_scales_partition_train_and_save(zero3_run, ckpts, name):
    """deploy.target vllm under ZeRO-3: a scale Parameter shared by several quantizers (q/k/v, an
    expert's gate/up, every expert input of a layer) is partitioned once, trains as the
    single-process tied model does, and is saved under every member's key; the untied PTQ
    checkpoint it started from loaded with the max rule. ``moe_tied_ckpt``: the same under layer
    checkpointing with one expert per gather (`recompute_experts_one_by_one`), against the same
    uncheckpointed reference."""
    results, run_dir, _ = zero3_run
    r, ref = results[name], ckpts["moe_tied_ref"]
    blocks = 2 if name == "moe_tied_ckpt" else 0  # the tiny MoE's 2 experts blocks, checkpointed
    assert [c.get("experts_recomputed_one_by_one", 0) for c in r["checks"]] == [blocks, blocks]
    assert ref["shared"] and len(ref["shared"]) == 16
    for rank_checks in r["checks"]:
        assert rank_checks["shared"] == ref["shared"]
        assert rank_checks["bad_shares"] == []
    assert len(ref["report"]["tied_disagreeing"]) > 0  # the untied checkpoint's keys did disagree
    rep = json.loads((run_dir / f"{name}_scales.json").read_text())
    assert rep["tied_disagreeing"] == ref["report"]["tied_disagreeing"] and rep["misses"] == 0
    torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=ATOL)
    assert set(r["quant_params"]) == set(ref["quant_params"])
    for k, v in ref["quant_params"].items():
        torch.testing.assert_close(r["quant_params"][k], v, rtol=RTOL, atol=ATOL, msg=k)
    saved = run_dir / f"{name}_saved"
    scales = load_file(str(saved / SCALES_FILE))
    keys = {  # quantizer name -> its linear's checkpoint key (docs/design.md)
        n: key_of(n.rpartition(".")[0], n.rpartition(".")[2].removesuffix("_quantizer"), "scale")
        for g in ref["shared"]
        for n in g
    }
    for group in ref["shared"]:
        vals = [scales[keys[n]] for n in group]  # one key per linear, the shared value under each
        assert all(torch.equal(vals[0], v) for v in vals[1:]), group
    moved = [
        g for g in ref["shared"] if not torch.equal(scales[keys[g[0]]], ref["init_params"][g[0] + ".scale"])
    ]
    assert moved  # the tied scales trained
    with one_thread():
        model, report = prepared_from(saved, saved, FP8_STATIC, "vllm")
        with torch.no_grad():
            logits = model(input_ids=torch.load(run_dir.parent / "data.pt")["eval"]).logits
    assert report["misses"] == 0 and report["tied_disagreeing"] == []
    assert torch.equal(logits, r["logits"])


@pytest.mark.slow
@pytest.mark.multirank
def test_tied_nvfp4_warm_start_shares_global_scales_on_every_rank(zero3_run, ckpts):
    """NVFP4 under deploy.target vllm on 2 ranks: the global scales vLLM merges (q/k/v, gate/up)
    are one partitioned Parameter per group on every rank, as in the single-process model (whose
    steps the run matches: test_qat_steps_match_single_process[nvfp4_tied]), loaded from an untied
    PTQ checkpoint, trained, and saved as one value under every member's key."""
    results, run_dir, _ = zero3_run
    r, ref = results["nvfp4_tied"], ckpts["nvfp4_tied_ref"]
    groups = ref["shared_global"]
    assert groups and sorted({len(g) for g in groups}) == [2, 3]  # q/k/v and gate/up, per layer
    for rank_checks in r["checks"]:
        assert rank_checks["shared_global"] == groups and rank_checks["bad_shares"] == []
    assert len(ref["report"]["tied_disagreeing"]) > 0  # the untied checkpoint's global scales differed
    scales = load_file(str(run_dir / "nvfp4_tied_saved" / SCALES_FILE))
    for g in groups:
        keys = [
            key_of(layer, q.removesuffix("_quantizer"), "global_scale")
            for layer, q in (n.rsplit(".", 1) for n in g)
        ]
        assert all(k in scales for k in keys), keys
        assert all(torch.equal(scales[keys[0]], scales[k]) for k in keys[1:]), keys
        assert not torch.equal(scales[keys[0]], ref["init_params"][g[0] + ".global_scale"])  # it trained


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("name", ["moe", "moe_noleaf", "moe_expertleaf"])
def test_moe_skewed_routing_completes(zero3_run, name):
    results, _, _ = zero3_run
    counts = results[name]["checks"][0]["expert_token_counts"]
    starved = [
        (layer, e)
        for layer, c1 in counts[1].items()
        for e, n in enumerate(c1)
        if n == 0 and counts[0][layer][e] > 0
    ]
    assert starved, counts  # some expert had tokens on rank 0 and none on rank 1, and the run went on
    # every rank fake-quantized the weights of exactly the experts that had tokens there (forward
    # and backward): starved experts' compute was skipped, their modules still ran on both ranks
    for rank in (0, 1):
        computed = {tuple(t) for t in results[name]["checks"][rank]["fake_quantized_experts"]}
        assert computed == {(layer, e) for layer, c in counts[rank].items() for e, n in enumerate(c) if n > 0}


@pytest.mark.slow
@pytest.mark.multirank
def test_moe_gather_unit_follows_the_deepspeed_config(zero3_run):
    """qatlib makes each expert one leaf (one expert per gather) unless the DeepSpeed config lists
    its own leaves; DeepSpeed's default Qwen3MoeSparseMoeBlock (a whole layer's experts) never is."""
    results, _, _ = zero3_run
    leaves = {
        name: results[name]["checks"][0]["leaf_classes"] for name in ("moe", "moe_noleaf", "moe_expertleaf")
    }
    assert leaves == {
        "moe": ["ExpertMLP"],
        "moe_noleaf": [],
        "moe_expertleaf": ["ExpertMLP"],
    }


@pytest.mark.slow
@pytest.mark.multirank
def test_bf16_engine_keeps_fp32_scales(zero3_run, ckpts):
    results, _, _ = zero3_run
    r = results["dense_bf16"]
    assert r["engine_bf16"]
    assert all(v.dtype == torch.float32 for v in r["quant_params"].values())
    moved = sum(
        not torch.equal(v, ckpts["dense_ref"]["init_params"][k]) for k, v in r["quant_params"].items()
    )
    assert moved > len(r["quant_params"]) // 2
    assert all(torch.isfinite(torch.tensor(step)).all() for step in r["losses"])


@pytest.mark.slow
@pytest.mark.multirank
def test_nvfp4_warm_start_loads_every_scale(zero3_run, ckpts):
    """The ZeRO-3 warm start from qatlib's NVFP4 PTQ checkpoint: every group scale, weight global
    scale and input global scale is a hit, the gathered values before the first step equal the
    checkpoint's tensors bit for bit, and no quantizer is left uninitialised on either rank."""
    results, run_dir, _ = zero3_run
    r = results["nvfp4"]
    ckpt = load_file(str(ckpts["nvfp4_ptq"] / SCALES_FILE))
    rep = json.loads((run_dir / "nvfp4_scales.json").read_text())
    assert rep["misses"] == 0 and rep["hits"] == len(ckpt) == len(r["init_quant_params"])
    kinds = {}
    for k in ckpt:
        kind = k.rsplit(".", 1)[1]
        kinds[kind] = kinds.get(kind, 0) + 1
    n_linear = 7 * tiny_qwen3_config().num_hidden_layers
    assert kinds == {
        "weight_scale": n_linear,
        "weight_global_scale": n_linear,
        "input_global_scale": n_linear,
    }
    with one_thread():
        model = load_plain(ckpts["dense"])
        prepare(model, NVFP4, options=PrepareOptions(init_from_weight=False))
    keys = scale_keys(model)
    assert set(keys) == set(r["init_quant_params"])
    for name, key in keys.items():
        assert torch.equal(
            r["init_quant_params"][name], ckpt[key].reshape(r["init_quant_params"][name].shape)
        ), name
    assert [c["uninitialized"] for c in r["checks"]] == [[], []]
    # the single-process reference loaded the same values (its init) and the steps moved them
    for name, v in ckpts["nvfp4_ref"]["init_params"].items():
        assert torch.equal(v, r["init_quant_params"][name]), name


# --------------------------------------------------------------------------- bad inputs (2 ranks)
BAD_CASES = {
    "missing_key": "missing (1): model.layers.0.mlp.up_proj.weight",
    "shape_mismatch": "model.layers.1.self_attn.o_proj.weight: checkpoint [64, 32] vs model",
    "unexpected_key": "unexpected (1): model.layers.0.mlp.extra_proj.weight",
    "truncated": "truncated safetensors file",
    "ptq_other_format": "incompatible with the configured 'test_w4g16_fp8'",
    "ptq_scale_shape": "model.layers.0.mlp.down_proj.weight_scale: checkpoint [64, 2] vs",
    "ptq_missing_dir": "does not exist",
    "no_ptq_ckpt": "needs a PTQ checkpoint (compression.QAT.from_ptq_ckpt)",
    "ptq_other_format_build": "incompatible with the configured",
    "optimizer_block": "has an 'optimizer' block",
}


@pytest.fixture(scope="module")
def bad_run(ckpts):
    import shutil

    from qatlib.quant import PRESETS

    tmp = ckpts["tmp"] / "bad"
    tmp.mkdir()
    sd = {}
    for f in sorted(ckpts["dense"].glob("*.safetensors")):
        sd.update(load_file(str(f)))

    def single(name, tensors):
        d = tmp / name
        d.mkdir()
        save_file(tensors, str(d / "model.safetensors"))
        shutil.copy(ckpts["dense"] / "config.json", d)
        return str(d)

    spec = {
        "scheme": SCHEME.to_dict(),
        "ds_config": str(DS_TEST),
        "model": str(ckpts["dense"]),
        "out": str(tmp / "bad_inputs.json"),
        "ptq_missing_dir": str(tmp / "no_such_ptq"),
    }
    spec["missing_key"] = single(
        "missing_key", {k: v for k, v in sd.items() if k != "model.layers.0.mlp.up_proj.weight"}
    )
    spec["shape_mismatch"] = single(
        "shape_mismatch", {**sd, "model.layers.1.self_attn.o_proj.weight": torch.zeros(64, 32)}
    )
    spec["unexpected_key"] = single(
        "unexpected_key", {**sd, "model.layers.0.mlp.extra_proj.weight": torch.zeros(2, 2)}
    )
    trunc = tmp / "truncated"
    shutil.copytree(ckpts["dense"], trunc)
    biggest = max(trunc.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    os.truncate(biggest, biggest.stat().st_size - 100)
    spec["truncated"], spec["truncated_file"] = str(trunc), biggest.name
    other = tmp / "ptq_other_format"
    shutil.copytree(ckpts["dense_ptq"], other)
    (other / "quant_scheme.json").write_text(json.dumps(PRESETS["fp8_static"].to_dict()))
    spec["ptq_other_format"] = str(other)
    bad_shape = tmp / "ptq_scale_shape"
    shutil.copytree(ckpts["dense_ptq"], bad_shape)
    scales = load_file(str(bad_shape / "scales-a.safetensors"))
    scales["model.layers.0.mlp.down_proj.weight_scale"] = torch.ones(64, 2)  # the quantizer's is [64, 8]
    save_file(scales, str(bad_shape / "scales-a.safetensors"))
    spec["ptq_scale_shape"] = str(bad_shape)
    cfg = json.loads(DS_TEST.read_text())
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-5}}
    (tmp / "with_optimizer.json").write_text(json.dumps(cfg))
    spec["ds_config_with_optimizer"] = str(tmp / "with_optimizer.json")
    proc, seconds = torchrun(WORKERS / "bad_inputs.py", spec, tmp, timeout=240)
    return proc, seconds, spec


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_input_is_a_clear_error_on_every_rank(bad_run, case):
    proc, _, spec = bad_run
    assert Path(spec["out"]).is_file(), proc.stderr[-5000:]
    ranks = json.loads(Path(spec["out"]).read_text())
    errors = [r[case]["error"] for r in ranks]
    assert errors[0] is not None and BAD_CASES[case] in errors[0], errors[0]
    assert errors[0] == errors[1]  # the same message on both ranks
    assert all(r[case]["seconds"] < 15 for r in ranks)  # decided at once, no collective waited out
    for rank in (0, 1):
        assert f"[rank{rank}] CASE {case}: " in proc.stderr
    if case == "truncated":
        assert spec["truncated_file"] in errors[0]


@pytest.mark.slow
@pytest.mark.multirank
def test_uncaught_error_ends_the_run_fast(bad_run):
    proc, seconds, spec = bad_run
    assert proc.returncode != 0
    for rank in (0, 1):
        line = next(ln for ln in proc.stderr.splitlines() if ln.startswith(f"[rank{rank}] FATAL"))
        assert "Zero3Error" in line and spec["truncated_file"] in line and "truncated" in line
    assert "UNEXPECTED" not in proc.stdout
    assert seconds < 55  # start-up + cases; a hang would wait out the 60 s collective timeout


# --------------------------------------------------------------------------- large tensors in pieces (2 ranks)
# 509 x 63: neither the embedding nor the head divides by 2 ranks (the last partition is padded);
# fp32 partitions of 64 KB move in pieces of at most 2 KB, loaded (read from the file) and saved
# (streamed to their own shard).
ODD = {"vocab_size": 509, "hidden_size": 63, "num_hidden_layers": 1}
PIECE = 2048
PARTITION_ERRORS = {
    "short_read_own": "short read of model.embed_tokens.weight",
    "short_read_other": "short read of model.embed_tokens.weight",
    "missing_file": "No such file or directory",
    "save_write_fails": "failed at model.embed_tokens: OSError: disk full (test)",
    "save_open_fails": "OSError: cannot create shard-00000.safetensors (test)",
}


@pytest.fixture(scope="module")
def partition_run(tmp_path_factory):
    import shutil

    tmp = tmp_path_factory.mktemp("partition_io")
    for name, tied in (("odd", False), ("odd_tied", True)):
        build_model(tiny_qwen3_config(**ODD, tie_word_embeddings=tied), seed=2).save_pretrained(tmp / name)
    errors = {"model": str(tmp / "odd"), "chunk_bytes": PIECE, "partition_bytes": PIECE}
    for case in ("short_read_own", "short_read_other", "missing_file"):  # a copy each case damages
        shutil.copytree(tmp / "odd", tmp / case)
        errors[case] = str(tmp / case)
    piece = {"chunk_bytes": PIECE, "partition_bytes": PIECE}
    spec = {
        "out": str(tmp / "run"),
        "ds_config": str(DS_TEST),
        "phases": [
            {"name": "odd", "model": str(tmp / "odd"), **piece},
            # bf16 parameters from an fp32 file: each piece converted as it is read
            {"name": "odd_tied_bf16", "model": str(tmp / "odd_tied"), "bf16": True, **piece},
        ],
        "errors": errors,
    }
    (tmp / "run").mkdir()
    proc, seconds = torchrun(WORKERS / "partition_io.py", spec, tmp, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.count("WORKER OK") == 2
    return spec, tmp / "run"


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("name", ["odd", "odd_tied_bf16"])
def test_large_tensors_load_and_save_in_pieces(partition_run, name):
    """Tensors above 2 KB load partition-wise in 2 KB pieces read straight from the file (padding
    zeroed on the receiver) and save streamed to a shard of their own; both bit for bit."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    spec, run_dir = partition_run
    ph = next(ph for ph in spec["phases"] if ph["name"] == name)
    dtype = torch.bfloat16 if ph.get("bf16") else torch.float32
    ckpt = load_file(str(Path(ph["model"]) / "model.safetensors"))
    emb = ckpt["model.embed_tokens.weight"]
    assert emb.numel() % 2 == 1 and emb.numel() // 2 * dtype.itemsize > 8 * PIECE  # padded; many pieces
    r = torch.load(run_dir / f"{name}.pt", weights_only=False)
    tied = name.startswith("odd_tied")
    streamed = ["model.embed_tokens.weight"] + ([] if tied else ["lm_head.weight"])
    for checks in r["checks"]:  # both ranks
        assert checks["gathered_mismatch"] == [] and checks["bad_padding"] == []
        assert set(streamed) <= set(checks["padded"])
    saved = run_dir / f"{name}_saved"
    index = json.loads((saved / WEIGHTS_INDEX_FILE).read_text())["weight_map"]
    for key in streamed:
        assert [k for k, f in index.items() if f == index[key]] == [key]  # alone in its shard
        with safe_open(str(saved / index[key]), framework="pt") as f:
            assert f.metadata() == {"format": "pt"} and list(f.keys()) == [key]
            t = f.get_tensor(key)
        assert t.dtype == dtype and torch.equal(t, ckpt[key].to(dtype))
        assert torch.equal(t, r["state_dict"][key])  # == the whole-tensor path (consolidated_state_dict)
    with one_thread():
        model = AutoModelForCausalLM.from_pretrained(str(saved), dtype=dtype)
    assert model.config.tie_word_embeddings == tied
    for n, p in model.named_parameters(remove_duplicate=False):
        ref = ckpt["model.embed_tokens.weight" if tied and n == "lm_head.weight" else n]
        assert torch.equal(p.detach(), ref.to(dtype)), n


@pytest.mark.slow
@pytest.mark.multirank
def test_large_tensor_failures_are_one_error_on_every_rank(partition_run):
    """A file that shrinks after its header was read (inside rank 0's own partition, inside rank
    1's), a file gone, a streamed shard whose write fails midway or at its start: the same
    `Zero3Error` on both ranks at once, the ranks still in step (a save afterwards works), and no
    output left by a failed save."""
    spec, run_dir = partition_run
    ranks = json.loads((run_dir / "errors.json").read_text())
    for case, text in PARTITION_ERRORS.items():
        errors = [r[case]["error"] for r in ranks]
        assert errors[0] is not None and text in errors[0], (case, errors[0])
        assert errors[0] == errors[1], case
        assert all(r[case]["seconds"] < 15 for r in ranks), case
    assert ranks[0]["write_calls"] == 2  # the write failed after one piece was written
    assert ranks[0]["saved_after_errors"]
    outputs = ranks[0]["outputs"]
    assert "after_errors" in outputs and not any("save_" in o for o in outputs), outputs


# --------------------------------------------------------------------------- single process (plain models)
def test_plain_warm_start_fans_fused_expert_scales_out(ckpts):
    """stream_load_scales on a plain model (the single-process warm start): the fused-expert keys
    ([E, 2I, H/g] split into gate/up, [E] scalars fanned out) restore exactly the calibrated scales."""
    for name in ("dense", "moe"):
        model, report = prepared_from(ckpts[name], ckpts[f"{name}_ptq"])
        assert report["misses"] == 0 and report["hits"] == len(ckpts[f"{name}_calibrated"])
        got = quant_params(model)
        for k, v in ckpts[f"{name}_calibrated"].items():
            assert torch.equal(got[k], v), k
        assert not any(z.is_zero3_param(p) for p in model.parameters())


def test_plain_stream_load_weights_both_expert_layouts(ckpts):
    """Per-expert keys -> transformers' fused experts, and fused keys -> linearised experts."""
    from qatlib.surgery.moe import linearize_moe_experts

    ref = load_plain(ckpts["moe"]).state_dict()
    fused_model = build_model(tiny_qwen3_moe_config(), seed=5)  # other random weights, fused experts
    report = zl.stream_load_weights(fused_model, ckpts["moe"])  # per-expert keys
    assert report["tensors"] == len(load_file(str(ckpts["moe"] / "model.safetensors")))
    for k, v in fused_model.state_dict().items():
        assert torch.equal(v, ref[k]), k
    lin_model = build_model(tiny_qwen3_moe_config(), seed=5)
    linearize_moe_experts(lin_model)
    zl.stream_load_weights(lin_model, ckpts["moe_fused"])  # fused keys
    inter = lin_model.config.moe_intermediate_size
    w = ref["model.layers.1.mlp.experts.gate_up_proj"][2]
    assert torch.equal(lin_model.model.layers[1].mlp.experts[2].gate_proj.weight, w[:inter])
    assert torch.equal(lin_model.model.layers[1].mlp.experts[2].up_proj.weight, w[inter:])
    assert torch.equal(
        lin_model.model.layers[1].mlp.experts[2].down_proj.weight,
        ref["model.layers.1.mlp.experts.down_proj"][2],
    )


def test_plain_stream_load_weights_lists_problems(tmp_path, ckpts):
    sd = load_file(str(ckpts["moe"] / "model.safetensors"))
    del sd["model.norm.weight"]
    sd["model.layers.0.mlp.experts.0.up_proj.weight"] = torch.zeros(3, 3)
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(z.Zero3Error) as err:
        zl.stream_load_weights(build_model(tiny_qwen3_moe_config()), tmp_path)
    msg = str(err.value)
    assert "missing (1): model.norm.weight" in msg
    assert "model.layers.0.mlp.experts.0.up_proj.weight: checkpoint [3, 3]" in msg


def test_tied_embeddings_need_one_key(tmp_path):
    cfg = tiny_qwen3_config(tie_word_embeddings=True)
    src = build_model(cfg, seed=3)
    src.save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(str(tmp_path / "model.safetensors"))
    dst = build_model(cfg, seed=4)
    zl.stream_load_weights(dst, tmp_path)
    assert dst.lm_head.weight is dst.model.embed_tokens.weight
    assert torch.equal(dst.lm_head.weight, src.lm_head.weight)


@pytest.mark.parametrize("lwc", [False, True])
def test_plain_save_consolidated_roundtrip(tmp_path, ckpts, lwc):
    """save_consolidated off ZeRO-3 (no process group): sharded HF weights + scales; reloading with
    plain transformers + prepare + stream_load_scales gives identical logits. LWC models save their
    clip factors (exact resume) and the derived weight_scale (a non-LWC model reloads it exactly)."""
    x = ckpts["data"]["eval"]
    with one_thread():
        model = load_plain(ckpts["dense"])
        opts = PrepareOptions(lwc_init=2.0) if lwc else PrepareOptions()
        prepare(model, SCHEME, options=opts)
        calibrate(model, x)
        with torch.no_grad():
            want = model(input_ids=x).logits
        out = zs.save_consolidated(model, tmp_path / "saved", max_shard_bytes=100_000)
        assert (out / WEIGHTS_INDEX_FILE).is_file() and len(list(out.glob("model-*-of-*.safetensors"))) > 1
        assert not list(tmp_path.glob(".saved.tmp-*"))  # the temporary dir was renamed
        for reload_opts in [opts, PrepareOptions()] if lwc else [opts]:
            again = load_plain(out)
            prepare(again, SCHEME, options=reload_opts)
            report = zl.stream_load_scales(again, out, SCHEME)
            assert report["misses"] == 0
            with torch.no_grad():
                assert torch.equal(again(input_ids=x).logits, want)
    assert json.loads((out / RUN_METADATA_FILE).read_text())["zero_stage"] == 0


def test_param_groups_dedupe_and_roles():
    model = build_model(tiny_qwen3_config())
    prepare(model, SCHEME, options=PrepareOptions(lwc_init=1.0))
    attn = model.model.layers[0].self_attn
    attn.v_proj.input_quantizer.scale = attn.k_proj.input_quantizer.scale  # a shared (tied) scale
    tp = select_trainable(model, Learnable(act_scale=True, weight_scale=True, kv_scale=True, lwc=True))
    groups = param_groups(tp, lr=1e-4, lwc_lr=1e-3)
    assert [(g["name"], g["lr"]) for g in groups] == [("scale", 1e-4), ("lwc", 1e-3)]
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids))
    from qatlib.quant.quantizer import role_parameters

    assert {id(p) for p in groups[1]["params"]} == {id(p) for _, p in role_parameters(model, "lwc")}
    assert sum(p.numel() for g in groups for p in g["params"]) == sum(
        p.numel() for p in {id(p): p for p in model.parameters() if id(p) in _quant_ids(model)}.values()
    )
    opt = torch.optim.AdamW(groups, lr=1e-4)
    assert isinstance(opt, torch.optim.AdamW) and len(opt.param_groups) == 2


def test_ds_config_checks():
    cfg = json.loads(DS_TEST.read_text())
    z.check_ds_config(cfg)
    for key in ("zero3.json", "zero3_cpu_test.json"):  # the shipped configs pass
        z.check_ds_config(json.loads((ROOT / "config" / "deepspeed" / key).read_text()))
    with pytest.raises(z.Zero3Error, match="'optimizer' block"):
        z.check_ds_config({**cfg, "optimizer": {"type": "AdamW"}})
    with pytest.raises(z.Zero3Error, match="stage must be 3"):
        z.check_ds_config({**cfg, "zero_optimization": {"stage": 2}})
    with pytest.raises(z.Zero3Error, match="does not exist"):
        z.load_ds_config("/no/such/ds.json")


def test_non_zero_path_is_untouched(ckpts):
    """Without a ZeRO-3 context models.load_model is plain transformers; the gather helpers are no-ops."""
    from qatlib.models import load_model

    model = load_model(ckpts["dense"], torch_dtype="fp32")
    ref = load_plain(ckpts["dense"])
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert not z.is_zero3_param(p) and torch.equal(p, q), n
    w = model.lm_head.weight
    with z.gathered_param_if_zero3(w, modifier_rank=0):
        assert w.shape == (VOCAB, 64)
    assert zs.consolidated_state_dict(model).keys() == model.state_dict().keys()
    meta = z.run_metadata(model)
    assert meta["world_size"] == 1 and meta["zero_stage"] == 0 and meta["ranks"][0]["share_max"] == 1.0


# Every scale of SCHEME (weight, input, k/v outputs; no q) trains, as in the ZeRO-3 workers.
ALL_SCALES = Learnable(act_scale=True, weight_scale=True, kv_scale=True)


def scale_optimizer(model, lr: float, eps: float, scale_update: str = "additive") -> torch.optim.AdamW:
    """torch AdamW over the trainers' own groups (`qatlib.trainers.params`) of every scale."""
    groups = param_groups(select_trainable(model, ALL_SCALES), lr=lr, scale_update=scale_update)
    return install_log_space_steps(torch.optim.AdamW(groups, lr=lr, eps=eps))


def _quant_ids(model):
    from qatlib.quant.quantizer import role_parameters

    return {id(p) for _, p in role_parameters(model)}


def test_deepspeed_default_leaf_list_is_mirrored():
    """`qatlib.zero3.ds_config` models what DeepSpeed does with a config that names no leaf modules (its
    own default list, whole MoE blocks): the mirror is DeepSpeed's list."""
    from deepspeed.runtime.zero.leaf_module_config import DEFAULT_LEAF_MODULE_CLASSES

    from qatlib.zero3.ds_config import DEEPSPEED_DEFAULT_LEAVES

    assert list(DEEPSPEED_DEFAULT_LEAVES) == DEFAULT_LEAF_MODULE_CLASSES
