"""A random-weight model at a real model's WIDTH, for rehearsing the 30B stages on a CPU machine.

Width is what breaks memory, not depth (#16): every per-layer tensor of Qwen3-30B-A3B (128
experts x 768 x 2048, a 151,936 x 2048 vocabulary) fits here, so the real config.json with
``num_hidden_layers`` cut to 1-2 exercises the real shapes through PTQ -> ZeRO-3 QAT -> export.

The weights are written tensor by tensor into safetensors shards in the HUB's key layout
(per-expert ``mlp.experts.{e}.gate_proj|up_proj|down_proj.weight``, as the published checkpoint
and ``save_pretrained`` have them), never the whole model in memory: the model is built on the
``meta`` device only to list its parameters. Values: normal(0, ``initializer_range``) for matrices,
ones for norm vectors (what the model's own init does), from one seed. A byte-level BPE
tokenizer trained on the offline corpus goes beside them (its ids are far below the vocabulary).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from ..checkpoint.layout import AtomicDir, name_weight_shards, write_json
from ..surgery.moe import is_fused_experts

SHARD_BYTES = 1 << 30


def _hub_tensors(model: torch.nn.Module) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(hub key, shape) of every parameter; fused experts ([E, 2I, H] / [E, H, I]) as per-expert keys."""
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if is_fused_experts(module):
            e, two_i, h = module.gate_up_proj.shape
            i = two_i // 2
            for k in range(e):
                yield f"{prefix}{k}.gate_proj.weight", (i, h)
                yield f"{prefix}{k}.up_proj.weight", (i, h)
                yield f"{prefix}{k}.down_proj.weight", (h, i)
            continue
        for pname, p in module.named_parameters(recurse=False):
            yield f"{prefix}{pname}", tuple(p.shape)


def _random(shape: tuple[int, ...], std: float, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Ones for a norm vector; normal(0, std) for a matrix, drawn in fp32 blocks of rows written into
    the ``dtype`` tensor (a 151,936 x 2048 embedding drawn at once would take 2.5 GB of fp32)."""
    if len(shape) == 1:
        return torch.ones(shape, dtype=dtype)
    out = torch.empty(shape, dtype=dtype)
    rows = max(1, (1 << 24) // max(1, out[0].numel()))
    for a in range(0, shape[0], rows):
        out[a : a + rows] = torch.randn((min(rows, shape[0] - a), *shape[1:]), generator=gen).mul_(std)
    return out


def write_random_model(
    config: str | Path | dict,
    out_dir: str | Path,
    *,
    num_hidden_layers: int,
    corpus_dir: str | Path | None = None,
    seed: int = 0,
    shard_bytes: int = SHARD_BYTES,
    dtype: torch.dtype = torch.bfloat16,
    tokenizer_vocab: int = 4096,
) -> dict:
    """Write ``config`` (a config.json path or dict) with ``num_hidden_layers`` layers and random
    weights into ``out_dir`` (complete or not at all). Returns {params, shards, bytes}."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    if num_hidden_layers < 1:
        raise ValueError(f"num_hidden_layers must be >= 1; got {num_hidden_layers}")
    raw = (
        json.loads(Path(config).read_text(encoding="utf-8")) if not isinstance(config, dict) else dict(config)
    )
    raw["num_hidden_layers"] = num_hidden_layers
    if "max_window_layers" in raw:
        raw["max_window_layers"] = num_hidden_layers
    model_type = raw.pop("model_type")
    for k in ("architectures", "transformers_version", "torch_dtype", "dtype"):
        raw.pop(k, None)
    cfg = AutoConfig.for_model(model_type, **raw)
    cfg.dtype = dtype
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    std = float(getattr(cfg, "initializer_range", 0.02))
    gen = torch.Generator().manual_seed(seed)
    target = AtomicDir(out_dir, overwrite=True)
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    with target as tmp:
        shards: list[tuple[Path, list[str]]] = []
        pending: dict[str, torch.Tensor] = {}
        size = params = total = 0

        def flush() -> None:
            nonlocal pending, size
            path = tmp / f"shard-{len(shards):05d}.safetensors"
            save_file(pending, str(path), metadata={"format": "pt"})
            shards.append((path, list(pending)))
            pending, size = {}, 0

        for key, shape in _hub_tensors(meta):
            t = _random(shape, std, dtype, gen)
            pending[key] = t
            nbytes = t.numel() * t.element_size()
            size, params, total = size + nbytes, params + t.numel(), total + nbytes
            if size >= shard_bytes:
                flush()
        if pending:
            flush()
        name_weight_shards(tmp, shards)
        cfg.architectures = [type(meta).__name__]
        cfg.save_pretrained(str(tmp))
        if corpus_dir is not None:
            from .base_model import read_documents
            from .tokenizer import train_tokenizer

            train_tokenizer(read_documents(Path(corpus_dir) / "train.txt"), tokenizer_vocab, tmp)
        write_json(
            tmp / "random_model.json",
            {
                "seed": seed,
                "std": std,
                "layers": num_hidden_layers,
                "params": params,
                "bytes": total,
                "shards": len(shards),
            },
        )
    return {"params": params, "shards": len(shards), "bytes": total}
