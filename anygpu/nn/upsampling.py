"""``interpolate`` (``F.interpolate``) and the ``Upsample`` layers, with PyTorch's modes,
arguments, errors and source-index formulas.

Every spatial axis is resampled on its own (the modes are separable): the source indices and
weights of an axis depend only on its sizes, so they are computed on the host in float32, as
PyTorch's CPU kernels compute them. Where they follow a pattern the output is made of views:
nearest with an integer scale is a slice with each element repeated, and taps that repeat with
a period (a scale factor of 2, 4, 1/2, ...) are slices of the input padded with its edges, one
per tap and phase, weighted by constants; elsewhere it is ``index_select`` gathers by indices
uploaded from the host, times the weights. Gradients come from autograd: views give
elementwise kernels, gathers a one-hot reduction.

>>> import anygpu as ag
>>> from anygpu.nn import functional as F
>>> x = ag.arange(4.0).reshape(1, 1, 4)
>>> F.interpolate(x, scale_factor=2, mode="nearest").tolist()
[[[0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]]]
>>> F.interpolate(x, size=3, mode="linear", align_corners=True).tolist()
[[[0.0, 1.5, 3.0]]]
"""

from __future__ import annotations

import functools
from typing import Any, Sequence, Union, cast

import numpy as np

from anygpu.nn.module import Module
from anygpu.tensor import Tensor, cat, stack, tensor

SizeLike = Union[int, Sequence[int]]
ScaleLike = Union[float, Sequence[float]]

_F32 = np.float32
# the modes and the input ranks each takes (N, C and one to three spatial axes)
_MODES = {"nearest": (3, 4, 5), "nearest-exact": (3, 4, 5), "area": (3, 4, 5), "linear": (3,),
          "bilinear": (4,), "trilinear": (5,), "bicubic": (4,)}
_RANK_NAMES = {"linear": 3, "bilinear": 4, "trilinear": 5}


def _is_integer(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _scale(size: int, out: int, align_corners: bool, scale: float | None) -> np.float32:
    """PyTorch's ``area_pixel_compute_scale`` in float32: input steps per output step."""
    if align_corners:
        return _F32(size - 1) / _F32(out - 1) if out > 1 else _F32(0)
    if scale is not None and scale > 0:
        return _F32(1.0 / scale)
    return _F32(size) / _F32(out)


def _nearest_index(size: int, out: int, scale: float | None, exact: bool) -> np.ndarray:
    """'nearest': ``floor(i * s)``, as OpenCV's INTER_NEAREST; 'nearest-exact':
    ``floor((i + 0.5) * s - 0.5 + 0.5)``, as Pillow and scipy; both clamped to the input."""
    s = _scale(size, out, False, scale)
    i = np.arange(out, dtype=_F32)
    if exact:
        real = np.maximum(s * (i + _F32(0.5)) - _F32(0.5), _F32(0))
        idx = np.floor(real.astype(np.float64) + 0.5)
    else:
        idx = np.floor(s * i)
    return np.minimum(idx.astype(np.int64), size - 1)


def _linear_taps(size: int, out: int, align_corners: bool, scale: float | None
                 ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The two source indices and weights of each output ('linear' and its 2-D, 3-D forms).
    Without ``align_corners`` the source position is ``s * (i + 0.5) - 0.5``, clamped at 0;
    with it, ``i * (size - 1) / (out - 1)``. An axis that keeps its size is copied."""
    if out == size:
        return [np.arange(out)] * 2, [np.ones(out, _F32), np.zeros(out, _F32)]
    s = _scale(size, out, align_corners, scale)
    i = np.arange(out, dtype=_F32)
    if align_corners:
        real = s * i
    else:
        real = np.maximum(s * (i + _F32(0.5)) - _F32(0.5), _F32(0))
    i0 = np.minimum(np.floor(real).astype(np.int64), size - 1)
    lam = np.minimum(np.maximum(real - i0.astype(_F32), _F32(0)), _F32(1))
    i1 = i0 + (i0 < size - 1)
    return [i0, i1], [_F32(1) - lam, lam]


def _cubic_taps(size: int, out: int, align_corners: bool, scale: float | None
                ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The four source indices (clamped to the input) and weights of each output: Keys' cubic
    convolution with A = -0.75, as PyTorch (the source position is not clamped at 0)."""
    s = _scale(size, out, align_corners, scale)
    i = np.arange(out, dtype=_F32)
    real = s * i if align_corners else s * (i + _F32(0.5)) - _F32(0.5)
    i0 = np.minimum(np.floor(real).astype(np.int64), size - 1)
    t = np.minimum(np.maximum(real - i0.astype(_F32), _F32(0)), _F32(1))
    a = _F32(-0.75)

    def near(x: np.ndarray) -> np.ndarray:  # |x| <= 1
        return ((a + _F32(2)) * x - (a + _F32(3))) * x * x + _F32(1)

    def far(x: np.ndarray) -> np.ndarray:  # 1 < |x| < 2
        return ((a * x - _F32(5) * a) * x + _F32(8) * a) * x - _F32(4) * a

    rest = _F32(1) - t
    weights = [far(t + _F32(1)), near(t), near(rest), far(rest + _F32(1))]
    return [np.clip(i0 - 1 + j, 0, size - 1) for j in range(4)], weights


def _slice(x: Tensor, axis: int, start: int, step: int, count: int) -> Tensor:
    """Elements ``start, start + step, ...`` (``count`` of them) along ``axis``: a view."""
    return x[(slice(None),) * axis + (slice(start, start + step * (count - 1) + 1, step),)]


def _repeat_pattern(idx: np.ndarray) -> tuple[int, int, int] | None:
    """(start, step, repeat) where ``idx[i] = start + (i // repeat) * step``, else None."""
    out, start = len(idx), int(idx[0])
    changes = np.flatnonzero(np.diff(idx))
    repeat = int(changes[0]) + 1 if len(changes) else out
    step = int(idx[repeat] - idx[0]) if repeat < out else 1
    if step < 1 or not np.array_equal(idx, start + (np.arange(out) // repeat) * step):
        return None
    return start, step, repeat


def _repeated(x: Tensor, axis: int, idx: np.ndarray) -> Tensor:
    """``x.index_select(axis, idx)`` as views, for indices that follow ``_repeat_pattern``
    (nearest with an integer scale factor: a slice, each element repeated)."""
    pattern = _repeat_pattern(idx)
    assert pattern is not None
    (start, step, repeat), out = pattern, len(idx)
    if (start, step, repeat, out) == (0, 1, 1, x.shape[axis]):
        return x
    count = -(-out // repeat)
    y = _slice(x, axis, start, step, count)
    if repeat > 1:
        shape = y.shape
        y = y.unsqueeze(axis + 1).expand(shape[:axis + 1] + (repeat,) + shape[axis + 1:])
        y = y.reshape(shape[:axis] + (count * repeat,) + shape[axis + 1:])
        if count * repeat != out:
            y = _slice(y, axis, 0, 1, out)
    return y


class _Periodic:
    """Output ``k * period + r`` is ``sum_t weights[t][r] * x[clamp(starts[t][r] + k * step)]``:
    a resampling whose taps repeat with a period (a power-of-two scale factor, rational ones
    within rounding). It runs as slices of the input padded with its edge values (the clamp),
    so it is one elementwise kernel, and so is its gradient; gathers would make the gradient
    a one-hot reduction of input size times output size."""

    def __init__(self, period: int, step: int, starts: np.ndarray, weights: np.ndarray):
        self.period, self.step, self.starts, self.weights = period, step, starts, weights

    def sources(self, out: int, size: int) -> list[np.ndarray]:
        k, r = np.arange(out) // self.period, np.arange(out) % self.period
        return [np.clip(s[r] + k * self.step, 0, size - 1) for s in self.starts]

    def apply(self, x: Tensor, axis: int, out: int) -> Tensor:
        size, count = x.shape[axis], out // self.period
        before = max(0, -int(self.starts.min()))
        after = max(0, int(self.starts.max()) + self.step * (count - 1) - (size - 1))
        parts = [x]
        if before:
            edge = _slice(x, axis, 0, 1, 1)
            parts.insert(0, edge.expand(x.shape[:axis] + (before,) + x.shape[axis + 1:]))
        if after:
            edge = _slice(x, axis, size - 1, 1, 1)
            parts.append(edge.expand(x.shape[:axis] + (after,) + x.shape[axis + 1:]))
        padded = cat(parts, axis) if len(parts) > 1 else x
        phases = []
        for r in range(self.period):
            total: Tensor | None = None
            for start, weight in zip(self.starts[:, r], self.weights[:, r]):
                term = _slice(padded, axis, int(start) + before, self.step, count)
                if weight != 1:  # a weight of 0 still multiplies: 0 * inf is NaN, as in torch
                    term = term * float(weight)
                total = term if total is None else total + term
            assert total is not None
            phases.append(total)
        if self.period == 1:
            return phases[0]
        y = stack(phases, axis + 1)
        return y.reshape(x.shape[:axis] + (out,) + x.shape[axis + 1:])


def _periodic(taps: list[np.ndarray], weights: list[np.ndarray], size: int
              ) -> _Periodic | None:
    """The shortest period (up to 16 outputs) whose repeated taps, read off the middle of the
    output, give the same linear map as ``taps`` and ``weights`` (to float32 rounding: the
    clamped borders keep their values), or None."""
    out = len(taps[0])
    probe = np.random.default_rng(0).standard_normal((size, 3))
    want = sum(w.astype(np.float64)[:, None] * probe[idx] for idx, w in zip(taps, weights))
    for period in range(1, min(out, 16) + 1):
        count = out // period
        if out % period or count < 2:
            continue
        rows = [idx.reshape(count, period) for idx in taps]
        mid = count // 2 - (1 if count % 2 == 0 else 0)
        steps = {int(d) for r in rows for d in r[mid + 1] - r[mid]}
        if len(steps) != 1 or min(steps) < 1:
            continue
        step = steps.pop()
        starts = np.stack([r[mid] - mid * step for r in rows]).astype(np.int64)
        chosen = np.stack([w.reshape(count, period)[mid] for w in weights]).astype(_F32)
        plan = _Periodic(period, step, starts, chosen)
        got = sum(w.astype(np.float64)[np.arange(out) % period][:, None] * probe[src]
                  for src, w in zip(plan.sources(out, size), chosen))
        if np.allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max()):
            return plan
    return None


@functools.lru_cache(maxsize=256)
def _axis_plan(mode: str, size: int, out: int, align_corners: bool, scale: float | None
               ) -> tuple[str, Any]:
    """How one axis is resampled, which depends on its sizes alone (so it is cached): a view
    ("repeat": nearest's indices), taps with a period ("periodic") or gathers ("gather": the
    taps and weights)."""
    if mode in ("nearest", "nearest-exact"):
        taps, weights = [_nearest_index(size, out, scale, mode == "nearest-exact")], \
            [np.ones(out, _F32)]
        if _repeat_pattern(taps[0]) is not None:
            return "repeat", taps[0]
    elif mode == "bicubic":
        taps, weights = _cubic_taps(size, out, align_corners, scale)
    else:
        taps, weights = _linear_taps(size, out, align_corners, scale)
    plan = _periodic(taps, weights, size)
    return ("periodic", plan) if plan is not None else ("gather", (taps, weights))


def _resample(x: Tensor, axis: int, out: int, plan: tuple[str, Any]) -> Tensor:
    """Apply an ``_axis_plan`` to ``axis`` of ``x``."""
    kind, data = plan
    if kind == "repeat":
        return _repeated(x, axis, data)
    if kind == "periodic":
        return data.apply(x, axis, out)
    shape = (out,) + (1,) * (x.ndim - axis - 1)
    total: Tensor | None = None
    for idx, w in zip(*data):
        term = x.index_select(axis, tensor(idx.astype(np.int32), device=x.device))
        if not np.all(w == 1):
            term = term * tensor(w, device=x.device).reshape(shape)
        total = term if total is None else total + term
    assert total is not None
    return total


def _area(x: Tensor, out: list[int]) -> Tensor:
    """Adaptive average pooling to ``out`` (mode 'area'): the box average is separable, so the
    last two axes pool first and a leading depth axis after them."""
    from anygpu.nn.functional import adaptive_avg_pool2d

    n, c = x.shape[:2]
    if x.ndim == 3:
        return adaptive_avg_pool2d(x.unsqueeze(2), (1, out[0])).squeeze(2)
    if x.ndim == 4:
        return adaptive_avg_pool2d(x, (out[0], out[1]))
    d = x.shape[2]
    y = adaptive_avg_pool2d(x.reshape(n, c * d, *x.shape[3:]), (out[1], out[2]))
    y = adaptive_avg_pool2d(y.reshape(n, c, d, out[1] * out[2]), (out[0], None))
    return y.reshape(n, c, *out)


def interpolate(input: Tensor, size: SizeLike | None = None,
                scale_factor: ScaleLike | None = None, mode: str = "nearest",
                align_corners: bool | None = None, recompute_scale_factor: bool | None = None,
                antialias: bool = False) -> Tensor:
    """Resample the spatial axes of (N, C, L), (N, C, H, W) or (N, C, D, H, W) to ``size`` or
    by ``scale_factor`` (a number or one per axis; the output is ``floor(n * scale)``), as
    ``torch.nn.functional.interpolate``. Modes: 'nearest', 'nearest-exact', 'linear' (3-D),
    'bilinear' (4-D), 'trilinear' (5-D), 'bicubic' (4-D) and 'area'. A given scale factor is
    also what maps outputs to sources, unless ``recompute_scale_factor`` (then the sizes' ratio
    is); ``align_corners`` maps the corner samples onto each other. ``antialias`` is not
    supported.

    >>> import anygpu as ag
    >>> from anygpu.nn import functional as F
    >>> x = ag.tensor([[[[1.0, 2.0], [3.0, 4.0]]]])
    >>> F.interpolate(x, scale_factor=2, mode="bilinear").shape
    (1, 1, 4, 4)
    >>> F.interpolate(x, size=(1, 3), mode="bilinear", align_corners=True).tolist()
    [[[[1.0, 1.5, 2.0]]]]
    """
    if mode in ("nearest", "area", "nearest-exact"):
        if align_corners is not None:
            raise ValueError("align_corners option can only be set with the interpolating "
                             "modes: linear | bilinear | bicubic | trilinear")
    elif align_corners is None:
        align_corners = False
    dim = input.ndim - 2
    scales: list[float | None]
    output_size: list[int]
    if size is not None and scale_factor is not None:
        raise ValueError("only one of size or scale_factor should be defined")
    if size is not None:
        if isinstance(size, (list, tuple)):
            if len(size) != dim:
                raise ValueError(
                    "Input and output must have the same number of spatial dimensions, but got "
                    f"input with spatial dimensions of {list(input.shape[2:])} and output size "
                    f"of {size}. Please provide input tensor in (N, C, d1, d2, ...,dK) format "
                    "and output size in (o1, o2, ...,oK) format.")
            if not all(_is_integer(s) for s in size):
                raise TypeError("expected size to be one of int or Tuple[int] or Tuple[int, int] "
                                "or Tuple[int, int, int], but got size with types "
                                f"{[type(s) for s in size]}")
            output_size = [int(s) for s in size]
        else:
            output_size = [int(cast(int, size))] * max(dim, 0)
        scales = [None] * max(dim, 0)
    elif scale_factor is not None:
        if isinstance(scale_factor, (list, tuple)):
            if len(scale_factor) != dim:
                raise ValueError(
                    "Input and scale_factor must have the same number of spatial dimensions, "
                    f"but got input with spatial dimensions of {list(input.shape[2:])} and "
                    f"scale_factor of shape {scale_factor}. Please provide input tensor in "
                    "(N, C, d1, d2, ...,dK) format and scale_factor in (s1, s2, ...,sK) format.")
            factors = [float(s) for s in scale_factor]
        else:
            factors = [float(cast(float, scale_factor))] * max(dim, 0)
        output_size = [int(n * s) for n, s in zip(input.shape[2:], factors)]
        scales = [s for s in factors]
    else:
        raise ValueError("either size or scale_factor should be defined")
    if recompute_scale_factor and size is not None:
        raise ValueError("recompute_scale_factor is not meaningful with an explicit size.")
    if recompute_scale_factor or mode == "area":  # the sizes' ratio maps outputs to sources
        scales = [None] * len(scales)
    if antialias and not (mode in ("bilinear", "bicubic") and input.ndim == 4):
        raise ValueError("Anti-alias option is restricted to bilinear and bicubic modes and "
                         "requires a 4-D tensor as input")
    if input.ndim not in _MODES.get(mode, ()):
        wanted = _RANK_NAMES.get(mode)
        if wanted is not None and input.ndim in (3, 4, 5):
            raise NotImplementedError(f"Got {input.ndim}D input, but {mode} mode needs "
                                      f"{wanted}D input")
        raise NotImplementedError(
            f"Input Error: Only 3D, 4D and 5D input Tensors supported (got {input.ndim}D) for "
            "the modes: nearest | linear | bilinear | bicubic | trilinear | area | nearest-exact "
            f"(got {mode})")
    if antialias:
        raise NotImplementedError("interpolate: antialias=True is not supported")
    if any(n <= 0 for n in input.shape[2:]) or any(o <= 0 for o in output_size):
        raise RuntimeError(f"Input and output sizes should be greater than 0, but got input "
                           f"{tuple(input.shape[2:])} output {tuple(output_size)}")
    if mode == "area":
        return _area(input, output_size)
    if mode not in ("nearest", "nearest-exact") and not input.dtype.is_float:
        raise NotImplementedError(f'"upsample_{mode}" not implemented for '
                                  f"'{input.dtype.name}'")
    nearest = mode in ("nearest", "nearest-exact")
    x = input if nearest else input.float()  # weights in float32, as PyTorch's opmath
    # the last axis first: PyTorch's kernels weight the innermost axis innermost
    for axis in reversed(range(2, input.ndim)):
        n, out, scale = x.shape[axis], output_size[axis - 2], scales[axis - 2]
        if mode in ("linear", "bilinear", "trilinear") and out == n:
            continue  # PyTorch copies an axis that keeps its size
        plan = _axis_plan(mode, n, out, bool(align_corners), scale)
        x = _resample(x, axis, out, plan)
    return x.cast(input.dtype)


class Upsample(Module):
    """``interpolate`` as a layer: ``Upsample(size=None, scale_factor=None, mode='nearest',
    align_corners=None, recompute_scale_factor=None)``; it holds no parameters.

    >>> import anygpu as ag
    >>> Upsample(scale_factor=2, mode="nearest")(ag.ones(1, 3, 5, 7)).shape
    (1, 3, 10, 14)
    """

    def __init__(self, size: SizeLike | None = None, scale_factor: ScaleLike | None = None,
                 mode: str = "nearest", align_corners: bool | None = None,
                 recompute_scale_factor: bool | None = None) -> None:
        super().__init__()
        self.name = type(self).__name__
        self.size = size
        self.scale_factor: Any
        if isinstance(scale_factor, tuple):
            self.scale_factor = tuple(float(factor) for factor in scale_factor)
        else:
            self.scale_factor = float(cast(float, scale_factor)) if scale_factor else None
        self.mode = mode
        self.align_corners = align_corners
        self.recompute_scale_factor = recompute_scale_factor

    def forward(self, input: Tensor) -> Tensor:
        return interpolate(input, self.size, self.scale_factor, self.mode, self.align_corners,
                           recompute_scale_factor=self.recompute_scale_factor)

    def extra_repr(self) -> str:
        if self.scale_factor is not None:
            info = "scale_factor=" + repr(self.scale_factor)
        else:
            info = "size=" + repr(self.size)
        return info + ", mode=" + repr(self.mode)


class UpsamplingNearest2d(Upsample):
    """``Upsample(size, scale_factor, mode='nearest')`` (PyTorch's deprecated alias).

    >>> import anygpu as ag
    >>> UpsamplingNearest2d(scale_factor=2)(ag.ones(1, 1, 2, 3)).shape
    (1, 1, 4, 6)
    """

    def __init__(self, size: SizeLike | None = None,
                 scale_factor: ScaleLike | None = None) -> None:
        super().__init__(size, scale_factor, mode="nearest")


class UpsamplingBilinear2d(Upsample):
    """``Upsample(size, scale_factor, mode='bilinear', align_corners=True)`` (PyTorch's
    deprecated alias).

    >>> import anygpu as ag
    >>> UpsamplingBilinear2d(size=(3, 3))(ag.ones(1, 1, 2, 2)).shape
    (1, 1, 3, 3)
    """

    def __init__(self, size: SizeLike | None = None,
                 scale_factor: ScaleLike | None = None) -> None:
        super().__init__(size, scale_factor, mode="bilinear", align_corners=True)


__all__ = ["interpolate", "Upsample", "UpsamplingNearest2d", "UpsamplingBilinear2d"]
