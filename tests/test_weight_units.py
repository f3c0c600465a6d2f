"""Weight steps in units of each tensor's size (`qatlib.trainers.weight_units`,
``quant_config.weight_update: relative``): the units, one AdamW step against Adam written out by
hand, the hook's life across optimizers, and the config / trainer wiring. The ZeRO-3 2-rank parity
(units summed from the partitions, the steps) is
``test_trainers.py::test_zero3_weight_training_with_a_partitioned_original_teacher_matches_single_process[relative]``."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import build_model, tiny_qwen3_config
from test_trainers import SCHEME, make_data, prepared_model, targs

from qatlib.data import PadCollator
from qatlib.losses import LossConfig
from qatlib.ptq import calibrate
from qatlib.quant import prepare
from qatlib.trainers.end2end import QATTrainer
from qatlib.trainers.params import Learnable, param_groups, select_trainable
from qatlib.trainers.weight_units import (
    WEIGHT_UNIT,
    install_weight_unit_steps,
    unit_groups,
    unit_of_rms,
    weight_units,
)


def test_unit_is_the_power_of_two_nearest_the_rms_in_log_scale():
    assert unit_of_rms(0.3) == 0.25  # log2 0.3 = -1.74
    assert unit_of_rms(0.17) == 0.125  # -2.56
    assert unit_of_rms(1e5) == 2.0**17  # 16.61
    assert unit_of_rms(1.0) == 1.0
    assert unit_of_rms(0.0) == 1.0 and unit_of_rms(float("nan")) == 1.0
    w = [torch.full((3, 4), 0.3), torch.tensor([[3.0, -4.0]]), torch.zeros(2)]  # RMS 0.3, 3.54, 0
    assert weight_units(w) == [0.25, 4.0, 1.0]


def hand_adam_first_step(w: float, g: float, c: float, lr: float, eps: float) -> float:
    """torch's AdamW, first step, no weight decay, on theta = w / c with gradient c * g: bias
    correction makes m_hat = c g and v_hat = (c g)^2, so theta moves by lr * c g / (|c g| + eps)."""
    gt = c * g
    return (w / c - lr * gt / (abs(gt) + eps)) * c


def test_one_step_moves_each_tensor_in_its_own_units():
    """Two weights 6 orders of magnitude apart (the upcycled MoE's q_proj ~0.2 and o_proj ~1e5,
    whose gradients are ~1e-5 of the others'). Absolute steps would move o_proj by ~lr x 1e-3 (its
    gradient below Adam's eps); in units, each element moves lr x c(1 - O(eps / |c g|))."""
    lr, eps = 1e-2, 1e-8
    small = torch.nn.Parameter(torch.full((4,), 0.2))
    big = torch.nn.Parameter(torch.full((4,), 1e5))
    g_small = torch.tensor([1e-3, -2e-3, 5e-4, 1e-3])
    g_big = torch.tensor([3e-11, -1e-11, 2e-11, -5e-11])
    units = weight_units([small, big])
    assert units == [0.25, 2.0**17]
    groups = unit_groups([small, big], units, lr=lr, weight_decay=0.0, name="weight")
    assert [(g["name"], g["lr"], g[WEIGHT_UNIT]) for g in groups] == [
        ("weight@2^-2", lr * 0.25, 0.25),
        ("weight@2^17", lr * 2.0**17, 2.0**17),
    ]
    opt = install_weight_unit_steps(torch.optim.AdamW(groups, eps=eps))
    ((g_small * small).sum() + (g_big * big).sum()).backward()  # dL/dw = g
    opt.step()
    for p, g, w0, c in ((small, g_small, 0.2, 0.25), (big, g_big, 1e5, 2.0**17)):
        want = torch.tensor(
            [hand_adam_first_step(w0, gi, c, lr, eps) for gi in g.tolist()], dtype=torch.float64
        )
        torch.testing.assert_close(p.detach().double(), want, rtol=2e-7, atol=0)
    # o_proj moved by ~lr x its unit (1310), not ~lr x 2^17 x 1e-3 as its raw gradient would give
    assert (big.detach() - 1e5).abs().min() > 0.99 * lr * 2.0**17


def test_weight_decay_is_relative_to_the_weight_as_with_absolute_steps():
    """AdamW multiplies the decay by the group's lr (lr x c): the group's decay is divided by c, so
    a weight without gradient shrinks by the factor (1 - lr x weight_decay), whatever its unit."""
    lr, wd = 1e-2, 0.1
    ps = [torch.nn.Parameter(torch.full((2,), v)) for v in (0.2, 1e5)]
    opt = install_weight_unit_steps(
        torch.optim.AdamW(unit_groups(ps, weight_units(ps), lr=lr, weight_decay=wd, name="weight"))
    )
    for p in ps:
        p.grad = torch.zeros_like(p)
    opt.step()
    torch.testing.assert_close(ps[0].detach(), torch.full((2,), 0.2 * (1 - lr * wd)))
    torch.testing.assert_close(ps[1].detach(), torch.full((2,), 1e5 * (1 - lr * wd)))


def test_a_second_optimizer_replaces_the_hook_and_an_additive_one_removes_it():
    p = torch.nn.Parameter(torch.full((2,), 1e3))  # unit 1024
    g = torch.tensor([1.0, -2.0])
    for _ in range(2):  # built twice (a two-phase run): the gradient is c g, not c^2 g
        install_weight_unit_steps(
            torch.optim.AdamW(unit_groups([p], [1024.0], lr=1.0, weight_decay=0.0, name="w"))
        )
    p.grad = None
    (g * p).sum().backward()
    torch.testing.assert_close(p.grad, 1024.0 * g)
    install_weight_unit_steps(torch.optim.AdamW([{"params": [p], "lr": 1.0}]))
    p.grad = None
    (g * p).sum().backward()
    torch.testing.assert_close(p.grad, g)


def test_frozen_weight_in_a_unit_group_is_refused():
    p = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    with pytest.raises(ValueError, match=r"weight@2\^2.*requires_grad=False"):
        install_weight_unit_steps(
            torch.optim.AdamW(unit_groups([p], [4.0], lr=1.0, weight_decay=0.0, name="weight"))
        )


def test_trainer_groups_the_weights_by_unit(tmp_path):
    """QATTrainer(weight_update="relative"): scales keep their group, the weights go in one group
    per unit at weight_lr x c, and a step moves a weight of unit c by ~weight_lr x c."""
    model = build_model(tiny_qwen3_config(), seed=0)
    with torch.no_grad():  # one linear 2^10 x its size, as the MoE's o_proj is 1e5 x the others'
        model.model.layers[0].self_attn.o_proj.weight.mul_(1024.0)
    prepare(model, SCHEME)
    calibrate(model, SCHEME, [torch.tensor([d["input_ids"]]) for d in make_data(2, seed=99)])
    tp = select_trainable(model, Learnable(), weights=True)
    wlr = 1e-4
    tr = QATTrainer(
        model,
        targs(tmp_path, max_steps=1),
        loss_config=LossConfig(loss_type="kl", lm_loss_weight=0.0, kd_loss_weight=1.0),
        trainable=tp,
        weight_lr=wlr,
        weight_update="relative",
        teacher=build_model(tiny_qwen3_config(), seed=0).eval(),
        train_dataset=make_data(),
        data_collator=PadCollator(0),
        log_file=False,
    )
    opt = tr.create_optimizer()
    want = weight_units([p for _, p in tp.weight])
    got = {g["name"]: (g["lr"], len(g["params"])) for g in opt.param_groups if g["name"].startswith("weight")}
    assert got == {f"weight@2^{int(math.log2(c))}": (wlr * c, want.count(c)) for c in set(want)}
    assert len(got) >= 2  # o_proj's unit is its own
    o = model.model.layers[0].self_attn.o_proj.weight
    c_o = want[[id(p) for _, p in tp.weight].index(id(o))]
    before = o.detach().clone()
    tr.train()
    step = (o.detach() - before).abs()
    # Adam's first step: ~weight_lr x c per element (to the fp32 spacing of weights ~20); additive: weight_lr
    assert step.max().item() == pytest.approx(wlr * c_o, rel=1e-2)


def test_param_groups_refuses_units_that_do_not_match_the_weights():
    model = prepared_model()
    tp = select_trainable(model, Learnable(), weights=True)
    with pytest.raises(ValueError, match="weight units for"):
        param_groups(tp, lr=1e-3, weight_lr=1e-4, weight_units=[1.0])
