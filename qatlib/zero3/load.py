"""Building and loading a ZeRO-3 model: the empty partitioned build, streamed weights and scales.

The load half of the ZeRO-3 path (`qatlib.zero3.io` holds start-up, collectives, the gathered
save and run metadata; the order a run uses both is in its docstring): `build_empty_model` builds
the model under ``deepspeed.zero.Init`` without reading a weight and linearises fused MoE experts
inside the same context; `stream_load_weights` / `stream_load_scales` execute the plans of
`qatlib.checkpoint.safetensors` (rank 0 reads, every rank joins the same
``GatheredParameters(modifier_rank=0)`` in the same order; on a plain model the same plans run
with no collective); `build_qat_model` is the whole warm-started QAT model
(`qatlib.models.load_prepared` calls it under ZeRO-3).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint import safetensors as st
from ..checkpoint.keys import scale_keys
from ..checkpoint.layout import (
    WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
    CheckpointError,
    check_scheme,
    safetensors_files,
    weight_files,
    write_json,
)
from ..checkpoint.tied import checkpoint_max, tied_checkpoint_keys
from ..device import collective_device
from ..quant import PrepareOptions, Quantizer, QuantScheme, prepare
from ..quant.tying import param_aliases
from ..surgery.moe import linearize_moe_experts
from .io import (
    Zero3Context,
    Zero3Error,
    _Comm,
    _dist_ready,
    gathered_param_if_zero3,
    is_zero3_param,
    model_is_zero3,
    sliced_evenly,
)

log = logging.getLogger(__name__)


# =========================================================================== empty model
def build_empty_model(
    model_path_or_config: str | os.PathLike | Any,
    ctx: Zero3Context,
    *,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    linearize_moe: bool = True,
) -> nn.Module:
    """A causal LM built from its config under ``zero.Init``: partitioned, weights NOT read nor
    initialised (fill them with `stream_load_weights`). Fused MoE experts are linearised inside the
    same context, so the per-expert linears are partitioned at creation and nothing is copied.
    What gathers together is the DeepSpeed config's ``zero_optimization.leaf_module`` (qatlib's
    default: one `qatlib.surgery.moe.ExpertMLP`, `qatlib.zero3.ds_config`), which DeepSpeed applies in
    ``initialize``."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.integrations.deepspeed import prevent_arange_dtype_change
    from transformers.modeling_utils import set_zero3_state

    if isinstance(model_path_or_config, (str, os.PathLike)):
        config = AutoConfig.from_pretrained(str(model_path_or_config), trust_remote_code=trust_remote_code)
    else:
        config = model_path_or_config
    kwargs: dict[str, Any] = {"dtype": ctx.dtype, "trust_remote_code": trust_remote_code}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    t0 = time.perf_counter()
    # Our own zero.Init (not from_config's): set_zero3_state tells from_config that one is active, so it
    # neither opens a second one nor runs initialize_weights_zero3 (a gathered random init of every module).
    with no_init_weights(), prevent_arange_dtype_change(), ctx.zero_init(), set_zero3_state():
        model = AutoModelForCausalLM.from_config(config, **kwargs)
        n_moe = linearize_moe_experts(model, copy_weights=False) if linearize_moe else 0
    if hasattr(model, "tie_weights"):  # no_init_weights also skipped the tying init_weights does
        model.tie_weights()
    model.config.use_cache = False
    log.info(
        "built empty %s under zero.Init in %.1fs (%d MoE blocks linearised)",
        type(model).__name__,
        time.perf_counter() - t0,
        n_moe,
    )
    return model.eval()


# =========================================================================== streamed loading
def _execute_plan(
    model: nn.Module, plan: list[st.PlanEntry], comm: _Comm, *, chunk_bytes: int, cast: Callable | None = None
) -> None:
    """All ranks: per chunk, gather its target parameters (modifier rank 0); rank 0 reads and copies;
    rank 0's read errors are broadcast after the chunk and raised everywhere."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())

    def dest_of(name: str) -> torch.Tensor:
        return params[name].data if name in params else buffers[name]

    for chunk in st.chunks(plan, chunk_bytes):
        if _partition_wise(chunk, params, comm, chunk_bytes, cast):
            _load_partitions(params[chunk[0].assigns[0].target], chunk[0], comm, chunk_bytes)
            continue
        targets = list(dict.fromkeys(a.target for e in chunk for a in e.assigns))
        chunk_params = [params[t] for t in targets if t in params]
        error = None
        with torch.no_grad(), gathered_param_if_zero3(chunk_params, modifier_rank=0):
            if comm.is_main:
                try:
                    with open(chunk[0].info.file, "rb") as fh:
                        for e in chunk:
                            st.copy_entry(fh, e, dest_of, cast)
                except Exception as err:  # noqa: BLE001 - broadcast and raised on every rank below
                    error = f"{chunk[0].info.file}: {err}"
        error = comm.bcast(error)
        if error:
            raise Zero3Error(error)
        if comm.active:
            for t in targets:
                if t in buffers:
                    _broadcast_tensor(buffers[t])


def _partition_wise(
    chunk: list[st.PlanEntry], params: dict, comm: _Comm, chunk_bytes: int, cast: Callable | None
) -> bool:
    """A chunk that is one tensor larger than ``chunk_bytes`` filling one whole partitioned
    parameter (Qwen3-30B-A3B's embed_tokens / lm_head, 0.62 GB bf16): loaded partition by partition
    (`_load_partitions`) instead of gathered on every rank."""
    if not comm.active or len(chunk) != 1 or cast is not None:
        return False
    e = chunk[0]
    a = e.assigns[0]
    if (
        len(e.assigns) != 1
        or a.dst is not None
        or a.src is not None
        or a.perm is not None
        or a.target not in params
    ):
        return False
    p = params[a.target]
    return e.info.end - e.info.start > chunk_bytes and sliced_evenly(p)


def _load_partitions(p: torch.Tensor, e: st.PlanEntry, comm: _Comm, chunk_bytes: int) -> None:
    """Rank 0 reads each rank's ZeRO-3 partition of the tensor (elements ``[r * n, (r + 1) * n)``
    of the flattened tensor) straight from the file, in pieces of at most ``chunk_bytes``, and
    sends each piece; rank r receives it into the matching slice of its ``ds_tensor`` and zeroes
    the padding past the tensor's end (never sent). Rank 0's own partition is read into its
    ``ds_tensor``. No rank holds the whole tensor, nor a partition beside its own: rank 0 holds one
    reused piece buffer. Gathering it instead holds it on every rank, twice under gloo (its
    all-gather writes a flat copy first): +1.2 GB per rank for a 0.62 GB embedding.

    A file dtype other than the parameter's is converted piece by piece, as `st.copy_entry` does
    (``copy_``). Rank 0's errors reach every rank as one `Zero3Error`: opening the file (and the
    conversion) is checked before any piece is sent; a read that fails later (the file shrank)
    still sends every piece the other ranks wait for, zeros from then on, and raises after."""
    info = e.info
    src = info.torch_dtype
    cast = src != p.dtype
    dev, n = collective_device(), p.ds_tensor.numel()
    # the piece's elements: its file bytes (and its converted copy) fit in chunk_bytes; every
    # rank computes the same pieces from the plan entry
    k = max(1, min(n, chunk_bytes // (src.itemsize + (p.element_size() if cast else 0))))
    fh, error = None, None
    if comm.is_main:
        try:
            fh = open(info.file, "rb")  # noqa: SIM115 - closed below, on every path
            if cast:  # a conversion copy_ refuses, refused before anything is sent
                torch.zeros(1, dtype=p.dtype).copy_(torch.zeros(1, dtype=src))
        except Exception as err:  # noqa: BLE001 - broadcast and raised on every rank below
            error = f"{info.file}: {err}"
    try:
        error = comm.bcast(error)
        if error:
            raise Zero3Error(error)
        with torch.no_grad():
            if comm.is_main:
                error = _send_partitions(p, fh, info, k, dev)
            else:
                _recv_partition(p, k, dev, comm.rank)
    finally:
        if fh is not None:
            fh.close()
    error = comm.bcast(error)
    if error:
        raise Zero3Error(error)


def _valid(rank: int, n: int, numel: int) -> int:
    """How many elements of rank ``rank``'s partition (``n`` long) lie inside the tensor."""
    return max(0, min(n, numel - rank * n))


def _send_partitions(p: torch.Tensor, fh, info: st.TensorInfo, k: int, dev: torch.device) -> str | None:
    """Rank 0's half of `_load_partitions`: read its own partition into ``p.ds_tensor``, then every
    other rank's, piece by piece, and send each piece. Returns the first read error (every piece
    is sent whatever happens: zeros after an error)."""
    src, n, numel = info.torch_dtype, p.ds_tensor.numel(), p.ds_numel
    part = p.ds_tensor.data.view(-1)
    into_part = part.device.type == "cpu" and src == p.dtype  # read straight into the partition
    raw = torch.empty(k, dtype=src)  # the piece as the file holds it (CPU: file reads)
    out = raw if src == p.dtype and dev.type == "cpu" else torch.empty(k, dtype=p.dtype, device=dev)
    error = None
    for r in range(torch.distributed.get_world_size()):
        valid = _valid(r, n, numel)
        for lo in range(0, valid, k):
            m = min(k, valid - lo)
            if error is None:
                try:
                    if r == 0:
                        if into_part:
                            st.read_elements(fh, info, lo, part[lo : lo + m])
                        else:
                            part[lo : lo + m].copy_(st.read_elements(fh, info, lo, raw[:m]))
                    else:
                        st.read_elements(fh, info, r * n + lo, raw[:m])
                        if out is not raw:
                            out[:m].copy_(raw[:m])
                except Exception as err:  # noqa: BLE001 - broadcast and raised on every rank
                    error = f"{info.file}: {err}"
            if r == 0:
                continue
            if error is not None:
                out[:m].zero_()  # rank r waits for this piece: it gets zeros, then the error
            torch.distributed.send(out[:m], dst=r)
        if r == 0:
            part[valid:].zero_()
    return error


def _recv_partition(p: torch.Tensor, k: int, dev: torch.device, rank: int) -> None:
    """Rank ``rank``'s half of `_load_partitions`: its partition's pieces, in order, into its
    ``ds_tensor`` (through one buffer on the collective's device when the partition is elsewhere);
    the padding past the tensor's end zeroed."""
    n, numel = p.ds_tensor.numel(), p.ds_numel
    part = p.ds_tensor.data.view(-1)
    direct = part.device == dev
    buf = None if direct else torch.empty(k, dtype=p.dtype, device=dev)
    valid = _valid(rank, n, numel)
    for lo in range(0, valid, k):
        m = min(k, valid - lo)
        if direct:
            torch.distributed.recv(part[lo : lo + m], src=0)
        else:
            torch.distributed.recv(buf[:m], src=0)
            part[lo : lo + m].copy_(buf[:m])
    part[valid:].zero_()


def _broadcast_tensor(t: torch.Tensor) -> None:
    """Rank 0's ``t`` to every rank, through the collective's device (NCCL cannot send a CPU buffer)."""
    dev = collective_device()
    if t.device == dev:
        torch.distributed.broadcast(t, src=0)
        return
    tmp = t.to(dev)
    torch.distributed.broadcast(tmp, src=0)
    t.copy_(tmp)


def _full_shape(p: torch.Tensor) -> tuple[int, ...]:
    return tuple(p.ds_shape) if is_zero3_param(p) else tuple(p.shape)


def stream_load_weights(
    model: nn.Module,
    model_path: str | os.PathLike,
    *,
    chunk_bytes: int = 64 << 20,
    ignore: Sequence[str] = st.DEFAULT_IGNORED_KEYS,
) -> dict:
    """Fill every parameter (and persistent buffer) of ``model`` from the safetensors checkpoint in
    ``model_path`` (``model.safetensors`` or a ``model.safetensors.index.json`` with shards).

    Under ZeRO-3 rank 0 alone reads, a chunk (<= ``chunk_bytes`` of one file) at a time, and every
    rank gathers the same parameters in the same order with ``modifier_rank=0``. Keys are placed by
    transformers' own key conversion for the model's class (`qatlib.checkpoint.conversion`: a
    Mixtral hub checkpoint's ``block_sparse_moe.experts.{e}.w1`` fills expert e's ``gate_proj``, as
    ``from_pretrained`` + linearisation would); per-expert and fused ``.experts.gate_up_proj`` /
    ``.experts.down_proj`` keys both load into linearised experts (and into fused ones).
    Missing / unexpected / unconvertible / shape-mismatched / duplicate keys raise one
    `Zero3Error` listing them, on every rank; tied parameters need only one of their names; keys
    matching ``ignore`` (regexes) are skipped; quantizer parameters (of a prepared model) are filled
    when the checkpoint has them under their module names and left alone otherwise (their keys are
    `stream_load_scales`' business). On a plain model it runs locally, with no collective.
    Returns a small report (tensors, bytes, seconds).
    """
    model_dir = Path(model_path)
    comm = _Comm(model_is_zero3(model))
    t0 = time.perf_counter()

    def plan_weights() -> list[st.PlanEntry]:
        files = weight_files(model_dir)
        if not files:
            raise CheckpointError(f"{model_dir}: no {WEIGHTS_FILE} nor {WEIGHTS_INDEX_FILE}")
        return st.weight_plan(files, _model_tensors(model), where=str(model_dir), ignore=ignore)

    plan = comm.decide(plan_weights)
    _execute_plan(model, plan, comm, chunk_bytes=chunk_bytes)
    report = {
        "tensors": len(plan),
        "bytes": sum(e.info.end - e.info.start for e in plan),
        "seconds": round(time.perf_counter() - t0, 3),
    }
    if comm.is_main:
        log.info(
            "loaded %d tensors (%.1f MB) from %s in %.1fs",
            report["tensors"],
            report["bytes"] / 2**20,
            model_dir,
            report["seconds"],
        )
    return report


def load_model(
    model_path: str | os.PathLike,
    ctx: Zero3Context,
    *,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    chunk_bytes: int = 64 << 20,
) -> nn.Module:
    """`build_empty_model` + `stream_load_weights`: the ZeRO-3 branch of `qatlib.models.load_model`."""
    model = build_empty_model(
        model_path,
        ctx,
        trust_remote_code=trust_remote_code,
        attn_implementation=attn_implementation,
    )
    stream_load_weights(model, model_path, chunk_bytes=chunk_bytes)
    return model


def _model_tensors(model: nn.Module) -> st.ModelTensors:
    return st.model_tensors(model, shape_of=_full_shape)


def _scale_plan(model: nn.Module, ptq_dir: str | os.PathLike, scheme: QuantScheme) -> tuple[list, dict]:
    d, _ = check_scheme(ptq_dir, scheme)
    aliases = param_aliases(model)  # a tied scale is filled from its first key; `_tied_max` reads the rest
    keys = scale_keys(model)
    qkeys = {key: name for name, key in keys.items() if name not in aliases}
    plan, report = st.scale_plan(safetensors_files(d), _model_tensors(model), qkeys, where=str(d))
    tied = {keys[n] for n in aliases if n in keys}
    report["unused_key_names"] = [k for k in report["unused_key_names"] if k not in tied]
    report["unused_keys"] = len(report["unused_key_names"])
    return plan, report


def stream_load_scales(
    model: nn.Module,
    ptq_dir: str | os.PathLike,
    scheme: QuantScheme,
    *,
    report_path: str | os.PathLike | None = None,
) -> dict:
    """Warm-start the quantizer parameters of a prepared ``model`` from a PTQ checkpoint.

    ``ptq_dir`` (or its nested ``final_quant_checkpoint/``) must hold ``quant_scheme.json`` compatible
    with ``scheme`` (`QuantScheme.compatible_with`) and ``*.safetensors`` with the keys of
    docs/design.md; fused-expert keys (leading expert dim) fan out to every expert. A scale whose
    shape differs from its quantizer's is an error (no broadcast; only a 1-element scalar fills a
    ``[1]`` scale). Quantizer parameters without a key keep their init value (misses); scale-like
    keys that fit no quantizer are reported as unused, other keys ignored. Works with and without
    ZeRO-3. Returns (and writes to ``report_path`` as JSON, rank 0) the hit / miss counts.
    """
    comm = _Comm(model_is_zero3(model))
    t0 = time.perf_counter()
    plan, report = comm.decide(lambda: _scale_plan(model, ptq_dir, scheme))
    _execute_plan(model, plan, comm, chunk_bytes=64 << 20, cast=lambda t: t.float())
    report["tied_disagreeing"] = _tied_max(model, ptq_dir, scheme, comm)
    loaded = {a.target for e in plan for a in e.assigns}
    # by identity: a scale shared by a tied group is loaded under its first name only, and every
    # member holds it (otherwise the others look uninitialised: export warned of hundreds)
    loaded_ids = {id(p) for n, p in model.named_parameters() if n in loaded}
    for q in model.modules():
        # any parameter: an NVFP4 input quantizer (dynamic groups) stores only its global scale
        if isinstance(q, Quantizer) and any(id(p) in loaded_ids for p in q.parameters(recurse=False)):
            q.initialized.fill_(True)
    report["seconds"] = round(time.perf_counter() - t0, 3)
    if comm.is_main:
        log.info(
            "PTQ scales from %s: %d hits, %d misses (init values kept), %d unused scale keys, %d other keys",
            report["ptq_dir"],
            report["hits"],
            report["misses"],
            report["unused_keys"],
            report["ignored_keys"],
        )
        if report["unused_keys"]:
            log.warning("scale keys matching no quantizer: %s", ", ".join(report["unused_key_names"][:10]))
        if report_path is not None:
            write_json(report_path, report)
    return report


def _tied_max(model: nn.Module, ptq_dir: str | os.PathLike, scheme: QuantScheme, comm: _Comm) -> list[str]:
    """Tied scales (`qatlib.quant.tying`) whose checkpoint keys disagree (an untied checkpoint) take
    the runtime's value, the max over the keys (`qatlib.checkpoint.tied.checkpoint_max`); rank 0 reads the few tied
    keys. Returns the disagreeing groups (logged)."""
    keys = tied_checkpoint_keys(model)
    if not keys:
        return []

    def decide():
        from safetensors import safe_open

        d, _ = check_scheme(ptq_dir, scheme)
        read = {}
        for f in safetensors_files(d):
            with safe_open(str(f), framework="pt") as fh:
                read.update({k: fh.get_tensor(k) for k in keys if k in fh.keys()})
        return checkpoint_max(model, read)

    fix, bad = comm.decide(decide)
    if fix:
        params = dict(model.named_parameters())
        with torch.no_grad(), gathered_param_if_zero3([params[n] for n in fix], modifier_rank=0):
            if comm.is_main:
                for n, v in fix.items():
                    params[n].data.copy_(v.reshape(params[n].shape).to(params[n].dtype))
        if comm.is_main:
            log.warning(
                "%s: %d tied scale groups have different values under their keys (an untied checkpoint); they "
                "take the max, as the runtime would: %s",
                ptq_dir,
                len(bad),
                "; ".join(bad[:3]),
            )
    return bad


# =========================================================================== QAT build
def prepare_zero3(
    model: nn.Module,
    scheme: QuantScheme,
    ctx: Zero3Context,
    *,
    ignore: Sequence[str] = ("lm_head",),
    options: PrepareOptions | None = None,
) -> nn.Module:
    """`qatlib.quant.prepare` on a partitioned model: the whole swap runs inside one fp32
    ``zero.Init``, so every new scale / zero point / LWC factor is partitioned at creation (and
    initialised from the init values: shards cannot be read)."""
    with ctx.scale_init():
        prepare(model, scheme, ignore=ignore, options=options or PrepareOptions())
    return model


def build_qat_model(
    model_path: str | os.PathLike,
    ctx: Zero3Context,
    scheme: QuantScheme,
    *,
    from_ptq_ckpt: str | os.PathLike | None,
    ignore: Sequence[str] = ("lm_head",),
    options: PrepareOptions | None = None,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    scales_report_path: str | os.PathLike | None = None,
    chunk_bytes: int = 64 << 20,
) -> nn.Module:
    """The whole ZeRO-3 start: empty model -> streamed weights -> prepare -> streamed PTQ scales.

    ``from_ptq_ckpt`` is required: under ZeRO-3 no rank sees a whole weight or activation, so scales
    cannot be calibrated by forward and must come from a PTQ checkpoint. Its scheme is checked
    before anything is built."""
    comm = _Comm(_dist_ready())
    if from_ptq_ckpt is None:
        raise Zero3Error(
            "ZeRO-3 QAT needs a PTQ checkpoint (compression.QAT.from_ptq_ckpt): scales cannot be calibrated by "
            "forward on partitioned weights. Run the PTQ stage first and point from_ptq_ckpt at its output."
        )
    comm.decide(lambda: check_scheme(from_ptq_ckpt, scheme))
    model = load_model(
        model_path,
        ctx,
        trust_remote_code=trust_remote_code,
        attn_implementation=attn_implementation,
        chunk_bytes=chunk_bytes,
    )
    prepare_zero3(model, scheme, ctx, ignore=ignore, options=options)
    stream_load_scales(model, from_ptq_ckpt, scheme, report_path=scales_report_path)
    return model
