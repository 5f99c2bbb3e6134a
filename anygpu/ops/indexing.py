"""Indexing composites: basic slicing through movement ops, advanced indexing and ``gather``
through the GATHER primitive; ``scatter_add``, ``scatter`` and ``scatter_reduce`` as one-hot
reductions (no atomics: the same result on every backend and every run)."""

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


def _index_copy_args(x: "Tensor", dim: int, index: Any, source: "Tensor",
                     name: str) -> tuple[int, "Tensor", "Tensor"]:
    """index_copy's axis, its index as an integer vector (host indices checked and wrapped,
    a tensor's as they are) and ``source`` on x's device, after PyTorch's checks."""
    from anygpu.tensor import Tensor, _axis

    if not isinstance(source, Tensor):
        raise TypeError(f"{name}(): source must be a Tensor, got {type(source).__name__}")
    axis = _axis(dim, max(x.ndim, 1))
    if isinstance(index, Tensor) and index.dtype.is_float:
        raise IndexError(f"{name}(): Expected a long tensor for index, but got "
                         f"{index.dtype.name}")
    if np.ndim(index) > 1 if not isinstance(index, Tensor) else index.ndim > 1:
        raise IndexError(f"{name}(): Index should have dimension 1 or 0 (got "
                         f"{index.ndim if isinstance(index, Tensor) else np.ndim(index)})")
    if source.dtype != x.dtype:
        raise RuntimeError(f"{name}(): self and source expected to have the same dtype, but "
                           f"got (self) {x.dtype.name} and (source) {source.dtype.name}")
    size = x.shape[axis] if x.ndim else 1
    # a device tensor's negative indices are wrapped by the kernels that read it
    idx = (index if isinstance(index, Tensor) else _index_tensor(index, x, size)).reshape(-1)
    if idx.device != x.device:
        idx = idx.to(x.device)
    if source.device != x.device:
        source = source.to(x.device)
    src_shape = source.shape if source.ndim else (1,)
    x_shape = x.shape if x.ndim else (1,)
    if len(src_shape) != len(x_shape) or any(
            a != b for k, (a, b) in enumerate(zip(src_shape, x_shape)) if k != axis):
        raise IndexError(f"{name}(): Source/destination tensor must have same slice shapes. "
                         f"Destination slice shape: {x.shape} at dimension {axis} and source "
                         f"slice shape: {source.shape} at dimension {axis}.")
    if src_shape[axis] != idx.shape[0]:
        raise IndexError(f"{name}(): Number of indices ({idx.shape[0]}) should be equal to "
                         f"source.size(dim) ({src_shape[axis]})")
    if idx.dtype not in (dt.int32, dt.int64):
        idx = idx.cast(dt.int32)
    return axis, idx, source.reshape(src_shape)


def index_copy(x: "Tensor", dim: int, index: Any, source: "Tensor") -> "Tensor":
    """PyTorch's ``index_copy``: ``x`` with its rows ``index[r]`` along ``dim`` replaced by
    ``source``'s rows ``r`` (where two name one row, the last wins; a negative index counts
    from the end, which PyTorch refuses). ``x.index_copy_`` writes only those rows, in place.

    >>> import anygpu as ag
    >>> ag.zeros(3, 2).index_copy(0, ag.tensor([2, 0]), ag.tensor([[1.0, 2.0], [3.0, 4.0]])
    ...                            ).tolist()
    [[3.0, 4.0], [0.0, 0.0], [1.0, 2.0]]
    """
    axis, idx, src = _index_copy_args(x, dim, index, source, "index_copy")
    idx = _index_tensor(idx, x, x.shape[axis] if x.ndim else 1)  # negatives count from the end
    shape = [1] * src.ndim
    shape[axis] = idx.shape[0]
    flat = x.reshape(src.shape[:axis] + (x.shape[axis] if x.ndim else 1,) + src.shape[axis + 1:])
    out = scatter(flat, axis, idx.reshape(shape).expand(src.shape), src)
    return out.reshape(x.shape)


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


def _one_hot(x: "Tensor", axis: int, index: Any, src: "Tensor | None",
             name: str) -> tuple["Tensor", "Tensor", "Tensor | None"]:
    """``x`` with ``axis`` last (..., n), and hit[..., r, i]: index element i (its own axis
    last, padded to x's other sizes) names position r; with ``src``, src cut to index's shape
    in the same layout (..., m). Indices outside [0, n) hit nothing."""
    from anygpu.tensor import Tensor, arange, full

    if not isinstance(index, Tensor):
        index = Tensor(np.asarray(index), device=x.device)
    if index.dtype.is_float or index.dtype.is_bool:
        raise RuntimeError(f"{name}(): Expected dtype int64 for index")
    if index.ndim != max(x.ndim, 1) and not (index.ndim == 0 and x.ndim == 0):
        raise RuntimeError(f"Index tensor must have the same number of dimensions as self "
                           f"tensor ({index.ndim} and {x.ndim})")
    if x.ndim == 0:  # a 0-d tensor scatters like a tensor of one element
        out, hit, cut = _one_hot(x.reshape(1), 0, index.reshape(1),
                                 None if src is None else src.reshape(1), name)
        return out, hit, cut
    if src is not None:
        if src.ndim != index.ndim:
            raise RuntimeError(f"Index tensor must have the same number of dimensions as src "
                               f"tensor ({index.ndim} and {src.ndim})")
        if any(i > s for i, s in zip(index.shape, src.shape)):
            raise RuntimeError(f"Expected index {list(index.shape)} to be no larger than src "
                               f"{list(src.shape)} apart from dimension {axis}")
    if any(i > s for a, (i, s) in enumerate(zip(index.shape, x.shape)) if a != axis):
        raise RuntimeError(f"Expected index {list(index.shape)} to be no larger than self "
                           f"{list(x.shape)} apart from dimension {axis}")
    xt, it = x.transpose(axis, -1), index.transpose(axis, -1)
    pads: list[int] = [0, 0]
    for a in reversed(range(xt.ndim - 1)):
        pads += [0, xt.shape[a] - it.shape[a]]
    n = xt.shape[-1]
    valid = full(it.shape, True, dt.bool_, x.device).pad(pads)
    rows = arange(n, device=x.device, dtype=it.dtype).reshape(n, 1)
    hit = it.pad(pads).unsqueeze(-2).eq(rows).logical_and(valid.unsqueeze(-2))  # (..., n, m)
    cut = None
    if src is not None:
        cut = src.shrink([(0, k) for k in index.shape]).transpose(axis, -1).pad(pads)
    return xt, hit, cut


def _finish(out: "Tensor", x: "Tensor", axis: int) -> "Tensor":
    return out.reshape(()) if x.ndim == 0 else out.transpose(axis, -1)


def scatter(x: "Tensor", dim: int, index: Any, src: Any = None, value: Any = None,
            reduce: str | None = None) -> "Tensor":
    """PyTorch's ``scatter``: ``out = x``, then ``out[..., index[i], ...] = src[i]`` along
    ``dim`` (or the number ``value``). Where several indices name one position, the last of
    them along ``dim`` wins (PyTorch leaves that undefined; its cpu backend does the same);
    indices outside the axis are ignored (PyTorch raises). ``reduce="add"``/``"multiply"`` are
    ``scatter_reduce``'s "sum" and "prod". Gradients as PyTorch's: the positions written lose
    theirs, and every element of ``src`` gets the gradient of the position it names.

    >>> import anygpu as ag
    >>> ag.zeros(2, 3).scatter(1, ag.tensor([[2], [0]]), 1.0).tolist()
    [[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]
    >>> ag.zeros(4).scatter(0, ag.tensor([3, 1, 3]), ag.tensor([5.0, 6.0, 7.0])).tolist()
    [0.0, 6.0, 0.0, 7.0]
    """
    from anygpu.tensor import Tensor, _axis, arange

    if src is None:
        src = value
    if src is None:
        raise TypeError("scatter() needs src or value")
    if reduce is not None:
        modes = {"add": "sum", "multiply": "prod"}
        if reduce not in modes:
            raise RuntimeError(f"reduce argument must be either add or multiply, got {reduce}")
        if not isinstance(src, Tensor):
            src = x._const_like(src).cast(x.dtype).expand(index.shape) if isinstance(
                index, Tensor) else Tensor(np.full(np.shape(index), src), device=x.device)
        return scatter_reduce(x, dim, index, src, modes[reduce])
    axis = _axis(dim, x.ndim)
    if not isinstance(src, Tensor):  # a number: every named position becomes it
        xt, hit, _ = _one_hot(x, axis, index, None, "scatter")
        named = hit._max((hit.ndim - 1,), keepdim=False)
        return _finish(named._select(xt._const_like(src, shape=()).cast(x.dtype), xt), x, axis)
    index_t = index if isinstance(index, Tensor) else Tensor(np.asarray(index), device=x.device)

    def compute() -> "Tensor":
        xt, hit, cut = _one_hot(x, axis, index_t, src, "scatter")
        assert cut is not None
        m = cut.shape[-1]
        # the last index along the axis that names each position, or -1
        last = hit._select(arange(m, device=x.device, dtype=dt.int32).reshape(1, m), -1)._max(
            (hit.ndim - 1,), keepdim=False)
        taken = cut.cast(x.dtype).gather(-1, last.maximum(0))
        return _finish(last.ge(0)._select(taken, xt), x, axis)
    return x._custom("scatter", (src,), (axis, index_t), compute)


def scatter_grad(out: "Tensor", ps: tuple["Tensor", ...], arg: Any, g: "Tensor") -> tuple:
    """PyTorch's rule for ``scatter``: x's gradient where nothing was written, and for each
    element of src the gradient at the position it names (src beyond index's shape: 0)."""
    x, src = ps
    axis, index = arg
    gx = scatter(g, axis, index, 0.0) if x.requires_grad else None
    gs = None
    if src.requires_grad:
        gs = g.gather(axis, index) if g.ndim else g.reshape(())
        gs = gs.pad([w for a in reversed(range(src.ndim))
                     for w in (0, src.shape[a] - index.shape[a])]).cast(src.dtype)
    return gx, gs


_REDUCTIONS = ("sum", "prod", "mean", "amax", "amin")


def scatter_reduce(x: "Tensor", dim: int, index: Any, src: "Tensor", reduce: str,
                   include_self: bool = True) -> "Tensor":
    """PyTorch's ``scatter_reduce``: each position of ``x`` named by ``index`` along ``dim``
    becomes the reduction ("sum", "prod", "mean", "amax", "amin") of the ``src`` elements that
    name it, and of its own value with ``include_self``. One reduction over a one-hot
    (..., n, m + 1) layout per row, x's own value as the last column, so gradients are those
    of the reduction (amax and amin split among equal values, x's included, as PyTorch's).
    Integer means round down, as PyTorch's.

    >>> import anygpu as ag
    >>> x = ag.tensor([1.0, 2.0, 3.0])
    >>> x.scatter_reduce(0, ag.tensor([0, 0, 2]), ag.tensor([4.0, 5.0, 6.0]), "amax").tolist()
    [5.0, 2.0, 6.0]
    >>> x.scatter_reduce(0, ag.tensor([0, 0]), ag.tensor([4.0, 5.0]), "mean", False).tolist()
    [4.5, 2.0, 3.0]
    """
    from anygpu.tensor import _axis, arange

    if reduce not in _REDUCTIONS:
        raise RuntimeError(f"reduce argument must be either sum, prod, mean, amax or amin, got "
                           f"{reduce}")
    axis = _axis(dim, x.ndim)
    xt, hit, cut = _one_hot(x, axis, index, src, "scatter_reduce")
    assert cut is not None
    cut = cut.cast(x.dtype)
    flip = reduce == "amin"
    if flip:  # through amax of the order reversed (-x; ~x for integers)
        xt, cut = xt._neg_for_min(), cut._neg_for_min()
    identity = {"sum": 0, "mean": 0, "prod": 1}.get(reduce, dt.min_value(xt.dtype))
    m = cut.shape[-1]
    own = arange(m + 1, device=x.device, dtype=dt.int32).eq(m)  # the last column: x itself
    terms = hit.pad((0, 1)).logical_or(own.logical_and(include_self))
    values = own._select(xt.unsqueeze(-1), cut.unsqueeze(-2).pad((0, 1)))
    values = terms._select(values, values._const_like(identity, shape=()))
    last = values.ndim - 1
    if reduce == "prod":
        out = values._reduce(Op.PROD, (last,))
    elif reduce in ("amax", "amin"):
        out = values._max((last,), keepdim=True)
    else:
        out = values._reduce(Op.SUM, (last,))
    out = out.reshape(out.shape[:-1])
    if reduce == "mean":
        count = terms.cast(dt.int32)._reduce(Op.SUM, (last,)).reshape(out.shape).maximum(1)
        out = out / count.cast(out.dtype) if out.dtype.is_float else out.floor_divide(count)
    if flip:
        out, xt = out._neg_for_min(), xt._neg_for_min()
    named = hit._max((hit.ndim - 1,), keepdim=False)
    out = named._select(out, xt).cast(x.dtype)
    return _finish(out, x, axis)


__all__ = ["getitem", "gather", "index_select", "index_copy", "scatter_add", "scatter",
           "scatter_reduce", "scatter_grad"]
