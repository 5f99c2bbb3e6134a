"""Loss modules: CrossEntropyLoss, NLLLoss, MSELoss, L1Loss, BCEWithLogitsLoss (PyTorch's
arguments; class weights are buffers, as in PyTorch)."""

from __future__ import annotations

from anygpu.nn import functional as F
from anygpu.nn.module import Module
from anygpu.tensor import Tensor


class _Loss(Module):
    def __init__(self, size_average: bool | None = None, reduce: bool | None = None,
                 reduction: str = "mean") -> None:
        super().__init__()
        self.reduction = F._legacy(size_average, reduce, reduction)


class _WeightedLoss(_Loss):
    def __init__(self, weight: Tensor | None = None, size_average: bool | None = None,
                 reduce: bool | None = None, reduction: str = "mean") -> None:
        super().__init__(size_average, reduce, reduction)
        self.register_buffer("weight", weight)
        self.weight: Tensor | None


class CrossEntropyLoss(_WeightedLoss):
    """``log_softmax`` then negative log likelihood, from class indices or class
    probabilities; ``weight``, ``ignore_index`` and ``label_smoothing`` as in PyTorch.

    >>> import anygpu as ag
    >>> loss = CrossEntropyLoss()(ag.zeros(3, 4), ag.tensor([0, 1, 3]))
    >>> round(loss.item(), 4)  # log(4)
    1.3863
    """

    def __init__(self, weight: Tensor | None = None, size_average: bool | None = None,
                 ignore_index: int = -100, reduce: bool | None = None, reduction: str = "mean",
                 label_smoothing: float = 0.0) -> None:
        super().__init__(weight, size_average, reduce, reduction)
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(input, target, weight=self.weight, ignore_index=self.ignore_index,
                               reduction=self.reduction, label_smoothing=self.label_smoothing)


class NLLLoss(_WeightedLoss):
    """Negative log likelihood of class indices, for log-probability inputs."""

    def __init__(self, weight: Tensor | None = None, size_average: bool | None = None,
                 ignore_index: int = -100, reduce: bool | None = None,
                 reduction: str = "mean") -> None:
        super().__init__(weight, size_average, reduce, reduction)
        self.ignore_index = ignore_index

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return F.nll_loss(input, target, weight=self.weight, ignore_index=self.ignore_index,
                          reduction=self.reduction)


class MSELoss(_Loss):
    """Mean squared error.

    >>> import anygpu as ag
    >>> MSELoss()(ag.tensor([1.0, 2.0]), ag.tensor([0.0, 0.0])).item()
    2.5
    """

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return F.mse_loss(input, target, reduction=self.reduction)


class L1Loss(_Loss):
    """Mean absolute error."""

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return F.l1_loss(input, target, reduction=self.reduction)


class BCEWithLogitsLoss(_Loss):
    """Sigmoid and binary cross entropy in one numerically stable step; ``pos_weight``
    weighs the positive term per class."""

    def __init__(self, weight: Tensor | None = None, size_average: bool | None = None,
                 reduce: bool | None = None, reduction: str = "mean",
                 pos_weight: Tensor | None = None) -> None:
        super().__init__(size_average, reduce, reduction)
        self.register_buffer("weight", weight)
        self.register_buffer("pos_weight", pos_weight)
        self.weight: Tensor | None
        self.pos_weight: Tensor | None

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return F.binary_cross_entropy_with_logits(input, target, self.weight,
                                                  pos_weight=self.pos_weight,
                                                  reduction=self.reduction)


__all__ = ["CrossEntropyLoss", "NLLLoss", "MSELoss", "L1Loss", "BCEWithLogitsLoss"]
