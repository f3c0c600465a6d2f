"""QAT trainers: end-to-end on the HF Trainer (`end2end`), per decoder block (`blockwise`), and the
trainable-parameter selection they share (`params`)."""

from .params import Learnable, TrainableParams, apply_learnable, param_groups, select_trainable

__all__ = ["Learnable", "TrainableParams", "apply_learnable", "param_groups", "select_trainable"]
