"""Faults at scale (issue 17): real processes, real signals, faults reached through test hooks.

- a rank SIGKILLed or SIGSTOPped mid-step ends every rank of a 2-rank ZeRO-3 QAT within the
  collective timeout plus a margin, with a non-zero exit naming that rank and no output;
- the training guard stops at the step of a NaN (a poisoned scale, a poisoned activation) on every
  rank, naming the layer; export refuses non-finite / non-positive scales by name;
- saves killed half-way leave the previous output intact and the orphan is removed by the next run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT, VOCAB, build_model, one_thread, tiny_qwen3_config

from qatlib.quant import Granularity, QuantScheme, QuantSpec, prepare
from qatlib.zero3 import io as z
from qatlib.zero3 import save as zs

WORKERS = Path(__file__).parent / "fault_workers"
DS_TEST = REPO_ROOT / "config" / "deepspeed" / "zero3_cpu_test.json"
SCHEME = QuantScheme("w4g16", weight=QuantSpec("int4", Granularity.GROUP, group_size=16, symmetric=False))
TIMEOUT_S = 20
# torchrun's agent gives the surviving workers 30 s between SIGTERM and SIGKILL (a stopped worker
# ignores SIGTERM), plus our 2.5 s heartbeat probe and process exit: 45 s over the timeout.
MARGIN_S = 45


def _env() -> dict:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }


def launch(worker: Path, spec: dict, tmp: Path) -> subprocess.Popen:
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [str(worker), str(spec_path)]
    return subprocess.Popen(
        cmd,
        env=_env(),
        cwd=tmp,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def wait_for(path: Path, proc: subprocess.Popen, limit: float = 240) -> int:
    t0 = time.monotonic()
    while not path.exists() or not path.read_text():
        if proc.poll() is not None:
            raise AssertionError(f"worker ended before the hook: {proc.stdout.read()[-4000:]}")
        if time.monotonic() - t0 > limit:
            raise AssertionError("hook never reached")
        time.sleep(0.2)
    return int(path.read_text())


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny dense base model and its PTQ checkpoint (a plain consolidated save: scales + scheme)."""
    tmp = tmp_path_factory.mktemp("faults")
    model = build_model(tiny_qwen3_config(), seed=1)
    model.save_pretrained(tmp / "base")
    with one_thread():
        prepare(model, SCHEME)
        zs.save_consolidated(model, tmp / "ptq", scheme=SCHEME)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (8, 16), generator=g).tolist()
    data = [{"input_ids": x, "labels": x} for x in ids]
    return {"tmp": tmp, "base": tmp / "base", "ptq": tmp / "ptq", "data": data}


def qat_spec(ckpt, out: Path, steps: int = 4, **kw) -> dict:
    return {
        "out": str(out),
        "model": str(ckpt["base"]),
        "ptq": str(ckpt["ptq"]),
        "ds_config": str(DS_TEST),
        "scheme": SCHEME.to_dict(),
        "data": ckpt["data"],
        "steps": steps,
        "timeout_s": TIMEOUT_S,
        **kw,
    }


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_rank_death_or_hang_ends_every_rank_naming_it(ckpt, tmp_path, sig):
    out = tmp_path / "out"
    hook = tmp_path / "paused.pid"
    proc = launch(
        WORKERS / "qat_fault.py",
        qat_spec(ckpt, out, pause={"rank": 1, "step": 2, "file": str(hook)}),
        tmp_path,
    )
    pid = wait_for(hook, proc)
    time.sleep(0.5)  # rank 0 is inside step 2's gathers, waiting on rank 1
    t0 = time.monotonic()
    os.kill(pid, getattr(signal, sig))
    try:
        text, _ = proc.communicate(timeout=TIMEOUT_S + MARGIN_S + 30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"{sig}: the job still runs {TIMEOUT_S + MARGIN_S + 30} s later") from None
    seconds = time.monotonic() - t0
    assert proc.returncode != 0
    assert seconds < TIMEOUT_S + MARGIN_S, (seconds, text[-3000:])
    assert not _alive(pid)
    if sig == "SIGSTOP":  # rank 0 waited out the timeout, then named the silent rank
        assert seconds >= TIMEOUT_S - 1, seconds
        assert "error: a collective failed on rank 0" in text, text[-4000:]
        assert f"rank 1 (pid {pid} on" in text and "stopped answering (its process is stopped" in text
    else:  # torchrun saw the death and named it as the root cause
        assert "rank      : 1" in text or "rank: 1" in text, text[-4000:]
        assert "SIGKILL" in text
    assert not out.joinpath("saved").exists()
    assert not [p for p in out.glob("*") if p.name.startswith(".saved")]
    print(f"{sig}: job ended {seconds:.1f} s after the signal")


# --------------------------------------------------------------------------- training guard
LAYER = "model.layers.0.mlp.down_proj"


def run_guarded(tmp: Path, nan: dict, steps: int = 3, lr: float = 1e-4, only_model: bool = True):
    """Single-process QAT of a tiny model with ``nan`` injected (see fault_workers/qat_fault.py)."""
    from transformers import TrainerCallback, TrainingArguments

    from qatlib.data import PadCollator
    from qatlib.losses import LossConfig
    from qatlib.trainers.end2end import QATTrainer
    from qatlib.trainers.params import Learnable

    model = build_model(tiny_qwen3_config(), seed=1)
    prepare(model, SCHEME)
    layer = model.get_submodule(LAYER)
    step = [0]
    if nan["what"] == "activation":
        layer.register_forward_hook(
            lambda m, a, o: o * float("nan") if step[0] == nan["step"] and m.training else None
        )

    class Hooks(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            step[0] = state.global_step + 1
            if nan["what"] == "scale" and step[0] == nan["step"]:
                with torch.no_grad():
                    layer.weight_quantizer.scale.view(-1)[3] = nan.get("value", float("nan"))

    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": x, "labels": x} for x in torch.randint(0, VOCAB, (8, 16), generator=g).tolist()]
    args = TrainingArguments(
        output_dir=str(tmp / "trainer"),
        max_steps=steps,
        per_device_train_batch_size=1,
        learning_rate=lr,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="steps",
        save_steps=1,
        save_only_model=only_model,
        max_grad_norm=0.0,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        train_sampling_strategy="sequential",
    )
    trainer = QATTrainer(
        model,
        args,
        loss_config=LossConfig(loss_type="cakld", lm_loss_weight=1.0, kd_loss_weight=1.0),
        learnable=Learnable(weight_scale=True),
        train_dataset=data,
        data_collator=PadCollator(0),
        callbacks=[Hooks()],
    )
    with one_thread():
        trainer.train()
    return trainer


@pytest.mark.parametrize(
    "nan,expect",
    [
        ({"what": "scale", "step": 2}, f"{LAYER}.weight_quantizer.scale: 1 of"),
        ({"what": "scale", "step": 2, "value": 0.0}, f"{LAYER}.weight_quantizer.scale: 1 of"),
        ({"what": "scale", "step": 2, "value": -0.5}, f"{LAYER}.weight_quantizer.scale: 1 of"),
        ({"what": "scale", "step": 2, "value": float("inf")}, f"{LAYER}.weight_quantizer.scale: 1 of"),
        ({"what": "activation", "step": 2}, f"first layer with a non-finite output: {LAYER} (rank 0)"),
    ],
    ids=["nan-scale", "zero-scale", "negative-scale", "inf-scale", "nan-activation"],
)
def test_guard_stops_at_the_step_naming_the_layer(tmp_path, nan, expect):
    from qatlib.trainers.guard import GuardError

    with pytest.raises(GuardError) as e:
        run_guarded(tmp_path, nan)
    msg = str(e.value)
    assert msg.startswith("step 2: "), msg
    assert expect in msg, msg
    # the last good checkpoint (step 1) is the resumable state; none of step 2
    assert sorted(p.name for p in (tmp_path / "trainer").glob("checkpoint-*")) == ["checkpoint-1"]


def test_update_taking_scales_below_zero_stops_naming_step_layer_and_fix(tmp_path):
    """The real cause, not an injection: Adam's first step moves every element by ~lr, so lr 0.1
    on ~1e-2 scales takes about half of them below 0 at step 1. The run stops there naming the
    step, the scale tensors, their layers and the fix (lower the scales' learning rate); no
    checkpoint of step 1 is written."""
    from qatlib.trainers.guard import GuardError

    with pytest.raises(GuardError) as e:
        run_guarded(tmp_path, {"what": "none"}, lr=0.1)
    msg = str(e.value)
    assert msg.startswith("step 1: quantizer parameters left their range after the update: "), msg
    assert re.search(
        r"model\.layers\.\d\.\S+\.weight_quantizer\.scale: \d+ of \d+ values <= 0 \(min -", msg
    ), msg
    assert re.search(r"\(layers: model\.layers\.\d\.\S+_proj", msg), msg
    assert "lower the scales' learning rate (compression.QAT.hf_args.learning_rate, now 0.1;" in msg, msg
    assert not list((tmp_path / "trainer").glob("checkpoint-*"))
    # the same run at the recipes' scale learning rate keeps every scale > 0
    run_guarded(tmp_path / "low", {"what": "none"}, lr=1e-4)


def test_guard_names_a_non_finite_gradient(tmp_path):
    """A NaN that only reaches the backward (a hook on the gradient of one scale)."""
    from qatlib.trainers import guard

    model = build_model(tiny_qwen3_config(), seed=1)
    prepare(model, SCHEME)
    scale = model.get_submodule(LAYER).weight_quantizer.scale
    g = guard.TrainingGuard(model, [(f"{LAYER}.weight_quantizer.scale", scale)])
    scale.grad = torch.zeros_like(scale)
    g.on_pre_optimizer_step(None, type("S", (), {"global_step": 4})(), None)  # finite: nothing
    scale.grad.view(-1)[0] = float("inf")
    with pytest.raises(
        guard.GuardError,
        match=rf"step 5: non-finite gradient: {LAYER}.weight_quantizer.scale.grad: 1 of \d+ values inf",
    ):
        g.on_pre_optimizer_step(None, type("S", (), {"global_step": 4})(), None)


@pytest.mark.slow
@pytest.mark.parametrize("what", ["scale", "activation"])
def test_guard_stops_every_rank_zero3(ckpt, tmp_path, what):
    out = tmp_path / "out"
    spec = qat_spec(ckpt, out, steps=3, nan={"what": what, "step": 2, "rank": 1}, save_steps=1)
    proc = launch(WORKERS / "qat_fault.py", spec, tmp_path)
    text, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0, text[-3000:]
    # both ranks, same step (their stderr lines may interleave: split on the prefix)
    errors = ["error: step 2: " + e.split("\n")[0] for e in text.split("error: step 2: ")[1:]]
    assert len(errors) == 2, text[-4000:]
    layer = f"{LAYER}.weight_quantizer.scale" if what == "scale" else f"{LAYER} (rank 1)"
    assert all(layer in e for e in errors), errors
    assert "WORKER OK" not in text and not (out / "saved").exists()
    assert sorted(p.name for p in (out / "trainer").glob("checkpoint-*")) == ["checkpoint-1"]


@pytest.mark.parametrize(
    "value", [float("nan"), float("inf"), 0.0, -1e-3], ids=["nan", "inf", "zero", "negative"]
)
@pytest.mark.parametrize("fmt", ["real", "fake"])
def test_export_refuses_bad_scales_by_name(tmp_path, value, fmt):
    from qatlib.export import ExportError, export

    model = build_model(tiny_qwen3_config(), seed=1)
    prepare(model, SCHEME)
    with torch.no_grad():
        model.get_submodule(LAYER).weight_quantizer.scale.view(-1)[7] = value
    what = (
        r"<= 0 \(min "
        if value == value and abs(value) != float("inf")
        else ("nan" if value != value else "inf")
    )
    with pytest.raises(ExportError, match=rf"{LAYER}.weight_quantizer.scale: 1 of \d+ values.*{what}"):
        export(model, SCHEME, tmp_path / "out", fmt)
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())


# --------------------------------------------------------------------------- interrupted saves
def _digest(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.mark.parametrize("mode", ["consolidated", "export"])
def test_killed_save_keeps_the_previous_output_and_the_orphan_is_removed(tmp_path, mode, caplog):
    from qatlib.checkpoint import layout

    out = tmp_path / "out"
    worker = [sys.executable, str(WORKERS / "save_kill.py"), mode, str(out)]
    subprocess.run([*worker, "1"], env=_env(), check=True, capture_output=True, timeout=120)
    before = _digest(out)
    hook = tmp_path / "hook.pid"
    env = {**_env(), layout.FAULT_ENV: f"atomic-commit:{hook}"}
    proc = subprocess.Popen(
        [*worker, "2"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    pid = wait_for(hook, proc, limit=120)
    os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert _digest(out) == before  # the previous output, intact
    orphans = [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]
    assert len(orphans) == 2 and any(p.name.endswith(layout.OWNER_SUFFIX) for p in orphans)  # temp + owner
    with caplog.at_level("WARNING", logger="qatlib.checkpoint.layout"):
        removed = layout.clean_stale(out)  # what the next run's first write does
    assert [p.name for p in removed] == [
        p.name for p in orphans if p.is_dir() or not p.name.endswith(".owner")
    ]
    assert f"left by process {pid}" in caplog.text
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    subprocess.run([*worker, "2"], env=_env(), check=True, capture_output=True, timeout=120)
    assert _digest(out) != before and sorted(p.name for p in tmp_path.iterdir()) == ["hook.pid", "out"]


def test_owner_alive_keeps_the_temporary(tmp_path):
    from qatlib.checkpoint import layout

    target = tmp_path / "x.json"
    tmp = layout._claim(target)
    tmp.write_text("{}")
    assert layout.clean_stale(target) == [] and tmp.exists()  # ours: a live owner
    rec = json.loads((tmp.parent / (tmp.name + layout.OWNER_SUFFIX)).read_text())
    rec["start"] = rec["start"] + 1  # same pid, another process (pid reuse)
    (tmp.parent / (tmp.name + layout.OWNER_SUFFIX)).write_text(json.dumps(rec))
    assert layout.clean_stale(target) == [tmp] and not tmp.exists()


def test_replacing_an_output_swaps_it_atomically(tmp_path, monkeypatch):
    from qatlib.checkpoint import layout

    out = tmp_path / "d"
    with layout.AtomicDir(out) as t:
        (t / "a").write_text("old")
    seen = []
    real = layout._exchange

    def spy(a, b):
        ok = real(a, b)
        seen.append((ok, (b / "a").read_text()))  # right after the swap: out is complete, and new
        return ok

    monkeypatch.setattr(layout, "_exchange", spy)
    with layout.AtomicDir(out, overwrite=True) as t:
        (t / "a").write_text("new")
    assert seen == [(True, "new")] and (out / "a").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


# --------------------------------------------------------------------------- bad inputs
def test_corrupt_safetensors_header_names_the_file(tmp_path):
    from safetensors.torch import save_file

    from qatlib.checkpoint.layout import CheckpointError
    from qatlib.checkpoint.safetensors import read_header

    f = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(4)}, str(f))
    raw = bytearray(f.read_bytes())
    raw[8:12] = b"\xff\xfe{["  # same length, not JSON: corrupt, not truncated
    f.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=rf"{f}: corrupt safetensors header"):
        read_header(f)


def test_index_naming_a_missing_shard_names_it(tmp_path):
    from qatlib.checkpoint.layout import WEIGHTS_INDEX_FILE, CheckpointError, weight_files

    model = build_model(tiny_qwen3_config(), seed=1)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    shards[1].unlink()
    with pytest.raises(
        CheckpointError, match=rf"{WEIGHTS_INDEX_FILE} names files that do not exist: {shards[1].name}"
    ):
        weight_files(tmp_path)


@pytest.mark.parametrize("content", ["", "\n\n"], ids=["empty", "blank-lines"])
def test_empty_training_file_names_it(tmp_path, tiny_tokenizer, content):
    from qatlib.data import DataError, load_training_data

    f = tmp_path / "train.jsonl"
    f.write_text(content)
    with pytest.raises(DataError, match=rf"{f}: no usable training samples"):
        load_training_data(f, tiny_tokenizer, 32)


# --------------------------------------------------------------------------- bad input, before the work
TEST_EXPERIMENT = REPO_ROOT / ".test" / "config" / "experiments" / "tiny-test.yaml"


def _qat_cli(tmp: Path, *sets: str, world: int = 1) -> subprocess.CompletedProcess:
    """scripts/qat.py on the CI experiment with a model path that does not exist: a refusal that
    comes before any model is read exits 2 with its message (a later one would name the path)."""
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "qat.py"), "-c", str(TEST_EXPERIMENT)]
    cmd += ["--model-path", str(tmp / "no-model"), "--save-path", str(tmp / "qat")]
    for s in sets:
        cmd += ["--set", s]
    env = {**_env(), "WORLD_SIZE": str(world)}
    return subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=300)


def test_bad_qat_inputs_are_refused_before_the_model_is_read(tmp_path):
    """``dataset.num_samples`` < world size, and resuming an HF checkpoint written by another
    number of ranks: scripts/qat.py exits 2 naming the field / the checkpoint before reading
    any model (the model path does not exist) and writes nothing."""
    r = _qat_cli(tmp_path, "dataset.num_samples=1", world=2)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "dataset.num_samples=1) for 2 ranks" in r.stderr and "no-model" not in r.stderr, r.stderr[-2000:]
    ckpt = tmp_path / "run" / "checkpoint-4"
    (ckpt / "global_step4").mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text("{}")
    for rank in range(2):  # DeepSpeed's per-rank ZeRO-3 optimizer partitions
        (ckpt / "global_step4" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"")
    r = _qat_cli(tmp_path, f"compression.QAT.resume_ckpt_dir={json.dumps(str(tmp_path / 'run'))}")
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"{ckpt}: written by 2 rank(s), this run has 1" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "qat").exists()


def test_fewer_training_samples_than_ranks_names_the_file(tmp_path, tiny_tokenizer, monkeypatch):
    """The config asked for enough, but the file holds fewer samples than ranks."""
    from qatlib.config import load_config
    from qatlib.data import DataError, training_data_from_config

    f = tmp_path / "train.txt"
    f.write_text("one short document of training text.\n")
    cfg = load_config(TEST_EXPERIMENT, [f"dataset.data_path={json.dumps(str(f))}", "dataset.num_samples=8"])
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert len(training_data_from_config(cfg, tiny_tokenizer)) == 1
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(
        DataError, match=rf"{f}: 1 training sample\(s\) \(dataset.num_samples=8\) for 2 ranks"
    ):
        training_data_from_config(cfg, tiny_tokenizer)


def test_resume_with_another_world_size_names_the_checkpoint(tmp_path):
    """A real one-process HF checkpoint (the Trainer's ``rng_state.pth``) refused for 2 ranks,
    accepted for 1; a saved model (no per-rank state) resumes at any world size."""
    from qatlib.resume import ResumeError, check_resume_world_size, saved_world_size

    run_guarded(tmp_path, {"what": "none"}, steps=1, only_model=False)
    ckpt = tmp_path / "trainer" / "checkpoint-1"
    assert saved_world_size(ckpt) == 1
    check_resume_world_size(tmp_path / "trainer", 1)
    with pytest.raises(ResumeError, match=rf"{ckpt}: written by 1 rank\(s\), this run has 2"):
        check_resume_world_size(tmp_path / "trainer", 2)
    saved = tmp_path / "saved"
    zs.save_consolidated(_prepared(), saved, scheme=SCHEME)
    check_resume_world_size(saved, 8)


def _prepared(vocab: int = VOCAB):
    m = build_model(tiny_qwen3_config(vocab_size=vocab), seed=1)
    prepare(m, SCHEME)
    return m


def test_teacher_with_another_vocabulary_is_refused(tmp_path):
    """KD against a teacher whose logits have another width: refused when the trainer is built
    (before any step), naming both vocabularies."""
    from transformers import TrainingArguments

    from qatlib.losses import LossConfig
    from qatlib.trainers.end2end import QATTrainer

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=1)
    kd = LossConfig(loss_type="kl", lm_loss_weight=0.0, kd_loss_weight=1.0)
    teacher = build_model(tiny_qwen3_config(vocab_size=VOCAB + 64), seed=2)
    with pytest.raises(ValueError, match=rf"teacher vocabulary \({VOCAB + 64} logits.*student's \({VOCAB},"):
        QATTrainer(_prepared(), args, loss_config=kd, teacher=teacher, train_dataset=[])
    QATTrainer(
        _prepared(), args, loss_config=kd, teacher=build_model(tiny_qwen3_config(), seed=2), train_dataset=[]
    )


def test_qat_save_writes_tokenizer_and_logs_in_the_one_commit(tmp_path, tiny_tokenizer):
    """scripts/qat.py's extra files (tokenizer, train log) go into the save's temporary folder
    (`save_consolidated(add_files=...)`): a failure while writing them leaves the previous output
    as it was and no temporary; on success they are in the output with the weights."""
    from qatlib.checkpoint.layout import TRAIN_LOG_FILE

    out = tmp_path / "qat"
    zs.save_consolidated(_prepared(), out, scheme=SCHEME)
    before = _digest(out)

    def failing(tmp: Path) -> None:
        tiny_tokenizer.save_pretrained(str(tmp))
        raise OSError("disk full")

    with pytest.raises(z.Zero3Error, match="OSError: disk full"):  # raised on every rank
        zs.save_consolidated(_prepared(), out, scheme=SCHEME, add_files=failing)
    assert _digest(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["qat"]

    def add(tmp: Path) -> None:
        assert not (out / "tokenizer.json").exists()  # not visible before the commit
        tiny_tokenizer.save_pretrained(str(tmp))
        (tmp / TRAIN_LOG_FILE).write_text('{"step": 1}\n')

    zs.save_consolidated(_prepared(), out, scheme=SCHEME, add_files=add)
    assert (out / "tokenizer.json").is_file() and (out / TRAIN_LOG_FILE).read_text() == '{"step": 1}\n'
    assert (out / "model.safetensors").is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["qat"]


@pytest.mark.slow  # a Snakemake DAG plus a 2-rank torchrun start (~20 s idle)
def test_snakemake_rule_fails_with_the_stages_message(tmp_path):
    """The `zero3_qat` rule of an experiment whose ``dataset.num_samples`` (1) is below its 2
    ranks: only that job runs (its inputs are placeholders: the script refuses before reading
    them), and Snakemake fails it with the script's message on every rank."""
    import shutil

    if shutil.which("snakemake") is None:
        pytest.skip("snakemake not installed")
    exps = tmp_path / "experiments"
    shutil.copytree(REPO_ROOT / ".test" / "config" / "experiments", exps)
    yml = exps / "tiny-test.yaml"
    yml.write_text(yml.read_text().replace("num_samples: 40", "num_samples: 1"))
    wd = tmp_path / "wd"
    for d in ("results/base/tiny-test", "results/tiny-test/ptq", "results/corpus"):
        (wd / d).mkdir(parents=True)
    (wd / "results/corpus/train.txt").write_text("text\n")
    cmd = [sys.executable, "-m", "snakemake", "results/tiny-test/qat", "-s", str(REPO_ROOT / "Snakefile")]
    cmd += ["--directory", str(wd), "-c2", "--configfile", str(REPO_ROOT / ".test/config/config.yaml")]
    cmd += ["--config", f"experiments_dir={exps}", "--allowed-rules", "zero3_qat"]
    r = subprocess.run(cmd, env=_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-4000:]
    assert "Error in rule zero3_qat" in out, out[-4000:]
    assert out.count("dataset.num_samples=1) for 2 ranks") >= 2, out[-4000:]  # both ranks
    log = (wd / "results/tiny-test/logs/zero3_qat.log").read_text()
    assert "dataset.num_samples=1) for 2 ranks" in log
    assert not (wd / "results/tiny-test/qat").exists()


def test_workflow_pins_the_cpu_kernels_of_every_job():
    """workflow/lib/launch.py's pin (the Snakefile calls it once; every job inherits it): the AVX2
    kernels of ATen / MKL on x86-64 (not oneDNN's ISA: its AVX2 path has no bf16 GEMM), a value
    the user exported wins, nothing on ARM; a process started with it runs torch's AVX2 kernels
    (checked where the CPU has AVX2)."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    from workflow.lib.launch import CPU_ARITHMETIC_ENV, pin_cpu_arithmetic

    env = {"ATEN_CPU_CAPABILITY": "default"}
    added = pin_cpu_arithmetic(env, machine="x86_64")
    assert env == {**CPU_ARITHMETIC_ENV, "ATEN_CPU_CAPABILITY": "default"}
    assert added == {"MKL_CBWR": "AVX2"}
    assert "ONEDNN_MAX_CPU_ISA" not in pin_cpu_arithmetic({}, machine="x86_64")
    arm: dict = {}
    assert pin_cpu_arithmetic(arm, machine="aarch64") == {} and arm == {}
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("no AVX2 on this CPU")
    env = {k: v for k, v in _env().items() if k not in CPU_ARITHMETIC_ENV}
    pin_cpu_arithmetic(env, machine="x86_64")
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "AVX2", out.stderr


# --------------------------------------------------------------------------- content hashes
def _product(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "model.safetensors").write_bytes(bytes(range(256)) * 40)
    (root / "config.json").write_text('{"a": 1}')
    (root / "sub" / "scales.safetensors").write_bytes(b"\x01\x02" * 100)
    (root / "tokenizer.json").write_text('{"vocab": {"a": 0}}')
    return root


def test_content_hash_equal_for_copies_and_changed_by_one_byte(tmp_path):
    """Two copies of the same content hash equal whatever the run records beside them (owner
    records, Snakemake's timestamp, logs, wall times); one changed byte, a renamed or a moved
    file changes the hash. A file hashes its bytes (sha256 computed here independently)."""
    import hashlib
    import shutil

    from qatlib.checkpoint.hashes import content_hash

    a = _product(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    (b / ".snakemake_timestamp").write_text("")
    (b / ".x.tmp-1.owner").write_text('{"pid": 1}')
    (b / "stage.log").write_text("took 3 s")
    (b / "run_metadata.json").write_text('{"peak_rss_bytes": 5}')
    (b / "train_log.jsonl").write_text('{"step": 1}\n')
    # the base-model stages' records (wall times, the host's wheel path): gguf, upcycle, pretrain
    for name in ("source.json", "upcycle_stats.json", "pretrain_stats.json"):
        (b / name).write_text('{"load_seconds": 27.37, "gguf_path": "/usr/lib/python3/x.gguf"}')
    assert content_hash(a) == content_hash(b) and content_hash(a).startswith("sha256:")
    data = (a / "model.safetensors").read_bytes()
    assert content_hash(a / "model.safetensors") == "sha256:" + hashlib.sha256(data).hexdigest()

    changed = bytearray(data)
    changed[1234] ^= 1
    (b / "model.safetensors").write_bytes(bytes(changed))
    assert content_hash(a) != content_hash(b)
    (b / "model.safetensors").write_bytes(data)
    assert content_hash(a) == content_hash(b)
    (b / "sub" / "scales.safetensors").rename(b / "scales.safetensors")  # same bytes, other name
    assert content_hash(a) != content_hash(b)
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        content_hash(tmp_path / "nothing-here")


def test_report_metrics_carry_the_content_hashes(tmp_path):
    """build_report writes ``hash/<product>`` for the corpus, tokenizer, base model and the
    experiment's ptq / qat / export into metrics.json and the metadata, with the CPU settings."""
    from qatlib.checkpoint.hashes import TOKENIZER_FILES, content_hash
    from qatlib.report import build_report

    exp = tmp_path / "exp"
    (exp / "eval").mkdir(parents=True)
    for v, ppl in (("bf16", 10.0), ("ptq", 12.0), ("qat", 11.0)):
        rec = {"variant": v, "ppl": {"t": {"ppl": ppl, "nll": 2.0, "tokens": 9, "windows": 1}}, "tasks": {}}
        (exp / "eval" / f"{v}.json").write_text(json.dumps(rec))
    for name in ("ptq", "qat", "export"):
        _product(exp / name)
    (exp / "qat" / "config.json").write_text('{"a": 2}')  # qat differs from ptq / export
    base = _product(tmp_path / "base")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "train.txt").write_text("some text\n")
    out = tmp_path / "site" / "report.html"
    build_report(
        exp,
        out,
        bench_dir=tmp_path / "none",
        products={"corpus": corpus, "tokenizer": base, "base_model": base},
    )
    metrics = json.loads((out.parent / "metrics.json").read_text())
    hashes = {k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith("hash/")}
    assert list(hashes) == ["base_model", "corpus", "export", "ptq", "qat", "tokenizer"]  # sorted keys
    assert hashes["ptq"] == hashes["export"] == hashes["base_model"] == content_hash(base)
    assert hashes["qat"] != hashes["ptq"]
    assert hashes["corpus"] == content_hash(corpus)
    assert hashes["tokenizer"] == content_hash(base, only=TOKENIZER_FILES) != hashes["base_model"]
    assert metrics["cpu/aten_capability"] == torch.backends.cpu.get_cpu_capability()
    assert metrics["cpu/torch_threads"] == torch.get_num_threads()
    html = out.read_text()
    assert "Content hashes" in html and all(h in html for h in hashes.values())
    assert html.index(hashes["corpus"]) < html.index(hashes["qat"])  # workflow order in the table


def test_reliability_table_names_existing_tests():

    page = (REPO_ROOT / "docs" / "reliability.md").read_text()
    section = page.split("## Reliability", 1)[1].split("\n## ", 1)[0]
    rows = [
        line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| Bad input")
    ]
    assert len(rows) >= 30, len(rows)
    for row in rows:
        m = re.search(r"`(test_\w+\.py)::(test_\w+)`", row)
        assert m, row
        src = (REPO_ROOT / "tests" / m[1]).read_text()
        assert re.search(rf"^def {m[2]}\(", src, re.M), f"{m[1]}::{m[2]} does not exist"


_SLOW_HEARTBEAT = """
import sys, time
from qatlib.zero3.peers import Heartbeat

class SlowStore:  # a store call that is still in flight when the process starts to exit
    def set(self, key, value):
        print("begin", flush=True)
        time.sleep(0.4)
        print("end", flush=True)

hb = Heartbeat(0, 2, interval=0.05)
hb.store = SlowStore()
hb.start()
time.sleep(0.2)  # the thread's first beat is now inside set
if sys.argv[1] == "stop":
    t = hb._thread
    hb.stop()
    print("alive" if t.is_alive() else "joined", flush=True)
"""


@pytest.mark.parametrize("how", ["stop", "exit"])
def test_heartbeat_thread_is_joined_before_the_process_exits(how):
    """A heartbeat beat in flight (a C++ store call) while the interpreter exits aborted a rank
    after its work succeeded (SIGABRT, "terminate called without an active exception"): `stop`
    waits for the thread, and an exit without `stop` (a worker that never closes its context)
    waits for it too. Every "begin" of a store call is followed by its "end"."""
    proc = subprocess.run(
        [sys.executable, "-c", _SLOW_HEARTBEAT, how], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.split()
    assert lines.count("begin") >= 2 and lines.count("begin") == lines.count("end"), lines
    if how == "stop":
        assert lines[-1] == "joined", lines
