"""Less common operators: CenterCropPad, ReverseSequence, Col2Im, TensorScatter, Det, the
training updates of ``ai.onnx.preview.training`` (Adagrad, Adam, Momentum) and two of
``ai.onnx.ml`` (Binarizer, ArrayFeatureExtractor).

>>> import numpy as np
>>> from anygpu.onnx.ops.table import Node
>>> node = Node("Det", "d", "", 11, "cpu", {}, [1], [1], 1)
>>> round(det(node, Tensor(np.array([[2.0, 1.0], [4.0, 3.0]], np.float32))).item(), 4)
2.0
"""

from __future__ import annotations

import math

import numpy as np

from anygpu import dtype as dt
from anygpu.onnx.ops.common import axes_list, axis as norm_axis, const, ints, scalar
from anygpu.onnx.ops.conv import _dilate
from anygpu.onnx.ops.table import Node, op
from anygpu.ops.sorting import argsort
from anygpu.tensor import Tensor, arange, cat, where


@op("CenterCropPad", since=18, attrs=("axes",), host=1)
def center_crop_pad(node: Node, x: Tensor, shape: np.ndarray) -> Tensor:
    axes = axes_list(node.attr("axes"), x.ndim, node) if node.has("axes") else \
        list(range(x.ndim))
    out = x
    for a, want in zip(axes, ints(shape)):
        have = out.shape[a]
        if want < have:  # crop: the extra element of an odd difference comes off the end
            start = (have - want) // 2
            bounds = [(0, m) for m in out.shape]
            bounds[a] = (start, start + want)
            out = out.shrink(bounds)
        elif want > have:  # pad: likewise at the end
            before = (want - have) // 2
            pads = [0, 0] * (out.ndim - 1 - a) + [before, want - have - before]
            out = out.pad(pads)
    return out


@op("ReverseSequence", since=10, attrs=("batch_axis", "time_axis"))
def reverse_sequence(node: Node, x: Tensor, lengths: Tensor) -> Tensor:
    b_axis = norm_axis(node.attr("batch_axis", 1), x.ndim, node)
    t_axis = norm_axis(node.attr("time_axis", 0), x.ndim, node)
    steps = x.shape[t_axis]
    view_t = [1] * x.ndim
    view_t[t_axis] = steps
    view_b = [1] * x.ndim
    view_b[b_axis] = x.shape[b_axis]
    t = arange(steps, device=x.device, dtype=dt.int64).reshape(view_t)
    n = lengths.cast(dt.int64).reshape(view_b)
    source = where(t.lt(n), n - 1 - t, t).expand(x.shape)
    return x.gather(t_axis, source)


@op("Col2Im", since=18, attrs=("dilations", "pads", "strides"), host=(1, 2))
def col2im(node: Node, x: Tensor, image: np.ndarray, block: np.ndarray) -> Tensor:
    size, kernel = ints(image), ints(block)
    nd = len(size)
    dil = node.attr("dilations", None) or [1] * nd
    strides = node.attr("strides", None) or [1] * nd
    pads = node.attr("pads", None) or [0] * (2 * nd)
    n = x.shape[0]
    c = x.shape[1] // math.prod(kernel)
    blocks = [(size[i] + pads[i] + pads[i + nd] - dil[i] * (kernel[i] - 1) - 1) // strides[i] + 1
              for i in range(nd)]
    padded = [size[i] + pads[i] + pads[i + nd] for i in range(nd)]
    cols = x.reshape((n, c, math.prod(kernel)) + tuple(blocks))
    total: Tensor | None = None
    for k, offset in enumerate(np.ndindex(*kernel)):
        part = _dilate(cols[:, :, k], strides)  # the blocks of one kernel offset, spread out
        grow = []
        for i in reversed(range(nd)):
            start = offset[i] * dil[i]
            grow += [start, padded[i] - start - part.shape[2 + i]]
        placed = part.pad(grow)
        total = placed if total is None else total + placed
    assert total is not None
    return total.shrink([(0, n), (0, c)] + [(pads[i], pads[i] + size[i]) for i in range(nd)])


@op("TensorScatter", since=24, attrs=("axis", "mode"),
    check=lambda n: None if n.attr("mode", "linear") in ("linear", "circular")
    else f"mode {n.attr('mode')!r} is not supported")
def tensor_scatter(node: Node, cache: Tensor, update: Tensor,
                   write_at: Tensor | None = None) -> Tensor:
    a = norm_axis(node.attr("axis", -2), cache.ndim, node)
    total, count = cache.shape[a], update.shape[a]
    view = [1] * cache.ndim
    view[a] = total
    p = arange(total, device=cache.device, dtype=dt.int64).reshape(view)
    if write_at is None:
        start = const(0, (), dt.int64, cache.device)
    else:
        start = write_at.cast(dt.int64).reshape((-1,) + (1,) * (cache.ndim - 1))
    s = p - start
    if node.attr("mode", "linear") == "circular":
        s = s.remainder(total)
    valid = s.ge(0).logical_and(s.lt(count))
    full = [m for m in cache.shape]
    source = s.clip(0, max(count - 1, 0)).expand(tuple(full))
    grow = [0, 0] * (cache.ndim - 1 - a) + [0, total - count]
    picked = update.pad(grow).gather(a, source) if count < total else update.gather(a, source)
    return where(valid, picked, cache)


@op("Det", since=11)
def det(node: Node, x: Tensor) -> Tensor:
    """Gaussian elimination with partial pivoting, unrolled over the matrix size."""
    n = x.shape[-1]
    lead = x.shape[:-2]
    a = x.cast(dt.float32).reshape((-1, n, n))
    result = const(1.0, (a.shape[0],), dt.float32, x.device)
    rows = arange(n, device=x.device, dtype=dt.int64)
    for k in range(n):
        column = a[:, :, k].abs()
        column = where(rows.lt(k), const(-1.0, (), dt.float32, x.device), column)
        pivot = column.argmax(1)  # (B,)
        # swap rows k and pivot: a permutation of the rows by a gather
        order = where(rows.eq(k), pivot.reshape(-1, 1),
                      where(rows.reshape(1, n).eq(pivot.reshape(-1, 1)),
                            const(k, (), dt.int64, x.device), rows))
        a = a.gather(1, order.unsqueeze(-1).expand(a.shape))
        swapped = pivot.ne(k)
        head = a[:, k, k]
        result = result * where(swapped, -head, head)
        safe = where(head.eq(0), const(1.0, (), dt.float32, x.device), head)
        factors = where(rows.gt(k), a[:, :, k] / safe.reshape(-1, 1),
                        const(0.0, (), dt.float32, x.device))
        a = a - factors.unsqueeze(-1) * a[:, k:k + 1, :]
    return result.reshape(lead).cast(x.dtype)


# ---- training updates ---------------------------------------------------------------------------
_TRAINING = "ai.onnx.preview.training"


def _groups(args: tuple[Tensor, ...], per: int) -> list[list[Tensor]]:
    n = len(args) // per
    return [[args[j * n + i] for j in range(per)] for i in range(n)]


@op("Adagrad", since=1, domain=_TRAINING, attrs=("decay_factor", "epsilon", "norm_coefficient"),
    host=1)
def adagrad(node: Node, rate: Tensor, step: np.ndarray, *tensors: Tensor) -> tuple[Tensor, ...]:
    t = float(scalar(step))
    r = rate.reshape(()) / (1 + t * node.attr("decay_factor", 0.0))
    xs, hs = [], []
    for x, g, h in _groups(tensors, 3):
        g = g + x * node.attr("norm_coefficient", 0.0)
        h_new = h + g * g
        xs.append(x - r * g / (h_new.sqrt() + node.attr("epsilon", 0.0)))
        hs.append(h_new)
    return tuple(xs + hs)


@op("Adam", since=1, domain=_TRAINING, attrs=("alpha", "beta", "epsilon", "norm_coefficient",
                                              "norm_coefficient_post"), host=1)
def adam(node: Node, rate: Tensor, step: np.ndarray, *tensors: Tensor) -> tuple[Tensor, ...]:
    t = float(scalar(step))
    alpha, beta = node.attr("alpha", 0.9), node.attr("beta", 0.999)
    r = rate.reshape(())
    if t > 0:
        r = r * (math.sqrt(1 - beta ** t) / (1 - alpha ** t))
    xs, vs, hs = [], [], []
    for x, g, v, h in _groups(tensors, 4):
        g = g + x * node.attr("norm_coefficient", 0.0)
        v_new = v * alpha + g * (1 - alpha)
        h_new = h * beta + g * g * (1 - beta)
        x_new = x - r * (v_new / (h_new.sqrt() + node.attr("epsilon", 0.0)))
        xs.append(x_new * (1 - node.attr("norm_coefficient_post", 0.0)))
        vs.append(v_new)
        hs.append(h_new)
    return tuple(xs + vs + hs)


@op("Momentum", since=1, domain=_TRAINING, attrs=("alpha", "beta", "mode", "norm_coefficient"),
    host=1, check=lambda n: None if n.attr("mode", "standard") in ("standard", "nesterov")
    else f"mode {n.attr('mode')!r} is not supported")
def momentum(node: Node, rate: Tensor, step: np.ndarray, *tensors: Tensor) -> tuple[Tensor, ...]:
    t = float(scalar(step))
    alpha, beta = node.attr("alpha"), node.attr("beta")
    r = rate.reshape(())
    xs, vs = [], []
    for x, g, v in _groups(tensors, 3):
        g = g + x * node.attr("norm_coefficient")
        v_new = v * alpha + g * (beta if t > 0 else 1.0)
        if node.attr("mode", "standard") == "nesterov":
            xs.append(x - r * (g + v_new * alpha))
        else:
            xs.append(x - r * v_new)
        vs.append(v_new)
    return tuple(xs + vs)


# ---- ai.onnx.ml ---------------------------------------------------------------------------------
_ML = "ai.onnx.ml"


@op("Binarizer", since=1, domain=_ML, attrs=("threshold",))
def binarizer(node: Node, x: Tensor) -> Tensor:
    return x.gt(node.attr("threshold", 0.0)).cast(x.dtype)


@op("ArrayFeatureExtractor", since=1, domain=_ML)
def array_feature_extractor(node: Node, x: Tensor, index: Tensor) -> Tensor:
    picked = x.index_select(x.ndim - 1, index.reshape(-1).cast(dt.int64))
    return picked.reshape(1, -1) if x.ndim == 1 else picked


__all__ = ["det", "col2im", "reverse_sequence"]


# ---- bit reinterpretation -----------------------------------------------------------------------
def _check_bitcast(node: Node) -> str | None:
    from onnx import TensorProto

    src, to = node.in_type(0), node.attr("to", None)
    if src is None or to is None:
        return None
    pair = {src, to}
    if TensorProto.DOUBLE in pair:
        return "bit casts of DOUBLE are not supported (float64 is held in float32)"
    if TensorProto.FLOAT16 in pair or TensorProto.BFLOAT16 in pair:
        return "bit casts of 16-bit floats are not supported"
    return None


@op("BitCast", since=26, attrs=("to",), check=_check_bitcast)
def bit_cast(node: Node, x: Tensor) -> Tensor:
    from onnx import TensorProto

    from anygpu.onnx.ops.elementwise import bits_float, cast_to, float_bits

    to = node.attr("to")
    if x.dtype == dt.float32 and to in (TensorProto.INT32, TensorProto.UINT32):
        return cast_to(float_bits(x), to)
    if to == TensorProto.FLOAT:
        return bits_float(x)
    return cast_to(x, to)  # integers of one width: the same bits, wrapped into the new type


# ---- non-maximum suppression --------------------------------------------------------------------
def _box_edges(boxes: Tensor, center: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(x_min, x_max, y_min, y_max) of (..., 4) boxes: corners in either order, or centers."""
    if center:
        xc, yc, w, h = (boxes[..., k] for k in range(4))
        return xc - w / 2, xc + w / 2, yc - h / 2, yc + h / 2
    y1, x1, y2, x2 = (boxes[..., k] for k in range(4))
    return x1.minimum(x2), x1.maximum(x2), y1.minimum(y2), y1.maximum(y2)


@op("NonMaxSuppression", since=10, attrs=("center_point_box",), host=(2, 3, 4))
def non_max_suppression(node: Node, boxes: Tensor, scores: Tensor,
                        max_per_class: np.ndarray | None = None,
                        iou_threshold: np.ndarray | None = None,
                        score_threshold: np.ndarray | None = None) -> Tensor:
    """Greedy selection by descending score (ties: the lower index first), dropping boxes whose
    IoU with one already selected exceeds the threshold; one step per candidate rank on the
    device, the number selected read back at the end."""
    b, c, n = scores.shape
    limit = max(int(scalar(max_per_class)), 0) if max_per_class is not None and \
        np.asarray(max_per_class).size else 0
    if limit == 0 or n == 0:
        return const(0, (0, 3), dt.int64, boxes.device)
    iou_max = float(scalar(iou_threshold)) if iou_threshold is not None and \
        np.asarray(iou_threshold).size else 0.0
    x0, x1, y0, y1 = _box_edges(boxes.cast(dt.float32), bool(node.attr("center_point_box", 0)))
    ix = x1.unsqueeze(2).minimum(x1.unsqueeze(1)) - x0.unsqueeze(2).maximum(x0.unsqueeze(1))
    iy = y1.unsqueeze(2).minimum(y1.unsqueeze(1)) - y0.unsqueeze(2).maximum(y0.unsqueeze(1))
    area = (x1 - x0) * (y1 - y0)  # (B, N)
    inter = ix * iy
    union = area.unsqueeze(2) + area.unsqueeze(1) - inter
    overlaps = ix.gt(0).logical_and(iy.gt(0)).logical_and(area.unsqueeze(2).gt(0)) \
        .logical_and(area.unsqueeze(1).gt(0)).logical_and(union.gt(0))
    zero = const(0.0, (), dt.float32, boxes.device)
    suppress = overlaps.logical_and(where(overlaps, inter / where(overlaps, union, zero + 1),
                                          zero).gt(iou_max))  # (B, N, N)
    s = scores.cast(dt.float32)
    valid = s.gt(float(scalar(score_threshold))) if score_threshold is not None and \
        np.asarray(score_threshold).size else const(True, s.shape, dt.bool_, boxes.device)
    order = argsort(s, -1, descending=True)  # (B, C, N), stable
    chosen = const(False, (b, c, n), dt.bool_, boxes.device)
    rank = const(0, (b, c, n), dt.int64, boxes.device)
    count = const(0, (b, c), dt.int64, boxes.device)
    positions = arange(n, device=boxes.device, dtype=dt.int64)
    for t in range(n):
        i = order[:, :, t]  # (B, C): the candidate of rank t
        rows = suppress.gather(1, i.unsqueeze(-1).expand(b, c, n))  # (B, C, N): its overlaps
        blocked = rows.logical_and(chosen).any(-1)
        ok = valid.gather(2, i.unsqueeze(-1)).squeeze(-1)
        take = ok.logical_and(blocked.logical_not()).logical_and(count.lt(limit))
        hit = positions.reshape(1, 1, n).eq(i.unsqueeze(-1)).logical_and(take.unsqueeze(-1))
        rank = where(hit, count.unsqueeze(-1), rank)
        chosen = chosen.logical_or(hit)
        count = count + take.cast(dt.int64)
        if t % 16 == 15:  # bound the depth of the graph the steps build
            chosen, rank, count = (v.contiguous().realize() for v in (chosen, rank, count))
    # order the selections by batch, class, then selection order; read back how many there are
    base = (arange(b * c, device=boxes.device, dtype=dt.int64).reshape(b, c, 1)) * n
    key = where(chosen, base + rank, const(b * c * n, (), dt.int64, boxes.device)).reshape(-1)
    total = int(count.sum().item())
    picked = argsort(key)[:total]  # flat (b, c, box) positions in output order
    box = picked % n
    pair = picked // n
    return cat([(pair // c).unsqueeze(1), (pair % c).unsqueeze(1), box.unsqueeze(1)], 1)
