"""`benchmarks.quality_low_bits`: what each runtime does with 2 / 3-bit WNA16, and the targets of
#40's build 2 from a row table (the measured run is results/bench/quality_low_bits.json)."""

from __future__ import annotations

import json

import pytest

from benchmarks.common import format_scheme
from benchmarks.quality_low_bits import LowBitRows, runtimes_of, targets_of


@pytest.mark.parametrize("fmt", ["int3_g64", "int2_g64"])
def test_odd_bit_wna16_loads_on_vllm_and_not_on_sglang(fmt):
    scheme = format_scheme(fmt)
    assert scheme.weight.bits == int(fmt[3]) and scheme.weight.group_size == 64 and scheme.input is None
    rt = runtimes_of(scheme)
    assert rt["vllm"] == "loads (int2/3/5/6/7 weight only)"
    assert rt["sglang"].startswith("refused: WNA16 with 2/3/5/6/7 bits")


def _fmt(name, gptq_ppl, two):
    rows = [{"variant": "rtn", "ppl": 99.0, "recovery": 0.0, "recovery_se": 0.0}, two]
    return {"format": name, "gptq_ppl": gptq_ppl, "rows": rows}


def test_targets_read_the_named_rows_loss_recovery_as_deployed():
    """int3 reads the two-phase row, int2 the end-to-end one (`LowBitRows.targets`); the value is
    the recovery of RTN's test loss, deployed where there is a deployed figure."""
    two3 = {"variant": "two-phase: x", "ppl": 30.0, "recovery": 0.95, "recovery_se": 0.01}
    two3 |= {"loss_recovery": 0.9, "loss_recovery_se": 0.01, "deployed_ppl": 30.5}
    two3 |= {"deployed_recovery": 0.93, "deployed_loss_recovery": 0.84, "deployed_loss_recovery_se": 0.02}
    e2e2 = {"variant": "end-to-end (x)", "ppl": 80.0, "recovery": 0.99, "recovery_se": 0.03}
    e2e2 |= {"loss_recovery": 0.61, "loss_recovery_se": 0.03}
    # a two-phase int2 row better than the end-to-end one: not the row the int2 target names
    two2 = {
        "variant": "two-phase: x",
        "ppl": 70.0,
        "recovery": 0.99,
        "loss_recovery": 0.2,
        "loss_recovery_se": 0.0,
    }
    int2_rows = _fmt("int2_g64", None, e2e2)
    int2_rows["rows"].append(two2)
    tg = targets_of(LowBitRows(), [_fmt("int3_g64", 31.0, two3), int2_rows])
    by = {t["target"]: t for t in tg}
    int3 = by["two-phase recovery of RTN's test loss (log-perplexity), as deployed [int3_g64] >= 0.85"]
    assert int3["value"] == 0.84 and int3["met"] is False  # deployed, not trained (0.90)
    assert int3["note"] == "SE 0.02; as trained 0.9; in perplexity 0.93"
    assert by["GPTQ perplexity minus two-phase's, as deployed [int3_g64] >= 0.0"]["value"] == 0.5
    int2 = by["end-to-end recovery of RTN's test loss (log-perplexity), as trained [int2_g64] >= 0.6"]
    assert int2["value"] == 0.61 and int2["met"] is True  # no deployed figure: as trained
    assert len(tg) == 3  # no GPTQ row for int2 here: no comparison


def test_loss_recovery_is_the_ratio_of_mean_losses_with_its_paired_error():
    """Two windows of 4 tokens; per-token losses BF16 (1, 2), RTN (5, 6), x (3, 3): mean losses 1.5,
    5.5, 3.0, so the loss recovery is (5.5 - 3) / (5.5 - 1.5) = 0.625, while the perplexity ratio
    says (e^5.5 - e^3) / (e^5.5 - e^1.5) = 0.935. Paired SE over the windows' summed losses: RTN - x
    (8, 12), RTN - BF16 (16, 16); residuals (8 - 10, 12 - 10) = (-2, 2), sd 2 sqrt 2, so
    2 sqrt 2 / sqrt 2 / 16 = 0.125."""
    import math

    import torch

    from benchmarks.common import exact
    from benchmarks.lab import loss_recovery_record, recovery_record

    def ev(per_token):
        nll = torch.tensor(per_token, dtype=torch.float64) * 4
        mean = sum(per_token) / 2
        return {"_nll": nll, "nll": mean, "ppl": math.exp(mean)}

    bf16, rtn, x = ev([1.0, 2.0]), ev([5.0, 6.0]), ev([3.0, 3.0])
    rec = loss_recovery_record(bf16, rtn, x)
    assert exact(rec["loss_recovery"]) == pytest.approx(0.625, abs=1e-12)
    assert exact(rec["loss_recovery_se"]) == pytest.approx(0.125, abs=1e-12)
    e = math.exp
    ppl_rec = (e(5.5) - e(3.0)) / (e(5.5) - e(1.5))
    assert exact(recovery_record(bf16, rtn, x)["recovery"]) == pytest.approx(ppl_rec, abs=1e-12)
    assert round(ppl_rec, 3) == 0.935


def test_keep_takes_the_other_formats_of_a_run_with_the_same_settings(tmp_path):
    from dataclasses import asdict, replace

    from benchmarks.quality_low_bits import kept_formats

    path = tmp_path / "quality_low_bits.json"
    assert kept_formats(path, LowBitRows()) == []  # no JSON yet: nothing kept
    int3 = _fmt("int3_g64", 31.0, {"variant": "two-phase: x"})
    int2 = _fmt("int2_g64", None, {"variant": "two-phase: x"})
    path.write_text(json.dumps({"settings": asdict(LowBitRows()), "formats": [int3, int2]}))
    only2 = replace(LowBitRows(), formats=("int2_g64",))
    assert kept_formats(path, only2) == [int3]  # the re-measured format is not kept
    with pytest.raises(ValueError, match=r"quality_low_bits.json: settings.steps is 100, this run's is 60"):
        kept_formats(path, replace(only2, steps=60))  # another budget: not rows of one table
    path.write_text('{"settings": ')  # truncated: the error names the file
    with pytest.raises(ValueError, match=r"quality_low_bits.json: not a benchmark JSON"):
        kept_formats(path, only2)


def test_deployed_minus_trained_is_the_paired_loss_difference_per_token():
    """Two windows of 4 tokens: per-token losses trained (2, 3), deployed (2.5, 3.1): differences
    0.5 and 0.1, mean 0.3; paired SE = sd(0.5, 0.1) / sqrt(2) = 0.2828.. / 1.4142.. = 0.2."""
    import torch

    from benchmarks.quality_low_bits import deployed_minus_trained

    def rec(per_token):
        nll = torch.tensor(per_token, dtype=torch.float64) * 4  # the lab's summed NLL per window
        return {"_nll": nll, "nll": sum(per_token) / 2, "tokens": 8, "windows": 2}

    out = deployed_minus_trained(rec([2.5, 3.1]), rec([2.0, 3.0]))
    assert out["deployed_minus_trained_nll"] == pytest.approx(0.3, abs=1e-6)
    assert out["deployed_minus_trained_nll_se"] == pytest.approx(0.2, abs=1e-6)


def test_results_headline_shows_the_row_each_target_reads():
    """The README's line per format: the row its target names (int2: end-to-end, not the two-phase
    row before it) and that row's test-loss recovery as deployed."""
    from qatlib.site.results import Result, quality_low_bits_headline

    e2e = {"variant": "end-to-end (x)", "ppl": 50.0, "recovery": 0.99, "loss_recovery": 0.7}
    e2e |= {"deployed_ppl": 51.0, "deployed_loss_recovery": 0.65, "deployed_loss_recovery_se": 0.02}
    two = {
        "variant": "two-phase: x",
        "ppl": 40.0,
        "recovery": 0.97,
        "loss_recovery": 0.3,
        "loss_recovery_se": 0.1,
    }
    formats = [{"format": "int2_g64", "gptq_ppl": 99.0, "rows": [two, e2e]}]
    doc = {"settings": {"targets": [["int2_g64", 0.6, "end-to-end"]]}, "formats": formats}
    title, line = quality_low_bits_headline(Result("quality_low_bits", "x.json", doc))
    assert title.endswith("recovery of RTN's test-loss (log-perplexity) gap, as deployed")
    assert line == "int2_g64: end-to-end 0.650 ± 0.020 (GPTQ 99.000 vs 51.000 PPL)"
