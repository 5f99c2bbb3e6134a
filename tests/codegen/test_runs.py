"""Elementwise kernels whose threads each compute a run of neighbouring outputs
(``lower._elementwise_runs``), on every device, against NumPy on fresh random data: every stored
dtype, runs of 16, 8 and 4 bytes and none (an odd innermost axis), inputs read as vectors
(contiguous), broadcast along the run, and gathered at unaligned addresses under a bounds check
(a convolution's windows over padding, as its unfolded operand is written).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import anygpu as ag
from anygpu import dtype as dt
from anygpu.codegen import ir, lower
from anygpu.codegen.render.cstyle import render, walk
from anygpu.graph.schedule import KernelItem, schedule
from anygpu.nn.convolution import unfold2d
from conftest import as_dtype, compare, host

DTYPES = [dt.float32, dt.float16, dt.bfloat16, dt.int32]


def _kernel(out: ag.Tensor, dialect: str) -> ir.Kernel:
    items = [i for i in schedule([out.lazy]) if isinstance(i, KernelItem)]
    ast = lower.build_kernel(lower.choose_spec(items[-1].output))
    return lower.to_ir(ast, dialect, 256, {})


def _stores(kernel: ir.Kernel) -> list[ir.VecStore]:
    return [st for st in walk(kernel.body) if isinstance(st, ir.VecStore)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("inner", [64, 36, 18, 33])
def test_runs_elementwise(device: str, dtype: dt.DType, inner: int) -> None:
    """A sum of a contiguous input, one broadcast along the run and one along the rows, cast:
    runs of 16 bytes (64 elements a row), 4 (36 of 2-byte elements; 18 of 4-byte ones: 8),
    and an odd row (33, of 1,990 rows: no run of 16 bytes over both axes either) that keeps a
    thread an element."""
    d = dtype
    shape = (lower.RUNS_MIN // inner + 5, inner)
    a, b, c = host(shape, d, 1), host((shape[0], 1), d, 2), host((inner,), d, 3)
    x, y, z = (ag.tensor(v, dtype=d, device=device) for v in (a, b, c))
    out = (x * 2 + y - z).cast(d)
    f = [v.astype(np.float32) for v in (a, b, c)]
    # a fused kernel computes in float32 and rounds once, at the store
    ref = as_dtype(f[0] * 2 + f[1] - f[2], d) if d.is_float else (a * 2 + b - c).astype(d.np)
    compare(out.numpy(), ref, d)


@pytest.mark.parametrize("dtype", [dt.float32, dt.bfloat16], ids=lambda d: d.name)
@pytest.mark.parametrize("order", [(1, 4, 5, 0, 2, 3), (0, 2, 3, 1, 4, 5)], ids=["cks", "sck"])
def test_runs_unfolded_windows(device: str, dtype: dt.DType, order: tuple[int, ...]) -> None:
    """A padded input's 3x3 windows written out as a 16-bit convolution's unfolded operand:
    the window offsets outer and the pixels inner, where each run reads neighbours that start
    at any address, some of them in the padding; or the pixels outer and the channels and
    offsets inner, where a run spans several axes on CUDA (a row's pixels, channels and 3 x 3
    offsets: 40 x 3 x 9 elements)."""
    d = dtype
    n, c, h, w = 4, 3, 24, 40  # 103,680 windows' elements: above RUNS_MIN
    x = host((n, c, h, w), d, 4)
    t = ag.tensor(x, dtype=d, device=device).pad([1, 1, 1, 1])
    out = unfold2d(t, (3, 3), (1, 1), (1, 1)).permute(*order).contiguous()
    pad = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    ref = np.stack([np.stack([pad[:, :, i:i + h, j:j + w] for j in range(3)], 1)
                    for i in range(3)], 1)  # N KH KW C H W
    ref = ref.transpose(0, 3, 4, 5, 1, 2)  # as unfold2d: N C H W KH KW
    compare(out.numpy(), ref.transpose(order), d)


def test_runs_in_place_and_sliced(device: str) -> None:
    """A large update written into its own input (``x += y``: the runs read the output's
    buffer as vectors before storing them), and an input read from a row slice that starts at
    an element the vectors are not aligned to."""
    a, b = host((300, 256), dt.float32, 8), host((300, 256), dt.float32, 9)
    x, y = ag.tensor(a, device=device), ag.tensor(b, device=device)
    x += y * 2
    compare(x.numpy(), a + b * 2, dt.float32)
    c = host((301 * 256 + 1,), dt.float32, 10)
    z = ag.tensor(c, device=device)
    compare((z[1:] * 3).numpy(), c[1:] * 3, dt.float32)


def test_runs_are_chosen() -> None:
    """Where the dialect stores vectors, a large elementwise kernel stores runs of 16 bytes
    (4 float32, 8 bfloat16 on CUDA) and reads its contiguous inputs as vectors; on CUDA a run
    may span trailing axes; an odd innermost axis, a small output, OpenCL's 16-bit outputs and
    the other dialects keep a thread an element."""
    x = ag.tensor(host((512, 256), dt.float32, 5))
    k = _kernel((x * 3).relu(), "cuda")
    assert [len(st.values) for st in _stores(k)] == [4]
    assert any(isinstance(st, ir.VecLoad) for st in k.body[0].body)  # type: ignore[attr-defined]
    assert [len(st.values) for st in _stores(_kernel(x.cast(ag.bfloat16), "cuda"))] == [8]
    assert [len(st.values) for st in _stores(_kernel(x + 1, "opencl"))] == [4]
    assert not _stores(_kernel(x.cast(ag.bfloat16), "opencl"))
    assert not _stores(_kernel(x * 3, "wgsl"))
    # runs across the trailing axes (CUDA): one store of 8, the windows' reads each their own
    t = ag.tensor(host((4, 8, 16, 16), dt.bfloat16, 7), dtype=dt.bfloat16).pad([1, 1, 1, 1])
    windows = unfold2d(t, (3, 3), (1, 1), (1, 1)).permute(0, 2, 3, 1, 4, 5).contiguous()
    k = _kernel(windows, "cuda")
    assert [len(st.values) for st in _stores(k)] == [8]
    assert not any(isinstance(st, ir.VecLoad) for st in k.body[0].body)  # type: ignore[attr-defined]
    assert "uint4" in render(k, "cuda", {"cc": (9, 0)})
    assert not _stores(_kernel(windows, "opencl"))
    # an output written anywhere but at the flat index over its axes keeps a thread an element
    items = [i for i in schedule([(x * 3).lazy]) if isinstance(i, KernelItem)]
    ast = lower.build_kernel(lower.choose_spec(items[-1].output))
    shifted = dataclasses.replace(ast, out_index=ir.alu("add", ast.out_index, 1))
    assert _stores(lower.to_ir(ast, "cuda", 256, {}))
    assert not _stores(lower.to_ir(shifted, "cuda", 256, {}))
    odd = ag.tensor(host((2049, 33), dt.float32, 6))
    assert not _stores(_kernel(odd * 3, "cuda"))
    assert not _stores(_kernel(x[:4] * 3, "cuda"))


@pytest.mark.parametrize("dtype", [dt.float32, dt.float16, dt.bfloat16], ids=lambda d: d.name)
@pytest.mark.parametrize("shape", [(2, 256, 14, 14), (3, 130, 7, 33)])
def test_channels_last_copies_go_by_tiles(device: str, dtype: dt.DType,
                                          shape: tuple[int, ...]) -> None:
    """A padded NCHW input written channels-last with its bias and ReLU fused (what the tensor
    cores' convolutions read), and a plain transpose of a batch of matrices: on GPUs through
    tiles of 32 x 32 in local memory (``lower._tiled_transpose``: each side read or written in
    neighbouring addresses), at sizes that are no multiple of the tiles; against NumPy."""
    if not ag.get_device(device).supports(dtype):
        pytest.skip(f"{dtype.name} is not supported on {device}")
    rng = np.random.default_rng(sum(shape))
    xs, bs = rng.standard_normal(shape, np.float32), rng.standard_normal(shape[1], np.float32)
    x, b = (ag.tensor(v, device=device).cast(dtype).realize() for v in (xs, bs))
    out = (x + b.reshape(1, -1, 1, 1)).relu().pad([1, 1, 1, 1]).permute(0, 2, 3, 1).contiguous()
    turned = x.reshape(shape[0], shape[1], -1).permute(0, 2, 1).contiguous()
    gpu = ag.get_device(device).dialect != "c"
    for got in (out, turned):
        kernel = _kernel(got, ag.get_device(device).dialect)
        assert (kernel.meta.get("template") == "tiled transpose") == gpu
    xr, br = (v.float().numpy() for v in (x, b))
    want = np.pad(np.maximum(xr + br.reshape(1, -1, 1, 1), 0),
                  ((0, 0), (0, 0), (1, 1), (1, 1))).transpose(0, 2, 3, 1)
    tol = 0 if dtype == dt.float32 else 1e-2
    np.testing.assert_allclose(out.float().numpy(), want, rtol=tol, atol=tol)
    np.testing.assert_array_equal(turned.float().numpy(),
                                  xr.reshape(shape[0], shape[1], -1).transpose(0, 2, 1))
