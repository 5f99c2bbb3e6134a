"""Resize and Upsample: separable resampling, one axis at a time.

For each resized axis the source taps of every output position and their weights are computed
on the host from the sizes alone (coordinate transformation, nearest rounding, the linear and
cubic kernels with or without antialiasing, ``exclude_outside``, edge clamping); the device
then gathers the taps of the input along the axis and sums them weighted, one kernel per axis.
Integer inputs are rounded and clamped back to their type, as ONNX Runtime does.

>>> import numpy as np
>>> idx, w, outside = axis_taps(2, 4, 2.0, "linear", "half_pixel", "round_prefer_floor",
...                             -0.75, False, False, None)
>>> idx.tolist(), w.round(2).tolist()
([[0, 0], [0, 1], [0, 1], [1, 1]], [[0.25, 0.75], [0.75, 0.25], [0.25, 0.75], [0.75, 0.25]])
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from anygpu import dtype as dt
from anygpu.onnx.ops.common import axes_list, const
from anygpu.onnx.ops.table import Node, op
from anygpu.tensor import Tensor, where

_MODES = ("nearest", "linear", "cubic")
_TRANSFORMS = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners",
               "asymmetric", "tf_crop_and_resize")
_NEAREST = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")
_POLICIES = ("stretch", "not_larger", "not_smaller")


def _source(mode: str, y: np.ndarray, scale: float, size: int, out: int,
            roi: tuple[float, float] | None) -> np.ndarray:
    """The input coordinate of each output position ``y``."""
    length = scale * size
    if mode == "align_corners":
        return np.zeros_like(y) if length == 1 else y * (size - 1) / (length - 1)
    if mode == "asymmetric":
        return y / scale
    if mode == "tf_crop_and_resize":
        assert roi is not None
        if length == 1:
            x = np.full_like(y, (roi[1] - roi[0]) * (size - 1) / 2)
        else:
            x = y * (roi[1] - roi[0]) * (size - 1) / (length - 1)
        return x + roi[0] * (size - 1)
    if mode == "pytorch_half_pixel":
        return np.full_like(y, -0.5) if length == 1 else (y + 0.5) / scale - 0.5
    if mode == "half_pixel_symmetric":
        offset = size / 2 * (1 - out / length)
        return offset + (y + 0.5) / scale - 0.5
    return (y + 0.5) / scale - 0.5  # half_pixel


def _cubic(t: np.ndarray, a: float) -> np.ndarray:
    """Keys' cubic convolution kernel with parameter ``a``."""
    t = np.abs(t)
    near = ((a + 2) * t - (a + 3)) * t * t + 1
    far = ((a * t - 5 * a) * t + 8 * a) * t - 4 * a
    return np.where(t <= 1, near, np.where(t < 2, far, 0.0))


def axis_taps(size: int, out: int, scale: float, mode: str, transform: str, nearest: str,
              cubic_a: float, exclude_outside: bool, antialias: bool,
              roi: tuple[float, float] | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(out, taps) source indices and weights along one axis, and which outputs lie outside
    the input (tf_crop_and_resize's extrapolation)."""
    y = np.arange(out, dtype=np.float64)
    x = _source(transform, y, scale, size, out, roi)
    outside = (x < 0) | (x > size - 1) if transform == "tf_crop_and_resize" else \
        np.zeros(out, dtype=bool)
    base = np.floor(x)
    integral = x == base
    ratio = np.where(integral, 1.0, x - base)
    if mode == "nearest":
        if nearest == "floor":
            pick = np.where(integral, x, base)
        elif nearest == "ceil":
            pick = np.where(integral, x, base + 1)
        elif nearest == "round_prefer_ceil":
            pick = np.where(ratio >= 0.5, base + 1, base)
            pick = np.where(integral, x, pick)
        else:
            pick = np.where(ratio > 0.5, base + 1, base)
            pick = np.where(integral, x, pick)
        idx = np.clip(pick, 0, size - 1).astype(np.int64)[:, None]
        return idx, np.ones((out, 1)), outside
    s = min(scale, 1.0) if antialias else 1.0
    if mode == "linear":
        start = int(math.floor(-1 / s) + 1) if antialias else 0
        taps = 2 - 2 * start
    else:
        start = int(math.floor(-2 / s) + 1) if antialias else -1
        taps = 2 - 2 * start
    offsets = np.arange(taps) + start  # relative to the tap at or left of x
    if mode == "linear":
        if antialias:
            weights = np.clip(1 - np.abs((offsets[None, :] - ratio[:, None]) * s), 0, 1)
        else:
            weights = np.stack([1 - ratio, ratio], axis=1)
    else:
        weights = _cubic((offsets[None, :] - ratio[:, None]) * s, cubic_a)
    if antialias:
        weights = weights / weights.sum(1, keepdims=True)
    # the window starts one further left where x is an integer (its weight then lies right)
    first = base.astype(np.int64) - np.where(integral, 1, 0)
    idx = first[:, None] + offsets[None, :]
    if exclude_outside:
        weights = np.where((idx < 0) | (idx >= size), 0.0, weights)
        total = weights.sum(1, keepdims=True)
        weights = weights / np.where(total == 0, 1.0, total)
    return np.clip(idx, 0, size - 1), weights, outside


def _resample(x: Tensor, a: int, idx: np.ndarray, weights: np.ndarray) -> Tensor:
    out, taps = idx.shape
    index = Tensor(idx.reshape(-1), device=x.device)
    picked = x.index_select(a, index)
    if taps == 1:
        return picked
    shape = x.shape[:a] + (out, taps) + x.shape[a + 1:]
    w = Tensor(weights.astype(np.float32), device=x.device).reshape(
        (out, taps) + (1,) * (x.ndim - a - 1))
    return (picked.reshape(shape) * w).sum(a + 1)


def resize_tensor(node: Node, x: Tensor, sizes: list[int], scales: list[float],
                  axes: list[int], roi: list[float] | None) -> Tensor:
    """Resize ``x`` along ``axes`` to ``sizes`` with the given scales."""
    mode = node.attr("mode", "nearest")
    transform = node.attr("coordinate_transformation_mode", "half_pixel")
    nearest = node.attr("nearest_mode", "round_prefer_floor")
    cubic_a = node.attr("cubic_coeff_a", -0.75)
    exclude = bool(node.attr("exclude_outside", 0))
    antialias = bool(node.attr("antialias", 0)) and mode != "nearest"
    value = node.attr("extrapolation_value", 0.0)
    y = x if x.dtype.is_float else x.cast(dt.float32)
    mask: Tensor | None = None
    for k, a in enumerate(axes):
        size, out, scale = x.shape[a], sizes[k], scales[k]
        window = (roi[k], roi[k + len(axes)]) if roi is not None else None
        if out == size and scale == 1.0 and (window is None or window == (0.0, 1.0)):
            continue
        idx, weights, outside = axis_taps(size, out, scale, mode, transform, nearest, cubic_a,
                                          exclude, antialias, window)
        y = _resample(y, a, idx, weights)
        if outside.any():
            view = [1] * x.ndim
            view[a] = out
            part = Tensor(outside, device=x.device).reshape(view)
            mask = part if mask is None else mask.logical_or(part)
    if mask is not None:
        y = where(mask, const(value, (), y.dtype, x.device), y)
    if not x.dtype.is_float:
        lo, hi = dt.min_value(x.dtype), dt.max_value(x.dtype)
        y = y.round().clip(float(lo), float(hi))
    return y.cast(x.dtype)


def _check(node: Node) -> str | None:
    for key, allowed, default in (("mode", _MODES, "nearest"),
                                  ("coordinate_transformation_mode", _TRANSFORMS, "half_pixel"),
                                  ("nearest_mode", _NEAREST, "round_prefer_floor"),
                                  ("keep_aspect_ratio_policy", _POLICIES, "stretch")):
        if node.attr(key, default) not in allowed:
            return f"{key} {node.attr(key)!r} is not supported"
    return None


_ATTRS = ("mode", "coordinate_transformation_mode", "nearest_mode", "cubic_coeff_a",
          "exclude_outside", "extrapolation_value", "antialias", "axes",
          "keep_aspect_ratio_policy")


def _plan(node: Node, x: Tensor, scales: Any, sizes: Any) -> tuple[list[int], list[float],
                                                                    list[int]]:
    axes = axes_list(node.attr("axes"), x.ndim, node) if node.has("axes") else \
        list(range(x.ndim))
    if sizes is not None and np.asarray(sizes).size:
        want = [int(v) for v in np.asarray(sizes).reshape(-1)]
        factors = [w / x.shape[a] for w, a in zip(want, axes)]
        policy = node.attr("keep_aspect_ratio_policy", "stretch")
        if policy != "stretch":
            common = min(factors) if policy == "not_larger" else max(factors)
            factors = [common] * len(axes)
            want = [int(common * x.shape[a] + 0.5) for a in axes]
        return want, factors, axes
    if scales is None or not np.asarray(scales).size:
        node.fail("needs scales or sizes")
    factors = [float(v) for v in np.asarray(scales, dtype=np.float64).reshape(-1)]
    if len(factors) != len(axes):
        node.fail(f"{len(factors)} scales for {len(axes)} axes")
    return [int(f * x.shape[a]) for f, a in zip(factors, axes)], factors, axes


@op("Resize", since=11, attrs=_ATTRS, host=(1, 2, 3), check=_check)
def resize(node: Node, x: Tensor, roi: np.ndarray | None = None,
           scales: np.ndarray | None = None, sizes: np.ndarray | None = None) -> Tensor:
    sizes_, factors, axes = _plan(node, x, scales, sizes)
    window = [float(v) for v in np.asarray(roi).reshape(-1)] if roi is not None and \
        np.asarray(roi).size else None
    return resize_tensor(node, x, sizes_, factors, axes, window)


@op("Resize", since=10, until=10, attrs=("mode",), host=1, check=_check)
def resize_10(node: Node, x: Tensor, scales: np.ndarray) -> Tensor:
    sizes_, factors, axes = _plan(node, x, scales, None)
    # opset 10 resizes by the asymmetric transformation with floor rounding for nearest
    node.attrs.setdefault("coordinate_transformation_mode", "asymmetric")
    node.attrs.setdefault("nearest_mode", "floor")
    return resize_tensor(node, x, sizes_, factors, axes, None)


@op("Upsample", since=7, until=9, attrs=("mode", "scales"), host=1, check=_check)
def upsample(node: Node, x: Tensor, scales: np.ndarray | None = None) -> Tensor:
    given = scales if scales is not None else np.asarray(node.attr("scales"))
    sizes_, factors, axes = _plan(node, x, given, None)
    node.attrs.setdefault("coordinate_transformation_mode", "asymmetric")
    node.attrs.setdefault("nearest_mode", "floor")
    return resize_tensor(node, x, sizes_, factors, axes, None)


__all__ = ["axis_taps", "resize_tensor"]
