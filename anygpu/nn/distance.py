"""Norms along an axis: ``normalize``, ``cosine_similarity`` and ``pairwise_distance``
(``F.*``), and the layers ``CosineSimilarity`` and ``PairwiseDistance``, with PyTorch's
formulas, so values and gradients match where a vector is zero or nearly so.

>>> import anygpu as ag
>>> from anygpu.nn import functional as F
>>> F.normalize(ag.tensor([[0.0, 2.0], [4.0, 0.0]])).tolist()
[[0.0, 1.0], [1.0, 0.0]]
"""

from __future__ import annotations

import math
from typing import Sequence, Union

from anygpu.nn.module import Module
from anygpu.tensor import Tensor, _broadcast, where

Dims = Union[int, Sequence[int]]


def _vector_norm(x: Tensor, p: float, dim: Dims, keepdim: bool = False) -> Tensor:
    """``torch.linalg.vector_norm``: its value, and its gradient, which is 0 (not NaN) where
    the norm is 0."""
    if abs(p) == math.inf:
        # |x| stored once: the gradient of amax/amin finds the extremes by comparing |x| with
        # the result, and |x| recomputed in another kernel may differ in the last bit (WebGPU
        # on llvmpipe rounds `a - b + c` differently in different kernels), matching nothing
        size = x.abs().contiguous()
        return size.amax(dim, keepdim=keepdim) if p > 0 else size.amin(dim, keepdim=keepdim)
    if p == 0:
        return x.ne(0).sum(dim, keepdim=keepdim).cast(x.dtype)
    if p == 1:
        return x.abs().sum(dim, keepdim=keepdim)
    total = (x * x if p == 2 else x.abs() ** p).sum(dim, keepdim=keepdim)
    zero = total.eq(0)
    safe = where(zero, total._const_like(1), total)
    root = safe.sqrt() if p == 2 else safe ** (1.0 / p)
    return where(zero, total._const_like(0), root)


def normalize(input: Tensor, p: float = 2.0, dim: Dims = 1, eps: float = 1e-12) -> Tensor:
    """``input / max(norm_p(input, dim), eps)``: the vectors along ``dim`` scaled to unit
    p-norm (a zero vector stays zero).

    >>> import anygpu as ag
    >>> from anygpu.nn import functional as F
    >>> F.normalize(ag.tensor([[1.0, 1.0], [0.0, 2.0]]), p=1).tolist()
    [[0.5, 0.5], [0.0, 1.0]]
    """
    return input / _vector_norm(input, p, dim, keepdim=True).clamp(min=eps)


def _float(x: Tensor, y: Tensor) -> None:
    if not (x.dtype.is_float or y.dtype.is_float):
        raise RuntimeError(f"expected common dtype to be floating point, yet common dtype is "
                           f"{x.dtype.name}")


def cosine_similarity(x1: Tensor, x2: Tensor, dim: int = 1, eps: float = 1e-8) -> Tensor:
    """``sum(x1 / max(|x1|, eps) * x2 / max(|x2|, eps))`` over ``dim`` (the inputs broadcast).
    Each input is divided by its own norm first, as PyTorch does, which keeps the result in
    [-1, 1]; the clamp to ``eps`` does not take part in the gradient (PyTorch clamps in place
    without recording it).

    >>> import anygpu as ag
    >>> from anygpu.nn import functional as F
    >>> F.cosine_similarity(ag.tensor([[1.0, 0.0]]), ag.tensor([[1.0, 1.0]])).tolist()
    [0.7071067690849304]
    """
    _float(x1, x2)
    x1, x2 = _broadcast(x1, x2)

    def unit(x: Tensor) -> Tensor:
        norm = _vector_norm(x, 2, dim, keepdim=True)
        return x / (norm + (norm.clamp(min=eps) - norm).detach())

    return (unit(x1) * unit(x2)).sum(dim)


def pairwise_distance(x1: Tensor, x2: Tensor, p: float = 2.0, eps: float = 1e-6,
                      keepdim: bool = False) -> Tensor:
    """``norm_p(x1 - x2 + eps)`` over the last axis (the inputs broadcast).

    >>> import anygpu as ag
    >>> from anygpu.nn import functional as F
    >>> F.pairwise_distance(ag.tensor([[0.0, 0.0]]), ag.tensor([[3.0, 4.0]]), eps=0).tolist()
    [5.0]
    """
    last = max(x1.ndim, x2.ndim) - 1
    return _vector_norm(x1 - x2 + eps, p, last, keepdim)


class CosineSimilarity(Module):
    """``cosine_similarity(x1, x2, dim, eps)`` as a layer.

    >>> import anygpu as ag
    >>> CosineSimilarity(dim=1)(ag.randn(4, 8), ag.randn(4, 8)).shape
    (4,)
    """

    def __init__(self, dim: int = 1, eps: float = 1e-8) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps

    def forward(self, x1: Tensor, x2: Tensor) -> Tensor:
        return cosine_similarity(x1, x2, self.dim, self.eps)


class PairwiseDistance(Module):
    """``pairwise_distance(x1, x2, p, eps, keepdim)`` as a layer (``p`` is kept as
    ``self.norm``, PyTorch's name).

    >>> import anygpu as ag
    >>> PairwiseDistance(p=1.0)(ag.randn(4, 8), ag.randn(4, 8)).shape
    (4,)
    """

    def __init__(self, p: float = 2.0, eps: float = 1e-6, keepdim: bool = False) -> None:
        super().__init__()
        self.norm, self.eps, self.keepdim = p, eps, keepdim

    def forward(self, x1: Tensor, x2: Tensor) -> Tensor:
        return pairwise_distance(x1, x2, self.norm, self.eps, self.keepdim)


__all__ = ["normalize", "cosine_similarity", "pairwise_distance", "CosineSimilarity",
           "PairwiseDistance"]
