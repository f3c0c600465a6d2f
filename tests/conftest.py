"""Shared fixtures: tiny Qwen3 / Qwen3-MoE models built from configs and an offline tokenizer.

Everything is built locally in seconds; nothing touches the hub.
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

VOCAB = 512


def tiny_qwen3_config(**kw):
    from transformers import Qwen3Config

    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                tie_word_embeddings=False)
    base.update(kw)
    return Qwen3Config(**base)


def tiny_qwen3_moe_config(**kw):
    from transformers import Qwen3MoeConfig

    base = dict(vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                num_experts_per_tok=2, max_position_embeddings=256, tie_word_embeddings=False)
    base.update(kw)
    return Qwen3MoeConfig(**base)


def build_model(config, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def local_texts(n_docs: int = 200) -> list[str]:
    """English prose available offline: docstrings of the Python standard library."""
    import collections
    import functools
    import itertools
    import json
    import os.path
    import re
    import string
    import textwrap

    docs = []
    for mod in (collections, functools, itertools, json, os.path, re, string, textwrap, inspect):
        for _, obj in inspect.getmembers(mod):
            d = inspect.getdoc(obj)
            if d and len(d) > 80:
                docs.append(d)
    docs = sorted(set(docs))
    return docs[:n_docs]


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    from qatlib.tokenizer import train_tokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    return train_tokenizer(local_texts(), vocab_size=VOCAB, out_dir=out)


@pytest.fixture
def tiny_qwen3():
    return build_model(tiny_qwen3_config())


@pytest.fixture
def tiny_qwen3_moe():
    return build_model(tiny_qwen3_moe_config())
