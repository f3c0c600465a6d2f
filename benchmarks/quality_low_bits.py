"""3-bit and 2-bit weight-only on the default model (SmolLM2-135M, #40 build 2): RTN and GPTQ against
end-to-end QAT and the two-phase recipe at the issue's token budget (100 x 256 tokens), each row
also as deployed, with its paired standard error and wall time.

Per format (``int3_g64``, ``int2_g64``: symmetric, groups of 64; 128 does not divide SmolLM2's 576):

- ``rtn``: `qatlib.ptq.calibrate`; ``gptq``: `qatlib.ptq.gptq.gptq` (16 calibration windows);
- ``end-to-end``: the default experiment's recipe (`quality_default.RECIPE`: forward KL, RTN's
  codes held, scales in log space at a relative 1e-3, constant after 3 warmup steps), 100 steps;
  int2's weights train too, at 1e-3 (``e2e_weight_lr``, chosen on calib.txt windows);
- ``two-phase``: blockwise training of weights and scales (`quality_default.BlockwiseRows`'
  recipe: token-relative block loss, weight lr 1e-3, scales 1e-2 relative) on ``bw_windows``
  windows, then end-to-end on its codes held for ``phase2_steps`` steps at 1e-3: with the defaults
  50 + 50 windows of 256 tokens, the end-to-end row's 100 x 256.

Every row: test perplexity on the same 32 spread windows, recovery ``(RTN - x) / (RTN - BF16)``
with its paired standard error (`qatlib.report.metrics.recovery`) in perplexity (the report's
definition) and in test loss (``loss_recovery``: log-perplexity, what the targets read, since the
perplexity ratio calls any int2 model a full recovery next to RTN's 7e6), and the same for the model
as deployed: the real export (`qatlib.export.export`) loaded as vLLM 0.33 computes it
(`qatlib.eval.variants.load_deployed`, the runtime emulator), against RTN as deployed. What the
runtimes do with 2 / 3-bit WNA16 (`qatlib.runtime.facts`, `Layout.WNA16_ODD_BITS`) is recorded in
``runtimes``: vLLM loads it, SGLang refuses it (Marlin is 4 / 8-bit only).

``python -m benchmarks.quality_low_bits [--formats int3_g64,int2_g64] [--recipe JSON] [--keep]`` ->
``results/bench/quality_low_bits.json`` (rewritten after each format). ``--keep``: the formats of
the existing JSON that this run does not measure stay in it (`kept_formats`: only from a run of
the same settings), so one format can be measured at a time on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from .common import DEFAULT_OUT, exact, format_scheme, log, machine, rounded, target, write_result
from .lab import loss_recovery_record, opened, recovery_record
from .quality_default import RECIPE, BlockwiseRows, blockwise_lab


@dataclass
class LowBitRows:
    formats: tuple[str, ...] = ("int3_g64", "int2_g64")
    steps: int = 100  # end-to-end alone: the 100 x 256 tokens
    bw_windows: int = 50  # two-phase: blockwise on 50 windows, then ...
    phase2_steps: int = 50  # ... 50 end-to-end steps: 100 x 256 tokens in all
    phase2_lr: float = 1e-3
    bw_val_windows: int = 8  # blockwise's validation windows (held apart, not trained on)
    bw_epochs: int = 1  # passes of phase 1 over its windows (more compute, the same tokens)
    gptq: bool = True
    deployed: bool = True
    eval_windows: int = 32
    seed: int = 0
    # formats whose end-to-end row trains the linear weights too (straight-through, at this lr; codes
    # free) instead of holding RTN's codes: int2, whose codes RTN leaves at 7e6 PPL. Chosen on 32
    # calib.txt windows (neither trained on nor test), end-to-end test-loss recovery at 100 steps:
    # codes held, scales at 1e-3 0.44 / at 1e-2 0.66; weights at 1e-4 0.61 / at 1e-3 0.70 (1.7 x the time)
    e2e_weight_lr: tuple[tuple[str, float], ...] = (("int2_g64", 1e-3),)
    # the targets: the recovery of RTN's test loss (log-perplexity: the perplexity ratio is
    # degenerate where RTN is at 7e6 PPL, `loss_recovery_record`) by the row named (a prefix),
    # as deployed, and that row beating GPTQ; int2's row chosen on the calib.txt windows above
    targets: tuple[tuple[str, float, str], ...] = (
        ("int3_g64", 0.85, "two-phase"),
        ("int2_g64", 0.60, "end-to-end"),
    )


def runtimes_of(scheme) -> dict[str, str]:
    """What each runtime does with the export of ``scheme`` (`qatlib.runtime.facts`)."""
    from qatlib.runtime.facts import TARGETS, layout_of, load_refusal

    layout = layout_of(scheme)
    out = {}
    for name in TARGETS:
        fact = load_refusal(name, layout, moe=False)
        out[name] = f"refused: {fact.what} ({fact.source})" if fact else f"loads ({layout.value})"
    return out


def deployed_minus_trained(dep: dict, q: dict) -> dict[str, float | None]:
    """The deployed model's test loss minus the trained one's (nats per token) and its paired
    standard error over the windows: the emulator's bound where the two cannot be equal. W4A4's
    activation codes at a rounding boundary flip with the kernel's summation order (vLLM applies the
    global scales after the GEMM, training inside the weight): on SmolLM2 NVFP4 RTN, fp32, layer 0's
    q_proj differs by 2.5e-7 relative, its down_proj by 3e-5 (flipped codes), the last hidden state
    by 17%, the perplexity by 0.2%; bit-equal weights, a chaotic forward."""
    from qatlib.report.metrics import paired_diff_se

    per = q["tokens"] / q["windows"]
    a, b = (dep["_nll"] / per).tolist(), (q["_nll"] / per).tolist()
    se = paired_diff_se(a, b)
    return {
        "deployed_minus_trained_nll": rounded(dep["nll"] - q["nll"], 6),
        "deployed_minus_trained_nll_se": rounded(se, 6),
    }


@dataclass
class RowTable:
    """One format's rows, each evaluated as trained and (``deployed``) as vLLM deploys it, with its
    recovery against RTN: as trained against RTN, as deployed against RTN as deployed (the first
    row's export), so that both columns compare like with like."""

    lab: Any
    scheme: Any
    fmt: str
    bf16: dict
    rtn: dict
    deployed: bool = True
    rows: list[dict] = field(default_factory=list)
    rtn_dep: dict = field(default_factory=dict)
    # with a smoothed PTQ start (``smooth_alpha``): plain RTN's evaluation and its deployed one, the
    # issue's baseline; each row then also records its recovery of plain RTN's gap
    plain: tuple[dict, dict | None] | None = None
    t0: float = field(default_factory=time.perf_counter)

    @classmethod
    def from_rtn(cls, lab, fmt: str, bf16: dict, *, deployed: bool, tag: str, deploy_target: str = "none"):
        """The table of ``fmt`` with its first row, RTN (`Lab.rtn`, the scales ``deploy_target``
        merges tied). Where the lab smooths (``smooth_alpha``), plain RTN is evaluated too: the
        issue's baseline (``plain``)."""
        t0 = time.perf_counter()
        scheme = format_scheme(fmt)
        rtn_m = lab.rtn(scheme, deploy_target=deploy_target)
        rtn = lab.eval(rtn_m, mc=False)
        log(f"{tag} {fmt}: bf16 {bf16['ppl']:.3f} rtn {rtn['ppl']:.3f}")
        plain = None
        if lab.s.smooth_alpha is not None:  # the baseline stays plain RTN: recorded beside
            pm = lab.rtn(scheme, deploy_target=deploy_target, smooth=False)
            plain = (lab.eval(pm, mc=False), lab.deployed_eval(pm, scheme) if deployed else None)
            del pm
        table = cls(lab, scheme, fmt, bf16, rtn, deployed, plain=plain, t0=t0)
        table.add("rtn", rtn_m, 0.0, q=rtn)
        return table

    def record(self, gptq: dict | None = None) -> dict[str, Any]:
        """The format's record: what the runtimes do with it, BF16's, RTN's and (``gptq``: its
        evaluation) GPTQ's perplexity, the rows and the wall time since `from_rtn`."""
        return {
            "format": self.fmt,
            "scheme": self.scheme.to_dict(),
            "runtimes": runtimes_of(self.scheme),
            "bf16_ppl": round(self.bf16["ppl"], 4),
            "rtn_ppl": round(self.rtn["ppl"], 4),
            "gptq_ppl": rounded(gptq["ppl"]) if gptq else None,
            "rows": self.rows,
            "wall_s": round(time.perf_counter() - self.t0, 1),
        }

    def add(self, name: str, m, train_s: float, q=None, **extra) -> dict:
        """Evaluate ``m`` (``q``: its evaluation, when already made), append its row; returns ``q``."""
        q = q if q is not None else self.lab.eval(m, mc=False)
        r: dict[str, Any] = {
            "variant": name,
            "ppl": rounded(q["ppl"]),
            **recovery_record(self.bf16, self.rtn, q),
            **loss_recovery_record(self.bf16, self.rtn, q),
        }
        if self.deployed:
            dep = self.lab.deployed_eval(m, self.scheme)
            if not self.rtn_dep:
                self.rtn_dep.update(dep)
            if "refused" in dep:
                r["deployed"] = dep
            else:
                base = self.rtn if "refused" in self.rtn_dep else self.rtn_dep
                dr = recovery_record(self.bf16, base, dep)
                r["deployed_ppl"] = rounded(dep["ppl"])
                r["deployed_recovery"], r["deployed_recovery_se"] = dr["recovery"], dr["recovery_se"]
                lr_ = loss_recovery_record(self.bf16, base, dep)
                r["deployed_loss_recovery"], r["deployed_loss_recovery_se"] = (
                    lr_["loss_recovery"],
                    lr_["loss_recovery_se"],
                )
                r["deployed_equals_trained"] = bool(torch.equal(dep["_nll"], q["_nll"]))
                r.update(deployed_minus_trained(dep, q))
                r["deployed_applied"] = dep["applied"]
                if self.plain and self.plain[1] and "refused" not in self.plain[1]:
                    pr = recovery_record(self.bf16, self.plain[1], dep)
                    r["deployed_plain_rtn_recovery"] = pr["recovery"]
                    r["deployed_plain_rtn_recovery_se"] = pr["recovery_se"]
        if self.plain:
            pr = recovery_record(self.bf16, self.plain[0], q)
            r["plain_rtn_ppl"] = round(self.plain[0]["ppl"], 4)
            r["plain_rtn_recovery"], r["plain_rtn_recovery_se"] = pr["recovery"], pr["recovery_se"]
        r.update(train_s=round(train_s, 1), **extra)
        self.rows.append(r)
        log(
            f"{self.fmt}: {name}: ppl {r['ppl']} recovery {r['recovery']} +- {r['recovery_se']}"
            + (f", deployed {r.get('deployed_ppl')} ({r.get('deployed_recovery')})" if self.deployed else "")
        )
        return q


def one_format(lab, b: LowBitRows, fmt: str, bf16: dict) -> dict[str, Any]:
    table = RowTable.from_rtn(lab, fmt, bf16, deployed=b.deployed, tag="low_bits")
    scheme, row = table.scheme, table.add
    gq = None
    if b.gptq:
        t1 = time.perf_counter()
        gm = lab.gptq(scheme)
        gq = row("gptq", gm, time.perf_counter() - t1, calib_windows=lab.s.calib_windows)
        del gm
    r, name = RECIPE, "end-to-end (RTN's codes held, scales)"
    if fmt in dict(b.e2e_weight_lr):
        r = {**RECIPE, "weight_lr": dict(b.e2e_weight_lr)[fmt], "frozen_codes": False}
        name = "end-to-end (weights and scales)"
    m, rec = lab.qat(
        scheme,
        steps=b.steps,
        lr=r["lr"],
        weight_lr=r["weight_lr"],
        scale_update=r["scale_update"],
        frozen_codes=r["frozen_codes"],
        act_scale=False,
    )
    row(name, m, rec["train_s"], steps=b.steps, recipe=r, teacher=rec["teacher"])
    del m
    bm, pm, extra = two_phase(lab, scheme, b, act_scale=False)
    row("blockwise (phase 1 alone)", bm, extra["phase1_s"], windows=b.bw_windows)
    row(TWO_PHASE_ROW, pm, extra.pop("train_s"), **extra)
    del bm, pm
    return table.record(gq)


TWO_PHASE_ROW = "two-phase: blockwise, then end-to-end on its codes"


def two_phase(lab, scheme, b, *, deploy_target: str = "none", act_scale: bool = True):
    """`benchmarks.lab.Lab.two_phase` at ``b``'s budget (``bw_windows``, ``phase2_steps``,
    ``phase2_lr``; the lab's ``bw_*`` settings, `rows_lab`), phase 2 on phase 1's codes held.
    ``(phase 1 model, two-phase model, the row's fields)``; ``train_s`` is both phases'."""
    bm, brec, pm, prec = lab.two_phase(
        scheme, steps=b.phase2_steps, lr=b.phase2_lr, act_scale=act_scale, deploy_target=deploy_target
    )
    extra = {
        "train_s": brec["train_s"] + prec["train_s"],
        "windows": b.bw_windows,
        "phase1_epochs": b.bw_epochs,
        "phase2_steps": b.phase2_steps,
        "phase2_lr": b.phase2_lr,
        "blockwise": brec["settings"],
        "phase1_s": round(brec["train_s"], 1),
    }
    return bm, pm, extra


def targets_of(b: LowBitRows, done: list[dict]) -> list[dict]:
    """Per target of ``b``: the named row's recovery of RTN's test loss as deployed (as trained
    where there is no deployed figure), and GPTQ's perplexity minus that row's (beating GPTQ)."""
    tg = []
    for fmt, floor, prefix in b.targets:
        f = next((d for d in done if d["format"] == fmt), None)
        if f is None:
            continue
        row = next(r for r in f["rows"] if r["variant"].startswith(prefix))
        dep = "deployed_loss_recovery" in row
        value = row["deployed_loss_recovery"] if dep else row["loss_recovery"]
        se = row["deployed_loss_recovery_se"] if dep else row["loss_recovery_se"]
        tg.append(
            target(
                f"{prefix} recovery of RTN's test loss (log-perplexity), {'as deployed' if dep else 'as trained'} [{fmt}]",
                value,
                floor,
                higher_is_better=True,
                note=f"SE {se}; as trained {row['loss_recovery']}; in perplexity {row.get('deployed_recovery', row['recovery'])}",
            )
        )
        if f["gptq_ppl"] is not None:
            ppl = row.get("deployed_ppl") or row["ppl"]
            tg.append(
                target(
                    f"GPTQ perplexity minus {prefix}'s, as deployed [{fmt}]",
                    exact(f["gptq_ppl"]) - exact(ppl),
                    0.0,
                    higher_is_better=True,
                    note=f"GPTQ {f['gptq_ppl']}, {prefix} {ppl}",
                )
            )
    return tg


def kept_formats(path: Path, b: LowBitRows) -> list[dict]:
    """The formats of the JSON at ``path`` that ``b`` does not measure, to keep beside the new ones;
    a ValueError naming the file and the field when its settings differ from ``b``'s (other than
    ``formats``): rows of another recipe or budget are not comparable rows of one table."""
    if not path.exists():
        return []
    try:
        old = json.loads(path.read_text())
    except ValueError as e:  # a truncated or hand-edited file: say which
        raise ValueError(f"{path}: not a benchmark JSON ({e})") from e
    mine = {k: v for k, v in json.loads(json.dumps(asdict(b))).items() if k != "formats"}
    theirs = {k: v for k, v in (old.get("settings") or {}).items() if k != "formats"}
    for k in sorted(set(mine) | set(theirs)):
        if mine.get(k) != theirs.get(k):
            raise ValueError(f"{path}: settings.{k} is {theirs.get(k)!r}, this run's is {mine.get(k)!r}")
    return [f for f in old.get("formats", []) if f["format"] not in b.formats]


def rows_lab(b, results: str, **overrides):
    """The lab settings of a rows benchmark (this one, `benchmarks.quality_w4a4`):
    `quality_default.blockwise_lab` of `BlockwiseRows`' recipe on ``b``'s ``bw_windows`` windows
    (``bw_epochs`` passes, ``bw_val_windows`` held apart), evaluation windows and seed; ``b``'s
    ``bw_norm`` and ``smooth_alpha`` where it has them; plus ``overrides``."""
    bw = BlockwiseRows(
        epochs=b.bw_epochs,
        train_size=b.bw_windows,
        val_size=b.bw_val_windows,
        eval_windows=b.eval_windows,
        seed=b.seed,
    )
    extra = {"bw_norm": getattr(b, "bw_norm", False), "smooth_alpha": getattr(b, "smooth_alpha", None)}
    return blockwise_lab(bw, results, **extra, **overrides)


def run_rows(b, s, *, one_format, targets_of, results, out, name, keep, lab_keys, train_tokens) -> dict:
    """Measure ``b.formats`` with the lab ``s`` (``one_format(lab, b, fmt, bf16)``), rewriting
    ``<out>/<name>.json`` after each format beside the ``keep`` ones; ``lab_keys``: the prefixes of
    the lab settings recorded."""
    torch.manual_seed(b.seed)
    t0 = time.perf_counter()
    done: list[dict] = list(keep or [])
    body: dict[str, Any] = {}
    with opened(s, results, f"bench-{name}-") as (lab, inputs):
        bf16 = lab.eval(lab.base, mc=False)
        for fmt in b.formats:
            done.append(one_format(lab, b, fmt, bf16))
            body = {
                "machine": machine(),
                "settings": asdict(b),
                "lab": {k: v for k, v in asdict(s).items() if k.startswith(lab_keys)},
                "inputs": {k: inputs[k] for k in ("base", "base_source", "corpus", "corpus_source")},
                "bf16_ppl": round(bf16["ppl"], 4),
                "eval_windows": bf16["windows"],
                "train_tokens": train_tokens,
                "formats": done,
                "targets": targets_of(b, done),
                "total_s": round(time.perf_counter() - t0, 1),
            }
            if out:
                log(f"{name}: wrote {write_result(out, name, body)}")
    return body


def run(
    b: LowBitRows,
    *,
    results: str = "results",
    out: str | None = None,
    name: str = "quality_low_bits",
    keep: list[dict] | None = None,
):
    s = rows_lab(
        b,
        results,
        qat_steps=max(b.steps, b.phase2_steps),
        warmup_steps=RECIPE["warmup_steps"],
        lr_scheduler=RECIPE["lr_scheduler_type"],
    )
    tokens = {"end_to_end": b.steps * s.seq_len, "two_phase": (b.bw_windows + b.phase2_steps) * s.seq_len}
    return run_rows(
        b,
        s,
        one_format=one_format,
        targets_of=targets_of,
        results=results,
        out=out,
        name=name,
        keep=keep,
        lab_keys=("bw_", "calib", "seq", "lr", "warm", "loss"),
        train_tokens=tokens,
    )


def rows_main(argv: list[str] | None, doc: str, rows_type: type, run_rows, name: str) -> int:
    """The command line of a rows benchmark (this one, `benchmarks.quality_w4a4`): ``--formats``,
    ``--recipe`` (JSON of ``rows_type``'s fields), ``--keep``; a bad format, recipe field or kept
    JSON is an argparse error naming it, before any model is loaded."""
    from .common import format_names

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument(
        "--formats", default=None, help=f"comma-separated (default {','.join(rows_type.formats)})"
    )
    ap.add_argument("--recipe", default=None, help=f"JSON: {rows_type.__name__} fields")
    ap.add_argument("--name", default=name)
    ap.add_argument("--results", default="results")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--keep", action="store_true", help="keep the JSON's formats this run does not measure")
    a = ap.parse_args(argv)
    try:
        b = rows_type(**json.loads(a.recipe)) if a.recipe else rows_type()
    except (ValueError, TypeError) as e:
        ap.error(f"--recipe: {e}")
    b = replace(b, formats=format_names(ap, "--formats", a.formats or b.formats))
    keep = None
    if a.keep:
        try:
            keep = kept_formats(Path(a.out) / f"{a.name}.json", b)
        except ValueError as e:
            ap.error(str(e))
    run_rows(b, results=a.results, out=a.out, name=a.name, keep=keep)
    return 0


def main(argv: list[str] | None = None) -> int:
    return rows_main(argv, __doc__, LowBitRows, run, "quality_low_bits")


if __name__ == "__main__":
    raise SystemExit(main())
