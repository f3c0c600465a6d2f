"""Where a process computes, decided in one place: the device of this rank, the collective backend,
the device object collectives travel on, and the autocast context.

Every launcher (torchrun, ``srun`` + torchrun, a plain ``python``) sets ``LOCAL_RANK`` for each
process (absent = 0). On a CUDA machine rank ``r`` of a node owns ``cuda:LOCAL_RANK`` and must bind
it (`bind`) before the first collective: NCCL runs object collectives (``broadcast_object_list``,
``all_gather_object``) on the *current* device, so an unbound rank sends them from ``cuda:0`` and
8 ranks collide on one GPU while DeepSpeed has put each rank's shards on its own. Without CUDA every
rank computes on the CPU and talks gloo. The same code path serves 1 GPU, 8 GPUs and the CPU:
only `resolve`'s inputs differ.

``QATLIB_DEVICE=cpu`` forces the CPU path on a CUDA machine (e.g. to run the CPU tests there).

The decisions (`resolve`) are pure functions of the environment and what CUDA reports, so they are
unit-tested on a CPU machine; `bind` is the one place that acts on them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Mapping

import torch

FORCE_ENV = "QATLIB_DEVICE"


class DeviceError(RuntimeError):
    """A rank cannot get a device (more local ranks than GPUs, a bad ``QATLIB_DEVICE``)."""


@dataclasses.dataclass(frozen=True)
class RankDevice:
    """This process's place: ranks from the launcher's environment, its device and backend."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str  # "nccl" with CUDA, "gloo" on the CPU

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def _int_env(env: Mapping[str, str], key: str, default: int) -> int:
    raw = env.get(key)
    if raw in (None, ""):
        return default
    try:
        return int(raw)
    except ValueError:
        raise DeviceError(f"environment variable {key}={raw!r} is not an integer") from None


def backend_for(device_type: str) -> str:
    """NCCL for CUDA devices, gloo for the CPU (DeepSpeed's CPU default would want oneCCL)."""
    return "nccl" if device_type == "cuda" else "gloo"


def resolve(
    env: Mapping[str, str] | None = None, *, cuda_available: bool | None = None, n_gpus: int | None = None
) -> RankDevice:
    """The device and backend of this rank, from the launcher's environment (``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE``, ``QATLIB_DEVICE``) and what CUDA reports. Pure: pass ``env``,
    ``cuda_available`` and ``n_gpus`` to decide for another machine (the tests do)."""
    env = os.environ if env is None else env
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if n_gpus is None:
        n_gpus = torch.cuda.device_count() if cuda_available else 0
    local_rank = _int_env(env, "LOCAL_RANK", 0)
    rank = _int_env(env, "RANK", local_rank)
    world = _int_env(env, "WORLD_SIZE", 1)
    forced = env.get(FORCE_ENV, "").strip().lower()
    if forced not in ("", "cpu", "cuda"):
        raise DeviceError(f"{FORCE_ENV}={env.get(FORCE_ENV)!r}: use 'cpu' or 'cuda' (or leave it unset)")
    if forced == "cuda" and not (cuda_available and n_gpus > 0):
        raise DeviceError(f"{FORCE_ENV}=cuda but torch sees no CUDA device")
    if forced == "cpu" or not cuda_available or n_gpus == 0:
        device = torch.device("cpu")
    else:
        if local_rank >= n_gpus:
            raise DeviceError(
                f"LOCAL_RANK={local_rank} but this node has {n_gpus} visible GPU(s): start at most "
                f"{n_gpus} processes per node (torchrun --nproc_per_node / Slurm --gpus-per-node)"
            )
        device = torch.device("cuda", local_rank)
    return RankDevice(rank, local_rank, world, device, backend_for(device.type))


def bind(env: Mapping[str, str] | None = None) -> RankDevice:
    """`resolve`, then make the rank's GPU the current device (``torch.cuda.set_device``). Call it
    before any collective or CUDA allocation; idempotent."""
    rd = resolve(env)
    if rd.is_cuda:
        torch.cuda.set_device(rd.device)
    return rd


def current() -> torch.device:
    """The device this process computes on now: its bound GPU, or the CPU."""
    if resolve().is_cuda:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def collective_device() -> torch.device:
    """The device tensors of a collective must live on: the current GPU under NCCL (which cannot
    move CPU tensors), the CPU under gloo (or with no process group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def use_cpu() -> bool:
    """``TrainingArguments(use_cpu=...)``: True on the CPU path (DeepSpeed on the CPU needs it)."""
    return not resolve().is_cuda


def device_map(configured: str | dict | None = None) -> str | dict | None:
    """``from_pretrained(device_map=...)`` for a single-process stage (PTQ, evaluation): the
    configured map (or ``"auto"``: accelerate spreads a model larger than one GPU over the visible
    GPUs and the host) on the CUDA path, ``None`` (plain CPU tensors) on the CPU path, so that
    ``QATLIB_DEVICE=cpu`` keeps these stages on the CPU of a GPU machine too."""
    if not resolve().is_cuda:
        return None
    return configured or "auto"


WHOLE_MODEL_HEADROOM = 1.2  # a whole-model stage holds the model plus activations and temporaries


def fits_current(nbytes: int, free_bytes: int | None = None) -> bool:
    """Whether a model of ``nbytes`` is evaluated whole on this process's device, read there by
    qatlib's reader (`qatlib.zero3.onload.load_whole`), instead of spread by accelerate's ``device_map``
    (which maps the safetensors files). Always on the CPU path (host RAM is the memory plan's
    concern); on CUDA when the free device memory (``torch.cuda.mem_get_info``, or
    ``free_bytes``) holds it `WHOLE_MODEL_HEADROOM` times: the plan's ``evaluate`` stage makes
    the same choice (the whole model on the device when it fits)."""
    if not resolve().is_cuda:
        return True
    free = free_bytes if free_bytes is not None else torch.cuda.mem_get_info(current())[0]
    return nbytes * WHOLE_MODEL_HEADROOM <= free


def autocast(device: torch.device | str | None = None, dtype: torch.dtype = torch.bfloat16):
    """bf16 autocast on CUDA (matmuls in bf16 on tensor cores, reductions in fp32); a null context
    on the CPU, where CPU autocast would change the numerics the CPU tests pin."""
    device = torch.device(device) if device is not None else current()
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=dtype)
    return contextlib.nullcontext()
