"""anygpu.profile: every launch, copy, transfer and compile of a block, with device times; the
summary, the Chrome trace, jit replays, and nothing recorded outside the block.

Launches are counted independently of the profiler, by wrapping ``Launch.__call__`` (every
kernel launch, eager or replayed by jit, goes through it).
"""

from __future__ import annotations

import contextlib
import json
import secrets
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import anygpu as ag
from anygpu import config
from anygpu.graph import schedule as sched
from anygpu.profile import Event, Profile, profile
from anygpu.profile import report
from anygpu.profile.record import Recorder
from anygpu.runtime import base
from anygpu.runtime.registry import get_device


@contextlib.contextmanager
def counted_launches(device: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The names of the kernels launched inside the ``with`` block. Launches captured into a
    device graph (CUDA), which do not run then, are left out."""
    names: list[str] = []
    counting = [True]
    launch = sched.Launch.__call__

    def counted(self: sched.Launch, wait: bool = False) -> float | None:
        if counting[0]:
            names.append(self.name)
        return launch(self, wait)

    monkeypatch.setattr(sched.Launch, "__call__", counted)
    kind = type(get_device(device))
    capture = getattr(kind, "capture_graph", None)
    if capture is not None:
        def capture_uncounted(self: Any, steps: Any) -> Any:
            counting[0] = False
            try:
                return capture(self, steps)
            finally:
                counting[0] = True

        monkeypatch.setattr(kind, "capture_graph", capture_uncounted)
    yield names
    counting[0] = False


def _model(device: str) -> tuple[Any, Any]:
    ag.manual_seed(0)
    model = ag.nn.Sequential(ag.nn.Linear(8, 16), ag.nn.ReLU(), ag.nn.Linear(16, 4)).to(device)
    return model, ag.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _data(device: str, seed: int) -> tuple[ag.Tensor, ag.Tensor]:
    rng = np.random.default_rng(seed)
    return (ag.tensor(rng.standard_normal((32, 8)).astype(np.float32), device=device),
            ag.tensor(rng.standard_normal((32, 4)).astype(np.float32), device=device))


def _step(model: Any, opt: Any, x: ag.Tensor, y: ag.Tensor) -> ag.Tensor:
    opt.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    return loss


def _kinds(prof: Profile, kind: str) -> list[Event]:
    return [e for e in prof.events if e.kind == kind]


def _check_consistent(prof: Profile, trace_path: Path) -> dict[str, Any]:
    """Durations positive, the summary's rows and totals the sums of the events, the trace
    one complete event per recorded event on named tracks. Returns the trace."""
    assert prof.events and all(e.duration > 0 for e in prof.events), \
        [e for e in prof.events if e.duration <= 0]
    assert all(e.start >= 0 for e in prof.events)
    rows = prof.stats()
    assert sum(s.calls for s in rows) == len(prof.events)
    for s in rows:
        mine = [e for e in prof.events if e.kind == s.kind and e.track == s.track and
                (e.name == s.name or s.kind not in report.KERNEL_KINDS)]
        assert s.calls == len(mine)
        assert s.total == pytest.approx(sum(e.duration for e in mine), rel=1e-12, abs=0)
        assert s.nbytes == sum(e.nbytes for e in mine)
    device_rows = [s for s in rows if s.kind in report.KERNEL_KINDS]
    if device_rows:
        assert sum(s.share for s in device_rows) == pytest.approx(1.0)
        totals = [s.total for s in device_rows]
        assert totals == sorted(totals, reverse=True)
    text = prof.summary()
    launches = len(_kinds(prof, "kernel"))
    assert text.startswith(f"{launches} kernel launches")
    for s in device_rows:
        assert s.name in text

    prof.export_chrome_trace(trace_path)
    trace = json.loads(trace_path.read_text())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(prof.events)
    assert all(e["dur"] > 0 and e["ts"] >= 0 for e in complete)
    for kind in {e.kind for e in prof.events}:
        assert sum(e["cat"] == kind for e in complete) == len(_kinds(prof, kind))
    named = {(e["pid"], e.get("tid"), e["name"]) for e in trace["traceEvents"] if e["ph"] == "M"}
    for e in complete:
        assert (e["pid"], None, "process_name") in named
        assert (e["pid"], e["tid"], "thread_name") in named
    return trace


def test_training_step(device: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    model, opt = _model(device)
    _step(model, opt, *_data(device, 0)).item()  # compiles outside the profile
    target = ag.zeros(64, device=device).realize()
    source = ag.tensor(np.arange(64, dtype=np.float32), device=device)
    with counted_launches(device, monkeypatch) as launched:
        before = len(launched)
        with profile() as prof:
            x, y = _data(device, 1)
            loss = _step(model, opt, x, y).item()
            target.assign(source)
        inside = launched[before:]
        after = len(launched)
        _step(model, opt, *_data(device, 2)).item()  # not recorded
        assert len(launched) > after
    assert np.isfinite(loss)
    np.testing.assert_array_equal(target.numpy(), np.arange(64))

    kernels = _kinds(prof, "kernel")
    assert [e.name for e in kernels] == inside and inside
    assert {e.track for e in kernels} == {device}
    uploads, downloads, copies = (_kinds(prof, k) for k in ("upload", "download", "copy"))
    assert len(uploads) >= 2 and sum(e.nbytes for e in uploads) >= (32 * 8 + 32 * 4) * 4
    assert len(downloads) >= 1
    assert any(e.nbytes == 64 * 4 for e in copies)
    assert not _kinds(prof, "compile")  # every kernel compiled before
    trace = _check_consistent(prof, tmp_path / "trace.json")
    assert sum(e["ph"] == "X" and e["cat"] == "kernel" for e in trace["traceEvents"]) \
        == len(inside)
    # device work follows its order on the queue
    queued = [e for e in prof.events if e.track == device]
    for a, b in zip(queued, queued[1:]):
        assert a.start <= b.start
    count = len(prof.events)
    _step(model, opt, *_data(device, 3)).item()
    assert len(prof.events) == count and sched.profiling is None and base.profiling is None


# sizes, so kernels, this process has not seen: a sum in one kernel, and one that splits in
# two (its new kernels compile together before either runs)
@pytest.mark.parametrize("size", ["one-kernel", "split"])
def test_compiles_on_a_cold_cache(device: str, size: str, monkeypatch: pytest.MonkeyPatch,
                                  tmp_path: Path) -> None:
    monkeypatch.setenv("ANYGPU_CACHE_DIR", str(tmp_path / "cache"))
    # and nothing lowered in this process before (the split's second kernel, a sum of three
    # partial sums, has the structure of other tests' kernels)
    for cache in ("_ast_cache", "_compiled", "_rendered"):
        monkeypatch.setattr(sched, cache, {})
    config.reload()
    try:
        n = 5000 + secrets.randbelow(5000) if size == "one-kernel" else \
            3 * (334000 + secrets.randbelow(5000))
        x = ag.tensor(np.ones(n, dtype=np.float32), device=device)
        with counted_launches(device, monkeypatch) as launched:
            with profile() as cold:
                total = (x * 3 + 1).sum().item()
            with profile() as warm:
                again = (x * 3 + 1).sum().item()
    finally:
        monkeypatch.undo()
        config.reload()
    assert total == again == 4 * n
    assert len(launched) == 2 * len(_kinds(cold, "kernel")) == 2 * len(_kinds(warm, "kernel"))
    compiles, lowered = _kinds(cold, "compile"), _kinds(cold, "lower")
    kernels = _kinds(cold, "kernel")
    assert compiles and {e.name for e in compiles} <= {e.name for e in kernels}
    assert {e.name for e in lowered} == {e.name for e in kernels}
    assert all(e.track == "host" and e.args["device"] == device for e in compiles + lowered)
    for kernel in kernels:  # compiled before it ran, on one timeline
        built = [e for e in compiles if e.name == kernel.name]
        assert all(e.start + e.duration <= kernel.start + 1e-6 for e in built)
    assert not _kinds(warm, "compile") and not _kinds(warm, "lower")
    text = cold.summary()
    assert "compiles (host)" in text and "lowering (host)" in text
    _check_consistent(cold, tmp_path / "cold.json")


def test_template_flops(device: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    a = ag.tensor(rng.standard_normal((256, 256)).astype(np.float32), device=device)
    b = ag.tensor(rng.standard_normal((256, 256)).astype(np.float32), device=device)
    (a @ b).realize()
    with profile() as prof:
        (a @ b).relu().realize()
    (gemm,) = [e for e in _kinds(prof, "kernel") if e.flops]
    assert gemm.flops == 2 * 256 ** 3
    (row,) = [s for s in prof.stats() if s.name == gemm.name]
    assert row.tflop_per_s == pytest.approx(gemm.flops / gemm.duration / 1e12)
    # name, device, calls, total (value, unit), share, mean (value, unit), GB/s, TFLOP/s
    (line,) = [line for line in prof.summary().splitlines() if line.startswith(gemm.name)]
    assert len(line.split()) == 10
    _check_consistent(prof, tmp_path / "gemm.json")


def test_jit_replays(device: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    model, opt = _model(device)

    @ag.jit
    def step(x: ag.Tensor, y: ag.Tensor) -> ag.Tensor:
        return _step(model, opt, x, y)

    batches = [_data(device, seed) for seed in range(6)]
    with counted_launches(device, monkeypatch) as launched:
        with profile() as whole:  # the first call, the capture and a replay
            for x, y in batches[:3]:
                step(x, y)
        first = len(launched)
        with profile() as replays:
            losses = [step(x, y).item() for x, y in batches[3:]]
        replayed = launched[first:]
    assert all(np.isfinite(losses))
    (captured,) = [c for c in step.captured.values() if c is not None]
    steps = sum(isinstance(s, sched.Launch) for s in captured.steps)
    graphs = _kinds(replays, "graph")
    if captured.graph is not None and not getattr(captured.graph, "timed_by_step", False):
        # a device graph (CUDA): one event per replay, for the launches of the graph
        assert not replayed and not _kinds(replays, "kernel")
        assert len(graphs) == 3 and all(g.args["launches"] == steps for g in graphs)
        assert len(_kinds(whole, "graph")) == 1
    else:  # without a graph, or one whose kernels a profile times one by one
        assert not graphs and len(replayed) == 3 * steps
        assert [e.name for e in _kinds(replays, "kernel")] == replayed
    assert len(_kinds(whole, "kernel")) == first
    _check_consistent(whole, tmp_path / "whole.json")
    _check_consistent(replays, tmp_path / "replays.json")
    # split: a device graph's launches run one by one, each timed
    with counted_launches(device, monkeypatch) as launched:
        with profile(split_graphs=True) as split:
            again = [step(x, y).item() for x, y in batches[3:]]
    assert not _kinds(split, "graph") and len(launched) == 3 * steps
    assert [e.name for e in _kinds(split, "kernel")] == launched
    assert np.isfinite(again).all()
    _check_consistent(split, tmp_path / "split.json")


def test_wait_returns_the_device_time(device: str) -> None:
    x = ag.ones(1000, device=device).realize()
    (item,) = sched.schedule([(x * 2).lazy])
    assert isinstance(item, sched.KernelItem)
    with profile() as prof:
        launch = sched.prepare(item)
        seconds = launch(wait=True)
    (kernel,) = _kinds(prof, "kernel")
    assert seconds == pytest.approx(kernel.duration) and seconds > 0


def test_blocks_do_not_nest_and_always_close() -> None:
    with pytest.raises(RuntimeError, match="nested"):
        with profile():
            with profile():
                pass
    assert sched.profiling is None and base.profiling is None
    with pytest.raises(ValueError, match="inside"):
        with profile() as prof:
            ag.ones(4).realize()
            raise ValueError("inside")
    assert sched.profiling is None and base.profiling is None
    assert _kinds(prof, "kernel") or _kinds(prof, "upload")
    fresh = profile()
    with pytest.raises(RuntimeError, match="ended"):
        fresh.summary()
    with fresh:
        pass
    with pytest.raises(RuntimeError, match="one block"):
        with fresh:
            pass


class _ShiftedTimer(base.QueueTimer):
    """Host times seen through a clock 1000 s behind, as a device's own clock would be."""

    device_clock = True

    def times(self) -> list[tuple[float, float]]:
        return [(start - 1000.0, end - 1000.0) for start, end in self._times]


def test_device_clocks_are_placed_on_the_host_timeline() -> None:
    device = types.SimpleNamespace(name="fake:0", info=types.SimpleNamespace(name="Fake"),
                                   synchronize=lambda: None)
    device.queue_timer = lambda: _ShiftedTimer(device)  # type: ignore[attr-defined]
    recorder = Recorder()
    recorder.transfer(device, "upload", 16, lambda: time.sleep(0.002))  # type: ignore[arg-type]
    time.sleep(0.003)
    recorder.transfer(device, "copy", 16, lambda: time.sleep(0.001))  # type: ignore[arg-type]
    recorder.built(device, "k", time.perf_counter() - 0.001, "compile")  # type: ignore[arg-type]
    upload, copy, compile_ = sorted(recorder.finish(), key=lambda e: e.start)
    assert (upload.kind, copy.kind, compile_.kind) == ("upload", "copy", "compile")
    assert 0 <= upload.start < 0.05 and upload.duration >= 0.002
    assert copy.start - (upload.start + upload.duration) >= 0.003
    assert copy.start + copy.duration <= compile_.start + compile_.duration


def test_summary_and_trace_of_known_events() -> None:
    events = [Event("gemm_64", "kernel", "cuda:0", 0.0, 1e-3, nbytes=10**6, flops=2 * 10**9),
              Event("e_8", "kernel", "cuda:0", 2e-3, 1e-4, nbytes=10**5),
              Event("gemm_64", "kernel", "cuda:0", 3e-3, 1e-3, nbytes=10**6, flops=2 * 10**9),
              Event("copy", "copy", "cuda:0", 5e-3, 2e-5, nbytes=4000),
              Event("e_8", "compile", "host", 0.0, 0.25, args={"device": "cuda:0"})]
    rows = report.stats(events)
    assert [(s.name, s.kind, s.calls) for s in rows] == [
        ("gemm_64", "kernel", 2), ("e_8", "kernel", 1), ("copies on the device", "copy", 1),
        ("compiles (host)", "compile", 1)]
    gemm = rows[0]
    assert gemm.share == pytest.approx(2 / 2.1) and gemm.mean == pytest.approx(1e-3)
    assert gemm.gb_per_s == pytest.approx(1.0) and gemm.tflop_per_s == pytest.approx(2.0)
    assert rows[1].tflop_per_s is None
    lines = report.summary(events, wall=0.5).splitlines()
    assert lines[0] == "3 kernel launches, 2.1 ms of device time in 500 ms (the block's wall time)"
    assert lines[1].split() == ["kernel", "device", "calls", "total", "share", "mean", "GB/s",
                                "TFLOP/s"]
    assert lines[3].split() == ["gemm_64", "cuda:0", "2", "2", "ms", "95.2%", "1", "ms", "1",
                                "2"]
    assert lines[4].split() == ["e_8", "cuda:0", "1", "100", "us", "4.8%", "100", "us", "1"]
    assert lines[5].split() == ["total", "3", "2.1", "ms", "100.0%"]
    assert lines[6] == ""
    assert lines[7].split() == ["copies", "on", "the", "device", "cuda:0", "1", "20", "us", "20",
                                "us", "0.2"]
    assert lines[8].split() == ["compiles", "(host)", "host", "1", "250", "ms", "250", "ms"]
    trace = report.chrome_trace(events, {"cuda:0": "NVIDIA H100"})
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    assert {"name": "process_name", "ph": "M", "pid": 1,
            "args": {"name": "cuda:0 (NVIDIA H100)"}} in meta
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert complete[0] == {"name": "gemm_64", "cat": "kernel", "ph": "X", "ts": 0.0,
                           "dur": 1000.0, "pid": 1, "tid": 0,
                           "args": {"bytes": 10**6, "GB/s": 1.0, "flops": 2 * 10**9}}
    assert [e["pid"] for e in complete] == [1, 1, 1, 1, 0]
