"""scatter, scatter_reduce (and their in-place forms), repeat_interleave, roll, diag, diagonal,
diag_embed, trace, kron, cummax, cummin, logcumsumexp and cdist against PyTorch (CPU) on every
available device: values, gradients, integer dtypes, empty and 0-d tensors, non-contiguous
inputs and PyTorch's errors."""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import pytest

import anygpu as ag

torch = pytest.importorskip("torch")


def _f(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) + 0.3).astype(np.float32)


def _i(shape: tuple[int, ...], seed: int, low: int = -50, high: int = 50) -> np.ndarray:
    return np.random.default_rng(seed).integers(low, high, shape).astype(np.int32)


def _same(got: ag.Tensor, want: Any, exact: bool = False) -> None:
    w = want.detach().numpy()
    g = got.numpy()
    assert g.shape == w.shape, (g.shape, w.shape)
    if exact or not np.issubdtype(w.dtype, np.floating):
        np.testing.assert_array_equal(g, w)
    else:
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def _both(device: str, program: Callable[..., Any], *arrays: np.ndarray,
          grad: bool = False) -> None:
    """``program(lib, *tensors)`` with anygpu and PyTorch: values, and with ``grad`` the
    gradients of a weighted sum of the result."""
    ours = [ag.tensor(a, device=device, requires_grad=grad and a.dtype.kind == "f")
            for a in arrays]
    theirs = [torch.tensor(a, requires_grad=grad and a.dtype.kind == "f") for a in arrays]
    got, want = program(ag, *ours), program(torch, *theirs)
    _same(got, want)
    if grad:
        weight = _f(tuple(want.shape), 99)
        (got * ag.tensor(weight, device=device)).sum().backward()
        (want * torch.tensor(weight)).sum().backward()
        for a, b in zip(ours, theirs):
            if b.requires_grad:
                assert a.grad is not None and b.grad is not None
                np.testing.assert_allclose(a.grad.numpy(), b.grad.numpy(), rtol=1e-5, atol=1e-5)


# ---- scatter ------------------------------------------------------------------------------------
def _index(shape: tuple[int, ...], size: int, seed: int, unique_axis: int | None = None
           ) -> np.ndarray:
    """Random indices below ``size``; with ``unique_axis``, no index repeats along it (PyTorch's
    scatter is only defined so)."""
    rng = np.random.default_rng(seed)
    if unique_axis is None:
        return rng.integers(0, size, shape).astype(np.int64)
    moved = list(shape)
    moved[unique_axis], moved[-1] = moved[-1], moved[unique_axis]
    rows = [rng.permutation(size)[:moved[-1]] for _ in range(math.prod(moved[:-1]))]
    return np.array(rows, np.int64).reshape(moved).swapaxes(unique_axis, -1).copy()


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_scatter(device: str, dim: int) -> None:
    x, src = _f((4, 5), 1), _f((5, 6), 2)
    index = _index((3, 4) if dim == 0 else (4, 3), 4 if dim == 0 else 5, 3,
                   unique_axis=dim % 2)
    _both(device, lambda m, a, i, b: a.scatter(dim, i, b), x, index, src)
    # (PyTorch's gradient needs src of index's shape)
    _both(device, lambda m, a, i, b: a.scatter(dim, i, b), x, index,
          src[:index.shape[0], :index.shape[1]].copy(), grad=True)
    _both(device, lambda m, a, i: a.scatter(dim, i, -2.5), x, index, grad=True)
    _both(device, lambda m, a, i: m.scatter(a, dim, i, value=7), _i((4, 5), 4), index)


def test_scatter_duplicates_and_edges(device: str) -> None:
    # duplicates: the last index along the axis wins (what PyTorch's cpu backend gives)
    x = ag.zeros(2, 4, device=device)
    got = x.scatter(1, ag.tensor([[1, 1, 3], [0, 2, 0]], device=device),
                    ag.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], device=device))
    assert got.tolist() == [[0.0, 2.0, 0.0, 3.0], [6.0, 0.0, 5.0, 0.0]]
    # 0-d, empty index, integer dtype with a float value (truncated, as PyTorch)
    s = ag.tensor(2.0, device=device).scatter(0, ag.tensor(0, device=device),
                                              ag.tensor(5.0, device=device))
    assert s.shape == () and s.item() == 5.0
    e = ag.tensor(_f((3,), 1), device=device).scatter(
        0, ag.tensor(np.zeros(0, np.int64), device=device), ag.tensor(np.zeros(0, np.float32),
                                                                      device=device))
    np.testing.assert_array_equal(e.numpy(), _f((3,), 1))
    assert ag.zeros(3, dtype=ag.int32, device=device).scatter(
        0, ag.tensor([1], device=device), 2.7).tolist() == [0, 2, 0]
    with pytest.raises(RuntimeError, match="same number of dimensions"):
        ag.zeros(3, device=device).scatter(0, ag.tensor([[1]], device=device), 1.0)


def test_scatter_in_place(device: str) -> None:
    x, src = _f((3, 4), 5), _f((3, 4), 6)
    index = _index((3, 2), 4, 7, unique_axis=1)
    for name, args in [("scatter_", (1, index, src)), ("scatter_", (1, index, 3.5)),
                       ("scatter_add_", (1, index, src)),
                       ("scatter_reduce_", (1, index, src, "amax"))]:
        ours, theirs = ag.tensor(x, device=device), torch.tensor(x)
        view, tview = ours[1:], theirs[1:]  # through a view: the base shows the write
        ours_args = [ag.tensor(a, device=device) if isinstance(a, np.ndarray) else a
                     for a in args]
        theirs_args = [torch.tensor(a) if isinstance(a, np.ndarray) else a for a in args]
        ours_args[1], theirs_args[1] = ours_args[1][:2], theirs_args[1][:2]
        if isinstance(args[2], np.ndarray):
            ours_args[2], theirs_args[2] = ours_args[2][:2], theirs_args[2][:2]
        getattr(view, name)(*ours_args)
        getattr(tview, name)(*theirs_args)
        _same(ours, theirs)


@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce(device: str, reduce: str, include_self: bool) -> None:
    x, src = _f((4, 6), 8), _f((4, 5), 9)
    src[0, :2] = x[0, 3]  # ties, with x's own value too where it is included
    if not include_self:  # (PyTorch then still counts x's value among the ties: see the docs)
        x[0, 3] += 1.0
    index = _index((4, 5), 6, 10)
    index[0, :2] = 3
    _both(device, lambda m, a, i, b: a.scatter_reduce(1, i, b, reduce, include_self=include_self),
          x, index, src, grad=True)
    ints, int_index = _i((4, 6), 11, -9, 9), _index((3, 6), 4, 12)
    _both(device, lambda m, a, i, b: m.scatter_reduce(a, 0, i, b, reduce,
                                                      include_self=include_self),
          ints, int_index, _i((4, 6), 12, -9, 9))


# ---- movement-like composites -------------------------------------------------------------------
@pytest.mark.parametrize("offset", [0, 1, -2, 5])
def test_diagonals(device: str, offset: int) -> None:
    x = _f((3, 4, 5), 13)
    _both(device, lambda m, a: a.diagonal(offset), x[0], grad=True)
    _both(device, lambda m, a: m.diagonal(a, offset, 2, 0), x, grad=True)
    _both(device, lambda m, a: a.transpose(0, 2).diagonal(offset, -1, 1), x)
    _both(device, lambda m, a: m.diag(a, offset), x[0, 1], grad=True)
    _both(device, lambda m, a: m.diag(a, offset), x[1], grad=True)
    _both(device, lambda m, a: m.diag_embed(a, offset), x[0], grad=True)
    _both(device, lambda m, a: m.diag_embed(a, offset, 0, 2), x[1])
    _both(device, lambda m, a: a.diag_embed(offset, -1, 1), _i((2, 3), 14))


def test_trace_and_diagonal_errors(device: str) -> None:
    _both(device, lambda m, a: m.trace(a), _f((4, 3), 15), grad=True)
    _both(device, lambda m, a: a.trace(), _i((3, 3), 16))
    t = ag.tensor(_f((3,), 1), device=device)
    with pytest.raises(RuntimeError, match="expected a matrix"):
        t.trace()
    with pytest.raises(RuntimeError, match="diagonal dimensions cannot be identical"):
        ag.tensor(_f((3, 3), 1), device=device).diagonal(0, 1, 1)
    with pytest.raises(RuntimeError, match=r"Supports 1D or 2D tensors. Got 3D"):
        ag.diag(ag.tensor(_f((2, 2, 2), 1), device=device))


@pytest.mark.parametrize("shifts,dims", [(1, None), (-3, None), (2, 0), ((1, -2), (0, 1)),
                                         (7, 1), ((0, 5), (1, 0)), (1, -1)])
def test_roll(device: str, shifts: Any, dims: Any) -> None:
    _both(device, lambda m, a: m.roll(a, shifts, dims), _f((3, 4), 17), grad=True)
    _both(device, lambda m, a: a.t().roll(shifts, dims), _i((4, 3), 18))


def test_roll_edges(device: str) -> None:
    _both(device, lambda m, a: a.roll(2, 0), _f((0, 3), 1))
    _both(device, lambda m, a: a.roll(1), np.float32(2.5).reshape(()))
    with pytest.raises(RuntimeError, match="shifts and dimensions must align"):
        ag.tensor(_f((3,), 1), device=device).roll((1, 2), (0,))


@pytest.mark.parametrize("dim", [None, 0, 1, -1])
def test_repeat_interleave(device: str, dim: int | None) -> None:
    x = _f((3, 4), 19)
    _both(device, lambda m, a: a.repeat_interleave(3, dim), x, grad=True)
    size = 12 if dim is None else x.shape[dim]
    counts = np.random.default_rng(20).integers(0, 4, size).astype(np.int64)
    _both(device, lambda m, a: m.repeat_interleave(a, m.tensor(counts), dim), x, grad=True)
    _both(device, lambda m, a: a.repeat_interleave(m.tensor(2), dim), _i((3, 4), 21))


def test_repeat_interleave_forms_and_errors(device: str) -> None:
    counts = ag.tensor([2, 0, 3], device=device)
    assert ag.repeat_interleave(counts).tolist() == [0, 0, 2, 2, 2]
    assert ag.tensor(1.5, device=device).repeat_interleave(2).tolist() == [1.5, 1.5]
    t = ag.tensor(_f((3,), 1), device=device)
    with pytest.raises(RuntimeError, match="repeats can not be negative"):
        t.repeat_interleave(ag.tensor([1, -1, 2], device=device))
    with pytest.raises(RuntimeError, match="same size as input along dim"):
        t.repeat_interleave(ag.tensor([1, 1], device=device))
    with pytest.raises(RuntimeError, match="allocated size does not match"):
        t.repeat_interleave(ag.tensor([1, 2, 3], device=device), output_size=5)


def test_kron(device: str) -> None:
    _both(device, lambda m, a, b: m.kron(a, b), _f((2, 3), 22), _f((4,), 23), grad=True)
    _both(device, lambda m, a, b: a.kron(b), _i((2, 2), 24), _i((3, 1, 2), 25))


# ---- scans ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["cummax", "cummin"])
@pytest.mark.parametrize("n", [1, 7, 100])
def test_cumulative_extremes(device: str, name: str, n: int) -> None:
    x = np.round(_f((3, n), n) * 2) / 2  # ties
    x[0, n // 2] = np.nan
    x[1, n // 3] = -np.inf
    ours = getattr(ag.tensor(x, device=device), name)(1)
    theirs = getattr(torch.tensor(x), name)(1)
    np.testing.assert_array_equal(ours.values.numpy(), theirs.values.numpy())
    np.testing.assert_array_equal(ours.indices.numpy(), theirs.indices.numpy())
    clean = _f((4, n), n + 1)
    _both(device, lambda m, a: getattr(m, name)(a, 0).values, clean, grad=True)
    ints = _i((2, n), n + 2, -3, 3)
    ours = getattr(ag.tensor(ints, device=device), name)(-1)
    theirs = getattr(torch.tensor(ints), name)(-1)
    np.testing.assert_array_equal(ours.indices.numpy(), theirs.indices.numpy())
    np.testing.assert_array_equal(ours.values.numpy(), theirs.values.numpy())


@pytest.mark.parametrize("n", [1, 7, 100])
def test_logcumsumexp(device: str, n: int) -> None:
    x = _f((3, n), n) * 4
    x[0, 0] = -1000.0  # far below the rest: kept, not underflowed
    _both(device, lambda m, a: m.logcumsumexp(a, 1), x, grad=True)
    _both(device, lambda m, a: a.t().logcumsumexp(0), x)
    with pytest.raises(NotImplementedError):
        ag.tensor([1, 2], device=device).logcumsumexp(0)


# ---- cdist ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [2.0, 1.0, 0.0, math.inf, 3.0])
@pytest.mark.parametrize("rows", [5, 30])
def test_cdist(device: str, p: float, rows: int) -> None:
    a, b = _f((2, rows, 4), 26), _f((7, 4), 27)
    a[0, 0] = b[3]  # a distance of exactly 0
    rtol = 1e-4 if rows > 25 and p == 2 else 1e-5  # through |a|^2 + |b|^2 - 2ab, as PyTorch
    ours = [ag.tensor(a, device=device, requires_grad=True),
            ag.tensor(b, device=device, requires_grad=True)]
    theirs = [torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)]
    got, want = ag.cdist(*ours, p=p), torch.cdist(*theirs, p=p)
    np.testing.assert_allclose(got.numpy(), want.detach().numpy(), rtol=rtol, atol=1e-3
                               if rows > 25 and p == 2 else 1e-5)
    weight = _f(tuple(want.shape), 28)  # gradients of every p, at the distance of 0 too
    (got * ag.tensor(weight, device=device)).sum().backward()
    (want * torch.tensor(weight)).sum().backward()
    for o, t in zip(ours, theirs):
        assert o.grad is not None and t.grad is not None
        np.testing.assert_allclose(o.grad.numpy(), t.grad.numpy(), rtol=1e-3, atol=1e-3)


def test_cdist_modes_and_errors(device: str) -> None:
    a, b = _f((40, 3), 29), _f((30, 3), 30)
    for mode in ("use_mm_for_euclid_dist", "donot_use_mm_for_euclid_dist"):
        got = ag.cdist(ag.tensor(a, device=device), ag.tensor(b, device=device),
                       compute_mode=mode)
        want = torch.cdist(torch.tensor(a), torch.tensor(b), compute_mode=mode)
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-4)
    t = ag.tensor(a, device=device)
    with pytest.raises(RuntimeError, match="at least 2D"):
        ag.cdist(t[0], t)
    with pytest.raises(RuntimeError, match="same number of columns"):
        ag.cdist(t, t[:, :2])
    with pytest.raises(RuntimeError, match="non-negative p"):
        ag.cdist(t, t, p=-1)
