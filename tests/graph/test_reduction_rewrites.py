"""How the scheduler rewrites sums before lowering them: on GPUs, sums with few outputs and long
reductions run as two kernels (partial sums of slices, then their sum), so that they fill the
device; on the processor, a large convolution's windows are unfolded into a buffer first, so that
BLAS takes the product. The results match NumPy and PyTorch on every backend, gradients
included."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
import torch

import anygpu as ag
from anygpu.nn import functional as F
from anygpu.graph import schedule as sched
from anygpu.graph.schedule import KernelItem, schedule
from anygpu.runtime.registry import get_device


def _kernels(t: ag.Tensor) -> int:
    return sum(isinstance(i, KernelItem) for i in schedule([t.lazy]))


def _splits(device: str) -> bool:
    return not device.startswith("cpu")


def _rand(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _kernels_run(run: Callable[[], Any], monkeypatch: pytest.MonkeyPatch
                 ) -> tuple[list[KernelItem], Any]:
    """The kernels that ``run()`` runs, and what it returns."""
    ran: list[KernelItem] = []
    real = sched._run_kernel
    monkeypatch.setattr(sched, "_run_kernel", lambda item: (ran.append(item), real(item)))
    try:
        return ran, run()
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("shape,axes", [((1 << 20,), None), ((4, 3, 1 << 14), (0, 2)),
                                        ((6, 50000), (1,)), ((128, 9, 9, 40), (0, 1, 2))])
def test_sums_split_and_match(device: str, shape: tuple[int, ...],
                              axes: tuple[int, ...] | None) -> None:
    x_host = _rand(shape, 1)
    x = ag.tensor(x_host, device=device)
    out = x.sum() if axes is None else x.sum(axes)
    assert _kernels(out) == (2 if _splits(device) else 1)
    want = x_host.astype(np.float64).sum(axis=axes)
    got = out.numpy()
    scale = np.abs(x_host).astype(np.float64).sum(axis=axes)  # error grows with |x| summed
    assert np.all(np.abs(got - want) <= 1e-6 * scale + 1e-6)
    mean = (x.mean() if axes is None else x.mean(axes)).numpy()
    np.testing.assert_allclose(mean, x_host.astype(np.float64).mean(axis=axes), rtol=1e-4,
                               atol=1e-6)


def test_integer_sums_split_exactly(device: str) -> None:
    x_host = np.random.default_rng(2).integers(-1000, 1000, (3, 1 << 16)).astype(np.int32)
    out = ag.tensor(x_host, device=device).sum(1)
    assert _kernels(out) == (2 if _splits(device) else 1)
    np.testing.assert_array_equal(out.numpy(), x_host.sum(1))


def test_small_sums_and_many_outputs_stay_whole(device: str) -> None:
    assert _kernels(ag.tensor(_rand((8, 1000), 3), device=device).sum(1)) == 1
    assert _kernels(ag.tensor(_rand((4096, 64), 4), device=device).sum(1)) == 1


def eps_of(dtype: str) -> float:
    """The relative size of a 16-bit result's one rounding."""
    return 2.0 ** (-8 if dtype == "bfloat16" else -11)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_sums_split_into_float32_partials(device: str, dtype: str) -> None:
    """A float16 or bfloat16 sum with few outputs splits like a float32 one, its partial sums
    stored in float32 (in 16 bits they would round): the result is float32 accumulation
    rounded once. A product's weight gradient too (a bf16 convolution's: whole, on a few SMs,
    ResNet-18's stem took 13 ms on an H100)."""
    if not get_device(device).supports(getattr(ag, dtype)):
        pytest.skip(f"{device} has no {dtype}")
    x = ag.tensor(_rand((6, 50000), 21), device=device).cast(dtype).realize()
    out = x.sum(1)
    items = [i for i in schedule([out.lazy]) if isinstance(i, KernelItem)]
    if _splits(device):
        assert len(items) == 2 and items[0].ast.output.dtype == ag.float32
    wide = x.sum(1).float()  # the float32 cast of the sum (autocast's weight gradients)
    items = [i for i in schedule([wide.lazy]) if isinstance(i, KernelItem)]
    if _splits(device):
        assert len(items) == 2 and items[0].ast.output.dtype == ag.float32
    rounded = x.float().numpy().astype(np.float64)
    np.testing.assert_allclose(wide.numpy(), rounded.sum(1), rtol=eps_of(dtype), atol=1e-3)
    got = out.float().numpy()
    eps = eps_of(dtype)
    np.testing.assert_allclose(got, rounded.sum(1), rtol=eps, atol=1e-3)
    # a convolution's weight gradient: 64 outputs of 3 x 3 windows over 4 x 56 x 56 pixels
    xs, gs = _rand((4, 8, 56, 56), 22), _rand((4, 16, 56, 56), 23)
    xq = ag.tensor(xs, device=device).cast(dtype)
    w = ag.tensor(_rand((16, 8, 3, 3), 24) * 0.1, device=device).cast(dtype)
    w.requires_grad_()
    g = ag.tensor(gs, device=device).cast(dtype)
    (F.conv2d(xq, w, padding=1).float() * g.float()).sum().backward()
    tx = torch.from_numpy(xq.float().numpy()).double()
    tw = torch.from_numpy(w.detach().float().numpy()).double().requires_grad_()
    (torch.nn.functional.conv2d(tx, tw, padding=1) *
     torch.from_numpy(g.float().numpy()).double()).sum().backward()
    want = tw.grad.numpy()
    assert w.grad is not None and w.grad.dtype == getattr(ag, dtype)
    np.testing.assert_allclose(w.grad.float().numpy(), want, rtol=2 * eps,
                               atol=2 * eps * float(np.abs(want).max()))


def test_long_contraction_and_weight_gradient(device: str) -> None:
    """A product with a small output and a long k (a convolution's weight gradient is one) runs
    as a batch of partial products; checked against PyTorch with its gradients."""
    a, b = _rand((48, 20000), 6), _rand((20000, 40), 7)
    x, y = ag.tensor(a, device=device), ag.tensor(b, device=device)
    out = x @ y
    assert _kernels(out) == (2 if _splits(device) else 1)
    want = torch.from_numpy(a).double() @ torch.from_numpy(b).double()
    assert np.abs(out.numpy() - want.numpy()).max() <= 1e-4 * float(want.abs().max())
    xs, ws = _rand((8, 16, 40, 40), 8), _rand((24, 16, 3, 3), 9)
    xi = ag.tensor(xs, device=device, requires_grad=True)
    wi = ag.tensor(ws, device=device, requires_grad=True)
    ag.nn.functional.conv2d(xi, wi, padding=1).square().sum().backward()
    xt = torch.from_numpy(xs).requires_grad_()
    wt = torch.from_numpy(ws).requires_grad_()
    torch.nn.functional.conv2d(xt, wt, padding=1).square().sum().backward()
    assert wi.grad is not None and xi.grad is not None
    np.testing.assert_allclose(wi.grad.numpy(), wt.grad.numpy(), rtol=2e-4,
                               atol=2e-4 * float(wt.grad.abs().max()))
    np.testing.assert_allclose(xi.grad.numpy(), xt.grad.numpy(), rtol=2e-4,
                               atol=2e-4 * float(xt.grad.abs().max()))


def test_large_convolution_unfolds_on_the_processor(device: str) -> None:
    """A convolution of 75M multiply-adds: on the processor its windows are written out (one
    kernel) and the product goes through BLAS; elsewhere one kernel. Forward and gradients
    against PyTorch."""
    xs, ws = _rand((4, 32, 32, 32), 10), _rand((64, 32, 3, 3), 11)
    xi = ag.tensor(xs, device=device, requires_grad=True)
    wi = ag.tensor(ws, device=device, requires_grad=True)
    out = ag.nn.functional.conv2d(xi, wi, padding=1)
    assert _kernels(out) == (1 if _splits(device) else 2)
    if not _splits(device):  # channels and window offsets outer, pixels inner: the copy reads
        # rows of the input (batch 4, 32 x 32 pixels last)
        unfolded = [i.ast.output.shape for i in schedule([out.lazy]) if isinstance(i, KernelItem)]
        assert unfolded[0][-3:] == (4, 32, 32)
    xt = torch.from_numpy(xs).requires_grad_()
    wt = torch.from_numpy(ws).requires_grad_()
    want = torch.nn.functional.conv2d(xt, wt, padding=1)
    np.testing.assert_allclose(out.numpy(), want.detach().numpy(), rtol=1e-4,
                               atol=1e-4 * float(want.abs().max()))
    out.square().sum().backward()
    want.square().sum().backward()
    assert wi.grad is not None and xi.grad is not None
    np.testing.assert_allclose(wi.grad.numpy(), wt.grad.numpy(), rtol=2e-4,
                               atol=2e-4 * float(wt.grad.abs().max()))
    np.testing.assert_allclose(xi.grad.numpy(), xt.grad.numpy(), rtol=2e-4,
                               atol=2e-4 * float(xt.grad.abs().max()))


def test_a_product_of_few_outputs_splits_into_short_partial_sums(device: str) -> None:
    """A product of so few outputs that it would fill a handful of work-groups (the weight
    gradient of a 1x1 downsampling convolution: 256 x 128 outputs over 3,136 products each)
    splits into partial sums shorter than other sums' (8 slices of 392 here)."""
    a, b = _rand((256, 3136), 10), _rand((3136, 128), 11)
    out = ag.tensor(a, device=device) @ ag.tensor(b, device=device)
    assert _kernels(out) == (2 if _splits(device) else 1)
    want = torch.from_numpy(a).double() @ torch.from_numpy(b).double()
    assert np.abs(out.numpy() - want.numpy()).max() <= 1e-4 * float(want.abs().max())
    # the same sum over longer rows with more outputs stays whole (below the usual 8192)
    assert _kernels(ag.tensor(_rand((1024, 4000), 12), device=device) @
                    ag.tensor(_rand((4000, 512), 13), device=device)) == 1


def test_a_first_layers_weight_gradient_splits_into_more_partial_sums(
        device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A convolution's weight gradient with a single work-group's outputs (a first layer of 3
    channels: 16 x 27 outputs over 4 x 128 x 64 products each) splits into more partial sums
    than the usual 64, so that they fill a GPU: the backward pass runs 128 partial sums of the
    128 rows here (as 56 slices VGG-16's first layer ran on 112 work-groups of an H100). The
    gradient matches PyTorch's."""
    xs, ws = _rand((4, 3, 128, 64), 16), _rand((16, 3, 3, 3), 17)
    x = ag.tensor(xs, device=device)
    w = ag.tensor(ws, device=device).requires_grad_()
    out = F.conv2d(x, w, padding=1).square().sum()
    out.realize()
    ran, _ = _kernels_run(out.backward, monkeypatch)
    assert w.grad is not None
    partials = [k for k in ran if k.output.numel == 128 * 16 * 27]
    assert bool(partials) == _splits(device), [k.output.shape for k in ran]
    xt, wt = torch.from_numpy(xs), torch.from_numpy(ws).requires_grad_()
    torch.nn.functional.conv2d(xt, wt, padding=1).square().sum().backward()
    np.testing.assert_allclose(w.grad.numpy(), wt.grad.numpy(), rtol=2e-4,
                               atol=2e-4 * float(wt.grad.abs().max()))


def test_a_weight_gradient_reads_batch_norms_gradient_stored(
        device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On GPUs, batch norm's gradient in a residual block (work of cost 8 per element, several
    full-size loads) is stored once before the convolution's weight and data gradients read
    it, rather than computed again in each of their tiles: each weight gradient's partial
    products read two buffers, that gradient and the convolution's input. Checked against
    PyTorch."""
    from anygpu import nn

    xs, rs = _rand((4, 32, 32, 32), 14), _rand((4, 32, 32, 32), 15)
    ag.manual_seed(0)  # the same weights whatever ran before (BENCHMARKS.md, thirteenth session)
    convs = [nn.Conv2d(32, 32, 3, padding=1, bias=False) for _ in range(2)]
    weights = [c.weight.numpy() for c in convs]
    c1, c2 = (c.to(device) for c in convs)
    b1, b2 = nn.BatchNorm2d(32).to(device), nn.BatchNorm2d(32).to(device)
    x = ag.tensor(xs, device=device)
    out = (b2(c2(b1(c1(x)).relu())) + x).relu()
    # the kernels backward runs (it computes the gradients)
    ran, _ = _kernels_run((out * ag.tensor(rs, device=device)).sum().backward, monkeypatch)
    assert c1.weight.grad is not None and c2.weight.grad is not None
    if _splits(device):
        items = [i for i in ran if i.ast.reduce]
        # the partial products: outputs of (1, 1, 32, slices, 1, 1, 32, 3, 3)
        partial = [i for i in items if i.ast.output.shape[-5:] == (1, 1, 32, 3, 3)]
        assert len(partial) == 2 and all(len(i.ast.inputs) == 2 for i in partial)
    t1, t2 = (torch.nn.Conv2d(32, 32, 3, padding=1, bias=False) for _ in range(2))
    with torch.no_grad():
        t1.weight.copy_(torch.from_numpy(weights[0]))
        t2.weight.copy_(torch.from_numpy(weights[1]))
    tb1, tb2 = torch.nn.BatchNorm2d(32), torch.nn.BatchNorm2d(32)
    tx = torch.from_numpy(xs)
    ((tb2(t2(tb1(t1(tx)).relu())) + tx).relu() * torch.from_numpy(rs)).sum().backward()
    for got, want in ((c1.weight.grad, t1.weight.grad), (c2.weight.grad, t2.weight.grad)):
        w = want.numpy()
        np.testing.assert_allclose(got.numpy(), w, rtol=1e-3, atol=1e-3 * float(np.abs(w).max()))


def test_a_normalization_over_few_long_rows_stores_its_sum_split(device: str) -> None:
    """A sum broadcast back over what it sums, of few long rows (batch norm's statistics: 16
    channels over 4 x 128 x 128 here), is not the elementwise kernel's epilogue on GPUs (one
    work-group per row) but a split sum of its own, then the elementwise kernel that reads
    it; on the processor one kernel."""
    xs = _rand((4, 16, 128, 128), 19)
    x = ag.tensor(xs, device=device)
    out = x - x.mean((0, 2, 3), keepdim=True)
    assert _kernels(out) == (3 if _splits(device) else 1)
    want = xs - xs.astype(np.float64).mean((0, 2, 3), keepdims=True)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5)


def test_a_linear_layer_under_its_activation_runs_once(device: str) -> None:
    """A classifier of linear layers under ReLU and dropout (a CNN's): the first layer's
    product (few rows, a long sum) is stored by a kernel of its own, which splits on a GPU,
    and the forward pass and ReLU's gradient both read it from there, so that a training step
    computes it once; it had run whole in the forward pass and again, split, for ReLU's
    gradient. The loss and the gradients against PyTorch."""
    rng = np.random.default_rng(30)
    shapes = [(512, 4096), (512,), (256, 512), (256,), (10, 256), (10,)]
    host = [rng.standard_normal(s).astype(np.float32) * (0.02 if len(s) == 2 else 1)
            for s in shapes]
    xs = rng.standard_normal((16, 4096)).astype(np.float32)
    masks = [(rng.random((16, n)) > 0.5).astype(np.float32) * 2 for n in (512, 256)]
    labels = rng.integers(0, 10, 16)

    def step(lib, params, x, k1, k2, y):
        w1, b1, w2, b2, w3, b3 = params
        h = lib.relu(x @ w1.T + b1) * k1
        h = lib.relu(h @ w2.T + b2) * k2
        return lib.cross_entropy(h @ w3.T + b3, y)

    params = [ag.tensor(h, device=device, requires_grad=True) for h in host]
    inputs = [ag.tensor(a, device=device) for a in (xs, *masks, labels)]
    with ag.profile() as prof:
        loss = step(F, params, *inputs)
        loss.backward()
        value = loss.item()
    # the first layer's forward product (whole, or its partial sums) and its weight gradient's
    layer = 2 * 16 * 512 * 4096
    assert sum(e.kind == "kernel" and e.flops == layer for e in prof.events) == 2

    tparams = [torch.from_numpy(h).requires_grad_() for h in host]
    tloss = step(torch.nn.functional, tparams, torch.from_numpy(xs),
                 *[torch.from_numpy(k) for k in masks], torch.from_numpy(labels))
    tloss.backward()
    assert abs(value - tloss.item()) <= 1e-4 * max(1.0, abs(tloss.item()))
    for p, t in zip(params, tparams):
        assert p.grad is not None and t.grad is not None
        np.testing.assert_allclose(p.grad.numpy(), t.grad.numpy(), rtol=2e-4,
                                   atol=2e-4 * float(t.grad.abs().max()))


def test_a_residual_streams_gradient_is_stored_once(
        device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gradient of a residual stream through a chain of blocks is a chain itself (ReLU's
    mask of each block times the sum of the next block's gradients): each value of it that
    several kernels read is stored once, so that no kernel of the backward pass reads more than
    three tensors of the stream's size (fused into every reader, each block's batch norm
    gradients had read one more for every block after it). Checked against PyTorch."""
    from anygpu import nn

    blocks, shape = 3, (8, 32, 32, 32)  # (the rule's least size: schedule._SHARED_MIN)
    xs, rs = _rand(shape, 20), _rand(shape, 21)
    ag.manual_seed(0)
    convs = [nn.Conv2d(32, 32, 3, padding=1, bias=False) for _ in range(blocks)]
    weights = [c.weight.numpy() for c in convs]
    ours = [(c.to(device), nn.BatchNorm2d(32).to(device)) for c in convs]
    x = ag.tensor(xs, device=device, requires_grad=True)
    h = x
    for conv, norm in ours:
        h = (norm(conv(h)) + h).relu()
    ran, _ = _kernels_run((h * ag.tensor(rs, device=device)).sum().backward, monkeypatch)
    numel = int(np.prod(shape))
    widest = max(sum(n.numel >= numel for n in i.ast.inputs) for i in ran)
    assert widest <= 3, widest
    theirs = [(torch.nn.Conv2d(32, 32, 3, padding=1, bias=False), torch.nn.BatchNorm2d(32))
              for _ in range(blocks)]
    tx = torch.from_numpy(xs).requires_grad_()
    th = tx
    for (conv, norm), w in zip(theirs, weights):
        with torch.no_grad():
            conv.weight.copy_(torch.from_numpy(w))
        th = (norm(conv(th)) + th).relu()
    (th * torch.from_numpy(rs)).sum().backward()
    assert x.grad is not None and tx.grad is not None
    for (conv, _), (their, _) in zip(ours, theirs):
        assert conv.weight.grad is not None and their.weight.grad is not None
        w = their.weight.grad.numpy()
        np.testing.assert_allclose(conv.weight.grad.numpy(), w, rtol=1e-3,
                                   atol=1e-3 * float(np.abs(w).max()))
    w = tx.grad.numpy()
    np.testing.assert_allclose(x.grad.numpy(), w, rtol=1e-3, atol=1e-3 * float(np.abs(w).max()))


@pytest.mark.parametrize("shape", [(16, 256, 14, 14), (16, 64, 56, 56)])
def test_batch_norm_statistics_split_into_rows_enough(device: str, shape: tuple[int, ...]
                                                      ) -> None:
    """A sum over the axes around a kept one (batch norm's over the batch and pixels of each
    channel) splits on GPUs until there are some thousands of rows (each row a warp's), from
    2048 elements per output; a sum over trailing axes (a norm's rows) of as few outputs stays
    whole below 8192 elements a row. Both match NumPy."""
    xs = _rand(shape, 22)
    x = ag.tensor(xs, device=device)
    per_channel = x.sum((0, 2, 3))
    rows = x.reshape(-1, 2 * shape[2] * shape[3]).sum(1)  # rows of two channels each
    assert _kernels(per_channel) == (2 if _splits(device) else 1)
    assert _kernels(rows) == 1
    np.testing.assert_allclose(per_channel.numpy(), xs.astype(np.float64).sum((0, 2, 3)),
                               rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(rows.numpy(), xs.reshape(-1, 2 * shape[2] * shape[3]).astype(
        np.float64).sum(1), rtol=1e-4, atol=1e-3)


def test_batch_norms_statistics_read_the_input_once_each(
        device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Batch norm in training realizes its mean and variance together: the mean's sum is split
    (its partial sums under the mean's epilogue) and computed once, read by the variance's
    kernel rather than computed again there (a whole mean and a split one had both run), so
    exactly two reductions read the input. Output and running statistics match PyTorch."""
    from anygpu import nn

    xs = _rand((16, 64, 28, 28), 23)
    x = ag.tensor(xs, device=device)
    norm = nn.BatchNorm2d(64).to(device)
    ran, out = _kernels_run(lambda: norm(x).relu().numpy(), monkeypatch)
    reading = [i for i in ran if i.ast.reduce and any(n.numel == xs.size for n in i.ast.inputs)]
    assert len(reading) == 2, [i.ast.output.shape for i in reading]
    theirs = torch.nn.BatchNorm2d(64)
    want = theirs(torch.from_numpy(xs)).relu().detach().numpy()
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(norm.running_mean.numpy(), theirs.running_mean.numpy(),
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(norm.running_var.numpy(), theirs.running_var.numpy(),
                               rtol=1e-4, atol=1e-5)


def test_batch_norms_gradient_reads_the_input_and_its_gradient_three_times(
        device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Training-mode batch norm's gradient by its own rule: the sum of the output's gradient,
    the sum of its product with the normalized input, and the input's gradient, so at most three
    backward kernels read or write tensors of the input's size (the chain of the mean's and
    variance's rules had summed four and stored the centred input twice). Gradients of input,
    weight and bias match float64 PyTorch."""
    from anygpu import nn

    xs, gs = _rand((16, 64, 16, 16), 31) * 2 + 0.5, _rand((16, 64, 16, 16), 32)
    norm = nn.BatchNorm2d(64).to(device)
    rng = np.random.default_rng(33)
    norm.weight.assign(ag.tensor(rng.standard_normal(64).astype(np.float32), device=device))
    norm.bias.assign(ag.tensor(rng.standard_normal(64).astype(np.float32), device=device))
    x = ag.tensor(xs, device=device, requires_grad=True)
    g = ag.tensor(gs, device=device)
    loss = (norm(x) * g).sum()
    loss.realize()
    ran, _ = _kernels_run(loss.backward, monkeypatch)
    big = [i for i in ran if sum(n.numel >= xs.size for n in i.ast.inputs) +
           (i.ast.output.numel >= xs.size) > 0]
    assert len(big) <= 3, [i.ast.output.shape for i in big]
    theirs = torch.nn.BatchNorm2d(64).double()
    with torch.no_grad():
        theirs.weight.copy_(torch.from_numpy(norm.weight.numpy()))
        theirs.bias.copy_(torch.from_numpy(norm.bias.numpy()))
    tx = torch.from_numpy(xs).double().requires_grad_()
    (theirs(tx) * torch.from_numpy(gs).double()).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(norm.weight.grad.numpy(), theirs.weight.grad.numpy(),
                               rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(norm.bias.grad.numpy(), theirs.bias.grad.numpy(),
                               rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("stride", [1, 2])
def test_a_pointwise_convolutions_data_gradient_is_written_once(
        device: str, stride: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1x1 convolution is the product of its (strided) input with its weight: on GPUs its
    data gradient is one product written in the input's layout (through the windows' views it
    was written in theirs and moved by a kernel of its own; the processor's BLAS lays out its
    operands apart). Both gradients match PyTorch."""
    xs, ws = _rand((8, 48, 20, 20), 41), _rand((96, 48, 1, 1), 42) * 0.2
    gs = _rand((8, 96, 20 // stride, 20 // stride), 43)
    x = ag.tensor(xs, device=device, requires_grad=True)
    w = ag.tensor(ws, device=device, requires_grad=True)
    loss = (F.conv2d(x, w, stride=stride) * ag.tensor(gs, device=device)).sum()
    loss.realize()
    ran, _ = _kernels_run(loss.backward, monkeypatch)
    writing = [i for i in ran if i.ast.output.numel == xs.size]
    if _splits(device):
        assert len(writing) == 1, [i.ast.output.shape for i in writing]
    tx = torch.from_numpy(xs).requires_grad_()
    tw = torch.from_numpy(ws).requires_grad_()
    (torch.nn.functional.conv2d(tx, tw, stride=stride) * torch.from_numpy(gs)).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(w.grad.numpy(), tw.grad.numpy(), rtol=1e-4, atol=1e-3)


def test_a_masked_data_gradient_is_stored_by_its_product(
        device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pointwise convolution, batch norm, ReLU, pointwise convolution: the gradient reaching
    batch norm (ReLU's mask over the second convolution's data gradient) is read by its two
    sums and its input gradient, so it is stored under the product's epilogue: on GPUs two
    backward kernels write tensors of batch norm's size, that one and the input gradient (the
    mask had been applied by a kernel of its own, or fused into a product stored apart).
    Gradients match PyTorch."""
    from anygpu import nn

    ag.manual_seed(5)
    layers = [nn.Conv2d(32, 64, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
              nn.Conv2d(64, 32, 1, bias=False)]
    model = nn.Sequential(*layers).to(device)
    xs, gs = _rand((16, 32, 16, 16), 51), _rand((16, 32, 16, 16), 52)
    x = ag.tensor(xs, device=device, requires_grad=True)
    loss = (model(x) * ag.tensor(gs, device=device)).sum()
    loss.realize()
    ran, _ = _kernels_run(loss.backward, monkeypatch)
    writing = [i for i in ran if i.ast.output.numel == 16 * 64 * 16 * 16]
    if _splits(device):
        assert len(writing) == 2, [i.ast.output.shape for i in writing]
    theirs = torch.nn.Sequential(torch.nn.Conv2d(32, 64, 1, bias=False), torch.nn.BatchNorm2d(64),
                                 torch.nn.ReLU(), torch.nn.Conv2d(64, 32, 1, bias=False))
    with torch.no_grad():
        for mine, their in zip(model.parameters(), theirs.parameters()):
            their.copy_(torch.from_numpy(mine.numpy()))
    tx = torch.from_numpy(xs).requires_grad_()
    (theirs(tx) * torch.from_numpy(gs)).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-3, atol=1e-3)
    for mine, their in zip(model.parameters(), theirs.parameters()):
        np.testing.assert_allclose(mine.grad.numpy(), their.grad.numpy(), rtol=1e-3, atol=2e-3)


def test_a_linear_layers_weight_gradient_is_written_in_its_layout(
        device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A linear layer whose weight needs a gradient multiplies over (rows, out, in): the
    weight's gradient, summed over the rows, is written in the weight's layout by one kernel
    (through ``weight.T`` it was written transposed and copied back by another). Gradients of
    input, weight and bias match PyTorch."""
    xs, ws, bs = _rand((24, 300), 61), _rand((200, 300), 62) * 0.1, _rand((200,), 63)
    gs = _rand((24, 200), 64)
    x = ag.tensor(xs, device=device, requires_grad=True)
    w = ag.tensor(ws, device=device, requires_grad=True)
    b = ag.tensor(bs, device=device, requires_grad=True)
    loss = (F.linear(x, w, b) * ag.tensor(gs, device=device)).sum()
    loss.realize()
    ran, _ = _kernels_run(loss.backward, monkeypatch)
    writing = [i for i in ran if i.ast.output.numel == ws.size]
    assert len(writing) == 1, [i.ast.output.shape for i in writing]
    tx, tw, tb = (torch.from_numpy(a).requires_grad_() for a in (xs, ws, bs))
    (torch.nn.functional.linear(tx, tw, tb) * torch.from_numpy(gs)).sum().backward()
    for mine, theirs in ((x, tx), (w, tw), (b, tb)):
        np.testing.assert_allclose(mine.grad.numpy(), theirs.grad.numpy(), rtol=1e-4, atol=1e-4)
