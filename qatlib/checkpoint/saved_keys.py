"""Model tensor name -> the checkpoint key a writer writes it under: the inverse of
`qatlib.checkpoint.conversion`'s placement, for every writer (the ZeRO-3 save, the PTQ checkpoint,
the in-memory and streamed exports).

qatlib holds MoE experts linearised (``mlp.experts.{e}.gate_proj``, `qatlib.surgery.moe`) where
transformers' class holds them fused and its hub checkpoints hold them per expert under other names
(Mixtral / MiniMax-M2: ``block_sparse_moe.experts.{e}.w1|w2|w3.weight``). Written under qatlib's
names, ``from_pretrained`` reports those experts MISSING and fills them at random (a warning only),
and vLLM 0.33's Mixtral / MiniMax-M2 loaders do not place them. The keys are not a second table:
they are what ``save_pretrained`` writes for the fused tensors (``revert_weight_conversion`` run on
the meta device), matched to the linears by `conversion.place_keys` itself. A module of its own
beside `conversion` (which stays the one owner of key -> parameter) for the 600-line limit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from .conversion import Assign, _expert_regions, model_tensors, place_keys, saved_names


def source_keys(
    model: nn.Module, shape_of: Callable[[torch.Tensor], Sequence[int]] = torch.Tensor.size
) -> dict[str, str]:
    """``linearised expert weight -> the checkpoint key that fills it whole``: the key transformers'
    class reads it from (Mixtral / MiniMax-M2: ``block_sparse_moe.experts.{e}.w1.weight`` for
    ``mlp.experts.{e}.gate_proj.weight``; Qwen3-MoE: its own name). Found by inverting the
    placement, not by a second table: the fused tensors the class holds (`_expert_regions`) are
    reverted on the meta device as ``save_pretrained`` reverts them (``revert_weight_conversion``),
    and the keys that gives are placed (`place_keys`); a key landing whole, unpermuted, on one
    linear is that linear's. Without this a qatlib save of a Mixtral (per-expert linears) loads in
    ``from_pretrained`` with its experts MISSING (randomly filled, a warning). An expert weight no
    single key fills (a transposed or interleaved fused layout) is left out: it keeps its name."""
    from transformers import PreTrainedModel
    from transformers.core_model_loading import revert_weight_conversion

    if not isinstance(model, PreTrainedModel):
        return {}
    tensors = model_tensors(model, shape_of)
    fused = {n: torch.empty(shape, device="meta") for n, (shape, _) in _expert_regions(tensors).items()}
    if not fused:
        return {}
    reverted = revert_weight_conversion(model, fused)
    placed = place_keys({k: tuple(t.shape) for k, t in reverted.items()}, tensors)
    return {
        a[0].target: key for key, a in placed.assigns.items() if len(a) == 1 and a[0] == Assign(a[0].target)
    }


def expert_names(
    model: nn.Module, shape_of: Callable[[torch.Tensor], Sequence[int]] = torch.Tensor.size
) -> Callable[[str], str]:
    """``tensor name -> the key every writer writes it under`` for a linearised expert's tensors (its
    weight and what an export writes beside it: ``weight_scale``, ``input_scale``, ...): under the
    module of the key that fills its weight (`source_keys`; what ``from_pretrained`` and vLLM 0.33's
    Mixtral / MiniMax-M2 loaders read); any other name unchanged. The result is left alone by
    ``save_pretrained``'s reverse conversion, so a writer may hand it to ``save_pretrained``."""
    direct = source_keys(model, shape_of)
    modules = {}
    for param, key in direct.items():
        (mod, _, leaf), (hub, _, hub_leaf) = param.rpartition("."), key.rpartition(".")
        if leaf == hub_leaf:
            modules[mod] = hub

    def name_of(name: str) -> str:
        if name in direct:
            return direct[name]
        mod, _, leaf = name.rpartition(".")
        return f"{modules[mod]}.{leaf}" if mod in modules else name

    return name_of


def checkpoint_names(model: nn.Module) -> Callable[[str], str]:
    """`expert_names`, then `saved_names` for the rest: every key as ``save_pretrained`` of the
    model with its experts named by `expert_names` writes it (the streamed export's writer)."""
    experts, rename = expert_names(model), saved_names(model)

    def name_of(name: str) -> str:
        new = experts(name)
        return new if new != name else rename(name)

    return name_of


def written_names(model: nn.Module) -> Callable[[str], tuple[str, ...]]:
    """``tensor name -> every key a writer may have written it under``: `expert_names`' (the ZeRO-3
    save) and, where it differs, `checkpoint_names`' (``save_pretrained``: the PTQ checkpoint, the
    exports; Mixtral's router is ``block_sparse_moe.gate`` there). For a reader that matches keys
    by name (`qatlib.resume`); a name only a converter writes (a fused tensor) has the first only."""
    experts, rename = expert_names(model), saved_names(model)

    def names(name: str) -> tuple[str, ...]:
        first = experts(name)
        try:
            second = rename(first)
        except ValueError:  # transformers converts this tensor when saving: its own name only
            return (first,)
        return (first,) if second == first else (first, second)

    return names
