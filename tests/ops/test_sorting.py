"""sort, argsort, msort, topk, kthvalue, searchsorted and bucketize against PyTorch (CPU) on every
available device: values, indices and gradients, both algorithms (ranks and the bitonic network,
forced where the cost model would pick the other), every dtype, ties, NaN, infinities, empty and
0-d tensors, non-contiguous inputs, axes of 1 to 5000 elements."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import anygpu as ag
from anygpu import dtype as dt
from anygpu.dtype import DType
from anygpu.ops import sorting

torch = pytest.importorskip("torch")

TORCH = {dt.float32: torch.float32, dt.float16: torch.float16, dt.bfloat16: torch.bfloat16,
         dt.int8: torch.int8, dt.uint8: torch.uint8, dt.int32: torch.int32,
         dt.int64: torch.int64, dt.bool_: torch.bool}


@pytest.fixture(params=["auto", "network"])
def algorithm(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The cost model's choice, or the bitonic network from blocks of 4 whatever the size (and
    topk's rounds of blocks of at least 8)."""
    if request.param == "network":
        monkeypatch.setattr(sorting, "_block_size",
                            lambda rows, n, device="cpu": 4 if n > 4 else n)
        monkeypatch.setattr(sorting, "_TOP_BLOCK", 8)
    return str(request.param)


def _data(shape: tuple[int, ...], seed: int, special: bool = True) -> np.ndarray:
    """Random floats with many ties (a few distinct values), and NaN, +-inf and -0.0 among them."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-6, 7, shape).astype(np.float32) * 0.5 + rng.choice(
        [0.0, 0.25], shape).astype(np.float32)
    if special and x.size:
        flat = x.reshape(-1)
        picks = rng.choice(flat.size, size=min(flat.size, 1 + flat.size // 8), replace=False)
        flat[picks] = rng.choice(np.array([np.nan, np.inf, -np.inf, -0.0], np.float32),
                                 picks.size)
    return x


def _same(got: ag.Tensor, want: Any) -> None:
    """Exact equality, NaN equal to NaN, dtypes' values compared as float64 (bfloat16 too)."""
    w = want.detach().float().numpy() if want.dtype.is_floating_point else want.numpy()
    g = got.numpy()
    assert g.shape == w.shape, (g.shape, w.shape)
    np.testing.assert_array_equal(g.astype(np.float64), w.astype(np.float64))


def _torch(x: np.ndarray, d: DType) -> Any:
    return torch.tensor(x).to(TORCH[d])


@pytest.mark.parametrize("n", [1, 7, 100, 1000, 5000])
@pytest.mark.parametrize("descending", [False, True])
def test_sort_matches_torch(device: str, algorithm: str, n: int, descending: bool) -> None:
    if algorithm == "network" and n == 5000 and device.startswith("opencl"):
        pytest.skip("the network over 8192 elements is covered on the other backends (slow PoCL)")
    x = _data((3, n), n)
    got = ag.sort(ag.tensor(x, device=device), descending=descending)
    want = torch.sort(torch.tensor(x), descending=descending, stable=True)
    _same(got.values, want.values)
    _same(got.indices, want.indices)
    assert got.indices.dtype == ag.int64


@pytest.mark.parametrize("dtype", [dt.float16, dt.bfloat16, dt.int8, dt.uint8, dt.int32, dt.int64,
                                   dt.bool_])
def test_sort_dtypes(device: str, algorithm: str, dtype: DType, host: Any) -> None:
    if dtype.is_float:
        x = _data((2, 100), 3).astype(np.float32)
        if dtype == dt.float16:
            x = x.astype(np.float16)
    else:
        low, high = {dt.uint8: (0, 255), dt.bool_: (0, 1)}.get(dtype, (-128, 127))
        x = host((2, 100), dtype, 5, low=low, high=high)
    if dtype == dt.int64:  # beyond 32 bits, and the extremes
        x = x.astype(np.int64) * (2**40) + np.int64(7)
        x[0, :2] = [np.iinfo(np.int64).min, np.iinfo(np.int64).max]
    t = ag.tensor(x, dtype=dtype, device=device)
    for descending in (False, True):
        got = t.sort(descending=descending)
        want = _torch(x, dtype).sort(descending=descending, stable=True)
        _same(got.values, want.values)
        _same(got.indices, want.indices)
        assert got.values.dtype == dtype


def test_sort_layouts(device: str, algorithm: str) -> None:
    """Other axes, non-contiguous inputs (a transposed view, a strided slice), negative dims."""
    x = _data((5, 6, 40), 11)
    t, tx = ag.tensor(x, device=device), torch.tensor(x)
    for dim in (0, 1, -1, -2):
        got, want = t.sort(dim), tx.sort(dim=dim, stable=True)
        _same(got.values, want.values)
        _same(got.indices, want.indices)
    view, tview = t.transpose(0, 2)[::3, 1:], tx.transpose(0, 2)[::3, 1:]
    got, want = view.sort(1, descending=True), tview.sort(dim=1, descending=True, stable=True)
    _same(got.values, want.values)
    _same(got.indices, want.indices)
    _same(ag.argsort(view, 0), torch.argsort(tview, dim=0, stable=True))
    _same(ag.msort(view), torch.msort(tview))


def test_sort_empty_and_scalar(device: str) -> None:
    for shape, dim in [((0,), 0), ((3, 0), 1), ((0, 4), 1), ((0, 4), 0), ((4, 1), 1)]:
        x = _data(shape, 1)
        got, want = ag.sort(ag.tensor(x, device=device), dim), torch.sort(torch.tensor(x), dim)
        _same(got.values, want.values)
        _same(got.indices, want.indices)
    s = ag.tensor(2.5, device=device)
    values, indices = s.sort()
    assert values.shape == () and values.item() == 2.5 and indices.item() == 0
    assert indices.dtype == ag.int64
    with pytest.raises(IndexError):
        s.sort(1)
    with pytest.raises(IndexError):
        ag.tensor([1.0, 2.0], device=device).sort(2)


def test_sort_result_type(device: str) -> None:
    t = ag.tensor([3.0, 1.0, 2.0], device=device)
    out = t.sort(descending=True)
    values, indices = out
    assert out.values is values and out.indices is indices and out[1] is indices
    assert values.tolist() == [3.0, 2.0, 1.0] and indices.tolist() == [0, 2, 1]
    assert "values=" in repr(out)
    top = t.topk(1)
    assert top.values.tolist() == [3.0] and top.indices.tolist() == [0]


@pytest.mark.parametrize("n", [7, 100])
def test_sort_gradients(device: str, algorithm: str, n: int) -> None:
    x = np.random.default_rng(n).standard_normal((3, n)).astype(np.float32)
    x[0, :4] = -5.0  # ties (outside the top 3, whose ties PyTorch breaks its own way)
    weight = np.random.default_rng(n + 1).standard_normal((3, n)).astype(np.float32)
    t = ag.tensor(x, device=device, requires_grad=True)
    tx = torch.tensor(x, requires_grad=True)
    for lib, v in ((ag, t), (torch, tx)):
        w = lib.tensor(weight) if lib is torch else ag.tensor(weight, device=device)
        s = lib.sort(v, dim=1, descending=True, stable=True) if lib is torch else \
            lib.sort(v, dim=1, descending=True)
        top = lib.topk(v, 3, dim=1) if lib is torch else v.topk(3, dim=1)
        ((s.values * w).sum() + (top.values ** 2).sum()).backward()
    assert t.grad is not None and tx.grad is not None
    np.testing.assert_allclose(t.grad.numpy(), tx.grad.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,k,largest", [(100, 1, True), (100, 3, True), (100, 3, False),
                                         (100, 100, False), (100, 0, True), (5000, 5, True),
                                         (1000, 70, False)])
def test_topk(device: str, algorithm: str, n: int, k: int, largest: bool) -> None:
    x = _data((4, n), 21)
    got = ag.tensor(x, device=device).topk(k, dim=1, largest=largest)
    # ours: sorted, equal values by index (PyTorch leaves the order of ties open)
    want = torch.sort(torch.tensor(x), dim=1, descending=largest, stable=True)
    _same(got.values, want.values[:, :k])
    _same(got.indices, want.indices[:, :k])
    _same(got.values, torch.topk(torch.tensor(x), k, 1, largest=largest).values)


def test_topk_and_kthvalue_edges(device: str) -> None:
    x = _data((3, 5), 2)
    t = ag.tensor(x, device=device)
    with pytest.raises(RuntimeError, match="selected index k out of range"):
        t.topk(6)
    with pytest.raises(RuntimeError, match="k out of range"):
        t.kthvalue(6)
    with pytest.raises(IndexError):
        ag.tensor(np.zeros((2, 0), np.float32), device=device).kthvalue(1)
    s = ag.tensor(1.5, device=device)
    assert s.topk(1).values.item() == 1.5 and s.kthvalue(1).indices.item() == 0
    empty = ag.tensor(np.zeros((2, 0), np.float32), device=device).topk(0)
    assert empty.values.shape == (2, 0) and empty.indices.dtype == ag.int64


@pytest.mark.parametrize("keepdim", [False, True])
def test_kthvalue(device: str, algorithm: str, keepdim: bool) -> None:
    x = _data((4, 9), 8)
    t, tx = ag.tensor(x, device=device), torch.tensor(x)
    for k in (1, 5, 9):
        got = t.kthvalue(k, 1, keepdim)
        want = tx.kthvalue(k, 1, keepdim)
        _same(got.values, want.values)
        picked = ag.tensor(x, device=device).gather(1, got.indices if keepdim
                                                    else got.indices.unsqueeze(1))
        _same(picked if keepdim else picked.squeeze(1), want.values)  # the index of that value


@pytest.mark.parametrize("right", [False, True])
def test_searchsorted(device: str, right: bool) -> None:
    rng = np.random.default_rng(4)
    seq = np.sort(rng.integers(-20, 20, 37)).astype(np.float32)  # repeated values
    values = np.concatenate([rng.integers(-25, 25, 40).astype(np.float32),
                             seq[:5], [np.nan, np.inf, -np.inf]]).astype(np.float32)
    got = ag.searchsorted(ag.tensor(seq, device=device), ag.tensor(values, device=device),
                          right=right)
    _same(got, torch.searchsorted(torch.tensor(seq), torch.tensor(values), right=right))
    # rows of sequences, a NaN at a row's end, values of another shape and dtype
    seqs = np.sort(rng.standard_normal((3, 16)).astype(np.float32), 1)
    seqs[1, -2:] = np.nan
    vals = rng.integers(-3, 3, (3, 5)).astype(np.int64)
    side = "right" if right else "left"
    got = ag.searchsorted(ag.tensor(seqs, device=device), ag.tensor(vals, device=device),
                          side=side, out_int32=True)
    want = torch.searchsorted(torch.tensor(seqs), torch.tensor(vals).float(), side=side,
                              out_int32=True)
    _same(got, want)
    assert got.dtype == ag.int32
    # an unsorted sequence with a sorter, a scalar value, an empty sequence
    raw = rng.permutation(seq)
    sorter = np.argsort(raw, kind="stable")
    got = ag.searchsorted(ag.tensor(raw, device=device), ag.tensor(values, device=device),
                          right=right, sorter=ag.tensor(sorter, device=device))
    _same(got, torch.searchsorted(torch.tensor(raw), torch.tensor(values), right=right,
                                  sorter=torch.tensor(sorter)))
    assert ag.searchsorted(ag.tensor(seq, device=device), 3.0, right=right).item() == \
        torch.searchsorted(torch.tensor(seq), 3.0, right=right).item()
    empty = ag.searchsorted(ag.tensor(np.zeros(0, np.float32), device=device),
                            ag.tensor(values, device=device))
    assert empty.tolist() == [0] * values.size


def test_bucketize_and_errors(device: str) -> None:
    bounds = np.array([-1.0, 0.0, 0.5, 2.0], np.float32)
    x = np.random.default_rng(9).uniform(-2, 3, (3, 4)).astype(np.float32)
    x[0, :2] = [0.0, 2.0]  # on a boundary
    for right in (False, True):
        got = ag.bucketize(ag.tensor(x, device=device), ag.tensor(bounds, device=device),
                           right=right)
        _same(got, torch.bucketize(torch.tensor(x), torch.tensor(bounds), right=right))
    with pytest.raises(RuntimeError, match="boundaries tensor must be 1 dimension"):
        ag.bucketize(ag.tensor(x, device=device), ag.tensor(x, device=device))
    with pytest.raises(RuntimeError, match="first N-1 dimensions"):
        ag.searchsorted(ag.tensor(x, device=device), ag.tensor(bounds, device=device))
    with pytest.raises(RuntimeError, match="opposites"):
        ag.searchsorted(ag.tensor(bounds, device=device), 1.0, side="left", right=True)


def test_network_stages_share_one_kernel(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every stage of the network runs the same compiled kernel (its (mask, half) are data)."""
    from anygpu.graph import schedule

    monkeypatch.setattr(sorting, "_block_size", lambda rows, n, device="cpu": 2)
    x = ag.tensor(_data((2, 64), 6), device=device).realize()
    before = len(schedule._compiled)
    x.sort()[1].numpy()
    first = len(schedule._compiled) - before
    assert first <= 8, first  # the stage kernel once, and the kernels around the network
