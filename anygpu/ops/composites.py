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


def _like(fill: Callable[..., "Tensor"]) -> Callable[..., "Tensor"]:
    def make(t: "Tensor", dtype: Any = None, device: Any = None,
             requires_grad: bool = False) -> "Tensor":
        return fill(*t.shape, dtype=dtype or t.dtype, device=device or t.device,
                    requires_grad=requires_grad)
    return make


def methods() -> dict[str, Any]:
    """The methods this module adds to ``Tensor``."""
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
    }


# functions of anygpu that are the method of their first argument
FUNCTIONS = ["abs", "exp", "log", "sqrt", "rsqrt", "sin", "cos", "tan", "tanh", "sigmoid",
             "relu", "floor", "ceil", "round", "trunc", "sign", "neg", "reciprocal", "square",
             "clamp", "clip", "maximum", "minimum", "pow", "add", "sub", "mul", "div",
             "remainder", "fmod", "floor_divide", "matmul", "dot", "sum", "mean", "prod", "std",
             "var", "max", "min", "amax", "amin", "argmax", "argmin", "logsumexp", "cumsum",
             "all", "any", "softmax", "log_softmax", "reshape", "permute", "transpose",
             "squeeze", "unsqueeze", "flatten", "unflatten", "flip", "chunk", "split",
             "gather", "scatter_add", "index_select", "masked_fill", "isnan", "isinf", "erf",
             "log1p", "expm1", "exp2", "log2", "t", "eq", "ne", "lt", "le", "gt", "ge",
             "logical_not", "logical_and", "logical_or", "logical_xor", "tril", "triu",
             "isclose", "allclose", "equal", "outer", "mm", "bmm", "unbind", "norm",
             "masked_select", "nonzero", "lerp", "numel", "repeat", "expand"]


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
           "equal", "outer", "mm", "bmm", "unbind", "norm", "masked_select", "nonzero"]
