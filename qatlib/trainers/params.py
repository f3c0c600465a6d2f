"""Which tensors train, and the optimizer groups they go in.

Selection is by module TYPE and parameter ROLE, never by name substrings: quantizer parameters
carry a role (``"scale"`` for scales / zero points, ``"lwc"`` for clip factors, see
`qatlib.quant.quantizer`), and norms are modules whose class name ends with ``RMSNorm`` /
``LayerNorm``. The ``learnable`` switches of ``plugin_config.quant_config`` map to:

============  ===========================================================================
act_scale     ``input_quantizer`` scale / zero point of every QuantLinear
weight_scale  ``weight_quantizer`` scale / zero point (none for LWC quantizers: derived), and
              FOCUS's sub-group scale logits (``subgroup_logit``, role ``"subgroup"``: upstream's
              ``quant_max_scale``, which its ``weight_scale`` switch trains)
kv_scale      ``output_quantizer`` scale / zero point of the attention k/v projections
norm          weight (and bias) of every norm module
lwc           ``weight_quantizer`` clip factors (``clip_factor_w_max/min``)
============  ===========================================================================

Everything else is frozen (``requires_grad=False``). q-projection output scales (``q`` in the
scheme) belong to no switch and stay frozen. Groups: scales at ``learning_rate`` (E8M0 scales at
`qatlib.trainers.log_scale.e8m0_lr` of it), sub-group logits additive at ``subgroup_lr`` (upstream's
``learnable.quant_max_scale_lr``), LWC at ``lwc_lr``, norms at ``norm_lr`` (default
``learning_rate``) — upstream marked norms trainable but never handed them to its optimizer, so
``norm: true`` trained nothing there.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from torch import nn

from ..quant import quant_linears
from ..quant.linear import attention_role
from ..quant.quantizer import PARAM_ROLES, POSITIVE_PARAMS, ROLE_LWC, ROLE_SCALE, ROLE_SUBGROUP, Quantizer
from ..quant.spec import ScaleFormat
from .log_scale import LOG_SPACE, SCALE_UPDATES, e8m0_lr
from .weight_units import unit_groups

NORM_SUFFIXES = ("RMSNorm", "LayerNorm")


@dataclass(frozen=True)
class Learnable:
    """The ``learnable`` switches (defaults as upstream: weight scales only).

    An experiment builds it with `qatlib.config.ExperimentConfig.learnable`; these defaults are
    the YAML's (``quant_config.learnable`` takes them from here).
    """

    act_scale: bool = False
    weight_scale: bool = True
    kv_scale: bool = False
    norm: bool = False
    lwc: bool = False


@dataclass
class TrainableParams:
    """Selected parameters by group, each a list of ``(name, Parameter)`` without duplicates.

    ``e8m0``: the ids of the selected scales whose quantizer rounds them to E8M0 (MXFP4 group
    scales), known from the quantizer's spec when selected; they step at their own lr."""

    scale: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    subgroup: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    lwc: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    norm: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    weight: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    e8m0: set[int] = field(default_factory=set)

    GROUPS = ("scale", "subgroup", "lwc", "norm", "weight")

    def items(self) -> Iterator[tuple[str, list[tuple[str, nn.Parameter]]]]:
        for g in self.GROUPS:
            yield g, getattr(self, g)

    def names(self) -> set[str]:
        return {n for _, ps in self.items() for n, _ in ps}

    def parameters(self) -> list[nn.Parameter]:
        return [p for _, ps in self.items() for _, p in ps]

    def counts(self) -> dict[str, int]:
        return {g: len(ps) for g, ps in self.items()}

    def numel(self) -> int:
        return sum(int(getattr(p, "ds_numel", p.numel())) for p in self.parameters())


def is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(NORM_SUFFIXES)


def _is_kv_projection(model: nn.Module, name: str) -> bool:
    """A k / v projection of an attention module (`qatlib.quant.linear.attention_role`)."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    return attention_role(parent, child) in ("k", "v")


def _role_params(q: Quantizer | None, prefix: str, role: str) -> Iterator[tuple[str, nn.Parameter]]:
    if q is None:
        return
    for pname, p in q.named_parameters(recurse=False):
        if PARAM_ROLES.get(pname) == role:
            yield f"{prefix}.{pname}", p


def _e8m0_scale(q: Quantizer | None) -> nn.Parameter | None:
    """``q``'s group scale when its forward rounds it to E8M0 (MXFP4), else None."""
    if q is None or q.scale is None or q.spec.scale_format is not ScaleFormat.E8M0:
        return None
    return q.scale


def select_trainable(
    model: nn.Module,
    learnable: Learnable,
    *,
    modules: Iterable[tuple[str, nn.Module]] | None = None,
    weights: bool = False,
) -> TrainableParams:
    """The parameters ``learnable`` selects in ``model`` (or only in ``modules``: ``(name, module)``
    pairs with names relative to ``model``, e.g. one decoder block for blockwise training).

    ``weights=True`` adds the QuantLinear weights / biases (blockwise ``weight_lr``)."""
    out = TrainableParams()
    seen: set[int] = set()

    def add(group: str, items: Iterable[tuple[str, nn.Parameter]]) -> None:
        for n, p in items:
            if id(p) not in seen:
                seen.add(id(p))
                getattr(out, group).append((n, p))

    def add_scales(q: Quantizer | None, prefix: str) -> None:
        add("scale", _role_params(q, prefix, ROLE_SCALE))
        if (p := _e8m0_scale(q)) is not None:
            out.e8m0.add(id(p))

    scopes = [("", model)] if modules is None else list(modules)
    for scope_name, scope in scopes:
        pre = f"{scope_name}." if scope_name else ""
        for rel, ql in quant_linears(scope):
            name = pre + rel
            if learnable.weight_scale:
                add_scales(ql.weight_quantizer, f"{name}.weight_quantizer")
                add("subgroup", _role_params(ql.weight_quantizer, f"{name}.weight_quantizer", ROLE_SUBGROUP))
            if learnable.lwc:
                add("lwc", _role_params(ql.weight_quantizer, f"{name}.weight_quantizer", ROLE_LWC))
            if learnable.act_scale:
                add_scales(ql.input_quantizer, f"{name}.input_quantizer")
            if learnable.kv_scale and _is_kv_projection(model, name):
                add_scales(ql.output_quantizer, f"{name}.output_quantizer")
            if weights:
                add("weight", ((f"{name}.{k}", p) for k, p in ql.named_parameters(recurse=False)))
        if learnable.norm:
            for rel, m in scope.named_modules():
                if is_norm(m):
                    name = pre + rel
                    add(
                        "norm",
                        ((f"{name}.{k}" if name else k, p) for k, p in m.named_parameters(recurse=False)),
                    )
    return out


def freeze_all_but(model: nn.Module, trainable: TrainableParams) -> None:
    """``requires_grad`` True exactly for ``trainable``'s parameters."""
    keep = {id(p) for p in trainable.parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)


def apply_learnable(model: nn.Module, learnable: Learnable) -> TrainableParams:
    """Select by ``learnable``, freeze everything else; raises when nothing would train."""
    tp = select_trainable(model, learnable)
    if not tp.parameters():
        raise ValueError(
            f"learnable={learnable} selects no parameter of this model (no QuantLinear with such "
            "quantizers; e.g. weight_scale with LWC quantizers, act_scale with dynamic activations)"
        )
    freeze_all_but(model, tp)
    return tp


def split_positive(named: list[tuple[str, nn.Parameter]]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(positive scales, the rest)`` of quantizer ``(qualified name, param)`` pairs: the
    attributes in `POSITIVE_PARAMS` (the tensors log-space steps may take) vs zero points / clip
    factors / anything else."""
    pos = [p for n, p in named if n.rpartition(".")[2] in POSITIVE_PARAMS]
    return pos, [p for n, p in named if n.rpartition(".")[2] not in POSITIVE_PARAMS]


def quantizer_groups(
    named: list[tuple[str, nn.Parameter]],
    *,
    lr: float,
    scale_update: str,
    e8m0: set[int] = frozenset(),
    e8m0_scale_lr: float | None = None,
    weight_decay: float = 0.0,
    names: tuple[str, str] = ("scale", "zero_point"),
) -> list[dict]:
    """AdamW groups for quantizer parameters ``named`` (empty groups left out).

    Additive: one group ``names[0]`` at ``lr``. ``scale_update="log"``: the positive scales
    (`POSITIVE_PARAMS`) in a ``log_space`` group ``names[0]`` without weight decay
    (`qatlib.trainers.log_scale`: ``lr`` is then a relative step), the rest (zero points, clip
    factors) additive in ``names[1]`` at ``lr``. Either way the E8M0 scales among them (ids in
    ``e8m0``) get a group ``<names[0]>_e8m0`` of their own at `log_scale.e8m0_lr` when that differs
    from ``lr``. Shared by the end-to-end and the blockwise trainers."""
    if scale_update not in SCALE_UPDATES:
        raise ValueError(f"scale_update must be one of {SCALE_UPDATES}; got {scale_update!r}")
    elr = e8m0_lr(lr, scale_update, e8m0_scale_lr)
    own = e8m0 if elr != lr else frozenset()  # the scales that step at elr
    groups = []

    def add(name: str, ps: list, glr: float, **extra) -> None:
        if ps:
            groups.append(
                {"params": ps, "lr": float(glr), "weight_decay": weight_decay, "name": name, **extra}
            )

    if scale_update == "log":
        pos, rest = split_positive(named)
        log_group = {LOG_SPACE: True, "weight_decay": 0.0}
    else:
        pos, rest, log_group = [p for _, p in named], [], {}
    add(names[0], [p for p in pos if id(p) not in own], lr, **log_group)
    add(f"{names[0]}_e8m0", [p for p in pos if id(p) in own], elr, **log_group)
    add(names[1], rest, lr)
    return groups


def param_groups(
    trainable: TrainableParams,
    *,
    lr: float,
    lwc_lr: float | None = None,
    norm_lr: float | None = None,
    weight_lr: float | None = None,
    weight_decay: float = 0.0,
    scale_update: str = "additive",
    e8m0_scale_lr: float | None = None,
    subgroup_lr: float | None = None,
    weight_units: list[float] | None = None,
) -> list[dict]:
    """AdamW groups (empty groups left out), each named for logs: ``scale`` at ``lr`` (laid out by
    `quantizer_groups`: log space, zero points, E8M0 scales at `log_scale.e8m0_lr`, explicit
    ``e8m0_scale_lr`` first), ``subgroup`` (FOCUS's logits, additive) at ``subgroup_lr``, ``lwc``
    at ``lwc_lr``, ``norm`` at ``norm_lr``, ``weight`` at ``weight_lr`` (defaults: ``lr``).
    ``weight_units`` (one per ``trainable.weight``, `weight_units.weight_units`): the weights step
    in those units instead, one group per unit (`weight_units.unit_groups`; the optimizer must then
    go through `weight_units.install_weight_unit_steps`).

    With ``scale_update="log"`` the optimizer must go through
    `qatlib.trainers.log_scale.install_log_space_steps`. A bad ``scale_update`` is refused by
    `quantizer_groups` (the scale group is always laid out, also when empty)."""
    lrs = {"scale": lr, "subgroup": subgroup_lr, "lwc": lwc_lr, "norm": norm_lr, "weight": weight_lr}
    groups = []
    for g, ps in trainable.items():
        glr = lr if lrs[g] is None else lrs[g]
        if g == "scale":
            groups += quantizer_groups(
                ps,
                lr=glr,
                scale_update=scale_update,
                e8m0=trainable.e8m0,
                e8m0_scale_lr=e8m0_scale_lr,
                weight_decay=weight_decay,
            )
        elif g == "weight" and ps and weight_units is not None:
            if len(weight_units) != len(ps):
                raise ValueError(f"{len(weight_units)} weight units for {len(ps)} weights")
            groups += unit_groups([p for _, p in ps], weight_units, lr=glr, weight_decay=weight_decay, name=g)
        elif ps:
            groups.append(
                {"params": [p for _, p in ps], "lr": float(glr), "weight_decay": weight_decay, "name": g}
            )
    return groups
