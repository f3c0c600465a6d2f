"""What QAT costs: the training step as the trainer runs it, against the same step with quantizers off.

    python -m benchmarks.speed [--quick] [--out results/bench]      # -> results/bench/speed.json
    python -m benchmarks.run --only speed                          # the same, through the runner

Every figure is a ratio of interleaved measurements (`benchmarks.common.interleaved`: each round
runs every variant once, so all see the same load) with its median, min and max over rounds.

``step``
    Per model (the default SmolLM2-135M, and the upcycled MoE) and per format, ONE prepared model
    (`qatlib.ptq.calibrate`: RTN), driven by `qatlib.trainers.end2end.QATTrainer` built from the
    default experiment's own config (config/experiments/smollm2-135m.yaml: forward-KL distillation
    from the model itself with its quantizers off, weight scales learned in log space, AdamW, the
    HF ``training_step``). Two variants of that same trainer step on the same model object, at
    each tokens-per-step count (sequences of ``seq`` tokens):

    - ``qat``: what QAT runs (teacher forward, fake-quantized student forward + backward, step);
    - ``plain``: the same step inside `qatlib.quant.quantization_disabled` (what fine-tuning the
      same model with the same trainer costs; no scale gets a gradient, so AdamW skips them).

    ``int4_g64_frozen`` is the default experiment's recipe (RTN codes frozen,
    `qatlib.quant.codes.freeze_codes`); ``int4_g64_lsq`` learns the scales of the continuous weight
    (LSQ, additive steps); the others use the default recipe on their own format.
``fake_quant``
    The weight fake-quant op alone (`qatlib.quant.functional.fake_quantize`, forward, no grad) on
    an ``N x N`` fp32 weight, in GB/s of weights processed (weight bytes / median time), against
    ``tensor.clone()`` of the same tensor in the same rounds (the machine's copy bandwidth, the
    floor of any elementwise op over the weights).
``zero3``
    The same trainer step under DeepSpeed ZeRO-3 at 1 and 2 ranks (torchrun, gloo) on the same
    global batch (`benchmarks.speed_zero3`).
``dag_qat``
    The default DAG's QAT stage's tokens/s from its own records (``results/<exp>/timings/zero3_qat.json``
    and the trainer's ``train_log.jsonl``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from .common import (
    DEFAULT_OUT,
    FORMATS,
    IGNORE,
    REPO,
    base_models_spec,
    find_base_model,
    format_scheme,
    interleaved,
    load_avg,
    log,
    machine,
    paired_ratio,
    rounded,
    write_result,
)

DEFAULT_EXPERIMENT = REPO / "config" / "experiments" / "smollm2-135m.yaml"
DENSE_MODEL = "smollm2-135m"
MOE_MODEL = "smollm2-moe"

# step variant -> (benchmark format, frozen codes, scale update); None: the experiment's own
STEP_FORMATS: dict[str, tuple[str, bool, str | None]] = {
    "int4_g64_frozen": ("int4_g64", True, None),
    "int4_g64_lsq": ("int4_g64", False, "additive"),
    "fp8_static": ("fp8_static", True, None),
    "int8_w8a8": ("int8_w8a8", True, None),
    "nvfp4": ("nvfp4", True, None),
}
FQ_FORMATS = ("int4_g64", "fp8_static", "int8_w8a8", "nvfp4")

# the targets (#62)
TARGET_FORMATS = ("int4_g64_frozen", "fp8_static")
TARGET_LARGE = (2048, 1.10)  # QAT step <= 1.10x plain at >= 2048 tokens per step
TARGET_MID = (512, 1.25)  # <= 1.25x at 512
TARGET_FQ_COPY = 0.5  # fake-quant op >= 50% of the copy bandwidth


@dataclass
class SpeedSettings:
    models: tuple[str, ...] = (DENSE_MODEL, MOE_MODEL)
    tokens: tuple[int, ...] = (128, 512, 2048, 4096)
    seq: int = 128  # the default experiment's max_seq_length
    repeats: int = 5
    warmup: int = 1  # rounds before timing, at <= 512 tokens (a longer step is its own warm-up)
    formats: tuple[str, ...] = tuple(STEP_FORMATS)
    large_formats: tuple[str, ...] = TARGET_FORMATS  # the formats also run at >= 2048 tokens (budget)
    # the MoE at fewer token counts and repeats (its step costs ~the dense one's; 2 cores)
    moe_tokens: tuple[int, ...] = (512,)
    moe_repeats: int = 5
    moe_formats: tuple[str, ...] = ("int4_g64_frozen", "fp8_static")
    wgrad: bool = True  # also time ``plain_wgrad`` (the plain step's backward with weight gradients)
    fq_size: int = 2048
    fq_repeats: int = 9
    fq_formats: tuple[str, ...] = FQ_FORMATS
    zero3: bool = True
    # the DAG's global batch (2 x 128); 1 warm-up + 3 timed steps: a 1-rank ZeRO-3 step of the
    # default model took 78-91 s on this machine (2 ranks: ~18 s, the DAG's own record)
    zero3_tokens: int = 256
    zero3_repeats: int = 3
    # torch threads while timing: 1 by default (on a shared machine every multi-threaded op waits
    # for descheduled threads, which turns the ratio into a count of parallel regions)
    threads: int | None = 1
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


QUICK = SpeedSettings(
    models=("tiny",),
    tokens=(16, 32),
    seq=16,
    repeats=2,
    formats=("int4_g64_frozen", "fp8_static"),
    fq_size=128,
    fq_repeats=2,
    fq_formats=("int4_g64", "fp8_static"),
    zero3=False,
)


# --------------------------------------------------------------------------- models
def tiny_model(seed: int = 0):
    """A 2-layer Llama (hidden 128) for the quick mode: the step's code paths in seconds."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        use_cache=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).float()


def load_model(name: str, results: str, seed: int = 0):
    """``(model, source)``: the pipeline's base model folder (``results/base/<name>``) when it
    exists; the MoE without one is upcycled from the dense model in memory with its routers
    untrained (`qatlib.offline.upcycle.upcycle_weights`: the same architecture and weights
    but the router's fit, which the step time does not depend on)."""
    from .common import load_base

    if name == "tiny":
        return tiny_model(seed), "tiny 2-layer Llama (random init; --quick)"
    path = find_base_model(results, name)
    if path is not None:
        return load_base(path), str(path)
    if name == MOE_MODEL:
        from qatlib.offline.upcycle import UpcycleSpec, upcycle_weights

        dense_path = find_base_model(results, DENSE_MODEL)
        if dense_path is None:
            raise FileNotFoundError(f"no {results}/base/{DENSE_MODEL} to upcycle {MOE_MODEL} from")
        spec = UpcycleSpec.from_dict(base_models_spec(MOE_MODEL)["upcycle"])
        spec = replace(spec, cluster=False)  # contiguous expert slices: no calibration forward
        moe = upcycle_weights(load_base(dense_path), spec)[0].float()
        moe.config.use_cache = False
        return moe, f"upcycled in memory from {dense_path} (routers untrained, contiguous experts)"
    raise FileNotFoundError(
        f"no {results}/base/{name}: build it with the default DAG (snakemake) or pass --quick"
    )


def experiment_config(path: Path = DEFAULT_EXPERIMENT):
    """The default experiment's config, one process (no DeepSpeed): loss, learnable, scale update
    and the HF training arguments the trainer is built from."""
    from qatlib.config import load_config

    return load_config(path, overrides=["compression.QAT.hf_args.deepspeed=null"])


# --------------------------------------------------------------------------- the step
class TrainerStep:
    """One prepared model and its `QATTrainer`; ``qat()`` and ``plain()`` are one trainer step
    each (HF ``training_step`` = `QATTrainer.compute_loss` with its teacher + backward, then the
    trainer's optimizer step), on the same model, inputs and optimizer."""

    def __init__(
        self,
        base,
        fmt: str,
        cfg,
        x: torch.Tensor,
        out_dir: str,
        *,
        frozen: bool = True,
        scale_update: str | None = None,
    ) -> None:
        from qatlib.ptq import calibrate
        from qatlib.quant.codes import freeze_codes
        from qatlib.trainers.end2end import QATTrainer, training_arguments

        self.model = model = copy.deepcopy(base)
        calibrate(model, format_scheme(fmt), [x[:1]], ignore=IGNORE)
        self.frozen = freeze_codes(model) if frozen else 0
        args = training_arguments(
            cfg,
            output_dir=out_dir,
            per_device_train_batch_size=x.shape[0],
            disable_tqdm=True,
            logging_steps=10**9,
        )
        self.trainer = QATTrainer(
            model,
            args,
            loss_config=cfg.loss_config(),
            learnable=cfg.learnable(),
            scale_update=scale_update or cfg.scale_update,
            log_file=False,
        )
        self.optimizer = self.trainer.create_optimizer()
        # the plain variant has no trainable tensor: its backward runs from the embedding output
        # (the activation gradients the QAT step's backward also computes)
        model.enable_input_require_grads()
        self.inputs = {"input_ids": x, "labels": x, "attention_mask": torch.ones_like(x)}
        self.n_items = torch.tensor(x.shape[0] * (x.shape[1] - 1))
        self.n_trainable = self.trainer.trainable.numel()
        self.last_loss: torch.Tensor | None = None
        from qatlib.quant import quant_linears

        self.weights = [ql.weight for _, ql in quant_linears(model)]

    def qat(self) -> None:
        self.last_loss = self.trainer.training_step(self.model, self.inputs, self.n_items)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def plain(self) -> None:
        from qatlib.quant import quantization_disabled

        with quantization_disabled(self.model):
            self.qat()

    def compiled(self) -> None:
        """``qat`` with qatlib's ``compile_fake_quant`` switched on (torch.compile of the op)."""
        from qatlib.quant import quantizers

        qs = [q for _, q in quantizers(self.model)]
        for q in qs:
            q.compile_fake_quant = True
        try:
            self.qat()
        finally:
            for q in qs:
                q.compile_fake_quant = False

    def plain_wgrad(self) -> None:
        """``plain`` with the quantized linears' weights requiring grad (computed, never applied):
        the backward of plain fine-tuning, whose weight-gradient GEMMs a learned weight scale
        needs too (``dL/ds = sum(dL/dW_q * dW_q/ds)``)."""
        for w in self.weights:
            w.requires_grad_(True)
        try:
            self.plain()
        finally:
            for w in self.weights:
                w.requires_grad_(False)
                w.grad = None


def step_rows(model_name: str, base, s: SpeedSettings, tokens: tuple[int, ...], repeats: int, formats):
    """One row per (format, tokens per step): ``qat / plain`` median, min, max over rounds."""
    cfg = experiment_config()
    rows = []
    gen = torch.Generator().manual_seed(s.seed)
    vocab = base.config.vocab_size
    for n_tok in tokens:
        if n_tok % s.seq:
            raise ValueError(f"tokens per step {n_tok} is not a multiple of seq {s.seq}")
        x = torch.randint(0, vocab, (n_tok // s.seq, s.seq), generator=gen)
        for variant in [f for f in formats if n_tok < TARGET_LARGE[0] or f in s.large_formats]:
            log(f"speed: {model_name} {variant} {n_tok} tokens/step (load {load_avg()})")
            with tempfile.TemporaryDirectory(prefix="bench-speed-") as d:
                fmt, frozen, update = STEP_FORMATS[variant]
                sb = TrainerStep(base, fmt, cfg, x, d, frozen=frozen, scale_update=update)
                fns = {"qat": sb.qat, "plain": sb.plain}
                if s.wgrad:
                    fns["plain_wgrad"] = sb.plain_wgrad
                t = interleaved(fns, repeats=repeats, warmup=s.warmup if n_tok <= 512 else 0)
            rows.append(
                {
                    "model": model_name,
                    "format": variant,
                    "weights": FORMATS[STEP_FORMATS[variant][0]],
                    "frozen_codes": bool(sb.frozen),
                    "tokens_per_step": n_tok,
                    "batch": n_tok // s.seq,
                    "seq": s.seq,
                    **spread(t["qat"], t["plain"]),
                    **(
                        {
                            "qat_over_plain_wgrad": paired_ratio(t["qat"], t["plain_wgrad"])["ratio"],
                            "plain_wgrad_over_plain": paired_ratio(t["plain_wgrad"], t["plain"])["ratio"],
                            "plain_wgrad_ms": round(1000 * statistics.median(t["plain_wgrad"]), 2),
                        }
                        if "plain_wgrad" in t
                        else {}
                    ),
                    "trainable_scale_elements": sb.n_trainable,
                }
            )
            del sb
    return rows


def spread(num: list[float], den: list[float]) -> dict[str, Any]:
    """``num / den`` per round: median (the figure), min, max; and each side's median ms."""
    per = [a / b for a, b in zip(num, den)]
    return {
        "qat_over_plain": paired_ratio(num, den)["ratio"],
        "min": rounded(min(per)),
        "max": rounded(max(per)),
        "qat_ms": round(1000 * statistics.median(num), 2),
        "qat_ms_min": round(1000 * min(num), 2),
        "qat_ms_max": round(1000 * max(num), 2),
        "plain_ms": round(1000 * statistics.median(den), 2),
        "plain_ms_min": round(1000 * min(den), 2),
        "plain_ms_max": round(1000 * max(den), 2),
        "rounds": len(per),
    }


def plain_step_is_the_model(base, x: torch.Tensor) -> dict[str, Any]:
    """The ``plain`` variant computes what the unprepared model computes: its first trainer step's
    loss (quantizers off, the teacher is the same model: KL 0) against the unprepared model's own
    KL to itself and LM loss (`qatlib.losses.qat_loss`), bit for bit (a check of the harness, not
    a timing)."""
    from qatlib.losses import LossConfig, qat_loss

    cfg = experiment_config()
    with tempfile.TemporaryDirectory(prefix="bench-speed-") as d:
        sb = TrainerStep(base, "int4_g64", cfg, x, d)
        sb.plain()
    with torch.no_grad():
        logits = base(input_ids=x, use_cache=False).logits
    ref = qat_loss(logits, x, cfg.loss_config(), logits).loss
    lm = LossConfig()
    from qatlib.quant import quantization_disabled

    with torch.no_grad(), quantization_disabled(sb.model):
        prep = sb.model(input_ids=x, use_cache=False).logits
    return {
        "plain_step_loss": float(sb.last_loss),
        "unprepared_loss": float(ref),
        "loss_bit_equal": bool(torch.equal(sb.last_loss.detach().float(), ref.float())),
        "logits_bit_equal": bool(torch.equal(prep, logits)),
        "unprepared_lm_loss": float(qat_loss(logits, x, lm).loss),
        "prepared_off_lm_loss": float(qat_loss(prep, x, lm).loss),
    }


# --------------------------------------------------------------------------- fake-quant op
def fake_quant_row(fmt: str, n: int, repeats: int) -> dict[str, Any]:
    """GB/s of fp32 weights through the weight fake-quant (forward) against ``clone`` (copy)."""
    from qatlib.quant import functional as F

    spec = format_scheme(fmt).weight
    w = torch.randn(n, n, generator=torch.Generator().manual_seed(0)) * 0.02
    gs = F.fp4_global_scale(w.abs().amax()) if spec.has_global_scale else None
    scale, zp = F.compute_qparams(w, spec, **({"global_scale": gs} if gs is not None else {}))

    def fq():
        with torch.no_grad():
            F.fake_quantize(w, scale, zp, spec, **({"global_scale": gs} if gs is not None else {}))

    t = interleaved({"copy": w.clone, "fake_quant": fq}, repeats=repeats, warmup=1)
    nbytes = w.numel() * w.element_size()
    return {
        "format": fmt,
        "weight_spec": spec.describe(),
        "shape": f"{n}x{n}",
        "dtype": "float32",
        "weight_bytes": nbytes,
        "fake_quant_s": statistics.median(t["fake_quant"]),
        "copy_s": statistics.median(t["copy"]),
        "fake_quant_GBps": rounded(nbytes / statistics.median(t["fake_quant"]) / 1e9, 3),
        "copy_GBps": rounded(nbytes / statistics.median(t["copy"]) / 1e9, 3),
        # per round: copy time / fake-quant time = (bytes / t_fq) / (bytes / t_copy)
        "fraction_of_copy": paired_ratio(t["copy"], t["fake_quant"])["ratio"],
        "rounds": repeats,
    }


# --------------------------------------------------------------------------- the DAG's own record
def dag_qat_record(results: str, experiment: str = DENSE_MODEL) -> dict[str, Any]:
    """The default DAG's QAT stage from its own records: the stage's wall time
    (``timings/zero3_qat.json``, the process from start to saved checkpoint) and the trainer's
    token counts (``qat/train_log.jsonl``: valid label tokens per logging interval)."""
    root = Path(results) / experiment
    timing = root / "timings" / "zero3_qat.json"
    log_file = root / "qat" / "train_log.jsonl"
    if not timing.is_file() or not log_file.is_file():
        return {"skipped": f"no {timing} / {log_file}: run the default DAG first"}
    t = json.loads(timing.read_text())
    lines = [json.loads(x) for x in log_file.read_text().splitlines() if x.strip()]
    tokens = sum(int(r.get("tokens", 0)) for r in lines)
    return {
        "experiment": experiment,
        "timing_file": str(timing),
        "world_size": t.get("world_size"),
        "steps": t.get("steps"),
        "samples": t.get("samples"),
        "wall_s": t.get("wall_s"),
        "trained_tokens": tokens,
        "tokens_per_s": round(tokens / t["wall_s"], 2) if t.get("wall_s") else None,
        "note": "wall_s is the whole stage (load, ZeRO-3 init, training, save); tokens are the "
        "trainer's valid label tokens over all ranks",
    }


# --------------------------------------------------------------------------- targets
def target(name: str, value: float | None, bound: float, *, higher_is_better: bool, reason: str = ""):
    """``{name, value, bound, met, reason}``; ``reason`` is kept only when the target is missed
    (or unmeasured). A `Rounded` value is compared unrounded."""
    from .common import exact

    v = exact(value)
    met = None if v is None else (v >= bound if higher_is_better else v <= bound)
    out = {"name": name, "value": v, "bound": bound, "op": ">=" if higher_is_better else "<=", "met": met}
    if met is not True:
        out["reason"] = reason or "not measured"
    return out


def step_reason(r: dict[str, Any]) -> str:
    """Why a step ratio is what it is: the weight-gradient GEMMs that the learned scales' gradient
    needs (``plain_wgrad / plain``) and what the fake-quant adds on top (``qat / plain_wgrad``)."""
    out = f"measured x{r['qat_over_plain']} (min {r['min']}, max {r['max']})"
    if "plain_wgrad_over_plain" in r:
        out += (
            f"; the scale gradient needs dL/dW_q, one more GEMM per linear: plain step with weight "
            f"gradients x{r['plain_wgrad_over_plain']}, QAT over that x{r['qat_over_plain_wgrad']}"
        )
    return out


def targets_of(step: list[dict], fq: list[dict], why: dict[str, str] | None = None) -> list[dict]:
    """The issue's targets over the measured rows (``why``: a reason per target name when missed)."""
    why = why or {}
    tg = []
    for r in step:
        if r["format"] not in TARGET_FORMATS:
            continue
        n = r["tokens_per_step"]
        bound = TARGET_LARGE[1] if n >= TARGET_LARGE[0] else TARGET_MID[1] if n == TARGET_MID[0] else None
        if bound is None:
            continue
        name = f"QAT step / plain step [{r['model']}, {r['format']}, {n} tokens]"
        tg.append(
            target(
                name,
                r["qat_over_plain"],
                bound,
                higher_is_better=False,
                reason=why.get(name, step_reason(r)),
            )
        )
    for r in fq:
        name = f"fake-quant GB/s / copy GB/s [{r['format']}]"
        tg.append(
            target(
                name,
                r["fraction_of_copy"],
                TARGET_FQ_COPY,
                higher_is_better=True,
                reason=why.get(
                    name,
                    f"{r['fake_quant_GBps']} GB/s vs copy {r['copy_GBps']} GB/s: the eager op makes "
                    "several fp32 passes over the weight",
                ),
            )
        )
    return tg


# --------------------------------------------------------------------------- driver
@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def run(
    settings: SpeedSettings | None = None,
    *,
    results: str = "results",
    models: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The speed record (the module docstring). ``models``: ``{name: (model, source)}`` to use
    instead of loading them (tests)."""
    s = settings or SpeedSettings()
    with torch_threads(s.threads):
        return _run(s, results, models or {})


def _run(s: SpeedSettings, results: str, given: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(s.seed)
    out: dict[str, Any] = {
        "settings": asdict(s),
        "torch_threads_used": torch.get_num_threads(),
        "load_avg_start": load_avg(),
        "models": {},
        "step": [],
    }
    for i, name in enumerate(s.models):
        base, source = given.get(name) or load_model(name, results, s.seed)
        base.eval()
        out["models"][name] = {"source": source, "params": sum(p.numel() for p in base.parameters())}
        moe = name == MOE_MODEL
        tokens, repeats, formats = (
            (s.moe_tokens, s.moe_repeats, s.moe_formats) if moe else (s.tokens, s.repeats, s.formats)
        )
        if i == 0:
            gen = torch.Generator().manual_seed(s.seed)
            x = torch.randint(0, base.config.vocab_size, (2, s.seq), generator=gen)
            out["plain_check"] = {"model": name, **plain_step_is_the_model(base, x)}
        out["step"] += step_rows(name, base, s, tokens, repeats, formats)
        if moe:
            out["models"][name]["reduced"] = (
                f"tokens {list(tokens)}, formats {list(formats)}, {repeats} repeats (2-core budget)"
            )
        del base
    out["fake_quant"] = []
    for fmt in s.fq_formats:
        log(f"speed: fake-quant op {fmt}")
        out["fake_quant"].append(fake_quant_row(fmt, s.fq_size, s.fq_repeats))
    if s.zero3:
        from .speed_zero3 import zero3_rows

        out["zero3"] = zero3_rows(s, results)
    out["dag_qat"] = dag_qat_record(results)
    out["targets"] = targets_of(out["step"], out["fake_quant"])
    out["load_avg_end"] = load_avg()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a tiny model, two token counts (seconds)")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="output folder (default results/bench)")
    ap.add_argument("--results", default="results", help="where the pipeline's base models are")
    ap.add_argument("--threads", type=int, default=None, help="torch threads while timing (default 1)")
    ap.add_argument("--no-zero3", action="store_true", help="skip the 1- vs 2-rank ZeRO-3 step")
    ap.add_argument("--models", help=f"comma-separated (default {DENSE_MODEL},{MOE_MODEL})")
    ap.add_argument("--tokens", help="tokens per step of the dense model, comma-separated")
    ap.add_argument("--formats", help=f"step formats, comma-separated, of {', '.join(STEP_FORMATS)}")
    ap.add_argument("--moe-tokens", help="tokens per step of the MoE, comma-separated (default 512)")
    ap.add_argument("--repeats", type=int, help="rounds per step ratio (default 5)")
    ap.add_argument("--no-wgrad", action="store_true", help="skip the plain_wgrad variant")
    args = ap.parse_args(argv)
    s = QUICK if args.quick else SpeedSettings()
    if args.threads:
        s = replace(s, threads=args.threads)
    if args.no_zero3:
        s = replace(s, zero3=False)
    if args.no_wgrad:
        s = replace(s, wgrad=False)
    if args.repeats:
        s = replace(s, repeats=args.repeats, moe_repeats=args.repeats)
    if args.models:
        s = replace(s, models=tuple(args.models.split(",")))
    if args.tokens:
        s = replace(s, tokens=tuple(int(t) for t in args.tokens.split(",")))
    if args.moe_tokens:
        s = replace(s, moe_tokens=tuple(int(t) for t in args.moe_tokens.split(",")))
    if args.formats:
        fs = tuple(args.formats.split(","))
        if unknown := [f for f in fs if f not in STEP_FORMATS]:
            ap.error(f"--formats: unknown {', '.join(unknown)}; choose from {', '.join(STEP_FORMATS)}")
        s = replace(s, formats=fs, moe_formats=tuple(f for f in s.moe_formats if f in fs) or fs[:1])
        s = replace(s, large_formats=tuple(f for f in s.large_formats if f in fs) or fs)
    doc = {"machine": machine(), **run(s, results=args.results)}
    path = write_result(args.out, "speed", doc)
    log(f"speed: wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
