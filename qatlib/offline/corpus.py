"""An English text corpus that exists offline on every machine with the pinned packages installed.

No pip package ships a usable English corpus and the hub is unreachable on the CPU machines, so
the default experiment uses the documentation that installed code carries: the docstrings of
the Python standard library, the language-reference topics shipped for ``pydoc``
(``pydoc_data.topics``) and the docstrings of pinned packages (numpy, torch, transformers, ...).

Docstrings are read with `ast` from the source files (nothing is imported or executed), cleaned
(`qatlib.offline.cleaning`: doctests, reST literal blocks, fenced code and code-like paragraphs
dropped, reST markup stripped, whitespace normalised), de-duplicated paragraph by paragraph
(near-duplicates such as ``Conv1d`` / ``Conv2d`` docstrings share a key) and grouped into one document per source file.
Every list is sorted, so two machines with the same Python and package versions produce the same
bytes; `build_corpus` records the versions and a SHA-256 of every split in ``manifest.json``.

Documents are assigned to train / calib / test by a hash of their text, so the split of a
document never depends on which other documents exist; no paragraph occurs in two splits.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import platform
import sys
import sysconfig
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from ..checkpoint.layout import write_text
from .cleaning import clean_text, dedupe_key

CORPUS_FORMAT_VERSION = 1

# Packages whose docstrings are used by default: all are (transitive) dependencies of qatlib
# with pins in requirements/constraints.txt or fixed by them.
DEFAULT_PACKAGES: tuple[str, ...] = (
    "numpy",
    "torch",
    "transformers",
    "datasets",
    "huggingface_hub",
    "accelerate",
    "deepspeed",
    "pydantic",
)
# Distribution names whose versions are recorded (import name -> distribution name).
_DIST_NAMES = {"huggingface_hub": "huggingface-hub", "yaml": "PyYAML", "sklearn": "scikit-learn"}

# Directories never read: test suites, vendored copies, generated code.
_SKIP_DIRS = frozenset(
    {
        "__pycache__",
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "testing",
        "idle_test",
        "turtledemo",
        "lib2to3",
        "ensurepip",
        "_vendor",
        "vendor",
        "third_party",
        "benchmarks",
    }
)
SPLITS = ("train", "calib", "test")


@dataclass(frozen=True)
class Document:
    """One cleaned document: ``source`` is a stable key (``stdlib/json/decoder.py``)."""

    source: str
    text: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------- sources
def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def package_root(name: str) -> Path | None:
    """The directory of an installed package, without importing it (None when absent)."""
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(sorted(spec.submodule_search_locations)[0])


def package_version(name: str) -> str | None:
    try:
        return metadata.version(_DIST_NAMES.get(name, name))
    except metadata.PackageNotFoundError:
        return None


def source_files(root: Path, prefix: str) -> list[tuple[str, Path]]:
    """Sorted ``(key, path)`` of every ``.py`` file under ``root`` outside skipped directories."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for fn in filenames:
            if fn.endswith(".py") and not fn.startswith("test_"):
                p = Path(dirpath) / fn
                out.append((f"{prefix}/{p.relative_to(root).as_posix()}", p))
    out.sort(key=lambda kv: kv[0])
    return out


def file_docstrings(path: str | Path) -> list[str]:
    """Docstrings of a module and its classes / functions, in source order (no import)."""
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError, RecursionError):
        return []
    nodes = [
        n
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    nodes.sort(key=lambda n: getattr(n, "lineno", 0))
    out = []
    for n in nodes:
        d = ast.get_docstring(n, clean=True)
        if d:
            out.append(d)
    return out


def pydoc_topics() -> list[tuple[str, str]]:
    """The language-reference topics the interpreter ships for ``help()`` (plain text)."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # pragma: no cover - stripped interpreters
        return []
    return [(f"pydoc_topics/{k}", topics[k]) for k in sorted(topics)]


# --------------------------------------------------------------------------- documents
def _file_paragraphs(path: str) -> list[str]:
    paras: list[str] = []
    for d in file_docstrings(path):
        paras.extend(clean_text(d))
    return paras


def collect_documents(
    packages: Sequence[str] = DEFAULT_PACKAGES,
    *,
    include_stdlib: bool = True,
    include_pydoc_topics: bool = True,
    min_doc_chars: int = 300,
    workers: int | None = None,
    progress: bool = False,
) -> tuple[list[Document], dict]:
    """Every source's cleaned, de-duplicated documents (one per file / topic), in source order.

    Returns ``(documents, sources)`` where ``sources`` records each source's version and counts.
    Missing packages are skipped and recorded as ``null``.
    """
    groups: list[tuple[str, list[tuple[str, Path]]]] = []
    sources: dict[str, dict] = {}
    if include_stdlib:
        groups.append(("stdlib", source_files(stdlib_root(), "stdlib")))
        sources["stdlib"] = {"version": platform.python_version()}
    for name in sorted(set(packages)):
        root = package_root(name)
        if root is None:
            sources[name] = {"version": None}
            continue
        groups.append((name, source_files(root, name)))
        sources[name] = {"version": package_version(name)}

    items: list[tuple[str, str, list[str] | None, str | None]] = []  # (group, key, paras, path)
    if include_pydoc_topics:
        topics = pydoc_topics()
        sources["pydoc_topics"] = {"version": platform.python_version(), "topics": len(topics)}
        for key, text in topics:
            items.append(("pydoc_topics", key, clean_text(text), None))
    for group, files in groups:
        for key, path in files:
            items.append((group, key, None, str(path)))

    paths = [p for _, _, paras, p in items if paras is None]
    workers = workers if workers is not None else min(2, os.cpu_count() or 1)
    bar = _progress(len(paths), "corpus: parse docstrings", progress)
    parsed: list[list[str]] = []
    if workers > 1 and len(paths) > 50:
        with ProcessPoolExecutor(max_workers=workers) as ex:
            for r in ex.map(_file_paragraphs, paths, chunksize=32):
                parsed.append(r)
                bar.update(1)
    else:
        for p in paths:
            parsed.append(_file_paragraphs(p))
            bar.update(1)
    bar.close()
    it = iter(parsed)

    seen: set[str] = set()
    docs: list[Document] = []
    for group, key, paras, _ in items:
        paras = paras if paras is not None else next(it)
        kept = []
        for p in paras:
            k = dedupe_key(p)
            if k in seen:
                continue
            seen.add(k)
            kept.append(p)
        text = "\n\n".join(kept)
        src = sources[group]
        src["files"] = src.get("files", 0) + 1
        if len(text) >= min_doc_chars:
            docs.append(Document(key, text))
            src["documents"] = src.get("documents", 0) + 1
            src["chars"] = src.get("chars", 0) + len(text)
    return docs, sources


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, mininterval=1.0)


# --------------------------------------------------------------------------- split
def split_of(text: str, *, calib_fraction: float, test_fraction: float, salt: str = "") -> str:
    """``train`` / ``calib`` / ``test`` from a hash of the document text (and an optional salt)."""
    h = hashlib.sha256((salt + text).encode("utf-8")).digest()
    u = int.from_bytes(h[:8], "big") / 2**64
    if u < test_fraction:
        return "test"
    if u < test_fraction + calib_fraction:
        return "calib"
    return "train"


def split_documents(
    docs: Iterable[Document], *, calib_fraction: float = 0.02, test_fraction: float = 0.05, salt: str = ""
) -> dict[str, list[Document]]:
    if not (0 <= calib_fraction and 0 < test_fraction and calib_fraction + test_fraction < 1):
        raise ValueError(f"bad split fractions: calib={calib_fraction}, test={test_fraction}")
    out: dict[str, list[Document]] = {s: [] for s in SPLITS}
    for d in docs:
        out[split_of(d.text, calib_fraction=calib_fraction, test_fraction=test_fraction, salt=salt)].append(d)
    check_disjoint(out)
    return out


def check_disjoint(splits: dict[str, list[Document]]) -> None:
    """Assert no document and no paragraph occurs in two splits."""
    seen: dict[str, str] = {}
    for name in SPLITS:
        for d in splits.get(name, []):
            for p in d.text.split("\n\n"):
                k = dedupe_key(p)
                other = seen.setdefault(k, name)
                if other != name:
                    raise AssertionError(f"paragraph of {d.source} occurs in both {other} and {name}")


# --------------------------------------------------------------------------- output
def atomic_write_text(path: Path, data: str) -> None:
    """`qatlib.checkpoint.layout.write_text`: readers never see a half-written file."""
    write_text(path, data)


def sft_records(
    docs: Sequence[Document], *, chunk_chars: int = 1200, prompt_fraction: float = 0.3
) -> list[dict]:
    """Chat records from documents: the user gives the start of a passage, the assistant continues it.

    Passages are runs of whole paragraphs of about ``chunk_chars`` characters; the prompt is the
    first ``prompt_fraction`` of the passage cut at a word boundary.
    """
    recs = []
    for d in docs:
        cur = ""
        for p in d.text.split("\n\n") + [None]:
            if p is not None and (not cur or len(cur) + len(p) + 2 <= chunk_chars):
                cur = p if not cur else cur + "\n\n" + p
                continue
            if cur:
                cut = cur.rfind(" ", 0, max(1, int(len(cur) * prompt_fraction)))
                if cut > 0:
                    recs.append(
                        {
                            "messages": [
                                {"role": "user", "content": "Continue this documentation:\n\n" + cur[:cut]},
                                {"role": "assistant", "content": cur[cut + 1 :]},
                            ]
                        }
                    )
            cur = p or ""
    return recs


def build_corpus(
    out_dir: str | Path,
    *,
    packages: Sequence[str] = DEFAULT_PACKAGES,
    include_stdlib: bool = True,
    include_pydoc_topics: bool = True,
    min_doc_chars: int = 300,
    calib_fraction: float = 0.02,
    test_fraction: float = 0.05,
    salt: str = "",
    write_sft: bool = True,
    sft_chunk_chars: int = 1200,
    workers: int | None = None,
    progress: bool = True,
) -> dict:
    """Write ``train.txt``, ``calib.txt``, ``test.txt`` (documents separated by a blank line),
    ``train_sft.jsonl`` (chat records, when ``write_sft``) and ``manifest.json`` into ``out_dir``.

    Each file is written to a temporary name and renamed. Returns the manifest: sources with
    versions, per-split document / character counts and SHA-256 digests, and a ``content_hash``
    over all splits (identical on machines with the same Python and package versions).
    """
    out = Path(out_dir)
    docs, sources = collect_documents(
        packages,
        include_stdlib=include_stdlib,
        include_pydoc_topics=include_pydoc_topics,
        min_doc_chars=min_doc_chars,
        workers=workers,
        progress=progress,
    )
    if not docs:
        raise RuntimeError("no documents found: no stdlib sources and none of the packages are installed")
    splits = split_documents(docs, calib_fraction=calib_fraction, test_fraction=test_fraction, salt=salt)
    if not splits["test"] or not splits["train"]:
        raise RuntimeError(f"split left an empty train or test set ({len(docs)} documents)")
    manifest: dict = {
        "format_version": CORPUS_FORMAT_VERSION,
        "python": platform.python_version(),
        "implementation": sys.implementation.name,
        "sources": sources,
        "params": {
            "packages": sorted(set(packages)),
            "include_stdlib": include_stdlib,
            "include_pydoc_topics": include_pydoc_topics,
            "min_doc_chars": min_doc_chars,
            "calib_fraction": calib_fraction,
            "test_fraction": test_fraction,
            "salt": salt,
        },
        "splits": {},
    }
    total = hashlib.sha256()
    for name in SPLITS:
        text = "\n\n".join(d.text for d in splits[name]) + "\n"
        atomic_write_text(out / f"{name}.txt", text)
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        total.update(f"{name}:{digest}\n".encode())
        manifest["splits"][name] = {
            "file": f"{name}.txt",
            "documents": len(splits[name]),
            "chars": len(text),
            "words": len(text.split()),
            "sha256": digest,
            "sources": [d.source for d in splits[name]],
        }
    if write_sft:
        recs = sft_records(splits["train"], chunk_chars=sft_chunk_chars)
        data = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in recs)
        atomic_write_text(out / "train_sft.jsonl", data)
        manifest["sft"] = {
            "file": "train_sft.jsonl",
            "records": len(recs),
            "sha256": hashlib.sha256(data.encode("utf-8")).hexdigest(),
        }
    manifest["content_hash"] = total.hexdigest()
    atomic_write_text(out / "manifest.json", json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def read_split(corpus_dir: str | Path, split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}; got {split!r}")
    return (Path(corpus_dir) / f"{split}.txt").read_text(encoding="utf-8")
