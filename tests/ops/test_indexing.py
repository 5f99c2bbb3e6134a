"""Indexing against NumPy and PyTorch: basic slicing (negative steps too), advanced indexing,
gather, scatter_add, index_select, and their errors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import anygpu as ag
from anygpu.dtype import DType

F32 = ag.float32
seeds = st.integers(0, 2**32 - 1)
DTYPES = [F32, ag.int8, ag.bool_]


def _x(shape: tuple[int, ...], dtype: DType, host: Any, seed: int = 0) -> np.ndarray:
    return host(shape, dtype, seed, low=-100, high=100)


@pytest.mark.parametrize("dtype", [F32, ag.int8])
@settings(max_examples=8)  # each slice is a kernel of its own
@given(seed=seeds, rows=st.slices(5), cols=st.slices(6))
def test_slices(device: str, dtype: DType, seed: int, rows: slice, cols: slice, host: Any,
                check: Any) -> None:
    x = _x((5, 6), dtype, host, seed)
    t = ag.tensor(x, dtype=dtype, device=device)
    check(t[rows, cols], x[rows, cols], dtype)


@pytest.mark.parametrize("i,j", [(0, -1), (-5, 3), (4, 0)])
@given(seed=seeds)
def test_integer_indices(device: str, seed: int, i: int, j: int, host: Any,
                         check: Any) -> None:
    x = _x((5, 6), F32, host, seed)
    t = ag.tensor(x, device=device)
    check(t[i], x[i], F32)
    check(t[i, j], x[i, j], F32)
    check(t[:, j], x[:, j], F32)
    check(t[i, ::-2], x[i, ::-2], F32)


BASIC = [
    (1, ...), (..., -1), (None, 1), (slice(None), None, slice(1, 3)), (..., None),
    (slice(None, None, -1),), (slice(4, 0, -2), slice(None), 2), (0, slice(None), None, -1),
    (slice(-2, None), ..., slice(None, None, 3)), (slice(3, 1),), (None, ..., None),
    (slice(1, 2), 0, slice(None, None, -1)),
]


@pytest.mark.parametrize("index,dtype", [(index, DTYPES[k % len(DTYPES)])
                                         for k, index in enumerate(BASIC)],
                         ids=[str(i) for i in range(len(BASIC))])
def test_basic_indexing(device: str, dtype: DType, index: tuple, host: Any,
                        check: Any) -> None:
    x = _x((4, 3, 5), dtype, host)
    t = ag.tensor(x, dtype=dtype, device=device)
    check(t[index], x[index], dtype)


def test_indexing_a_0d_and_empty_results(device: str, check: Any) -> None:
    t = ag.tensor(3.5, device=device)
    check(t[...], np.array(3.5), F32)
    check(t[None], np.array([3.5]), F32)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = ag.tensor(x, device=device)
    for index in [(slice(1, 1),), (slice(None), slice(3, None)), (slice(None), slice(None, 0, 2)),
                  (slice(1, 1), slice(None, None, -2))]:
        out = t[index]
        assert out.shape == x[index].shape
        assert out.numpy().shape == x[index].shape  # an empty kernel, or none
        assert (out + 1).numpy().shape == x[index].shape


ADVANCED = [
    ([0, 3, 3, -1],),
    (np.array([[1, 0], [2, 3]]),),
    (slice(None), [2, 0]),
    ([1, 2], [0, 2]),
    ([[0], [3]], [1, 2]),  # broadcast index arrays
    ([0, 2], slice(None), [4, 1]),  # not adjacent: the index shape goes first
    (slice(None), [0, 2], [4, 1]),  # adjacent after a slice: it stays in place
    (1, [0, 2], slice(None)),
    ([True, False, True, True],),
    (slice(1, None), np.array([True, False, True])),
    (..., [-1, 0]),
    (None, [1], 0),
]


@pytest.mark.parametrize("index,dtype", [(index, DTYPES[k % len(DTYPES)])
                                         for k, index in enumerate(ADVANCED)],
                         ids=[str(i) for i in range(len(ADVANCED))])
def test_advanced_indexing(device: str, dtype: DType, index: tuple, host: Any,
                           check: Any) -> None:
    x = _x((4, 3, 5), dtype, host)
    t = ag.tensor(x, dtype=dtype, device=device)
    np_index = tuple(np.asarray(i) if isinstance(i, list) else i for i in index)
    check(t[index], x[np_index], dtype)


@pytest.mark.parametrize("idx_dtype", [ag.int32, ag.int64])
def test_tensor_indices(device: str, idx_dtype: DType, host: Any, check: Any) -> None:
    x = _x((4, 3, 5), F32, host)
    t = ag.tensor(x, device=device)
    i = np.array([[3, -1], [0, 2]])
    ti = ag.tensor(i, dtype=idx_dtype, device=device)
    check(t[ti], x[i], F32)
    check(t[:, ti[1, :1]], x[:, i[1, :1]], F32)
    check(t[ti, 1, ti], x[i, 1, i], F32)


def test_bool_masks(device: str, host: Any, check: Any) -> None:
    """Masks of one and several dimensions, on the host or the device, beside other indices;
    the gradient reaches the selected elements only."""
    x = _x((4, 3, 5), F32, host)
    t = ag.tensor(x, device=device)
    m2 = x[:, :, 0] > 0
    m1 = np.array([True, False, True])
    check(t[ag.tensor(m2, device=device)], x[m2], F32)
    check(t[m2], x[m2], F32)
    check(t[x > 0], x[x > 0], F32)
    check(t[1, ag.tensor(m1, device=device)], x[1, m1], F32)
    check(t[:, m1, 1:3], x[:, m1, 1:3], F32)
    check(t[ag.tensor(np.zeros(4, bool), device=device)], x[np.zeros(4, bool)], F32)
    leaf = ag.tensor(x, device=device, requires_grad=True)
    leaf[ag.tensor(m2, device=device)].sum().backward()
    check(leaf.grad, np.broadcast_to(m2[:, :, None], x.shape).astype(np.float32), F32)


@given(seed=seeds, dim=st.sampled_from([0, 1, -1]), small=st.booleans())
def test_gather(device: str, seed: int, dim: int, small: bool, host: Any, check: Any) -> None:
    x = _x((4, 5), F32, host, seed)
    rng = np.random.default_rng(seed)
    shape = (3, 2) if small else (4, 5)
    n = x.shape[dim]
    idx = rng.integers(0, n, shape)
    t = ag.tensor(x, device=device)
    ref = torch.gather(torch.from_numpy(x), dim, torch.from_numpy(idx)).numpy()
    check(t.gather(dim, ag.tensor(idx, device=device)), ref, F32)
    check(t.gather(dim, ag.tensor(idx, dtype=ag.int32, device=device)), ref, F32)
    check(t.gather(dim, idx), ref, F32)  # host index arrays are uploaded


def test_gather_of_computed_values_and_indices(device: str, check: Any) -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = ag.tensor(x, device=device)
    idx = ag.tensor([[3, 0], [1, 1], [2, 0]], device=device)
    ref = np.take_along_axis(x * 2 + 1, np.array([[3, 0], [1, 1], [2, 0]]), 1)
    check((t * 2 + 1).gather(1, idx), ref, F32)
    check(t.gather(1, t.argmax(1, keepdim=True)), x.max(1, keepdims=True), F32)
    check(t.gather(1, (idx + 1) % 4), np.take_along_axis(x, (np.array(
        [[3, 0], [1, 1], [2, 0]]) + 1) % 4, 1), F32)


def test_gather_clamps_out_of_range_indices(device: str, check: Any) -> None:
    """Indices computed on the device are not checked; they read the nearest element instead
    of memory outside the buffer."""
    t = ag.tensor([10.0, 20.0, 30.0], device=device)
    check(t.gather(0, ag.tensor([5, -2, 1], device=device)), np.array([30.0, 10.0, 20.0]), F32)


@pytest.mark.parametrize("dtype", [F32, ag.int32, ag.int64])
@given(seed=seeds, dim=st.sampled_from([0, 1, -1]))
def test_scatter_add(device: str, dtype: DType, seed: int, dim: int, host: Any,
                     check: Any) -> None:
    rng = np.random.default_rng(seed)
    x = host((3, 4), dtype, seed)
    src = host((3, 4), dtype, seed + 1)
    n = x.shape[dim]
    idx = rng.integers(0, n, (2, 3))  # repeated indices accumulate
    ref = torch.from_numpy(x).scatter_add(dim, torch.from_numpy(idx), torch.from_numpy(src))
    out = ag.tensor(x, device=device).scatter_add(dim, ag.tensor(idx, device=device),
                                                  ag.tensor(src, device=device))
    check(out, ref.numpy(), dtype)


@given(seed=seeds, dim=st.sampled_from([0, 1]))
def test_index_select(device: str, seed: int, dim: int, host: Any, check: Any) -> None:
    rng = np.random.default_rng(seed)
    x = _x((4, 5), F32, host, seed)
    idx = rng.integers(-x.shape[dim], x.shape[dim], 6)
    ref = np.take(x, idx, axis=dim)
    t = ag.tensor(x, device=device)
    check(t.index_select(dim, idx), ref, F32)
    check(t.index_select(dim, ag.tensor(idx, device=device)), ref, F32)


def test_index_errors(device: str) -> None:
    t = ag.tensor(np.zeros((3, 4), np.float32), device=device)
    with pytest.raises(IndexError, match="index 3 is out of bounds for dimension 0 with size 3"):
        t[3]
    with pytest.raises(IndexError, match="out of bounds"):
        t[:, -5]
    with pytest.raises(IndexError, match="index 7 is out of bounds"):
        t[[0, 7]]
    with pytest.raises(IndexError, match="out of bounds"):
        t[:, [-5]]
    with pytest.raises(IndexError, match="out of bounds"):
        t.index_select(0, [0, 3])
    with pytest.raises(IndexError, match="too many indices"):
        t[0, 0, 0]
    with pytest.raises(IndexError, match="Ellipsis|ellipsis"):
        t[..., ...]
    with pytest.raises(IndexError, match="must be integer"):
        t[ag.tensor([0.0], device=device)]
    with pytest.raises(IndexError, match="bool scalars"):
        t[ag.tensor(True, device=device)]
    with pytest.raises(IndexError, match="bool scalars"):
        t[True]
    with pytest.raises(IndexError, match="integer or bool"):
        t[np.array([0.5])]
    with pytest.raises(IndexError, match="unsupported index"):
        t["a"]


def test_gather_scatter_errors(device: str) -> None:
    t = ag.tensor(np.zeros((3, 4), np.float32), device=device)
    with pytest.raises(TypeError, match="index must be an integer tensor, got float32"):
        t.gather(1, ag.tensor([[0.0]], device=device))
    with pytest.raises(ValueError, match="index has 1 dimensions, input has 2"):
        t.gather(1, ag.tensor([0], device=device))
    with pytest.raises(ValueError, match="does not fit"):
        t.gather(1, ag.tensor(np.zeros((4, 1), np.int64), device=device))
    with pytest.raises(IndexError, match="out of range"):
        t.gather(2, ag.tensor([[0]], device=device))
    idx = ag.tensor([[0]], device=device)
    with pytest.raises(ValueError, match="same number of dimensions"):
        t.scatter_add(0, idx, ag.zeros(3, device=device))
    with pytest.raises(ValueError, match="does not fit"):
        t.scatter_add(0, ag.tensor(np.zeros((2, 5), np.int64), device=device),
                      ag.zeros(3, 4, device=device))
