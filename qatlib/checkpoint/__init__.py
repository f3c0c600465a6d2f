"""The PTQ / QAT checkpoint contract of docs/design.md, and nothing else.

- `layout`: file names, where a checkpoint's files are (`resolve_dir`, `weight_files`), its
  ``quant_scheme.json``, atomic writing (`AtomicDir`, `write_json`, `write_text`), `CheckpointError`;
- `keys`: the one module-name <-> checkpoint-key table (`scale_keys`, `parse_key`,
  `scale_state_dict`, `load_scales`);
- `conversion`: where each checkpoint key lands (a parameter, or a slice of one), by transformers'
  own key conversion for the model's class (renamings, converters followed slice by slice), and
  the names ``save_pretrained`` writes back (`saved_names`);
- `saved_keys`: its inverse for every writer: a linearised expert under the key that fills it
  (`expert_names`, `checkpoint_names`);
- `safetensors`: the file reader (no mmap) and the key -> parameter-slice plans built from
  `conversion`'s placement, which know names and shapes only (the ZeRO-3 loader executes them on
  partitioned parameters).
"""

from .layout import CheckpointError

__all__ = ["CheckpointError"]
