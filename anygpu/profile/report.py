"""A profile's events, and what is made of them: the summary table and the Chrome trace.

Everything here works on recorded :class:`Event` lists alone, with no device.

>>> events = [Event("e_1024", "kernel", "cpu:0", 0.0, 2e-6, nbytes=8192),
...           Event("e_1024", "kernel", "cpu:0", 1e-5, 2e-6, nbytes=8192)]
>>> [(s.name, s.calls, round(s.total * 1e6, 1), s.share) for s in stats(events)]
[('e_1024', 2, 4.0, 1.0)]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

# kinds of device work that the kernel table lists one row per name
KERNEL_KINDS = ("kernel", "graph")
# the other kinds, in the order the summary lists them, with the row's label
OTHER_KINDS = {"copy": "copies on the device", "upload": "host to device",
               "download": "device to host", "lower": "lowering (host)",
               "compile": "compiles (host)", "load": "loads from the disk cache (host)"}


@dataclass(frozen=True)
class Event:
    """One piece of recorded work.

    ``kind`` is "kernel" (a launch), "graph" (a jit replay run as one device graph), "copy"
    (within a device), "upload" or "download" (between host and device), "lower" (a kernel
    lowered and rendered), "compile" (a program compiled) or "load" (a program loaded from the
    disk cache). ``track`` is the device that ran it ("cuda:0"), or "host". ``start`` and
    ``duration`` are in seconds, ``start`` from the beginning of the profile; device times come
    from the device's own timers, placed on the host's timeline."""

    name: str
    kind: str
    track: str
    start: float
    duration: float
    nbytes: int = 0  # bytes the work reads and writes (kernels: each input once, the output)
    flops: int = 0  # floating-point operations, where a template knows them
    args: Mapping[str, Any] = field(default_factory=dict)  # grid, block, template, launches


@dataclass(frozen=True)
class Stat:
    """The events of one row of the summary: a kernel (or device graph) on one device, or all
    events of another kind on one track."""

    name: str
    kind: str
    track: str
    calls: int
    total: float  # seconds
    nbytes: int
    flops: int
    share: float  # of the kernels' and graphs' device time (0 for other kinds)

    @property
    def mean(self) -> float:
        return self.total / self.calls if self.calls else 0.0

    @property
    def gb_per_s(self) -> float | None:
        """Bytes moved per second, in GB/s (None where no bytes are known)."""
        return self.nbytes / self.total / 1e9 if self.nbytes and self.total > 0 else None

    @property
    def tflop_per_s(self) -> float | None:
        """Floating-point operations per second, in TFLOP/s (None where not known)."""
        return self.flops / self.total / 1e12 if self.flops and self.total > 0 else None


def stats(events: Sequence[Event]) -> list[Stat]:
    """Kernel and graph rows by total time, longest first, then one row per other kind and
    track in ``OTHER_KINDS`` order."""
    rows: dict[tuple[str, str, str], list[Event]] = {}
    for e in events:
        name = e.name if e.kind in KERNEL_KINDS else OTHER_KINDS.get(e.kind, e.kind)
        rows.setdefault((e.kind, name, e.track), []).append(e)
    device_time = sum(e.duration for e in events if e.kind in KERNEL_KINDS)
    out = []
    for (kind, name, track), group in rows.items():
        total = sum(e.duration for e in group)
        share = total / device_time if kind in KERNEL_KINDS and device_time > 0 else 0.0
        out.append(Stat(name, kind, track, len(group), total, sum(e.nbytes for e in group),
                        sum(e.flops for e in group), share))
    order = list(OTHER_KINDS)
    kernels = sorted((s for s in out if s.kind in KERNEL_KINDS), key=lambda s: -s.total)
    others = sorted((s for s in out if s.kind not in KERNEL_KINDS),
                    key=lambda s: (order.index(s.kind) if s.kind in order else len(order),
                                   s.track))
    return kernels + others


def _time(seconds: float) -> str:
    """A duration with four significant digits in s, ms or us."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3)):
        if seconds >= scale:
            return f"{seconds / scale:.4g} {unit}"
    return f"{seconds * 1e6:.4g} us"


def _rate(value: float | None) -> str:
    """A rate with three significant digits, blank where unknown."""
    if value is None:
        return ""
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def summary(events: Sequence[Event], wall: float) -> str:
    """The table ``Profile.summary`` prints (see there)."""
    rows = stats(events)
    kernels = [s for s in rows if s.kind in KERNEL_KINDS]
    others = [s for s in rows if s.kind not in KERNEL_KINDS]
    width = max([len(s.name) for s in rows] + [len("kernel")])
    device_width = max([len(s.track) for s in rows] + [len("device")])

    def line(*cells: str) -> str:
        name, track, calls, total, share, mean, gbps, tflops = cells
        return (f"{name:<{width}}  {track:<{device_width}}  {calls:>6}  {total:>10}  "
                f"{share:>6}  {mean:>10}  {gbps:>8}  {tflops:>8}").rstrip()

    launches = sum(s.calls for s in kernels if s.kind == "kernel")
    device_time = sum(s.total for s in kernels)
    lines = [f"{launches} kernel launches, {_time(device_time)} of device time in "
             f"{_time(wall)} (the block's wall time)",
             line("kernel", "device", "calls", "total", "share", "mean", "GB/s", "TFLOP/s")]
    lines.append("-" * len(lines[-1]))
    for s in kernels:
        lines.append(line(s.name, s.track, str(s.calls), _time(s.total),
                          f"{s.share * 100:.1f}%", _time(s.mean), _rate(s.gb_per_s),
                          _rate(s.tflop_per_s)))
    if kernels:
        lines.append(line("total", "", str(sum(s.calls for s in kernels)), _time(device_time),
                          "100.0%", "", "", ""))
    if others:
        lines.append("")
    for s in others:
        lines.append(line(s.name, s.track, str(s.calls), _time(s.total), "", _time(s.mean),
                          _rate(s.gb_per_s), ""))
    return "\n".join(lines)


def chrome_trace(events: Sequence[Event], devices: Mapping[str, str]) -> dict[str, Any]:
    """The trace-event JSON object of ``events`` (Chrome's about:tracing and Perfetto read
    it): one complete ("X") event each, ``ts`` and ``dur`` in microseconds; the host and each
    device are a process with one named thread (the device's queue), named by metadata
    events. ``devices`` maps a device's name to its product's, for the track names."""
    tracks = ["host"] + list(devices) + sorted({e.track for e in events} - {"host", *devices})
    pids = {track: pid for pid, track in enumerate(tracks)}
    out: list[dict[str, Any]] = []
    for track, pid in pids.items():
        product = devices.get(track)
        process = f"{track} ({product})" if product else track
        thread = "lowering and compiles" if track == "host" else "queue"
        out += [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": process}},
                {"name": "process_sort_index", "ph": "M", "pid": pid,
                 "args": {"sort_index": pid}},
                {"name": "thread_name", "ph": "M", "pid": pid, "tid": 0,
                 "args": {"name": thread}}]
    for e in events:
        args = dict(e.args)
        if e.nbytes:
            args["bytes"] = e.nbytes
            if e.duration > 0:
                args["GB/s"] = round(e.nbytes / e.duration / 1e9, 3)
        if e.flops:
            args["flops"] = e.flops
        out.append({"name": e.name, "cat": e.kind, "ph": "X", "ts": round(e.start * 1e6, 3),
                    "dur": round(e.duration * 1e6, 3), "pid": pids[e.track], "tid": 0,
                    "args": args})
    return {"traceEvents": out, "displayTimeUnit": "ns"}
