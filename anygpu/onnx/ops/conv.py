"""Convolutions and pooling over any number of spatial axes: Conv, ConvTranspose, MaxPool,
AveragePool, LpPool, GlobalAveragePool, GlobalMaxPool, GlobalLpPool.

Padding is explicit here (ONNX pads may differ at the two ends of an axis, and ``auto_pad``
decides them from the sizes); a 2-D convolution of the padded input then runs through
``anygpu.nn.functional.conv2d`` (its implicit GEMM and Winograd paths), a 1-D one as a 2-D one
of height 1, and other ranks through sliding-window views and one reduction, as conv2d itself
does. Pooling windows are the same views.

>>> import numpy as np
>>> from anygpu.onnx.ops.table import Node
>>> node = Node("MaxPool", "p", "", 12, "cpu", {"kernel_shape": [2], "strides": [2]},
...             [1], [1], 1)
>>> max_pool(node, Tensor(np.array([[[1.0, 3.0, 2.0, 5.0]]], np.float32)))[0].tolist()
[[[3.0, 5.0]]]
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from anygpu import dtype as dt
from anygpu.nn import functional as F
from anygpu.nn.convolution import _pool1d
from anygpu.ops.indexing import scatter
from anygpu.onnx.ops.common import const
from anygpu.onnx.ops.table import Node, op
from anygpu.tensor import Tensor, arange

_AUTO_PADS = ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")


def _check_auto_pad(node: Node) -> str | None:
    mode = node.attr("auto_pad", "NOTSET")
    return None if mode in _AUTO_PADS else f"auto_pad {mode!r} is not supported"


def _spatial(node: Node, key: str, n: int, default: int) -> list[int]:
    values = node.attr(key, None)
    if values is None or len(values) == 0:
        return [default] * n
    if len(values) != n:
        node.fail(f"{key} {values} does not have {n} values")
    return [int(v) for v in values]


def _pads(node: Node, sizes: Sequence[int], kernel: Sequence[int], strides: Sequence[int],
          dilations: Sequence[int]) -> tuple[list[int], list[int]]:
    """(begin, end) padding per spatial axis, from ``pads`` or ``auto_pad``."""
    n = len(sizes)
    mode = node.attr("auto_pad", "NOTSET")
    if mode == "VALID":
        return [0] * n, [0] * n
    if mode in ("SAME_UPPER", "SAME_LOWER"):
        begin, end = [], []
        for size, k, s, d in zip(sizes, kernel, strides, dilations):
            out = -(-size // s)
            total = max((out - 1) * s + (k - 1) * d + 1 - size, 0)
            small, big = total // 2, total - total // 2
            begin.append(small if mode == "SAME_UPPER" else big)
            end.append(big if mode == "SAME_UPPER" else small)
        return begin, end
    pads = node.attr("pads", None) or [0] * (2 * n)
    if len(pads) != 2 * n:
        node.fail(f"pads {pads} do not have {2 * n} values")
    return [int(p) for p in pads[:n]], [int(p) for p in pads[n:]]


def _pad_spatial(x: Tensor, begin: Sequence[int], end: Sequence[int], value: float) -> Tensor:
    if not any(begin) and not any(end):
        return x
    torch_order = [v for b, e in zip(reversed(begin), reversed(end)) for v in (b, e)]
    return x.pad(torch_order, value)


def windows(x: Tensor, kernel: Sequence[int], strides: Sequence[int],
            dilations: Sequence[int]) -> Tensor:
    """(N, C, S1..Sn) -> (N, C, O1..On, K1..Kn) sliding windows, as views only."""
    lead = x.ndim - len(kernel)
    for i, (k, s, d) in enumerate(zip(kernel, strides, dilations)):
        a = lead + i
        order = [j for j in range(x.ndim) if j != a] + [a]
        y = _pool1d(x.permute(order), k, s, d)  # (others..., O, K)
        nd = y.ndim
        back = list(range(a)) + [nd - 2] + list(range(a, nd - 2)) + [nd - 1]
        x = y.permute(back)
    return x


def convolve(x: Tensor, w: Tensor, bias: Tensor | None, strides: Sequence[int],
             dilations: Sequence[int], groups: int) -> Tensor:
    """A convolution of an already padded (N, C, S...) input by (O, C/groups, K...)."""
    n_sp = w.ndim - 2
    if n_sp == 2:
        return F.conv2d(x, w, bias, tuple(strides), 0, tuple(dilations), groups)
    if n_sp == 1:
        return F.conv2d(x.unsqueeze(2), w.unsqueeze(2), bias, (1, strides[0]), 0,
                        (1, dilations[0]), groups).squeeze(2)
    n, c = x.shape[:2]
    o, cg = w.shape[:2]
    kernel = w.shape[2:]
    win = windows(x, kernel, strides, dilations)  # N C O.. K..
    outs = win.shape[2:2 + n_sp]
    g, og = groups, o // groups
    win = win.reshape((n, g, cg) + outs + kernel)
    order = [0, 1] + list(range(3, 3 + n_sp)) + [2] + list(range(3 + n_sp, 3 + 2 * n_sp))
    win = win.permute(order).unsqueeze(2)  # N G 1 O.. Cg K..
    wt = w.reshape((1, g, og) + (1,) * n_sp + (cg,) + kernel)
    out = (win * wt).sum(tuple(range(3 + n_sp, 4 + 2 * n_sp)))
    out = out.reshape((n, o) + outs).cast(x.dtype)
    if bias is not None:
        out = out + bias.reshape((1, o) + (1,) * n_sp)
    return out


_CONV_ATTRS = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")


@op("Conv", since=1, attrs=_CONV_ATTRS, check=_check_auto_pad)
def conv(node: Node, x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    n_sp = w.ndim - 2
    kernel = _spatial(node, "kernel_shape", n_sp, 0)
    if kernel != list(w.shape[2:]) and node.has("kernel_shape"):
        node.fail(f"kernel_shape {kernel} differs from the weight's {list(w.shape[2:])}")
    kernel = list(w.shape[2:])
    strides = _spatial(node, "strides", n_sp, 1)
    dilations = _spatial(node, "dilations", n_sp, 1)
    begin, end = _pads(node, x.shape[2:], kernel, strides, dilations)
    xp = _pad_spatial(x, begin, end, 0.0)
    return convolve(xp, w, bias, strides, dilations, node.attr("group", 1))


def _dilate(x: Tensor, strides: Sequence[int]) -> Tensor:
    """Spatial axes with ``stride - 1`` zeros between neighbours."""
    lead = x.ndim - len(strides)
    for i, s in enumerate(strides):
        if s == 1:
            continue
        a = lead + i
        size = x.shape[a]
        y = x.unsqueeze(a + 1)
        pads = [0, 0] * (x.ndim - a - 1) + [0, s - 1]
        y = y.pad(pads).reshape(x.shape[:a] + (size * s,) + x.shape[a + 1:])
        bounds = [(0, m) for m in y.shape]
        bounds[a] = (0, (size - 1) * s + 1)
        x = y.shrink(bounds)
    return x


@op("ConvTranspose", since=1, attrs=_CONV_ATTRS + ("output_padding", "output_shape"),
    check=_check_auto_pad)
def conv_transpose(node: Node, x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    n_sp = w.ndim - 2
    kernel = list(w.shape[2:])
    strides = _spatial(node, "strides", n_sp, 1)
    dilations = _spatial(node, "dilations", n_sp, 1)
    out_pad = _spatial(node, "output_padding", n_sp, 0)
    groups = node.attr("group", 1)
    sizes = x.shape[2:]
    mode = node.attr("auto_pad", "NOTSET")
    target = node.attr("output_shape", None)
    if target is not None or mode in ("SAME_UPPER", "SAME_LOWER"):
        want = [int(v) for v in target][-n_sp:] if target is not None else \
            [n * s for n, s in zip(sizes, strides)]
        begin, end = [], []
        for size, k, s, d, op_, o in zip(sizes, kernel, strides, dilations, out_pad, want):
            total = s * (size - 1) + op_ + (k - 1) * d + 1 - o
            if mode == "SAME_UPPER":
                begin.append(total // 2)
                end.append(total - total // 2)
            else:
                begin.append(total - total // 2)
                end.append(total // 2)
    elif mode == "VALID":
        begin, end = [0] * n_sp, [0] * n_sp
    else:
        begin, end = _pads(node, sizes, kernel, strides, dilations)
    y = _dilate(x, strides)
    lo = [d * (k - 1) - b for k, d, b in zip(kernel, dilations, begin)]
    hi = [d * (k - 1) - e + p for k, d, e, p in zip(kernel, dilations, end, out_pad)]
    if any(v < 0 for v in lo + hi):  # more padding than the kernel reaches: crop
        y = y.shrink([(0, m) for m in y.shape[:2]] +
                     [(max(-a, 0), m - max(-b, 0)) for a, b, m in zip(lo, hi, y.shape[2:])])
        lo, hi = [max(v, 0) for v in lo], [max(v, 0) for v in hi]
    y = _pad_spatial(y, lo, hi, 0.0)
    c, og = w.shape[:2]
    wt = w.reshape((groups, c // groups, og) + tuple(kernel)).transpose(1, 2)
    wt = wt.reshape((groups * og, c // groups) + tuple(kernel))
    wt = wt.flip(*range(2, 2 + n_sp))
    return convolve(y, wt, bias, [1] * n_sp, dilations, groups)


# ---- pooling ------------------------------------------------------------------------------------
def _pool_geometry(node: Node, x: Tensor) -> tuple[list[int], list[int], list[int], list[int],
                                                    list[int], list[int]]:
    """kernel, strides, dilations, begin and end padding, output sizes."""
    n_sp = x.ndim - 2
    kernel = _spatial(node, "kernel_shape", n_sp, 1)
    strides = _spatial(node, "strides", n_sp, 1)
    dilations = _spatial(node, "dilations", n_sp, 1)
    sizes = list(x.shape[2:])
    begin, end = _pads(node, sizes, kernel, strides, dilations)
    ceil_mode = bool(node.attr("ceil_mode", 0))
    outs = []
    for size, k, s, d, b, e in zip(sizes, kernel, strides, dilations, begin, end):
        span = size + b + e - (k - 1) * d - 1
        if node.attr("auto_pad", "NOTSET") in ("SAME_UPPER", "SAME_LOWER"):
            o = -(-size // s)
        elif ceil_mode:
            o = -(-span // s) + 1
            if (o - 1) * s >= size + b:  # the last window must start inside the input
                o -= 1
        else:
            o = span // s + 1
        if o <= 0:
            node.fail(f"the pooling window does not fit an input of size {size}")
        outs.append(o)
    return kernel, strides, dilations, begin, end, outs


def _pooled_windows(x: Tensor, kernel: list[int], strides: list[int], dilations: list[int],
                    begin: list[int], end: list[int], outs: list[int], value: float) -> Tensor:
    """(N, C, O.., K1*..*Kn) windows of ``x`` padded with ``value`` (also past the end where
    ceil mode's last window reaches)."""
    extra = [max((o - 1) * s + (k - 1) * d + 1 - (n + b + e), 0)
             for o, s, k, d, n, b, e in zip(outs, strides, kernel, dilations, x.shape[2:], begin,
                                            end)]
    xp = _pad_spatial(x, begin, [e + x_ for e, x_ in zip(end, extra)], value)
    win = windows(xp, kernel, strides, dilations)
    shape = win.shape[:2 + len(kernel)]
    win = win.shrink([(0, m) for m in win.shape[:2]] + [(0, o) for o in outs] +
                     [(0, k) for k in kernel])
    return win.reshape(tuple(shape[:2]) + tuple(outs) + (math.prod(kernel),))


_POOL_ATTRS = ("auto_pad", "ceil_mode", "dilations", "kernel_shape", "pads", "strides")


@op("MaxPool", since=1, attrs=_POOL_ATTRS + ("storage_order",), check=_check_auto_pad)
def max_pool(node: Node, x: Tensor) -> tuple[Tensor, Tensor | None]:
    kernel, strides, dilations, begin, end, outs = _pool_geometry(node, x)
    low = dt.min_value(x.dtype)
    win = _pooled_windows(x, kernel, strides, dilations, begin, end, outs, low)
    values = win.amax(-1)
    if node.num_outputs < 2:
        return values, None
    # the flat index (over N, C and the spatial axes) of each window's first maximum
    first = win.argmax(-1)
    sizes = list(x.shape[2:])
    n_sp = len(kernel)
    flat = None
    rem = first
    positions: list[Tensor] = []
    for i in reversed(range(n_sp)):
        k_idx = rem % kernel[i]
        rem = rem // kernel[i]
        view = [1] * (2 + n_sp)
        view[2 + i] = outs[i]
        start = arange(outs[i], device=x.device, dtype=dt.int64).reshape(view) * strides[i]
        positions.insert(0, start - begin[i] + k_idx * dilations[i])
    if node.attr("storage_order", 0) and n_sp == 2:  # column-major over (H, W)
        flat = positions[1] * sizes[0] + positions[0]
    else:
        flat = positions[0]
        for i in range(1, n_sp):
            flat = flat * sizes[i] + positions[i]
    n, c = x.shape[:2]
    plane = math.prod(sizes)
    nc = arange(n * c, device=x.device, dtype=dt.int64).reshape((n, c) + (1,) * n_sp)
    return values, flat + nc * plane


def _counts(node: Node, sizes: Sequence[int], kernel: Sequence[int], strides: Sequence[int],
            dilations: Sequence[int], begin: Sequence[int], end: Sequence[int],
            outs: Sequence[int], include_pad: bool) -> np.ndarray:
    """How many elements each window averages: positions inside the input, or inside the
    padded input with ``count_include_pad`` (never those past it, ceil mode's)."""
    total = np.ones((1,), np.float64)
    for size, k, s, d, b, e, o in zip(sizes, kernel, strides, dilations, begin, end, outs):
        start = np.arange(o)[:, None] * s - b + np.arange(k)[None, :] * d
        if include_pad:
            inside = (start >= -b) & (start < size + e)
        else:
            inside = (start >= 0) & (start < size)
        total = np.multiply.outer(total, inside.sum(1)).reshape(-1)
    return total.reshape(outs).astype(np.float32)


@op("AveragePool", since=1, attrs=_POOL_ATTRS + ("count_include_pad",), check=_check_auto_pad)
def average_pool(node: Node, x: Tensor) -> Tensor:
    kernel, strides, dilations, begin, end, outs = _pool_geometry(node, x)
    win = _pooled_windows(x, kernel, strides, dilations, begin, end, outs, 0.0)
    counts = _counts(node, x.shape[2:], kernel, strides, dilations, begin, end, outs,
                     bool(node.attr("count_include_pad", 0)))
    divisor = Tensor(counts, device=x.device).cast(x.dtype)
    return (win.sum(-1) / divisor).cast(x.dtype)


@op("LpPool", since=2, attrs=_POOL_ATTRS + ("p",), check=_check_auto_pad)
def lp_pool(node: Node, x: Tensor) -> Tensor:
    p = node.attr("p", 2)
    kernel, strides, dilations, begin, end, outs = _pool_geometry(node, x)
    win = _pooled_windows(x, kernel, strides, dilations, begin, end, outs, 0.0)
    return (win.abs() ** p).sum(-1) ** (1.0 / p)


@op("GlobalAveragePool", since=1)
def global_average_pool(node: Node, x: Tensor) -> Tensor:
    return x.mean(tuple(range(2, x.ndim)), keepdim=True)


@op("GlobalMaxPool", since=1)
def global_max_pool(node: Node, x: Tensor) -> Tensor:
    return x.amax(tuple(range(2, x.ndim)), keepdim=True)


@op("GlobalLpPool", since=2, attrs=("p",))
def global_lp_pool(node: Node, x: Tensor) -> Tensor:
    p = node.attr("p", 2)
    return (x.abs() ** p).sum(tuple(range(2, x.ndim)), keepdim=True) ** (1.0 / p)


@op("MaxUnpool", since=9, attrs=("kernel_shape", "pads", "strides"), host=2)
def max_unpool(node: Node, x: Tensor, index: Tensor, output_shape: np.ndarray | None = None
               ) -> Tensor:
    n_sp = x.ndim - 2
    kernel = _spatial(node, "kernel_shape", n_sp, 1)
    strides = _spatial(node, "strides", n_sp, 1)
    pads = node.attr("pads", None) or [0] * (2 * n_sp)
    spatial = [(i - 1) * s + k - pads[j] - pads[j + n_sp]
               for j, (i, s, k) in enumerate(zip(x.shape[2:], strides, kernel))]
    inferred = list(x.shape[:2]) + spatial
    flat = const(0, (math.prod(inferred),), x.dtype, x.device)
    out = scatter(flat, 0, index.reshape(-1).cast(dt.int64), x.reshape(-1)).reshape(inferred)
    if output_shape is not None:  # the indices address the inferred shape; zeros around it
        shape = [int(v) for v in np.asarray(output_shape).reshape(-1)]
        out = out.pad([v for a in reversed(range(len(shape)))
                       for v in (0, shape[a] - inferred[a])])
    return out


__all__ = ["windows", "convolve"]
