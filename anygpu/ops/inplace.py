"""In-place writes as PyTorch has them: ``x[i] = v``, ``x[mask] = v``, ``x.add_(y)``, ``x += y``,
``x.copy_(y)``, ``x.zero_()`` and the rest of the ``*_`` methods.

A write changes the memory the tensor shows, so views of it (and the tensor it is a view of)
show the new values, and values computed before the write keep the old ones. Where autograd
records the write (a tensor with history, or a value that requires gradients), the tensor is
re-bound to the new value instead, and the graph recorded before the write keeps reading the old
one; a view re-binds the tensor it is a view of as well, through its recorded movement ops.

>>> import anygpu as ag
>>> x = ag.zeros(2, 3)
>>> x[0, 1:] = 5.0
>>> x[x > 1] += 1
>>> x.tolist()
[[0.0, 6.0, 6.0], [0.0, 0.0, 0.0]]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from anygpu import dtype as dt
from anygpu.graph.lazy import Lazy
from anygpu.ops.grad import is_grad_enabled
from anygpu.ops.indexing import (_index_copy_args, getitem, index_copy, scatter, scatter_add,
                                 scatter_reduce)
from anygpu.ops.primitives import MOVEMENT, Op

if TYPE_CHECKING:
    from anygpu.tensor import Tensor

_SHARED = ("unsupported operation: more than one element of the written-to tensor refers to a "
           "single memory location. Please clone() the tensor before performing the operation.")


def _unmove(op: Op, arg: Any, src_shape: tuple[int, ...], x: "Tensor") -> "Tensor":
    """``x``, shaped like the result of movement ``op`` on a tensor of ``src_shape``, carried
    back to ``src_shape``: each element goes where the view took it from, and the elements the
    view does not show become 0 (False)."""
    if op is Op.RESHAPE:
        return x._move(Op.RESHAPE, src_shape)
    if op is Op.PERMUTE:
        return x._move(Op.PERMUTE, tuple(int(a) for a in np.argsort(arg)))
    if op is Op.SHRINK:
        return x._move(Op.PAD, tuple((a, n - b) for (a, b), n in zip(arg, src_shape)))
    if op is Op.PAD:
        return x._move(Op.SHRINK, tuple((a, a + n) for (a, _), n in zip(arg, src_shape)))
    if op is Op.FLIP:
        return x._move(Op.FLIP, arg)
    raise RuntimeError(_SHARED)  # EXPAND: several elements of the view share one in memory


def _prepare(target: "Tensor", value: Any) -> "Tensor":
    """``value`` as a tensor of the target's dtype, device and shape (broadcast)."""
    from anygpu.tensor import Tensor, _as_tensor, broadcast_shapes

    v = _as_tensor(value, target) if not isinstance(value, Tensor) else value
    if v.device != target.device:
        v = v.to(target.device)
    if v.shape != target.shape:
        try:
            if broadcast_shapes(v.shape, target.shape) != target.shape:
                raise ValueError
        except ValueError:
            raise RuntimeError(f"the value of shape {v.shape} does not broadcast to the "
                               f"written tensor's shape {target.shape}") from None
        v = v.expand(target.shape)
    return v.cast(target.dtype)


def _records(target: "Tensor", value: "Tensor") -> bool:
    return is_grad_enabled() and (target.requires_grad or value.requires_grad)


def write(target: "Tensor", value: Any) -> "Tensor":
    """``target``'s elements become ``value``'s (broadcast and cast to its shape and dtype), in
    place; returns ``target``."""
    v = _prepare(target, value)
    if _records(target, v):
        if target.is_leaf and target.requires_grad:
            raise RuntimeError("a leaf Variable that requires grad is being used in an in-place "
                               "operation.")
        _rebind(target, v)
        return target
    target.realize()
    node = target.lazy
    if node.op is Op.BUFFER:
        return target.assign(v)
    # a view of realized memory: write the tensor it shows, where the view shows it
    mask, placed = _place(node, v)
    while node.op is not Op.BUFFER:
        node = node.srcs[0]
    from anygpu.tensor import Tensor, where

    base = Tensor(node)
    base.assign(where(mask, placed, base))
    return target


def _place(view: Lazy, value: "Tensor") -> tuple["Tensor", "Tensor"]:
    """(mask, placed): ``value`` carried down ``view``'s movement ops to the buffer it shows,
    and which elements of that buffer it covers."""
    from anygpu.tensor import Tensor

    mask = Tensor(Lazy.const(True, view.shape, dt.bool_, view.device))
    node = view
    while node.op is not Op.BUFFER:
        assert node.op in MOVEMENT, node.op
        src = node.srcs[0]
        value = _unmove(node.op, node.arg, src.shape, value)
        mask = _unmove(node.op, node.arg, src.shape, mask)
        node = src
    return mask, value


def _rebind(target: "Tensor", value: "Tensor") -> None:
    """The recorded form of a write: ``target`` becomes ``value``'s tensor (its graph and
    history), and the tensor it is a view of (found through its recorded movement op) is
    re-bound to hold the new values where the view shows them."""
    from anygpu.tensor import where

    ctx = target._ctx
    if ctx is None and target.lazy.op in MOVEMENT:
        raise RuntimeError("an in-place write that records gradients into a view of a tensor "
                           "that does not: write into that tensor itself (x[index] = value), or "
                           "clone() the view first")
    if ctx is not None and ctx[0] in MOVEMENT:
        op, (parent,), arg = ctx
        mask = _unmove(op, arg, parent.shape, value._const_like(True).cast(dt.bool_)
                       .expand(value.shape))
        placed = _unmove(op, arg, parent.shape, value)
        _rebind(parent, where(mask, placed, parent))
        value = parent._move(op, arg)
    old = _snapshot(target)
    _replace(value, target, old)
    target.lazy, target._ctx, target.requires_grad = value.lazy, value._ctx, value.requires_grad


def _snapshot(t: "Tensor") -> "Tensor":
    from anygpu.tensor import Tensor

    old = Tensor(t.lazy)
    old._ctx, old.requires_grad = t._ctx, t.requires_grad
    return old


def _replace(root: "Tensor", target: "Tensor", old: "Tensor") -> None:
    """In the recorded graph behind ``root``, every use of ``target`` becomes a use of ``old``
    (the graph recorded before the write reads the value from before it)."""
    seen: set[int] = set()
    stack = [root]
    while stack:
        t = stack.pop()
        if id(t) in seen or t._ctx is None:
            continue
        seen.add(id(t))
        op, parents, arg = t._ctx
        if any(p is target for p in parents):
            parents = tuple(old if p is target else p for p in parents)
            t._ctx = (op, parents, arg)
        stack.extend(p for p in parents if p is not old)


def _is_basic(i: Any) -> bool:
    return i is None or i is Ellipsis or isinstance(i, (int, np.integer, slice)) and \
        not isinstance(i, (bool, np.bool_))


def setitem(x: "Tensor", index: Any, value: Any) -> None:
    """``x[index] = value``. Basic indices (ints, slices, None, ...) write through the view
    they select; a bool mask over x's leading dimensions with a value that broadcasts over the
    rest selects with ``where`` (no read of the mask); anything else writes the positions the
    index selects (several writes to one element add up, where PyTorch leaves it undefined)."""
    from anygpu.tensor import Tensor, _as_tensor, arange, where, zeros

    key = index if isinstance(index, tuple) else (index,)
    if all(_is_basic(i) for i in key):
        v = _as_tensor(value, x) if not isinstance(value, Tensor) else value
        if not _records(x, v):
            x.realize()
            write(getitem(x, index), v)
            return
        if x.is_leaf and x.requires_grad:
            raise RuntimeError("a leaf Variable that requires grad is being used in an in-place "
                               "operation.")
        # the view's movement ops, taken on a stand-in for x that no reshape folds into, carry
        # the value down to x's shape; x is then re-bound to the merged values
        stand = Tensor(x.lazy.contiguous())
        node = getitem(stand, index).lazy
        v = _prepare(Tensor(node), v)
        mask = Tensor(Lazy.const(True, node.shape, dt.bool_, x.device))
        while node is not stand.lazy:
            src = node.srcs[0]
            v = _unmove(node.op, node.arg, src.shape, v)
            mask = _unmove(node.op, node.arg, src.shape, mask)
            node = src
        write(x, where(mask, v, x))
        return
    if len(key) == 1 and isinstance(key[0], Tensor) and key[0].dtype == dt.bool_ and \
            key[0].ndim <= x.ndim and key[0].shape == x.shape[:key[0].ndim]:
        mask = key[0]
        rest = x.shape[mask.ndim:]
        v = _as_tensor(value, x) if not isinstance(value, Tensor) else value
        if v.ndim <= len(rest):
            try:
                v = _prepare(Tensor(Lazy.const(0, rest, x.dtype, x.device)), v)
            except RuntimeError:
                pass
            else:
                mask = mask.to(x.device).reshape(mask.shape + (1,) * len(rest))
                write(x, where(mask, v, x))
                return
    # the flat positions the index selects, then a one-hot scatter of the values to them
    idx_dtype = dt.int64 if x.numel() >= 2 ** 31 else dt.int32
    positions = getitem(arange(x.numel(), device=x.device, dtype=idx_dtype).reshape(x.shape),
                        index)
    v = _prepare(positions.cast(x.dtype), value)
    flat_pos = positions.reshape(1, -1)
    n = x.numel()
    wide = dt.int32 if x.dtype == dt.bool_ else x.dtype
    hits = scatter_add(zeros(1, n, dtype=dt.int32, device=x.device), 1, flat_pos,
                       flat_pos._const_like(1).cast(dt.int32).expand(flat_pos.shape))
    summed = scatter_add(zeros(1, n, dtype=wide, device=x.device), 1, flat_pos,
                         v.cast(wide).reshape(1, -1))
    write(x, where(hits.gt(0), summed.cast(x.dtype), x.reshape(1, -1)).reshape(x.shape))


def index_copy_(x: "Tensor", dim: int, index: Any, source: "Tensor") -> "Tensor":
    """``x.index_copy_(dim, index, source)``: rows ``index[r]`` of ``x`` along ``dim`` become
    ``source``'s rows ``r``, in place. Where autograd does not record it and ``x`` owns its
    memory, one kernel writes only those rows (a cache taking new entries costs what it
    takes, not its size); indices that a device tensor holds outside the rows write nothing
    there (host indices out of range raise). Otherwise as ``x.copy_(x.index_copy(...))``."""
    from anygpu.graph import schedule as sched

    axis, idx, src = _index_copy_args(x, dim, index, source, "index_copy_")
    if _records(x, src) or x.ndim == 0:
        return write(x, index_copy(x, axis, idx, src))
    x.realize()
    if x.lazy.op is not Op.BUFFER:  # a view: written through the tensor it shows
        return write(x, index_copy(x, axis, idx, src))
    sched.write_rows(x.lazy, axis, idx.lazy, src.lazy)
    return x


# the in-place methods: name_ computes name (or the function given) and writes it back
_SAME_NAME = ["add", "sub", "mul", "div", "pow", "neg", "abs", "sqrt", "rsqrt", "exp", "log",
              "sin", "cos", "tan", "sigmoid", "tanh", "relu", "clamp", "clip", "floor", "ceil",
              "round", "trunc", "sign", "reciprocal", "square", "masked_fill", "fmod",
              "remainder", "floor_divide", "logical_not", "leaky_relu", "erf", "log1p",
              "expm1", "exp2", "log2", "silu", "gelu", "maximum", "minimum", "scatter_add"]


def _fill(t: "Tensor", value: Any) -> "Tensor":
    from anygpu.tensor import Tensor

    if isinstance(value, Tensor) and value.numel() != 1:
        raise RuntimeError(f"fill_ takes a number or a one-element tensor, got shape "
                           f"{value.shape}")
    return value.reshape(()) if isinstance(value, Tensor) else t._const_like(value)


def _lerp(t: "Tensor", end: Any, weight: Any) -> "Tensor":
    return t + (end - t) * weight


def _addcmul(t: "Tensor", a: "Tensor", b: "Tensor", value: Any = 1) -> "Tensor":
    return t + a * b * value


def _addcdiv(t: "Tensor", a: "Tensor", b: "Tensor", value: Any = 1) -> "Tensor":
    return t + a / b * value


def _uniform(t: "Tensor", a: float = 0.0, b: float = 1.0, generator: Any = None) -> "Tensor":
    from anygpu.tensor import rand

    return rand(*t.shape, device=t.device, generator=generator) * (b - a) + a


def _normal(t: "Tensor", mean: float = 0.0, std: float = 1.0, generator: Any = None
            ) -> "Tensor":
    from anygpu.tensor import randn

    return randn(*t.shape, device=t.device, generator=generator) * std + mean


def _bernoulli(t: "Tensor", p: Any = 0.5, generator: Any = None) -> "Tensor":
    from anygpu.tensor import rand

    return (rand(*t.shape, device=t.device, generator=generator) < p).cast(t.dtype)


_OWN: dict[str, Callable[..., "Tensor"]] = {
    "fill": _fill,
    "zero": lambda t: t._const_like(0),
    "copy": lambda t, src, non_blocking=False: src,
    "clamp_min": lambda t, m: t.clamp(min=m),
    "clamp_max": lambda t, m: t.clamp(max=m),
    "lerp": _lerp,
    "addcmul": _addcmul,
    "addcdiv": _addcdiv,
    "uniform": _uniform,
    "normal": _normal,
    "bernoulli": _bernoulli,
    "scatter": scatter,
    "scatter_reduce": scatter_reduce,
}


def _method(name: str, compute: Callable[..., "Tensor"]) -> Callable[..., "Tensor"]:
    def method(self: "Tensor", *args: Any, **kwargs: Any) -> "Tensor":
        return write(self, compute(self, *args, **kwargs))

    method.__name__ = name + "_"
    method.__doc__ = f"In place: this tensor becomes ``{name}`` of itself (see ops/inplace.py)."
    return method


def methods() -> dict[str, Callable[..., "Tensor"]]:
    """The in-place methods by name (``add_``, ...), and the augmented assignments (``__iadd__``,
    ...), for ``Tensor``."""
    from anygpu.tensor import Tensor

    out = {n + "_": _method(n, getattr(Tensor, n)) for n in _SAME_NAME if hasattr(Tensor, n)}
    out.update({n + "_": _method(n, f) for n, f in _OWN.items()})
    out["index_copy_"] = index_copy_
    for op, name in [("add", "__iadd__"), ("sub", "__isub__"), ("mul", "__imul__"),
                     ("div", "__itruediv__"), ("floor_divide", "__ifloordiv__"),
                     ("remainder", "__imod__"), ("pow", "__ipow__"),
                     ("__and__", "__iand__"), ("__or__", "__ior__"), ("__xor__", "__ixor__"),
                     ("__lshift__", "__ilshift__"), ("__rshift__", "__irshift__")]:
        out[name] = _method(op, getattr(Tensor, op))
    return out


__all__ = ["write", "setitem", "methods"]
