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

import warnings
from typing import Any, Iterable, Mapping

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
        flat = cat([p.grad.reshape(-1) for p in self.params])  # type: ignore[union-attr]
        # fused into the update kernels that read it (each reads the gradients once), not
        # stored first as cat's result otherwise is: that would add a kernel and two passes
        flat.lazy.keep = False
        return flat

    def buffer(self, name: str) -> Tensor:
        if name not in self.state:
            # in memory from the start, so the first step runs the same kernels as the rest
            self.state[name] = zeros(self.flat.shape, dtype=self.flat.dtype,
                                     device=self.flat.device).realize()
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
        # the flat buffers now, not in the first step: that step then runs the kernels of the
        # steps after it (a realization between backward and the update would change them)
        for i, group in enumerate(self.param_groups):
            self._group_buckets(i, list(group["params"]))

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
            dict.__setitem__(group, "_step", zeros(1, device=device).realize())
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

    def _indexed_params(self) -> list[Tensor]:
        """Every parameter, in the order state_dict numbers them (group after group)."""
        return [p for g in self.param_groups for p in g["params"]]

    def state_dict(self) -> dict[str, Any]:
        """PyTorch's structure: ``{"state": {index: {"step", buffers}}, "param_groups":
        [{hyperparameters, "params": [indices]}]}``, parameters numbered group after group. The
        tensors show the optimizer's own memory, as PyTorch's are references to its state: save
        them, or ``clone()`` them to keep the values of this step.

        >>> import anygpu as ag
        >>> w = ag.tensor([1.0, 2.0], requires_grad=True)
        >>> opt = ag.optim.Adam([w], lr=0.1)
        >>> (w * w).sum().backward()
        >>> opt.step()
        >>> sd = opt.state_dict()
        >>> sorted(sd["state"][0]), sd["state"][0]["step"].item(), sd["param_groups"][0]["params"]
        (['exp_avg', 'exp_avg_sq', 'step'], 1.0, [0])
        """
        index = {id(p): k for k, p in enumerate(self._indexed_params())}
        state: dict[int, dict[str, Tensor]] = {}
        # later buckets hold a parameter's current state where the parameters with gradients
        # changed between steps (dicts keep insertion order)
        for (group_index, _), buckets in self._buckets.items():
            count = self.param_groups[group_index].get("_step")
            for b in buckets:
                start = 0
                for p, n, shape in zip(b.params, b.sizes, b.shapes):
                    entry = state.setdefault(index[id(p)], {})
                    if count is not None and count.device == b.flat.device:
                        entry["step"] = count.reshape(())  # a 0-d float32 tensor, as PyTorch's
                    for name, t in b.state.items():
                        entry[name] = t.shrink([(start, start + n)]).reshape(shape)
                    start += n
        groups = []
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params" and not k.startswith("_")}
            packed["params"] = [index[id(p)] for p in g["params"]]
            groups.append(packed)
        # buckets exist from the start: parameters without state yet have no entry, as in PyTorch
        state = {k: v for k, v in state.items() if v}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Take the hyperparameters and state of ``state_dict()``, this optimizer's or
        ``torch.optim``'s (buffers as torch tensors, NumPy arrays or Tensors; steps as tensors or
        numbers), for the same parameters in the same order. The loaded state replaces this
        optimizer's, written into the same device memory.

        anygpu keeps one step count per parameter group and device, where PyTorch keeps one per
        parameter: the largest step of the group's parameters is taken (they differ only where
        some parameters got no gradient in some steps; a warning says so).

        >>> import anygpu as ag
        >>> w = ag.tensor([1.0, 2.0], requires_grad=True)
        >>> opt = ag.optim.SGD([w], lr=0.1, momentum=0.9)
        >>> (w * w).sum().backward()
        >>> opt.step()
        >>> twin = ag.optim.SGD([ag.tensor([1.0, 2.0], requires_grad=True)], lr=0.5, momentum=0.9)
        >>> twin.load_state_dict(opt.state_dict())
        >>> twin.param_groups[0]["lr"], twin.state_dict()["state"][0]["momentum_buffer"].tolist()
        (0.1, [2.0, 4.0])
        """
        saved_groups = list(state_dict["param_groups"])
        saved_state = {int(k): v for k, v in state_dict["state"].items()}
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        by_index: dict[int, Tensor] = {}
        for group, saved in zip(self.param_groups, saved_groups):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError("loaded state dict contains a parameter group that doesn't "
                                 "match the size of optimizer's group")
            by_index.update(zip((int(i) for i in saved["params"]), group["params"]))
        for i, entry in saved_state.items():
            if i not in by_index:
                raise ValueError(f"loaded state dict has state for parameter {i}, which no "
                                 "parameter group lists")
            for name, value in entry.items():
                shape = tuple(getattr(value, "shape", np.shape(value)))
                if name != "step" and value is not None and shape != by_index[i].shape:
                    raise ValueError(f"loaded state {name!r} of parameter {i} has shape "
                                     f"{shape}, the parameter {by_index[i].shape}")
        # everything checked: nothing changes where something raised
        for group, saved in zip(self.param_groups, saved_groups):
            for key, value in saved.items():
                if key != "params":
                    group[key] = float(value) if key == "lr" else value
        loaded: set[int] = set()
        with no_grad():
            for gi, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
                with_state = [(p, saved_state[int(i)]) for i, p in zip(saved["params"],
                                                                       group["params"])
                              if int(i) in saved_state]
                for device in dict.fromkeys(p.device for p, _ in with_state):
                    here = [(p, e) for p, e in with_state if p.device == device]
                    _, count = self._device_scalars(group, device)
                    count.assign(_loaded_step([e for _, e in here]))
                    entries = {id(p): e for p, e in here}
                    for b in self._group_buckets(gi, [p for p, _ in here]):
                        _load_bucket(b, [entries[id(p)] for p in b.params])
                        loaded.add(id(b))
                if not with_state and "_step" in group:
                    group["_step"].assign(0)
            # PyTorch's load replaces the whole state: what the file lacks starts afresh
            for buckets in self._buckets.values():
                for b in buckets:
                    if id(b) not in loaded:
                        for t in b.state.values():
                            t.assign(0)


def _loaded_step(entries: list[Mapping[str, Any]]) -> float:
    """The step count of a group's parameters. A state without one but with buffers (torch's
    SGD keeps no step) has stepped at least once: its momentum buffer is in use."""
    steps = {float(e["step"]) for e in entries if e.get("step") is not None}
    if len(steps) > 1:
        warnings.warn(f"the loaded parameters of a group have different step counts "
                      f"{sorted(steps)}; anygpu keeps one per group and takes {max(steps)}",
                      stacklevel=3)
    if steps:
        return max(steps)
    has_buffers = any(v is not None for e in entries for k, v in e.items() if k != "step")
    return 1.0 if has_buffers else 0.0


def _load_bucket(bucket: Bucket, entries: list[Mapping[str, Any]]) -> None:
    """Write the loaded buffers of a bucket's parameters into its flat state tensors; a buffer
    that a parameter lacks starts at zero."""
    names = dict.fromkeys(k for e in entries for k, v in e.items()
                          if k != "step" and v is not None)
    flat = bucket.flat
    for name in names:
        parts = []
        for entry, n in zip(entries, bucket.sizes):
            value = entry.get(name)
            if value is None:
                parts.append(zeros(n, dtype=flat.dtype, device=flat.device))
            elif isinstance(value, Tensor):
                parts.append(value.detach().to(flat.device).cast(flat.dtype).reshape(-1))
            else:  # a torch tensor or a NumPy array
                parts.append(tensor(value, dtype=flat.dtype, device=flat.device).reshape(-1))
        bucket.buffer(name).assign(cat(parts))
    for name, t in bucket.state.items():
        if name not in names:
            t.assign(0)
