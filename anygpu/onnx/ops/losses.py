"""Losses: NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss, with class weights,
``ignore_index`` and the reductions "none", "sum" and "mean" (a weighted mean: the sum divided
by the total weight of the targets not ignored).

>>> import numpy as np
>>> from anygpu.onnx.ops.table import Node
>>> node = Node("NegativeLogLikelihoodLoss", "l", "", 13, "cpu", {"reduction": "sum"},
...             [1, 7], [1], 1)
>>> x = Tensor(np.log(np.array([[0.5, 0.5], [0.25, 0.75]], np.float32)))
>>> round(nll_loss(node, x, Tensor(np.array([0, 1]))).item(), 4)
0.9808
"""

from __future__ import annotations

from anygpu import dtype as dt
from anygpu.onnx.ops.common import const
from anygpu.onnx.ops.table import Node, op
from anygpu.tensor import Tensor, where

_REDUCTIONS = ("none", "sum", "mean")


def _check(node: Node) -> str | None:
    r = node.attr("reduction", "mean")
    return None if r in _REDUCTIONS else f"reduction {r!r} is not supported"


def nll(node: Node, log_prob: Tensor, target: Tensor, weight: Tensor | None) -> Tensor:
    """The negative log-likelihood of ``target`` classes under (N, C, d...) log-probabilities."""
    c = log_prob.shape[1]
    target = target.cast(dt.int64)
    ignore = node.attr("ignore_index", None)
    keep = target.ge(0).logical_and(target.lt(c))
    if ignore is not None:
        keep = keep.logical_and(target.ne(ignore))
    safe = where(keep, target, const(0, (), dt.int64, target.device))
    picked = log_prob.gather(1, safe.unsqueeze(1)).squeeze(1)
    zero = const(0, (), log_prob.dtype, log_prob.device)
    if weight is not None:
        w = where(keep, weight.index_select(0, safe.reshape(-1)).reshape(safe.shape), zero)
    else:
        w = where(keep, const(1, (), log_prob.dtype, log_prob.device), zero)
    loss = where(keep, -picked * w, zero)
    reduction = node.attr("reduction", "mean")
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / w.sum()


@op("NegativeLogLikelihoodLoss", since=12, attrs=("ignore_index", "reduction"), check=_check)
def nll_loss(node: Node, x: Tensor, target: Tensor, weight: Tensor | None = None) -> Tensor:
    return nll(node, x, target, weight).cast(x.dtype)


@op("SoftmaxCrossEntropyLoss", since=12, attrs=("ignore_index", "reduction"), check=_check)
def softmax_cross_entropy_loss(node: Node, scores: Tensor, labels: Tensor,
                               weight: Tensor | None = None) -> tuple[Tensor, Tensor]:
    log_prob = scores.cast(dt.float32).log_softmax(1) if not scores.dtype.is_float else \
        scores.log_softmax(1)
    return nll(node, log_prob, labels, weight).cast(scores.dtype), log_prob.cast(scores.dtype)


__all__ = ["nll"]
