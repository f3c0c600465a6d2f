"""Where a QAT run resumes from (``compression.QAT.resume_ckpt_dir``).

Two kinds of directory are accepted:

- an HF Trainer checkpoint (``checkpoint-N/`` with ``trainer_state.json``), or an output directory
  holding such checkpoints (the last one is used). The Trainer restores model (weights + quantizer
  parameters), optimizer, scheduler, RNG and data position, so an interrupted run ends with the
  same scales as an uninterrupted one;
- a saved model with a scales file beside it: plain HF safetensors weights (a ``fake`` export, i.e.
  ``dequantize(quantize(W))``, or a `qatlib.zero3.save.save_consolidated` directory) plus
  ``quant_scheme.json`` and a safetensors file with the quantizer keys of `qatlib.checkpoint.keys`
  (``scales.safetensors``; LWC clip factors under their module path). Weights are copied
  into the prepared model, scales loaded with `qatlib.zero3.load.stream_load_scales`, and training
  starts at step 0 from there (optimizer state is not part of such a save). When the saved
  weights are exactly the model's own weights or their fake-quantized form at the loaded scales
  (a ``fake`` export or consolidated save of an end-to-end run from the same base model), the
  model keeps its own full-precision weights instead: the student computes the same thing, and
  the KD teacher (the model with quantizers off) stays the original model rather than the
  quantized one. Otherwise (weights trained, e.g. blockwise with ``weight_lr > 0``, or another base
  model) the saved weights are copied, and `qatlib.trainers.end2end.train_end2end` loads the
  original model (``model.model_path``) as a separate KD teacher (`base_model_teacher`).

Under ZeRO-3 a saved model is not loaded here: build the model from it instead
(``zero3_load.build_qat_model(path, ..., from_ptq_ckpt=path)``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open
from torch import nn

from .checkpoint.layout import (
    SCHEME_FILE,
    CheckpointError,
    read_scheme,
    resolve_dir,
    scale_files,
    weight_files,
)
from .checkpoint.saved_keys import written_names
from .quant import QuantScheme
from .quant.quantizer import Quantizer

log = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.json"


class ResumeError(ValueError):
    """``resume_ckpt_dir`` is neither an HF checkpoint nor a saved model with scales."""


def _last_hf_checkpoint(d: Path) -> Path | None:
    from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(str(d)) if d.is_dir() else None
    return Path(last) if last else None


def classify_resume_dir(path: str | os.PathLike) -> tuple[Literal["hf", "saved"], Path]:
    """``("hf", checkpoint_dir)`` or ``("saved", model_dir)``; ResumeError otherwise."""
    p = Path(path)
    if not p.exists():
        raise ResumeError(f"resume_ckpt_dir {p} does not exist")
    if (p / TRAINER_STATE).is_file():
        return "hf", p
    last = _last_hf_checkpoint(p)
    if last is not None:
        return "hf", last
    try:
        d = resolve_dir(p)
    except CheckpointError:
        d = None
    if d is not None and scale_files(d):
        return "saved", d
    raise ResumeError(
        f"resume_ckpt_dir {p}: neither an HF Trainer checkpoint ({TRAINER_STATE}, or checkpoint-N folders) nor a "
        f"saved model with {SCHEME_FILE} and safetensors scales beside its weights"
    )


def saved_world_size(ckpt: Path) -> int | None:
    """How many ranks wrote an HF Trainer checkpoint: DeepSpeed's per-rank optimizer partitions
    (``global_step*/zero_pp_rank_<r>_mp_rank_*_optim_states.pt``), else the Trainer's RNG states
    (``rng_state.pth`` for one process, ``rng_state_<r>.pth`` per rank); None when neither is there."""
    zero = {p.name.split("_")[3] for p in ckpt.glob("global_step*/zero_pp_rank_*_mp_rank_*_optim_states.pt")}
    if zero:
        return len(zero)
    ranked = list(ckpt.glob("rng_state_*.pth"))
    if ranked:
        return len(ranked)
    return 1 if (ckpt / "rng_state.pth").is_file() else None


def check_resume_world_size(path: str | os.PathLike, world_size: int) -> None:
    """ResumeError when ``resume_ckpt_dir`` is an HF checkpoint written by another number of ranks.

    ZeRO-3 partitions the optimizer state per rank (DeepSpeed reads back exactly its own
    partition), and the data position and RNG state are per rank: another world size would fail
    deep inside DeepSpeed's loader, or silently train on a different batch order. A saved model
    (consolidated save / fake export) holds no per-rank state and resumes at any world size."""
    kind, ckpt = classify_resume_dir(path)
    if kind != "hf":
        return
    saved = saved_world_size(ckpt)
    if saved is not None and saved != world_size:
        raise ResumeError(
            f"resume_ckpt_dir {ckpt}: written by {saved} rank(s), this run has {world_size}: resume with "
            f"{saved} rank(s), or start a new run from a saved model (the consolidated QAT save) at "
            "any world size"
        )


def _quantizer_prefixes(model: nn.Module) -> tuple[str, ...]:
    return tuple(f"{n}." for n, m in model.named_modules() if isinstance(m, Quantizer))


def _saved_keys(model_dir: str | os.PathLike):
    """``(key, open safetensors handle)`` for every tensor of the weight files in ``model_dir``."""
    for f in weight_files(model_dir):
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                yield key, fh


@torch.no_grad()
def load_saved_weights(model: nn.Module, model_dir: str | os.PathLike) -> int:
    """Copy every non-quantizer parameter / persistent buffer of a (prepared, non-ZeRO) model from
    the safetensors files in ``model_dir``. Missing, unexpected and mis-shaped keys are errors;
    tied parameters need one of their names. Returns the number of tensors loaded."""
    model_dir = Path(model_dir)
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        raise ResumeError(
            "a ZeRO-3 model cannot be filled here: build it from the saved directory instead "
            "(zero3_load.build_qat_model(path, ..., from_ptq_ckpt=path))"
        )
    qpre = _quantizer_prefixes(model)
    keys = written_names(model)  # a linearised expert under the hub's key (Mixtral: ...w1.weight)
    targets: dict[str, torch.Tensor] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if not n.startswith(qpre):
            targets.update(dict.fromkeys(keys(n), p))
    for mname, m in model.named_modules():
        for bname, b in m.named_buffers(recurse=False):
            full = f"{mname}.{bname}" if mname else bname
            if b is not None and bname not in m._non_persistent_buffers_set and not full.startswith(qpre):
                targets.update(dict.fromkeys(keys(full), b))
    if not weight_files(model_dir):
        raise ResumeError(f"{model_dir}: no weight files (*.safetensors)")
    filled: set[int] = set()
    unexpected, mismatched = [], []
    n = 0
    for key, fh in _saved_keys(model_dir):
        dst = targets.get(key)
        if dst is None:
            if not key.endswith(("inv_freq",)):
                unexpected.append(key)
            continue
        t = fh.get_tensor(key)
        if tuple(t.shape) != tuple(dst.shape):
            mismatched.append(f"{key}: file {list(t.shape)} vs model {list(dst.shape)}")
            continue
        dst.copy_(t.to(dst.dtype))
        filled.add(id(dst))
        n += 1
    missing = sorted({k for k, t in targets.items() if id(t) not in filled})
    if unexpected or mismatched or missing:
        parts = [
            f"{what} ({len(v)}): {', '.join(v[:8])}"
            for what, v in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", mismatched))
            if v
        ]
        raise ResumeError(f"{model_dir} does not match the model: " + "; ".join(parts))
    return n


@torch.no_grad()
def saved_weights_derive_from(model: nn.Module, model_dir: str | os.PathLike) -> bool:
    """True when every weight tensor in ``model_dir`` equals the model's own, or for a quantized
    linear its fake-quantized weight at the model's current scales: the save adds nothing the
    model's full-precision weights and scales do not already give."""
    from .quant.linear import QuantLinear

    if any(hasattr(p, "ds_id") for p in model.parameters()):
        return False
    qpre = _quantizer_prefixes(model)
    keys = written_names(model)  # a linearised expert under the hub's key (Mixtral: ...w1.weight)
    own = {
        k: p
        for n, p in model.named_parameters(remove_duplicate=False)
        if not n.startswith(qpre)
        for k in keys(n)
    }
    qlinears = {
        k: m for n, m in model.named_modules() if isinstance(m, QuantLinear) for k in keys(f"{n}.weight")
    }
    seen = 0
    for key, fh in _saved_keys(model_dir):
        mine = own.get(key)
        if mine is None:
            continue
        t = fh.get_tensor(key)
        if t.shape != mine.shape or t.dtype != mine.dtype:
            return False
        if not torch.equal(t, mine):
            ql = qlinears.get(key)
            if ql is None or ql.weight_quantizer is None or not torch.equal(t, ql.fake_quant_weight()):
                return False
        seen += 1
    return seen > 0


def load_saved_model(
    model: nn.Module, model_dir: str | os.PathLike, scheme: QuantScheme | None = None
) -> dict:
    """Quantizer parameters (``stream_load_scales``) and, unless they derive from the model's own
    (`saved_weights_derive_from`; see the module docstring), weights (`load_saved_weights`) of a
    saved model into a prepared, non-ZeRO ``model``. ``scheme`` defaults to the directory's
    ``quant_scheme.json``. Returns the scale loader's report plus ``weights`` (tensors copied) and
    ``kept_base_weights``."""
    from .zero3.load import stream_load_scales

    model_dir = Path(model_dir)
    if scheme is None:
        scheme = read_scheme(model_dir)
    report = stream_load_scales(model, model_dir, scheme)
    if report.get("hits", 0) == 0:
        raise ResumeError(f"{model_dir}: no quantizer parameter found in its safetensors files")
    keep = saved_weights_derive_from(model, model_dir)
    report["weights"] = 0 if keep else load_saved_weights(model, model_dir)
    report["kept_base_weights"] = keep
    if keep:
        log.info(
            "resumed scales (%d) from %s; its weights are this model's (fake-quantized), so the "
            "full-precision weights are kept",
            report["hits"],
            model_dir,
        )
    else:
        log.info(
            "resumed weights (%d tensors) and scales (%d) from %s",
            report["weights"],
            report["hits"],
            model_dir,
        )
    return report
