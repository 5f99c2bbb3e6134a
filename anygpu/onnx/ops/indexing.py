"""Gathers and scatters: Gather, GatherElements, GatherND, ScatterElements, ScatterND,
Compress, NonZero.

ONNX indices may be negative (counted from the end of their axis); they are wrapped on the
device before anygpu's gathers and scatters read them.

>>> import numpy as np
>>> from anygpu.onnx.ops.table import Node
>>> node = Node("Gather", "g", "", 13, "cpu", {"axis": 0}, [1, 7], [1], 1)
>>> data = Tensor(np.array([10.0, 20.0, 30.0], np.float32))
>>> gather(node, data, Tensor(np.array([[2, -1], [0, 1]]))).tolist()
[[30.0, 30.0], [10.0, 20.0]]
"""

from __future__ import annotations

import math

import numpy as np

from anygpu import dtype as dt
from anygpu.ops.composites import nonzero
from anygpu.ops.sorting import argsort
from anygpu.ops.indexing import scatter as scatter_values
from anygpu.ops.indexing import scatter_reduce
from anygpu.onnx.ops.common import axis, const
from anygpu.onnx.ops.table import Node, op
from anygpu.tensor import Tensor, arange, cat, where


def wrap_index(index: Tensor, size: int) -> Tensor:
    """Indices as int64 with negative ones counted from the end of an axis of ``size``."""
    idx = index.cast(dt.int64)
    return where(idx.lt(0), idx + size, idx)


def _fold_gather(node: Node, x: np.ndarray, index: np.ndarray) -> np.ndarray:
    a = axis(node.attr("axis", 0), x.ndim, node)
    return np.take(x, np.where(index < 0, index + x.shape[a], index), axis=a)


@op("Gather", since=1, attrs=("axis",), fold=_fold_gather)
def gather(node: Node, x: Tensor, index: Tensor) -> Tensor:
    a = axis(node.attr("axis", 0), x.ndim, node)
    idx = wrap_index(index, x.shape[a])
    out = x.index_select(a, idx.reshape(-1))
    return out.reshape(x.shape[:a] + index.shape + x.shape[a + 1:])


@op("GatherElements", since=11, attrs=("axis",))
def gather_elements(node: Node, x: Tensor, index: Tensor) -> Tensor:
    a = axis(node.attr("axis", 0), x.ndim, node)
    return x.gather(a, wrap_index(index, x.shape[a]))


def _linear_index(index: Tensor, sizes: tuple[int, ...]) -> Tensor:
    """(..., k) indices into axes of ``sizes`` as one flat index (...)."""
    k = index.shape[-1]
    flat: Tensor | None = None
    stride = 1
    for j in reversed(range(k)):
        part = wrap_index(index[..., j], sizes[j]) * stride
        flat = part if flat is None else flat + part
        stride *= sizes[j]
    if flat is None:
        return const(0, index.shape[:-1], dt.int64, index.device)
    return flat


@op("GatherND", since=11, attrs=("batch_dims",))
def gather_nd(node: Node, x: Tensor, index: Tensor) -> Tensor:
    b = node.attr("batch_dims", 0)
    k = index.shape[-1]
    batch = x.shape[:b]
    nb = math.prod(batch)
    inner = x.shape[b + k:]
    m = math.prod(x.shape[b:b + k])
    rows = index.shape[b:-1]
    n = math.prod(rows)
    flat = _linear_index(index.reshape((nb, n, k)), x.shape[b:b + k])  # (B, N)
    flat = flat + arange(nb, device=x.device, dtype=dt.int64).reshape(nb, 1) * m
    data = x.reshape((nb * m,) + inner)
    out = data.index_select(0, flat.reshape(-1))
    return out.reshape(batch + rows + inner)


_REDUCE = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}


def _check_reduction(node: Node) -> str | None:
    r = node.attr("reduction", "none")
    return None if r == "none" or r in _REDUCE else f"reduction {r!r} is not supported"


def _scatter(x: Tensor, a: int, index: Tensor, updates: Tensor, reduction: str) -> Tensor:
    if index.numel() == 0:
        return x
    idx = wrap_index(index, x.shape[a])
    if reduction == "none":
        return scatter_values(x, a, idx, updates.cast(x.dtype))
    return scatter_reduce(x, a, idx, updates.cast(x.dtype), _REDUCE[reduction])


@op("ScatterElements", since=11, attrs=("axis", "reduction"), check=_check_reduction)
def scatter_elements(node: Node, x: Tensor, index: Tensor, updates: Tensor) -> Tensor:
    a = axis(node.attr("axis", 0), x.ndim, node)
    return _scatter(x, a, index, updates, node.attr("reduction", "none"))


@op("Scatter", since=9, until=10, attrs=("axis",))
def scatter(node: Node, x: Tensor, index: Tensor, updates: Tensor) -> Tensor:
    a = axis(node.attr("axis", 0), x.ndim, node)
    return _scatter(x, a, index, updates, "none")


@op("ScatterND", since=11, attrs=("reduction",), check=_check_reduction)
def scatter_nd(node: Node, x: Tensor, index: Tensor, updates: Tensor) -> Tensor:
    k = index.shape[-1]
    m = math.prod(x.shape[:k])
    inner = x.shape[k:]
    n = math.prod(index.shape[:-1])
    if n == 0:
        return x
    flat = _linear_index(index.reshape(n, k), x.shape[:k])  # (N,)
    data = x.reshape((m,) + inner)
    upd = updates.reshape((n,) + inner)
    idx = flat.reshape((n,) + (1,) * len(inner)).expand((n,) + inner)
    out = _scatter(data, 0, idx, upd, node.attr("reduction", "none"))
    return out.reshape(x.shape)


@op("Compress", since=11, attrs=("axis",))
def compress(node: Node, x: Tensor, condition: Tensor) -> Tensor:
    if node.has("axis"):
        a = axis(node.attr("axis"), x.ndim, node)
        data = x
    else:
        a, data = 0, x.reshape(-1)
    cond = condition.reshape(-1).bool()[:data.shape[a]]
    return data.index_select(a, nonzero(cond).reshape(-1))  # (the count is read back)


@op("NonZero", since=9)
def non_zero(node: Node, x: Tensor) -> Tensor:
    if x.ndim == 0:  # no axes to index: (0, 1) if the value is nonzero, else (0, 0)
        return const(0, (0, 1 if x.item() else 0), dt.int64, x.device)
    return nonzero(x).cast(dt.int64).T




@op("Unique", since=11, attrs=("axis", "sorted"))
def unique(node: Node, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The distinct elements (or slices along ``axis``): rows sorted lexicographically by
    stable sorts from the last column to the first, group starts where a row differs from the
    one before; the number of groups is read back (the output's size depends on the data)."""
    if node.has("axis"):
        a = axis(node.attr("axis"), x.ndim, node)
        layout = [a] + [i for i in range(x.ndim) if i != a]  # the axis first, the rest in order
        moved = x.permute(layout)
        rows = moved.reshape(moved.shape[0], -1)
    else:
        a = None
        moved = x.reshape(-1)
        rows = moved.reshape(-1, 1)
    n, width = rows.shape
    perm = arange(n, device=x.device, dtype=dt.int64)
    for col in reversed(range(width)):
        keys = rows[:, col].index_select(0, perm)
        perm = perm.index_select(0, argsort(keys, stable=True))
    ordered = rows.index_select(0, perm)
    if n > 1:
        differs = ordered[1:].ne(ordered[:-1]).any(1)
        first = cat([const(True, (1,), dt.bool_, x.device), differs], 0)
    else:
        first = const(True, (n,), dt.bool_, x.device)
    starts = nonzero(first).reshape(-1)  # sorted positions where a group starts (read back)
    indices = perm.index_select(0, starts)
    ends = cat([starts[1:], const(n, (1,), dt.int64, x.device)], 0)
    counts = ends - starts
    group_of = first.cast(dt.int64).cumsum(0) - 1
    inverse = group_of.index_select(0, argsort(perm))
    if not node.attr("sorted", 1):  # groups in the order their first element appears
        by_first = argsort(indices)
        rank = argsort(by_first)
        indices, counts = indices.index_select(0, by_first), counts.index_select(0, by_first)
        inverse = rank.index_select(0, inverse)
    values = moved.index_select(0, indices)
    if a:
        values = values.permute([layout.index(i) for i in range(x.ndim)])
    return values, indices, inverse, counts


__all__ = ["wrap_index", "unique"]
