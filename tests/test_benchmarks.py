"""Smoke tests of the benchmarks: the --quick path writes valid JSON, and the helpers compute what
they say. Nothing here asserts a timing (the machine is shared); the numbers are the benchmark's
output, not the test's business."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from benchmarks import common, pipeline, quality
from benchmarks.run import main


def _check_common(doc: dict, name: str) -> None:
    assert doc["benchmark"] == name
    assert "error" not in doc, doc.get("error")
    assert doc["quick"] is True
    m = doc["machine"]
    for key in ("cpu_count", "torch_threads", "date_utc", "load_avg_1m"):
        assert key in m
    assert (
        m["versions"]["torch"] == torch.__version__.split("+")[0]
        or m["versions"]["torch"] == torch.__version__
    )
    for pkg in ("transformers", "deepspeed", "compressed-tensors"):
        assert pkg in m["versions"]
    assert "commit" in m["git"]


def _report_renders(doc: dict, name: str) -> None:
    """The report builder renders benchmark JSON generically: it must accept ours."""
    from qatlib.report.blocks import json_tables

    blocks = json_tables(doc, f"{name}.json")
    assert blocks


def _quick(tmp_path, only: str) -> list[str]:
    """``--quick`` argv for ``only``, writing into ``tmp_path/bench`` (results from ``tmp_path/res``)."""
    out, res = str(tmp_path / "bench"), str(tmp_path / "res")
    return ["--quick", "--only", only, "--threads", "1", "--out", out, "--results", res]


def test_quick_speed_memory_pipeline(tmp_path):
    out = tmp_path / "bench"
    rc = main(_quick(tmp_path, "speed,memory,pipeline"))
    assert rc == 0
    for name in ("speed", "memory", "pipeline"):
        doc = json.loads((out / f"{name}.json").read_text())
        _check_common(doc, name)
        _report_renders(doc, name)
    speed = json.loads((out / "speed.json").read_text())
    assert {(r["format"], r["tokens_per_step"]) for r in speed["step"]} == {
        (f, n) for f in ("int4_g64_frozen", "fp8_static") for n in (16, 32)
    }
    assert all(r["qat_over_plain"] > 0 and math.isfinite(r["qat_over_plain"]) for r in speed["step"])
    assert speed["fake_quant"][0]["fraction_of_copy"] > 0
    assert all(t["met"] in (True, False) for t in speed["targets"])
    mem = json.loads((out / "memory.json").read_text())
    (kd,) = mem["kd_loss"]
    assert kd["tracker_chunked_peak_bytes"] > 0 and kd["tracker_full_peak_bytes"] > 0
    assert mem["zero3_load"]["status"] == "not run"  # no zero3_load.json in this folder
    pipe = json.loads((out / "pipeline.json").read_text())
    assert pipe["status"] == "not run" and pipe["missing_stages"]


@pytest.mark.slow
def test_quick_quality(tmp_path):
    out = tmp_path / "bench"
    assert main(_quick(tmp_path, "quality")) == 0
    doc = json.loads((out / "quality.json").read_text())
    _check_common(doc, "quality")
    _report_renders(doc, "quality")
    assert doc["eval_check"]["abs_diff"] < 1e-6 * doc["eval_check"]["qatlib_eval_perplexity"]
    fmts = {r["format"]: r for r in doc["formats"]}
    assert set(fmts) == {"fp8_static", "w4a8_fp8_g32"}
    assert (
        fmts["w4a8_fp8_g32"]["gptq_ppl"] is not None and fmts["fp8_static"]["gptq_ppl"] is not None
    )  # FP8 too
    for r in fmts.values():
        for key in ("bf16_ppl", "rtn_ppl", "qat_ppl", "rtn_weights_only_ppl", "rtn_inputs_only_ppl"):
            assert math.isfinite(r[key]) and r[key] > 1
        # each half of the format alone is another model than the whole and than the other half
        assert len({r["rtn_ppl"], r["rtn_weights_only_ppl"], r["rtn_inputs_only_ppl"], r["bf16_ppl"]}) == 4
    assert [r["variant"] for r in doc["ablation_kd_loss_equal_steps"]] == ["origin", "kl"]
    assert [r["lr"] for r in doc["ablation_lr_equal_steps"]] == [1e-4, 2e-4]
    assert len(doc["ablation_lwc_equal_steps"]) == 2 and len(doc["ablation_e2e_vs_blockwise_equal_wall"]) == 2
    two = doc["ablation_two_phase"]  # blockwise, then phase 2 at the main lr and at two_phase_lr
    assert [r["variant"].split(" (")[0] for r in two] == ["blockwise"] + ["blockwise + end-to-end"] * 2
    assert len(doc["ablation_norm_equal_steps"]) == 2
    assert "errors" not in doc
    for fmt in ("w4a8_fp8_g32", "fp8_static"):
        assert any(f"[{fmt}]" in t["target"] and t["met"] in (True, False) for t in doc["targets"])


def test_paired_ratio_and_interleaving():
    r = common.paired_ratio([2.0, 4.0, 6.0], [1.0, 2.0, 2.0])
    assert r["ratio"] == 2.0 and r["ratio_of_medians"] == 2.0 and r["rounds"] == 3
    calls = []
    t = common.interleaved(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=2, warmup=1
    )
    assert calls == ["a", "b", "a", "b", "b", "a"]  # warm-up, then the order rotates
    assert len(t["a"]) == len(t["b"]) == 2


def test_fused_prototype_matches_fake_quantize():
    """The proposal measured by the speed benchmark computes exactly what qatlib computes."""
    from benchmarks import speed
    from benchmarks.fused_prototype import check_fused
    from qatlib.quant.spec import Granularity, QuantSpec

    schemes = [common.format_scheme(n) for n in speed.FQ_FORMATS]
    specs = [s.weight for s in schemes] + [s.input for s in schemes if s.input]
    specs += [QuantSpec("int4", Granularity.GROUP, group_size=32, symmetric=False)]
    r = check_fused([sp for sp in specs if not sp.has_global_scale])  # the prototype has no NVFP4
    assert r["values_bit_exact"] and r["max_rel_grad_error"] < 1e-4


def test_fp4_rows_take_a_subset(capsys):
    """``--fp4 LIST``: some of the FP4 rows (e.g. upstream FOCUS's beside qatlib's W4A4), same settings."""
    with pytest.raises(SystemExit) as e:
        quality.main(["--fp4", "nvfp4,nvfp4_fokus", "--results", "/nonexistent"])
    assert e.value.code == 2 and "--fp4: unknown nvfp4_fokus" in capsys.readouterr().err


def test_formats_are_what_they_say():
    s = common.format_scheme("w4a8_fp8_g32")
    assert s.weight.qtype == "int4" and s.weight.group_size == 32 and s.weight.fp8_recast and s.input.is_fp8
    assert common.format_scheme("int4_ch").weight.granularity.value == "per-channel"
    assert common.format_scheme("int2_g32").weight.qtype == "int2"
    assert set(common.FORMATS) >= set(quality.QUALITY_FORMATS) | set(quality.FP4_FORMATS)
    # the default model's rows (#12): groups of 64 (128 does not divide SmolLM2's 576)
    assert set(common.FORMATS) >= set(quality.DEFAULT_FORMAT_ROWS.formats)
    s64, i3 = common.format_scheme("w4a8_fp8_g64"), common.format_scheme("int3_g64").weight
    assert (s64.weight.qtype, s64.weight.group_size, s64.input.is_fp8) == ("int4", 64, True)
    assert (i3.qtype, i3.group_size, i3.bits_per_element) == ("int3", 64, 3 + 16 / 64)
    # the FP4 rows (#14) at their storage bits: int4 g32 = NVFP4 = 4.5, int4 g16 = 5, MXFP4 = 4.25
    bits = {n: common.format_scheme(n).weight.bits_per_element for n in quality.FP4_FORMATS}
    assert bits == {
        "int4_g16": 5.0,
        "int4_g32": 4.5,
        "nvfp4_w4a16": 4.5,
        "nvfp4": 4.5,
        "mxfp4_w4a16": 4.25,
        "mxfp4": 4.25,
        "nvfp4_focus": 4.5,  # FOCUS's sub-group scales are folded into the codes: no storage
        "mxfp4_focus": 4.25,
    }
    assert common.format_scheme("nvfp4").input.dynamic and common.format_scheme("mxfp4_w4a16").input is None
    # upstream FOCUS (#41): qatlib's W4A4 rows plus sub-group scales (and MXFP4's ceil scale rule)
    nf, mf = common.format_scheme("nvfp4_focus"), common.format_scheme("mxfp4_focus")
    assert (
        nf.weight == common.format_scheme("nvfp4").weight.replace(subgroups=2)
        and nf.input.scale_rule.value != "ceil"
    )
    assert (mf.weight.subgroups, mf.weight.scale_rule.value, mf.input.scale_rule.value) == (4, "ceil", "ceil")
    with pytest.raises(KeyError):
        common.format_scheme("int5_g7")
    # the deployment rows' fp8_dynamic and the GPU check's groups of 128 are qatlib's presets
    from qatlib.quant import PRESETS

    assert common.format_scheme("fp8_dynamic") == PRESETS["fp8_dynamic"]
    w4a8 = common.format_scheme("w4a8_fp8_g128")
    assert w4a8.weight == PRESETS["w4a8_fp8"].weight.replace(group_size=128) and w4a8.input.is_fp8


def test_recovery_and_noise_flag():
    w = 50
    g = torch.Generator().manual_seed(0)
    base = 100 + torch.rand(w, generator=g, dtype=torch.float64)
    bf16 = {"ppl": 10.0, "_nll": base}
    ptq = {"ppl": 11.0, "_nll": base + 5.0 + 0.01 * torch.rand(w, generator=g, dtype=torch.float64)}
    qat = {"ppl": 10.2, "_nll": base + 1.0 + 0.01 * torch.rand(w, generator=g, dtype=torch.float64)}
    r = quality.recovery_record(bf16, ptq, qat)
    assert r["recovery"] == pytest.approx(0.8) and not r["noise"] and r["recovery_se"] < 0.01
    tiny = {"ppl": 10.01, "_nll": ptq["_nll"]}  # PTQ costs 0.1%: any recovery is noise
    assert quality.recovery_record(bf16, tiny, qat)["noise"]


def test_pipeline_reads_stage_timings(tmp_path):
    res = tmp_path / "results"
    (res / "timings").mkdir(parents=True)
    (res / "exp" / "timings").mkdir(parents=True)
    (res / "timings" / "corpus.json").write_text(json.dumps({"stage": "corpus", "wall_s": 30.0}))
    (res / "exp" / "timings" / "zero3_qat.json").write_text(
        json.dumps({"stage": "zero3_qat", "wall_s": 90.0})
    )
    (res / "exp" / "timings" / "ptq_calibrate.json").write_text("{not json")
    (res / "exp" / "timings" / "corpus.json").write_text(
        json.dumps({"stage": "corpus", "wall_s": 30.0})
    )  # a copy
    out = pipeline.run(results=str(res), experiment="exp")
    assert [r["stage"] for r in out["stages"]] == ["corpus", "ptq_calibrate", "zero3_qat"]
    assert out["total_wall_s"] == 120.0 and out["status"] == "partial"
    assert out["stages"][0]["share"] == 0.25 and "error" in out["stages"][1]
    assert "convert_export" in out["missing_stages"]
    assert len(out["duplicate_records_skipped"]) == 1


def test_pipeline_counts_only_the_experiments_shared_stages(tmp_path):
    """Shared records of other experiments (another base model) are not counted; the default
    experiment's base model and local task are expected."""
    res = tmp_path / "results"
    (res / "timings").mkdir(parents=True)
    for stem, wall in [
        ("corpus", 10.0),
        ("local_task-qat_local_mc", 1.0),
        ("base_model-tiny-qwen3-moe", 100.0),
        ("base_model-tiny-qwen3", 70.0),
    ]:
        (res / "timings" / f"{stem}.json").write_text(json.dumps({"stage": stem, "wall_s": wall}))
    out = pipeline.run(results=str(res), experiment="tiny-qwen3-moe")
    assert [r["stage"] for r in out["stages"]] == [
        "corpus",
        "local_task-qat_local_mc",
        "base_model-tiny-qwen3-moe",
    ]
    assert out["total_wall_s"] == 111.0
    assert "base_model-tiny-qwen3-moe" not in out["missing_stages"] and "zero3_qat" in out["missing_stages"]


def test_plain_scale_qat_trains_only_weight_scales_and_lowers_kl():
    """The --default-model comparison row (`quality_default.plain_scale_qat`): only the weight scales
    move, and forward KL to the teacher falls on the sample it trained on."""
    import copy

    import torch.nn.functional as F
    from conftest import VOCAB, build_model, tiny_qwen3_config

    from benchmarks.quality_default import plain_scale_qat
    from qatlib.ptq import calibrate

    teacher = build_model(tiny_qwen3_config(), seed=0).eval()
    student = copy.deepcopy(teacher)
    scheme = common.format_scheme("int2_g32")  # a coarse grid: a gap a few steps can close
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(1))
    calibrate(student, scheme, [ids], ignore=common.IGNORE)

    def kl() -> float:
        with torch.no_grad():
            t = F.log_softmax(teacher(input_ids=ids).logits, -1)[0]
            s = F.log_softmax(student(input_ids=ids).logits, -1)[0]
        return F.kl_div(s, t, log_target=True, reduction="batchmean").item()

    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    kl0 = kl()
    plain_scale_qat(student, teacher, [{"input_ids": ids[0].tolist()}], steps=8, lr=1e-3)
    moved = {n for n, p in student.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all(n.endswith("weight_quantizer.scale") for n in moved)
    assert kl() < 0.9 * kl0


def test_default_model_row_refuses_a_missing_base_model(tmp_path):
    from benchmarks import quality_default as qd

    with pytest.raises(FileNotFoundError, match="smollm2-135m.*gguf_model"):
        qd.run(qd.DefaultModelSettings(), results=str(tmp_path))
    assert common.format_scheme("int4_g64").weight.group_size == 64


def test_scale_lr_is_one_relative_lr_in_log_space_and_per_format_additive():
    """Log space: one relative lr for every format (E8M0 scales get theirs from the trainer,
    ``test_log_scale.py::test_e8m0_scales_get_their_own_lr_from_the_config``); an explicit lr wins;
    additive keeps the per-format absolute values."""
    from dataclasses import replace

    s = replace(quality.QualitySettings(), lr=0.011, fp8_lr=3e-6, nvfp4_lr=0.2, mxfp4_lr=4e-4)
    f = common.format_scheme
    for name in ("int4_g32", "nvfp4_w4a16", "nvfp4", "fp8_static", "mxfp4_w4a16", "mxfp4"):
        assert quality.scale_lr(s, f(name), "log", None) == 0.011, name
    assert quality.scale_lr(s, f("mxfp4_w4a16"), "log", 0.003) == 0.003
    assert quality.scale_lr(s, f("mxfp4_w4a16"), "additive", None) == 4e-4
    assert quality.scale_lr(s, f("nvfp4_w4a16"), "additive", None) == 0.2
    assert quality.scale_lr(s, f("fp8_static"), "additive", None) == 3e-6
    assert quality.scale_lr(s, f("int4_g32"), "additive", None) == 0.011


def test_blockwise_rows_refuse_an_unknown_deploy_target():
    """A misspelled target would train untied (`qatlib.quant.tying` ignores unknown targets) and
    label the rows as tied: refused when the settings are built, before any training."""
    from benchmarks.quality_default import BlockwiseRows

    assert BlockwiseRows(deploy_target="vllm").deploy_target == "vllm"
    with pytest.raises(ValueError, match=r"deploy_target 'vlm': one of none, vllm"):
        BlockwiseRows(deploy_target="vlm")
    assert BlockwiseRows(phase2_deploy_target="sglang").phase2_deploy_target == "sglang"
    with pytest.raises(ValueError, match=r"phase2_deploy_target 'vlm': one of none, vllm"):
        BlockwiseRows(phase2_deploy_target="vlm")
    # phase 2's tying starts from an untied phase 1; both set would tie twice under two labels
    with pytest.raises(ValueError, match="phase2_deploy_target ties phase 1's untied model"):
        BlockwiseRows(deploy_target="vllm", phase2_deploy_target="vllm")


def test_evaluator_keeps_each_windows_nll_sum_exactly(tmp_path):
    """`benchmarks.lab.Evaluator` scores with `qatlib.eval.perplexity` and rebuilds each window's
    summed NLL from qatlib's per-token mean: bit for bit the fp32 sums of a direct loop over the
    same batches, so the perplexity and the paired statistics are the numbers they were."""
    from dataclasses import replace

    import torch.nn.functional as F
    from conftest import VOCAB, build_model, tiny_qwen3_config

    from benchmarks.lab import Evaluator

    model = build_model(tiny_qwen3_config(), seed=0)
    s = replace(quality.QUICK, seq_len=16, eval_windows=6, eval_batch=4)
    text = "".join(chr(97 + (i * 7919) % 26) for i in range(16 * 9))

    def tok(t, **_):
        return {"input_ids": [ord(c) % VOCAB for c in t]}

    ev = Evaluator(tok, text, s, None, tmp_path)
    rec = ev(model, mc=False)
    direct = []
    with torch.no_grad():
        for i in range(0, ev.windows.shape[0], s.eval_batch):
            b = ev.windows[i : i + s.eval_batch]
            logits = model(input_ids=b, use_cache=False).logits
            direct += [
                F.cross_entropy(logits[r, :-1].float(), b[r, 1:], reduction="sum").item()
                for r in range(len(b))
            ]
    direct = torch.tensor(direct, dtype=torch.float64)
    tokens = ev.windows.shape[0] * (s.seq_len - 1)
    assert torch.equal(rec["_nll"], direct) and rec["tokens"] == tokens
    assert rec["ppl"] == math.exp(direct.sum().item() / tokens) == rec["_qatlib_ppl"]
    # the rebuild is exact for any fp32 sum: x / t * t is within 2^-52 of x, fp32's spacing 2^-24
    x = (torch.rand(10_000, generator=torch.Generator().manual_seed(0)) * 4000).double()
    assert torch.equal(
        (torch.tensor([v / 255 for v in x.tolist()], dtype=torch.float64) * 255).float().double(), x
    )


def test_tensor_bytes_reads_the_headers(tmp_path):
    from safetensors.torch import save_file

    save_file(
        {"a": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16)},
        str(tmp_path / "model.safetensors"),
    )
    assert common.tensor_bytes(tmp_path) == {"a": 48, "b": 10}


def test_no_import_cycle_and_no_long_module_in_benchmarks(monkeypatch):
    """The benchmarks import one way (grimp reads every import statement, function-local ones
    included): common <- lab_inputs <- lab <- quality_default <- quality, deployed; each question's
    module at most 600 lines."""
    import grimp

    repo = Path(__file__).resolve().parents[1]
    monkeypatch.syspath_prepend(str(repo))
    g = grimp.build_graph("benchmarks", cache_dir=None)
    mods = sorted(g.modules)
    both_ways = [
        (a, b)
        for i, a in enumerate(mods)
        for b in mods[i + 1 :]
        if g.chain_exists(a, b) and g.chain_exists(b, a)
    ]
    assert both_ways == []
    assert g.chain_exists("benchmarks.quality", "benchmarks.lab")  # the graph is the real one
    long = {
        p.name: n for p in (repo / "benchmarks").glob("*.py") if (n := len(p.read_text().splitlines())) > 600
    }
    assert long == {}


def test_fused_prototype_takes_what_fake_quantize_takes():
    """The prototype stands in for `fake_quantize` in the speed benchmark: the same keywords (a
    keyword qatlib adds, like FOCUS's ``subgroup_scale``, must reach it)."""
    import inspect

    from benchmarks.fused_prototype import fused_fake_quantize
    from qatlib.quant.functional import fake_quantize

    assert list(inspect.signature(fused_fake_quantize).parameters) == list(
        inspect.signature(fake_quantize).parameters
    )


def test_an_experiment_record_against_a_baseline_ptq(tmp_path):
    """`benchmarks.moe_experiment` with ``--baseline-ptq``: each row's recovery of the other PTQ's
    gap, on the same windows, computed here by hand in perplexity space; a baseline evaluated on
    other windows is refused naming its file."""
    from benchmarks import moe_experiment

    exp = tmp_path / "exp"
    (exp / "eval").mkdir(parents=True)
    (exp / "config.yaml").write_text("model:\n  model_path: results/base/m\n")

    def ev(nll: float, windows: int = 2) -> dict:
        rec = {"ppl": math.exp(nll), "nll": nll, "window_nll": [nll] * windows, "windows": windows}
        return {"ppl": {"corpus/test": rec}, "wall_s": 1.0}

    for v, nll in {"bf16": 1.0, "ptq": 1.8, "qat": 1.5, "export": 1.5, "deployed": 1.5}.items():
        (exp / f"eval/{v}.json").write_text(json.dumps(ev(nll)))
    (tmp_path / "plain.json").write_text(json.dumps(ev(2.0)))
    rec = moe_experiment.experiment_record(exp, tmp_path, 0.6, str(tmp_path / "plain.json"))
    dep = next(r for r in rec["rows"] if r["variant"] == "deployed")
    e = math.e
    assert dep["baseline_recovery"] == round((e**2 - e**1.5) / (e**2 - e), 4)  # 0.6224
    assert dep["recovery"] == round((e**1.8 - e**1.5) / (e**1.8 - e), 4)
    assert rec["baseline_ptq"]["ppl"] == round(e**2, 4)
    assert rec["target"]["value"] == pytest.approx((e**2 - e**1.5) / (e**2 - e), rel=1e-12)
    assert rec["target"]["met"] is True
    assert "baseline PTQ's gap" in rec["target"]["target"]
    (tmp_path / "other.json").write_text(json.dumps(ev(2.0, windows=3)))
    with pytest.raises(ValueError, match="other.json: no 'corpus/test' perplexity on 2 windows"):
        moe_experiment.experiment_record(exp, tmp_path, 0.6, str(tmp_path / "other.json"))

    # the target compares the unrounded recovery: 0.470665... is recorded as 0.4707, and does not
    # reach a floor of 0.47067
    own = moe_experiment.experiment_record(exp, tmp_path, 0.47067)
    assert next(r for r in own["rows"] if r["variant"] == "deployed")["recovery"] == 0.4707
    assert own["target"]["met"] is False and own["target"]["value"] == pytest.approx(0.4706654, abs=1e-7)
    assert moe_experiment.experiment_record(exp, tmp_path, 0.47066)["target"]["met"] is True

    # the CLI: the note recorded beside the experiments, where the results page reads it
    argv = [str(exp), "--results", str(tmp_path), "--out", str(tmp_path / "bench"), "--name", "x"]
    assert moe_experiment.main([*argv, "--note", "chosen by a probe"]) == 0
    doc = json.loads((tmp_path / "bench" / "x.json").read_text())
    assert doc["note"] == "chosen by a probe" and doc["experiments"][0]["ppl"]["ptq"] == round(e**1.8, 4)
    assert moe_experiment.main(argv) == 0
    assert "note" not in json.loads((tmp_path / "bench" / "x.json").read_text())

    # what the export variant's reload left unused rides on its row (and the results page prints it)
    from qatlib.scores import not_applied
    from qatlib.site.results import Result
    from qatlib.site.results import moe_experiment as page

    assert all("not_applied" not in r for r in own["rows"])
    na = not_applied([f"model.layers.1.mlp.experts.{i}.down_proj.input_scale" for i in range(4)])
    d = json.loads((exp / "eval/export.json").read_text())
    (exp / "eval/export.json").write_text(json.dumps({**d, "not_applied": na}))
    rec = moe_experiment.experiment_record(exp, tmp_path, 0.6)
    assert [r["variant"] for r in rec["rows"] if r.get("not_applied") == na] == ["export"]
    lines = page(Result(name="x", path="x.json", doc={"experiments": [rec], "targets": []}))
    assert (
        "export: transformers left 4 checkpoint tensors unused (4 input_scale): " + na["why"] + "." in lines
    )


def test_git_state_leaves_the_benchmarks_own_output_out_of_the_changes(tmp_path):
    """A multi-row benchmark rewrites its JSON after each row: that file is not a change the run
    used, so the record of a clean tree must not read dirty because of it."""
    import subprocess

    def git(*a):
        subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "bench.json").write_text("{}\n")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    (tmp_path / "out" / "bench.json").write_text('{"rows": 1}\n')
    assert common.git_state(tmp_path)["changed_files"] == 1
    clean = common.git_state(tmp_path, exclude=[tmp_path / "out" / "bench.json"])
    assert clean["dirty"] is False and clean["changed_files"] == 0
    (tmp_path / "code.py").write_text("x = 2\n")  # a real change still counts
    (tmp_path / "new.py").write_text("y = 1\n")  # and an untracked file
    assert common.git_state(tmp_path, exclude=[tmp_path / "out" / "bench.json"])["changed_files"] == 2


def test_served_benchmark_gain_bounds_and_page(tmp_path):
    """`benchmarks.served` on a finished experiment's records (written here): QAT's gain as served is
    the paired mean of served - served_ptq window NLL (windows 2.0/2.2/2.4 vs 2.1/2.2/2.6: -0.1 mean,
    SE sqrt(var([-0.1, 0, -0.2]) / 3) = 0.0577); the bound of an fp32 served export is the larger of
    its floor and 2x the emulator's own 1e-7 noise; a mean difference over 3 SE is a systematic one;
    a bf16-served export has no systematic check. The results page renders the table."""
    from benchmarks import served as sv
    from qatlib.site.page import render_page
    from qatlib.site.results import Result

    exp = tmp_path / "exp-w8a8"
    (exp / "eval").mkdir(parents=True)
    (exp / "config.yaml").write_text(
        "compression:\n  quantization:\n    name: w8a8\nevaluation:\n  limit: 3\n  max_seq_length: 8\n"
    )

    def ppl(nll):
        return {"d": {"ppl": math.exp(sum(nll) / len(nll)), "nll": sum(nll) / len(nll), "window_nll": nll}}

    for v, nll in {"bf16": [1.9, 2.0, 2.1], "ptq": [2.1, 2.2, 2.6], "qat": [2.0, 2.2, 2.4]}.items():
        (exp / "eval" / f"{v}.json").write_text(json.dumps({"variant": v, "ppl": ppl(nll)}))
    (exp / "eval" / "deployed.json").write_text(
        json.dumps({"variant": "deployed", "ppl": ppl([2.0, 2.2, 2.4])})
    )

    def served(v, nll, emulated, noise, dtype="float32"):
        diff = [a - b for a, b in zip(nll, emulated)]
        mean = sum(diff) / 3
        se = math.sqrt(sum((d - mean) ** 2 for d in diff) / 2 / 3)
        emu = {"ppl": 1.0, "window_nll": emulated, "max_abs_dnll": max(map(abs, diff))}
        emu.update(
            mean_abs_dnll=sum(map(abs, diff)) / 3, mean_dnll=mean, mean_dnll_se=se, noise_max_abs_dnll=noise
        )
        rec = {"variant": v, "ppl": ppl(nll), "dtype": dtype, "label": "vLLM", "engine": {"isa": "avx2"}}
        rec["emulated"] = {"int8_gemm": "exact", "dtype": "float32", "ppl": {"d": emu}}
        (exp / "eval" / f"{v}.json").write_text(json.dumps(rec))

    served("served_ptq", [2.1, 2.2, 2.6], [2.1, 2.2, 2.6], 0.001)  # identical: within, no systematic
    served("served", [2.0, 2.2, 2.4], [1.99, 2.19, 2.38], 0.004)  # +0.0133 mean, SE 0.0033: systematic
    rec = sv.experiment_record(exp)
    g = rec["qat_gain_served"]
    assert g["mean_nll_delta"] == pytest.approx(-0.1) and g["mean_nll_delta_se"] == pytest.approx(
        0.057735, abs=1e-6
    )
    assert g["better"] is False  # -0.1 + 2 x 0.0577 > 0: not separated from the windows' noise
    q = rec["served"]["emulated"]
    assert q["bound"] == max(sv.BOUNDS["float32"], 2 * 0.004) == 0.008 and q["max_abs_dnll"] == pytest.approx(
        0.02
    )
    assert q["within"] is False and q["no_systematic_difference"] is False
    p = rec["served_ptq"]["emulated"]
    assert (
        p["within"] is True and p["bound"] == sv.BOUNDS["float32"] and p["no_systematic_difference"] is True
    )
    served("served", [2.0, 2.2, 2.4], [1.99, 2.21, 2.40], 0.004, dtype="bfloat16")
    q = sv.experiment_record(exp)["served"]["emulated"]
    assert (
        q["bound"] == sv.BOUNDS["bfloat16"] and q["within"] is True and q["no_systematic_difference"] is None
    )
    doc = {"experiments": [rec], "targets": sv.targets([rec], []), "isa_capped": []}
    assert [t["met"] for t in doc["targets"]] == [True, True, False, False, True]
    page = render_page([Result(name="served", path="results/bench/served.json", doc=doc)])
    assert "## Served by vLLM's engine, per format" in page and "| `exp-w8a8` (w8a8) |" in page
    assert "-0.1000 ± 0.0577 (not separated)" in page and "OVER 0.008" in page


def test_speed_quick_plain_step_is_the_model_and_gbps_is_bytes_over_time():
    """`benchmarks.speed.run` in its quick mode on a tiny model: the record's structure, the
    ``plain`` trainer step computes the unprepared model's logits bit for bit (its LM loss equals
    cross-entropy computed here from the unprepared model), and each fake-quant GB/s is the weight
    bytes over the recorded median time of that op."""
    from dataclasses import replace

    from benchmarks import speed

    tiny = speed.tiny_model()
    s = replace(speed.QUICK, tokens=(32,), repeats=1, fq_formats=("int4_g64",), fq_repeats=1, wgrad=False)
    out = speed.run(s, models={"tiny": (tiny, "test model")})
    (r1, r2) = out["step"]
    assert {r1["format"], r2["format"]} == {"int4_g64_frozen", "fp8_static"}
    for r in out["step"]:
        assert r["tokens_per_step"] == 32 and r["batch"] * r["seq"] == 32 and r["rounds"] == 1
        assert r["min"] <= r["qat_over_plain"] <= r["max"]
    assert out["step"][0]["frozen_codes"] is True
    chk = out["plain_check"]
    assert chk["logits_bit_equal"] and chk["loss_bit_equal"]
    gen = torch.Generator().manual_seed(s.seed)
    x = torch.randint(0, tiny.config.vocab_size, (2, s.seq), generator=gen)
    with torch.no_grad():
        logits = tiny(input_ids=x).logits
    ref = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)
    )
    assert chk["prepared_off_lm_loss"] == pytest.approx(ref.item(), rel=1e-6)
    (fq,) = out["fake_quant"]
    assert fq["weight_bytes"] == s.fq_size**2 * 4
    assert fq["fake_quant_GBps"] == round(fq["weight_bytes"] / fq["fake_quant_s"] / 1e9, 3)
    assert fq["copy_GBps"] == round(fq["weight_bytes"] / fq["copy_s"] / 1e9, 3)
    assert fq["fraction_of_copy"] == pytest.approx(fq["copy_s"] / fq["fake_quant_s"], rel=1e-3)
    for t in out["targets"]:
        assert {"name", "value", "bound", "met"} <= set(t) and (t["met"] or t["reason"])
    from qatlib.site.results import Result
    from qatlib.site.speed import speed as render

    lines = render(Result("speed", "results/bench/speed.json", out))
    assert any("`int4_g64_frozen`" in line for line in lines)
