"""DeepSpeed settings that raise a rank's ZeRO-3 peak above what qatlib's defaults give.

Why: a user brings their own DeepSpeed JSON (upstream AngelSlim's, a cluster template), and a
setting in it can make the plan's ZeRO-3 peak unreachable: a leaf list that gathers a whole MoE
layer, a prefetch bucket or a persistence threshold sized for a dense model. qatlib does not
rewrite those keys (the JSON is the user's), but the QAT stage and ``python -m qatlib.plan``
name each such key and what it costs, measured on the plan itself: the stage's per-rank peak
with every modelled key left to qatlib's default (`qatlib.zero3.ds_config`: no ``leaf_module``,
``"auto"`` buckets and thresholds), against the same plan with that one key as the JSON sets
it. Torch-free.
"""

from __future__ import annotations

import copy
from typing import Any

from qatlib.zero3.ds_config import zero_stage

from .model import ModelShape, from_experiment
from .stages import GIB, Run, plan

# keys the plan models; left out, each is what qatlib's defaults give
MODELLED = (
    "leaf_module",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_model_persistence_threshold",
)
# keys the plan does not model: it assumes at most DeepSpeed's default for each
DEEPSPEED_DEFAULT_AT_MOST = {"stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9}
MARGIN = 0.05  # a key that adds more than this fraction of the default peak is named


def _qat_peak(m: ModelShape, raw: dict[str, Any], ds: dict[str, Any], run: Run, dtype: str | None) -> int:
    """One rank's ZeRO-3 QAT peak on ``run``'s world: its working set and host terms (placed as
    on CPU ranks, so that device and host terms add up; which memory holds them does not change
    a key's difference)."""
    cpu = Run(gpus=0, nodes=run.nodes, cpu_ranks=run.ranks_per_node)
    return plan(m, from_experiment(raw, ds, dtype), cpu)[1].host_per_rank


def zero3_setting_warnings(
    m: ModelShape,
    raw: dict[str, Any],
    ds: dict[str, Any] | None,
    run: Run | None = None,
    model_dtype: str | None = None,
) -> list[str]:
    """One line per ``zero_optimization`` key of ``ds`` that raises the ZeRO-3 QAT peak of the
    experiment ``raw`` on model ``m`` (``run``: its ranks) by more than `MARGIN` over qatlib's
    default for that key,
    naming the key, its value and the GiB it adds per rank; and per unmodelled key set above
    DeepSpeed's default. Empty when ``ds`` is not ZeRO-3."""
    if zero_stage(ds) != 3:
        return []
    zo, run = ds["zero_optimization"], run or Run()
    ref_ds = copy.deepcopy(ds)
    for key in MODELLED:
        ref_ds["zero_optimization"].pop(key, None)
    ref = _qat_peak(m, raw, ref_ds, run, model_dtype)  # every modelled key at qatlib's default
    out = []
    for key in MODELLED:
        if key not in zo:
            continue
        one = copy.deepcopy(ref_ds)
        one["zero_optimization"][key] = zo[key]
        peak = _qat_peak(m, raw, one, run, model_dtype)
        if peak - ref > MARGIN * ref:
            out.append(
                f"zero_optimization.{key} = {zo[key]!r} raises the ZeRO-3 QAT peak per rank from "
                f"{ref / GIB:.2f} to {peak / GIB:.2f} GiB (+{(peak - ref) / GIB:.2f}, qatlib.plan); "
                "remove the key for qatlib's default"
            )
    for key, most in DEEPSPEED_DEFAULT_AT_MOST.items():
        value = zo.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > most:
            out.append(
                f"zero_optimization.{key} = {value!r} is above DeepSpeed's default {most:g}: ZeRO-3 may "
                "keep that many more parameters gathered than qatlib.plan assumes"
            )
    return out
