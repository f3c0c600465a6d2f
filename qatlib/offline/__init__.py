"""What lets the default experiment run without the hub: the fixtures a CI machine cannot download.

- `corpus` (+ `cleaning`): an English corpus from the docstrings installed packages ship;
- `tokenizer`: a byte-level BPE trained on it, saved as a HF tokenizer folder;
- `base_model`: a tiny Qwen3-MoE / Qwen3 pre-trained on it (was ``qatlib.pretrain``);
- `mc_task`: a local lm-eval multiple-choice task from the held-out split.

None of this is QAT: no QAT module imports this package (only ``scripts/{corpus,base_model,
local_task}.py``, the benchmarks and the tests do). Importing the package imports nothing.
"""
