"""``einsum``: Einstein summation, as composites. Repeated subscripts within an operand take its
diagonal (a view), subscripts that no other operand and not the output has are summed first,
and the operands are then contracted pairwise from left to right, each contraction lowered to
``matmul`` on permuted and reshaped views (batch subscripts, then the kept ones of each side,
then the summed ones), so that large contractions run through the GEMM templates.

>>> import anygpu as ag
>>> a = ag.tensor([[1.0, 2.0], [3.0, 4.0]])
>>> ag.einsum("ij,jk->ik", a, a).tolist(), ag.einsum("ii", a).item()
([[7.0, 10.0], [15.0, 22.0]], 5.0)
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Sequence

from anygpu import dtype as dt

if TYPE_CHECKING:
    from anygpu.tensor import Tensor

_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_NONE = ("einsum(): must specify the equation string and at least one operand, or at least one "
         "operand and its subscripts list")


def _from_sublists(args: Sequence[Any]) -> tuple[str, list[Any]]:
    """PyTorch's second form, ``einsum(op0, [0, 1], op1, [1, 2], [0, 2])``: subscripts as
    integers below 52 (and ``...``), turned into an equation."""
    def term(sub: Any) -> str:
        out = ""
        for s in sub:
            if s is Ellipsis:
                out += "..."
            elif isinstance(s, int) and 0 <= s < len(_LETTERS):
                out += _LETTERS[s]
            else:
                raise RuntimeError(f"einsum(): expected subscript to be within the range [0, 52), "
                                   f"but got {s}")
        return out
    operands = list(args[0::2])
    subs = list(args[1::2])
    output = None
    if len(subs) < len(operands):  # the last item is the output's sublist
        output = operands.pop()
    equation = ",".join(term(s) for s in subs)
    if output is not None:
        equation += "->" + term(output)
    return equation, operands


def _parse_term(text: str, start: int, what: str) -> list[str]:
    """The subscripts of one term, ``...`` kept as one item; ``start`` is where the term
    begins in the equation (for the error's index)."""
    out: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c == ".":
            if text[i:i + 3] != "...":
                if what == "output":
                    raise RuntimeError("einsum(): found '.' for output that is not part of any "
                                       "ellipsis (...)")
                raise RuntimeError(f"einsum(): found '.' for {what} that is not part of any "
                                   f"ellipsis")
            if "..." in out:
                raise RuntimeError(f"einsum(): found '.' for {what} for which an ellipsis was "
                                   f"already found")
            out.append("...")
            i += 3
            continue
        if c not in _LETTERS:
            raise RuntimeError(f"einsum(): invalid subscript given at index {start + i} in the "
                               f"equation string, subscripts must be in [a-zA-Z]")
        out.append(c)
        i += 1
    return out


def einsum(*args: Any) -> "Tensor":
    """PyTorch's ``einsum(equation, *operands)`` (operands also as one list, or PyTorch's
    sublist form): implicit and explicit output, diagonals of repeated subscripts, ``...``
    broadcasting, sums over subscripts the output lacks, any number of operands (contracted
    left to right through ``matmul``). Operands of different dtypes are promoted (PyTorch
    raises).

    >>> import anygpu as ag
    >>> x = ag.arange(6.0).reshape(2, 3)
    >>> ag.einsum("ij->ji", x).shape, ag.einsum("bi,bi->b", x, x).tolist()
    ((3, 2), [5.0, 50.0])
    >>> ag.einsum("...ij,...jk", [x.reshape(1, 2, 3), x.t()]).tolist()
    [[[5.0, 14.0], [14.0, 50.0]]]
    """
    from anygpu.tensor import Tensor

    if not args:
        raise ValueError(_NONE)
    if isinstance(args[0], str):
        equation, operands = args[0], list(args[1:])
        if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
            operands = list(operands[0])
    else:
        equation, operands = _from_sublists(args)
    if not operands:
        raise ValueError(_NONE)
    for op in operands:
        if not isinstance(op, Tensor):
            raise TypeError(f"einsum(): operands must be tensors, got {type(op).__name__}")
    arrow = equation.find("->")
    lhs = equation if arrow < 0 else equation[:arrow]
    terms: list[list[str]] = []
    start = 0
    for k, text in enumerate(lhs.split(",")):
        terms.append(_parse_term(text.replace(" ", ""), start, f"operand {k}"))
        start += len(text) + 1
    if len(terms) > len(operands):
        raise RuntimeError("einsum(): fewer operands were provided than specified in the "
                           "equation")
    if len(terms) < len(operands):
        raise RuntimeError("einsum(): more operands were provided than specified in the "
                           "equation")
    common = operands[0].dtype
    for op in operands[1:]:
        common = dt.promote(common, op.dtype)
    # each operand's subscripts, its ellipsis spelled out as "0", "1", ... aligned to the right
    ellipsis = 0
    for k, (term, op) in enumerate(zip(terms, operands)):
        named = len(term) - term.count("...")
        if "..." not in term and named != op.ndim:
            raise RuntimeError(f"einsum(): the number of subscripts in the equation ({named}) "
                               f"does not match the number of dimensions ({op.ndim}) for "
                               f"operand {k} and no ellipsis was given")
        if named > op.ndim:
            raise RuntimeError(f"einsum(): the number of subscripts in the equation ({named}) "
                               f"is more than the number of dimensions ({op.ndim}) for "
                               f"operand {k}")
        ellipsis = max(ellipsis, op.ndim - named)
    labelled: list[tuple[list[str], Tensor]] = []
    sizes: dict[str, int] = {}
    for k, (term, op) in enumerate(zip(terms, operands)):
        labels: list[str] = []
        for s in term:
            if s == "...":
                covered = op.ndim - (len(term) - 1)
                labels += [str(e) for e in range(ellipsis - covered, ellipsis)]
            else:
                labels.append(s)
        for a, (label, n) in enumerate(zip(labels, op.shape)):
            first = labels.index(label)
            if first < a and op.shape[first] != n:
                raise RuntimeError(f"einsum(): subscript {label} is repeated for operand {k} but "
                                   f"the sizes don't match, {n} != {op.shape[first]}")
            seen = sizes.get(label)
            if seen is not None and seen != n and seen != 1 and n != 1:
                if label.isdigit():
                    raise RuntimeError(f"einsum(): dimension {label} covered by ellipsis in "
                                       f"operand {k} has size {n} which does not broadcast with "
                                       f"previously seen ellipsis with size {seen} for the "
                                       f"respective dimension")
                raise RuntimeError(f"einsum(): subscript {label} has size {n} for operand {k} "
                                   f"which does not broadcast with previously seen size {seen}")
            sizes[label] = n if seen is None or seen == 1 else seen
        labelled.append((labels, op.cast(common)))
    ellipsis_labels = [str(e) for e in range(ellipsis)]
    if arrow < 0:
        counts: dict[str, int] = {}
        for term in terms:
            for s in term:
                counts[s] = counts.get(s, 0) + 1
        output = ellipsis_labels + sorted(s for s, c in counts.items() if c == 1 and s != "...")
    else:
        out_term = _parse_term(equation[arrow + 2:].replace(" ", ""), arrow + 2, "output")
        output = []
        for s in out_term:
            if s == "...":
                output += ellipsis_labels
                continue
            if s in output:
                raise RuntimeError(f"einsum(): output subscript {s} appears more than once in "
                                   f"the output")
            if not any(s in term for term in terms):
                raise RuntimeError(f"einsum(): output subscript {s} does not appear in the "
                                   f"equation for any input operand")
            output.append(s)
    return _contract(labelled, output)


def _diagonals(labels: list[str], t: "Tensor") -> tuple[list[str], "Tensor"]:
    """Repeated subscripts of one operand become one: its diagonal (a view)."""
    from anygpu.ops.composites import diagonal

    while len(set(labels)) < len(labels):
        label = next(s for s in labels if labels.count(s) > 1)
        a = labels.index(label)
        b = labels.index(label, a + 1)
        t = diagonal(t, 0, a, b)
        labels = [s for k, s in enumerate(labels) if k not in (a, b)] + [label]
    return labels, t


def _sum_out(labels: list[str], t: "Tensor", keep: set[str]) -> tuple[list[str], "Tensor"]:
    gone = [k for k, s in enumerate(labels) if s not in keep]
    if not gone:
        return labels, t
    return [s for s in labels if s in keep], t.sum(gone, dtype=t.dtype)


def _contract(operands: list[tuple[list[str], "Tensor"]], output: list[str]) -> "Tensor":
    prepared = []
    for k, (labels, t) in enumerate(operands):
        labels, t = _diagonals(labels, t)
        elsewhere = set(output).union(*(set(o[0]) for i, o in enumerate(operands) if i != k))
        prepared.append(_sum_out(labels, t, elsewhere))
    labels, result = prepared[0]
    for k in range(1, len(prepared)):
        later = set(output).union(*(set(p[0]) for p in prepared[k + 1:]))
        right_labels, right = prepared[k]
        labels, result = _pair(labels, result, right_labels, right, later)
    labels, result = _sum_out(labels, result, set(output))
    return result.permute([labels.index(s) for s in output]) if output else result


def _pair(la: list[str], a: "Tensor", lb: list[str], b: "Tensor",
          keep: set[str]) -> tuple[list[str], "Tensor"]:
    """One contraction: (batch, kept of a, summed) x (batch, summed, kept of b) as a matmul of
    the views; without summed subscripts, a broadcast product."""
    la, a = _sum_out(la, a, keep | set(lb))
    lb, b = _sum_out(lb, b, keep | set(la))
    batch = [s for s in la if s in lb and s in keep]
    summed = [s for s in la if s in lb and s not in keep]
    left = [s for s in la if s not in lb]
    right = [s for s in lb if s not in la]
    size = {**dict(zip(lb, b.shape)), **{s: n for s, n in zip(la, a.shape) if n != 1}}
    if not summed:  # an outer or elementwise product: align the subscripts and multiply
        labels = batch + left + right
        return labels, _aligned(la, a, labels) * _aligned(lb, b, labels)
    # a summed subscript of size 1 on one side broadcasts: expand it, as PyTorch's einsum does
    a = a.expand([size[s] if s in summed else n for s, n in zip(la, a.shape)])
    b = b.expand([size[s] if s in summed else n for s, n in zip(lb, b.shape)])
    a = a.permute([la.index(s) for s in batch + left + summed])
    b = b.permute([lb.index(s) for s in batch + summed + right])
    nb = len(batch)
    m = math.prod(a.shape[nb:nb + len(left)])
    k = math.prod(size[s] for s in summed)
    n = math.prod(b.shape[nb + len(summed):])
    out = a.reshape(a.shape[:nb] + (m, k)).matmul(b.reshape(b.shape[:nb] + (k, n)))
    batch_shape = out.shape[:nb]
    out = out.reshape(batch_shape + a.shape[nb:nb + len(left)] + b.shape[nb + len(summed):])
    return batch + left + right, out


def _aligned(labels: list[str], t: "Tensor", order: list[str]) -> "Tensor":
    """``t`` permuted to ``order``'s subscripts, with size-1 axes for those it lacks."""
    t = t.permute([labels.index(s) for s in order if s in labels])
    return t.reshape([t.shape[[s for s in order if s in labels].index(s)] if s in labels else 1
                      for s in order])


__all__ = ["einsum"]
