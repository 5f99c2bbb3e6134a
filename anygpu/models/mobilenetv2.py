"""MobileNetV2 (Sandler et al., 2018): inverted residual blocks of depthwise convolutions,
with torchvision's layers, arguments, initialization and state_dict keys.

>>> import anygpu as ag
>>> from anygpu.models import mobilenet_v2
>>> model = mobilenet_v2(num_classes=10, width_mult=0.5).eval()
>>> model(ag.randn(1, 3, 32, 32)).shape
(1, 10)
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from anygpu import nn
from anygpu.models.weights import WeightsPath, build
from anygpu.nn import functional as F
from anygpu.nn import init
from anygpu.tensor import Tensor

NormLayer = Callable[[int], nn.Module]


def _make_divisible(v: float, divisor: int, min_value: int | None = None) -> int:
    """``v`` rounded to the nearest multiple of ``divisor`` (at least ``min_value``, by default
    ``divisor``), rounding up where rounding to nearest would lose more than 10%."""
    if min_value is None:
        min_value = divisor
    new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


class Conv2dNormActivation(nn.Sequential):
    """A convolution padded to keep the size (at stride 1), a norm layer and an activation,
    as entries 0, 1 and 2 of a Sequential. The convolution has a bias only when there is no
    norm layer (unless ``bias`` says otherwise); ``None`` leaves the norm or activation out.

    >>> import anygpu as ag
    >>> block = Conv2dNormActivation(3, 8, stride=2)
    >>> block(ag.randn(1, 3, 16, 16)).shape, list(block.state_dict())[:2]
    ((1, 8, 8, 8), ['0.weight', '1.weight'])
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3,
                 stride: int = 1, padding: int | None = None, groups: int = 1,
                 norm_layer: NormLayer | None = nn.BatchNorm2d,
                 activation_layer: Callable[..., nn.Module] | None = nn.ReLU,
                 dilation: int = 1, inplace: bool | None = True,
                 bias: bool | None = None) -> None:
        if padding is None:
            padding = (kernel_size - 1) // 2 * dilation
        if bias is None:
            bias = norm_layer is None
        layers: list[nn.Module] = [nn.Conv2d(in_channels, out_channels, kernel_size, stride,
                                             padding, dilation=dilation, groups=groups,
                                             bias=bias)]
        if norm_layer is not None:
            layers.append(norm_layer(out_channels))
        if activation_layer is not None:
            layers.append(activation_layer() if inplace is None
                          else activation_layer(inplace=inplace))
        super().__init__(*layers)
        self.out_channels = out_channels


class InvertedResidual(nn.Module):
    """1x1 expansion by ``expand_ratio`` (left out at ratio 1), 3x3 depthwise convolution
    carrying the stride, both with ReLU6, then a linear 1x1 projection; added to the input
    when the stride is 1 and the channels stay the same."""

    def __init__(self, inp: int, oup: int, stride: int, expand_ratio: int,
                 norm_layer: NormLayer | None = None) -> None:
        super().__init__()
        if stride not in (1, 2):
            raise ValueError(f"stride should be 1 or 2 instead of {stride}")
        if norm_layer is None:
            norm_layer = nn.BatchNorm2d
        self.stride = stride
        hidden_dim = int(round(inp * expand_ratio))
        self.use_res_connect = stride == 1 and inp == oup
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(Conv2dNormActivation(inp, hidden_dim, kernel_size=1,
                                               norm_layer=norm_layer,
                                               activation_layer=nn.ReLU6))
        layers += [
            Conv2dNormActivation(hidden_dim, hidden_dim, stride=stride, groups=hidden_dim,
                                 norm_layer=norm_layer, activation_layer=nn.ReLU6),
            nn.Conv2d(hidden_dim, oup, 1, 1, 0, bias=False),
            norm_layer(oup),
        ]
        self.conv = nn.Sequential(*layers)
        self.out_channels = oup

    def forward(self, x: Tensor) -> Tensor:
        out = self.conv(x)
        return x + out if self.use_res_connect else out


# expansion t, output channels c, repeats n, first stride s of each stage
DEFAULT_SETTING = [[1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 3, 2], [6, 64, 4, 2], [6, 96, 3, 1],
                   [6, 160, 3, 2], [6, 320, 1, 1]]


class MobileNetV2(nn.Module):
    """A stride-2 3x3 stem of 32 channels, the inverted residual stages of
    ``inverted_residual_setting`` (rows of expansion, channels, repeats, stride), a 1x1
    convolution to 1280 channels, global average pooling, dropout and a linear classifier.
    ``width_mult`` scales every channel count (rounded to multiples of ``round_nearest``; the
    last one never shrinks). The input size only needs to survive five halvings.

    Convolutions start from He-normal weights (fan_out) and zero bias, norm layers from weight
    1 and bias 0, the linear layer from N(0, 0.01) weights and zero bias.

    >>> import anygpu as ag
    >>> model = MobileNetV2(num_classes=3, width_mult=0.25)
    >>> model.last_channel, model(ag.randn(2, 3, 32, 32)).shape
    (1280, (2, 3))
    """

    def __init__(self, num_classes: int = 1000, width_mult: float = 1.0,
                 inverted_residual_setting: Sequence[Sequence[int]] | None = None,
                 round_nearest: int = 8, block: Callable[..., nn.Module] | None = None,
                 norm_layer: NormLayer | None = None, dropout: float = 0.2) -> None:
        super().__init__()
        if block is None:
            block = InvertedResidual
        if norm_layer is None:
            norm_layer = nn.BatchNorm2d
        input_channel = 32
        last_channel = 1280
        if inverted_residual_setting is None:
            inverted_residual_setting = DEFAULT_SETTING
        if len(inverted_residual_setting) == 0 or len(inverted_residual_setting[0]) != 4:
            raise ValueError("inverted_residual_setting should be non-empty and a 4-element "
                             f"list, got {inverted_residual_setting}")
        input_channel = _make_divisible(input_channel * width_mult, round_nearest)
        self.last_channel = _make_divisible(last_channel * max(1.0, width_mult), round_nearest)
        features: list[nn.Module] = [
            Conv2dNormActivation(3, input_channel, stride=2, norm_layer=norm_layer,
                                 activation_layer=nn.ReLU6)]
        for t, c, n, s in inverted_residual_setting:
            output_channel = _make_divisible(c * width_mult, round_nearest)
            for i in range(n):
                features.append(block(input_channel, output_channel, s if i == 0 else 1,
                                      expand_ratio=t, norm_layer=norm_layer))
                input_channel = output_channel
        features.append(Conv2dNormActivation(input_channel, self.last_channel, kernel_size=1,
                                             norm_layer=norm_layer,
                                             activation_layer=nn.ReLU6))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(p=dropout),
                                        nn.Linear(self.last_channel, num_classes))

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                init.kaiming_normal_(m.weight, mode="fan_out")
                if m.bias is not None:
                    init.zeros_(m.bias)
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                init.ones_(m.weight)
                init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                init.normal_(m.weight, 0, 0.01)
                init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        x = F.adaptive_avg_pool2d(self.features(x), (1, 1))
        return self.classifier(x.flatten(1))


def mobilenet_v2(*, weights: WeightsPath | None = None, progress: bool = True,
                 **kwargs: Any) -> MobileNetV2:
    """MobileNetV2; ``weights`` is the path of a state_dict to load (safetensors or PyTorch;
    torchvision's checkpoints fit), ``progress`` is accepted for torchvision's signature and
    ignored (nothing is downloaded). Other keywords (``num_classes``, ``width_mult``,
    ``inverted_residual_setting``, ``round_nearest``, ``dropout``, ...) go to
    ``MobileNetV2``."""
    return build(MobileNetV2, weights, kwargs, "classifier.1.weight")


__all__ = ["MobileNetV2", "InvertedResidual", "Conv2dNormActivation", "mobilenet_v2"]
