"""VGG (Simonyan and Zisserman, 2015), configurations A, B, D and E (11, 13, 16 and 19 weight
layers), with or without batch norm: torchvision's layers, initialization and state_dict keys.

>>> import anygpu as ag
>>> from anygpu.models import vgg11
>>> model = vgg11(num_classes=10).eval()
>>> model(ag.randn(1, 3, 32, 32)).shape
(1, 10)
"""

from __future__ import annotations

from typing import Any, Sequence, Union

from anygpu import nn
from anygpu.models.weights import WeightsPath, build
from anygpu.nn import init
from anygpu.tensor import Tensor

# the feature extractor of each configuration: output channels of a 3x3 convolution, or "M"
# for a 2x2 max-pool
CONFIGS: dict[str, list[Union[int, str]]] = {
    "A": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "B": [64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "D": [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512,
          "M"],
    "E": [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512,
          512, 512, 512, "M"],
}


def make_layers(config: Sequence[Union[int, str]], batch_norm: bool = False) -> nn.Sequential:
    """The feature extractor for ``config``: each number a 3x3 convolution (padding 1, with
    bias) followed by batch norm if asked and ReLU, each "M" a 2x2 max-pool."""
    layers: list[nn.Module] = []
    in_channels = 3
    for v in config:
        if v == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            continue
        channels = int(v)
        layers.append(nn.Conv2d(in_channels, channels, kernel_size=3, padding=1))
        if batch_norm:
            layers.append(nn.BatchNorm2d(channels))
        layers.append(nn.ReLU(inplace=True))
        in_channels = channels
    return nn.Sequential(*layers)


class VGG(nn.Module):
    """``features`` (see ``make_layers``), an adaptive average pool to 7x7 (so any input of at
    least 32x32 works) and a three-layer classifier with dropout.

    Convolutions start from He-normal weights (fan_out, ReLU gain) and zero bias, batch norms
    from weight 1 and bias 0, linear layers from N(0, 0.01) weights and zero bias (with
    ``init_weights``, the default).

    >>> import anygpu as ag
    >>> model = VGG(make_layers([16, "M", 512, "M"]), num_classes=4)
    >>> model.classifier[0].in_features, model(ag.randn(1, 3, 8, 8)).shape
    (25088, (1, 4))
    """

    def __init__(self, features: nn.Module, num_classes: int = 1000, init_weights: bool = True,
                 dropout: float = 0.5) -> None:
        super().__init__()
        self.features = features
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096),
            nn.ReLU(True),
            nn.Dropout(p=dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(True),
            nn.Dropout(p=dropout),
            nn.Linear(4096, num_classes),
        )
        if init_weights:
            for m in self.modules():
                if isinstance(m, nn.Conv2d):
                    init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                    if m.bias is not None:
                        init.constant_(m.bias, 0)
                elif isinstance(m, nn.BatchNorm2d):
                    init.constant_(m.weight, 1)
                    init.constant_(m.bias, 0)
                elif isinstance(m, nn.Linear):
                    init.normal_(m.weight, 0, 0.01)
                    init.constant_(m.bias, 0)

    def forward(self, x: Tensor) -> Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(x.flatten(1))


def _vgg(config: str, batch_norm: bool, weights: WeightsPath | None,
         kwargs: dict[str, Any]) -> VGG:
    """What every constructor below does: ``weights`` is the path of a state_dict to load
    (safetensors or PyTorch; torchvision's checkpoints fit), and the other keywords
    (``num_classes``, ``init_weights``, ``dropout``) go to ``VGG``. The constructors take
    ``progress`` for torchvision's signature and ignore it: nothing is downloaded."""

    def factory(**kw: Any) -> VGG:
        return VGG(make_layers(CONFIGS[config], batch_norm=batch_norm), **kw)

    return build(factory, weights, kwargs, "classifier.6.weight")


def vgg11(*, weights: WeightsPath | None = None, progress: bool = True, **kwargs: Any) -> VGG:
    """VGG-11 (configuration A). See ``_vgg`` for the arguments."""
    return _vgg("A", False, weights, kwargs)


def vgg11_bn(*, weights: WeightsPath | None = None, progress: bool = True,
             **kwargs: Any) -> VGG:
    """VGG-11 (configuration A) with batch norm. See ``_vgg`` for the arguments."""
    return _vgg("A", True, weights, kwargs)


def vgg13(*, weights: WeightsPath | None = None, progress: bool = True, **kwargs: Any) -> VGG:
    """VGG-13 (configuration B). See ``_vgg`` for the arguments."""
    return _vgg("B", False, weights, kwargs)


def vgg13_bn(*, weights: WeightsPath | None = None, progress: bool = True,
             **kwargs: Any) -> VGG:
    """VGG-13 (configuration B) with batch norm. See ``_vgg`` for the arguments."""
    return _vgg("B", True, weights, kwargs)


def vgg16(*, weights: WeightsPath | None = None, progress: bool = True, **kwargs: Any) -> VGG:
    """VGG-16 (configuration D). See ``_vgg`` for the arguments."""
    return _vgg("D", False, weights, kwargs)


def vgg16_bn(*, weights: WeightsPath | None = None, progress: bool = True,
             **kwargs: Any) -> VGG:
    """VGG-16 (configuration D) with batch norm. See ``_vgg`` for the arguments."""
    return _vgg("D", True, weights, kwargs)


def vgg19(*, weights: WeightsPath | None = None, progress: bool = True, **kwargs: Any) -> VGG:
    """VGG-19 (configuration E). See ``_vgg`` for the arguments."""
    return _vgg("E", False, weights, kwargs)


def vgg19_bn(*, weights: WeightsPath | None = None, progress: bool = True,
             **kwargs: Any) -> VGG:
    """VGG-19 (configuration E) with batch norm. See ``_vgg`` for the arguments."""
    return _vgg("E", True, weights, kwargs)


__all__ = ["VGG", "make_layers", "vgg11", "vgg11_bn", "vgg13", "vgg13_bn", "vgg16", "vgg16_bn",
           "vgg19", "vgg19_bn"]
