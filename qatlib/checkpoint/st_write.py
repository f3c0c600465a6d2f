"""Writing safetensors files with one tensor (or one piece of one) in memory at a time.

Hand-written because safetensors 0.8 has no streaming writer: ``save_file`` / ``serialize_file``
take every tensor of a file as one buffer in memory (a ``TensorSpec`` is a data pointer and
length), so a file is held whole while it is written. Two writers, each producing the bytes
``save_file`` writes for the same tensors and metadata (tests/test_checkpoint.py):

- `TensorFileWriter`: a file of ONE tensor whose bytes arrive in pieces (the ZeRO-3 consolidated
  save: rank 0 writes each rank's partition of a 0.58 GiB embedding as it is received);
- `ShardWriter`: a file of MANY tensors that arrive one by one (the streamed export: each
  tensor's bytes go to a spill file beside the shard as it is computed; `close` writes the header
  and copies the bytes in safetensors' storage order, 64 MiB at a time), so an output shard of
  up to 5 GiB costs one tensor of memory, not the shard (issue #36).

Both are context managers: on an error the partial files are removed.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import torch

from .layout import CheckpointError

ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
}
_NAMES = {v: k for k, v in ST_DTYPES.items()}
# safetensors' ``Dtype`` enum, in declaration order (safetensors/src/tensor.rs, 0.8): ``serialize``
# stores tensors by DEScending dtype in this order, then by name, and lists them so in the header
_DTYPE_ORDER = "BOOL F4 F6_E2M3 F6_E3M2 U8 I8 F8_E5M2 F8_E4M3 F8_E8M0 I16 U16 F16 BF16 I32 U32 F32 C64 F64 I64 U64".split()
COPY_BYTES = 64 << 20  # what `ShardWriter.close` holds while it copies a tensor's bytes


def numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _dtype_name(key: str, dtype: torch.dtype) -> str:
    if dtype not in _NAMES:
        raise CheckpointError(f"{key}: dtype {dtype} has no safetensors name")
    return _NAMES[dtype]


def storage_order(entries: Sequence[tuple[str, torch.dtype]]) -> list[str]:
    """The keys of ``(key, dtype)`` entries in the order safetensors stores them."""
    rank = {name: i for i, name in enumerate(_DTYPE_ORDER)}
    return [k for k, d in sorted(entries, key=lambda e: (-rank[_dtype_name(e[0], e[1])], e[0]))]


def header_of(
    entries: Sequence[tuple[str, torch.dtype, Sequence[int]]], metadata: dict[str, str] | None
) -> bytes:
    """The 8-byte length and JSON header of a safetensors file holding ``(key, dtype, shape)``
    entries, as safetensors itself writes them: ``__metadata__`` first (its keys sorted), the
    tensors in storage order, compact JSON, padded with spaces so that the data starts at a
    multiple of 8 bytes."""
    info = {k: (d, s) for k, d, s in entries}
    if len(info) != len(entries):
        raise CheckpointError("a safetensors file cannot hold one key twice")
    # metadata in key order: safetensors serializes it from a hash map, in an order that changes
    # from run to run once there are two keys (one key: the same bytes)
    header: dict = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    offset = 0
    for key in storage_order([(k, d) for k, d, _ in entries]):
        dtype, shape = info[key]
        nbytes = numel(shape) * dtype.itemsize
        header[key] = {
            "dtype": _NAMES[dtype],
            "shape": [int(s) for s in shape],
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def header_bytes(
    key: str, dtype: torch.dtype, shape: Sequence[int], metadata: dict[str, str] | None
) -> bytes:
    """`header_of` a file holding the one tensor ``key``."""
    _dtype_name(key, dtype)
    return header_of([(key, dtype, shape)], metadata)


def _bytes_of(t: torch.Tensor):
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy()


class TensorFileWriter:
    """A safetensors file holding one tensor, written as its bytes arrive: the header first, then
    `write` the tensor's pieces in order (flattened, row-major); `close` checks every byte came."""

    def __init__(
        self,
        path: str | os.PathLike,
        key: str,
        dtype: torch.dtype,
        shape: Sequence[int],
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.path = Path(path)
        self.key = key
        self.dtype = dtype
        self.nbytes = numel(shape) * dtype.itemsize
        self.written = 0
        head = header_bytes(key, dtype, shape, metadata)
        self._fh = open(self.path, "wb")  # noqa: SIM115 - closed by close() / abort()
        try:
            self._fh.write(head)
        except BaseException:
            self.abort()
            raise

    def write(self, piece: torch.Tensor) -> None:
        """Append ``piece``'s elements (a CPU tensor of the file's dtype) after those written."""
        if piece.dtype != self.dtype:
            raise CheckpointError(f"{self.path}: {self.key} is {self.dtype}, got a {piece.dtype} piece")
        data = _bytes_of(piece)
        if self.written + data.size > self.nbytes:
            raise CheckpointError(
                f"{self.path}: {self.key} holds {self.nbytes} bytes, got {self.written + data.size}"
            )
        self._fh.write(data)
        self.written += data.size

    def close(self) -> None:
        """Finish the file; fewer bytes than the tensor holds is a `CheckpointError` (file removed)."""
        if self._fh is None:
            return
        if self.written != self.nbytes:
            self.abort()
            raise CheckpointError(f"{self.path}: {self.key} holds {self.nbytes} bytes, got {self.written}")
        self._fh.close()
        self._fh = None

    def abort(self) -> None:
        """Close and remove the partial file."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> TensorFileWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class ShardWriter:
    """A safetensors file of many tensors that arrive one at a time: `add` appends each tensor's
    bytes to a spill file beside ``path`` (``<name>.spill``) and drops it; `close` writes the
    header, then each tensor's bytes from the spill in storage order, and removes the spill. The
    file is ``save_file``'s for the same tensors and metadata, byte for byte; memory: one tensor
    while it is added, `COPY_BYTES` while the file is assembled. Costs the shard's bytes twice in
    disk writes (the spill, then the file)."""

    def __init__(self, path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        self.spill = self.path.with_name(self.path.name + ".spill")
        self.metadata = metadata
        self.entries: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        self._at: dict[str, tuple[int, int]] = {}  # key -> (offset in the spill, bytes)
        self.nbytes = 0
        self._fh = open(self.spill, "wb")  # noqa: SIM115 - closed by close() / abort()

    def add(self, key: str, t: torch.Tensor) -> None:
        """Append the CPU tensor ``t`` under ``key`` (not kept)."""
        _dtype_name(key, t.dtype)
        if key in self._at:
            raise CheckpointError(f"{self.path}: {key} added twice")
        data = _bytes_of(t)
        self._fh.write(data)
        self._at[key] = (self.nbytes, data.size)
        self.entries.append((key, t.dtype, tuple(t.shape)))
        self.nbytes += data.size

    def close(self) -> None:
        """Assemble the file from the spill; the spill is removed."""
        if self._fh is None:
            return
        self._fh.close()
        self._fh = None
        try:
            with open(self.spill, "rb") as src, open(self.path, "wb") as dst:
                dst.write(header_of(self.entries, self.metadata))
                for key in storage_order([(k, d) for k, d, _ in self.entries]):
                    offset, left = self._at[key]
                    src.seek(offset)
                    while left:
                        buf = src.read(min(COPY_BYTES, left))
                        if not buf:
                            raise CheckpointError(f"{self.spill}: short read of {key}")
                        dst.write(buf)
                        left -= len(buf)
        except BaseException:
            self.path.unlink(missing_ok=True)
            raise
        finally:
            self.spill.unlink(missing_ok=True)

    def abort(self) -> None:
        """Close and remove the spill and any partial file."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        self.spill.unlink(missing_ok=True)
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def save_tensors(
    tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str] | None = None
) -> None:
    """``save_file`` with the same bytes on every run: safetensors writes ``__metadata__`` from a
    hash map, so a file with two or more metadata keys (a PTQ checkpoint's ``format`` and
    ``qatlib``) got different bytes, hence a different `qatlib.checkpoint.hashes.content_hash`,
    each time the same tensors were saved. Here the metadata is in key order (`header_of`)."""
    with ShardWriter(path, metadata) as w:
        for key, t in tensors.items():
            w.add(key, t)
