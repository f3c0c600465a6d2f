"""The base-model stages' one way of writing their folder (`qatlib.offline.publish`)."""

from __future__ import annotations

import json

import pytest
from conftest import build_model, tiny_llama_config
from transformers import LlamaForCausalLM

from qatlib.offline.publish import save_model_folder


class _Tok:
    """The tokenizer half of the contract: ``save_pretrained(folder)``."""

    def save_pretrained(self, folder: str) -> None:
        with open(f"{folder}/tokenizer.json", "w") as f:
            f.write("{}")


def _model():
    return build_model(tiny_llama_config())


def test_saves_weights_tokenizer_and_the_record_that_saw_them(tmp_path):
    out = tmp_path / "base"
    seen = {}

    def record(folder):
        seen["files"] = sorted(p.name for p in folder.iterdir())
        return {"files": seen["files"]}

    rec = save_model_folder(out, _model(), _Tok(), "stats.json", record)
    assert "model.safetensors" in rec["files"] and "tokenizer.json" in rec["files"]
    assert json.loads((out / "stats.json").read_text()) == rec
    reloaded = LlamaForCausalLM.from_pretrained(out)
    assert reloaded.config.hidden_size == 64


def test_a_failing_record_leaves_no_folder_and_keeps_the_old_one(tmp_path):
    out = tmp_path / "base"
    save_model_folder(out, _model(), _Tok(), "stats.json", lambda _f: {"run": 1})

    def broken(_folder):
        raise RuntimeError("record failed")

    with pytest.raises(RuntimeError, match="record failed"):
        save_model_folder(out, _model(), _Tok(), "stats.json", broken)
    assert json.loads((out / "stats.json").read_text()) == {"run": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]
