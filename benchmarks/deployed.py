"""Deployment fidelity: PTQ vs QAT perplexity as trained AND as the runtime deploys it.

Per format (`DEPLOYED_FORMATS`), on the default model and data of the quality benchmarks
(`benchmarks.lab.Lab`: RTN PTQ, end-to-end QAT warm-started from it, the same test windows): the
perplexity of the PTQ and the QAT model as trained (fake quantization in memory) and as deployed
(`Lab.deployed`: the export loaded by `qatlib.eval.variants.load_deployed`, the runtime emulator
`qatlib.runtime.emulate` for vLLM 0.33), and the share of QAT's gain that survives deployment::

    survives = (ppl_ptq_deployed - ppl_qat_deployed) / (ppl_ptq_trained - ppl_qat_trained)

(1.0: the whole gain is deployed; below: the runtime's load-time transformations undo part of
what QAT learned). ``tied`` (``PrepareOptions(deploy=tie_for(target))``) repeats the row with the
runtime's merged scales (fp8 per-tensor scales, NVFP4 global scales) trained as one. A format the
runtime refuses gets its refusal instead of deployed numbers. The models run in fp32 (the
lab's): the runtimes' bf16 scale rounding is a no-op here.

    python -m benchmarks.deployed [--quick] [--base-model DIR] [--capability 9.0] [--out results/bench]
"""

from __future__ import annotations

import argparse
import math
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from qatlib.report.metrics import MIN_REL_GAP

from .common import DEFAULT_OUT, format_scheme, load_avg, log, machine, target, write_result
from .lab import DEPLOY_TARGET, Lab, opened
from .lab_inputs import QUICK as QUALITY_QUICK
from .lab_inputs import QualitySettings

# The default model's rows (SmolLM2-135M: hidden 576, k/v 192, MLP 1536, so group 64 divides every
# in_features; w4a8_fp8_g64 is recorded as vLLM's refusal: its CUTLASS W4A8 kernel needs group 128
# and K, N % 128, and 576 is not)
DEPLOYED_FORMATS = (
    "int4_g64",
    "nvfp4_w4a16",
    "fp8_static",
    "nvfp4",
    "mxfp4_w4a16",
    "fp8_dynamic",
    "w4a8_fp8_g64",
)
TARGET = DEPLOY_TARGET
# a row's scheme: `common.format_scheme` names every format above (the name stays for the tests)
deployed_scheme = format_scheme


@dataclass
class DeployedSettings:
    formats: tuple[str, ...] = DEPLOYED_FORMATS
    target: str = TARGET
    # sized to run on 2 CPU cores: ~2.5 min per format and tying at idle (4 evaluations of 16 x 256
    # tokens, 20 steps of 256 tokens); the tied rows' deployed == trained is exact at any size
    qat_steps: int = 20
    qat_batch: int = 1
    eval_windows: int = 16
    # the default experiment's recipe (config/experiments/smollm2-135m.yaml): scales in log space
    # at a relative lr, one value for int / fp8 / FP4 scales (qatlib.trainers.log_scale)
    lr: float = 1e-2
    scale_update: str = "log"
    loss_type: str = "kl"
    tied: bool = True  # also the tied run (`qatlib.runtime.tying.tie_for`)
    base_model: str | None = None  # --base-model DIR (default: the workflow's results/base/<base_name>)
    base_name: str = "smollm2-135m"  # the project's default model (config/experiments/smollm2-135m.yaml)
    capability: str | None = None  # the GPU the deployment runs on (FP4 W4A4: weight-only below "10.0")


# --quick: the micro model of the quality benchmark's quick path (`lab_inputs.QUICK`), one fp8 and
# one FP4 row, tied too
QUICK = DeployedSettings(formats=("fp8_static", "nvfp4_w4a16"), qat_steps=3, eval_windows=8, tied=True)


def _row(name: str, lab: Lab, s: DeployedSettings, deploy_target: str = "none") -> dict[str, Any]:
    """PTQ and QAT, each as trained and as deployed; ``deploy_target``: the runtime's merged scales
    calibrated and trained as one (`qatlib.runtime.tying`)."""
    scheme = format_scheme(name)
    ev = lab.eval
    ptq = lab.rtn(scheme, deploy_target=deploy_target)
    ptq_t = ev(ptq, mc=False)["ppl"]
    ptq_d = lab.deployed(ptq, scheme, s.target, s.capability)
    if "refused" in ptq_d:  # nothing deployed to compare: no QAT run
        return {"format": name, "ptq_trained": ptq_t, "qat_trained": None, "refused": ptq_d["refused"]} | {
            "ptq_deployed": None,
            "qat_deployed": None,
            "survives": None,
        }
    qat, _ = lab.qat(scheme, steps=s.qat_steps, start=ptq)
    qat_t = ev(qat, mc=False)["ppl"]
    qat_d = lab.deployed(qat, scheme, s.target, s.capability)
    row: dict[str, Any] = {"format": name, "ptq_trained": ptq_t, "qat_trained": qat_t}
    if "refused" in qat_d:
        row.update(refused=qat_d["refused"], ptq_deployed=None, qat_deployed=None, survives=None)
        return row
    row.update(ptq_deployed=ptq_d["ppl"], qat_deployed=qat_d["ppl"], applied=qat_d["applied"])
    gain_t, gain_d = ptq_t - qat_t, ptq_d["ppl"] - qat_d["ppl"]
    row["qat_gain_trained"], row["qat_gain_deployed"] = gain_t, gain_d
    # the report's noise rule (`qatlib.report.metrics.MIN_REL_GAP`): a gain below 0.5% of PTQ's
    # perplexity is noise, and a share of it says nothing
    row["survives"] = gain_d / gain_t if gain_t > MIN_REL_GAP * ptq_t else None
    if row["survives"] is None:
        row["note"] = f"QAT's gain as trained ({gain_t:+.4f}) is below {MIN_REL_GAP:.1%} of PTQ's perplexity"
    return row


def run(
    settings: DeployedSettings | None = None, *, results: str = "results", partial: Path | None = None
) -> dict[str, Any]:
    """The rows of every format; ``partial``: rewrite this JSON after each row (a long run that is
    cut short keeps what it measured)."""
    s = settings or DeployedSettings()
    qs = QualitySettings(
        eval_windows=s.eval_windows,
        qat_steps=s.qat_steps,
        qat_batch=s.qat_batch,
        lr=s.lr,
        scale_update=s.scale_update,
        loss_type=s.loss_type,
        warmup_steps=3,
        mc=False,
        gptq=False,
        base_model=s.base_name,
        base_model_path=s.base_model,
    )
    if s.formats == QUICK.formats and s.qat_steps == QUICK.qat_steps and not s.base_model:
        qs = replace(QUALITY_QUICK, qat_steps=s.qat_steps, eval_windows=s.eval_windows, mc=False, gptq=False)
    t0, load0 = time.perf_counter(), load_avg()
    torch.manual_seed(qs.seed)
    rows, tied_rows, errors = [], [], []
    why_untied = None if s.tied else "not requested (--no-tied)"
    with opened(qs, results, "bench-deployed-") as (lab, inputs):
        bf16 = lab.eval(lab.base, mc=False)["ppl"]
        for name in s.formats:
            try:
                log(f"deployed: {name} (untied)")
                rows.append(_row(name, lab, s))
                if why_untied is None:
                    log(f"deployed: {name} (tied)")
                    tied_rows.append(_row(name, lab, s, deploy_target=s.target))
            except Exception as e:  # recorded; the other formats still run
                traceback.print_exc()
                errors.append({"format": name, "error": f"{type(e).__name__}: {e}"})
            if partial is not None:
                doc = {"partial": True, "rows": rows, "tied_rows": tied_rows, "errors": errors}
                write_result(partial.parent, partial.stem, doc)
    tied = {r["format"]: r for r in tied_rows}
    for r in rows:
        t = tied.get(r["format"])
        r["tied"] = t if t is not None else None
        r["tied_survives"] = None if t is None else t.get("survives")
    targets = [
        target(
            f"{r['format']}: share of QAT's gain deployed with tied scales",
            r["tied_survives"],
            0.95,
            higher_is_better=True,
            note=(why_untied or "") if r["tied"] is None else "",
        )
        for r in rows
        if not r.get("refused")
    ]
    return {
        "machine": machine(),
        "settings": asdict(s),
        "targets": targets,
        "base_model": inputs.get("base"),
        "target": s.target,
        "bf16_ppl": bf16,
        "rows": rows,
        "tied_note": why_untied,
        "errors": errors,
        "wall_s": round(time.perf_counter() - t0, 1),
        "load_avg": [load0, load_avg()],
    }


def table(doc: dict[str, Any]) -> str:
    """The README's markdown table of ``doc``."""

    def f(x, p=3):
        return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{p}f}"

    lines = [
        "| format | PTQ trained | PTQ deployed | QAT trained | QAT deployed | QAT gain survives | tied survives |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        surv = (
            "refused"
            if r.get("refused")
            else ("—" if r["survives"] is None else f"{100 * r['survives']:.0f}%")
        )
        tied = "—" if r["tied_survives"] is None else f"{100 * r['tied_survives']:.0f}%"
        lines.append(
            f"| {r['format']} | {f(r['ptq_trained'])} | {f(r['ptq_deployed'])} | {f(r['qat_trained'])} "
            f"| {f(r['qat_deployed'])} | {surv} | {tied} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-tied", action="store_true")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--results", default="results")
    ap.add_argument(
        "--formats", default=None, help=f"comma-separated subset (default {','.join(DEPLOYED_FORMATS)})"
    )
    ap.add_argument(
        "--base-model", default=None, help="a pre-trained model folder (default: results/base/...)"
    )
    ap.add_argument("--capability", default=None, help='the GPU\'s compute capability, e.g. "9.0"')
    ap.add_argument("--eval-windows", type=int, default=None)
    ap.add_argument("--qat-steps", type=int, default=None)
    args = ap.parse_args(argv)
    s = QUICK if args.quick else DeployedSettings()
    if args.no_tied:
        s = replace(s, tied=False)
    if args.formats:
        s = replace(s, formats=tuple(args.formats.split(",")))
    if args.eval_windows:
        s = replace(s, eval_windows=args.eval_windows)
    if args.qat_steps:
        s = replace(s, qat_steps=args.qat_steps)
    if args.base_model or args.capability:
        s = replace(s, base_model=args.base_model, capability=args.capability)
    doc = run(s, results=args.results, partial=Path(args.out) / "deployed.partial.json")
    path = write_result(args.out, "deployed", doc)
    print(table(doc))
    log(f"deployed: wrote {path}")
    return 1 if doc["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
