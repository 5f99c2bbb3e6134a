"""The torchvision classification models the tests compare against, written in plain torch.nn
for machines without torchvision: same layers, same forward computation, same state_dict keys
(names, shapes, order, buffers). Only what the comparisons need is here: construction with
torchvision's keyword arguments and PyTorch's default initialization (the tests overwrite it).
Where torchvision is installed, the tests use it instead."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _conv_bn_act(cin: int, cout: int, k: int, stride: int = 1, groups: int = 1,
                 act: Any = nn.ReLU6) -> nn.Sequential:
    """torchvision's Conv2dNormActivation: entries 0 (conv, no bias), 1 (batch norm), 2."""
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride, (k - 1) // 2, groups=groups,
                                   bias=False), nn.BatchNorm2d(cout), act(inplace=True))


# ---- AlexNet -------------------------------------------------------------------------------------
class AlexNet(nn.Module):
    def __init__(self, num_classes: int = 1000, dropout: float = 0.5) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        cin = 3
        # (out channels, kernel, stride, padding, pool after)
        for cout, k, s, p, pool in [(64, 11, 4, 2, True), (192, 5, 1, 2, True),
                                    (384, 3, 1, 1, False), (256, 3, 1, 1, False),
                                    (256, 3, 1, 1, True)]:
            layers += [nn.Conv2d(cin, cout, k, s, p), nn.ReLU(inplace=True)]
            if pool:
                layers.append(nn.MaxPool2d(3, 2))
            cin = cout
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(6)
        self.classifier = nn.Sequential(
            nn.Dropout(dropout), nn.Linear(9216, 4096), nn.ReLU(inplace=True),
            nn.Dropout(dropout), nn.Linear(4096, 4096), nn.ReLU(inplace=True),
            nn.Linear(4096, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def alexnet(weights: None = None, **kw: Any) -> AlexNet:
    return AlexNet(**kw)


# ---- VGG -----------------------------------------------------------------------------------------
_VGG_DEPTHS = {11: [1, 1, 2, 2, 2], 13: [2, 2, 2, 2, 2], 16: [2, 2, 3, 3, 3],
               19: [2, 2, 4, 4, 4]}  # 3x3 convolutions before each of the five max-pools


class VGG(nn.Module):
    def __init__(self, depth: int, bn: bool, num_classes: int = 1000, dropout: float = 0.5,
                 init_weights: bool = True) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        cin = 3
        for stage, count in enumerate(_VGG_DEPTHS[depth]):
            cout = min(64 * 2 ** stage, 512)
            for _ in range(count):
                layers.append(nn.Conv2d(cin, cout, 3, padding=1))
                layers += [nn.BatchNorm2d(cout)] if bn else []
                layers.append(nn.ReLU(inplace=True))
                cin = cout
            layers.append(nn.MaxPool2d(2, 2))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(25088, 4096), nn.ReLU(True), nn.Dropout(dropout),
            nn.Linear(4096, 4096), nn.ReLU(True), nn.Dropout(dropout),
            nn.Linear(4096, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.avgpool(self.features(x)).flatten(1))


def vgg11(weights: None = None, **kw: Any) -> VGG:
    return VGG(11, False, **kw)


def vgg13(weights: None = None, **kw: Any) -> VGG:
    return VGG(13, False, **kw)


def vgg16(weights: None = None, **kw: Any) -> VGG:
    return VGG(16, False, **kw)


def vgg19(weights: None = None, **kw: Any) -> VGG:
    return VGG(19, False, **kw)


def vgg11_bn(weights: None = None, **kw: Any) -> VGG:
    return VGG(11, True, **kw)


def vgg13_bn(weights: None = None, **kw: Any) -> VGG:
    return VGG(13, True, **kw)


def vgg16_bn(weights: None = None, **kw: Any) -> VGG:
    return VGG(16, True, **kw)


def vgg19_bn(weights: None = None, **kw: Any) -> VGG:
    return VGG(19, True, **kw)


# ---- ResNet --------------------------------------------------------------------------------------
class _Block(nn.Module):
    """Basic (two 3x3) or bottleneck (1x1, 3x3, 1x1) residual block; the attribute names
    (conv1, bn1, ..., downsample) are the state_dict's."""

    def __init__(self, bottleneck: bool, cin: int, planes: int, stride: int, groups: int,
                 width_per_group: int, dilation: int) -> None:
        super().__init__()
        self.bottleneck = bottleneck
        cout = planes * (4 if bottleneck else 1)
        if bottleneck:
            width = planes * width_per_group // 64 * groups
            self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(width)
            self.conv2 = nn.Conv2d(width, width, 3, stride, dilation, dilation, groups,
                                   bias=False)
            self.bn2 = nn.BatchNorm2d(width)
            self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
            self.bn3 = nn.BatchNorm2d(cout)
        else:
            self.conv1 = nn.Conv2d(cin, planes, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        if not bottleneck:
            self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        if self.bottleneck:
            y = self.bn3(self.conv3(torch.relu(y)))
        skip = x if self.downsample is None else self.downsample(x)
        return torch.relu(y + skip)


class ResNet(nn.Module):
    def __init__(self, bottleneck: bool, depths: list[int], num_classes: int = 1000,
                 groups: int = 1, width_per_group: int = 64,
                 replace_stride_with_dilation: list[bool] | None = None) -> None:
        super().__init__()
        dilate = list(replace_stride_with_dilation or [False] * 3)
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin, dilation = 64, 1
        for stage, count in enumerate(depths):
            planes = 64 * 2 ** stage
            stride = 1 if stage == 0 else 2
            first_dilation = dilation
            if stage > 0 and dilate[stage - 1]:
                dilation, stride = dilation * 2, 1
            blocks = []
            for i in range(count):
                blocks.append(_Block(bottleneck, cin, planes, stride if i == 0 else 1, groups,
                                     width_per_group, first_dilation if i == 0 else dilation))
                cin = planes * (4 if bottleneck else 1)
            setattr(self, f"layer{stage + 1}", nn.Sequential(*blocks))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for stage in (self.layer1, self.layer2, self.layer3, self.layer4):
            x = stage(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(weights: None = None, **kw: Any) -> ResNet:
    return ResNet(False, [2, 2, 2, 2], **kw)


def resnet34(weights: None = None, **kw: Any) -> ResNet:
    return ResNet(False, [3, 4, 6, 3], **kw)


def resnet50(weights: None = None, **kw: Any) -> ResNet:
    return ResNet(True, [3, 4, 6, 3], **kw)


def resnet101(weights: None = None, **kw: Any) -> ResNet:
    return ResNet(True, [3, 4, 23, 3], **kw)


def resnet152(weights: None = None, **kw: Any) -> ResNet:
    return ResNet(True, [3, 8, 36, 3], **kw)


def resnext50_32x4d(weights: None = None, **kw: Any) -> ResNet:
    return ResNet(True, [3, 4, 6, 3], groups=32, width_per_group=4, **kw)


def resnext101_32x8d(weights: None = None, **kw: Any) -> ResNet:
    return ResNet(True, [3, 4, 23, 3], groups=32, width_per_group=8, **kw)


def resnext101_64x4d(weights: None = None, **kw: Any) -> ResNet:
    return ResNet(True, [3, 4, 23, 3], groups=64, width_per_group=4, **kw)


def wide_resnet50_2(weights: None = None, **kw: Any) -> ResNet:
    return ResNet(True, [3, 4, 6, 3], width_per_group=128, **kw)


def wide_resnet101_2(weights: None = None, **kw: Any) -> ResNet:
    return ResNet(True, [3, 4, 23, 3], width_per_group=128, **kw)


# ---- MobileNetV2 ---------------------------------------------------------------------------------
def _divisible(v: float, d: int = 8) -> int:
    rounded = max(d, int(v + d / 2) // d * d)
    return rounded + d if rounded < 0.9 * v else rounded


class _InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, t: int) -> None:
        super().__init__()
        hidden = int(round(cin * t))
        expand = [_conv_bn_act(cin, hidden, 1)] if t != 1 else []
        self.conv = nn.Sequential(*expand, _conv_bn_act(hidden, hidden, 3, stride, hidden),
                                  nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.use_res_connect = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.use_res_connect else self.conv(x)


class MobileNetV2(nn.Module):
    def __init__(self, num_classes: int = 1000, width_mult: float = 1.0,
                 dropout: float = 0.2) -> None:
        super().__init__()
        cin = _divisible(32 * width_mult)
        last = _divisible(1280 * max(1.0, width_mult))
        layers: list[nn.Module] = [_conv_bn_act(3, cin, 3, 2)]
        for t, c, n, s in [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
                           (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]:
            cout = _divisible(c * width_mult)
            for i in range(n):
                layers.append(_InvertedResidual(cin, cout, s if i == 0 else 1, t))
                cin = cout
        layers.append(_conv_bn_act(cin, last, 1))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(last, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).mean((2, 3)))


def mobilenet_v2(weights: None = None, **kw: Any) -> MobileNetV2:
    return MobileNetV2(**kw)
