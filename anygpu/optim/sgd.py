"""SGD with momentum, dampening, Nesterov momentum and weight decay, as ``torch.optim.SGD``."""

from __future__ import annotations

from typing import Any, Iterable

from anygpu.optim.optimizer import Bucket, Optimizer, ParamGroup
from anygpu.tensor import Tensor


class SGD(Optimizer):
    def __init__(self, params: Iterable[Any], lr: float = 1e-3, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
                 maximize: bool = False):
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"invalid SGD hyperparameters lr={lr} momentum={momentum} "
                             f"weight_decay={weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum needs a momentum and zero dampening")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov,
                                      maximize=maximize))

    def _update(self, group: ParamGroup, bucket: Bucket, lr: Tensor, count: Tensor) -> None:
        p = bucket.flat
        g = bucket.grad()
        if group["maximize"]:
            g = -g
        if group["weight_decay"]:
            g = g + group["weight_decay"] * p
        mu = group["momentum"]
        if mu:
            buf = bucket.buffer("momentum_buffer")
            # the first step starts the buffer at the gradient itself
            first = count.eq(1)
            buf.assign(first._select(g, buf * mu + g * (1 - group["dampening"])))
            g = g + buf * mu if group["nesterov"] else buf
        p.assign(p - lr * g)
