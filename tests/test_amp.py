"""Mixed precision: ``anygpu.autocast`` against ``torch.autocast``, and ``GradScaler``."""

from __future__ import annotations

import numpy as np
import pytest

import anygpu as ag
from anygpu.nn import functional as F
from anygpu.runtime.registry import get_device

torch = pytest.importorskip("torch")
TF = torch.nn.functional


def _data(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((4, 3, 10, 10)).astype(np.float32),
            "w": (rng.standard_normal((6, 3, 3, 3)) * 0.3).astype(np.float32),
            "b": rng.standard_normal(6).astype(np.float32),
            "lw": (rng.standard_normal((5, 6 * 8 * 8)) * 0.05).astype(np.float32),
            "lb": rng.standard_normal(5).astype(np.float32),
            "y": rng.integers(0, 5, 4)}


def _step(lib, fn, data, device, region):
    """A convolution, ReLU, linear layer and cross-entropy under ``region``: the dtypes seen,
    the loss and the parameters' gradients."""
    kw = {"device": device} if lib is ag else {}
    params = [lib.tensor(data[k], requires_grad=True, **kw) for k in ("w", "b", "lw", "lb")]
    w, b, lw, lb = params
    with region:
        h = fn.relu(fn.conv2d(lib.tensor(data["x"], **kw), w, b))
        logits = fn.linear(h.flatten(1), lw, lb)
        loss = fn.cross_entropy(logits, lib.tensor(data["y"], **kw))
    loss.backward()
    names = [str(t.dtype).split(".")[-1] for t in (h, logits, loss)]
    return names, float(loss.item()), [np.asarray(p.grad.float().cpu().numpy() if lib is torch
                                                  else p.grad.numpy()) for p in params], params


def test_autocast_matches_torch(device: str) -> None:
    if not get_device(device).supports(ag.bfloat16):
        pytest.skip(f"{device} has no bfloat16")
    data = _data(1)
    ours = _step(ag, F, data, device, ag.autocast(device, dtype=ag.bfloat16))
    theirs = _step(torch, TF, data, "cpu", torch.autocast("cpu", dtype=torch.bfloat16))
    # products in bfloat16, the loss in float32, as PyTorch's
    assert ours[0] == theirs[0] == ["bfloat16", "bfloat16", "float32"]
    np.testing.assert_allclose(ours[1], theirs[1], rtol=2e-2)
    for got, want in zip(ours[2], theirs[2]):
        assert got.dtype == np.float32  # the weights and their gradients stay float32
        scale = np.abs(want).max()
        np.testing.assert_allclose(got, want, atol=3e-2 * scale)
    assert all(p.dtype == ag.float32 for p in ours[3])
    # and close to the float32 step: the region changes precision, not the function
    exact = _step(ag, F, data, device, ag.autocast(device, enabled=False))
    assert exact[0] == ["float32"] * 3
    np.testing.assert_allclose(ours[1], exact[1], rtol=2e-2)


def test_autocast_regions(device: str) -> None:
    if not get_device(device).supports(ag.float16):
        pytest.skip(f"{device} has no float16")
    rng = np.random.default_rng(2)
    a = ag.tensor(rng.standard_normal((4, 8)).astype(np.float32), device=device)
    b = ag.tensor(rng.standard_normal((8, 3)).astype(np.float32), device=device)
    kind = device.split(":")[0]
    assert (a @ b).dtype == ag.float32
    with ag.autocast(kind, dtype=ag.float16):
        assert ag.amp.is_autocast_enabled(kind)
        assert (a @ b).dtype == ag.float16
        assert (a @ b).softmax(-1).dtype == ag.float32  # float32-list ops widen
        assert (a + 1).dtype == ag.float32  # other ops keep their inputs' dtype
        with ag.autocast(kind, enabled=False):
            assert (a @ b).dtype == ag.float32
        other = "cpu" if kind != "cpu" else "cuda"
        with ag.autocast(other):  # a region for another device type changes nothing here
            assert (a @ b).dtype == ag.float16
    assert (a @ b).dtype == ag.float32 and not ag.amp.is_autocast_enabled(kind)

    @ag.autocast(kind, dtype=ag.bfloat16)
    def product(x, y):
        return x @ y

    if get_device(device).supports(ag.bfloat16):
        out = product(a, b)
        assert out.dtype == ag.bfloat16
        np.testing.assert_allclose(out.float().numpy(), a.numpy() @ b.numpy(), rtol=3e-2,
                                   atol=3e-2)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        ag.autocast(kind, dtype=ag.int32)


def test_grad_scaler_follows_torch() -> None:
    """The same losses (one of them with an inf gradient) through both scalers: the scales,
    the skipped step and the weights after it agree with torch.amp.GradScaler's."""
    rng = np.random.default_rng(3)
    w0 = rng.standard_normal(4).astype(np.float32)
    scales = ([2.0 ** 10, 2.0 ** 10], [])

    def run(lib, make_scaler, which):
        w = lib.tensor(w0, requires_grad=True)
        opt = lib.optim.SGD([w], lr=0.1)
        scaler = make_scaler()
        for step in range(5):
            opt.zero_grad()
            loss = (w * w).sum() * (float("inf") if step == 2 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scales[which].append(scaler.get_scale())
        return w.detach().numpy() if lib is torch else w.numpy()

    scales[0].clear()
    ours = run(ag, lambda: ag.amp.GradScaler(init_scale=2.0 ** 10, growth_interval=2), 0)
    theirs = run(torch, lambda: torch.amp.GradScaler("cpu", init_scale=2.0 ** 10,
                                                     growth_interval=2), 1)
    assert scales[0] == scales[1], scales
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    want = w0 * 0.8 ** 4  # four good steps of w -= 0.1 * 2w; the inf step skipped
    np.testing.assert_allclose(ours, want, rtol=1e-5)
