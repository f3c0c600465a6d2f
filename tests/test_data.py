"""SFT / text / parquet data: last-reply supervision, truncation accounting, errors, collation."""

from __future__ import annotations

import json

import pytest
import torch

from qatlib.data import DataError, PadCollator, load_training_data, record_to_messages, sft_sample
from qatlib.losses import IGNORE_INDEX

CONV = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is a list?"},
    {"role": "assistant", "content": "A sequence."},
    {"role": "user", "content": "And a tuple?"},
    {"role": "assistant", "content": "An immutable sequence of objects."},
]


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _first_supervised(sample):
    return next(i for i, v in enumerate(sample["labels"]) if v != IGNORE_INDEX)


def test_first_label_right_after_assistant_header(tiny_tokenizer):
    s = sft_sample(CONV, tiny_tokenizer, 512)
    header = tiny_tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    i = _first_supervised(s)
    ids = s["input_ids"]
    # the tokens just before the first supervised label are the LAST assistant header
    assert ids[i - len(header) : i] == header
    prompt = tiny_tokenizer.apply_chat_template(CONV[:-1], add_generation_prompt=True, tokenize=True)
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    assert i == len(prompt)
    # supervised text = the last reply (+ the end-of-turn marker); the earlier reply is not supervised
    sup = tiny_tokenizer.decode([t for t in s["labels"] if t != IGNORE_INDEX])
    assert sup == "An immutable sequence of objects.<|im_end|>\n"
    assert s["labels"][:i] == [IGNORE_INDEX] * i and len(s["labels"]) == len(ids)


def test_schemas_are_equivalent(tiny_tokenizer, tmp_path):
    msgs = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello friend"}]
    sharegpt = {
        "conversations": [{"from": "human", "value": "hi there"}, {"from": "gpt", "value": "hello friend"}]
    }
    io = {"input": "hi there", "output": "hello friend"}
    p = _write_jsonl(tmp_path / "d.jsonl", [{"messages": msgs}, sharegpt, io])
    ds = load_training_data(p, tiny_tokenizer, 128)
    assert len(ds) == 3 and ds.stats.records == 3 and ds.stats.kind == "chat"
    assert ds[0] == ds[1] == ds[2]
    assert record_to_messages(sharegpt) == msgs


def test_truncated_prompts_are_dropped_and_counted(tiny_tokenizer, tmp_path):
    long_prompt = {
        "messages": [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]
    }
    short = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello " * 50}]}
    p = _write_jsonl(tmp_path / "d.jsonl", [long_prompt, short, long_prompt])
    ds = load_training_data(p, tiny_tokenizer, 32)
    assert len(ds) == 1
    assert ds.stats.dropped_no_supervised == 2 and ds.stats.truncated == 3
    assert len(ds[0]["input_ids"]) == 32


def test_num_samples_and_text_blocks(tiny_tokenizer, tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 80)
    ds = load_training_data(text, tiny_tokenizer, 16, num_samples=5)
    assert len(ds) == 5 and ds.stats.kind == "text"
    for s in ds:
        assert len(s["input_ids"]) == 16 and s["labels"] == s["input_ids"]  # every token supervised
    p = _write_jsonl(tmp_path / "d.jsonl", [{"messages": CONV}] * 10)
    assert len(load_training_data(p, tiny_tokenizer, 256, num_samples=4)) == 4


def test_home_folder_in_a_data_path(tiny_tokenizer, tmp_path, monkeypatch):
    """``~/corpus.txt`` in a YAML is the home folder's file (not a hub dataset id)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "corpus.txt").write_text("The quick brown fox jumps over the lazy dog. " * 80)
    ds = load_training_data("~/corpus.txt", tiny_tokenizer, 16, num_samples=3)
    assert len(ds) == 3 and ds.stats.kind == "text"
    with pytest.raises(DataError, match="file not found"):
        load_training_data("~/missing.txt", tiny_tokenizer, 16)


def test_text_samples_spread_over_the_file(tiny_tokenizer, tmp_path):
    """num_samples below the block count takes blocks from the whole file, not its head (split
    files are in source order)."""
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"Section {i}: " + "words and more words here. " * 6 + "\n\n" for i in range(40)))
    every = load_training_data(text, tiny_tokenizer, 16, num_samples=None)
    n = len(every)
    some = load_training_data(text, tiny_tokenizer, 16, num_samples=4)
    assert n > 8 and len(some) == 4
    assert [s["input_ids"] for s in some] == [every[i * n // 4]["input_ids"] for i in range(4)]
    assert some[3]["input_ids"] == every[3 * n // 4]["input_ids"] != every[3]["input_ids"]


def test_parquet_messages_and_text(tiny_tokenizer, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.Table.from_pylist([{"messages": CONV}, {"messages": CONV[:3]}]), tmp_path / "chat.parquet"
    )
    ds = load_training_data(tmp_path / "chat.parquet", tiny_tokenizer, 256)
    assert len(ds) == 2 and ds[0] == sft_sample(CONV, tiny_tokenizer, 256)
    pq.write_table(
        pa.Table.from_pylist([{"text": "alpha beta gamma delta " * 30}] * 3), tmp_path / "t.parquet"
    )
    assert load_training_data(tmp_path / "t.parquet", tiny_tokenizer, 24).stats.kind == "text"


def test_bad_jsonl_names_file_and_line(tiny_tokenizer, tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"messages": CONV}) + "\n\n{not json}\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:3: invalid JSON"):
        load_training_data(p, tiny_tokenizer, 256)
    p.write_text(json.dumps({"messages": CONV}) + "\n" + json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:2: no known schema"):
        load_training_data(p, tiny_tokenizer, 256)
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:1: .*no assistant reply"):
        load_training_data(p, tiny_tokenizer, 256)
    p.write_text(json.dumps({"conversations": [{"from": "alien", "value": "x"}]}) + "\n")
    with pytest.raises(DataError, match="unknown ShareGPT speaker"):
        load_training_data(p, tiny_tokenizer, 256)
    with pytest.raises(DataError, match="file not found"):
        load_training_data(tmp_path / "missing.jsonl", tiny_tokenizer, 256)


def test_hf_dataset_id_goes_to_load_dataset(tiny_tokenizer, monkeypatch):
    import datasets

    seen = {}

    def fake_load(*args, split=None, cache_dir=None):
        seen.update(args=args, split=split, cache_dir=cache_dir)
        return [{"text": "some words for a block " * 20}]

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    ds = load_training_data("Salesforce/wikitext,wikitext-2-raw-v1", tiny_tokenizer, 16, hf_cache_dir="/c")
    assert seen == {"args": ("Salesforce/wikitext", "wikitext-2-raw-v1"), "split": "train", "cache_dir": "/c"}
    assert len(ds) > 0


def test_collator_pads_to_batch_max():
    coll = PadCollator(pad_token_id=7)
    b = coll([{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}, {"input_ids": [4], "labels": [4]}])
    assert b["input_ids"].tolist() == [[1, 2, 3], [4, 7, 7]]
    assert b["labels"].tolist() == [[-100, 2, 3], [4, -100, -100]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b["input_ids"].dtype == torch.long
