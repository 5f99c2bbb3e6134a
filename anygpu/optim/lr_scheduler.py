"""Learning-rate schedules, as ``torch.optim.lr_scheduler`` (closed-form versions). Their
attributes carry PyTorch's names, so that ``state_dict`` round-trips with PyTorch's schedulers.

>>> import anygpu as ag
>>> w = ag.tensor([1.0], requires_grad=True)
>>> opt = ag.optim.SGD([w], lr=0.5)
>>> sched = StepLR(opt, step_size=2, gamma=0.1)
>>> sched.step(); sched.step()
>>> resumed = StepLR(ag.optim.SGD([w], lr=0.5), step_size=2)
>>> resumed.load_state_dict(sched.state_dict())
>>> resumed.last_epoch, resumed.gamma
(2, 0.1)
"""

from __future__ import annotations

import math
import types
from typing import Any, Callable, Sequence

from anygpu.optim.optimizer import Optimizer


class LRScheduler:
    def __init__(self, optimizer: Optimizer, last_epoch: int = -1):
        self.optimizer = optimizer
        self.base_lrs = [g.setdefault("initial_lr", g["lr"]) for g in optimizer.param_groups]
        self.last_epoch = last_epoch
        self.step()

    def lr_at(self, base_lr: float, epoch: int) -> float:
        raise NotImplementedError

    def group_lr(self, index: int, base_lr: float, epoch: int) -> float:
        """The learning rate of parameter group ``index`` at ``epoch``."""
        return self.lr_at(base_lr, epoch)

    def step(self) -> None:
        self.last_epoch += 1
        for i, (group, base) in enumerate(zip(self.optimizer.param_groups, self.base_lrs)):
            group["lr"] = self.group_lr(i, base, self.last_epoch)

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's attributes but the optimizer, as PyTorch's: the learning rates
        themselves are in the optimizer's state_dict."""
        return {k: v for k, v in self.__dict__.items() if k != "optimizer"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take the attributes of ``state_dict()``, this library's or PyTorch's."""
        self.__dict__.update(state_dict)


class StepLR(LRScheduler):
    def __init__(self, optimizer: Optimizer, step_size: int, gamma: float = 0.1,
                 last_epoch: int = -1):
        self.step_size, self.gamma = step_size, gamma
        super().__init__(optimizer, last_epoch)

    def lr_at(self, base_lr: float, epoch: int) -> float:
        return base_lr * self.gamma ** (epoch // self.step_size)


class CosineAnnealingLR(LRScheduler):
    def __init__(self, optimizer: Optimizer, T_max: int, eta_min: float = 0.0,
                 last_epoch: int = -1):
        self.T_max, self.eta_min = T_max, eta_min
        super().__init__(optimizer, last_epoch)

    def lr_at(self, base_lr: float, epoch: int) -> float:
        return self.eta_min + (base_lr - self.eta_min) * (
            1 + math.cos(math.pi * epoch / self.T_max)) / 2


class LinearLR(LRScheduler):
    """Linear ramp of the factor from start_factor to end_factor over total_iters (warmup)."""

    def __init__(self, optimizer: Optimizer, start_factor: float = 1 / 3,
                 end_factor: float = 1.0, total_iters: int = 5, last_epoch: int = -1):
        self.start_factor, self.end_factor = start_factor, end_factor
        self.total_iters = total_iters
        super().__init__(optimizer, last_epoch)

    def lr_at(self, base_lr: float, epoch: int) -> float:
        t = min(epoch, self.total_iters) / self.total_iters
        return base_lr * (self.start_factor + (self.end_factor - self.start_factor) * t)


class LambdaLR(LRScheduler):
    """The base rate times ``lr_lambda(epoch)``: one function, or one per parameter group."""

    def __init__(self, optimizer: Optimizer,
                 lr_lambda: Callable[[int], float] | Sequence[Callable[[int], float]],
                 last_epoch: int = -1):
        groups = len(optimizer.param_groups)
        if callable(lr_lambda):
            self.lr_lambdas = [lr_lambda] * groups
        else:
            self.lr_lambdas = list(lr_lambda)
            if len(self.lr_lambdas) != groups:
                raise ValueError(f"expected {groups} lr_lambdas, got {len(self.lr_lambdas)}")
        super().__init__(optimizer, last_epoch)

    def group_lr(self, index: int, base_lr: float, epoch: int) -> float:
        return base_lr * self.lr_lambdas[index](epoch)

    def state_dict(self) -> dict[str, Any]:
        """As PyTorch's: functions are left out, callable objects keep their attributes."""
        out = {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "lr_lambdas")}
        out["lr_lambdas"] = [dict(vars(fn)) if _is_object(fn) else None
                             for fn in self.lr_lambdas]
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        for fn, saved in zip(self.lr_lambdas, state.pop("lr_lambdas", [])):
            if saved is not None:
                vars(fn).update(saved)
        super().load_state_dict(state)


def _is_object(fn: Any) -> bool:
    """A callable object with attributes (kept in a state), not a function or lambda."""
    return not isinstance(fn, types.FunctionType) and hasattr(fn, "__dict__")
