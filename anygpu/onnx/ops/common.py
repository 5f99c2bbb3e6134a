"""Small helpers shared by the operator modules.

>>> import anygpu as ag
>>> const(2.5, (2,), ag.float32, "cpu").tolist()
[2.5, 2.5]
>>> axis(-1, 3)
2
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from anygpu import dtype as dt
from anygpu.dtype import DType
from anygpu.graph.lazy import Lazy
from anygpu.onnx import dtypes
from anygpu.onnx.ops.table import Node
from anygpu.tensor import Tensor


def const(value: Any, shape: Sequence[int], dtype: DType, device: str) -> Tensor:
    """A constant tensor that fuses into the kernels that read it (never stored)."""
    if dtype.is_bool:
        value = bool(value)
    elif dtype.is_int:
        value = dt.wrap_int(int(value), dtype)
    else:
        value = float(value)
    return Tensor(Lazy.const(value, tuple(int(n) for n in shape), dtype, device))


def scalar_like(x: Tensor, value: Any) -> Tensor:
    """A 0-d constant of ``x``'s dtype and device."""
    return const(value, (), x.dtype, x.device)


def axis(a: int, ndim: int, node: Node | None = None) -> int:
    """An ONNX axis (negative counts from the end) as a position in ``range(ndim)``."""
    if not -ndim <= a < max(ndim, 1):
        message = f"axis {a} is out of range for a tensor of rank {ndim}"
        if node is not None:
            node.fail(message)
        raise ValueError(message)
    return a % max(ndim, 1)


def axes_list(values: Any, ndim: int, node: Node | None = None) -> list[int]:
    """Axes from an attribute or a host array, normalized and in the order given."""
    return [axis(int(a), ndim, node) for a in np.asarray(values, dtype=np.int64).reshape(-1)]


def ints(values: Any) -> list[int]:
    """A host array or list of integers as a Python list."""
    return [int(v) for v in np.asarray(values).reshape(-1)]


def scalar(value: Any) -> Any:
    """A host array of one element as a Python number."""
    arr = np.asarray(value).reshape(-1)
    if arr.size != 1:
        raise ValueError(f"expected one value, got {arr.size}")
    return arr[0].item()


def storage_of(node: Node, position: int, fallback: DType) -> DType:
    """The storage dtype of an input's declared element type, or ``fallback``."""
    elem = node.in_type(position)
    return dtypes.storage(elem) if elem is not None and dtypes.supported(elem) else fallback


def wrap_unsigned(x: Tensor, elem: int | None) -> Tensor:
    """An unsigned 16- or 32-bit value held in wider signed storage, wrapped into its range."""
    bits = dtypes.UNSIGNED_BITS.get(elem) if elem is not None else None
    return x & ((1 << bits) - 1) if bits else x


def wrap_int16(x: Tensor) -> Tensor:
    """An INT16 value held in int32 storage, wrapped into [-32768, 32767]."""
    return ((x + 32768) & 0xFFFF) - 32768


def float_of(x: Tensor) -> Tensor:
    """``x`` as a floating-point tensor (integers and bools as float32)."""
    return x if x.dtype.is_float else x.cast(dt.float32)


def move_axis_last(x: Tensor, a: int) -> tuple[Tensor, list[int]]:
    """``x`` with axis ``a`` moved to the end, and the permutation that moves it back."""
    order = [i for i in range(x.ndim) if i != a] + [a]
    back = [order.index(i) for i in range(x.ndim)]
    return x.permute(order), back


__all__ = ["const", "scalar_like", "axis", "axes_list", "ints", "scalar", "storage_of",
           "wrap_unsigned", "wrap_int16", "float_of", "move_axis_last"]
