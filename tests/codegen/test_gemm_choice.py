"""The SIMT GEMM template's default tiles (``gemm.choose``) for the shapes whose choice was
measured: a batch of products counts all its outputs, transform-like products (a side of 16,
another of millions, a few summed elements) take their own tiles, and a batch summed along a
long k keeps 64 x 64 tiles; and such products computed on every backend against NumPy."""

from __future__ import annotations

import numpy as np
import pytest

import anygpu as ag
from anygpu.codegen import ir
from anygpu.codegen.templates import gemm
from anygpu.dtype import float32

H200_UNITS = 132


def _contraction(batch: int, m: int, n: int, k: int, x_along_k: bool = True,
                 y_along_n: bool = True) -> gemm.Contraction:
    x = ir.load("b1", float32, ir.var("i"))
    y = ir.load("b2", float32, ir.var("j"))
    return gemm.Contraction([("m", m)], [("n", n)], [("k", k)],
                            [("b", batch)] if batch > 1 else [], x, y, x_along_k, y_along_n)


def _tiles(opts: gemm.GemmOptions | None) -> tuple[int, int, int, int, int]:
    assert opts is not None
    return opts.block_m, opts.block_n, opts.thread_m, opts.thread_n, opts.slices


def test_a_batch_of_products_counts_all_its_outputs() -> None:
    # Winograd's 16 products of a 14 x 14 layer of 512 channels at batch 16: 128 x 128 tiles,
    # as one product of 16 times its outputs would take; one such product alone is too small
    # for them (the ladder's 64 x 32 tiles in two slices)
    alone = gemm.choose(_contraction(1, 512, 784, 512), 1024, H200_UNITS)
    batched = gemm.choose(_contraction(16, 512, 784, 512), 1024, H200_UNITS)
    assert _tiles(alone) == (64, 32, 8, 4, 2)
    assert _tiles(batched) == (128, 128, 8, 8, 1)


def test_a_batch_summed_along_a_long_k_keeps_64_by_64_tiles() -> None:
    # Winograd's weight gradients: both operands in runs along 12,544 tiles
    opts = gemm.choose(_contraction(16, 256, 256, 12544, y_along_n=False), 1024, H200_UNITS)
    assert _tiles(opts) == (64, 64, 8, 8, 2)
    # ... and skips the ladder's 128 x 64 tiles along a shorter one
    opts = gemm.choose(_contraction(16, 512, 512, 784, y_along_n=False), 1024, H200_UNITS)
    assert _tiles(opts) == (64, 64, 8, 8, 2)
    # a split weight gradient of a 64-channel convolution: tiles 64 wide along its 64 rows
    opts = gemm.choose(_contraction(32, 64, 576, 25088), 1024, H200_UNITS)
    assert opts is not None and opts.block_m == 64


@pytest.mark.parametrize("k,along_k,want", [(4, True, (128, 64, 8, 8, 1)),
                                            (16, True, (64, 64, 4, 4, 1)),
                                            (16, False, (64, 32, 8, 4, 2))])
def test_transform_like_products_take_their_own_tiles(k: int, along_k: bool,
                                                      want: tuple[int, ...]) -> None:
    tall = gemm.choose(_contraction(1, 1 << 20, 16, k, x_along_k=along_k), 1024, H200_UNITS)
    assert _tiles(tall) == want
    # the same product transposed: the tile transposed
    wide = gemm.choose(_contraction(1, 16, 1 << 20, k, y_along_n=not along_k), 1024,
                       H200_UNITS)
    assert _tiles(wide) == (want[1], want[0], want[3], want[2], want[4])
    # a linear layer of 16 rows over a long sum keeps the 16-row tiles
    rows = gemm.choose(_contraction(1, 16, 4096, 4096), 1024, H200_UNITS)
    assert _tiles(rows)[:2] == (16, 64)


@pytest.mark.parametrize("k", [4, 16])
def test_transform_like_products_match_numpy(device: str, k: int) -> None:
    rng = np.random.default_rng(k)
    a = rng.standard_normal((1 << 16, k)).astype(np.float32)
    b = rng.standard_normal((k, 16)).astype(np.float32)
    tall = (ag.tensor(a, device=device) @ ag.tensor(b, device=device)).numpy()
    np.testing.assert_allclose(tall, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-4)
    wide = (ag.tensor(b.T.copy(), device=device) @ ag.tensor(a.T.copy(), device=device)).numpy()
    np.testing.assert_allclose(wide, b.T.astype(np.float64) @ a.T, rtol=1e-5, atol=1e-4)
    batched = rng.standard_normal((4, 64, 96)).astype(np.float32)
    other = rng.standard_normal((4, 96, 80)).astype(np.float32)
    got = (ag.tensor(batched, device=device) @ ag.tensor(other, device=device)).numpy()
    np.testing.assert_allclose(got, batched.astype(np.float64) @ other, rtol=1e-4, atol=1e-4)
