"""Benchmarks of qatlib: quality (QAT vs PTQ), speed, memory and pipeline wall time.

One entry point writes every JSON under ``results/bench/``::

    python -m benchmarks.run [--only quality,speed,memory,pipeline] [--quick]

See benchmarks/README.md for what each file measures and how to read it.
"""
