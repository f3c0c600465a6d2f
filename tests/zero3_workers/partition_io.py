"""2-rank ZeRO-3 worker (torchrun): large tensors loaded and saved partition by partition, in pieces.

Usage: torchrun --standalone --nproc_per_node=2 partition_io.py SPEC.json

SPEC: {"out": dir, "ds_config": file, "phases": [{"name", "model": checkpoint dir, "bf16": bool,
"chunk_bytes": load piece bound, "partition_bytes": save threshold and piece bound}], "errors":
{"model": checkpoint dir, "chunk_bytes", "partition_bytes", "short_read_own" / "short_read_other" /
"missing_file": a copy of the checkpoint each case may damage}}.

Per phase: `zero3_load.load_model` (tensors above ``chunk_bytes`` go partition-wise, read in pieces
straight from the file), checks on every rank (gathered == checkpoint bit for bit, the padding
past an odd tensor's end is zero), then `save_consolidated` (tensors above ``partition_bytes``
stream to their own shard) and `consolidated_state_dict` (the whole-tensor path) for comparison;
rank 0 writes ``{out}/{name}.pt``. Then the failures, each caught as a `Zero3Error` on both ranks
and followed by a barrier (still in step): a file that shrinks after its header was read (in rank
0's own partition, in rank 1's), a file gone before the load, and a write failure in the middle of
a streamed shard (and at its start); ``{out}/errors.json`` holds both ranks' messages and times.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import torch
from cases import run_cases

logging.basicConfig(level=logging.INFO, format=f"[rank{os.environ.get('RANK', '?')}] %(name)s: %(message)s")


def checkpoint_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    sd = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        sd.update(load_file(str(f)))
    return sd


def load_checks(model, ckpt: dict[str, torch.Tensor], chunk_bytes: int, z) -> dict:
    from qatlib.zero3 import save as zs

    """Every rank: gathered parameters vs the checkpoint (cast to the model's dtype), and the zero
    padding of the last rank's partition of every tensor loaded partition-wise (above
    ``chunk_bytes`` in the file) whose size the world does not divide. (Not of the gathered ones:
    DeepSpeed's re-partitioning after a gather leaves whatever was in the padding.)"""
    world, rank = z.get_world_size(), z.get_rank()
    mismatch, padded, bad_padding = [], [], []
    for name, p in model.named_parameters():
        n, numel = p.ds_tensor.numel(), p.ds_numel
        big = name in ckpt and ckpt[name].numel() * ckpt[name].element_size() > chunk_bytes
        if numel % world and big:
            padded.append(name)
            valid = max(0, min(n, numel - rank * n))
            if not bool((p.ds_tensor[valid:] == 0).all()):
                bad_padding.append(name)
    for name, m in zs.iter_gathered_modules(model, unit_types=()):
        for pname, p in m.named_parameters(recurse=False):
            full = f"{name}.{pname}" if name else pname
            ref = ckpt.get(full)
            if ref is None and full == "lm_head.weight" and model.config.tie_word_embeddings:
                ref = ckpt.get("model.embed_tokens.weight")
            if ref is None or not torch.equal(ref.to(p.dtype), p.data.cpu()):
                mismatch.append(full)
    return {"gathered_mismatch": mismatch, "padded": padded, "bad_padding": bad_padding}


def run_phase(ph: dict, spec: dict) -> None:
    from qatlib.zero3 import io as z
    from qatlib.zero3 import load as zl
    from qatlib.zero3 import save as zs

    ds_config = json.loads(Path(spec["ds_config"]).read_text())
    ds_config["bf16"] = {"enabled": bool(ph.get("bf16"))}
    ctx = z.init_zero3(ds_config, timeout_s=60)
    model = zl.load_model(ph["model"], ctx, chunk_bytes=ph["chunk_bytes"])
    checks = load_checks(model, checkpoint_tensors(Path(ph["model"])), ph["chunk_bytes"], z)
    out = Path(spec["out"])
    saved = zs.save_consolidated(model, out / f"{ph['name']}_saved", partition_bytes=ph["partition_bytes"])
    sd = zs.consolidated_state_dict(model, partition_bytes=ph["partition_bytes"])
    everyone = [None] * z.get_world_size()
    torch.distributed.all_gather_object(everyone, checks)
    if z.get_rank() == 0:
        assert saved is not None
        torch.save({"checks": everyone, "state_dict": sd}, out / f"{ph['name']}.pt")
    del model


def run_errors(spec: dict) -> dict:
    from qatlib.checkpoint import safetensors as st
    from qatlib.checkpoint import st_write as stw
    from qatlib.checkpoint.layout import weight_files
    from qatlib.zero3 import io as z
    from qatlib.zero3 import load as zl
    from qatlib.zero3 import save as zs

    err = spec["errors"]
    ctx = z.init_zero3(json.loads(Path(spec["ds_config"]).read_text()), timeout_s=60)
    rank = z.get_rank()
    model = zl.load_model(err["model"], ctx, chunk_bytes=err["chunk_bytes"])
    comm = z._Comm(True)
    key = "model.embed_tokens.weight"

    def damaged_load(case: str):
        """The plan is made from the complete file (its header checked), then rank 0 damages the
        file and every rank executes the plan's entry for the embedding (partition-wise)."""
        d = Path(err[case])
        plan = comm.decide(lambda: st.weight_plan(weight_files(d), zl._model_tensors(model), where=str(d)))
        entry = next(e for e in plan if e.info.key == key)
        if rank == 0:
            info = entry.info
            n = model.model.embed_tokens.weight.ds_tensor.numel()
            size = info.torch_dtype.itemsize
            if case == "missing_file":
                os.remove(info.file)
            else:  # inside rank 0's own partition, or inside rank 1's (after rank 0's was read)
                at = 5 if case == "short_read_own" else (n + 3) * size + 1
                os.truncate(info.file, info.start + at)
        torch.distributed.barrier()
        zl._execute_plan(model, [entry], comm, chunk_bytes=err["chunk_bytes"])

    calls = {"n": 0}
    real_write, real_init = stw.TensorFileWriter.write, stw.TensorFileWriter.__init__

    def failing_write(self, piece):
        calls["n"] += 1
        if calls["n"] == 2:  # after one piece is on disk
            raise OSError("disk full (test)")
        real_write(self, piece)

    def failing_init(self, path, *a, **k):
        raise OSError(f"cannot create {Path(path).name} (test)")

    def failing_save(case: str, patch: dict):
        if rank == 0:
            for attr, fn in patch.items():
                setattr(stw.TensorFileWriter, attr, fn)
        try:
            return zs.save_consolidated(
                model, Path(spec["out"]) / case, partition_bytes=err["partition_bytes"]
            )
        finally:
            stw.TensorFileWriter.write, stw.TensorFileWriter.__init__ = real_write, real_init

    cases = {
        "short_read_own": lambda: damaged_load("short_read_own"),
        "short_read_other": lambda: damaged_load("short_read_other"),
        "missing_file": lambda: damaged_load("missing_file"),
        "save_write_fails": lambda: failing_save("save_write_fails", {"write": failing_write}),
        "save_open_fails": lambda: failing_save("save_open_fails", {"__init__": failing_init}),
    }
    results = run_cases(cases, z.Zero3Error)
    results["write_calls"] = calls["n"]
    # the model still saves (every collective matched), and the failed saves left no output
    ok = zs.save_consolidated(
        model, Path(spec["out"]) / "after_errors", partition_bytes=err["partition_bytes"]
    )
    results["saved_after_errors"] = ok is not None
    results["outputs"] = sorted(p.name for p in Path(spec["out"]).iterdir())  # temporaries included
    return results


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    for ph in spec["phases"]:
        run_phase(ph, spec)
    from qatlib.zero3 import io as z

    errors = run_errors(spec)
    everyone = [None] * z.get_world_size()
    torch.distributed.all_gather_object(everyone, errors)
    if z.get_rank() == 0:
        (Path(spec["out"]) / "errors.json").write_text(json.dumps(everyone, indent=1))
    z.shutdown()
    print(f"[rank{os.environ.get('RANK')}] WORKER OK", flush=True)


if __name__ == "__main__":
    main()
