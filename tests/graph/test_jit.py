"""jit: replays match eager runs, advance random numbers, plan memory, and recapture on new
shapes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import anygpu as ag
from anygpu.runtime.base import SubBuffer
from anygpu.runtime.registry import get_device


def _train(device: str, use_jit: bool) -> tuple[list[float], np.ndarray]:
    rng = np.random.default_rng(0)
    w = ag.tensor(rng.standard_normal((4, 3)).astype(np.float32), device=device,
                  requires_grad=True)
    b = ag.tensor(rng.standard_normal(3).astype(np.float32), device=device, requires_grad=True)
    opt = ag.optim.Adam([w, b], lr=0.1)

    def step(x: ag.Tensor, y: ag.Tensor) -> tuple[ag.Tensor, ag.Tensor]:
        opt.zero_grad()
        h = x @ w + b
        noise = ag.rand(h.shape, device=device)
        loss = ((h + noise * 0.1 - y) ** 2).mean()
        loss.backward()
        opt.step()
        return loss, noise.sum()

    fn = ag.jit(step) if use_jit else step
    ag.manual_seed(7)
    out = []
    data = np.random.default_rng(1)
    for _ in range(6):
        x = data.standard_normal((8, 4)).astype(np.float32)
        y = data.standard_normal((8, 3)).astype(np.float32)
        loss, noise = fn(ag.tensor(x, device=device), ag.tensor(y, device=device))
        out += [loss.item(), noise.item()]
    return out, w.numpy()


def test_replay_matches_eager(device: str) -> None:
    eager, w_eager = _train(device, False)
    replay, w_replay = _train(device, True)
    np.testing.assert_allclose(replay, eager, rtol=1e-5)
    np.testing.assert_allclose(w_replay, w_eager, rtol=1e-5, atol=1e-6)
    # random numbers advanced on every replay
    assert len({round(v, 4) for v in replay[1::2]}) == 6


def test_replay_uses_new_inputs_and_no_graph_work(device: str, monkeypatch) -> None:
    from anygpu.graph import schedule as sched

    @ag.jit
    def f(x: ag.Tensor) -> ag.Tensor:
        return (x * 2 + 1).exp().sum()

    rng = np.random.default_rng(0)
    for _ in range(2):
        f(ag.tensor(rng.standard_normal(16).astype(np.float32), device=device))
    calls = []
    monkeypatch.setattr(sched, "schedule", lambda *a: calls.append(a))
    for _ in range(3):
        x = rng.standard_normal(16).astype(np.float32)
        got = f(ag.tensor(x, device=device)).item()
        assert got == pytest.approx(float(np.exp(x * 2 + 1).sum()), rel=1e-5)
    assert not calls, "a replay scheduled graph work"


def test_memory_is_planned(device: str) -> None:
    """Intermediate buffers of a long chain share memory by lifetime."""
    @ag.jit
    def chain(x: ag.Tensor) -> ag.Tensor:
        for _ in range(10):
            x = (x * 1.01 + 0.5).contiguous().realize()
        return x

    x = ag.tensor(np.random.default_rng(0).standard_normal(64).astype(np.float32), device=device)
    for _ in range(3):
        out = chain(x)
    (captured,) = chain.captured.values()
    # the memory each buffer is (a sub-buffer of the step's one allocation, where the device
    # binds several ranges of a buffer, is its range)
    ranges = {(id(b.base), b.offset) if isinstance(b, SubBuffer) else (id(b), 0)
              for st in captured.steps for b in st.buffers}
    assert len(ranges) <= 4  # input, output and two alternating intermediates
    ref = x.numpy()
    for _ in range(10):
        ref = ref * 1.01 + 0.5
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5)


def _shrinking_chain(device: str, seed: int) -> tuple[Any, ag.Tensor]:
    """A jit chain whose intermediates shrink (6, 5, ..., 1 blocks of 4 KiB), run three times
    (eager, capture, replay), each result checked against NumPy: (the jit function, its
    input)."""
    @ag.jit
    def chain(x: ag.Tensor) -> ag.Tensor:
        for blocks in range(5, 0, -1):
            x = (x[:1024 * blocks] * 1.01 + 0.5).contiguous().realize()
        return x * 2

    xs = np.random.default_rng(seed).standard_normal(1024 * 6).astype(np.float32)
    x = ag.tensor(xs, device=device)
    outs = [chain(x).numpy() for _ in range(3)]
    ref = xs
    for blocks in range(5, 0, -1):
        ref = ref[:1024 * blocks] * np.float32(1.01) + np.float32(0.5)
    for out in outs:
        np.testing.assert_allclose(out, ref * 2, rtol=1e-5, atol=1e-6)
    return chain, x


def test_buffers_of_different_sizes_share_one_allocation(device: str) -> None:
    """A chain whose intermediates shrink (6, 5, ..., 1 blocks of 4 KiB) holds, where the device
    binds several ranges of one buffer, one allocation of no more than two neighbours need at
    once (the pool of buffers of equal sizes it replaced held one buffer per size: ResNet-18's
    step twice the bytes ever live). Against NumPy."""
    if not get_device(device).arena_sub_buffers:
        pytest.skip(f"{device} keeps buffers of their own")
    chain, _ = _shrinking_chain(device, 1)
    (captured,) = chain.captured.values()
    planned = {id(b): b for st in captured.steps for b in st.buffers if isinstance(b, SubBuffer)}
    bases = {id(b.base): b.base for b in planned.values()}
    assert len(planned) == 5 and len(bases) == 1
    (base,) = bases.values()
    assert base.nbytes <= 4096 * (5 + 4)  # the largest two in use at once


def test_buffers_share_slots_where_a_device_binds_no_ranges(device: str,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """Where a step's buffers cannot be ranges of one allocation (WebGPU's), they are the first
    bytes of a few buffers, none two in use at once in one: the shrinking chain's five
    intermediates (5, 4, ..., 1 blocks of 4 KiB) fit in two, of 5 and 4 blocks (exact sizes,
    each reused only by its size, had made five). Against NumPy, on every device (the arena
    turned off where it is on)."""
    monkeypatch.setattr(type(get_device(device)), "arena_sub_buffers", False)
    chain, x = _shrinking_chain(device, 2)
    (captured,) = chain.captured.values()
    outside = {id(x.lazy.buffer), id(captured.steps[-1].buffers[0])} | \
        {id(b) for b in captured.input_bufs or []}  # (the input, the output: their own)
    chained = {id(b): b for st in captured.steps for b in st.buffers if id(b) not in outside}
    bases = {id(b.base if isinstance(b, SubBuffer) else b):
             b.base if isinstance(b, SubBuffer) else b for b in chained.values()}
    assert len(chained) == 5 and sorted(b.nbytes for b in bases.values()) == [4096 * 4,
                                                                             4096 * 5]


def test_new_shape_recaptures() -> None:
    @ag.jit
    def f(x: ag.Tensor) -> ag.Tensor:
        return x.sum()

    for n in (3, 3, 3, 5, 5, 5):
        x = np.arange(n, dtype=np.float32) + 1
        assert f(ag.tensor(x)).item() == pytest.approx(x.sum())
    assert len(f.captured) == 2


def test_kept_shapes_drop_the_least_recently_used_quietly(recwarn) -> None:
    """``keep``: a function that sees a few shapes in turn holds at most that many captures,
    recapturing a dropped shape when it comes back, without a warning."""
    f = ag.jit(lambda x: (x * 2).sum(), keep=2)
    rng = np.random.default_rng()
    for n in (3, 3, 3, 5, 5, 5, 3, 7, 7, 7, 3, 5, 5, 5):
        x = rng.standard_normal(n).astype(np.float32)
        assert f(ag.tensor(x)).item() == pytest.approx(2 * x.sum(), rel=1e-5, abs=1e-5)
        assert len(f.captured) <= 2
    assert [k[0][0] for k in f.captured] == [(3,), (5,)]
    assert not [w for w in recwarn.list if "jit" in str(w.message)]


def test_view_inputs_replay_with_their_values(device: str) -> None:
    """A view of other memory (a slice) as input: each replay reads the slice passed."""
    @ag.jit
    def f(x: ag.Tensor) -> ag.Tensor:
        return (x * 3).sum()

    rng = np.random.default_rng(7)
    for _ in range(4):
        base = rng.standard_normal((4, 6)).astype(np.float32)
        got = f(ag.tensor(base, device=device)[1:3]).item()
        want = base[1:3].astype(np.float64) * 3
        # a sum that may cancel: the error bound scales with the sum of magnitudes
        assert got == pytest.approx(want.sum(), abs=1e-6 * np.abs(want).sum())


def test_assign_inside_replays_each_input(device: str) -> None:
    """A state written with ``assign`` inside the function takes each call's input."""
    state = ag.zeros(2, device=device)

    @ag.jit
    def remember(v: ag.Tensor) -> ag.Tensor:
        state.assign(v)
        return state * 1

    rng = np.random.default_rng(0)
    for _ in range(4):
        v = rng.standard_normal(2).astype(np.float32)
        np.testing.assert_allclose(remember(ag.tensor(v, device=device)).numpy(), v)
        np.testing.assert_allclose(state.numpy(), v)


def test_transfers_between_devices_replay(devices: list[str]) -> None:
    """``.to(other device)`` inside the function copies each call's data."""
    if len(devices) < 2:
        pytest.skip("needs two devices")
    here, there = devices[0], devices[1]

    @ag.jit
    def roundtrip(v: ag.Tensor) -> ag.Tensor:
        return (v.to(there) * 2).to(here) + 1

    rng = np.random.default_rng(0)
    for _ in range(4):
        v = rng.standard_normal(3).astype(np.float32)
        np.testing.assert_allclose(roundtrip(ag.tensor(v, device=here)).numpy(), v * 2 + 1,
                                   rtol=1e-6)


def test_view_outputs_replay(device: str) -> None:
    """An output that is a view of computed memory (a 0-d sum) comes back on every replay."""
    fn = ag.jit(lambda v: (v * 2).sum())
    rng = np.random.default_rng(0)
    for _ in range(4):
        v = rng.standard_normal(5).astype(np.float32)
        np.testing.assert_allclose(fn(ag.tensor(v, device=device)).item(), (v * 2).sum(),
                                   rtol=1e-5)


def test_long_replays_with_copies_match_eager(device: str) -> None:
    """More launches than a replay submits in one command buffer (WebGPU), with a copy among
    them: each replay computes what an eager call does, from the call's own input, replayed
    from a device graph or recording where the backend has one."""
    from anygpu.graph import schedule as sched

    state = ag.zeros(8, device=device)

    def f(x: ag.Tensor) -> ag.Tensor:
        for i in range(150):
            x = (x * 0.5 + i).realize()
            if i == 70:
                state.assign(x)  # a copy within the device
        return x - state

    def want(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float64)
        for i in range(150):
            x = x * 0.5 + i
            if i == 70:
                kept = x
        return x - kept

    jitted = ag.jit(f)
    rng = np.random.default_rng(3)
    for _ in range(4):
        x = rng.standard_normal(8).astype(np.float32)
        np.testing.assert_allclose(jitted(ag.tensor(x, device=device)).numpy(), want(x),
                                   rtol=1e-5, atol=1e-4)
    (captured,) = jitted.captured.values()
    assert captured is not None
    assert sum(isinstance(s, sched.Launch) for s in captured.steps) >= 150
    assert any(isinstance(s, sched.DeviceCopy) for s in captured.steps)
    if hasattr(get_device(device), "capture_graph"):  # CUDA, WebGPU
        assert captured.graph is not None
