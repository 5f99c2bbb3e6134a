"""Optimizers and learning-rate schedules with PyTorch's names and defaults."""

from anygpu.optim import lr_scheduler
from anygpu.optim.adam import Adam, AdamW
from anygpu.optim.optimizer import Optimizer
from anygpu.optim.sgd import SGD

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "lr_scheduler"]
