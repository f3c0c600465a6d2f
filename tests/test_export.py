"""Export: every format is written, then reloaded by transformers (+ compressed-tensors) on the CPU.

Reference for each reload: the in-memory fake-quant model. Where the deployed arithmetic differs
by design (documented in `CTFormat.changes`), the reference is the fake-quant model with exactly
that difference applied, and the comparison is exact (atol 0).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_model, tiny_qwen3_config, tiny_qwen3_moe_config
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from qatlib.export import ExportError, compressed_tensors_format, export
from qatlib.export import compress as compress_mod
from qatlib.export import plan as plan_mod
from qatlib.export.format import CTFormat
from qatlib.ptq import calibrate, save_ptq_checkpoint
from qatlib.quant import (
    Granularity,
    PrepareOptions,
    Quantizer,
    QuantLinear,
    QuantScheme,
    QuantSpec,
    prepare,
    preset,
    quant_linears,
    quantization_disabled,
)
from qatlib.zero3.load import stream_load_scales

G16 = QuantSpec("int4", Granularity.GROUP, group_size=16)
# a dequantizing reload passes a CompressedTensorsConfig over the checkpoint's own: expected
pytestmark = pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")


def g16(scheme: QuantScheme) -> QuantScheme:
    return scheme.replace(weight=scheme.weight.replace(group_size=16))


def _batches(n=2, b=2, t=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (b, t), generator=g) for _ in range(n)]


IDS = _batches(n=1, b=2, t=20, seed=11)[0]


def _calibrated(scheme, *, moe=False, kv=None, dtype=None, options=None):
    model = build_model(tiny_qwen3_moe_config() if moe else tiny_qwen3_config())
    if dtype is not None:
        model.to(dtype)
    report = calibrate(model, scheme, _batches(), kv=kv, options=options)
    return model, report.scheme


def _reload(d, dequantize=False):
    kw = {}
    if dequantize:
        from transformers.utils.quantization_config import CompressedTensorsConfig

        kw["quantization_config"] = CompressedTensorsConfig(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(d, **kw).eval()


@torch.no_grad()
def _logits(model):
    return model(IDS).logits.float()


def _tensors(path):
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _disable(model, pred):
    for name, q in model.named_modules():
        if isinstance(q, Quantizer) and pred(name):
            q.enabled = False


# --------------------------------------------------------------------------- real: exact formats
# (scheme, reload with dequantize=True). compressed-tensors 0.20.1 + transformers 5.24 cannot
# initialise packed asymmetric zero points on the default load path (it sizes weight_zero_point
# unpacked and the load fails on the shape); the dequantizing load reads them and is exact. The
# checkpoint layout is vLLM's (zero points packed along the output dim), checked below.
EXACT = {
    "fp8_static": (preset("fp8_static"), False),
    "fp8_dynamic": (preset("fp8_dynamic"), False),
    "fp8_channel_static": (preset("fp8_static").replace(weight=QuantSpec("fp8", Granularity.CHANNEL)), False),
    "int4_g16_sym": (g16(preset("int4_weight_only")), False),
    "int4_g16_asym": (QuantScheme("int4_asym", weight=G16.replace(symmetric=False)), True),
    "int3_g16": (g16(preset("int3_weight_only")), False),
    "int8_channel_weight_only": (
        QuantScheme("int8_wo", weight=QuantSpec("int8", Granularity.CHANNEL)),
        False,
    ),
    "int8_static_tensor": (
        QuantScheme("int8_static", weight=QuantSpec("int8", Granularity.CHANNEL), input=QuantSpec("int8")),
        False,
    ),
}


@pytest.mark.parametrize("name", list(EXACT))
def test_real_export_reloads_exactly(tmp_path, name):
    scheme, dequantize = EXACT[name]
    model, scheme = _calibrated(scheme)
    out = export(model, scheme, tmp_path / name, "real")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["quantization_status"] == "compressed"
    assert qc["format"] == compressed_tensors_format(scheme).format
    assert "lm_head" in qc["ignore"] and "model.embed_tokens" in qc["ignore"]
    reloaded = _reload(out, dequantize)
    ref = _logits(model)
    if dequantize:  # the dequantizing load drops activation quantization (none here)
        assert scheme.input is None
    torch.testing.assert_close(_logits(reloaded), ref, rtol=0, atol=0)
    if name == "int4_g16_asym":
        t = _tensors(out / "model.safetensors")
        zp = t["model.layers.0.mlp.down_proj.weight_zero_point"]
        assert zp.dtype == torch.int32 and tuple(zp.shape) == (64 // 8, 128 // 16)


def test_real_export_keeps_trained_scales_and_lwc(tmp_path):
    """LWC: the exported scale is the clipped scale of the weight; scales stay fp32 in a bf16 model."""
    scheme = g16(preset("int4_weight_only"))
    model, _ = _calibrated(scheme, options=PrepareOptions(lwc_init=1.5))
    with torch.no_grad():
        for _, ql in quant_linears(model):
            ql.weight_quantizer.clip_factor_w_max.uniform_(0.5, 3.0)
    out = export(model, scheme, tmp_path / "lwc", "real")
    t = _tensors(out / "model.safetensors")
    ql = model.model.layers[1].mlp.up_proj
    torch.testing.assert_close(
        t["model.layers.1.mlp.up_proj.weight_scale"], ql.weight_quantizer.qparams(ql.weight)[0].detach()
    )
    torch.testing.assert_close(_logits(_reload(out)), _logits(model), rtol=0, atol=0)

    bf16, sch = _calibrated(preset("fp8_static"), dtype=torch.bfloat16)
    out = export(bf16, sch, tmp_path / "bf16", "real")
    t = _tensors(out / "model.safetensors")
    q = bf16.model.layers[0].self_attn.o_proj
    assert t["model.layers.0.self_attn.o_proj.weight"].dtype == torch.float8_e4m3fn
    for key, mine in (("weight_scale", q.weight_quantizer.scale), ("input_scale", q.input_quantizer.scale)):
        got = t[f"model.layers.0.self_attn.o_proj.{key}"]
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, mine.detach(), rtol=0, atol=0)


# --------------------------------------------------------------------------- real: documented differences
def test_real_export_int8_w8a8(tmp_path):
    """Weights: exact (dequantizing load vs. our model without activation quantization).
    Activations: compressed-tensors' CPU forward computes the dynamic per-token scale as
    absmax / 127.5 (qatlib and vLLM: absmax / 127). The tolerance is the activation quantization
    error itself: two int8 grids that differ by 0.4 % disagree by about one rounding step, so the
    logits differ by about the size of the activation-quantization effect itself; bound: twice that
    effect (measured: diff 0.0092 vs. effect 0.0083, on logits of magnitude 0.66)."""
    scheme = preset("int8")
    model, _ = _calibrated(scheme)
    out = export(model, scheme, tmp_path / "int8", "real")
    info = json.loads((out / "qatlib_export.json").read_text())
    assert any("127.5" in c for c in info["compressed_tensors"]["changes"])
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "int-quantized"
    ours = _logits(model)
    with torch.no_grad():
        _disable(model, lambda n: n.endswith("input_quantizer"))
        ours_weights_only = _logits(model)
    torch.testing.assert_close(_logits(_reload(out, dequantize=True)), ours_weights_only, rtol=0, atol=0)
    diff = (_logits(_reload(out)) - ours).abs().max().item()
    act_effect = (ours - ours_weights_only).abs().max().item()
    assert diff <= 2 * act_effect, (diff, act_effect)


@pytest.mark.parametrize("mode", ["runtime", "trained"])
def test_real_export_w4a8_fp8(tmp_path, mode):
    """W4A8-FP8 is written in vLLM's CompressedTensorsW4A8Fp8 layout (packed int4 + group scales).
    runtime: activations become fp8 per-token dynamic (the kernel's only mode); trained: the static
    input scale is kept. The stored weights never carry the fp8_recast (the kernel's own FP8
    conversion). Reference: our model with exactly those changes, compared exactly."""
    scheme = g16(preset("w4a8_fp8"))
    model, _ = _calibrated(scheme)
    trained = _logits(model)
    out = export(model, scheme, tmp_path / mode, "real", w4a8_activation=mode)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    grp = qc["config_groups"]["group_0"]
    assert (
        qc["format"] == "pack-quantized"
        and grp["weights"]["num_bits"] == 4
        and grp["weights"]["group_size"] == 16
    )
    t = _tensors(out / "model.safetensors")
    assert t["model.layers.0.mlp.up_proj.weight_packed"].dtype == torch.int32
    if mode == "runtime":
        assert grp["input_activations"]["strategy"] == "token" and grp["input_activations"]["dynamic"] is True
        assert not any(k.endswith("input_scale") for k in t)
    else:
        assert (
            grp["input_activations"]["strategy"] == "tensor" and "model.layers.0.mlp.up_proj.input_scale" in t
        )
    for _, ql in quant_linears(model):
        ql.weight_quantizer.spec = ql.weight_quantizer.spec.replace(fp8_recast=False)
        if mode == "runtime":
            ql.input_quantizer = Quantizer(QuantSpec("fp8", Granularity.TOKEN, dynamic=True))
    reference = _logits(model)
    reloaded = _logits(_reload(out))
    torch.testing.assert_close(reloaded, reference, rtol=0, atol=0)
    with quantization_disabled(model):
        fp = _logits(model)
    # sanity: the deployed model is closer to the trained one than the unquantized model is
    assert (reloaded - trained).abs().max() < (fp - trained).abs().max()


# --------------------------------------------------------------------------- MoE, KV cache
@pytest.mark.parametrize("name", ["int4_g16_sym", "fp8_static"])
def test_real_export_moe(tmp_path, name):
    """Per-expert keys (vLLM's layout). transformers fuses the experts on load (no Linear left for
    compressed-tensors' activation quantization), so the expert input scales are checked on disk
    and the reference disables the experts' input quantizers; everything else is exact. The
    evaluation's ``export`` variant (`load_variant`) records those unused input scales, one per
    expert linear of every MoE layer, and nothing for a weight-only export."""
    from types import SimpleNamespace

    from qatlib.eval.variants import load_variant
    from qatlib.scores import EXPERT_INPUTS_UNQUANTIZED

    scheme = EXACT[name][0]
    model, _ = _calibrated(scheme, moe=True)
    out = export(model, scheme, tmp_path / name, "real")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert {"model.layers.0.mlp.gate", "model.layers.1.mlp.gate", "lm_head"} <= set(qc["ignore"])
    t = _tensors(out / "model.safetensors")
    key = "weight_packed" if scheme.input is None else "weight"
    assert all(f"model.layers.1.mlp.experts.{e}.down_proj.{key}" in t for e in range(4))
    if scheme.input is not None:
        ql = model.model.layers[1].mlp.experts[2].gate_proj
        torch.testing.assert_close(
            t["model.layers.1.mlp.experts.2.gate_proj.input_scale"], ql.input_quantizer.scale.detach()
        )
        _disable(model, lambda n: ".experts." in n and n.endswith("input_quantizer"))
    reloaded, record = load_variant(
        SimpleNamespace(model=SimpleNamespace(trust_remote_code=False)), "export", str(out), None
    )
    torch.testing.assert_close(_logits(reloaded), _logits(model), rtol=0, atol=0)
    if scheme.input is None:
        assert "not_applied" not in record
    else:
        expert_linears = [n for n, _ in quant_linears(model) if ".experts." in n]
        assert len(expert_linears) == sum(1 for k in t if ".experts." in k and k.endswith(".input_scale")) > 0
        assert record["not_applied"]["by_kind"] == {"input_scale": len(expert_linears)}
        assert record["not_applied"]["why"] == EXPERT_INPUTS_UNQUANTIZED


@pytest.mark.parametrize("kv", ["per-tensor", "per-head"])
def test_real_and_kvcache_export(tmp_path, kv):
    """kv_cache_scheme + <attn>.k_scale / v_scale in compressed-tensors' form, and
    kv_cache_scales.safetensors with the PTQ keys. transformers 5.24 passes the cache as ``cache``
    (not ``past_key_values``), so compressed-tensors 0.20.1 cannot hook the KV cache on reload: the
    scales are checked on disk and the reference disables the k/v output quantizers."""
    model, scheme = _calibrated(preset("fp8_static"), kv=kv)
    out = export(model, scheme, tmp_path / kv, "real_and_kvcache")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"]["type"] == "float" and qc["kv_cache_scheme"]["num_bits"] == 8
    assert qc["kv_cache_scheme"]["strategy"] == ("tensor" if kv == "per-tensor" else "attn_head")
    t = _tensors(out / "model.safetensors")
    # only what a runtime loads at the top (vLLM globs every *.safetensors): the PTQ-key KV file
    # lives in the qatlib/ side folder
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    kvf = _tensors(out / "qatlib" / "kv_cache_scales.safetensors")
    assert len(kvf) == 4
    for li, layer in enumerate(model.model.layers):
        for r in "kv":
            mine = getattr(layer.self_attn, f"{r}_proj").output_quantizer.scale.detach()
            ct = t[f"model.layers.{li}.self_attn.{r}_scale"]
            assert tuple(ct.shape) == ((1,) if kv == "per-tensor" else (2, 1, 1))
            torch.testing.assert_close(ct.flatten(), mine, rtol=0, atol=0)
            # also under the runtimes' parameter name (SGLang's Qwen3-MoE loader never remaps)
            assert torch.equal(t[f"model.layers.{li}.self_attn.attn.{r}_scale"], ct)
            torch.testing.assert_close(
                kvf[f"model.layers.{li}.self_attn.{r}_cache.scale"], mine, rtol=0, atol=0
            )
    _disable(model, lambda n: n.endswith(("k_proj.output_quantizer", "v_proj.output_quantizer")))
    torch.testing.assert_close(_logits(_reload(out)), _logits(model), rtol=0, atol=0)

    only = export(model, scheme, tmp_path / "kv_only", "save_kvcache_only")
    assert sorted(p.name for p in only.iterdir()) == ["kv_cache_scales.safetensors", "qatlib_export.json"]
    assert _tensors(only / "kv_cache_scales.safetensors").keys() == kvf.keys()


# --------------------------------------------------------------------------- fake
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_fake_export(tmp_path, moe):
    """A plain HF checkpoint of dequantize(quantize(W)): loads without any quantization library,
    logits identical to the fake-quant model (weight-only) / to it without activation quantizers."""
    scheme = g16(preset("int4_weight_only")) if moe else preset("fp8_static")
    model, _ = _calibrated(scheme, moe=moe)
    out = export(model, scheme, tmp_path / "fake", "fake")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    # vLLM loads every top-level *.safetensors of a folder without an index: only the weights there
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    # ... and it stays a resume checkpoint: the scales are found in the side folder
    from qatlib.checkpoint.keys import load_scales, scale_state_dict
    from qatlib.resume import classify_resume_dir

    assert classify_resume_dir(out) == ("saved", out)
    mine = scale_state_dict(model)
    back = load_scales(out)
    assert mine.keys() <= back.keys() and all(torch.equal(back[k], mine[k].float()) for k in mine)
    _disable(model, lambda n: n.endswith("input_quantizer"))
    torch.testing.assert_close(_logits(_reload(out)), _logits(model), rtol=0, atol=0)


# --------------------------------------------------------------------------- PTQ -> load -> export
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_ptq_checkpoint_to_export_roundtrip(tmp_path, moe):
    """PTQ -> scales checkpoint -> scales loaded into a freshly prepared model -> real export ->
    transformers reload: identical logits to the calibrated model."""
    cfg = tiny_qwen3_moe_config() if moe else tiny_qwen3_config()
    scheme = QuantScheme("int4_g16", weight=G16)
    model, _ = _calibrated(scheme, moe=moe)
    ptq_dir = save_ptq_checkpoint(model, scheme, tmp_path / "ptq")
    fresh = prepare(build_model(cfg), scheme, options=PrepareOptions(init_from_weight=False))
    assert stream_load_scales(fresh, ptq_dir, scheme)["misses"] == 0
    out = export(fresh, scheme, tmp_path / "real", "real")
    torch.testing.assert_close(_logits(_reload(out)), _logits(model), rtol=0, atol=0)
    if not moe:
        # the ZeRO-3 path hands the modules over one gathered unit at a time; only rank 0 writes
        from qatlib.zero3.save import iter_gathered_modules

        assert (
            export(
                fresh,
                scheme,
                tmp_path / "r1",
                "real",
                modules=iter_gathered_modules(fresh),
                is_main_process=False,
            )
            is None
        )
        assert not (tmp_path / "r1").exists()
        out2 = export(fresh, scheme, tmp_path / "r0", "real", modules=iter_gathered_modules(fresh))
        a, b = _tensors(out / "model.safetensors"), _tensors(out2 / "model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- errors
def test_export_errors_write_nothing(tmp_path, monkeypatch):
    plain = build_model(tiny_qwen3_config())
    with pytest.raises(ExportError, match="no QuantLinear"):
        export(plain, preset("fp8_static"), tmp_path / "a", "real")

    model, scheme = _calibrated(preset("fp8_static"))
    with pytest.raises(ExportError, match="save_format"):
        export(model, scheme, tmp_path / "a", "pt")
    with pytest.raises(ExportError, match="does not match"):  # prepared with another scheme
        export(model, preset("fp8_dynamic"), tmp_path / "a", "real")
    with pytest.raises(ExportError, match="static k/v"):
        export(model, scheme, tmp_path / "a", "save_kvcache_only")

    grouped, gscheme = _calibrated(g16(preset("int4_weight_only")))
    with pytest.raises(ExportError, match="does not match"):  # a group size other than the trained one
        export(
            grouped,
            g16(preset("int4_weight_only")).replace(weight=G16.replace(group_size=48)),
            tmp_path / "a",
            "real",
        )

    per_head_q = QuantSpec("fp8", Granularity.HEAD)
    qmodel, qscheme = _calibrated(preset("fp8_static").replace(q=per_head_q))
    with pytest.raises(ExportError, match="q projection output"):
        export(qmodel, qscheme, tmp_path / "a", "real")
    export(qmodel, qscheme, tmp_path / "q_fake", "fake")  # fake exports weights only: fine
    with pytest.raises(ExportError, match="per-head input"):
        compressed_tensors_format(
            QuantScheme("x", weight=G16, input=QuantSpec("fp8", Granularity.HEAD, num_heads=4))
        )
    with pytest.raises(ExportError, match="one kv_cache_scheme"):
        compressed_tensors_format(preset("fp8_static").replace(k=QuantSpec("fp8")))
    with pytest.raises(ExportError, match="static per-tensor or per-head"):
        compressed_tensors_format(
            preset("fp8_static").replace(
                k=QuantSpec("fp8", Granularity.TOKEN), v=QuantSpec("fp8", Granularity.TOKEN)
            )
        )

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        export(model, scheme, busy, "real")
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]

    def boom(*a, **k):
        raise RuntimeError("write failed")

    monkeypatch.setattr(type(model), "save_pretrained", boom)
    with pytest.raises(RuntimeError, match="write failed"):
        export(model, scheme, tmp_path / "b", "real")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy", "q_fake"]  # nothing partial, no temp dirs

    export(model, scheme, busy, "real", overwrite=True)
    assert not (busy / "keep.txt").exists() and (busy / "config.json").is_file()


def test_export_refuses_destroyed_weights(tmp_path, monkeypatch):
    """The round-trip check: a checkpoint header that does not describe the tensors (the upstream
    bug: an fp8 header written over int4 weights) stops the export before anything is written.
    Simulated with a mapping that declares int3 weights for an int4 model."""
    model, scheme = _calibrated(g16(preset("w4a8_fp8")))
    real = plan_mod.compressed_tensors_format

    def wrong_format(s, **kw):
        f = real(s, **kw)
        bad = f.scheme.model_copy(update={"weights": f.scheme.weights.model_copy(update={"num_bits": 3})})
        return CTFormat(bad, f.format, None)

    monkeypatch.setattr(plan_mod, "compressed_tensors_format", wrong_format)
    with pytest.raises(ExportError, match="round trip changed the weight"):
        export(model, scheme, tmp_path / "w", "real")
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- ignore list / fused groups
def _ct_ignored(model, ignore):
    """The Linear modules an ``ignore`` list selects under compressed-tensors' own matcher (0.20.1
    `is_match`: ``re:`` entries by `re.match`, names exactly; vLLM / SGLang use the same rule)."""
    from compressed_tensors.utils.match import is_match

    linears = (torch.nn.Linear, QuantLinear)
    return {n for n, m in model.named_modules() if isinstance(m, linears) and is_match(n, m, ignore)}


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_ignore_patterns_resolved_for_compressed_tensors(tmp_path, moe):
    """qatlib full-matches ``re:`` patterns: ``re:model\\.layers\\.1`` names the decoder layer, no linear.
    compressed-tensors reads it by prefix: every layer-1 linear. The export writes resolved names,
    and compressed-tensors' matcher then selects exactly the linears qatlib left unquantized."""
    patterns = ["lm_head", "re:model\\.layers\\.1\\.self_attn\\.[qkv]_proj", "re:model\\.layers\\.1"]
    cfg = tiny_qwen3_moe_config() if moe else tiny_qwen3_config()
    model = prepare(build_model(cfg), preset("fp8_static"), ignore=patterns)
    calibrate(model, preset("fp8_static"), _batches())
    out = export(model, preset("fp8_static"), tmp_path / "e", "real", ignore=patterns)
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert not any(e.startswith("re:") for e in ignore)
    plain = {n for n, m in model.named_modules() if type(m) is torch.nn.Linear}
    assert {"model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj", "lm_head"} <= plain
    assert "model.layers.1.self_attn.o_proj" not in plain
    assert _ct_ignored(model, ignore) == plain
    # the defect fixed: the raw patterns would make the runtime drop layer 1's trained o_proj (+ MLP)
    assert "model.layers.1.self_attn.o_proj" in _ct_ignored(model, patterns)


@pytest.mark.parametrize(
    "moe,ignore,named",
    [
        (False, ["lm_head", "re:.*\\.q_proj"], "qkv group model.layers.0.self_attn"),
        (False, ["lm_head", "re:model\\.layers\\.1\\.mlp\\.gate_proj"], "gate_up group model.layers.1.mlp"),
        (True, ["lm_head", "re:.*experts\\.2\\..*"], "moe_layer group model.layers.0.mlp.experts"),
    ],
    ids=["q-only", "gate-only", "one-expert"],
)
def test_export_refuses_split_fused_group(tmp_path, moe, ignore, named):
    cfg = tiny_qwen3_moe_config() if moe else tiny_qwen3_config()
    model = prepare(build_model(cfg), preset("fp8_static"), ignore=ignore)
    calibrate(model, preset("fp8_static"), _batches(n=1))
    with pytest.raises(ExportError, match="splits groups") as e:
        export(model, preset("fp8_static"), tmp_path / "e", "real", ignore=ignore)
    assert named in str(e.value)
    assert not (tmp_path / "e").exists()
    export(model, preset("fp8_static"), tmp_path / "f", "fake")  # a fake export has no fused kernels


def test_export_refuses_ignore_of_quantized_layer(tmp_path):
    model, scheme = _calibrated(preset("fp8_static"))  # prepared with the default ignore (lm_head)
    with pytest.raises(ExportError, match="different ignore set"):
        export(model, scheme, tmp_path / "e", "real", ignore=["re:model\\.layers\\.0\\.mlp\\..*"])


def test_export_records_deployment_differences(tmp_path):
    """qatlib_export.json counts, per runtime, the fused groups whose independently trained scales a
    runtime collapses; tying them (equal scales) brings the count to zero."""
    model, scheme = _calibrated(preset("fp8_static"), moe=True)
    info = json.loads((export(model, scheme, tmp_path / "a", "real") / "qatlib_export.json").read_text())
    vllm = info["deployment"]["vllm 0.33.0"]
    assert vllm["loads"] and info["deployment"]["sglang 0.5.23"]["loads"]
    text = "\n".join(vllm["differences"])
    # q/k/v of 2 layers + gate/up of 2 x 4 experts: each group's members see the same input, so
    # their calibrated input scales agree; their weight scales and the experts' input scales do not
    assert "0 of 10 fused groups have different input scales" in text
    assert "4 of 4 expert groups (w13 / w2 per layer) have different input scales" in text
    assert "10 of 10 fused groups have different weight scales" in text
    with torch.no_grad():  # tie by hand what the runtime collapses: weight scales of every fused group
        mods = dict(model.named_modules())
        from qatlib.runtime.fusion import GroupKind, fused_groups

        for g in fused_groups(model):
            role = "weight" if g.kind in (GroupKind.QKV, GroupKind.GATE_UP) else "input"
            qs = [getattr(mods[m], f"{role}_quantizer") for m in g.members]
            top = torch.stack([q.scale.reshape(()) for q in qs]).max()
            for q in qs:
                q.scale.fill_(top)
    info = json.loads((export(model, scheme, tmp_path / "b", "real") / "qatlib_export.json").read_text())
    text = "\n".join(info["deployment"]["vllm 0.33.0"]["differences"])
    assert "0 of 10 fused groups have different weight scales" in text
    assert "0 of 4 expert groups (w13 / w2 per layer) have different input scales" in text
    # a layout vLLM cannot load on MoE is recorded as such
    dyn, dscheme = _calibrated(preset("fp8_dynamic"), moe=True)
    info = json.loads((export(dyn, dscheme, tmp_path / "c", "real") / "qatlib_export.json").read_text())
    assert not info["deployment"]["vllm 0.33.0"]["loads"]
    assert "kFp8Dynamic128Sym" in info["deployment"]["vllm 0.33.0"]["refusal"]


# --------------------------------------------------------------------------- streaming (qatlib.zero3.onload)
def _files(d):
    import hashlib

    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }


def _streamed(tmp_path, cfg, scheme, kv=None):
    """(model calibrated in memory, its checkpoint folder, a skeleton of it with the scales loaded,
    the Onloader streaming the skeleton's weights from the folder)."""
    from qatlib.models import load_model
    from qatlib.zero3.onload import Onloader, load_skeleton, realize_quantizers

    base = tmp_path / "base"
    build_model(cfg).save_pretrained(base)
    model = load_model(base)
    scheme = calibrate(model, scheme, _batches(), kv=kv).scheme
    ptq_dir = save_ptq_checkpoint(model, scheme, tmp_path / "ptq")
    skel = prepare(load_skeleton(base), scheme)
    realize_quantizers(skel)
    assert stream_load_scales(skel, ptq_dir, scheme)["misses"] == 0
    return model, scheme, skel, Onloader.from_checkpoint(skel, base)


@pytest.mark.parametrize(
    "moe,name,save_format,kv",
    [
        (True, "fp8_static", "real_and_kvcache", "per-tensor"),
        (True, "int4_g16_asym", "fake", None),
        (False, "int4_g16_sym", "real", None),
    ],
    ids=["moe-fp8-real_and_kvcache", "moe-int4-fake", "dense-int4-real"],
)
def test_streaming_export_is_the_in_memory_export(tmp_path, moe, name, save_format, kv):
    """Layer by layer from the checkpoint folder, the export writes the same files with the same
    bytes as the in-memory export (the side scale file of a fake export: same tensors; its two
    metadata entries have no fixed order), and it reloads to the same logits."""
    cfg = tiny_qwen3_moe_config() if moe else tiny_qwen3_config(tie_word_embeddings=True)
    model, scheme, skel, loader = _streamed(tmp_path, cfg, EXACT[name][0], kv)
    a = export(model, scheme, tmp_path / "a", save_format)
    b = export(skel, scheme, tmp_path / "b", save_format, onload=loader)
    fa, fb = _files(a), _files(b)
    assert fa.keys() == fb.keys()
    side = "qatlib/scales.safetensors"
    assert {k: v for k, v in fa.items() if k != side} == {k: v for k, v in fb.items() if k != side}
    if side in fa:
        sa, sb = _tensors(a / side), _tensors(b / side)
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert all(p.is_meta for n, p in skel.named_parameters() if "quantizer" not in n)
    if save_format != "fake":
        torch.testing.assert_close(
            _logits(_reload(b, EXACT[name][1])), _logits(_reload(a, EXACT[name][1])), rtol=0, atol=0
        )


def test_streaming_export_writes_shards(tmp_path):
    """A shard limit below the model's size: several shards (each written when full) and the
    index, the same tensors as the one-file export, and transformers reloads them."""
    model, scheme, skel, loader = _streamed(tmp_path, tiny_qwen3_moe_config(), preset("fp8_static"))
    a = export(model, scheme, tmp_path / "a", "real")
    b = export(skel, scheme, tmp_path / "b", "real", onload=loader, max_shard_size=64 << 10)
    shards = sorted(b.glob("model-*.safetensors"))
    assert len(shards) > 2 and (b / "model.safetensors.index.json").is_file()
    for p in shards:  # at most the limit, unless one tensor alone is larger (the fp32 embedding)
        t = _tensors(p)
        assert len(t) == 1 or sum(v.numel() * v.element_size() for v in t.values()) <= 64 << 10
    ta = _tensors(a / "model.safetensors")
    tb = {k: v for p in shards for k, v in _tensors(p).items()}
    assert set(ta) ^ set(tb) == set()
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    index = json.loads((b / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(ta)
    torch.testing.assert_close(_logits(_reload(b)), _logits(_reload(a)), rtol=0, atol=0)


def test_streaming_export_failure_writes_nothing(tmp_path, monkeypatch):
    model, scheme, skel, loader = _streamed(tmp_path, tiny_qwen3_config(), preset("fp8_static"))
    calls = []

    def boom(*a, **k):
        calls.append(1)
        if len(calls) == 5:
            raise ExportError("boom")
        return real(*a, **k)

    real = compress_mod.compress_linear
    monkeypatch.setattr(compress_mod, "compress_linear", boom)
    with pytest.raises(ExportError, match="boom"):
        export(skel, scheme, tmp_path / "out", "real", onload=loader)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
