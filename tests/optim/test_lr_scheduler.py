"""Learning-rate schedulers' state_dict: resuming gives the rates of an uninterrupted run, from
this library's state or PyTorch's."""

from __future__ import annotations

from typing import Any, Callable

import pytest

import anygpu as ag
from anygpu.optim import lr_scheduler

MAKERS: list[Callable[[Any, Any], Any]] = [
    lambda m, o: m.StepLR(o, step_size=3, gamma=0.5),
    lambda m, o: m.CosineAnnealingLR(o, T_max=7, eta_min=0.01),
    lambda m, o: m.LinearLR(o, start_factor=0.1, total_iters=4),
    lambda m, o: m.LambdaLR(o, lambda epoch: 0.9 ** epoch),
]


def _sgd(lr: float = 0.5) -> ag.optim.SGD:
    return ag.optim.SGD([ag.tensor([1.0], requires_grad=True)], lr=lr)


@pytest.mark.parametrize("make", MAKERS, ids=["StepLR", "Cosine", "LinearLR", "LambdaLR"])
def test_resume_from_our_state_and_torchs(make: Callable[[Any, Any], Any]) -> None:
    opt = _sgd()
    sched = make(lr_scheduler, opt)
    for _ in range(4):
        sched.step()
    resumed_opt = _sgd(lr=0.1)
    resumed = make(lr_scheduler, resumed_opt)
    resumed_opt.load_state_dict(opt.state_dict())
    resumed.load_state_dict(sched.state_dict())
    for _ in range(5):
        sched.step()
        resumed.step()
        assert resumed.get_last_lr() == sched.get_last_lr()

    torch = pytest.importorskip("torch")
    topt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
    theirs = make(torch.optim.lr_scheduler, topt)
    for _ in range(4):
        topt.step()
        theirs.step()
    ours_opt = _sgd(lr=0.1)
    ours = make(lr_scheduler, ours_opt)
    ours_opt.load_state_dict(topt.state_dict())
    ours.load_state_dict(theirs.state_dict())
    assert ours.last_epoch == theirs.last_epoch == 4
    for _ in range(5):
        topt.step()
        theirs.step()
        ours.step()
        assert ours.get_last_lr()[0] == pytest.approx(theirs.get_last_lr()[0], rel=1e-9)


def test_lambda_state_keeps_callable_objects() -> None:
    class Warmup:
        def __init__(self, steps: int):
            self.steps = steps

        def __call__(self, epoch: int) -> float:
            return min(1.0, (epoch + 1) / self.steps)

    sched = lr_scheduler.LambdaLR(_sgd(), [Warmup(10)])
    state = sched.state_dict()
    assert state["lr_lambdas"] == [{"steps": 10}] and "optimizer" not in state
    other = lr_scheduler.LambdaLR(_sgd(), Warmup(3))
    other.load_state_dict(state)
    assert other.lr_lambdas[0].steps == 10
    assert lr_scheduler.LambdaLR(_sgd(), lambda e: 1.0).state_dict()["lr_lambdas"] == [None]
