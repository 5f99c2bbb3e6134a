"""Neural-network operators: MatMul, Gemm, the normalizations (Batch, Instance, Layer, Group,
RMS, LRN), Einsum, Dropout, and the attention and embedding helpers of recent opsets.

Normalization statistics are computed in float32 (ONNX's ``stash_type`` 1) and the result is
cast back to the input's type.

>>> import numpy as np
>>> from anygpu.onnx.ops.table import Node
>>> node = Node("Gemm", "g", "", 13, "cpu", {"transB": 1}, [1, 1], [1], 1)
>>> gemm(node, Tensor(np.ones((1, 2), np.float32)), Tensor(np.ones((3, 2), np.float32))).tolist()
[[2.0, 2.0, 2.0]]
"""

from __future__ import annotations

import numpy as np

from anygpu import dtype as dt
from anygpu.ops.einsum import einsum as ag_einsum
from anygpu.onnx.ops.common import axis, const, float_of
from anygpu.onnx.ops.table import Node, op
from anygpu.tensor import Tensor, rand, where


@op("MatMul", since=1)
def matmul(node: Node, a: Tensor, b: Tensor) -> Tensor:
    return a.matmul(b)


@op("Gemm", since=7, attrs=("alpha", "beta", "transA", "transB"))
def gemm(node: Node, a: Tensor, b: Tensor, c: Tensor | None = None) -> Tensor:
    if node.attr("transA", 0):
        a = a.T
    if node.attr("transB", 0):
        b = b.T
    out = a.matmul(b)
    alpha, beta = node.attr("alpha", 1.0), node.attr("beta", 1.0)
    if alpha != 1.0:
        out = out * alpha
    if c is not None and beta != 0.0:
        out = out + (c * beta if beta != 1.0 else c)
    return out


@op("Einsum", since=12, attrs=("equation",))
def einsum(node: Node, *xs: Tensor) -> Tensor:
    return ag_einsum(node.attr("equation").replace(" ", ""), *xs)


# ---- normalizations -----------------------------------------------------------------------------
def _channel_view(t: Tensor, ndim: int) -> Tensor:
    return t.reshape((1, -1) + (1,) * (ndim - 2))


def _moments(x: Tensor, axes: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """Mean and biased variance over ``axes`` (kept), in float32."""
    xf = float_of(x).cast(dt.float32)
    mean = xf.mean(axes, keepdim=True)
    diff = xf - mean
    return mean, (diff * diff).mean(axes, keepdim=True)


@op("BatchNormalization", since=9, attrs=("epsilon", "momentum", "training_mode"))
def batch_normalization(node: Node, x: Tensor, scale: Tensor, bias: Tensor, mean: Tensor,
                        var: Tensor) -> tuple[Tensor, ...]:
    eps = node.attr("epsilon", 1e-5)
    nd = x.ndim
    if node.attr("training_mode", 0):
        axes = tuple(a for a in range(nd) if a != 1)
        batch_mean, batch_var = _moments(x, axes)
        momentum = node.attr("momentum", 0.9)
        new_mean = mean * momentum + batch_mean.reshape(-1).cast(mean.dtype) * (1 - momentum)
        new_var = var * momentum + batch_var.reshape(-1).cast(var.dtype) * (1 - momentum)
        y = (float_of(x) - batch_mean) * (batch_var + eps).rsqrt()
        y = y * _channel_view(scale, nd) + _channel_view(bias, nd)
        return y.cast(x.dtype), new_mean, new_var
    inv = (_channel_view(var, nd).cast(dt.float32) + eps).rsqrt()
    y = (float_of(x) - _channel_view(mean, nd)) * inv * _channel_view(scale, nd) + \
        _channel_view(bias, nd)
    return (y.cast(x.dtype),)


@op("InstanceNormalization", since=6, attrs=("epsilon",))
def instance_normalization(node: Node, x: Tensor, scale: Tensor, bias: Tensor) -> Tensor:
    mean, var = _moments(x, tuple(range(2, x.ndim)))
    y = (float_of(x) - mean) * (var + node.attr("epsilon", 1e-5)).rsqrt()
    return (y * _channel_view(scale, x.ndim) + _channel_view(bias, x.ndim)).cast(x.dtype)


@op("LayerNormalization", since=17, attrs=("axis", "epsilon", "stash_type"))
def layer_normalization(node: Node, x: Tensor, scale: Tensor, bias: Tensor | None = None
                        ) -> tuple[Tensor, Tensor, Tensor]:
    a = axis(node.attr("axis", -1), x.ndim, node)
    axes = tuple(range(a, x.ndim))
    mean, var = _moments(x, axes)
    inv = (var + node.attr("epsilon", 1e-5)).rsqrt()
    y = (float_of(x).cast(dt.float32) - mean) * inv * scale
    if bias is not None:
        y = y + bias
    return y.cast(x.dtype), mean.cast(x.dtype), inv.cast(x.dtype)


@op("GroupNormalization", since=18, attrs=("epsilon", "num_groups", "stash_type"))
def group_normalization(node: Node, x: Tensor, scale: Tensor, bias: Tensor) -> Tensor:
    groups = node.attr("num_groups")
    n, c = x.shape[:2]
    grouped = x.reshape((n, groups, c // groups) + x.shape[2:])
    mean, var = _moments(grouped, tuple(range(2, grouped.ndim)))
    y = ((float_of(grouped) - mean) * (var + node.attr("epsilon", 1e-5)).rsqrt()).reshape(x.shape)
    if scale.shape[0] != c:  # opset 18: one scale and bias per group
        scale = scale.reshape(groups, 1).expand(groups, c // groups).reshape(c)
        bias = bias.reshape(groups, 1).expand(groups, c // groups).reshape(c)
    return (y * _channel_view(scale, x.ndim) + _channel_view(bias, x.ndim)).cast(x.dtype)


@op("RMSNormalization", since=23, attrs=("axis", "epsilon", "stash_type"))
def rms_normalization(node: Node, x: Tensor, scale: Tensor) -> Tensor:
    a = axis(node.attr("axis", -1), x.ndim, node)
    xf = float_of(x).cast(dt.float32)
    ms = (xf * xf).mean(tuple(range(a, x.ndim)), keepdim=True)
    y = xf * (ms + node.attr("epsilon", 1e-5)).rsqrt()
    return (y.cast(x.dtype) * scale).cast(x.dtype)


@op("LRN", since=1, attrs=("alpha", "beta", "bias", "size"))
def lrn(node: Node, x: Tensor) -> Tensor:
    size = node.attr("size")
    alpha, beta, bias = node.attr("alpha", 1e-4), node.attr("beta", 0.75), node.attr("bias", 1.0)
    c = x.shape[1]
    before, after = (size - 1) // 2, -(-(size - 1) // 2)
    sq = float_of(x) * float_of(x)
    pads = [0, 0] * (x.ndim - 2) + [before, after]
    padded = sq.pad(pads)
    total: Tensor | None = None
    for k in range(size):  # the channel window as a sum of shifted views
        bounds = [(0, m) for m in padded.shape]
        bounds[1] = (k, k + c)
        part = padded.shrink(bounds)
        total = part if total is None else total + part
    assert total is not None
    return (float_of(x) / (total * (alpha / size) + bias) ** beta).cast(x.dtype)


# ---- dropout ------------------------------------------------------------------------------------
@op("Dropout", since=12, attrs=("seed",), host=(1, 2), pure=False)
def dropout(node: Node, x: Tensor, ratio: np.ndarray | None = None,
            training: np.ndarray | None = None) -> tuple[Tensor, Tensor]:
    p = float(np.asarray(ratio).reshape(-1)[0]) if ratio is not None else 0.5
    if training is None or not bool(np.asarray(training).reshape(-1)[0]) or p == 0.0:
        return x, const(True, x.shape, dt.bool_, x.device)
    keep = rand(x.shape, device=x.device).ge(p)
    return where(keep, x / (1 - p), const(0, (), x.dtype, x.device)), keep


@op("Dropout", since=1, until=11, attrs=("ratio", "is_test", "seed"))
def dropout_old(node: Node, x: Tensor) -> tuple[Tensor, Tensor]:
    return x, const(True, x.shape, dt.bool_, x.device)


__all__ = ["gemm", "matmul", "einsum"]
