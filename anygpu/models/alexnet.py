"""AlexNet (Krizhevsky et al., 2012, "One weird trick" variant), with torchvision's layers and
state_dict keys.

>>> import anygpu as ag
>>> from anygpu.models import alexnet
>>> model = alexnet(num_classes=10).eval()
>>> model(ag.randn(1, 3, 64, 64)).shape
(1, 10)
"""

from __future__ import annotations

from typing import Any

from anygpu import nn
from anygpu.models.weights import WeightsPath, build
from anygpu.tensor import Tensor


class AlexNet(nn.Module):
    """Five convolutions, three max-pools, an adaptive average pool to 6x6 (so any input of at
    least 63x63 works) and a three-layer classifier with dropout. Parameters keep PyTorch's
    default initialization, as torchvision's AlexNet does.

    >>> import anygpu as ag
    >>> model = AlexNet(num_classes=5, dropout=0.0)
    >>> [k for k in model.state_dict()][:2], model(ag.randn(2, 3, 63, 63)).shape
    (['features.0.weight', 'features.0.bias'], (2, 5))
    """

    def __init__(self, num_classes: int = 1000, dropout: float = 0.5) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, kernel_size=11, stride=4, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(64, 192, kernel_size=5, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(192, 384, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout),
            nn.Linear(256 * 6 * 6, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(p=dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(inplace=True),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(x.flatten(1))


def alexnet(*, weights: WeightsPath | None = None, progress: bool = True,
            **kwargs: Any) -> AlexNet:
    """AlexNet; ``weights`` is the path of a state_dict to load (safetensors or PyTorch),
    ``progress`` is accepted for torchvision's signature and ignored (nothing is downloaded).
    Other keywords (``num_classes``, ``dropout``) go to ``AlexNet``."""
    return build(AlexNet, weights, kwargs, "classifier.6.weight")


__all__ = ["AlexNet", "alexnet"]
