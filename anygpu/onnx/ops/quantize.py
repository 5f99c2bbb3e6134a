"""Quantization: QuantizeLinear, DequantizeLinear (per tensor, per axis, blocked),
DynamicQuantizeLinear, and the integer products MatMulInteger, ConvInteger, QLinearMatMul,
QLinearConv.

Integer products are computed in float32, exact while the sums stay below 2**24 (8-bit
operands over up to 256 terms); quantized results round half to even and saturate to their
type, as ONNX specifies.

>>> import numpy as np
>>> from anygpu.onnx.ops.table import Node
>>> node = Node("QuantizeLinear", "q", "", 13, "cpu", {}, [1, 1, 2], [2], 1)
>>> x = Tensor(np.array([0.0, 1.0, 2.5, 300.0], np.float32))
>>> quantize_linear(node, x, Tensor(np.float32(0.5)),
...                 Tensor(np.uint8(10))).tolist()
[10, 12, 15, 255]
"""

from __future__ import annotations

from onnx import TensorProto

from anygpu import dtype as dt
from anygpu.onnx import dtypes
from anygpu.onnx.ops.common import axis as norm_axis
from anygpu.onnx.ops.conv import conv
from anygpu.onnx.ops.elementwise import round_to_format
from anygpu.onnx.ops.table import Node, op
from anygpu.tensor import Tensor

_RANGES: dict[int, tuple[int, int]] = {TensorProto.UINT8: (0, 255), TensorProto.INT8: (-128, 127),
           TensorProto.UINT16: (0, 65535), TensorProto.INT16: (-32768, 32767),
           dtypes.UINT4: (0, 15), dtypes.INT4: (-8, 7), dtypes.UINT2: (0, 3),
           dtypes.INT2: (-2, 1), TensorProto.INT32: (-2**31, 2**31 - 1)}


def _along(value: Tensor, x: Tensor, node: Node) -> Tensor:
    """A scale or zero point shaped to broadcast against ``x``: one value, one per index of
    ``axis``, or one per block of ``block_size`` along it."""
    if value.numel() == 1:
        return value.reshape(())
    a = norm_axis(node.attr("axis", 1), x.ndim, node)
    block = node.attr("block_size", 0)
    if not block:
        view = [1] * x.ndim
        view[a] = value.numel()
        return value.reshape(view)
    n = x.shape[a]
    moved = value.transpose(a, -1)
    repeated = moved.unsqueeze(-1).expand(moved.shape + (block,)).reshape(
        moved.shape[:-1] + (moved.shape[-1] * block,))
    repeated = repeated.shrink([(0, m) for m in repeated.shape[:-1]] + [(0, n)])
    return repeated.transpose(a, -1)


def quantize(x: Tensor, scale: Tensor, zero: Tensor | None, to: int, saturate: bool) -> Tensor:
    """``x / scale`` (+ the zero point) in element type ``to``."""
    y = x.cast(dt.float32) / scale.cast(dt.float32)
    if to in dtypes.FLOAT_FORMATS:
        if zero is not None and to == dtypes.FLOAT4E2M1:
            y = y + zero.cast(dt.float32)
        return round_to_format(y, dtypes.FLOAT_FORMATS[to], saturate)
    if to not in _RANGES:
        raise NotImplementedError(f"quantizing to {dtypes.name(to)} is not supported")
    lo, hi = _RANGES[to]
    y = y.round()
    if zero is not None:
        y = y + zero.cast(dt.float32)
    return y.clip(float(lo), float(hi)).cast(dtypes.storage(to))


def _out_type(node: Node, zero: Tensor | None) -> int:
    if zero is not None and node.in_type(2) is not None:
        return node.in_type(2)  # type: ignore[return-value]
    return node.attr("output_dtype", 0) or TensorProto.UINT8


_Q_ATTRS = ("axis", "saturate", "block_size", "output_dtype", "precision")


@op("QuantizeLinear", since=10, attrs=_Q_ATTRS)
def quantize_linear(node: Node, x: Tensor, scale: Tensor, zero: Tensor | None = None) -> Tensor:
    z = _along(zero, x, node) if zero is not None else None
    return quantize(x, _along(scale, x, node), z, _out_type(node, zero),
                    bool(node.attr("saturate", 1)))


@op("DequantizeLinear", since=10, attrs=("axis", "block_size", "output_dtype"))
def dequantize_linear(node: Node, x: Tensor, scale: Tensor,
                      zero: Tensor | None = None) -> Tensor:
    y = x.cast(dt.float32)
    if zero is not None and node.in_type(0) not in dtypes.FLOAT_FORMATS:
        y = y - _along(zero, x, node).cast(dt.float32)
    y = y * _along(scale, x, node).cast(dt.float32)
    to = node.attr("output_dtype", 0)
    return y.cast(dtypes.storage(to) if to else scale.dtype)


@op("DynamicQuantizeLinear", since=11)
def dynamic_quantize_linear(node: Node, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    xf = x.cast(dt.float32)
    hi = xf.amax().maximum(0.0)
    lo = xf.amin().minimum(0.0)
    scale = (hi - lo) / 255.0
    zero = (-lo / scale).round().clip(0.0, 255.0)
    y = ((xf / scale).round() + zero).clip(0.0, 255.0)
    return y.cast(dt.uint8), scale, zero.cast(dt.uint8)


def _centered(x: Tensor, zero: Tensor | None, node: Node, a: int) -> Tensor:
    """``x - zero`` in float32; a zero point per row (``a``) broadcasts along that axis."""
    y = x.cast(dt.float32)
    if zero is None:
        return y
    z = zero.cast(dt.float32)
    if z.numel() > 1:
        view = [1] * x.ndim
        view[a % x.ndim] = z.numel()
        z = z.reshape(view)
    return y - z.reshape(()) if z.numel() == 1 else y - z


@op("MatMulInteger", since=10)
def matmul_integer(node: Node, a: Tensor, b: Tensor, a_zero: Tensor | None = None,
                   b_zero: Tensor | None = None) -> Tensor:
    product = _centered(a, a_zero, node, -2).matmul(_centered(b, b_zero, node, -1))
    return product.round().cast(dt.int32)


@op("QLinearMatMul", since=10)
def qlinear_matmul(node: Node, a: Tensor, a_scale: Tensor, a_zero: Tensor, b: Tensor,
                   b_scale: Tensor, b_zero: Tensor, y_scale: Tensor, y_zero: Tensor) -> Tensor:
    product = _centered(a, a_zero, node, -2).matmul(_centered(b, b_zero, node, -1))
    a_s = a_scale.cast(dt.float32)
    a_s = a_s.reshape(()) if a_s.numel() == 1 else a_s.reshape(-1, 1)
    b_s = b_scale.cast(dt.float32)
    b_s = b_s.reshape(()) if b_s.numel() == 1 else b_s.reshape(1, -1)
    y = product * (a_s * b_s)
    to = node.in_type(7) or TensorProto.UINT8
    return quantize(y, y_scale.reshape(()) if y_scale.numel() == 1 else y_scale,
                    y_zero.reshape(()) if y_zero.numel() == 1 else y_zero, to, True)


_CONV_ATTRS = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")


@op("ConvInteger", since=10, attrs=_CONV_ATTRS)
def conv_integer(node: Node, x: Tensor, w: Tensor, x_zero: Tensor | None = None,
                 w_zero: Tensor | None = None) -> Tensor:
    xc = _centered(x, x_zero, node, 1)
    wc = _centered(w, w_zero, node, 0)
    return conv(node, xc, wc).round().cast(dt.int32)


@op("QLinearConv", since=10, attrs=_CONV_ATTRS)
def qlinear_conv(node: Node, x: Tensor, x_scale: Tensor, x_zero: Tensor, w: Tensor,
                 w_scale: Tensor, w_zero: Tensor, y_scale: Tensor, y_zero: Tensor,
                 bias: Tensor | None = None) -> Tensor:
    xc = _centered(x, x_zero, node, 1)
    wc = _centered(w, w_zero, node, 0)
    acc = conv(node, xc, wc)
    if bias is not None:
        acc = acc + bias.cast(dt.float32).reshape((1, -1) + (1,) * (acc.ndim - 2))
    ws = w_scale.cast(dt.float32)
    ws = ws.reshape(()) if ws.numel() == 1 else ws.reshape((1, -1) + (1,) * (acc.ndim - 2))
    y = acc * (x_scale.cast(dt.float32).reshape(()) * ws)
    to = node.in_type(7) or TensorProto.UINT8
    return quantize(y, y_scale.reshape(()), y_zero.reshape(()), to, True)


__all__ = ["quantize"]
