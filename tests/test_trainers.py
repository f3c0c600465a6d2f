"""End-to-end QAT trainer on tiny models: learnable switches, GA invariance, teacher, logging, resume."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, build_model, one_thread, tiny_qwen3_config, tiny_qwen3_moe_config, torchrun
from transformers import TrainerCallback, TrainingArguments

from qatlib import device as qdevice
from qatlib.data import PadCollator
from qatlib.losses import LossConfig
from qatlib.ptq import calibrate
from qatlib.quant import PrepareOptions, QuantScheme, QuantSpec, prepare, quantization_disabled
from qatlib.quant.spec import PRESETS, Granularity
from qatlib.runtime.tying import tie_for
from qatlib.trainers.end2end import LOG_FILE, QATTrainer, read_log
from qatlib.trainers.params import Learnable, select_trainable

SCHEME = QuantScheme(
    "test-w4a8-kv8",
    weight=QuantSpec("int4", Granularity.GROUP, group_size=16),
    input=QuantSpec("int8"),
    q=QuantSpec("int8"),
    k=QuantSpec("int8"),
    v=QuantSpec("int8"),
)


def make_data(n: int = 8, seed: int = 0, lengths=(12, 16, 9, 16, 14, 10, 16, 16)):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, VOCAB, (lengths[i % len(lengths)],), generator=g).tolist()
        labels = list(ids)
        k = min((i * 3) % 7, len(ids) - 2)  # a masked "prompt" of varying length
        labels[:k] = [-100] * k
        out.append({"input_ids": ids, "labels": labels})
    return out


def prepared_model(*, lwc: bool = False, seed: int = 0, scheme: QuantScheme = SCHEME):
    model = build_model(tiny_qwen3_config(), seed=seed)
    prepare(model, scheme, options=PrepareOptions(lwc_init=4.0 if lwc else None))
    calibrate(model, scheme, [torch.tensor([d["input_ids"]]) for d in make_data(2, seed=99)])
    return model


def targs(tmp_path, on_device: bool = False, **kw):
    """Trainer arguments of a tiny run. ``on_device``: train where the suite runs (the GPU on a CUDA
    machine, `qatlib.device.use_cpu`); the other tests call the model themselves with CPU tensors."""
    base = dict(
        output_dir=str(tmp_path / "out"),
        max_steps=2,
        per_device_train_batch_size=2,
        # 1e-2 drove the tiny model's weight scales (~7e-3) below 0 in one Adam step: the guard stops that
        learning_rate=1e-4,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=qdevice.use_cpu() if on_device else True,
        disable_tqdm=True,
        lr_scheduler_type="constant",
        seed=0,
    )
    base.update(kw)
    return TrainingArguments(**base)


def snapshot(model):
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def changed(before, model):
    return {n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach().cpu())}


# --------------------------------------------------------------------------- learnable switches
SWITCH_SUFFIXES = {
    "weight_scale": (".weight_quantizer.scale",),
    "act_scale": (".input_quantizer.scale",),
    "kv_scale": ("k_proj.output_quantizer.scale", "v_proj.output_quantizer.scale"),
    "norm": ("norm.weight",),
    "lwc": (".weight_quantizer.clip_factor_w_max", ".weight_quantizer.clip_factor_w_min"),
}


@pytest.mark.device_aware
@pytest.mark.parametrize("switch", list(SWITCH_SUFFIXES))
def test_learnable_switch_trains_exactly_its_tensors(switch, tmp_path):
    model = prepared_model(lwc=switch == "lwc")
    flags = dict.fromkeys(("act_scale", "weight_scale", "kv_scale", "norm", "lwc"), False)
    flags[switch] = True
    learnable = Learnable(**flags)
    selected = select_trainable(model, learnable).names()
    assert selected and all(n.endswith(SWITCH_SUFFIXES[switch]) for n in selected)
    if switch == "norm":  # selected by type: every RMSNorm, incl. q_norm / k_norm and the final norm
        assert {"model.norm.weight", "model.layers.0.self_attn.q_norm.weight"} <= selected
    before = snapshot(model)
    tr = QATTrainer(
        model,
        targs(tmp_path, on_device=True),
        loss_config=LossConfig(),
        learnable=learnable,
        train_dataset=make_data(),
        data_collator=PadCollator(0),
        log_file=False,
    )
    tr.train()
    assert changed(before, model) == selected
    assert {n for n, p in model.named_parameters() if p.requires_grad} == selected
    # q-projection output scales belong to no switch
    assert not any("q_proj.output_quantizer" in n for n in selected)


def test_lwc_gets_its_own_learning_rate(tmp_path):
    model = prepared_model(lwc=True)
    tr = QATTrainer(
        model,
        targs(tmp_path),
        loss_config=LossConfig(),
        learnable=Learnable(act_scale=True, lwc=True),
        lwc_lr=0.5,
        train_dataset=make_data(),
        data_collator=PadCollator(0),
        log_file=False,
    )
    opt = tr.create_optimizer()
    assert {g["name"]: g["lr"] for g in opt.param_groups} == {"scale": 1e-4, "lwc": 0.5}


def test_weights_train_at_weight_lr_with_a_separate_teacher(tmp_path):
    """Full QAT (weights + scales, straight-through): the weight group gets ``weight_lr``, one step
    moves the linear weights and scales only, and the separate teacher stays untouched."""
    model = prepared_model()
    teacher = build_model(tiny_qwen3_config(), seed=0).eval()  # the unprepared base model
    tp = select_trainable(model, Learnable(), weights=True)
    tr = QATTrainer(
        model,
        targs(tmp_path, max_steps=1),
        loss_config=LossConfig(loss_type="kl", lm_loss_weight=0.0, kd_loss_weight=1.0),
        trainable=tp,
        weight_lr=3e-4,
        teacher=teacher,
        train_dataset=make_data(),
        data_collator=PadCollator(0),
        log_file=False,
    )
    opt = tr.create_optimizer()
    assert {g["name"]: g["lr"] for g in opt.param_groups} == {"scale": 1e-4, "weight": 3e-4}
    before, t_before = snapshot(model), snapshot(teacher)
    tr.train()
    moved = changed(before, model)
    assert any(n.endswith("proj.weight") for n in moved) and any(
        n.endswith("weight_quantizer.scale") for n in moved
    )
    assert all(n.endswith(("proj.weight", "proj.bias", "weight_quantizer.scale")) for n in moved), moved
    assert not changed(t_before, teacher)


@pytest.mark.device_aware
def test_gradient_checkpointing_still_trains_scales(tmp_path):
    """All weights frozen + checkpointed blocks: the trainer makes the inputs require grad."""
    model = prepared_model()
    before = snapshot(model)
    tr = QATTrainer(
        model,
        targs(tmp_path, on_device=True, max_steps=1, activation_checkpointing=True),
        loss_config=LossConfig(),
        train_dataset=make_data(),
        data_collator=PadCollator(0),
        log_file=False,
    )
    tr.train()
    assert changed(before, model) == tr.trainable.names() != set()


# --------------------------------------------------------------------------- gradient accumulation
class GradRecorder(TrainerCallback):
    def __init__(self, model):
        self.model, self.grads = model, []

    def on_pre_optimizer_step(self, args, state, control, **kw):
        self.grads.append(
            {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}
        )


def test_gradient_accumulation_is_mean_over_all_valid_tokens(tmp_path):
    """GA=2 x batch 2 == GA=1 x batch 4 on the same 4 samples (sequential order), whose two
    micro-batches hold 30 and 6 valid tokens (a mean of per-micro-batch means would weight the
    second one's tokens 5x too much).

    Gradients agree to rtol 1e-4 (atol 1e-5 of the largest |g|: only float summation order
    differs), and so do the scales after one AdamW step; adam_epsilon=1 makes that step ~ lr * g,
    so it is sensitive to the gradient's scale (with the default eps the first step is lr * sign(g))."""
    data = make_data(4, lengths=(16,))
    for i, k in enumerate((1, 1, 13, 13)):
        data[i]["labels"] = [-100] * k + data[i]["input_ids"][k:]
    results = []
    for ga, bs in ((1, 4), (2, 2)):
        model = prepared_model()
        rec = GradRecorder(model)
        tr = QATTrainer(
            model,
            targs(
                tmp_path / f"ga{ga}",
                max_steps=1,
                per_device_train_batch_size=bs,
                gradient_accumulation_steps=ga,
                max_grad_norm=0.0,
                adam_epsilon=1.0,
                learning_rate=1e-4,  # 1.0 stepped activation scales below 0 (the guard stops that)
                train_sampling_strategy="sequential",
            ),
            loss_config=LossConfig(loss_type="kl", kd_loss_weight=1.0),
            learnable=Learnable(act_scale=True),
            train_dataset=data,
            data_collator=PadCollator(0),
            callbacks=[rec],
            log_file=False,
        )
        tr.train()
        results.append((rec.grads[0], snapshot(model), tr.state.log_history[0]))
    (g1, p1, l1), (g2, p2, l2) = results
    assert g1.keys() == g2.keys() and g1
    gmax = max(g.abs().max().item() for g in g1.values())
    for n in g1:
        torch.testing.assert_close(g2[n], g1[n], rtol=1e-4, atol=1e-5 * gmax)
    moved = 0
    for n in p1:
        torch.testing.assert_close(p2[n], p1[n], rtol=1e-5, atol=1e-5 * gmax)
        moved += n in g1
    assert moved == len(g1)
    assert l1["tokens"] == l2["tokens"] == 36
    assert l2["loss"] == pytest.approx(l1["loss"], rel=1e-5)
    assert l2["total_loss"] == pytest.approx(l1["total_loss"], rel=1e-5)


# --------------------------------------------------------------------------- teacher
class ForwardCounter:
    def __init__(self, model):
        self.n = 0
        model.register_forward_hook(lambda *a: setattr(self, "n", self.n + 1))


def test_no_teacher_forward_when_kd_off(tmp_path):
    for loss, expect_teacher in (
        (LossConfig(), 0),
        (LossConfig(loss_type="origin", kd_loss_weight=1.0), 0),
        (LossConfig(loss_type="rkl", kd_loss_weight=0.5), 2),
    ):
        model = prepared_model()
        fc = ForwardCounter(model)
        tr = QATTrainer(
            model,
            targs(tmp_path),
            loss_config=loss,
            train_dataset=make_data(),
            data_collator=PadCollator(0),
            log_file=False,
        )
        tr.train()
        assert tr.teacher_forwards == expect_teacher
        assert fc.n == 2 + expect_teacher  # 2 steps x 1 micro-batch, plus the teacher's


def test_teacher_is_the_unquantized_model_without_grad(tmp_path):
    model = prepared_model()
    tr = QATTrainer(
        model,
        targs(tmp_path),
        loss_config=LossConfig(loss_type="kl", kd_loss_weight=1.0),
        train_dataset=make_data(),
        data_collator=PadCollator(0),
        log_file=False,
    )
    batch = PadCollator(0)(make_data(2))
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    model.train()
    t = tr.teacher_logits(model, inputs)
    assert not t.requires_grad and model.training  # training mode restored
    with torch.no_grad(), quantization_disabled(model):
        ref = model(**inputs).logits
    quant = model(**inputs).logits
    torch.testing.assert_close(t, ref)
    assert not torch.allclose(t, quant)
    # a separate teacher is used as given
    other = build_model(tiny_qwen3_config(), seed=5)
    tr2 = QATTrainer(
        prepared_model(),
        targs(tmp_path),
        loss_config=LossConfig(loss_type="kl", kd_loss_weight=1.0),
        teacher=other,
        train_dataset=make_data(),
        data_collator=PadCollator(0),
        log_file=False,
    )
    with torch.no_grad():
        torch.testing.assert_close(tr2.teacher_logits(tr2.model, inputs), other(**inputs).logits)
    assert not any(p.requires_grad for p in other.parameters())


# --------------------------------------------------------------------------- logging
def test_log_components_are_token_weighted_interval_means(tmp_path):
    calls = []

    class Recording(QATTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            n0 = self._acc.clone()
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            calls.append((self.state.global_step, self._acc - n0))
            return out

    loss = LossConfig(loss_type="cakld", lm_loss_weight=0.5, kd_loss_weight=2.0)
    model = prepared_model()
    tr = Recording(
        model,
        targs(
            tmp_path,
            max_steps=4,
            logging_steps=2,
            gradient_accumulation_steps=2,
            per_device_train_batch_size=1,
        ),
        loss_config=loss,
        train_dataset=make_data(),
        data_collator=PadCollator(0),
    )
    tr.train()
    logs = [h for h in tr.state.log_history if "loss" in h]
    lines = read_log(tmp_path / "out" / LOG_FILE)
    assert [h["step"] for h in logs] == [2, 4] and [x["step"] for x in lines] == [2, 4]
    keys = ["lm_loss", "kd/cakld", "kd/forward_kl", "kd/backward_kl", "total_loss"]
    for h, line in zip(logs, lines):
        for k in keys + ["loss", "learning_rate", "grad_norm", "tokens"]:
            assert line[k] == pytest.approx(h[k])
        assert h["total_loss"] == pytest.approx(0.5 * h["lm_loss"] + 2.0 * h["kd/cakld"], rel=1e-6)
    # interval 1 = micro-batches of steps 0..1 (4 micro-batches): sum of sums / sum of tokens
    for interval, h in zip(((0, 1), (2, 3)), logs):
        acc = sum(d for s, d in calls if s in interval)
        for i, k in enumerate(tr._acc_keys):
            assert h[k] == pytest.approx(acc[i].item() / acc[-1].item(), rel=1e-9)
        assert h["tokens"] == int(acc[-1].item())


def test_resumed_log_has_one_line_per_step(tmp_path):
    path = tmp_path / "out" / LOG_FILE
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3, 4)))
    model = prepared_model()
    tr = QATTrainer(
        model,
        targs(tmp_path, max_steps=1),
        loss_config=LossConfig(),
        train_dataset=make_data(),
        data_collator=PadCollator(0),
    )
    tr.state.global_step = 2  # as after resuming from checkpoint-2
    tr._append_log_line({"step": 3, "loss": 2.0})
    assert [x["step"] for x in read_log(path)] == [1, 2, 3] and read_log(path)[-1]["loss"] == 2.0


# --------------------------------------------------------------------------- it learns
def test_short_qat_run_lowers_the_distillation_loss(tmp_path):
    """int3 g16 weights (learnable scales) on a tiny model with peaked outputs; 12 steps of KL to
    the unquantized model on fixed data lower the KL by more than 15%% (measured: ~30%%)."""
    scheme = QuantScheme("int3", weight=QuantSpec("int3", Granularity.GROUP, group_size=16))
    model = build_model(tiny_qwen3_config(initializer_range=0.1))
    prepare(model, scheme)
    tr = QATTrainer(
        model,
        targs(tmp_path, max_steps=12, logging_steps=3, learning_rate=1e-3),
        loss_config=LossConfig(loss_type="kl", lm_loss_weight=0.0, kd_loss_weight=1.0),
        train_dataset=make_data(8),
        data_collator=PadCollator(0),
        log_file=False,
    )
    tr.train()
    kl = [h["kd/kl"] for h in tr.state.log_history if "kd/kl" in h]
    assert len(kl) == 4 and kl[0] > 0.05
    assert kl[-1] < 0.85 * kl[0], kl


# --------------------------------------------------------------------------- resume
class Crash(TrainerCallback):
    def __init__(self, at):
        self.at = at

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.at:
            raise RuntimeError("killed")


def _scales(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "quantizer" in n}


def test_resume_from_checkpoint_reaches_the_same_scales(tmp_path):
    data = make_data(8)
    kw = dict(
        max_steps=4,
        save_strategy="steps",
        save_steps=2,
        learning_rate=1e-4,
        lr_scheduler_type="cosine",
        warmup_steps=1,
    )
    loss = LossConfig(loss_type="cakld", kd_loss_weight=1.0)
    learn = Learnable(act_scale=True, kv_scale=True)

    def trainer(out, callbacks=()):
        return QATTrainer(
            prepared_model(),
            targs(tmp_path / out, **kw),
            loss_config=loss,
            learnable=learn,
            train_dataset=data,
            data_collator=PadCollator(0),
            callbacks=list(callbacks),
        )

    full = trainer("a")
    full.train()
    crashed = trainer("b", [Crash(3)])
    with pytest.raises(RuntimeError, match="killed"):
        crashed.train()
    ckpt = tmp_path / "b" / "out" / "checkpoint-2"
    assert ckpt.is_dir()
    from qatlib.resume import classify_resume_dir

    assert classify_resume_dir(tmp_path / "b" / "out") == ("hf", ckpt)
    resumed = trainer("b")
    resumed.train(resume_from_checkpoint=str(ckpt))
    a, b = _scales(full.model), _scales(resumed.model)
    for n in a:
        torch.testing.assert_close(b[n], a[n], rtol=1e-6, atol=0)
    steps = [x["step"] for x in read_log(tmp_path / "b" / "out" / LOG_FILE)]
    assert steps == [1, 2, 3, 4]


def test_resume_from_saved_model_with_scales(tmp_path):
    from qatlib.resume import classify_resume_dir, load_saved_model
    from qatlib.zero3.save import save_consolidated

    src = prepared_model(seed=1)
    with torch.no_grad():
        for n, p in src.named_parameters():
            if n.endswith("input_quantizer.scale"):
                p.mul_(1.5)  # "trained" scales differ from a fresh calibration
    save_consolidated(src, tmp_path / "saved", scheme=SCHEME)
    kind, d = classify_resume_dir(tmp_path / "saved")
    assert kind == "saved"
    dst = prepared_model(seed=2)
    load_saved_model(dst, d)
    sd_src, sd_dst = src.state_dict(), dst.state_dict()
    assert sd_src.keys() == sd_dst.keys()
    for k in sd_src:
        torch.testing.assert_close(sd_dst[k], sd_src[k], rtol=0, atol=0)


# --------------------------------------------------------------------------- config driver
def _experiment(tmp_path, tokenizer_dir, *, raw: bool = False, **qat):
    from qatlib.config import parse_config

    data = tmp_path / "sft.jsonl"
    recs = [
        {
            "messages": [
                {"role": "user", "content": f"Say something about item {i}."},
                {"role": "assistant", "content": f"Item {i} is a fine thing to talk about."},
            ]
        }
        for i in range(8)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    base = {
        "loss_type": "cakld",
        "kd_loss_weight": 1.0,
        "hf_args": {
            "max_steps": 2,
            "per_device_train_batch_size": 2,
            "logging_steps": 1,
            "save_strategy": "no",
            "learning_rate": 1e-4,
            "disable_tqdm": True,
        },
        "plugin_config": {"quant_config": {"lazy_init_samples": 2, "learnable": {"act_scale": True}}},
    }
    base.update(qat)
    d = {
        "model": {"model_path": str(tokenizer_dir), "torch_dtype": "fp32"},
        "compression": {"name": "QAT", "quantization": {"name": "w4a8_fp8", "group_size": 16}, "QAT": base},
        "dataset": {"data_path": str(data), "max_seq_length": 64},
        "global": {"save_path": str(tmp_path / "run"), "seed": 0},
    }
    return (d if raw else parse_config(d)), data


def test_train_end2end_from_config_with_lazy_init_and_saved_resume(tmp_path, tiny_tokenizer):
    from qatlib.data import training_data_from_config
    from qatlib.trainers.end2end import train_end2end
    from qatlib.zero3.save import save_consolidated

    tok_dir = tmp_path / "tok"
    tiny_tokenizer.save_pretrained(tok_dir)
    cfg, data = _experiment(tmp_path, tok_dir)
    scheme = cfg.quant_scheme()
    ds = training_data_from_config(cfg, tiny_tokenizer)
    assert len(ds) == 8
    model = build_model(tiny_qwen3_config())
    prepare(model, scheme)
    inq = model.model.layers[0].mlp.up_proj.input_quantizer
    assert not bool(inq.initialized)
    tr = train_end2end(cfg, model, tiny_tokenizer, ds)
    assert bool(inq.initialized)  # lazy activation init ran on lazy_init_samples samples
    lines = read_log(tmp_path / "run" / LOG_FILE)
    assert [x["step"] for x in lines] == [1, 2] and {"lm_loss", "kd/cakld", "total_loss"} <= lines[0].keys()
    assert tr.teacher_forwards == 2
    # resume_ckpt_dir = a saved model with scales: loaded, no lazy init, training continues from it
    save_consolidated(model, tmp_path / "saved", scheme=scheme)
    cfg2, _ = _experiment(tmp_path, tok_dir, resume_ckpt_dir=str(tmp_path / "saved"), do_train=False)
    model2 = build_model(tiny_qwen3_config(), seed=3)
    model2.save_pretrained(tok_dir)  # model.model_path: the KD teacher when the resumed weights differ
    prepare(model2, scheme)
    tr2 = train_end2end(cfg2, model2, tiny_tokenizer, ds)
    assert tr2.teacher is not None  # another model's weights were loaded: the teacher is model_path's
    torch.testing.assert_close(model2.model.layers[0].mlp.up_proj.input_quantizer.scale, inq.scale)
    torch.testing.assert_close(
        model2.model.layers[1].self_attn.o_proj.weight, model.model.layers[1].self_attn.o_proj.weight
    )


@pytest.mark.parametrize("weight_update", ["additive", "relative"])
def test_config_weight_lr_trains_weights_against_the_original_teacher(
    tmp_path, tiny_tokenizer, weight_update
):
    """``quant_config.weight_lr`` from the config: the weights train at that rate (their own group;
    ``weight_update: relative``: one group per unit c at weight_lr x c, `qatlib.trainers.weight_units`),
    the scales at learning_rate in log space, and the KD teacher is model.model_path's model, a
    separate copy whose weights stay the original's."""
    from qatlib.data import training_data_from_config
    from qatlib.trainers.end2end import train_end2end

    tok_dir = tmp_path / "tok"
    tiny_tokenizer.save_pretrained(tok_dir)
    model = build_model(tiny_qwen3_config())
    model.save_pretrained(tok_dir)  # model.model_path: the teacher
    qc = {"lazy_init_samples": 2, "weight_lr": 3e-3, "scale_update": "log", "weight_update": weight_update}
    cfg, _ = _experiment(tmp_path, tok_dir, plugin_config={"quant_config": qc})
    scheme = cfg.quant_scheme()
    prepare(model, scheme)
    before = snapshot(model)
    tr = train_end2end(cfg, model, tiny_tokenizer, training_data_from_config(cfg, tiny_tokenizer))
    groups = {g["name"]: g for g in tr.optimizer.param_groups}
    assert groups["scale"].get("log_space") is True
    if weight_update == "additive":
        assert groups["weight"]["initial_lr"] == pytest.approx(3e-3)
    else:  # the tiny model's linears: RMS ~0.02, unit 2^-6
        units = {n: g["weight_unit"] for n, g in groups.items() if n.startswith("weight@")}
        assert units and "weight" not in groups
        for n, c in units.items():
            assert n == f"weight@2^{int(math.log2(c))}" and groups[n]["initial_lr"] == pytest.approx(3e-3 * c)
    assert tr.teacher is not None and tr.teacher is not model
    moved = changed(before, model)
    assert any(n.endswith("proj.weight") for n in moved) and any(
        n.endswith("weight_quantizer.scale") for n in moved
    )
    for n, p in tr.teacher.named_parameters():  # the teacher is the original, untouched
        assert torch.equal(p, before[n]), n


def test_resume_from_trained_weights_distils_toward_the_original_model(tmp_path, tiny_tokenizer):
    """Phase 2 of a two-phase recipe (end-to-end after a phase that trained the weights, e.g.
    blockwise with weight_lr > 0): the trained weights are loaded into the student, and the KD
    teacher is the ORIGINAL model of model.model_path, not the trained weights with quantizers off
    (those were fitted to be good after quantization; distilling toward them lost phase 1's gain)."""
    from qatlib.data import training_data_from_config
    from qatlib.trainers.end2end import train_end2end
    from qatlib.zero3.save import save_consolidated

    base_dir = tmp_path / "base"
    tiny_tokenizer.save_pretrained(base_dir)
    base = build_model(tiny_qwen3_config(), seed=4)
    base.save_pretrained(base_dir)
    cfg, _ = _experiment(tmp_path, base_dir)
    scheme = cfg.quant_scheme()
    ds = training_data_from_config(cfg, tiny_tokenizer)
    phase1 = prepare(copy.deepcopy(base), scheme)
    calibrate(phase1, scheme, [torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))])
    with torch.no_grad():  # "trained" weights
        for ql in (phase1.model.layers[0].self_attn.o_proj, phase1.model.layers[1].mlp.down_proj):
            ql.weight.mul_(1.3)
    save_consolidated(phase1, tmp_path / "phase1", scheme=scheme)
    cfg2, _ = _experiment(tmp_path, base_dir, resume_ckpt_dir=str(tmp_path / "phase1"), do_train=False)
    student = prepare(copy.deepcopy(base), scheme)
    tr = train_end2end(cfg2, student, tiny_tokenizer, ds)
    o = student.model.layers[0].self_attn.o_proj.weight
    assert torch.equal(o, phase1.model.layers[0].self_attn.o_proj.weight)  # phase 1's weights kept
    ids = torch.arange(2, 26).reshape(2, 12)
    with torch.no_grad():
        want = base(input_ids=ids).logits
        with quantization_disabled(student):
            trained_fp = student(input_ids=ids).logits
    got = tr.teacher_logits(student, {"input_ids": ids})
    assert (trained_fp - want).abs().max() > 1e-2  # the two candidate teachers do differ
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


# --------------------------------------------------------------------------- blockwise
def test_blockwise_lowers_block_mse_with_activation_quant_on(tmp_path):
    from qatlib.trainers.blockwise import BlockwiseSettings, BlockwiseTrainer, capture_first_block_inputs

    model = build_model(tiny_qwen3_config(initializer_range=0.1))
    scheme = QuantScheme(
        "w4a8", weight=QuantSpec("int4", Granularity.GROUP, group_size=16), input=QuantSpec("int8")
    )
    prepare(model, scheme)
    g = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, VOCAB, (32,), generator=g) for _ in range(6)]
    # activation quantizers really quantize while blocks train
    seen = []
    q0 = model.model.layers[0].mlp.down_proj.input_quantizer
    q0.register_forward_hook(
        lambda m, a, out: seen.append(
            (torch.is_grad_enabled(), m.enabled, m.calibrating, not torch.equal(out, a[0]))
        )
    )
    # what block 1 is trained on
    block1_inputs = []
    model.model.layers[1].register_forward_pre_hook(
        lambda m, a, kw: block1_inputs.append(a[0].detach().clone()) if torch.is_grad_enabled() else None,
        with_kwargs=True,
    )
    before = snapshot(model)
    tr = BlockwiseTrainer(
        model,
        BlockwiseSettings(
            epochs=4,
            batch_size=2,
            train_size=4,
            val_size=2,
            training_seqlen=32,
            quant_lr=1e-3,
            weight_lr=1e-4,
        ),
        log_file=tmp_path / "bw.jsonl",
    )
    res = tr.train(samples)
    assert res.blocks == 2 and len(res.log) == 8 and len(read_log(tmp_path / "bw.jsonl")) == 8
    for b in (0, 1):
        recs = [r for r in res.log if r["block"] == b]
        assert recs[-1]["train_loss"] < recs[0]["train_loss"] and "val_loss" in recs[0]
        assert recs[-1]["lr"]["quant"] == pytest.approx(1e-3 / 20)  # cosine to lr / min_lr_factor
    training_calls = [c for c in seen if c[0]]
    assert training_calls and all(
        enabled and not calib and quantized for _, enabled, calib, quantized in training_calls
    )
    assert bool(q0.initialized)  # calibrated on the block's quantized inputs first
    moved = changed(before, model)
    assert any(n.endswith("weight_quantizer.scale") for n in moved) and any(
        n.endswith("proj.weight") for n in moved
    )
    assert not any(n.startswith(("model.embed_tokens", "lm_head", "model.norm")) for n in moved)
    # block 1 was trained on the QUANTIZED outputs of the trained block 0
    inps, kws = capture_first_block_inputs(model, [torch.stack(samples[0:2])])
    with torch.no_grad():
        expect = model.model.layers[0](inps[0], **kws[0])
    torch.testing.assert_close(block1_inputs[0], expect[0] if isinstance(expect, tuple) else expect)


def test_token_relative_error_weighs_every_token_alike():
    """Hand values: two tokens with the same 20% relative error, one 10x the norm of the other.
    The element MSE is dominated by the large token; the per-token relative error is not."""
    from qatlib.trainers.blockwise import BLOCK_LOSSES, block_mse, token_relative_error

    target = torch.tensor([[[3.0, 4.0], [30.0, 40.0]]])  # norms 5 and 50
    out = target + torch.tensor([[[0.0, 1.0], [0.0, 10.0]]])  # errors 1 and 10
    assert token_relative_error(out, target).item() == pytest.approx((1 / 25 + 100 / 2500) / 2)
    assert block_mse(out, target).item() == pytest.approx((1 + 100) / 4)
    # the small token's error alone: all of it counts relatively, ~1% of the MSE
    small = target.clone()
    small[0, 0, 1] += 1.0
    assert token_relative_error(small, target).item() == pytest.approx(1 / 25 / 2)
    assert block_mse(small, target).item() == pytest.approx(1 / 4)
    assert BLOCK_LOSSES == {"mse": block_mse, "token_relative": token_relative_error}


def test_blockwise_trains_and_validates_with_the_configured_loss():
    """``loss: token_relative``: the first (only) step's logged training loss and the last epoch's
    validation loss are the per-token relative error of the block, recomputed here by hand."""
    from qatlib.trainers.blockwise import BlockwiseSettings, BlockwiseTrainer, capture_first_block_inputs

    model = build_model(tiny_qwen3_config(initializer_range=0.1))
    prepare(model, QuantScheme("w4", weight=QuantSpec("int4", Granularity.GROUP, group_size=16)))
    g = torch.Generator().manual_seed(1)
    samples = [torch.randint(0, VOCAB, (16,), generator=g) for _ in range(2)]
    inps, kws = capture_first_block_inputs(model, [s[None] for s in samples])

    def rel(out, tgt):  # by hand, float64
        o, t = out.double(), tgt.double()
        return ((o - t).pow(2).sum(-1) / t.pow(2).sum(-1)).mean().item()

    b0 = model.model.layers[0]
    with torch.no_grad():
        with quantization_disabled(b0):  # the targets: the block BEFORE training, unquantized
            tgt = [b0(x, **kw) for x, kw in zip(inps, kws)]
        first = rel(b0(inps[0], **kws[0]), tgt[0])
    settings = BlockwiseSettings(
        epochs=1, train_size=1, val_size=1, training_seqlen=16, quant_lr=1e-3, weight_lr=1e-3,
        loss="token_relative",
    )  # fmt: skip
    res = BlockwiseTrainer(model, settings, calibrate_activations=False).train(samples)
    rec0 = next(r for r in res.log if r["block"] == 0)
    assert rec0["loss"] == "token_relative"
    assert rec0["train_loss"] == pytest.approx(first, rel=1e-5)
    with torch.no_grad():
        val = rel(b0(inps[1], **kws[1]), tgt[1])
    assert rec0["val_loss"] == pytest.approx(val, rel=1e-5)
    with pytest.raises(ValueError, match="block_wise_config.loss"):
        BlockwiseTrainer(model, BlockwiseSettings(loss="l1"))


def test_blockwise_moe_bf16_then_fake_export(tmp_path, tiny_qwen3_moe):
    from transformers import AutoModelForCausalLM

    from qatlib.export import export
    from qatlib.trainers.blockwise import BlockwiseSettings, BlockwiseTrainer

    model = tiny_qwen3_moe.to(torch.bfloat16)
    scheme = QuantScheme(
        "w4a8", weight=QuantSpec("int4", Granularity.GROUP, group_size=16), input=QuantSpec("int8")
    )
    prepare(model, scheme)
    g = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, VOCAB, (16,), generator=g) for _ in range(3)]
    res = BlockwiseTrainer(
        model,
        BlockwiseSettings(
            epochs=1,
            batch_size=1,
            train_size=2,
            val_size=1,
            training_seqlen=16,
            quant_lr=1e-3,
            weight_lr=1e-4,
        ),
    ).train(samples)
    assert res.blocks == 2
    ql = model.model.layers[0].mlp.experts[0].up_proj
    assert ql.weight.dtype == torch.bfloat16 and ql.weight_quantizer.scale.dtype == torch.float32
    out = export(model, scheme, tmp_path / "fake", "fake")
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    ids = samples[0][None]
    acts = [q for n, q in model.named_modules() if n.endswith("input_quantizer")]
    for q in acts:  # the fake checkpoint holds fake-quantized weights only
        q.enabled = False
    with torch.no_grad():
        ref = model(ids).logits.float()
        got = reloaded(ids).logits.float()
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)


def test_blockwise_cli_trains_and_saves_a_qat_checkpoint(tmp_path, tiny_tokenizer):
    """``python scripts/qat.py -c CONFIG`` with ``training_mode: blockwise``: train_blockwise from the
    config, then a QAT checkpoint that reloads (weights) and warm-starts (scales) a fresh prepared model."""
    import subprocess
    import sys

    import yaml

    from qatlib.checkpoint.layout import TRAIN_LOG_FILE
    from qatlib.zero3.load import stream_load_scales

    model_dir = tmp_path / "base"
    build_model(tiny_qwen3_config()).save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    bw = {"epochs": 1, "batch_size": 1, "train_size": 2, "val_size": 1, "training_seqlen": 16}
    raw, _ = _experiment(
        tmp_path,
        model_dir,
        raw=True,
        training_mode="blockwise",
        loss_type="origin",
        kd_loss_weight=0.0,
        block_wise_config=bw,
    )
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(raw))
    script = Path(__file__).resolve().parents[1] / "scripts" / "qat.py"
    cmd = [
        sys.executable,
        str(script),
        "-c",
        str(tmp_path / "exp.yaml"),
        "--save-path",
        str(tmp_path / "qat"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = read_log(tmp_path / "qat" / TRAIN_LOG_FILE)
    assert [(x["block"], x["epoch"]) for x in lines] == [(0, 0), (1, 0)] and "val_loss" in lines[0]
    from qatlib.resume import load_saved_model

    fresh = build_model(tiny_qwen3_config(), seed=4)
    scheme = QuantScheme.from_dict(json.loads((tmp_path / "qat" / "quant_scheme.json").read_text()))
    prepare(fresh, scheme)
    load_saved_model(fresh, tmp_path / "qat")
    assert stream_load_scales(fresh, tmp_path / "qat", scheme)["misses"] == 0


def _loaded_qat(path: Path, seed: int = 9):
    """A QAT checkpoint loaded into a fresh prepared tiny model."""
    from qatlib.resume import load_saved_model

    m = build_model(tiny_qwen3_config(), seed=seed)
    prepare(m, QuantScheme.from_dict(json.loads((path / "quant_scheme.json").read_text())))
    load_saved_model(m, path)
    return m


def test_two_phase_stage_equals_the_two_stages_chained_by_hand(tmp_path, tiny_tokenizer):
    """``training_mode: two_phase`` (`qatlib.trainers.two_phase`) = a blockwise stage, then an
    end2end stage resumed from its checkpoint with ``frozen_codes``: the same weights and scales
    bit for bit, phase 1's codes kept while the scales moved, the original model as phase 2's KD
    teacher (the hand chain gets it from `resume`'s rule), and each phase's records in its log."""
    import subprocess
    import sys

    import safetensors.torch as st
    import yaml

    from qatlib.checkpoint.layout import BLOCKWISE_LOG_FILE, TRAIN_LOG_FILE

    model_dir = tmp_path / "base"
    build_model(tiny_qwen3_config(), seed=2).save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    bw = {
        "epochs": 1,
        "batch_size": 1,
        "train_size": 2,
        "val_size": 1,
        "training_seqlen": 16,
        "quant_lr": 1e-2,
    }

    def run(name: str, **qat) -> Path:
        raw, _ = _experiment(tmp_path, model_dir, raw=True, block_wise_config=bw, **qat)
        raw["compression"]["quantization"] = {"name": "int4_weight_only", "group_size": 16}
        qc = raw["compression"]["QAT"]["plugin_config"]["quant_config"]
        qc["learnable"] = {"act_scale": False}
        qc["scale_update"] = "log"
        raw["compression"]["QAT"]["hf_args"]["learning_rate"] = 3e-2
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(raw))
        script = Path(__file__).resolve().parents[1] / "scripts" / "qat.py"
        cmd = [
            sys.executable,
            str(script),
            "-c",
            str(tmp_path / f"{name}.yaml"),
            "--save-path",
            str(tmp_path / name),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return tmp_path / name

    kd = {"loss_type": "kl", "kd_loss_weight": 1.0}
    frozen = {"plugin_config": {"quant_config": {"frozen_codes": True}}}
    two = run("two", training_mode="two_phase", **kd, **frozen)
    phase1 = run("phase1", training_mode="blockwise", loss_type="origin", kd_loss_weight=0.0)
    (tmp_path / "chain_run").mkdir()  # a run folder reused after a two-phase run: its stale phase-1 log
    (tmp_path / "chain_run" / BLOCKWISE_LOG_FILE).write_text('{"block": 0}\n')
    chain = run("chain", training_mode="end2end", resume_ckpt_dir=str(phase1), **kd, **frozen)
    assert not (chain / BLOCKWISE_LOG_FILE).exists()  # an end2end checkpoint carries its own log only

    for f in ("model.safetensors", "scales.safetensors"):
        a, b = st.load_file(two / f), st.load_file(chain / f)
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (f, k)
    assert read_log(two / BLOCKWISE_LOG_FILE) == read_log(phase1 / TRAIN_LOG_FILE)
    assert [r["step"] for r in read_log(two / TRAIN_LOG_FILE)] == [1, 2]
    # phase 2 moved the scales and kept phase 1's codes
    m1, m2 = _loaded_qat(phase1), _loaded_qat(two)
    moved = 0
    for (n, q1), q2 in zip(
        ((n, m) for n, m in m1.named_modules() if hasattr(m, "codes") and m.weight_quantizer is not None),
        (m for m in m2.modules() if hasattr(m, "codes") and m.weight_quantizer is not None),
    ):
        c1, s1, _ = q1.codes()
        c2, s2, _ = q2.codes()
        assert torch.equal(c1, c2), n
        moved += not torch.equal(s1, s2)
    assert moved > 0


# --------------------------------------------------------------------------- ZeRO-3, 2 ranks
ROOT = Path(__file__).resolve().parents[1]
DS_CPU = ROOT / "config" / "deepspeed" / "zero3_cpu.json"
Z3_SCHEME = QuantScheme(
    "z3", weight=QuantSpec("int4", Granularity.GROUP, group_size=16), input=QuantSpec("int8")
)


def _have_cxx() -> bool:
    import shutil

    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


Z3_WORKER = ROOT / "tests" / "trainer_workers" / "e2e_zero3.py"


def _z3_setup(tmp_path: Path, n_samples: int, steps: int, **extra) -> tuple[dict, list]:
    """A tiny dense model and its RTN PTQ checkpoint on disk; the worker spec and its data."""
    from transformers import AutoModelForCausalLM

    from qatlib.ptq import save_ptq_checkpoint

    model_dir, ptq_dir = tmp_path / "model", tmp_path / "ptq"
    scheme = QuantScheme.from_dict(extra["scheme"]) if "scheme" in extra else Z3_SCHEME
    ds_config = DS_CPU
    if extra.get("moe"):  # one expert per gather, as config/deepspeed/zero3_cpu_lean.json
        config = tiny_qwen3_moe_config(initializer_range=0.1, **extra.get("moe_config", {}))
        ds = json.loads(DS_CPU.read_text())
        ds["zero_optimization"]["leaf_module"] = {
            "classes": [extra.get("leaf", "qatlib.surgery.moe.ExpertMLP")]
        }
        # no prefetch: 5e5 elements would prefetch every tiny expert and hide what the recompute holds
        ds["zero_optimization"]["stage3_prefetch_bucket_size"] = 0
        ds_config = tmp_path / "ds_expert_leaf.json"
        ds_config.write_text(json.dumps(ds))
    else:
        config = tiny_qwen3_config(initializer_range=0.1)
    base = build_model(config, seed=1)
    if extra.get("sizes_apart"):
        # weights whose sizes differ by orders of magnitude (`weight_units`' case, the upcycled MoE's
        # o_proj): layer 1's o_proj 2^10 x, and the first half of layer 0's (rank 0's ZeRO-3 slice)
        # 2^6 x, so a unit taken from one partition alone differs between the ranks
        with torch.no_grad():
            base.model.layers[1].self_attn.o_proj.weight.mul_(1024.0)
            flat = base.model.layers[0].self_attn.o_proj.weight.view(-1)
            flat[: flat.numel() // 2].mul_(64.0)
    base.save_pretrained(model_dir)
    with one_thread():
        pm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        prepare(pm, scheme, options=PrepareOptions(deploy=tie_for(extra.get("deploy", "none"))))
        calibrate(pm, scheme, [torch.tensor([d["input_ids"]]) for d in make_data(2, seed=7)])
        save_ptq_checkpoint(pm, scheme, ptq_dir)
    data = make_data(n_samples, lengths=(16,))
    spec = {
        "out": str(tmp_path / "run"),
        "model": str(model_dir),
        "ptq": str(ptq_dir),
        "ds_config": str(ds_config),
        "scheme": scheme.to_dict(),
        "data": data,
        "steps": steps,
        "lr": 1e-3,
        **extra,
    }
    return spec, data


def _saved_scales(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(d) / "scales.safetensors"))


# Why the reference is re-synced every step, and runs with Adam eps = 1. The ZeRO-3 ranks and one
# process do the same fp32 ops except the order in which gradients are accumulated (DeepSpeed's hooks
# change the autograd graph), so after one step the scales differ at the ulp level. Two amplifiers
# turn that into failures at rtol 1e-4 that depend on where values fall (platform, library versions):
# - rounding flips: carried over steps, a difference eventually flips the rounding of an activation
#   code, and that scale's LSQ gradient jumps by a whole code. Measured on this model and data: no
#   flip in steps 1-3, 6 codes of layer 1's MLP inputs in step 4, then 4e-4 relative (the resume test
#   compared 4 steps against one process and failed so, every run). Re-synced to ZeRO-3's scales
#   before every step (its own Adam moments), the reference's forward is bitwise the ZeRO-3 forward
#   (batch 1 x 2 accumulation steps: the ranks' shapes): no code can flip, and every logged loss is
#   EXACTLY equal;
# - Adam's normalisation of a nearly cancelling gradient: with eps 1e-8 one q_proj scale differed by
#   6.8e-7 (2.7e-5 relative, 0.26 of the rtol-1e-4 bound) after step 1; with eps 1e-6, 9x over the
#   bound. With eps = 1 (|g| << 1 here) Adam is in its linear regime, u ~ lr * g: the scales then
#   agree to 1.2e-7 .. 2.2e-7 relative (2-4 ulp) every step, while moving up to 1.5e-3, so the check
#   is rtol 1e-5 (10x tighter than before) and a gradient off by a constant factor, which plain Adam
#   would hide, shows.
def _z3_reference(tmp_path: Path, spec: dict, data: list) -> list[dict[str, torch.Tensor]]:
    """The same training in one process, re-synced each step to the ZeRO-3 run's per-step saves
    (``{out}/steps/k``, see above): both ranks' micro-batches, same order, as batch 1 x 2 accumulation
    steps (the token normalisation spans both). Its scales after each step; the trainer log lands in
    ``tmp_path/ref/out``."""
    from transformers import AutoModelForCausalLM

    from qatlib.zero3 import load as zl
    from qatlib.zero3 import save as zs

    z3_steps, after = Path(spec["out"]) / "steps", []
    scheme = QuantScheme.from_dict(spec["scheme"])

    class Sync(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kw):
            if state.global_step:  # in place: the optimizer keeps its parameters and moments
                zl.stream_load_scales(model, z3_steps / str(state.global_step), scheme)

        def on_step_end(self, args, state, control, model=None, **kw):
            d = tmp_path / "ref_steps" / str(state.global_step)
            zs.save_consolidated(model, d, scheme=scheme)
            after.append(_saved_scales(d))

    with one_thread():
        ref = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
        deploy = tie_for(spec.get("deploy", "none"))
        prepare(ref, scheme, options=PrepareOptions(init_from_weight=False, deploy=deploy))
        zl.stream_load_scales(ref, spec["ptq"], scheme)
        QATTrainer(
            ref,
            targs(
                tmp_path / "ref",
                max_steps=spec["steps"],
                learning_rate=spec["lr"],
                adam_epsilon=spec.get("eps", 1e-8),
                max_grad_norm=0.0,
                per_device_train_batch_size=1,
                gradient_accumulation_steps=2,
                train_sampling_strategy="sequential",
                gradient_checkpointing=bool(spec.get("gradient_checkpointing", False)),
                gradient_checkpointing_kwargs={"use_reentrant": bool(spec.get("use_reentrant", False))},
            ),
            loss_config=LossConfig(loss_type="cakld", lm_loss_weight=1.0, kd_loss_weight=1.0),
            learnable=Learnable(weight_scale=True, act_scale=True),
            train_dataset=data,
            data_collator=PadCollator(0),
            callbacks=[Sync()],
        ).train()
        assert ref.is_gradient_checkpointing == bool(spec.get("gradient_checkpointing", False))
    return after


def _assert_steps_match_reference(
    tmp_path: Path, spec: dict, data: list, steps: int, *, loss_rel: float = 0.0
) -> None:
    """The ZeRO-3 run's per-step scales against `_z3_reference`'s (rtol 1e-5: why above it), its
    logged losses equal (``loss_rel`` 0) or within ``loss_rel``, and the scales trained."""
    lines = read_log(tmp_path / "run" / "trainer" / LOG_FILE)
    z3 = [_saved_scales(tmp_path / "run" / "steps" / str(k)) for k in range(1, steps + 1)]
    ref = _z3_reference(tmp_path, spec, data)
    ref_lines = read_log(tmp_path / "ref" / "out" / LOG_FILE)
    assert len(ref_lines) == len(lines) == len(ref) == steps
    for a, b in zip(lines, ref_lines):
        for k in ("lm_loss", "kd/cakld", "total_loss", "loss"):
            assert a[k] == pytest.approx(b[k], rel=loss_rel, abs=0), (a["step"], k)
    for step, (got, exp) in enumerate(zip(z3, ref), 1):
        assert got.keys() == exp.keys()
        for k in exp:
            torch.testing.assert_close(got[k], exp[k], rtol=1e-5, atol=1e-8, msg=f"step {step}: {k}")
    _assert_trained(spec, _saved_scales(tmp_path / "run" / "saved"))


def _assert_trained(spec: dict, got: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import load_file

    init = load_file(str(next(Path(spec["ptq"]).glob("*.safetensors"))))
    assert any(not torch.equal(got[k], init[k]) for k in got if k in init)  # the scales did train


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize(
    "compile_fq",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.skipif(not _have_cxx(), reason="torch.compile (inductor) needs a C++ compiler"),
        ),
    ],
    ids=["eager", "compiled"],
)
def test_zero3_two_ranks_lm_plus_cakld_matches_single_process(tmp_path, compile_fq):
    """ZeRO-3 (2 CPU ranks, batch 1 each) vs one process on the same samples in the same order,
    re-synced to ZeRO-3's scales before every step (why: above `_z3_reference`): every loss
    component is logged each step and equals the single-process value (eager: exactly; compiled
    fake-quant vs the eager reference: rel 1e-6), and each step's scales agree (rtol 1e-5): the token
    normalisation spans both ranks. ``compiled``: the ZeRO-3 ranks run ``compile_fake_quant``."""
    spec, data = _z3_setup(tmp_path, 6, 3, compile=compile_fq, save_every_step=True, eps=1.0)
    proc, _ = torchrun(Z3_WORKER, spec, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.count("WORKER OK") == 2
    res = json.loads((tmp_path / "run" / "result.json").read_text())
    lines = read_log(tmp_path / "run" / "trainer" / LOG_FILE)
    keys = ["lm_loss", "kd/cakld", "kd/forward_kl", "kd/backward_kl", "total_loss"]
    assert [x["step"] for x in lines] == [1, 2, 3]
    for x in lines:
        assert all(k in x and math.isfinite(x[k]) for k in keys)
        assert x["total_loss"] == pytest.approx(x["lm_loss"] + x["kd/cakld"], rel=1e-6)
    assert res["teacher_forwards"] == 3 and res["world"] == 2
    assert (res["compiled_calls"] > 0) == compile_fq  # the compiled path ran iff it was asked for
    z3 = [_saved_scales(tmp_path / "run" / "steps" / str(k)) for k in (1, 2, 3)]
    final = _saved_scales(tmp_path / "run" / "saved")
    assert all(torch.equal(final[k], z3[-1][k]) for k in final)  # the per-step saves changed nothing

    ref = _z3_reference(tmp_path, spec, data)
    ref_lines = read_log(tmp_path / "ref" / "out" / LOG_FILE)
    assert len(ref_lines) == len(lines) == len(ref)
    for a, b in zip(lines, ref_lines):
        assert a["tokens"] == b["tokens"]
        for k in keys + ["loss"]:
            assert a[k] == (pytest.approx(b[k], rel=1e-6) if compile_fq else b[k]), (a["step"], k)
    for step, (got, exp) in enumerate(zip(z3, ref), 1):
        assert got.keys() == exp.keys()
        for k in exp:
            torch.testing.assert_close(got[k], exp[k], rtol=1e-5, atol=1e-8, msg=f"step {step}: {k}")
    _assert_trained(spec, final)


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("weight_update", ["additive", "relative"])
def test_zero3_weight_training_with_a_partitioned_original_teacher_matches_single_process(
    tmp_path, weight_update
):
    """``quant_config.weight_lr`` under ZeRO-3: the linear weights train with the scales, and the KD
    teacher is the ORIGINAL model, partitioned in an inference-only DeepSpeed engine. On 2 ranks
    (batch 1 each) vs one process (batch 1 x 2 accumulation steps, a plain copy of the original as
    teacher): the step's losses, the trained weights and the scales agree (one step: with the
    weights training, ulp differences flip weight codes from step 2 on, see `_z3_reference`; Adam
    eps = 1 as there). After training, the teacher engine computes the original model's logits,
    which the student's own weights with quantizers off no longer do. ``relative``
    (`qatlib.trainers.weight_units`): on weights whose sizes differ by 2^10 and whose halves differ
    by 2^6, the units summed from the partitions are the whole tensors' (the same groups)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from qatlib.zero3 import load as zl

    steps, wlr = 1, 0.1
    rel = {"weight_update": "relative", "sizes_apart": True} if weight_update == "relative" else {}
    spec, data = _z3_setup(tmp_path, 2, steps, eps=1.0, weight_lr=wlr, **rel)
    proc, _ = torchrun(Z3_WORKER, spec, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    res = json.loads((tmp_path / "run" / "result.json").read_text())
    assert res["teacher"] == "DeepSpeedEngine" and res["teacher_partitioned"] is True
    assert res["teacher_forwards"] == steps and res["trainable"]["weight"] > 0
    lines = read_log(tmp_path / "run" / "trainer" / LOG_FILE)

    with one_thread():
        ref = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
        original = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
        prepare(ref, Z3_SCHEME, options=PrepareOptions(init_from_weight=False))
        zl.stream_load_scales(ref, spec["ptq"], Z3_SCHEME)
        learnable = Learnable(weight_scale=True, act_scale=True)
        ref_tr = QATTrainer(
            ref,
            targs(
                tmp_path / "ref",
                max_steps=steps,
                learning_rate=spec["lr"],
                adam_epsilon=1.0,
                max_grad_norm=0.0,
                per_device_train_batch_size=1,
                gradient_accumulation_steps=2,
                train_sampling_strategy="sequential",
            ),
            loss_config=LossConfig(loss_type="cakld", lm_loss_weight=1.0, kd_loss_weight=1.0),
            trainable=select_trainable(ref, learnable, weights=True),
            weight_lr=wlr,
            weight_update=weight_update,
            teacher=original,
            train_dataset=data,
            data_collator=PadCollator(0),
        )
        ref_tr.train()
    ref_groups = [g["name"] for g in ref_tr.optimizer.param_groups]
    assert res["groups"] == ref_groups
    if weight_update == "relative":  # 2^-3 (most), 2^2 (layer 0 o_proj: RMS 4.5 whole, 0.07 in one half), 2^7
        assert {"weight@2^2", "weight@2^7"} <= set(ref_groups) and "weight" not in ref_groups
    ref_lines = read_log(tmp_path / "ref" / "out" / LOG_FILE)
    assert [x["step"] for x in lines] == [x["step"] for x in ref_lines] == [1]
    for a, b in zip(lines, ref_lines):
        for k in ("lm_loss", "kd/cakld", "total_loss"):
            assert a[k] == pytest.approx(b[k], rel=1e-5), (a["step"], k)
    saved = tmp_path / "run" / "saved"
    got = {k: v for f in saved.glob("model*.safetensors") for k, v in load_file(str(f)).items()}
    base = {k: v for f in Path(spec["model"]).glob("*.safetensors") for k, v in load_file(str(f)).items()}
    moved = 0
    for n, p in ref.named_parameters():
        if n.endswith("proj.weight"):
            torch.testing.assert_close(got[n], p.detach(), rtol=1e-5, atol=1e-7, msg=n)
            moved += not torch.equal(got[n], base[n])
    assert moved > 0  # the weights trained
    scales = _saved_scales(saved)
    for n, q in ((n, q) for n, q in ref.named_modules() if n.endswith("weight_quantizer")):
        key = n.removesuffix("_quantizer") + "_scale"
        torch.testing.assert_close(scales[key], q.scale.detach(), rtol=1e-5, atol=1e-8, msg=key)
    x = torch.tensor([data[0]["input_ids"]])
    with torch.no_grad(), quantization_disabled(ref):
        want, self_teacher = original(input_ids=x).logits, ref(input_ids=x).logits
    teacher = torch.load(tmp_path / "run" / "teacher_logits.pt")
    torch.testing.assert_close(teacher, want, rtol=1e-5, atol=1e-6)
    assert (self_teacher - want).abs().max() > 100 * (teacher - want).abs().max()


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize(
    "reentrant, moe",
    [(False, False), (True, False), (False, True)],
    ids=["non_reentrant", "reentrant", "moe_expertleaf"],
)
def test_zero3_gradient_checkpointing_frozen_weights_matches_single_process(tmp_path, reentrant, moe):
    """ZeRO-3 + ``gradient_checkpointing: true`` with every weight frozen (only scales train; what the
    30B configs run): checkpointed blocks whose inputs do not require grad would give the scales no
    gradient (the upstream failure; the trainer makes the inputs require grad). On 2 ranks the
    blocks really are recomputed (3 forwards of layer 0 per step: student, its recompute in
    backward, teacher), the scales train, and every step's scales match one process running the
    same checkpointed training (rtol 1e-5, re-synced each step and Adam eps 1: why above
    `_z3_reference`); every logged loss is exactly equal. transformers' default checkpoint is
    non-reentrant (gradients flow without inputs that require grad); the reentrant one (the
    upstream setting) is the one that needs the inputs made to require grad. ``moe_expertleaf``:
    a Qwen3-MoE gathering one expert at a time (`recompute_experts_one_by_one`), whose recompute
    must not hold the other experts of the block (issue #16's checkpointed step peak)."""
    steps = 3
    spec, data = _z3_setup(
        tmp_path,
        6,
        steps,
        save_every_step=True,
        eps=1.0,
        gradient_checkpointing=True,
        use_reentrant=reentrant,
        moe=moe,
    )
    proc, _ = torchrun(Z3_WORKER, spec, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    res = json.loads((tmp_path / "run" / "result.json").read_text())
    assert res["checkpointing"] and res["world"] == 2
    assert res["teacher_forwards"] == steps
    assert res["layer0_forwards"] == 3 * steps  # student + recompute + teacher, per step
    assert res["trainable"]["scale"] > 0  # only the scales train: every weight is frozen
    assert res["trainable"].get("weight", 0) == res["trainable"].get("norm", 0) == 0
    if moe:  # each expert recomputed in its own backward: no other expert of its block is gathered
        assert res["others_gathered"] == 0  # (the layer-wide recompute held all 4 experts: 3)
    _assert_steps_match_reference(tmp_path, spec, data, steps)


# 8 experts, 7 per token, a dense first and last layer: the smallest MoE found on which the
# weight-training step below failed in DeepSpeed (4 experts / 2 layers / 2 per token ran)
SPLIT_MOE = {"num_experts": 8, "num_experts_per_tok": 7, "num_hidden_layers": 4, "mlp_only_layers": [0, 3]}
EXPERT_LEAF, LAYER_LEAF = "qatlib.surgery.moe.ExpertMLP", "qatlib.surgery.moe.LinearizedMoeExperts"


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize(
    "leaf, weight_lr",
    [(EXPERT_LEAF, None), (LAYER_LEAF, 1e-3), (EXPERT_LEAF, 1e-3)],
    ids=["expert_leaf-scales", "layer_leaf-weights", "expert_leaf-weights"],
)
def test_zero3_moe_scale_shared_by_experts(tmp_path, leaf, weight_lr):
    """vLLM's fused MoE serves ONE static input scale per layer (the max over its experts), so under
    ``deploy.target: vllm`` the fp8_static experts of a layer share one Parameter, which DeepSpeed
    files under one expert when each expert is a ZeRO-3 leaf. 2 ranks:
    - scales only, one expert per gather: every step's scales, the shared ones included, match
      one process (rtol 1e-5) and the shared scales train;
    - the weights training too (``weight_lr``), a whole layer's experts per gather (qatlib's default
      for such a run): the steps run, the shared scale trains and stays one value per layer;
    - the weights training with one expert per gather failed in DeepSpeed's ``zero_grad``
      (``record_stream``: "unknown parameter type"): the trainer refuses that leaf list before any
      step, naming the field and the class to use."""
    steps = 2
    extra = {"weight_lr": weight_lr} if weight_lr else {}
    spec, data = _z3_setup(
        tmp_path,
        4,
        steps,
        eps=1.0,
        save_every_step=True,
        moe=True,
        moe_config=SPLIT_MOE,
        leaf=leaf,
        scheme=PRESETS["fp8_static"].to_dict(),
        deploy="vllm",
        lr=1e-5,  # additive steps: the tiny model's fp8 scales are ~1e-4
        **extra,
    )
    proc, _ = torchrun(Z3_WORKER, spec, tmp_path)
    err = proc.stdout + proc.stderr
    if leaf == EXPERT_LEAF and weight_lr:
        assert proc.returncode != 0
        assert "Zero3Error" in err and "zero_optimization.leaf_module.classes" in err, err[-3000:]
        assert f"Name {LAYER_LEAF} instead" in err
        assert "unknown parameter type" not in err
        assert not (tmp_path / "run" / "steps").exists()  # refused before any step
        return
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    if not weight_lr:
        _assert_steps_match_reference(tmp_path, spec, data, steps)
    from safetensors.torch import load_file

    init = load_file(str(next(Path(spec["ptq"]).glob("*.safetensors"))))
    got = _saved_scales(tmp_path / "run" / "saved")
    shared = [k for k in got if ".layers.1.mlp.experts." in k and k.endswith("input_scale")]
    w13 = {float(got[k]) for k in shared if "down_proj" not in k}
    assert len(shared) == 8 * 3 and len(w13) == 1  # one gate/up input scale for the layer's 8 experts
    assert all(not torch.equal(got[k], init[k]) for k in shared)  # and the shared scales trained


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("block_bytes", [3000, None], ids=["partitioned", "deepspeed_gathers"])
def test_zero3_embeddings_from_partitions_match_single_process(tmp_path, block_bytes):
    """Issue #16: under ZeRO-3 the trainer computes the input embedding and the output head from the
    ranks' partitions (`qatlib.zero3.vocab_parallel`), so DeepSpeed never gathers either matrix (Qwen3-30B-
    A3B's 0.58 GiB each were the rank's step peak). Blocks of 11 rows (3000 bytes of 64 fp32): one
    block straddles the two ranks' partitions (rows 253-263 of 512), so it is assembled from both.
    Reentrant layer checkpointing: its layers train only if the embedding's output requires grad,
    which the swapped module must keep. Every step's scales match one process (rtol 1e-5 as above)
    and the logged losses to 1e-5 relative (the head's products are taken block by block: the KD
    term, a small difference of logits, moved 4.6e-6 relative in step 2).
    ``deepspeed_gathers`` (the switch off) is the probe's check: there DeepSpeed does fetch them."""
    steps = 2
    spec, data = _z3_setup(
        tmp_path,
        4,
        steps,
        save_every_step=True,
        eps=1.0,
        gradient_checkpointing=True,
        use_reentrant=True,
        vocab_block_bytes=block_bytes,
    )
    proc, _ = torchrun(Z3_WORKER, spec, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    res = json.loads((tmp_path / "run" / "result.json").read_text())
    if block_bytes is None:
        assert res["vocab_swapped"] == [] and res["vocab_gathered"]
        return
    assert res["vocab_swapped"] == ["input", "output"]
    assert not res["vocab_gathered"]
    _assert_steps_match_reference(tmp_path, spec, data, steps, loss_rel=1e-5)


@pytest.mark.slow
@pytest.mark.multirank
def test_zero3_resume_after_kill_matches_the_uninterrupted_run(tmp_path):
    """A 2-rank ZeRO-3 run killed after step 4 (checkpoints every 2 steps; its state at the kill is
    saved first) and resumed from checkpoint-2 ends BITWISE where the killed run was, and re-logs
    step 3 exactly: same ranks, same reduction order, so only a wrong resume (weights, scales, Adam
    moments and step, data position) can make them differ. (Against a single process the runs drift
    by the rounding flips explained above `_z3_reference`: 4e-4 relative after 4 steps here.)"""
    spec, _ = _z3_setup(tmp_path, 8, 4, save_steps=2)
    killed, _ = torchrun(Z3_WORKER, {**spec, "crash_at": 4}, tmp_path)
    assert killed.returncode != 0 and "killed at step 4" in killed.stdout + killed.stderr
    trainer_dir = tmp_path / "run" / "trainer"
    assert (trainer_dir / "checkpoint-2" / "trainer_state.json").is_file()
    assert not (trainer_dir / "checkpoint-4").exists()  # killed before its step-4 checkpoint
    killed_lines = read_log(trainer_dir / LOG_FILE)
    assert [x["step"] for x in killed_lines] == [1, 2, 3]
    at_kill = _saved_scales(tmp_path / "run" / "at_kill")
    resumed, _ = torchrun(Z3_WORKER, {**spec, "resume_from": str(trainer_dir / "checkpoint-2")}, tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-6000:]
    lines = read_log(trainer_dir / LOG_FILE)
    assert [x["step"] for x in lines] == [1, 2, 3, 4]
    assert lines[:3] == killed_lines  # step 3 re-logged by the resumed run, identical
    got = _saved_scales(tmp_path / "run" / "saved")
    assert got.keys() == at_kill.keys()
    for k in at_kill:
        assert torch.equal(got[k], at_kill[k]), k
    _assert_trained(spec, got)


def test_fake_export_is_a_resume_checkpoint(tmp_path):
    """`resume_ckpt_dir` accepts a `fake` save. Into another base model: its weights are copied (the
    fake-quantized ones) and the scales come back exactly, so the resumed model reproduces the
    exported one."""
    from conftest import build_model, tiny_qwen3_config

    from qatlib.export import export
    from qatlib.quant import PRESETS, QuantSpec, prepare
    from qatlib.resume import load_saved_model

    scheme = PRESETS["int4_weight_only"].replace(weight=QuantSpec("int4", "per-group", group_size=32))
    model = prepare(build_model(tiny_qwen3_config(), seed=1), scheme)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("weight_quantizer.scale"):
                p.mul_(1.1)  # "trained" scales, not the ones a fresh prepare would compute
    export(model, scheme, tmp_path / "fake", "fake")
    resumed = prepare(build_model(tiny_qwen3_config(), seed=2), scheme)
    report = load_saved_model(resumed, tmp_path / "fake")
    assert report["misses"] == 0 and not report["kept_base_weights"] and report["weights"] > 0
    want = {n: p for n, p in model.named_parameters() if "_quantizer." in n}
    got = dict(resumed.named_parameters())
    for n, p in want.items():
        assert torch.equal(got[n], p), n
    ids = torch.arange(24).reshape(2, 12)
    torch.testing.assert_close(resumed(ids).logits, model(ids).logits, rtol=0, atol=1e-6)


def test_resume_from_own_fake_export_keeps_the_original_weights(tmp_path):
    """Resuming from a `fake` export of the same base model: scales come back, the full-precision
    weights stay, so the student reproduces the export and the KD teacher (quantizers off) is the
    original model, not the fake-quantized one. A consolidated save (original weights) likewise."""
    from conftest import build_model, tiny_qwen3_config

    from qatlib.export import export
    from qatlib.quant import PRESETS, QuantSpec, prepare, quantization_disabled
    from qatlib.resume import load_saved_model
    from qatlib.zero3 import save as zs

    scheme = PRESETS["int4_weight_only"].replace(weight=QuantSpec("int4", "per-group", group_size=32))
    base = build_model(tiny_qwen3_config(), seed=1)
    ids = torch.arange(24).reshape(2, 12)
    with torch.no_grad():
        base_logits = base(ids).logits
    model = prepare(copy.deepcopy(base), scheme)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("weight_quantizer.scale"):
                p.mul_(1.1)
        quant_logits = model(ids).logits
    export(model, scheme, tmp_path / "fake", "fake")
    zs.save_consolidated(model, tmp_path / "saved", scheme=scheme)
    for d in ("fake", "saved"):
        resumed = prepare(copy.deepcopy(base), scheme)
        report = load_saved_model(resumed, tmp_path / d)
        assert report["kept_base_weights"] and report["weights"] == 0, d
        for (n, p), (_, q) in zip(resumed.named_parameters(), model.named_parameters()):
            assert torch.equal(p, q), (d, n)  # the original weights and the trained scales
        with torch.no_grad():
            torch.testing.assert_close(resumed(ids).logits, quant_logits, rtol=0, atol=0)
            with quantization_disabled(resumed):
                torch.testing.assert_close(resumed(ids).logits, base_logits, rtol=0, atol=0)
