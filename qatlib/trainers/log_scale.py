"""Adam steps in log space for positive quantization scales (``quant_config.scale_update: log``).

Why: Adam moves every element by about ``lr`` per step whatever its gradient, so one absolute
``learning_rate`` cannot serve scales whose sizes differ by orders of magnitude: int4 g16 weight
scales are ~5e-3 on SmolLM2 (lr 1e-3 is a 20% step: the guard stopped int4 g16 at step 8), FP8
scales ~1e-4, NVFP4's E4M3 group scales ~64 (lr 2e-4 left QAT = PTQ to every digit). Training
``u = log(scale)`` instead makes ``lr`` a RELATIVE step per element (lr 1e-2 ~ 1% of each scale),
the same for every format and every element of a tensor, and a scale can never reach 0 or below.

How: the optimizer stays the stock ``torch.optim.AdamW`` (DeepSpeed ZeRO-3 accepts it and hands it
its flat fp32 partitions, one param group at a time). The gradient of each scale in a group marked
``log_space`` is ``dL/du = scale * dL/ds`` from the start: a gradient hook on the parameter applies
the chain rule as autograd computes it, so everything between backward and the step (the
trainer's ``max_grad_norm`` / DeepSpeed's ``gradient_clipping``, the ZeRO-3 reduction) sees the
gradient the optimizer steps on. The tensor itself moves into log space around each ``step`` (the
optimizer's public step hooks: ``log(scale)`` before, ``exp`` after). All of it is elementwise, so
it is the same on a flat ZeRO-3 partition as on the full tensor (ZeRO-3 parity), and the checkpoint
keeps the scale itself (layout unchanged). Adam's moments are in log units; decoupled weight decay
would pull ``log(scale)`` toward 0 (scale 1), so these groups have none. Zero points are not
positive and stay in an ordinary (additive) group.

Why in the backward and not in the pre-step hook (as until 2026-12): the clipping norm was then
taken over ``dL/ds``, which grows as ``1/scale``. On the upcycled MoE (fp8_static), whose q_proj
inputs are ~1e-5 (scales ~2e-8), those raw gradients were ~1e5 and the global norm 2.3e5: clipping
to 1 divided every gradient by 2.3e5, below Adam's ``eps``, and the scales and weights barely moved
(scales-only QAT recovered -0.05 +- 0.25 of the PTQ gap). In log units the same gradients are ~1e-3.

E8M0 scales (MXFP4's power-of-two group scales) get their own rate, `e8m0_lr`: the forward
rounds a master to the nearest power of two, so in log space its rounding bucket is ln 2 wide, and
a master starts on a power of two (the bucket's centre): it must move ln(2)/2 = 0.35 before the
forward changes at all. At the relative 1e-2 that suits fp32 / E4M3 scales, Adam moves it at most
~0.2 in a 30-step cosine schedule, so QAT left every MXFP4 scale where RTN put it (SmolLM2 W4A16:
recovery 0.000); at 5 x that rate it recovers 0.526 +- 0.032 (benchmarks/README.md at 2faaa77, FP4 rows).

No library does this: torch / DeepSpeed optimizers have no per-element relative rate, and a
reparametrised Parameter (``torch.nn.utils.parametrize``) would change the checkpoint keys.
"""

from __future__ import annotations

import torch

from .grad_hook import set_gradient_hook

LOG_SPACE = "log_space"  # the param-group key marking a group trained in log space
SCALE_UPDATES = ("additive", "log")
# padding of a flat ZeRO-3 partition is 0: log would make it -inf (harmless but noisy); a scale
# this small is not a scale anyone trains
_TINY = torch.finfo(torch.float32).tiny
# log space: E8M0 scales step at this multiple of the scales' relative lr (module docstring: the
# measured 5e-2 against 1e-2); additive steps keep one absolute lr (E8M0 scales are ~2^-4 there)
E8M0_LOG_LR_FACTOR = 5.0
# the attribute a log-space scale keeps its gradient hook's handle in (`_set_log_gradient`)
_HOOK_ATTR = "_qatlib_log_gradient_hook"


def e8m0_lr(lr: float, scale_update: str, explicit: float | None = None) -> float:
    """The learning rate of E8M0 (power-of-two) scales when the other scales train at ``lr``:
    ``explicit`` (``quant_config.e8m0_scale_lr``) when set, else ``E8M0_LOG_LR_FACTOR * lr`` in
    log space and ``lr`` under additive steps. The one place that default is decided."""
    if explicit is not None:
        return float(explicit)
    return E8M0_LOG_LR_FACTOR * lr if scale_update == "log" else lr


def _log_groups(optimizer: torch.optim.Optimizer):
    for g in optimizer.param_groups:
        if g.get(LOG_SPACE):
            yield g


def _to_log(optimizer: torch.optim.Optimizer, *_args) -> None:
    with torch.no_grad():
        for g in _log_groups(optimizer):
            for p in g["params"]:
                p.clamp_(min=_TINY).log_()


def _from_log(optimizer: torch.optim.Optimizer, *_args) -> None:
    with torch.no_grad():
        for g in _log_groups(optimizer):
            for p in g["params"]:
                p.exp_()


def install_log_space_steps(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make ``optimizer`` step its ``log_space`` groups in log space (see the module docstring).
    Refuses a group with weight decay. Returns the optimizer."""
    for g in _log_groups(optimizer):
        if g.get("weight_decay", 0.0):
            raise ValueError(
                f"param group {g.get('name', '?')!r} is stepped in log space: weight decay there would "
                "pull every scale toward 1; set its weight_decay to 0"
            )
        if frozen := sum(not p.requires_grad for p in g["params"]):
            # the chain rule is a gradient hook, which torch registers only on a tensor that
            # requires grad: unfrozen later, such a scale would step its raw dL/ds in log space
            raise ValueError(
                f"param group {g.get('name', '?')!r} is stepped in log space but holds {frozen} "
                "parameter(s) with requires_grad=False: unfreeze the scales before building the optimizer"
            )
    for g in optimizer.param_groups:
        for p in g["params"]:
            _set_log_gradient(p, bool(g.get(LOG_SPACE)))
    optimizer.register_step_pre_hook(_to_log)
    optimizer.register_step_post_hook(_from_log)
    return optimizer


def _chain_rule(p: torch.nn.Parameter):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        return grad * p.detach()  # d L / d log s = s * d L / d s, with s as the forward used it

    return hook


def _set_log_gradient(p: torch.nn.Parameter, on: bool) -> None:
    """``p``'s gradient in log units (``on``) or its own: the latest optimizer that holds ``p``
    decides (`grad_hook.set_gradient_hook`)."""
    set_gradient_hook(p, _HOOK_ATTR, _chain_rule(p) if on else None)
