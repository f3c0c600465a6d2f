"""The streaming export: `qatlib.export.export` with ``onload``, for a model that does not fit in
host memory.

The model is a skeleton (`qatlib.zero3.onload.load_skeleton`, prepared, every scale real and loaded,
every weight on the meta device); each decoder layer is onloaded from the checkpoint in turn
(`qatlib.zero3.onload.iter_onloaded_modules`), its tensors exported one at a time
(`qatlib.export.compress.iter_export_tensors`) and appended to the current output shard, which is written
as soon as it is full, each tensor spilled to disk as it comes. Host memory: one output tensor +
one onloaded layer and one linear's compression temporaries (``benchmarks/stream_memory.py`` and
``benchmarks/plan_rehearsal.py`` measure it). Same tensors as the in-memory export (and, for a
model within one shard, the same bytes: the keys named by
`qatlib.checkpoint.saved_keys.checkpoint_names`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..checkpoint.layout import WEIGHTS_FILE, AtomicDir, name_weight_shards
from ..checkpoint.saved_keys import checkpoint_names
from ..checkpoint.st_write import ShardWriter
from .compress import iter_export_tensors, write_side_files
from .plan import ExportPlan

if TYPE_CHECKING:
    from ..zero3.onload import Onloader

log = logging.getLogger(__name__)


def export_streaming(
    model: nn.Module,
    plan: ExportPlan,
    target: AtomicDir,
    loader: Onloader,
    *,
    max_shard_size: int,
    tokenizer: Any = None,
    verify: bool = True,
) -> Path:
    """Write ``plan`` for the skeleton ``model`` layer by layer, shard by shard, inside ``target``
    (a failure midway leaves no output); returns the output directory."""
    from ..zero3.onload import iter_onloaded_modules

    kv: dict[str, torch.Tensor] | None = {} if plan.kv_file is not None else None
    resume: dict[str, torch.Tensor] | None = {} if plan.resume_file is not None else None
    tensors = iter_export_tensors(
        model,
        plan,
        kv_scales=kv,
        resume_scales=resume,
        modules=iter_onloaded_modules(model, loader),
        verify=verify,
    )
    with target as tmp:
        if plan.weights is not None:
            # config.json / generation_config.json exactly as save_pretrained writes them
            model.save_pretrained(str(tmp), state_dict={})
            (tmp / WEIGHTS_FILE).unlink(missing_ok=True)
            # the keys the in-memory export's save_pretrained writes (`checkpoint_names`: linearised
            # experts under the hub's per-expert keys, the rest by transformers' reverse renamings)
            name_of = checkpoint_names(model)
            write_shards(tmp, ((name_of(k), t) for k, t in tensors), max_shard_size)
        else:
            for _ in tensors:
                pass
        write_side_files(tmp, plan, tokenizer=tokenizer, kv_scales=kv, resume_scales=resume)
    log.info(
        "exported %s (%s, streamed layer by layer) to %s", plan.scheme.name, plan.save_format, target.out
    )
    return Path(target.out)


def write_shards(
    directory: Path, tensors: Iterable[tuple[str, torch.Tensor]], max_shard_bytes: int
) -> list[tuple[Path, list[str]]]:
    """Write ``tensors`` (in order) into safetensors shards of at most ``max_shard_bytes`` (a
    tensor larger than that gets a shard of its own; huggingface_hub's greedy split), named as
    ``save_pretrained`` names them (`qatlib.checkpoint.layout.name_weight_shards`), each file
    the bytes ``save_file`` writes. Each tensor is spilled to disk as it comes
    (`qatlib.checkpoint.st_write.ShardWriter`), so what is held is one tensor, not a shard
    (issue #36: a 2.3 GiB shard was the streamed export's peak). Hand-written because
    ``save_pretrained`` needs the whole state dict up front."""
    shards: list[tuple[Path, list[str]]] = []
    cur: ShardWriter | None = None
    try:
        for key, t in tensors:
            n = t.numel() * t.element_size()
            if cur is not None and cur.nbytes + n > max_shard_bytes and cur.entries:
                cur.close()
                cur = None
            if cur is None:
                path = directory / f".shard-{len(shards):05d}.safetensors"
                cur = ShardWriter(path, metadata={"format": "pt"})  # save_pretrained's metadata
                shards.append((path, []))
            cur.add(key, t)
            shards[-1][1].append(key)
        if cur is None:  # no tensor at all: one empty shard, as save_file writes it
            path = directory / ".shard-00000.safetensors"
            cur = ShardWriter(path, metadata={"format": "pt"})
            shards.append((path, []))
        cur.close()
    except BaseException:
        if cur is not None:
            cur.abort()
        raise
    name_weight_shards(directory, shards)
    return shards
