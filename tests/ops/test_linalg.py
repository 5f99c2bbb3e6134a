"""matmul against NumPy: vectors, matrices, batched broadcasts, integer and half types."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import anygpu as ag
from anygpu.dtype import DType
from anygpu.ops.linalg import outer

seeds = st.integers(0, 2**32 - 1)
SHAPES = [((4,), (4,)), ((4,), (4, 3)), ((2, 4), (4,)), ((3, 4), (4, 5)), ((1, 33), (33, 2)),
          ((3, 4), (2, 4, 5)), ((2, 1, 3, 4), (5, 4, 2))]


def _cases() -> list[Any]:
    """float32 with every shape; the other dtypes (whose loops are the same) with two each."""
    out = [pytest.param(ag.float32, s, id=f"float32-{k}") for k, s in enumerate(SHAPES)]
    others = [ag.float16, ag.bfloat16, ag.int32, ag.int8]
    for k, d in enumerate(others):
        for j in (k, k + len(others)):
            out.append(pytest.param(d, SHAPES[j % len(SHAPES)], id=f"{d.name}-{j % len(SHAPES)}"))
    return out


@pytest.mark.parametrize("dtype,shapes", _cases())
@given(seed=seeds)
def test_matmul(device: str, dtype: DType, shapes: tuple, seed: int, make: Any,
                check: Any) -> None:
    kw = {"low": -1.0, "high": 1.0} if dtype.is_float else {"low": -5, "high": 5}
    a, ta = make(shapes[0], dtype, seed, device, **kw)
    b, tb = make(shapes[1], dtype, seed + 1, device, **kw)
    af, bf = a.astype(np.float64), b.astype(np.float64)
    ref = np.matmul(af, bf)
    if dtype == ag.int8:
        ref = np.matmul(a.astype(np.int64), b.astype(np.int64)).astype(np.int8)  # wraps
    k = shapes[0][-1]
    # sums of k products: the tolerance of one rounding, scaled by the number of terms
    tol = {} if not dtype.is_float else {"atol": {ag.float32: 1e-5, ag.float16: 2e-3,
                                                  ag.bfloat16: 2e-2}[dtype] * max(k / 8, 1)}
    check(ta @ tb, ref, dtype, **tol)
    check(ta.matmul(tb), ref, dtype, **tol)


@given(seed=seeds)
def test_matmul_promotes_and_fuses(device: str, seed: int, make: Any, check: Any) -> None:
    a, ta = make((3, 4), ag.int32, seed, device)
    b, tb = make((4, 2), ag.float32, seed + 1, device)
    check(ta @ tb, a.astype(np.float64) @ b, ag.float32)
    check((tb.T @ ta.T.float() + 1).relu(), np.maximum(b.T @ a.T.astype(np.float64) + 1, 0),
          ag.float32)
    check(ta.dot(ta[0]), a.astype(np.int64) @ a[0], ag.int32)
    check(outer(ta[0], tb[:, 0]), np.outer(a[0], b[:, 0]), ag.float32)
    check(b.T @ tb, b.T.astype(np.float64) @ b, ag.float32)  # a NumPy array on the left


def test_matmul_errors(device: str) -> None:
    a = ag.zeros(3, 4, device=device)
    with pytest.raises(ValueError, match=r"shapes \(3, 4\) and \(3, 4\) do not match \(4 != 3\)"):
        a @ a
    with pytest.raises(ValueError, match="at least one dimension"):
        a @ ag.tensor(1.0, device=device)
    with pytest.raises(TypeError, match="bool"):
        a.bool() @ a.T.bool()
    with pytest.raises(TypeError, match="expects a Tensor"):
        a.matmul([[1.0]] * 4)
    with pytest.raises(ValueError, match="cannot be broadcast"):
        ag.zeros(2, 3, 4, device=device) @ ag.zeros(3, 4, 5, device=device)


@pytest.mark.parametrize("k", [128, 200, 256, 4096])
def test_matrix_vector_products_read_as_vectors(device: str, k: int) -> None:
    """Products whose rows a few threads sum in chunks of neighbouring elements, read as
    vectors where the row splits into them (128, 256, 4096), element by element where not
    (200); float32, float16 and bfloat16 weights where the device has them, against NumPy."""
    rng = np.random.default_rng()
    x = rng.standard_normal((2, 1, k)).astype(np.float32)
    w = rng.standard_normal((1024, k)).astype(np.float32) / np.float32(np.sqrt(k))
    tx, tw = ag.tensor(x, device=device), ag.tensor(w, device=device)
    np.testing.assert_allclose((tx @ tw.T).numpy(), x @ w.T, rtol=1e-4, atol=1e-4)
    if ag.get_device(device).supports(ag.float16):
        h = tx.cast(ag.float16) @ tw.cast(ag.float16).T
        ref = x.astype(np.float16).astype(np.float32) @ w.astype(np.float16).astype(np.float32).T
        np.testing.assert_allclose(h.float().numpy(), ref, rtol=2e-2, atol=2e-2)
    if ag.get_device(device).supports(ag.bfloat16):
        xb, wb = tx.cast(ag.bfloat16), tw.cast(ag.bfloat16)
        ref = xb.float().numpy() @ wb.float().numpy().T
        np.testing.assert_allclose((xb @ wb.T).float().numpy(), ref, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("cols", [32, 96, 1024])
def test_sums_along_a_strided_axis_of_few_outputs(device: str, cols: int) -> None:
    """Few outputs, each summing a long strided axis (a bias's gradient, attention's weighted
    sum of cached values at decode), which several threads per output share: sum, max and a
    logsumexp (a stage reading the other's result) against NumPy."""
    rng = np.random.default_rng()
    x = rng.standard_normal((3000, cols)).astype(np.float32)
    t = ag.tensor(x, device=device)
    np.testing.assert_allclose(t.sum(0).numpy(), x.sum(0), rtol=1e-4, atol=1e-3)
    np.testing.assert_array_equal(t.max(0).values.numpy(), x.max(0))
    m = x.max(0)
    want = m + np.log(np.exp(x - m).sum(0))
    np.testing.assert_allclose(t.logsumexp(0).numpy(), want, rtol=1e-5, atol=1e-5)
    probs = rng.random((32, 1, 579)).astype(np.float32)
    values = rng.standard_normal((32, 579, 128)).astype(np.float32)
    got = (ag.tensor(probs, device=device) @ ag.tensor(values, device=device)).numpy()
    np.testing.assert_allclose(got, probs @ values, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("rows", [1, 3, 16, 17])
def test_matrix_vector_products_of_long_rows(device: str, rows: int) -> None:
    """Decode-shaped products ``x @ W.T``: rows of 1024 or more summed by a few threads each,
    several rows (sequences) reading each weight once where they can (up to 16), and two
    products summed in one loop (SwiGLU's gate and up), against NumPy."""
    rng = np.random.default_rng()
    k, n = 1536, 1024
    x = rng.standard_normal((rows, 1, k)).astype(np.float32)
    wg, wu = (rng.standard_normal((n, k)).astype(np.float32) / np.float32(40) for _ in range(2))
    tx, tg, tu = (ag.tensor(a, device=device) for a in (x, wg, wu))
    np.testing.assert_allclose((tx @ tg.T).numpy(), x @ wg.T, rtol=1e-4, atol=1e-4)
    gate, up = x @ wg.T, x @ wu.T
    want = gate / (1 + np.exp(-gate)) * up
    got = ((tx @ tg.T).silu() * (tx @ tu.T)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    if ag.get_device(device).supports(ag.float16):
        h = tx.cast(ag.float16) @ tg.cast(ag.float16).T
        ref = x.astype(np.float16).astype(np.float32) @ wg.astype(np.float16).astype(np.float32).T
        np.testing.assert_allclose(h.float().numpy(), ref, rtol=2e-2, atol=2e-2)
