"""The deployment runtimes (vLLM, SGLang) as qatlib sees them.

- `facts`: which export layouts each runtime (version named) loads, and the load-time
  transformations it applies to the scales, each with its source file:line;
- `fusion`: the linears a runtime fuses into one kernel (q/k/v, gate/up, a layer's experts);
- `differences`: the trained-vs-deployed differences of one model's export, measured;
- `ignore`: whether an ignore set reads the same in the runtimes (no split fused group);
- `emulate`: the model a runtime computes from an export, in plain PyTorch (the ``deployed``
  evaluation variant).
"""
