"""PTQ calibration (RTN and GPTQ) and the PTQ checkpoint of docs/design.md."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from conftest import build_model, tiny_qwen3_config, tiny_qwen3_moe_config

from qatlib import ptq
from qatlib.checkpoint.layout import read_scheme, read_scheme_record
from qatlib.ptq import calibrate, save_ptq_checkpoint
from qatlib.ptq.gptq import gptq, gptq_quantize_weight
from qatlib.quant import Granularity, QuantScheme, QuantSpec, compute_qparams, prepare, preset, quant_linears
from qatlib.zero3.load import stream_load_scales

G16 = QuantSpec("int4", Granularity.GROUP, group_size=16)


def _batches(n=2, b=2, t=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (b, t), generator=g) for _ in range(n)]


def _record_inputs(model):
    """Forward pre-hooks on every QuantLinear: running (min, max) of its input; per-head absmax of
    the values (v_proj outputs) and of the keys the attention kernel sees (k_proj output after
    k_norm and RoPE, recomputed from the attention layer's input)."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    seen, handles = {}, []

    def absmax_per_head(key, x):  # x [..., heads * 16]
        h = x.detach().float().reshape(-1, x.shape[-1] // 16, 16).abs().amax(dim=(0, 2))
        seen[key] = h if key not in seen else torch.maximum(seen[key], h)

    for name, attn in model.named_modules():
        if not hasattr(attn, "k_norm"):
            continue

        def keys(m, args, kwargs, out, name=name):
            h = kwargs["hidden_states"]
            cos, sin = kwargs["position_embeddings"]
            b, t, _ = h.shape
            k = torch.nn.functional.linear(h, m.k_proj.fake_quant_weight(), m.k_proj.bias)
            k = m.k_norm(k.view(b, t, -1, m.head_dim)).transpose(1, 2)
            _, k = apply_rotary_pos_emb(k, k, cos, sin)
            absmax_per_head(f"{name}.k_proj.out", k.transpose(1, 2).reshape(b, t, -1))

        handles.append(attn.register_forward_hook(keys, with_kwargs=True))
    for name, ql in quant_linears(model):

        def pre(m, args, name=name):
            x = args[0].detach().float()
            if x.numel():
                lo, hi = seen.get(name, (float("inf"), float("-inf")))
                seen[name] = (min(lo, x.min().item()), max(hi, x.max().item()))

        def post(m, args, out, name=name):
            if name.endswith("v_proj") and out.numel():  # values are cached as v_proj computes them
                absmax_per_head(name + ".out", out)

        handles += [ql.register_forward_pre_hook(pre), ql.register_forward_hook(post)]
    return seen, handles


# --------------------------------------------------------------------------- RTN calibration
@pytest.mark.parametrize(
    "scheme",
    [
        preset("fp8_static"),
        QuantScheme(
            "int4_g16_asym_int8_static",
            weight=G16.replace(symmetric=False),
            input=QuantSpec("int8", symmetric=False),
        ),
        QuantScheme(
            "int8_channel_w8a8", weight=QuantSpec("int8", Granularity.CHANNEL), input=QuantSpec("int8")
        ),
    ],
    ids=lambda s: s.name,
)
def test_calibrate_scales_are_observer_values(scheme):
    kv = QuantSpec("fp8", Granularity.HEAD)
    scheme = scheme.replace(k=kv, v=kv)
    model = prepare(build_model(tiny_qwen3_config()), scheme)
    # hooks see the calibration forwards themselves (weights fake-quantized, activations not)
    seen, handles = _record_inputs(model)
    report = calibrate(model, scheme, _batches())
    for h in handles:
        h.remove()
    assert report.num_batches == 2 and report.num_tokens == 2 * 2 * 24 and not report.fallbacks
    for name, ql in quant_linears(model):
        s, z = ql.weight_quantizer.qparams()
        es, ez = compute_qparams(ql.weight, scheme.weight)
        torch.testing.assert_close(s, es, rtol=0, atol=0)
        if ez is not None:
            torch.testing.assert_close(z, ez, rtol=0, atol=0)
        spec = scheme.input
        lo, hi = (torch.tensor([v]) for v in seen[name])
        if spec.symmetric:
            expected = torch.maximum(lo.abs(), hi.abs()) / spec.qmax
        else:
            expected = (hi.clamp(min=0) - lo.clamp(max=0)) / (spec.qmax - spec.qmin)
        torch.testing.assert_close(ql.input_quantizer.scale.detach(), expected, rtol=1e-6, atol=0)
        if name.endswith(("k_proj", "v_proj")):
            torch.testing.assert_close(
                ql.output_quantizer.scale.detach(), seen[name + ".out"] / 448.0, rtol=1e-6, atol=0
            )
    assert report.scheme == scheme


def _block_expert(model, expert: int):
    """Route no token to ``expert`` (every layer) by masking its router logit."""
    import torch.nn.functional as TF

    for layer in model.model.layers:
        gate = layer.mlp.gate

        def forward(hidden_states, gate=gate):
            hs = hidden_states.reshape(-1, gate.hidden_dim)
            logits = TF.linear(hs, gate.weight)
            logits[:, expert] = float("-inf")
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            top, idx = torch.topk(probs, gate.top_k, dim=-1)
            if gate.norm_topk_prob:
                top = top / top.sum(dim=-1, keepdim=True)
            return logits, top.to(logits.dtype), idx

        gate.forward = forward


def test_moe_every_expert_calibrated_and_unrouted_expert_falls_back(caplog):
    model = build_model(tiny_qwen3_moe_config())
    _block_expert(model, 3)
    scheme = preset("fp8_static")
    with caplog.at_level(logging.WARNING, logger="qatlib.ptq"):
        report = calibrate(model, scheme, _batches())
    # 2 layers x (gate, up, down) of expert 3 saw nothing; everything else saw data
    assert len(report.fallbacks) == 6, report.fallbacks
    assert all(".experts.3." in k for k in report.fallbacks)
    assert "saw no token" in caplog.text
    for layer in model.model.layers:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            sib = [getattr(layer.mlp.experts[e], proj).input_quantizer.scale.detach() for e in range(3)]
            got = getattr(layer.mlp.experts[3], proj).input_quantizer.scale.detach()
            torch.testing.assert_close(got, torch.stack(sib).amax(0), rtol=0, atol=0)
            # the weights of the unrouted expert are calibrated too
            w = getattr(layer.mlp.experts[3], proj).weight
            torch.testing.assert_close(
                getattr(layer.mlp.experts[3], proj).weight_quantizer.scale.detach(),
                compute_qparams(w, scheme.weight)[0],
            )


def test_calibrate_errors():
    model = build_model(tiny_qwen3_config())
    with pytest.raises(ValueError, match="does not divide"):
        calibrate(model, QuantScheme("g48", weight=G16.replace(group_size=48)), _batches())
    with pytest.raises(ValueError, match="no calibration batch"):
        calibrate(build_model(tiny_qwen3_config()), preset("fp8_static"), [])
    prepared = prepare(build_model(tiny_qwen3_config()), preset("fp8_static"))
    with pytest.raises(ValueError, match="another scheme"):
        calibrate(prepared, preset("fp8_dynamic"), _batches())


# --------------------------------------------------------------------------- checkpoint
def _loaded_copy(cfg, scheme, ckpt):
    fresh = prepare(build_model(cfg, seed=1), scheme)
    report = stream_load_scales(fresh, ckpt, scheme)
    return fresh, report


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_save_load_ptq_checkpoint(tmp_path, moe):
    cfg = tiny_qwen3_moe_config() if moe else tiny_qwen3_config()
    scheme = QuantScheme(
        "int4_asym_int8_in", weight=G16.replace(symmetric=False), input=QuantSpec("int8", symmetric=False)
    )
    model = build_model(cfg)
    report = calibrate(model, scheme, _batches(), kv="per-tensor")
    scheme = report.scheme
    out = save_ptq_checkpoint(model, scheme, tmp_path / "ptq", calibration=report)
    meta = read_scheme_record(out)
    assert read_scheme(out) == scheme
    assert meta["qatlib_version"] and meta["calibration"]["num_batches"] == 2 and meta["weights"] is None
    assert sorted(p.name for p in out.iterdir()) == ["quant_scheme.json", "scales.safetensors"]
    from safetensors import safe_open

    with safe_open(out / "scales.safetensors", "pt") as f:
        keys = set(f.keys())
    n_lin = sum(1 for _ in quant_linears(model))
    assert sum(k.endswith(".weight_scale") for k in keys) == n_lin
    assert sum(k.endswith(".input_zero_point") for k in keys) == n_lin
    assert (
        "model.layers.0.self_attn.k_cache.scale" in keys and "model.layers.1.self_attn.v_cache.scale" in keys
    )
    if moe:
        assert "model.layers.1.mlp.experts.3.down_proj.weight_zero_point" in keys
    fresh, rep = _loaded_copy(cfg, scheme, out)
    assert rep["misses"] == 0 and rep["unused_keys"] == 0
    for (n, a), (_, b) in zip(quant_linears(model), quant_linears(fresh)):
        for (r, qa), (_, qb) in zip(a.quantizers(), b.quantizers()):
            torch.testing.assert_close(qb.scale, qa.scale, rtol=0, atol=0, msg=f"{n}.{r}")


def test_ptq_checkpoint_target_dir_rules(tmp_path, monkeypatch):
    model = build_model(tiny_qwen3_config())
    scheme = QuantScheme("int4", weight=G16)
    with pytest.raises(ValueError, match="no QuantLinear"):
        save_ptq_checkpoint(model, scheme, tmp_path / "a")
    assert not (tmp_path / "a").exists()
    calibrate(model, scheme, [])
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        save_ptq_checkpoint(model, scheme, busy)
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]
    save_ptq_checkpoint(model, scheme, busy, overwrite=True)
    assert not (busy / "keep.txt").exists() and (busy / "scales.safetensors").is_file()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ptq, "save_tensors", boom)
    with pytest.raises(OSError, match="disk full"):
        save_ptq_checkpoint(model, scheme, tmp_path / "b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy"]  # no partial or temporary directory
    with pytest.raises(OSError, match="disk full"):
        save_ptq_checkpoint(model, scheme, busy, overwrite=True)
    assert (busy / "scales.safetensors").is_file()  # the previous content survives a failed overwrite


# --------------------------------------------------------------------------- GPTQ
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize(
    "spec",
    [G16, G16.replace(qtype="int3", symmetric=False), QuantSpec("int4", Granularity.CHANNEL)],
    ids=["int4_g16", "int3_g16_asym", "int4_channel"],
)
def test_gptq_beats_rtn_on_one_layer(spec, act_order):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 64, generator=g) @ torch.randn(64, 64, generator=g)  # correlated inputs
    w = torch.randn(32, 64, generator=g)
    h = 2 * x.T @ x / x.shape[0]
    q, scale, zp = gptq_quantize_weight(w, h, spec, block_size=32, act_order=act_order)
    # the returned weight is on the grid of the returned scales: fake quantization reproduces it
    from qatlib.quant import fake_quantize

    torch.testing.assert_close(fake_quantize(q, scale, zp, spec), q, rtol=0, atol=0)
    rs, rz = compute_qparams(w, spec)
    rtn = fake_quantize(w, rs, rz, spec)
    err = lambda wq: (x @ (w - wq).T).pow(2).mean().item()  # noqa: E731
    assert err(q) < 0.7 * err(rtn), (err(q), err(rtn))


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_latent_weight_is_what_gptq_rounded(act_order):
    """``latent``: the weight each column had when GPTQ rounded it. With a diagonal Hessian GPTQ
    compensates nothing, so that is the original weight, by hand; with correlated inputs it is
    not, yet it rounds to GPTQ's codes at GPTQ's scales, and it sits off the grid (where QAT's
    scale gradient ``round(w / s) - w / s`` is not zero)."""
    from qatlib.quant import fake_quantize

    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 64, generator=g)
    diag = torch.diag(torch.rand(64, generator=g) + 0.5)
    lat, scale, zp = gptq_quantize_weight(w, diag, G16, block_size=32, act_order=act_order, latent=True)
    torch.testing.assert_close(lat, w, rtol=0, atol=0)

    x = torch.randn(512, 64, generator=g) @ torch.randn(64, 64, generator=g)
    h = 2 * x.T @ x / x.shape[0]
    q, scale, zp = gptq_quantize_weight(w, h, G16, block_size=32, act_order=act_order)
    lat, lscale, lzp = gptq_quantize_weight(w, h, G16, block_size=32, act_order=act_order, latent=True)
    torch.testing.assert_close(lscale, scale, rtol=0, atol=0)
    torch.testing.assert_close(fake_quantize(lat, scale, zp, G16), q, rtol=0, atol=0)
    assert (lat - w).abs().mean() > 0.05  # compensated: not the original ...
    r = lat / _group_scales(scale)
    off_grid = (r - torch.round(r)).abs()
    assert off_grid.mean() > 0.1  # ... and not the grid (uniform offsets would average 0.25)


def _group_scales(scale: torch.Tensor) -> torch.Tensor:
    """Per-group scales ``[out, in / 16]`` broadcast to the weight's ``[out, in]``."""
    return scale.repeat_interleave(16, dim=1)


def test_gptq_latent_model_is_the_same_ptq_model():
    """gptq(latent=True) leaves other weights in the model than gptq(), but the same quantized
    model: the same scales and bit-identical fake-quantized outputs."""
    cfg = tiny_qwen3_moe_config()
    scheme = QuantScheme("int3_g16", weight=G16.replace(qtype="int3"))
    batches = _batches(n=2, b=4, t=32)
    a, b = build_model(cfg), build_model(cfg)
    gptq(a, scheme, batches)
    gptq(b, scheme, batches, latent=True)
    qa, qb = a.model.layers[1].self_attn.o_proj, b.model.layers[1].self_attn.o_proj
    assert not torch.equal(qa.weight, qb.weight)
    torch.testing.assert_close(qb.weight_quantizer.scale, qa.weight_quantizer.scale, rtol=0, atol=0)
    ids = _batches(n=1, seed=7)[0]
    with torch.no_grad():
        torch.testing.assert_close(b(ids).logits, a(ids).logits, rtol=0, atol=0)


def test_gptq_model_checkpoint_roundtrip(tmp_path):
    cfg = tiny_qwen3_moe_config()
    scheme = QuantScheme("int3_g16", weight=G16.replace(qtype="int3"))
    batches = _batches(n=2, b=4, t=32)
    # layer-0 q_proj sees the same (embedding) inputs under RTN and GPTQ: compare its output error
    fp = build_model(cfg)
    xs = []
    h = fp.model.layers[0].self_attn.q_proj.register_forward_pre_hook(lambda m, a: xs.append(a[0].detach()))
    with torch.no_grad():
        for b in batches:
            fp(b)
    h.remove()
    x = torch.cat([t.reshape(-1, t.shape[-1]) for t in xs])
    w = fp.model.layers[0].self_attn.q_proj.weight.detach()
    rtn = build_model(cfg)
    calibrate(rtn, scheme, [])
    model = build_model(cfg)
    report = gptq(model, scheme, batches)
    assert report.algorithm == "gptq" and report.num_batches == 2 and report.num_tokens == 2 * 4 * 32
    err = lambda m: (x @ (w - m.model.layers[0].self_attn.q_proj.fake_quant_weight()).T).pow(2).mean().item()  # noqa: E731
    assert err(model) < err(rtn)

    out = save_ptq_checkpoint(model, scheme, tmp_path / "gptq", calibration=report, save_weights=True)
    meta = json.loads((out / "quant_scheme.json").read_text())
    assert meta["weights"] == "model.safetensors" and meta["calibration"]["algorithm"] == "gptq"
    # the directory is a loadable HF checkpoint with the GPTQ weights; scales load on top
    from transformers import AutoModelForCausalLM

    fresh = prepare(AutoModelForCausalLM.from_pretrained(out).eval(), scheme)
    rep = stream_load_scales(fresh, out, scheme)
    assert rep["misses"] == 0
    ids = _batches(n=1, seed=7)[0]
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits, model(ids).logits, rtol=0, atol=0)


# --------------------------------------------------------------------------- layer by layer (qatlib.zero3.onload)
def _saved(tmp_path, cfg):
    """A checkpoint folder of ``cfg``'s model and the model loaded back the ordinary way."""
    from qatlib.models import load_model

    d = tmp_path / "base"
    build_model(cfg).save_pretrained(d)
    return d, load_model(d)


def _st(path):
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


class _NoBatches:
    def __iter__(self):
        raise AssertionError("a weight-only calibration must not read a batch")


LAYERWISE = [
    ("fp8_static", preset("fp8_static")),
    ("fp8_static_kv", preset("fp8_static").replace(k=QuantSpec("fp8"), v=QuantSpec("fp8"))),
    ("int4_g16_asym_wo", QuantScheme("int4_g16_asym", weight=G16.replace(symmetric=False))),
]


@pytest.mark.parametrize(
    "moe,scheme",
    [(False, LAYERWISE[1][1]), (False, LAYERWISE[2][1]), (True, LAYERWISE[0][1]), (True, LAYERWISE[2][1])],
    ids=["dense-fp8_static_kv", "dense-int4_g16_asym_wo", "moe-fp8_static", "moe-int4_g16_asym_wo"],
)
def test_layerwise_calibration_gives_the_same_scales(tmp_path, moe, scheme):
    """Streamed from the checkpoint, one decoder layer at a time, calibration sets every scale
    bit for bit as the whole-model forward does, and the skeleton never holds a weight."""
    from qatlib.checkpoint.keys import scale_state_dict
    from qatlib.ptq import calibrate_from_checkpoint, calibrate_layerwise
    from qatlib.zero3.onload import Onloader

    d, model = _saved(tmp_path, tiny_qwen3_moe_config() if moe else tiny_qwen3_config())
    static = scheme.input is not None
    ref_report = calibrate(model, scheme, _batches())
    ref = scale_state_dict(model)
    skel, report, scales = calibrate_from_checkpoint(d, scheme, _batches() if static else _NoBatches())
    assert scales.keys() == ref.keys()
    assert [k for k in ref if not torch.equal(ref[k], scales[k])] == []
    assert report.to_dict() == ref_report.to_dict()
    assert report.num_batches == (2 if static else 0)
    assert all(p.is_meta for n, p in skel.named_parameters() if "quantizer" not in n)
    # the same loop over a model held in host memory (GPTQ's and small models' case)
    resident, _ = _saved(tmp_path / "r", tiny_qwen3_moe_config() if moe else tiny_qwen3_config())
    from qatlib.models import load_model

    resident = load_model(resident)
    _, scales2 = calibrate_layerwise(resident, scheme, _batches(), Onloader.resident(resident))
    assert all(torch.equal(ref[k], scales2[k]) for k in ref)
    # the PTQ checkpoint written from the streamed scales is the whole-model one
    a = save_ptq_checkpoint(model, scheme, tmp_path / "a", calibration=ref_report)
    b = save_ptq_checkpoint(skel, scheme, tmp_path / "b", calibration=report, scales=scales)
    # (not the bytes: safetensors writes a two-entry metadata map in no fixed order)
    ta, tb = (_st(x / "scales.safetensors") for x in (a, b))
    assert (
        ta[1] == tb[1]
        and ta[0].keys() == tb[0].keys()
        and all(torch.equal(ta[0][k], tb[0][k]) for k in ta[0])
    )
    assert json.loads((a / "quant_scheme.json").read_text()) == json.loads(
        (b / "quant_scheme.json").read_text()
    )


def test_layerwise_calibration_refuses_what_it_cannot_run(tmp_path):
    from qatlib.ptq import calibrate_from_checkpoint

    d, _ = _saved(tmp_path, tiny_qwen3_config())
    with pytest.raises(ValueError, match="lm_head.input_quantizer"):  # the head is never run
        calibrate_from_checkpoint(d, preset("fp8_static"), _batches(), ignore=())
    with pytest.raises(ValueError, match="no calibration batch"):
        calibrate_from_checkpoint(d, preset("fp8_static"), [])


def test_layerwise_calibration_keeps_the_deploy_ties(tmp_path):
    """Under ``deploy.target`` (scales tied as the runtime fuses them, `qatlib.quant.tying`), the
    streamed calibration of a meta skeleton gives the whole-model scales bit for bit, and the tied
    quantizers still share ONE real Parameter after `onload.realize_quantizers` (it had untied
    them, and the skeleton's meta ``initialized`` flags stopped `tying.tie`)."""
    from qatlib.checkpoint.keys import scale_state_dict
    from qatlib.ptq import calibrate_from_checkpoint
    from qatlib.quant.linear import PrepareOptions
    from qatlib.runtime.tying import tie_for

    scheme, opts = preset("fp8_static"), PrepareOptions(deploy=tie_for("vllm"))
    d, model = _saved(tmp_path, tiny_qwen3_moe_config())
    ref_report = calibrate(model, scheme, _batches(), options=opts)
    ref = scale_state_dict(model)
    skel, report, scales = calibrate_from_checkpoint(d, scheme, _batches(), options=opts)
    assert scales.keys() == ref.keys() and [k for k in ref if not torch.equal(ref[k], scales[k])] == []
    assert report.to_dict() == ref_report.to_dict()
    attn = skel.model.layers[0].self_attn
    shared = {id(getattr(attn, n).input_quantizer.scale) for n in ("q_proj", "k_proj", "v_proj")}
    assert len(shared) == 1 and not attn.q_proj.input_quantizer.scale.is_meta
    assert bool(attn.q_proj.input_quantizer.initialized)
