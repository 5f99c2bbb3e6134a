"""``anygpu.profile``: record every launch, copy, transfer and compile of a block of code."""

from __future__ import annotations

import json
import os
import time
from types import TracebackType

from anygpu.graph import schedule
from anygpu.profile import report
from anygpu.profile.record import Recorder
from anygpu.profile.report import Event, Stat
from anygpu.runtime import base


class Profile:
    """What happened inside one ``with profile() as prof:`` block (see :func:`profile`).

    ``events`` holds every kernel launch, device graph replay, copy, transfer, lowering and
    compile, by start time; it is filled when the block ends, as are ``stats``, ``summary``
    and ``export_chrome_trace``.
    """

    def __init__(self, split_graphs: bool = False) -> None:
        self.split_graphs = split_graphs
        self.events: list[Event] = []
        self.wall = 0.0  # seconds the block took on the host
        self._devices: dict[str, str] = {}
        self._recorder: Recorder | None = None
        self._state = "new"

    def __enter__(self) -> Profile:
        if self._state != "new":
            raise RuntimeError("a Profile records one block; make a new one with profile()")
        if schedule.profiling is not None or base.profiling is not None:
            raise RuntimeError("anygpu.profile blocks cannot be nested")
        self._recorder = Recorder(self.split_graphs)
        self._state = "recording"
        schedule.profiling = base.profiling = self._recorder
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        schedule.profiling = base.profiling = None
        recorder, self._recorder = self._recorder, None
        assert recorder is not None
        self.wall = time.perf_counter() - recorder.origin
        self._state = "done"
        try:
            self.events = recorder.finish()
        except Exception:
            if error is None:  # a device error of the block itself wins over a failed read
                raise
        self._devices = dict(recorder.devices)

    def _done(self) -> None:
        if self._state != "done":
            raise RuntimeError("the profile is read once its block has ended")

    def stats(self) -> list[Stat]:
        """One row per kernel name and device (device graphs too), longest total first, then
        one per other kind of work and track: copies, host to device, device to host,
        lowering, compiles, loads from the disk cache."""
        self._done()
        return report.stats(self.events)

    def summary(self) -> str:
        """A table of the kernels by total device time: calls, total, share of the device
        time, mean, GB/s (the bytes each launch reads and writes, at the least) and TFLOP/s
        (where a GEMM or convolution template counted its operations); then copies, transfers
        and compiles with their counts and times."""
        self._done()
        return report.summary(self.events, self.wall)

    def __str__(self) -> str:
        return self.summary() if self._state == "done" else f"<Profile {self._state}>"

    def export_chrome_trace(self, path: str | os.PathLike[str]) -> None:
        """Write the events as Chrome trace-event JSON, which ui.perfetto.dev and
        chrome://tracing open: a track per device queue and one for the host's lowering and
        compiles, one complete event per launch, copy, transfer and compile."""
        self._done()
        with open(path, "w") as f:
            json.dump(report.chrome_trace(self.events, self._devices), f)

    def __repr__(self) -> str:
        return f"<Profile {self._state}, {len(self.events)} events>"


def profile(split_graphs: bool = False) -> Profile:
    """Record every kernel launch, copy, host-device transfer and compile inside a ``with``
    block, with device-side times.

    Device work is timed by the device itself and read when the block ends, without waiting
    in between: CUDA and HIP events around each launch, OpenCL's profiling timestamps (the
    kernel's own event; markers before and after copies), WebGPU timestamp queries where the
    adapter has them. The cpu backend runs each kernel before the launch returns, so the host
    time of the call is its run time. A WebGPU adapter without timestamps is timed on the host,
    waiting for the queue before and after each launch while the profile is open. jit replays
    are recorded launch by launch, except on CUDA, where a replay is one CUDA graph: it is one
    event ("graph <function>", kind "graph", with the number of launches it holds). With
    ``split_graphs=True`` such a replay runs its launches one by one instead, each timed: the
    table says where a step's time goes, though the step runs without the graph (the same
    kernels, launched from the host).

    Outside a profile, launches cost one test of a module variable more.

    >>> import anygpu as ag
    >>> from anygpu.profile import profile
    >>> x = ag.ones(256, 256)
    >>> with profile() as prof:
    ...     y = ((x @ x).relu() + 1).sum().item()
    >>> kernels = [e for e in prof.events if e.kind == "kernel"]
    >>> len(kernels) >= 1 and all(e.duration > 0 for e in kernels)
    True
    >>> print(prof.summary())  # doctest: +SKIP
    2 kernel launches, 3.607 ms of device time in 320 ms (the block's wall time)
    kernel            device   calls       total   share        mean      GB/s   TFLOP/s
    ------------------------------------------------------------------------------------
    r_65536           cpu:0        1    3.048 ms   84.5%    3.048 ms     0.086
    gemm_256_256_256  cpu:0        1    559.3 us   15.5%    559.3 us     0.937      0.06
    total                          2    3.607 ms  100.0%
    <BLANKLINE>
    device to host    cpu:0        1    15.54 us            15.54 us  0.000257
    lowering (host)   host         2    571.3 us            285.6 us
    compiles (host)   host         2    313.7 ms            156.9 ms
    >>> prof.export_chrome_trace("trace.json")  # doctest: +SKIP
    """
    return Profile(split_graphs)
