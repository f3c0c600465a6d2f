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


def test_targets_read_the_two_phase_row_as_deployed():
    two3 = {"variant": "two-phase: x", "ppl": 30.0, "recovery": 0.9, "recovery_se": 0.01}
    two3 |= {"deployed_ppl": 30.5, "deployed_recovery": 0.84, "deployed_recovery_se": 0.02}
    two2 = {"variant": "two-phase: x", "ppl": 80.0, "recovery": 0.61, "recovery_se": 0.03}
    tg = targets_of(LowBitRows(), [_fmt("int3_g64", 31.0, two3), _fmt("int2_g64", None, two2)])
    by = {t["target"]: t for t in tg}
    int3 = by["two-phase recovery of RTN's loss, as deployed [int3_g64] >= 0.85"]
    assert int3["value"] == 0.84 and int3["met"] is False  # deployed, not trained (0.90)
    assert by["GPTQ perplexity minus two-phase's, as deployed [int3_g64] >= 0.0"]["value"] == 0.5
    int2 = by["two-phase recovery of RTN's loss, as deployed [int2_g64] >= 0.6"]
    assert int2["value"] == 0.61 and int2["met"] is True  # no deployed figure: as trained
    assert len(tg) == 3  # no GPTQ row for int2 here: no comparison


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
