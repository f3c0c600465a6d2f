"""`Quantizer`: one tensor's fake-quantizer with fp32 learnable scale / zero point, lazy
(observer-based) calibration, and LWC (learnable weight clipping)."""

from __future__ import annotations

import torch
from torch import nn

from . import functional as F
from .spec import QuantSpec

# Parameter roles, so optimizers and `learnable` switches select parameters by role, not by name.
ROLE_SCALE = "scale"
ROLE_LWC = "lwc"
ROLE_SUBGROUP = "subgroup"  # FOCUS's sub-group scale logits (upstream ``quant_max_scale``)
# A Quantizer's parameters by attribute name. Roles are derived from the module type + attribute,
# never stored on the Parameter object: attributes set on a Parameter are lost by copy.deepcopy.
PARAM_ROLES = {
    "scale": ROLE_SCALE,
    "zero_point": ROLE_SCALE,
    "global_scale": ROLE_SCALE,
    "clip_factor_w_max": ROLE_LWC,
    "clip_factor_w_min": ROLE_LWC,
    "subgroup_logit": ROLE_SUBGROUP,
}
# upstream FOCUS's initial ``quant_max_scale`` (quantizer.py `_init_mxfp_params` / `_init_nvfp4_params`):
# sigmoid(6) = 0.9975, a factor just below 1
SUBGROUP_LOGIT_INIT = 6.0
# The parameters that are positive by construction (scales, not zero points or clip logits): the
# ones `qatlib.trainers.log_scale` may step in log space.
POSITIVE_PARAMS = frozenset({"scale", "global_scale"})


def role_parameters(model: nn.Module, role: str | None = None):
    """``(qualified_name, param)`` of every Quantizer parameter (of ``role``, if given), in module order.

    A scale shared by several quantizers (`qatlib.quant.tying`) appears once, under its first name
    (as ``named_parameters`` gives it): an optimizer must not see one tensor twice."""
    seen: set[int] = set()
    for mname, m in model.named_modules():
        if isinstance(m, Quantizer):
            for pname, p in m.named_parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                if role is None or PARAM_ROLES.get(pname) == role:
                    yield (f"{mname}.{pname}" if mname else pname), p


class Quantizer(nn.Module):
    """Fake-quantizes one tensor according to ``spec``.

    Static specs own an fp32 ``scale`` (and ``zero_point`` when asymmetric) shaped as in
    docs/design.md; dynamic specs own nothing and compute qparams per call. With ``lwc_init``
    (weights only) the scale is not a parameter of its own but derived every call from the weight's
    range shrunk by ``sigmoid(clip_factor_w_max/min)`` (OmniQuant's LWC); that derived scale is
    what `qparams` returns and therefore what gets exported.

    The parameters stay fp32 when the model is cast to bf16/fp16 (`_apply` below): a bf16 scale of
    ~1e-3 cannot move by a 1e-5 learning-rate step.

    FP4 formats: ``scale`` is the fp32 master of the group scale, rounded to E4M3 (NVFP4) / E8M0
    (MXFP4) in every forward (straight-through), so what trains is what the checkpoint stores.
    NVFP4 adds ``global_scale`` (fp32 [1], compressed-tensors' ``448 * 6 / amax`` convention,
    learnable): on weights next to the group scales (with LWC: derived from the weight each call),
    and on dynamic inputs as the static ``input_global_scale`` the group scales are relative to.
    FOCUS (``spec.subgroups``): ``subgroup_logit`` (fp32, `functional.subgroup_shape`, init
    `SUBGROUP_LOGIT_INIT`), whose sigmoid is each sub-group's factor (`functional.code_divisor`).
    """

    def __init__(
        self,
        spec: QuantSpec,
        tensor_shape: tuple[int, ...] | torch.Size | None = None,
        *,
        init_value: float = 1.0,
        lwc_init: float | None = None,
        clamp_grad: str = "mask",
        compile_fake_quant: bool = False,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.enabled = True
        self.clamp_grad = clamp_grad
        # run the fake-quant through torch.compile (F.compiled); not `compile`: nn.Module.compile
        self.compile_fake_quant = compile_fake_quant
        self.calibrating = False
        self._obs: tuple[torch.Tensor, torch.Tensor] | None = None
        self.register_buffer("initialized", torch.tensor(False), persistent=False)
        # (scale, zero point) the weight's codes are frozen at (`qatlib.quant.codes`; None: the
        # codes follow the scale)
        self.frozen_at: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.scale: nn.Parameter | None = None
        self.zero_point: nn.Parameter | None = None
        self.clip_factor_w_max: nn.Parameter | None = None
        self.clip_factor_w_min: nn.Parameter | None = None
        self.global_scale: nn.Parameter | None = None
        self.subgroup_logit: nn.Parameter | None = None
        if spec.has_global_scale and (spec.dynamic or lwc_init is None):
            self.global_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
        if spec.dynamic:
            if lwc_init is not None:
                raise ValueError("LWC needs a static weight quantizer")
            return
        if tensor_shape is None:
            raise ValueError("a static quantizer needs the tensor shape to size its scale")
        shape = F.scale_shape(tuple(tensor_shape), spec)
        if spec.subgroups:
            if lwc_init is not None:
                raise ValueError(
                    "sub-group scales (FOCUS) and LWC do not combine: the group scale is learned"
                )
            sub = F.subgroup_shape(tuple(tensor_shape), spec)
            self.subgroup_logit = nn.Parameter(torch.full(sub, SUBGROUP_LOGIT_INIT, dtype=torch.float32))
        if lwc_init is not None:
            self.clip_factor_w_max = nn.Parameter(torch.full(shape, float(lwc_init), dtype=torch.float32))
            self.clip_factor_w_min = nn.Parameter(torch.full(shape, float(lwc_init), dtype=torch.float32))
            return
        self.scale = nn.Parameter(torch.full(shape, float(init_value), dtype=torch.float32))
        if spec.has_zero_point:
            self.zero_point = nn.Parameter(torch.zeros(shape, dtype=torch.float32))

    # ------------------------------------------------------------------ dtype
    def _apply(self, fn, recurse=True):  # noqa: D401 - nn.Module hook
        """Keep fp32 masters through ``model.to(bfloat16)``; device moves still apply.

        The fp32 values are restored from a copy taken before the cast: casting back up
        (``bf16 -> fp32``) would keep the dtype but lose the precision the fp32 master exists for.
        """
        masters = {
            name: (p.detach().clone(), None if p.grad is None else p.grad.detach().clone())
            for name, p in self.named_parameters(recurse=False)
            if p.dtype == torch.float32 and not hasattr(p, "ds_id")
        }
        super()._apply(fn, recurse)
        for name, p in self.named_parameters(recurse=False):
            if name in masters and p.dtype != torch.float32:
                data, grad = masters[name]
                p.data = data.to(p.device)
                if grad is not None and p.grad is not None:
                    p.grad = grad.to(p.device)
            elif p.is_floating_point() and p.dtype != torch.float32 and not hasattr(p, "ds_id"):
                p.data = p.data.float()
        return self

    @property
    def run_spec(self) -> QuantSpec:
        """The spec a dynamic quantizer computes with: its ``dynamic_granularity`` (the runtime's,
        e.g. vLLM's per-token fp8 input of dense layers and of the W4A8 kernel, which runs a
        calibrated static input dynamically) when set, else the spec itself."""
        g = self.spec.dynamic_granularity
        return self.spec if g is None else self.spec.replace(granularity=g, dynamic_granularity=None)

    @property
    def uses_lwc(self) -> bool:
        return self.clip_factor_w_max is not None

    # ------------------------------------------------------------------ qparams
    def qparams(self, x: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The (scale, zero_point) used for ``x``: parameters, LWC-derived, or dynamic. FP4 scales
        are returned rounded to their format (E4M3 / E8M0 values, straight-through), as stored;
        NVFP4's global scale is `global_scale_for`."""
        if self.spec.dynamic:
            if x is None:
                raise ValueError("a dynamic quantizer's qparams depend on the input")
            return F.compute_qparams(x, self.run_spec, self.global_scale_for(x))
        if self.uses_lwc:
            if x is None:
                raise ValueError("LWC qparams depend on the weight: pass it")
            xmin, xmax = F.observe_range(x, self.spec)
            scale, zp = F.qparams_from_range(
                xmin * torch.sigmoid(self.clip_factor_w_min),
                xmax * torch.sigmoid(self.clip_factor_w_max),
                self.spec,
                self.global_scale_for(x),
            )
            if self.spec.is_fp4:
                return scale, zp
        elif self.spec.is_fp4:
            return F._round_scale_ste(self.scale, self.spec), None
        else:
            scale, zp = self.scale, self.zero_point
        if self.spec.scale_dtype is not None:  # the runtime keeps the scale in the model dtype
            scale = scale.detach().to(getattr(torch, self.spec.scale_dtype)).float() + (
                scale - scale.detach()
            )
        return scale, zp

    def subgroup_scale(self) -> torch.Tensor | None:
        """FOCUS's sub-group factors ``sigmoid(subgroup_logit)`` (differentiable), None without."""
        return None if self.subgroup_logit is None else torch.sigmoid(self.subgroup_logit)

    def global_scale_for(self, x: torch.Tensor | None = None) -> torch.Tensor | None:
        """NVFP4's global scale for ``x``: the parameter, or (LWC weights, which have none) the
        `F.fp4_global_scale` of the unclipped weight; None for every other format."""
        if not self.spec.has_global_scale:
            return None
        if self.global_scale is not None:
            return self.global_scale
        if x is None:
            raise ValueError("the LWC global scale depends on the weight: pass it")
        return F.fp4_global_scale(x.detach().abs().amax())

    @torch.no_grad()
    def init_from(self, x: torch.Tensor) -> None:
        """Set the static scale / zero point from ``x`` (a full weight, or calibration ranges)."""
        if self.spec.dynamic or self.uses_lwc:
            self.initialized.fill_(True)
            return
        gs = None
        if self.global_scale is not None:
            gs = F.fp4_global_scale(x.detach().abs().amax())
            self.global_scale.copy_(gs)
        scale, zp = F.compute_qparams(x, self.spec, gs)
        self.set_qparams(scale, zp)

    @torch.no_grad()
    def set_qparams(self, scale: torch.Tensor, zero_point: torch.Tensor | None = None) -> None:
        if self.scale is None:
            raise ValueError("this quantizer has no stored scale (dynamic or LWC)")
        if tuple(scale.shape) != tuple(self.scale.shape):
            raise ValueError(
                f"scale shape {tuple(scale.shape)} does not match {tuple(self.scale.shape)} ({self.spec.describe()})"
            )
        self.scale.copy_(scale.to(self.scale.dtype))
        if self.zero_point is not None:
            if zero_point is None:
                raise ValueError("asymmetric quantizer needs a zero point")
            self.zero_point.copy_(zero_point.to(self.zero_point.dtype))
        self.initialized.fill_(True)

    # ------------------------------------------------------------------ calibration
    def start_calibration(self) -> None:
        """Observe min/max over the next forwards (inputs pass through unquantized)."""
        self.calibrating = True
        self._obs = None

    @torch.no_grad()
    def finish_calibration(self) -> None:
        self.calibrating = False
        if self._obs is None:
            raise RuntimeError("calibration saw no data: no forward reached this quantizer")
        if self.spec.dynamic:
            # NVFP4 activations: only the global input scale is static (from the observed absmax)
            amax = torch.maximum(self._obs[0].abs(), self._obs[1].abs()).amax()
            self._obs = None
            if self.global_scale is not None:
                self.global_scale.copy_(F.fp4_global_scale(amax))
                self.initialized.fill_(True)
            return
        scale, zp = F.qparams_from_range(*self._obs, self.spec)
        self._obs = None
        if self.scale is not None:
            self.set_qparams(scale, zp)

    @torch.no_grad()
    def _observe(self, x: torch.Tensor) -> None:
        spec = self.spec
        if x.numel() == 0:
            return
        if spec.dynamic:  # a dynamic quantizer observes only its tensor range (global scale)
            xmin, xmax = x.detach().float().amin().reshape(1), x.detach().float().amax().reshape(1)
        else:
            xmin, xmax = F.observe_range(x, spec)
        if spec.granularity.value in ("per-token",):
            xmin, xmax = xmin.amin().reshape(1), xmax.amax().reshape(1)
        if self._obs is None:
            self._obs = (xmin, xmax)
        else:
            self._obs = (torch.minimum(self._obs[0], xmin), torch.maximum(self._obs[1], xmax))

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return x
        if self.calibrating:
            self._observe(x)
            return x
        if (
            self.spec.dynamic or self.spec.dynamic_granularity is not None
        ):  # (a static spec the runtime runs dynamic)
            fq = F.compiled(F.dynamic_fake_quantize) if self.compile_fake_quant else F.dynamic_fake_quantize
            return fq(x, self.run_spec, clamp_grad=self.clamp_grad, global_scale=self.global_scale)
        scale, zp = self.qparams(x)
        fq = F.compiled(F.fake_quantize) if self.compile_fake_quant else F.fake_quantize
        gs, sub = self.global_scale_for(x), self.subgroup_scale()
        return fq(x, scale, zp, self.spec, clamp_grad=self.clamp_grad, global_scale=gs, subgroup_scale=sub)

    def extra_repr(self) -> str:
        return self.spec.describe() + (" lwc" if self.uses_lwc else "")
