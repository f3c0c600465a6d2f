"""One gradient hook per named slot on a parameter, replaced (never stacked) by whichever optimizer
was built last: a two-phase run builds several optimizers over the same tensors, and a second
chain-rule hook would apply the factor twice. Used by `log_scale` (scales stepped in log space) and
`weight_units` (weights stepped in units of their size), each with its own slot."""

from __future__ import annotations

from collections.abc import Callable

import torch


def set_gradient_hook(
    p: torch.nn.Parameter, slot: str, hook: Callable[[torch.Tensor], torch.Tensor] | None
) -> None:
    """Remove the hook ``p`` holds in ``slot`` (an attribute name) and register ``hook`` there (none:
    ``p`` keeps its plain gradient). torch registers a hook only on a tensor that requires grad."""
    handle = getattr(p, slot, None)
    if handle is not None:
        handle.remove()
        delattr(p, slot)
    if hook is not None:
        setattr(p, slot, p.register_hook(hook))
