"""Layer-sequential onloading: run a model one decoder layer at a time, so PTQ calibration,
GPTQ, export and evaluation of a model larger than the device (or than host RAM) need about one
layer beyond what must stay resident.

Two sources of weights, one interface (`Onloader`):

- a checkpoint folder (`load_skeleton` + `Onloader.from_checkpoint`): the model is built with
  every weight on the meta device (accelerate's ``init_empty_weights``; buffers such as RoPE tables
  are real) and MoE experts linearised; `Onloader.onload` reads one module's weights from the
  safetensors shards (the plans of `qatlib.checkpoint.safetensors`, the ZeRO-3 loader's key
  mapping: fused and per-expert MoE keys, tied names) and `offload` returns them to meta. Host
  memory: the module being run, never the model.
- a model already in host memory (`Onloader.resident`): `onload` moves a module to the device,
  `offload` back to the CPU (GPTQ, whose updated weights must be kept).

Quantizer parameters (scales) are small and are the product of these stages: they stay real on
the CPU between onloads (`realize_quantizers` gives a meta-prepared skeleton its init values by
building each quantizer anew with the owner's constructor).

`capture_layer_inputs` runs the model's own forward up to the first decoder layer (its embeddings,
attention mask and position embeddings) and stops; `run_layer` / `carry` then push those inputs
through each layer in turn, as GPTQ always did. Hand-written: accelerate's ``cpu_offload`` /
``device_map`` keeps every weight resident in host memory (and its disk offload re-saves the whole
model first), which is exactly what a 61 GB checkpoint on a 24-64 GB host cannot afford.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint import safetensors as st
from ..checkpoint.layout import WEIGHTS_FILE, WEIGHTS_INDEX_FILE, CheckpointError, weight_files
from ..quant.calibration import batch_inputs
from ..quant.linear import PrepareOptions, QuantLinear
from ..quant.quantizer import Quantizer
from ..surgery.modeling import decoder_layers, resolve_dtype
from ..surgery.moe import linearize_moe_experts

log = logging.getLogger(__name__)

Batch = tuple[tuple, dict]  # (args, kwargs) of one decoder-layer call


class _Stop(Exception):
    pass


# =========================================================================== skeleton
def load_skeleton(
    path: str | os.PathLike,
    *,
    torch_dtype: str | torch.dtype | None = "auto",
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
) -> nn.Module:
    """The causal LM of the checkpoint folder ``path`` with every parameter on the meta device
    (no weight read; buffers real), fused MoE experts linearised, tied weights tied, eval mode,
    ``use_cache`` off: what `qatlib.models.load_model` returns, without the weights."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    dtype = resolve_dtype(torch_dtype)
    if dtype == "auto":  # as from_pretrained's "auto": the config's dtype, else the checkpoint's
        dtype = getattr(config, "dtype", None) or _checkpoint_dtype(path)
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, **kwargs)
        linearize_moe_experts(model, copy_weights=False)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    model.config.use_cache = False
    return model.eval()


def load_whole(model: nn.Module, path: str | os.PathLike, device="cpu") -> nn.Module:
    """Every weight of the skeleton ``model`` (`load_skeleton`, possibly prepared and its scales
    loaded) read from the checkpoint folder ``path`` onto ``device``, to stay: the model
    `qatlib.models.load_model` returns, read the way the layer-by-layer stages read it.

    Why not ``from_pretrained`` (the evaluation's CPU load, #16): transformers maps each
    safetensors file and keeps the tensors it does not convert as views of the mapping, so the
    process's RSS (and a cgroup limit) counts every touched page of the file besides its own
    copies (fused MoE experts, split again by `qatlib.surgery.moe`): 6.9 to 11.7 GiB for a 3.74 GB
    model. Here each tensor is read with plain file reads into its own storage
    (`qatlib.checkpoint.safetensors`), experts straight into their linears: the model once."""
    Onloader.from_checkpoint(model, path, device=device).onload(model)  # buffers move with it
    return model


def _checkpoint_dtype(path) -> torch.dtype:
    files = weight_files(path)
    for info in st.read_header(files[0]) if files else ():
        dt = st._ST_DTYPES[info.dtype]
        if dt.is_floating_point:
            return dt
    return torch.float32


@torch.no_grad()
def realize_quantizers(model: nn.Module, options: PrepareOptions | None = None) -> int:
    """Give every quantizer whose parameters are on the meta device (a skeleton prepared with
    `qatlib.quant.prepare`) real CPU parameters holding their init values, by building it anew
    with `Quantizer`'s own constructor (``options``: the init values prepare used). Returns how
    many quantizers were realised."""
    options = options or PrepareOptions()
    n = 0
    # a meta Parameter shared by several quantizers (`qatlib.quant.tying`: q/k/v, gate/up, a
    # layer's expert inputs) becomes ONE real Parameter shared by the same quantizers
    real: dict[int, nn.Parameter] = {}
    kept: list[nn.Parameter] = []  # the replaced meta Parameters stay alive: their ids stay unique
    for _, ql in _quant_linears(model):
        shapes = {
            "weight_quantizer": (ql.out_features, ql.in_features),
            "input_quantizer": (ql.in_features,),
            "output_quantizer": (ql.out_features,),
        }
        for role, q in ql.quantizers():
            if not any(t.is_meta for t in [*q.parameters(), *q.buffers()]):
                continue
            weight = role == "weight_quantizer"
            fresh = Quantizer(
                q.spec,
                shapes[role],
                init_value=options.weight_init_value if weight else options.act_init_value,
                lwc_init=options.lwc_init if weight else None,
                clamp_grad=q.clamp_grad,
                compile_fake_quant=q.compile_fake_quant,
            )
            for name, p in fresh.named_parameters(recurse=False):
                old = getattr(q, name)
                if old is None or tuple(old.shape) != tuple(p.shape):
                    raise RuntimeError(f"realize_quantizers: {role}.{name} does not match a fresh quantizer")
                if old.is_meta:
                    kept.append(old)
                    q._parameters[name] = real.setdefault(id(old), p)
            for name, b in fresh.named_buffers(recurse=False):
                q._buffers[name] = b
            n += 1
    return n


def _quant_linears(module: nn.Module) -> Iterator[tuple[str, QuantLinear]]:
    for name, m in module.named_modules():
        if isinstance(m, QuantLinear):
            yield name, m


def is_skeleton(model: nn.Module) -> bool:
    """True when some parameter of ``model`` is on the meta device (weights onloaded on demand)."""
    return any(p.is_meta for p in model.parameters())


# =========================================================================== onloader
def _quantizer_param_ids(module: nn.Module) -> set[int]:
    return {id(t) for m in module.modules() if isinstance(m, Quantizer) for t in m.parameters(recurse=False)}


class Onloader:
    """Puts one module's weights on ``device`` at a time (`onload` / `offload`, or `onloaded`).

    ``source`` is a checkpoint folder (the model is a `load_skeleton` skeleton, possibly
    prepared) or None (the model is in host memory: modules move between the CPU and
    ``device``). Quantizers move with their module and come back to the CPU."""

    def __init__(
        self, model: nn.Module, source: str | os.PathLike | None, device: torch.device | str | None = "cpu"
    ):
        self.model = model
        # device None (resident only): nothing moves (a model dispatched by device_map keeps its placement)
        self.moves = device is not None
        if device is None and source is not None:
            raise ValueError("Onloader: a checkpoint source needs a device")
        self.device = (
            torch.device(device)
            if device is not None
            else next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))
        )
        self.source = None if source is None else Path(source)
        self.refresh()
        self._entries: dict[str, list[st.PlanEntry]] = {}
        if self.source is not None:
            # each onload allocates a layer's tensors and each offload frees them: without a fixed
            # mmap threshold glibc raises its dynamic one to their size and keeps the freed layers
            # in the heap, so the RSS grows layer by layer (the ZeRO-3 loader's remedy, zero3_io)
            from .heap import mmap_large_allocations

            mmap_large_allocations()
            files = weight_files(self.source)
            if not files:
                raise CheckpointError(f"{self.source}: no {WEIGHTS_FILE} nor {WEIGHTS_INDEX_FILE}")
            for e in st.weight_plan(files, st.model_tensors(model), where=str(self.source)):
                for a in e.assigns:
                    self._entries.setdefault(a.target, []).append(e)

    @classmethod
    def from_checkpoint(cls, model: nn.Module, path: str | os.PathLike, device="cpu") -> Onloader:
        return cls(model, path, device)

    @classmethod
    def resident(cls, model: nn.Module, device="cpu") -> Onloader:
        """Onloading of a model in host memory; ``device`` None: nothing moves (the model computes
        where it is, e.g. dispatched by ``device_map``)."""
        return cls(model, None, device)

    def refresh(self) -> None:
        """Index every module slot holding each parameter (tied parameters have several). Call it
        after the model's modules were swapped (`qatlib.quant.prepare`): onloading replaces a
        parameter in the slots indexed here."""
        self._owners: dict[int, list[tuple[nn.Module, str]]] = {}
        self._names: dict[int, str] = {}
        for mname, m in self.model.named_modules(remove_duplicate=False):
            for pname, p in m._parameters.items():
                if p is not None:
                    self._owners.setdefault(id(p), []).append((m, pname))
                    self._names.setdefault(id(p), f"{mname}.{pname}" if mname else pname)

    # ------------------------------------------------------------------ weights
    def _replace(self, old: nn.Parameter, new: torch.Tensor) -> nn.Parameter:
        p = nn.Parameter(new, requires_grad=old.requires_grad)
        owners = self._owners.pop(id(old))
        for m, pname in owners:
            m._parameters[pname] = p
        self._owners[id(p)] = owners
        self._names[id(p)] = self._names.pop(id(old))
        return p

    def _weights(self, module: nn.Module, recurse: bool) -> list[nn.Parameter]:
        skip = _quantizer_param_ids(module)
        return [p for p in module.parameters(recurse=recurse) if id(p) not in skip]

    @torch.no_grad()
    def onload(self, module: nn.Module, *, recurse: bool = True) -> None:
        """``module``'s weights (its own only, without ``recurse``) and quantizers on the device."""
        if self.source is None:
            if self.moves:
                _move(module, self.device, recurse)
            return
        todo = {}
        for p in self._weights(module, recurse):
            if p.is_meta:
                name = self._names[id(p)]
                todo[name] = self._replace(p, torch.empty(p.shape, dtype=p.dtype, device="cpu"))
        self._read(todo)
        _move(module, self.device, recurse)

    def _read(self, todo: dict[str, nn.Parameter]) -> None:
        entries = list({id(e): e for name in todo for e in self._entries.get(name, ())}.values())
        missing = [n for n in todo if n not in self._entries]
        if missing:
            raise CheckpointError(f"{self.source}: no checkpoint key fills {', '.join(missing[:5])}")
        entries.sort(key=lambda e: (e.info.file, e.info.start))
        by_file: dict[str, list[st.PlanEntry]] = {}
        for e in entries:
            by_file.setdefault(e.info.file, []).append(e)
        for file, es in by_file.items():
            with open(file, "rb") as fh:
                for e in es:
                    inside = tuple(a for a in e.assigns if a.target in todo)
                    st.copy_entry(fh, st.PlanEntry(e.info, inside), lambda n: todo[n].data)

    @torch.no_grad()
    def offload(self, module: nn.Module, *, recurse: bool = True) -> None:
        """Undo `onload`: weights back to meta (checkpoint source) or to the CPU, quantizers to the CPU."""
        cpu = torch.device("cpu")
        if self.source is None:
            if self.moves:
                _move(module, cpu, recurse)
            return
        for p in self._weights(module, recurse):
            if not p.is_meta:
                self._replace(p, torch.empty(p.shape, dtype=p.dtype, device="meta"))
        _move(module, cpu, recurse)

    @contextmanager
    def onloaded(self, module: nn.Module, *, recurse: bool = True) -> Iterator[nn.Module]:
        self.onload(module, recurse=recurse)
        try:
            yield module
        finally:
            self.offload(module, recurse=recurse)

    # ------------------------------------------------------------------ the outer modules
    def outer_modules(self, *, head: bool = False) -> list[nn.Module]:
        """The modules owning parameters outside the decoder layers (embeddings, final norm; the
        output head only with ``head``: calibration and the layer inputs never run it)."""
        _, layers = decoder_layers(self.model)
        inside = {id(m) for layer in layers for m in layer.modules()}
        out_emb = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        skip = set() if head or out_emb is None else {id(m) for m in out_emb.modules()}
        return [
            m
            for m in self.model.modules()
            if id(m) not in inside and id(m) not in skip and any(True for _ in m.parameters(recurse=False))
        ]

    @contextmanager
    def outer_onloaded(self, *, head: bool = False) -> Iterator[None]:
        """The outer modules (`outer_modules`) onloaded inside the block; the outer buffers (RoPE
        tables: real on a skeleton, small) move to the device and stay there."""
        mods = self.outer_modules(head=head)
        for m in mods:
            self.onload(m, recurse=False)
        _, layers = decoder_layers(self.model)
        inside = {id(m) for layer in layers for m in layer.modules()}
        for m in self.model.modules() if self.moves else ():
            if id(m) not in inside:
                for k, b in m._buffers.items():
                    if b is not None and not b.is_meta and b.device != self.device:
                        m._buffers[k] = b.to(self.device)
        try:
            yield
        finally:
            for m in mods:
                self.offload(m, recurse=False)


def _move(module: nn.Module, device: torch.device, recurse: bool) -> None:
    """Move the real (non-meta) parameters and buffers of ``module`` (its own and its quantizers'
    only, without ``recurse``) to ``device``, keeping the Parameter objects (ties, optimizer
    references); meta ones stay where they are."""
    mods = (
        list(module.modules())
        if recurse
        else [module, *(c for c in module.children() if isinstance(c, Quantizer))]
    )
    for m in mods:
        for p in m._parameters.values():
            if p is not None and not p.is_meta and p.device != device:
                p.data = p.data.to(device)
        for k, b in m._buffers.items():
            if b is not None and not b.is_meta and b.device != device:
                m._buffers[k] = b.to(device)


# =========================================================================== running
def capture_layer_inputs(model: nn.Module, batches: Iterable[Any], device) -> tuple[list[Batch], int, int]:
    """``(inputs of the first decoder layer per batch, batches, tokens)``: the model's own forward
    (embeddings, attention mask, position embeddings) stopped at the first layer. Needs the outer
    modules but the head onloaded (`Onloader.outer_onloaded`)."""
    _, layers = decoder_layers(model)
    inputs: list[Batch] = []

    def catch(module, args, kwargs):
        inputs.append((args, kwargs))
        raise _Stop

    n_batches = n_tokens = 0
    handle = layers[0].register_forward_pre_hook(catch, with_kwargs=True)
    try:
        with torch.no_grad():
            for batch in batches:
                kwargs, n = _batch_on(model, batch, device)
                try:
                    model(**kwargs, use_cache=False)
                except _Stop:
                    pass
                n_batches += 1
                n_tokens += n
    finally:
        handle.remove()
    return inputs, n_batches, n_tokens


def _batch_on(model: nn.Module, batch: Any, device) -> tuple[dict, int]:
    # batch_inputs moves the batch to the first parameter's device: on a skeleton that may be meta
    probe = nn.Linear(1, 1, device=device)
    return batch_inputs(probe, batch)


def run_layer(layer: nn.Module, batch: Batch) -> torch.Tensor:
    """The hidden states one decoder layer returns for one captured call."""
    args, kwargs = batch
    out = layer(*args, **kwargs)
    return out[0] if isinstance(out, (tuple, list)) else out


def carry(outputs: list[Batch], layer: nn.Module, batch: Batch) -> None:
    """Run ``layer`` on one captured call and keep the next layer's inputs in ``outputs``."""
    args, kwargs = batch
    outputs.append(((run_layer(layer, batch), *args[1:]), kwargs))


def layer_prefix(model: nn.Module, index: int) -> str:
    path, _ = decoder_layers(model)
    return f"{path}.{index}."


def iter_onloaded_modules(model: nn.Module, loader: Onloader) -> Iterator[tuple[str, nn.Module]]:
    """``model.named_modules()`` with each module's weights onloaded while it is yielded: a decoder
    layer from its first module to its last, any other module owning parameters on its own. The
    walk `qatlib.export.export` takes as ``modules`` (one layer resident at a time)."""
    _, layers = decoder_layers(model)
    layer_ids = {id(m) for m in layers}
    current: tuple[str, nn.Module] | None = None
    try:
        for name, m in model.named_modules():
            if current is not None and not name.startswith(current[0] + "."):
                loader.offload(current[1])
                current = None
            if id(m) in layer_ids:
                loader.onload(m)
                current = (name, m)
            if current is not None or not any(True for _ in m.parameters(recurse=False)):
                yield name, m
                continue
            with loader.onloaded(m, recurse=False):
                yield name, m
    finally:
        if current is not None:
            loader.offload(current[1])
