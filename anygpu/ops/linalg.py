"""Linear algebra composites. ``matmul`` is a broadcast multiply and a sum over the shared axis,
which the scheduler turns into one kernel (the tuned GEMM template replaces it for large sizes).
``cdist``: distances between two sets of rows."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from anygpu import amp
from anygpu import dtype as dt
from anygpu.ops.primitives import Op

if TYPE_CHECKING:
    from anygpu.tensor import Tensor


_PRECISIONS = ("highest", "high", "medium")
_float32_matmul = ["highest"]


def set_float32_matmul_precision(precision: str) -> None:
    """PyTorch's switch for float32 products: "highest" (the default) computes them exactly in
    float32; "high" and "medium" allow tensor cores in tf32 (10 bits of mantissa per operand,
    float32 accumulation) where the device has them."""
    if precision not in _PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(_PRECISIONS)}, got {precision!r}")
    _float32_matmul[0] = precision


def get_float32_matmul_precision() -> str:
    return _float32_matmul[0]


def matmul(a: "Tensor", b: "Tensor") -> "Tensor":
    """PyTorch's ``matmul``: vector, matrix and batched (broadcast) products."""
    from anygpu.tensor import Tensor, broadcast_shapes

    if not isinstance(b, Tensor):
        raise TypeError(f"matmul expects a Tensor, got {type(b).__name__}")
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError("matmul: both arguments need at least one dimension")
    if a.dtype == dt.bool_ or b.dtype == dt.bool_:
        raise TypeError("matmul is not defined for bool tensors")
    a, b = amp.lower(a, b)
    if a.ndim == 1 and b.ndim == 1:
        return matmul(a.unsqueeze(0), b.unsqueeze(1)).reshape(())
    if a.ndim == 1:
        return matmul(a.unsqueeze(0), b).squeeze(-2)
    if b.ndim == 1:
        return matmul(a, b.unsqueeze(1)).squeeze(-1)
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"matmul: shapes {a.shape} and {b.shape} do not match "
                         f"({a.shape[-1]} != {b.shape[-2]})")
    d = dt.promote(a.dtype, b.dtype)
    a, b = a.cast(d), b.cast(d)
    batch = broadcast_shapes(a.shape[:-2], b.shape[:-2])
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    a = a.expand(batch + (m, k)).unsqueeze(-1).expand(batch + (m, k, n))
    b = b.expand(batch + (k, n)).unsqueeze(-3).expand(batch + (m, k, n))
    prod = a._alu(Op.MUL, b)
    return prod._reduce(Op.SUM, (len(batch) + 1,)).reshape(batch + (m, n))


def matmul_transposed(a: "Tensor", b: "Tensor") -> "Tensor":
    """``a @ b.T`` for a 2-D ``b`` of shape (n, k), multiplied over (..., n, k): the gradient of
    ``b``, summed over ``a``'s rows, comes out in ``b``'s own layout (through ``b.T`` it came
    out transposed, and realized into ``b``'s gradient it was copied back by a kernel of its
    own: VGG-16's first classifier layer, 411 MB each way)."""
    if b.ndim != 2 or a.ndim == 0:
        raise ValueError(f"matmul_transposed expects a 2-D second argument and a first with "
                         f"dimensions, got {a.shape} and {b.shape}")
    if a.shape[-1] != b.shape[1]:
        raise ValueError(f"matmul: shapes {a.shape} and {b.shape[::-1]} do not match "
                         f"({a.shape[-1]} != {b.shape[1]})")
    if a.dtype == dt.bool_ or b.dtype == dt.bool_:
        raise TypeError("matmul is not defined for bool tensors")
    a, b = amp.lower(a, b)
    d = dt.promote(a.dtype, b.dtype)
    lead, (n, k) = a.shape[:-1], b.shape
    x = a.cast(d).unsqueeze(-2).expand(lead + (n, k))
    y = b.cast(d).reshape((1,) * len(lead) + (n, k)).expand(lead + (n, k))
    return x._alu(Op.MUL, y)._reduce(Op.SUM, (len(lead) + 1,)).reshape(lead + (n,))


def outer(a: "Tensor", b: "Tensor") -> "Tensor":
    return a.reshape(-1, 1) * b.reshape(1, -1)


_CDIST_MODES = ("use_mm_for_euclid_dist_if_necessary", "use_mm_for_euclid_dist",
                "donot_use_mm_for_euclid_dist")


def cdist(x1: "Tensor", x2: "Tensor", p: float = 2.0,
          compute_mode: str = "use_mm_for_euclid_dist_if_necessary") -> "Tensor":
    """PyTorch's ``cdist``: the p-norm distance between each row of ``x1`` (..., P, M) and each
    row of ``x2`` (..., R, M), as (..., P, R); batch axes broadcast. For p = 2 with more than 25
    rows on a side (PyTorch's rule, or ``compute_mode="use_mm_for_euclid_dist"``) it is
    sqrt(|a|^2 + |b|^2 - 2 a.b) through ``matmul`` (the GEMM templates), else the differences
    summed directly. The p = 2 gradient is PyTorch's (0 where a distance is 0).

    >>> import anygpu as ag
    >>> a = ag.tensor([[0.0, 0.0], [3.0, 4.0]])
    >>> ag.cdist(a, a).tolist(), ag.cdist(a, a, p=1)[0, 1].item()
    ([[0.0, 5.0], [5.0, 0.0]], 7.0)
    """
    from anygpu.tensor import Tensor

    if not isinstance(x1, Tensor) or not isinstance(x2, Tensor):
        raise TypeError("cdist expects two tensors")
    for name, x in (("X1", x1), ("X2", x2)):
        if x.ndim < 2:
            raise RuntimeError(f"cdist only supports at least 2D tensors, {name} got: {x.ndim}D")
        if not x.dtype.is_float:
            raise RuntimeError(f"cdist only supports floating-point dtypes, {name} got: "
                               f"{x.dtype.name}")
    if x1.shape[-1] != x2.shape[-1]:
        raise RuntimeError(f"X1 and X2 must have the same number of columns. X1: "
                           f"{x1.shape[-1]} X2: {x2.shape[-1]}")
    if p < 0:
        raise RuntimeError("cdist only supports non-negative p values")
    if compute_mode not in _CDIST_MODES:
        raise RuntimeError(f"{compute_mode} is not a valid value for compute_mode")
    d = dt.promote(x1.dtype, x2.dtype)
    x1, x2 = x1.cast(d), x2.cast(d)
    if p == 2:
        many = x1.shape[-2] > 25 or x2.shape[-2] > 25
        use_mm = compute_mode == "use_mm_for_euclid_dist" or (
            compute_mode == _CDIST_MODES[0] and many)
        return x1._custom("cdist", (x2,), 2, lambda: _euclidean(x1, x2, use_mm))
    diff = (x1.unsqueeze(-2) - x2.unsqueeze(-3)).abs()  # (..., P, R, M)
    if p == 0:  # a count: zero gradients, as PyTorch's
        return x1._custom("zero", (x2,), None, lambda: diff.ne(0).cast(d).sum(-1))
    if p == 1:
        return diff.sum(-1)
    if p == math.inf:  # its gradient goes whole to every coordinate at the maximum
        return x1._custom("cdist", (x2,), p, lambda: diff.amax(-1) if diff.shape[-1]
                          else diff.sum(-1))
    # zeros kept out of pow's gradient (its 0 ** negative is infinite): 0 there, as PyTorch's
    zero = diff.eq(0)
    powers = zero._select(0.0, zero._select(1.0, diff) ** p)
    total = powers.sum(-1)
    empty = total.eq(0)
    return empty._select(0.0, empty._select(1.0, total) ** (1.0 / p))


def _euclidean(x1: "Tensor", x2: "Tensor", use_mm: bool) -> "Tensor":
    if not use_mm:
        diff = x1.unsqueeze(-2) - x2.unsqueeze(-3)
        return (diff * diff).sum(-1).sqrt()
    square1 = (x1 * x1).sum(-1, keepdim=True)  # (..., P, 1)
    square2 = (x2 * x2).sum(-1, keepdim=True).transpose(-1, -2)  # (..., 1, R)
    product = matmul(x1, x2.transpose(-1, -2))
    return (square1 + square2 - product * 2).maximum(0).sqrt()


def cdist_grad(out: "Tensor", ps: tuple["Tensor", ...], arg: Any, g: "Tensor") -> tuple:
    """PyTorch's rules. p = 2: with r = g / d (0 where d = 0), x1 gets x1 * sum(r) - r @ x2 and
    x2 gets x2 * sum(r) - r^T @ x1. p = inf: each coordinate whose difference is the
    distance gets the whole gradient, with the difference's sign. Summed over broadcast batch
    axes."""
    from anygpu.ops.grad import _reduce_to

    x1, x2 = ps
    if arg == 2:
        ratio = out.eq(0)._select(g._const_like(0), g / out)
        g1 = x1 * ratio.sum(-1, keepdim=True) - matmul(ratio, x2)
        g2 = x2 * ratio.sum(-2).unsqueeze(-1) - matmul(ratio.transpose(-1, -2), x1)
    else:
        diff = x1.unsqueeze(-2) - x2.unsqueeze(-3)  # (..., P, R, M)
        at_max = diff.abs().eq(out.unsqueeze(-1))
        part = at_max._select(g.unsqueeze(-1) * diff.sign(), g._const_like(0, shape=()))
        g1, g2 = part.sum(-2), -part.sum(-3)
    return _reduce_to(g1, x1.shape), _reduce_to(g2, x2.shape)
