"""More of PyTorch's methods and the top-level functions that mirror them, against PyTorch on
every available device."""

from __future__ import annotations

import math

import numpy as np
import pytest

import anygpu as ag

torch = pytest.importorskip("torch")


def close(got, want):
    want = want.detach().numpy() if hasattr(want, "detach") else np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


def _data(shape, seed):
    return (np.random.default_rng(seed).standard_normal(shape) + 0.25).astype(np.float32)


CASES = [
    ("tril", lambda m, x: m.tril(x), (4, 5)),
    ("tril -1", lambda m, x: x.tril(-1), (3, 4, 5)),
    ("triu 2", lambda m, x: m.triu(x, 2), (5, 4)),
    ("isclose", lambda m, x: m.isclose(x, x + 1e-6), (4, 5)),
    ("outer", lambda m, x: m.outer(x[0], x[1]), (2, 6)),
    ("mm", lambda m, x: m.mm(x, x.t()), (4, 5)),
    ("bmm", lambda m, x: m.bmm(x, x.transpose(1, 2)), (2, 3, 4)),
    ("norm", lambda m, x: m.norm(x), (4, 5)),
    ("norm dim", lambda m, x: x.norm(dim=1, keepdim=True), (4, 5)),
    ("norm 1", lambda m, x: x.norm(p=1, dim=0), (4, 5)),
    ("norm 3", lambda m, x: x.norm(p=3), (4, 5)),
    ("norm inf", lambda m, x: x.norm(p=math.inf, dim=1), (4, 5)),
    ("lerp", lambda m, x: x.lerp(x * 2, 0.3), (4, 5)),
    ("masked_select", lambda m, x: x.masked_select(x > 0.3), (4, 5)),
    ("nonzero", lambda m, x: (x > 0.3).nonzero(), (4, 5)),
    ("unbind", lambda m, x: m.unbind(x, 1)[2], (3, 4)),
    ("view_as", lambda m, x: x.view_as(x.reshape(20)), (4, 5)),
    ("type_as", lambda m, x: x.type_as(x.int()), (4, 5)),
    ("new_full", lambda m, x: x.new_full((2, 3), 1.5) + x.new_ones(3) - x.new_zeros(2, 3), (2,)),
    ("functions", lambda m, x: m.flatten(m.softmax(m.abs(x), -1)) + m.sum(m.tanh(x)), (3, 4)),
    ("argmax", lambda m, x: m.argmax(x, 1), (3, 4)),
]


@pytest.mark.parametrize("name,program,shape", CASES, ids=[c[0] for c in CASES])
def test_matches_pytorch(device, name, program, shape):
    data = _data(shape, 11)
    got = program(ag, ag.tensor(data, device=device))
    want = program(torch, torch.tensor(data))
    close(got, want)


def test_gradients_match_pytorch(device):
    data = _data((4, 5), 12)
    x = ag.tensor(data, device=device, requires_grad=True)
    tx = torch.tensor(data, requires_grad=True)
    for lib, t in ((ag, x), (torch, tx)):
        (lib.tril(t) * 2 + lib.norm(t, dim=1, keepdim=True) + t.lerp(t * t, 0.5)).sum().backward()
    close(x.grad, tx.grad)


def test_conveniences(device):
    x = ag.tensor(_data((3,), 13), device=device)
    assert f"{x.sum():.3f}" == f"{float(x.numpy().sum()):.3f}"
    assert list(range(ag.tensor(3, device=device))) == [0, 1, 2]
    assert [10, 20, 30][ag.tensor(1, device=device)] == 20
    with pytest.raises(TypeError, match="integer tensors of a single element"):
        range(ag.tensor(2.0, device=device))
    with pytest.raises(TypeError, match="unsupported format string"):
        f"{x:.2f}"
    assert ag.allclose(x, x + 1e-7) and not ag.allclose(x, x + 1)
    assert ag.equal(x, x) and not ag.equal(x, x[:2])
    assert ag.is_tensor(x) and not ag.is_tensor(data := _data((2,), 1)) and data.shape == (2,)
    assert ag.randn_like(x).shape == x.shape and ag.empty(2, 3, device=device).shape == (2, 3)
    assert x.element_size() == 4
