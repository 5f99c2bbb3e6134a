"""Sampling by coordinates: GridSample (nearest, linear, cubic; zeros, border, reflection
padding; any number of spatial axes) and AffineGrid.

GridSample computes each output's source coordinates on the device from the grid, then reads
the input at the 1, 2**n or 4**n neighbouring positions by gathers over the flattened spatial
axes and sums them weighted.

>>> import numpy as np
>>> from anygpu.onnx.ops.table import Node
>>> node = Node("GridSample", "g", "", 20, "cpu", {"align_corners": 1}, [1, 1], [1], 1)
>>> x = Tensor(np.arange(4, dtype=np.float32).reshape(1, 1, 2, 2))
>>> grid = Tensor(np.array([[[[0.0, 0.0]]]], np.float32))
>>> grid_sample(node, x, grid).tolist()
[[[[1.5]]]]
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from anygpu import dtype as dt
from anygpu.onnx.ops.common import const, ints
from anygpu.onnx.ops.table import Node, op
from anygpu.tensor import Tensor, arange, cat, stack, where

_MODES = {"bilinear": "linear", "linear": "linear", "nearest": "nearest", "bicubic": "cubic",
          "cubic": "cubic"}


def _check(node: Node) -> str | None:
    if node.attr("mode", "linear") not in _MODES:
        return f"mode {node.attr('mode')!r} is not supported"
    if node.attr("padding_mode", "zeros") not in ("zeros", "border", "reflection"):
        return f"padding_mode {node.attr('padding_mode')!r} is not supported"
    return None


def _reflect(v: Tensor, low: float, high: float) -> Tensor:
    """``v`` folded back into [low, high] by reflections at its ends."""
    span = high - low
    if span <= 0:
        return const(low, (), v.dtype, v.device) + v * 0
    below, above = low - v, v - high
    out = v
    for dist, first, second in ((below, low, high), (above, high, low)):
        n = (dist / span).floor()
        r = dist - n * span
        even = n.remainder(2).eq(0)
        direction = 1.0 if first == low else -1.0
        folded = where(even, first + direction * r, second - direction * r)
        out = where(dist.gt(0), folded, out)
    return out


def _cubic(t: Tensor) -> list[Tensor]:
    a = -0.75
    t1, t2 = t + 1, 1 - t
    return [((a * t1 - 5 * a) * t1 + 8 * a) * t1 - 4 * a,
            ((a + 2) * t - (a + 3)) * t * t + 1,
            ((a + 2) * t2 - (a + 3)) * t2 * t2 + 1,
            ((a * (2 - t) - 5 * a) * (2 - t) + 8 * a) * (2 - t) - 4 * a]


@op("GridSample", since=16, attrs=("align_corners", "mode", "padding_mode"), check=_check)
def grid_sample(node: Node, x: Tensor, grid: Tensor) -> Tensor:
    mode = _MODES[node.attr("mode", "linear" if node.opset >= 20 else "bilinear")]
    padding = node.attr("padding_mode", "zeros")
    align = bool(node.attr("align_corners", 0))
    n, c = x.shape[:2]
    sizes = x.shape[2:]
    nd = len(sizes)
    out_shape = grid.shape[1:-1]
    m = math.prod(out_shape)
    g = grid.cast(dt.float32).reshape(n, m, nd)
    taps_per_axis: list[list[tuple[Tensor, Tensor]]] = []
    for k, d in enumerate(sizes):
        norm = g[:, :, nd - 1 - k]  # the grid lists the fastest axis first
        pos = (norm + 1) / 2 * (d - 1) if align else ((norm + 1) * d - 1) / 2
        if mode == "nearest":
            pos = pos.round()  # half to even
        low, high = (0.0, d - 1.0) if align else (-0.5, d - 0.5)
        outside = pos.lt(low).logical_or(pos.gt(high))
        if padding == "border":
            pos = where(outside, pos.clip(0.0, d - 1.0), pos)
        elif padding == "reflection":
            pos = _reflect(pos, low, high)
        if mode == "nearest":
            taps = [(pos, const(1.0, (n, m), dt.float32, x.device))]
        else:
            base = pos.floor()
            t = pos - base
            if mode == "linear":
                taps = [(base, 1 - t), (base + 1, t)]
            else:
                taps = [(base + (j - 1), w) for j, w in enumerate(_cubic(t))]
        fixed = []
        for spot, tap_weight in taps:
            if padding == "border":
                spot = spot.clip(0.0, d - 1.0)
            elif padding == "reflection":
                spot = _reflect(spot, low, high).trunc()
            fixed.append((spot.cast(dt.int64), tap_weight))
        taps_per_axis.append(fixed)
    flat = x.reshape(n, c, math.prod(sizes))
    total: Tensor | None = None
    for combo in itertools.product(*taps_per_axis):
        index: Tensor | None = None
        valid: Tensor | None = None
        weight: Tensor | None = None
        stride = 1
        for k in reversed(range(nd)):
            idx, w = combo[k]
            inside = idx.ge(0).logical_and(idx.lt(sizes[k]))
            safe = idx.clip(0, sizes[k] - 1)
            index = safe * stride if index is None else index + safe * stride
            valid = inside if valid is None else valid.logical_and(inside)
            weight = w if weight is None else weight * w
            stride *= sizes[k]
        assert index is not None and valid is not None and weight is not None
        picked = flat.gather(2, index.unsqueeze(1).expand(n, c, m))
        term = where(valid.unsqueeze(1), picked.cast(dt.float32) * weight.unsqueeze(1),
                     const(0.0, (), dt.float32, x.device))
        total = term if total is None else total + term
    assert total is not None
    return total.reshape((n, c) + out_shape).cast(x.dtype)


@op("AffineGrid", since=20, attrs=("align_corners",), host=1)
def affine_grid(node: Node, theta: Tensor, size: np.ndarray) -> Tensor:
    dims = ints(size)
    n, spatial = dims[0], dims[2:]
    align = bool(node.attr("align_corners", 0))
    axes = []
    for d in spatial:
        i = arange(d, device=theta.device, dtype=dt.float32)
        if align:
            axes.append(i * (2.0 / (d - 1)) - 1 if d > 1 else i * 0)
        else:
            axes.append((i * 2 + 1) / d - 1)
    nd = len(spatial)
    # base[..., k]: the coordinate of axis k, fastest axis first, then 1
    coords = []
    for k in reversed(range(nd)):
        view = [1] * nd
        view[k] = spatial[k]
        coords.append(axes[k].reshape(view).expand(tuple(spatial)))
    coords.append(const(1.0, tuple(spatial), dt.float32, theta.device))
    base = stack(coords, -1).reshape(1, math.prod(spatial), nd + 1)
    out = base.matmul(theta.cast(dt.float32).transpose(1, 2))  # (N, S, nd)
    return out.reshape((n,) + tuple(spatial) + (nd,)).cast(theta.dtype)




def _bilinear_taps(y: Tensor, x: Tensor, h: int, w: int
                   ) -> list[tuple[Tensor, Tensor, Tensor]]:
    """The four corners around (y, x): flat index into an (h, w) plane (clamped), weight, and
    whether the corner lies inside (outside ones count as zeros)."""
    y0, x0 = y.floor(), x.floor()
    ty, tx = y - y0, x - x0
    taps = []
    for dy, wy in ((0, 1 - ty), (1, ty)):
        for dx, wx in ((0, 1 - tx), (1, tx)):
            yi, xi = (y0 + dy).cast(dt.int64), (x0 + dx).cast(dt.int64)
            inside = yi.ge(0).logical_and(yi.lt(h)).logical_and(xi.ge(0)).logical_and(xi.lt(w))
            flat = yi.clip(0, h - 1) * w + xi.clip(0, w - 1)
            taps.append((flat, wy * wx, inside))
    return taps


@op("DeformConv", since=19, attrs=("dilations", "group", "kernel_shape", "offset_group", "pads",
                                   "strides"))
def deform_conv(node: Node, x: Tensor, w: Tensor, offset: Tensor, bias: Tensor | None = None,
                mask: Tensor | None = None) -> Tensor:
    """A 2-D convolution whose taps sample the input at learned offsets (bilinear, zeros
    outside), scaled by ``mask``; the sampled columns are contracted with the weights."""
    if x.ndim != 4:
        node.fail("only 2-D deformable convolutions are supported")
    n, ic, ih, iw = x.shape
    oc, icg, kh, kw = w.shape
    groups = node.attr("group", 1)
    og = node.attr("offset_group", 1)
    sh, sw = node.attr("strides", None) or [1, 1]
    dh, dw = node.attr("dilations", None) or [1, 1]
    pads = node.attr("pads", None) or [0, 0, 0, 0]
    oh, ow = offset.shape[2:]
    off = offset.cast(dt.float32).reshape(n, og, kh, kw, 2, oh, ow)
    rows = arange(oh, device=x.device, dtype=dt.float32).reshape(1, 1, 1, oh, 1) * sh - pads[0]
    cols = arange(ow, device=x.device, dtype=dt.float32).reshape(1, 1, 1, 1, ow) * sw - pads[1]
    ki = arange(kh, device=x.device, dtype=dt.float32).reshape(1, kh, 1, 1, 1) * dh
    kj = arange(kw, device=x.device, dtype=dt.float32).reshape(1, 1, kw, 1, 1) * dw
    per = ic // og
    parts = []
    for g in range(og):
        y = rows + ki + off[:, g, :, :, 0]  # (n, kh, kw, oh, ow)
        xx = cols + kj + off[:, g, :, :, 1]
        m = kh * kw * oh * ow
        plane = x[:, g * per:(g + 1) * per].cast(dt.float32).reshape(n, per, ih * iw)
        total: Tensor | None = None
        for flat, weight, inside in _bilinear_taps(y, xx, ih, iw):
            picked = plane.gather(2, flat.reshape(n, 1, m).expand(n, per, m))
            term = where(inside.reshape(n, 1, m), picked * weight.reshape(n, 1, m),
                         const(0.0, (), dt.float32, x.device))
            total = term if total is None else total + term
        assert total is not None
        if mask is not None:
            gate = mask.cast(dt.float32).reshape(n, og, kh * kw * oh * ow)[:, g]
            total = total * gate.reshape(n, 1, m)
        parts.append(total)
    cols_all = cat(parts, 1) if og > 1 else parts[0]  # (n, ic, kh*kw*oh*ow)
    ocg = oc // groups
    sampled = cols_all.reshape(n, groups, 1, icg * kh * kw, oh * ow)
    weights = w.cast(dt.float32).reshape(1, groups, ocg, icg * kh * kw, 1)
    out = (sampled * weights).sum(3).reshape(n, oc, oh, ow)
    if bias is not None:
        out = out + bias.cast(dt.float32).reshape(1, oc, 1, 1)
    return out.cast(x.dtype)


@op("RoiAlign", since=10, attrs=("coordinate_transformation_mode", "mode", "output_height",
                                 "output_width", "sampling_ratio", "spatial_scale"),
    check=lambda n: None if n.attr("mode", "avg") in ("avg", "max")
    else f"mode {n.attr('mode')!r} is not supported")
def roi_align(node: Node, x: Tensor, rois: Tensor, batch: Tensor) -> Tensor:
    """Average (or maximum) of bilinear samples on a regular grid in each bin of each region.
    With ``sampling_ratio`` 0 the regions' sizes decide how many samples a bin takes: those
    counts are read back (the grid is as large as the largest); all else is on the device."""
    n, c, h, w = x.shape
    r = rois.shape[0]
    out_h, out_w = node.attr("output_height", 1), node.attr("output_width", 1)
    ratio, scale = node.attr("sampling_ratio", 0), node.attr("spatial_scale", 1.0)
    half = node.attr("coordinate_transformation_mode", "half_pixel" if node.opset >= 16
                     else "output_half_pixel") == "half_pixel"
    box = rois.cast(dt.float32) * scale - (0.5 if half else 0.0)  # (R, 4)
    size_h = box[:, 3] - box[:, 1]
    size_w = box[:, 2] - box[:, 0]
    if not half:
        size_h, size_w = size_h.maximum(1.0), size_w.maximum(1.0)
    if ratio > 0:
        counts_h = const(float(ratio), (r,), dt.float32, x.device)
        counts_w = counts_h
        gh = gw = ratio
    else:
        counts_h, counts_w = (size_h / out_h).ceil(), (size_w / out_w).ceil()
        both = stack([counts_h, counts_w], 0).amax(1).numpy() if r else np.ones(2)
        gh, gw = max(int(both[0]), 1), max(int(both[1]), 1)
    counts_h, counts_w = counts_h.maximum(1.0), counts_w.maximum(1.0)
    bin_h = (size_h / out_h).reshape(r, 1, 1, 1, 1)
    bin_w = (size_w / out_w).reshape(r, 1, 1, 1, 1)
    ph = arange(out_h, device=x.device, dtype=dt.float32).reshape(1, out_h, 1, 1, 1)
    pw = arange(out_w, device=x.device, dtype=dt.float32).reshape(1, 1, out_w, 1, 1)
    iy = arange(gh, device=x.device, dtype=dt.float32).reshape(1, 1, 1, gh, 1)
    ix = arange(gw, device=x.device, dtype=dt.float32).reshape(1, 1, 1, 1, gw)
    ch, cw = counts_h.reshape(r, 1, 1, 1, 1), counts_w.reshape(r, 1, 1, 1, 1)
    y = box[:, 1].reshape(r, 1, 1, 1, 1) + ph * bin_h + (iy + 0.5) * bin_h / ch
    xx = box[:, 0].reshape(r, 1, 1, 1, 1) + pw * bin_w + (ix + 0.5) * bin_w / cw
    used = iy.lt(ch).logical_and(ix.lt(cw))  # samples past a region's own grid are padding
    inside = y.ge(-1.0).logical_and(y.le(h)).logical_and(xx.ge(-1.0)).logical_and(xx.le(w))
    # ONNX's rule at the edges: clamp to 0 below, and to the last row or column above
    y, xx = y.maximum(0.0), xx.maximum(0.0)
    y = where(y.ge(h - 1), const(h - 1.0, (), dt.float32, x.device), y)
    xx = where(xx.ge(w - 1), const(w - 1.0, (), dt.float32, x.device), xx)
    shape = (r, out_h, out_w, gh, gw)
    y, xx = y.expand(shape), xx.expand(shape)
    m = out_h * out_w * gh * gw
    planes = x.cast(dt.float32).reshape(n, c, h * w).index_select(0, batch.cast(dt.int64))
    mode = node.attr("mode", "avg")
    zero = const(0.0, (), dt.float32, x.device)
    corners = []
    for flat, weight, _ in _bilinear_taps(y, xx, h, w):
        picked = planes.gather(2, flat.reshape(r, 1, m).expand(r, c, m))
        corners.append(picked * weight.reshape(r, 1, m))
    valid = used.logical_and(inside).expand(shape).reshape(r, 1, m)
    if mode == "avg":
        total = corners[0] + corners[1] + corners[2] + corners[3]
        total = where(valid, total, zero).reshape(r, c, out_h, out_w, gh * gw).sum(-1)
        return (total / (ch * cw).reshape(r, 1, 1, 1)).cast(x.dtype)
    best = corners[0].maximum(corners[1]).maximum(corners[2]).maximum(corners[3])
    best = where(valid, best, const(float("-inf"), (), dt.float32, x.device))
    best = best.reshape(r, c, out_h, out_w, gh * gw).amax(-1)
    return where(best.isinf(), zero, best).cast(x.dtype)


__all__ = ["grid_sample", "affine_grid", "deform_conv", "roi_align"]
