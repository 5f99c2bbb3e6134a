"""Normalization layers: BatchNorm1d/2d, LayerNorm, RMSNorm, GroupNorm (PyTorch's arguments,
parameter and buffer names)."""

from __future__ import annotations

from typing import Any, Sequence

from anygpu import dtype as dt
from anygpu.nn import functional as F
from anygpu.nn import init
from anygpu.nn.module import Module, Parameter
from anygpu.tensor import Tensor


def _add_affine(module: Module, shape: tuple[int, ...], affine: bool, bias: bool,
                device: str | None, dtype: Any) -> None:
    """Register ``weight`` (and ``bias``) of ``shape``, or None for each that is absent."""
    weight = Parameter(init._empty(shape, device, dtype)) if affine else None
    module.register_parameter("weight", weight)
    module.register_parameter("bias", Parameter(init._empty(shape, device, dtype))
                              if affine and bias else None)


def _reset_affine(module: Module) -> None:
    if module.weight is not None:
        init.ones_(module.weight)
    if module.bias is not None:
        init.zeros_(module.bias)


class _NormBase(Module):
    _optional_keys = ("num_batches_tracked",)  # checkpoints from older PyTorch lack it

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 device: str | None = None, dtype: Any = None, *, bias: bool = True) -> None:
        super().__init__()
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.affine = affine
        self.track_running_stats = track_running_stats
        _add_affine(self, (num_features,), affine, bias, device, dtype)
        if track_running_stats:
            self.register_buffer("running_mean", init._empty((num_features,), device, dtype))
            self.register_buffer("running_var", init._empty((num_features,), device, dtype))
            self.register_buffer("num_batches_tracked", init._empty((), device, dt.int64))
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)
        self.reset_parameters()

    def reset_running_stats(self) -> None:
        if self.track_running_stats:
            init.zeros_(self.running_mean)
            init.ones_(self.running_var)
            init.zeros_(self.num_batches_tracked)

    def reset_parameters(self) -> None:
        self.reset_running_stats()
        _reset_affine(self)

    def _check_input_dim(self, input: Tensor) -> None:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, "
                f"affine={self.affine}, bias={self.bias is not None}, "
                f"track_running_stats={self.track_running_stats}")


class _BatchNorm(_NormBase):
    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        factor: float | Tensor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            nbt = self.num_batches_tracked
            nbt.assign(nbt + 1)
            if self.momentum is None:  # cumulative moving average, read on the device
                factor = 1.0 / nbt.float()
        training = self.training or (self.running_mean is None and self.running_var is None)
        use_stats = not self.training or self.track_running_stats
        return F.batch_norm(input, self.running_mean if use_stats else None,
                            self.running_var if use_stats else None, self.weight, self.bias,
                            training, factor, self.eps)


class BatchNorm1d(_BatchNorm):
    """Batch normalization over (N, C) or (N, C, L) inputs, per channel.

    >>> import anygpu as ag
    >>> m = BatchNorm1d(4)
    >>> m(ag.randn(8, 4)).shape, list(m.state_dict())
    ((8, 4), ['weight', 'bias', 'running_mean', 'running_var', 'num_batches_tracked'])
    """

    def _check_input_dim(self, input: Tensor) -> None:
        if input.ndim not in (2, 3):
            raise ValueError(f"expected 2D or 3D input (got {input.ndim}D input)")


class BatchNorm2d(_BatchNorm):
    """Batch normalization over (N, C, H, W) inputs, per channel. Training uses the batch's
    statistics and updates ``running_mean``/``running_var`` (momentum 0.1, unbiased variance);
    eval mode uses the running ones.

    >>> import anygpu as ag
    >>> m = BatchNorm2d(3)
    >>> y = m(ag.randn(4, 3, 5, 5))
    >>> int(m.num_batches_tracked), m.eval()(ag.randn(1, 3, 5, 5)).shape
    (1, (1, 3, 5, 5))
    """

    def _check_input_dim(self, input: Tensor) -> None:
        if input.ndim != 4:
            raise ValueError(f"expected 4D input (got {input.ndim}D input)")


def _normalized_shape(shape: int | Sequence[int]) -> tuple[int, ...]:
    return (int(shape),) if isinstance(shape, int) else tuple(int(s) for s in shape)


class LayerNorm(Module):
    """Normalizes over the last ``len(normalized_shape)`` axes, then scales and shifts.

    >>> import anygpu as ag
    >>> m = LayerNorm(8)
    >>> round(m(ag.randn(2, 8)).mean(-1).abs().max().item(), 4)
    0.0
    """

    def __init__(self, normalized_shape: int | Sequence[int], eps: float = 1e-5,
                 elementwise_affine: bool = True, bias: bool = True, device: str | None = None,
                 dtype: Any = None) -> None:
        super().__init__()
        self.normalized_shape = _normalized_shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        _add_affine(self, self.normalized_shape, elementwise_affine, bias, device, dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _reset_affine(self)

    def forward(self, input: Tensor) -> Tensor:
        return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}, bias={self.bias is not None}")


class RMSNorm(Module):
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last ``len(normalized_shape)`` axes;
    ``eps=None`` uses the input dtype's machine epsilon.

    >>> import anygpu as ag
    >>> [round(v, 4) for v in RMSNorm(4)(ag.full((1, 4), 3.0)).tolist()[0]]
    [1.0, 1.0, 1.0, 1.0]
    """

    def __init__(self, normalized_shape: int | Sequence[int], eps: float | None = None,
                 elementwise_affine: bool = True, device: str | None = None,
                 dtype: Any = None) -> None:
        super().__init__()
        self.normalized_shape = _normalized_shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = Parameter(init._empty(self.normalized_shape, device, dtype))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.elementwise_affine:
            init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}")


class GroupNorm(Module):
    """Normalizes each sample over groups of channels (``num_channels / num_groups`` each),
    then scales and shifts per channel.

    >>> import anygpu as ag
    >>> GroupNorm(2, 4)(ag.randn(3, 4, 5, 5)).shape
    (3, 4, 5, 5)
    """

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5,
                 affine: bool = True, device: str | None = None, dtype: Any = None, *,
                 bias: bool = True) -> None:
        super().__init__()
        if num_channels % num_groups != 0:
            raise ValueError("num_channels must be divisible by num_groups")
        self.num_groups, self.num_channels = num_groups, num_channels
        self.eps, self.affine = eps, affine
        _add_affine(self, (num_channels,), affine, bias, device, dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _reset_affine(self)

    def forward(self, input: Tensor) -> Tensor:
        return F.group_norm(input, self.num_groups, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return (f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}, "
                f"bias={self.bias is not None}")


__all__ = ["BatchNorm1d", "BatchNorm2d", "LayerNorm", "RMSNorm", "GroupNorm"]
