"""Log-space scale steps (`qatlib.trainers.log_scale`, ``quant_config.scale_update: log``): the
steps against a hand-written Adam on ``log(scale)``, the groups, and the trainer / config wiring.
The ZeRO-3 2-rank parity of the same steps is ``test_zero3.py::test_qat_steps_match_single_process[dense_log]``."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import build_model, tiny_qwen3_config
from test_trainers import make_data, prepared_model, targs

from qatlib.data import PadCollator
from qatlib.losses import LossConfig
from qatlib.quant import PrepareOptions, QuantScheme, QuantSpec, prepare, quant_linears
from qatlib.quant.spec import Granularity
from qatlib.trainers.end2end import QATTrainer
from qatlib.trainers.log_scale import LOG_SPACE, install_log_space_steps
from qatlib.trainers.params import Learnable, param_groups, select_trainable


def hand_adam_log(s0, grads, lr, betas=(0.9, 0.999), eps=1e-8):
    """Adam (torch's bias-corrected form, no weight decay) on u = log(s), written out per element
    in float64: du = lr * m_hat / (sqrt(v_hat) + eps), with g_u = s * g_s."""
    s = [float(v) for v in s0]
    m = [0.0] * len(s)
    v = [0.0] * len(s)
    for t, g in enumerate(grads, start=1):
        for i in range(len(s)):
            gu = s[i] * float(g[i])
            m[i] = betas[0] * m[i] + (1 - betas[0]) * gu
            v[i] = betas[1] * v[i] + (1 - betas[1]) * gu * gu
            mh, vh = m[i] / (1 - betas[0] ** t), v[i] / (1 - betas[1] ** t)
            s[i] = math.exp(math.log(s[i]) - lr * mh / (math.sqrt(vh) + eps))
    return s


def test_log_steps_equal_a_hand_written_adam_on_log_scale():
    # scales 4 orders of magnitude apart (an int4 g16 scale, an fp8 one, an NVFP4 E4M3 group scale):
    # each moves by the same RELATIVE amount; additive Adam would take the small ones below 0
    s0 = torch.tensor([5e-3, 1e-4, 64.0, 0.3])
    grads = [
        torch.tensor([1.0, 2.0, -0.5, 3.0]),
        torch.tensor([0.5, -1.0, -0.25, 1.0]),
        torch.tensor([2.0, 1.0, 1.0, -1.0]),
    ]
    p = torch.nn.Parameter(s0.clone())
    opt = install_log_space_steps(
        torch.optim.AdamW([{"params": [p], "lr": 0.1, "weight_decay": 0.0, LOG_SPACE: True}])
    )
    for g in grads:
        opt.zero_grad()
        (g * p).sum().backward()  # d L / d s = g
        opt.step()
    want = torch.tensor(hand_adam_log(s0.tolist(), [g.tolist() for g in grads], 0.1), dtype=torch.float32)
    torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=0)
    # first step alone: every element moved by the factor exp(-+lr), whatever its size
    q = torch.nn.Parameter(s0.clone())
    opt = install_log_space_steps(
        torch.optim.AdamW([{"params": [q], "lr": 0.1, "weight_decay": 0.0, LOG_SPACE: True}])
    )
    (grads[0] * q).sum().backward()
    # the gradient is d L / d log s as soon as backward ends (what clipping and ZeRO-3 see)
    torch.testing.assert_close(q.grad, grads[0] * s0)
    opt.step()
    torch.testing.assert_close(q.detach() / s0, torch.exp(-0.1 * torch.sign(grads[0])), rtol=1e-5, atol=0)


def test_gradient_clipping_sees_the_gradient_in_log_units():
    """The norm a trainer clips (HF's ``max_grad_norm``, DeepSpeed's ``gradient_clipping``) is taken
    between backward and step: over d L / d log s for log-space scales. A scale of 2e-8 (the upcycled
    MoE's q_proj input scales) with d L / d s = 1e5 is 2e-3 in log units; taken in scale units it was a
    norm of 1e5 that clipping to 1 divided every gradient by, the weight's too."""
    s = torch.nn.Parameter(torch.tensor([2e-8, 1e-3]))
    w = torch.nn.Parameter(torch.tensor([0.5]))
    opt = install_log_space_steps(
        torch.optim.AdamW(
            [
                {"params": [s], "lr": 1e-2, "weight_decay": 0.0, LOG_SPACE: True},
                {"params": [w], "lr": 1e-4, "weight_decay": 0.0},
            ]
        )
    )
    (torch.tensor([1e5, 2.0]) * s).sum().add(3.0 * w.sum()).backward()
    torch.testing.assert_close(s.grad, torch.tensor([2e-3, 2e-3]))
    norm = torch.nn.utils.clip_grad_norm_([s, w], max_norm=1.0)
    want = math.sqrt(2 * 2e-3**2 + 3.0**2)  # 3.0000013: the weight's gradient dominates
    assert norm.item() == pytest.approx(want, rel=1e-6)
    torch.testing.assert_close(w.grad, torch.tensor([3.0 / want]))
    opt.step()
    assert s.detach()[0].item() == pytest.approx(2e-8 * math.exp(-1e-2), rel=1e-5)  # a relative step


def test_the_latest_optimizer_decides_the_gradient_units():
    """A two-phase run builds several optimizers over the same scales: the chain rule is applied
    once however many log-space optimizers held the scale, and not at all once an additive one does."""
    p = torch.nn.Parameter(torch.tensor([0.25, 4.0]))
    for _ in range(2):
        install_log_space_steps(torch.optim.AdamW([{"params": [p], "weight_decay": 0.0, LOG_SPACE: True}]))
    (torch.tensor([1.0, 1.0]) * p).sum().backward()
    torch.testing.assert_close(p.grad, torch.tensor([0.25, 4.0]))
    install_log_space_steps(torch.optim.AdamW([{"params": [p], "weight_decay": 0.0}]))
    p.grad = None
    (torch.tensor([1.0, 1.0]) * p).sum().backward()
    torch.testing.assert_close(p.grad, torch.tensor([1.0, 1.0]))


def test_groups_without_the_flag_step_as_plain_adamw():
    a, b = torch.nn.Parameter(torch.tensor([0.5, 2.0])), torch.nn.Parameter(torch.tensor([0.5, 2.0]))
    plain = torch.optim.AdamW([a], lr=0.1, weight_decay=0.0)
    hooked = install_log_space_steps(torch.optim.AdamW([{"params": [b], "lr": 0.1, "weight_decay": 0.0}]))
    for opt, p in ((plain, a), (hooked, b)):
        p.grad = torch.tensor([1.0, -1.0])
        opt.step()
    assert torch.equal(a, b) and torch.allclose(a, torch.tensor([0.4, 2.1]))


def test_weight_decay_in_a_log_group_is_refused():
    p = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="'scale'.*weight decay"):
        install_log_space_steps(
            torch.optim.AdamW([{"params": [p], "weight_decay": 0.01, LOG_SPACE: True, "name": "scale"}])
        )


def test_a_frozen_scale_in_a_log_group_is_refused():
    """The chain rule is a gradient hook, which torch registers only on a tensor that requires grad:
    a scale frozen when the optimizer is built and unfrozen later would step its raw d L / d s."""
    s, t = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2), requires_grad=False)
    with pytest.raises(ValueError, match="'scale'.*1 parameter.*requires_grad=False"):
        install_log_space_steps(
            torch.optim.AdamW([{"params": [s, t], "weight_decay": 0.0, LOG_SPACE: True, "name": "scale"}])
        )
    # a frozen tensor in an additive group is the optimizer's business, not ours
    install_log_space_steps(torch.optim.AdamW([{"params": [t], "weight_decay": 0.0}]))


def test_param_groups_put_positive_scales_in_log_space_and_zero_points_additive():
    asym = QuantScheme("asym-w4", weight=QuantSpec("int4", Granularity.GROUP, group_size=16, symmetric=False))
    model = prepare(build_model(tiny_qwen3_config()), asym, options=PrepareOptions())
    tp = select_trainable(model, Learnable())
    groups = param_groups(tp, lr=1e-2, weight_decay=0.1, scale_update="log")
    by = {g["name"]: g for g in groups}
    assert set(by) == {"scale", "zero_point"}
    assert by["scale"][LOG_SPACE] is True and by["scale"]["weight_decay"] == 0.0
    assert not by["zero_point"].get(LOG_SPACE) and by["zero_point"]["weight_decay"] == 0.1
    ids = lambda ps: {id(p) for p in ps}  # noqa: E731
    quantizers = [ql.weight_quantizer for _, ql in quant_linears(model)]
    assert ids(by["scale"]["params"]) == ids(q.scale for q in quantizers)
    assert ids(by["zero_point"]["params"]) == ids(q.zero_point for q in quantizers)
    assert [g["name"] for g in param_groups(tp, lr=1e-2)] == ["scale"]  # additive: one group as before
    with pytest.raises(ValueError, match="scale_update"):
        param_groups(tp, lr=1e-2, scale_update="relative")


def test_trainer_steps_scales_relatively_and_config_reaches_it(tmp_path):
    """An lr of 0.05 is a 5% step in log space: on the tiny model's int4 scales (~7e-3) the
    additive rule takes them below 0 in one step (the guard stops that, see test_trainers.targs)."""
    model = prepared_model()
    before = {
        n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("weight_quantizer.scale")
    }
    tr = QATTrainer(
        model,
        targs(tmp_path, learning_rate=0.05, max_steps=1, adam_epsilon=1e-20),
        loss_config=LossConfig(),
        scale_update="log",
        train_dataset=make_data(),
        data_collator=PadCollator(0),
        log_file=False,
    )
    tr.train()
    assert {g["name"]: bool(g.get(LOG_SPACE)) for g in tr.optimizer.param_groups} == {"scale": True}
    ratios = torch.cat(
        [(dict(model.named_parameters())[n].detach() / v).flatten() for n, v in before.items()]
    )
    moved = ratios[ratios != 1]
    assert moved.numel() > 0.9 * ratios.numel()
    # one Adam step (constant lr, no warm-up, eps ~0): each moved element by exp(+-0.05)
    torch.testing.assert_close(torch.log(moved).abs(), torch.full_like(moved, 0.05), rtol=2e-3, atol=0)


def test_scale_update_is_a_checked_config_key(tmp_path):
    from qatlib.config import ConfigError, load_config

    cfg_path = tmp_path / "exp.yaml"
    (tmp_path / "train.jsonl").write_text('{"text": "hello"}\n')
    body = (
        "model: {name: Qwen, model_path: /nonexistent}\n"
        "dataset: {name: TextDataset, data_path: train.jsonl}\n"
        "compression:\n  name: QAT\n  quantization: {name: fp8_static}\n"
        "  QAT:\n    plugin_config:\n      quant_config: {scale_update: %s}\n"
    )
    cfg_path.write_text(body % "log")
    assert load_config(cfg_path).qat.plugin_config.quant_config.scale_update == "log"
    cfg_path.write_text(body % "relative")
    with pytest.raises(ConfigError, match="scale_update"):
        load_config(cfg_path)


def test_blockwise_steps_scales_in_log_space(tmp_path):
    """Blockwise (``scale_update: log`` reaches it from the config through `train_blockwise`): the
    quantizer group is a log-space group; with lr 0.05 one step (one epoch of one batch per block)
    moves each scale by a factor of at most exp(+-0.05) (Adam's first step is ~lr per element): an
    additive step of 0.05 would take the tiny model's scales (~7e-3) below 0."""
    from qatlib.trainers.blockwise import BlockwiseSettings, BlockwiseTrainer

    model = prepared_model()
    before = {
        n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("weight_quantizer.scale")
    }
    g = torch.Generator().manual_seed(1)
    samples = [torch.randint(0, 64, (16,), generator=g) for _ in range(3)]
    settings = BlockwiseSettings(
        epochs=1, batch_size=2, train_size=2, val_size=1, training_seqlen=16, quant_lr=0.05, weight_lr=0.0
    )
    tr = BlockwiseTrainer(model, settings, calibrate_activations=False, scale_update="log")
    opt = tr._optimizer(model.model.layers[0], "model.layers.0")
    assert [(g["name"], bool(g.get(LOG_SPACE))) for g in opt.param_groups] == [("quant", True)]
    tr.train(samples)
    params = dict(model.named_parameters())
    r = torch.cat([(params[n].detach() / v).flatten() for n, v in before.items()])
    assert (r[r != 1] > 0).all() and r[r != 1].numel() > 0.5 * r.numel()
    step = torch.log(r[r != 1]).abs()  # relative: at most lr (Adam: ~lr where |grad| >> eps)
    assert 0.04 < step.max() <= 0.05 * (1 + 1e-5)
    with pytest.raises(ValueError, match="scale_update"):
        BlockwiseTrainer(model, settings, scale_update="relative")


MXFP4_W = QuantScheme("mxfp4-w", weight=QuantSpec("mxfp4", Granularity.GROUP, group_size=32))


def test_e8m0_rate_crosses_the_power_of_two_bucket_the_common_rate_cannot():
    """Why E8M0 scales need their own rate, by hand: a master on 2^-4 (where `mx_scale_from_amax`
    puts it, the centre of `round_e8m0`'s bucket) under L = log s (d L / d log s = 1, constant)
    moves by exactly lr per constant-lr Adam step in log space. 30 steps at 1e-2: log2 s = -4 - 0.3 / ln 2 = -4.433, still
    rounds to 2^-4 (the forward never changes); at the default 5 x 1e-2: -4 - 1.5 / ln 2 = -6.164,
    rounds to 2^-6."""
    from qatlib.quant.functional import round_e8m0
    from qatlib.trainers.params import quantizer_groups

    def train(e8m0_scale_lr):
        p = torch.nn.Parameter(torch.full((4,), 2.0**-4))
        groups = quantizer_groups(
            [("w.weight_quantizer.scale", p)],
            lr=1e-2,
            scale_update="log",
            e8m0={id(p)},
            e8m0_scale_lr=e8m0_scale_lr,
        )
        opt = install_log_space_steps(torch.optim.AdamW(groups, eps=1e-30))
        for _ in range(30):
            opt.zero_grad()
            torch.log(p).sum().backward()  # L = log s: the scale wants to shrink, d L / d log s = 1
            opt.step()
        return p.detach()

    stuck = train(1e-2)
    torch.testing.assert_close(torch.log2(stuck), torch.full((4,), -4 - 0.3 / math.log(2)), rtol=0, atol=1e-5)
    assert torch.equal(round_e8m0(stuck), torch.full((4,), 2.0**-4))
    moved = train(None)  # the library's default for E8M0 scales
    torch.testing.assert_close(torch.log2(moved), torch.full((4,), -4 - 1.5 / math.log(2)), rtol=0, atol=1e-5)
    assert torch.equal(round_e8m0(moved), torch.full((4,), 2.0**-6))


def test_param_groups_give_e8m0_scales_their_own_group():
    """Selected by the quantizer's scale format (MXFP4 -> E8M0), not by name: under log the MXFP4
    weight scales form ``scale_e8m0`` at 5 x lr; an NVFP4 model (E4M3 group scales, fp32 global
    scales) has no such group; additive keeps one group unless ``e8m0_scale_lr`` is set."""
    from qatlib.trainers.log_scale import E8M0_LOG_LR_FACTOR

    model = prepare(build_model(tiny_qwen3_config()), MXFP4_W, options=PrepareOptions())
    tp = select_trainable(model, Learnable())
    ids = lambda ps: {id(p) for p in ps}  # noqa: E731
    scales = ids(ql.weight_quantizer.scale for _, ql in quant_linears(model))
    assert len(scales) == 14 and tp.e8m0 == scales
    by = {g["name"]: g for g in param_groups(tp, lr=1e-2, scale_update="log")}
    assert set(by) == {"scale_e8m0"} and ids(by["scale_e8m0"]["params"]) == scales
    assert by["scale_e8m0"]["lr"] == pytest.approx(5e-2) and E8M0_LOG_LR_FACTOR == 5.0
    assert by["scale_e8m0"][LOG_SPACE] is True and by["scale_e8m0"]["weight_decay"] == 0.0
    by = {g["name"]: g for g in param_groups(tp, lr=1e-2, scale_update="log", e8m0_scale_lr=0.03)}
    assert by["scale_e8m0"]["lr"] == 0.03
    assert [(g["name"], g["lr"]) for g in param_groups(tp, lr=1e-3)] == [("scale", 1e-3)]
    assert [(g["name"], g["lr"]) for g in param_groups(tp, lr=1e-3, e8m0_scale_lr=2e-3)] == [
        ("scale_e8m0", 2e-3)
    ]
    nv = QuantScheme("nvfp4-w", weight=QuantSpec("nvfp4", Granularity.GROUP, group_size=16))
    tp_nv = select_trainable(
        prepare(build_model(tiny_qwen3_config()), nv, options=PrepareOptions()), Learnable()
    )
    assert not tp_nv.e8m0
    assert [g["name"] for g in param_groups(tp_nv, lr=1e-2, scale_update="log")] == ["scale"]


@pytest.mark.parametrize("explicit", [None, 0.03])
def test_e8m0_scales_get_their_own_lr_from_the_config(tmp_path, tiny_tokenizer, explicit):
    """``quant_config.e8m0_scale_lr`` (default: 5 x learning_rate in log space) reaches the
    end-to-end trainer's optimizer (which then trains) and the blockwise one."""
    from test_trainers import _experiment

    from qatlib.config import parse_config
    from qatlib.data import training_data_from_config
    from qatlib.trainers.blockwise import BlockwiseTrainer
    from qatlib.trainers.end2end import train_end2end

    tok_dir = tmp_path / "tok"
    tiny_tokenizer.save_pretrained(tok_dir)
    qc = {"lazy_init_samples": 2, "scale_update": "log"}
    if explicit is not None:
        qc["e8m0_scale_lr"] = explicit
    d, _ = _experiment(tmp_path, tok_dir, raw=True, plugin_config={"quant_config": qc})
    d["compression"]["quantization"] = {"name": "mxfp4_weight_only"}
    d["compression"]["QAT"]["hf_args"]["learning_rate"] = 1e-2
    cfg = parse_config(d)
    want = 5e-2 if explicit is None else explicit
    model = prepare(build_model(tiny_qwen3_config()), cfg.quant_scheme())
    tr = train_end2end(cfg, model, tiny_tokenizer, training_data_from_config(cfg, tiny_tokenizer))
    assert {g["name"]: g["initial_lr"] for g in tr.optimizer.param_groups} == {
        "scale_e8m0": pytest.approx(want)
    }
    bw = BlockwiseTrainer(
        model,
        cfg.blockwise(),
        scale_update="log",
        e8m0_scale_lr=cfg.qat.plugin_config.quant_config.e8m0_scale_lr,
    )
    opt = bw._optimizer(model.model.layers[0], "model.layers.0")
    q_lr = cfg.blockwise().quant_lr
    assert [(g["name"], g["lr"]) for g in opt.param_groups if g["name"] != "weight"] == [
        ("quant_e8m0", pytest.approx(5 * q_lr if explicit is None else explicit))
    ]


def test_e8m0_scale_lr_is_a_checked_config_key(tmp_path):
    from test_trainers import _experiment

    from qatlib.config import ConfigError, parse_config

    d, _ = _experiment(tmp_path, tmp_path, raw=True, plugin_config={"quant_config": {"e8m0_scale_lr": 0}})
    with pytest.raises(ConfigError, match="e8m0_scale_lr"):
        parse_config(d)
