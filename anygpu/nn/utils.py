"""Gradient clipping, as ``torch.nn.utils``. Nothing waits for the device: the norm stays a
tensor and the scaling fuses into the optimizer's update.

>>> import anygpu as ag
>>> w = ag.tensor([3.0, 4.0], requires_grad=True)
>>> (w * w).sum().backward()                       # grad = [6, 8], norm 10
>>> round(ag.nn.utils.clip_grad_norm_([w], 5.0).item(), 3)
10.0
>>> [round(v, 3) for v in w.grad.numpy().tolist()]
[3.0, 4.0]
"""

from __future__ import annotations

from typing import Iterable

from anygpu.ops.grad import no_grad
from anygpu.tensor import Tensor, stack


def _with_grads(parameters: Iterable[Tensor] | Tensor) -> list[Tensor]:
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    return [p for p in params if p.grad is not None]


def clip_grad_norm_(parameters: Iterable[Tensor] | Tensor, max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False) -> Tensor:
    """Scale the gradients so that their joint norm is at most ``max_norm``; return the norm."""
    params = _with_grads(parameters)
    if not params:
        raise ValueError("clip_grad_norm_: no parameter has a gradient")
    if error_if_nonfinite:
        raise NotImplementedError("error_if_nonfinite would wait for the device; check the "
                                  "returned norm instead")
    with no_grad():
        grads = [p.grad for p in params if p.grad is not None]  # all of them: see _with_grads
        if norm_type == float("inf"):
            total = stack([g.abs().amax() for g in grads]).amax()
        else:
            total = stack([(g.abs() ** norm_type).sum() for g in grads]).sum() ** (1.0 / norm_type)
        scale = (max_norm / (total + 1e-6)).clip(max=1.0)
        for p, g in zip(params, grads):
            p.grad = (g * scale).realize()
    return total


def clip_grad_value_(parameters: Iterable[Tensor] | Tensor, clip_value: float) -> None:
    """Clamp every gradient element into [-clip_value, clip_value]."""
    with no_grad():
        for p in _with_grads(parameters):
            p.grad = p.grad.clip(-clip_value, clip_value).realize()  # type: ignore[union-attr]
