"""Write a tiny QAT model's consolidated save or export into OUT, replacing what is there; the test
sets QATLIB_FAULT_PAUSE so it stops at a save's commit point and SIGKILLs it.

Usage: python save_kill.py consolidated|export OUT SEED
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from qatlib.export import export
from qatlib.quant import Granularity, QuantScheme, QuantSpec, prepare
from qatlib.zero3 import save as zs

SCHEME = QuantScheme("w4g16", weight=QuantSpec("int4", Granularity.GROUP, group_size=16, symmetric=False))


def model(seed: int):
    cfg = Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(cfg).eval()
    prepare(m, SCHEME)
    return m


if __name__ == "__main__":
    mode, out, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "consolidated":
        zs.save_consolidated(model(seed), out, scheme=SCHEME)
    else:
        export(model(seed), SCHEME, out, "real", overwrite=True)
    print("SAVED")
