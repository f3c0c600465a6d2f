"""The deployment runtimes (vLLM, SGLang) as qatlib sees them.

- `facts`: which export layouts each runtime (version named) loads, and the load-time
  transformations it applies to the scales, each with its source file:line;
- `fusion`: the linears a runtime fuses into one kernel (q/k/v, gate/up, MLA's q_a / kv_a, linear
  attention's qkv / z and b / a, a layer's experts: `fusion.PACKED`, vLLM's packed_modules_mapping);
- `differences`: the trained-vs-deployed differences of one model's export, measured;
- `ignore`: whether an ignore set reads the same in the runtimes (no split fused group);
- `tying`: under ``deploy.target``, the quantizers a runtime merges share one scale
  (`tying.tie_for(target)` reaches `qatlib.quant.prepare` as ``PrepareOptions.deploy``);
- `emulate`: the model a runtime computes from an export, in plain PyTorch (the ``deployed``
  evaluation variant);
- `oracle` / `check`: the installed vLLM's own load path, run on CPU, against the emulator, fact by
  fact (``python -m qatlib.runtime.check``; docs/runtime-oracle.md); `load`: does vLLM load an
  export, with which method per layer (``python -m qatlib.runtime.load``; the family suite,
  docs/reference/families.md). Nothing in qatlib imports them.
"""
