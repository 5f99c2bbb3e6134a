"""In-place writes (``x[i] = v``, ``x[mask] = v``, ``add_``, ``+=``, ``copy_``...) against PyTorch
on every available device: the written tensor, views of it, values computed before the write,
and gradients through recorded writes."""

from __future__ import annotations

import numpy as np
import pytest

import anygpu as ag

torch = pytest.importorskip("torch")


def both(program, device):
    """Run ``program(lib, data)`` with anygpu on ``device`` and with PyTorch on the same data,
    and compare every tensor it returns."""
    rng = np.random.default_rng(7)
    data = rng.standard_normal((4, 5)).astype(np.float32) + 0.5
    ours = program(ag, lambda a: ag.tensor(a, device=device), data)
    theirs = program(torch, torch.tensor, data)
    for got, want in zip(ours, theirs):
        np.testing.assert_allclose(got.detach().numpy(), want.detach().numpy(), rtol=1e-5,
                                   atol=1e-6)


def basic(m, t, data):
    x = t(data)
    before = x * 2                 # computed before the writes: keeps the old values
    row = x[1]                     # a view: shows the writes
    x[1, ::2] = -1.0
    x[:, 3] = t(data[0, :4].copy())
    x[2] += 100.0
    x[-1, 1:4].mul_(3).sub_(1)
    x[..., 0] = x[..., 4]
    return [x, before, row]


def methods(m, t, data):
    x = t(data)
    y = x
    y += 1                         # in place: x changes too
    x.mul_(2).clamp_(-1.0, 3.0)
    x[0].zero_()
    x[1].fill_(0.25)
    x[2].copy_(t(data[3]))
    x[3].exp_().neg_()
    z = t(data).abs().sqrt_()
    z.addcmul_(t(data), t(data), value=0.5).lerp_(t(data), 0.25)
    return [x, y, z]


def transposed(m, t, data):
    x = t(data)
    xt = x.t()                     # a view through a permute
    xt[1:3] = 7.0
    x.t()[0, ::2] += 1.0           # a strided view of a permute
    flipped = t(data)
    flipped.reshape(20)[::3] = 0.0
    return [x, xt, flipped]


def masks(m, t, data):
    x = t(data)
    x[x > 1.0] = 0.5               # a scalar through a mask: no read of the mask
    x[x < 0] = -x[x < 0] * 10      # values, one per true element
    rows = t(data)
    rows[t(np.array([True, False, True, False]))] = t(data[0])   # a mask over rows
    return [x, rows]


def index_tensors(m, t, data):
    x = t(data)
    x[t(np.array([0, 3]))] = t(data[1:3])
    x[t(np.array([1, 2])), t(np.array([4, 0]))] = -2.0
    x[[2]] = 9.0
    ints = t(np.arange(10, dtype=np.int64))
    ints[t(np.array([7, 1]))] = t(np.array([-5, 5]))
    ints //= 2
    flags = t(data) > 0.5
    flags[0] = True
    flags[t(np.array([1]))] = False
    return [x, ints, flags]


def index_copies(m, t, data):
    x = t(data)
    before = x.sum(1)              # computed before the write: keeps the old values
    x.index_copy_(0, t(np.array([3, 0])), t(data[1:3]) * 2 + 1)   # the value fused in
    x.index_copy_(1, t(np.array([4, 0, 2])), x[:, 1:4].clone())   # read the target first
    x.index_copy_(1, t(np.array([1])), x[:, 3:4])                  # a view of the target
    col = x[:, 2]                  # a view: shows the next write
    x.index_copy_(1, t(np.array([2])), t(data[:, :1]).exp())
    ints = t(np.arange(12, dtype=np.int32).reshape(3, 4))
    ints.index_copy_(1, t(np.array([3, 1])), t(np.array([[7, 8]] * 3, dtype=np.int32)))
    cube = t(np.arange(24, dtype=np.float32).reshape(2, 3, 4))
    cube.index_copy_(1, t(np.array([2, 0])), -cube[:, :2] - 1)
    cube.index_copy_(2, t(np.array([0])), t(data[:2, :3, None]))
    # the functional form, with gradients for both tensors
    w = t(data).requires_grad_()
    src = t(data[:2] * 3).requires_grad_()
    out = w.index_copy(0, t(np.array([1, 3])), src * src)
    (out * t(data)).sum().backward()
    return [x, before, col, ints, cube, out, w.grad, src.grad]


@pytest.mark.parametrize("program", [basic, methods, transposed, masks, index_tensors,
                                     index_copies], ids=lambda f: f.__name__)
def test_in_place_matches_pytorch(device, program):
    both(program, device)


def recorded(m, t, data):
    # writes that autograd records: into a non-leaf, through a view, and a value that needs
    # gradients into a plain buffer
    w = t(data).requires_grad_()
    h = w * 3
    h[h < 0] = 0.0
    h[0] = h[2] * 2
    h[1].mul_(-1)
    h.exp_()
    buf = m.zeros(4, 5) if m is torch else ag.zeros(4, 5, device=w.device)
    v = t(data[0]).requires_grad_()
    buf[:, 1] = (v * v)[:4]
    loss = (h * t(data)).sum() + buf.sum()
    loss.backward()
    return [h, buf, w.grad, v.grad]


def test_recorded_writes_match_pytorch_gradients(device):
    both(recorded, device)


def test_manual_sgd_updates_parameters_in_place(device):
    # PyTorch's plain SGD idiom: the parameter object the model holds changes
    results = []
    for lib in (ag, torch):
        lib.manual_seed(0)
        lin = lib.nn.Linear(3, 2)
        with lib.no_grad():
            lin.weight.copy_(lib.tensor([[0.5, -1.0, 0.25], [1.5, 0.75, -0.5]]))
            lin.bias.fill_(0.1)
        if lib is ag:
            lin = lin.to(device)
        x = lib.tensor([[1.0, -2.0, 0.5]])
        x = x.to(device) if lib is ag else x
        for _ in range(3):
            loss = lin(x).pow(2).sum()
            loss.backward()
            with lib.no_grad():
                for p in lin.parameters():
                    p -= 0.1 * p.grad
                    p.grad.zero_()
        results.append(lin(x).detach().numpy())
    np.testing.assert_allclose(results[0], results[1], rtol=1e-5, atol=1e-6)


def test_write_errors(device):
    w = ag.tensor([1.0, 2.0], device=device, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        w.add_(1)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        w[0] = 3.0
    with ag.no_grad():
        w.add_(1)                  # allowed without recording
    np.testing.assert_allclose(w.detach().numpy(), [2.0, 3.0])
    x = ag.tensor([[1.0], [2.0]], device=device).expand(2, 3)
    with pytest.raises(RuntimeError, match="more than one element"):
        x.add_(1)
    y = ag.tensor([1.0, 2.0, 3.0], device=device)
    with pytest.raises(RuntimeError, match="does not broadcast"):
        y[:2] = ag.tensor([1.0, 2.0, 3.0], device=device)


def test_assign_rows_of_another_tensor(device):
    rng = np.random.default_rng(11)
    host = rng.standard_normal((8, 3)).astype(np.float32)
    src = ag.tensor(host, device=device)
    dst = ag.tensor(rng.standard_normal((4, 3)).astype(np.float32), device=device)
    dst.assign(src[2:6])               # rows of memory, read as a buffer of their own
    np.testing.assert_array_equal(dst.numpy(), host[2:6])
    src.add_(1.0)
    np.testing.assert_array_equal(dst.numpy(), host[2:6])


def test_index_copy_writes_only_its_rows(device):
    # one kernel over the new rows, the value computed inside it; the rest of the target is
    # neither read nor written (a cache of many rows taking one new row)
    rng = np.random.default_rng(3)
    host = rng.standard_normal((64, 8)).astype(np.float32)
    cache = ag.tensor(host, device=device).realize()
    new = ag.tensor(rng.standard_normal((2, 8)).astype(np.float32), device=device).realize()
    where = ag.tensor(np.array([5, 60], dtype=np.int32), device=device).realize()
    with ag.profile() as prof:
        cache.index_copy_(0, where, new * 0.5 - 1)
    kernels = [e for e in prof.events if e.kind == "kernel"]
    assert len(kernels) == 1 and kernels[0].nbytes == (2 * 8 * 2 + 2) * 4
    want = host.copy()
    want[[5, 60]] = new.numpy() * 0.5 - 1
    np.testing.assert_array_equal(cache.numpy(), want)


def test_index_copy_device_indices_out_of_range_write_nothing(device):
    x = ag.tensor(np.arange(10, dtype=np.float32).reshape(5, 2), device=device)
    # a device tensor's indices are not read back: rows past the end are skipped, negative
    # ones count from the end (PyTorch raises for both)
    x.index_copy_(0, ag.tensor(np.array([7, -1, 1], dtype=np.int32), device=device),
                  ag.tensor(np.full((3, 2), -3.0, np.float32), device=device))
    want = np.arange(10, dtype=np.float32).reshape(5, 2)
    want[[4, 1]] = -3.0
    np.testing.assert_array_equal(x.numpy(), want)


def test_index_copy_replays_under_jit(device):
    rng = np.random.default_rng(5)
    cache = ag.tensor(np.zeros((16, 4), np.float32) + 1.0, device=device).realize()
    want = cache.numpy()

    def step(rows, pos):
        cache.index_copy_(0, pos, rows.exp())
        return cache.sum()

    run = ag.jit(step)
    for k in range(5):
        rows = rng.standard_normal((2, 4)).astype(np.float32)
        pos = np.array([k, 15 - k], dtype=np.int32)
        total = run(ag.tensor(rows, device=device), ag.tensor(pos, device=device)).item()
        want[pos] = np.exp(rows)
        np.testing.assert_allclose(cache.numpy(), want, rtol=1e-6)
        np.testing.assert_allclose(total, want.sum(), rtol=1e-5)


def test_index_copy_from_another_device(device):
    x = ag.zeros(4, 2, device=device)
    rows = ag.tensor(np.array([[1.0, 2.0], [3.0, 4.0]], np.float32), device="cpu")
    x.index_copy_(0, ag.tensor(np.array([3, 1], np.int32), device="cpu"), rows)
    np.testing.assert_array_equal(x.numpy(), [[0, 0], [3, 4], [0, 0], [1, 2]])


def test_index_copy_errors(device):
    x = ag.zeros(4, 3, device=device)
    src = ag.ones(2, 3, device=device)
    with pytest.raises(IndexError, match="Number of indices"):
        x.index_copy_(0, ag.tensor([1, 2, 3], device=device), src)
    with pytest.raises(IndexError, match="same slice shapes"):
        x.index_copy_(0, ag.tensor([1, 2], device=device), ag.ones(2, 4, device=device))
    with pytest.raises(IndexError, match="dimension 1 or 0"):
        x.index_copy_(0, ag.tensor([[1, 2]], device=device), src)
    with pytest.raises(RuntimeError, match="same dtype"):
        x.index_copy_(0, ag.tensor([1, 2], device=device), src.int())
    with pytest.raises(IndexError):
        x.index_copy_(0, [1, 4], src)      # host indices are checked
    with pytest.raises(IndexError, match="long tensor"):
        x.index_copy_(0, ag.tensor([1.0, 2.0], device=device), src)


def test_a_held_value_fused_into_an_assign_keeps_the_old_values(device):
    # ``a`` reads m and is fused into the value written into m; held by the caller, it is
    # computed before the write, so that it keeps what m was
    host = np.random.default_rng(7).standard_normal(64).astype(np.float32)
    m = ag.tensor(host, device=device).realize()
    a = m * 0.5
    m.assign(a + 1.0)
    np.testing.assert_allclose(m.numpy(), host * 0.5 + 1.0, rtol=1e-6)
    np.testing.assert_allclose(a.numpy(), host * 0.5, rtol=1e-6)
