"""Linear algebra composites. ``matmul`` is a broadcast multiply and a sum over the shared axis,
which the scheduler turns into one kernel (the tuned GEMM template replaces it for large sizes)."""

from __future__ import annotations

from typing import TYPE_CHECKING

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


def outer(a: "Tensor", b: "Tensor") -> "Tensor":
    return a.reshape(-1, 1) * b.reshape(1, -1)
