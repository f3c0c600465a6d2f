"""Checkpoint key -> model parameter (+ slice): the one place that decides where each tensor of a
weights checkpoint lands in a model, for every reader (the ZeRO-3 streamed load, the layer-by-layer
PTQ / export / evaluation `qatlib.zero3.onload.Onloader`, `qatlib.checkpoint.safetensors.weight_plan`).

The rules are transformers' own, those ``from_pretrained`` applies for the model's class
(``transformers.conversion_mapping.get_model_conversion_mapping``: the class's and model type's
``WeightRenaming`` / ``WeightConverter`` list, the legacy renamings, the base-model prefix, the
class's ``_keys_to_ignore_on_load_unexpected``), applied key by key with transformers'
``rename_source_key`` in transformers' key order (``dot_natural_key``). So a checkpoint that
``from_pretrained`` loads loads here: Mixtral / MiniMax-M2's hub layout
(``block_sparse_moe.experts.{e}.w1|w2|w3.weight``), Qwen-MoE's per-expert keys, renamed routers.

Why not run transformers' converters on the tensors: a converter (``MergeModulelist`` +
``Concatenate``) builds a whole layer's fused experts before anything is stored (1.2 GB bf16 per
Qwen3-30B-A3B layer), on the one reading rank, and qatlib's model holds those experts linearised
(`qatlib.surgery.moe`) anyway. Instead each converter's operations are followed on index boxes
(`_Piece`): which slice of the fused tensor each checkpoint tensor becomes (a stacked expert index,
an offset along the concatenated dim, a transposition, a chunk), then which slice of which
linearised expert that slice is. Each checkpoint tensor is then read once into its own place, as a
Qwen3-MoE per-expert key is: the same reads, the same peak. An operation with no such index
reading (``Interleave``, ``PermuteForRope``, custom ones) is refused naming the key and the
operation, before anything is read. A key that no rule explains stays an error naming it.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..quant.quantizer import role_parameters
from ..surgery.moe import ExpertsLayout, LinearizedMoeExperts, expert_slices, fused_shapes, is_fused_experts

Range = tuple[int, int]


# =========================================================================== what a plan knows
@dataclasses.dataclass(frozen=True)
class Assign:
    """Copy ``source[src].permute(perm)`` into ``target[dst]`` (``target``: a parameter or buffer
    name; None: the whole tensor, no permutation)."""

    target: str
    dst: tuple | None = None
    src: tuple | None = None
    perm: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class ExpertBlock:
    """An MoE experts module: fused 3-D tensors (``gate_up_proj [E, 2I, H]``, ``down_proj``) or
    linearised per-expert ``{e}.gate_proj|up_proj|down_proj`` linears; ``layout``: the fused layout
    linearised ones were made from (`qatlib.surgery.moe.ExpertsLayout`: GPT-OSS's is transposed,
    interleaved, biased), which is where their fused checkpoint tensors put each expert."""

    num_experts: int
    intermediate_dim: int
    fused: bool
    layout: ExpertsLayout | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class KeyRules:
    """transformers' loading rules for one model: its conversion list (renamings and converters,
    in order), its base-model prefix, its config (a ``Chunk`` may read a count from it) and the
    unexpected-key patterns its class declares harmless."""

    transforms: tuple
    base_model_prefix: str | None
    config: Any
    ignore_unexpected: tuple[str, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class ModelTensors:
    """What a plan knows of a model: names and full shapes, no tensor."""

    params: dict[str, tuple[int, ...]]  # every parameter, once (tied: under its first name)
    buffers: dict[str, tuple[int, ...]]  # persistent buffers
    aliases: dict[str, str]  # another name of a tied parameter -> its first name
    experts: dict[str, ExpertBlock]  # module name -> experts module
    optional: frozenset[str]  # quantizer parameters: filled when a checkpoint has them
    rules: KeyRules | None = None  # transformers' key conversion (None: keys are the model's names)


def key_rules(model: nn.Module) -> KeyRules | None:
    """transformers' loading rules for ``model`` as ``from_pretrained`` gathers them (None for a
    module that is no transformers model)."""
    from transformers import PreTrainedModel
    from transformers.conversion_mapping import get_model_conversion_mapping

    if not isinstance(model, PreTrainedModel):
        return None
    ignore = tuple(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    return KeyRules(tuple(get_model_conversion_mapping(model)), model.base_model_prefix, model.config, ignore)


def model_tensors(
    model: nn.Module, shape_of: Callable[[torch.Tensor], Sequence[int]] = torch.Tensor.size
) -> ModelTensors:
    """The `ModelTensors` of ``model``; ``shape_of`` gives a parameter's full shape (a partitioned
    parameter's is not its ``shape``)."""
    params = {n: tuple(shape_of(p)) for n, p in model.named_parameters()}
    canon = {id(p): n for n, p in model.named_parameters()}
    aliases = {
        n: canon[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if canon[id(p)] != n
    }
    buffers = {}
    for mname, m in model.named_modules():
        for bname, b in m.named_buffers(recurse=False):
            if b is not None and bname not in m._non_persistent_buffers_set:
                buffers[f"{mname}.{bname}" if mname else bname] = tuple(b.shape)
    experts = {}
    for n, m in model.named_modules():
        if isinstance(m, LinearizedMoeExperts):
            layout = m.source_layout or ExpertsLayout(len(m), m.hidden_dim, m.intermediate_dim)
            experts[n] = ExpertBlock(len(m), m.intermediate_dim, fused=False, layout=layout)
        elif is_fused_experts(m):
            experts[n] = ExpertBlock(m.num_experts, m.intermediate_dim, fused=True)
    optional = frozenset(n for n, _ in role_parameters(model))
    return ModelTensors(params, buffers, aliases, experts, optional, key_rules(model))


# =========================================================================== the model's own names
def _expert_regions(model: ModelTensors) -> dict[str, tuple[tuple[int, ...], list[tuple[str, tuple, Any]]]]:
    """The fused tensors transformers' class holds where qatlib holds linearised experts: fused
    name -> (its shape, [(linear parameter, its index into the fused tensor, its permutation)]).
    The layout is the one the experts were linearised from (`ExpertBlock.layout`), its arithmetic
    `qatlib.surgery.moe.expert_slices`'s: Qwen3-MoE's ``gate_up_proj [E, 2I, H]`` (gate rows
    first), GPT-OSS's transposed ``[E, H, 2I]`` with interleaved gate / up columns and biases."""
    out = {}
    for p, blk in model.experts.items():
        if blk.fused:
            continue
        # no recorded layout: Qwen3-MoE's, its hidden width read off an expert's down_proj [H, I]
        layout = blk.layout or ExpertsLayout(
            blk.num_experts, model.params[f"{p}.0.down_proj.weight"][0], blk.intermediate_dim
        )
        regions: dict[str, list] = {}
        for e in range(blk.num_experts):
            for local, sl in expert_slices(layout, e).items():
                regions.setdefault(sl.source, []).append((f"{p}.{e}.{local}", sl.index, sl.perm))
        for source, shape in fused_shapes(layout).items():
            out[f"{p}.{source}"] = (shape, regions[source])
    return out


def _as_ranges(index: tuple, shape: tuple[int, ...]) -> tuple | None:
    """``index`` (ints and slices) as the index box `_region` takes (ints and ``(lo, hi)``), None
    for a strided slice (no box: an interleaved layout)."""
    out = []
    for i, n in zip(index, shape):
        if isinstance(i, int):
            out.append(i)
            continue
        lo, hi, step = i.indices(n)
        if step != 1:
            return None
        out.append((lo, hi))
    return tuple(out)


# =========================================================================== index boxes
@dataclasses.dataclass(frozen=True)
class _Piece:
    """One checkpoint tensor inside the tensor being built: per dim of that tensor, ``dst`` is an
    int (a dim the checkpoint tensor lacks: a stacked expert) or a ``(lo, hi)`` range that runs
    along the checkpoint tensor's dim ``link[d]``; ``src`` is, per checkpoint dim, the range read
    (or the one index picked)."""

    key: str
    dst: tuple
    src: tuple
    link: tuple


@dataclasses.dataclass(frozen=True)
class _Sym:
    """A tensor being built by a converter's operations: its shape and the pieces that fill it."""

    shape: tuple[int, ...]
    pieces: tuple[_Piece, ...]


def _set(t: tuple, i: int, v) -> tuple:
    return t[:i] + (v,) + t[i + 1 :]


def _leaf(key: str, shape: tuple[int, ...]) -> _Sym:
    whole = tuple((0, n) for n in shape)
    return _Sym(tuple(shape), (_Piece(key, whole, whole, tuple(range(len(shape)))),))


def _dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _stack(syms: list[_Sym], dim: int, bad: list[str]) -> _Sym:
    """``torch.stack``: each tensor at its list position along the new dim ``dim``. A tensor whose
    shape differs from its siblings' is left out and named in ``bad``."""
    shape = Counter(s.shape for s in syms).most_common(1)[0][0]
    dim = _dim(dim, len(shape) + 1)
    pieces = []
    for i, s in enumerate(syms):
        if s.shape != shape:
            bad += [f"{p.key}: checkpoint {list(s.shape)}, its siblings {list(shape)}" for p in s.pieces]
            continue
        pieces += [
            dataclasses.replace(
                p, dst=p.dst[:dim] + (i,) + p.dst[dim:], link=p.link[:dim] + (None,) + p.link[dim:]
            )
            for p in s.pieces
        ]
    return _Sym(shape[:dim] + (len(syms),) + shape[dim:], tuple(pieces))


def _cat(syms: list[_Sym], dim: int, bad: list[str]) -> _Sym:
    """``torch.cat`` along ``dim``: each tensor's pieces shifted by the sizes before it."""
    ref = syms[0].shape
    dim = _dim(dim, len(ref))
    pieces, off = [], 0
    for s in syms:
        if len(s.shape) != len(ref) or s.shape[:dim] + s.shape[dim + 1 :] != ref[:dim] + ref[dim + 1 :]:
            bad += [
                f"{p.key}: checkpoint part {list(s.shape)} does not concatenate with {list(ref)}"
                for p in s.pieces
            ]
            continue
        for p in s.pieces:
            d = p.dst[dim]
            moved = d + off if isinstance(d, int) else (d[0] + off, d[1] + off)
            pieces.append(dataclasses.replace(p, dst=_set(p.dst, dim, moved)))
        off += s.shape[dim]
    return _Sym(_set(ref, dim, off), tuple(pieces))


def _transpose(s: _Sym, d0: int, d1: int) -> _Sym:
    d0, d1 = _dim(d0, len(s.shape)), _dim(d1, len(s.shape))

    def swap(t: tuple) -> tuple:
        t = list(t)
        t[d0], t[d1] = t[d1], t[d0]
        return tuple(t)

    return _Sym(
        swap(s.shape), tuple(dataclasses.replace(p, dst=swap(p.dst), link=swap(p.link)) for p in s.pieces)
    )


def _narrow(s: _Sym, dim: int, lo: int, hi: int) -> _Sym:
    """``s[..., lo:hi, ...]`` along ``dim``: the pieces cut to it, their reads cut alike."""
    pieces = []
    for p in s.pieces:
        d = p.dst[dim]
        if isinstance(d, int):
            if lo <= d < hi:
                pieces.append(dataclasses.replace(p, dst=_set(p.dst, dim, d - lo)))
            continue
        a, b = max(d[0], lo), min(d[1], hi)
        if a >= b:
            continue
        sd = p.link[dim]
        s0 = p.src[sd][0] + a - d[0]
        pieces.append(
            dataclasses.replace(
                p, dst=_set(p.dst, dim, (a - lo, b - lo)), src=_set(p.src, sd, (s0, s0 + b - a))
            )
        )
    return _Sym(_set(s.shape, dim, hi - lo), tuple(pieces))


def _select(s: _Sym, dim: int, i: int) -> _Sym:
    """``s[..., i, ...]`` (the dim dropped): the pieces that hold index ``i``."""
    pieces = []
    for p in s.pieces:
        d = p.dst[dim]
        if isinstance(d, int):
            if d != i:
                continue
            src = p.src
        elif d[0] <= i < d[1]:
            src = _set(p.src, p.link[dim], p.src[p.link[dim]][0] + i - d[0])
        else:
            continue
        pieces.append(_Piece(p.key, p.dst[:dim] + p.dst[dim + 1 :], src, p.link[:dim] + p.link[dim + 1 :]))
    return _Sym(s.shape[:dim] + s.shape[dim + 1 :], tuple(pieces))


def _region(s: _Sym, region: tuple) -> _Sym:
    """``s[region]`` (per dim an int or a ``(lo, hi)`` range), last dim first so indices stay put."""
    for dim in reversed(range(len(region))):
        r = region[dim]
        s = _select(s, dim, r) if isinstance(r, int) else _narrow(s, dim, *r)
    return s


def _chunks(n: int, parts: int) -> list[Range]:
    """The ranges ``torch.chunk`` cuts ``n`` into (``ceil(n / parts)`` each, maybe fewer parts)."""
    step = -(-n // parts)
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)]


def _assign(target: str, p: _Piece, shape: tuple[int, ...], src_shape: tuple[int, ...]) -> Assign:
    """The `Assign` of a piece of ``target`` (full shape ``shape``): whole indices become None."""

    def index(box: tuple, full: tuple[int, ...]) -> tuple | None:
        if all(not isinstance(b, int) and b == (0, n) for b, n in zip(box, full)):
            return None
        return tuple(b if isinstance(b, int) else slice(*b) for b in box)

    kept = [d for d, v in enumerate(p.src) if not isinstance(v, int)]
    order = tuple(kept.index(p.link[d]) for d, v in enumerate(p.dst) if not isinstance(v, int))
    perm = None if order == tuple(range(len(order))) else order
    return Assign(target, index(p.dst, shape), index(p.src, src_shape), perm)


# =========================================================================== converters
class _Unsupported(Exception):
    pass


def _one(v) -> _Sym:
    return v[0] if isinstance(v, list) else v


def _run_converter(conv, collected: dict[str, list[_Sym]], layer: str, native: dict, config, bad: list[str]):
    """Follow ``conv``'s operations on index boxes, as `WeightConverter.convert` runs them on
    tensors (same inputs, same target names); returns ``{full target name: _Sym}``."""
    from transformers.core_model_loading import (
        Chunk,
        Concatenate,
        MergeModulelist,
        Split,
        Transpose,
    )

    data: dict[str, Any] = dict(collected)
    src, tgt = conv.source_patterns, conv.target_patterns
    for op in conv.operations:
        if type(op) is MergeModulelist:
            size = len(data)
            data = {
                op.get_target_pattern(size, k, tgt): (_stack(v, op.dim, bad) if isinstance(v, list) else v)
                for k, v in data.items()
            }
        elif type(op) is Concatenate:
            parts = []
            for k in src:
                if k in data:
                    v = data.pop(k)
                    parts += v if isinstance(v, list) else [v]
            data = {op.get_target_pattern(tgt): _cat(parts, op.dim, bad)}
        elif type(op) is Transpose:
            name = op.get_target_pattern(data, src, tgt)
            s = _one(next(iter(data.values())))
            if op.check_dims and s.shape == native.get(layer):
                data = {name: s}
            else:
                data = {name: _transpose(s, op.dim0, op.dim1)}
        elif type(op) in (Chunk, Split):
            if len(data) > 1:
                raise _Unsupported(f"{type(op).__name__} of several tensors")
            s = _one(next(iter(data.values())))
            dim = _dim(op.dim, len(s.shape))
            if type(op) is Chunk:
                names = op.get_target_patterns(tgt, config=config)
                ranges = _chunks(s.shape[dim], len(names))
            else:
                names, ranges, lo = tgt, [], 0
                for t in tgt:
                    n = native.get(layer.replace(tgt[0], t), (0,) * (dim + 1))[dim]
                    ranges.append((lo, lo + n))
                    lo += n
            data = {name: _narrow(s, dim, *r) for name, r in zip(names, ranges)}
        else:
            raise _Unsupported(type(op).__name__)
    full = layer.replace("*.", "0.") if "*." in layer else layer
    found = next((full.partition(k) for k in data if k in full), None)
    if found is not None:
        prefix, _, suffix = found
        data = {prefix + k + suffix: v for k, v in data.items()}
    return {k: _one(v) for k, v in data.items()}


# =========================================================================== placing keys
@dataclasses.dataclass
class Placement:
    """Where every key of a checkpoint goes: ``assigns`` per key; ``problems`` by title (the
    titles of `qatlib.checkpoint.safetensors.format_problems`); ``reported``: targets a problem
    already names (not listed again as missing); ``tied`` / ``skipped``: keys deliberately not
    read (another name of a tied parameter; an ignored pattern)."""

    assigns: dict[str, list[Assign]] = dataclasses.field(default_factory=dict)
    problems: dict[str, list[str]] = dataclasses.field(
        default_factory=lambda: {"unexpected": [], "shape mismatch": [], "not convertible slice by slice": []}
    )
    reported: set[str] = dataclasses.field(default_factory=set)
    tied: list[str] = dataclasses.field(default_factory=list)
    skipped: list[str] = dataclasses.field(default_factory=list)


def place_keys(
    shapes: dict[str, tuple[int, ...]], model: ModelTensors, ignore: Sequence[str] = ()
) -> Placement:
    """Map the checkpoint keys ``shapes`` (key -> shape) onto ``model``'s parameters and buffers.

    Each key is renamed by transformers' rules for the model (``rename_source_key``, keys in
    ``dot_natural_key`` order: a converter's list position is that order, as in
    ``from_pretrained``); a key the rules leave alone that names a tensor of the model is that
    tensor (qatlib's own saves: linearised experts, quantizer parameters). A converter's keys
    become slices of its target (`_run_converter`), a fused target of linearised experts becomes
    slices of the expert linears. Keys matching ``ignore`` (regexes, whole key) or the class's
    ``_keys_to_ignore_on_load_unexpected`` (searched, as transformers does) are skipped."""
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    regions = _expert_regions(model)
    aliases = model.aliases
    native = {**model.params, **model.buffers, **{a: model.params[c] for a, c in aliases.items()}}
    native.update({k: shape for k, (shape, _) in regions.items()})
    rules = model.rules
    transforms = copy.deepcopy(list(rules.transforms)) if rules else []  # some renamings keep state
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    ignore_re = [re.compile(p) for p in ignore]
    class_ignore = [re.compile(p) for p in (rules.ignore_unexpected if rules else ())]
    out = Placement()
    groups: dict[str, tuple[Any, dict[str, list[_Sym]]]] = {}

    def land(target: str, s: _Sym | None, src_shape: tuple[int, ...]) -> list[Assign]:
        """Assigns filling ``target`` (a name of ``native``) with ``s``'s pieces (None: the whole
        checkpoint tensor is the whole target)."""
        if target not in regions:
            return (
                [Assign(target)]
                if s is None
                else [_assign(target, p, native[target], src_shape) for p in s.pieces]
            )
        out_ = []
        for param, index, perm in _candidates(target, s):
            if s is None:
                out_.append(Assign(param, src=index, perm=perm))
                continue
            box = _as_ranges(index, native[target])
            if box is None or perm is not None:
                # a converter built this fused tensor, and the linear is a strided / transposed
                # region of it: no index box follows that (no transformers converter builds one)
                raise _Unsupported(f"a converter into the {target} layout (strided / transposed experts)")
            sub = _region(s, box)
            out_ += [_assign(param, p, sub.shape, src_shape) for p in sub.pieces]
        return out_

    # the regions of each fused target by expert (their first index): a piece holding one expert
    # meets only that expert's linears (128 experts: without this, placing Qwen3-30B-A3B's keys
    # intersects every piece with every region, ~45 s)
    by_expert = {t: {} for t in regions}
    for t, (_, regs) in regions.items():
        for reg in regs:
            by_expert[t].setdefault(reg[1][0], []).append(reg)

    def _candidates(target: str, s: _Sym | None) -> list:
        if s is not None and len(s.pieces) == 1 and isinstance(s.pieces[0].dst[0], int):
            return by_expert[target].get(s.pieces[0].dst[0], [])
        return regions[target][1]

    def targets_of(name: str) -> list[str]:
        return [reg[0] for reg in regions[name][1]] if name in regions else [name]

    for key in sorted(shapes, key=dot_natural_key):
        target, pattern = key, None
        if rules is not None:
            target, pattern = rename_source_key(key, renamings, converters, rules.base_model_prefix, native)
            if target not in native and key in native:
                target, pattern = rename_source_key(key, [], [], rules.base_model_prefix, native)
        if target in native and pattern is not None:
            conv, collected = groups.setdefault(target, (by_pattern[pattern], {}))
            collected.setdefault(pattern, []).append(_leaf(key, tuple(shapes[key])))
        elif target in aliases:
            out.tied.append(key)  # the same Parameter as aliases[target]: filled by that key
        elif target in native:
            out.assigns.setdefault(key, []).extend(land(target, None, tuple(shapes[key])))
        elif any(r.fullmatch(key) for r in ignore_re) or any(r.search(target) for r in class_ignore):
            out.skipped.append(key)
        else:
            out.problems["unexpected"].append(key if target == key else f"{key} (read as {target})")
    for layer, (conv, collected) in groups.items():
        keys = [p.key for v in collected.values() for s in v for p in s.pieces]
        bad: list[str] = []
        try:
            built = _run_converter(conv, collected, layer, native, rules.config, bad)
        except _Unsupported as e:
            out.problems["not convertible slice by slice"] += [
                f"{k} (transformers applies {e})" for k in keys
            ]
            continue
        out.problems["shape mismatch"] += bad
        for name, s in built.items():
            if name in aliases:
                out.tied += sorted({p.key for p in s.pieces})
                continue
            if name not in native:
                out.problems["unexpected"] += [f"{p.key} (converted into {name})" for p in s.pieces]
                continue
            if s.shape != native[name]:
                out.problems["shape mismatch"].append(
                    f"{name}: converted from {len(keys)} keys ({keys[0]}, ...) to {list(s.shape)}, "
                    f"model {list(native[name])}"
                )
                out.reported.update(targets_of(name))
                continue
            if bad:
                out.reported.update(targets_of(name))
            try:
                placed = [(p.key, land(name, _Sym(s.shape, (p,)), tuple(shapes[p.key]))) for p in s.pieces]
            except _Unsupported as e:
                out.problems["not convertible slice by slice"] += [f"{k} ({e})" for k in keys]
                out.reported.update(targets_of(name))
                continue
            for key, assigns in placed:
                out.assigns.setdefault(key, []).extend(assigns)
    return out


# =========================================================================== the other way: saving
def saved_names(model: nn.Module) -> Callable[[str], str]:
    """``name -> the key save_pretrained writes for it``: transformers' reverse renamings, as
    ``revert_weight_conversion`` applies them to a model not loaded by ``from_pretrained`` (the
    class's list without the legacy renamings and prefix changes, reversed). A writer that streams
    tensors one at a time (`qatlib.export.stream`) names them as the in-memory export's
    ``save_pretrained`` does (Mixtral: ``mlp.`` back to ``block_sparse_moe.``). A name a reverse
    converter would claim is refused: its tensor changes, not only its name (the whole-model
    export, ``save_pretrained``, can write it)."""
    from transformers import PreTrainedModel
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        PrefixChange,
        WeightConverter,
        WeightRenaming,
        apply_converters,
        apply_renamings,
    )

    if not isinstance(model, PreTrainedModel):
        return lambda name: name
    forward = [
        t for t in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(t, PrefixChange)
    ]
    reverse = [t.reverse_transform() for t in forward[::-1]]
    renamings = [t for t in reverse if isinstance(t, WeightRenaming)]
    converters = [t for t in reverse if isinstance(t, WeightConverter)]

    def name_of(name: str) -> str:
        _, pattern = apply_converters(name, converters)
        if pattern is not None:
            raise ValueError(
                f"{name}: transformers converts this tensor when saving ({pattern}); the streamed writer "
                "only renames (export the whole model)"
            )
        return apply_renamings(name, renamings)

    return name_of
