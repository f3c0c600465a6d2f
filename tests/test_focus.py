"""Upstream FOCUS's FP4 QAT (configs/qwen3/fp4, AngelSlim 67394ce): MXFP4 scales rounded up
(``mxfp4_rceil``) and learned sub-group scales (``use_subgroup_scale`` / ``num_sub``).

The arithmetic against hand-computed values and against upstream's own forward (re-typed from
angelslim/compressor/qat/modules/quantizer.py), the gradients, what the four YAMLs mean, and each
file run on a tiny Qwen3: PTQ, a few QAT steps (one process), the export; then what a runtime
computes from the export (the emulator, and vLLM's own load for NVFP4) is the trained weight."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
import upstream_compat as uc
from conftest import build_model, local_texts, stage_script, tiny_qwen3_config

from qatlib.quant import QuantScheme, QuantSpec, prepare
from qatlib.quant import functional as F
from qatlib.quant.fq_linear import fake_quant_linear
from qatlib.quant.quantizer import ROLE_SUBGROUP, SUBGROUP_LOGIT_INIT, Quantizer
from qatlib.quant.spec import Granularity, ScaleRule, SpecError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
QC = "compression.QAT.plugin_config.quant_config"
MX = QuantSpec("mxfp4", Granularity.GROUP, group_size=32, scale_rule=ScaleRule.CEIL, subgroups=4)
NV = QuantSpec("nvfp4", Granularity.GROUP, group_size=16, subgroups=2)


def _logit(c: float) -> float:
    return math.log(c / (1.0 - c))


# --------------------------------------------------------------------------- ceil-rounded MX scales
def test_mx_ceil_scale_hand_values():
    amax = torch.tensor([6.0, 6.5, 3.0, 3.0000002, 12.0, 6.4, 1e-3, 0.0, 1e38])
    got = F.mx_ceil_scale_from_amax(amax)
    # 2 ** ceil(log2(amax / 6)): 6 -> 2**0; 6.5 -> 2**1; 3 -> exactly 2**-1; just above 3 -> 2**0;
    # 12 -> 2**1; 1e-3 / 6 = 1.67e-4 -> 2**-12; a zero group -> 2**-127; 1e38 / 6 -> 2**124
    want = [1.0, 2.0, 0.5, 1.0, 2.0, 2.0, 2.0**-12, 2.0**-127, 2.0**124]
    assert got.tolist() == want
    # where it differs from compressed-tensors' rule (qatlib's mxfp4): a group max of mantissa 1.6
    # (6.4 = 1.6 * 4) rounds up to scale 2 (max / s = 3.2), CT clips it at scale 1 (6.4 -> 6)
    assert F.mx_scale_from_amax(torch.tensor([6.4, 6.0, 7.0])).tolist() == [1.0, 1.0, 2.0]
    # upstream's 2 ** ceil(log2(m)) on values away from a power of two: the same
    x = torch.rand(10000) * torch.logspace(-6, 6, 10000)
    m = x / 6.0
    far = (torch.log2(m) - torch.log2(m).round()).abs() > 1e-5
    upstream = torch.exp2(torch.ceil(torch.log2(m)))
    assert torch.equal(F.mx_ceil_scale_from_amax(x)[far], upstream[far])
    # one ulp above a power of two: log2 rounds onto the integer upstream (so its max clips by an
    # ulp); the exponent read from the bits does not
    above = torch.tensor([0.25]).nextafter(torch.tensor([1.0])) * 6.0
    assert F.mx_ceil_scale_from_amax(above).item() == 0.5


def test_ceil_rule_spec_and_dynamic_activations():
    with pytest.raises(SpecError) as e:
        QuantSpec("nvfp4", Granularity.GROUP, group_size=16, scale_rule="ceil")
    assert e.value.field == "scale_rule"
    a = QuantSpec("mxfp4", Granularity.GROUP, group_size=32, dynamic=True, scale_rule="ceil")
    x = torch.tensor([[6.4] + [0.3] * 31])
    s, _ = F.compute_qparams(x, a)
    assert s.item() == 2.0  # ceil rule; the runtime's (CT) rule would give 1
    # 6.4 / 2 = 3.2 -> 3 -> 6.0; 0.3 / 2 = 0.15 -> 0 (below 0.25)
    assert F.dynamic_fake_quantize(x, a)[0, :2].tolist() == [6.0, 0.0]
    assert (
        a.to_dict()["scale_rule"] == "ceil"
        and "scale_rule" not in a.replace(scale_rule="compressed-tensors").to_dict()
    )


# --------------------------------------------------------------------------- sub-group scales
def test_subgroup_fake_quant_hand_values():
    """One MXFP4 group of 32 at scale 1, four sub-groups of 8 with factors c = 0.5, 1, 0.8, 0.25:
    each weight is divided by c before the E2M1 rounding, the code is multiplied by the scale alone."""
    q = Quantizer(MX, (1, 32))
    q.set_qparams(torch.ones(1, 1))
    with torch.no_grad():
        q.subgroup_logit.copy_(torch.tensor([[_logit(0.5), 20.0, _logit(0.8), _logit(0.25)]]))
    x = torch.full((1, 32), 1.3)
    x[0, 31] = 4.0  # 4 / 0.25 = 16: clamped to 6
    got = q(x)[0]
    # 1.3 / 0.5 = 2.6 -> 3; 1.3 / 1 -> 1.5; 1.3 / 0.8 = 1.625 -> 1.5; 1.3 / 0.25 = 5.2 -> 6
    assert got[:8].tolist() == [3.0] * 8 and got[8:16].tolist() == [1.5] * 8
    assert got[16:24].tolist() == [1.5] * 8 and got[24:31].tolist() == [6.0] * 7 and got[31].item() == 6.0
    # NVFP4: global scale 1, E4M3 group scale 1 -> effective 1; two sub-groups of 8 (c = 0.5, 1)
    n = Quantizer(NV, (1, 16))
    n.set_qparams(torch.ones(1, 1))
    with torch.no_grad():
        n.global_scale.fill_(1.0)
        n.subgroup_logit.copy_(torch.tensor([[_logit(0.5), 20.0]]))
    assert n(torch.full((1, 16), 1.3))[0].tolist() == [3.0] * 8 + [1.5] * 8
    # the codes carry the factor: dequantize(quantize(.)) is the fake-quantized weight
    s, _ = q.qparams()
    codes = F.quantize(x, s, None, MX, subgroup_scale=q.subgroup_scale())
    assert torch.equal(F.dequantize(codes, s, None, MX), got.unsqueeze(0))
    with pytest.raises(ValueError, match="sub-group scales are missing"):
        F.fake_quantize(x, s, None, MX)


def test_subgroup_spec_and_quantizer_parameters():
    assert MX.describe() == "mxfp4 per-group g32 sym static ceil-scales 4-subgroups"
    assert QuantSpec.from_dict(MX.to_dict()) == MX
    for bad, field in (
        (dict(qtype="int4", group_size=32, subgroups=2), "subgroups"),
        (dict(qtype="mxfp4", group_size=32, subgroups=5), "subgroups"),
        (dict(qtype="mxfp4", group_size=32, subgroups=2, dynamic=True), "subgroups"),
    ):
        with pytest.raises(SpecError) as e:
            QuantSpec(granularity=Granularity.GROUP, **bad)
        assert e.value.field == field
    q = Quantizer(NV, (8, 64))
    assert q.subgroup_logit.shape == (8, 64 // 16 * 2) and q.subgroup_logit.dtype == torch.float32
    assert torch.all(q.subgroup_logit == SUBGROUP_LOGIT_INIT)
    q = q.to(torch.bfloat16)  # fp32 masters survive a model cast
    assert q.subgroup_logit.dtype == torch.float32
    with pytest.raises(ValueError, match="LWC do not combine"):
        Quantizer(NV, (8, 64), lwc_init=4.0)


def _upstream_fp4_element(t: torch.Tensor) -> torch.Tensor:
    """Upstream's `_quant_fp4_element` (ebits 2, mbits 3, max_norm 6, mantissa_rounding "even")."""
    exp = torch.floor(torch.log2(t.abs() + (t == 0).float())).clip(min=0.0)
    t = t / 2.0**exp * 2.0
    a = t.abs()
    t = torch.sign(t) * (torch.floor(a + 0.5) - ((a - 0.5) % 2 == 0).float())
    return torch.clamp(t / 2.0 * 2.0**exp, -6, 6)


def _upstream_mxfp4(x: torch.Tensor, quant_max_scale: torch.Tensor, num_sub: int) -> torch.Tensor:
    """Upstream's `_fake_quant_mxfp4` forward (l.796-840) with ``max_scale`` at its init, 1."""
    t = x.reshape(-1, 32).float()
    max_val = t.abs().amax(-1, keepdim=True)
    e = torch.where(max_val == 0, torch.ones_like(max_val), torch.ceil(torch.log2(max_val / 6.0)))
    scale = 2.0 ** e.clamp(-127, 127)
    qs = scale.expand(scale.shape[0], num_sub).reshape(-1, 1) * torch.sigmoid(quant_max_scale).reshape(-1, 1)
    t = (t.reshape(-1, 32 // num_sub) / qs).reshape(-1, 32)
    t = _upstream_fp4_element(torch.clamp(t, -6, 6)) * scale
    return t.reshape(x.shape)


def test_focus_mxfp4_equals_upstreams_forward():
    """qatlib's MXFP4 FOCUS weight quantizer at its initial scales (2 ** ceil(log2(amax / 6)): what
    upstream computes with max_scale 1) and upstream's forward: the same values, bit for bit."""
    torch.manual_seed(0)
    w = torch.randn(16, 128) * torch.logspace(-3, 1, 128)
    q = Quantizer(MX, w.shape)
    q.init_from(w)
    logits = torch.randn(q.subgroup_logit.shape) * 2 + 2
    with torch.no_grad():
        q.subgroup_logit.copy_(logits)
    assert torch.equal(q(w), _upstream_mxfp4(w, logits, 4))
    # the sub-group factors moved codes: a plain MXFP4 rounding at the same scales differs
    assert not torch.equal(q(w), F.fake_quantize(w, q.qparams()[0], None, MX.replace(subgroups=None)))


def test_subgroup_gradients():
    """Through the STE: d out / d x = 1 / c, d out / d c = -s * (x / (s c)) / c inside the range
    (hand values), and the fused linear's written-out backward equals autograd's."""
    q = Quantizer(MX, (1, 32))
    q.set_qparams(torch.ones(1, 1))
    with torch.no_grad():
        q.subgroup_logit.copy_(torch.tensor([[_logit(0.5), 20.0, _logit(0.8), _logit(0.25)]]))
    x = torch.full((1, 32), 1.3, requires_grad=True)
    c = q.subgroup_scale().detach().requires_grad_(True)
    s, _ = q.qparams()
    out = F.fake_quantize(x, s.detach(), None, MX, subgroup_scale=c)
    out.sum().backward()
    assert x.grad[0, 0].item() == pytest.approx(2.0)  # 1 / 0.5
    assert c.grad[0, 0].item() == pytest.approx(-8 * 1.3 / 0.5 / 0.5, rel=1e-6)  # 8 elements of -s v / c
    assert c.grad[0, 3].item() == pytest.approx(-8 * 1.3 / 0.25 / 0.25, rel=1e-5)  # 5.2 < 6: inside
    torch.manual_seed(1)
    for spec in (MX, NV):
        w = torch.randn(8, 64)
        q = Quantizer(spec, w.shape)
        q.init_from(w)
        with torch.no_grad():
            q.subgroup_logit.normal_(2.0, 1.0)
        for mode in ("mask", "pass"):
            q.clamp_grad = mode
            xin = torch.randn(3, 64)
            grads = []
            for fused in (False, True):
                wv = w.clone().requires_grad_(True)
                if fused:
                    sc, zp = q.qparams(wv)
                    y = fake_quant_linear(
                        xin, wv, None, sc, zp, spec, clamp_grad=mode,
                        global_scale=q.global_scale_for(wv), subgroup_scale=q.subgroup_scale(),
                    )  # fmt: skip
                else:
                    y = torch.nn.functional.linear(xin, q(wv))
                y.pow(2).sum().backward()
                grads.append([wv.grad] + [p.grad.clone() for p in q.parameters()])
                q.zero_grad()
            for a, b in zip(*grads):
                assert b.abs().max() > 0
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * b.abs().max().item())  # fp32 sums


def test_subgroup_logits_are_their_own_optimizer_group():
    from qatlib.trainers.params import Learnable, param_groups, select_trainable

    model = build_model(tiny_qwen3_config())
    prepare(
        model,
        QuantScheme(
            "focus", weight=NV, input=QuantSpec("nvfp4", Granularity.GROUP, group_size=16, dynamic=True)
        ),
    )
    tp = select_trainable(model, Learnable(weight_scale=True))
    assert tp.subgroup and all(n.endswith("weight_quantizer.subgroup_logit") for n, _ in tp.subgroup)
    groups = {g["name"]: g for g in param_groups(tp, lr=1e-2, scale_update="log", subgroup_lr=1e-3)}
    assert groups["subgroup"]["lr"] == 1e-3 and "log_space" not in groups["subgroup"]  # additive logits
    assert not select_trainable(model, Learnable(weight_scale=False, act_scale=True)).subgroup
    from qatlib.quant.quantizer import PARAM_ROLES

    assert PARAM_ROLES["subgroup_logit"] == ROLE_SUBGROUP


# --------------------------------------------------------------------------- the YAMLs
def test_focus_configs_mean_what_upstream_means():
    for rel in uc.FOCUS_RUNS:
        cfg = uc.load(rel)
        s = cfg.quant_scheme()
        assert cfg.zero3_enabled and cfg.scale_update == "log"  # FP4 scales: upstream's relative steps
        assert cfg.qat.save_format == ("real" if "_real" in rel else "fake")
        assert cfg.learnable().weight_scale and not cfg.learnable().act_scale
        if "nvfp4" in rel:
            assert s.name == "nvfp4" and s.weight == NV
            assert s.input == QuantSpec("nvfp4", Granularity.GROUP, group_size=16, dynamic=True)
            assert cfg.qat.plugin_config.quant_config.learnable.quant_max_scale_lr == 1e-3
        else:  # upstream names w4a8_fp8; its plugin blocks make it MXFP4: a scheme of no preset
            assert s.name == "custom" and s.weight == MX
            assert s.input == QuantSpec(
                "mxfp4", Granularity.GROUP, group_size=32, dynamic=True, scale_rule="ceil"
            )
            assert cfg.qat.plugin_config.quant_config.learnable.quant_max_scale_lr == 5e-2
    rel = uc.FOCUS_RUNS[2]  # mxfp4: without use_subgroup_scale, upstream's num_sub is read by nothing
    plain = uc.load(rel, **{f"{QC}.weight.use_subgroup_scale": False}).quant_scheme()
    assert plain.weight.subgroups is None and plain.weight.scale_rule is ScaleRule.CEIL
    no_num = uc.load(rel, **{f"{QC}.weight.num_sub": None}).quant_scheme()
    assert no_num.weight.subgroups == 4  # upstream's default num_sub
    explicit = uc.load(rel, **{f"{QC}.scale_update": "additive"})
    assert explicit.scale_update == "additive"


# --------------------------------------------------------------------------- each file, run
@pytest.fixture(scope="module")
def focus_runs(tiny_tokenizer, tmp_path_factory):
    """Each FOCUS file on a tiny Qwen3 (in_features divisible by 32): its PTQ (`run_ptq`), two QAT
    steps through ``scripts/qat.py`` in one process (the YAML's DeepSpeed ZeRO-3 JSON dropped: the
    workflow runs it under torchrun) and ``scripts/export.py``'s export (the file's save_format)."""
    from qatlib.config import load_config
    from qatlib.pipeline import run_ptq

    root = tmp_path_factory.mktemp("focus")
    model = root / "model"
    build_model(tiny_qwen3_config(hidden_size=128, head_dim=32, intermediate_size=256)).save_pretrained(model)
    tiny_tokenizer.save_pretrained(model)
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in local_texts(20)))
    qat, export = stage_script("qat"), stage_script("export")
    out = {}
    for rel in uc.FOCUS_RUNS:
        d = root / rel.rsplit("/", 1)[1].removesuffix(".yaml")
        sets = {
            **uc.local_overrides(rel, str(model), str(data), str(d / "ptq")),
            "compression.QAT.hf_args.deepspeed": None,
            "compression.QAT.hf_args.bf16": False,
            "compression.QAT.hf_args.max_steps": 2,
            "compression.QAT.hf_args.gradient_accumulation_steps": 1,
            "compression.QAT.hf_args.per_device_train_batch_size": 1,
            "dataset.max_seq_length": 32,
            "dataset.num_samples": 4,
        }
        cfg = load_config(uc.UPSTREAM / rel, {**sets, "global.save_path": str(d / "ptq")})
        run_ptq(cfg, progress=False)

        argv = _argv(rel, sets)
        assert qat.main([*argv(model, d / "qat"), "--from-ptq-ckpt", str(d / "ptq")]) == 0
        assert export.main(argv(d / "qat", d / "export")) == 0
        out[rel] = (cfg, d)
    return out


def _argv(rel: str, sets: dict):
    """A stage script's arguments for ``rel`` with ``sets`` (and ``global.save_path``) overridden."""

    def argv(model_path, save) -> list[str]:
        a = ["-c", str(uc.UPSTREAM / rel), "--model-path", str(model_path), "--save-path", str(save)]
        for k, v in {**sets, "global.save_path": str(save)}.items():
            a += ["--set", f"{k}={json.dumps(v)}"]
        return [*a, "--no-progress"]

    return argv


def _trained(cfg, d):
    """The QAT model reloaded with its trained scales: its fake-quantized weights by linear."""
    from qatlib.models import load_prepared
    from qatlib.quant import quant_linears

    model, _ = load_prepared(cfg, d / "qat", scales=d / "qat", complete=True)
    with torch.no_grad():
        return model, {n: ql.fake_quant_weight().float() for n, ql in quant_linears(model)}


@pytest.mark.parametrize("rel", uc.FOCUS_RUNS, ids=[r.rsplit("/", 1)[1] for r in uc.FOCUS_RUNS])
def test_focus_file_trains_and_exports_what_it_trained(rel, focus_runs):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from qatlib.runtime.emulate import emulate_export
    from qatlib.runtime.emulate_fp4 import DeployedFP4Linear

    cfg, d = focus_runs[rel]
    log = [json.loads(x) for x in (d / "qat" / "train_log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log] == [1, 2] and all(math.isfinite(x["loss"]) for x in log)
    scales = load_file(d / "qat" / "scales.safetensors")
    logits = {k: v for k, v in scales.items() if k.endswith(".weight_quantizer.subgroup_logit")}
    assert len(logits) == 14 and any(not torch.all(v == SUBGROUP_LOGIT_INIT) for v in logits.values())
    model, trained = _trained(cfg, d)
    exp = d / "export"
    info = json.loads((exp / "qatlib_export.json").read_text())
    if "_real" not in rel:  # fake: transformers reloads the trained fake-quantized weights exactly
        reloaded = AutoModelForCausalLM.from_pretrained(exp, dtype=torch.float32)
        for name, w in trained.items():
            assert torch.equal(reloaded.get_submodule(name).weight.float(), w), name
        return
    notes = " ".join(info["compressed_tensors"]["runtime_notes"])
    assert "sub-group scales" in notes and "folded into the E2M1 codes" in notes
    changes = " ".join(info["compressed_tensors"]["changes"])
    assert ("ceil-rounded E8M0" in changes) == ("mxfp4" in rel)
    # what vLLM computes from the export: codes x group scale (x 1 / global scale), the trained weight
    dep = emulate_export(exp, "vllm")
    n = 0
    for name, mod in dep.model.named_modules():
        if isinstance(mod, DeployedFP4Linear):
            w = mod.weight if mod.global_scale is None else mod.weight * (1.0 / mod.global_scale)
            torch.testing.assert_close(w, trained[name], rtol=2.0**-22, atol=0.0)
            n += 1
    assert n == 14


def test_focus_nvfp4_export_as_vllm_loads_it(focus_runs):
    """vLLM 0.33's own load of the FOCUS NVFP4 export (`qatlib.runtime.oracle`): its effective
    weights are the trained fake-quantized ones (rtol 2**-22: vLLM scales each E4M3 group scale by the
    inverted global scale before the code, two fp32 roundings). MXFP4 W4A4: vLLM picks no MXFP4 kernel
    on a CPU without amd-quark, so there the emulator's check above stands alone."""
    from qatlib.runtime import oracle

    if oracle.vllm_version() is None:
        pytest.skip("vllm is not installed (pip install --no-deps -r requirements/runtime-oracle.txt)")
    rel = uc.FOCUS_RUNS[1]
    assert rel.endswith("nvfp4_w4a4_real_zero3.yaml")
    cfg, d = focus_runs[rel]
    _, trained = _trained(cfg, d)
    with oracle.vllm_loaded(d / "export") as vm:
        for name, w in trained.items():
            torch.testing.assert_close(
                oracle.vllm_linear(vm, name).weight.float(), w, rtol=2.0**-22, atol=0.0
            )


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("rel", [r for r in uc.FOCUS_RUNS if "_real" in r], ids=["nvfp4", "mxfp4"])
def test_focus_file_as_shipped_trains_under_zero3_on_two_ranks(rel, tiny_tokenizer, tmp_path):
    """The FOCUS file with its own DeepSpeed JSON (ds_config_zero3_focus.json: ZeRO-3, bf16,
    reentrant gradient checkpointing), local paths and a 2-step budget only: ``scripts/qat.py`` under
    torchrun on 2 CPU ranks from the file's PTQ, then the export; the runtime computes the trained
    weights."""
    import os
    import subprocess

    from conftest import REPO_ROOT, multirank_device

    from qatlib.config import load_config
    from qatlib.pipeline import run_ptq
    from qatlib.runtime.emulate import emulate_export
    from qatlib.runtime.emulate_fp4 import DeployedFP4Linear

    multirank_device(2)
    model = tmp_path / "model"
    build_model(tiny_qwen3_config(hidden_size=128, head_dim=32, intermediate_size=256)).save_pretrained(model)
    tiny_tokenizer.save_pretrained(model)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in local_texts(20)))
    sets = {
        **uc.local_overrides(rel, str(model), str(data), str(tmp_path / "ptq")),
        "compression.QAT.hf_args.max_steps": 2,
        "compression.QAT.hf_args.gradient_accumulation_steps": 1,
        "compression.QAT.hf_args.per_device_train_batch_size": 1,
        "dataset.max_seq_length": 32,
        "dataset.num_samples": 4,
    }
    cfg = load_config(uc.UPSTREAM / rel, {**sets, "global.save_path": str(tmp_path / "ptq")})
    assert cfg.zero3_enabled and cfg.deepspeed_config_path.name == "ds_config_zero3_focus.json"
    run_ptq(cfg, progress=False)
    argv = _argv(rel, sets)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [str(REPO_ROOT / "scripts" / "qat.py"), *argv(model, tmp_path / "qat")]
    cmd += ["--from-ptq-ckpt", str(tmp_path / "ptq")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    meta = json.loads((tmp_path / "qat" / "run_metadata.json").read_text())
    assert meta["world_size"] == 2 and meta["zero_stage"] == 3
    assert stage_script("export").main(argv(tmp_path / "qat", tmp_path / "export")) == 0
    _, trained = _trained(cfg, tmp_path)
    dep = emulate_export(tmp_path / "export", "vllm")
    n = 0
    for name, mod in dep.model.named_modules():
        if isinstance(mod, DeployedFP4Linear):
            w = mod.weight if mod.global_scale is None else mod.weight * (1.0 / mod.global_scale)
            torch.testing.assert_close(w, trained[name], rtol=2.0**-22, atol=0.0)
            n += 1
    assert n == 14


def test_the_memory_plan_counts_the_subgroup_logits():
    """`qatlib.plan` sizes the trainable quantizer tensors: FOCUS adds ``subgroups`` logits per group
    (NVFP4: 2 per 16 weights beside the one group scale, MXFP4 4 per 32), trained with their Adam state."""
    from qatlib.plan import from_experiment

    for rel, (g, n) in zip(uc.FOCUS_RUNS, ((16, 2), (16, 2), (32, 4), (32, 4)), strict=True):
        cfg = uc.load(rel)
        w = from_experiment(cfg.raw, cfg.deepspeed_config).weight
        assert (w.bits, w.group_size, w.subgroups) == (4, g, n)
        assert w.scales(8, 64) == 8 * (64 // g) * (1 + n)
        plain = uc.load(rel, **{f"{QC}.weight.use_subgroup_scale": False})
        assert from_experiment(plain.raw, plain.deepspeed_config).weight.scales(8, 64) == 8 * (64 // g)
