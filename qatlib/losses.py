"""QAT training objectives: the LM (cross-entropy) loss and the knowledge-distillation variants.

Every term is a mean over VALID tokens only, with the HF causal-LM shift: ``logits[:, t]``
predicts ``labels[:, t + 1]`` and positions whose label is ``-100`` (prompt, padding) are ignored.

    total = lm_loss_weight * lm + kd_loss_weight * kd<loss_type>

KD variants (per valid token, ``p_t`` / ``p_s`` the teacher / student softmax):

=================  =========================================================================
``kl``             ``KL(p_t || p_s)`` (forward KL)
``rkl``            ``KL(p_s || p_t)`` (reverse / backward KL)
``mse``            mean over the vocabulary of ``(z_s - z_t)^2`` on the logits
``kd``             ``alpha * T^2 * KL(softmax(z_t/T) || softmax(z_s/T)) + (1 - alpha) * CE``:
                   classic Hinton KD with the upstream ``kd_temperature`` / ``kd_alpha``
                   mixing (the docs call kd_alpha "the mixing coefficient of CE and the
                   distillation loss"). With ``lm_loss_weight > 0`` the CE is counted twice;
                   set ``lm_loss_weight: 0`` for textbook KD.
``kl_top_K``       forward KL over the teacher's top-K tokens, both distributions renormalised
                   over that set
``r_kl_top_K``     reverse KL over the same teacher top-K set (upstream took the STUDENT's
                   top-K for the reverse variant; one set for both is the documented intent)
``cakld``          ``conf * rkl + (1 - conf) * kl`` with ``conf = p_t[label]`` (teacher's
                   confidence in the reference token; a constant, no gradient)
``origin``         no distillation at all (the LM loss only, whatever ``kd_loss_weight`` says)
=================  =========================================================================

``K`` is written inline (``kl_top_1000``) or given by ``loss_topk`` (which wins over an inline K,
as upstream). Diagnostics ``kd/forward_kl`` and ``kd/backward_kl`` (T = 1, full
vocabulary) are returned whenever distillation is on.

Memory: the logits of a 150k-vocabulary model are the largest tensors of a step. The terms are
computed over chunks of valid tokens (``chunk_size`` rows at a time; by default as many rows as
fit `CHUNK_ELEMENTS` logits, so the working set does not grow with the vocabulary) and each chunk is
differentiated on the spot into one gradient buffer shaped like the logits, so at most one
chunk's fp32 working set exists at any time, next to the model-dtype logits and that buffer
(``benchmarks/memory.py`` measures chunked vs the plain autograd formulation).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100

# --------------------------------------------------------------------------- loss vocabulary
# The one list of ``loss_type`` values (upstream's end2end trainer). The experiment config checks
# a YAML against it (`parse_loss_type`) and its JSON schema carries `LOSS_PATTERN`.
PLAIN_LOSSES = ("origin", "kl", "rkl", "mse", "kd", "cakld")  # origin: no distillation term
TOPK_LOSSES = ("kl_top", "r_kl_top")  # K inline (kl_top_100) or from loss_topk
LOSS_TYPES = PLAIN_LOSSES + TOPK_LOSSES
# plain Python and ECMA-262 regex alike (the JSON schema's "pattern"): group 1 a plain loss,
# group 2 a top-K family, group 3 its inline K (a positive int, no leading zero)
LOSS_PATTERN = rf"^({'|'.join(PLAIN_LOSSES)})$|^({'|'.join(TOPK_LOSSES)})(?:_([1-9][0-9]*))?$"
LOSS_VOCAB = ", ".join((*PLAIN_LOSSES, *(f"{t}, {t}_<K>" for t in TOPK_LOSSES))) + " (K a positive int)"
_LOSS_RE = re.compile(LOSS_PATTERN)


class LossTypeError(ValueError):
    """An invalid ``loss_type`` / ``loss_topk``; ``field`` names which of the two is at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class LossType(NamedTuple):
    kind: str  # a member of LOSS_TYPES (the family: kl_top for kl_top_100)
    topk: int | None  # K of a top-K loss (loss_topk wins over the inline K), else None


def parse_loss_type(loss_type: str, loss_topk: int | None = None) -> LossType:
    """``loss_type`` (and ``loss_topk``) as a family and a K; `LossTypeError` for anything else.

    ``loss_topk`` overrides an inline K, as upstream; it is an error with a loss that has no K.
    """
    m = _LOSS_RE.match(loss_type) if isinstance(loss_type, str) else None
    if m is None:
        raise LossTypeError("loss_type", f"unknown loss_type {loss_type!r}; choose one of {LOSS_VOCAB}")
    if m.group(1) is not None:
        if loss_topk is not None:
            raise LossTypeError(
                "loss_topk",
                f"loss_topk only applies to kl_top / r_kl_top losses, not loss_type {loss_type!r}",
            )
        return LossType(m.group(1), None)
    if loss_topk is not None and (
        isinstance(loss_topk, bool) or not isinstance(loss_topk, int) or loss_topk <= 0
    ):
        raise LossTypeError("loss_topk", f"loss_topk must be a positive int; got {loss_topk!r}")
    k = loss_topk if loss_topk is not None else (int(m.group(3)) if m.group(3) else None)
    if k is None:
        raise LossTypeError(
            "loss_type", f"loss_type {loss_type!r} needs a positive K: write {loss_type}_<K> or set loss_topk"
        )
    return LossType(m.group(2), k)


_TERMS = ("lm", "kd", "forward_kl", "backward_kl")
# Logits elements per chunk when ``chunk_size`` is not set: 32M = 128 MiB per fp32 copy. A fixed
# row count would not do: 1024 rows are 32M elements at a 32k vocabulary but 155M at Qwen3's
# 151,936, where the chunk's fp32 working set then exceeded the unchunked formulation's peak
# (benchmarks/memory.py measured 1.18x full at 1024 rows, 0.27x at 128).
CHUNK_ELEMENTS = 1 << 25


@dataclass(frozen=True)
class LossConfig:
    """The objective (``compression.QAT`` fields of the experiment config)."""

    loss_type: str = "origin"
    loss_topk: int | None = None
    kd_temperature: float = 1.0
    kd_alpha: float = 0.5
    lm_loss_weight: float = 1.0
    kd_loss_weight: float = 0.0
    chunk_size: int | None = None  # valid rows per chunk; None: CHUNK_ELEMENTS // vocab

    def __post_init__(self) -> None:
        lt = str(self.loss_type).lower()
        object.__setattr__(self, "loss_type", lt)
        parse_loss_type(lt, self.loss_topk)
        if not self.kd_temperature > 0:
            raise ValueError(f"kd_temperature must be > 0; got {self.kd_temperature}")
        if not 0.0 <= self.kd_alpha <= 1.0:
            raise ValueError(f"kd_alpha must lie in [0, 1]; got {self.kd_alpha}")
        if self.lm_loss_weight < 0 or self.kd_loss_weight < 0:
            raise ValueError("lm_loss_weight and kd_loss_weight must be >= 0")
        if not (self.lm_enabled or self.kd_enabled):
            raise ValueError(
                "nothing to optimise: lm_loss_weight is 0 and distillation is off "
                f"(kd_loss_weight={self.kd_loss_weight}, loss_type={lt!r})"
            )
        if self.chunk_size is not None and self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive; got {self.chunk_size}")

    # ------------------------------------------------------------------ derived
    def rows_per_chunk(self, vocab: int) -> int:
        """``chunk_size``, or as many rows as hold `CHUNK_ELEMENTS` logits of width ``vocab``."""
        return self.chunk_size or max(1, CHUNK_ELEMENTS // max(int(vocab), 1))

    @property
    def kind(self) -> str:
        """The loss family: origin / kl / rkl / mse / kd / cakld / kl_top / r_kl_top."""
        return parse_loss_type(self.loss_type, self.loss_topk).kind

    @property
    def topk(self) -> int | None:
        """K of a top-K loss: ``loss_topk`` when set (it overrides, as upstream), else the inline K."""
        return parse_loss_type(self.loss_type, self.loss_topk).topk

    @property
    def lm_enabled(self) -> bool:
        return self.lm_loss_weight > 0

    @property
    def kd_enabled(self) -> bool:
        """Distillation (and therefore a teacher forward) happens only when this is True."""
        return self.kd_loss_weight > 0 and self.loss_type != "origin"

    @property
    def kd_key(self) -> str:
        return f"kd/{self.loss_type}"

    def log_keys(self) -> list[str]:
        keys = ["lm_loss"] if self.lm_enabled else []
        if self.kd_enabled:
            keys += [self.kd_key, "kd/forward_kl", "kd/backward_kl"]
        return keys + ["total_loss"]


@dataclass
class LossOutput:
    """What `qat_loss` returns.

    ``loss``: the differentiable objective, ``(lm_w * sum_lm + kd_w * sum_kd) / denominator``.
    ``n_tokens``: valid tokens in THIS batch. ``sums``: detached per-component sums over those
    tokens keyed by log name (``lm_loss``, ``kd/<loss_type>``, ``kd/forward_kl``,
    ``kd/backward_kl``, ``total_loss``), so callers can average exactly over any interval
    (sum of sums / sum of n_tokens).
    """

    loss: torch.Tensor
    n_tokens: int
    sums: dict[str, float] = field(default_factory=dict)

    def means(self) -> dict[str, float]:
        n = max(self.n_tokens, 1)
        return {k: v / n for k, v in self.sums.items()}


# --------------------------------------------------------------------------- per-token terms
def _kl(logp_ref: torch.Tensor, logp_other: torch.Tensor) -> torch.Tensor:
    """Per-row ``KL(ref || other)`` from log-probabilities (0 * log 0 taken as 0)."""
    return torch.sum(logp_ref.exp() * (logp_ref - logp_other), dim=-1)


def token_terms(
    s: torch.Tensor, t: torch.Tensor | None, y: torch.Tensor, cfg: LossConfig
) -> dict[str, torch.Tensor]:
    """Per-token loss terms for aligned rows: student logits ``s [N, V]``, teacher ``t [N, V]`` (or
    None when distillation is off), labels ``y [N]`` (all valid). Returns ``[N]`` tensors for ``lm``
    and, with a teacher, ``kd``, ``forward_kl``, ``backward_kl``. Computed in fp32."""
    s = s.float()
    s_logp = F.log_softmax(s, dim=-1)
    out = {"lm": -s_logp.gather(-1, y[:, None]).squeeze(-1)}
    if t is None:
        return out
    t = t.float()
    t_logp = F.log_softmax(t, dim=-1)
    fkl = _kl(t_logp, s_logp)
    bkl = _kl(s_logp, t_logp)
    kind = cfg.kind
    if kind == "kl":
        kd = fkl
    elif kind == "rkl":
        kd = bkl
    elif kind == "mse":
        kd = (s - t).pow(2).mean(dim=-1)
    elif kind == "kd":
        temp = cfg.kd_temperature
        soft = _kl(F.log_softmax(t / temp, dim=-1), F.log_softmax(s / temp, dim=-1)) * temp * temp
        kd = cfg.kd_alpha * soft + (1.0 - cfg.kd_alpha) * out["lm"]
    elif kind == "cakld":
        conf = t_logp.gather(-1, y[:, None]).squeeze(-1).exp()
        kd = conf * bkl + (1.0 - conf) * fkl
    elif kind in ("kl_top", "r_kl_top"):
        k = min(cfg.topk, t.shape[-1])
        idx = t.topk(k, dim=-1).indices
        t_k = F.log_softmax(t.gather(-1, idx), dim=-1)
        s_k = F.log_softmax(s.gather(-1, idx), dim=-1)
        kd = _kl(t_k, s_k) if kind == "kl_top" else _kl(s_k, t_k)
    else:  # pragma: no cover - LossConfig validates
        raise ValueError(f"no distillation term for loss_type {cfg.loss_type!r}")
    out.update(kd=kd, forward_kl=fkl.detach(), backward_kl=bkl.detach())
    return out


def _weighted(terms: dict[str, torch.Tensor], cfg: LossConfig) -> torch.Tensor:
    obj = cfg.lm_loss_weight * terms["lm"].sum() if cfg.lm_enabled else terms["lm"].sum() * 0.0
    if cfg.kd_enabled:
        obj = obj + cfg.kd_loss_weight * terms["kd"].sum()
    return obj


def _sums(terms: dict[str, torch.Tensor], obj: torch.Tensor) -> torch.Tensor:
    """``[lm, kd, forward_kl, backward_kl, objective]`` sums (detached, fp32)."""
    zero = obj.new_zeros(())
    return torch.stack([terms[k].detach().sum() if k in terms else zero for k in _TERMS] + [obj.detach()])


class _ChunkedObjective(torch.autograd.Function):
    """Objective over valid positions, chunk by chunk, with the gradient computed in the forward.

    Each chunk's logits rows are gathered, upcast, turned into the loss terms and differentiated
    right away (``torch.autograd.grad`` on that chunk alone); the row gradients are written into
    one buffer shaped like the logits. Peak memory: the logits, that buffer (both in the logits'
    dtype) and one chunk's fp32 working set. Backward scales the buffer by the incoming gradient.
    """

    @staticmethod
    def forward(ctx, s_logits, t_logits, rows, cols, y, cfg, need_grad):
        grad_buf = torch.zeros_like(s_logits) if need_grad else None
        total = torch.zeros(len(_TERMS) + 1, dtype=torch.float32, device=s_logits.device)
        step = cfg.rows_per_chunk(s_logits.shape[-1])
        for i in range(0, rows.numel(), step):
            r, c, yy = rows[i : i + step], cols[i : i + step], y[i : i + step]
            t = None if t_logits is None else t_logits[r, c]
            with torch.enable_grad():
                x = s_logits[r, c].detach().requires_grad_(need_grad)
                terms = token_terms(x, t, yy, cfg)
                obj = _weighted(terms, cfg)
                if need_grad:
                    (g,) = torch.autograd.grad(obj, x)
                    grad_buf[r, c] = g.to(grad_buf.dtype)
            total += _sums(terms, obj)
        ctx.save_for_backward(grad_buf)
        sums = total[:-1].clone()
        ctx.mark_non_differentiable(sums)
        return total[-1].clone(), sums

    @staticmethod
    def backward(ctx, g_obj, _g_sums):
        (grad_buf,) = ctx.saved_tensors
        if grad_buf is None:
            return (None,) * 7
        grad = grad_buf if bool(g_obj == 1) else grad_buf * g_obj.to(grad_buf.dtype)
        return grad, None, None, None, None, None, None


def valid_positions(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rows, cols, targets)`` of the logits positions with a valid next-token label."""
    shifted = labels[:, 1:]
    rows, cols = torch.nonzero(shifted != IGNORE_INDEX, as_tuple=True)
    return rows, cols, shifted[rows, cols]


def qat_loss(
    student_logits: torch.Tensor,
    labels: torch.Tensor,
    cfg: LossConfig,
    teacher_logits: torch.Tensor | None = None,
    *,
    denominator: float | torch.Tensor | None = None,
    chunked: bool = True,
) -> LossOutput:
    """The QAT objective of one (micro-)batch.

    ``student_logits`` / ``teacher_logits``: ``[B, T, V]`` (any float dtype; terms run in fp32).
    ``labels``: ``[B, T]``, unshifted, ``-100`` = ignored. ``denominator``: the number of valid
    tokens the loss is normalised by; default this batch's own count. Under gradient accumulation
    pass the count of the whole accumulated batch (HF's ``num_items_in_batch``) so that the
    summed micro-batch losses equal the mean over all valid tokens. ``chunked=False`` is the plain
    autograd formulation over all valid rows at once (a reference; several fp32 copies of them);
    it is also what runs when one chunk would hold every valid row, because the chunked form then
    only adds its gradient buffer (measured 1.18x the plain peak).
    """
    if cfg.kd_enabled and teacher_logits is None:
        raise ValueError(f"loss_type {cfg.loss_type!r} with kd_loss_weight > 0 needs teacher logits")
    if teacher_logits is not None and teacher_logits.shape != student_logits.shape:
        raise ValueError(
            f"teacher logits {tuple(teacher_logits.shape)} != student {tuple(student_logits.shape)}"
        )
    t_logits = teacher_logits.detach() if cfg.kd_enabled else None
    rows, cols, y = valid_positions(labels.to(student_logits.device))
    n = int(rows.numel())
    if n == 0:
        # Keep the graph connected (DeepSpeed / DDP expect a backward through the model).
        return LossOutput(student_logits.sum() * 0.0, 0, dict.fromkeys(cfg.log_keys(), 0.0))
    if chunked and n > cfg.rows_per_chunk(student_logits.shape[-1]):
        need_grad = student_logits.requires_grad and torch.is_grad_enabled()
        objective, sums_t = _ChunkedObjective.apply(student_logits, t_logits, rows, cols, y, cfg, need_grad)
    else:
        terms = token_terms(
            student_logits[rows, cols], None if t_logits is None else t_logits[rows, cols], y, cfg
        )
        objective = _weighted(terms, cfg)
        sums_t = _sums(terms, objective)[:-1]
    lm_sum, kd_sum, fkl_sum, bkl_sum = sums_t.tolist()
    sums: dict[str, float] = {}
    if cfg.lm_enabled:
        sums["lm_loss"] = lm_sum
    if cfg.kd_enabled:
        sums[cfg.kd_key] = kd_sum
        sums["kd/forward_kl"] = fkl_sum
        sums["kd/backward_kl"] = bkl_sum
    sums["total_loss"] = objective.item()
    denom = n if denominator is None else denominator
    return LossOutput(objective / denom, n, sums)
