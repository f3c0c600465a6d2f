"""What glibc does with the host memory a CPU rank frees: the one place qatlib sets it.

A ZeRO-3 rank on the CPU allocates and frees a gathered copy of every decoder layer (and its
fake-quantization temporaries) several times a step: teacher forward, forward, checkpointed
recompute, backward. glibc keeps freed heap memory for reuse instead of returning it, and its
arenas fragment, so the resident set climbs with every gather although the live tensors stay at
one layer. Measured on the real-width rehearsal (Qwen3-30B-A3B cut to 1 layer, M = 2.49 GB bf16,
2 gloo ranks, one step; `benchmarks/README.md` at 2faaa77, Memory plan vs measured): rank 0 peaked at 8.6 GB
with `reuse_training_allocations` (6.5 without); ``malloc_trim(0)`` after the teacher forward
alone returned 1.15 GB, and only 19 M elements were still gathered then.

- `mmap_large_allocations` (the build and the streamed loads): allocations above 1 MiB as fresh
  mappings, returned whole when freed;
- `reuse_training_allocations` (the training loop of a small model, `configure_training`): up to
  32 MiB from the heap again, which saves the zero-filling of a fresh mapping for every 1-4 MiB
  temporary of its step; a model whose decoder layer passes the trim limit keeps fresh mappings
  (its temporaries fragment the heap: +1.9 GB per rank on the rehearsal);
- `trim_freed_memory` / `install_layer_trims`: at every decoder-layer boundary of a CPU run, the
  heap's free pages go back to the OS once more than ``limit`` bytes are free in it, so the
  resident set stays near the live tensors.

No library does this: torch's CPU allocator is plain ``malloc``, and neither torch nor DeepSpeed
trims the heap. Every function is a no-op (False) without glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

from torch import nn

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
TRIM_LIMIT = 256 << 20  # free heap bytes tolerated before a trim (also reuse_training_allocations' trim)


class _Mallinfo2(ctypes.Structure):
    """glibc >= 2.33's ``struct mallinfo2`` (size_t fields; ``fordblks``: free bytes in the heap)."""

    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 (glibc, not musl / macOS)
    except (OSError, AttributeError):
        return None
    if hasattr(libc, "mallinfo2"):
        libc.mallinfo2.restype = _Mallinfo2
    return libc


def mmap_large_allocations(threshold: int = 1 << 20) -> bool:
    """glibc ``mallopt(M_MMAP_THRESHOLD, threshold)``; False where there is no glibc."""
    libc = _libc()
    return bool(libc and libc.mallopt(M_MMAP_THRESHOLD, threshold))


def reuse_training_allocations(threshold: int = 32 << 20, trim: int = TRIM_LIMIT) -> bool:
    """glibc, for training (after the build): allocations up to ``threshold`` (glibc's maximum)
    from the heap again, keeping up to ``trim`` freed bytes. `mmap_large_allocations`' 1 MiB
    threshold made each step's 1-4 MiB temporaries (gathered weights, fake-quant copies) fresh
    zero-filled mappings. Default experiment, per rank per step (shared machine): user 10.0 -> 8.7
    CPU-s, system 5.2 -> 1.4 CPU-s; peak RSS 2.3 -> 2.9 GiB per rank."""
    libc = _libc()
    return bool(libc and libc.mallopt(M_TRIM_THRESHOLD, trim) and libc.mallopt(M_MMAP_THRESHOLD, threshold))


def free_heap_bytes() -> int | None:
    """Bytes free inside glibc's heap (``mallinfo2().fordblks``), None where unknown."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    return int(libc.mallinfo2().fordblks)


def trim_freed_memory(limit: int = TRIM_LIMIT) -> bool:
    """``malloc_trim(0)`` when more than ``limit`` bytes are free in the heap (or when that is
    unknown): the free pages, also those between live chunks, go back to the OS. True if it ran."""
    libc = _libc()
    if libc is None:
        return False
    free = free_heap_bytes()
    if free is not None and free <= limit:
        return False
    libc.malloc_trim(0)
    return True


def install_layer_trims(model: nn.Module, trim=trim_freed_memory) -> list:
    """``trim()`` before and after every decoder layer's forward (`qatlib.surgery.modeling.decoder_layers`),
    which under gradient checkpointing also runs inside the backward (the recompute). Returns the
    hook handles. For CPU runs: a GPU rank's layers live in device memory."""
    from ..surgery.modeling import decoder_layers

    def hook(*_args):
        trim()

    _, layers = decoder_layers(model)
    handles = []
    for layer in layers:
        handles.append(layer.register_forward_pre_hook(hook))
        handles.append(layer.register_forward_hook(hook))
    return handles


def layer_bytes(model: nn.Module) -> int:
    """Bytes of the largest decoder layer's parameters (``ds_numel`` under ZeRO-3): what a rank
    gathers at a time."""
    from ..surgery.modeling import decoder_layers

    _, layers = decoder_layers(model)
    return max(
        sum(int(getattr(p, "ds_numel", p.numel())) * p.element_size() for p in layer.parameters())
        for layer in layers
    )


def configure_training(model: nn.Module, device_type: str, limit: int = TRIM_LIMIT) -> dict:
    """The heap policy of a ZeRO-3 training loop: `reuse_training_allocations` when one decoder
    layer is below ``limit`` (a small model: its freed temporaries cost less than the limit, and
    reuse saves their zero-filling), else fresh mappings for everything above 1 MiB, returned
    when freed; on the CPU, `install_layer_trims`. Measured on the 1-layer real-width rehearsal
    (1.25 GB layer): reuse + trims peaked at 6.59 / 5.66 GiB (rank 0 / 1), trims alone at
    4.72 / 4.07, the plan says 6.06 / 3.74; the step took 78 s and 75 s."""
    size = layer_bytes(model)
    reuse = size < limit and reuse_training_allocations(trim=limit)
    trims = (
        install_layer_trims(model, functools.partial(trim_freed_memory, limit))
        if device_type == "cpu"
        else []
    )
    return {"reuse": reuse, "layer_trims": len(trims) // 2, "layer_bytes": size}
