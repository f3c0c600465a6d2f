"""scripts/evaluate.py --layerwise (qatlib.eval.layerwise): a model evaluated one decoder layer at a
time, weights streamed from the checkpoint, gives the whole-model evaluation's perplexity; what
it cannot evaluate is refused by name before anything is loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import build_model, local_texts, stage_script, tiny_qwen3_moe_config

REPO = Path(__file__).resolve().parents[1]
EXP = REPO / "config/experiments/tiny-qwen3-moe.yaml"


@pytest.fixture(scope="module")
def evaluate_script():
    return stage_script("evaluate")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_tokenizer):
    """A tiny Qwen3-MoE checkpoint, a test text and a PTQ checkpoint of the experiment's scheme."""
    from qatlib.config import load_config
    from qatlib.ptq import calibrate, save_ptq_checkpoint

    root = tmp_path_factory.mktemp("layerwise")
    torch.manual_seed(0)
    model = build_model(tiny_qwen3_moe_config())
    model.save_pretrained(root / "base")
    tiny_tokenizer.save_pretrained(root / "base")
    (root / "test.txt").write_text("\n\n".join(local_texts(30)))
    sets = [
        f"model.model_path={root / 'base'}",
        f"evaluation.ppl=[{root / 'test.txt'}]",
        "evaluation.tasks=[]",
        "evaluation.max_seq_length=32",
        "evaluation.limit=6",
        "evaluation.batch_size=4",
    ]
    cfg = load_config(EXP, sets)
    ids = torch.randint(0, 200, (2, 32), generator=torch.Generator().manual_seed(1))
    report = calibrate(
        model, cfg.quant_scheme(), [ids], ignore=cfg.ignore_layers, options=cfg.prepare_options()
    )
    save_ptq_checkpoint(model, cfg.quant_scheme(), root / "ptq", calibration=report)
    return root, sets


def _argv(root, sets, variant, out, *extra):
    argv = ["-c", str(EXP), "--variant", variant, "--out", str(out), "--no-progress", *extra]
    return argv + [f"--set={s}" for s in sets]


@pytest.mark.parametrize("variant", ["bf16", "ptq"])
def test_layerwise_evaluation_is_the_whole_model_one(evaluate_script, setup, variant, single_thread):
    root, sets = setup
    scales = ["--scales", str(root / "ptq")] if variant == "ptq" else []
    res = {}
    for mode, flag in (("whole", []), ("layerwise", ["--layerwise"])):
        out = root / f"{variant}-{mode}.json"
        assert evaluate_script.main(_argv(root, sets, variant, out, *scales, *flag)) == 0
        res[mode] = json.loads(out.read_text())
    (key,) = res["whole"]["ppl"]
    whole, layer = res["whole"]["ppl"][key], res["layerwise"]["ppl"][key]
    assert layer["windows"] == whole["windows"] == 6 and layer["tokens"] == whole["tokens"]
    # bit-equal: the same layer computations on the same inputs, only the weights' residence differs
    assert layer["nll"] == whole["nll"]
    assert res["layerwise"]["layerwise"] is True and "layerwise" not in res["whole"]


def test_layerwise_differs_from_a_wrong_model(evaluate_script, setup, single_thread):
    """The equality above is not vacuous: PTQ's fake quantization changes the perplexity."""
    root, sets = setup
    nll = {}
    for variant, extra in (("bf16", []), ("ptq", ["--scales", str(root / "ptq")])):
        out = root / f"{variant}-lw2.json"
        assert evaluate_script.main(_argv(root, sets, variant, out, "--layerwise", *extra)) == 0
        nll[variant] = next(iter(json.loads(out.read_text())["ppl"].values()))["nll"]
    assert nll["bf16"] != nll["ptq"]


@pytest.mark.parametrize(
    "variant,extra_sets,match",
    [
        ("export", [], "not 'export'"),
        ("deployed", [], "not 'deployed'"),
        ("bf16", ["evaluation.tasks=[hellaswag]"], "evaluation.tasks"),
    ],
)
def test_layerwise_refuses_by_name_before_loading(evaluate_script, setup, capsys, variant, extra_sets, match):
    root, sets = setup
    argv = _argv(root, [*sets, *extra_sets], variant, root / "never.json", "--layerwise")
    with pytest.raises(SystemExit) as e:
        evaluate_script.main(argv)
    assert e.value.code == 2 and match in capsys.readouterr().err
    assert not (root / "never.json").exists()
