"""Benchmarks of qatlib: quality (QAT vs PTQ), deployment, speed, memory and pipeline wall time.

One entry point writes every JSON under ``results/bench/``::

    python -m benchmarks.run [--only quality,speed,memory,pipeline,deployed] [--quick]

One module per question, calling qatlib's verbs; imports go one way (common <- lab_inputs <- lab
<- the questions <- run, checked by tests/test_benchmarks.py):

- ``common``: the machine record, paired timing, the format names, the default model, RSS, JSON;
- ``lab_inputs``, ``lab``: the quality lab (settings, model and data; PTQ, QAT, export, evaluation);
- ``quality`` (the default model's rows of #12 in ``quality_default``): BF16 vs PTQ vs QAT;
- ``deployed``: QAT's gain as trained and as the runtime deploys it;
- ``speed`` (its fused fake-quant proposal in ``fused_prototype``): what QAT costs per step;
- ``memory``, ``zero3_load``, ``stream_memory``, ``plan_rehearsal``: peak memory of the KD loss,
  the ZeRO-3 load, streamed PTQ / export, and every stage against `qatlib.plan`;
- ``qat_width``: one QAT step at Qwen3-30B-A3B's width; ``pipeline``: the workflow's stage times;
  ``gpu_check``: what only a GPU shows.

See benchmarks/README.md for what each file measures and how to read it.
"""
