"""The ZeRO-3 consolidated save: every rank walks the model gathered module by module, rank 0
writes one HF checkpoint (+ the scales) that loads without DeepSpeed.

The save half of the ZeRO-3 path (`qatlib.zero3.io` holds start-up, collectives and run metadata,
`qatlib.zero3.load` the build / load half). A tensor above ``partition_bytes`` (an embedding, the
head) is never gathered whole: each rank sends its partition to rank 0 in pieces, which rank 0
writes to a shard of its own as they arrive (`qatlib.checkpoint.st_write.TensorFileWriter`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from ..checkpoint.keys import key_of, scale_keys
from ..checkpoint.layout import (
    RUN_METADATA_FILE,
    SCALES_FILE,
    SCHEME_FILE,
    AtomicDir,
    name_weight_shards,
    write_json,
)
from ..checkpoint.saved_keys import expert_names
from ..checkpoint.st_write import TensorFileWriter
from ..device import collective_device
from ..quant import Quantizer, QuantLinear, QuantScheme
from ..quant.linear import prepared_scheme
from ..quant.tying import param_aliases
from .io import (
    PARTITION_BYTES,
    Zero3Error,
    _Comm,
    _dist_ready,
    gathered_param_if_zero3,
    get_rank,
    get_world_size,
    is_zero3_param,
    run_metadata,
    sliced_evenly,
)

log = logging.getLogger(__name__)

# A consolidated save's shard size: what rank 0 buffers before writing (qatlib.plan mirrors it).
SAVE_SHARD_BYTES = 512 << 20


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

    - ``model.safetensors`` (or shards + index): plain HF weights under the keys ``from_pretrained``
      reads (`qatlib.checkpoint.saved_keys.expert_names`: linearised experts under the hub's
      per-expert keys, Mixtral's ``block_sparse_moe.experts.{e}.w1.weight``), plus ``config.json``;
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
    # a linearised expert's weight under the key from_pretrained fills it from (Mixtral:
    # ``block_sparse_moe.experts.{e}.w1.weight``); every other tensor under its module name
    key = expert_names(model, lambda p: p.ds_shape if is_zero3_param(p) else p.shape)

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
                    write_streamed(key(full), t)
                    continue
                if full.startswith(quant_prefixes):
                    for name_ in (full, *aliases.get(full, ())):  # a tied scale: under every member's key
                        if name_ in param_key:
                            scales[param_key[name_]] = t.float().contiguous().clone()  # own storage per key
                    continue
                pending[key(full)] = t.contiguous()
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
