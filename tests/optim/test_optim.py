"""Ten steps of each optimizer match torch.optim from the same start, on every device."""

from __future__ import annotations

import numpy as np
import pytest

import anygpu as ag

torch = pytest.importorskip("torch")

SHAPES = [(5, 3), (3,), (4, 4, 2), (7,), (2, 3), (6,), (3, 3), (1,), (2, 2)]
CASES = [
    ("SGD", dict(lr=0.1)),
    ("SGD", dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    ("SGD", dict(lr=0.05, momentum=0.9, dampening=0.1)),
    ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True)),
    ("SGD", dict(lr=0.05, maximize=True)),
    ("Adam", dict(lr=0.01)),
    ("Adam", dict(lr=0.01, betas=(0.8, 0.99), weight_decay=0.1)),
    ("AdamW", dict(lr=0.01, weight_decay=0.1)),
]


def _loss(params: list, x) -> object:
    total = 0
    for i, p in enumerate(params):
        total = total + ((p * x[i % len(x)]).sin() * (i + 1)).sum() + (p * p).sum() * 0.1
    return total


@pytest.mark.parametrize("name,kwargs", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_ten_steps_match_torch(device: str, name: str, kwargs: dict) -> None:
    rng = np.random.default_rng(len(name) * 1000 + len(kwargs))
    init = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    # small inputs keep the loss surface gentle: with steep sines, ten momentum steps magnify
    # float32 rounding differences beyond any fixed tolerance
    data = (rng.standard_normal((10, 8)) * 0.3).astype(np.float32)
    ours = [ag.tensor(a, device=device, requires_grad=True) for a in init]
    theirs = [torch.tensor(a, requires_grad=True) for a in init]
    opt = getattr(ag.optim, name)(ours, **kwargs)
    topt = getattr(torch.optim, name)(theirs, **kwargs)
    for step in range(10):
        opt.zero_grad()
        topt.zero_grad()
        _loss(ours, ag.tensor(data[step], device=device)).backward()
        _loss(theirs, torch.tensor(data[step])).backward()
        opt.step()
        topt.step()
    for p, t in zip(ours, theirs):
        np.testing.assert_allclose(p.numpy(), t.detach().numpy(), rtol=1e-4, atol=1e-5)


def test_lr_schedules_match_torch() -> None:
    def pair(make):
        w = ag.tensor([1.0], requires_grad=True)
        tw = torch.tensor([1.0], requires_grad=True)
        o, to = ag.optim.SGD([w], lr=0.5), torch.optim.SGD([tw], lr=0.5)
        return make(ag.optim.lr_scheduler, o), make(torch.optim.lr_scheduler, to), o, to

    makers = [lambda m, o: m.StepLR(o, step_size=3, gamma=0.5),
              lambda m, o: m.CosineAnnealingLR(o, T_max=7, eta_min=0.01),
              lambda m, o: m.LinearLR(o, start_factor=0.1, total_iters=4),
              lambda m, o: m.LambdaLR(o, lambda e: 0.9 ** e)]
    for make in makers:
        ours, theirs, o, to = pair(make)
        for _ in range(9):
            o.step()
            to.step()
            ours.step()
            theirs.step()
            assert ours.get_last_lr()[0] == pytest.approx(theirs.get_last_lr()[0], rel=1e-9)


def test_scheduler_changes_reach_the_update(device: str) -> None:
    w = ag.tensor([1.0, 2.0], device=device, requires_grad=True)
    opt = ag.optim.SGD([w], lr=1.0)
    sched = ag.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    expected = np.array([1.0, 2.0])
    for lr in (1.0, 0.5, 0.25):
        opt.zero_grad()
        w.sum().backward()
        opt.step()
        sched.step()
        expected = expected - lr
        np.testing.assert_allclose(w.numpy(), expected, rtol=1e-6)


def test_update_is_a_few_kernels(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The update of 20 parameters is a few fused kernels, not several per parameter."""
    from anygpu.graph import schedule as sched

    params = [ag.tensor(np.random.default_rng(4).standard_normal(4).astype(np.float32),
                        device=device, requires_grad=True) for _ in range(20)]
    opt = ag.optim.Adam(params, lr=0.1)
    for p in params:
        p.grad = (p * 2).realize().detach()
    launched: list[str] = []
    real = sched._run_kernel
    monkeypatch.setattr(sched, "_run_kernel", lambda item: (launched.append("k"), real(item)))
    opt.step()
    # the first step also fills the zeroed state buffers (exp_avg, exp_avg_sq, the step count)
    assert len(launched) <= 19, f"{len(launched)} kernels for 20 parameters"


def test_a_step_is_three_passes_a_bucket(device: str) -> None:
    """A later Adam step over a bucket of parameters writes its two moments and the
    parameters in place, one kernel each (every launch counted, in-place ones too); the
    moments scaled by their betas had run as kernels of their own first, two passes more."""
    rng = np.random.default_rng(6)
    params = [ag.tensor(rng.standard_normal(n).astype(np.float32), device=device,
                        requires_grad=True) for n in (300, 40, 7)]
    opt = ag.optim.Adam(params, lr=0.1)
    for _ in range(2):
        for p in params:
            p.grad = (p * 2).realize().detach()
        with ag.profile() as prof:
            opt.step()
    kernels = [e for e in prof.events if e.kind == "kernel" and e.name == "e_347"]
    assert len(kernels) == 3, [e.name for e in prof.events]


def test_errors() -> None:
    with pytest.raises(ValueError):
        ag.optim.SGD([], lr=0.1)
    with pytest.raises(ValueError):
        ag.optim.SGD([ag.tensor([1.0])], lr=0.1)  # does not require grad
    with pytest.raises(ValueError):
        ag.optim.SGD([ag.tensor([1.0], requires_grad=True)], lr=0.1, nesterov=True)
    with pytest.raises(ValueError):
        ag.optim.Adam([ag.tensor([1.0], requires_grad=True)], betas=(1.5, 0.9))


def test_values_built_before_a_step_see_the_old_parameters(device: str) -> None:
    """`loss.item()` after `opt.step()` is the loss of the parameters it was computed from."""
    start = np.random.default_rng(5).standard_normal(5).astype(np.float32)
    w = ag.tensor(start, device=device, requires_grad=True)
    opt = ag.optim.SGD([w], lr=0.5, momentum=0.9)
    out = (w * 3).exp()
    loss = out.sum()
    loss.backward()
    opt.step()
    np.testing.assert_allclose(loss.item(), np.exp(start * 3).sum(), rtol=1e-5)
    np.testing.assert_allclose(out.numpy(), np.exp(start * 3), rtol=1e-5)
    assert not np.allclose(w.numpy(), start)


def test_intermediates_built_before_a_later_step_keep_their_values(device: str) -> None:
    """After a first step the parameters are views of the optimizer's memory; values fused
    into the loss but held by the program (``out``) still show the parameters they were built
    from when read after the next step."""
    start = np.random.default_rng(6).standard_normal(5).astype(np.float32)
    w = ag.tensor(start, device=device, requires_grad=True)
    opt = ag.optim.Adam([w], lr=0.1)
    for _ in range(3):
        before = w.numpy().copy()
        out = (w * 3).exp()
        half = w[1:4] * 2          # through a view of the parameter
        loss = out.sum() + half.sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        np.testing.assert_allclose(loss.item(), np.exp(before * 3).sum() + before[1:4].sum() * 2,
                                   rtol=1e-5)
        np.testing.assert_allclose(out.numpy(), np.exp(before * 3), rtol=1e-5)
        np.testing.assert_allclose(half.numpy(), before[1:4] * 2, rtol=1e-6)
        assert not np.allclose(w.numpy(), before)
