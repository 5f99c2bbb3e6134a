"""Gradient clipping against torch.nn.utils."""

from __future__ import annotations

import numpy as np
import pytest

import anygpu as ag

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_grad_norm_matches_torch(device: str, norm_type: float) -> None:
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s).astype(np.float32) * 3 for s in [(4, 3), (5,), (2, 2, 2)]]
    ours = [ag.tensor(a, device=device, requires_grad=True) for a in arrays]
    theirs = [torch.tensor(a, requires_grad=True) for a in arrays]
    sum(((p * p).sum() for p in ours), ag.tensor(0.0, device=device)).backward()
    sum((p * p).sum() for p in theirs).backward()
    total = ag.nn.utils.clip_grad_norm_(ours, 1.5, norm_type)
    ref = torch.nn.utils.clip_grad_norm_(theirs, 1.5, norm_type)
    assert total.item() == pytest.approx(ref.item(), rel=1e-5)
    for p, t in zip(ours, theirs):
        np.testing.assert_allclose(p.grad.numpy(), t.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_clip_grad_value(device: str) -> None:
    w = ag.tensor([1.0, -2.0, 3.0], device=device, requires_grad=True)
    (w * w).sum().backward()
    ag.nn.utils.clip_grad_value_([w], 3.0)
    np.testing.assert_allclose(w.grad.numpy(), [2.0, -3.0, 3.0])
