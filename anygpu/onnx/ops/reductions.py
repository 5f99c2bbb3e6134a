"""Reductions and the operators along an axis: ReduceX, ArgMax/ArgMin, Softmax, LogSoftmax,
Hardmax, CumSum, CumProd, TopK, LpNormalization, MeanVarianceNormalization.

ReduceX take their axes as an attribute before opset 18 (ReduceSum: 13) and as an optional
input after; without axes they reduce everything, or nothing with ``noop_with_empty_axes``
(the elementwise part, such as ReduceSumSquare's square, still applies). A reduction over an
empty axis gives the operator's identity (0, 1, -inf, the type's minimum).

>>> import numpy as np
>>> from anygpu.onnx.ops.table import Node
>>> node = Node("ReduceSum", "r", "", 13, "cpu", {"keepdims": 0}, [1, 7], [1], 1)
>>> reduce_sum(node, Tensor(np.ones((2, 3), np.float32)), np.array([1])).tolist()
[3.0, 3.0]
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from anygpu import dtype as dt
from anygpu.ops.sorting import topk
from anygpu.onnx.ops.common import axes_list, axis, const, float_of, ints, scalar
from anygpu.onnx.ops.table import Node, op
from anygpu.tensor import Tensor, arange, where

Axes = tuple[int, ...] | None


def _axes(node: Node, x: Tensor, given: np.ndarray | None) -> Axes:
    """The reduced axes: None for all, () for none (noop_with_empty_axes)."""
    if given is None or np.asarray(given).size == 0:
        return () if node.attr("noop_with_empty_axes", 0) else None
    return tuple(sorted(set(axes_list(given, x.ndim, node))))


def _out_shape(x: Tensor, axes: Axes, keep: bool) -> tuple[int, ...]:
    reduced = set(range(x.ndim)) if axes is None else set(axes)
    return tuple(1 if i in reduced else n for i, n in enumerate(x.shape) if keep or
                 i not in reduced)


def _is_empty(x: Tensor, axes: Axes) -> bool:
    reduced = range(x.ndim) if axes is None else axes
    return any(x.shape[a] == 0 for a in reduced) or (axes is None and x.numel() == 0)


def _min_of(d: dt.DType) -> Any:
    return dt.min_value(d)


def _max_of(d: dt.DType) -> Any:
    return dt.max_value(d)


def _reducer(pre: Callable[[Tensor], Tensor], core: str, post: Callable[[Tensor], Tensor],
             empty: Callable[[dt.DType], Any] | None) -> Callable[..., Tensor]:
    """A ReduceX handler: ``post(core(pre(x)))`` over the axes."""

    def run(node: Node, x: Tensor, given: np.ndarray | None = None) -> Tensor:
        if node.has("axes"):
            given = np.asarray(node.attr("axes"), dtype=np.int64)
        axes = _axes(node, x, given)
        keep = bool(node.attr("keepdims", 1))
        y = pre(x)
        if axes == ():
            return post(y)
        if _is_empty(x, axes) and empty is not None:
            return const(empty(y.dtype), _out_shape(x, axes, keep), y.dtype, x.device)
        if core == "sum":
            out = y.sum(axes, keepdim=keep)
        elif core == "mean":
            out = float_of(y).mean(axes, keepdim=keep)
        elif core == "max":
            out = y.amax(axes, keepdim=keep)
        elif core == "min":
            out = y.amin(axes, keepdim=keep)
        elif core == "prod":
            out = _prod(y, axes, keep)
        else:  # logsumexp
            out = float_of(y).logsumexp(axes if axes is not None else tuple(range(x.ndim)),
                                        keepdim=keep)
        return post(out)
    return run


def _prod(x: Tensor, axes: Axes, keep: bool) -> Tensor:
    order = tuple(range(x.ndim)) if axes is None else axes
    out = x
    for a in sorted(order, reverse=True):
        out = out.prod(a, keepdim=True)
    return out if keep else out.reshape(_out_shape(x, axes, False))


def _same(x: Tensor) -> Tensor:
    return x


_REDUCTIONS: dict[str, tuple[Callable[[Tensor], Tensor], str, Callable[[Tensor], Tensor],
                             Callable[[dt.DType], Any] | None]] = {
    "ReduceSum": (_same, "sum", _same, None),
    "ReduceMean": (_same, "mean", _same, lambda d: float("nan")),
    "ReduceMax": (_same, "max", _same, _min_of),
    "ReduceMin": (_same, "min", _same, _max_of),
    "ReduceProd": (_same, "prod", _same, lambda d: 1),
    "ReduceL1": (lambda x: x.abs(), "sum", _same, None),
    "ReduceL2": (lambda x: x * x, "sum", lambda x: float_of(x).sqrt(), None),
    "ReduceSumSquare": (lambda x: x * x, "sum", _same, None),
    "ReduceLogSum": (_same, "sum", lambda x: float_of(x).log(), None),
    "ReduceLogSumExp": (_same, "logsumexp", _same, lambda d: float("-inf")),
}

for _name, (_pre, _core, _post, _empty) in _REDUCTIONS.items():
    _handler = _reducer(_pre, _core, _post, _empty)
    _input_since = 13 if _name == "ReduceSum" else 18
    op(_name, since=1, until=_input_since - 1, attrs=("axes", "keepdims"))(_handler)
    op(_name, since=_input_since, attrs=("keepdims", "noop_with_empty_axes"), host=1)(_handler)

reduce_sum = _reducer(*_REDUCTIONS["ReduceSum"])


# ---- arg max / min ------------------------------------------------------------------------------
def _arg(node: Node, x: Tensor, largest: bool) -> Tensor:
    a = axis(node.attr("axis", 0), x.ndim, node)
    keep = bool(node.attr("keepdims", 1))
    last = bool(node.attr("select_last_index", 0))
    y = x.flip(a) if last else x
    idx = y.argmax(a, keepdim=True) if largest else y.argmin(a, keepdim=True)
    if last:
        idx = (x.shape[a] - 1) - idx
    return idx if keep else idx.squeeze(a)


@op("ArgMax", since=1, attrs=("axis", "keepdims", "select_last_index"))
def arg_max(node: Node, x: Tensor) -> Tensor:
    return _arg(node, x, True)


@op("ArgMin", since=1, attrs=("axis", "keepdims", "select_last_index"))
def arg_min(node: Node, x: Tensor) -> Tensor:
    return _arg(node, x, False)


# ---- softmax family -----------------------------------------------------------------------------
def _along_axis(node: Node, x: Tensor, fn: Callable[[Tensor, int], Tensor]) -> Tensor:
    """Before opset 13 the input is seen as 2-D (axis splits it) and the operator runs along
    the second dimension; from 13 on it runs along ``axis`` alone."""
    if node.opset < 13:
        a = axis(node.attr("axis", 1), x.ndim, node) if x.ndim else 0
        rows = math.prod(x.shape[:a])
        flat = x.reshape(rows, math.prod(x.shape[a:]))
        return fn(flat, 1).reshape(x.shape)
    return fn(x, axis(node.attr("axis", -1), x.ndim, node))


@op("Softmax", since=1, attrs=("axis",))
def softmax(node: Node, x: Tensor) -> Tensor:
    return _along_axis(node, x, lambda t, a: t.softmax(a))


@op("LogSoftmax", since=1, attrs=("axis",))
def log_softmax(node: Node, x: Tensor) -> Tensor:
    return _along_axis(node, x, lambda t, a: t.log_softmax(a))


def _hardmax(t: Tensor, a: int) -> Tensor:
    n = t.shape[a]
    first = t.argmax(a, keepdim=True)
    shape = [1] * t.ndim
    shape[a] = n
    return first.eq(arange(n, device=t.device, dtype=dt.int64).reshape(shape)).cast(t.dtype)


@op("Hardmax", since=1, attrs=("axis",))
def hardmax(node: Node, x: Tensor) -> Tensor:
    return _along_axis(node, x, _hardmax)


# ---- cumulative ---------------------------------------------------------------------------------
def _cumulative(node: Node, x: Tensor, axis_value: np.ndarray, product: bool) -> Tensor:
    a = axis(int(scalar(axis_value)), x.ndim, node)
    y = x.flip(a) if node.attr("reverse", 0) else x
    n = y.shape[a]
    if node.attr("exclusive", 0) and n:
        bounds = [(0, m) for m in y.shape]
        bounds[a] = (0, n - 1)
        pads = [0, 0] * (y.ndim - 1 - a) + [1, 0]
        y = y.shrink(bounds).pad(pads, 1 if product else 0)
    if product:
        moved = y.transpose(a, -1)
        i = arange(n, device=x.device, dtype=dt.int32)
        mask = i.reshape(n, 1).ge(i.reshape(1, n))  # out[j] multiplies x[k] for k <= j
        terms = where(mask, moved.unsqueeze(-2), const(1, (), moved.dtype, x.device))
        out = terms.prod(-1).transpose(a, -1)
    else:
        out = y.cumsum(a)
    out = out.cast(x.dtype)
    return out.flip(a) if node.attr("reverse", 0) else out


@op("CumSum", since=11, attrs=("exclusive", "reverse"), host=1)
def cum_sum(node: Node, x: Tensor, axis_value: np.ndarray) -> Tensor:
    return _cumulative(node, x, axis_value, False)


@op("CumProd", since=26, attrs=("exclusive", "reverse"), host=1)
def cum_prod(node: Node, x: Tensor, axis_value: np.ndarray) -> Tensor:
    return _cumulative(node, x, axis_value, True)


# ---- top k --------------------------------------------------------------------------------------
@op("TopK", since=10, attrs=("axis", "largest", "sorted"), host=1)
def top_k(node: Node, x: Tensor, k: np.ndarray) -> tuple[Tensor, Tensor]:
    a = axis(node.attr("axis", -1), x.ndim, node)
    count = int(ints(k)[0])
    values, indices = topk(x, count, a, largest=bool(node.attr("largest", 1)))
    return values, indices.cast(dt.int64)


@op("TopK", since=1, until=9, attrs=("axis", "k"))
def top_k_attr(node: Node, x: Tensor) -> tuple[Tensor, Tensor]:
    return top_k(node, x, np.asarray([node.attr("k")]))


# ---- normalizations along axes ------------------------------------------------------------------
@op("LpNormalization", since=1, attrs=("axis", "p"),
    check=lambda n: None if n.attr("p", 2) in (1, 2) else "p must be 1 or 2")
def lp_normalization(node: Node, x: Tensor) -> Tensor:
    a = axis(node.attr("axis", -1), x.ndim, node)
    if node.attr("p", 2) == 1:
        norm = x.abs().sum(a, keepdim=True)
    else:
        norm = (x * x).sum(a, keepdim=True).sqrt()
    return where(norm.eq(0), const(0, (), x.dtype, x.device), x / norm)


@op("MeanVarianceNormalization", since=9, attrs=("axes",))
def mean_variance_normalization(node: Node, x: Tensor) -> Tensor:
    axes = tuple(axes_list(node.attr("axes", [0, 2, 3]), x.ndim, node))
    mean = x.mean(axes, keepdim=True)
    centered = x - mean
    var = (centered * centered).mean(axes, keepdim=True)
    return centered / (var.sqrt() + 1e-9)


__all__ = ["reduce_sum"]
