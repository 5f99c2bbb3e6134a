"""Matrix products through the contraction kernels (the tiled GEMM template on cuda, opencl and
webgpu; BLAS and a compiled epilogue on the processor) against PyTorch, at sizes that are no
multiple of any tile: transposed operands read in place, batches (broadcast too), fused
epilogues, reduced precisions and gradients."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch

import anygpu as ag
from anygpu.codegen import lower
from anygpu.graph.schedule import KernelItem, schedule
from anygpu.nn import functional as F
from anygpu.ops.primitives import Op
from anygpu.runtime.registry import get_device

F32 = ag.float32
TOL = {ag.float32: (2e-4, 2e-4), ag.float16: (2e-2, 2e-2), ag.bfloat16: (5e-2, 5e-2)}
TORCH = {ag.float32: torch.float32, ag.float16: torch.float16, ag.bfloat16: torch.bfloat16}


def _kernel_names(t: ag.Tensor) -> list[str]:
    dev = get_device(t.device)
    return [lower.to_ir(i.ast, dev.dialect, dev.info.max_local_size).name
            for i in schedule([t.lazy]) if isinstance(i, KernelItem)]


def _uses_template(t: ag.Tensor) -> bool:
    return any(n.startswith("gemm_") for n in _kernel_names(t))


def _rand(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _check(got: ag.Tensor, want: torch.Tensor, dtype: ag.DType) -> None:
    rtol, atol = TOL[dtype]
    w = want.float().numpy()
    scale = max(float(np.abs(w).max()), 1.0)
    np.testing.assert_allclose(got.float().numpy(), w, rtol=rtol, atol=atol * scale)


def _check_after_adam(got: ag.Tensor, want: torch.Tensor, dtype: ag.DType, lr: float,
                      steps: int) -> None:
    """Parameters after ``steps`` Adam steps. Adam moves an element by about ``lr`` a step
    whatever its gradient's size, so an element whose gradient lies within rounding of zero
    (summed in another order on a machine with more cores) may move the other way: at most 1%
    of the elements may differ, by at most 2 * lr * steps; the rest keep the dtype's
    tolerance."""
    rtol, atol = TOL[dtype]
    g, w = got.float().numpy(), want.float().numpy()
    scale = max(float(np.abs(w).max()), 1.0)
    off = np.abs(g - w) > atol * scale + rtol * np.abs(w)
    assert off.mean() <= 0.01, f"{int(off.sum())} of {off.size} parameters differ"
    np.testing.assert_allclose(g[off], w[off], rtol=0, atol=2 * lr * steps)


@pytest.mark.parametrize("m,k,n", [(200, 70, 150), (129, 33, 257), (64, 300, 40), (1000, 9, 33),
                                   (17500, 72, 60), (50, 40, 21000)])
def test_shapes(device: str, m: int, k: int, n: int) -> None:
    a, b = _rand((m, k), m), _rand((k, n), n)
    out = ag.tensor(a, device=device) @ ag.tensor(b, device=device)
    # GPUs: the tiled template; the processor: its BLAS and the epilogue, for large products
    on_cpu = device.partition(":")[0] == "cpu"
    assert _uses_template(out) == (not on_cpu or m * k * n >= 1 << 21)
    _check(out, torch.from_numpy(a) @ torch.from_numpy(b), F32)


@pytest.mark.parametrize("ta,tb", [(True, False), (False, True), (True, True)])
def test_transposed_operands_in_place(device: str, ta: bool, tb: bool) -> None:
    a = _rand((90, 130) if ta else (130, 90), 1)
    b = _rand((70, 90) if tb else (90, 70), 2)
    x, y = ag.tensor(a, device=device), ag.tensor(b, device=device)
    x, y = (x.T if ta else x), (y.T if tb else y)
    out = x @ y
    assert len(_kernel_names(out)) == 1  # no copy of the transposed operand
    want = (torch.from_numpy(a).T if ta else torch.from_numpy(a)) @ \
        (torch.from_numpy(b).T if tb else torch.from_numpy(b))
    _check(out, want, F32)


def test_batched_and_broadcast(device: str) -> None:
    a, b, c = _rand((3, 70, 90), 3), _rand((3, 90, 50), 4), _rand((90, 50), 5)
    x, y, z = (ag.tensor(v, device=device) for v in (a, b, c))
    ta, tb, tc = (torch.from_numpy(v) for v in (a, b, c))
    _check(x @ y, ta @ tb, F32)
    _check(x @ z, ta @ tc, F32)
    _check(ag.tensor(_rand((2, 1, 40, 64), 6), device=device) @
           ag.tensor(_rand((3, 64, 48), 7), device=device),
           torch.from_numpy(_rand((2, 1, 40, 64), 6)) @ torch.from_numpy(_rand((3, 64, 48), 7)),
           F32)


def test_fused_epilogue(device: str) -> None:
    a, b, bias, res = _rand((150, 80), 8), _rand((80, 120), 9), _rand((120,), 10), \
        _rand((150, 120), 11)
    x, y, z, r = (ag.tensor(v, device=device) for v in (a, b, bias, res))
    out = ((x @ y + z).relu() * 0.5 + r).cast(ag.float16) if get_device(device).supports(
        ag.float16) else (x @ y + z).relu() * 0.5 + r
    assert len(_kernel_names(out)) == 1  # bias, activation, scaling, residual, cast: one kernel
    ta, tb, tz, tr = (torch.from_numpy(v) for v in (a, b, bias, res))
    _check(out, (ta @ tb + tz).relu() * 0.5 + tr, ag.float16 if out.dtype == ag.float16 else F32)


@pytest.mark.parametrize("dtype", [ag.float16, ag.bfloat16])
def test_reduced_precision(device: str, dtype: ag.DType) -> None:
    if not get_device(device).supports(dtype):
        pytest.skip(f"{dtype.name} is not supported on {device}")
    a, b = _rand((96, 200), 12), _rand((200, 72), 13)
    x = ag.tensor(a, device=device).cast(dtype)
    y = ag.tensor(b, device=device).cast(dtype)
    out = x @ y
    assert out.dtype == dtype
    want = (torch.from_numpy(a).to(TORCH[dtype]).float() @
            torch.from_numpy(b).to(TORCH[dtype]).float())
    _check(out, want, dtype)


def test_gradients(device: str) -> None:
    a, b, g = _rand((120, 70), 14), _rand((70, 90), 15), _rand((120, 90), 16)
    x = ag.tensor(a, device=device, requires_grad=True)
    y = ag.tensor(b, device=device, requires_grad=True)
    (x @ y * ag.tensor(g, device=device)).sum().backward()
    tx = torch.from_numpy(a).requires_grad_()
    ty = torch.from_numpy(b).requires_grad_()
    (tx @ ty * torch.from_numpy(g)).sum().backward()
    assert x.grad is not None and y.grad is not None
    _check(x.grad, tx.grad, F32)
    _check(y.grad, ty.grad, F32)


def test_nan_and_inf_propagate(device: str) -> None:
    a, b = _rand((64, 64), 17), _rand((64, 64), 18)
    a[3, 5], b[7, 9] = np.nan, np.inf
    out = (ag.tensor(a, device=device) @ ag.tensor(b, device=device)).numpy()
    want = (torch.from_numpy(a) @ torch.from_numpy(b)).numpy()
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(out), np.isinf(want))


def test_float32_matmul_precision(device: str) -> None:
    """"highest" (the default) is exact float32; "high" allows tf32 tensor cores where the device
    has them (CUDA, compute capability 8.0 and newer), elsewhere it changes nothing."""
    assert ag.get_float32_matmul_precision() == "highest"
    with pytest.raises(ValueError, match="precision must be one of"):
        ag.set_float32_matmul_precision("fast")
    a, b = _rand((192, 160), 19), _rand((160, 136), 20)
    want = torch.from_numpy(a).double() @ torch.from_numpy(b).double()
    ag.set_float32_matmul_precision("high")
    try:
        out = ag.tensor(a, device=device) @ ag.tensor(b, device=device)
        dev = get_device(device)
        cc = dev.info.extra.get("cc", (0, 0))
        tensor_cores = dev.dialect == "cuda" and cc >= (8, 0)
        item = [i for i in schedule([out.lazy]) if isinstance(i, KernelItem)][0]
        kernel = lower.to_ir(item.ast, dev.dialect, dev.info.max_local_size,
                             {"cc": cc, "tf32": True})
        assert ("tensor cores" in kernel.meta.get("template", "")) == tensor_cores
        got = out.numpy().astype(np.float64)
        scale = float(np.abs(want.numpy()).max())
        # tf32 keeps 10 bits of each operand's mantissa; exact float32 far more
        bound = 4e-3 if tensor_cores else 1e-5
        assert np.abs(got - want.numpy()).max() <= bound * scale
    finally:
        ag.set_float32_matmul_precision("highest")


def test_tensor_core_kernel_renders(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tf32 tensor-core kernel for a computed operand as CUDA renders it (checked here
    without a GPU; the GPU check runs it): staged through registers, one mma.sync per 16 x 8
    fragment and k-step, operands from padded local tiles."""
    from anygpu.codegen.render.cstyle import render
    from anygpu.graph import schedule as sched

    a = ag.tensor(_rand((1024, 128), 21))
    b = ag.tensor(_rand((128, 1024), 22))
    # scheduled as for a GPU (the processor stores a computed operand of a product for BLAS)
    monkeypatch.setattr(sched, "_dialect", lambda device: "cuda")
    item = [i for i in schedule([((a.exp() @ b) + 1).lazy]) if isinstance(i, KernelItem)][0]
    kernel = lower.to_ir(item.ast, "cuda", 1024, {"cc": (9, 0), "tf32": True})
    assert kernel.local == 256 and "tensor cores (tf32)" in kernel.meta["template"]
    source = render(kernel, "cuda")
    assert source.count("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32") == 16
    assert "__shared__ __align__(16) float xs[" in source
    simt = lower.to_ir(item.ast, "cuda", 1024, {"cc": (7, 5), "tf32": True}).meta["template"]
    assert "tensor cores" not in simt and "per thread" in simt  # before sm_80: the SIMT one


def test_implicit_convolution_shares_its_tap_arithmetic(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 3x3 convolution as the SIMT template renders it for CUDA (checked without a GPU): a
    thread stages four elements of the windows' tile and two of the filters' per k-step, all
    at the same channel and tap, so the channel and tap (k / 3, k / 3 / 3, k % 3) are worked
    out once per k-step, not once per element (16 divisions by 3 in the kernel before)."""
    from anygpu.codegen.render.cstyle import render
    from anygpu.graph import schedule as sched

    x = ag.tensor(_rand((16, 64, 56, 56), 31))
    w = ag.tensor(_rand((64, 64, 3, 3), 32))
    monkeypatch.setattr(sched, "_dialect", lambda device: "cuda")
    items = [i for i in schedule([F.conv2d(x, w, padding=1).lazy]) if isinstance(i, KernelItem)]
    kernel = lower.to_ir(items[-1].ast, "cuda", 1024, {"cc": (9, 0), "max_shared": 227 * 1024})
    assert "per thread" in kernel.meta["template"]
    source = render(kernel, "cuda")
    loads = source.count("b1[") + source.count("b2[")
    assert loads >= 8  # several elements of each operand a thread, before and in the loop
    # the tap's row and the channel (k / 3, then / 3 again) before the loop and in it
    assert source.count("/ 3)") == 4 and source.count("% 3)") == 4, source


def _template(t: ag.Tensor) -> str:
    dev = get_device(t.device)
    features = {"cc": dev.info.extra.get("cc", (0, 0)),
                "tf32": ag.get_float32_matmul_precision() != "highest",
                "max_shared": dev.info.extra.get("max_shared", 48 * 1024)}
    items = [i for i in schedule([t.lazy]) if isinstance(i, KernelItem)]
    return lower.to_ir(items[-1].ast, dev.dialect, dev.info.max_local_size,
                       features).meta.get("template", "")


def _pipelined_here(device: str) -> bool:
    dev = get_device(device)
    return dev.dialect == "cuda" and dev.info.extra.get("cc", (0, 0)) >= (8, 0)


@pytest.mark.parametrize("dtype", [ag.float16, ag.bfloat16])
@pytest.mark.parametrize("ta,tb", [(False, False), (False, True), (True, False), (True, True)])
def test_half_precision_tensor_cores(device: str, dtype: ag.DType, ta: bool, tb: bool) -> None:
    """float16 and bfloat16 products large enough for the pipelined tensor-core template on CUDA
    (cp.async and ldmatrix; transposed operands read in place through ldmatrix's transpose), at
    sizes that are no multiple of its tiles and a k that is no multiple of its step, with a
    fused bias and activation; elsewhere the same products through the device's template."""
    if not get_device(device).supports(dtype):
        pytest.skip(f"{dtype.name} is not supported on {device}")
    m, k, n = 200, 264, 136
    a = _rand((k, m) if ta else (m, k), 23)
    b = _rand((n, k) if tb else (k, n), 24)
    bias = _rand((n,), 25)
    x = ag.tensor(a, device=device).cast(dtype).realize()
    y = ag.tensor(b, device=device).cast(dtype).realize()
    x, y = x.T if ta else x, y.T if tb else y
    out = (x @ y + ag.tensor(bias, device=device).cast(dtype)).relu()
    assert ("cp.async" in _template(out)) == _pipelined_here(device)
    ta_, tb_ = (torch.from_numpy(v).to(TORCH[dtype]).float() for v in (a, b))
    want = ((ta_.T if ta else ta_) @ (tb_.T if tb else tb_) +
            torch.from_numpy(bias).to(TORCH[dtype]).float()).relu()
    _check(out, want, dtype)


def test_half_precision_batched_and_unaligned(device: str) -> None:
    """A batched float16 product through the pipelined template, and one whose k (a multiple of
    no 8) keeps its rows from 16-byte copies, so another template takes it."""
    if not get_device(device).supports(ag.float16):
        pytest.skip(f"float16 is not supported on {device}")
    for shape_a, shape_b, pipelined in [((3, 200, 96), (3, 96, 136), True),
                                        ((150, 100), (100, 120), False)]:
        a, b = _rand(shape_a, 26), _rand(shape_b, 27)
        x = ag.tensor(a, device=device).half().realize()
        out = x @ ag.tensor(b, device=device).half().realize()
        assert ("cp.async" in _template(out)) == (pipelined and _pipelined_here(device))
        want = torch.from_numpy(a).half().float() @ torch.from_numpy(b).half().float()
        _check(out, want, ag.float16)


def test_pipelined_tensor_core_kernel_renders() -> None:
    """The float16 pipelined kernel as CUDA renders it (checked here without a GPU; the GPU check
    runs it): a ring of cp.async stages in dynamic shared memory, ldmatrix fragments (transposed
    for an operand whose rows are not along k) and one mma.sync per 16 x 8 fragment and 16 of k."""
    from anygpu.codegen.render.cstyle import render

    a = ag.tensor(_rand((2048, 512), 28)).half().realize()
    b = ag.tensor(_rand((512, 2048), 29)).half().realize()
    item = [i for i in schedule([(a @ b).lazy]) if isinstance(i, KernelItem)][-1]
    kernel = lower.to_ir(item.ast, "cuda", 1024, {"cc": (9, 0), "max_shared": 227 * 1024})
    assert "128x128x64 tiles, 2x2 warps, 3-stage cp.async" in kernel.meta["template"]
    source = render(kernel, "cuda")
    assert source.startswith("/* dynamic shared memory: ")
    assert "extern __shared__" in source
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in source  # y is [k][n]
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in source  # x is [m][k]
    # 4 steps of 16 in k, each 4 x 8 fragments of 16 x 8 per warp
    assert source.count("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32") == 4 * 4 * 8
    assert source.count("cp.async.wait_group") == 2
    # tf32 from float32 operands: ldmatrix for x ([m][k]), element reads for y ([k][n])
    a32, b32 = ag.tensor(_rand((2048, 512), 28)), ag.tensor(_rand((512, 2048), 29))
    item32 = [i for i in schedule([(a32 @ b32).lazy]) if isinstance(i, KernelItem)][-1]
    tf32 = lower.to_ir(item32.ast, "cuda", 1024,
                       {"cc": (9, 0), "tf32": True, "max_shared": 227 * 1024})
    assert "tensor cores (tf32), 128x128x32 tiles, 2x2 warps, 3-stage" in tf32.meta["template"]
    source = render(tf32, "cuda")
    assert source.count("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32") == 4 * 4 * 8
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in source and ".trans" not in source
    small = lower.to_ir(item.ast, "cuda", 1024, {"cc": (8, 6), "max_shared": 48 * 1024})
    assert "2-stage cp.async" in small.meta["template"]  # what 48 KiB holds
    assert not render(small, "cuda").startswith("/* dynamic")


@pytest.mark.parametrize("ta,tb", [(False, False), (False, True), (True, False), (True, True)])
def test_tf32_layouts(device: str, ta: bool, tb: bool) -> None:
    """float32 products with tf32 allowed, at sizes that are no multiple of the tiles, each
    operand layout read in place: the pipelined tensor-core template on CUDA (ldmatrix where the
    rows run along k, element reads elsewhere), exact float32 on other devices."""
    m, k, n = 200, 268, 136
    a = _rand((k, m) if ta else (m, k), 30)
    b = _rand((n, k) if tb else (k, n), 31)
    x, y = ag.tensor(a, device=device), ag.tensor(b, device=device)
    ag.set_float32_matmul_precision("high")
    try:
        out = (x.T if ta else x) @ (y.T if tb else y)
        assert ("cp.async" in _template(out)) == _pipelined_here(device)
        got = out.numpy().astype(np.float64)
    finally:
        ag.set_float32_matmul_precision("highest")
    ta_, tb_ = torch.from_numpy(a).double(), torch.from_numpy(b).double()
    want = ((ta_.T if ta else ta_) @ (tb_.T if tb else tb_)).numpy()
    assert np.abs(got - want).max() <= 4e-3 * float(np.abs(want).max())


def _few_rows(device: str, dtype: ag.DType, rows: int, k: int, n: int = 1000
              ) -> tuple[ag.Tensor, torch.Tensor]:
    """A batched decode step's feed-forward product: ``rows`` RMS-normalized activations
    against SwiGLU's two weight matrices of ``n`` rows, and the same in PyTorch."""
    x, nw = _rand((rows, 1, k), 30 + rows), _rand((k,), 31)
    wg, wu = _rand((n, k), 32) / np.float32(np.sqrt(k)), _rand((n, k), 33) / np.float32(np.sqrt(k))
    tx, tn, tg, tu = (ag.tensor(v, device=device).cast(dtype).realize() for v in (x, nw, wg, wu))
    xf = tx.float()
    h = (xf * (xf.square().mean(-1, keepdim=True) + 1e-5).rsqrt()).cast(dtype) * tn
    out = (h @ tg.T).silu() * (h @ tu.T)
    px, pn, pg, pu = (torch.from_numpy(v).to(TORCH[dtype]) for v in (x, nw, wg, wu))
    pf = px.float()
    ph = ((pf * torch.rsqrt(pf.square().mean(-1, keepdim=True) + 1e-5)).to(TORCH[dtype]) *
          pn).float()
    want = torch.nn.functional.silu(ph @ pg.float().T) * (ph @ pu.float().T)
    return out, want


@pytest.mark.parametrize("dtype", [ag.float16, ag.bfloat16])
@pytest.mark.parametrize("rows,k", [(2, 1056), (5, 2048), (9, 1056), (16, 2048)])
def test_few_rows_against_large_matrices(device: str, dtype: ag.DType, rows: int,
                                         k: int) -> None:
    """Products of a few rows (a batched decode step's sequences) against 1000-row weight
    matrices, each weight read once for every row: on tensor cores on CUDA from sm_80 (the
    rows an mma fragment's m), elsewhere on the device's segments. The normalization is fused
    in and SwiGLU's two products summed in one loop; k a multiple of 32 that the warps' steps
    divide (2048) and one they do not (1056), columns no multiple of a work-group's; against
    PyTorch."""
    if not get_device(device).supports(dtype):
        pytest.skip(f"{dtype.name} is not supported on {device}")
    out, want = _few_rows(device, dtype, rows, k)
    assert ("tensor-core rows" in _template(out)) == _pipelined_here(device)
    _check(out, want, dtype)


@pytest.mark.parametrize("rows,k,cols", [(16, 2304, 1030), (24, 1000, 520), (17, 4096, 300)])
def test_float32_batch_of_rows_takes_tiles(device: str, rows: int, k: int, cols: int) -> None:
    """A linear layer of a batch of 16 to 31 rows in float32 (a CNN's classifier at batch 16),
    as ``x @ w.T`` and ``w @ x.T``: on GPUs the template's tiles of 16 rows, each weight read
    once (the generic reduction read the weights once per row: AlexNet's first classifier layer
    took 3.5 ms on an H200); against PyTorch."""
    x, w = _rand((rows, k), rows), _rand((cols, k), cols)
    tx, tw = ag.tensor(x, device=device), ag.tensor(w, device=device)
    on_cpu = device.partition(":")[0] == "cpu"
    for got, want in ((tx @ tw.T, torch.from_numpy(x) @ torch.from_numpy(w).T),
                      (tw @ tx.T, torch.from_numpy(w) @ torch.from_numpy(x).T)):
        assert _uses_template(got) or on_cpu
        _check(got, want, F32)


@pytest.mark.parametrize("dtype", [ag.float16, ag.bfloat16])
def test_16_bit_batch_of_rows_against_weights_along_columns(device: str, dtype: ag.DType) -> None:
    """A 16-bit linear layer's input gradient at a batch of 16 (``g @ w``, the weights running
    along the product's columns, not along k, so the tensor cores' rows template does not read
    them): on GPUs the SIMT template's tiles of 16 rows, each weight read once (the generic
    reduction ran VGG-16's at 163 GB/s on an H100); the forward product ``x @ w.T`` stays with
    the rows template on CUDA from sm_80. Both operands stored in 16 bits, as a model's are (a
    cast fused into the product reads float32, which the rows template does not). Against
    PyTorch."""
    if not get_device(device).supports(dtype):
        pytest.skip(f"{dtype.name} is not supported on {device}")
    g, w = _rand((16, 512), 50), _rand((512, 1040), 51) / np.float32(np.sqrt(512))
    tg, tw = (ag.tensor(v, device=device).cast(dtype).realize() for v in (g, w))
    got = tg @ tw
    on_cpu = device.partition(":")[0] == "cpu"
    assert on_cpu or _template(got).startswith("gemm 16x64x16 tiles")
    pg, pw = (torch.from_numpy(v).to(TORCH[dtype]) for v in (g, w))
    _check(got, (pg.float() @ pw.float()), dtype)
    # (a forward product sums a multiple of 32 elements, as the rows template reads them)
    x, w2 = (_rand(shape, seed) for shape, seed in (((16, 1056), 52), ((512, 1056), 59)))
    tx, tw2 = (ag.tensor(v, device=device).cast(dtype).realize() for v in (x, w2))
    got = tx @ tw2.T
    assert ("tensor-core rows" in _template(got)) == _pipelined_here(device)
    px, pw2 = (torch.from_numpy(v).to(TORCH[dtype]) for v in (x, w2))
    _check(got, px.float() @ pw2.float().T, dtype)


def test_16_bit_rows_tiles_render() -> None:
    """Checked without a GPU (the GPU check runs them): a 16-bit product of 16 rows whose long
    side's operand runs along its columns takes the SIMT tiles of 16 rows on CUDA; along k (a
    linear layer's forward product) the tensor cores' rows template, and at 24 rows (more than
    that template takes) the generic reduction still; float32 the tiles either way, along k
    with 32-element k-steps and four groups an SM."""
    def template(dtype: ag.DType, along_k: bool, rows: int = 16) -> str:
        g = ag.tensor(_rand((rows, 2048), 53)).cast(dtype).realize()
        w = ag.tensor(_rand((1000, 2048) if along_k else (2048, 1000), 54)).cast(dtype).realize()
        out = g @ w.T if along_k else g @ w
        item = [i for i in schedule([out.lazy]) if isinstance(i, KernelItem)][-1]
        kernel = lower.to_ir(item.ast, "cuda", 1024, {"cc": (9, 0), "subgroup": 32})
        return kernel.meta.get("template", "")

    assert template(ag.bfloat16, False).startswith("gemm 16x64x16 tiles")
    assert template(ag.float16, False).startswith("gemm 16x64x16 tiles")
    assert template(ag.bfloat16, True).startswith("tensor-core rows")
    assert template(ag.bfloat16, True, 24) == ""
    assert template(ag.bfloat16, False, 24).startswith("gemm 16x64x16 tiles")
    assert template(ag.float32, True).startswith("gemm 16x64x32 tiles")
    assert template(ag.float32, True).endswith("4 groups per SM")
    assert template(ag.float32, False).startswith("gemm 16x64x16 tiles")


def _tf32_convolution_step(device: str) -> tuple[list, list]:
    """A 64-channel convolution's training step in tf32 with its windows left where they lie
    (``ANYGPU_CONV_UNFOLD=0``, as for windows over 1 GiB): (the kernels it ran, [output,
    input gradient, weight gradient] each as (anygpu's, PyTorch's in float64))."""
    from anygpu import config
    from anygpu.graph import schedule as sched

    xs, ws = _rand((4, 64, 64, 64), 57), _rand((64, 64, 3, 3), 58) * 0.05
    ran: list[KernelItem] = []
    real = sched._run_kernel
    mp = pytest.MonkeyPatch()
    mp.setenv("ANYGPU_CONV_UNFOLD", "0")
    mp.setattr(sched, "_run_kernel", lambda item: (ran.append(item), real(item)))
    config.reload()
    ag.set_float32_matmul_precision("high")
    try:
        x = ag.tensor(xs, device=device).requires_grad_()
        w = ag.tensor(ws, device=device).requires_grad_()
        out = F.conv2d(x, w, padding=1)
        (out ** 2).sum().backward()
        got = [out.numpy(), x.grad.numpy(), w.grad.numpy()]  # type: ignore[union-attr]
    finally:
        ag.set_float32_matmul_precision("highest")
        mp.undo()
        config.reload()
    tx, tw = (torch.from_numpy(v).double().requires_grad_() for v in (xs, ws))
    want = torch.nn.functional.conv2d(tx, tw, padding=1)
    (want ** 2).sum().backward()
    refs = [want.detach().numpy(), tx.grad.numpy(), tw.grad.numpy()]  # type: ignore[union-attr]
    return ran, list(zip(got, refs))


def test_tf32_staged_tiles_of_64_along_a_narrow_side(device: str) -> None:
    """A tf32 convolution of 64 channels whose windows are not written out (VGG-16's at 224 x
    224, over 1 GiB): on CUDA from sm_80 its forward product, its input gradient's and its
    weight gradient's partial products (a batch of 64 x 576) are staged through registers on
    64 x 64 tiles; exact float32 elsewhere. Against PyTorch in float64."""
    ran, pairs = _tf32_convolution_step(device)
    tol = 4e-3 if _pipelined_here(device) else 1e-5  # tf32's 10-bit mantissa, or float32
    for got, want in pairs:
        assert np.abs(got - want).max() <= tol * float(np.abs(want).max())
    if _pipelined_here(device):
        dev = get_device(device)
        features = {"cc": dev.info.extra.get("cc", (0, 0)), "tf32": True,
                    "max_shared": dev.info.extra.get("max_shared", 48 * 1024)}
        templates = [lower.to_ir(k.ast, dev.dialect, dev.info.max_local_size,
                                 features).meta.get("template", "") for k in ran]
        staged = [t for t in templates if "64x64x8 tiles, 2x2 warps, register staging" in t]
        assert len(staged) == 3, templates


def test_tf32_staged_narrow_tiles_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same step scheduled as for an H100 (checked without a GPU): the forward product and
    the weight gradient's partial products on the register-staged 64 x 64 tf32 tiles. (The
    processor's graph takes the input gradient as the windows' gradient, 16,384 x 576, a
    product with no narrow side.)"""
    kernels = _as_on_hopper(monkeypatch)
    _, pairs = _tf32_convolution_step("cpu")
    features = dict(HOPPER, tf32=True)
    templates = [lower.to_ir(k.ast, "cuda", 1024, features).meta.get("template", "")
                 for k in kernels]
    staged = [t for t in templates if "64x64x8 tiles, 2x2 warps, register staging" in t]
    assert len(staged) == 2, templates
    for got, want in pairs:  # (computed on the processor, in float32)
        assert np.abs(got - want).max() <= 1e-5 * float(np.abs(want).max())


def test_tf32_warpgroup_kernel_renders() -> None:
    """Checked without a GPU (the GPU check runs it): a float32 product whose operands both run
    along k, where products may run as tf32 on Hopper, takes the warpgroup template with
    wgmma's tf32 shape (k of 8, no transpose: tf32 tiles run along k); one whose weights run
    along their columns keeps mma.sync's pipelined template."""
    from anygpu.codegen.render.cstyle import render

    features = dict(HOPPER, tf32=True)
    a, b = (ag.tensor(_rand(shape, seed)).realize()
            for shape, seed in (((512, 256), 60), ((384, 256), 61)))

    def lowered(out: ag.Tensor) -> Any:
        item = [i for i in schedule([out.lazy]) if isinstance(i, KernelItem)][-1]
        return lower.to_ir(item.ast, "cuda", 1024, features)

    kernel = lowered(a @ b.T)
    assert kernel.meta["template"].startswith("gemm wgmma tensor cores (tf32)")
    source = render(kernel, "cuda")
    assert "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32" in source
    assert "p, 1, 1;" in source  # scales, and no transpose operands
    along_columns = lowered(a @ ag.tensor(_rand((256, 384), 62)).realize())
    assert along_columns.meta["template"].startswith("gemm tensor cores (tf32)")


def test_tensor_core_rows_kernel_renders() -> None:
    """The tensor-core rows kernel as CUDA renders it (checked here without a GPU; the GPU check
    runs it): the raw words of the rows (scaled rows, computed by a kernel of their own) and of
    the weights read as 16-byte vectors straight into the fragments, two mma.sync per fragment
    and block of 32; devices before sm_80 keep the segments, and float32 products take the
    SIMT template's tiles of 16 rows."""
    from anygpu.codegen.render.cstyle import render

    def last_kernel(dtype: ag.DType, features: dict) -> Any:
        x, scale, w = _rand((16, 1, 2048), 40), _rand((16, 1, 1), 41), _rand((1000, 2048), 42)
        tx, tw = (ag.tensor(v).cast(dtype).realize() for v in (x, w))
        h = (tx.float() * ag.tensor(scale).realize()).cast(dtype)
        item = [i for i in schedule([(h @ tw.T).lazy]) if isinstance(i, KernelItem)][-1]
        return lower.to_ir(item.ast, "cuda", 1024, features)

    kernel = last_kernel(ag.float16, {"cc": (9, 0), "subgroup": 32})
    assert kernel.meta["template"] == "tensor-core rows (16 rows, 8 columns a group)"
    source = render(kernel, "cuda")
    # a fragment of 8 columns, 2 halves of a block of 32, 4 blocks a step
    assert source.count("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32") == 8
    # raw words of the two rows' halves and the weights', for each of the 4 blocks
    assert source.count("reinterpret_cast<const unsigned int*>") == 4 * 3
    assert "template" not in last_kernel(ag.float16, {"cc": (7, 5), "subgroup": 32}).meta
    # float32: the SIMT template's tiles of 16 rows
    assert last_kernel(ag.float32, {"cc": (9, 0), "subgroup": 32}).meta["template"].startswith(
        "gemm 16x64x32 tiles")


def _bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (nearest, ties to even), as float32."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


@pytest.mark.parametrize("dtype,low,high", [("float16", -8, 7), ("float16", -128, 127),
                                            ("bfloat16", -8, 7)])
def test_packed_weights_in_half_arithmetic_equal_the_rounded_product(dtype: str, low: int,
                                                                     high: int) -> None:
    """The identity the tensor-core rows unpack 4-bit and 8-bit weights by (``mma_rows._pair``):
    an integer n put in the mantissa of a power of two P (bits P | (n - low)), P - low taken
    away and the scale multiplied in, each step rounded to the 16-bit dtype, equals the float32
    product n * scale rounded once, for every n and scales of every magnitude (subnormal to
    large)."""
    from anygpu.codegen.templates import mma_rows

    top, power = mma_rows._MANTISSA[getattr(ag, dtype)]
    rng = np.random.default_rng(44)
    scales = np.concatenate([rng.uniform(-1, 1, 3000) * 10.0 ** rng.integers(-7, 4, 3000),
                             [6.1e-5, -6.0e-8, 1.0, 60000.0 / 128]]).astype(np.float32)
    n = np.arange(low, high + 1, dtype=np.float32)
    with np.errstate(over="ignore"):  # large scales overflow to inf, the same either way
        got, want = _two_ways(dtype, top, power, low, n, scales)
    assert np.array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32),
                          equal_nan=True)


def _two_ways(dtype: str, top: int, power: int, low: int, n: np.ndarray, scales: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
    """(n * scale made in 16-bit arithmetic from the mantissa, the float32 product rounded)."""
    if dtype == "float16":
        s = scales.astype(np.float16)
        bits = (power | (n - low).astype(np.uint16)).astype(np.uint16).view(np.float16)
        values = bits - np.float16(top - low)  # float16 arithmetic, rounded each step
        got = values[:, None] * s[None, :]
        want = (n[:, None] * s.astype(np.float32)[None, :]).astype(np.float16)
        np.testing.assert_array_equal(values.astype(np.float32), n)
    else:
        s = _bfloat16(scales)
        bits = ((power | (n - low).astype(np.uint32)) << 16).astype(np.uint32).view(np.float32)
        values = _bfloat16(bits - _bfloat16(np.float32(top - low)))
        got = _bfloat16(values[:, None] * s[None, :])
        want = _bfloat16(n[:, None] * s[None, :])
        np.testing.assert_array_equal(values, n)
    return got, want


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_one_row_against_packed_weights_renders_on_tensor_cores(kind: str) -> None:
    """A decode step's product of one row and 4-bit (or 8-bit) weights as CUDA renders it:
    the tensor-core rows kernel, each lane reading a run of 32 weights (one 16-byte load of
    4-bit weights, 32 bytes of 8-bit), the weights unpacked and scaled two at a time in half2
    arithmetic; one row of float16 weights keeps the segments (it runs at the memory's rate)."""
    from anygpu.codegen.render.cstyle import render
    from anygpu.llm import quant

    rng = np.random.default_rng(43)
    qw = quant.quantize(rng.standard_normal((512, 1024)).astype(np.float32), kind, 32, "cpu",
                        ag.float16)
    x = ag.tensor(rng.standard_normal((1, 1024)).astype(np.float16)).realize()
    features = {"cc": (9, 0), "subgroup": 32}
    item = [i for i in schedule([qw.linear(x).lazy]) if isinstance(i, KernelItem)][-1]
    kernel = lower.to_ir(item.ast, "cuda", 1024, features)
    assert kernel.meta["template"] == "tensor-core rows (1 rows, 8 columns a group)"
    source = render(kernel, "cuda")
    # 2 mmas for each of the run's 4 blocks
    assert source.count("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32") == 8
    # the fragment's 16 registers made two weights at a time
    assert source.count("halves2_mul<__half2>(") == 16
    assert "__float2half_rn((float)" not in source  # no weight rounded from float32
    w = ag.tensor(rng.standard_normal((512, 1024)).astype(np.float16)).realize()
    item = [i for i in schedule([(x @ w.T).lazy]) if isinstance(i, KernelItem)][-1]
    assert "template" not in lower.to_ir(item.ast, "cuda", 1024, features).meta


@pytest.mark.parametrize("ta,tb", [(False, True), (False, False), (True, False)])
def test_warpgroup_kernel_renders(ta: bool, tb: bool) -> None:
    """On a device with Hopper's warpgroup instructions (the feature "wgmma"), a float16
    product as CUDA renders it (checked here without a GPU; the GPU check runs it): cp.async
    copies into 128-byte-swizzled tiles of a ring of stages in dynamic shared memory aligned to
    1024 bytes, fenced for the tensor cores' reads, and per step of 64 along k four wgmmas of
    64 x 128 x 16 per warpgroup, the previous step's group still in flight; an operand whose
    lines run along its rows instead of k is read transposed."""
    from anygpu.codegen.render.cstyle import render

    a = _rand((512, 2048) if ta else (2048, 512), 28)
    b = _rand((2048, 512) if tb else (512, 2048), 29)
    x, y = ag.tensor(a).half().realize(), ag.tensor(b).half().realize()
    out = (x.T if ta else x) @ (y.T if tb else y)
    item = [i for i in schedule([out.lazy]) if isinstance(i, KernelItem)][-1]
    features = {"cc": (9, 0), "wgmma": True, "units": 132, "max_shared": 227 * 1024}
    kernel = lower.to_ir(item.ast, "cuda", 1024, features)
    assert kernel.meta["template"] == \
        "gemm wgmma tensor cores, 128x128x64 tiles, 2 warpgroups, 6-stage cp.async"
    assert kernel.local == 256
    source = render(kernel, "cuda")
    assert source.startswith("/* dynamic shared memory: 196608 bytes */")
    assert "extern __shared__ __align__(1024)" in source
    assert source.count("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16") == 4
    # transposed where the operand's lines run along its rows: x when ta, y unless tb
    assert source.count(f"p, 1, 1, {int(ta)}, {int(not tb)};") == 4
    assert re.search(r" \^ \(\w+ % 8\)\)", source)  # the swizzle: chunk ^ (line % 8)
    for sync in ("fence.proxy.async.shared::cta", "wgmma.fence.sync.aligned",
                 "wgmma.commit_group.sync.aligned", "wgmma.wait_group.sync.aligned 1",
                 "wgmma.wait_group.sync.aligned 0"):
        assert sync in source
    # without the feature (Ampere, or ANYGPU_WGMMA=0): mma.sync
    plain = lower.to_ir(item.ast, "cuda", 1024, {"cc": (9, 0), "max_shared": 227 * 1024})
    assert "wgmma" not in render(plain, "cuda")


def _conv_step(device: str, dtype: ag.DType, seed: int) -> tuple[Any, ...]:
    """A convolution large enough to be unfolded for tensor cores on GPUs (2 x 64 x 32 x 32, 64
    filters of 3 x 3: 75M multiply-adds) in ``dtype``, forward and both gradients, beside
    PyTorch's float32 computation on the same rounded values."""
    xs, ws, gs = _rand((2, 64, 32, 32), seed), _rand((64, 64, 3, 3), seed + 1) * 0.05, \
        _rand((2, 64, 32, 32), seed + 2)
    x = ag.tensor(xs, device=device).cast(dtype).realize().requires_grad_()
    w = ag.tensor(ws, device=device).cast(dtype).realize().requires_grad_()
    out = ag.nn.functional.conv2d(x, w, padding=1)
    (out.float() * ag.tensor(gs, device=device)).sum().backward()
    tx, tw = (torch.from_numpy(v).to(TORCH[dtype]).float().requires_grad_() for v in (xs, ws))
    want = torch.nn.functional.conv2d(tx, tw, padding=1)
    (want * torch.from_numpy(gs)).sum().backward()
    return out, x.grad, w.grad, want.detach(), tx.grad, tw.grad


@pytest.mark.parametrize("dtype", [ag.float16, ag.bfloat16])
def test_16_bit_convolutions_on_tensor_cores(device: str, dtype: ag.DType) -> None:
    """float16 and bfloat16 convolutions, forward and both gradients, against PyTorch: on CUDA
    the products read the padded inputs stored channels inner on the pipelined tensor-core
    templates; elsewhere through the device's own kernels."""
    if not get_device(device).supports(dtype):
        pytest.skip(f"{dtype.name} is not supported on {device}")
    x = ag.tensor(_rand((2, 64, 32, 32), 40), device=device).cast(dtype).realize()
    w = ag.tensor(_rand((64, 64, 3, 3), 41), device=device).cast(dtype).realize()
    assert ("cp.async" in _template(ag.nn.functional.conv2d(x, w, padding=1))) == \
        _pipelined_here(device)
    out, gx, gw, want, want_gx, want_gw = _conv_step(device, dtype, 42)
    for got, ref in ((out, want), (gx, want_gx), (gw, want_gw)):
        assert got.dtype == dtype
        _check(got, ref, dtype)


HOPPER = {"cc": (9, 0), "wgmma": True, "max_shared": 227 * 1024, "units": 132}


def _as_on_hopper(monkeypatch: pytest.MonkeyPatch) -> list[KernelItem]:
    """Schedule the processor's graphs as for an H100 (run on the processor): the kernels
    scheduled from now on. (The plans made meanwhile are dropped with the test.)"""
    from anygpu.graph import plans
    from anygpu.graph import schedule as sched

    monkeypatch.setattr(plans, "_plans", {})
    monkeypatch.setattr(sched, "_dialect", lambda device: "cuda")
    monkeypatch.setitem(get_device("cpu").info.extra, "cc", (9, 0))
    kernels: list[KernelItem] = []
    real = sched.schedule

    def recorded(outputs, *order):
        items = real(outputs, *order)
        kernels.extend(i for i in items if isinstance(i, KernelItem))
        return items

    monkeypatch.setattr(sched, "schedule", recorded)
    return kernels


def test_16_bit_convolutions_unfold_for_tensor_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scheduled as for a GPU with tensor cores (checked here without one; the GPU check runs
    it): a bfloat16 convolution's forward product reads its padded input stored once with the
    channels innermost (not its windows, nine times the input's size), summing the channels
    last, the weights written out in that order; the weight gradient's windows are written out
    by a kernel of their own. All three products read plain buffers on the warpgroup and
    cp.async templates, and the numbers stay PyTorch's."""
    kernels = _as_on_hopper(monkeypatch)
    out, gx, gw, want, want_gx, want_gw = _conv_step("cpu", ag.bfloat16, 43)
    for got, ref in ((out, want), (gx, want_gx), (gw, want_gw)):
        _check(got, ref, ag.bfloat16)
    templates = [lower.to_ir(k.ast, "cuda", 1024, HOPPER).meta.get("template", "")
                 for k in kernels]
    products = [t for t in templates if t.startswith("gemm")]
    assert len(products) == 3, templates  # forward, the windows' gradient, the weights'
    assert all("cp.async" in t for t in products), products
    assert sum("wgmma" in t for t in products) >= 2, products
    shapes = [k.ast.output.shape for k in kernels]
    assert shapes.count((1, 1, 64, 3, 3, 2, 32, 32)) == 1, shapes  # the weight gradient's
    assert shapes.count((2, 34, 34, 64)) == 1, shapes  # the padded input, channels inner
    assert shapes.count((1, 1, 1, 1, 64, 3, 3, 64)) == 1, shapes  # the weights, (kh, kw, c)


@pytest.mark.parametrize("dtype", [ag.bfloat16, ag.float32])
def test_convolution_gradients_read_channels_last_inputs(monkeypatch: pytest.MonkeyPatch,
                                                        dtype: ag.DType) -> None:
    """Scheduled as for an H100 (checked here without one; the GPU check runs it), with the
    data gradient a convolution of the output's gradient as on GPUs: in bfloat16 and in tf32,
    no product's windows are written out. The forward product and the data gradient read
    their padded inputs (the input, the output's gradient) stored channels inner, and the
    weight gradient sums over windows ordered (row, column, channel) of its own such copy of
    the input; all three on the tensor cores' cp.async templates, the numbers PyTorch's."""
    from anygpu.graph import schedule as sched
    from anygpu.nn import convolution

    monkeypatch.setattr(convolution, "_gradient_convolves", lambda device: True)
    monkeypatch.setattr(sched, "get_float32_matmul_precision", lambda: "high")
    kernels = _as_on_hopper(monkeypatch)
    out, gx, gw, want, want_gx, want_gw = _conv_step("cpu", dtype, 45)
    out.realize()
    for got, ref in ((out, want), (gx, want_gx), (gw, want_gw)):
        _check(got, ref, ag.bfloat16 if dtype == ag.bfloat16 else ag.float32)
    features = dict(HOPPER, tf32=dtype == ag.float32)
    templates = [lower.to_ir(k.ast, "cuda", 1024, features).meta.get("template", "")
                 for k in kernels]
    products = [t for t in templates if t.startswith("gemm")]
    assert len(products) == 3 and all("cp.async" in t for t in products), templates
    shapes = [k.ast.output.shape for k in kernels]
    assert (1, 1, 64, 3, 3, 2, 32, 32) not in shapes, shapes  # no windows written out
    if dtype == ag.bfloat16:
        assert shapes.count((2, 34, 34, 64)) == 3, shapes  # the input twice, the gradient once
    else:
        # tf32: the weight gradient reads the input along its pixels (wgmma reads tf32 tiles
        # only along k), stored once per kernel column, shifted by it
        assert shapes.count((2, 34, 34, 64)) == 2, shapes
        assert shapes.count((3, 2, 64, 34, 32)) == 1, shapes
        assert sum("wgmma" in t for t in products) == 3, products


def test_strided_16_bit_convolution_reads_its_input_channels_last(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A bfloat16 3x3 convolution of stride 2 (a ResNet's downsampling), scheduled as for an
    H100: its forward product reads the padded input stored channels inner (strided windows
    are linear there too); its data gradient, not a convolution at stride 2, keeps the
    windows' rule. Forward and both gradients against PyTorch."""
    kernels = _as_on_hopper(monkeypatch)
    xs, ws, gs = _rand((4, 64, 32, 32), 46), _rand((128, 64, 3, 3), 47) * 0.05, \
        _rand((4, 128, 16, 16), 48)
    x = ag.tensor(xs).cast(ag.bfloat16).realize().requires_grad_()
    w = ag.tensor(ws).cast(ag.bfloat16).realize().requires_grad_()
    out = ag.nn.functional.conv2d(x, w, stride=2, padding=1)
    (out.float() * ag.tensor(gs)).sum().backward()
    out.realize()
    tx, tw = (torch.from_numpy(v).to(torch.bfloat16).float().requires_grad_() for v in (xs, ws))
    want = torch.nn.functional.conv2d(tx, tw, stride=2, padding=1)
    (want * torch.from_numpy(gs)).sum().backward()
    for got, ref in ((out, want.detach()), (x.grad, tx.grad), (w.grad, tw.grad)):
        _check(got, ref, ag.bfloat16)
    shapes = [k.ast.output.shape for k in kernels]
    assert shapes.count((4, 34, 34, 64)) == 1, shapes


@pytest.mark.parametrize("dtype", [ag.bfloat16, ag.float32])
def test_first_layer_padded_to_eight_channels(monkeypatch: pytest.MonkeyPatch,
                                             dtype: ag.DType) -> None:
    """A first layer's convolution of 3 channels, scheduled as for an H100 in bfloat16 and in
    tf32 (checked here without one; the GPU check runs it): its input and weight padded with
    zero channels to 8, its forward product reads the input stored channels inner on the
    tensor cores' cp.async templates, and the weight's gradient comes back with 3 channels,
    the numbers PyTorch's."""
    from anygpu.graph import schedule as sched

    monkeypatch.setattr(sched, "get_float32_matmul_precision", lambda: "high")
    kernels = _as_on_hopper(monkeypatch)
    xs, ws, gs = _rand((4, 3, 64, 64), 63), _rand((64, 3, 3, 3), 64), _rand((4, 64, 64, 64), 65)
    x = ag.tensor(xs).cast(dtype).realize()
    w = ag.tensor(ws).cast(dtype).realize().requires_grad_()
    out = ag.nn.functional.conv2d(x, w, padding=1)
    (out.float() * ag.tensor(gs)).sum().backward()
    out.realize()
    tdtype = torch.bfloat16 if dtype == ag.bfloat16 else torch.float32
    tx = torch.from_numpy(xs).to(tdtype).float()
    tw = torch.from_numpy(ws).to(tdtype).float().requires_grad_()
    want = torch.nn.functional.conv2d(tx, tw, padding=1)
    (want * torch.from_numpy(gs)).sum().backward()
    assert w.grad.shape == (64, 3, 3, 3)
    for got, ref in ((out, want.detach()), (w.grad, tw.grad)):
        _check(got, ref, ag.bfloat16 if dtype == ag.bfloat16 else ag.float32)
    shapes = [k.ast.output.shape for k in kernels]
    assert (4, 66, 66, 8) in shapes, shapes
    forward = [k for k in kernels if k.ast.output.shape == (4, 64, 64, 64) and
               k.ast.reduce]
    features = dict(HOPPER, tf32=dtype == ag.float32)
    template = lower.to_ir(forward[0].ast, "cuda", 1024, features).meta["template"]
    assert "cp.async" in template, template


@pytest.mark.parametrize("precision", ["bf16", "tf32"])
def test_a_small_network_trains_as_scheduled_for_hopper(monkeypatch: pytest.MonkeyPatch,
                                                        precision: str) -> None:
    """Three Adam steps of a small VGG-like network (3x3 convolutions of 64 and 128 channels,
    ReLU, max pooling, a linear layer), scheduled as for an H100 with the GPU's rule for data
    gradients (checked here without one): channels-last inputs for the forward product, data
    and weight gradients of the layer large enough for the tensor cores, the later steps
    replaying the first one's plans. Losses, the first step's gradients and the parameters
    against PyTorch's, under bfloat16 autocast or in tf32 (computed exactly here)."""
    from anygpu.graph import plans
    from anygpu.graph import schedule as sched
    from anygpu.nn import convolution

    monkeypatch.setattr(convolution, "_gradient_convolves", lambda device: True)
    if precision == "tf32":
        monkeypatch.setattr(sched, "get_float32_matmul_precision", lambda: "high")
    kernels = _as_on_hopper(monkeypatch)
    rng = np.random.default_rng(66)
    xs = rng.standard_normal((2, 16, 32, 32)).astype(np.float32)
    ys = rng.integers(0, 10, 2)

    def net(nn: Any) -> Any:
        return nn.Sequential(nn.Conv2d(16, 64, 3, padding=1), nn.ReLU(),
                             nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(128 * 8 * 8, 10))

    ours, theirs = net(ag.nn), net(torch.nn)
    for p, q in zip(ours.parameters(), theirs.parameters()):
        p.assign(ag.tensor(q.detach().numpy().copy()))
    opt = ag.optim.Adam(ours.parameters(), lr=1e-3)
    topt = torch.optim.Adam(theirs.parameters(), lr=1e-3)
    x, y = ag.tensor(xs), ag.tensor(ys)
    tx, ty = torch.from_numpy(xs), torch.from_numpy(ys)
    bf16 = precision == "bf16"
    kept = []
    for step in range(3):
        opt.zero_grad()
        topt.zero_grad()
        with ag.autocast("cpu", dtype=ag.bfloat16, enabled=bf16):
            loss = ag.nn.functional.cross_entropy(ours(x).float(), y)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            want = torch.nn.functional.cross_entropy(theirs(tx).float(), ty)
        loss.backward()
        want.backward()
        opt.step()
        topt.step()
        _check(loss, want.detach(), ag.bfloat16 if bf16 else ag.float32)
        if step == 0:  # from the same parameters: the gradients themselves
            for p, q in zip(ours.parameters(), theirs.parameters()):
                assert p.grad is not None and q.grad is not None
                _check(p.grad, q.grad, ag.bfloat16 if bf16 else ag.float32)
        kept.append(len(plans._plans))
    assert kept[1:] == kept[:1] * 2  # the later steps replay the first one's plans
    for p, q in zip(ours.parameters(), theirs.parameters()):
        _check_after_adam(p, q.detach(), ag.bfloat16 if bf16 else ag.float32, lr=1e-3, steps=3)
    # the 64-channel layer (large enough to go to the tensor cores): its input for the
    # forward product and the weight gradient (in tf32: stored once per kernel column,
    # shifted by it), and the output's gradient for the data gradient, stored channels-last
    # in each step
    shapes = [k.ast.output.shape for k in kernels]
    if bf16:
        assert shapes.count((2, 34, 34, 64)) == 9, shapes
    else:
        assert shapes.count((2, 34, 34, 64)) == 6, shapes
        assert shapes.count((3, 2, 64, 34, 32)) == 3, shapes


def test_a_convolution_stored_for_the_next_layer_is_not_computed_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two bfloat16 convolutions with a ReLU between, forward and backward scheduled as one
    graph (a training step that does not look at its loss first), as for an H100: the first
    convolution's output, stored for the second one's unfolded windows, is what the backward
    pass's ReLU mask reads; it is not computed a second time inside the mask's kernel. Five
    products: two forward, the second one's windows' gradient, both weights' gradients."""
    kernels = _as_on_hopper(monkeypatch)
    rng = np.random.default_rng(44)
    c1, c2 = ag.nn.Conv2d(64, 64, 3, padding=1), ag.nn.Conv2d(64, 64, 3, padding=1)
    x = ag.tensor(rng.standard_normal((2, 64, 32, 32)).astype(np.float32))
    with ag.autocast("cpu", dtype=ag.bfloat16):
        loss = (c2(c1(x).relu()).float() ** 2).mean()
    loss.backward()
    flops = [lower.to_ir(k.ast, "cuda", 1024, HOPPER).meta.get("flops", 0) for k in kernels]
    conv = 2 * 2 * 64 * 32 * 32 * 64 * 9
    assert sum(f >= conv for f in flops) == 5, flops

    tx = torch.from_numpy(x.numpy())
    t1, t2 = torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.Conv2d(64, 64, 3, padding=1)
    for t, c in ((t1, c1), (t2, c2)):
        t.weight.data, t.bias.data = (torch.from_numpy(p.numpy()) for p in (c.weight, c.bias))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = (t2(t1(tx).relu()).float() ** 2).mean()
    want.backward()
    _check(loss, want.detach(), ag.bfloat16)
    for t, c in ((t1, c1), (t2, c2)):
        _check(c.weight.grad, t.weight.grad, ag.bfloat16)


def test_16_bit_rows_against_many_columns_stay_whole_on_tensor_cores(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A training step through a bfloat16 linear layer of 16 rows (a classifier at batch 16),
    scheduled as for an H100: its product is not split into partial sums (whose widened factors
    the rows template does not take; they ran as a generic reduction) but runs whole on the
    tensor-core rows template, each weight read once; PyTorch's loss and gradients."""
    kernels = _as_on_hopper(monkeypatch)
    rng = np.random.default_rng(45)
    layer = ag.nn.Linear(4096, 1024)
    x = ag.tensor(rng.standard_normal((16, 64, 16, 16)).astype(np.float32))
    with ag.autocast("cpu", dtype=ag.bfloat16):
        loss = (layer(F.max_pool2d(x, 2).flatten(1)).relu().float() ** 2).mean()
    loss.backward()
    reading = [lower.to_ir(k.ast, "cuda", 1024, HOPPER).meta.get("template", "")
               for k in kernels if any(i.shape == (1024, 4096) and i.dtype == ag.bfloat16
                                       for i in k.ast.inputs)]  # the weight's bf16 copy
    assert len(reading) == 1 and "tensor-core rows (16 rows" in reading[0], reading
    from anygpu.graph import schedule as sched

    # the rule itself: such a sum, which would split on float32 rows, stays whole in 16 bits
    a, w = ag.randn(16, 4096), ag.randn(1024, 4096)
    for dtype, splits in ((ag.bfloat16, False), (ag.float32, True)):
        node = (a.cast(dtype) @ w.cast(dtype).T).lazy
        while node.op is not Op.SUM:
            node = node.srcs[0]
        assert (sched._split_plan(node) is not None) == splits, dtype
    tl = torch.nn.Linear(4096, 1024)
    tl.weight.data, tl.bias.data = (torch.from_numpy(p.numpy()) for p in (layer.weight,
                                                                          layer.bias))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pooled = torch.nn.functional.max_pool2d(torch.from_numpy(x.numpy()), 2).flatten(1)
        want = (tl(pooled).relu().float() ** 2).mean()
    want.backward()
    _check(loss, want.detach(), ag.bfloat16)
    _check(layer.weight.grad, tl.weight.grad, ag.bfloat16)
    _check(layer.bias.grad, tl.bias.grad, ag.bfloat16)


def test_16_bit_convolutions_of_14_by_14_pixels_unfold_channels_inner(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """At 14 x 14 pixels (196, no multiple of 8) a bfloat16 convolution's windows are written
    out with the channels and window offsets inner, so that its products still copy 16-byte
    runs onto the tensor cores; forward and both gradients against PyTorch."""
    kernels = _as_on_hopper(monkeypatch)
    rng = np.random.default_rng(46)
    xs = rng.standard_normal((8, 128, 14, 14)).astype(np.float32)
    ws = rng.standard_normal((128, 128, 3, 3)).astype(np.float32) * 0.03
    x = ag.tensor(xs).cast(ag.bfloat16).realize().requires_grad_()
    w = ag.tensor(ws).cast(ag.bfloat16).realize().requires_grad_()
    out = ag.nn.functional.conv2d(x, w, padding=1)
    (out.float() ** 2).sum().backward()
    templates = [lower.to_ir(k.ast, "cuda", 1024, HOPPER).meta.get("template", "")
                 for k in kernels]
    products = [t for t in templates if t.startswith("gemm")]
    assert len(products) == 3 and all("cp.async" in t for t in products), products
    tx, tw = (torch.from_numpy(v).bfloat16().float().requires_grad_() for v in (xs, ws))
    want = torch.nn.functional.conv2d(tx, tw, padding=1)
    (want ** 2).sum().backward()
    for got, ref in ((out, want.detach()), (x.grad, tx.grad), (w.grad, tw.grad)):
        _check(got, ref, ag.bfloat16)


def test_tf32_convolutions_unfold_for_tensor_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where float32 products may run as tf32, a convolution's windows are written out too, as
    for 16-bit ones (scheduled as for an H100): its three products copy plain buffers onto the
    tensor cores; with tf32 off they stay on the SIMT template, unfolded nowhere."""
    kernels = _as_on_hopper(monkeypatch)
    for precision, tensor_cores in (("high", True), ("highest", False)):
        kernels.clear()
        ag.set_float32_matmul_precision(precision)
        try:
            xs, ws = _rand((2, 64, 32, 32), 47), _rand((64, 64, 3, 3), 48) * 0.05
            x = ag.tensor(xs).requires_grad_()
            w = ag.tensor(ws).requires_grad_()
            out = ag.nn.functional.conv2d(x, w, padding=1)
            (out ** 2).sum().backward()
            features = dict(HOPPER, tf32=precision == "high")
            templates = [lower.to_ir(k.ast, "cuda", 1024, features).meta.get("template", "")
                         for k in kernels]
        finally:
            ag.set_float32_matmul_precision("highest")
        products = [t for t in templates if t.startswith("gemm")]
        assert len(products) == 3, products
        assert all(("tensor cores (tf32)" in t and "cp.async" in t) == tensor_cores
                   for t in products), products
        tx, tw = (torch.from_numpy(v).requires_grad_() for v in (xs, ws))
        want = torch.nn.functional.conv2d(tx, tw, padding=1)
        (want ** 2).sum().backward()
        for got, ref in ((out, want.detach()), (x.grad, tx.grad), (w.grad, tw.grad)):
            _check(got, ref, ag.float32)


@pytest.mark.parametrize("unfold,dtype,copies", [("0", ag.bfloat16, 0), ("1", ag.float32, 0),
                                                 ("2", ag.float32, 1)])
def test_conv_unfold_setting(monkeypatch: pytest.MonkeyPatch, unfold: str, dtype: ag.DType,
                             copies: int) -> None:
    """ANYGPU_CONV_UNFOLD (scheduled as for an H100): 0 leaves even 16-bit windows where they
    lie; exact float32 windows are written out only at 2 (the weight gradient's: the forward
    product reads its input stored channels inner); the numbers stay PyTorch's."""
    from anygpu import config

    monkeypatch.setenv("ANYGPU_CONV_UNFOLD", unfold)
    config.reload()
    try:
        kernels = _as_on_hopper(monkeypatch)
        out, gx, gw, want, want_gx, want_gw = _conv_step("cpu", dtype, 49)
        out.realize()
    finally:
        monkeypatch.undo()
        config.reload()
    unfolded = [k for k in kernels if k.ast.output.shape == (1, 1, 64, 3, 3, 2, 32, 32)]
    assert len(unfolded) == copies
    for got, ref in ((out, want), (gx, want_gx), (gw, want_gw)):
        _check(got, ref, dtype)
