"""Sorting on the device: ``sort``, ``argsort``, ``msort``, ``topk``, ``kthvalue``, and binary
search in sorted sequences (``searchsorted``, ``bucketize``). All of it is composites.

Every sort is stable (PyTorch's ``stable=True``; with ``stable=False`` PyTorch leaves ties in any
order, so this is one of its valid answers), and NaN sorts as the largest value: last when
ascending, first when descending. The values are first turned into a (key, tie) pair that plain
``<`` orders as wanted (``_total_order``): the tie is the position plus a class for the values
that share a key (NaN with +inf), so every element is distinct. Then one of two algorithms, by a
cost model fitted to measurements (``_COSTS``, ``benchmarks/bench_sort.py``):

- ranks: rank_i = how many j sort before i (one comparison reduction over (..., n, n), no
  n x n memory), then for each rank the element that has it (a second such reduction): four
  kernels in all, n**2 comparisons per row. On GPUs this wins up to tens of thousands of
  elements per row.
- a bitonic network: the axis padded to a power of two N with elements that sort last, blocks
  of B sorted by ranks, then merged by the network's stages (the sum of m for m from
  log2(B) + 1 to log2(N): 81 for N = 65536 and B = 1024). Each stage is one elementwise kernel
  over the positions alone: element i gathers its partner's position, and both keys through
  those positions, and keeps the one its place wants. A stage's (partner mask, half) is read
  from a row of a small table on the device, so every stage runs the same compiled kernel;
  each is computed before the next is built, so two stages' buffers are alive at a time.

The host does no sorting work and reads nothing back: it only plans the stages.

>>> import anygpu as ag
>>> x = ag.tensor([3.0, float("nan"), 1.0, 3.0])
>>> v, i = ag.sort(x)
>>> v.tolist()[:3], i.tolist()
([1.0, 3.0, 3.0], [2, 0, 3, 1])
>>> ag.topk(x, 2).indices.tolist(), ag.searchsorted(ag.tensor([1, 3, 5]), 3).item()
([1, 0], 1)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from anygpu import dtype as dt
from anygpu.ops.grad import no_grad
from anygpu.ops.primitives import Op

if TYPE_CHECKING:
    from anygpu.tensor import Tensor

class ValuesIndices(NamedTuple):
    """(values, indices), as ``torch.return_types.sort`` and its kin: unpack it or read the
    fields."""

    values: "Tensor"
    indices: "Tensor"


# ---- the order -----------------------------------------------------------------------------------
def _total_order(x: "Tensor", descending: bool, size: int) -> tuple["Tensor", "Tensor"]:
    """(key, tie) along the last axis, padded to ``size``, such that plain ``<`` on the key, then
    on the tie, is the order the sort wants. Floats: NaN becomes the key that sorts last (first
    when descending) and its tie is pushed past every other value's; descending negates the key
    (integers: ``~key``, which cannot overflow). tie = position + size * class, where the class
    (0, 1; 2 for the padding) orders the values that share a key (+inf and NaN); the position
    is ``tie % size``. Every element has its own tie, so the order is total and stable."""
    from anygpu.tensor import arange

    n = x.shape[-1]
    key = x.cast(dt.uint8) if x.dtype == dt.bool_ else x
    cls: "Tensor | None" = None
    if key.dtype.is_float:
        nan = key.isnan()
        key = nan._select(key._const_like(float("-inf" if descending else "inf")),
                          -key if descending else key)
        cls = nan.logical_not() if descending else nan
    elif descending:
        key = ~key
    key = key.pad((0, size - n), value=dt.max_value(key.dtype))
    tie_dtype = _tie_dtype(size)
    pos = arange(size, device=x.device, dtype=tie_dtype).reshape((1,) * (x.ndim - 1) + (size,))
    outside = pos.ge(n).cast(tie_dtype) * 2
    classes = outside if cls is None else cls.cast(tie_dtype).pad((0, size - n)) + outside
    return key, (pos + classes * size).expand(key.shape)


def _tie_dtype(size: int) -> dt.DType:
    """Ties stay below 4 * size (classes 0 to 2, and ``topk``'s padding above them)."""
    return dt.int32 if 4 * size < 2**31 else dt.int64


def _before(key_a: "Tensor", tie_a: "Tensor", key_b: "Tensor", tie_b: "Tensor") -> "Tensor":
    """1 where element a sorts before element b, else 0 (int32; see ``_total_order``): as
    arithmetic on 0/1 rather than && and ||, which C compilers do not vectorize (the rank sort
    ran 11x faster so on the cpu backend)."""
    def bit(t: "Tensor") -> "Tensor":
        return t.cast(dt.int32)
    return bit(key_a.lt(key_b)) + bit(key_a.eq(key_b)) * bit(tie_a.lt(tie_b))


# ---- ranks: short axes, and the blocks the network starts from ----------------------------------
def _rank_sort(key: "Tensor", tie: "Tensor", count: int | None = None) -> "Tensor":
    """The positions (int32) of the elements in sorted order along the last axis (of the first
    ``count`` of them): rank_i = how many j sort before i (one comparison reduction), then for
    each rank r the position of the element with rank r (a one-hot reduction)."""
    from anygpu.tensor import arange

    n = key.shape[-1]
    count = n if count is None else count
    # earlier[..., i, j]: element j sorts before element i
    earlier = _before(key.unsqueeze(-2), tie.unsqueeze(-2), key.unsqueeze(-1), tie.unsqueeze(-1))
    rank = earlier._reduce(Op.SUM, (earlier.ndim - 1,))  # (..., n, 1)
    ranks = arange(count, device=key.device, dtype=dt.int32).reshape(count, 1)
    holder = rank.reshape(key.shape).unsqueeze(-2).eq(ranks)  # [..., r, i]: i has rank r
    picked = holder._select(arange(n, device=key.device, dtype=dt.int32).reshape(1, n), 0)
    return picked._reduce(Op.SUM, (picked.ndim - 1,)).reshape(key.shape[:-1] + (count,))


# ---- the bitonic network -------------------------------------------------------------------------
_tables: dict[tuple[str, int, int], "Tensor"] = {}


def _stages(size: int, block: int) -> list[tuple[int, int]]:
    """The compare-exchange stages that merge sorted blocks of ``block`` elements into one
    sorted run of ``size`` (powers of two), as (mask, half): element i meets i ^ mask, and the
    one at the lower position of the two (i & half == 0) keeps the element that sorts first.
    Each merge of two runs of k/2 starts with a stage that compares mirrored positions
    (mask k - 1: the second run read backwards, which makes the pair one bitonic sequence),
    then halves (mask j = k/4, ..., 1). So every run stays ascending."""
    out = []
    k = 2 * block
    while k <= size:
        out.append((k - 1, k // 2))
        j = k // 4
        while j >= 1:
            out.append((j, j))
            j //= 2
        k *= 2
    return out


def _stage_table(device: str, size: int, block: int) -> "Tensor":
    """The stages' (mask, half) as rows of a table on the device, each row as wide as the
    device's sub-buffer alignment: a kernel reads its row as a buffer of its own
    (``schedule.row_slice``), so its source does not depend on which row it reads and every
    stage runs the one compiled kernel."""
    from anygpu.runtime.registry import get_device
    from anygpu.tensor import Tensor

    key = (device, size, block)
    if key not in _tables:
        width = max(get_device(device).sub_buffer_align // 4, 2)
        table = np.zeros((len(_stages(size, block)), width), np.int32)
        table[:, :2] = _stages(size, block)
        _tables[key] = Tensor(table, device=device).realize()
    return _tables[key]


def _exchange(key: "Tensor", tie: "Tensor", mask: "Tensor", half: "Tensor") -> "Tensor":
    """One compare-exchange stage over ``tie`` (..., N), the elements in their current order,
    whose keys it gathers from ``key`` (in the original order) through their positions."""
    from anygpu.tensor import arange

    size = tie.shape[-1]
    pos = arange(size, device=tie.device, dtype=dt.int32).reshape((1,) * (tie.ndim - 1) + (size,))
    other = tie.gather(-1, (pos ^ mask).expand(tie.shape))
    other_first = _before(key.gather(-1, other % size), other, key.gather(-1, tie % size), tie)
    # the lower position takes the first of the two, the upper one the other
    take = (pos & half).eq(0).eq(other_first.eq(1))
    return take._select(other, tie)


def _network_sort(key: "Tensor", tie: "Tensor", block: int) -> "Tensor":
    """The ties in sorted order along the last axis (a power of two): blocks of ``block``
    sorted by ranks, then merged by the bitonic network, one kernel per stage."""
    from anygpu.tensor import realize

    size = key.shape[-1]
    blocks = key.shape[:-1] + (size // block, block)
    local = _rank_sort(key.reshape(blocks), tie.reshape(blocks))
    tie = tie.reshape(blocks).gather(-1, local).reshape(key.shape).contiguous()
    realize(tie)
    table = _stage_table(key.device, size, block)
    one = (1,) * key.ndim
    for r in range(table.shape[0]):
        row = table.shrink(((r, r + 1), (0, table.shape[1])))
        mask = row.shrink(((0, 1), (0, 1))).reshape(one)
        half = row.shrink(((0, 1), (1, 2))).reshape(one)
        tie = _exchange(key, tie, mask, half).contiguous()
        realize(tie)  # stage by stage: two stages' buffers alive at a time, not all of them
    return tie


# What the choice of algorithm weighs, in ns: a pair of elements compared by the rank sort, an
# element of a network stage (gathers and a compare), and the host's work for each kernel
# (building, scheduling and launching it), measured with benchmarks/bench_sort.py. cpu: the cpu
# backend on one thread of a 2-core machine (sorting 64x1000: ranks 14 ms, the network from
# blocks of 64 26 ms; 1x50000: ranks 536 ms, blocks of 1024 61 ms, of 64 75 ms). GPUs: an H100
# through cuda, where comparisons cost next to nothing and every kernel costs the host about
# 0.7 ms (1x50000: ranks 4.5 ms, blocks of 8192 39 ms, of 64 96 ms; 1x1000000: blocks of
# 8192 67 ms, of 512 98 ms).
_COSTS = {"cpu": (0.1, 2.5, 400_000.0), "gpu": (0.002, 0.01, 700_000.0)}


def _block_size(rows: int, n: int, device: str = "cpu") -> int:
    """The sorted blocks the network starts from: the cheapest by the costs above, or ``n``
    where ranks over the whole axis are cheapest."""
    rank_ns, stage_ns, kernel_ns = _COSTS["cpu" if device.startswith("cpu") else "gpu"]
    size = 1 << (n - 1).bit_length()

    def cost(block: int) -> float:
        if block >= n:
            return rows * n * n * rank_ns + 4 * kernel_ns
        stages = len(_stages(size, block))
        return (rows * size * block * rank_ns + (stages + 4) * kernel_ns
                + stages * rows * size * stage_ns)
    return min([n] + [1 << b for b in range(1, size.bit_length() - 1)], key=cost)


def _argsort_last(x: "Tensor", descending: bool) -> "Tensor":
    """Positions in sorted order (int32, or int64 past 2**29 elements) along the last axis of
    ``x`` (length >= 2)."""
    n = x.shape[-1]
    rows = x.numel() // n
    block = _block_size(rows, n, x.device)
    size = n if block >= n else 1 << (n - 1).bit_length()
    # stored first: the rank sort's inner loop then only loads and compares (and vectorizes)
    key, tie = (t.contiguous() for t in _total_order(x, descending, size))
    if block >= n:
        return _rank_sort(key, tie)
    order = _network_sort(key, tie, block) % size
    return order.shrink([(0, m) for m in order.shape[:-1]] + [(0, n)])


# topk's blocks: each keeps its first k of at least this many, until ranks over what is left
# are cheapest
_TOP_BLOCK = 256


def _top_block(k: int) -> int:
    return max(_TOP_BLOCK, 1 << (4 * k - 1).bit_length())


def _top_sorts_all(rows: int, n: int, k: int, device: str) -> bool:
    """Whether ``topk`` sorts the whole axis: where ranks over it are not the cheapest and k
    is too large a share of it for blocks that keep their first k to shrink it."""
    return _block_size(rows, n, device) < n and 2 * _top_block(k) > n


def _top_positions(x: "Tensor", k: int, largest: bool) -> "Tensor":
    """Positions (int32 or int64) of the first ``k`` (k >= 1) of the sorted order along the
    last axis, without sorting it all: ranks over the whole axis where that is cheapest, else
    blocks ranked, each keeping its first k, and the same again over the survivors until ranks
    over the remainder are cheapest (four kernels a round)."""
    from anygpu.tensor import arange

    n = x.shape[-1]
    rows = x.numel() // n
    block = _top_block(k)
    key, tie = (t.contiguous() for t in _total_order(x, largest, n))
    lead = key.shape[:-1]
    while True:
        m = key.shape[-1]
        if m <= block or _block_size(rows, m, x.device) >= m:
            return tie.gather(-1, _rank_sort(key, tie, k)) % n
        # padding that sorts after everything (the largest key, ties past all the others'):
        # the first k of the axis are real elements and survive every round
        extra = -m % block
        if extra:
            key = key.pad((0, extra), value=dt.max_value(key.dtype))
            tail = arange(extra, device=x.device, dtype=tie.dtype) + 3 * n
            tie = tie.pad((0, extra)) + tail.pad((m, 0))
        blocks = lead + (key.shape[-1] // block, block)
        kb, tb = key.reshape(blocks), tie.reshape(blocks)
        local = _rank_sort(kb, tb, k)
        key = kb.gather(-1, local).reshape(lead + (-1,)).contiguous()
        tie = tb.gather(-1, local).reshape(lead + (-1,)).contiguous()


def _inverse_permutation(index: "Tensor", axis: int) -> "Tensor":
    """inv with inv[index[r]] = r along ``axis`` (``index`` a permutation along it)."""
    last = index.transpose(axis, -1)
    return _argsort_last(last.cast(dt.int32), False).cast(dt.int64).transpose(axis, -1)


def unsort(g: "Tensor", axis: int, index: "Tensor") -> "Tensor":
    """``g`` (shaped like the sorted values) put back at the positions ``index`` took them
    from: the gradient of ``sort``. A permutation's inverse is a sort of its positions, so for
    long axes this is a gather, not a one-hot scatter of n**2 terms."""
    from anygpu.tensor import zeros

    n = g.shape[axis] if g.ndim else 1
    if g.ndim == 0 or _block_size(g.numel() // max(n, 1), n, g.device) >= n:
        return zeros(g.shape, dtype=g.dtype, device=g.device).scatter_add(axis, index, g)
    return g.gather(axis, _inverse_permutation(index, axis))


# ---- the public functions -----------------------------------------------------------------------
def sort(x: "Tensor", dim: int = -1, descending: bool = False, stable: bool = False,
         ) -> ValuesIndices:
    """PyTorch's ``sort``: (values, indices) along ``dim``, stable whatever ``stable`` says,
    NaN as the largest value; the gradient goes back to the positions ``indices`` name.

    >>> import anygpu as ag
    >>> ag.tensor([[2, 1, 2], [0, 5, 4]]).sort(dim=1, descending=True).indices.tolist()
    [[0, 2, 1], [1, 2, 0]]
    """
    from anygpu.tensor import _axis, full, zeros

    if x.ndim == 0:
        _axis(dim, 0)
        return ValuesIndices(x.contiguous(), full((), 0, dt.int64, x.device))
    axis = _axis(dim, x.ndim)
    n = x.shape[axis]
    if n <= 1 or x.numel() == 0:
        return ValuesIndices(x.contiguous(), zeros(x.shape, dtype=dt.int64, device=x.device))
    with no_grad():
        last = x.detach().transpose(axis, -1)
        index = _argsort_last(last, descending)
        ordered = last.gather(-1, index).transpose(axis, -1)
        indices = index.cast(dt.int64).transpose(axis, -1)
    values = x._custom("sort", (), (axis, indices), lambda: ordered)
    return ValuesIndices(values, indices)


def argsort(x: "Tensor", dim: int = -1, descending: bool = False,
            stable: bool = False) -> "Tensor":
    """The indices ``sort`` returns (int64).

    >>> import anygpu as ag
    >>> ag.tensor([3.0, 1.0, 2.0]).argsort().tolist()
    [1, 2, 0]
    """
    return sort(x, dim, descending, stable).indices


def msort(x: "Tensor") -> "Tensor":
    """The values of ``sort`` along the first dimension.

    >>> import anygpu as ag
    >>> ag.msort(ag.tensor([[2.0, 0.0], [1.0, 3.0]])).tolist()
    [[1.0, 0.0], [2.0, 3.0]]
    """
    return sort(x, 0).values


def _narrow(t: "Tensor", axis: int, start: int, length: int) -> "Tensor":
    bounds = [(0, m) for m in t.shape]
    bounds[axis] = (start, start + length)
    return t.shrink(bounds)


def topk(x: "Tensor", k: int, dim: int = -1, largest: bool = True,
         sorted: bool = True) -> ValuesIndices:
    """The ``k`` largest (or smallest) elements along ``dim`` and their indices, in sorted order
    (also with ``sorted=False``); among equal values the first index comes first.

    >>> import anygpu as ag
    >>> ag.tensor([1.0, 5.0, 3.0, 5.0]).topk(2)
    ValuesIndices(values=tensor([5., 5.]), indices=tensor([1, 3]))
    """
    from anygpu.tensor import _axis

    n = x.shape[_axis(dim, x.ndim)] if x.ndim else 1
    if not 0 <= k <= n:
        raise RuntimeError(f"selected index k out of range (k={k}, size {n})")
    if x.ndim == 0:
        return sort(x, dim)
    axis = _axis(dim, x.ndim)
    if k == 0 or n == 1 or _top_sorts_all(x.numel() // n, n, k, x.device):
        values, indices = sort(x, axis, descending=largest)
        return ValuesIndices(_narrow(values, axis, 0, k), _narrow(indices, axis, 0, k))
    with no_grad():
        last = x.detach().transpose(axis, -1)
        indices = _top_positions(last, k, largest).cast(dt.int64).transpose(axis, -1)
    return ValuesIndices(x.gather(axis, indices), indices)  # gather's gradient: to the indices


def kthvalue(x: "Tensor", k: int, dim: int = -1, keepdim: bool = False) -> ValuesIndices:
    """The ``k``-th smallest element along ``dim`` (k counts from 1) and its index.

    >>> import anygpu as ag
    >>> ag.tensor([4.0, 1.0, 3.0]).kthvalue(2).values.item()
    3.0
    """
    from anygpu.tensor import _axis

    n = x.shape[_axis(dim, x.ndim)] if x.ndim else 1
    if n == 0:
        raise IndexError(f"kthvalue(): Expected reduction dim {dim} to have non-zero size.")
    if not 1 <= k <= n:
        raise RuntimeError(f"kthvalue(): selected number k out of range for dimension {dim} "
                           f"(k={k}, size {n})")
    values, indices = topk(x, k, dim, largest=False)
    if x.ndim == 0:
        return ValuesIndices(values, indices)
    axis = _axis(dim, x.ndim)
    values, indices = _narrow(values, axis, k - 1, 1), _narrow(indices, axis, k - 1, 1)
    if not keepdim:
        values, indices = values.squeeze(axis), indices.squeeze(axis)
    return ValuesIndices(values, indices)


# ---- binary search -------------------------------------------------------------------------------
def searchsorted(sorted_sequence: "Tensor", input: Any, *, out_int32: bool = False,
                 right: bool = False, side: str | None = None,
                 sorter: "Tensor | None" = None) -> "Tensor":
    """PyTorch's ``searchsorted``: for each value, the index where it would be inserted into
    the innermost dimension of ``sorted_sequence`` to keep it sorted (the first such index, or
    the last with ``right=True`` / ``side="right"``). A binary search in one kernel: each of its
    ceil(log2(n + 1)) steps is a gather, with the same probes as PyTorch's, so even NaN and
    unsorted input give PyTorch's answer.

    >>> import anygpu as ag
    >>> seq = ag.tensor([1.0, 3.0, 5.0, 7.0])
    >>> ag.searchsorted(seq, ag.tensor([3.0, 6.0, 9.0])).tolist()
    [1, 3, 4]
    >>> ag.searchsorted(seq, ag.tensor([3.0]), right=True).tolist()
    [2]
    """
    from anygpu.tensor import Tensor, _as_tensor, full, zeros

    seq = sorted_sequence
    if side is not None:
        if side not in ("left", "right"):
            raise RuntimeError(f"torch.searchsorted(): side can only be 'left' or 'right' but "
                               f"got {side}")
        if right and side == "left":
            raise RuntimeError("torch.searchsorted(): side and right can't be set to "
                               "opposites, got side of left while right was True")
        right = side == "right"
    scalar = not isinstance(input, Tensor)
    values = _as_tensor(input, seq) if scalar else input
    if seq.ndim == 0:
        raise RuntimeError("torch.searchsorted(): boundaries tensor should have positive "
                           "dimension, but got 0 dimension")
    if seq.ndim > 1 and (scalar or seq.shape[:-1] != values.shape[:-1]):
        raise RuntimeError(f"torch.searchsorted(): boundaries tensor should be 1 dimension or "
                           f"the first N-1 dimensions of boundaries tensor and input value "
                           f"tensor must match, but we got boundaries tensor {list(seq.shape)} "
                           f"and input value tensor {list(values.shape)}")
    if sorter is not None and sorter.shape != seq.shape:
        raise RuntimeError(f"torch.searchsorted(): boundary and sorter must have the same size, "
                           f"but got boundary tensor {list(seq.shape)} and got sorter tensor "
                           f"{list(sorter.shape)}")
    out_dtype = dt.int32 if out_int32 else dt.int64
    if values.dtype != seq.dtype:
        common = dt.promote(values.dtype, seq.dtype)
        values, seq = values.cast(common), seq.cast(common)
    shape = values.shape
    if seq.ndim == 1:
        values = values.reshape(-1)
    n = seq.shape[-1]
    if values.numel() == 0 or n == 0:
        return zeros(shape, dtype=out_dtype, device=seq.device)
    axis = seq.ndim - 1
    start = zeros(values.shape, dtype=dt.int32, device=seq.device)
    end = full(values.shape, n, dt.int32, seq.device)
    with no_grad():
        seq, values = seq.detach(), values.detach()
        for _ in range(n.bit_length()):  # the range halves each step: bit_length(n) steps
            active = start.lt(end)
            mid = start + ((end - start) >> 1)
            probe = sorter.gather(axis, mid) if sorter is not None else mid
            at = seq.gather(axis, probe.cast(dt.int32) if sorter is not None else probe)
            # PyTorch's: left goes right while !(at >= value), right while !(at > value)
            stop = at.gt(values) if right else at.ge(values)
            go_right = stop.logical_not()
            start = active.logical_and(go_right)._select(mid + 1, start)
            end = active.logical_and(stop)._select(mid, end)
    return start.cast(out_dtype).reshape(shape)


def bucketize(input: Any, boundaries: "Tensor", *, out_int32: bool = False,
              right: bool = False) -> "Tensor":
    """The bucket of each value among 1-D ``boundaries``: ``searchsorted(boundaries, input,
    right=right)``.

    >>> import anygpu as ag
    >>> ag.bucketize(ag.tensor([0.5, 2.0, 9.0]), ag.tensor([1.0, 2.0, 3.0])).tolist()
    [0, 1, 3]
    """
    if boundaries.ndim != 1:
        raise RuntimeError(f"torch.bucketize(): boundaries tensor must be 1 dimension, but got "
                           f"dim({boundaries.ndim})")
    return searchsorted(boundaries, input, out_int32=out_int32, right=right)


def methods() -> dict[str, Any]:
    """The methods this module adds to ``Tensor``."""
    return {"sort": sort, "argsort": argsort, "msort": msort, "topk": topk,
            "kthvalue": kthvalue}


__all__ = ["ValuesIndices", "sort", "argsort", "msort", "topk", "kthvalue", "searchsorted",
           "bucketize", "unsort", "methods"]

