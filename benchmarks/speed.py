"""Speed: what fake quantization costs in a QAT training step, and whether torch.compile helps.

Measured on the default tiny model (the pre-trained one when it exists, else the same
architecture from its config), every figure a ratio of interleaved measurements
(`benchmarks.common.interleaved`):

``step``
    For each format, ONE prepared model (`qatlib.quant.prepare` + RTN calibration), frozen
    weights, AdamW over the weight and activation scales (the default experiment's ``learnable``),
    the LM loss of `qatlib.losses.qat_loss`, ``batch x seq`` tokens per step. Three variants of
    the same step on the same model object:

    - ``qat``: quantizers on (what QAT runs);
    - ``plain``: the same step inside `quantization_disabled` (the scales get no gradient, so the
      backward only propagates activation gradients through the frozen weights);
    - ``plain_wgrad``: ``plain`` with the quantized linears' weights requiring grad (gradients
      computed, never applied): the backward work a scale gradient forces (``dL/dW_q`` for every
      quantized linear), without any fake-quant op.

    ``qat / plain`` is the issue's target (<= 1.15). It splits into ``plain_wgrad / plain`` (the
    weight-gradient GEMMs that ANY learnable weight scale needs) times ``qat / plain_wgrad`` (the
    fake-quant ops themselves, forward and backward).
``moe_linearization``
    ``prepare`` replaces fused experts (``grouped_mm``) by per-expert ``nn.Linear``s; the same frozen
    step on the unprepared model vs the prepared one with quantizers disabled.
``fake_quant``
    The weight quantizer alone on an ``N x N`` tensor (fp32 and bf16): ``fake_quantize`` forward
    (no grad) and forward + backward (scale gradient) vs ``tensor.clone()`` (read + write, the
    floor of any elementwise op), as effective GB/s (input + output bytes / time) and ratios.
``compile``
    qatlib's opt-in ``quant_config.compile_fake_quant`` (`qatlib.quant.functional.compiled`:
    ``torch.compile``, inductor; CPU needs a C++ compiler), switched on in the same prepared
    model: compiled vs eager QAT step and fake-quant op; the cold compile time (fresh inductor
    cache) is reported separately.
``profile``
    torch.profiler over QAT and plain steps: the ops taking the most self CPU time, and the
    forward time spent inside the quantizers (a ``record_function`` around `Quantizer.forward`).
"""

from __future__ import annotations

import contextlib
import copy
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from qatlib.quant.spec import Granularity, QuantSpec

from .common import (
    FORMATS,
    IGNORE,
    default_model,
    format_scheme,
    interleaved,
    load_avg,
    log,
    median_ms,
    paired_ratio,
    target,
)
from .fused_prototype import check_fused, fake_quantize_swapped, fused_fake_quantize

SPEED_FORMATS = ("fp8_static", "int4_g32", "w4a8_fp8_g32", "int8_w8a8", "int3_g32")
TARGET_STEP_RATIO = 1.15


@dataclass
class SpeedSettings:
    batch: int = 8
    seq: int = 256
    repeats: int = 7
    warmup: int = 1
    formats: tuple[str, ...] = SPEED_FORMATS
    fq_size: int = 4096
    fq_repeats: int = 5
    fq_dtypes: tuple[str, ...] = ("float32", "bfloat16")
    compile: bool = True
    compile_formats: tuple[str, ...] = SPEED_FORMATS
    compile_warmup_steps: int = 3
    profile_format: str | None = "w4a8_fp8_g32"
    profile_steps: int = 2
    # torch threads while timing. 1 by default: on a shared machine every multi-threaded op waits
    # for descheduled threads (stalls of 20-50 ms per op were measured at load 9 on 2 cores), which
    # turns the step ratio into a count of parallel regions. Pass --threads N on an idle machine.
    threads: int | None = 1
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


QUICK = SpeedSettings(
    batch=2,
    seq=32,
    repeats=2,
    formats=("w4a8_fp8_g32",),
    fq_size=128,
    fq_repeats=2,
    fq_dtypes=("float32",),
    compile=False,
    profile_steps=1,
)


# --------------------------------------------------------------------------- the step
class StepBench:
    """One prepared model and the three step variants of the module docstring.

    The step is written out here rather than run through `qatlib.trainers.end2end.QATTrainer` on
    purpose: the variants time single steps of ONE model and optimizer, round-robin, which the
    trainer's loop (data loader, scheduler, logging) would blur. Its pieces are qatlib's:
    `qatlib.ptq.calibrate`, `qatlib.trainers.params` and the loss `qatlib.losses.qat_loss`."""

    def __init__(self, base: torch.nn.Module, scheme, x: torch.Tensor) -> None:
        from qatlib.losses import LossConfig
        from qatlib.ptq import calibrate
        from qatlib.quant import quant_linears
        from qatlib.trainers.params import Learnable, apply_learnable, param_groups

        self.model = model = copy.deepcopy(base)
        calibrate(model, scheme, [x[:1]], ignore=IGNORE)
        trainable = apply_learnable(model, Learnable(act_scale=True, weight_scale=True))
        self.n_trainable = trainable.numel()
        self.opt = torch.optim.AdamW(param_groups(trainable, lr=1e-6, weight_decay=0.0))
        model.enable_input_require_grads()  # the plain variants have no trainable tensor
        model.train()
        self.weights = [ql.weight for _, ql in quant_linears(model)]
        self.x = x
        self.loss_cfg = LossConfig()

    def _step(self) -> None:
        from qatlib.losses import qat_loss

        self.model.zero_grad(set_to_none=True)
        out = self.model(input_ids=self.x, use_cache=False)
        qat_loss(out.logits, self.x, self.loss_cfg).loss.backward()
        self.opt.step()

    def qat(self) -> None:
        self._step()

    def plain(self) -> None:
        from qatlib.quant import quantization_disabled

        with quantization_disabled(self.model):
            self._step()

    def qat_compiled(self) -> None:
        """The QAT step with ``compile_fake_quant`` on (what `PrepareOptions` sets in qatlib)."""
        from qatlib.quant import quantizers

        qs = [q for _, q in quantizers(self.model)]
        for q in qs:
            q.compile_fake_quant = True
        try:
            self._step()
        finally:
            for q in qs:
                q.compile_fake_quant = False

    def qat_fused(self) -> None:
        """The QAT step with the fused prototype in place of `fake_quantize`."""
        with fake_quantize_swapped(fused_fake_quantize):
            self._step()

    def plain_wgrad(self) -> None:
        for w in self.weights:
            w.requires_grad_(True)
        try:
            self.plain()
        finally:
            for w in self.weights:
                w.requires_grad_(False)
                w.grad = None


def frozen_step(model: torch.nn.Module, x: torch.Tensor) -> Callable[[], None]:
    """Forward + backward (activation gradients only) of a frozen model."""
    from qatlib.losses import LossConfig, qat_loss

    cfg = LossConfig()

    def run() -> None:
        model.zero_grad(set_to_none=True)
        qat_loss(model(input_ids=x, use_cache=False).logits, x, cfg).loss.backward()

    return run


# --------------------------------------------------------------------------- torch.compile
@contextlib.contextmanager
def fresh_inductor_cache() -> Iterator[str]:
    """A fresh inductor / dynamo state so that compile times are cold."""
    import torch._dynamo

    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="bench-inductor-") as d:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = d
        torch._dynamo.reset()
        try:
            yield d
        finally:
            torch._dynamo.reset()
            if old is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = old


def compiled_fake_quantize() -> Callable:
    """qatlib's compiled fake-quant (``compile_fake_quant``), as `Quantizer` calls it."""
    from qatlib.quant import functional as F

    return F.compiled(F.fake_quantize)


# --------------------------------------------------------------------------- fake-quant op
def fake_quant_bench(
    spec_name: str, spec, n: int, dtype: torch.dtype, repeats: int, compiled: Callable | None
):
    from qatlib.quant import functional as F

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(n, n, generator=g) * 0.02).to(dtype)
    scale, zp = F.compute_qparams(x, spec)
    scale = scale.clone().requires_grad_(True)
    grad_out = torch.ones_like(x)
    nbytes = 2 * x.numel() * x.element_size()  # read + write

    def fwd(fn):
        def run():
            with torch.no_grad():
                fn(x, scale, zp, spec)

        return run

    def fwd_bwd(fn):
        def run():
            scale.grad = None
            fn(x, scale, zp, spec).backward(grad_out)

        return run

    fns: dict[str, Callable[[], Any]] = {
        "clone": lambda: x.clone(),
        "fq_fwd": fwd(F.fake_quantize),
        "fq_fwd_bwd": fwd_bwd(F.fake_quantize),
        "fq_fwd_fused": fwd(fused_fake_quantize),
        "fq_fwd_bwd_fused": fwd_bwd(fused_fake_quantize),
    }
    compile_s = None
    if compiled is not None:
        t0 = time.perf_counter()
        fwd(compiled)()
        fwd_bwd(compiled)()
        compile_s = time.perf_counter() - t0
        with torch.no_grad():
            exact = torch.equal(compiled(x, scale, zp, spec), F.fake_quantize(x, scale, zp, spec))
        fns["fq_fwd_compiled"] = fwd(compiled)
        fns["fq_fwd_bwd_compiled"] = fwd_bwd(compiled)
    t = interleaved(fns, repeats=repeats, warmup=1)
    row: dict[str, Any] = {
        "format": spec_name,
        "weight_spec": spec.describe(),
        "shape": f"{n}x{n}",
        "dtype": str(dtype).removeprefix("torch."),
    }
    for k, v in t.items():
        row[f"{k}_GBps"] = round(nbytes / statistics.median(v) / 1e9, 3)
    for k in t:
        if k != "clone":
            row[f"{k}_vs_clone"] = paired_ratio(t[k], t["clone"])["ratio"]
    row["fused_vs_eager_fwd"] = paired_ratio(t["fq_fwd_fused"], t["fq_fwd"])["ratio"]
    row["fused_vs_eager_fwd_bwd"] = paired_ratio(t["fq_fwd_bwd_fused"], t["fq_fwd_bwd"])["ratio"]
    if compiled is not None:
        row["compiled_vs_eager_fwd"] = paired_ratio(t["fq_fwd_compiled"], t["fq_fwd"])["ratio"]
        row["compiled_vs_eager_fwd_bwd"] = paired_ratio(t["fq_fwd_bwd_compiled"], t["fq_fwd_bwd"])["ratio"]
        row["compile_s"] = round(compile_s, 2)
        row["compiled_forward_bit_exact"] = exact
    return row


# --------------------------------------------------------------------------- profile
@contextlib.contextmanager
def quantizer_ranges() -> Iterator[None]:
    """``record_function("qatlib::Quantizer.forward")`` around every quantizer call (benchmark-only)."""
    from torch.profiler import record_function

    from qatlib.quant.quantizer import Quantizer

    orig = Quantizer.forward

    def forward(self, x):
        with record_function("qatlib::Quantizer.forward"):
            return orig(self, x)

    Quantizer.forward = forward
    try:
        yield
    finally:
        Quantizer.forward = orig


def profile_steps(sb: StepBench, steps: int, top: int = 15) -> dict[str, Any]:
    """torch.profiler over ``steps`` QAT and plain steps: totals, the forward time inside quantizers,
    the ops the QAT step adds (self CPU ms per step, QAT minus plain, with call counts) and the QAT
    step's top ops."""
    from torch.profiler import ProfilerActivity, profile

    per: dict[str, dict[str, tuple[float, int]]] = {}
    fq_ms: dict[str, float] = {}
    for variant in ("qat", "plain"):
        fn = getattr(sb, variant)
        fn()  # warm
        with quantizer_ranges(), profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                fn()
        ka = prof.key_averages()
        per[variant] = {e.key: (e.self_cpu_time_total / 1000 / steps, e.count // steps) for e in ka}
        fq_ms[variant] = (
            sum(e.cpu_time_total for e in ka if e.key == "qatlib::Quantizer.forward") / 1000 / steps
        )
    tot = {v: sum(ms for ms, _ in per[v].values()) for v in per}
    none = (0, 0)
    diff = {
        k: per["qat"].get(k, none)[0] - per["plain"].get(k, none)[0]
        for k in set(per["qat"]) | set(per["plain"])
    }
    added = tot["qat"] - tot["plain"]
    return {
        "summary": {
            "qat_self_cpu_ms_per_step": round(tot["qat"], 2),
            "plain_self_cpu_ms_per_step": round(tot["plain"], 2),
            "quantizer_forward_ms_per_step": round(fq_ms["qat"], 2),
            "quantizer_forward_share_of_qat": round(fq_ms["qat"] / tot["qat"], 4) if tot["qat"] else None,
        },
        "extra_ops": [
            {
                "op": k,
                "extra_ms_per_step": round(diff[k], 2),
                "share_of_added": round(diff[k] / added, 4) if added > 0 else None,
                "calls_plain": per["plain"].get(k, none)[1],
                "calls_qat": per["qat"].get(k, none)[1],
            }
            for k in sorted(diff, key=diff.__getitem__, reverse=True)[:top]
        ],
        "top_qat_ops": [
            {"op": k, "self_cpu_ms_per_step": round(ms, 2), "share": round(ms / tot["qat"], 4), "calls": n}
            for k, (ms, n) in sorted(per["qat"].items(), key=lambda kv: kv[1][0], reverse=True)[:top]
        ],
    }


# --------------------------------------------------------------------------- driver
def targets_of(rows: list[dict], compile_rows: list[dict]) -> list[dict]:
    """The step targets of the step rows and the compiled-step rows (their `paired_ratio`s
    compared unrounded)."""
    tg = [
        target(
            f"QAT step / plain step [{r['format']}]",
            r["qat_over_plain"],
            TARGET_STEP_RATIO,
            higher_is_better=False,
            note=f"weight-grad GEMMs alone: x{r['plain_wgrad_over_plain']}, "
            f"fake-quant ops on top: x{r['qat_over_plain_wgrad']}",
        )
        for r in rows
    ]
    for r in rows:
        tg.append(
            target(
                f"fused-prototype QAT step / plain step [{r['format']}]",
                r["fused_qat_over_plain"],
                TARGET_STEP_RATIO,
                higher_is_better=False,
                note="proposal: hand-written STE/LSQ autograd.Function (benchmarks.speed.fused_fake_quantize)",
            )
        )
    for r in compile_rows:
        tg.append(
            target(
                f"compiled QAT step / plain step [{r['format']}]",
                r["compiled_qat_over_plain"],
                TARGET_STEP_RATIO,
                higher_is_better=False,
                note="torch.compile on fake_quantize",
            )
        )
    return tg


def run(settings: SpeedSettings | None = None, *, results: str = "results") -> dict[str, Any]:
    s = settings or SpeedSettings()
    old_threads = torch.get_num_threads()
    if s.threads:
        torch.set_num_threads(s.threads)
    try:
        out = _run(s, results)
    finally:
        torch.set_num_threads(old_threads)
    return out


def _run(s: SpeedSettings, results: str) -> dict[str, Any]:
    torch.manual_seed(s.seed)
    base, source = default_model(results)
    vocab = base.config.vocab_size
    x = torch.randint(0, vocab, (s.batch, s.seq), generator=torch.Generator().manual_seed(s.seed))
    out: dict[str, Any] = {
        "settings": asdict(s),
        "model": {
            "source": source,
            "params": sum(p.numel() for p in base.parameters()),
            "experts_implementation": getattr(base.config, "_experts_implementation", None),
        },
        "tokens_per_step": s.batch * s.seq,
        "torch_threads_used": torch.get_num_threads(),
        "load_avg_start": load_avg(),
    }

    # 1. the QAT step vs the plain step, per format
    rows = []
    benches: dict[str, StepBench] = {}
    for name in s.formats:
        log(f"speed: step {name} (load {load_avg()})")
        sb = StepBench(base, format_scheme(name), x)
        t = interleaved(
            {"qat": sb.qat, "plain": sb.plain, "plain_wgrad": sb.plain_wgrad, "qat_fused": sb.qat_fused},
            repeats=s.repeats,
            warmup=s.warmup,
        )
        r = paired_ratio(t["qat"], t["plain"])
        rows.append(
            {
                "format": name,
                "description": FORMATS[name],
                "qat_over_plain": r["ratio"],
                "qat_over_plain_q1": r["ratio_q1"],
                "qat_over_plain_q3": r["ratio_q3"],
                "plain_wgrad_over_plain": paired_ratio(t["plain_wgrad"], t["plain"])["ratio"],
                "qat_over_plain_wgrad": paired_ratio(t["qat"], t["plain_wgrad"])["ratio"],
                "fused_qat_over_plain": paired_ratio(t["qat_fused"], t["plain"])["ratio"],
                "fused_over_eager_qat": paired_ratio(t["qat_fused"], t["qat"])["ratio"],
                "qat_ms": median_ms(t["qat"]),
                "plain_ms": median_ms(t["plain"]),
                "plain_wgrad_ms": median_ms(t["plain_wgrad"]),
                "qat_fused_ms": median_ms(t["qat_fused"]),
                "trainable_scale_elements": sb.n_trainable,
                "rounds": r["rounds"],
            }
        )
        benches[name] = sb
    out["step"] = rows

    specs = [format_scheme(n).weight for n in s.formats] + [format_scheme(n).input for n in s.formats]
    specs += [QuantSpec("int4", Granularity.GROUP, group_size=32, symmetric=False)]
    out["fused_prototype_check"] = check_fused([sp for sp in specs if sp is not None])

    # 2. what linearising the fused experts costs (format-independent)
    first = benches[s.formats[0]]
    frozen = copy.deepcopy(base).requires_grad_(False)
    frozen.enable_input_require_grads()
    frozen.train()
    t = interleaved(
        {"prepared_disabled": first.plain, "unprepared": frozen_step(frozen, x)},
        repeats=s.repeats,
        warmup=s.warmup,
    )
    out["moe_linearization"] = {
        "prepared_disabled_over_unprepared": paired_ratio(t["prepared_disabled"], t["unprepared"])["ratio"],
        "prepared_disabled_ms": median_ms(t["prepared_disabled"]),
        "unprepared_ms": median_ms(t["unprepared"]),
        "note": "same frozen step; prepare() replaces grouped_mm fused experts by per-expert nn.Linear",
    }
    del frozen

    # 3. profile of the default format's step
    if s.profile_format and s.profile_format in benches:
        log("speed: profile")
        prof = profile_steps(benches[s.profile_format], s.profile_steps)
        out["profile"] = {"format": s.profile_format, "steps": s.profile_steps, **prof["summary"]}
        out["profile_extra_ops_qat_minus_plain"] = prof["extra_ops"]
        out["profile_top_ops_qat"] = prof["top_qat_ops"]

    # 4. the fake-quant op alone (+ compiled)
    fq_rows = []
    compile_info: dict[str, Any] = {"enabled": s.compile}
    with fresh_inductor_cache() if s.compile else contextlib.nullcontext():
        compiled = compiled_fake_quantize() if s.compile else None
        for dt in s.fq_dtypes:
            for name in s.formats:
                log(f"speed: fake-quant op {name} {dt}")
                spec = format_scheme(name).weight
                fq_rows.append(
                    fake_quant_bench(name, spec, s.fq_size, getattr(torch, dt), s.fq_repeats, compiled)
                )
    out["fake_quant"] = fq_rows

    # 5. compiled fake-quant inside the QAT step
    if s.compile:
        crow = []
        for name in [f for f in s.compile_formats if f in benches]:
            log(f"speed: compiled step {name}")
            sb = benches[name]
            with fresh_inductor_cache():
                qat_compiled = sb.qat_compiled
                eager_s = statistics.median(interleaved({"e": sb.qat}, repeats=2, warmup=0)["e"])
                t0 = time.perf_counter()
                for _ in range(s.compile_warmup_steps):
                    qat_compiled()
                warm_s = time.perf_counter() - t0
                t = interleaved(
                    {"eager": sb.qat, "compiled": qat_compiled, "plain": sb.plain},
                    repeats=s.repeats,
                    warmup=0,
                )
            crow.append(
                {
                    "format": name,
                    "compiled_over_eager": paired_ratio(t["compiled"], t["eager"])["ratio"],
                    "compiled_qat_over_plain": paired_ratio(t["compiled"], t["plain"])["ratio"],
                    "eager_qat_over_plain": paired_ratio(t["eager"], t["plain"])["ratio"],
                    "eager_ms": median_ms(t["eager"]),
                    "compiled_ms": median_ms(t["compiled"]),
                    "compile_s": round(max(warm_s - s.compile_warmup_steps * eager_s, 0.0), 1),
                    "warmup_steps": s.compile_warmup_steps,
                }
            )
        out["compile_step"] = crow
    out["compile"] = compile_info

    # 6. targets
    out["targets"] = targets_of(rows, out.get("compile_step", []))
    out["load_avg_end"] = load_avg()
    return out
