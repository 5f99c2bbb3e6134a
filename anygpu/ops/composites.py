"""More of PyTorch's tensor methods, each a few lines of composites (installed on ``Tensor`` by
``tensor.py``), and the top-level functions that mirror methods (``anygpu.flatten(x)`` is
``x.flatten()``).

>>> import anygpu as ag
>>> x = ag.tensor([[1.0, 2.0], [3.0, 4.0]])
>>> ag.tril(x).tolist(), f"{x.sum():.1f}", ag.allclose(x, x + 1e-9)
([[1.0, 0.0], [3.0, 4.0]], '10.0', True)
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from anygpu import dtype as dt

if TYPE_CHECKING:
    from anygpu.tensor import Tensor


def _format(t: "Tensor", spec: str) -> str:
    """``f"{loss:.4f}"``: a one-element tensor formats as its number; otherwise as ``str``."""
    if t.numel() == 1:
        return format(t.item(), spec)
    if spec:
        raise TypeError(f"unsupported format string {spec!r} for a tensor of shape {t.shape}")
    return str(t)


def _index(t: "Tensor") -> int:
    """``range(n)``, ``list[t]``: a one-element integer tensor as a Python int."""
    if t.dtype.is_float or t.numel() != 1:
        raise TypeError("only integer tensors of a single element can be converted to an index")
    return int(t.item())


def _new(t: "Tensor", fill: Any) -> Callable[..., "Tensor"]:
    def make(*size: Any, dtype: Any = None, device: Any = None,
             requires_grad: bool = False) -> "Tensor":
        from anygpu.tensor import _shape_arg, full

        return full(_shape_arg(size), fill, dtype or t.dtype, device or t.device, requires_grad)
    return make


def _new_tensor(t: "Tensor", data: Any, dtype: Any = None, device: Any = None,
                requires_grad: bool = False) -> "Tensor":
    from anygpu.tensor import tensor

    return tensor(data, dtype=dtype or t.dtype, device=device or t.device,
                  requires_grad=requires_grad)


def _tri(t: "Tensor", diagonal: int, lower: bool) -> "Tensor":
    if t.ndim < 2:
        raise ValueError(f"tril/triu need at least 2 dimensions, got shape {t.shape}")
    from anygpu.tensor import arange

    n, m = t.shape[-2:]
    rows = arange(n, device=t.device, dtype=dt.int32).reshape(n, 1)
    cols = arange(m, device=t.device, dtype=dt.int32).reshape(1, m)
    keep = (cols - rows).le(diagonal) if lower else (cols - rows).ge(diagonal)
    return t.where(keep, t._const_like(0))


def tril(t: "Tensor", diagonal: int = 0) -> "Tensor":
    """The lower triangle (``diagonal`` above the main one kept too), the rest 0."""
    return _tri(t, diagonal, True)


def triu(t: "Tensor", diagonal: int = 0) -> "Tensor":
    """The upper triangle (from ``diagonal`` on), the rest 0."""
    return _tri(t, diagonal, False)


def isclose(a: "Tensor", b: Any, rtol: float = 1e-5, atol: float = 1e-8,
            equal_nan: bool = False) -> "Tensor":
    """``|a - b| <= atol + rtol * |b|`` elementwise (infinities equal only to themselves)."""
    from anygpu.tensor import _as_tensor

    b = _as_tensor(b, a)
    close = (a - b).abs().le((b.abs() * rtol) + atol) | a.eq(b)
    if equal_nan:
        close = close | (a.isnan() & b.isnan())
    return close


def allclose(a: "Tensor", b: Any, rtol: float = 1e-5, atol: float = 1e-8,
             equal_nan: bool = False) -> bool:
    return bool(isclose(a, b, rtol, atol, equal_nan).all().item())


def equal(a: "Tensor", b: "Tensor") -> bool:
    """Same shape and the same elements."""
    return a.shape == b.shape and bool(a.eq(b).all().item())


def outer(a: "Tensor", b: "Tensor") -> "Tensor":
    if a.ndim != 1 or b.ndim != 1:
        raise ValueError(f"outer needs two 1-D tensors, got {a.shape} and {b.shape}")
    return a.reshape(-1, 1) * b.reshape(1, -1)


def mm(a: "Tensor", b: "Tensor") -> "Tensor":
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"mm needs two 2-D tensors, got {a.shape} and {b.shape}")
    return a.matmul(b)


def bmm(a: "Tensor", b: "Tensor") -> "Tensor":
    if a.ndim != 3 or b.ndim != 3 or a.shape[0] != b.shape[0]:
        raise ValueError(f"bmm needs two 3-D tensors of one batch, got {a.shape} and {b.shape}")
    return a.matmul(b)


def unbind(t: "Tensor", dim: int = 0) -> tuple["Tensor", ...]:
    from anygpu.tensor import _axis

    axis = _axis(dim, t.ndim)
    return tuple(t[(slice(None),) * axis + (i,)] for i in range(t.shape[axis]))


def norm(t: "Tensor", p: Any = "fro", dim: Any = None, keepdim: bool = False) -> "Tensor":
    """Vector p-norms (2 and "fro" by default, 1, inf, -inf, any positive p) over ``dim`` or
    all elements."""
    a = t.abs()
    if p in ("fro", 2, 2.0):
        return (t * t).sum(dim, keepdim=keepdim).sqrt()
    if p == math.inf:
        return a.amax(dim, keepdim=keepdim) if dim is not None else a.max()
    if p == -math.inf:
        return a.amin(dim, keepdim=keepdim) if dim is not None else a.min()
    if p in (1, 1.0):
        return a.sum(dim, keepdim=keepdim)
    if isinstance(p, (int, float)) and p > 0:
        return (a ** p).sum(dim, keepdim=keepdim) ** (1.0 / p)
    raise ValueError(f"norm: unsupported p={p!r}")


def masked_select(t: "Tensor", mask: "Tensor") -> "Tensor":
    """The elements where ``mask`` (broadcast) is true, as a 1-D tensor (reads the mask back,
    as the result's size depends on it)."""
    from anygpu.tensor import _broadcast

    t, mask = _broadcast(t, mask)
    return t[mask]


def nonzero(t: "Tensor", as_tuple: bool = False) -> Any:
    """Indices of the nonzero elements, (count, ndim) int64 (reads the tensor back)."""
    from anygpu.tensor import tensor

    where = np.nonzero(t.numpy())
    if as_tuple:
        return tuple(tensor(w.astype(np.int64), device=t.device) for w in where)
    return tensor(np.stack(where, 1).astype(np.int64).reshape(-1, t.ndim), device=t.device)


def lerp(t: "Tensor", end: Any, weight: Any) -> "Tensor":
    return t + (end - t) * weight


def type_as(t: "Tensor", other: "Tensor") -> "Tensor":
    return t.cast(other.dtype)


def view_as(t: "Tensor", other: "Tensor") -> "Tensor":
    return t.reshape(other.shape)


def element_size(t: "Tensor") -> int:
    return t.dtype.itemsize


# ---- diagonals, rolls, repeats ------------------------------------------------------------------
def diagonal(t: "Tensor", offset: int = 0, dim1: int = 0, dim2: int = 1) -> "Tensor":
    """The diagonal ``offset`` above the main one (below it if negative) of the planes spanned by
    ``dim1`` and ``dim2``, as a new last axis: a view (the two axes flattened, then every
    (n2 + 1)-th element).

    >>> import anygpu as ag
    >>> x = ag.arange(9).reshape(3, 3)
    >>> x.diagonal().tolist(), x.diagonal(1).tolist(), ag.diagonal(x, -1).tolist()
    ([0, 4, 8], [1, 5], [3, 7])
    """
    from anygpu.ops.indexing import _strided
    from anygpu.tensor import _axis

    if t.ndim < 2:
        _axis(dim1, t.ndim), _axis(dim2, t.ndim)
    a, b = _axis(dim1, t.ndim), _axis(dim2, t.ndim)
    if a == b:
        raise RuntimeError(f"diagonal dimensions cannot be identical {dim1}, {dim2}")
    x = t.permute([d for d in range(t.ndim) if d not in (a, b)] + [a, b])
    n1, n2 = x.shape[-2:]
    count = max(0, min(n1, n2 - offset) if offset >= 0 else min(n1 + offset, n2))
    start = offset if offset >= 0 else -offset * n2
    flat = x.reshape(x.shape[:-2] + (n1 * n2,))
    if count == 0:
        return flat.shrink([(0, m) for m in flat.shape[:-1]] + [(0, 0)])
    return _strided(flat, flat.ndim - 1, start, start + (count - 1) * (n2 + 1) + 1, n2 + 1)


_diagonal = diagonal  # for diag, whose argument of that name (PyTorch's) hides the function


def diag_embed(t: "Tensor", offset: int = 0, dim1: int = -2, dim2: int = -1) -> "Tensor":
    """Matrices with the last axis of ``t`` on their diagonal ``offset`` (the rest 0), in the
    output's axes ``dim1`` and ``dim2``: views and padding, no kernel of its own.

    >>> import anygpu as ag
    >>> ag.diag_embed(ag.tensor([1, 2])).tolist(), ag.diag_embed(ag.tensor([3]), 1).tolist()
    ([[1, 0], [0, 2]], [[0, 3], [0, 0]])
    """
    from anygpu.tensor import _axis

    if t.ndim == 0:
        t = t.reshape(1)
    out_ndim = t.ndim + 1
    a, b = _axis(dim1, out_ndim), _axis(dim2, out_ndim)
    if a == b:
        raise RuntimeError(f"diagonal dimensions cannot be identical {dim1}, {dim2}")
    n = t.shape[-1]
    lead = t.shape[:-1]
    # x[i] at flat position i * (n + 1) of an n x n matrix: pad each element with n zeros
    square = t.unsqueeze(-1).pad((0, n)).reshape(lead + (n * (n + 1),))
    square = square.shrink([(0, m) for m in lead] + [(0, n * n)]).reshape(lead + (n, n))
    k = abs(offset)
    square = square.pad((k, 0, 0, k) if offset >= 0 else (0, k, k, 0))
    order = []
    batch = iter(range(len(lead)))
    for p in range(out_ndim):
        order.append(out_ndim - 2 if p == a else out_ndim - 1 if p == b else next(batch))
    return square.permute(order)


def diag(t: "Tensor", diagonal: int = 0) -> "Tensor":
    """A 1-D tensor as the diagonal ``diagonal`` of a square matrix; of a matrix, that
    diagonal as a 1-D tensor.

    >>> import anygpu as ag
    >>> ag.diag(ag.tensor([1, 2])).tolist(), ag.diag(ag.tensor([[1, 2], [3, 4]]), 1).tolist()
    ([[1, 0], [0, 2]], [2])
    """
    if t.ndim == 1:
        return diag_embed(t, diagonal)
    if t.ndim == 2:
        return _diagonal(t, diagonal)
    raise RuntimeError(f"diag(): Supports 1D or 2D tensors. Got {t.ndim}D")


def trace(t: "Tensor") -> "Tensor":
    """The sum of a matrix's main diagonal (integers sum into int64).

    >>> import anygpu as ag
    >>> ag.trace(ag.tensor([[1.0, 2.0], [3.0, 4.0]])).item()
    5.0
    """
    if t.ndim != 2:
        raise RuntimeError(f"trace: expected a matrix, but got tensor with dim {t.ndim}")
    return diagonal(t).sum()


def roll(t: "Tensor", shifts: Any, dims: Any = None) -> "Tensor":
    """Elements shifted along ``dims`` by ``shifts``, those pushed off the end coming back at the
    start (without ``dims``: over the flattened tensor). A view: each axis is read from the
    tensor repeated twice along it.

    >>> import anygpu as ag
    >>> ag.tensor([1, 2, 3, 4]).roll(1).tolist()
    [4, 1, 2, 3]
    >>> ag.roll(ag.tensor([[1, 2], [3, 4]]), -1, 0).tolist()
    [[3, 4], [1, 2]]
    """
    from anygpu.tensor import _axis

    shift_list = list(shifts) if isinstance(shifts, (tuple, list)) else [shifts]
    if dims is None:
        if len(shift_list) != 1:
            raise RuntimeError(f"shifts and dimensions must align. shifts: {len(shift_list)}, "
                               f"dims:0")
        return roll(t.flatten(), shift_list[0], 0).reshape(t.shape)
    dim_list = list(dims) if isinstance(dims, (tuple, list)) else [dims]
    if len(shift_list) != len(dim_list):
        raise RuntimeError(f"shifts and dimensions must align. shifts: {len(shift_list)}, "
                           f"dims:{len(dim_list)}")
    out = t
    for shift, dim in zip(shift_list, dim_list):
        axis = _axis(dim, t.ndim)
        n = out.shape[axis] if t.ndim else 1
        if t.ndim == 0 or n == 0 or int(shift) % n == 0:
            continue
        s = int(shift) % n
        twice = out.unsqueeze(axis).expand(out.shape[:axis] + (2,) + out.shape[axis:])
        twice = twice.reshape(out.shape[:axis] + (2 * n,) + out.shape[axis + 1:])
        bounds = [(0, m) for m in twice.shape]
        bounds[axis] = (n - s, 2 * n - s)
        out = twice.shrink(bounds)
    return out


def repeat_interleave(t: "Tensor", repeats: Any = None, dim: int | None = None,
                      output_size: int | None = None) -> "Tensor":
    """Each element repeated ``repeats`` times along ``dim`` (the flattened tensor without
    one). An int repeats through a broadcast view; a tensor of counts is read back to the host
    (the result's size depends on it) and the elements gathered on the device. With no
    ``repeats``, ``t`` holds the counts and the result repeats their indices, as
    ``torch.repeat_interleave(counts)``.

    >>> import anygpu as ag
    >>> ag.tensor([1, 2]).repeat_interleave(2).tolist()
    [1, 1, 2, 2]
    >>> ag.repeat_interleave(ag.tensor([[1, 2], [3, 4]]), ag.tensor([1, 2]), dim=0).tolist()
    [[1, 2], [3, 4], [3, 4]]
    >>> ag.repeat_interleave(ag.tensor([2, 0, 1])).tolist()
    [0, 0, 2]
    """
    from anygpu.tensor import Tensor, _axis, arange

    if repeats is None:  # torch.repeat_interleave(counts)
        if t.ndim != 1 or t.dtype.is_float:
            raise RuntimeError("repeat_interleave: repeats must be 0-dim or 1-dim integer tensor")
        return repeat_interleave(arange(t.shape[0], device=t.device), t, 0, output_size)
    if dim is None:
        t, axis = t.flatten(), 0
    else:
        axis = _axis(dim, t.ndim)
    if t.ndim == 0:
        t = t.reshape(1)
    n = t.shape[axis]
    if isinstance(repeats, Tensor) and repeats.numel() == 1:
        repeats = int(repeats.item())
    if isinstance(repeats, Tensor):
        if repeats.ndim != 1 or repeats.dtype.is_float:
            raise RuntimeError("repeat_interleave: repeats must be 0-dim or 1-dim integer tensor")
        counts = repeats.numpy().astype(np.int64)  # the result's size depends on them
        if counts.shape[0] != n:
            raise RuntimeError(f"repeats must have the same size as input along dim, but got "
                               f"repeats.size(0) = {counts.shape[0]} and input.size(0) = {n}")
        if (counts < 0).any():
            raise RuntimeError("repeats can not be negative")
        total = int(counts.sum())
        if output_size is not None and output_size != total:
            raise RuntimeError("allocated size does not match required size")
        index = Tensor(np.repeat(np.arange(n, dtype=np.int32), counts), device=t.device)
        return t.index_select(axis, index)
    r = int(repeats)
    if r < 0:
        raise RuntimeError("Repeats must be non-negative")
    if output_size is not None and output_size != n * r:
        raise RuntimeError("allocated size does not match required size")
    spread = t.unsqueeze(axis + 1).expand(t.shape[:axis + 1] + (r,) + t.shape[axis + 1:])
    return spread.reshape(t.shape[:axis] + (n * r,) + t.shape[axis + 1:])


def kron(a: "Tensor", b: "Tensor") -> "Tensor":
    """The Kronecker product: block (i, j, ...) of the result is ``a[i, j, ...] * b``.

    >>> import anygpu as ag
    >>> ag.kron(ag.tensor([1, 2]), ag.tensor([1, 10])).tolist()
    [1, 10, 2, 20]
    """
    nd = max(a.ndim, b.ndim)
    sa = (1,) * (nd - a.ndim) + a.shape
    sb = (1,) * (nd - b.ndim) + b.shape
    left = a.reshape(tuple(v for n in sa for v in (n, 1)))
    right = b.reshape(tuple(v for n in sb for v in (1, n)))
    return (left * right).reshape(tuple(x * y for x, y in zip(sa, sb)))


# ---- running maxima and log-sums -----------------------------------------------------------------
def _prefix(t: "Tensor", axis: int, fill: Any) -> "Tensor":
    """(..., n, n) from ``t`` with ``axis`` last: [..., j, k] = t[..., k] for k <= j, else
    ``fill`` (the masked prefix that a reduction over the last axis turns into a scan)."""
    from anygpu.tensor import arange

    x = t.transpose(axis, -1)
    n = x.shape[-1]
    i = arange(n, device=t.device, dtype=dt.int32)
    inside = i.reshape(n, 1).ge(i.reshape(1, n))
    return inside._select(x.unsqueeze(-2), x._const_like(fill, shape=()))


def _cumulative_max(t: "Tensor", dim: int, name: str) -> Any:
    from anygpu.ops.sorting import ValuesIndices
    from anygpu.tensor import _axis, arange, full

    axis = _axis(dim, t.ndim)
    if t.ndim == 0:
        return ValuesIndices(t.contiguous(), full((), 0, dt.int64, t.device))
    x = t.cast(dt.uint8) if t.dtype == dt.bool_ else t
    if name == "cummin":
        x = x._neg_for_min()
    n = x.shape[axis]
    if n == 0:
        return ValuesIndices(t.contiguous(), full(t.shape, 0, dt.int64, t.device))
    best = _prefix(x, axis, dt.min_value(x.dtype))._max(-1, keepdim=True)  # (..., n, 1)
    rows = x.transpose(axis, -1).unsqueeze(-2)
    hit = rows.eq(best)
    if x.dtype.is_float:
        hit = hit.logical_or(rows.isnan().logical_and(best.isnan()))
    # PyTorch's: the last index of the running maximum (of the last NaN once one is seen)
    k = arange(n, device=t.device, dtype=dt.int32).reshape(1, n)
    j = k.reshape(n, 1)
    last = hit.logical_and(k.le(j))._select(k, -1)._max(-1, keepdim=False)
    indices = last.cast(dt.int64).transpose(axis, -1)
    return ValuesIndices(t.gather(axis, indices), indices)


def cummax(t: "Tensor", dim: int) -> Any:
    """The running maximum along ``dim`` and where it was last seen (NaN, once seen, stays), as
    (values, indices); the gradient goes to those indices. A masked (n, n) reduction per row.

    >>> import anygpu as ag
    >>> ag.tensor([1, 3, 2, 3]).cummax(0).indices.tolist()
    [0, 1, 1, 3]
    """
    return _cumulative_max(t, dim, "cummax")


def cummin(t: "Tensor", dim: int) -> Any:
    """The running minimum along ``dim`` and where it was last seen, as (values, indices).

    >>> import anygpu as ag
    >>> ag.cummin(ag.tensor([3, 1, 2, 1]), 0).values.tolist()
    [3, 1, 1, 1]
    """
    return _cumulative_max(t, dim, "cummin")


def logcumsumexp(t: "Tensor", dim: int) -> "Tensor":
    """log(cumsum(exp(t))) along ``dim``, each prefix as its own ``logsumexp`` (shifted by its
    own maximum, so small terms are not lost).

    >>> import anygpu as ag
    >>> [round(v, 4) for v in ag.tensor([0.0, 0.0, -1000.0]).logcumsumexp(0).tolist()]
    [0.0, 0.6931, 0.6931]
    """
    from anygpu.tensor import _axis

    if not t.dtype.is_float:
        raise NotImplementedError(f"logcumsumexp is not implemented for {t.dtype.name} tensors")
    if t.ndim == 0:
        _axis(dim, 0)
        return t * 1
    axis = _axis(dim, t.ndim)
    if t.shape[axis] == 0:
        return t * 1
    return _prefix(t, axis, float("-inf")).logsumexp(-1).transpose(axis, -1)


def _like(fill: Callable[..., "Tensor"]) -> Callable[..., "Tensor"]:
    def make(t: "Tensor", dtype: Any = None, device: Any = None,
             requires_grad: bool = False) -> "Tensor":
        return fill(*t.shape, dtype=dtype or t.dtype, device=device or t.device,
                    requires_grad=requires_grad)
    return make


def methods() -> dict[str, Any]:
    """The methods this module adds to ``Tensor``."""
    from anygpu.ops import indexing

    return {
        "__format__": _format, "__index__": _index,
        "new_zeros": lambda t, *s, **k: _new(t, 0)(*s, **k),
        "new_ones": lambda t, *s, **k: _new(t, 1)(*s, **k),
        "new_empty": lambda t, *s, **k: _new(t, 0)(*s, **k),
        "new_full": lambda t, size, fill_value, **k: _new(t, fill_value)(size, **k),
        "new_tensor": _new_tensor,
        "tril": tril, "triu": triu, "isclose": isclose, "allclose": allclose,
        "equal": equal, "outer": outer, "mm": mm, "bmm": bmm, "unbind": unbind, "norm": norm,
        "masked_select": masked_select, "nonzero": nonzero, "lerp": lerp, "type_as": type_as,
        "view_as": view_as, "element_size": element_size,
        "diagonal": diagonal, "diag_embed": diag_embed, "diag": diag, "trace": trace,
        "roll": roll, "repeat_interleave": repeat_interleave, "kron": kron, "cummax": cummax,
        "cummin": cummin, "logcumsumexp": logcumsumexp, "scatter": indexing.scatter,
        "scatter_reduce": indexing.scatter_reduce, "index_copy": indexing.index_copy,
    }


# functions of anygpu that are the method of their first argument
FUNCTIONS = ["abs", "exp", "log", "sqrt", "rsqrt", "sin", "cos", "tan", "tanh", "sigmoid",
             "relu", "floor", "ceil", "round", "trunc", "sign", "neg", "reciprocal", "square",
             "clamp", "clip", "maximum", "minimum", "pow", "add", "sub", "mul", "div",
             "remainder", "fmod", "floor_divide", "matmul", "dot", "sum", "mean", "prod", "std",
             "var", "max", "min", "amax", "amin", "argmax", "argmin", "logsumexp", "cumsum",
             "all", "any", "softmax", "log_softmax", "reshape", "permute", "transpose",
             "squeeze", "unsqueeze", "flatten", "unflatten", "flip", "chunk", "split",
             "gather", "scatter_add", "index_select", "masked_fill", "isnan", "isinf", "isfinite",
             "erf", "log1p", "expm1", "exp2", "log2", "t", "eq", "ne", "lt", "le", "gt", "ge",
             "logical_not", "logical_and", "logical_or", "logical_xor", "tril", "triu",
             "isclose", "allclose", "equal", "outer", "mm", "bmm", "unbind", "norm",
             "masked_select", "nonzero", "lerp", "numel", "repeat", "expand",
             "sort", "argsort", "msort", "topk", "kthvalue", "diagonal", "diag_embed", "diag",
             "trace", "roll", "repeat_interleave", "kron", "cummax", "cummin", "logcumsumexp",
             "scatter", "scatter_reduce", "index_copy"]


def function(name: str) -> Callable[..., Any]:
    def call(input: "Tensor", *args: Any, **kwargs: Any) -> Any:
        return getattr(input, name)(*args, **kwargs)

    call.__name__ = name
    call.__doc__ = f"``anygpu.{name}(x, ...)`` is ``x.{name}(...)``."
    return call


def like(name: str) -> Callable[..., "Tensor"]:
    """``zeros_like``-style constructors for ``rand``, ``randn`` and ``empty``."""
    from anygpu.tensor import rand, randn, zeros

    return _like({"rand": rand, "randn": randn, "empty": zeros}[name])


__all__ = ["methods", "FUNCTIONS", "function", "like", "tril", "triu", "isclose", "allclose",
           "equal", "outer", "mm", "bmm", "unbind", "norm", "masked_select", "nonzero",
           "diagonal", "diag_embed", "diag", "trace", "roll", "repeat_interleave", "kron",
           "cummax", "cummin", "logcumsumexp"]
