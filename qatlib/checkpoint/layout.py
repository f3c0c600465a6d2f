"""The files of a PTQ / QAT checkpoint (docs/design.md) and how they are found and written.

A checkpoint is a directory, or its nested ``final_quant_checkpoint/`` (`resolve_dir`), holding
``quant_scheme.json`` (the `QuantScheme`, plus metadata) and ``*.safetensors`` with the scale keys
of `qatlib.checkpoint.keys`; a QAT checkpoint is also an HF model folder (``model.safetensors`` or
shards + index). Every file name of that contract is defined here and nowhere else, and every
output directory is written through `AtomicDir`: complete, or not at all.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import secrets
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from ..quant.spec import QuantScheme

log = logging.getLogger(__name__)

SCHEME_FILE = "quant_scheme.json"
SCALES_FILE = "scales.safetensors"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
KV_SCALES_FILE = "kv_cache_scales.safetensors"
RUN_METADATA_FILE = "run_metadata.json"
TRAIN_LOG_FILE = "train_log.jsonl"
# two-phase QAT's first (blockwise) phase: its per-block records, beside phase 2's train log
BLOCKWISE_LOG_FILE = "blockwise_log.jsonl"
SCALE_LOAD_FILE = "scale_load.json"
# The records the base-model stages write beside the weights (`qatlib.offline`): what was built and
# how it scored, with wall times and host paths, so not part of the folder's content hash.
PRETRAIN_STATS_FILE = "pretrain_stats.json"
GGUF_SOURCE_FILE = "source.json"
UPCYCLE_STATS_FILE = "upcycle_stats.json"
NESTED_DIR = "final_quant_checkpoint"
# Safetensors files beside a model's weights that hold no weight.
NON_WEIGHT_FILES = (SCALES_FILE, KV_SCALES_FILE)
# An export folder holds only what a runtime should load: vLLM / SGLang load EVERY top-level
# ``*.safetensors`` of a folder without an index (vLLM 0.33 model_loader/default_loader.py:228-254),
# so qatlib's own side files of an export (a `fake` export's resume scales, the KV scales of a
# `real_and_kvcache` export) live in this subfolder, which no runtime globs.
EXPORT_SIDE_DIR = "qatlib"
EXPORT_INFO_FILE = "qatlib_export.json"  # what an export changed of the trained arithmetic, and why
FAKE_EXPORT_SCALES_FILE = f"{EXPORT_SIDE_DIR}/{SCALES_FILE}"
EXPORT_KV_SCALES_FILE = f"{EXPORT_SIDE_DIR}/{KV_SCALES_FILE}"


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, or does not fit (the message names the file)."""


class CheckpointNotFound(CheckpointError, FileNotFoundError):
    """No checkpoint at the given path."""


# --------------------------------------------------------------------------- reading
def resolve_dir(path: str | os.PathLike, *, safetensors_fallback: bool = False) -> Path:
    """The directory holding ``quant_scheme.json``: ``path`` itself or its nested
    ``final_quant_checkpoint/``. With ``safetensors_fallback`` (analysis of any model folder) a
    directory holding only ``*.safetensors`` is accepted when neither has the scheme file."""
    p = Path(path)
    candidates = (p, p / NESTED_DIR)
    for d in candidates:
        if (d / SCHEME_FILE).is_file():
            return d
    if safetensors_fallback:
        for d in candidates:
            if d.is_dir() and any(d.glob("*.safetensors")):
                return d
    if not p.exists():
        raise CheckpointNotFound(f"checkpoint {p} does not exist (not a PTQ/QAT checkpoint)")
    also = " or *.safetensors" if safetensors_fallback else ""
    raise CheckpointNotFound(f"no {SCHEME_FILE}{also} in {p} or {p / NESTED_DIR}: not a PTQ/QAT checkpoint")


def read_scheme_record(path: str | os.PathLike) -> dict[str, Any]:
    """The whole ``quant_scheme.json`` of a checkpoint (scheme + ``qatlib_version``, ``calibration``,
    ``weights`` when PTQ wrote it)."""
    f = resolve_dir(path) / SCHEME_FILE
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f}: not a quant scheme ({e})") from None


def weights_dir(path: str | os.PathLike) -> Path | None:
    """The checkpoint's folder when its record names the model's weights stored in it (a GPTQ PTQ
    checkpoint: GPTQ changes the weights, so the model its scales belong to is loaded from there,
    not from ``model.model_path``), else None."""
    d = resolve_dir(path)
    name = read_scheme_record(d).get("weights")
    if not name:
        return None
    if not (d / name).is_file():
        raise CheckpointError(f"{d / SCHEME_FILE} names the weights {name!r}, which {d} does not hold")
    return d


def read_scheme(path: str | os.PathLike) -> QuantScheme:
    """The `QuantScheme` a checkpoint was made with (extra metadata keys are ignored)."""
    record = read_scheme_record(path)
    try:
        return QuantScheme.from_dict(record)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{resolve_dir(path) / SCHEME_FILE}: not a quant scheme ({e})") from None


def check_scheme(path: str | os.PathLike, scheme: QuantScheme) -> tuple[Path, QuantScheme]:
    """Resolve the checkpoint directory and refuse one made for a scheme incompatible with
    ``scheme`` (`QuantScheme.compatible_with`); returns ``(directory, its scheme)``."""
    d = resolve_dir(path)
    ckpt_scheme = read_scheme(d)
    problems = scheme.compatible_with(ckpt_scheme)
    if problems:
        raise CheckpointError(
            f"PTQ checkpoint {d} was made for scheme {ckpt_scheme.name!r}, incompatible with the configured "
            f"{scheme.name!r}: " + "; ".join(problems)
        )
    return d, ckpt_scheme


def scale_files(d: Path) -> list[Path]:
    """Every ``*.safetensors`` file of the directory ``d`` and of its `EXPORT_SIDE_DIR` (a `fake`
    export keeps its scales there), sorted: the scales may be in any of them."""
    return sorted(d.glob("*.safetensors")) + sorted((d / EXPORT_SIDE_DIR).glob("*.safetensors"))


def safetensors_files(path: str | os.PathLike) -> list[Path]:
    """Every scale-holding ``*.safetensors`` file of a checkpoint directory (`resolve_dir`,
    `scale_files`): a PTQ ``scales.safetensors``, shards, the files of a model folder, a `fake`
    export's side scales."""
    d = resolve_dir(path)
    files = scale_files(d)
    if not files:
        raise CheckpointError(f"checkpoint {d}: no *.safetensors file")
    return files


def weight_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files holding a model's weights: ``path`` itself when it is a file; the
    files ``model.safetensors.index.json`` names (all must exist); ``model.safetensors``; else every
    ``*.safetensors`` but the scale files. A folder without any takes those of its nested
    ``final_quant_checkpoint/``. An empty list when there are none."""
    d = Path(path)
    if d.is_file():
        return [d]
    index = d / WEIGHTS_INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
        files = list(dict.fromkeys(weight_map.values()))
        missing = [f for f in files if not (d / f).is_file()]
        if missing:
            raise CheckpointError(f"{index} names files that do not exist: {', '.join(missing)}")
        return [d / f for f in files]
    if (d / WEIGHTS_FILE).is_file():
        return [d / WEIGHTS_FILE]
    files = sorted(f for f in d.glob("*.safetensors") if f.name not in NON_WEIGHT_FILES)
    if not files and (d / NESTED_DIR).is_dir():
        return weight_files(d / NESTED_DIR)
    return files


# --------------------------------------------------------------------------- writing
def name_weight_shards(directory: Path, shards: list[tuple[Path, list[str]]]) -> None:
    """Give weight shards written in ``directory`` (``(file, its keys)`` in order) their HF names:
    one shard is ``model.safetensors``; several are ``model-0000i-of-0000n.safetensors`` plus
    ``model.safetensors.index.json``."""
    if len(shards) <= 1:
        if shards:
            shards[0][0].rename(directory / WEIGHTS_FILE)
        return
    n = len(shards)
    weight_map, total = {}, 0
    for i, (path, keys) in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        path.rename(directory / final)
        total += (directory / final).stat().st_size
        weight_map.update(dict.fromkeys(keys, final))
    write_json(directory / WEIGHTS_INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})


# --------------------------------------------------------------------------- atomic writes
# A temporary output ``.{name}.tmp-{token}`` (a directory or a file) has an owner record beside it,
# ``.{name}.tmp-{token}.owner`` ({host, pid, start}), written BEFORE the temporary exists: a run
# killed at any point leaves at most an orphan whose owner is known, and the next write to the
# same output removes it once that owner is gone (same host: no such pid, or one started later).
OWNER_SUFFIX = ".owner"
FAULT_ENV = "QATLIB_FAULT_PAUSE"  # test hook: "<point>:<file>": write our pid there, then sleep


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc), None when it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[19])


def owner_record() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_ticks(os.getpid())}


def _owner_gone(rec: dict[str, Any]) -> bool:
    if rec.get("host") != socket.gethostname():
        return False  # another host's: cannot tell, leave it
    start = _start_ticks(int(rec.get("pid", -1)))
    return start is None or (rec.get("start") is not None and start != rec["start"])


def fault_point(name: str) -> None:
    """Test hook (`FAULT_ENV`): stop at the named point so a test can kill the process there."""
    spec = os.environ.get(FAULT_ENV, "")
    point, _, path = spec.partition(":")
    if point == name and path:
        Path(path).write_text(str(os.getpid()))
        while True:
            time.sleep(1)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def clean_stale(target: str | os.PathLike) -> list[Path]:
    """Remove the temporary outputs of ``target`` whose owner process is gone (a killed run) and
    report each; returns the removed paths. Orphans of other hosts are reported, not touched."""
    target = Path(target)
    removed = []
    if not target.parent.is_dir():
        return removed
    for owner in target.parent.glob(f".{target.name}.tmp-*{OWNER_SUFFIX}"):
        tmp = owner.with_name(owner.name[: -len(OWNER_SUFFIX)])
        try:
            rec = json.loads(owner.read_text())
        except (OSError, json.JSONDecodeError):
            rec = {}
        if not _owner_gone(rec):
            if rec.get("host") != socket.gethostname() and tmp.exists():
                log.warning(
                    "%s: temporary output of %s on host %s left alone", tmp, rec.get("pid"), rec.get("host")
                )
            continue
        if tmp.exists():
            _remove(tmp)
            log.warning(
                "removed %s: left by process %s on %s, which is gone", tmp, rec.get("pid"), rec.get("host")
            )
            removed.append(tmp)
        owner.unlink(missing_ok=True)
    return removed


def _claim(target: Path) -> Path:
    """A fresh temporary sibling path of ``target``, its owner record already written."""
    target.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(target)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    owner = tmp.with_name(tmp.name + OWNER_SUFFIX)
    owner.write_text(json.dumps(owner_record()))
    return tmp


def _release(tmp: Path) -> None:
    _remove(tmp)
    tmp.with_name(tmp.name + OWNER_SUFFIX).unlink(missing_ok=True)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``; no library exposes it).
    False where the OS or file system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a))


def _install(tmp: Path, out: Path) -> None:
    """Put the complete ``tmp`` at ``out``: a plain rename when ``out`` does not exist; else an
    atomic swap (``out`` is never missing), then the old content (now at ``tmp``) is removed."""
    fault_point("atomic-commit")
    if out.exists() and out.is_dir() != tmp.is_dir():
        raise FileExistsError(f"output path {out} exists and is a {'directory' if out.is_dir() else 'file'}")
    if out.exists() and _exchange(tmp, out):
        _release(tmp)  # the old output
        return
    if out.is_dir():  # no atomic swap here: the shortest gap a rename pair allows
        old = tmp.with_name(tmp.name + "-old")
        out.rename(old)
        tmp.rename(out)
        _remove(old)
    else:
        os.replace(tmp, out)
    tmp.with_name(tmp.name + OWNER_SUFFIX).unlink(missing_ok=True)


def publish_permissions(directory: Path) -> None:
    """Readable by everyone, as a plain ``mkdir`` + write would leave it: `AtomicDir`'s temporary
    folder comes from ``mkdtemp`` (0700) and some writers create 0600 files, which a model folder
    shared with other users (or served by a runtime under another uid) must not keep."""
    os.chmod(directory, 0o755)
    for f in directory.iterdir():
        if f.is_file():
            os.chmod(f, 0o644)


class AtomicDir:
    """Write a directory completely or not at all: ``with AtomicDir(out) as tmp:`` fills a fresh
    temporary sibling of ``out`` (with an owner record), swapped in for ``out`` when the block succeeds.

    An existing non-empty ``out`` is an error (checked before anything is written) unless
    ``overwrite``; then it is replaced only once the new content is complete, by an atomic swap
    (there is never a moment without a complete ``out``). On any exception the temporary directory
    is removed and ``out`` is left as it was; a killed run's orphan is removed by the next write
    to ``out`` (`clean_stale`). Code whose writing is split around collectives calls `open` /
    `commit` / `abort` itself.
    """

    def __init__(self, out_dir: str | os.PathLike, *, overwrite: bool = False) -> None:
        self.out = Path(out_dir)
        self.overwrite = overwrite
        self.tmp: Path | None = None

    def check(self) -> None:
        out = self.out
        if out.exists() and not out.is_dir():
            raise FileExistsError(f"output path {out} exists and is not a directory")
        if out.is_dir() and any(out.iterdir()) and not self.overwrite:
            raise FileExistsError(f"output directory {out} is not empty (pass overwrite=True to replace it)")

    def open(self) -> Path:
        self.check()
        self.tmp = _claim(self.out)
        self.tmp.mkdir()
        return self.tmp

    def commit(self) -> Path:
        _install(self.tmp, self.out)
        self.tmp = None
        return self.out

    def abort(self) -> None:
        if self.tmp is not None:
            _release(self.tmp)
            self.tmp = None

    def __enter__(self) -> Path:
        return self.open()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                self.commit()
            except BaseException:
                self.abort()
                raise
        else:
            self.abort()


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (owned temporary sibling + rename); parents are created."""
    p = Path(path)
    tmp = _claim(p)
    try:
        tmp.write_bytes(data)
        os.replace(tmp, p)
        tmp.with_name(tmp.name + OWNER_SUFFIX).unlink(missing_ok=True)
    except BaseException:
        _release(tmp)
        raise
    return p


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` atomically (`write_bytes`, UTF-8)."""
    return write_bytes(path, text.encode())


def write_json(path: str | os.PathLike, obj: Any, *, sort_keys: bool = False) -> Path:
    """``obj`` as indented JSON (non-JSON values through ``str``), atomically (`write_text`)."""
    return write_text(path, json.dumps(obj, indent=2, sort_keys=sort_keys, default=str) + "\n")
