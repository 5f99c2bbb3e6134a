"""Schedules kept by the structure of the graph they realize, so that a repeated step reuses them.

A training loop without ``jit`` builds the same graph every step, and ``schedule`` planned each of
its kernels anew: fusion choices, window rewrites, stored operands, the key of each kernel's
lowering (about 100 us of host time per kernel). ``walk`` reads the graph to realize once, down
to realized memory, into a key: each node's op, shape, dtype, argument, device, ``keep`` mark and
sources (by position), each realized node by its shape, dtype and which other leaves share its
buffer. A key seen before gives back the schedule made for it (``Plan``): its kernels (lowered
templates without graph nodes, the nodes they read and write by position), the nodes the
scheduler made (partial sums, unfolded windows) and the changes it made to the graph (ops
and sources rewritten, nodes marked ``keep``), which ``replay`` applies to the new graph as
the scheduler would have. Everything the scheduler decides from is in the key, except how many other
computations hold a node (``Lazy.consumers``, which only sways where a kernel stores an
operand): a replayed plan computes the same values either way.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Sequence

from anygpu.dtype import DType
from anygpu.graph.lazy import Lazy
from anygpu.ops.primitives import Op

# Plans kept at most, counted by the graph nodes their keys describe (about 170 bytes each): a
# training step of ResNet-18 makes about 180 plans over 6,500 nodes. The oldest go first.
MAX_NODES = 1 << 18


@dataclass
class Walk:
    """The graph under some outputs: its nodes in the key's order and the key."""

    nodes: list[Lazy]
    index: dict[int, int]  # id(node) -> position
    parts: list[tuple]  # each node's part of the key
    key: tuple


@dataclass
class Step:
    """One kernel or copy of a plan. A reference ``r`` is the walk's node ``r`` (``r >= 0``)
    or the plan's new node ``~r``."""

    output: int
    inputs: tuple[int, ...]
    fused: tuple[int, ...]
    ast: Any  # the kernel's lowering template (no graph nodes); None for a copy
    signature: tuple
    sid: int | None = None  # the signature's number (schedule.signature_id), once looked up


@dataclass
class Plan:
    # new nodes, sources first: (op, source refs, arg, shape, dtype, device, keep)
    made: list[tuple]
    rewired: list[tuple[int, Op, tuple[int, ...], Any]]  # (node, its new op, sources, arg)
    kept: tuple[int, ...]  # walked nodes the scheduler marked keep
    steps: list[Step]


_plans: dict[tuple, Plan] = {}
_kept_nodes = 0
# The nodes' parts of the key hold plain values only (ints, strings, tuples of them): hashed in
# C, and left alone by Python's garbage collector once it has seen them (ops and dtypes are
# objects it tracks). The settings (a frozen dataclass) are the one object in a key.
_CODES = {op: i for i, op in enumerate(Op)}


def walk(outputs: Sequence[Lazy], context: tuple) -> Walk:
    """The structure of the unrealized graph under ``outputs`` (``context``: the settings the
    scheduler reads, part of the key)."""
    nodes: list[Lazy] = []
    index: dict[int, int] = {}
    parts: list[tuple] = []
    buffers: dict[int, int] = {}
    codes = _CODES

    def visit(node: Lazy) -> int:
        at = index.get(id(node))
        if at is not None:
            return at
        if node.buffer is not None:
            part: tuple = (node.shape, node.dtype.name, node.device,
                           buffers.setdefault(id(node.buffer), len(nodes)))
        else:
            srcs, arg = node.srcs, node.arg
            part = (codes[node.op], node.shape, node.dtype.name,
                    arg if arg.__class__ in _PLAIN else key_arg(arg), node.device, node.keep,
                    (visit(srcs[0]),) if len(srcs) == 1 else tuple([visit(s) for s in srcs]))
        at = index[id(node)] = len(nodes)
        nodes.append(node)
        parts.append(part)
        return at

    try:
        heads = tuple([visit(out) for out in outputs])
    finally:
        visit = None  # type: ignore[assignment]  # break the closure's cycle: the nodes die now
    return Walk(nodes, index, parts, (context, heads, tuple(parts)))


_PLAIN = frozenset({type(None), tuple, int, str})


def key_arg(arg: Any) -> Any:
    """An op's argument as a key holds it: numbers other than ints and bools by their type and
    text (NaN, the sign of zero), a dtype by its name."""
    if arg.__class__ in _PLAIN:
        return arg
    if isinstance(arg, DType):
        return arg.name
    # a float or a NumPy scalar (-0.0 == 0.0 as numbers): its type and text
    return arg if type(arg) is bool else (type(arg).__name__, repr(arg))


def find(w: Walk) -> Plan | None:
    try:
        return _plans.get(w.key)
    except TypeError:  # an argument that cannot be hashed: not kept
        return None


class _Unplanned(Exception):
    """The schedule reaches memory the walk did not see: it is not kept."""


def store(w: Walk, items: list[tuple[Lazy, Sequence[Lazy], Sequence[Lazy], Any, tuple]]) -> None:
    """Keep the schedule made for ``w``'s graph: ``items`` (output, inputs, fused nodes, template,
    signature) in order, after the scheduler changed the graph as it does."""
    made: list[tuple] = []
    new: dict[int, int] = {}

    def ref(node: Lazy) -> int:
        at = w.index.get(id(node))
        if at is not None:
            return at
        at = new.get(id(node))
        if at is None:
            if node.buffer is not None:
                raise _Unplanned
            srcs = tuple(ref(s) for s in node.srcs)
            made.append((node.op, srcs, node.arg, node.shape, node.dtype, node.device,
                         node.keep))
            at = new[id(node)] = len(made) - 1
        return ~at

    try:
        steps = [Step(ref(out), tuple(ref(i) for i in inputs), tuple(ref(f) for f in fused),
                      template, signature)
                 for out, inputs, fused, template, signature in items]
        rewired, kept = [], []
        for at, (node, part) in enumerate(zip(w.nodes, w.parts)):
            if len(part) == 4:  # realized
                continue
            srcs = tuple(ref(s) for s in node.srcs)
            # rewritten by the scheduler
            if srcs != part[6] or key_arg(node.arg) != part[3] or _CODES[node.op] != part[0]:
                rewired.append((at, node.op, srcs, node.arg))
            if node.keep and not part[5]:
                kept.append(at)
    except _Unplanned:
        return
    finally:
        ref = None  # type: ignore[assignment]  # break the closure's cycle
    global _kept_nodes
    try:
        _plans[w.key] = Plan(made, rewired, tuple(kept), steps)
    except TypeError:
        return
    _kept_nodes += len(w.nodes)
    while _kept_nodes > MAX_NODES and len(_plans) > 1:
        oldest = next(iter(_plans))
        _kept_nodes -= len(oldest[2])
        del _plans[oldest]


def replay(plan: Plan, w: Walk) -> list[tuple[Step, Lazy, list[Lazy], list[Lazy]]]:
    """Apply ``plan`` to ``w``'s graph (its new nodes, rewired sources and keep marks) and give
    each step with its nodes: (step, output, inputs, fused)."""
    nodes = w.nodes
    made: list[Lazy] = []
    for op, srcs, arg, shape, dtype, device, keep in plan.made:
        node = Lazy(op, tuple(nodes[s] if s >= 0 else made[~s] for s in srcs), arg, shape,
                    dtype, device)
        node.keep = keep
        made.append(node)
    for at, op, srcs, arg in plan.rewired:
        node = nodes[at]
        new = tuple(nodes[s] if s >= 0 else made[~s] for s in srcs)
        for s in new:
            if not any(s is old for old in node.srcs):
                s.consumers.append(weakref.ref(node))
        node.op, node.srcs, node.arg = op, new, arg
    for at in plan.kept:
        nodes[at].keep = True
    return [(step, nodes[step.output] if step.output >= 0 else made[~step.output],
             [nodes[r] if r >= 0 else made[~r] for r in step.inputs],
             [nodes[r] if r >= 0 else made[~r] for r in step.fused])
            for step in plan.steps]


def clear() -> None:
    global _kept_nodes
    _plans.clear()
    _kept_nodes = 0
