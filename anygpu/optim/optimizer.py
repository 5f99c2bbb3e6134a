"""Optimizers whose update is fused: parameters of one device and dtype live in flat buffers of
a few parameters each (a *bucket*), and each bucket's update is one kernel per state tensor,
written in place. Hyperparameters that change during training (the learning rate, the step count)
live in device memory, so the kernels never change and a ``jit``-captured step replays them.

>>> import anygpu as ag
>>> w = ag.tensor([1.0, 2.0], requires_grad=True)
>>> opt = ag.optim.SGD([w], lr=0.5)
>>> (w * w).sum().backward()
>>> opt.step()
>>> w.numpy().tolist()
[0.0, 0.0]
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from anygpu.ops.grad import no_grad
from anygpu.tensor import Tensor, cat, tensor, zeros

# parameters per fused kernel: WebGPU guarantees only 8 storage buffers per kernel
BUCKET_SIZE = 6


class ParamGroup(dict):
    """A parameter group (a dict, as in PyTorch). Setting ``lr`` also updates the device copy
    the update kernels read, so schedulers work with captured steps."""

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        if key == "lr" and "_lr" in self:
            self["_lr"].assign(tensor([float(value)], device=self["_lr"].device))


class Bucket:
    """A few parameters of one device and dtype, stored back to back in one flat tensor."""

    def __init__(self, params: list[Tensor]):
        self.params = params
        self.sizes = [p.numel() for p in params]
        self.shapes = [p.shape for p in params]
        with no_grad():
            self.flat = cat([p.detach().reshape(-1) for p in params]).contiguous().realize()
            self.flat = self.flat.detach()
        self.views: list[Any] = []
        self._point()
        self.state: dict[str, Tensor] = {}

    def _point(self) -> None:
        """Make each parameter a view of its slice of the flat buffer."""
        self.views, start = [], 0
        for p, n, shape in zip(self.params, self.sizes, self.shapes):
            view = self.flat.shrink([(start, start + n)]).reshape(shape)
            p.lazy = view.lazy
            self.views.append(view.lazy)
            start += n

    def refresh(self) -> None:
        """Take back parameters that were replaced from outside (load_state_dict, .to())."""
        if any(p.lazy is not v for p, v in zip(self.params, self.views)):
            with no_grad():
                self.flat.assign(cat([p.detach().reshape(-1) for p in self.params]))
            self._point()

    def grad(self) -> Tensor:
        return cat([p.grad.reshape(-1) for p in self.params])  # type: ignore[union-attr]

    def buffer(self, name: str) -> Tensor:
        if name not in self.state:
            self.state[name] = zeros(self.flat.shape, dtype=self.flat.dtype,
                                     device=self.flat.device)
        return self.state[name]


class Optimizer:
    """Base class: ``param_groups`` and ``state`` as in PyTorch, ``step()`` and ``zero_grad()``."""

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]):
        groups = list(params)
        if not groups:
            raise ValueError("optimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.defaults = defaults
        self.param_groups: list[ParamGroup] = []
        for g in groups:
            group = ParamGroup({**defaults, **g})
            group["params"] = list(group["params"])
            for p in group["params"]:
                if not isinstance(p, Tensor) or not p.requires_grad:
                    raise ValueError("optimizers take tensors that require gradients")
            self.param_groups.append(group)
        self._buckets: dict[tuple, list[Bucket]] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    def _group_buckets(self, index: int, params: list[Tensor]) -> list[Bucket]:
        key = (index, tuple(id(p) for p in params))
        buckets = self._buckets.get(key)
        if buckets is None:
            by_kind: dict[tuple, list[Tensor]] = {}
            for p in params:
                by_kind.setdefault((p.device, p.dtype), []).append(p)
            buckets = [Bucket(ps[i:i + BUCKET_SIZE]) for ps in by_kind.values()
                       for i in range(0, len(ps), BUCKET_SIZE)]
            self._buckets[key] = buckets
        for b in buckets:
            b.refresh()
        return buckets

    def _device_scalars(self, group: ParamGroup, device: str) -> tuple[Tensor, Tensor]:
        """The group's learning rate and step count as one-element device tensors."""
        if "_lr" not in group or group["_lr"].device != device:
            dict.__setitem__(group, "_lr", tensor([float(group["lr"])], device=device))
            dict.__setitem__(group, "_step", zeros(1, device=device))
        return group["_lr"], group["_step"]

    def step(self) -> None:
        with no_grad():
            for i, group in enumerate(self.param_groups):
                params = [p for p in group["params"] if p.grad is not None]
                if not params:
                    continue
                devices = {p.device for p in params}
                for device in devices:
                    lr, count = self._device_scalars(group, device)
                    count.assign(count + 1)
                    for b in self._group_buckets(i, [p for p in params if p.device == device]):
                        self._update(group, b, lr, count)

    def _update(self, group: ParamGroup, bucket: Bucket, lr: Tensor, count: Tensor) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Hyperparameters and per-parameter state, keyed by parameter position as PyTorch."""
        state: dict[int, dict[str, np.ndarray]] = {}
        index = {id(p): k for k, p in enumerate(p for g in self.param_groups
                                                 for p in g["params"])}
        for buckets in self._buckets.values():
            for b in buckets:
                start = 0
                for p, n in zip(b.params, b.sizes):
                    state[index[id(p)]] = {name: t.numpy()[start:start + n].reshape(p.shape)
                                           for name, t in b.state.items()}
                    start += n
        groups = [{k: v for k, v in g.items() if k != "params" and not k.startswith("_")}
                  for g in self.param_groups]
        return {"state": state, "param_groups": groups}
