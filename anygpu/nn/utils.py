"""Gradient clipping and batch-norm folding, as ``torch.nn.utils``. Nothing waits for the
device: the norm stays a tensor and the scaling fuses into the optimizer's update.

>>> import anygpu as ag
>>> w = ag.tensor([3.0, 4.0], requires_grad=True)
>>> (w * w).sum().backward()                       # grad = [6, 8], norm 10
>>> round(ag.nn.utils.clip_grad_norm_([w], 5.0).item(), 3)
10.0
>>> [round(v, 3) for v in w.grad.numpy().tolist()]
[3.0, 4.0]
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Iterable

from anygpu.ops.grad import no_grad
from anygpu.tensor import Tensor, stack

if TYPE_CHECKING:
    from anygpu.nn.layers import Conv2d
    from anygpu.nn.norm import BatchNorm2d


def _with_grads(parameters: Iterable[Tensor] | Tensor) -> list[Tensor]:
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    return [p for p in params if p.grad is not None]


def clip_grad_norm_(parameters: Iterable[Tensor] | Tensor, max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False) -> Tensor:
    """Scale the gradients so that their joint norm is at most ``max_norm``; return the norm."""
    params = _with_grads(parameters)
    if not params:
        raise ValueError("clip_grad_norm_: no parameter has a gradient")
    if error_if_nonfinite:
        raise NotImplementedError("error_if_nonfinite would wait for the device; check the "
                                  "returned norm instead")
    with no_grad():
        grads = [p.grad for p in params if p.grad is not None]  # all of them: see _with_grads
        if norm_type == float("inf"):
            total = stack([g.abs().amax() for g in grads]).amax()
        else:
            total = stack([(g.abs() ** norm_type).sum() for g in grads]).sum() ** (1.0 / norm_type)
        scale = (max_norm / (total + 1e-6)).clip(max=1.0)
        for p, g in zip(params, grads):
            p.grad = (g * scale).realize()
    return total


def clip_grad_value_(parameters: Iterable[Tensor] | Tensor, clip_value: float) -> None:
    """Clamp every gradient element into [-clip_value, clip_value]."""
    with no_grad():
        for p in _with_grads(parameters):
            p.grad = p.grad.clip(-clip_value, clip_value).realize()  # type: ignore[union-attr]


def fuse_conv_bn_weights(conv_w: Tensor, conv_b: Tensor | None, bn_rm: Tensor, bn_rv: Tensor,
                         bn_eps: float, bn_w: Tensor | None, bn_b: Tensor | None,
                         transpose: bool = False) -> tuple[Tensor, Tensor]:
    """The weight and bias of one convolution that computes ``conv`` followed by an inference
    batch norm: each output channel's filter scaled by ``bn_w / sqrt(bn_rv + bn_eps)`` and its
    bias moved to match. ``transpose``: the weight is a transposed convolution's (in, out, ...).

    >>> import anygpu as ag
    >>> w, b = fuse_conv_bn_weights(ag.ones(2, 1, 1, 1), None, ag.tensor([1.0, 2.0]),
    ...                             ag.tensor([3.0, 15.0]), 1.0, None, None)
    >>> w.reshape(2).numpy().tolist(), b.numpy().tolist()
    ([0.5, 0.25], [-0.5, -0.5])
    """
    with no_grad():
        scale = (bn_rv.float() + bn_eps).rsqrt()
        if bn_w is not None:
            scale = scale * bn_w.float()
        shift = -bn_rm.float() * scale
        if bn_b is not None:
            shift = shift + bn_b.float()
        if conv_b is not None:
            shift = shift + conv_b.float() * scale
        shape = [1] * conv_w.ndim
        shape[1 if transpose else 0] = -1
        weight = (conv_w.float() * scale.reshape(*shape)).cast(conv_w.dtype)
        bias = shift.cast(conv_w.dtype if conv_b is None else conv_b.dtype)
        return weight.realize(), bias.realize()


def fuse_conv_bn_eval(conv: "Conv2d", bn: "BatchNorm2d", transpose: bool = False) -> "Conv2d":
    """A copy of ``conv`` (in eval mode) whose weights fold in ``bn``'s running statistics and
    affine parameters, so that one convolution kernel computes both at inference.

    >>> import anygpu as ag
    >>> from anygpu import nn
    >>> conv, bn = nn.Conv2d(3, 4, 3).eval(), nn.BatchNorm2d(4).eval()
    >>> x = ag.randn(1, 3, 8, 8)
    >>> fused = fuse_conv_bn_eval(conv, bn)
    >>> bool(((fused(x) - bn(conv(x))).abs().amax() < 1e-5).item())
    True
    """
    if conv.training or bn.training:
        raise ValueError("fuse_conv_bn_eval: both modules must be in eval mode (a training "
                         "batch norm uses the batch's statistics, which no weight can hold)")
    if bn.running_mean is None or bn.running_var is None:
        raise ValueError("fuse_conv_bn_eval: the batch norm tracks no running statistics")
    if bn.num_features != conv.weight.shape[1 if transpose else 0] * (
            conv.groups if transpose else 1):
        raise ValueError(f"fuse_conv_bn_eval: the batch norm has {bn.num_features} features, "
                         f"the convolution {conv.out_channels} output channels")
    from anygpu.nn.module import Parameter

    fused = copy.deepcopy(conv)
    weight, bias = fuse_conv_bn_weights(conv.weight, conv.bias, bn.running_mean,
                                        bn.running_var, bn.eps, bn.weight, bn.bias, transpose)
    fused.weight = Parameter(weight, requires_grad=conv.weight.requires_grad)
    fused.bias = Parameter(bias, requires_grad=conv.weight.requires_grad)
    return fused
