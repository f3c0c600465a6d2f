"""The checkpoint key table of docs/design.md, in both directions: module names -> keys
(`scale_keys`, `scale_state_dict`) and keys -> modules (`parse_key`).

For a `QuantLinear` named ``L``:

===========================================  ==============================================
key                                          quantizer
===========================================  ==============================================
``L.weight_scale``, ``L.weight_zero_point``  ``L.weight_quantizer`` (LWC: the clipped scale)
``L.input_scale``, ``L.input_zero_point``    ``L.input_quantizer``
``L.weight_global_scale``                    NVFP4: the weight quantizer's global scale
``L.input_global_scale``                     NVFP4: the (dynamic) input quantizer's global scale
``<attn>.k_cache.scale`` / ``.zero_point``   ``<attn>.k_proj.output_quantizer`` (same for v)
``L.output_scale``, ``L.output_zero_point``  any other static output quantizer (q)
``L.weight_quantizer.clip_factor_w_max|min``  the LWC clip factors (under their own name)
``L.weight_quantizer.subgroup_logit``        FOCUS's sub-group scale logits (own name, raw)
===========================================  ==============================================

The sub-group logits train with the scales; an export folds their factors into the FP4 codes
(`qatlib.quant.linear.QuantLinear.codes`), so no runtime key carries them.

The global scales follow compressed-tensors (``448 * 6 / amax``, the effective group scale is
``weight_scale / weight_global_scale``), so a PTQ checkpoint, a QAT save and the export agree.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import NamedTuple

import torch
from safetensors import safe_open
from torch import nn

from ..quant.linear import QuantLinear, attention_role, quant_linears, weight_readable
from .layout import CheckpointError, resolve_dir, scale_files

SCALE_KINDS = ("scale", "zero_point", "global_scale")
LWC_PARAMS = ("clip_factor_w_max", "clip_factor_w_min")
# quantizer parameters stored under their own name (raw, for resuming): LWC's and FOCUS's
OWN_NAME_PARAMS = (*LWC_PARAMS, "subgroup_logit")

# ``L.weight_scale``, ``L.input_zero_point``, ``L.output_scale`` ...
_LINEAR_KEY = re.compile(
    r"^(?P<layer>.+)\.(?P<role>weight|input|output)_(?P<kind>global_scale|scale|zero_point)$"
)
# ``<attn>.k_cache.scale`` = ``<attn>.k_proj.output_quantizer``
_CACHE_KEY = re.compile(r"^(?:(?P<attn>.+)\.)?(?P<kv>[kv])_cache\.(?P<kind>scale|zero_point)$")


class ScaleKey(NamedTuple):
    """A parsed checkpoint key: the linear it belongs to, the tensor role and scale / zero point."""

    layer: str  # module name of the linear (k/v cache keys: the k_proj / v_proj)
    role: str  # "weight" | "input" | "output"
    kind: str  # "scale" | "zero_point" | "global_scale"


def kv_role(name: str, model: nn.Module | None = None) -> str | None:
    """``"k"`` / ``"v"`` when the linear ``name`` is an attention module's k / v projection (its
    output quantizer is the KV cache's), else None. With ``model`` the attention module is found
    by structure (`qatlib.quant.linear.attention_role`); without, by the projection's name."""
    parent_name, _, child = name.rpartition(".")
    if model is None:
        role = child[0] if child in ("k_proj", "v_proj") else None
    else:
        role = attention_role(model.get_submodule(parent_name) if parent_name else model, child)
    return role if role in ("k", "v") else None


def key_of(layer: str, role: str, kind: str, kv: str | None = None) -> str:
    """The key of ``layer``'s ``role`` quantizer ("weight" / "input" / "output") ``kind``
    ("scale" / "zero_point"); ``kv``: the layer's `kv_role` (its output is then a cache key)."""
    if role == "output" and kv is not None:
        parent = layer.rpartition(".")[0]
        return f"{parent}.{kv}_cache.{kind}" if parent else f"{kv}_cache.{kind}"
    return f"{layer}.{role}_{kind}"


def parse_key(key: str) -> ScaleKey | None:
    """The inverse of `key_of`: ``model.layers.0.mlp.down_proj.weight_scale`` -> (``...down_proj``,
    weight, scale); ``<attn>.k_cache.scale`` -> (``<attn>.k_proj``, output, scale); None for any
    other key (weights, LWC clip factors)."""
    m = _LINEAR_KEY.match(key)
    if m:
        return ScaleKey(m["layer"], m["role"], m["kind"])
    m = _CACHE_KEY.match(key)
    if m:
        proj = f"{m['kv']}_proj"
        return ScaleKey(f"{m['attn']}.{proj}" if m["attn"] else proj, "output", m["kind"])
    return None


def scale_keys(model: nn.Module) -> dict[str, str]:
    """Quantizer parameter name -> checkpoint key, for every stored quantizer parameter of
    ``model`` (scales, zero points, LWC clip factors, sub-group logits; dynamic quantizers have
    none)."""
    keys: dict[str, str] = {}
    for name, ql in quant_linears(model):
        kv = kv_role(name, model)
        for attr, q in ql.quantizers():
            role = attr.removesuffix("_quantizer")
            for kind in SCALE_KINDS:
                if getattr(q, kind) is not None:
                    keys[f"{name}.{attr}.{kind}"] = key_of(name, role, kind, kv)
            for pname in OWN_NAME_PARAMS:
                if getattr(q, pname) is not None:
                    keys[f"{name}.{attr}.{pname}"] = f"{name}.{attr}.{pname}"
    return keys


@torch.no_grad()
def scale_state_dict(
    model: nn.Module, *, linears: Iterable[tuple[str, QuantLinear]] | None = None
) -> dict[str, torch.Tensor]:
    """The scale keys of every `QuantLinear` (or of ``linears``, names relative to ``model``),
    fp32, CPU, contiguous: weight scale / zero point (LWC: the clipped scale of the current
    weight), static input and output scales (k/v outputs: the cache keys). No LWC clip factors."""
    out: dict[str, torch.Tensor] = {}

    def put(key: str, t: torch.Tensor | None) -> None:
        if t is not None:
            out[key] = t.detach().float().cpu().contiguous().clone()

    for name, ql in quant_linears(model) if linears is None else linears:
        wq = ql.weight_quantizer
        if wq is not None:
            if wq.uses_lwc and not weight_readable(ql.weight):
                raise ValueError(f"the LWC scale of {name} needs its full weight (ZeRO-3: gather it first)")
            s, z = wq.qparams(ql.weight if wq.uses_lwc else None)
            put(key_of(name, "weight", "scale"), s)
            put(key_of(name, "weight", "zero_point"), None if z is None else torch.round(z))
            put(key_of(name, "weight", "global_scale"), ql.weight_global_scale())
        kv = kv_role(name, model)
        for attr in ("input_quantizer", "output_quantizer"):
            q = getattr(ql, attr)
            if q is not None and not q.spec.dynamic:
                role = attr.removesuffix("_quantizer")
                put(key_of(name, role, "scale", kv), q.scale)
                put(key_of(name, role, "zero_point", kv), q.zero_point)
            if q is not None and q.global_scale is not None:  # NVFP4 input: dynamic groups, static global
                put(key_of(name, attr.removesuffix("_quantizer"), "global_scale", kv), q.global_scale)
    return out


def own_name_key(key: str) -> bool:
    """A quantizer parameter stored under its own name (`OWN_NAME_PARAMS`: LWC clip factors,
    FOCUS's sub-group logits), ``L.weight_quantizer.<param>``."""
    return key.rpartition(".")[2] in OWN_NAME_PARAMS and ".weight_quantizer." in key


def load_scales(ckpt_dir: str | os.PathLike, *, own_names: bool = False) -> dict[str, torch.Tensor]:
    """Every scale and zero-point tensor of a PTQ or QAT checkpoint, as fp32 CPU tensors.

    Reads all ``*.safetensors`` files of the directory (`resolve_dir`, with the safetensors
    fallback: single file or shards, the PTQ ``scales.safetensors`` as well as the scale file beside
    a QAT model folder) and keeps the keys `parse_key` understands (with ``own_names``, also the
    parameters stored under their own name: `own_name_key`); weights (and otherwise LWC clip
    factors / sub-group logits) are skipped without being read. A key present in two files must
    hold the same values there (else the checkpoint is ambiguous: error).
    """
    d = resolve_dir(ckpt_dir, safetensors_fallback=True)
    files = scale_files(d)
    if not files:
        raise CheckpointError(f"{d}: no *.safetensors file")
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if parse_key(key) is None and not (own_names and own_name_key(key)):
                    continue
                t = f.get_tensor(key).float()
                if key in out:
                    if torch.equal(out[key], t):
                        continue
                    raise CheckpointError(
                        f"{d}: scale key {key} differs between {origin[key]} and {path.name}"
                    )
                out[key] = t
                origin[key] = path.name
    return out
