"""What a profile records while it is open, and how device clocks meet the host's.

A :class:`Recorder` is installed as ``graph.schedule.profiling`` and ``runtime.base.profiling``
for the length of an ``anygpu.profile`` block; the launch, copy, transfer and compile points
call it only then, so code outside a profile pays one ``if`` on a module variable. Device work
goes through each device's ``QueueTimer`` (``Device.queue_timer``): timestamps are queued with
the work and read once, when the block ends. Host work (lowering, compiling, loading programs)
is timed with the host clock as it happens.

Each device timer has a clock of its own. No work can start before the host queued it, so the
smallest shift that puts every piece of work after its queuing places the device's timeline on
the host's; it is exact for any piece that started at once, which the first usually does.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from anygpu.profile.report import Event
from anygpu.runtime.base import Device, QueueTimer

if TYPE_CHECKING:
    from anygpu.graph.schedule import Launch

# the names of device work that is not a kernel, by kind
_NAMES = {"copy": "copy", "upload": "host to device", "download": "device to host"}


@dataclass
class _Queued:
    """Device work timed by ``timer`` (its ``index``-th piece), not read yet."""

    timer: QueueTimer
    index: int
    issued: float  # host clock when it was queued
    name: str
    kind: str
    device: str
    nbytes: int = 0
    flops: int = 0
    args: dict[str, Any] = field(default_factory=dict)


class Recorder:
    """Receives launches, copies, transfers and compiles while a profile is open."""

    def __init__(self, split_graphs: bool = False) -> None:
        self.origin = time.perf_counter()
        # jit replays run launch by launch, each timed, rather than as one device graph
        self.split_graphs = split_graphs
        self.devices: dict[str, str] = {}  # device name -> the product's name, first seen first
        self._timers: dict[int, QueueTimer] = {}  # by id(device): devices live as long as we do
        self._queued: list[_Queued] = []
        self._host: list[Event] = []
        # launches may come from several threads; a timer's indices must follow its queue
        self._lock = threading.RLock()

    def _timer(self, device: Device) -> QueueTimer:
        timer = self._timers.get(id(device))
        if timer is None:
            timer = self._timers[id(device)] = device.queue_timer()
            self.devices[device.name] = device.info.name
        return timer

    def _queue(self, device: Device, run: Callable[[QueueTimer], int], name: str, kind: str,
               nbytes: int = 0, flops: int = 0, args: dict[str, Any] | None = None) -> _Queued:
        with self._lock:
            timer = self._timer(device)
            issued = time.perf_counter()
            queued = _Queued(timer, run(timer), issued, name, kind, device.name, nbytes, flops,
                             args or {})
            self._queued.append(queued)
        return queued

    # ---- device work ------------------------------------------------------------------------
    def launch(self, launch: Launch, wait: bool) -> float | None:
        """Queue ``launch`` timed; with ``wait``, wait for it and return its device time."""
        args: dict[str, Any] = {"grid": list(launch.groups), "block": list(launch.local)}
        if launch.template:
            args["template"] = launch.template
        queued = self._queue(launch.program.device,
                             lambda timer: timer.launch(launch.program, launch.buffers,
                                                        launch.groups, launch.local),
                             launch.name, "kernel", launch.nbytes, launch.flops, args)
        if not wait:
            return None
        start, end = queued.timer.times()[queued.index]
        return end - start

    def transfer(self, device: Device, kind: str, nbytes: int, fn: Callable[[], object]) -> None:
        """Run ``fn``, a copy within ``device`` ("copy") or between it and the host ("upload",
        "download"), timed."""
        self._queue(device, lambda timer: timer.around(fn), _NAMES[kind], kind, nbytes)

    def graph(self, graph: Any, name: str, steps: Sequence[object]) -> None:
        """Replay ``graph`` (a device graph of ``steps``, from jit), timed as one piece."""
        from anygpu.graph.schedule import Launch

        launches = [s for s in steps if isinstance(s, Launch)]
        self._queue(graph.device, lambda timer: timer.around(graph), f"graph {name}", "graph",
                    sum(s.nbytes for s in launches), sum(s.flops for s in launches),
                    {"launches": len(launches), "steps": len(steps)})

    # ---- host work --------------------------------------------------------------------------
    def lowered(self, device: Device, name: str, start: float) -> None:
        """Kernel ``name`` for ``device`` was lowered and rendered from ``start`` until now."""
        self._host_event(name, "lower", start, {"device": device.name})

    def built(self, device: Device, name: str, start: float, kind: str) -> None:
        """A program was compiled ("compile") or loaded from the disk cache ("load") from
        ``start`` until now."""
        self._host_event(name, kind, start, {"device": device.name})

    def _host_event(self, name: str, kind: str, start: float, args: dict[str, Any]) -> None:
        end = time.perf_counter()
        with self._lock:
            self._host.append(Event(name, kind, "host", start - self.origin, end - start,
                                    args=args))

    # ---- the end ----------------------------------------------------------------------------
    def finish(self) -> list[Event]:
        """Wait for the devices, read every timer and return all events by start time."""
        events = list(self._host)
        try:
            by_timer: dict[int, list[_Queued]] = {}
            for q in self._queued:
                by_timer.setdefault(id(q.timer), []).append(q)
            for queued in by_timer.values():
                timer = queued[0].timer
                times = timer.times()
                offset = max(q.issued - times[q.index][0] for q in queued) \
                    if timer.device_clock else 0.0
                for q in queued:
                    start, end = times[q.index]
                    events.append(Event(q.name, q.kind, q.device, start + offset - self.origin,
                                        end - start, q.nbytes, q.flops, q.args))
        finally:
            for timer in self._timers.values():
                timer.close()
        events.sort(key=lambda e: e.start)
        return events
