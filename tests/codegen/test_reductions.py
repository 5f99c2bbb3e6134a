"""Reductions with one work-group per output (``lower._group_per_output``) on every device: rows of
awkward lengths, every reduction kind and dtype, against NumPy on fresh random data.

Where the device has subgroups (CUDA's warps, OpenCL's and WebGPU's subgroups) the work-group's
values combine through them (``lower._combine_subgroups``), elsewhere through local memory; the
results must agree with NumPy either way, NaN propagating through max and min as it does there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import anygpu as ag
from anygpu import dtype as dt
from anygpu.codegen import ir, lower
from anygpu.codegen.render.cstyle import render
from anygpu.dtype import DType
from anygpu.graph.schedule import KernelItem, device_features, schedule
from anygpu.runtime.registry import get_device
from conftest import host, tolerance

# 1: no reduction left (a size-1 axis is dropped); 31 and 33: either side of a warp; 1000: a
# partly filled stride; 4097: one past a power of two, below the length where sums are split
LENGTHS = (1, 31, 33, 1000, 4097)
ROWS = 3  # few outputs: a work-group each

EPS32 = 2.0**-24


def _nan_rows(x: np.ndarray, seed: int) -> np.ndarray:
    """``x`` with a NaN at a random place of row 0 and at the end of row 2 (a lane of the last
    subgroup), row 1 left without."""
    x = x.copy()
    rng = np.random.default_rng(seed)
    x[0, rng.integers(x.shape[1])] = np.nan
    x[2, -1] = np.nan
    return x


def _one_true(x: np.ndarray, value: bool, seed: int) -> np.ndarray:
    """Row 0 random, row 1 all ``not value`` but one ``value`` at a random place, row 2 all
    ``not value``: any/all must see a single lane."""
    x = x.copy()
    rng = np.random.default_rng(seed)
    x[1:] = not value
    x[1, rng.integers(x.shape[1])] = value
    return x


# kind -> (the op, NumPy's answer, host data kwargs)
Kind = tuple[Callable[[ag.Tensor], ag.Tensor], Callable[[np.ndarray], np.ndarray], dict[str, Any]]
KINDS: dict[str, Kind] = {
    "sum": (lambda t: t.sum(1), lambda x: x.sum(1, dtype=np.float64 if x.dtype.kind == "f"
                                                 else np.int64), {}),
    # an integer sum into its own dtype (no widening to int64): int8 wraps as it goes
    "sum_same_dtype": (lambda t: t.sum(1, dtype=t.dtype), lambda x: x.sum(1, dtype=x.dtype),
                       {"low": -100, "high": 100}),
    "max": (lambda t: t.amax(1), lambda x: x.max(1), {"low": -1000, "high": 1000}),
    "min": (lambda t: t.amin(1), lambda x: x.min(1), {"low": -1000, "high": 1000}),
    "prod": (lambda t: t.prod(1), lambda x: x.astype(np.float64).prod(1) if x.dtype.kind == "f"
             else x.astype(np.int64).prod(1), {"low": -3, "high": 3, "away_from_zero": 1}),
    "softmax": (lambda t: t.softmax(1), lambda x: _softmax(x), {}),
    "any": (lambda t: t.any(1), lambda x: x.any(1), {}),
    "all": (lambda t: t.all(1), lambda x: x.all(1), {}),
    # along the slow axis of a (n, 3) tensor: still a work-group per output, strided reads
    "sum_columns": (lambda t: t.reshape(ROWS, -1).t().contiguous().t().sum(1),
                    lambda x: x.astype(np.float64).sum(1), {}),
}

CASES = [
    ("sum", dt.float32), ("sum", dt.float16), ("sum", dt.bfloat16), ("sum", dt.int32),
    ("sum", dt.int64), ("sum", dt.int8), ("sum", dt.bool_),
    ("sum_same_dtype", dt.int32), ("sum_same_dtype", dt.int8),
    ("max", dt.float32), ("max", dt.float16), ("max", dt.bfloat16), ("max", dt.int32),
    ("max", dt.int64), ("max", dt.int8), ("max", dt.uint8),
    ("min", dt.float32), ("min", dt.float16), ("min", dt.int64), ("min", dt.uint8),
    ("prod", dt.float32), ("prod", dt.float16), ("prod", dt.int32), ("prod", dt.int64),
    ("softmax", dt.float32), ("softmax", dt.float16),
    ("any", dt.bool_), ("all", dt.bool_), ("sum_columns", dt.float32),
]


def _softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    e = np.exp(x - x.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def _data(kind: str, dtype: DType, n: int, seed: int) -> np.ndarray:
    kwargs = dict(KINDS[kind][2])
    if dtype.is_float and kind == "prod":  # near 1, so 4097 factors stay in float16's range
        kwargs = {"low": 0.95, "high": 1.05}
    elif dtype.is_float and kind in ("max", "min"):
        kwargs = {}
    elif dtype == dt.uint8:
        kwargs = {"low": 0, "high": 255}
    x = host((ROWS, n), dtype, seed, **kwargs)
    if kind in ("max", "min") and dtype.is_float:
        x = _nan_rows(x, seed)
    if kind in ("any", "all"):
        x = _one_true(x, kind == "any", seed)
    return x


def _check(got: np.ndarray, want: np.ndarray, x: np.ndarray, kind: str, out_dtype: DType) -> None:
    if not out_dtype.is_float:
        np.testing.assert_array_equal(got, want.astype(out_dtype.np))
        return
    rtol, _ = tolerance(out_dtype)
    if kind == "prod":
        rtol = max(rtol, 4 * x.shape[1] * EPS32)  # a rounding per factor
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=rtol)
        return
    if kind == "softmax":
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=max(rtol, 1e-4),
                                   atol=1e-7)
        return
    # a sum's rounding error: each thread adds about n / 256 values, then a tree of depth
    # log2(256) (or a subgroup's) combines them; 64 roundings of the sum of magnitudes bound it
    magnitude = np.abs(x.astype(np.float64)).sum(1).max()
    atol = 64 * EPS32 * magnitude if kind.startswith("sum") else 0.0
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol,
                               atol=atol)  # NaN where NumPy has NaN (equal_nan)


def _subgroups(device: str) -> bool:
    return bool(device_features(get_device(device)).get("subgroup"))


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("kind,dtype", CASES)
def test_row_reduction(device: str, kind: str, dtype: DType, n: int) -> None:
    if not _subgroups(device) and n != LENGTHS[CASES.index((kind, dtype)) % len(LENGTHS)]:
        # the local-memory combine, which the rest of the suite covers too: each case at one
        # length (every length still comes up), so that slow compilers (PoCL) stay quick
        pytest.skip("without subgroups: one length per case")
    op, ref, _ = KINDS[kind]
    seed = 1000 * n + CASES.index((kind, dtype))
    x = _data(kind, dtype, n, seed)
    t = ag.tensor(x, dtype=dtype, device=device)
    out = op(t)
    want = ref(x.astype(np.float32) if dtype == dt.bfloat16 else x)
    got = out.numpy()  # bfloat16 reads as float32
    assert got.shape == want.shape
    _check(got, want, x.astype(np.float32) if dtype == dt.bfloat16 else x, kind, out.dtype)


def test_full_reduction(device: str) -> None:
    """All of a tensor to one value: a single work-group (after the split into partial sums
    where the tensor is large)."""
    x = host((3, 4097), dt.float32, 7)
    t = ag.tensor(x, device=device)
    np.testing.assert_allclose(t.sum().numpy(), x.astype(np.float64).sum(), rtol=1e-5,
                               atol=64 * EPS32 * np.abs(x).sum())
    y = _nan_rows(x, 8)
    assert np.isnan(ag.tensor(y, device=device).max().numpy())
    np.testing.assert_array_equal(ag.tensor(y[1], device=device).max().numpy(), y[1].max())


def test_subgroups_in_the_source(device: str) -> None:
    """A device that reports subgroups reduces its rows through them."""
    dev = get_device(device)
    if not _subgroups(device):
        pytest.skip(f"{dev.name} has no subgroups")
    x = ag.tensor(host((ROWS, 1000), dt.float32, 9), device=device)
    (item,) = [i for i in schedule([x.sum(1).lazy]) if isinstance(i, KernelItem)]
    kernel = lower.to_ir(item.ast, dev.dialect, dev.info.max_local_size, device_features(dev))
    source = render(kernel, dev.dialect)
    assert {"cuda": "__shfl_xor_sync", "hip": "__shfl_xor", "opencl": "sub_group_reduce_add",
            "wgsl": "subgroupAdd"}[dev.dialect] in source


def test_subgroups_switch(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """ANYGPU_SUBGROUPS=0 combines through local memory: the feature is part of the compiled
    kernels' key, so the same graph compiles again rather than reusing the subgroup kernel."""
    if not _subgroups(device):
        pytest.skip(f"{device} has no subgroups")
    from anygpu import config
    from anygpu.graph import schedule as sched

    x = host((ROWS, 1000), dt.float32, 11)
    want = x.astype(np.float64).sum(1)
    t = ag.tensor(x, device=device)
    (item,) = [i for i in schedule([t.sum(1).lazy]) if isinstance(i, KernelItem)]
    np.testing.assert_allclose(t.sum(1).numpy(), want, rtol=1e-5, atol=1e-4)
    monkeypatch.setenv("ANYGPU_SUBGROUPS", "0")
    config.reload()
    try:
        assert "subgroup" not in device_features(get_device(device))
        np.testing.assert_allclose(t.sum(1).numpy(), want, rtol=1e-5, atol=1e-4)
        number = sched.signature_id(item.signature)  # (the compiled kernels' key)
        kernels = [k for (sid, *_), (_, k) in sched._compiled.items() if sid == number]
        assert len(kernels) == 2
        # subgroups: one barrier; local memory: one per halving of 256 values, and two more
        barriers = sorted(sum(isinstance(s, ir.Barrier) for s in k.body) for k in kernels)
        assert barriers == [1, 10]
    finally:
        monkeypatch.delenv("ANYGPU_SUBGROUPS")
        config.reload()


def test_chunk_index_folding() -> None:
    """``lower._fold`` simplifies remainders and quotients only where it may: the variables it
    is told are not negative, constant offsets of 0 or more; constant arithmetic folds as C
    computes it (truncating division, a remainder with the dividend's sign)."""
    i32 = dt.int32
    ridx, other = ir.var("ridx", i32), ir.var("other", i32)
    known = frozenset({"ridx"})

    def fold(e: ir.Expr) -> ir.Expr:
        return lower._fold(e, known, {})

    def c(v: int) -> ir.Expr:
        return ir.const(v, i32)

    elem = ir.alu("add", ir.alu("mul", ridx, c(32)), c(5))  # ridx * 32 + 5
    assert fold(ir.alu("mod", elem, c(4))) is c(1)
    assert fold(ir.alu("idiv", elem, c(4))) is ir.alu("add", ir.alu("mul", ridx, c(8)), c(1))
    assert fold(ir.alu("idiv", elem, c(32))) is ridx
    # a variable not known to be at least 0, a stride that is no multiple, a negative offset
    for e in (ir.alu("add", ir.alu("mul", other, c(32)), c(5)),
              ir.alu("add", ir.alu("mul", ridx, c(6)), c(5)),
              ir.alu("add", ir.alu("mul", ridx, c(32)), c(-5))):
        assert fold(ir.alu("mod", e, c(4))).op == "mod"
    assert fold(ir.alu("idiv", c(-7), c(2))) is c(-3)
    assert fold(ir.alu("mod", c(-7), c(2))) is c(-1)
    shift = ir.alu("shr", ir.var("w", i32), ir.alu("mul", ir.alu("mod", elem, c(4)), c(8)))
    assert fold(shift).srcs[1] is c(8)  # a 4-bit weight's shift within its word
    # shifts past the word's width are left for the renderer's guarded shift
    assert fold(ir.alu("shl", c(1), c(40))).op == "shl"
