"""The upcycled real-weight MoE's workflow runs (#40 build 3) as one benchmarks JSON; any other
finished experiment's with ``--name``.

    python -m benchmarks.moe_experiment results/smollm2-moe results/smollm2-moe-fp8 [--out results/bench]
    python -m benchmarks.moe_experiment results/smollm2-135m-nvfp4-two-phase --name nvfp4_two_phase_experiment --target 0.8

Each folder is a finished `snakemake results/<exp>/report.html` of a ``smollm2-moe*`` experiment:
PTQ -> 2-rank ZeRO-3 QAT -> export -> evaluation (bf16 / ptq / qat / export / deployed). Per
experiment: the settings (from the ``config.yaml`` the report saved), the upcycled base model's
own record (``upcycle_stats.json``: SmolLM2's and the MoE's perplexity on the same windows), each
variant's test perplexity, the recovery ``(PTQ - x) / (PTQ - BF16)`` of qat / export / deployed
with its paired standard error over the evaluation windows (`qatlib.report.metrics.recovery`, the
report's definition), every stage's wall time, and the target (#40: the deployed model recovers
>= 0.85 of the PTQ gap). ``--baseline-ptq results/<exp>/eval/ptq.json`` of another PTQ of the same
model on the same windows (plain RTN, where the experiments start from SmoothQuant + RTN): each row's
recovery of that gap too, with its paired SE, which the targets then read; the file's path, perplexity
and sha256 are recorded. ``--note TEXT``: recorded as the JSON's note (the results page prints it).
Writes ``<out>/<name>.json`` (default ``moe_experiment``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

from qatlib.report.metrics import MIN_REL_GAP, recovery
from qatlib.yamlio import load_yaml, section

from .common import DEFAULT_OUT, log, machine, rounded, target, write_result

VARIANTS = ("bf16", "ptq", "qat", "export", "deployed")
TARGET = 0.85
SETTINGS = {
    "format": "compression.quantization.name",
    "quant_method": "compression.quantization.quant_method",
    "quant_helpers": "compression.quantization.quant_helpers",
    "smooth_alpha": "compression.quantization.smooth_alpha",
    "training_mode": "compression.QAT.training_mode",
    "block_wise_config": "compression.QAT.block_wise_config",
    "loss_type": "compression.QAT.loss_type",
    "scale_update": "compression.QAT.plugin_config.quant_config.scale_update",
    "frozen_codes": "compression.QAT.plugin_config.quant_config.frozen_codes",
    "learnable": "compression.QAT.plugin_config.quant_config.learnable",
    "learning_rate": "compression.QAT.hf_args.learning_rate",
    "weight_lr": "compression.QAT.plugin_config.quant_config.weight_lr",
    "weight_update": "compression.QAT.plugin_config.quant_config.weight_update",
    "max_steps": "compression.QAT.hf_args.max_steps",
    "lr_scheduler_type": "compression.QAT.hf_args.lr_scheduler_type",
    "warmup_steps": "compression.QAT.hf_args.warmup_steps",
    "deepspeed": "compression.QAT.hf_args.deepspeed",
    "train_tokens_per_sample": "dataset.max_seq_length",
    "train_samples": "dataset.num_samples",
    "eval_windows": "evaluation.limit",
    "model_path": "model.model_path",
}


def sha256_of(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def baseline_ptq(path: str | Path, data: str, windows: int) -> dict[str, Any]:
    """The perplexity record (``data``'s) of another PTQ of the same model, evaluated on the same
    ``windows`` (an ``eval/ptq.json`` of the experiment without a PTQ helper: plain RTN against a
    SmoothQuant start); a ValueError naming the file where it is not comparable."""
    p = Path(path)
    rec = (json.loads(p.read_text()).get("ppl") or {}).get(data)
    if rec is None or rec.get("windows") != windows:
        raise ValueError(f"{p}: no {data!r} perplexity on {windows} windows; not the same evaluation")
    return rec


def experiment_record(
    exp_dir: str | Path, results: str | Path = "results", floor: float = TARGET, baseline: str | None = None
) -> dict[str, Any]:
    """One finished experiment's figures; ``baseline``: another PTQ's ``eval/ptq.json``
    (`baseline_ptq`) whose gap each row's recovery is also measured against, and the target reads."""
    exp = Path(exp_dir)
    config = load_yaml(exp / "config.yaml")
    evals = {v: json.loads((exp / f"eval/{v}.json").read_text()) for v in VARIANTS}
    data = next(iter(evals["bf16"]["ppl"]))
    ppl = {v: e["ppl"][data] for v, e in evals.items() if "skipped" not in e}
    base_ptq = baseline_ptq(baseline, data, ppl["bf16"]["windows"]) if baseline else None
    rows = []
    for v in ("qat", "export", "deployed"):
        if v not in ppl:
            rows.append({"variant": v, "skipped": evals[v].get("skipped")})
            continue
        nll = tuple(ppl[k]["window_nll"] for k in ("bf16", "ptq", v))
        bf16 = ppl["bf16"]["ppl"]
        rv = recovery(bf16, ppl["ptq"]["ppl"], ppl[v]["ppl"], min_gap=MIN_REL_GAP * bf16, nll=nll)
        rows.append(
            {
                "variant": v,
                "ppl": round(ppl[v]["ppl"], 4),
                "recovery": rounded(rv.value),  # the target compares it unrounded (`rounded`)
                "recovery_se": None if rv.se is None else round(rv.se, 4),
                "noise": rv.noise,
                "wall_s": evals[v].get("wall_s"),
            }
        )
        if evals[v].get("not_applied"):  # `qatlib.eval.variants.not_applied`: not the runtime's number
            rows[-1]["not_applied"] = evals[v]["not_applied"]
        if base_ptq is not None:
            nll = (ppl["bf16"]["window_nll"], base_ptq["window_nll"], ppl[v]["window_nll"])
            bv = recovery(bf16, base_ptq["ppl"], ppl[v]["ppl"], min_gap=MIN_REL_GAP * bf16, nll=nll)
            rows[-1]["baseline_recovery"] = rounded(bv.value)
            rows[-1]["baseline_recovery_se"] = None if bv.se is None else round(bv.se, 4)
    timings = {}
    for f in sorted((exp / "timings").glob("*.json")):
        timings[f.stem] = json.loads(f.read_text()).get("wall_s")
    base = Path(results) / "base" / Path(str(section(config, "model.model_path"))).name
    up = base / "upcycle_stats.json"
    upcycled = None
    if up.is_file():
        st = json.loads(up.read_text())
        upcycled = {
            "dense_ppl": round(st["dense"]["ppl"], 4),
            "initial_ppl": round(st["initial"]["ppl"], 4),
            "upcycled_ppl": round(st["upcycled"]["ppl"], 4),
            "ppl_ratio": st["ppl_ratio"],
            "eval_windows": st["upcycled"]["windows"],
            "router_training": {k: st["router_training"][k] for k in ("steps", "tokens", "seconds")},
            "expert_load": st.get("expert_load"),
            "params": st["params"],
            "spec": st["spec"],
        }
        shared = Path(results) / "timings" / f"base_model-{base.name}.json"
        if shared.is_file():
            timings[f"base_model-{base.name}"] = json.loads(shared.read_text()).get("wall_s")
    dep = next(r for r in rows if r["variant"] == "deployed")
    what, se = "the PTQ gap", dep.get("recovery_se")
    if base_ptq is not None:
        what, se = "the baseline PTQ's gap", dep.get("baseline_recovery_se")
    value = dep.get("recovery") if base_ptq is None else dep.get("baseline_recovery")
    return {
        "experiment": exp.name,
        "settings": {k: section(config, key) for k, key in SETTINGS.items()},
        "upcycled_base_model": upcycled,
        "ppl": {v: round(p["ppl"], 4) for v, p in ppl.items()},
        "eval_windows": ppl["bf16"]["windows"],
        "ptq_rel_gap": round(ppl["ptq"]["ppl"] / ppl["bf16"]["ppl"] - 1, 5),
        "baseline_ptq": None
        if base_ptq is None
        else {"source": str(baseline), "ppl": round(base_ptq["ppl"], 4), "sha256": sha256_of(baseline)},
        "rows": rows,
        "stage_wall_s": timings,
        "target": target(
            f"deployed recovery of {what} [{exp.name}]",
            value,
            floor,
            higher_is_better=True,
            note=f"SE {se}, PTQ gap {ppl['ptq']['ppl'] / ppl['bf16']['ppl'] - 1:+.2%}"
            + ("" if base_ptq is None else f"; of its own PTQ's gap {dep.get('recovery')}"),
        ),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("exp_dirs", nargs="+", help="finished results/<exp> folders")
    ap.add_argument("--results", default="results", help="the workflow's results folder (base models)")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--name", default="moe_experiment", help="the JSON's name (a renderer of qatlib.site)")
    ap.add_argument("--target", type=float, default=TARGET, help="the deployed recovery aimed at")
    ap.add_argument(
        "--baseline-ptq",
        default=None,
        help="another PTQ's eval/ptq.json on the same windows (plain RTN against a SmoothQuant start): "
        "each row's recovery of its gap too, which the targets read",
    )
    ap.add_argument(
        "--note",
        default=None,
        help="what a reader needs beside the numbers (the probes that chose the recipe, a model's history): "
        "recorded as the JSON's note, which the results page prints above the tables",
    )
    a = ap.parse_args(argv)
    try:
        exps = [experiment_record(d, a.results, a.target, a.baseline_ptq) for d in a.exp_dirs]
    except (OSError, ValueError) as e:
        ap.error(str(e))
    body = {"machine": machine(), "experiments": exps, "targets": [e["target"] for e in exps]}
    if a.note:
        body["note"] = a.note
    log(f"{a.name}: wrote {write_result(a.out, a.name, body)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
