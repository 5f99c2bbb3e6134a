"""Image classification models with torchvision's names, arguments, layers, initialization and
state_dict keys: AlexNet, VGG (11/13/16/19, with or without batch norm), ResNet (18 to 152,
ResNeXt, Wide ResNet) and MobileNetV2.

``weights=`` takes the path of a state_dict: a safetensors file, or a PyTorch checkpoint (read
with PyTorch, which must then be installed). Nothing is ever downloaded. torchvision's
checkpoints load one to one; ``convert_weights`` turns one into safetensors, after which
PyTorch is no longer needed.

>>> import anygpu as ag
>>> from anygpu import models
>>> model = models.resnet18(num_classes=10).eval()
>>> model(ag.randn(2, 3, 32, 32)).shape
(2, 10)
>>> list(model.state_dict())[:3]
['conv1.weight', 'bn1.weight', 'bn1.bias']
"""

from anygpu.models.alexnet import AlexNet, alexnet
from anygpu.models.mobilenetv2 import (Conv2dNormActivation, InvertedResidual, MobileNetV2,
                                       mobilenet_v2)
from anygpu.models.resnet import (BasicBlock, Bottleneck, ResNet, resnet18, resnet34, resnet50,
                                  resnet101, resnet152, resnext50_32x4d, resnext101_32x8d,
                                  resnext101_64x4d, wide_resnet50_2, wide_resnet101_2)
from anygpu.models.vgg import (VGG, vgg11, vgg11_bn, vgg13, vgg13_bn, vgg16, vgg16_bn, vgg19,
                               vgg19_bn)
from anygpu.models.weights import convert_weights, read_weights

__all__ = ["AlexNet", "alexnet", "ResNet", "BasicBlock", "Bottleneck", "resnet18", "resnet34",
           "resnet50", "resnet101", "resnet152", "resnext50_32x4d", "resnext101_32x8d",
           "resnext101_64x4d", "wide_resnet50_2", "wide_resnet101_2", "VGG", "vgg11",
           "vgg11_bn", "vgg13", "vgg13_bn", "vgg16", "vgg16_bn", "vgg19", "vgg19_bn",
           "MobileNetV2", "InvertedResidual", "Conv2dNormActivation", "mobilenet_v2",
           "convert_weights", "read_weights"]
