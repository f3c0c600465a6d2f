"""Content hashes of the workflow's products, so two runs can be compared stage by stage.

One function, `content_hash`, for every product (corpus, tokenizer, base model, PTQ / QAT
checkpoints, export): sha256 over the sorted relative file names and bytes of a folder (a file
hashes its bytes alone). Records of the run rather than of its content are left out, so that the
same arithmetic on another day or host gives the same hash: hidden files (Snakemake's
``.snakemake_timestamp``, owner records and temporaries of `qatlib.checkpoint.layout`), logs
(``*.log``, the train log), and the files that hold wall times, memory peaks or host facts
(`RUN_FILES`). The first stage whose hash differs between two runs is where they diverged.

hashlib does the hashing; what is hand-written is only the choice of files and their order (no
library defines a content hash of a model folder).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from .layout import (
    BLOCKWISE_LOG_FILE,
    GGUF_SOURCE_FILE,
    PRETRAIN_STATS_FILE,
    RUN_METADATA_FILE,
    SCALE_LOAD_FILE,
    TRAIN_LOG_FILE,
    UPCYCLE_STATS_FILE,
)

# Written with the content but describing the run (times, RSS peaks, host paths): not hashed. A
# base model's record holds its files' own sha256 too, and those files are hashed themselves.
RUN_FILES = frozenset(
    {
        RUN_METADATA_FILE,
        SCALE_LOAD_FILE,
        TRAIN_LOG_FILE,
        BLOCKWISE_LOG_FILE,
        PRETRAIN_STATS_FILE,
        GGUF_SOURCE_FILE,
        UPCYCLE_STATS_FILE,
    }
)
# The tokenizer's files inside a model folder (transformers' names).
TOKENIZER_FILES = frozenset(
    {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "chat_template.jinja",
        "vocab.json",
        "merges.txt",
        "tokenizer.model",
    }
)
_CHUNK = 1 << 20


def hashed_files(path: str | os.PathLike) -> list[Path]:
    """The files `content_hash` reads, relative to ``path``, sorted (POSIX names)."""
    root = Path(path)
    out = []
    for p in root.rglob("*"):
        rel = p.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or not p.is_file():
            continue
        if p.suffix == ".log" or p.name in RUN_FILES:
            continue
        out.append(rel)
    return sorted(out, key=lambda r: r.as_posix())


def _update_file(h, path: Path) -> None:
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)


def content_hash(path: str | os.PathLike, *, only: Iterable[str] | None = None) -> str:
    """``sha256:<hex>`` of a file's bytes, or of a folder's sorted (relative name, size, bytes)
    records (the size delimits one file's bytes from the next name). ``only``: hash just the files
    of the folder with these names (e.g. `TOKENIZER_FILES`). A missing path is FileNotFoundError."""
    p = Path(path)
    h = hashlib.sha256()
    if p.is_file():
        _update_file(h, p)
        return f"sha256:{h.hexdigest()}"
    if not p.is_dir():
        raise FileNotFoundError(f"{p}: no such file or folder to hash")
    names = set(only) if only is not None else None
    for rel in hashed_files(p):
        if names is not None and rel.name not in names:
            continue
        f = p / rel
        h.update(rel.as_posix().encode() + b"\0" + str(f.stat().st_size).encode() + b"\0")
        _update_file(h, f)
    return f"sha256:{h.hexdigest()}"


def product_hashes(products: Mapping[str, str | os.PathLike | None]) -> dict[str, str]:
    """``{label: content_hash}`` for each product that exists (a ``tokenizer`` label hashes only
    the tokenizer files of its folder); missing ones are left out."""
    out = {}
    for label, path in products.items():
        if path is None or not Path(path).exists():
            continue
        only = TOKENIZER_FILES if label == "tokenizer" and Path(path).is_dir() else None
        out[label] = content_hash(path, only=only)
    return out
