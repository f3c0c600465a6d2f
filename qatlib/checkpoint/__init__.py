"""The PTQ / QAT checkpoint contract of docs/design.md, and nothing else.

- `layout`: file names, where a checkpoint's files are (`resolve_dir`, `weight_files`), its
  ``quant_scheme.json``, atomic writing (`AtomicDir`, `write_json`, `write_text`), `CheckpointError`;
- `keys`: the one module-name <-> checkpoint-key table (`scale_keys`, `parse_key`,
  `scale_state_dict`, `load_scales`);
- `safetensors`: the file reader (no mmap) and the key -> parameter-slice plans (dense, fused and
  per-expert MoE), which know names and shapes only (the ZeRO-3 loader executes them on partitioned parameters).
"""

from .layout import CheckpointError

__all__ = ["CheckpointError"]
