"""Shape and movement operators: Shape, Reshape, Squeeze, Transpose, Concat, Split, Slice,
Expand, Tile, Pad, ConstantOfShape, Range and friends.

Shapes, axes, pads and slice bounds are read on the host (they decide the structure of the
computation); the data moves on the device as views wherever anygpu can express it.

>>> import numpy as np
>>> from anygpu.onnx.ops.table import Node
>>> node = Node("Slice", "s", "", 13, "cpu", {}, [1, 7, 7], [1], 1)
>>> x = Tensor(np.arange(6, dtype=np.float32))
>>> slice_(node, x, np.array([4]), np.array([0]), None, np.array([-2])).tolist()
[4.0, 2.0]
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from anygpu import dtype as dt
from anygpu.nn import functional as F
from anygpu.onnx import dtypes
from anygpu.onnx.ops.common import axes_list, axis, const, ints, scalar
from anygpu.onnx.ops.table import ALL, Node, op
from anygpu.tensor import Tensor, arange, cat, where


# ---- shapes -------------------------------------------------------------------------------------
def _shape_range(node: Node, ndim: int) -> tuple[int, int]:
    start, end = node.attr("start", 0), node.attr("end", ndim)
    start = min(max(start + ndim if start < 0 else start, 0), ndim)
    end = min(max(end + ndim if end < 0 else end, 0), ndim)
    return start, end


def _shape_of(node: Node, shape: Sequence[int]) -> np.ndarray:
    start, end = _shape_range(node, len(shape))
    return np.asarray(list(shape)[start:end], dtype=np.int64)


@op("Shape", since=1, attrs=("start", "end"), fold=lambda node, x: _shape_of(node, x.shape))
def shape(node: Node, x: Tensor) -> np.ndarray:
    return _shape_of(node, x.shape)


@op("Size", since=1, fold=lambda node, x: np.asarray(x.size, dtype=np.int64))
def size(node: Node, x: Tensor) -> np.ndarray:
    return np.asarray(math.prod(x.shape), dtype=np.int64)


def reshape_target(node: Node, in_shape: Sequence[int], target: Sequence[int],
                   allowzero: bool) -> tuple[int, ...]:
    """ONNX Reshape's target: 0 copies the input's size there (unless ``allowzero``), -1 is
    inferred."""
    out = [int(t) for t in target]
    for i, t in enumerate(out):
        if t == 0 and not allowzero:
            if i >= len(in_shape):
                node.fail(f"shape {list(target)} copies dimension {i} of an input of rank "
                          f"{len(in_shape)}")
            out[i] = in_shape[i]
    if out.count(-1) > 1:
        node.fail(f"shape {list(target)} has more than one -1")
    total = math.prod(in_shape)
    if -1 in out:
        known = math.prod(t for t in out if t != -1)
        if known == 0 or total % known:
            node.fail(f"cannot reshape {tuple(in_shape)} to {list(target)}")
        out[out.index(-1)] = total // known
    if math.prod(out) != total:
        node.fail(f"cannot reshape {tuple(in_shape)} ({total} elements) to {tuple(out)}")
    return tuple(out)


@op("Reshape", since=5, attrs=("allowzero",), host=1,
    fold=lambda node, x, s: x.reshape(reshape_target(node, x.shape, ints(s),
                                                     node.attr("allowzero", 0))))
def reshape(node: Node, x: Tensor, target: np.ndarray) -> Tensor:
    return x.reshape(reshape_target(node, x.shape, ints(target), node.attr("allowzero", 0)))


def _flat_shape(node: Node, shape: Sequence[int]) -> tuple[int, int]:
    a = node.attr("axis", 1)
    a = a + len(shape) if a < 0 else a
    if not 0 <= a <= len(shape):
        node.fail(f"axis {node.attr('axis', 1)} is out of range for rank {len(shape)}")
    return math.prod(shape[:a]), math.prod(shape[a:])


@op("Flatten", since=1, attrs=("axis",), fold=lambda node, x: x.reshape(_flat_shape(node,
                                                                                     x.shape)))
def flatten(node: Node, x: Tensor) -> Tensor:
    return x.reshape(_flat_shape(node, x.shape))


def _squeezed(node: Node, shape: Sequence[int], axes: Any) -> tuple[int, ...]:
    if axes is None or len(np.asarray(axes).reshape(-1)) == 0:
        return tuple(n for n in shape if n != 1)
    drop = set(axes_list(axes, len(shape), node))
    for a in drop:
        if shape[a] != 1:
            node.fail(f"cannot squeeze axis {a} of size {shape[a]}")
    return tuple(n for i, n in enumerate(shape) if i not in drop)


def _unsqueezed(node: Node, shape: Sequence[int], axes: Any) -> tuple[int, ...]:
    rank = len(shape) + len(np.asarray(axes).reshape(-1))
    new = sorted(axes_list(axes, rank, node))
    if len(set(new)) != len(new):
        node.fail(f"repeated axes {ints(axes)}")
    out, it = [], iter(shape)
    for i in range(rank):
        out.append(1 if i in new else next(it))
    return tuple(out)


@op("Squeeze", since=1, until=12, attrs=("axes",),
    fold=lambda node, x: x.reshape(_squeezed(node, x.shape, node.attr("axes", None))))
def squeeze_attr(node: Node, x: Tensor) -> Tensor:
    return x.reshape(_squeezed(node, x.shape, node.attr("axes", None)))


@op("Squeeze", since=13, host=1,
    fold=lambda node, x, a=None: x.reshape(_squeezed(node, x.shape, a)))
def squeeze(node: Node, x: Tensor, axes: np.ndarray | None = None) -> Tensor:
    return x.reshape(_squeezed(node, x.shape, axes))


@op("Unsqueeze", since=1, until=12, attrs=("axes",),
    fold=lambda node, x: x.reshape(_unsqueezed(node, x.shape, node.attr("axes"))))
def unsqueeze_attr(node: Node, x: Tensor) -> Tensor:
    return x.reshape(_unsqueezed(node, x.shape, node.attr("axes")))


@op("Unsqueeze", since=13, host=1,
    fold=lambda node, x, a: x.reshape(_unsqueezed(node, x.shape, a)))
def unsqueeze(node: Node, x: Tensor, axes: np.ndarray) -> Tensor:
    return x.reshape(_unsqueezed(node, x.shape, axes))


def _perm(node: Node, ndim: int) -> list[int]:
    perm = node.attr("perm", None)
    if perm is None:
        return list(reversed(range(ndim)))
    perm = axes_list(perm, ndim, node)
    if sorted(perm) != list(range(ndim)):
        node.fail(f"perm {node.attr('perm')} is not a permutation of {ndim} axes")
    return perm


@op("Transpose", since=1, attrs=("perm",),
    fold=lambda node, x: np.transpose(x, _perm(node, x.ndim)))
def transpose(node: Node, x: Tensor) -> Tensor:
    return x.permute(_perm(node, x.ndim))


def _fold_concat(node: Node, *xs: np.ndarray) -> np.ndarray:
    return np.concatenate(xs, axis=axis(node.attr("axis"), xs[0].ndim, node))


@op("Concat", since=4, attrs=("axis",), fold=_fold_concat)
def concat(node: Node, *xs: Tensor) -> Tensor:
    a = axis(node.attr("axis"), xs[0].ndim, node)
    parts = [x for x in xs if x.shape[a] > 0] or [xs[0]]
    return parts[0] if len(parts) == 1 else cat(parts, a)


def _split_sizes(node: Node, n: int, split: Any) -> list[int]:
    if split is not None and len(np.asarray(split).reshape(-1)):
        sizes = ints(split)
        if sum(sizes) != n:
            node.fail(f"split sizes {sizes} do not add up to {n}")
        return sizes
    parts = node.attr("num_outputs", node.num_outputs)
    if node.opset >= 18:  # equal parts, the last smaller
        step = -(-n // parts)
        return [min(step, n - i * step) for i in range(parts)]
    if n % parts:
        node.fail(f"cannot split {n} into {parts} equal parts")
    return [n // parts] * parts


def _split(node: Node, x: Tensor, split: Any) -> tuple[Tensor, ...]:
    a = axis(node.attr("axis", 0), x.ndim, node)
    sizes = _split_sizes(node, x.shape[a], split)
    out, start = [], 0
    for s in sizes:
        bounds = [(0, m) for m in x.shape]
        bounds[a] = (start, start + s)
        out.append(x.shrink(bounds))
        start += s
    return tuple(out)


@op("Split", since=2, until=12, attrs=("axis", "split"))
def split_attr(node: Node, x: Tensor) -> tuple[Tensor, ...]:
    return _split(node, x, node.attr("split", None))


@op("Split", since=13, attrs=("axis", "num_outputs"), host=1)
def split(node: Node, x: Tensor, sizes: np.ndarray | None = None) -> tuple[Tensor, ...]:
    return _split(node, x, sizes)


# ---- slicing ------------------------------------------------------------------------------------
def _slice_plan(node: Node, shape: Sequence[int], starts: Any, ends: Any, axes: Any,
                steps: Any) -> list[tuple[int, int, int]]:
    """(first index, count, step) per axis, by ONNX's clamping rules."""
    starts, ends = ints(starts), ints(ends)
    rank = len(shape)
    axes_ = axes_list(axes, rank, node) if axes is not None else list(range(len(starts)))
    steps_ = ints(steps) if steps is not None else [1] * len(starts)
    if not len(starts) == len(ends) == len(axes_) == len(steps_):
        node.fail("starts, ends, axes and steps differ in length")
    plan = [(0, n, 1) for n in shape]
    for a, s, e, st in zip(axes_, starts, ends, steps_):
        n = shape[a]
        if st == 0:
            node.fail("a slice step of 0")
        s = s + n if s < 0 else s
        e = e + n if e < 0 else e
        if st > 0:
            s, e = min(max(s, 0), n), min(max(e, 0), n)
            count = max(0, -(-(e - s) // st))
        else:
            s, e = min(max(s, -1), n - 1), min(max(e, -1), n - 1)
            count = max(0, -(-(s - e) // -st))
        plan[a] = (s, count, st)
    return plan


def _apply_slice(x: Tensor, plan: list[tuple[int, int, int]]) -> Tensor:
    index = []
    flips = []
    for a, (first, count, step) in enumerate(plan):
        if count == 0:
            index.append(slice(0, 0))
        elif step > 0:
            index.append(slice(first, first + (count - 1) * step + 1, step))
        else:
            last = first + (count - 1) * step
            index.append(slice(last, first + 1, -step))
            flips.append(a)
    out = x[tuple(index)] if any(p != (0, n, 1) for p, n in zip(plan, x.shape)) else x
    return out.flip(*flips) if flips else out


def _fold_slice(node: Node, x: np.ndarray, starts: Any, ends: Any, axes: Any = None,
                steps: Any = None) -> np.ndarray:
    plan = _slice_plan(node, x.shape, starts, ends, axes, steps)
    index = tuple(slice(f, f + c * s if f + c * s >= 0 else None, s) for f, c, s in plan)
    return x[index]


@op("Slice", since=1, until=9, attrs=("starts", "ends", "axes"))
def slice_attr(node: Node, x: Tensor) -> Tensor:
    plan = _slice_plan(node, x.shape, node.attr("starts"), node.attr("ends"),
                       node.attr("axes", None), None)
    return _apply_slice(x, plan)


@op("Slice", since=10, host=(1, 2, 3, 4), fold=_fold_slice)
def slice_(node: Node, x: Tensor, starts: np.ndarray, ends: np.ndarray,
           axes: np.ndarray | None = None, steps: np.ndarray | None = None) -> Tensor:
    return _apply_slice(x, _slice_plan(node, x.shape, starts, ends, axes, steps))


# ---- broadcasting, tiling, padding --------------------------------------------------------------
def _expand_shape(node: Node, shape: Sequence[int], target: Sequence[int]) -> tuple[int, ...]:
    nd = max(len(shape), len(target))
    a = [1] * (nd - len(shape)) + list(shape)
    b = [1] * (nd - len(target)) + list(target)
    out = []
    for x, y in zip(a, b):
        if x != y and x != 1 and y != 1:
            node.fail(f"cannot expand shape {tuple(shape)} to {tuple(target)}")
        out.append(x if y == 1 else y)
    return tuple(out)


@op("Expand", since=8, host=1,
    fold=lambda node, x, s: np.broadcast_to(x, _expand_shape(node, x.shape, ints(s))).copy())
def expand(node: Node, x: Tensor, target: np.ndarray) -> Tensor:
    out = _expand_shape(node, x.shape, ints(target))
    return x.expand(out) if out != x.shape else x


@op("Tile", since=6, host=1, fold=lambda node, x, r: np.tile(x, ints(r)))
def tile(node: Node, x: Tensor, repeats: np.ndarray) -> Tensor:
    reps = ints(repeats)
    if len(reps) != x.ndim:
        node.fail(f"repeats {reps} do not match rank {x.ndim}")
    return x.repeat(*reps) if x.ndim else x


_PAD_MODES = {"constant": "constant", "reflect": "reflect", "edge": "replicate",
              "wrap": "circular"}


def _pad(node: Node, x: Tensor, pads: list[int], value: Any, axes: list[int] | None) -> Tensor:
    mode = node.attr("mode", "constant")
    rank = x.ndim
    axes = axes if axes is not None else list(range(rank))
    if len(pads) != 2 * len(axes):
        node.fail(f"pads {pads} do not fit {len(axes)} axes")
    begin, end = [0] * rank, [0] * rank
    for k, a in enumerate(axes):
        begin[a], end[a] = pads[k], pads[k + len(axes)]
    # crop first (negative pads), then grow
    if any(b < 0 or e < 0 for b, e in zip(begin, end)):
        x = x.shrink([(max(-b, 0), n - max(-e, 0)) for b, e, n in zip(begin, end, x.shape)])
        begin, end = [max(b, 0) for b in begin], [max(e, 0) for e in end]
    if not any(begin) and not any(end):
        return x
    torch_order = [v for a in reversed(range(rank)) for v in (begin[a], end[a])]
    if mode == "constant":
        return x.pad(torch_order, value)
    if x.numel() == 0:
        node.fail(f"{mode} padding of an empty tensor")
    if mode == "reflect" and any(p >= n for a, n in enumerate(x.shape)
                                 for p in (begin[a], end[a]) if n > 1):
        return _pad_reflect_repeated(x, begin, end)
    return F.pad(x, torch_order, _PAD_MODES[mode])


def _pad_reflect_repeated(x: Tensor, begin: list[int], end: list[int]) -> Tensor:
    """Reflection padding wider than the axis: the reflection repeats, by an index gather."""
    for a, n in enumerate(x.shape):
        if not begin[a] and not end[a]:
            continue
        pos = np.arange(-begin[a], n + end[a])
        period = 2 * (n - 1) if n > 1 else 1
        pos = np.abs(pos) % period if n > 1 else np.zeros_like(pos)
        pos = np.where(pos >= n, period - pos, pos)
        x = x.index_select(a, Tensor(pos.astype(np.int64), device=x.device))
    return x


def _check_pad(node: Node) -> str | None:
    mode = node.attr("mode", "constant")
    return None if mode in _PAD_MODES else f"pad mode {mode!r} is not supported"


@op("Pad", since=2, until=10, attrs=("mode", "pads", "value"), check=_check_pad)
def pad_attr(node: Node, x: Tensor) -> Tensor:
    return _pad(node, x, node.attr("pads"), node.attr("value", 0.0), None)


@op("Pad", since=11, attrs=("mode",), host=(1, 2, 3), check=_check_pad)
def pad(node: Node, x: Tensor, pads: np.ndarray, value: np.ndarray | None = None,
        axes: np.ndarray | None = None) -> Tensor:
    v = scalar(value) if value is not None and np.asarray(value).size else 0
    return _pad(node, x, ints(pads), v, axes_list(axes, x.ndim, node) if axes is not None
                else None)


# ---- making tensors -----------------------------------------------------------------------------
def _fill_value(node: Node) -> np.ndarray:
    value = node.attr("value", None)
    if value is None:
        return np.zeros((), np.float32)
    return np.asarray(value).reshape(())


def _fold_constant_of_shape(node: Node, shape: np.ndarray) -> np.ndarray | None:
    dims = ints(shape)
    if math.prod(dims) > 4096:
        return None
    return np.full(dims, _fill_value(node))


@op("ConstantOfShape", since=9, attrs=("value",), host=0, fold=_fold_constant_of_shape)
def constant_of_shape(node: Node, shape: np.ndarray) -> Tensor:
    value = _fill_value(node)
    elem = dtypes.elem_type_of(value)
    d = dtypes.storage(elem)
    return const(value.item(), ints(shape), d, node.device)


def _range_count(start: Any, limit: Any, delta: Any) -> int:
    return max(int(math.ceil((limit - start) / delta)), 0)


def _fold_range(node: Node, start: np.ndarray, limit: np.ndarray,
                delta: np.ndarray) -> np.ndarray:
    s, lim, d = scalar(start), scalar(limit), scalar(delta)
    n = _range_count(s, lim, d)
    if n > 4096:
        return None  # type: ignore[return-value]
    return (np.asarray(s, dtype=start.dtype) + np.arange(n).astype(start.dtype) *
            np.asarray(d, dtype=start.dtype)).astype(start.dtype)


@op("Range", since=11, host=ALL, fold=_fold_range)
def range_(node: Node, start: np.ndarray, limit: np.ndarray, delta: np.ndarray) -> Tensor:
    s, lim, d = scalar(start), scalar(limit), scalar(delta)
    n = _range_count(s, lim, d)
    elem = dtypes.elem_type_of(np.asarray(start))
    want = dtypes.storage(elem)
    idx = arange(n, device=node.device, dtype=dt.int64 if want.is_int else dt.float32)
    return (idx * d + s).cast(want)


@op("EyeLike", since=9, attrs=("dtype", "k"))
def eye_like(node: Node, x: Tensor) -> Tensor:
    elem = node.attr("dtype", node.in_type(0))
    want = dtypes.storage(elem) if elem is not None else x.dtype
    n, m = x.shape
    rows = arange(n, device=x.device, dtype=dt.int64).reshape(n, 1)
    cols = arange(m, device=x.device, dtype=dt.int64).reshape(1, m)
    return (cols - rows).eq(node.attr("k", 0)).cast(want)


@op("Trilu", since=14, attrs=("upper",), host=1)
def trilu(node: Node, x: Tensor, k: np.ndarray | None = None) -> Tensor:
    diagonal = int(scalar(k)) if k is not None else 0
    n, m = x.shape[-2:]
    rows = arange(n, device=x.device, dtype=dt.int64).reshape(n, 1)
    cols = arange(m, device=x.device, dtype=dt.int64).reshape(1, m)
    keep = (cols - rows).ge(diagonal) if node.attr("upper", 1) else (cols - rows).le(diagonal)
    return where(keep, x, const(0, (), x.dtype, x.device))


@op("OneHot", since=9, attrs=("axis",), host=1)
def one_hot(node: Node, indices: Tensor, depth: np.ndarray, values: Tensor) -> Tensor:
    d = int(scalar(depth))
    idx = indices
    if idx.dtype.is_float:
        idx = idx.trunc()
    idx = idx.cast(dt.int64)
    idx = where(idx.lt(0), idx + d, idx)
    a = axis(node.attr("axis", -1), indices.ndim + 1, node)
    shape = [1] * (indices.ndim + 1)
    shape[a] = d
    hot = idx.unsqueeze(a).eq(arange(d, device=indices.device, dtype=dt.int64).reshape(shape))
    off, on = values.reshape(-1)[0], values.reshape(-1)[1]
    return where(hot, on, off)


# ---- rearranging blocks -------------------------------------------------------------------------
@op("DepthToSpace", since=1, attrs=("blocksize", "mode"),
    check=lambda n: None if n.attr("mode", "DCR") in ("DCR", "CRD") else "mode must be DCR or CRD")
def depth_to_space(node: Node, x: Tensor) -> Tensor:
    b = node.attr("blocksize")
    n, c, h, w = x.shape
    if node.attr("mode", "DCR") == "DCR":
        y = x.reshape(n, b, b, c // (b * b), h, w).permute(0, 3, 4, 1, 5, 2)
    else:
        y = x.reshape(n, c // (b * b), b, b, h, w).permute(0, 1, 4, 2, 5, 3)
    return y.reshape(n, c // (b * b), h * b, w * b)


@op("SpaceToDepth", since=1, attrs=("blocksize", "mode"),
    check=lambda n: None if n.attr("mode", "DCR") in ("DCR", "CRD") else "mode must be DCR or CRD")
def space_to_depth(node: Node, x: Tensor) -> Tensor:
    b = node.attr("blocksize")
    n, c, h, w = x.shape
    y = x.reshape(n, c, h // b, b, w // b, b)
    if node.attr("mode", "DCR") == "DCR":  # output channel (by, bx, c)
        y = y.permute(0, 3, 5, 1, 2, 4)
    else:  # (c, by, bx)
        y = y.permute(0, 1, 3, 5, 2, 4)
    return y.reshape(n, c * b * b, h // b, w // b)


__all__ = ["reshape_target"]
