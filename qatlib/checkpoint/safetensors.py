"""Reading safetensors files tensor by tensor, and the plans that map their tensors to parameter
slices (where each key goes is `qatlib.checkpoint.conversion`'s, transformers' own rules).

The reader is hand-written (8-byte header length, JSON header, raw data) and reads with plain file
reads, no mmap: mapped pages would count in the RSS of the reading process (rank 0 of a ZeRO-3
load) for the whole shard. A truncated or corrupt file is found from its header, before any
collective depends on it. `read_elements` reads a range of one tensor (a ZeRO-3 partition, a
piece of one); the writers (`TensorFileWriter`, `ShardWriter`) are `qatlib.checkpoint.st_write`'s.

A plan is built from file headers and a `ModelTensors` (names and FULL shapes, no tensors), so it
knows nothing of how the parameters are stored; the ZeRO-3 loader executes plans on partitioned
parameters (gathers, rank 0 reads), and `copy_entry` applies one entry to ordinary tensors.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import struct
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

# the plans' vocabulary is the key mapping's (re-exported: readers name them through this module)
from .conversion import Assign, ExpertBlock, ModelTensors, model_tensors, place_keys
from .layout import CheckpointError
from .st_write import ST_DTYPES as _ST_DTYPES
from .st_write import numel as _numel

log = logging.getLogger(__name__)

__all__ = ["Assign", "ExpertBlock", "ModelTensors", "PlanEntry", "TensorInfo", "model_tensors", "weight_plan"]

# Checkpoint keys a model never has a parameter for (old checkpoints stored RoPE tables).
DEFAULT_IGNORED_KEYS = (r".*\.rotary_emb\.inv_freq$",)


# =========================================================================== reading
@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor of a safetensors file lies (absolute byte offsets)."""

    file: str
    key: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return _ST_DTYPES[self.dtype]


def read_header(path: str | os.PathLike) -> list[TensorInfo]:
    """The tensors of one file in storage order, after checking the file is complete: a truncated or
    corrupt file is a `CheckpointError` naming it (found here, before anything depends on it)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", raw)
            if 8 + n > size:
                raise CheckpointError(
                    f"{path}: truncated safetensors file (header of {n} bytes, file of {size})"
                )
            header = json.loads(f.read(n))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    base = 8 + n
    out = []
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        try:
            b, e = meta["data_offsets"]
            info = TensorInfo(str(path), key, meta["dtype"], tuple(meta["shape"]), base + b, base + e)
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{path}: corrupt safetensors header entry {key!r} ({err})") from None
        if info.dtype not in _ST_DTYPES:
            raise CheckpointError(f"{path}: tensor {key} has unsupported dtype {info.dtype}")
        if info.end > size:
            raise CheckpointError(
                f"{path}: truncated safetensors file: tensor {key} ends at byte {info.end}, the file has {size}"
            )
        out.append(info)
    return sorted(out, key=lambda i: i.start)


def read_tensor(fh, info: TensorInfo, out: torch.Tensor | None = None) -> torch.Tensor:
    """Read one tensor with plain file reads (no mmap: mapped pages would count in the RSS of the
    reader for the whole shard). With ``out`` (contiguous, same dtype and size) it reads straight
    into it."""
    dtype = _ST_DTYPES[info.dtype]
    nbytes = info.end - info.start
    if out is None:
        buf = torch.empty(nbytes, dtype=torch.uint8)
    else:
        buf = out.view(-1).view(torch.uint8)
        if buf.numel() != nbytes:
            raise CheckpointError(f"{info.file}: {info.key} holds {nbytes} bytes, the target {buf.numel()}")
    fh.seek(info.start)
    if nbytes and fh.readinto(buf.numpy()) != nbytes:
        raise CheckpointError(f"{info.file}: short read of {info.key} (file truncated while loading?)")
    return out if out is not None else buf.view(dtype).reshape(info.shape)


def read_all(files: Sequence[str | os.PathLike]) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors ``files``, each read into its own storage with plain file
    reads (`read_tensor`): safetensors' ``load_file`` maps the file, and the reading process's RSS
    (and a cgroup limit) then counts the mapped pages besides the tensors."""
    out: dict[str, torch.Tensor] = {}
    for path in files:
        with open(path, "rb") as fh:
            for info in read_header(path):
                out[info.key] = read_tensor(fh, info)
    return out


def read_elements(fh, info: TensorInfo, start: int, out: torch.Tensor) -> torch.Tensor:
    """Read elements ``[start, start + out.numel())`` of the flattened tensor ``info`` into ``out``
    (contiguous, the file's dtype) with plain file reads: one partition of a large tensor, or a
    piece of one, without reading the rest. A short read is a `CheckpointError`."""
    dtype = info.torch_dtype
    size = dtype.itemsize
    count = out.numel()
    if out.dtype != dtype or not out.is_contiguous() or out.device.type != "cpu":
        raise CheckpointError(
            f"{info.file}: {info.key} is {dtype}, read into a {out.dtype} {out.device} tensor"
        )
    if start < 0 or info.start + (start + count) * size > info.end:
        raise CheckpointError(
            f"{info.file}: elements [{start}, {start + count}) lie outside {info.key} "
            f"({(info.end - info.start) // size} elements)"
        )
    nbytes = count * size
    fh.seek(info.start + start * size)
    if nbytes and fh.readinto(out.view(-1).view(torch.uint8).numpy()) != nbytes:
        raise CheckpointError(f"{info.file}: short read of {info.key} (file truncated while loading?)")
    return out


# =========================================================================== plans
@dataclasses.dataclass(frozen=True)
class PlanEntry:
    info: TensorInfo
    assigns: tuple[Assign, ...]


def format_problems(where: str, problems: dict[str, list[str]], limit: int = 20) -> str:
    lines = [f"{where}:"]
    for title, items in problems.items():
        if items:
            shown = ", ".join(items[:limit]) + (
                f", ... ({len(items) - limit} more)" if len(items) > limit else ""
            )
            lines.append(f"  {title} ({len(items)}): {shown}")
    return "\n".join(lines)


def _shape_after(shape: Sequence[int], index: tuple | None) -> tuple[int, ...] | None:
    """Shape of ``tensor[index]`` for a tensor of ``shape`` (None when the index does not fit)."""
    if not index:
        return tuple(shape)
    try:
        return tuple(torch.empty(tuple(shape), device="meta")[index].shape)
    except IndexError:
        return None


def _fmt(shape: Sequence[int] | None) -> str:
    return "(does not fit)" if shape is None else str(list(shape))


def _src_shape(shape: Sequence[int], a: Assign) -> tuple[int, ...] | None:
    """Shape of what ``a`` copies from a checkpoint tensor of ``shape``."""
    out = _shape_after(shape, a.src)
    return out if out is None or a.perm is None else tuple(out[i] for i in a.perm)


def weight_plan(
    files: Sequence[str | os.PathLike],
    model: ModelTensors,
    *,
    where: str,
    ignore: Sequence[str] = DEFAULT_IGNORED_KEYS,
) -> list[PlanEntry]:
    """Map every tensor of the weight ``files`` to the parameter slices it fills (the keys placed
    by `qatlib.checkpoint.conversion.place_keys`: transformers' renamings and converters for the
    model, fused and per-expert MoE layouts into fused or linearised experts); any missing,
    unexpected, duplicate, unconvertible or shape-mismatched key is one `CheckpointError` listing
    them all. Tied parameters need only one of their names; keys matching ``ignore`` (regexes) or
    the model class's ignore list are skipped; quantizer parameters (``model.optional``) are
    filled when present and not required."""
    shapes = {**model.params, **model.buffers}
    infos: list[TensorInfo] = []
    duplicate: list[str] = []
    first: dict[str, str] = {}
    for path in files:
        for info in read_header(path):
            if info.key in first:
                duplicate.append(f"{info.key} (in {Path(info.file).name} and {Path(first[info.key]).name})")
                continue
            first[info.key] = info.file
            infos.append(info)
    placed = place_keys({i.key: i.shape for i in infos}, model, ignore)
    covered: dict[str, int] = {}
    seen: dict[tuple, str] = {}
    mismatched = placed.problems["shape mismatch"]
    reported = set(placed.reported)  # targets of mismatched keys: not also listed as missing
    plan = []
    for info in infos:
        assigns = placed.assigns.get(info.key)
        if not assigns:
            continue
        ok = True
        for a in assigns:
            src_shape = _src_shape(info.shape, a)
            dst_shape = _shape_after(shapes[a.target], a.dst)
            if src_shape != dst_shape:
                mismatched.append(
                    f"{info.key}: checkpoint {_fmt(src_shape)} vs model {a.target} {_fmt(dst_shape)}"
                )
                reported.add(a.target)
                ok = False
                break
            piece = (a.target, repr(a.dst))
            if piece in seen:
                duplicate.append(f"{info.key} (also {seen[piece]})")
                ok = False
                break
            seen[piece] = info.key
        if ok:
            for a in assigns:
                covered[a.target] = covered.get(a.target, 0) + _numel(_shape_after(shapes[a.target], a.dst))
            plan.append(PlanEntry(info, tuple(assigns)))
    missing = []
    for name, shape in shapes.items():
        if name in reported or (name in model.optional and name not in covered):
            continue
        if covered.get(name, 0) != _numel(shape):
            missing.append(
                name if name not in covered else f"{name} (partly: {covered[name]}/{_numel(shape)})"
            )
    problems = {"missing": missing, **placed.problems, "duplicate": duplicate}
    if any(problems.values()):
        raise CheckpointError(format_problems(f"checkpoint {where} does not match the model", problems))
    if placed.tied:
        log.info("skipped %d tied checkpoint keys (%s)", len(placed.tied), ", ".join(placed.tied[:5]))
    if placed.skipped:
        log.info(
            "skipped %d ignored checkpoint keys (%s)", len(placed.skipped), ", ".join(placed.skipped[:5])
        )
    return plan


_SCALE_LIKE = re.compile(
    r".*(_scale|\.scale|_zero_point|\.zero_point|clip_factor_w_max|clip_factor_w_min|subgroup_logit)$"
)
_FUSED_SCALE = re.compile(
    r"^(?P<prefix>.+)\.(?P<proj>gate_up_proj|down_proj)"
    r"(?:\.(?P<a>weight_scale|weight_zero_point|input_scale|input_zero_point)"
    r"|_(?P<b>scale|zero_point|input_scale|input_zero_point|weight_scale|weight_zero_point))$"
)


def _fused_scale_assigns(
    key: str, shape: tuple[int, ...], qkeys: dict[str, str], experts: dict[str, ExpertBlock]
) -> list[Assign] | None:
    """Fan a fused-expert scale key (``mlp.experts.gate_up_proj_scale`` or
    ``mlp.experts.gate_up_proj.weight_scale``, leading expert dim) out to each linearised expert's
    quantizer. A gate_up scale whose per-expert slice spans the fused out dim (2I rows) is split
    into gate / up; a per-tensor one applies to both."""
    m = _FUSED_SCALE.match(key)
    blk = experts.get(m["prefix"]) if m else None
    if blk is None or blk.fused:
        return None
    kind = m["a"] or m["b"]
    kind = {"scale": "weight_scale", "zero_point": "weight_zero_point"}.get(kind, kind)
    inter = blk.intermediate_dim
    projs = ("gate_proj", "up_proj") if m["proj"] == "gate_up_proj" else ("down_proj",)
    split = kind.startswith("weight") and len(projs) == 2 and len(shape) >= 3 and shape[1] == 2 * inter
    out = []
    for e in range(blk.num_experts):
        for i, proj in enumerate(projs):
            target = qkeys.get(f"{m['prefix']}.{e}.{proj}.{kind}")
            if target is not None:
                out.append(Assign(target, src=(e, slice(i * inter, (i + 1) * inter)) if split else (e,)))
    return out


def scale_plan(
    files: Sequence[str | os.PathLike], model: ModelTensors, qkeys: dict[str, str], *, where: str
) -> tuple[list[PlanEntry], dict]:
    """Map the scale keys of ``files`` (``qkeys``: checkpoint key -> quantizer parameter) to the
    quantizer parameters; fused-expert keys fan out to every expert. A scale whose shape differs
    from its quantizer's is an error (only a 1-element scalar fills a ``[1]`` scale), as is a
    parameter filled twice. Returns the plan and a report: hits, misses (parameters without a key),
    unused scale-like keys, other (ignored) keys."""
    plan, seen = [], {}
    mismatched, duplicate, unused = [], [], []
    ignored = 0
    for path in files:
        for info in read_header(path):
            key = info.key
            if key in qkeys:
                assigns = [Assign(qkeys[key])]
            else:
                assigns = _fused_scale_assigns(key, info.shape, qkeys, model.experts)
                if assigns is None:
                    if _SCALE_LIKE.fullmatch(key):
                        unused.append(key)
                    else:
                        ignored += 1  # weights of a full checkpoint
                    continue
            ok = True
            for a in assigns:
                src_shape, dst_shape = _shape_after(info.shape, a.src), model.params[a.target]
                if src_shape != dst_shape and not (
                    src_shape is not None and _numel(src_shape) == 1 and dst_shape == (1,)
                ):
                    mismatched.append(f"{key}: checkpoint {_fmt(src_shape)} vs {a.target} {_fmt(dst_shape)}")
                    ok = False
                    break
                if a.target in seen:
                    duplicate.append(f"{key} (also {seen[a.target]})")
                    ok = False
                    break
                seen[a.target] = key
            if ok and assigns:
                plan.append(PlanEntry(info, tuple(assigns)))
    problems = {"shape mismatch": mismatched, "duplicate": duplicate}
    if any(problems.values()):
        raise CheckpointError(
            format_problems(f"PTQ checkpoint {where} does not fit the prepared model", problems)
        )
    misses = sorted(set(qkeys.values()) - set(seen))
    report = {
        "ptq_dir": str(where),
        "files": [Path(p).name for p in files],
        "hits": len(seen),
        "misses": len(misses),
        "unused_keys": len(unused),
        "ignored_keys": ignored,
        "missed_params": misses,
        "unused_key_names": unused,
    }
    return plan, report


# =========================================================================== applying
def chunks(entries: list[PlanEntry], chunk_bytes: int) -> Iterator[list[PlanEntry]]:
    """Consecutive entries of one file, up to ``chunk_bytes`` of source data (at least one entry)."""
    cur: list[PlanEntry] = []
    size = 0
    for e in entries:
        n = e.info.end - e.info.start
        if cur and (e.info.file != cur[0].info.file or size + n > chunk_bytes):
            yield cur
            cur, size = [], 0
        cur.append(e)
        size += n
    if cur:
        yield cur


def copy_entry(
    fh, e: PlanEntry, dest_of: Callable[[str], torch.Tensor], cast: Callable | None = None
) -> None:
    """Read ``e``'s tensor from the open file ``fh`` into its targets (``dest_of(name)``: the tensor
    to write); a whole-tensor, same-dtype CPU target is read into directly."""
    a0 = e.assigns[0]
    if len(e.assigns) == 1 and a0.dst is None and a0.src is None and a0.perm is None and cast is None:
        d = dest_of(a0.target)
        if d.is_contiguous() and d.dtype == _ST_DTYPES[e.info.dtype] and d.device.type == "cpu":
            read_tensor(fh, e.info, out=d)
            return
    t = read_tensor(fh, e.info)
    for a in e.assigns:
        d = dest_of(a.target)
        view = d[a.dst] if a.dst else d
        src = t[a.src] if a.src else t
        if a.perm is not None:
            src = src.permute(a.perm)
        if cast is not None:
            src = cast(src)
        if src.shape != view.shape:  # only a 1-element scalar <-> [1] (validated in the plan)
            src = src.reshape(view.shape)
        view.copy_(src)
