"""One node of the lazy graph: a primitive op, its sources, shape, dtype and device.

A node becomes realized when a kernel writes it into a device buffer; it then drops its sources so
the graph behind it can be freed. Movement ops on constants fold away here, at build time.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Sequence

from anygpu.dtype import DType, min_value
from anygpu.ops.primitives import ELEMENTWISE, MOVEMENT, REDUCE, Op, result_dtype
from anygpu.runtime.base import Buffer

Shape = tuple[int, ...]


_FREE = frozenset({Op.CONST, Op.IOTA, Op.BUFFER}) | MOVEMENT


class Lazy:
    """``computed``: a kernel that ran fused this node into its own work without storing it
    (schedule sets it). A node built on such a node is a value used again after it was
    computed, such as a buffer updated by reassignment each step or a token list grown by
    ``cat``: fused once more, it would be recomputed, from ever more steps back. So the
    computed node is marked ``keep``: it is realized into a buffer of its own when next
    scheduled, and never fused into its consumers, as eager PyTorch would have stored it."""

    __slots__ = ("op", "srcs", "arg", "shape", "dtype", "device", "buffer", "consumers",
                 "computed", "keep", "__weakref__")

    def __init__(self, op: Op, srcs: tuple["Lazy", ...], arg: Any, shape: Shape, dtype: DType,
                 device: str):
        self.op, self.srcs, self.arg = op, srcs, arg
        self.shape, self.dtype, self.device = shape, dtype, device
        self.buffer: Buffer | None = None
        self.computed = self.keep = False
        # weak links to the nodes built on this one: an in-place write finds the pending
        # computations that must read the old values first (see pending_readers)
        self.consumers: list[weakref.ref] = []
        for s in srcs:
            if len(s.consumers) > 64:
                s.consumers = [r for r in s.consumers if r() is not None]
            s.consumers.append(weakref.ref(self))
            if s.computed and s.buffer is None and not s.keep:
                _keep(s)

    def __repr__(self) -> str:
        state = "realized" if self.buffer is not None else self.op.value
        return f"<Lazy {state} {self.shape} {self.dtype.name} {self.device}>"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def realized(self) -> bool:
        return self.buffer is not None

    def readers(self) -> list["Lazy"]:
        """The unrealized nodes alive that compute from this one: its consumers that still list
        it among their sources (the scheduler's rewrites, such as a sum split into partial
        sums, leave the old links behind)."""
        return [c for c in (r() for r in self.consumers)
                if c is not None and any(s is self for s in c.srcs)]

    def set_buffer(self, buffer: Buffer) -> None:
        self.buffer, self.op, self.srcs, self.arg = buffer, Op.BUFFER, (), None

    # ---- constructors ---------------------------------------------------------------------------
    @staticmethod
    def from_buffer(buffer: Buffer, shape: Shape, dtype: DType, device: str) -> "Lazy":
        node = Lazy(Op.BUFFER, (), None, tuple(shape), dtype, device)
        node.buffer = buffer
        return node

    @staticmethod
    def const(value: Any, shape: Shape, dtype: DType, device: str) -> "Lazy":
        if dtype.is_bool:
            value = bool(value)
        elif dtype.is_float:
            value = float(value)
        else:
            value = int(value)
        return Lazy(Op.CONST, (), value, tuple(shape), dtype, device)

    @staticmethod
    def iota(n: int, dtype: DType, device: str) -> "Lazy":
        return Lazy(Op.IOTA, (), None, (n,), dtype, device)

    def gather(self, axis: int, index: "Lazy") -> "Lazy":
        """out[o] = self[o with o[axis] replaced by index[o]] (index has the output's shape)."""
        if len(index.shape) != len(self.shape) or any(
                o > n for a, (o, n) in enumerate(zip(index.shape, self.shape)) if a != axis):
            raise ValueError(f"gather: index shape {index.shape} does not fit {self.shape} "
                             f"along axis {axis}")
        if index.dtype.is_float or index.dtype.is_bool:
            raise TypeError(f"gather: index must be an integer tensor, got {index.dtype.name}")
        if index.device != self.device:
            raise ValueError(f"gather: index on {index.device}, source on {self.device}")
        return Lazy(Op.GATHER, (self, index), axis, index.shape, self.dtype, self.device)

    def alu(self, op: Op, *others: "Lazy", arg: Any = None) -> "Lazy":
        assert op in ELEMENTWISE, op
        srcs = (self, *others)
        for s in srcs:
            if s.shape != self.shape:
                raise ValueError(f"{op.value}: shapes differ {[x.shape for x in srcs]}")
            if s.device != self.device:
                raise ValueError(f"{op.value}: operands on different devices "
                                 f"{[x.device for x in srcs]}; move them with .to()")
        dtype = result_dtype(op, [s.dtype for s in srcs], arg)
        if op is Op.CAST and dtype == self.dtype:
            return self
        return Lazy(op, srcs, arg, self.shape, dtype, self.device)

    def reduce(self, op: Op, axes: Sequence[int]) -> "Lazy":
        assert op in REDUCE, op
        axes = tuple(sorted(set(axes)))
        if not axes:
            return self
        shape = tuple(1 if i in axes else n for i, n in enumerate(self.shape))
        if any(self.shape[a] == 0 for a in axes):  # the identity (max and min check first)
            identity = {Op.SUM: 0, Op.PROD: 1, Op.RMAX: min_value(self.dtype)}[op]
            return Lazy.const(identity, shape, self.dtype, self.device)
        return Lazy(op, (self,), axes, shape, self.dtype, self.device)

    def movement(self, op: Op, arg: Any) -> "Lazy":
        assert op in MOVEMENT, op
        shape = movement_shape(self.shape, op, arg)
        if op is Op.RESHAPE or op is Op.EXPAND:
            if shape == self.shape:
                return self
        elif op is Op.PERMUTE:
            if tuple(arg) == tuple(range(len(self.shape))):
                return self
        elif op is Op.PAD:
            if all(tuple(p) == (0, 0) for p in arg):
                return self
        elif op is Op.SHRINK:
            if shape == self.shape:  # (each (lo, hi) within its axis: the whole axis)
                return self
        elif not arg:  # a flip of no axes
            return self
        if self.op is Op.CONST and op is not Op.PAD:
            return Lazy.const(self.arg, shape, self.dtype, self.device)
        if op is self.op and op in (Op.RESHAPE, Op.EXPAND) and not self.realized:
            return self.srcs[0].movement(op, arg)  # collapse chains of reshapes/expands
        return Lazy(op, (self,), tuple(arg), shape, self.dtype, self.device)

    def contiguous(self) -> "Lazy":
        return Lazy(Op.CONTIGUOUS, (self,), None, self.shape, self.dtype, self.device)

    def copy_to(self, device: str) -> "Lazy":
        return Lazy(Op.COPY, (self,), device, self.shape, self.dtype, device)


def movement_shape(shape: Shape, op: Op, arg: Any) -> Shape:
    """Check a movement op's argument against ``shape`` and return the new shape."""
    nd = len(shape)
    if op is Op.RESHAPE:
        new = tuple(map(int, arg))
        if (new and min(new) < 0) or math.prod(new) != math.prod(shape):
            raise ValueError(f"cannot reshape {shape} to {new}")
        return new
    if op is Op.PERMUTE:
        if sorted(arg) != list(range(nd)):
            raise ValueError(f"permute {tuple(arg)} is not an order of {nd} axes")
        return tuple([shape[a] for a in arg])
    if op is Op.EXPAND:
        new = tuple(map(int, arg))
        if len(new) != nd or any([o != n and o != 1 for o, n in zip(shape, new)]):
            raise ValueError(f"cannot expand {shape} to {new}")
        return new
    if op is Op.PAD:
        if len(arg) != nd or any(b < 0 or a < 0 for a, b in arg):
            raise ValueError(f"bad padding {arg} for shape {shape}")
        return tuple(n + a + b for n, (a, b) in zip(shape, arg))
    if op is Op.SHRINK:
        if len(arg) != nd or any(not 0 <= a <= b <= n for n, (a, b) in zip(shape, arg)):
            raise ValueError(f"bad shrink {arg} for shape {shape}")
        return tuple(b - a for a, b in arg)
    if op is Op.FLIP:
        if any(not 0 <= a < nd for a in arg):
            raise ValueError(f"bad flip axes {arg} for shape {shape}")
        return shape
    raise AssertionError(op)


def _keep(node: Lazy) -> None:
    """Mark the computation under ``node``'s views to be kept (see Lazy)."""
    while node.op in MOVEMENT and node.srcs and node.srcs[0].buffer is None:
        node = node.srcs[0]
    if node.op not in _FREE:
        node.keep = True


def is_boundary(node: "Lazy", root: "Lazy") -> bool:
    """Whether a kernel computing ``root`` reads ``node`` as an input rather than fusing it."""
    return node.buffer is not None or node.op is Op.COPY or (
        node is not root and (node.keep or node.op is Op.CONTIGUOUS))


def is_view_of_buffer(node: "Lazy") -> bool:
    """Whether ``node`` only re-indexes realized memory (it needs no kernel of its own)."""
    while node.op in MOVEMENT and not node.realized:
        node = node.srcs[0]
    return node.realized and node is not None


def contiguous_run(node: "Lazy") -> tuple["Lazy", int] | None:
    """(the node read, element offset) where ``node`` is a chain of shrinks and reshapes of
    realized memory (or of a node that is stored before it is read: kept, ``contiguous``, a
    copy) that reads one contiguous run of it, in order: ``data[:n][i:i + b]``, or
    ``idx[:, -k:]`` of a one-row ``idx``. A shrink keeps a run contiguous where the axes
    before the one it cuts have one element left and the axes after it are whole."""
    chain = []
    while node.op in (Op.SHRINK, Op.RESHAPE) and not node.realized:
        chain.append(node)
        node = node.srcs[0]
    # realized memory, or a node stored by a kernel of its own before any kernel reads it
    if node.op is not Op.BUFFER and (node.buffer is not None or not (
            node.keep or node.op in (Op.CONTIGUOUS, Op.COPY))):
        return None
    shape, offset = node.shape, 0
    for view in reversed(chain):
        if view.op is Op.SHRINK:
            sizes = [hi - lo for lo, hi in view.arg]
            first = next((a for a, n in enumerate(sizes) if n != 1), len(sizes))
            if any(n != full for n, full in zip(sizes[first + 1:], shape[first + 1:])):
                return None
            stride = 1
            for (lo, _), n in zip(reversed(view.arg), reversed(shape)):
                offset += lo * stride
                stride *= n
        shape = view.shape
    return node, offset


def pending_readers(target: "Lazy", exclude: "Lazy") -> list["Lazy"]:
    """The unrealized computations alive now that read ``target`` (other than ``exclude``):
    the ends of its chains of consumers, each taken back through pure views to the node that
    computes something. A consumer that no longer lists the node among its sources (``exclude``,
    cut loose from its graph once scheduled) does not count."""
    found: dict[int, Lazy] = {}
    seen: set[int] = set()
    stack = [target]
    while stack:
        node = stack.pop()
        consumers = [c for c in (r() for r in node.consumers) if c is not None and (
            c.realized or any(s is node for s in c.srcs))]
        node.consumers = [weakref.ref(c) for c in consumers]
        # a node some realized node was computed from is a leftover of that computation (held
        # by autograd records), not a value anyone is waiting for
        if not consumers and node is not target:
            end = node
            while end.op in MOVEMENT and end.srcs and not end.srcs[0].realized:
                end = end.srcs[0]
            if end.op not in MOVEMENT and end is not exclude:
                found[id(end)] = end
        for c in consumers:
            if not c.realized and id(c) not in seen:
                seen.add(id(c))
                stack.append(c)
    return list(found.values())
