"""The quality lab's settings and inputs: `QualitySettings` (one dataclass for every quality and
deployment row: model, data, PTQ, QAT and ablation budgets), its presets, and where the base model
and the data come from (`resolve_inputs`).

Model: the default experiment's pre-trained base model (``results/base/<name>/`` from the
workflow, else pre-trained here with `qatlib.offline.base_model` and its ``config/base_models.yaml``
budget into ``results/bench/cache/``), or a micro model pre-trained here in seconds (``--quick``).
Data: the offline corpus (``results/corpus/``, else built here with `qatlib.offline.corpus`):
calibration windows from ``calib.txt``, QAT samples from ``train.txt``, evaluation on ``test.txt``,
and the local multiple-choice task built from the test split (`qatlib.offline.mc_task`).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .common import DEFAULT_BASE_MODEL, base_models_spec, find_base_model, log

QUALITY_FORMATS = ("fp8_static", "int4_g32", "int4_ch", "w4a8_fp8_g32", "int3_g32", "int2_g32")
# The 4-bit float rows (#14) beside int4 at equal storage bits (`bits_per_weight` in each row); a
# list of format names, so they rerun unchanged on any default model whose linear input widths
# divide by 32 (NVFP4 groups 16, MXFP4 32; SmolLM2-135M's 576 and 1536 do).
# upstream FOCUS's NVFP4 / MXFP4 (#41) beside qatlib's own W4A4 rows, with the same budget and recipe
FP4_FORMATS = (
    "int4_g16",
    "int4_g32",
    "nvfp4_w4a16",
    "nvfp4",
    "mxfp4_w4a16",
    "mxfp4",
    "nvfp4_focus",
    "mxfp4_focus",
)
TARGET_RECOVERY = 0.70
MC_TASK = "qat_local_mc"


@dataclass
class QualitySettings:
    formats: tuple[str, ...] = QUALITY_FORMATS
    gptq: bool = True
    seq_len: int = 256
    eval_windows: int | None = 400  # test windows (None: the whole split)
    eval_batch: int = 8
    mc: bool = True
    mc_limit: int | None = None
    calib_windows: int = 32
    calib_batch: int = 4
    # end-to-end QAT: config/experiments/tiny-qwen3-moe.yaml's objective and schedule, one process
    # (distillation only, lr 1e-3: it recovered 0.56 of int3's RTN loss here vs 0.29 for the
    # upstream lm 1 + kd 1 at lr 1e-4; the batch is 4 windows, the workflow's is 4 per rank x 2)
    qat_steps: int = 100
    qat_batch: int = 4
    lr: float = 2e-4  # the default experiment's (1e-3 took scales below 0: the guard stops that)
    warmup_steps: int = 5
    lr_scheduler: str = "cosine"  # hf_args.lr_scheduler_type
    loss_type: str = "cakld"
    lm_loss_weight: float = 0.0
    # ablations: int3 g32 because its PTQ gap is measurable on the under-trained tiny model (w4a8's is
    # ~0.4% perplexity, below the noise rule, so differences between variants would be noise)
    ablation_format: str = "int3_g32"
    kd_losses: tuple[str, ...] = ("origin", "kl", "rkl", "cakld")
    lrs: tuple[float, ...] = (1e-4, 2e-4, 1e-3)  # 1e-3: recorded as stopped by the guard if it is
    # FP8 weight scales are amax / 448 (~1e-4 here), ~100x an int3 scale: Adam's ~lr step must stay
    # well below them (2e-4 took them below 0 at step 1); the repo's fp8 configs train at 1e-6
    fp8_lr: float = 1e-6
    # FP4 group scales are trained in their own units, so one absolute lr cannot serve them and int
    # scales alike (Adam moves every element by ~lr per step): on SmolLM2 NVFP4's E4M3 group scales
    # are ~64 (3.75..448, amax / 6 over the fp32 global scale) and lr 2e-4 left QAT = PTQ to every
    # digit, lr 0.5 recovered 0.71 of NVFP4 W4A16's RTN loss in 20 steps untied but took a tied
    # v_proj scale (~4) below 0 at step 16; MXFP4's E8M0 scales are ~0.0625 (min 2^-7) and lr 2e-3
    # took one below 0 at step 7. Both values below are kept under the smallest scale's reach
    # over 30 cosine steps (~0.6 x steps x lr); the per-element relative lr is the real fix
    nvfp4_lr: float = 0.1
    scale_update: str = "additive"  # "log": lr is a relative step (qatlib.trainers.log_scale)
    mxfp4_lr: float = 3e-4
    # log space: MXFP4's E8M0 scales step at the library's own multiple of lr
    # (qatlib.trainers.log_scale.e8m0_lr; at lr itself MXFP4 QAT changed no scale)
    lwc: bool = True
    lwc_init: float = 4.0
    lwc_lr: float = 1e-2
    norm: bool = True
    blockwise: bool = True
    bw_epochs: int = 4
    bw_train_size: int = 64
    bw_val_size: int = 16
    bw_quant_lr: float = 1e-4
    bw_weight_lr: float = 1e-3
    bw_loss: str = "mse"  # qatlib.trainers.blockwise.BLOCK_LOSSES
    smooth_alpha: float | None = None  # SmoothQuant before RTN (`qatlib.quant.smoothing`); None: off
    bw_norm: bool = False  # blockwise also trains the blocks' RMSNorm weights (``learnable.norm``)
    # phase 2 of the two-phase recipe (blockwise, then end-to-end scales from its result): at the
    # main lr (2e-4) phase 2 lost blockwise's gain on the micro model (int2 g32: 0.92 -> 0.86-0.89),
    # at 2e-5 it added to it (0.94-0.98); EfficientQAT's E2E-QP trains step sizes at ~1e-5 too
    two_phase_lr: float = 2e-5
    # where the model comes from
    base_model: str = DEFAULT_BASE_MODEL
    base_model_path: str | None = None  # an explicit pre-trained model folder (tokenizer inside)
    micro: bool = False  # --quick: a micro model pre-trained here in seconds (numbers meaningless)
    seed: int = 0
    # a QAT row from GPTQ's result too (formats with a GPTQ row), against both, at its own lr
    # (None: the main one); ``rtn_init_qat`` False skips the main (RTN-initialised) QAT row
    gptq_init_qat: bool = False
    gptq_init_lr: float | None = None
    # what GPTQ leaves in the weights the GPTQ-initialised QAT starts from (`qatlib.ptq.gptq.gptq`'s
    # ``latent``): the weights it rounded (True) or the rounded grid values (False, the old start)
    gptq_latent: bool = True
    # ... and trains its scales with GPTQ's codes held fixed (`qatlib.quant.codes`)
    gptq_frozen_codes: bool = False
    rtn_init_qat: bool = True
    # the formats whose QAT recovery of RTN's loss is a target, and its threshold
    recovery_targets: tuple[str, ...] = ("int4_g32", "int4_ch", "w4a8_fp8_g32")
    target_recovery: float = TARGET_RECOVERY


# The FP4 rows alone: ``python -m benchmarks.quality --fp4`` -> quality_fp4.json. No ablations and
# no MC task (its stderr, ~0.03, dwarfs every quantization effect here, and its lm-eval pass is most
# of a row's time); perplexity and RTN / GPTQ / QAT as in the full run.
FP4_ROWS = QualitySettings(
    formats=FP4_FORMATS,
    mc=False,
    kd_losses=(),
    lrs=(),
    lwc=False,
    norm=False,
    blockwise=False,
    ablation_format="int4_g32",
    # on the default model (SmolLM2-135M, the workflow's gguf_model rule), with the default
    # experiment's recipe (forward KL; scales in log space at a relative lr of 1e-2 for every
    # format), sized for 2 CPU cores: 30 steps of 256 tokens, 32 test windows, no GPTQ
    base_model="smollm2-135m",
    gptq=False,
    seq_len=256,
    eval_windows=32,
    calib_windows=16,
    qat_steps=30,
    qat_batch=1,
    # additive, one lr could not serve int4 (1e-3 took an int4 g32 scale, min 0.0054, below 0 at
    # step 13) and FP4 (NVFP4's E4M3 group scales ~64 did not move at 2e-4) alike
    lr=1e-2,
    scale_update="log",
    loss_type="kl",
    lm_loss_weight=0.0,
    warmup_steps=3,
)

# --quick: a micro model and corpus made here in seconds, tiny budgets (numbers meaningless)
QUICK = QualitySettings(
    formats=("fp8_static", "w4a8_fp8_g32"),
    seq_len=64,
    eval_windows=8,
    eval_batch=8,
    mc=True,
    mc_limit=8,
    calib_windows=4,
    calib_batch=2,
    qat_steps=3,
    qat_batch=2,
    warmup_steps=0,
    kd_losses=("origin", "kl"),
    lrs=(1e-4, 2e-4),
    ablation_format="w4a8_fp8_g32",
    bw_epochs=1,
    bw_train_size=2,
    bw_val_size=1,
    micro=True,
)


# --------------------------------------------------------------------------- inputs
def _micro_inputs(work: Path, seed: int) -> tuple[Path, Path]:
    """A micro corpus (stdlib docstrings) and a micro model pre-trained on it in seconds."""
    import inspect

    from qatlib.offline.base_model import pretrain

    corpus = work / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    docs = []
    import collections
    import functools
    import itertools
    import json
    import pathlib
    import re
    import string
    import textwrap

    for mod in (collections, functools, itertools, json, pathlib, re, string, textwrap, inspect, os):
        for _, obj in inspect.getmembers(mod):
            d = inspect.getdoc(obj)
            if d and len(d) > 200:
                docs.append(" ".join(d.split()))
    docs = sorted(set(docs))
    test, calib, train = docs[::10], docs[1::10], [d for i, d in enumerate(docs) if i % 10 > 1]
    for name, part in (("train", train), ("calib", calib), ("test", test)):
        (corpus / f"{name}.txt").write_text("\n\n".join(part) + "\n", encoding="utf-8")
    base = work / "base"
    spec = dict(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        max_position_embeddings=256,
    )
    pretrain(
        corpus,
        base,
        model=spec,
        train=dict(token_budget=4 * 8 * 64, seq_len=64, batch_size=8, seed=seed, eval_windows=4),
        progress=False,
    )
    return corpus, base


def resolve_inputs(s: QualitySettings, results: str, work: Path) -> dict[str, Any]:
    """Corpus folder, base model folder and MC task folder (made here when missing)."""
    res = Path(results)
    info: dict[str, Any] = {}
    if s.micro:
        corpus, base = _micro_inputs(work, s.seed)
        info.update(
            corpus=str(corpus),
            corpus_source="micro (stdlib docstrings, --quick)",
            base=str(base),
            base_source="micro model pre-trained here (--quick)",
        )
    else:
        corpus = res / "corpus"
        if (corpus / "manifest.json").is_file() and (corpus / "test.txt").is_file():
            info["corpus_source"] = "workflow (results/corpus)"
        else:
            from qatlib.offline.corpus import build_corpus

            corpus = res / "bench" / "cache" / "corpus"
            if not (corpus / "manifest.json").is_file():
                log(f"quality: building the corpus into {corpus}")
                build_corpus(corpus, progress=False)
            info["corpus_source"] = f"built by the benchmark ({corpus})"
        info["corpus"] = str(corpus)
        base = Path(s.base_model_path) if s.base_model_path else find_base_model(results, s.base_model)
        if s.base_model_path:
            info["base_source"] = f"given (--base-model {s.base_model_path})"
        elif base is not None:
            info["base_source"] = "workflow" if base == res / "base" / s.base_model else "benchmark cache"
        else:
            from qatlib.offline.base_model import pretrain

            base = res / "bench" / "cache" / "base" / s.base_model
            spec = base_models_spec(s.base_model)
            log(f"quality: pre-training {s.base_model} into {base} (budget {spec.get('train')})")
            t0 = time.perf_counter()
            pretrain(corpus, base, model=spec.get("model"), train=spec.get("train"), progress=False)
            info["pretrain_s"] = round(time.perf_counter() - t0, 1)
            info["base_source"] = "pre-trained by the benchmark (config/base_models.yaml budget)"
        info["base"] = str(base)
    stats = Path(info["base"]) / "pretrain_stats.json"
    if stats.is_file():
        import json

        st = json.loads(stats.read_text())
        info["base_pretrain"] = {k: st.get(k) for k in ("steps", "tokens", "final_loss", "wall_seconds")}
        info["base_pretrain"]["test_ppl"] = (st.get("test") or {}).get("ppl")
    # Snapshot the texts: the workflow may rebuild results/corpus while this runs.
    snap = work / "corpus_snapshot"
    snap.mkdir(parents=True, exist_ok=True)
    for name in ("train.txt", "calib.txt", "test.txt"):
        shutil.copyfile(Path(info["corpus"]) / name, snap / name)
    info["corpus_snapshot"] = str(snap)
    if s.mc:
        # Built from the test split with the workflow's parameters (config/config.yaml corpus.mc_task):
        # deterministic, and independent of the workflow's copy.
        from qatlib.offline.mc_task import build_local_mc_task

        task_dir = work / "tasks" / MC_TASK
        mc = build_local_mc_task(snap / "test.txt", task_dir, n=16 if s.micro else 200, task=MC_TASK, seed=0)
        info["mc_task"] = str(task_dir)
        info["mc_items"], info["mc_sha256"] = mc["items"], mc["sha256"]
    return info
