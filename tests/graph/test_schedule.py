"""Kernel counts: what the scheduler fuses. Nothing here runs a kernel (inputs are uploaded to
the cpu device, which needs no compiler for that)."""

from __future__ import annotations

import numpy as np
import pytest

import anygpu as ag
from anygpu.graph import schedule as sched
from anygpu.graph.schedule import CopyItem, KernelItem, count_kernels


def t(*shape: int) -> ag.Tensor:
    return ag.tensor(np.ones(shape, np.float32))


def kernels(*outs: ag.Tensor) -> int:
    return count_kernels([o.lazy for o in outs])


def test_elementwise_and_reduction_fuse() -> None:
    a, b, c = t(4, 5), t(4, 5), t(5)
    assert kernels(((a * b) + c).relu().sum(1)) == 1


def test_elementwise_chain_is_one_kernel() -> None:
    a, b = t(3, 4), t(4)
    assert kernels((((a * 2 + 1).exp() - b) / 3).sqrt()) == 1
    assert kernels(a.sigmoid().gelu().tanh().erf()) == 1


@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_softmax_is_one_kernel(axis: int) -> None:
    x = t(3, 4, 5)
    assert kernels(x.softmax(axis)) == 1
    assert kernels(x.log_softmax(axis)) == 1


def test_reductions_of_one_axis_are_one_kernel() -> None:
    x = t(3, 4, 5)
    for out in (x.sum(1), x.mean(-1), x.amax(0), x.var(1), x.std(), x.logsumexp(2),
                x.argmax(1), x.sum((0, 2)), x.prod(1), x.all(), x.any(1)):
        assert kernels(out) == 1


def test_reduction_of_a_reduction_is_two_kernels() -> None:
    x = t(3, 4, 5)
    assert kernels(x.sum(0).sum(0)) == 2
    assert kernels(x.sum(2).amax(1)) == 2
    assert kernels(x.mean(1, keepdim=True).softmax(0)) == 2


def test_layernorm_is_one_kernel() -> None:
    x = t(3, 4, 5)
    mean = x.mean(-1, keepdim=True)
    var = x.var(-1, keepdim=True, correction=0)
    assert kernels((x - mean) / (var + 1e-5).sqrt() * 2 + 1) == 1


@pytest.mark.parametrize("a,b", [((3, 4), (4, 6)), ((4,), (4,)), ((4,), (4, 6)), ((3, 4), (4,)),
                                 ((2, 3, 4), (4, 6)), ((2, 3, 4), (2, 4, 6)),
                                 ((5, 1, 3, 4), (2, 4, 6))])
def test_matmul_is_one_kernel(a: tuple, b: tuple) -> None:
    assert kernels(t(*a) @ t(*b)) == 1


def test_matmul_with_fused_epilogue() -> None:
    x, w, bias = t(3, 4), t(4, 6), t(6)
    assert kernels((x @ w + bias).relu()) == 1


def test_a_costly_operand_of_a_product_is_stored_first() -> None:
    # computed once, not again for each tile of the other side that reads it
    x, w1, b1, w2 = t(8, 16), t(16, 32), t(32), t(32, 4)
    h = x @ w1 + b1
    assert kernels(h.relu() @ w2) == 2  # the first product, then relu fused into the second
    assert kernels(h.gelu() @ w2) == 2  # GELU in the first product's epilogue, then stored
    assert kernels((h * 0.5 * (1 + (h * 0.70710678).erf())) @ w2) == 2  # erf's GELU
    # an operand with no product below it: a kernel of its own, then the product
    items = sched.schedule([(((x.exp() * 2).exp() + 1).sqrt() @ w1).lazy])
    assert [type(i) for i in items] == [KernelItem, KernelItem]
    # the same graph computes the same values either way
    rng = np.random.default_rng(3)
    a = ag.tensor(rng.standard_normal((8, 16)).astype(np.float32))
    m = ag.tensor(rng.standard_normal((16, 4)).astype(np.float32))
    g = a.numpy()
    np.testing.assert_allclose(((a.exp() + 1).sqrt().log() @ m).numpy(),
                               np.log(np.sqrt(np.exp(g) + 1)) @ m.numpy(), rtol=1e-4, atol=1e-4)


def test_a_product_normalized_after_a_residual_sum_is_computed_once() -> None:
    # RMSNorm of h + x @ w: the product is stored for the sum of squares and read by the
    # normalized output, not computed again inside it
    rng = np.random.default_rng(4)
    h, x, w = (ag.tensor(rng.standard_normal(s).astype(np.float32))
               for s in ((2, 64), (2, 32), (32, 64)))
    r = h + x @ w
    out = r * ((r * r).mean(-1, keepdim=True) + 1e-5).rsqrt() * 1.5
    items = sched.schedule([out.lazy])
    assert len(items) == 2
    assert sum(1 for i in items if i.ast.reduce and
               max(d[1] for d in i.ast.reduce) == 32) == 1  # one kernel sums over the product's k
    g = h.numpy() + x.numpy() @ w.numpy()
    want = g / np.sqrt((g * g).mean(-1, keepdims=True) + 1e-5) * 1.5
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-4)


def test_cat_and_stack_are_one_kernel() -> None:
    a, b, c = t(2, 3), t(4, 3), t(1, 3)
    assert kernels(ag.cat([a, b, c])) == 1
    assert kernels(ag.cat([a * 2, b.exp(), c + 1], 0)) == 1
    assert kernels(ag.stack([a, a * 2, a.sqrt()], 1)) == 1


def test_a_cat_is_stored_not_fused_into_its_readers() -> None:
    # as PyTorch stores it: a token list grown by cat is read as memory, not recomputed
    a, b = t(2, 3), t(4, 3)
    assert kernels(ag.cat([a, b]).exp()) == 2
    assert kernels(ag.cat([a, b]).sum()) == 2


def test_kernels_split_at_the_devices_buffer_limit(device: str, monkeypatch) -> None:
    from anygpu.runtime.registry import get_device
    monkeypatch.setattr(get_device(device), "max_kernel_buffers", 8)
    rng = np.random.default_rng(7)
    hosts = [rng.standard_normal((3, 5)).astype(np.float32) for _ in range(30)]
    xs = [ag.tensor(h, device=device) for h in hosts]
    total, want = xs[0], hosts[0]
    for x, h in zip(xs[1:], hosts[1:]):
        total, want = total * 0.5 + x.exp(), want * 0.5 + np.exp(h)
    reads = []
    real = sched._run_kernel
    monkeypatch.setattr(sched, "_run_kernel",
                        lambda item: (reads.append(len(item.ast.inputs)), real(item)))
    np.testing.assert_allclose(total.numpy(), want, rtol=1e-5)
    assert len(reads) >= 4 and max(reads) <= 7, reads
    stacked = ag.stack(xs) * 2
    np.testing.assert_allclose(stacked.numpy(), np.stack(hosts) * 2, rtol=1e-6)
    assert max(reads) <= 7, reads


def test_movement_is_free() -> None:
    x = t(2, 3, 4)
    assert kernels(x.permute(2, 0, 1).reshape(4, 6)[1:, ::2].flip(0).pad((1, 0)) * 2) == 1


def test_contiguous_is_a_boundary() -> None:
    x = t(3, 4)
    assert kernels(x.T.contiguous() + 1) == 2
    assert kernels(x.contiguous()) == 1


def test_realized_tensors_need_no_kernel() -> None:
    x = t(3, 4)
    assert kernels(x) == 0
    y = (x * 2).realize()
    assert kernels(y) == 0
    assert kernels(y + 1) == 1
    assert kernels(ag.rand(3)) == 0  # rand realizes


def test_reduction_broadcast_back_fuses() -> None:
    x = t(3, 4)
    big = x.sum(0).reshape(1, 4).expand(3, 4)
    assert kernels(x * big) == 1  # two passes over x in one kernel, as softmax
    assert kernels(x * big, x + big) == 2


def test_shared_inputs_are_scheduled_once() -> None:
    x = t(3, 4)
    s = x.T.contiguous()
    assert kernels(s + 1, s * 2, s.sum(0)) == 4
    assert kernels(s + 1) == 2


def test_schedule_orders_dependencies_first() -> None:
    x = t(3, 4)
    out = x.sum(0).sum(0) + 1
    items = sched.schedule([out.lazy])
    assert all(isinstance(i, KernelItem) for i in items)
    assert len(items) == 2
    first, second = items
    assert first.output in second.ast.inputs
    assert second.output is out.lazy


def test_copies_are_not_kernels(devices: list[str]) -> None:
    others = [d for d in devices if not d.startswith("cpu")]
    if not others:
        pytest.skip("needs a device besides cpu")
    other = others[0]
    x = t(3, 4)
    moved = x.to(other)
    items = sched.schedule([moved.lazy])
    assert len(items) == 1 and isinstance(items[0], CopyItem)
    assert kernels(moved) == 0
    assert kernels((x * 2).to(other) + 1) == 2


def test_same_structure_twice_schedules_the_same() -> None:
    a, b = t(3, 4), t(3, 4)
    first = sched.schedule([(a * b + 1).sum(1).lazy])
    c, d = t(3, 4), t(3, 4)
    second = sched.schedule([(c * d + 1).sum(1).lazy])
    assert len(first) == len(second) == 1
    k1, k2 = first[0], second[0]
    assert isinstance(k1, KernelItem) and isinstance(k2, KernelItem)
    assert [n.buffer for n in k2.ast.inputs] == [c.lazy.buffer, d.lazy.buffer]
    assert k2.ast.output is not k1.ast.output


def test_assign_keeps_earlier_values(device: str) -> None:
    """Values built before an in-place write read the old data, as in eager PyTorch."""
    x = ag.tensor([1.0, 2.0, 3.0], device=device)
    y = x * 2
    x.assign(y + 1)
    assert y.tolist() == [2.0, 4.0, 6.0]
    assert x.tolist() == [3.0, 5.0, 7.0]


def test_assigned_value_stays_its_own(device: str) -> None:
    """After ``x.assign(z)`` a later write into x leaves z alone (PyTorch's copy_)."""
    x = ag.tensor([1.0, 2.0, 3.0], device=device)
    z = x * 3 + 1
    x.assign(z)
    x.assign(x * 0 - 1)
    assert z.tolist() == [4.0, 7.0, 10.0]
    assert x.tolist() == [-1.0, -1.0, -1.0]


def test_views_see_writes(device: str) -> None:
    """A pure view of a tensor shows later writes into it (PyTorch views share memory)."""
    x = ag.tensor([1.0, 2.0, 3.0], device=device)
    v = x[1:]
    x.assign(x + 10)
    assert v.tolist() == [12.0, 13.0]


def test_gather_reads_views_in_place(device: str) -> None:
    """Indexing a view of realized memory reads that memory: the view gets no copy of its own,
    so it keeps showing the memory after later writes."""
    flat = ag.tensor(np.arange(12, dtype=np.float32), device=device)
    table = flat[2:].reshape(5, 2)
    rows = table[ag.tensor([4, 0], device=device)]
    assert rows.tolist() == [[10.0, 11.0], [2.0, 3.0]]
    assert table.lazy.buffer is None
    flat.assign(flat * 2)
    assert table[ag.tensor([1], device=device)].tolist() == [[8.0, 10.0]]


def test_a_max_pool_gradient_is_stored_for_its_readers(monkeypatch: pytest.MonkeyPatch) -> None:
    """max_pool2d's gradient (each window's first maximum found, each of its offsets placed)
    is written by an elementwise kernel of its own: fused into its readers (batch norm's
    gradient, the convolution's weight gradient under it) it was computed again for each.
    Here two weight gradients read it, in the kernels backward runs."""
    from anygpu.nn import functional as F

    rng = np.random.default_rng(3)
    x1, x2 = (ag.tensor(rng.standard_normal((2, 4, 16, 16)).astype(np.float32))
              for _ in range(2))
    w1, w2 = (ag.tensor(rng.standard_normal((1, 4, 1, 1)).astype(np.float32),
                        requires_grad=True) for _ in range(2))
    ran: list[KernelItem] = []
    real = sched._run_kernel
    monkeypatch.setattr(sched, "_run_kernel", lambda item: (ran.append(item), real(item)))
    F.max_pool2d(x1 * w1 + x2 * w2, 3, 2, 1).square().sum().backward()
    monkeypatch.undo()
    assert w1.grad is not None and w2.grad is not None
    stored = [i for i in ran if i.ast.output.shape == (2, 4, 16, 16)]
    assert len(stored) == 1 and not stored[0].ast.reduce


def test_rmsnorm_of_a_residual_product_reads_the_weights_once(device: str) -> None:
    """RMSNorm of ``h + x @ W.T`` for one row (a decode step's output projection): the product
    is computed by one kernel and the norm reads it; the sum of squares of one row of 4,096
    stays whole (it had split into partial sums, and the product, computed for the sum and
    again inside the normalized output, read W twice). Against NumPy."""
    rng = np.random.default_rng(5)
    xs, hs = rng.standard_normal((2, 1, 4096)).astype(np.float32)
    ws = (rng.standard_normal((4096, 4096)) * 0.02).astype(np.float32)
    gs = rng.standard_normal(4096).astype(np.float32)
    x, h, w, g = (ag.tensor(v, device=device) for v in (xs, hs, ws, gs))
    h2 = h + x @ w.T
    n = h2 * (h2 * h2).mean(-1, keepdim=True).add(1e-5).rsqrt() * g
    items = [i for i in sched.schedule([n.lazy]) if isinstance(i, KernelItem)]
    assert sum(any(d is w.lazy for d in i.ast.inputs) for i in items) == 1
    assert not [i for i in items if i.ast.output.shape in ((1, 16, 1), (1, 1))]
    want = hs + xs @ ws.T
    want = want / np.sqrt((want * want).mean(-1, keepdims=True) + 1e-5) * gs
    np.testing.assert_allclose(n.numpy(), want, rtol=2e-4, atol=2e-4 * float(np.abs(want).max()))


def test_layer_norms_of_a_residual_stream_read_the_stream_stored(device: str) -> None:
    """Four post-norm residual blocks, ``h = LayerNorm(h @ W + h)`` (BERT's): a norm's output
    that the next block's product stores is read there by the next norm's kernel, which had
    computed every earlier norm of its row again (the last kernel: 10 chained statistics here,
    24 in BERT-base). On GPUs the first outputs, cheap enough for the product's tiles to
    compute again (``schedule._TILED_OPERAND_COST``), are computed again in the third norm's
    kernel too; the stream stays bounded. Against NumPy."""
    rng = np.random.default_rng(6)
    xs = rng.standard_normal((128, 256)).astype(np.float32)
    ws = [(rng.standard_normal((256, 256)) * 0.06).astype(np.float32) for _ in range(4)]

    def norm(v: ag.Tensor) -> ag.Tensor:
        d = v - v.mean(-1, keepdim=True)
        return d * (d * d).mean(-1, keepdim=True).add(1e-5).rsqrt()

    h = norm(ag.tensor(xs, device=device))
    want = xs
    for w in ws:
        h = norm(h @ ag.tensor(w, device=device) + h)
    items = [i for i in sched.schedule([h.lazy]) if isinstance(i, KernelItem)]
    norms = [len(i.ast.stages) for i in items if i.ast.output.shape == (128, 256) and
             all(s.op.name == "SUM" for s in i.ast.stages) and len(i.ast.stages) >= 2]
    assert norms[-2:] == [2, 2] and max(norms) <= 6, norms

    def norm_np(v: np.ndarray) -> np.ndarray:
        d = v - v.mean(-1, keepdims=True)
        return d / np.sqrt((d * d).mean(-1, keepdims=True) + 1e-5)

    want = norm_np(xs)
    for w in ws:
        want = norm_np(want @ w + want)
    np.testing.assert_allclose(h.numpy(), want, rtol=2e-4, atol=2e-4)


def _nested_conditions(item: KernelItem) -> int:
    """How many selections and paddings nest at most in the kernel of ``item``."""
    from anygpu.graph.lazy import is_boundary
    from anygpu.ops.primitives import Op

    root, inside = item.output, {id(n) for n in item.fused} | {id(item.output)}
    depth: dict[int, int] = {}

    def visit(n) -> int:  # type: ignore[no-untyped-def]
        if id(n) not in inside or (n is not root and is_boundary(n, root)):
            return 0
        if id(n) not in depth:
            depth[id(n)] = max((visit(s) for s in n.srcs), default=0) + \
                (n.op is Op.WHERE or n.op is Op.PAD)
        return depth[id(n)]

    return visit(root)


def test_deeply_nested_selections_are_stored_every_few(device: str) -> None:
    """A residual stream's gradient under 20 blocks' ReLU masks, summed (a batch norm's
    gradient at a small size, where the stream is not stored for its size): no kernel nests
    more than ``schedule._NESTED_CONDITIONS`` selections, and the sums are NumPy's. (Fused
    whole, ResNet-101's batch norm gradients nested 16 and more, which NVIDIA's compiler got
    wrong on an H200: see the limit's comment.)"""
    rng = np.random.default_rng(11)
    depth = 20
    masks = [np.maximum(rng.standard_normal((48, 64)) + 1.0, 0).astype(np.float32)
             for _ in range(depth)]
    adds = [rng.standard_normal((48, 64)).astype(np.float32) for _ in range(depth + 1)]
    v = ag.tensor(adds[0], device=device)
    want = adds[0].astype(np.float64)
    for k in range(depth):
        m = ag.tensor(masks[k], device=device)
        v = ag.where(m > 0, v + ag.tensor(adds[k + 1], device=device), 0.0)
        want = np.where(masks[k] > 0, want + adds[k + 1], 0.0)
    rows, cols = v.sum(1), v.sum(0)
    items = [i for i in sched.schedule([rows.lazy, cols.lazy]) if isinstance(i, KernelItem)]
    assert max(map(_nested_conditions, items)) <= sched._NESTED_CONDITIONS
    np.testing.assert_allclose(rows.numpy(), want.sum(1), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(cols.numpy(), want.sum(0), rtol=1e-5, atol=1e-4)


def test_a_convolutions_activation_is_stored_by_its_product(device: str,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """conv -> bias -> ReLU -> conv, trained: on GPUs the first convolution's kernel stores
    the ReLU's output in its epilogue (the same bytes as its raw output), so the second
    convolution's forward product and weight gradient and ReLU's gradient read it rather than
    computing the bias and the ReLU again for every element they read (through 3 x 3 windows:
    nine times each). The processor's products keep the rules of their own. Against PyTorch."""
    torch = pytest.importorskip("torch")
    from anygpu.nn import functional as F

    rng = np.random.default_rng(11)
    xs = rng.standard_normal((2, 32, 32, 32)).astype(np.float32)
    w1s, w2s = (rng.standard_normal((32, 32, 3, 3)).astype(np.float32) / 17 for _ in range(2))
    b1s = rng.standard_normal(32).astype(np.float32)
    gs = rng.standard_normal((2, 32, 32, 32)).astype(np.float32)
    x = ag.tensor(xs, device=device)
    w1, b1, w2 = (ag.tensor(v, device=device, requires_grad=True) for v in (w1s, b1s, w2s))
    ran: list[KernelItem] = []
    real = sched._run_kernel
    monkeypatch.setattr(sched, "_run_kernel", lambda item: (ran.append(item), real(item))[1])
    out = F.conv2d(F.conv2d(x, w1, b1, padding=1).relu(), w2, padding=1)
    (out * ag.tensor(gs, device=device)).sum().backward()
    monkeypatch.undo()
    reading_bias = [i for i in ran if any(n is b1.lazy for n in i.ast.inputs)]
    if sched._dialect(device) != "c":
        assert len(reading_bias) == 1 and reading_bias[0].ast.reduce, \
            [i.ast.output.shape for i in reading_bias]
    tx = torch.tensor(xs)
    tw1, tb1, tw2 = (torch.tensor(v, requires_grad=True) for v in (w1s, b1s, w2s))
    tout = torch.nn.functional.conv2d(
        torch.nn.functional.conv2d(tx, tw1, tb1, padding=1).relu(), tw2, padding=1)
    (tout * torch.tensor(gs)).sum().backward()
    for got, want in ((out, tout), (w1.grad, tw1.grad), (b1.grad, tb1.grad), (w2.grad, tw2.grad)):
        assert got is not None and want is not None
        want = want.detach().numpy()
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-3,
                                   atol=1e-4 * float(np.abs(want).max()))


def test_work_on_weights_runs_just_before_its_reader(device: str) -> None:
    """A kernel that reads only memory realized before the step (work on weights, such as a
    convolution's transformed filters) runs right before the kernel that first reads it, not
    at the step's start, where depth-first planning from the output had put it: each such
    buffer had lived from the step's start to its layer. Values against NumPy."""
    rng = np.random.default_rng(3)
    xs = rng.standard_normal((8, 16)).astype(np.float32)
    ws = [rng.standard_normal((16, 16)).astype(np.float32) / 4 for _ in range(4)]
    x = ag.tensor(xs, device=device)
    w = [ag.tensor(v, device=device) for v in ws]
    h, ref = x, xs
    for wi, vi in zip(w, ws):
        h = wi.exp().sum(0) + (h @ wi).tanh().contiguous()  # the weights' sum planned first
        ref = np.exp(vi).sum(0) + np.tanh(ref @ vi)
    items = sched.schedule([h.lazy])
    assert all(isinstance(item, KernelItem) for item in items)

    def leaf(item: KernelItem) -> bool:
        return all(n.realized for n in item.ast.inputs)

    sums = [i for i, item in enumerate(items) if item.output.shape == (1, 16)]
    assert len(sums) == 4
    for i in sums:  # only other such kernels between each and its first reader
        j = next(j for j in range(i + 1, len(items))
                 if any(n is items[i].output for n in items[j].ast.inputs))
        assert all(leaf(items[k]) for k in range(i, j))
    np.testing.assert_allclose(h.numpy(), ref, rtol=1e-4, atol=1e-4)
