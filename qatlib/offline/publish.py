"""Publishing a base model folder: one place for how the offline stages write what they made.

A base-model stage (`gguf_model`, `base_model`, `upcycle`) ends the same way: the model and its
tokenizer saved with ``save_pretrained`` (safetensors), its JSON record beside them, the folder
readable by the other ranks' users, all swapped in complete or not at all
(`qatlib.checkpoint.layout.AtomicDir`): a crash never leaves a half-written base model that the
next stage would load.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..checkpoint.layout import AtomicDir, publish_permissions


def save_model_folder(
    out_dir: str | Path,
    model,
    tokenizer,
    record_file: str,
    record: Callable[[Path], dict[str, Any]],
) -> dict[str, Any]:
    """Save ``model`` + ``tokenizer`` into ``out_dir`` with ``record(folder)`` as ``record_file``.

    ``record`` is called after the weights are written (it may read them, as the GGUF stage's
    file hashes do) and its dict is returned.
    """
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    target = AtomicDir(out, overwrite=True)  # owned temporary, swapped in complete
    tmp = target.open()
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        rec = record(tmp)
        (tmp / record_file).write_text(json.dumps(rec, indent=2, default=str) + "\n")
        publish_permissions(tmp)
        target.commit()
    except BaseException:
        target.abort()
        raise
    return rec
