"""The plan of one export: every answer the writers need, asked once, before anything is written.

`plan_export` checks the model against the scheme (`check_model`), then asks each owner once:

==============================================  ==================================================
answer (`ExportPlan` field)                     owner
==============================================  ==================================================
``fmt``: scheme -> compressed-tensors           `qatlib.export.format.compressed_tensors_format`
``ignore``: config.json's ignore list           `qatlib.runtime.ignore` (checked), module structure
                                                (`qatlib.quant.linear.is_router`)
``quantization_config``: config.json's header   compressed-tensors' `QuantizationConfig`, or the
                                                runtimes' own fp8 header (`fp8_native_config`)
``kv_roles``: the KV cache's projections        `qatlib.checkpoint.keys.kv_role`
``aliases``: tied names not written             `qatlib.checkpoint.safetensors.model_tensors`
``ties``: what each runtime merges at load      `qatlib.runtime.tying.tie_plan`
``deployment``: what each runtime's load        `qatlib.runtime.differences.deployment_differences`
changes, refuses, or was trained with
``kv_file`` / ``resume_file``: the side files   `qatlib.checkpoint.layout`
``coverage``: quantized / kept per module type  `qatlib.export.coverage.export_coverage`
==============================================  ==================================================

The writers (`qatlib.export` in memory, `qatlib.export.stream` layer by layer; both through
`qatlib.export.compress`) follow the plan and ask runtime/ nothing more. The plan holds names,
formats and records, not the model: it is the same for every process of a ZeRO-3 export.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from torch import nn

from .. import __version__
from ..checkpoint.keys import kv_role
from ..checkpoint.layout import EXPORT_KV_SCALES_FILE, FAKE_EXPORT_SCALES_FILE, KV_SCALES_FILE
from ..checkpoint.safetensors import model_tensors
from ..checkpoint.saved_keys import checkpoint_names
from ..quant import QuantLinear, QuantScheme, quant_linears
from ..quant.calibration import prepared_mismatch
from ..quant.health import bad_quant_params
from ..quant.linear import attention_role
from ..quant.quantizer import Quantizer
from ..quant.spec import CheckpointFormat, Granularity
from ..runtime.differences import deployment_differences
from ..runtime.facts import TARGETS, layout_of
from ..runtime.ignore import ignore_problems
from ..runtime.tying import TiedGroup, tie_plan
from .coverage import export_coverage, is_router_like
from .format import CTFormat, ExportError, compressed_tensors_format

log = logging.getLogger(__name__)

# save_format -> what the checkpoint's tensors are: compressed ("real"), fake-quant, or none at all
WEIGHTS: dict[str, str | None] = {
    "real": "real",
    "fake": "fake",
    "save_kvcache_only": None,
    "real_and_kvcache": "real",
}
SAVE_FORMATS = tuple(WEIGHTS)
KV_FORMATS = ("save_kvcache_only", "real_and_kvcache")
FAKE_NOTE = "weights are dequantize(quantize(W)); activation / KV-cache quantization is not represented"


@dataclass(frozen=True)
class ExportPlan:
    """What one export writes, decided before writing (`plan_export`); the writers follow it.
    The runtime fields (``fmt``, ``ignore``, ``quantization_config``, ``ties``, ``deployment``) are
    empty for ``fake`` and ``save_kvcache_only``, which no runtime loads as a quantized model."""

    scheme: QuantScheme
    save_format: str
    # the compressed-tensors mapping of ``scheme`` (`qatlib.export.format`), with its changes and notes
    fmt: CTFormat | None
    # every k / v projection -> "k" / "v": its static output scale is the KV cache's
    kv_roles: Mapping[str, str]
    # other names of tied tensors (``lm_head.weight``): not written, each tensor once under its first name
    aliases: frozenset[str]
    # config.json's ignore list: the unquantized modules, by resolved name
    ignore: tuple[str, ...]
    # config.json's header: compressed-tensors' `QuantizationConfig`, or `fp8_native_config`'s dict
    quantization_config: Any
    # runtime ("vllm") -> the quantizer groups whose scales it merges at load (`qatlib.runtime.tying`;
    # one trained Parameter each when the model was prepared for that ``deploy.target``)
    ties: Mapping[str, tuple[TiedGroup, ...]]
    # runtime ("vllm 0.33.0") -> whether it loads the export, what its load changes, what the model
    # was trained as deployed (`qatlib.runtime.differences`): ``qatlib_export.json``'s "deployment"
    deployment: Mapping[str, Any]
    # the side files, relative to the export folder (`qatlib.checkpoint.layout`), or None
    kv_file: str | None
    resume_file: str | None
    # per module type: how many were quantized, how many kept and why (`qatlib.export.coverage`)
    coverage: tuple[Mapping[str, Any], ...] = ()

    @property
    def weights(self) -> str | None:
        """What the checkpoint tensors are: ``real`` (compressed), ``fake`` or None (none written)."""
        return WEIGHTS[self.save_format]

    def record(self) -> dict[str, Any]:
        """``qatlib_export.json``: the version, format and scheme, the compressed-tensors mapping's
        changes and runtime notes, the deployment differences, and what was quantized and kept
        per module type (``coverage``)."""
        info: dict[str, Any] = {
            "qatlib_version": __version__,
            "save_format": self.save_format,
            "scheme": self.scheme.to_dict(),
        }
        if self.fmt is not None:
            import compressed_tensors

            info["compressed_tensors"] = {
                "version": compressed_tensors.__version__,
                "format": self.fmt.format,
                "changes": list(self.fmt.changes),
                "runtime_notes": list(self.fmt.runtime_notes),
            }
            info["deployment"] = dict(self.deployment)
        if self.save_format == "fake":
            info["note"] = FAKE_NOTE
        if self.coverage:
            info["coverage"] = [dict(r) for r in self.coverage]
        return info


def plan_export(
    model: nn.Module,
    scheme: QuantScheme,
    save_format: str,
    *,
    ignore: Sequence[str] = (),
    w4a8_activation: str = "runtime",
    measure: bool = True,
) -> ExportPlan:
    """The `ExportPlan` of exporting ``model`` (prepared with ``scheme``) as ``save_format``, or
    `ExportError` for what cannot be exported. ``ignore``: the user's ``ignore_layers`` (checked,
    never copied: `unquantized_modules`). ``measure=False`` (a ZeRO-3 model: each process holds a
    shard of the scales) lists the runtimes' load-time changes without counting what they change."""
    if save_format not in WEIGHTS:
        raise ExportError(f"save_format must be one of {', '.join(SAVE_FORMATS)}; got {save_format!r}")
    # the model: prepared with this scheme, exportable as this format
    kv_roles = {n: r for n, _ in quant_linears(model) if (r := kv_role(n, model)) is not None}
    check_model(model, scheme, save_format, kv_roles)
    weights = WEIGHTS[save_format]
    fmt = compressed_tensors_format(scheme, w4a8_activation=w4a8_activation) if weights == "real" else None
    # what a runtime reads: config.json's ignore list and header, what it merges and changes at load
    names: tuple[str, ...] = ()
    header: Any = None
    ties: dict[str, tuple[TiedGroup, ...]] = {}
    deployment: dict[str, Any] = {}
    if fmt is not None:
        check_ignore(model, ignore)
        names = tuple(unquantized_modules(model, checkpoint_names(model)))
        if scheme.checkpoint_format is CheckpointFormat.FP8:
            header = fp8_native_config(scheme, names)
        else:
            header = quantization_config(fmt, names)
        layout = layout_of(scheme, w4a8_activation=w4a8_activation)
        ties = {target: tuple(tie_plan(model, target, layout)) for target in TARGETS}
        deployment = deployment_differences(model, scheme, w4a8_activation=w4a8_activation, measure=measure)
    # the side files
    kv_file = None
    if save_format in KV_FORMATS:
        kv_file = KV_SCALES_FILE if weights is None else EXPORT_KV_SCALES_FILE
    return ExportPlan(
        scheme=scheme,
        save_format=save_format,
        fmt=fmt,
        kv_roles=MappingProxyType(kv_roles),
        aliases=tied_names(model) if weights is not None else frozenset(),
        ignore=names,
        quantization_config=header,
        ties=MappingProxyType(ties),
        deployment=MappingProxyType(deployment),
        kv_file=kv_file,
        resume_file=FAKE_EXPORT_SCALES_FILE if save_format == "fake" else None,
        coverage=tuple(export_coverage(model, ignore)) if weights is not None else (),
    )


def tied_names(model: nn.Module) -> frozenset[str]:
    """The other names of ``model``'s tied tensors (e.g. ``lm_head.weight`` = the embedding's), not
    written: ``save_pretrained`` writes each tensor once, under its first name. Quantizer
    parameters tied under a ``deploy.target`` are not among them: every member's key holds the
    shared scale (`qatlib.runtime.tying`)."""
    mods = dict(model.named_modules())
    return frozenset(
        n for n in model_tensors(model).aliases if not isinstance(mods.get(n.rpartition(".")[0]), Quantizer)
    )


def log_plan(plan: ExportPlan) -> None:
    """Warn about what the exported arithmetic changes and what the runtimes may do differently
    (the format's notes, then each module type's coverage notes)."""
    if plan.fmt is None:
        return
    for msg in plan.fmt.changes:
        log.warning("export (%s): %s", plan.scheme.name, msg)
    for msg in plan.fmt.runtime_notes:
        log.warning("export (%s), deployment: %s", plan.scheme.name, msg)
    for row in plan.coverage:
        for msg in row.get("notes", ()):
            log.warning("export (%s), %s: %s", plan.scheme.name, row["module_type"], msg)


# --------------------------------------------------------------------------- validation
def check_model(model: nn.Module, scheme: QuantScheme, save_format: str, kv_roles: Mapping[str, str]) -> None:
    """`ExportError` unless ``model`` holds `QuantLinear` layers prepared with ``scheme`` (output
    quantizers included), group sizes that divide the layers (compressed formats), static k / v
    output quantizers for a KV-cache format, and finite positive quantizer parameters; warns about
    static quantizers never initialised."""
    qls = list(quant_linears(model))
    if not qls:
        raise ExportError(
            "export: the model has no QuantLinear layers (prepare / calibrate / train it first)"
        )
    problem = prepared_mismatch(model, scheme)
    if problem is not None:
        raise ExportError(problem)
    mods = dict(model.named_modules())
    for name, ql in qls:
        parent, _, child = name.rpartition(".")
        oq, role = ql.output_quantizer, attention_role(mods.get(parent), child)
        ospec = getattr(scheme, role) if role is not None else None
        if (oq is None) != (ospec is None) or (
            oq is not None and oq.spec.replace(num_heads=None) != ospec.replace(num_heads=None)
        ):
            raise ExportError(
                f"{name}.output_quantizer ({'none' if oq is None else oq.spec.describe()}) does not match the scheme "
                f"({'none' if ospec is None else ospec.describe()})"
            )
        if (
            save_format != "fake"
            and ql.weight_quantizer is not None
            and ql.weight_quantizer.spec.granularity is Granularity.GROUP
        ):
            if ql.in_features % ql.weight_quantizer.spec.group_size:
                raise ExportError(
                    f"group_size {ql.weight_quantizer.spec.group_size} does not divide {name}.in_features"
                )
    if save_format in KV_FORMATS:
        kv = [
            n
            for n, ql in qls
            if ql.output_quantizer is not None and n in kv_roles and not ql.output_quantizer.spec.dynamic
        ]
        if not kv:
            raise ExportError(
                f"save_format {save_format!r} needs static k/v output quantizers (scheme.k / scheme.v)"
            )
    # A NaN / inf / non-positive scale would only surface as "round trip changed the weight (nan)"
    # or a broken deployment: refuse it by name (`qatlib.trainers.guard`, this rank's share under ZeRO-3).
    bad = bad_quant_params(model)
    if bad:
        raise ExportError(f"export: {len(bad)} quantizer parameter(s) out of range: " + "; ".join(bad[:5]))
    uninit = [
        f"{n}.{r}"
        for n, ql in qls
        for r, q in ql.quantizers()
        if q.scale is not None and not bool(q.initialized)
    ]
    if uninit:
        log.warning(
            "export: %d static quantizer(s) were never initialised (scale = init value), e.g. %s",
            len(uninit),
            uninit[0],
        )


def check_ignore(model: nn.Module, patterns: Sequence[str]) -> None:
    """`ExportError` for an ignore set a runtime would read differently (`qatlib.runtime.ignore`)."""
    problem = ignore_problems(model, patterns)
    if problem:
        raise ExportError(problem)


# --------------------------------------------------------------------------- config.json's header
def unquantized_modules(model: nn.Module, key_of: Callable[[str], str] = str) -> list[str]:
    """Module names compressed-tensors / vLLM must leave unquantized: every plain linear (e.g.
    ``lm_head``), embedding and MoE router (`is_router_like`: also GPT-OSS's ``router``, a module
    of its own), by resolved name only, as the checkpoint names
    them (``key_of``: a tensor's module name -> its checkpoint key, `checkpoint_names`; a runtime
    matches the ignore list against its own module names, which follow the checkpoint's: Mixtral's
    router is ``block_sparse_moe.gate`` there, ``mlp.gate`` in transformers 5).

    The user's ``ignore_layers`` (names or ``re:`` regexes, qatlib's matching) are checked
    (`check_ignore`), never copied: a runtime reads ``re:`` entries with ``re.match`` (prefix;
    compressed-tensors utils/match.py `match_name`, vLLM quantization/utils, SGLang CT utils.py),
    so ``re:model.layers.1`` would unquantize every layer-1 linear there. Every module the
    patterns select is a plain linear of the model, hence already named here."""
    names = []
    mods = dict(model.named_modules())
    for name, m in mods.items():
        if not name or isinstance(m, (QuantLinear, Quantizer)):
            continue
        parent_name, _, child = name.rpartition(".")
        if isinstance(m, (nn.Linear, nn.Embedding)) or is_router_like(mods.get(parent_name), child, m):
            names.append(key_of(f"{name}.weight").removesuffix(".weight"))
    return names


def quantization_config(fmt: CTFormat, ignore: Sequence[str]):
    """The compressed-tensors `QuantizationConfig` (status ``compressed``) for ``config.json``."""
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    return QuantizationConfig(
        config_groups={"group_0": fmt.scheme},
        kv_cache_scheme=fmt.kv_cache,
        format=fmt.format,
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=list(ignore),
    )


def fp8_native_config(scheme: QuantScheme, ignore: Sequence[str]) -> dict[str, Any]:
    """``config.json``'s ``quantization_config`` in vLLM's / SGLang's own fp8 format
    (`CheckpointFormat.FP8`, upstream's ``save_name: fp8``: angelslim/compressor/quant/core/save.py
    l.292-315): ``quant_method``, ``activation_scheme`` and ``ignored_layers`` (vLLM matches them
    exactly, ``Fp8Config.get_quant_method``)."""
    return {
        "quant_method": CheckpointFormat.FP8.value,
        "activation_scheme": "dynamic" if scheme.input.dynamic else "static",
        "ignored_layers": list(ignore),
    }
