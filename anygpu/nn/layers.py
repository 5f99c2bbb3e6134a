"""Linear, convolution, embedding, dropout, reshaping and activation layers (PyTorch's names,
arguments, defaults, parameter names and initializations)."""

from __future__ import annotations

import math
from typing import Any, Sequence

from anygpu.nn import functional as F
from anygpu.nn import init
from anygpu.nn import init as _init  # PReLU's argument "init" hides the module's name
from anygpu.nn.module import Module, Parameter
from anygpu.tensor import Tensor, arange, where

IntPair = int | tuple[int, int]


def _ntuple(v: Any, n: int) -> tuple[int, ...]:
    return (int(v),) * n if isinstance(v, int) else tuple(int(x) for x in v)


class Identity(Module):
    """Returns its input; takes and ignores any arguments.

    >>> import anygpu as ag
    >>> Identity(54, unused="x")(ag.ones(2)).tolist()
    [1.0, 1.0]
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    def forward(self, input: Tensor) -> Tensor:
        return input


class Linear(Module):
    """``y = x @ weight.T + bias`` with weight (out_features, in_features).

    >>> import anygpu as ag
    >>> m = Linear(20, 30)
    >>> m(ag.randn(128, 20)).shape
    (128, 30)
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: str | None = None, dtype: Any = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = Parameter(init._empty((out_features, in_features), device, dtype))
        if bias:
            self.bias = Parameter(init._empty((out_features,), device, dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in, _ = init._calculate_fan_in_and_fan_out(self.weight)
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
            init.uniform_(self.bias, -bound, bound)

    def forward(self, input: Tensor) -> Tensor:
        return F.linear(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


class _ConvNd(Module):
    _dims = 2  # spatial axes

    def __init__(self, in_channels: int, out_channels: int, kernel_size: Any,
                 stride: Any, padding: Any, dilation: Any, transposed: bool,
                 output_padding: Any, groups: int, bias: bool, padding_mode: str,
                 device: str | None, dtype: Any) -> None:
        super().__init__()
        if groups <= 0:
            raise ValueError("groups must be a positive integer")
        if in_channels % groups:
            raise ValueError("in_channels must be divisible by groups")
        if out_channels % groups:
            raise ValueError("out_channels must be divisible by groups")
        if padding_mode not in ("zeros", "reflect", "replicate", "circular"):
            raise ValueError(f"padding_mode must be one of 'zeros', 'reflect', 'replicate' or "
                             f"'circular', but got padding_mode='{padding_mode}'")
        self.in_channels, self.out_channels = in_channels, out_channels
        n = self._dims
        self.kernel_size, self.stride = _ntuple(kernel_size, n), _ntuple(stride, n)
        self.dilation = _ntuple(dilation, n)
        if isinstance(padding, str):
            if padding not in ("same", "valid"):
                raise ValueError(f"Invalid padding string {padding!r}, should be one of "
                                 "{'valid', 'same'}")
            if padding == "same" and any(s != 1 for s in self.stride):
                raise ValueError("padding='same' is not supported for strided convolutions")
            self.padding: Any = padding
        else:
            self.padding = _ntuple(padding, n)
        self.transposed = transposed
        self.output_padding = _ntuple(output_padding, n)
        self.groups = groups
        self.padding_mode = padding_mode
        # F.pad order (last axis first) of the padding that padding_mode applies
        if padding == "same":
            pads: list[int] = []
            for d, k in zip(reversed(self.dilation), reversed(self.kernel_size)):
                total = d * (k - 1)
                pads += [total // 2, total - total // 2]
            self._reversed_padding_repeated_twice = pads
        elif padding == "valid":
            self._reversed_padding_repeated_twice = [0, 0] * n
        else:
            self._reversed_padding_repeated_twice = [p for p in reversed(self.padding)
                                                     for _ in range(2)]
        shape = ((in_channels, out_channels // groups) if transposed
                 else (out_channels, in_channels // groups)) + self.kernel_size
        self.weight = Parameter(init._empty(shape, device, dtype))
        if bias:
            self.bias = Parameter(init._empty((out_channels,), device, dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in, _ = init._calculate_fan_in_and_fan_out(self.weight)
            if fan_in != 0:
                bound = 1 / math.sqrt(fan_in)
                init.uniform_(self.bias, -bound, bound)

    def extra_repr(self) -> str:
        s = (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
             f"stride={self.stride}")
        if self.padding != (0,) * len(self.padding):
            s += f", padding={self.padding}"
        if self.dilation != (1,) * len(self.dilation):
            s += f", dilation={self.dilation}"
        if self.output_padding != (0,) * len(self.output_padding):
            s += f", output_padding={self.output_padding}"
        if self.groups != 1:
            s += f", groups={self.groups}"
        if self.bias is None:
            s += ", bias=False"
        if self.padding_mode != "zeros":
            s += f", padding_mode={self.padding_mode}"
        return s


class Conv1d(_ConvNd):
    """1-D convolution over (N, C, L) or unbatched (C, L) with weight (out, in/groups, k).

    >>> import anygpu as ag
    >>> m = Conv1d(4, 6, 3, stride=2, padding=1, groups=2)
    >>> m(ag.randn(2, 4, 11)).shape
    (2, 6, 6)
    """

    _dims = 1

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | tuple[int],
                 stride: int | tuple[int] = 1, padding: int | tuple[int] | str = 0,
                 dilation: int | tuple[int] = 1, groups: int = 1, bias: bool = True,
                 padding_mode: str = "zeros", device: str | None = None,
                 dtype: Any = None) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation,
                         False, 0, groups, bias, padding_mode, device, dtype)

    def _conv_forward(self, input: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if self.padding_mode != "zeros":
            x = F.pad(input, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            return F.conv1d(x, weight, bias, self.stride, 0, self.dilation, self.groups)
        return F.conv1d(input, weight, bias, self.stride, self.padding, self.dilation,
                        self.groups)

    def forward(self, input: Tensor) -> Tensor:
        return self._conv_forward(input, self.weight, self.bias)


class Conv2d(_ConvNd):
    """2-D convolution over (N, C, H, W) with weight (out, in/groups, kH, kW).

    >>> import anygpu as ag
    >>> m = Conv2d(3, 8, 3, stride=2, padding=1)
    >>> m(ag.randn(1, 3, 16, 16)).shape
    (1, 8, 8, 8)
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: IntPair,
                 stride: IntPair = 1, padding: IntPair | str = 0, dilation: IntPair = 1,
                 groups: int = 1, bias: bool = True, padding_mode: str = "zeros",
                 device: str | None = None, dtype: Any = None) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation,
                         False, 0, groups, bias, padding_mode, device, dtype)

    def _conv_forward(self, input: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if self.padding_mode != "zeros":
            x = F.pad(input, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            return F.conv2d(x, weight, bias, self.stride, 0, self.dilation, self.groups)
        return F.conv2d(input, weight, bias, self.stride, self.padding, self.dilation,
                        self.groups)

    def forward(self, input: Tensor) -> Tensor:
        if input.ndim == 3:
            return self._conv_forward(input.unsqueeze(0), self.weight, self.bias).squeeze(0)
        return self._conv_forward(input, self.weight, self.bias)


class _ConvTransposeNd(_ConvNd):
    """What the transposed convolutions share: zero padding only, and ``output_size``."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: Any, stride: Any,
                 padding: Any, output_padding: Any, groups: int, bias: bool, dilation: Any,
                 padding_mode: str, device: str | None, dtype: Any) -> None:
        if padding_mode != "zeros":
            raise ValueError(f'Only "zeros" padding mode is supported for {type(self).__name__}')
        if isinstance(padding, str):
            raise ValueError(f"{type(self).__name__} does not support string padding")
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation,
                         True, output_padding, groups, bias, padding_mode, device, dtype)

    def _output_padding(self, input: Tensor, output_size: Sequence[int] | None
                        ) -> tuple[int, ...]:
        if output_size is None:
            return self.output_padding
        k = self._dims
        lead = 2 if input.ndim == k + 2 else 1  # batch and channels, or channels
        size = [int(s) for s in output_size]
        if len(size) == lead + k:
            size = size[lead:]
        if len(size) != k:
            raise ValueError(f"ConvTranspose{k}D: for {input.ndim}D input, output_size must "
                             f"have {k} or {lead + k} elements (got {len(output_size)})")
        out = []
        for d in range(k):
            n = input.shape[input.ndim - k + d]
            smallest = ((n - 1) * self.stride[d] - 2 * self.padding[d]
                        + self.dilation[d] * (self.kernel_size[d] - 1) + 1)
            largest = smallest + self.stride[d] - 1
            if not smallest <= size[d] <= largest:
                raise ValueError(f"requested an output size of {size}, but valid sizes range "
                                 f"from {smallest} to {largest} (for an input of "
                                 f"{input.shape[input.ndim - k:]})")
            out.append(size[d] - smallest)
        return tuple(out)



class ConvTranspose1d(_ConvTransposeNd):
    """Transposed 1-D convolution (the gradient of Conv1d), weight (in, out/groups, k).
    ``forward(input, output_size=None)``: ``output_size`` picks among the lengths a stride > 1
    makes possible.

    >>> import anygpu as ag
    >>> m = ConvTranspose1d(4, 2, 3, stride=2, padding=1)
    >>> m(ag.randn(1, 4, 5), output_size=[10]).shape
    (1, 2, 10)
    """

    _dims = 1

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | tuple[int],
                 stride: int | tuple[int] = 1, padding: int | tuple[int] = 0,
                 output_padding: int | tuple[int] = 0, groups: int = 1, bias: bool = True,
                 dilation: int | tuple[int] = 1, padding_mode: str = "zeros",
                 device: str | None = None, dtype: Any = None) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride, padding,
                         output_padding, groups, bias, dilation, padding_mode, device, dtype)

    def forward(self, input: Tensor, output_size: Sequence[int] | None = None) -> Tensor:
        op = self._output_padding(input, output_size)
        return F.conv_transpose1d(input, self.weight, self.bias, self.stride, self.padding, op,
                                  self.groups, self.dilation)


class ConvTranspose2d(_ConvTransposeNd):
    """Transposed 2-D convolution (the gradient of Conv2d), weight (in, out/groups, kH, kW).
    ``forward(input, output_size=None)``: ``output_size`` picks among the sizes a stride > 1
    makes possible.

    >>> import anygpu as ag
    >>> m = ConvTranspose2d(8, 3, 3, stride=2, padding=1, output_padding=1)
    >>> m(ag.randn(1, 8, 8, 8)).shape
    (1, 3, 16, 16)
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: IntPair,
                 stride: IntPair = 1, padding: IntPair = 0, output_padding: IntPair = 0,
                 groups: int = 1, bias: bool = True, dilation: IntPair = 1,
                 padding_mode: str = "zeros", device: str | None = None,
                 dtype: Any = None) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride, padding,
                         output_padding, groups, bias, dilation, padding_mode, device, dtype)

    def forward(self, input: Tensor, output_size: Sequence[int] | None = None) -> Tensor:
        op = self._output_padding(input, output_size)
        return F.conv_transpose2d(input, self.weight, self.bias, self.stride, self.padding, op,
                                  self.groups, self.dilation)


class Embedding(Module):
    """A lookup table: integer indices of any shape -> rows of ``weight`` (N(0, 1) initialized;
    the ``padding_idx`` row is zero and gets no gradient).

    >>> import anygpu as ag
    >>> emb = Embedding(10, 3, padding_idx=0)
    >>> emb(ag.tensor([[0, 2], [4, 5]])).shape
    (2, 2, 3)
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0,
                 scale_grad_by_freq: bool = False, sparse: bool = False,
                 _weight: Tensor | None = None, _freeze: bool = False,
                 device: str | None = None, dtype: Any = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError("Padding_idx must be within num_embeddings")
            padding_idx %= num_embeddings
        self.padding_idx = padding_idx
        self.max_norm, self.norm_type = max_norm, norm_type
        self.scale_grad_by_freq, self.sparse = scale_grad_by_freq, sparse
        if _weight is None:
            self.weight = Parameter(init._empty((num_embeddings, embedding_dim), device, dtype),
                                    requires_grad=not _freeze)
            self.reset_parameters()
        else:
            if tuple(_weight.shape) != (num_embeddings, embedding_dim):
                raise ValueError("Shape of weight does not match num_embeddings and "
                                 "embedding_dim")
            self.weight = Parameter(_weight, requires_grad=not _freeze)

    def reset_parameters(self) -> None:
        init.normal_(self.weight)
        self._fill_padding_idx_with_zero()

    def _fill_padding_idx_with_zero(self) -> None:
        if self.padding_idx is not None:
            rows = arange(self.num_embeddings, device=self.weight.device).reshape(-1, 1)
            w = Tensor(self.weight.lazy)
            init._assign(self.weight, where(rows.eq(self.padding_idx), w._const_like(0), w))

    def forward(self, input: Tensor) -> Tensor:
        return F.embedding(input, self.weight, self.padding_idx, self.max_norm, self.norm_type,
                           self.scale_grad_by_freq, self.sparse)

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        if self.max_norm is not None:
            s += f", max_norm={self.max_norm}"
        if self.norm_type != 2:
            s += f", norm_type={self.norm_type}"
        if self.scale_grad_by_freq is not False:
            s += ", scale_grad_by_freq=True"
        if self.sparse is not False:
            s += ", sparse=True"
        return s

    @classmethod
    def from_pretrained(cls, embeddings: Tensor, freeze: bool = True,
                        padding_idx: int | None = None, max_norm: float | None = None,
                        norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                        sparse: bool = False) -> "Embedding":
        """An Embedding whose weight is ``embeddings`` (rows, dim); frozen by default."""
        if embeddings.ndim != 2:
            raise ValueError("Embeddings parameter is expected to be 2-dimensional")
        rows, cols = embeddings.shape
        return cls(rows, cols, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse,
                   _weight=embeddings, _freeze=freeze)


class Dropout(Module):
    """Zeroes elements with probability ``p`` in training (scaling the rest by 1/(1-p));
    the identity in eval mode.

    >>> import anygpu as ag
    >>> m = Dropout(0.5).eval()
    >>> m(ag.ones(3)).tolist()
    [1.0, 1.0, 1.0]
    """

    def __init__(self, p: float = 0.5, inplace: bool = False) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        self.p, self.inplace = p, inplace

    def forward(self, input: Tensor) -> Tensor:
        return F.dropout(input, self.p, self.training, self.inplace)

    def extra_repr(self) -> str:
        return f"p={self.p}, inplace={self.inplace}"


class Flatten(Module):
    """Flattens axes ``start_dim..end_dim`` into one.

    >>> import anygpu as ag
    >>> Flatten()(ag.ones(2, 3, 4, 5)).shape
    (2, 60)
    """

    def __init__(self, start_dim: int = 1, end_dim: int = -1) -> None:
        super().__init__()
        self.start_dim, self.end_dim = start_dim, end_dim

    def forward(self, input: Tensor) -> Tensor:
        return input.flatten(self.start_dim, self.end_dim)

    def extra_repr(self) -> str:
        return f"start_dim={self.start_dim}, end_dim={self.end_dim}"


class Unflatten(Module):
    """Splits axis ``dim`` into ``unflattened_size``."""

    def __init__(self, dim: int, unflattened_size: Sequence[int]) -> None:
        super().__init__()
        self.dim, self.unflattened_size = dim, tuple(unflattened_size)

    def forward(self, input: Tensor) -> Tensor:
        sizes = list(self.unflattened_size)
        if -1 in sizes:
            known = math.prod(s for s in sizes if s != -1)
            sizes[sizes.index(-1)] = input.shape[self.dim] // known
        return input.unflatten(self.dim, sizes)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, unflattened_size={self.unflattened_size}"


# ---- activations -----------------------------------------------------------------------------
class ReLU(Module):
    """``max(x, 0)``.

    >>> import anygpu as ag
    >>> ReLU()(ag.tensor([-1.0, 2.0])).tolist()
    [0.0, 2.0]
    """

    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.inplace = inplace

    def forward(self, input: Tensor) -> Tensor:
        return input.relu()

    def extra_repr(self) -> str:
        return "inplace=True" if self.inplace else ""


class Hardtanh(Module):
    """``x`` clamped to [min_val, max_val] (the gradient is 0 at the bounds, as in PyTorch).

    >>> import anygpu as ag
    >>> Hardtanh(-2.0, 2.0)(ag.tensor([-3.0, 1.0, 5.0])).tolist()
    [-2.0, 1.0, 2.0]
    """

    def __init__(self, min_val: float = -1.0, max_val: float = 1.0,
                 inplace: bool = False) -> None:
        super().__init__()
        if min_val > max_val:
            raise ValueError("min_val cannot be greater than max_val")
        self.min_val, self.max_val, self.inplace = min_val, max_val, inplace

    def forward(self, input: Tensor) -> Tensor:
        return F.hardtanh(input, self.min_val, self.max_val)

    def extra_repr(self) -> str:
        return f"min_val={self.min_val}, max_val={self.max_val}" + (
            ", inplace=True" if self.inplace else "")


class ReLU6(Hardtanh):
    """``min(max(x, 0), 6)`` (MobileNet's activation).

    >>> import anygpu as ag
    >>> ReLU6()(ag.tensor([-1.0, 3.0, 8.0])).tolist()
    [0.0, 3.0, 6.0]
    """

    def __init__(self, inplace: bool = False) -> None:
        super().__init__(0.0, 6.0, inplace)

    def extra_repr(self) -> str:
        return "inplace=True" if self.inplace else ""


class GELU(Module):
    """Gaussian error linear unit; ``approximate='tanh'`` for the tanh form."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, input: Tensor) -> Tensor:
        return input.gelu(self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class SiLU(Module):
    """``x * sigmoid(x)``."""

    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.inplace = inplace

    def forward(self, input: Tensor) -> Tensor:
        return input.silu()

    def extra_repr(self) -> str:
        return "inplace=True" if self.inplace else ""


class Sigmoid(Module):
    def forward(self, input: Tensor) -> Tensor:
        return input.sigmoid()


class Tanh(Module):
    def forward(self, input: Tensor) -> Tensor:
        return input.tanh()


class LeakyReLU(Module):
    """``x`` if positive, else ``negative_slope * x``."""

    def __init__(self, negative_slope: float = 0.01, inplace: bool = False) -> None:
        super().__init__()
        self.negative_slope, self.inplace = negative_slope, inplace

    def forward(self, input: Tensor) -> Tensor:
        return input.leaky_relu(self.negative_slope)

    def extra_repr(self) -> str:
        return f"negative_slope={self.negative_slope}" + (", inplace=True" if self.inplace
                                                          else "")


class PReLU(Module):
    """``x`` if positive, else ``weight * x``: a learned slope, one for all channels or one
    per channel (axis 1), initialized to ``init``.

    >>> import anygpu as ag
    >>> m = PReLU(3)
    >>> m.weight.tolist(), m(-ag.ones(2, 3)).tolist()
    ([0.25, 0.25, 0.25], [[-0.25, -0.25, -0.25], [-0.25, -0.25, -0.25]])
    """

    def __init__(self, num_parameters: int = 1, init: float = 0.25, device: str | None = None,
                 dtype: Any = None) -> None:
        super().__init__()
        self.num_parameters = num_parameters
        self.init = init
        self.weight = Parameter(_init._empty((num_parameters,), device, dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init.constant_(self.weight, self.init)

    def forward(self, input: Tensor) -> Tensor:
        return F.prelu(input, self.weight)

    def extra_repr(self) -> str:
        return f"num_parameters={self.num_parameters}"


def _softmax_dim(ndim: int) -> int:
    # PyTorch's legacy choice when no dim is given
    return 0 if ndim in (0, 1, 3) else 1


class Softmax(Module):
    """Softmax over ``dim``.

    >>> import anygpu as ag
    >>> Softmax(dim=-1)(ag.zeros(2, 4)).tolist()[0]
    [0.25, 0.25, 0.25, 0.25]
    """

    def __init__(self, dim: int | None = None) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, input: Tensor) -> Tensor:
        return input.softmax(self.dim if self.dim is not None else _softmax_dim(input.ndim))

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class LogSoftmax(Module):
    """Log of the softmax over ``dim``, computed stably."""

    def __init__(self, dim: int | None = None) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, input: Tensor) -> Tensor:
        return input.log_softmax(self.dim if self.dim is not None else _softmax_dim(input.ndim))

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


__all__ = ["Identity", "Linear", "Conv2d", "ConvTranspose2d", "Embedding", "Dropout", "Flatten",
           "Unflatten", "ReLU", "GELU", "SiLU", "Sigmoid", "Tanh", "LeakyReLU", "Softmax",
           "LogSoftmax", "Conv1d", "ConvTranspose1d", "PReLU", "Hardtanh", "ReLU6"]
