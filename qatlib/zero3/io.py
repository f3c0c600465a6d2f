"""DeepSpeed ZeRO-3 start-up, detection, collectives and run metadata (ZeRO-3 only).

The ZeRO-3 path, in the order a run uses it (upstream design: shared spec qat-zero3.md; steps 2-4
live in `qatlib.zero3.load`, the build / load half, step 6 in `qatlib.zero3.save`):

1. `init_zero3(ds_config)` initialises ``deepspeed.comm`` (gloo on CPU, nccl on GPU, with a
   collective timeout) and registers the HF DeepSpeed config; the returned `Zero3Context` keeps
   that config referenced (transformers only holds a weakref to it).
2. `build_empty_model` builds the model from its config under ``deepspeed.zero.Init`` without
   reading or initialising any weight, then linearises fused MoE experts inside the same context,
   so every parameter is partitioned at creation (per-rank peak ~ model / world).
3. `stream_load_weights` fills the parameters: rank 0 reads the safetensors files tensor by tensor
   and every rank takes part in the same ``GatheredParameters(modifier_rank=0)`` in the same order,
   following a plan of `qatlib.checkpoint.safetensors` (which key fills which parameter slice, by
   transformers' key conversion for the class: `qatlib.checkpoint.conversion`).
4. `prepare_zero3` swaps linears for `QuantLinear` under a fp32 ``zero.Init``, so the new scales are
   partitioned fp32 masters; `stream_load_scales` fills them from a PTQ checkpoint (it works on a
   plain model too, with no collective: `qatlib.models.load_prepared` uses it for every warm start).
5. `check_ds_config` refuses a DeepSpeed config with its own ``optimizer`` block (qatlib builds the
   optimizer itself, with its scale / LWC groups).
6. `qatlib.zero3.save`: ``iter_gathered_modules``, ``consolidated_state_dict``,
   ``save_consolidated`` gather module by module (same collectives on every rank, CPU copies on
   rank 0 only); `run_metadata` records the shares.

Every check that fails raises the same `Zero3Error` on every rank (rank 0 decides, broadcasts the
verdict), so bad input ends the run instead of leaving ranks waiting in a collective. Off ZeRO-3
(a plain model, no process group) all of this runs with no collective at all.

Decisions (measured with DeepSpeed 0.19.8, 2 CPU ranks, gloo; see tests/test_zero3.py):

- Optimizer: qatlib owns it (torch AdamW, scale / LWC groups, passed to ``deepspeed.initialize``
  with ``zero_allow_untested_optimizer``); a config with an ``optimizer`` block is refused.
- MoE: each expert (`qatlib.surgery.moe.ExpertMLP`) is a ZeRO-3 leaf module, gathered alone (correct
  with prefetch on), whatever JSON the user brings: `init_zero3` fills
  ``zero_optimization.leaf_module`` where the JSON has none (`qatlib.zero3.ds_config`), because
  DeepSpeed's own default makes ``Qwen3MoeSparseMoeBlock`` one leaf, a whole layer's experts (1.2
  GB bf16 per Qwen3-30B-A3B layer) on every rank at once. A JSON with its own list keeps it.
  Without any leaf module DeepSpeed's parameter prefetch produced wrong MoE gradients (silently;
  correct with ``stage3_prefetch_bucket_size: 0``). Every expert runs on every rank, so the
  per-expert hooks stay in step whatever the routing.
- Loading: rank 0 reads; a tensor larger than the load chunk (an embedding) is sent to each rank
  as its partition only (`qatlib.zero3.load`), in pieces read straight from the file, never
  gathered whole on every rank nor held whole on rank 0. Saving mirrors it: each rank sends its
  partition of such a tensor to rank 0 in pieces, which rank 0 writes to a shard of its own as
  they arrive (`qatlib.checkpoint.st_write.TensorFileWriter`).
- bf16: quantizer parameters are created under an fp32 ``zero.Init`` and stay fp32 partitions; the
  engine does not cast ZeRO-Init models, and ZeRO-3's optimizer takes its working dtype from the
  (fp32) trainable parameters, so scales are fp32 in forward and in the optimizer. Keep all
  trainable parameters of one optimizer in one dtype (ZeRO-3 flattens them into one buffer).
- ``zero.Init`` gets its dtype through the config's bf16/fp16 flags: its ``dtype=`` argument is
  ignored on accelerators without fp16 (the CPU picks bf16 whatever is asked).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import platform
import resource
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint.layout import (
    CheckpointError,
)
from ..device import bind as bind_device
from ..device import collective_device
from ..surgery.modeling import resolve_dtype
from . import heap, peers
from .ds_config import expert_leaf_issue, leaf_classes, with_defaults

log = logging.getLogger(__name__)

# Above this a tensor moves partition by partition, in pieces of at most this size (load:
# `qatlib.zero3.load`, whose load chunk is the same size; save: `qatlib.zero3.save`), never
# gathered whole on every rank.
PARTITION_BYTES = 64 << 20


class Zero3Error(ValueError):
    """A checkpoint / config problem, raised with the same message on every rank."""


# =========================================================================== detection
def is_zero3_param(p: Any) -> bool:
    """A parameter partitioned by ``deepspeed.zero.Init`` (it carries ``ds_id`` / ``ds_tensor``)."""
    return hasattr(p, "ds_id")


def model_is_zero3(model: nn.Module) -> bool:
    return any(is_zero3_param(p) for p in model.parameters())


def leaf_split_params(model: nn.Module, ds_config: dict | None) -> list[str]:
    """Trainable parameters that belong to more than one ZeRO-3 leaf module under ``ds_config``
    (the outermost module of a leaf class decides, as in DeepSpeed), by name. DeepSpeed reduces a
    leaf's gradients when that leaf's backward ends, so such a parameter (a scale tied across
    experts) loses the gradients of the leaves whose backward runs later: `check_leaf_modules`."""
    wanted = {c.rsplit(".", 1)[-1] for c in leaf_classes(ds_config)} | set(leaf_classes(ds_config))
    owners: dict[int, set[str]] = {}
    inside = None  # the prefix of the leaf being walked (named_modules is pre-order)
    for name, m in model.named_modules():
        if inside is not None and name.startswith(inside):
            continue  # inside a leaf: the outer one owns its parameters
        cls = type(m)
        if cls.__name__ in wanted or f"{cls.__module__}.{cls.__qualname__}" in wanted:
            inside = f"{name}."
            for p in m.parameters():
                owners.setdefault(id(p), set()).add(name)
    return [n for n, p in model.named_parameters() if p.requires_grad and len(owners.get(id(p), ())) > 1]


def check_leaf_modules(model: nn.Module, ds_config: dict | None, *, weights_train: bool) -> None:
    """Refuse, before any step, a ZeRO-3 leaf list that splits a trainable parameter between leaves
    (`leaf_split_params`) while the weights train: the step would fail in DeepSpeed's ``zero_grad``
    (`qatlib.zero3.ds_config.expert_leaf_issue`). Scales alone trained as one process with such a split."""
    if weights_train and (split := leaf_split_params(model, ds_config)):
        why = expert_leaf_issue(ds_config) or (
            "zero_optimization.leaf_module splits these parameters between leaf modules; name a class "
            "that holds all of their users"
        )
        raise Zero3Error(f"{why}. Shared by several leaves: {', '.join(split[:4])}")


def gathered_param_if_zero3(params: torch.Tensor | Iterable[torch.Tensor], modifier_rank: int | None = None):
    """``deepspeed.zero.GatheredParameters`` over the ZeRO-3 parameters among ``params``; a null
    context when there are none (plain models, off ZeRO-3). Every rank must enter it together."""
    if isinstance(params, torch.Tensor):
        params = [params]
    params = [p for p in params if p is not None and is_zero3_param(p)]
    if not params:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)


def sliced_evenly(p: Any) -> bool:
    """Whether ``p``'s ZeRO-3 partitions are the plain slices ``[r * n, (r + 1) * n)`` of its
    flattened tensor over the whole world (rank r holds slice r, the last zero-padded): what
    sending a tensor partition by partition (`qatlib.zero3.load`, loading) and assembling it from
    its partitions (`qatlib.zero3.save`) rely on. Not with hpZ's second partitioning or a
    process group smaller than the world."""
    return (
        is_zero3_param(p)
        and _dist_ready()
        and getattr(p, "ds_secondary_tensor", None) is None
        and torch.distributed.get_world_size(p.ds_process_group) == torch.distributed.get_world_size()
    )


def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def get_rank() -> int:
    return torch.distributed.get_rank() if _dist_ready() else 0


def get_world_size() -> int:
    return torch.distributed.get_world_size() if _dist_ready() else 1


class _Comm:
    """Rank-0-decides helpers. Inactive (no collective at all) for a plain model."""

    def __init__(self, active: bool) -> None:
        self.active = active and _dist_ready()
        self.rank = get_rank() if self.active else 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def bcast(self, obj: Any) -> Any:
        if not self.active:
            return obj
        box = [obj if self.is_main else None]
        torch.distributed.broadcast_object_list(box, src=0, device=collective_device())
        return box[0]

    def decide(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on rank 0 and hand its result to every rank; a `Zero3Error` (or any error)
        raised there is raised on every rank with the same message."""
        result, error = None, None
        if self.is_main:
            try:
                result = fn()
            except (Zero3Error, CheckpointError) as e:
                error = str(e)
            except Exception as e:  # noqa: BLE001 - re-raised on every rank below
                error = f"{type(e).__name__}: {e}"
        result, error = self.bcast((result, error))
        if error is not None:
            raise Zero3Error(error)
        return result

    def barrier(self) -> None:
        if self.active:
            torch.distributed.barrier()


# =========================================================================== start-up
def load_ds_config(ds_config: dict | str | os.PathLike) -> dict:
    """A DeepSpeed config as a dict (a copy), from a dict or a JSON file."""
    if isinstance(ds_config, dict):
        return json.loads(json.dumps(ds_config))
    path = Path(ds_config)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise Zero3Error(f"DeepSpeed config {path} does not exist") from None
    except json.JSONDecodeError as e:
        raise Zero3Error(f"DeepSpeed config {path} is not valid JSON: {e}") from None


def check_ds_config(ds_config: dict, *, source: str = "the DeepSpeed config") -> None:
    """Refuse what qatlib cannot honour: a stage other than 3, and an ``optimizer`` block.

    qatlib owns the optimizer (torch AdamW with separate scale / LWC groups). With an ``optimizer``
    block transformers would build DeepSpeed's optimizer from it instead, silently losing the
    groups (and on CPU, compile ``fused_adam``). A ``scheduler`` block is allowed.
    """
    stage = ds_config.get("zero_optimization", {}).get("stage")
    if stage != 3:
        raise Zero3Error(f"{source}: zero_optimization.stage must be 3 for the ZeRO-3 path; got {stage!r}")
    if "optimizer" in ds_config:
        raise Zero3Error(
            f"{source} has an 'optimizer' block ({ds_config['optimizer'].get('type', '?')}): qatlib builds the "
            "optimizer itself (AdamW with separate scale / LWC learning rates) and DeepSpeed/transformers would "
            "replace it and lose those groups. Remove the block; set the learning rates in the experiment config."
        )


def _precision_dtype(ds_config: dict) -> torch.dtype | None:
    """The dtype the config pins (bf16 / fp16 ``enabled: true``), None when "auto" or absent."""
    for key in ("bf16", "bfloat16", "fp16"):
        if ds_config.get(key, {}).get("enabled") is True:
            return resolve_dtype(key)
    return None


def _resolved_init_config(ds_config: dict, dtype: torch.dtype) -> dict:
    """A copy ``zero.Init`` can parse before TrainingArguments fills the "auto" values."""

    def drop_auto(d: Any) -> Any:
        if isinstance(d, dict):
            return {k: drop_auto(v) for k, v in d.items() if v != "auto"}
        return d

    cfg = drop_auto(ds_config)
    cfg.pop("optimizer", None)
    cfg.pop("scheduler", None)
    cfg.pop("train_batch_size", None)
    cfg["train_micro_batch_size_per_gpu"] = cfg.get("train_micro_batch_size_per_gpu", 1)
    cfg["gradient_accumulation_steps"] = cfg.get("gradient_accumulation_steps", 1)
    cfg["bf16"] = {**cfg.get("bf16", {}), "enabled": dtype == torch.bfloat16}
    cfg["fp16"] = {**cfg.get("fp16", {}), "enabled": dtype == torch.float16}
    return cfg


def inference_ds_config(ctx: Zero3Context) -> dict:
    """The run's DeepSpeed config for an inference-only engine (a partitioned KD teacher): no
    optimizer or scheduler, the "auto" values HF fills for training dropped, the run's dtype."""
    return _resolved_init_config(ctx.ds_config, ctx.dtype)


@dataclasses.dataclass(eq=False)
class Zero3Context:
    """What a ZeRO-3 run keeps alive: the DeepSpeed config, the model dtype and the registered
    ``HfDeepSpeedConfig`` (``hf_config``; transformers holds only a weakref, so dropping this
    object silently turns ZeRO-3 detection off). No module-global state of ours."""

    ds_config: dict
    dtype: torch.dtype
    hf_config: Any
    timeout: datetime.timedelta
    heartbeat: Any = None  # `qatlib.zero3.peers.Heartbeat`: names a dead / hung rank when a collective fails
    _inits: dict = dataclasses.field(default_factory=dict, repr=False)

    def zero_init(self, dtype: torch.dtype | None = None):
        """The ``deepspeed.zero.Init`` context (one object per dtype, re-entered: building it parses the
        config and entering it patches every module class, both too slow to repeat per layer)."""
        import deepspeed

        dtype = dtype or self.dtype
        if dtype not in self._inits:
            # The dtype travels in the config's bf16/fp16 flags, not in Init(dtype=...): DeepSpeed 0.19.8
            # ignores an explicit dtype on accelerators without fp16 (the CPU) and picks bf16.
            cfg = _resolved_init_config(self.ds_config, dtype)
            self._inits[dtype] = deepspeed.zero.Init(config_dict_or_path=cfg)
        return self._inits[dtype]

    def close(self) -> None:
        """End the run cleanly (see `shutdown`)."""
        if self.heartbeat is not None:
            self.heartbeat.stop()
        shutdown()

    def __enter__(self) -> Zero3Context:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # On an error, skip the barrier: the other ranks may never reach it.
        if exc_type is None:
            self.close()
            return
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if exc is not None and peers.is_collective_failure(exc):
            msg = peers.failure_message(exc, self.heartbeat, get_rank(), self.timeout.total_seconds())
            log.error("%s", msg)
            raise peers.CollectiveFailure(msg) from exc

    def scale_init(self):
        """``zero.Init`` for new quantizer parameters: fp32 whatever the model dtype (an Init with the
        model's bf16 would turn ``torch.full(..., dtype=float32)`` scales into bf16)."""
        return self.zero_init(torch.float32)


def shutdown() -> None:
    """Barrier, then destroy the process group. A process that exits with the gloo process group
    alive can abort in its C++ teardown ("terminate called without an active exception", SIGABRT)
    after all its work succeeded, failing the whole torchrun job."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def init_zero3(
    ds_config: dict | str | os.PathLike,
    *,
    dtype: torch.dtype | str | None = None,
    timeout_s: float = 300.0,
    backend: str | None = None,
    return_freed_memory: bool = True,
) -> Zero3Context:
    """Initialise ``deepspeed.comm`` and register the HF DeepSpeed config; call it FIRST (before any
    TrainingArguments or model exists), under ``torchrun``.

    ``dtype``: model dtype (or its name, `qatlib.surgery.modeling.resolve_dtype`) when the config says ``"auto"``
    (default fp32); a config that pins bf16/fp16 wins, and a contradicting ``dtype`` is an error.
    ``timeout_s`` (``global.collective_timeout_s``) bounds every collective of the process group,
    so a rank that dies or hangs ends the run instead of hanging it; leaving the returned context
    on such a failure raises `qatlib.zero3.peers.CollectiveFailure` naming the silent rank (`peers`).
    ``backend``: `qatlib.device`'s choice (nccl with CUDA, else gloo); the rank's GPU
    (``LOCAL_RANK``) is bound first. ``return_freed_memory`` (glibc only) makes
    every host allocation of 1 MiB or more its own mapping, returned to the OS when freed: building
    under ``zero.Init`` allocates each full parameter and frees it after partitioning, and glibc's
    adaptive threshold would otherwise keep those blocks in the heap (measured: +0.27 GiB per rank
    on a 1 GB model, benchmarks/zero3_load.py).
    """
    cfg = load_ds_config(ds_config)
    source = str(ds_config) if not isinstance(ds_config, dict) else "the DeepSpeed config"
    check_ds_config(cfg, source=source)
    cfg = with_defaults(cfg)  # one expert per gather where the JSON names no leaf modules
    pinned = _precision_dtype(cfg)
    dtype = resolve_dtype(dtype) if dtype is not None else None
    dtype = None if dtype == "auto" else dtype
    if pinned is not None and dtype is not None and dtype != pinned:
        raise Zero3Error(f"{source} enables {pinned} but the model dtype is {dtype}; make them agree")
    dtype = pinned or dtype or torch.float32
    cfg.setdefault("zero_allow_untested_optimizer", True)

    import deepspeed
    import deepspeed.ops

    # The shm all-reduce op is only used for inference all-reduce and costs a ~60 s C++ build on CPU.
    with contextlib.suppress(Exception):
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if return_freed_memory:
        heap.mmap_large_allocations()
    # Bind this rank's GPU before the first collective (qatlib.device): NCCL's object collectives run
    # on the current device, which is cuda:0 on every rank until set.
    backend = backend or bind_device().backend
    timeout = datetime.timedelta(seconds=timeout_s)
    deepspeed.init_distributed(dist_backend=backend, timeout=timeout, verbose=False)

    from transformers.integrations import HfDeepSpeedConfig

    hf_config = HfDeepSpeedConfig(cfg)
    heartbeat = peers.Heartbeat(get_rank(), get_world_size()).start() if get_world_size() > 1 else None
    return Zero3Context(cfg, dtype, hf_config, timeout, heartbeat)


# =========================================================================== observability
def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux ``ru_maxrss`` is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_metadata(model: nn.Module | None = None) -> dict:
    """World size, ZeRO stage, the share of each parameter this rank holds and every rank's peak RSS.

    A collective when a process group exists (every rank must call it); rank 0's dict holds all
    ranks' RSS and shares, the others hold their own."""
    import transformers

    stage, shares, local, total, n_params, n_persist = 0, [], 0, 0, 0, 0
    if model is not None:
        for p in model.parameters():
            n_params += 1
            if is_zero3_param(p):
                stage = 3
                held = p.ds_tensor.numel() if p.ds_tensor is not None else 0
                shares.append(held / max(p.ds_numel, 1))
                local += held * p.ds_tensor.element_size() if p.ds_tensor is not None else 0
                total += p.ds_numel * p.element_size()
                n_persist += bool(getattr(p, "ds_persist", False))
            else:
                local += p.numel() * p.element_size()
                total += p.numel() * p.element_size()
    mine = {
        "rank": get_rank(),
        "peak_rss_bytes": peak_rss_bytes(),
        "peak_cuda_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else None,
        "param_bytes_held": local,
        "share_min": min(shares) if shares else 1.0,
        "share_max": max(shares) if shares else 1.0,
        "share_mean": sum(shares) / len(shares) if shares else 1.0,
    }
    ranks = [mine]
    if _dist_ready():
        ranks = [None] * get_world_size()
        torch.distributed.all_gather_object(ranks, mine)
    try:
        import deepspeed

        ds_version = deepspeed.__version__
    except ImportError:  # pragma: no cover
        ds_version = None
    meta = {
        "world_size": get_world_size(),
        "zero_stage": stage,
        "n_params": n_params,
        "n_persistent_params": n_persist,
        "param_bytes_total": total,
        "ranks": ranks,
        "peak_rss_bytes_max": max(r["peak_rss_bytes"] for r in ranks),
        "device": str(collective_device().type),
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "deepspeed": ds_version,
        },
    }
    if get_rank() == 0:
        log.info(
            "run metadata: world %d, ZeRO stage %d, %.1f MB of %.1f MB params held on rank 0, peak RSS %s MB",
            meta["world_size"],
            stage,
            local / 2**20,
            total / 2**20,
            [round(r["peak_rss_bytes"] / 2**20) for r in ranks],
        )
    return meta
