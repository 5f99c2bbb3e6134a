"""Indexing composites: basic slicing through movement ops, advanced indexing and ``gather``
through the GATHER primitive, ``scatter_add`` as a one-hot reduction."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from anygpu import dtype as dt
from anygpu.ops.primitives import Op

if TYPE_CHECKING:
    from anygpu.tensor import Tensor


def _strided(x: "Tensor", axis: int, start: int, stop: int, step: int) -> "Tensor":
    """Elements start, start+step, ... < stop along ``axis`` (step > 0)."""
    bounds = [(0, n) for n in x.shape]
    start = min(start, x.shape[axis])
    bounds[axis] = (start, min(max(stop, start), x.shape[axis]))
    x = x.shrink(bounds)
    if step == 1:
        return x
    n = x.shape[axis]
    m = -(-n // step)
    pad = [0] * (2 * x.ndim)
    pad[2 * (x.ndim - 1 - axis) + 1] = m * step - n
    x = x.pad(pad)
    x = x.reshape(x.shape[:axis] + (m, step) + x.shape[axis + 1:])
    bounds = [(0, s) for s in x.shape]
    bounds[axis + 1] = (0, 1)
    x = x.shrink(bounds)
    return x.reshape(x.shape[:axis] + (m,) + x.shape[axis + 2:])


def _index_tensor(value: Any, like: "Tensor", size: int) -> "Tensor":
    """An int index tensor; host data is bounds-checked here, negative indices wrap."""
    from anygpu.tensor import Tensor

    if isinstance(value, Tensor):
        if value.dtype.is_float:
            raise IndexError(f"tensors used as indices must be integer, got {value.dtype.name}")
        return value.lt(0)._select(value + size, value)
    arr = np.asarray(value)
    if arr.size == 0 and arr.dtype.kind == "f":  # x[[]]: an empty list selects nothing
        arr = arr.astype(np.int64)
    if arr.dtype == np.bool_:
        arr = np.nonzero(arr)[0]
    if arr.dtype.kind not in "iu":
        raise IndexError(f"index arrays must be integer or bool, got {arr.dtype}")
    if arr.size and (arr.max() >= size or arr.min() < -size):
        bad = arr[(arr >= size) | (arr < -size)][0]
        raise IndexError(f"index {bad} is out of bounds for dimension with size {size}")
    arr = np.where(arr < 0, arr + size, arr).astype(np.int32)
    return Tensor(arr, device=like.device)


class _MaskAxes(tuple):
    """The index arrays of a k-dimensional bool mask, one per axis it covers."""


def _split_mask(i: Any) -> Any:
    """A bool mask (host or device) becomes the index arrays of its true elements, as in
    PyTorch; a device mask is read back first (the result's shape depends on it)."""
    from anygpu.tensor import Tensor

    if isinstance(i, Tensor) and i.dtype == dt.bool_:
        arr = i.numpy()
    elif isinstance(i, (list, np.ndarray)) and not isinstance(i, Tensor):
        arr = np.asarray(i)
        if arr.dtype != np.bool_:
            return i
    else:
        return i
    if arr.ndim == 0:
        raise IndexError("bool scalars are not supported as indices")
    return _MaskAxes(np.nonzero(arr))


def getitem(x: "Tensor", index: Any) -> "Tensor":
    from anygpu.tensor import Tensor

    if not isinstance(index, tuple):
        index = (index,)
    index = tuple(_split_mask(i) for i in index)
    index = tuple(j for i in index for j in (i if isinstance(i, _MaskAxes) else (i,)))
    n_real = sum(1 for i in index if i is not None and i is not Ellipsis)
    if sum(1 for i in index if i is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis")
    if n_real > x.ndim:
        raise IndexError(f"too many indices for a tensor of dimension {x.ndim}")
    expanded: list[Any] = []
    for i in index:
        if i is Ellipsis:
            expanded += [slice(None)] * (x.ndim - n_real)
        else:
            expanded.append(i)
    expanded += [slice(None)] * (x.ndim - sum(1 for i in expanded if i is not None))
    out = x
    axis = 0
    squeeze: list[int] = []
    advanced: list[tuple[int, Any]] = []
    for i in expanded:
        if i is None:
            out = out.unsqueeze(axis)
            axis += 1
            continue
        n = out.shape[axis]
        if isinstance(i, (bool, np.bool_)):
            raise IndexError("bool scalars are not supported as indices")
        if isinstance(i, (int, np.integer)):  # a basic index even beside advanced ones (PyTorch)
            j = int(i)
            if not -n <= j < n:
                raise IndexError(f"index {j} is out of bounds for dimension {axis} with size {n}")
            j %= n
            bounds = [(0, s) for s in out.shape]
            bounds[axis] = (j, j + 1)
            out = out.shrink(bounds)
            squeeze.append(axis)
        elif isinstance(i, slice):
            start, stop, step = i.indices(n)
            if step > 0:
                out = _strided(out, axis, start, stop, step)
            else:
                # walk backwards: flip, then the same stride from the mirrored start
                count = len(range(start, stop, step))
                out = out.flip(axis)
                first = n - 1 - start
                out = _strided(out, axis, first, first + (-step) * (count - 1) + 1 if count
                               else first, -step)
        elif isinstance(i, (Tensor, list, np.ndarray)):
            advanced.append((axis, i))
        else:
            raise IndexError(f"unsupported index {i!r}")
        axis += 1
    if squeeze:
        out = out.reshape(tuple(s for k, s in enumerate(out.shape) if k not in squeeze))
        advanced = [(a - sum(1 for q in squeeze if q < a), v) for a, v in advanced]
    if advanced:
        return _advanced(out, advanced)
    return out


def _advanced(x: "Tensor", adv: list[tuple[int, Any]]) -> "Tensor":
    """NumPy/PyTorch advanced indexing: the indexed axes flatten into one, which one gather
    reads; the broadcast index shape goes where the indexed axes were if they were adjacent,
    else first."""
    from anygpu.tensor import _broadcast

    axes = [a for a, _ in adv]
    idxs = [_index_tensor(v, x, x.shape[a]) for a, v in adv]
    idx_dtype = dt.int64 if any(i.dtype == dt.int64 for i in idxs) else dt.int32
    idxs = list(_broadcast(*[i.cast(idx_dtype) for i in idxs]))
    batch = idxs[0].shape
    sizes = [x.shape[a] for a in axes]
    flat = idxs[0] * 0
    stride = 1
    for i, n in zip(reversed(idxs), reversed(sizes)):
        flat = flat + i * stride
        stride *= n
    rest = [a for a in range(x.ndim) if a not in axes]
    rest_shape = tuple(x.shape[a] for a in rest)
    xp = x.permute(axes + rest).reshape((math.prod(sizes),) + rest_shape)
    m = math.prod(batch)
    index = flat.reshape((m,) + (1,) * len(rest)).expand((m,) + rest_shape)
    out = gather(xp, 0, index).reshape(batch + rest_shape)
    adjacent = axes == list(range(axes[0], axes[0] + len(axes)))
    if adjacent and axes[0] > 0:
        nb, p = len(batch), axes[0]
        out = out.permute(list(range(nb, nb + p)) + list(range(nb)) +
                          list(range(nb + p, out.ndim)))
    return out


def gather(x: "Tensor", dim: int, index: "Tensor") -> "Tensor":
    from anygpu.tensor import Tensor, _axis

    axis = _axis(dim, x.ndim)
    if not isinstance(index, Tensor):
        index = Tensor(np.asarray(index), device=x.device)
    if index.ndim != x.ndim:
        raise ValueError(f"gather: index has {index.ndim} dimensions, input has {x.ndim}")
    return Tensor._make(x.lazy.gather(axis, index.lazy), (x, index), "gather", axis)


def index_select(x: "Tensor", dim: int, index: Any) -> "Tensor":
    from anygpu.tensor import _axis

    axis = _axis(dim, x.ndim)
    idx = _index_tensor(index, x, x.shape[axis]).reshape(-1)
    shape = list(x.shape)
    shape[axis] = idx.shape[0]
    view = [1] * x.ndim
    view[axis] = idx.shape[0]
    return gather(x, axis, idx.reshape(view).expand(shape))


def scatter_add(x: "Tensor", dim: int, index: "Tensor", src: "Tensor") -> "Tensor":
    """``out = x``, then ``out[..., index[i], ...] += src[i]`` along ``dim``, as a one-hot
    reduction (no atomics, so the result is the same on every backend and every run)."""
    from anygpu.tensor import Tensor, _axis, arange

    axis = _axis(dim, x.ndim)
    if not isinstance(index, Tensor):
        index = Tensor(np.asarray(index), device=x.device)
    if index.ndim != x.ndim or src.ndim != x.ndim:
        raise ValueError("scatter_add: x, index and src need the same number of dimensions")
    if any(i > s for i, s in zip(index.shape, src.shape)) or any(
            i > s for a, (i, s) in enumerate(zip(index.shape, x.shape)) if a != axis):
        raise ValueError(f"scatter_add: index shape {index.shape} does not fit src {src.shape} "
                         f"and x {x.shape}")
    src = src.shrink([(0, n) for n in index.shape]).cast(x.dtype)
    # bring dim last, pad the other dims of index/src up to x's (padding adds zeros)
    xt, it, st = (t.transpose(axis, -1) for t in (x, index, src))
    pads: list[int] = [0, 0]
    for a in reversed(range(xt.ndim - 1)):
        pads += [0, xt.shape[a] - it.shape[a]]
    it, st = it.pad(pads), st.pad(pads)
    n = xt.shape[-1]
    onehot = it.unsqueeze(-2).eq(arange(n, device=x.device, dtype=it.dtype).reshape(n, 1))
    contrib = onehot._select(st.unsqueeze(-2), 0)
    summed = contrib._reduce(Op.SUM, (contrib.ndim - 1,))
    out = xt + summed.reshape(summed.shape[:-1])
    return out.transpose(axis, -1)


__all__ = ["getitem", "gather", "index_select", "scatter_add"]
