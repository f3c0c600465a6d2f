"""GPT-OSS (transformers' ``gpt_oss``: fused experts transposed ``gate_up_proj [E, H, 2I]`` with
interleaved gate / up columns, ``down_proj [E, I, H]``, per-expert biases) through qatlib's
streamed readers: the single-process streamed load, the 2-rank ZeRO-3 load and the streamed
PTQ / export read its checkpoint exactly as ``from_pretrained`` + qatlib's linearisation holds it;
each fused tensor is read once and sliced by `qatlib.surgery.moe.expert_slices`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, one_thread, stage_inputs, torchrun
from safetensors.torch import load_file

from qatlib.checkpoint import safetensors as st
from qatlib.checkpoint.layout import weight_files
from qatlib.runtime import oracle  # sets VLLM_TARGET_DEVICE=cpu before vLLM is imported
from qatlib.surgery.moe import LinearizedMoeExperts, linearize_moe_experts
from qatlib.zero3 import load as zl

ROOT = Path(__file__).resolve().parents[1]
DS_TEST = ROOT / "config" / "deepspeed" / "zero3_cpu_test.json"
EXPS = ROOT / "config" / "experiments"
# hidden 40, odd expert width 21 (gate_up 42 interleaved columns), 4 experts, 2 layers
SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=40,
    intermediate_size=21,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_local_experts=4,
    num_experts_per_tok=2,
    layer_types=["sliding_attention", "full_attention"],
    sliding_window=8,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)


def gpt_oss_config(**kw):
    from transformers import GptOssConfig

    return GptOssConfig(**{**SIZES, **kw})


def reference(model_dir: Path) -> dict[str, torch.Tensor]:
    """``from_pretrained`` + qatlib's linearisation (in memory): what every streamed path must hold."""
    from transformers import AutoModelForCausalLM

    with one_thread():
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    assert linearize_moe_experts(model) == 2
    return model.state_dict()


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Path:
    """A tiny random GPT-OSS as ``save_pretrained`` writes it (fused keys), sharded; expert weights
    and biases of unit scale, so a slice in the wrong place cannot hide."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(gpt_oss_config(), dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".experts." in n:
                p.normal_(0, 1)
    d = tmp_path_factory.mktemp("gpt_oss")
    model.save_pretrained(d, max_shard_size="60KB")
    keys = {k: v.shape for f in d.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert keys["model.layers.1.mlp.experts.gate_up_proj"] == (4, 40, 42)  # the fused, transposed layout
    assert keys["model.layers.1.mlp.experts.gate_up_proj_bias"] == (4, 42)
    assert keys["model.layers.0.mlp.experts.down_proj"] == (4, 21, 40)
    assert len(list(d.glob("*.safetensors"))) > 3
    return d


def test_streamed_load_is_from_pretrained_plus_linearisation_bit_for_bit(hub):
    """A model linearised empty (as ZeRO-3 and the skeleton build it: no refusal any more) and
    filled by the streamed reader equals ``from_pretrained`` + in-memory linearisation; each fused
    tensor is one plan entry (read once) fanning out to every expert's strided, transposed slice."""
    from transformers import AutoModelForCausalLM

    ref = reference(hub)
    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_config(gpt_oss_config(), dtype=torch.float32)
    assert linearize_moe_experts(model, copy_weights=False) == 2
    assert all(
        m.source_layout.interleaved and m.source_layout.transposed and m.source_layout.bias
        for m in model.modules()
        if isinstance(m, LinearizedMoeExperts)
    )
    plan = st.weight_plan(weight_files(hub), st.model_tensors(model), where="gpt_oss")
    gu = next(e for e in plan if e.info.key == "model.layers.1.mlp.experts.gate_up_proj")
    up2 = next(a for a in gu.assigns if a.target == "model.layers.1.mlp.experts.2.up_proj.weight")
    assert len(gu.assigns) == 8 and up2.src == (2, slice(None), slice(1, None, 2)) and up2.perm == (1, 0)
    zl.stream_load_weights(model, hub)
    got = model.state_dict()
    assert got.keys() == ref.keys()
    assert [k for k in ref if not torch.equal(got[k], ref[k])] == []
    # independent of qatlib's slicing: expert 3's up rows are the odd columns of the fused tensor
    fused = {k: v for f in weight_files(hub) for k, v in load_file(str(f)).items()}
    w = fused["model.layers.0.mlp.experts.gate_up_proj"][3]
    b = fused["model.layers.0.mlp.experts.gate_up_proj_bias"][3]
    for row in range(21):
        assert torch.equal(got["model.layers.0.mlp.experts.3.up_proj.weight"][row], w[:, 2 * row + 1])
        assert torch.equal(got["model.layers.0.mlp.experts.3.gate_proj.bias"][row], b[2 * row])
    assert torch.equal(got["model.layers.0.mlp.experts.1.down_proj.weight"],
                       fused["model.layers.0.mlp.experts.down_proj"][1].t())  # fmt: skip


def test_zero3_streamed_load_is_from_pretrained_bit_for_bit(hub, tmp_path):
    """The ZeRO-3 QAT's load (`qatlib.zero3.load.load_model`) on 2 gloo ranks, tensors above 4 KB
    sent partition by partition: every gathered parameter equals ``from_pretrained`` +
    linearisation."""
    out = tmp_path / "run"
    out.mkdir()
    spec = {"out": str(out), "ds_config": str(DS_TEST), "models": {"gpt_oss": str(hub)}, "chunk_bytes": 4096}
    proc, _ = torchrun(ROOT / "tests" / "zero3_workers" / "key_conversion.py", spec, tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ref = reference(hub)
    r = torch.load(out / "gpt_oss.pt", weights_only=False)
    assert all(x["partitioned"] for x in r["ranks"])
    got = {**r["params"], **{k: v for k, v in r["buffers"].items() if k in ref}}
    assert got.keys() == ref.keys()
    assert [k for k in ref if not torch.equal(got[k], ref[k])] == []


W8A8_INT8 = [
    "compression.quantization.name=int8",
    "compression.quantization.quant_method.weight=per-channel",
    "compression.QAT.plugin_config.quant_config.use_activation_quant=true",
]


def _same_dir(a: Path, b: Path) -> int:
    """The same files; safetensors byte for byte. Returns the tensors compared."""
    fa = sorted(str(p.relative_to(a)) for p in a.rglob("*.safetensors"))
    assert fa == sorted(str(p.relative_to(b)) for p in b.rglob("*.safetensors"))
    for f in fa:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    return sum(len(load_file(str(a / f))) for f in fa)


def test_streamed_ptq_and_export_equal_the_whole_model_paths(hub, tmp_path, tiny_tokenizer, single_thread):
    """PTQ (W8A8 int8, calibration carried layer to layer) and the real export read the fused
    checkpoint streamed (the records say so, no whole-model fallback) and write the same bytes as
    the whole-model paths (``from_pretrained`` + linearisation); the experts are quantized."""
    from qatlib.config import load_config
    from qatlib.pipeline import run_export, run_ptq

    # W8A8 int8 (channel weights, dynamic token inputs): what vLLM 0.33 loads for gpt_oss experts
    base, sets = stage_inputs(tmp_path, hub, tiny_tokenizer, W8A8_INT8)
    sets.append(f"compression.QAT.from_ptq_ckpt={tmp_path / 'ptq-whole'}")

    def cfg(out: str):
        return load_config(EXPS / "tiny-qwen3-moe.yaml", [*sets, f"global.save_path={tmp_path / out}"])

    assert run_ptq(cfg("ptq-stream"), progress=False)["streamed"] is True
    assert run_ptq(cfg("ptq-whole"), whole_model=True, progress=False)["streamed"] is False
    n = _same_dir(tmp_path / "ptq-whole", tmp_path / "ptq-stream")
    scales = load_file(str(tmp_path / "ptq-whole" / "scales.safetensors"))
    assert "model.layers.1.mlp.experts.3.up_proj.weight_scale" in scales and n == len(scales)
    qat = tmp_path / "qat"  # the base weights beside PTQ's scales, as a QAT checkpoint
    shutil.copytree(base, qat)
    for f in ("scales.safetensors", "quant_scheme.json"):
        shutil.copy(tmp_path / "ptq-whole" / f, qat)
    assert run_export(cfg("export-stream"), qat)["streamed"] is True
    assert run_export(cfg("export-whole"), qat, whole_model=True)["streamed"] is False
    assert _same_dir(tmp_path / "export-whole", tmp_path / "export-stream") > 0
    keys = {
        k: v for f in (tmp_path / "export-stream").glob("*.safetensors") for k, v in load_file(str(f)).items()
    }
    assert keys["model.layers.0.mlp.experts.2.gate_up_proj.weight"].dtype == torch.int8


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    out = torch.empty((2 * gate.shape[0], *gate.shape[1:]), dtype=gate.dtype)
    out[0::2], out[1::2] = gate, up  # GPT-OSS's gate_up_proj[..., ::2] / [..., 1::2], written by hand
    return out


@pytest.fixture(scope="module")
def exported(hub, tmp_path_factory):
    """The in-memory real export (int8 per-channel weights, dynamic per-token int8 inputs: what
    vLLM 0.33's gpt_oss loader takes per expert) of the prepared tiny GPT-OSS, and the model."""
    from transformers import AutoModelForCausalLM

    from qatlib.export import export
    from qatlib.quant import Granularity, QuantScheme, QuantSpec, prepare

    with one_thread():
        model = AutoModelForCausalLM.from_pretrained(str(hub), dtype=torch.float32)
    linearize_moe_experts(model)
    # W8A8 int8, per-channel weights, per-token dynamic inputs: vLLM 0.33's compressed-tensors MoE
    # method that creates GPT-OSS's expert biases (CompressedTensorsW8A8Int8MoEMethod; its fp8 one
    # has no biases)
    scheme = QuantScheme(
        "w8a8_int8_channel",
        weight=QuantSpec("int8", Granularity.CHANNEL),
        input=QuantSpec("int8", Granularity.TOKEN, dynamic=True),
    )
    prepare(model, scheme)
    out = tmp_path_factory.mktemp("export") / "real"
    export(model, scheme, out, "real")
    return model, out


def test_export_writes_each_expert_as_vllm_reads_it(exported):
    """transformers 5.24 cannot reload it (see `qatlib.export.coverage`); each expert is ``experts.<e>.gate_up_proj`` (gate / up interleaved, transposed ``[H, 2I]``,
    scales alike, bias interleaved) and ``experts.<e>.down_proj`` (transposed): read back by hand
    and compared with each linear compressed on its own (`compress_linear`)."""
    from transformers import AutoModelForCausalLM

    from qatlib.export.compress import compress_linear
    from qatlib.export.coverage import VLLM_INTERLEAVED_EXPERTS
    from qatlib.export.experts import unfused_expert_tensors
    from qatlib.export.format import compressed_tensors_format
    from qatlib.quant.linear import prepared_scheme

    model, out = exported
    keys = {k: v for f in out.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert not [k for k in keys if ".gate_proj." in k or ".up_proj." in k]
    record = json.loads((out / "qatlib_export.json").read_text())
    rows = {r["module_type"]: r for r in record["coverage"]}
    assert rows["ExpertMLP.gate_proj"]["quantized"] == 8 and rows["ExpertMLP.up_proj"]["notes"] == [
        VLLM_INTERLEAVED_EXPERTS
    ]
    # what the record says: transformers 5.24 leaves the experts at their init, without an error
    with one_thread():
        _, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert "model.layers.1.mlp.experts.gate_up_proj" in info["missing_keys"]
    assert "model.layers.1.mlp.experts.3.gate_up_proj.weight" in info["unexpected_keys"]
    fmt = compressed_tensors_format(prepared_scheme(model))
    for layer in range(2):
        for e in range(4):
            p = f"model.layers.{layer}.mlp.experts.{e}"
            ex = model.get_submodule(p)
            g, u, d = (compress_linear(getattr(ex, n), fmt) for n in ("gate_proj", "up_proj", "down_proj"))
            w = keys[f"{p}.gate_up_proj.weight"]
            assert w.dtype == torch.int8 and w.shape == (40, 42)
            assert torch.equal(w.t()[0::2].view(torch.uint8), g["weight"].view(torch.uint8))
            assert torch.equal(w.t()[1::2].view(torch.uint8), u["weight"].view(torch.uint8))
            assert torch.equal(
                keys[f"{p}.gate_up_proj.weight_scale"], _interleave(g["weight_scale"], u["weight_scale"]).t()
            )
            assert torch.equal(
                keys[f"{p}.gate_up_proj.bias"], _interleave(ex.gate_proj.bias, ex.up_proj.bias).detach()
            )
            assert torch.equal(
                keys[f"{p}.down_proj.weight"].t().view(torch.uint8), d["weight"].view(torch.uint8)
            )
            assert torch.equal(keys[f"{p}.down_proj.weight_scale"], d["weight_scale"].t())
            assert torch.equal(keys[f"{p}.down_proj.bias"], ex.down_proj.bias.detach())
            # qatlib's reader of the export gives back each linear's own compressed tensors
            back = unfused_expert_tensors(keys, p)
            want = {
                f"{n}.{k}": v
                for n, c in zip(("gate_proj", "up_proj", "down_proj"), (g, u, d))
                for k, v in c.items()
            }
            assert back.keys() == want.keys() and all(torch.equal(back[k], want[k]) for k in want)


def test_vllm_places_every_expert_tensor_as_qatlib_computed_it(exported):
    """vLLM 0.33's own gpt_oss load (`qatlib.runtime.oracle.vllm_loaded`, CPU): every expert's
    ``w13`` (gate / up interleaved rows), ``w2``, scales and biases equal qatlib's codes and
    scales (`QuantLinear.codes`), nothing left at vLLM's init."""
    pytest.importorskip("vllm")
    model, out = exported
    # the CPU has no int8 fused-MoE backend: `oracle.SUBSTITUTIONS` selects Triton's layout
    with (
        oracle.vllm_loaded(out) as vm,
    ):
        vp = dict(vm.named_parameters())
        for layer in range(2):
            v = {k.rpartition(".")[2]: t for k, t in vp.items() if f"layers.{layer}.mlp.experts.routed" in k}
            assert v["w13_weight"].shape == (4, 42, 40) and v["w2_weight"].shape == (4, 40, 21)
            for e in range(4):
                ex = model.get_submodule(f"model.layers.{layer}.mlp.experts.{e}")
                (gc, gs, _), (uc, us, _), (dc, ds, _) = (
                    getattr(ex, n).codes() for n in ("gate_proj", "up_proj", "down_proj")
                )
                assert torch.equal(v["w13_weight"][e].float(), _interleave(gc, uc).float())
                assert torch.equal(v["w13_weight_scale"][e], _interleave(gs, us).float())
                assert torch.equal(v["w13_bias"][e], _interleave(ex.gate_proj.bias, ex.up_proj.bias).detach())
                assert torch.equal(v["w2_weight"][e].float(), dc.float())
                assert torch.equal(v["w2_weight_scale"][e], ds.float())
                assert torch.equal(v["w2_bias"][e], ex.down_proj.bias.detach())


def test_zero3_qat_trains_the_quantized_experts_on_two_ranks(hub, tmp_path, tiny_tokenizer, single_thread):
    """The ZeRO-3 QAT start (`qatlib.zero3.load.build_qat_model`, 2 gloo ranks) of a GPT-OSS
    checkpoint: every expert projection is a QuantLinear, the weights are ``from_pretrained`` +
    linearisation bit for bit, every expert weight scale is the PTQ checkpoint's, and DeepSpeed
    steps train them (finite losses on both ranks, every expert scale moved)."""
    from qatlib.checkpoint.keys import key_of
    from qatlib.config import load_config
    from qatlib.pipeline import run_ptq
    from qatlib.quant import preset

    base, sets = stage_inputs(tmp_path, hub, tiny_tokenizer, W8A8_INT8)
    sets.append(f"global.save_path={tmp_path / 'ptq'}")
    run_ptq(load_config(EXPS / "tiny-qwen3-moe.yaml", sets), progress=False)
    ptq = load_file(str(tmp_path / "ptq" / "scales.safetensors"))
    steps = 3
    torch.save(torch.randint(0, VOCAB, (steps, 2, 2, 16), generator=torch.Generator().manual_seed(5)),
               tmp_path / "data.pt")  # fmt: skip
    out = tmp_path / "run"
    out.mkdir()
    spec = {"out": str(out), "ds_config": str(DS_TEST), "model": str(base), "ptq": str(tmp_path / "ptq"),
            "scheme": preset("int8").to_dict(), "steps": steps, "lr": 1e-3, "data": str(tmp_path / "data.pt")}  # fmt: skip
    proc, _ = torchrun(ROOT / "tests" / "zero3_workers" / "gpt_oss.py", spec, tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.count("WORKER OK") == 2
    r = torch.load(out / "gpt_oss.pt", weights_only=False)
    assert len(r["experts"]) == 2 * 4 * 3
    ref = reference(hub)
    weights = {k: v for k, v in r["before"].items() if "_quantizer." not in k}
    assert weights.keys() == {k for k in ref if k in r["before"]} and len(weights) == len(ref)
    assert [k for k in weights if not torch.equal(weights[k], ref[k])] == []
    for lin in r["experts"]:
        scale = r["before"][f"{lin}.weight_quantizer.scale"]
        assert torch.equal(scale.reshape(-1), ptq[key_of(lin, "weight", "scale")].reshape(-1)), lin
        assert not torch.equal(r["after"][f"{lin}.weight_quantizer.scale"], scale), lin
    assert all(torch.isfinite(torch.tensor(both)).all() and len(both) == 2 for both in r["losses"])


def test_export_refuses_what_vllm_would_not_load_for_these_experts(hub, tmp_path):
    """fp8 (compressed-tensors' fp8 MoE has no expert biases) and per-tensor scales are refused
    by name, and nothing is written."""
    from transformers import AutoModelForCausalLM

    from qatlib.export import ExportError, export
    from qatlib.quant import prepare, preset

    with one_thread():
        model = AutoModelForCausalLM.from_pretrained(str(hub), dtype=torch.float32)
    linearize_moe_experts(model)
    prepare(model, preset("fp8_dynamic"))
    with pytest.raises(
        ExportError, match=r"experts\.0: interleaved gate/up.*fp8 weights.*weight strategy tensor"
    ):
        export(model, preset("fp8_dynamic"), tmp_path / "fp8", "real")
    assert not (tmp_path / "fp8").exists()
