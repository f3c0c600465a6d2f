"""What qatlib changes in, or needs to know of, a transformers model's structure before any
quantizer is attached; the bottom layer, imported by everything that touches a model.

- `modeling`: where a causal LM keeps its decoder layers, what a dtype name means.
- `moe`: fused 3-D expert tensors turned into one ``nn.Linear`` per expert projection, so every
  expert weight is quantized and checkpoint keys equal module names.
- `frozen_linear`: the frozen output head and a linear's input gradient in a form the CPU runs fast.
"""
