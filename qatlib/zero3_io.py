"""DeepSpeed ZeRO-3 start-up, collectives, the gathered save and run metadata (ZeRO-3 only).

The ZeRO-3 path, in the order a run uses it (upstream design: shared spec qat-zero3.md; steps 2-4
live in `qatlib.zero3_load`, the build / load half):

1. `init_zero3(ds_config)` initialises ``deepspeed.comm`` (gloo on CPU, nccl on GPU, with a
   collective timeout) and registers the HF DeepSpeed config; the returned `Zero3Context` keeps
   that config referenced (transformers only holds a weakref to it).
2. `build_empty_model` builds the model from its config under ``deepspeed.zero.Init`` without
   reading or initialising any weight, then linearises fused MoE experts inside the same context,
   so every parameter is partitioned at creation (per-rank peak ~ model / world).
3. `stream_load_weights` fills the parameters: rank 0 reads the safetensors files tensor by tensor
   and every rank takes part in the same ``GatheredParameters(modifier_rank=0)`` in the same order,
   following a plan of `qatlib.checkpoint.safetensors` (which key fills which parameter slice).
4. `prepare_zero3` swaps linears for `QuantLinear` under a fp32 ``zero.Init``, so the new scales are
   partitioned fp32 masters; `stream_load_scales` fills them from a PTQ checkpoint (it works on a
   plain model too, with no collective: `qatlib.models.load_prepared` uses it for every warm start).
5. `check_ds_config` refuses a DeepSpeed config with its own ``optimizer`` block (qatlib builds the
   optimizer itself, with its scale / LWC groups).
6. `iter_gathered_modules`, `consolidated_state_dict`, `save_consolidated` gather module by module
   (same collectives on every rank, CPU copies on rank 0 only); `run_metadata` records the shares.

Every check that fails raises the same `Zero3Error` on every rank (rank 0 decides, broadcasts the
verdict), so bad input ends the run instead of leaving ranks waiting in a collective. Off ZeRO-3
(a plain model, no process group) all of this runs with no collective at all.

Decisions (measured with DeepSpeed 0.19.8, 2 CPU ranks, gloo; see tests/test_zero3.py):

- Optimizer: qatlib owns it (torch AdamW, scale / LWC groups, passed to ``deepspeed.initialize``
  with ``zero_allow_untested_optimizer``); a config with an ``optimizer`` block is refused.
- MoE: each expert (`qatlib.moe.ExpertMLP`) is a ZeRO-3 leaf module, gathered alone (correct
  with prefetch on), whatever JSON the user brings: `init_zero3` fills
  ``zero_optimization.leaf_module`` where the JSON has none (`qatlib.ds_config`), because
  DeepSpeed's own default makes ``Qwen3MoeSparseMoeBlock`` one leaf, a whole layer's experts (1.2
  GB bf16 per Qwen3-30B-A3B layer) on every rank at once. A JSON with its own list keeps it.
  Without any leaf module DeepSpeed's parameter prefetch produced wrong MoE gradients (silently;
  correct with ``stage3_prefetch_bucket_size: 0``). Every expert runs on every rank, so the
  per-expert hooks stay in step whatever the routing.
- Loading: rank 0 reads; a tensor larger than the load chunk (an embedding) is sent to each rank
  as its partition only (`qatlib.zero3_load`), in pieces read straight from the file, never
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
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import heap, peers
from .checkpoint.keys import key_of, scale_keys
from .checkpoint.layout import (
    RUN_METADATA_FILE,
    SCALES_FILE,
    SCHEME_FILE,
    AtomicDir,
    CheckpointError,
    name_weight_shards,
    write_json,
)
from .checkpoint.st_write import TensorFileWriter
from .device import bind as bind_device
from .device import collective_device
from .ds_config import with_defaults
from .models import resolve_dtype
from .quant import Quantizer, QuantLinear, QuantScheme
from .quant.linear import prepared_scheme
from .quant.tying import param_aliases

log = logging.getLogger(__name__)

# A consolidated save's shard size: what rank 0 buffers before writing (qatlib.plan mirrors it).
SAVE_SHARD_BYTES = 512 << 20
# Above this a tensor moves partition by partition, in pieces of at most this size (load:
# `qatlib.zero3_load`, whose load chunk is the same size; save: `save_consolidated`), never
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
    sending a tensor partition by partition (`qatlib.zero3_load`, loading) and assembling it from
    its partitions (`save_consolidated`) rely on. Not with hpZ's second partitioning or a
    process group smaller than the world."""
    return (
        is_zero3_param(p)
        and _dist_ready()
        and getattr(p, "ds_secondary_tensor", None) is None
        and torch.distributed.get_world_size(p.ds_process_group) == torch.distributed.get_world_size()
    )


def _partition_pieces(p: torch.Tensor, piece_bytes: int) -> Iterator[torch.Tensor]:
    """``p``'s flattened elements in order on rank 0, in CPU pieces of at most ``piece_bytes``;
    every other rank sends its partition's pieces (only its elements inside the tensor: never the
    padding) and yields nothing. Every rank must exhaust it, the same parameters in the same order.
    Rank 0's pieces are views of its own partition or of one reused receive buffer: each is valid
    until the next is asked for."""
    dev, n, numel = collective_device(), p.ds_tensor.numel(), p.ds_numel
    k = max(1, min(n, piece_bytes // p.element_size()))
    part = p.ds_tensor.detach().view(-1)
    rank = get_rank()
    if rank != 0:
        buf = None if part.device == dev else torch.empty(k, dtype=p.dtype, device=dev)
        valid = max(0, min(n, numel - rank * n))
        for lo in range(0, valid, k):
            m = min(k, valid - lo)
            piece = part[lo : lo + m]
            if buf is not None:
                piece = buf[:m].copy_(piece)
            torch.distributed.send(piece, dst=0)
        return
    buf = None
    for r in range(get_world_size()):
        valid = max(0, min(n, numel - r * n))
        for lo in range(0, valid, k):
            m = min(k, valid - lo)
            if r == 0:
                yield part[lo : lo + m].cpu()
                continue
            if buf is None:
                buf = torch.empty(k, dtype=p.dtype, device=dev)
            torch.distributed.recv(buf[:m], src=r)
            yield buf[:m].cpu()


class _PartitionStream:
    """A partitioned parameter on its way to rank 0 in pieces (`_partition_pieces`): rank 0's
    consumer iterates it (``save_consolidated`` writes each piece to the file as it comes);
    `_iter_full_tensors` drains what is left on every rank, so each rank's sends and rank 0's
    receives match whatever the consumer did (e.g. stopped writing after an error). A failed
    send / receive is raised again by `drain` (whatever the consumer caught): the collectives
    are out of step."""

    def __init__(self, p: torch.Tensor, piece_bytes: int) -> None:
        self.dtype = p.dtype
        self.shape = tuple(p.ds_shape)
        self._pieces = _partition_pieces(p, piece_bytes)
        self._failed: BaseException | None = None

    def __iter__(self) -> _PartitionStream:
        return self

    def __next__(self) -> torch.Tensor:
        try:
            return next(self._pieces)
        except StopIteration:
            raise
        except BaseException as e:
            self._failed = e
            raise

    def drain(self) -> None:
        if self._failed is not None:
            raise self._failed
        for _ in self:
            pass


def _partitions_to_rank0(p: torch.Tensor) -> torch.Tensor | None:
    """``p`` whole on rank 0 (a CPU tensor), sent there partition by partition; None elsewhere.
    Every rank must call it. Gathering instead puts the whole tensor on every rank, twice under
    gloo (its all-gather writes a flat copy first): +1.2 GB per rank for a 0.62 GB embedding."""
    dev, n, numel = collective_device(), p.ds_tensor.numel(), p.ds_numel
    if get_rank() != 0:
        torch.distributed.send(p.ds_tensor.detach().to(dev).contiguous(), dst=0)
        return None
    full = torch.empty(numel, dtype=p.dtype)
    piece = torch.empty(n, dtype=p.dtype, device=dev)
    for r in range(get_world_size()):
        lo, hi = r * n, min((r + 1) * n, numel)
        if r == 0:
            src = p.ds_tensor.detach()
        else:
            torch.distributed.recv(piece, src=r)
            src = piece
        if hi > lo:
            full[lo:hi].copy_(src[: hi - lo])
    return full.view(tuple(p.ds_shape))


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
    heartbeat: Any = None  # `qatlib.peers.Heartbeat`: names a dead / hung rank when a collective fails
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

    ``dtype``: model dtype (or its name, `qatlib.models.resolve_dtype`) when the config says ``"auto"``
    (default fp32); a config that pins bf16/fp16 wins, and a contradicting ``dtype`` is an error.
    ``timeout_s`` (``global.collective_timeout_s``) bounds every collective of the process group,
    so a rank that dies or hangs ends the run instead of hanging it; leaving the returned context
    on such a failure raises `qatlib.peers.CollectiveFailure` naming the silent rank (`peers`).
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


# =========================================================================== gather / save
def iter_gathered_modules(
    model: nn.Module,
    unit_types: tuple[type, ...] = (QuantLinear,),
    leave: Callable[[list[torch.Tensor]], bool] | None = None,
) -> Iterator[tuple[str, nn.Module]]:
    """Walk ``model`` one unit at a time with the unit's parameters gathered (read-only) on every rank.

    A unit is a module of ``unit_types`` (with all its descendants: a `QuantLinear` comes with its
    weight and quantizers) or any other module owning parameters directly. Each parameter is in
    exactly one unit. Every rank must run the loop to its end (the gathers are collectives); only
    the full tensors of one unit are alive at a time. Off ZeRO-3 nothing is gathered, nor is a
    unit whose parameter list ``leave`` accepts (the caller reads those itself).
    """
    skip = None
    for name, m in model.named_modules():
        if skip is not None and (name == skip or name.startswith(skip + ".")):
            continue
        skip = None
        params = _unit_params(m, unit_types)
        if isinstance(m, unit_types):
            skip = name
        elif not params and not any(b not in m._non_persistent_buffers_set for b in m._buffers):
            continue
        with (
            contextlib.nullcontext()
            if leave is not None and leave(params)
            else gathered_param_if_zero3(params)
        ):
            yield name, m


def _unit_params(m: nn.Module, unit_types: tuple[type, ...]) -> list[torch.Tensor]:
    """The parameters one unit gathers: all of a ``unit_types`` module's, else its own only."""
    return list(m.parameters(recurse=isinstance(m, unit_types)))


def _unit_tensors(name: str, m: nn.Module, unit_types) -> Iterator[tuple[str, torch.Tensor]]:
    prefix = f"{name}." if name else ""
    if isinstance(m, unit_types):
        for pname, p in m.named_parameters():
            yield prefix + pname, p
        for mname, sub in m.named_modules():
            for bname, b in sub.named_buffers(recurse=False):
                if b is not None and bname not in sub._non_persistent_buffers_set:
                    yield prefix + (f"{mname}.{bname}" if mname else bname), b
    else:
        for pname, p in m.named_parameters(recurse=False):
            yield prefix + pname, p
        for bname, b in m.named_buffers(recurse=False):
            if b is not None and bname not in m._non_persistent_buffers_set:
                yield prefix + bname, b


def _iter_full_tensors(
    model: nn.Module,
    keep: bool,
    partition_bytes: int = PARTITION_BYTES,
    stream: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, nn.Module, dict[str, torch.Tensor | _PartitionStream], bool]]:
    """(unit name, unit, {full name: CPU clone}, assembled) per unit; clones only when ``keep``
    (rank 0). A unit that is one parameter above ``partition_bytes`` (an embedding, an output
    head) is not gathered: rank 0 assembles it from the ranks' partitions (`_partitions_to_rank0`)
    and ``assembled`` is True; or, when ``stream(full name)`` says so (the same answer on every
    rank), rank 0 gets a `_PartitionStream` of its pieces (at most ``partition_bytes`` each) in
    place of the tensor, and whatever of it the consumer did not read is received (and dropped)
    before the next unit. Tied parameters appear once, under their first name (as
    ``named_parameters`` gives them)."""
    unit_types = (QuantLinear,)
    seen: set[int] = set()

    def assembled(params: list[torch.Tensor]) -> bool:
        return (
            len(params) == 1
            and sliced_evenly(params[0])
            and params[0].ds_numel * params[0].element_size() > partition_bytes
        )

    for name, m in iter_gathered_modules(model, unit_types, leave=assembled):
        direct = assembled(_unit_params(m, unit_types))
        out: dict[str, torch.Tensor | _PartitionStream] = {}
        streams = []
        for full, t in _unit_tensors(name, m, unit_types):
            if id(t) in seen:
                continue
            seen.add(id(t))
            if direct and is_zero3_param(t) and stream is not None and stream(full):
                streams.append(_PartitionStream(t, partition_bytes))  # sent while rank 0 reads it
                if keep:
                    out[full] = streams[-1]
            elif direct and is_zero3_param(t):
                whole = _partitions_to_rank0(t)  # every rank: point-to-point sends
                if keep:
                    out[full] = whole
            elif keep:
                out[full] = t.detach().to("cpu", copy=True)
        yield name, m, out, direct
        for s_ in streams:  # every rank: the sends (ranks > 0), what rank 0 left unread
            s_.drain()


def consolidated_state_dict(
    model: nn.Module, partition_bytes: int = PARTITION_BYTES
) -> dict[str, torch.Tensor]:
    """The full state dict (parameters + persistent buffers, module names, CPU copies) on rank 0;
    ``{}`` on the other ranks, whose peak stays ~ one unit. Every rank must call it."""
    keep = get_rank() == 0
    sd: dict[str, torch.Tensor] = {}
    for _, _, tensors, _ in _iter_full_tensors(model, keep, partition_bytes):
        sd.update(tensors)
    return sd


def save_consolidated(
    model: nn.Module,
    out_dir: str | os.PathLike,
    *,
    scheme: QuantScheme | None = None,
    max_shard_bytes: int = SAVE_SHARD_BYTES,
    partition_bytes: int = PARTITION_BYTES,
    overwrite: bool = True,
    add_files: Callable[[Path], None] | None = None,
) -> Path | None:
    """Save a (prepared, maybe partitioned) model so that it reloads WITHOUT DeepSpeed:

    - ``model.safetensors`` (or shards + index): plain HF weights under the model's names (linearised
      experts as the per-expert keys ``save_pretrained`` writes), plus ``config.json``;
      ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads them;
    - ``scales.safetensors`` + ``quant_scheme.json`` (prepared models): the quantizer parameters
      under the docs/design.md keys (LWC: the derived ``weight_scale`` and the clip factors), so the
      directory is also a PTQ checkpoint: ``prepare(model, scheme)`` + `stream_load_scales` restores
      the exact QAT model;
    - ``run_metadata.json`` (`run_metadata`);
    - whatever ``add_files(tmp_dir)`` writes (rank 0; e.g. the tokenizer and the train log), in
      the same temporary folder, so they are part of the one atomic commit.

    Every rank runs the same gathers unit by unit; rank 0 alone keeps CPU copies and flushes a shard
    once ``max_shard_bytes`` accumulate, writing into a temporary sibling directory renamed at the end
    (no half-written ``out_dir``). A tensor above ``partition_bytes`` is not gathered: each rank
    sends its partition to rank 0 in pieces of at most ``partition_bytes``, which rank 0 writes to
    a shard of its own as they arrive (`TensorFileWriter`: safetensors has no streaming
    writer), never holding the tensor whole. Rank 0's peak: its shard of the model,
    ``max_shard_bytes`` and one unit (issue #16: the 2 GiB buffer this used to default to was the
    2-layer rehearsal's rank-0 peak; assembling an embedding whole was the next one). Returns the
    path on rank 0, None elsewhere.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    rank0 = get_rank() == 0
    comm = _Comm(_dist_ready())
    scheme = scheme or prepared_scheme(model)
    param_key = scale_keys(model)
    aliases: dict[str, list[str]] = {}
    for alias, canon in param_aliases(model).items():
        aliases.setdefault(canon, []).append(alias)
    target = AtomicDir(out_dir, overwrite=overwrite)
    tmp = comm.decide(target.open)  # rank 0 creates it; the others never write
    shards: list[tuple[Path, list[str]]] = []
    pending: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    pending_bytes = 0
    error: str | None = None  # rank 0's write failure: the gathers go on (collectives), then raised

    def flush() -> None:
        nonlocal pending, pending_bytes
        if pending:
            path = tmp / f"shard-{len(shards):05d}.safetensors"
            save_file(pending, str(path), metadata={"format": "pt"})
            shards.append((path, list(pending)))
            pending, pending_bytes = {}, 0

    def write_streamed(full: str, pieces: _PartitionStream) -> None:
        """A shard holding only ``full``, written piece by piece as the ranks send them. A write
        error stops the writing, not the receiving: the pieces left are drained by
        `_iter_full_tensors` (the other ranks send them whatever happens here)."""
        path = tmp / f"shard-{len(shards):05d}.safetensors"
        with TensorFileWriter(path, full, pieces.dtype, pieces.shape, metadata={"format": "pt"}) as w:
            for piece in pieces:
                w.write(piece)
        shards.append((path, [full]))

    quant_prefixes = tuple(f"{n}." for n, m in model.named_modules() if isinstance(m, Quantizer))

    def streamed(full: str) -> bool:
        """Every rank, the same answer: an assembled tensor streams to its file, but a quantizer
        parameter comes whole (a scale is converted and stored under every tied member's key)."""
        return not full.startswith(quant_prefixes)

    for name, m, tensors, assembled in _iter_full_tensors(model, rank0, partition_bytes, streamed):
        if not rank0 or error is not None:
            continue
        try:
            if assembled:
                flush()  # alone in its shard: the buffer never holds it beside a full shard
            for full, t in tensors.items():
                if isinstance(t, _PartitionStream):
                    write_streamed(full, t)
                    continue
                if full.startswith(quant_prefixes):
                    for name_ in (full, *aliases.get(full, ())):  # a tied scale: under every member's key
                        if name_ in param_key:
                            scales[param_key[name_]] = t.float().contiguous().clone()  # own storage per key
                    continue
                pending[full] = t.contiguous()
                pending_bytes += t.numel() * t.element_size()
            if isinstance(m, QuantLinear) and m.weight_quantizer is not None and m.weight_quantizer.uses_lwc:
                with (
                    torch.no_grad()
                ):  # the LWC-derived scale, what a PTQ checkpoint / export calls weight_scale
                    s, zp = m.weight_quantizer.qparams(m.weight.detach().float())
                scales[key_of(name, "weight", "scale")] = s.detach().float().cpu().contiguous()
                if zp is not None:
                    scales[key_of(name, "weight", "zero_point")] = zp.detach().float().cpu().contiguous()
            if assembled or pending_bytes >= max_shard_bytes:
                flush()
        except Exception as e:  # noqa: BLE001 - raised on every rank by finish()
            error = f"saving {out_dir} failed at {name or 'the root module'}: {type(e).__name__}: {e}"
            pending, scales = {}, {}
    meta = run_metadata(model)

    def finish() -> None:
        try:
            if error is not None:
                raise Zero3Error(error)
            flush()
            name_weight_shards(tmp, shards)
            model.config.save_pretrained(tmp)
            if getattr(model, "generation_config", None) is not None:
                with contextlib.suppress(Exception):
                    model.generation_config.save_pretrained(tmp)
            if scales:
                save_file(scales, str(tmp / SCALES_FILE), metadata={"format": "pt"})
                if scheme is not None:
                    write_json(tmp / SCHEME_FILE, scheme.to_dict())
            write_json(tmp / RUN_METADATA_FILE, meta)
            if add_files is not None:
                add_files(tmp)
            target.commit()
        except BaseException:
            target.abort()  # no half-written output
            raise
        log.info(
            "saved consolidated model to %s (%d weight files, %d scale tensors)",
            out_dir,
            max(len(shards), 1),
            len(scales),
        )

    comm.decide(finish)
    return out_dir if rank0 else None


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
