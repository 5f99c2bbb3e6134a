"""A small CNN trained from the same weights and data order as in PyTorch tracks PyTorch's loss
curve for 20 steps, on every device."""

from __future__ import annotations

import numpy as np
import pytest

import anygpu as ag
from anygpu.nn import functional as F

torch = pytest.importorskip("torch")


def _forward(lib, params, x):
    conv = F.conv2d if lib is ag else torch.nn.functional.conv2d
    w1, b1, w2, b2, w3, b3 = params
    h = conv(x, w1, b1, padding=1).relu()
    h = conv(h, w2, b2, stride=2).relu()
    h = h.reshape(h.shape[0], -1)
    logits = h @ w3 + b3
    return logits.log_softmax(-1)


def _nll(logp, y, lib):
    if lib is ag:
        return -(logp.gather(1, y.reshape(-1, 1))).mean()
    return torch.nn.functional.nll_loss(logp, y)


def test_cnn_tracks_pytorch(device: str) -> None:
    rng = np.random.default_rng(0)
    shapes = [(8, 1, 3, 3), (8,), (16, 8, 3, 3), (16,), (16 * 3 * 3, 10), (10,)]
    init = [(rng.standard_normal(s) * (0.15 if len(s) > 1 else 0.05)).astype(np.float32)
            for s in shapes]
    xs = rng.standard_normal((20, 16, 1, 8, 8)).astype(np.float32)
    ys = rng.integers(0, 10, (20, 16))
    ours = [ag.tensor(a, device=device, requires_grad=True) for a in init]
    theirs = [torch.tensor(a, requires_grad=True) for a in init]
    opt = ag.optim.SGD(ours, lr=0.02, momentum=0.9)
    topt = torch.optim.SGD(theirs, lr=0.02, momentum=0.9)
    curve, ref = [], []
    for step in range(20):
        opt.zero_grad()
        topt.zero_grad()
        loss = _nll(_forward(ag, ours, ag.tensor(xs[step], device=device)),
                    ag.tensor(ys[step], device=device), ag)
        tloss = _nll(_forward(torch, theirs, torch.tensor(xs[step])), torch.tensor(ys[step]),
                     torch)
        loss.backward()
        tloss.backward()
        opt.step()
        topt.step()
        curve.append(loss.item())
        ref.append(tloss.item())
    np.testing.assert_allclose(curve, ref, rtol=1e-3, atol=1e-4)
