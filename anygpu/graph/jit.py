"""Capture a function's kernel launches once per input signature and replay them.

The first call of a signature runs normally (kernels compile, optimizer state appears); the second
runs while recording every launch and device copy; later calls replay the recording with the new
inputs' buffers: no graph building, scheduling or allocation. Buffers that only live inside the
step are planned by lifetime and share memory. On ``cuda`` the replay is one CUDA graph.

Like CUDA graphs, a replay returns its outputs in the same buffers every time, and values computed
in Python inside the function (constants, shapes, host data turned into tensors) are frozen at
capture; random numbers keep advancing because the generator's position lives on the device.

>>> import anygpu as ag
>>> @ag.jit
... def step(x):
...     return (x * 2 + 1).sum()
>>> [round(step(ag.tensor([1.0, 2.0]) * k).item(), 1) for k in (1, 2, 3)]
[8.0, 14.0, 20.0]
"""

from __future__ import annotations

import bisect
import functools
import gc
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable

from anygpu.graph import schedule as sched
from anygpu.graph.lazy import Lazy
from anygpu.runtime import base
from anygpu.runtime.base import Buffer, Device, SubBuffer
from anygpu.runtime.registry import get_device

MAX_SIGNATURES = 8  # recaptures past this warn: the function is seeing ever-changing shapes


def _tensors(x: Any) -> list[Any]:
    from anygpu.tensor import Tensor

    if isinstance(x, Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


def _map_tensors(x: Any, fn: Callable[[Any], Any]) -> Any:
    from anygpu.tensor import Tensor

    if isinstance(x, Tensor):
        return fn(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_map_tensors(v, fn) for v in x)
    if isinstance(x, dict):
        return {k: _map_tensors(v, fn) for k, v in x.items()}
    return x


def _owning(t: Any) -> Any:
    """``t`` realized into a buffer of its own (a view of other memory is copied)."""
    t.realize()
    return t if t.lazy.buffer is not None else t.contiguous().realize()


def _signature(args: tuple, kwargs: dict) -> tuple:
    parts = []
    for t in _tensors((args, kwargs)):
        parts.append((t.shape, t.dtype, t.device))
    others = [repr(a) for a in args if not _tensors(a)] + \
        [f"{k}={v!r}" for k, v in sorted(kwargs.items()) if not _tensors(v)]
    return tuple(parts) + tuple(others)


@dataclass
class Captured:
    steps: list[Any]  # Launch / DeviceCopy / TransferCopy objects, in order
    input_slots: list[list[tuple[int, int]]]  # per input: (step, buffer position) it appears at
    outputs: Any  # the function's return value with tensors replaced by (index into out_bufs)
    out_bufs: list[tuple[Buffer, tuple[int, ...], Any, str]]
    graph: Any = None  # a device graph (CUDA) replaying all steps
    input_bufs: list[Buffer] | None = None  # the captured inputs (graph replays copy into them)


class JitFunction:
    def __init__(self, fn: Callable[..., Any], keep: int | None = None):
        self.fn = fn
        # at most this many captured signatures, the least recently used dropped quietly (a
        # function that expects a few shapes in turn); None: MAX_SIGNATURES, with a warning
        self.keep = keep
        self.captured: dict[tuple, Captured | None] = {}
        self.calls: dict[tuple, int] = {}
        functools.update_wrapper(self, fn)

    def reset(self) -> None:
        self.captured.clear()
        self.calls.clear()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = _signature(args, kwargs)
        # each input gets memory of its own: a replay substitutes whole buffers
        args, kwargs = _map_tensors((args, kwargs), _owning)
        inputs = _tensors((args, kwargs))
        captured = self.captured.get(key)
        if captured is not None:
            if self.keep is not None:  # the most recently used last
                self.captured[key] = self.captured.pop(key)
            return self._replay(captured, inputs)
        n = self.calls.get(key, 0)
        self.calls[key] = n + 1
        if n == 0:
            out = self.fn(*args, **kwargs)
            _realize_all(out)
            return out
        if self.keep is not None and len(self.captured) >= self.keep:
            self.captured.pop(next(iter(self.captured)))
        elif len(self.captured) >= MAX_SIGNATURES:
            warnings.warn(f"jit: {self.fn.__name__} has been captured for {len(self.captured)} "
                          "input signatures; changing shapes or dtypes recapture each time",
                          stacklevel=2)
            self.captured.pop(next(iter(self.captured)))
        return self._capture(key, inputs, args, kwargs)

    def _capture(self, key: tuple, inputs: list[Any], args: tuple, kwargs: dict) -> Any:
        if sched.recording is not None:
            raise RuntimeError("jit functions cannot be nested")
        steps: list[Any] = []
        sched.recording = steps
        try:
            out = self.fn(*args, **kwargs)
            _realize_all(out)
            # a replay hands back whole buffers: an output that is a view gets its own copy
            out = _map_tensors(out, _owning)
        finally:
            sched.recording = None
        input_ids = [id(t.lazy.buffer) for t in inputs]
        slots = [[(i, j) for i, st in enumerate(steps) for j, b in enumerate(st.buffers)
                  if id(b) == bid] for bid in input_ids]
        out_tensors = _tensors(out)
        out_bufs = [(t.lazy.buffer, t.shape, t.dtype, t.device) for t in out_tensors]
        del out_tensors
        _plan_memory(steps)
        captured = Captured(steps, slots, None, out_bufs)
        captured.outputs = _template(out, _tensors(out))
        _make_graph(captured, inputs)
        self.captured[key] = captured
        return out

    def _replay(self, c: Captured, inputs: list[Any]) -> Any:
        if c.graph is not None:
            assert c.input_bufs is not None
            for t, buf in zip(inputs, c.input_bufs):
                if t.lazy.buffer is not buf:
                    get_device(t.device).copy(buf, t.lazy.buffer)
            if sched.profiling is None:
                c.graph()
            elif sched.profiling.split_graphs or getattr(c.graph, "timed_by_step", False):
                for step in c.steps:  # each kernel timed on its own
                    step()
            else:  # one event for the whole graph: its kernels are not timed one by one
                sched.profiling.graph(c.graph, self.fn.__name__, c.steps)
        else:
            for t, slots in zip(inputs, c.input_slots):
                for i, j in slots:
                    c.steps[i].buffers[j] = t.lazy.buffer
            for step in c.steps:
                step()
        from anygpu.tensor import Tensor

        made = [Tensor(Lazy.from_buffer(b, shape, dtype, device))
                for b, shape, dtype, device in c.out_bufs]
        return _fill(c.outputs, made)


def jit(fn: Callable[..., Any], keep: int | None = None) -> JitFunction:
    """Decorator: capture ``fn``'s kernels once per input signature and replay them; ``keep``:
    the most signatures held at once, the least recently used dropped without a warning."""
    return JitFunction(fn, keep)


def _realize_all(out: Any) -> None:
    from anygpu.tensor import realize

    ts = _tensors(out)
    if ts:
        realize(*ts)


_OUT = object()


def _template(out: Any, tensors: list[Any]) -> Any:
    from anygpu.tensor import Tensor

    index = {id(t): i for i, t in enumerate(tensors)}
    if isinstance(out, Tensor):
        return (_OUT, index[id(out)])
    if isinstance(out, (list, tuple)):
        return type(out)(_template(v, tensors) for v in out)
    if isinstance(out, dict):
        return {k: _template(v, tensors) for k, v in out.items()}
    return out


def _fill(template: Any, made: list[Any]) -> Any:
    if isinstance(template, tuple) and len(template) == 2 and template[0] is _OUT:
        return made[template[1]]
    if isinstance(template, (list, tuple)):
        return type(template)(_fill(v, made) for v in template)
    if isinstance(template, dict):
        return {k: _fill(v, made) for k, v in template.items()}
    return template


def _plan_memory(steps: list[Any]) -> None:
    """Give buffers that nothing outside the step holds a shared pool, by lifetime.

    A buffer whose last use comes before another's first use can share its memory. The
    buffers that outlive the step (parameters, optimizer state, gradients, outputs, inputs)
    are the ones still referenced once the step's own references are dropped; a buffer the
    step reads before writing (data uploaded during capture) always keeps its memory.
    """
    info: dict[int, tuple[int, Device]] = {}
    refs: dict[int, weakref.ref] = {}
    layout: list[list[int]] = []
    pinned: dict[int, Buffer] = {}
    written: set[int] = set()
    for st in steps:
        ids = [id(b) for b in st.buffers]
        for j, b in enumerate(st.buffers):
            info[id(b)] = (b.nbytes, b.device)
            refs[id(b)] = weakref.ref(b)
            if j > 0 and id(b) not in written:
                pinned[id(b)] = b
        written.add(ids[0])
        layout.append(ids)
        st.buffers = [None] * len(ids)
    b = None  # the loop variable would keep the last buffer alive
    gc.collect()
    alive: dict[int, Buffer] = dict(pinned)
    for bid, ref in refs.items():
        buf = ref()
        if buf is not None:
            alive[bid] = buf
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, ids in enumerate(layout):
        for bid in ids:
            if bid not in alive:
                first.setdefault(bid, i)
                last[bid] = i
    assigned: dict[int, Buffer] = {}
    devices: dict[str, tuple[Device, list[int]]] = {}
    for bid in first:
        devices.setdefault(info[bid][1].name, (info[bid][1], []))[1].append(bid)
    for device, bids in devices.values():
        placed = _arena(device, bids, info, first, last) \
            if device.arena_sub_buffers and device.sub_buffer_align else None
        assigned.update(placed if placed is not None else _pool(device, bids, info, first, last))
    for st, ids in zip(steps, layout):
        st.buffers = [alive[bid] if bid in alive else assigned[bid] for bid in ids]


def _arena(device: Device, bids: list[int], info: dict[int, tuple[int, Device]],
           first: dict[int, int], last: dict[int, int]) -> dict[int, Buffer] | None:
    """The buffers ``bids`` as sub-buffers of one allocation, at offsets such that buffers in
    use at the same step never overlap: largest first, each in the smallest gap it fits between
    the buffers already placed whose lifetimes meet its own (the exact-size pool below held
    twice the bytes ever in use at once: ResNet-18's training step at 112 x 112 pooled 375 MiB
    for 189 MiB live). None if the device cannot give the arena in one allocation."""
    align = device.sub_buffer_align
    size = {bid: -(-info[bid][0] // align) * align for bid in bids}
    offsets: dict[int, int] = {}
    placed: list[int] = []
    end = 0
    for bid in sorted(bids, key=lambda b: (-size[b], first[b])):
        taken = sorted((offsets[o], offsets[o] + size[o]) for o in placed
                       if first[o] <= last[bid] and first[bid] <= last[o])
        best, gap_at = None, 0
        for lo, hi in taken:
            if lo - gap_at >= size[bid] and (best is None or lo - gap_at < best[0]):
                best = (lo - gap_at, gap_at)
            gap_at = max(gap_at, hi)
        at = best[1] if best is not None else gap_at
        offsets[bid] = at
        placed.append(bid)
        end = max(end, at + size[bid])
    try:
        arena = device.alloc(end)
    except MemoryError:  # (OutOfMemoryError too)
        return None
    return {bid: device.sub_buffer(arena, offsets[bid], info[bid][0]) for bid in bids}


def _pool(device: Device, bids: list[int], info: dict[int, tuple[int, Device]],
          first: dict[int, int], last: dict[int, int]) -> dict[int, Buffer]:
    """The buffers ``bids`` as the leading bytes of a few buffers (slots), for devices whose
    steps cannot bind ranges of one allocation: largest first, each in the first slot none of
    whose buffers is in use while it is (and so never bound beside it), else in a slot of its
    own. Buffers of exact sizes, each reused only by its size, had held more than PyTorch
    held (WebGPU's training steps: ResNet-18 at 224 x 224, batch 16, 834 MiB against 649)."""
    slots: list[tuple[Buffer, list[tuple[int, int]]]] = []  # each slot's spans, sorted

    def free(spans: list[tuple[int, int]], lo: int, hi: int) -> bool:
        at = bisect.bisect_left(spans, (lo, hi))
        return (at == 0 or spans[at - 1][1] < lo) and (at == len(spans) or hi < spans[at][0])

    assigned: dict[int, Buffer] = {}
    for bid in sorted(bids, key=lambda b: (-info[b][0], first[b])):
        nbytes, lo, hi = info[bid][0], first[bid], last[bid]
        slot = next((sl for sl in slots if free(sl[1], lo, hi)), None)
        if slot is None:
            slot = (device.alloc(nbytes), [])
            slots.append(slot)
        bisect.insort(slot[1], (lo, hi))
        base = slot[0]
        assigned[bid] = base if base.nbytes == nbytes else \
            SubBuffer(base, 0, nbytes, base.handle)  # (its first bytes: the same handle)
    return assigned


def _make_graph(c: Captured, inputs: list[Any]) -> None:
    """Record the whole replay as one piece where the device can: a CUDA graph; on WebGPU,
    the dispatches with their bind groups made once (see ``Device.recorded``)."""
    devices = {st.buffers[0].device for st in c.steps}
    # a transfer between devices goes through the host, which a device graph cannot hold
    if len(devices) != 1 or any(isinstance(st, sched.TransferCopy) for st in c.steps):
        return
    (device,) = devices
    make = getattr(device, "capture_graph", None)
    if make is None:
        return
    # launches and copies captured into a graph do not run now: a profile records the
    # graph's replays instead
    profiling = sched.profiling, base.profiling
    sched.profiling = base.profiling = None
    try:
        c.graph = make(c.steps)
    finally:
        sched.profiling, base.profiling = profiling
    c.input_bufs = [t.lazy.buffer for t in inputs]
