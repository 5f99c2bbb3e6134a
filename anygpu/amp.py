"""Automatic mixed precision, as ``torch.autocast`` and ``torch.amp.GradScaler``.

Inside ``autocast(device_type, dtype)``, on tensors of that device type:
- products and convolutions (``matmul`` and ``@``, ``linear``, ``conv1d``/``conv2d`` and their
  transposes) take their float32 operands in ``dtype`` and return ``dtype``. A parameter's
  lowered copy is stored by a kernel of its own (as PyTorch caches it for the region), so the
  product reads plain 16-bit memory and runs on tensor cores where the device has them;
- softmax, log-softmax, layer and group norm and the losses compute in float32 and return
  float32 (they reduce over many values, where 16-bit sums lose precision);
- everything else runs in the dtype of its inputs (batch norm keeps its input's dtype, and
  elementwise ops promote as usual).
Weights stay float32 (the optimizer updates float32 "master" weights); gradients flow back
through the casts in float32. ``float16`` (PyTorch's default on GPUs) needs a ``GradScaler``
against gradients that underflow; ``bfloat16`` (the default on the processor) does not.

>>> import anygpu as ag
>>> model = ag.nn.Linear(8, 4)
>>> with ag.autocast("cpu", dtype=ag.bfloat16):
...     out = model(ag.randn(2, 8))
>>> out.dtype.name, model.weight.dtype.name
('bfloat16', 'float32')
"""

from __future__ import annotations

import functools
import threading
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from anygpu import dtype as dt
from anygpu.graph.lazy import is_view_of_buffer

if TYPE_CHECKING:
    from anygpu.tensor import Tensor

F = TypeVar("F", bound=Callable[..., Any])

_local = threading.local()  # .stack: the active (device type, dtype) regions, innermost last


def _regions() -> list[tuple[str, dt.DType | None]]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


class autocast:
    """A region (``with``) or a function (as a decorator) whose products and convolutions on
    ``device_type`` ("cuda", "cpu", "opencl", "webgpu", "hip") run in ``dtype``: float16 by
    default on GPUs, bfloat16 on the processor, as PyTorch's defaults."""

    def __init__(self, device_type: str = "cuda", dtype: Any = None, enabled: bool = True,
                 cache_enabled: bool | None = None) -> None:
        self.device_type = str(device_type).split(":")[0]
        if dtype is None:
            dtype = dt.bfloat16 if self.device_type == "cpu" else dt.float16
        self.dtype = dt.to_dtype(dtype)
        if self.dtype not in (dt.float16, dt.bfloat16):
            raise ValueError(f"autocast runs in float16 or bfloat16, not {self.dtype.name}")
        self.enabled = enabled

    def __enter__(self) -> "autocast":
        _regions().append((self.device_type, self.dtype if self.enabled else None))
        return self

    def __exit__(self, *exc: Any) -> None:
        _regions().pop()

    def __call__(self, fn: F) -> F:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with autocast(self.device_type, self.dtype, self.enabled):
                return fn(*args, **kwargs)
        return wrapped  # type: ignore[return-value]


def is_autocast_enabled(device_type: str | None = None) -> bool:
    return _active(device_type) is not None if device_type else any(
        d is not None for _, d in _regions())


def get_autocast_dtype(device_type: str) -> dt.DType:
    found = _active(device_type)
    return found if found is not None else (dt.bfloat16 if device_type == "cpu" else dt.float16)


def _active(device_type: str | None) -> dt.DType | None:
    """The dtype the innermost region for ``device_type`` lowers to (None: no region)."""
    for kind, dtype in reversed(_regions()):
        if kind == device_type:
            return dtype
    return None


def lower(*tensors: "Tensor | None") -> tuple[Any, ...]:
    """The operands of a product or convolution as autocast wants them: float32 ones cast to
    the region's dtype; the rest as they are. Outside a region, all as they are."""
    if not getattr(_local, "stack", None):
        return tensors
    out: list[Any] = []
    for t in tensors:
        target = _active(t.device.split(":")[0]) if t is not None else None
        if t is None or target is None or t.dtype != dt.float32:
            out.append(t)
            continue
        low = t.cast(target)
        if is_view_of_buffer(t.lazy):
            # a parameter (or other stored tensor): its copy gets a kernel of its own, so the
            # product reads 16-bit memory rather than casting inside its operand loads
            low.lazy.keep = True
        out.append(low)
    return tuple(out)


def widen(*tensors: "Tensor | None") -> tuple[Any, ...]:
    """16-bit float operands of a float32-list op (softmax, norms, losses) as float32, inside
    a region for their device; the rest as they are."""
    if not getattr(_local, "stack", None):
        return tensors
    return tuple(t.float() if t is not None and t.dtype in (dt.float16, dt.bfloat16) and
                 _active(t.device.split(":")[0]) is not None else t for t in tensors)


class GradScaler:
    """Scales the loss so that float16 gradients do not underflow, as ``torch.amp.GradScaler``:
    ``scaler.scale(loss).backward()``, ``scaler.step(optimizer)`` (unscales the gradients and
    skips the step where any is inf or NaN), ``scaler.update()`` (halves the scale after a
    skipped step, doubles it after ``growth_interval`` good ones).

    >>> import anygpu as ag
    >>> w = ag.tensor([1.0, 2.0], requires_grad=True)
    >>> opt = ag.optim.SGD([w], lr=0.1)
    >>> scaler = ag.amp.GradScaler()
    >>> scaler.scale((w * w).sum()).backward()
    >>> scaler.step(opt); scaler.update()
    >>> w.tolist()
    [0.800000011920929, 1.600000023841858]
    """

    def __init__(self, device: str = "cuda", init_scale: float = 2.0 ** 16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True) -> None:
        if growth_factor <= 1.0 or not 0.0 < backoff_factor < 1.0:
            raise ValueError("growth_factor must be > 1 and backoff_factor in (0, 1)")
        self._scale, self.growth_factor, self.backoff_factor = init_scale, growth_factor, \
            backoff_factor
        self.growth_interval, self.enabled = growth_interval, enabled
        self._good_steps = 0
        self._found_inf: bool | None = None
        self._unscaled: set[int] = set()

    def get_scale(self) -> float:
        return self._scale if self.enabled else 1.0

    def is_enabled(self) -> bool:
        return self.enabled

    def scale(self, outputs: Any) -> Any:
        if not self.enabled:
            return outputs
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        return outputs * self._scale

    def unscale_(self, optimizer: Any) -> None:
        """Divide the optimizer's gradients by the scale, in place, once per step."""
        if not self.enabled or id(optimizer) in self._unscaled:
            return
        from anygpu.tensor import stack

        grads = [p.grad for g in optimizer.param_groups for p in g["params"]
                 if p.grad is not None]
        inv = 1.0 / self._scale
        for p in (p for g in optimizer.param_groups for p in g["params"]):
            if p.grad is not None:
                p.grad = p.grad * inv
        # one read of the device for every gradient: whether any holds inf or NaN
        finite = stack([g.isfinite().all() for g in grads]).all() if grads else None
        self._found_inf = bool(finite is not None and not finite.item())
        self._unscaled.add(id(optimizer))

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.enabled:
            return optimizer.step(*args, **kwargs)
        self.unscale_(optimizer)
        if self._found_inf:
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | None = None) -> None:
        if not self.enabled:
            return
        if new_scale is not None:
            self._scale = float(new_scale)
        elif self._found_inf:
            self._scale *= self.backoff_factor
            self._good_steps = 0
        elif self._found_inf is not None:
            self._good_steps += 1
            if self._good_steps >= self.growth_interval:
                self._scale *= self.growth_factor
                self._good_steps = 0
        self._found_inf = None
        self._unscaled.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self._scale, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "_growth_tracker": self._good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._scale = float(state["scale"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self._good_steps = int(state.get("_growth_tracker", 0))
