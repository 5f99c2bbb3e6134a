"""Schedules kept by graph structure: a repeated step without ``jit`` is planned once and replayed
after, with the same kernels and the same results as planning it again; graphs that differ in
anything the scheduler reads (shapes, constants, which inputs share memory) get plans of their
own; the scheduler's rewrites (split sums, unfolded windows) are replayed onto the new graph."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import anygpu as ag
from anygpu import nn
from anygpu.graph import plans
from anygpu.graph import schedule as sched
from anygpu.graph.lazy import Lazy
from anygpu.nn import functional as F
from anygpu.ops.primitives import Op
from anygpu.runtime.registry import get_device


@pytest.fixture
def planned(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the graphs the scheduler plans (not replays): [plans made]."""
    made = [0]
    real = sched._plan_items

    def counted(outputs, *order):
        made[0] += 1
        return real(outputs, *order)

    monkeypatch.setattr(sched, "_plan_items", counted)
    return made


def _train(device: str, steps: int) -> tuple[list[float], list[np.ndarray]]:
    ag.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 4 * 4, 5)).to(device)
    opt = ag.optim.Adam(model.parameters(), lr=1e-2)
    data = np.random.default_rng(4)
    losses = []
    for _ in range(steps):
        x = ag.tensor(data.standard_normal((4, 3, 8, 8)).astype(np.float32), device=device)
        y = ag.tensor(data.integers(0, 5, 4), device=device)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.numpy() for p in model.parameters()]


def test_a_repeated_step_is_planned_once_and_replays_the_same_kernels(
        device: str, planned: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    plans.clear()
    losses, params = _train(device, 4)
    first = planned[0]
    assert first > 0
    planned[0] = 0
    replayed = _train(device, 4)  # the same structure: every graph of every step replays
    assert planned[0] == 0
    np.testing.assert_array_equal(replayed[0], losses)
    # planned afresh each time, the same numbers
    monkeypatch.setattr(plans, "find", lambda walk: None)
    fresh = _train(device, 4)
    np.testing.assert_array_equal(fresh[0], losses)
    for a, b in zip(fresh[1], params):
        np.testing.assert_array_equal(a, b)
    assert np.isfinite(losses).all() and losses[-1] != losses[0]


def _buffer(device: str, data: np.ndarray) -> Lazy:
    return ag.tensor(data, device=device).lazy


def test_graphs_that_differ_get_their_own_plans(device: str, planned: list[int]) -> None:
    plans.clear()
    rng = np.random.default_rng(5)
    a_host, b_host = rng.standard_normal((2, 64)).astype(np.float32)
    a = _buffer(device, a_host)
    b = _buffer(device, b_host)
    twin = Lazy.from_buffer(a.buffer, a.shape, a.dtype, a.device)  # a's memory, another node

    def run(x: Lazy, y: Lazy, scale: float) -> np.ndarray:
        out = x.alu(Op.ADD, y).alu(Op.MUL, Lazy.const(scale, x.shape, x.dtype, x.device))
        return ag.Tensor(out).numpy()

    np.testing.assert_allclose(run(a, b, 2.0), (a_host + b_host) * 2, rtol=1e-6)
    assert planned[0] == 1
    np.testing.assert_allclose(run(b, a, 2.0), (a_host + b_host) * 2, rtol=1e-6)
    assert planned[0] == 1  # the same structure on other buffers
    np.testing.assert_allclose(run(a, b, -0.0), (a_host + b_host) * -0.0, rtol=1e-6)
    assert planned[0] == 2  # another constant, even one equal as a number
    np.testing.assert_allclose(run(a, twin, 2.0), a_host * 4, rtol=1e-6)
    assert planned[0] == 3  # both inputs in one buffer
    np.testing.assert_allclose(run(b, a, 2.0), (a_host + b_host) * 2, rtol=1e-6)
    assert planned[0] == 3


def test_replayed_plans_rewrite_the_new_graph_as_the_scheduler_did(
        device: str, planned: list[int]) -> None:
    """A sum with few outputs splits on GPUs (partial sums, a node the scheduler makes), a
    large convolution unfolds its windows on the processor: replayed, the new graph gets the
    same kernels, nodes and results."""
    plans.clear()
    rng = np.random.default_rng(6)
    shapes = []
    for _ in range(3):
        x_host = rng.standard_normal((6, 50000)).astype(np.float32)
        w_host = rng.standard_normal((32, 16, 3, 3)).astype(np.float32)
        i_host = rng.standard_normal((2, 16, 48, 48)).astype(np.float32)
        x = ag.tensor(x_host, device=device)
        total = x.sum(1)
        conv = F.conv2d(ag.tensor(i_host, device=device), ag.tensor(w_host, device=device),
                        padding=1)
        items = sched.schedule([total.lazy, conv.lazy])
        shapes.append([(type(i).__name__, i.output.shape) for i in items])
        sched.run(items)
        np.testing.assert_allclose(total.numpy(), x_host.astype(np.float64).sum(1),
                                   rtol=1e-4, atol=1e-3)
        want = torch.nn.functional.conv2d(torch.from_numpy(i_host), torch.from_numpy(w_host),
                                          padding=1).numpy()
        np.testing.assert_allclose(conv.numpy(), want, rtol=1e-3, atol=1e-3)
    assert planned[0] == 1
    assert shapes[0] == shapes[1] == shapes[2]
    assert len(shapes[0]) > 2  # more kernels than the two outputs: the rewrites' own
    assert all(plan.made for plan in plans._plans.values())  # nodes the scheduler made


def test_jit_recording_plans_afresh(planned: list[int]) -> None:
    """jit records with row slices read as whole buffers: it never takes a kept plan."""
    plans.clear()
    x = ag.tensor(np.arange(12, dtype=np.float32), device="cpu")
    for _ in range(2):
        (x * 2 + 1).sum().realize()
    assert planned[0] == 1
    step = ag.jit(lambda t: (t * 2 + 1).sum())
    for _ in range(3):
        step(x).realize()
    assert planned[0] == 2  # the recording (the first call took the kept plan, replays none)


def test_plans_kept_are_bounded_by_the_nodes_they_describe(
        planned: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    plans.clear()
    monkeypatch.setattr(plans, "MAX_NODES", 40)
    x = ag.tensor(np.linspace(-1, 1, 16, dtype=np.float32))
    for k in range(12):  # twelve structures (another constant each) of five nodes
        np.testing.assert_allclose(((x + k) * 2).numpy(), (np.linspace(-1, 1, 16) + k) * 2,
                                   rtol=1e-6)
    assert planned[0] == 12
    assert 1 <= len(plans._plans) <= 10 and plans._kept_nodes <= 40
    ((x + 11) * 2).numpy()  # the newest is kept
    assert planned[0] == 12
    ((x + 0) * 2).numpy()  # the oldest went first
    assert planned[0] == 13


def test_a_replayed_16_bit_split_becomes_the_cast_of_its_partials(
        device: str, planned: list[int]) -> None:
    """A bfloat16 (or float16) sum with few outputs splits on GPUs into float32 partials and
    becomes a cast of their sum (an op the scheduler rewrote): replayed, the same."""
    dtype = next((d for d in (ag.bfloat16, ag.float16) if get_device(device).supports(d)), None)
    if dtype is None:
        pytest.skip(f"{device} has no 16-bit float type")
    plans.clear()
    rng = np.random.default_rng(8)
    ops = []
    for _ in range(3):
        x = ag.tensor(rng.standard_normal((6, 50000)).astype(np.float32), device=device)
        x = x.cast(dtype).realize()
        total = x.sum(1)
        before = planned[0]
        items = sched.schedule([total.lazy])
        node = total.lazy.srcs[0]  # the sum under the view that drops its axis
        ops.append((node.op, len(items), planned[0] - before))
        sched.run(items)
        want = x.float().numpy().astype(np.float64).sum(1)
        np.testing.assert_allclose(total.float().numpy(), want, rtol=2 ** -7, atol=1e-3)
    assert [planned for _, _, planned in ops] == [1, 0, 0]
    assert ops[0][:2] == ops[1][:2] == ops[2][:2]
    if not device.startswith("cpu"):
        assert ops[0][:2] == (Op.CAST, 2)
