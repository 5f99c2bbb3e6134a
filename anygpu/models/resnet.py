"""ResNet (He et al., 2016) with the stride on the 3x3 convolution of the bottleneck (the
"ResNet v1.5" of torchvision), ResNeXt and Wide ResNet: torchvision's layers, arguments,
initialization and state_dict keys, so its checkpoints load one to one.

>>> import anygpu as ag
>>> from anygpu.models import resnet18
>>> model = resnet18(num_classes=10).eval()
>>> model(ag.randn(1, 3, 32, 32)).shape
(1, 10)
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, Union

from anygpu import nn
from anygpu.models.weights import WeightsPath, build
from anygpu.nn import init
from anygpu.tensor import Tensor

NormLayer = Callable[[int], nn.Module]


def conv3x3(in_planes: int, out_planes: int, stride: int = 1, groups: int = 1,
            dilation: int = 1) -> nn.Conv2d:
    """3x3 convolution without bias, padded to keep the size (at stride 1)."""
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=dilation,
                     groups=groups, bias=False, dilation=dilation)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    """1x1 convolution without bias."""
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm, added to the input (or to its ``downsample``)
    and passed through ReLU. ResNet-18 and -34 are built of these."""

    expansion: int = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: nn.Module | None = None, groups: int = 1, base_width: int = 64,
                 dilation: int = 1, norm_layer: NormLayer | None = None) -> None:
        super().__init__()
        if norm_layer is None:
            norm_layer = nn.BatchNorm2d
        if groups != 1 or base_width != 64:
            raise ValueError("BasicBlock only supports groups=1 and base_width=64")
        if dilation > 1:
            raise NotImplementedError("Dilation > 1 not supported in BasicBlock")
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = norm_layer(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = norm_layer(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride, grouped for ResNeXt), 1x1 expand by 4, each with
    batch norm, added to the input (or to its ``downsample``) and passed through ReLU.
    ResNet-50, -101 and -152 are built of these."""

    expansion: int = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: nn.Module | None = None, groups: int = 1, base_width: int = 64,
                 dilation: int = 1, norm_layer: NormLayer | None = None) -> None:
        super().__init__()
        if norm_layer is None:
            norm_layer = nn.BatchNorm2d
        width = int(planes * (base_width / 64.0)) * groups
        self.conv1 = conv1x1(inplanes, width)
        self.bn1 = norm_layer(width)
        self.conv2 = conv3x3(width, width, stride, groups, dilation)
        self.bn2 = norm_layer(width)
        self.conv3 = conv1x1(width, planes * self.expansion)
        self.bn3 = norm_layer(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


Block = Union[type[BasicBlock], type[Bottleneck]]


class ResNet(nn.Module):
    """A 7x7 stem with max-pool, four stages of ``layers[i]`` blocks (64, 128, 256 and 512
    planes; the last three halve the size, or dilate instead where
    ``replace_stride_with_dilation`` says so), global average pooling and a linear classifier.
    The input size only needs to survive five halvings (32x32 gives 1x1 before the pool).

    Convolutions start from He-normal weights (fan_out, ReLU gain), norm layers from weight 1
    and bias 0; ``zero_init_residual`` zeroes the last norm of every block, so that each
    block starts as the identity.

    >>> import anygpu as ag
    >>> model = ResNet(BasicBlock, [1, 1, 1, 1], num_classes=3)
    >>> model(ag.randn(2, 3, 32, 32)).shape
    (2, 3)
    """

    def __init__(self, block: Block, layers: Sequence[int], num_classes: int = 1000,
                 zero_init_residual: bool = False, groups: int = 1, width_per_group: int = 64,
                 replace_stride_with_dilation: Sequence[bool] | None = None,
                 norm_layer: NormLayer | None = None) -> None:
        super().__init__()
        if norm_layer is None:
            norm_layer = nn.BatchNorm2d
        self._norm_layer = norm_layer
        self.inplanes = 64
        self.dilation = 1
        if replace_stride_with_dilation is None:
            replace_stride_with_dilation = [False, False, False]
        if len(replace_stride_with_dilation) != 3:
            raise ValueError("replace_stride_with_dilation should be None or a 3-element "
                             f"tuple, got {replace_stride_with_dilation}")
        self.groups = groups
        self.base_width = width_per_group
        self.conv1 = nn.Conv2d(3, self.inplanes, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = norm_layer(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, 64, layers[0])
        self.layer2 = self._make_layer(block, 128, layers[1], stride=2,
                                       dilate=replace_stride_with_dilation[0])
        self.layer3 = self._make_layer(block, 256, layers[2], stride=2,
                                       dilate=replace_stride_with_dilation[1])
        self.layer4 = self._make_layer(block, 512, layers[3], stride=2,
                                       dilate=replace_stride_with_dilation[2])
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                init.constant_(m.weight, 1)
                init.constant_(m.bias, 0)
        if zero_init_residual:
            for m in self.modules():
                last = None
                if isinstance(m, Bottleneck):
                    last = m.bn3
                elif isinstance(m, BasicBlock):
                    last = m.bn2
                if last is not None and getattr(last, "weight", None) is not None:
                    init.constant_(last.weight, 0)

    def _make_layer(self, block: Block, planes: int, blocks: int, stride: int = 1,
                    dilate: bool = False) -> nn.Sequential:
        norm_layer = self._norm_layer
        previous_dilation = self.dilation
        if dilate:  # keep the resolution: the stride becomes dilation of later blocks
            self.dilation *= stride
            stride = 1
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(conv1x1(self.inplanes, planes * block.expansion, stride),
                                       norm_layer(planes * block.expansion))
        stage = [block(self.inplanes, planes, stride, downsample, self.groups, self.base_width,
                       previous_dilation, norm_layer)]
        self.inplanes = planes * block.expansion
        for _ in range(1, blocks):
            stage.append(block(self.inplanes, planes, groups=self.groups,
                               base_width=self.base_width, dilation=self.dilation,
                               norm_layer=norm_layer))
        return nn.Sequential(*stage)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.avgpool(x).flatten(1))


def _resnet(block: Block, layers: list[int], weights: WeightsPath | None,
            kwargs: dict[str, Any]) -> ResNet:
    """What every constructor below does: ``weights`` is the path of a state_dict to load
    (safetensors or PyTorch; torchvision's checkpoints fit), and the other keywords
    (``num_classes``, ``zero_init_residual``, ``groups``, ``width_per_group``,
    ``replace_stride_with_dilation``, ``norm_layer``) go to ``ResNet``. The constructors take
    ``progress`` for torchvision's signature and ignore it: nothing is downloaded."""

    def factory(**kw: Any) -> ResNet:
        return ResNet(block, layers, **kw)

    return build(factory, weights, kwargs, "fc.weight")


def resnet18(*, weights: WeightsPath | None = None, progress: bool = True,
             **kwargs: Any) -> ResNet:
    """ResNet-18 (basic blocks [2, 2, 2, 2]).
    See ``_resnet`` for the arguments."""
    return _resnet(BasicBlock, [2, 2, 2, 2], weights, kwargs)


def resnet34(*, weights: WeightsPath | None = None, progress: bool = True,
             **kwargs: Any) -> ResNet:
    """ResNet-34 (basic blocks [3, 4, 6, 3]).
    See ``_resnet`` for the arguments."""
    return _resnet(BasicBlock, [3, 4, 6, 3], weights, kwargs)


def resnet50(*, weights: WeightsPath | None = None, progress: bool = True,
             **kwargs: Any) -> ResNet:
    """ResNet-50 (bottlenecks [3, 4, 6, 3]).
    See ``_resnet`` for the arguments."""
    return _resnet(Bottleneck, [3, 4, 6, 3], weights, kwargs)


def resnet101(*, weights: WeightsPath | None = None, progress: bool = True,
              **kwargs: Any) -> ResNet:
    """ResNet-101 (bottlenecks [3, 4, 23, 3]).
    See ``_resnet`` for the arguments."""
    return _resnet(Bottleneck, [3, 4, 23, 3], weights, kwargs)


def resnet152(*, weights: WeightsPath | None = None, progress: bool = True,
              **kwargs: Any) -> ResNet:
    """ResNet-152 (bottlenecks [3, 8, 36, 3]).
    See ``_resnet`` for the arguments."""
    return _resnet(Bottleneck, [3, 8, 36, 3], weights, kwargs)


def resnext50_32x4d(*, weights: WeightsPath | None = None, progress: bool = True,
                    **kwargs: Any) -> ResNet:
    """ResNeXt-50 32x4d (bottlenecks [3, 4, 6, 3], 32 groups of width 4).
    See ``_resnet`` for the arguments."""
    return _resnet(Bottleneck, [3, 4, 6, 3], weights,
                   {"groups": 32, "width_per_group": 4, **kwargs})


def resnext101_32x8d(*, weights: WeightsPath | None = None, progress: bool = True,
                     **kwargs: Any) -> ResNet:
    """ResNeXt-101 32x8d (bottlenecks [3, 4, 23, 3], 32 groups of width 8).
    See ``_resnet`` for the arguments."""
    return _resnet(Bottleneck, [3, 4, 23, 3], weights,
                   {"groups": 32, "width_per_group": 8, **kwargs})


def resnext101_64x4d(*, weights: WeightsPath | None = None, progress: bool = True,
                     **kwargs: Any) -> ResNet:
    """ResNeXt-101 64x4d (bottlenecks [3, 4, 23, 3], 64 groups of width 4).
    See ``_resnet`` for the arguments."""
    return _resnet(Bottleneck, [3, 4, 23, 3], weights,
                   {"groups": 64, "width_per_group": 4, **kwargs})


def wide_resnet50_2(*, weights: WeightsPath | None = None, progress: bool = True,
                    **kwargs: Any) -> ResNet:
    """Wide ResNet-50-2 (bottlenecks [3, 4, 6, 3], twice as wide inside).
    See ``_resnet`` for the arguments."""
    return _resnet(Bottleneck, [3, 4, 6, 3], weights, {"width_per_group": 128, **kwargs})


def wide_resnet101_2(*, weights: WeightsPath | None = None, progress: bool = True,
                     **kwargs: Any) -> ResNet:
    """Wide ResNet-101-2 (bottlenecks [3, 4, 23, 3], twice as wide inside).
    See ``_resnet`` for the arguments."""
    return _resnet(Bottleneck, [3, 4, 23, 3], weights, {"width_per_group": 128, **kwargs})


__all__ = ["ResNet", "BasicBlock", "Bottleneck", "resnet18", "resnet34", "resnet50",
           "resnet101", "resnet152", "resnext50_32x4d", "resnext101_32x8d", "resnext101_64x4d",
           "wide_resnet50_2", "wide_resnet101_2"]
