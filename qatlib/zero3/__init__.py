"""DeepSpeed ZeRO-3 and the streamed, one-layer-at-a-time paths: everything qatlib does so that a
model larger than one device (or than host RAM) trains, calibrates and exports.

In the order a run meets them (top to bottom; ``lint-imports`` holds the order):

- `load` builds the empty partitioned model and streams the checkpoint into it; `save` gathers
  the trained scales and weights back into a checkpoint; `vocab_parallel` runs the embedding and
  the output head from the ranks' partitions.
- `io` starts ZeRO-3 (distributed init, the DeepSpeed config kept referenced), detects it and
  gathers partitioned parameters; `onload` runs a model one decoder layer at a time from a
  checkpoint (PTQ, GPTQ, export, evaluation).
- `heap` (what glibc does with the memory a rank frees), `peers` (which rank died when a
  collective fails) and `ds_config` (the user's DeepSpeed JSON with qatlib's memory defaults).

Nothing is re-exported here: importing ``qatlib.zero3.ds_config`` (the config layer does) must not
import DeepSpeed.
"""
