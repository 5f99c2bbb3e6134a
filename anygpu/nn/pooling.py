"""Pooling layers: MaxPool2d, AvgPool2d, AdaptiveAvgPool2d (PyTorch's arguments and defaults)."""

from __future__ import annotations

from typing import Any

from anygpu.nn import functional as F
from anygpu.nn.module import Module
from anygpu.tensor import Tensor


class MaxPool2d(Module):
    """Maximum over ``kernel_size`` windows (stride defaults to the kernel size); padding
    counts as -inf. With ``return_indices`` it also returns each maximum's flat index into the
    input's H*W plane.

    >>> import anygpu as ag
    >>> MaxPool2d(2)(ag.arange(16.0).reshape(1, 1, 4, 4)).tolist()
    [[[[5.0, 7.0], [13.0, 15.0]]]]
    """

    def __init__(self, kernel_size: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1,
                 return_indices: bool = False, ceil_mode: bool = False) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.stride = stride if stride is not None else kernel_size
        self.padding, self.dilation = padding, dilation
        self.return_indices, self.ceil_mode = return_indices, ceil_mode

    def forward(self, input: Tensor) -> Any:
        return F.max_pool2d(input, self.kernel_size, self.stride, self.padding, self.dilation,
                            ceil_mode=self.ceil_mode, return_indices=self.return_indices)

    def extra_repr(self) -> str:
        return (f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}, "
                f"dilation={self.dilation}, ceil_mode={self.ceil_mode}")


class AvgPool2d(Module):
    """Mean over ``kernel_size`` windows; zero padding counts in the divisor unless
    ``count_include_pad=False``.

    >>> import anygpu as ag
    >>> AvgPool2d(2)(ag.arange(16.0).reshape(1, 1, 4, 4)).tolist()
    [[[[2.5, 4.5], [10.5, 12.5]]]]
    """

    def __init__(self, kernel_size: Any, stride: Any = None, padding: Any = 0,
                 ceil_mode: bool = False, count_include_pad: bool = True,
                 divisor_override: int | None = None) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.stride = stride if stride is not None else kernel_size
        self.padding = padding
        self.ceil_mode, self.count_include_pad = ceil_mode, count_include_pad
        self.divisor_override = divisor_override

    def forward(self, input: Tensor) -> Tensor:
        return F.avg_pool2d(input, self.kernel_size, self.stride, self.padding, self.ceil_mode,
                            self.count_include_pad, self.divisor_override)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class AdaptiveAvgPool2d(Module):
    """Average pooling to a fixed output size; output cell i averages inputs
    ``floor(i * H / out)`` to ``ceil((i + 1) * H / out)``. ``None`` keeps that input size.

    >>> import anygpu as ag
    >>> AdaptiveAvgPool2d((1, 1))(ag.ones(2, 3, 7, 5)).shape
    (2, 3, 1, 1)
    """

    def __init__(self, output_size: Any) -> None:
        super().__init__()
        self.output_size = output_size

    def forward(self, input: Tensor) -> Tensor:
        return F.adaptive_avg_pool2d(input, self.output_size)

    def extra_repr(self) -> str:
        return f"output_size={self.output_size}"


__all__ = ["MaxPool2d", "AvgPool2d", "AdaptiveAvgPool2d"]
