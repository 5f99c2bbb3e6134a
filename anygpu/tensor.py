"""Tensor: a lazy n-dimensional array with a PyTorch-like API.

Operations build a graph; nothing runs until a value is needed (``numpy()``, ``item()``, printing)
or ``realize()`` is called. Then the graph is fused into kernels and run on the tensor's device.

>>> import anygpu as ag
>>> x = ag.tensor([[1.0, 2.0], [3.0, 4.0]])
>>> ((x * 2 + 1).relu().sum(1)).numpy().tolist()
[8.0, 16.0]
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Sequence, Union

import numpy as np

from anygpu import amp
from anygpu import dtype as dt
from anygpu.dtype import DType
from anygpu.graph import schedule as sched
from anygpu.graph.lazy import Lazy, contiguous_run
from anygpu.ops.grad import is_grad_enabled, no_grad
from anygpu.ops.primitives import Op
from anygpu.runtime.registry import canonical, get_device, is_device_name

Scalar = Union[int, float, bool]
TensorLike = Union["Tensor", Scalar, Sequence[Any], np.ndarray]
ShapeLike = Union[int, Sequence[int]]

LOG2_E = 1.4426950408889634
LN_2 = 0.6931471805599453


def _shape_arg(shape: tuple[Any, ...]) -> tuple[int, ...]:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        return tuple(int(s) for s in shape[0])
    return tuple(int(s) for s in shape)


def _axis(axis: int, ndim: int) -> int:
    if not -max(ndim, 1) <= axis < max(ndim, 1):
        raise IndexError(f"dimension {axis} out of range for a tensor of {ndim} dimensions")
    return axis % max(ndim, 1)


def _host_array(data: Any, dtype: DType | None) -> tuple[np.ndarray, DType]:
    if isinstance(data, Tensor):
        data = data.numpy()
    if hasattr(data, "detach") and hasattr(data, "cpu"):  # a torch.Tensor
        data = data.detach().cpu()
        if str(data.dtype) == "torch.bfloat16":
            arr = data.float().numpy()
            return arr, dtype or dt.bfloat16
        data = data.numpy()
    try:
        arr = np.asarray(data)
    except ValueError as err:  # NumPy >= 1.24 refuses ragged nesting
        raise ValueError(f"cannot make a tensor from ragged data: {err}") from err
    if arr.dtype == object:
        raise TypeError("cannot make a tensor from non-numeric data")
    if dtype is None:
        if arr.dtype == np.float64 and not isinstance(data, np.ndarray):
            dtype = dt.float32  # Python floats take the default float dtype, as in PyTorch
        elif arr.dtype.kind == "i" and not isinstance(data, np.ndarray):
            dtype = dt.int64
        else:
            dtype = dt.from_numpy(arr.dtype)
    return arr, dtype


_new_tensor = object.__new__


def _leaf(lazy: Lazy) -> "Tensor":
    """``Tensor(lazy)`` without its checks: a tensor that needs no gradient."""
    out = _new_tensor(Tensor)
    out.lazy, out.requires_grad, out.grad, out._ctx = lazy, False, None, None
    return out


class Tensor:
    """A lazy array on a device. ``Tensor(data, device=None, dtype=None, requires_grad=False)``."""

    __slots__ = ("lazy", "requires_grad", "grad", "_ctx", "__weakref__")
    __array_priority__ = 1000  # numpy scalars on the left defer to Tensor's operators

    if TYPE_CHECKING:  # the in-place methods, installed from ops/inplace.py below the class
        add_: Callable[..., "Tensor"]
        sub_: Callable[..., "Tensor"]
        mul_: Callable[..., "Tensor"]
        div_: Callable[..., "Tensor"]
        pow_: Callable[..., "Tensor"]
        clamp_: Callable[..., "Tensor"]
        clip_: Callable[..., "Tensor"]
        copy_: Callable[..., "Tensor"]
        fill_: Callable[..., "Tensor"]
        zero_: Callable[..., "Tensor"]
        masked_fill_: Callable[..., "Tensor"]
        uniform_: Callable[..., "Tensor"]
        normal_: Callable[..., "Tensor"]
        __iadd__: Callable[..., "Tensor"]
        __isub__: Callable[..., "Tensor"]
        __imul__: Callable[..., "Tensor"]
        __itruediv__: Callable[..., "Tensor"]

    def __init__(self, data: Any, device: str | None = None, dtype: Any = None,
                 requires_grad: bool = False):
        if isinstance(data, Lazy):
            self.lazy = data
        else:
            want = None if dtype is None else dt.to_dtype(dtype)
            arr, d = _host_array(data, want)
            self.lazy = _upload(arr, d, canonical(device))
        self.requires_grad = False
        self.grad: Tensor | None = None
        self._ctx: Any = None
        if requires_grad:
            self.requires_grad_(True)

    # ---- properties ------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self.lazy.shape

    @property
    def dtype(self) -> DType:
        return self.lazy.dtype

    @property
    def device(self) -> str:
        return self.lazy.device

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return self.ndim

    def numel(self) -> int:
        return self.lazy.numel

    def size(self, axis: int | None = None) -> Any:
        return self.shape if axis is None else self.shape[_axis(axis, self.ndim)]

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def is_floating_point(self) -> bool:
        return self.dtype.is_float

    # ---- realizing and reading -------------------------------------------------------------------
    def realize(self) -> "Tensor":
        """Run the kernels that compute this tensor (queued; returns without waiting)."""
        sched.realize(self.lazy)
        return self

    def numpy(self) -> np.ndarray:
        """The values as a NumPy array (waits for the device). bfloat16 reads as float32."""
        self.realize()
        return sched.read_buffer(self.lazy)

    def tolist(self) -> Any:
        return self.numpy().tolist()

    def item(self) -> Scalar:
        if self.numel() != 1:
            raise ValueError(f"item() needs exactly one element, this tensor has {self.numel()}")
        return self.numpy().reshape(-1)[0].item()

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def __bool__(self) -> bool:
        return bool(self.item())

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        arr = self.numpy()
        return arr if dtype is None else arr.astype(dtype)

    def __repr__(self) -> str:
        body = np.array2string(self.numpy(), separator=", ", precision=4)
        extra = f", device='{self.device}'" if not self.device.startswith("cpu") else ""
        if self.dtype not in (dt.float32, dt.int64, dt.bool_):
            extra += f", dtype={self.dtype!r}"
        if self.requires_grad:
            extra += ", requires_grad=True"
        return f"tensor({body}{extra})"

    def to(self, *args: Any, **kwargs: Any) -> "Tensor":
        """``to(device)``, ``to(dtype)``, ``to(device, dtype)`` or ``to(other)`` (PyTorch's
        forms; the device a string or an ``anygpu.device``). ``non_blocking`` and ``copy`` are
        accepted and ignored: the copy is lazy and runs with the graph that needs it."""
        device, dtype = parse_to(args, kwargs)
        out = self
        if dtype is not None:
            out = out.cast(dtype)
        if device is not None and canonical(device) != self.device:
            out = Tensor._make(out.lazy.copy_to(canonical(device)), (out,), "copy")
        return out

    def cpu(self) -> "Tensor":
        return self.to("cpu")

    def cuda(self) -> "Tensor":
        return self.to("cuda")

    def contiguous(self) -> "Tensor":
        return Tensor._make(self.lazy.contiguous(), (self,), "contiguous")

    def detach(self) -> "Tensor":
        return Tensor(self.lazy)

    def clone(self) -> "Tensor":
        return self.contiguous()

    def __deepcopy__(self, memo: dict) -> "Tensor":
        """A copy in memory of its own, of the same class (``copy.deepcopy`` of a model copies
        its parameters); only a leaf tensor may be copied, as in PyTorch."""
        if self._ctx is not None:
            raise RuntimeError("only tensors created explicitly (graph leaves) support "
                               "deepcopy; detach() it first")
        data = Tensor(self.lazy.contiguous()).realize()
        out = type(self).__new__(type(self))
        Tensor.__init__(out, data.lazy, requires_grad=self.requires_grad)
        memo[id(self)] = out
        if self.grad is not None:
            out.grad = self.grad.__deepcopy__(memo)
        return out

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        """Pickling by value (``anygpu.save``, ``pickle``): dtype, shape, host bytes, device
        and ``requires_grad``; see ``anygpu/serialization.py``."""
        from anygpu import serialization  # it imports this module
        return serialization.reduce_tensor(self, int(protocol))

    # ---- the one place graph nodes are made ------------------------------------------------------
    @staticmethod
    def _make(lazy: Lazy, parents: tuple["Tensor", ...], op: Any, arg: Any = None) -> "Tensor":
        out = _new_tensor(Tensor)  # Tensor(lazy) without its checks: the hottest constructor
        out.lazy, out.requires_grad, out.grad, out._ctx = lazy, False, None, None
        if lazy.dtype.is_float and is_grad_enabled():
            for p in parents:
                if p.requires_grad:
                    out.requires_grad = True
                    out._ctx = (op, parents, arg)
                    break
        return out

    def _alu(self, op: Op, *others: "Tensor", arg: Any = None) -> "Tensor":
        return Tensor._make(self.lazy.alu(op, *(o.lazy for o in others), arg=arg),
                            (self, *others), op, arg)

    def _move(self, op: Op, arg: Any) -> "Tensor":
        lazy = self.lazy.movement(op, arg)
        return self if lazy is self.lazy else Tensor._make(lazy, (self,), op, tuple(arg))

    def _custom(self, name: str, others: tuple["Tensor", ...], arg: Any,
                compute: Any) -> "Tensor":
        """A composite whose gradient is its own rule (``ops/grad.py`` RULES[name]) rather than
        the chain of its primitives' (which is NaN or wrong at kinks and extremes)."""
        with no_grad():
            out = compute()
        return Tensor._make(out.lazy, (self, *others), name, arg)

    def _reduce(self, op: Op, axes: Sequence[int]) -> "Tensor":
        return Tensor._make(self.lazy.reduce(op, axes), (self,), op, tuple(sorted(set(axes))))

    # ---- dtype -----------------------------------------------------------------------------------
    def cast(self, dtype: Any) -> "Tensor":
        d = dt.to_dtype(dtype)
        if d == self.dtype:
            return self
        get_device(self.device).check_dtype(d)  # here, not when some later kernel compiles
        return self._alu(Op.CAST, arg=d)

    def type(self, dtype: Any) -> "Tensor":
        return self.cast(dtype)

    # ---- broadcasting ----------------------------------------------------------------------------
    def _const_like(self, value: Scalar, dtype: DType | None = None,
                    shape: tuple[int, ...] | None = None) -> "Tensor":
        return _leaf(Lazy.const(value, self.lazy.shape if shape is None else shape,
                                dtype or self.lazy.dtype, self.lazy.device))

    def _operands(self, other: TensorLike, reverse: bool = False,
                  out_dtype: DType | None = None) -> tuple["Tensor", "Tensor"]:
        if isinstance(other, Tensor) and out_dtype is None:
            mine, theirs = self.lazy, other.lazy
            if mine.dtype is theirs.dtype and mine.shape == theirs.shape and \
                    mine.device == theirs.device:
                return (other, self) if reverse else (self, other)  # nothing to promote
        if isinstance(other, Tensor):
            d = dt.promote_tensors(self.dtype, self.ndim == 0, other.dtype, other.ndim == 0)
            if other.device != self.device:
                raise ValueError(f"operands are on different devices: {self.device} and "
                                 f"{other.device}; move one with .to()")
            a, b = self.cast(out_dtype or d), other.cast(out_dtype or d)
        elif isinstance(other, (int, float, bool, np.number, np.bool_)):
            d = out_dtype or dt.scalar_dtype(other, self.dtype)
            if d.is_int and isinstance(other, (int, np.integer)) and not isinstance(other, bool):
                other = dt.wrap_int(int(other), d)  # an integer scalar wraps, as in PyTorch
            a = self if d is self.lazy.dtype else self.cast(d)
            # made in the broadcast shape at once (a constant's views fold to a constant)
            b = _leaf(Lazy.const(other, a.lazy.shape, d, a.lazy.device))
            return (b, a) if reverse else (a, b)
        else:
            return self._operands(Tensor(other, device=self.device), reverse, out_dtype)
        a, b = _broadcast(a, b)
        return (b, a) if reverse else (a, b)

    # ---- arithmetic ------------------------------------------------------------------------------
    def add(self, other: TensorLike, alpha: Scalar = 1) -> "Tensor":
        if alpha != 1:
            other = _as_tensor(other, self) * alpha
        a, b = self._operands(other)
        if a.dtype == dt.bool_:
            return a._alu(Op.OR, b)
        return a._alu(Op.ADD, b)

    def sub(self, other: TensorLike, alpha: Scalar = 1) -> "Tensor":
        if self.dtype == dt.bool_ or isinstance(other, (bool, np.bool_)) or (
                isinstance(other, Tensor) and other.dtype == dt.bool_):
            raise TypeError("subtraction with a bool operand is not supported (as in PyTorch); "
                            "use logical_xor or ~ to invert a mask")
        a, b = self._operands(other)
        return a._alu(Op.ADD, b.neg() if alpha == 1 else b * (-alpha))

    def mul(self, other: TensorLike) -> "Tensor":
        a, b = self._operands(other)
        if a.dtype == dt.bool_:
            return a._alu(Op.AND, b)
        return a._alu(Op.MUL, b)

    def div(self, other: TensorLike, rounding_mode: str | None = None) -> "Tensor":
        if rounding_mode == "floor":
            return self.floor_divide(other)
        if rounding_mode == "trunc":
            self._check_int_divisor(other)
            a, b = self._operands(other)
            _refuse_bool(a, "div(rounding_mode='trunc')")
            if not a.dtype.is_float:
                return a._alu(Op.IDIV, b)
            return a._custom("step", (b,), None, lambda: (a / b).trunc())
        if not self.dtype.is_float and not (isinstance(other, Tensor) and other.dtype.is_float):
            # integers divide as floats, each operand converted from its own dtype
            other = other.float() if isinstance(other, Tensor) else other
            return self.float().div(other)
        a, b = self._operands(other)
        return a._alu(Op.DIV, b)

    def neg(self) -> "Tensor":
        if self.dtype == dt.bool_:
            raise TypeError("negation of a bool tensor is not supported; use logical_not")
        return self._alu(Op.NEG)

    def _check_int_divisor(self, other: TensorLike) -> None:
        if not self.dtype.is_float and isinstance(other, (int, np.integer)) and not isinstance(
                other, bool) and other == 0:
            raise ZeroDivisionError("integer division by zero")

    def floor_divide(self, other: TensorLike) -> "Tensor":
        self._check_int_divisor(other)
        a, b = self._operands(other)
        _refuse_bool(a, "floor_divide")
        if a.dtype.is_float:
            def compute() -> "Tensor":
                # PyTorch's div_floor: from the exact remainder, so 1.0 // 0.1 is 9 as in Python
                mod = a._alu(Op.MOD, b)
                div = (a - mod) / b
                div = div - (mod.ne(0).logical_and(b.lt(0).logical_xor(mod.lt(0)))).cast(a.dtype)
                floor = div.floor()
                floor = floor + (div - floor).gt(0.5).cast(a.dtype)
                out = div.ne(0)._select(floor, (a / b) * 0)  # a zero keeps the quotient's sign
                return b.eq(0)._select(a / b, out)
            return a._custom("step", (b,), None, compute)  # piecewise constant: gradient 0
        q = a._alu(Op.IDIV, b)
        r = a._alu(Op.MOD, b)
        fix = (r != 0).logical_and((r < 0).logical_xor(b < 0))
        return q - fix.cast(q.dtype)

    def remainder(self, other: TensorLike) -> "Tensor":
        self._check_int_divisor(other)
        a, b = self._operands(other)
        _refuse_bool(a, "remainder")
        r = a._alu(Op.MOD, b)
        if a.dtype.is_float:
            fix = r.ne(0).logical_and(b.lt(0).logical_xor(r.lt(0)))
            return fix._select(r + b, r)
        fix = (r != 0).logical_and((r < 0).logical_xor(b < 0))
        return r + fix.cast(r.dtype) * b

    def fmod(self, other: TensorLike) -> "Tensor":
        self._check_int_divisor(other)
        a, b = self._operands(other)
        _refuse_bool(a, "fmod")
        return a._alu(Op.MOD, b)

    def pow(self, exponent: TensorLike) -> "Tensor":
        if not self.dtype.is_float and isinstance(exponent, (int, np.integer)) and exponent < 0:
            raise ValueError("integers to negative integer powers are not allowed")
        _check_scalar_fits(exponent, self.dtype, half=True)
        if self.dtype == dt.bool_ and (isinstance(exponent, (bool, np.bool_)) or (
                isinstance(exponent, Tensor) and exponent.dtype == dt.bool_)):
            a, b = self._operands(exponent)
            return b.logical_not().logical_or(a)  # x ** False is True, x ** True is x
        a, b = self._operands(exponent)
        scalar = isinstance(exponent, (int, float, np.number)) and not isinstance(exponent, bool)
        if a.dtype == dt.bool_:
            a, b = a.cast(dt.int64), b.cast(dt.int64)
        if not a.dtype.is_float:
            if scalar and exponent < 0:  # type: ignore[operator]
                raise ValueError("integers to negative integer powers are not allowed")
            return _int_pow(a, b, int(exponent) if scalar else None)  # type: ignore[arg-type]
        if scalar and float(exponent) in (0.0, 1.0, 2.0, 3.0):  # type: ignore[arg-type]
            n = int(exponent)  # type: ignore[arg-type]
            # products, whose gradient PyTorch's pow has too: exact, and finite at zero
            if n < 2:
                return a * 0 + 1 if n == 0 else a * 1
            # the gradient as PyTorch's pow computes it, g * (n * a ** (n - 1)) (through the
            # products' own rules, g * a + g * a, it stayed finite where PyTorch's overflows)
            return a._custom("pow_small", (), n, lambda: a * a if n == 2 else a * a * a)
        if scalar and float(exponent) == 0.5:  # type: ignore[arg-type]
            return a.sqrt()
        return a._custom("pow", (b,), None, lambda: _float_pow(a, b))

    def __add__(self, o: TensorLike) -> "Tensor":
        return self.add(o)

    def __radd__(self, o: TensorLike) -> "Tensor":
        a, b = self._operands(o, reverse=True)
        return a.add(b)

    def __sub__(self, o: TensorLike) -> "Tensor":
        return self.sub(o)

    def __rsub__(self, o: TensorLike) -> "Tensor":
        if self.dtype == dt.bool_ or isinstance(o, (bool, np.bool_)):
            return self.sub(o)  # raises, as PyTorch does
        a, b = self._operands(o, reverse=True)
        return a.sub(b)

    def __mul__(self, o: TensorLike) -> "Tensor":
        return self.mul(o)

    def __rmul__(self, o: TensorLike) -> "Tensor":
        return self.mul(o)

    def __truediv__(self, o: TensorLike) -> "Tensor":
        return self.div(o)

    def __rtruediv__(self, o: TensorLike) -> "Tensor":
        a, b = self._operands(o, reverse=True)
        return a.div(b)

    def __floordiv__(self, o: TensorLike) -> "Tensor":
        return self.floor_divide(o)

    def __rfloordiv__(self, o: TensorLike) -> "Tensor":
        a, b = self._operands(o, reverse=True)
        return a.floor_divide(b)

    def __mod__(self, o: TensorLike) -> "Tensor":
        return self.remainder(o)

    def __rmod__(self, o: TensorLike) -> "Tensor":
        a, b = self._operands(o, reverse=True)
        return a.remainder(b)

    def __pow__(self, o: TensorLike) -> "Tensor":
        return self.pow(o)

    def __rpow__(self, o: TensorLike) -> "Tensor":
        a, b = self._operands(o, reverse=True)
        return a.pow(b)

    def __neg__(self) -> "Tensor":
        return self.neg()

    def __pos__(self) -> "Tensor":
        return self

    def __abs__(self) -> "Tensor":
        return self.abs()

    def __matmul__(self, o: "Tensor") -> "Tensor":
        return self.matmul(o)

    def __rmatmul__(self, o: "Tensor") -> "Tensor":
        return _as_tensor(o, self).matmul(self)

    # ---- comparisons and logic -------------------------------------------------------------------
    def lt(self, o: TensorLike) -> "Tensor":
        a, b = self._operands(o)
        return a._alu(Op.CMPLT, b)

    def gt(self, o: TensorLike) -> "Tensor":
        a, b = self._operands(o)
        return b._alu(Op.CMPLT, a)

    def eq(self, o: TensorLike) -> "Tensor":
        a, b = self._operands(o)
        return a._alu(Op.CMPEQ, b)

    def ne(self, o: TensorLike) -> "Tensor":
        return self.eq(o).logical_not()

    def le(self, o: TensorLike) -> "Tensor":
        return self.lt(o).logical_or(self.eq(o))

    def ge(self, o: TensorLike) -> "Tensor":
        return self.gt(o).logical_or(self.eq(o))

    __lt__, __gt__, __le__, __ge__ = lt, gt, le, ge

    def __eq__(self, o: TensorLike) -> "Tensor":  # type: ignore[override]
        return self.eq(o)

    def __ne__(self, o: TensorLike) -> "Tensor":  # type: ignore[override]
        return self.ne(o)

    __hash__ = object.__hash__

    def logical_not(self) -> "Tensor":
        return self.bool()._alu(Op.NOT)

    def logical_and(self, o: TensorLike) -> "Tensor":
        a, b = self._operands(o, out_dtype=dt.bool_)
        return a._alu(Op.AND, b)

    def logical_or(self, o: TensorLike) -> "Tensor":
        a, b = self._operands(o, out_dtype=dt.bool_)
        return a._alu(Op.OR, b)

    def logical_xor(self, o: TensorLike) -> "Tensor":
        a, b = self._operands(o, out_dtype=dt.bool_)
        return a._alu(Op.XOR, b)

    def _bitwise(self, o: TensorLike, op: Op) -> "Tensor":
        a, b = self._operands(o)
        if a.dtype.is_float:
            raise TypeError(f"bitwise {op.value} needs integer or bool tensors, got {a.dtype.name}")
        if op in (Op.SHL, Op.SHR):
            _refuse_bool(a, "shift")
        return a._alu(op, b)

    def __and__(self, o: TensorLike) -> "Tensor":
        return self._bitwise(o, Op.AND)

    def __or__(self, o: TensorLike) -> "Tensor":
        return self._bitwise(o, Op.OR)

    def __xor__(self, o: TensorLike) -> "Tensor":
        return self._bitwise(o, Op.XOR)

    __rand__, __ror__, __rxor__ = __and__, __or__, __xor__

    def __invert__(self) -> "Tensor":
        if self.dtype == dt.bool_:
            return self.logical_not()
        if self.dtype.is_float:
            raise TypeError("~ needs an integer or bool tensor")
        return self._alu(Op.XOR, self._const_like(-1 if not self.dtype.is_unsigned else 255))

    def __lshift__(self, o: TensorLike) -> "Tensor":
        return self._bitwise(o, Op.SHL)

    def __rshift__(self, o: TensorLike) -> "Tensor":
        return self._bitwise(o, Op.SHR)

    def __rlshift__(self, o: TensorLike) -> "Tensor":
        a, b = self._operands(o, reverse=True)
        return a._bitwise(b, Op.SHL)

    def __rrshift__(self, o: TensorLike) -> "Tensor":
        a, b = self._operands(o, reverse=True)
        return a._bitwise(b, Op.SHR)

    def where(self, condition: TensorLike, other: TensorLike) -> "Tensor":
        """PyTorch's ``x.where(cond, y)``: x where cond is true, else y."""
        return where(condition, self, other)

    def _select(self, a: TensorLike, b: TensorLike) -> "Tensor":
        """``where(self, a, b)`` for a condition tensor ``self``."""
        return where(self, a, b)

    def maximum(self, o: TensorLike) -> "Tensor":
        a, b = self._operands(o)
        if a.dtype == dt.bool_:
            return a.logical_or(b)
        return a._alu(Op.MAX, b)

    def minimum(self, o: TensorLike) -> "Tensor":
        a, b = self._operands(o)
        if a.dtype == dt.bool_:
            return a.logical_and(b)
        if a.dtype.is_float:  # through max, which propagates NaN as PyTorch does
            return a.neg()._alu(Op.MAX, b.neg()).neg()
        return b.lt(a)._select(b, a)

    def clip(self, min: TensorLike | None = None, max: TensorLike | None = None) -> "Tensor":
        """Clamp into [min, max]; the gradient passes where min <= x <= max (the bounds
        included, as in PyTorch)."""
        if min is None and max is None:
            raise ValueError("clip needs min or max")
        if self.dtype.is_int:  # PyTorch casts an integer bound to the tensor's dtype first
            min, max = (dt.wrap_int(b, self.dtype) if isinstance(b, int) and not isinstance(b, bool)
                        else b for b in (min, max))
        bounds = tuple(b for b in (min, max) if isinstance(b, Tensor))

        def compute() -> "Tensor":
            out = self
            if min is not None:
                out = out.maximum(min)
            if max is not None:
                out = out.minimum(max)
            return out
        return self._custom("clamp", bounds, (min, max), compute)

    clamp = clip

    def isnan(self) -> "Tensor":
        return self.ne(self)

    def isinf(self) -> "Tensor":
        return self.abs().eq(float("inf")) if self.dtype.is_float else self._const_like(False,
                                                                                      dt.bool_)

    def isfinite(self) -> "Tensor":
        if not self.dtype.is_float:
            return self._const_like(True, dt.bool_)
        return self.abs().lt(float("inf"))  # false for inf and for NaN (NaN < inf is false)

    # ---- unary math ------------------------------------------------------------------------------
    def _float(self) -> "Tensor":
        return self if self.dtype.is_float else self.float()

    def exp2(self) -> "Tensor":
        return self._float()._alu(Op.EXP2)

    def log2(self) -> "Tensor":
        return self._float()._alu(Op.LOG2)

    def exp(self) -> "Tensor":
        return (self._float() * LOG2_E).exp2()

    def log(self) -> "Tensor":
        return self.log2() * LN_2

    def log1p(self) -> "Tensor":
        """log(1 + x), accurate for tiny x: log(u) * x / (u - 1) with u = 1 + x rounded (the
        rounding error of u cancels; Goldberg, 1991), and below 2^-7 in magnitude the series to
        x^5 (error under x^6 / 6): WGSL's log2 is only bounded to 2^-21 absolutely near 1, which
        left softplus(-10) 0.2% off on WebGPU."""
        x = self._float()

        def compute() -> "Tensor":
            u = x + 1
            wide = u.eq(1)._select(x, u.eq(float("inf"))._select(u, u.log() * (x / (u - 1))))
            series = x * (1 + x * (-0.5 + x * (1 / 3 + x * (-0.25 + x * 0.2))))
            return x.abs().lt(1 / 128)._select(series, wide)
        return x._custom("log1p", (), None, compute)

    def expm1(self) -> "Tensor":
        """exp(x) - 1, accurate for tiny x: (u - 1) * x / log(u) with u = exp(x) (Kahan)."""
        x = self._float()

        def compute() -> "Tensor":
            u = x.exp()
            um1 = u - 1
            exact = um1.eq(-1).logical_or(u.eq(float("inf")))
            return u.eq(1)._select(x, exact._select(um1, um1 * (x / u.log())))
        return x._custom("expm1", (), None, compute)

    def sqrt(self) -> "Tensor":
        return self._float()._alu(Op.SQRT)

    def rsqrt(self) -> "Tensor":
        return self.sqrt().reciprocal()

    def reciprocal(self) -> "Tensor":
        return self._float()._alu(Op.RECIP)

    def sin(self) -> "Tensor":
        return self._float()._alu(Op.SIN)

    def cos(self) -> "Tensor":
        """1 - 2 sin(x/2)^2: halving is exact, so huge arguments keep their accuracy (sin(pi/2 -
        x) would round x first)."""
        s = (self._float() * 0.5).sin()
        return 1 - 2 * s * s

    def tan(self) -> "Tensor":
        return self.sin() / self.cos()

    def square(self) -> "Tensor":
        return self.pow(2)

    def abs(self) -> "Tensor":
        if self.dtype == dt.bool_ or self.dtype.is_unsigned:
            return self
        return self._custom("abs", (), None, lambda: self.lt(0)._select(-self, self))

    def sign(self) -> "Tensor":
        if self.dtype == dt.bool_:
            return self
        if not self.dtype.is_float:
            return self.gt(0).cast(self.dtype) - self.lt(0).cast(self.dtype)
        # sign(NaN) is 0; the gradient is zero, but the result stays in the graph (PyTorch's)
        return self._custom("sign", (), None,
                            lambda: self.gt(0).cast(self.dtype) - self.lt(0).cast(self.dtype))

    def trunc(self) -> "Tensor":
        return self._alu(Op.TRUNC) if self.dtype.is_float else self

    def floor(self) -> "Tensor":
        if not self.dtype.is_float:
            return self
        t = self.trunc()
        return t - self.lt(t).cast(self.dtype)

    def ceil(self) -> "Tensor":
        if not self.dtype.is_float:
            return self
        t = self.trunc()
        return t + self.gt(t).cast(self.dtype)

    def round(self) -> "Tensor":
        """Round half to even, as PyTorch."""
        if not self.dtype.is_float:
            return self
        f = self.floor()
        diff = self - f
        f_even = f.remainder(2).eq(0)
        up = diff.gt(0.5).logical_or(diff.eq(0.5).logical_and(f_even.logical_not()))
        return f + up.cast(self.dtype)

    def sigmoid(self) -> "Tensor":
        x = self._float()
        return x._custom("sigmoid", (), None, lambda: (1 + (-x).exp()).reciprocal())

    def tanh(self) -> "Tensor":
        """sign(x) * (1 - e) / (1 + e) with e = exp(-2|x|), through expm1 so that tiny x keep
        their precision: tanh(|x|) = -expm1(-2|x|) / (2 + expm1(-2|x|))."""
        x = self._float()

        def compute() -> "Tensor":
            m = (x.abs() * -2).expm1()
            t = -m / (m + 2)
            return x.lt(0)._select(-t, t)
        return x._custom("tanh", (), None, compute)

    def relu(self) -> "Tensor":
        # NaN stays NaN, as in PyTorch. The gradient reads the output, as PyTorch's does: the
        # next layer stores it anyway, while the input (a convolution's result fused into this
        # kernel) would have to be kept for the backward pass or computed again
        return self._custom("relu", (), None,
                            lambda: self.le(0)._select(self._const_like(0), self))

    def leaky_relu(self, negative_slope: float = 0.01) -> "Tensor":
        return self.gt(0)._select(self, self * negative_slope)

    def silu(self) -> "Tensor":
        return self * self.sigmoid()

    def erf(self) -> "Tensor":
        """Chebyshev fit of erfc (Numerical Recipes' erfcc): relative error below 1.2e-7."""
        x = self._float()

        def compute() -> "Tensor":
            z = x.abs()
            t = (1 + 0.5 * z).reciprocal()
            coeffs = [-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807,
                      -1.13520398, 1.48851587, -0.82215223, 0.17087277]
            poly = t * 0 + coeffs[-1]
            for c in reversed(coeffs[:-1]):
                poly = poly * t + c
            out = 1 - t * (-z * z + poly).exp()
            return x.lt(0)._select(-out, out)
        return x._custom("erf", (), None, compute)

    def gelu(self, approximate: str = "none") -> "Tensor":
        x = self._float()
        if approximate == "tanh":
            return 0.5 * x * (1 + (0.7978845608028654 * (x + 0.044715 * x * x * x)).tanh())
        return 0.5 * x * (1 + (x * 0.7071067811865476).erf())

    def softplus(self, beta: float = 1.0, threshold: float = 20.0) -> "Tensor":
        """log(1 + exp(beta * x)) / beta, and x itself where beta * x > threshold (PyTorch's)."""
        x = self._float()
        bx = x * beta
        return bx.gt(threshold)._select(x, (bx.maximum(0) + (-bx.abs()).exp().log1p()) / beta)

    # ---- reductions ------------------------------------------------------------------------------
    def _axes(self, axis: ShapeLike | None) -> tuple[int, ...]:
        if axis is None:
            return tuple(range(self.ndim))
        if isinstance(axis, int):
            return (_axis(axis, self.ndim),) if self.ndim else ()
        return tuple(sorted({_axis(a, self.ndim) for a in axis}))

    def _finish(self, out: "Tensor", axes: tuple[int, ...], keepdim: bool) -> "Tensor":
        if keepdim:
            return out
        return out.reshape(tuple(n for i, n in enumerate(out.shape) if i not in axes))

    def sum(self, axis: ShapeLike | None = None, keepdim: bool = False, dtype: Any = None,
            dim: ShapeLike | None = None) -> "Tensor":
        axis = dim if dim is not None else axis
        axes = self._axes(axis)
        x = self
        if dtype is not None:
            x = x.cast(dtype)
        elif x.dtype.is_int or x.dtype.is_bool:
            x = x.cast(dt.int64)  # PyTorch sums integers and bools into int64
        return x._finish(x._reduce(Op.SUM, axes), axes, keepdim)

    def prod(self, axis: int | None = None, keepdim: bool = False, dtype: Any = None,
             dim: int | None = None) -> "Tensor":
        axis = dim if dim is not None else axis
        axes = self._axes(axis)
        x = self.cast(dtype) if dtype is not None else (
            self.cast(dt.int64) if not self.dtype.is_float else self)
        return x._finish(x._reduce(Op.PROD, axes), axes, keepdim)

    def _max(self, axis: ShapeLike | None, keepdim: bool) -> "Tensor":
        axes = self._axes(axis)
        x = self.cast(dt.uint8) if self.dtype == dt.bool_ else self
        out = x._finish(x._reduce(Op.RMAX, axes), axes, keepdim)
        return out.bool() if self.dtype == dt.bool_ else out

    def max(self, axis: Any = None, keepdim: bool = False, dim: int | None = None) -> Any:
        """Without an axis: the maximum. With one: (values, indices), as in PyTorch."""
        axis = dim if dim is not None else axis
        if isinstance(axis, Tensor):
            return self.maximum(axis)
        self._check_not_empty(axis, "max")
        if axis is None:
            return self._max(None, False)
        return MinMax(self._max_first(axis, keepdim), self.argmax(axis, keepdim))

    def min(self, axis: Any = None, keepdim: bool = False, dim: int | None = None) -> Any:
        axis = dim if dim is not None else axis
        if isinstance(axis, Tensor):
            return self.minimum(axis)
        self._check_not_empty(axis, "min")
        if axis is None:
            return self._neg_for_min()._max(None, False)._neg_for_min()
        values = self._neg_for_min()._max_first(axis, keepdim)._neg_for_min()
        return MinMax(values, self.argmin(axis, keepdim))

    def _max_first(self, axis: int, keepdim: bool) -> "Tensor":
        """The maximum along one axis whose gradient goes to the first maximum (the index that
        argmax returns), as ``torch.max(x, dim)``; ``amax`` splits it among ties."""
        if self.ndim == 0:
            _axis(axis, 0)
            return self * 1
        ax = _axis(axis, self.ndim)
        if not self.dtype.is_float:
            return self._max(ax, keepdim)
        out = self._custom("max_first", (), ax, lambda: self._max(ax, keepdim=True))
        return self._finish(out, (ax,), keepdim)

    def amax(self, axis: ShapeLike | None = None, keepdim: bool = False,
             dim: ShapeLike | None = None) -> "Tensor":
        axis = dim if dim is not None else axis
        self._check_not_empty(axis, "amax")
        return self._max(axis, keepdim)

    def amin(self, axis: ShapeLike | None = None, keepdim: bool = False,
             dim: ShapeLike | None = None) -> "Tensor":
        axis = dim if dim is not None else axis
        self._check_not_empty(axis, "amin")
        return self._neg_for_min()._max(axis, keepdim)._neg_for_min()

    def _check_not_empty(self, axis: Any, name: str) -> None:
        """A maximum or minimum of nothing is an error, as in PyTorch."""
        axes = self._axes(axis) if not isinstance(axis, Tensor) else ()
        if any(self.shape[a] == 0 for a in axes) or (axis is None and self.numel() == 0):
            raise IndexError(f"{name}: reduction over an empty dimension of a tensor of shape "
                             f"{self.shape}")

    def _neg_for_min(self) -> "Tensor":
        if self.dtype == dt.bool_:
            return self.logical_not()
        if self.dtype.is_int:
            return ~self  # -x - 1 reverses the order without overflow (-x wraps at the minimum)
        return -self

    def argmax(self, axis: int | None = None, keepdim: bool = False,
               dim: int | None = None) -> "Tensor":
        """Index of the first maximum (int64), as PyTorch."""
        axis = dim if dim is not None else axis
        if axis is None:
            return self.reshape(-1).argmax(0)
        if self.ndim == 0:
            _axis(axis, 0)
            return full((), 0, dt.int64, self.device)
        ax = _axis(axis, self.ndim)
        n = self.shape[ax]
        if n == 0:
            raise IndexError(f"argmax/argmin over an empty dimension of shape {self.shape}")
        x = self.cast(dt.uint8) if self.dtype == dt.bool_ else self
        m = x._max(ax, keepdim=True)
        # the first index wins: take the largest of (n - i) over the positions equal to the max
        rev = (n - arange(n, device=self.device, dtype=dt.int32)).reshape(
            (n,) + (1,) * (self.ndim - ax - 1))
        hit = x.eq(m).logical_or(x.isnan() if x.dtype.is_float else x.eq(m))
        score = hit._select(rev, 0)
        best = score._max(ax, keepdim=True)
        out = (n - best).cast(dt.int64)
        return out if keepdim else out.squeeze(ax)

    def argmin(self, axis: int | None = None, keepdim: bool = False,
               dim: int | None = None) -> "Tensor":
        axis = dim if dim is not None else axis
        return self._neg_for_min().argmax(axis, keepdim)

    def mean(self, axis: ShapeLike | None = None, keepdim: bool = False,
             dim: ShapeLike | None = None) -> "Tensor":
        axis = dim if dim is not None else axis
        if not self.dtype.is_float:
            raise TypeError(f"mean needs a floating-point tensor, got {self.dtype.name}")
        axes = self._axes(axis)
        count = math.prod(self.shape[a] for a in axes)
        total = self.sum(axes, keepdim)
        if not count:  # a mean of nothing is NaN (0 * NaN may fold to 0 in a shader compiler)
            return total + full(total.shape, float("nan"), total.dtype, self.device)
        return total / count  # a division: the mean of equal values is exactly that value

    def var(self, axis: ShapeLike | None = None, keepdim: bool = False, correction: int = 1,
            dim: ShapeLike | None = None, unbiased: bool | None = None) -> "Tensor":
        axis = dim if dim is not None else axis
        if unbiased is not None:
            correction = int(unbiased)
        axes = self._axes(axis)
        count = math.prod(self.shape[a] for a in axes)
        diff = self - self.mean(axes, keepdim=True)
        return (diff * diff).sum(axes, keepdim) * (1.0 / max(count - correction, 0)
                                                   if count - correction > 0 else float("nan"))

    def std(self, axis: ShapeLike | None = None, keepdim: bool = False, correction: int = 1,
            dim: ShapeLike | None = None, unbiased: bool | None = None) -> "Tensor":
        """The square root of ``var``, computed on deviations scaled by the largest one so that
        values beyond 1e19 do not overflow float32 when squared."""
        axis = dim if dim is not None else axis
        if unbiased is not None:
            correction = int(unbiased)
        axes = self._axes(axis)
        count = math.prod(self.shape[a] for a in axes)

        def compute() -> "Tensor":
            diff = self - self.mean(axes, keepdim=True)
            scale = diff.abs()._max(axes, keepdim=True) if count else diff.sum(axes, True)
            scale = scale.eq(0).logical_or(scale.isinf())._select(scale._const_like(1.0), scale)
            scaled = diff / scale
            return scale * scaled.var(axes, True, correction).sqrt()
        out = self._custom("std", (), (axes, count, correction), compute)
        return self._finish(out, axes, keepdim)

    def logsumexp(self, axis: ShapeLike | None = None, keepdim: bool = False,
                  dim: ShapeLike | None = None) -> "Tensor":
        axis = dim if dim is not None else axis
        if axis is None:
            raise TypeError("logsumexp() needs dim")
        axes = self._axes(axis)
        x = self._float()
        m = x._max(axes, keepdim=True).detach()  # the shift changes no gradient
        m = m.isinf()._select(m._const_like(0.0), m)
        out = (x - m).exp().sum(axes, keepdim=True).log() + m
        return x._finish(out, axes, keepdim)

    def softmax(self, axis: int = -1, dtype: Any = None, dim: int | None = None) -> "Tensor":
        axis = dim if dim is not None else axis
        x = self.cast(dtype) if dtype is not None else amp.widen(self._float())[0]
        # the shift changes no gradient: detached, backward does no work for it (as PyTorch's)
        e = (x - x._max(axis, keepdim=True).detach()).exp()
        return e / e.sum(axis, keepdim=True)

    def log_softmax(self, axis: int = -1, dtype: Any = None, dim: int | None = None) -> "Tensor":
        axis = dim if dim is not None else axis
        x = self.cast(dtype) if dtype is not None else amp.widen(self._float())[0]
        shifted = x - x._max(axis, keepdim=True).detach()
        return shifted - shifted.exp().sum(axis, keepdim=True).log()

    def all(self, axis: ShapeLike | None = None, keepdim: bool = False,
            dim: ShapeLike | None = None) -> "Tensor":
        axis = dim if dim is not None else axis
        out = self.bool().logical_not()._max(axis, keepdim).logical_not()
        return out.cast(dt.uint8) if self.dtype == dt.uint8 else out  # PyTorch keeps uint8

    def any(self, axis: ShapeLike | None = None, keepdim: bool = False,
            dim: ShapeLike | None = None) -> "Tensor":
        axis = dim if dim is not None else axis
        out = self.bool()._max(axis, keepdim)
        return out.cast(dt.uint8) if self.dtype == dt.uint8 else out  # PyTorch keeps uint8

    def cumsum(self, axis: int = 0, dim: int | None = None) -> "Tensor":
        axis = _axis(dim if dim is not None else axis, self.ndim)
        if self.ndim == 0:
            return self * 1 if self.dtype.is_float else self.cast(dt.int64)
        n = self.shape[axis]
        x = self.transpose(axis, -1)
        i = arange(n, device=self.device, dtype=dt.int32)
        mask = i.reshape(n, 1).ge(i.reshape(1, n))  # out[j] sums x[k] for k <= j
        x = x.cast(dt.int64) if not x.dtype.is_float else x
        out = mask._select(x.unsqueeze(-2), 0).sum(-1)  # a select: inf * 0 would be NaN
        return out.transpose(axis, -1)

    # ---- movement --------------------------------------------------------------------------------
    def reshape(self, *shape: Any) -> "Tensor":
        new = list(_shape_arg(shape))
        if new.count(-1) > 1:
            raise ValueError("only one dimension can be -1")
        if -1 in new:
            known = math.prod(n for n in new if n != -1)
            if known == 0 or self.numel() % known:
                raise ValueError(f"cannot reshape {self.shape} to {tuple(new)}")
            new[new.index(-1)] = self.numel() // known
        return self._move(Op.RESHAPE, tuple(new))

    view = reshape

    def permute(self, *order: Any) -> "Tensor":
        axes = tuple(_axis(a, self.ndim) for a in _shape_arg(order))
        return self._move(Op.PERMUTE, axes)

    def transpose(self, a: int = 0, b: int = 1) -> "Tensor":
        if self.ndim == 0:
            _axis(a, 0), _axis(b, 0)
            return self
        order = list(range(self.ndim))
        a, b = _axis(a, self.ndim), _axis(b, self.ndim)
        order[a], order[b] = order[b], order[a]
        return self.permute(order)

    @property
    def T(self) -> "Tensor":
        return self.permute(tuple(reversed(range(self.ndim))))

    def t(self) -> "Tensor":
        if self.ndim > 2:
            raise ValueError("t() expects a tensor with at most 2 dimensions")
        return self.T

    def expand(self, *shape: Any) -> "Tensor":
        new = shape[0] if len(shape) == 1 and type(shape[0]) is tuple else _shape_arg(shape)
        have = self.lazy.shape
        if len(new) < len(have):
            raise ValueError(f"cannot expand {have} to {new}")
        x = self if len(new) == len(have) else self.reshape((1,) * (len(new) - len(have)) + have)
        if -1 in new:
            new = tuple([o if n == -1 else n for o, n in zip(x.lazy.shape, new)])
        return x._move(Op.EXPAND, new)

    def expand_as(self, other: "Tensor") -> "Tensor":
        return self.expand(other.shape)

    def squeeze(self, axis: ShapeLike | None = None, dim: ShapeLike | None = None) -> "Tensor":
        axis = dim if dim is not None else axis
        if axis is None:
            return self.reshape(tuple(n for n in self.shape if n != 1))
        axes = self._axes(axis)
        return self.reshape(tuple(n for i, n in enumerate(self.shape)
                                  if not (i in axes and n == 1)))

    def unsqueeze(self, axis: int) -> "Tensor":
        axis = _axis(axis, self.ndim + 1)
        return self.reshape(self.shape[:axis] + (1,) + self.shape[axis:])

    def flatten(self, start_dim: int = 0, end_dim: int = -1) -> "Tensor":
        if self.ndim == 0:
            return self.reshape(1)
        s, e = _axis(start_dim, self.ndim), _axis(end_dim, self.ndim)
        return self.reshape(self.shape[:s] + (math.prod(self.shape[s:e + 1]),) + self.shape[e + 1:])

    def unflatten(self, axis: int, sizes: Sequence[int]) -> "Tensor":
        axis = _axis(axis, self.ndim)
        return self.reshape(self.shape[:axis] + tuple(sizes) + self.shape[axis + 1:])

    def flip(self, *axes: Any) -> "Tensor":
        if self.ndim == 0:
            for a in _shape_arg(axes):
                _axis(a, 0)
            return self
        return self._move(Op.FLIP, tuple(sorted({_axis(a, self.ndim) for a in _shape_arg(axes)})))

    def shrink(self, bounds: Sequence[tuple[int, int]]) -> "Tensor":
        return self._move(Op.SHRINK, tuple((int(a), int(b)) for a, b in bounds))

    def pad(self, pad: Sequence[int], value: Scalar = 0) -> "Tensor":
        """PyTorch's ``F.pad`` order: (last_before, last_after, second_last_before, ...).
        Negative padding crops."""
        if len(pad) % 2 or len(pad) // 2 > self.ndim:
            raise ValueError(f"padding {tuple(pad)} does not fit {self.ndim} dimensions")
        pairs = [(0, 0)] * self.ndim
        for i in range(len(pad) // 2):
            pairs[self.ndim - 1 - i] = (int(pad[2 * i]), int(pad[2 * i + 1]))
        x = self.shrink([(max(-a, 0), n - max(-b, 0)) for (a, b), n in zip(pairs, self.shape)])
        grow = tuple((max(a, 0), max(b, 0)) for a, b in pairs)
        out = x._move(Op.PAD, grow)
        if value == 0 or all(g == (0, 0) for g in grow):
            return out
        mask = Tensor(Lazy.const(True, x.shape, dt.bool_, self.device))._move(Op.PAD, grow)
        return mask._select(out, out._const_like(value))

    def repeat(self, *repeats: Any) -> "Tensor":
        reps = _shape_arg(repeats)
        if len(reps) < self.ndim:
            raise ValueError("repeat needs at least as many repeats as dimensions")
        x = self.reshape((1,) * (len(reps) - self.ndim) + self.shape)
        inter = tuple(v for n, r in zip(x.shape, reps) for v in (1, n))
        big = tuple(v for n, r in zip(x.shape, reps) for v in (r, n))
        return x.reshape(inter).expand(big).reshape(tuple(n * r for n, r in zip(x.shape, reps)))

    def split(self, split_size: int | Sequence[int], dim: int = 0) -> tuple["Tensor", ...]:
        axis = _axis(dim, self.ndim)
        n = self.shape[axis]
        if isinstance(split_size, int):
            if split_size <= 0:
                raise ValueError("split_size must be positive")
            sizes = [min(split_size, n - i) for i in range(0, n, split_size)] or [0]
        else:
            sizes = list(split_size)
            if sum(sizes) != n:
                raise ValueError(f"split sizes {sizes} do not add up to {n}")
        out, start = [], 0
        for s in sizes:
            bounds = [(0, m) for m in self.shape]
            bounds[axis] = (start, start + s)
            out.append(self.shrink(bounds))
            start += s
        return tuple(out)

    def chunk(self, chunks: int, dim: int = 0) -> tuple["Tensor", ...]:
        if self.ndim == 0:
            raise IndexError("chunk expects at least a 1-dimensional tensor")
        n = self.shape[_axis(dim, self.ndim)]
        if n == 0:  # PyTorch gives `chunks` empty pieces
            return tuple(self for _ in range(chunks))
        return self.split(max(-(-n // chunks), 1), dim)

    def cat(self, *others: "Tensor", dim: int = 0) -> "Tensor":
        return cat([self, *others], dim)

    # ---- indexing --------------------------------------------------------------------------------
    def __getitem__(self, index: Any) -> "Tensor":
        from anygpu.ops.indexing import getitem
        return getitem(self, index)

    def gather(self, dim: int, index: "Tensor") -> "Tensor":
        """``out[i][j] = self[i][index[i][j]]`` for dim=1, as ``torch.gather``."""
        from anygpu.ops.indexing import gather
        return gather(self, dim, index)

    def scatter_add(self, dim: int, index: "Tensor", src: "Tensor") -> "Tensor":
        from anygpu.ops.indexing import scatter_add
        return scatter_add(self, dim, index, src)

    def index_select(self, dim: int, index: "Tensor") -> "Tensor":
        from anygpu.ops.indexing import index_select
        return index_select(self, dim, index)

    def masked_fill(self, mask: TensorLike, value: Scalar) -> "Tensor":
        return where(mask, self._const_like(value), self)

    # ---- linear algebra --------------------------------------------------------------------------
    def matmul(self, other: "Tensor") -> "Tensor":
        from anygpu.ops.linalg import matmul
        return matmul(self, other)

    def dot(self, other: "Tensor") -> "Tensor":
        return self.matmul(other)

    # ---- autograd (see ops/grad.py) --------------------------------------------------------------
    def backward(self, gradient: "Tensor | None" = None, retain_graph: bool = False) -> None:
        """Accumulate gradients of this tensor into ``.grad`` of the leaves that need them."""
        from anygpu.ops.grad import backward
        backward(self, gradient, retain_graph)

    def requires_grad_(self, flag: bool = True) -> "Tensor":
        if flag and not self.dtype.is_float:
            raise RuntimeError(f"only floating-point tensors can require gradients, this one is "
                               f"{self.dtype.name}")
        self.requires_grad = flag
        return self

    @property
    def is_leaf(self) -> bool:
        return self._ctx is None

    def __setitem__(self, index: Any, value: Any) -> None:
        """``x[index] = value`` in place, as PyTorch (see ops/inplace.py)."""
        from anygpu.ops.inplace import setitem
        setitem(self, index, value)

    @property
    def data(self) -> "Tensor":
        """This tensor's values without its history (the same memory), as PyTorch's ``.data``."""
        return Tensor(self.lazy)

    @data.setter
    def data(self, value: "Tensor") -> None:
        if not isinstance(value, Tensor):
            raise TypeError(f"data must be a Tensor, got {type(value).__name__}")
        if value.shape == self.shape and value.dtype == self.dtype and \
                value.device == self.device:
            from anygpu.ops.inplace import write
            with no_grad():  # same shape: written in place, so views of this memory see it
                write(self.data, value)
        else:
            self.lazy = value.lazy

    def assign(self, value: "TensorLike") -> "Tensor":
        """Write ``value`` into this tensor's memory (in place; the shape and dtype stay)."""
        v = _as_tensor(value, self).cast(self.dtype)
        if v.shape != self.shape:
            v = v.expand(self.shape)
        if v.device != self.device:
            raise ValueError(f"assign: value on {v.device}, tensor on {self.device}")
        self.realize()
        sched.realize_into(v.lazy, self.lazy)
        return self

    # last in the class: methods named after builtins would shadow them in the annotations above
    def float(self) -> "Tensor":
        return self.cast(dt.float32)

    def double(self) -> "Tensor":
        """float32: anygpu offers no float64 (see docs/from-pytorch.md), as NumPy float64 data
        becomes float32."""
        return self.cast(dt.float32)

    def half(self) -> "Tensor":
        return self.cast(dt.float16)

    def bfloat16(self) -> "Tensor":
        return self.cast(dt.bfloat16)

    def int(self) -> "Tensor":
        return self.cast(dt.int32)

    def long(self) -> "Tensor":
        return self.cast(dt.int64)

    def bool(self) -> "Tensor":
        return self.cast(dt.bool_)


def _install_methods() -> None:
    """The in-place methods (ops/inplace.py) and more composites (ops/composites.py,
    ops/sorting.py)."""
    from anygpu.ops import composites, inplace, random, sorting
    for name, method in {**inplace.methods(), **composites.methods(),
                         **random.methods(), **sorting.methods()}.items():
        setattr(Tensor, name, method)


_install_methods()


def parse_to(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str | None, DType | None]:
    """(device, dtype) from the arguments of ``Tensor.to`` and ``Module.to``, in PyTorch's forms:
    a device string, a dtype, a tensor (its device and dtype), or keywords."""
    device, dtype = kwargs.get("device"), kwargs.get("dtype")
    for a in args:
        if isinstance(a, Tensor):
            device, dtype = a.device, a.dtype
        elif isinstance(a, str) and is_device_name(a):
            device = a
        else:
            dtype = dt.to_dtype(a)
    return device, (dt.to_dtype(dtype) if dtype is not None else None)


class MinMax(tuple):
    """(values, indices) as ``torch.max(x, dim)`` returns."""

    def __new__(cls, values: Tensor, indices: Tensor) -> "MinMax":
        return super().__new__(cls, (values, indices))

    @property
    def values(self) -> Tensor:
        return self[0]

    @property
    def indices(self) -> Tensor:
        return self[1]


# ---- module-level functions --------------------------------------------------------------------
def _upload(arr: np.ndarray, dtype: DType, device: str) -> Lazy:
    dev = get_device(device)
    dev.check_dtype(dtype)
    if dtype == dt.bfloat16:
        host = np.ascontiguousarray(arr, dtype=np.float32)
    else:
        host = np.ascontiguousarray(arr).astype(dtype.np, copy=False)
    buf = sched.alloc_for(dev, host.size, dtype)
    if host.size:
        buf.copy_in(sched.to_storage(host, dtype, dev).reshape(-1))
    return Lazy.from_buffer(buf, tuple(arr.shape), dtype, dev.name)


def _int_pow(a: Tensor, b: Tensor, exponent: int | None) -> Tensor:
    """Integer powers, exact (wrapping as PyTorch's): square-and-multiply over the exponent's
    bits. A negative exponent gives 0 except for bases 1 and -1, as in PyTorch."""
    if exponent is not None:
        out, base, e = a * 0 + 1, a, exponent
        while e:
            if e & 1:
                out = out * base
            e >>= 1
            if e:
                base = base * base
        return out
    out, base, bits_left = a * 0 + 1, a, b
    bits = 8 * a.dtype.itemsize
    for k in range(bits - 1):
        out = (bits_left & 1).ne(0)._select(out * base, out)
        if k < bits - 2:
            base, bits_left = base * base, bits_left >> 1
    odd = (b & 1).ne(0)
    negative = a.eq(1)._select(a, a.eq(-1)._select(odd._select(a, -a), a * 0))
    return b.lt(0)._select(negative, out)


def _float_pow(a: Tensor, b: Tensor) -> Tensor:
    """a ** b for floats with C's special cases: |a| ** b through exp2 and log2, the sign from an
    odd integer exponent (a zero's too), NaN for a finite negative base and a non-integer
    exponent and for NaN operands, 1 for 1 ** anything, anything ** 0 and (-1) ** +-inf."""
    zero = a.eq(0)
    # a zero base and NaNs are selected apart: a shader compiler may fuse exp2(b * log2(x)) into
    # a pow of its own, undefined there (Mesa's gave 0 for 0 ** -1.5 and for NaN ** 2.5)
    mag = zero._select(b.lt(0)._select(a._const_like(float("inf")), a._const_like(0.0)),
                       (b * a.abs().log2()).exp2())
    is_int = b.eq(b.trunc())
    odd = is_int.logical_and(b.remainder(2).eq(1))
    # -0.0 takes the sign of an odd exponent too, as in C: (-0.0) ** -1 is -inf
    negative = a.lt(0).logical_or(zero.logical_and(a.reciprocal().lt(0)))
    finite_negative = a.lt(0).logical_and(a.ne(float("-inf")))
    nan = a._const_like(float("nan"))
    out = negative._select(odd._select(-mag, finite_negative._select(is_int._select(mag, nan),
                                                                       mag)), mag)
    out = a.ne(a).logical_or(b.ne(b))._select(nan, out)
    one = a.eq(1).logical_or(b.eq(0)).logical_or(a.eq(-1).logical_and(b.abs().eq(float("inf"))))
    return one._select(a._const_like(1.0), out)


def _as_tensor(x: TensorLike, like: Tensor) -> Tensor:
    if isinstance(x, Tensor):
        return x
    if isinstance(x, (int, float, bool)):
        return Tensor(Lazy.const(x, (), dt.scalar_dtype(x, like.dtype), like.device))
    return Tensor(x, device=like.device)


def broadcast_shapes(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    key = shapes if all(type(s) is tuple for s in shapes) else None
    hit = _broadcasts.get(key) if key is not None else None
    if hit is None:
        hit = _broadcast_shapes(shapes)
        if key is not None and len(_broadcasts) < 4096:
            _broadcasts[key] = hit
    return hit


_broadcasts: dict[tuple, tuple[int, ...]] = {}  # the shapes a model broadcasts, again each step


def _broadcast_shapes(shapes: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
    nd = max(len(s) for s in shapes)
    out = []
    for dims in zip(*[(1,) * (nd - len(s)) + tuple(s) for s in shapes]):
        sizes = {d for d in dims if d != 1}
        if len(sizes) > 1:
            raise ValueError(f"shapes {' and '.join(map(str, shapes))} cannot be broadcast")
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def _broadcast(*ts: Tensor) -> tuple[Tensor, ...]:
    if len(ts) == 2 and ts[0].lazy.shape == ts[1].lazy.shape:
        return ts
    shape = broadcast_shapes(*[t.lazy.shape for t in ts])
    return tuple([t if t.lazy.shape == shape else t.expand(shape) for t in ts])


def tensor(data: Any, dtype: Any = None, device: str | None = None,
           requires_grad: bool = False) -> Tensor:
    """A tensor from a list, a NumPy array, a scalar or another tensor (copied)."""
    return Tensor(data, device=device, dtype=dtype, requires_grad=requires_grad)


def full(shape: ShapeLike, fill_value: Scalar, dtype: Any = None, device: str | None = None,
         requires_grad: bool = False) -> Tensor:
    shp = (shape,) if isinstance(shape, int) else tuple(shape)
    d = dt.to_dtype(dtype) if dtype is not None else (
        dt.bool_ if isinstance(fill_value, bool) else dt.int64 if isinstance(fill_value, int)
        else dt.float32)
    out = Tensor(Lazy.const(fill_value, shp, d, canonical(device)))
    return out.contiguous().realize().detach().requires_grad_(requires_grad)


def zeros(*shape: Any, dtype: Any = None, device: str | None = None,
          requires_grad: bool = False) -> Tensor:
    return full(_shape_arg(shape), 0.0, dtype or dt.float32, device, requires_grad)


def ones(*shape: Any, dtype: Any = None, device: str | None = None,
         requires_grad: bool = False) -> Tensor:
    return full(_shape_arg(shape), 1.0, dtype or dt.float32, device, requires_grad)


def zeros_like(t: Tensor, dtype: Any = None) -> Tensor:
    return zeros(t.shape, dtype=dtype or t.dtype, device=t.device)


def ones_like(t: Tensor, dtype: Any = None) -> Tensor:
    return ones(t.shape, dtype=dtype or t.dtype, device=t.device)


def full_like(t: Tensor, fill_value: Scalar, dtype: Any = None) -> Tensor:
    return full(t.shape, fill_value, dtype=dtype or t.dtype, device=t.device)


def arange(start: Scalar, end: Scalar | None = None, step: Scalar = 1, dtype: Any = None,
           device: str | None = None) -> Tensor:
    if end is None:
        start, end = 0, start
    n = max(math.ceil((end - start) / step), 0)
    is_float = any(isinstance(v, float) for v in (start, end, step))
    d = dt.to_dtype(dtype) if dtype is not None else (dt.float32 if is_float else dt.int64)
    dev = canonical(device)
    idx = Tensor(Lazy.iota(n, dt.int32 if n < 2**31 else dt.int64, dev))
    if d.is_float:
        return (idx.cast(d) * step + start).cast(d)
    return idx.cast(d) * int(step) + int(start)


def linspace(start: float, end: float, steps: int, dtype: Any = None,
             device: str | None = None) -> Tensor:
    if steps <= 0:
        raise ValueError("linspace needs steps >= 1")
    d = dt.to_dtype(dtype) if dtype is not None else dt.float32
    if steps == 1:
        return full((1,), start, d, device)
    step = (end - start) / (steps - 1)
    i = arange(steps, dtype=dt.float32, device=device)
    # the second half counts back from the end, as PyTorch does, so both ends are exact
    half = steps // 2
    out = i.lt(half)._select(i * step + start, end - (steps - 1 - i) * step)
    return out.cast(d)


def eye(n: int, m: int | None = None, dtype: Any = None, device: str | None = None) -> Tensor:
    m = n if m is None else m
    r = arange(n, device=device, dtype=dt.int32).reshape(n, 1)
    c = arange(m, device=device, dtype=dt.int32).reshape(1, m)
    return r.eq(c).cast(dt.to_dtype(dtype) if dtype is not None else dt.float32)


def _refuse_bool(t: Tensor, what: str) -> None:
    if t.dtype == dt.bool_:
        raise TypeError(f"{what} is not defined for bool tensors (as in PyTorch)")


def _check_scalar_fits(value: Any, dtype: DType, half: bool = False) -> None:
    """PyTorch's where and pow refuse a Python integer outside the other operand's integer
    range (arithmetic and comparisons wrap it instead); pow also a number beyond float16's."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        return
    if dtype.is_int and isinstance(value, (int, np.integer)):
        low, high = dt.min_value(dtype), dt.max_value(dtype)
    elif half and dtype == dt.float16 and math.isfinite(value):
        low, high = -65504.0, 65504.0
    else:
        return
    if not low <= value <= high:
        raise RuntimeError(f"value {value} cannot be converted to {dtype.name} without overflow")


def where(condition: TensorLike, input: TensorLike, other: TensorLike) -> Tensor:
    """``input`` where ``condition`` is true, else ``other`` (broadcast, promoted)."""
    ref = next((t for t in (condition, input, other) if isinstance(t, Tensor)), None)
    if ref is None:
        raise TypeError("where needs at least one tensor")
    c = _as_tensor(condition, ref).bool()
    a = _as_tensor(input, ref)
    b = _as_tensor(other, ref)
    for t, s in ((input, other), (other, input)):
        if isinstance(t, Tensor):
            _check_scalar_fits(s, t.dtype)
    if isinstance(input, Tensor) and isinstance(other, Tensor):
        d = dt.promote_tensors(a.dtype, a.ndim == 0, b.dtype, b.ndim == 0)
    elif isinstance(input, Tensor):
        d = dt.promote(a.dtype, dt.scalar_dtype(other, a.dtype)) if not isinstance(
            other, Tensor) else a.dtype
    elif isinstance(other, Tensor):
        d = dt.promote(b.dtype, dt.scalar_dtype(input, b.dtype))
    else:
        d = dt.float32 if isinstance(input, float) or isinstance(other, float) else dt.int64
    c, a, b = _broadcast(c, a.cast(d), b.cast(d))
    return c._alu(Op.WHERE, a, b)


def cat(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
    """Concatenate along ``dim``: each input padded to the full size, then summed (one kernel)."""
    ts = [t for t in tensors]
    if not ts:
        raise ValueError("cat needs at least one tensor")
    ref = ts[0]
    axis = _axis(dim, ref.ndim)
    d = ref.dtype
    for t in ts[1:]:
        d = dt.promote(d, t.dtype)
        if t.ndim != ref.ndim or any(a != b for i, (a, b) in enumerate(zip(t.shape, ref.shape))
                                     if i != axis):
            raise ValueError(f"cat: shapes {[x.shape for x in ts]} differ outside dim {axis}")
    total = sum(t.shape[axis] for t in ts)
    rows = _rows_of_one_buffer(ts) if axis == 0 else None
    if rows is not None:
        return rows[0][np.concatenate(rows[1])].cast(d)
    out: Tensor | None = None
    start = 0
    for t in ts:
        n = t.shape[axis]
        pads = [(0, 0)] * ref.ndim
        pads[axis] = (start, total - start - n)
        piece = t.cast(d)._move(Op.PAD, tuple(pads))
        if d == dt.bool_:
            out = piece if out is None else out.logical_or(piece)
        else:
            out = piece if out is None else out._alu(Op.ADD, piece)
        start += n
    assert out is not None
    if len(ts) > 1 and out.lazy.op in (Op.ADD, Op.OR):
        # stored when first computed, as PyTorch stores it, not fused into its readers: a token
        # list grown by cat and cropped (idx[:, -n:]) is then read as a run of memory, so the
        # model's kernels do not change with its length
        out.lazy.keep = True
    return out


def stack(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
    ts = list(tensors)
    if not ts:
        raise ValueError("stack needs at least one tensor")
    axis = _axis(dim, ts[0].ndim + 1)
    rows = _rows_of_one_buffer(ts) if axis == 0 else None
    if rows is not None and all(t.shape == ts[0].shape for t in ts):
        return rows[0][np.stack(rows[1])]
    return cat([t.unsqueeze(axis) for t in ts], axis)


def _rows_of_one_buffer(ts: Sequence[Tensor]) -> tuple[Tensor, list[np.ndarray]] | None:
    """(a tensor, the rows of it each of ``ts`` is) where every one of ``ts`` is a run of rows
    of one stored tensor that needs no gradient: ``x[a:b]``, or rows of rows ``x[:m][a:b]``
    (``lazy.contiguous_run``). Then ``stack`` and ``cat`` gather those rows by an index
    uploaded as data: a batch of windows cut at new places each step (``stack([data[i:i + n]
    for i in ix])``) reuses one kernel, where padding and adding the slices would compile a
    kernel for each new set of offsets."""
    if len(ts) < 2 or sched.recording is not None:
        return None
    base: Lazy | None = None
    rows = []
    row_shape = ts[0].shape[1:]
    row = math.prod(row_shape)
    for t in ts:
        node = t.lazy
        if t.requires_grad or node.op is not Op.SHRINK or node.realized or \
                t.shape[1:] != row_shape:
            return None
        run = contiguous_run(node)
        if run is None or (base is not None and run[0] is not base):
            return None
        base, first = run
        if row == 0 or first % row or base.numel % row:
            return None
        rows.append(np.arange(first // row, first // row + t.shape[0]))
    assert base is not None
    return Tensor(base).reshape(base.numel // row, *row_shape), rows


def manual_seed(seed: int) -> Any:
    """Restart the global generator (see ops/random.py); returns it, as in PyTorch."""
    from anygpu.ops import random
    return random.manual_seed(seed)


def rand(*shape: Any, dtype: Any = None, device: str | None = None,
         requires_grad: bool = False, generator: Any = None) -> Tensor:
    from anygpu.ops import random
    out = random.rand(_shape_arg(shape), dtype, device, generator)
    return out.requires_grad_(requires_grad)


def randn(*shape: Any, dtype: Any = None, device: str | None = None,
          requires_grad: bool = False, generator: Any = None) -> Tensor:
    from anygpu.ops import random
    out = random.randn(_shape_arg(shape), dtype, device, generator)
    return out.requires_grad_(requires_grad)


def randint(low: int = 0, high: Any = None, size: ShapeLike | None = None, dtype: Any = None,
            device: str | None = None, generator: Any = None,
            requires_grad: bool = False) -> Tensor:
    """Uniform integers in [low, high), int64 by default: PyTorch's ``randint(high, size)`` and
    ``randint(low, high, size)``.

    >>> import anygpu as ag
    >>> ag.randint(3, (4,)).shape, ag.randint(5, 6, (2,)).tolist()
    ((4,), [5, 5])
    """
    from anygpu.ops import random
    if size is None and isinstance(high, (tuple, list)):
        low, high, size = 0, low, high
    if high is None:
        low, high = 0, low
    shp = () if size is None else (size,) if isinstance(size, int) else tuple(size)
    out = random.randint(int(low), int(high), shp, dtype, device, generator)
    return out.requires_grad_(requires_grad)


def realize(*tensors: Tensor) -> None:
    """Realize several tensors in one schedule (shared inputs are computed once)."""
    sched.realize(*(t.lazy for t in tensors))
