"""The engine's throughput job (`qatlib.serve.serve_throughputs`, the worker's ``"kind":
"throughput"``) on a tiny Llama (tests/test_serve.py's: hidden 128, one layer, head_dim 32) served
in bf16 and its W8A8-INT8 dynamic export, in ONE worker: the facts the benchmark
(`benchmarks.serve_speed`) reads are real (the generated token count is what was asked, the rates
come from measured times, the kernel is the format's), not how fast they are (no timing thresholds).
~40 s: vLLM imported once, two engine starts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import build_model, tiny_llama_config

from qatlib.export import export
from qatlib.ptq import calibrate
from qatlib.quant import preset
from qatlib.serve import ServeError, serve_python
from qatlib.serve.engine import ThroughputJob, serve_throughputs

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CONFIG = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
)
SIZES = dict(prompt_len=32, prompts=4, decode_prompts=3, decode_tokens=5, repeats=2)


@pytest.fixture(scope="module")
def timed(tmp_path_factory):
    try:
        serve_python()
    except ServeError as e:  # in CI a skip fails the run (conftest): install.sh makes the env
        pytest.skip(f"the serving environment is missing, so vLLM's engine cannot run here: {e}")
    root = tmp_path_factory.mktemp("speed")
    build_model(tiny_llama_config(**CONFIG)).to(torch.bfloat16).save_pretrained(root / "bf16")
    model = build_model(tiny_llama_config(**CONFIG))
    g = torch.Generator().manual_seed(1)
    rep = calibrate(model, preset("int8"), [torch.randint(0, 512, (2, 32), generator=g)])
    export(model, rep.scheme, root / "int8", "real")
    jobs = [ThroughputJob(root / name, **SIZES) for name in ("bf16", "int8")]
    record = serve_throughputs(jobs)
    return root, record


@pytest.mark.slow
def test_throughput_counts_rates_and_kernels(timed):
    root, record = timed
    engine = record["engine"]
    assert engine["vllm_version"] and engine["isa"] and engine["peak_rss_bytes"] > 100 << 20
    bf16, int8 = record["models"]
    for res in (bf16, int8):
        keys = ("prompt_tok_s", "decode_tok_s", "peak_rss_bytes", "rss_before_bytes", "rss_loaded_bytes")
        print(Path(res["model_dir"]).name, res["weight_bytes_disk"], {k: round(res[k]) for k in keys})
    n, p, m, d, r = (
        SIZES[k] for k in ("prompts", "prompt_len", "decode_prompts", "decode_tokens", "repeats")
    )
    for res, name in ((bf16, "bf16"), (int8, "int8")):
        assert res["kind"] == "throughput" and res["model_dir"] == str((root / name).resolve())
        assert res["dtype"] == "bfloat16"
        # every decode request generated exactly decode_tokens (ignore_eos), in every round
        assert res["generated_tokens"] == [m * d] * r
        assert res["prompt_tokens"] == n * p
        assert all(len(res["times_s"][k]) == r for k in ("prefill", "decode_total", "decode_prefill"))
        # the rates are the counts over the medians of the measured times
        assert res["prompt_tok_s"] == pytest.approx(n * p / res["prefill_s"])
        assert res["decode_s"] == pytest.approx(res["decode_total_s"] - res["decode_prefill_s"])
        assert res["decode_s"] > 0 and res["decode_tok_s"] == pytest.approx(m * (d - 1) / res["decode_s"])
        # the fastest round's rates: from the smallest time of each phase
        assert res["best_prompt_tok_s"] == pytest.approx(n * p / min(res["times_s"]["prefill"]))
        assert res["best_prompt_tok_s"] >= res["prompt_tok_s"] and res["best_decode_tok_s"] > 0
        assert res["peak_rss_bytes"] >= res["rss_before_bytes"] > 0
        disk = sum(f.stat().st_size for f in (root / name).glob("*.safetensors"))
        assert res["weight_bytes_disk"] == disk > 0
        assert res["start_s"] > 0
    assert bf16["kernels"] == [] and bf16["linears"] == {}
    # qkv, o, gate_up, down quantized (the tied lm_head / embeddings are not)
    assert len(int8["linears"]) == 4
    if engine["device"] == "cpu":
        assert int8["kernels"] == ["CPUInt8ScaledMMLinearKernel"]
    # the export is smaller on disk than the bf16 model (int8 codes, though its embeddings stay fp32)
    assert int8["weight_bytes_disk"] < bf16["weight_bytes_disk"]
    for res in (bf16, int8):
        assert res["peak_rss_bytes"] >= res["rss_loaded_bytes"] > 0


def test_throughput_job_spec(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    spec = ThroughputJob(tmp_path, **SIZES).spec()
    assert spec["kind"] == "throughput" and spec["dtype"] == "bfloat16" and "windows" not in spec
    assert spec["model_dir"] == str(Path(tmp_path).resolve()) and spec["decode_tokens"] == 5
    with pytest.raises(ValueError, match="decode_tokens >= 2"):
        ThroughputJob(tmp_path, decode_tokens=1).spec()
    with pytest.raises(ServeError) as err:
        ThroughputJob(tmp_path / "nothing").spec()
    assert err.value.kind == "bad_export"
