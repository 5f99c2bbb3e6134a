"""Elementwise operators: arithmetic, comparisons, logic and bits, math functions, activations,
casts and ``Where``.

Inverse trigonometric and hyperbolic functions are composites of ``exp``, ``log`` and ``sqrt``
with a polynomial arctangent (Cephes' single-precision fit after range reduction), since
anygpu has no primitive for them.

>>> import numpy as np
>>> from anygpu.onnx.ops.table import Node
>>> node = Node("Atan", "n", "", 13, "cpu", {}, [1], [1], 1)
>>> [round(v, 5) for v in atan(node, Tensor(np.array([1.0, -2.0], np.float32))).tolist()]
[0.7854, -1.10715]
"""

from __future__ import annotations

import math
from functools import reduce
from typing import Any

import numpy as np
from onnx import TensorProto

from anygpu import dtype as dt
from anygpu.onnx import dtypes
from anygpu.onnx.ops.common import const, float_of, scalar_like, wrap_int16, wrap_unsigned
from anygpu.onnx.ops.table import Node, op
from anygpu.tensor import Tensor, where

PI = math.pi


# ---- host folds of the arithmetic used on shapes ------------------------------------------------
def _fold_binary(fn: Any) -> Any:
    def fold(node: Node, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        with np.errstate(all="ignore"):
            return np.asarray(fn(a, b)).astype(a.dtype)  # ONNX: one type in and out
    return fold


def _fold_variadic(fn: Any) -> Any:
    def fold(node: Node, *xs: np.ndarray) -> np.ndarray:
        return np.asarray(reduce(fn, xs)).astype(xs[0].dtype)
    return fold


def _fold_div(node: Node, a: np.ndarray, b: np.ndarray) -> np.ndarray | None:
    if a.dtype.kind in "iu":
        if np.any(b == 0):
            return None
        return (np.trunc(a / b)).astype(a.dtype)
    with np.errstate(all="ignore"):
        return np.asarray(a / b, dtype=a.dtype)


# ---- arithmetic ---------------------------------------------------------------------------------
@op("Add", since=7, fold=_fold_binary(np.add))
def add(node: Node, a: Tensor, b: Tensor) -> Tensor:
    return a + b


@op("Sub", since=7, fold=_fold_binary(np.subtract))
def sub(node: Node, a: Tensor, b: Tensor) -> Tensor:
    return a - b


@op("Mul", since=7, fold=_fold_binary(np.multiply))
def mul(node: Node, a: Tensor, b: Tensor) -> Tensor:
    return a * b


@op("Div", since=7, fold=_fold_div)
def div(node: Node, a: Tensor, b: Tensor) -> Tensor:
    if a.dtype.is_float:
        return a / b
    return a.div(b, rounding_mode="trunc")


@op("Mod", since=10, attrs=("fmod",))
def mod(node: Node, a: Tensor, b: Tensor) -> Tensor:
    if node.attr("fmod", 0):
        return a.fmod(b)
    return a.remainder(b)


@op("Pow", since=7)
def power(node: Node, a: Tensor, b: Tensor) -> Tensor:
    if a.dtype.is_float:
        return a.pow(b.cast(a.dtype))
    if b.dtype.is_float:  # an integer base with a float exponent: computed in float, truncated
        return a.cast(b.dtype).pow(b).round().cast(a.dtype)
    return a.pow(b.cast(a.dtype))


def _variadic(fn: Any) -> Any:
    def handler(node: Node, *xs: Tensor) -> Tensor:
        return reduce(fn, xs)
    return handler


# exported models take maxima and minima of sizes: those fold on the host
op("Max", since=8, fold=_fold_variadic(np.maximum))(_variadic(lambda a, b: a.maximum(b)))
op("Min", since=8, fold=_fold_variadic(np.minimum))(_variadic(lambda a, b: a.minimum(b)))
op("Sum", since=8)(_variadic(lambda a, b: a + b))


@op("Mean", since=8)
def mean(node: Node, *xs: Tensor) -> Tensor:
    return reduce(lambda a, b: a + b, xs) / len(xs)


@op("Neg", since=6, fold=lambda node, a: -a)
def neg(node: Node, x: Tensor) -> Tensor:
    return -x


@op("Abs", since=6, fold=lambda node, a: np.abs(a))
def abs_(node: Node, x: Tensor) -> Tensor:
    return x.abs()


@op("Sign", since=9)
def sign(node: Node, x: Tensor) -> Tensor:
    return x.sign()


@op("Reciprocal", since=6)
def reciprocal(node: Node, x: Tensor) -> Tensor:
    return x.reciprocal()


@op("Floor", since=6, fold=lambda node, a: np.floor(a))
def floor(node: Node, x: Tensor) -> Tensor:
    return x.floor()


@op("Ceil", since=6, fold=lambda node, a: np.ceil(a))
def ceil(node: Node, x: Tensor) -> Tensor:
    return x.ceil()


@op("Round", since=11)
def round_(node: Node, x: Tensor) -> Tensor:
    return x.round()  # half to even, as ONNX


@op("Sqrt", since=6, fold=lambda node, a: np.sqrt(a))
def sqrt(node: Node, x: Tensor) -> Tensor:
    return x.sqrt()


@op("Exp", since=6)
def exp(node: Node, x: Tensor) -> Tensor:
    return x.exp()


@op("Log", since=6)
def log(node: Node, x: Tensor) -> Tensor:
    return x.log()


@op("Erf", since=9)
def erf(node: Node, x: Tensor) -> Tensor:
    return float_of(x).erf().cast(x.dtype)


# ---- trigonometric and hyperbolic ---------------------------------------------------------------
@op("Sin", since=7)
def sin(node: Node, x: Tensor) -> Tensor:
    return x.sin()


@op("Cos", since=7)
def cos(node: Node, x: Tensor) -> Tensor:
    return x.cos()


@op("Tan", since=7)
def tan(node: Node, x: Tensor) -> Tensor:
    return x.tan()


def _atan(x: Tensor) -> Tensor:
    """arctan by range reduction to |z| <= tan(pi/8) and Cephes' polynomial (atanf)."""
    a = x.abs()
    big = a.gt(2.414213562373095)  # tan(3 pi / 8): atan(a) = pi/2 - atan(1/a)
    mid = a.gt(0.41421356237309503).logical_and(big.logical_not())  # pi/4 + atan((a-1)/(a+1))
    z = where(big, -a.reciprocal(), where(mid, (a - 1) / (a + 1), a))
    base = where(big, scalar_like(a, PI / 2), where(mid, scalar_like(a, PI / 4),
                                                    scalar_like(a, 0.0)))
    z2 = z * z
    poly = ((8.05374449538e-2 * z2 - 1.38776856032e-1) * z2 + 1.99777106478e-1) * z2 \
        - 3.33329491539e-1
    y = base + (z + z * z2 * poly)
    return where(x.lt(0), -y, y)


def _unary_float(fn: Any) -> Any:
    def handler(node: Node, x: Tensor) -> Tensor:
        return fn(float_of(x)).cast(x.dtype)
    return handler


atan = op("Atan", since=7)(_unary_float(_atan))
op("Asin", since=7)(_unary_float(lambda x: _atan(x / ((1 - x) * (1 + x)).sqrt())))
op("Acos", since=7)(_unary_float(lambda x: 2 * _atan(((1 - x) / (1 + x)).sqrt())))
op("Sinh", since=9)(_unary_float(lambda x: (x.expm1() - (-x).expm1()) * 0.5))
op("Cosh", since=9)(_unary_float(lambda x: (x.exp() + (-x).exp()) * 0.5))


def _asinh(x: Tensor) -> Tensor:
    a = x.abs()
    # log1p(a + a^2 / (1 + sqrt(1 + a^2))) keeps small arguments exact
    y = (a + a * a / (1 + (a * a + 1).sqrt())).log1p()
    return where(x.lt(0), -y, y)


op("Asinh", since=9)(_unary_float(_asinh))
op("Acosh", since=9)(_unary_float(lambda x: (x + ((x - 1) * (x + 1)).sqrt()).log()))
op("Atanh", since=9)(_unary_float(lambda x: (2 * x / (1 - x)).log1p() * 0.5))


# ---- comparisons and logic ----------------------------------------------------------------------
def _cmp(name: str, method: str, since: int, fold: Any) -> None:
    def handler(node: Node, a: Tensor, b: Tensor) -> Tensor:
        return getattr(a, method)(b)

    op(name, since=since, fold=lambda node, a, b: np.asarray(fold(a, b)))(handler)


_cmp("Equal", "eq", 7, np.equal)
_cmp("Less", "lt", 7, np.less)
_cmp("Greater", "gt", 7, np.greater)
_cmp("LessOrEqual", "le", 12, np.less_equal)
_cmp("GreaterOrEqual", "ge", 12, np.greater_equal)


@op("Not", since=1, fold=lambda node, a: np.logical_not(a))
def not_(node: Node, x: Tensor) -> Tensor:
    return x.logical_not()


@op("And", since=7, fold=lambda node, a, b: np.logical_and(a, b))
def and_(node: Node, a: Tensor, b: Tensor) -> Tensor:
    return a.logical_and(b)


@op("Or", since=7, fold=lambda node, a, b: np.logical_or(a, b))
def or_(node: Node, a: Tensor, b: Tensor) -> Tensor:
    return a.logical_or(b)


@op("Xor", since=7)
def xor(node: Node, a: Tensor, b: Tensor) -> Tensor:
    return a.logical_xor(b)


@op("BitwiseAnd", since=18)
def bitwise_and(node: Node, a: Tensor, b: Tensor) -> Tensor:
    return a & b


@op("BitwiseOr", since=18)
def bitwise_or(node: Node, a: Tensor, b: Tensor) -> Tensor:
    return a | b


@op("BitwiseXor", since=18)
def bitwise_xor(node: Node, a: Tensor, b: Tensor) -> Tensor:
    return a ^ b


@op("BitwiseNot", since=18)
def bitwise_not(node: Node, x: Tensor) -> Tensor:
    return wrap_unsigned(~x, node.in_type(0))


@op("BitShift", since=11, attrs=("direction",),
    check=lambda n: None if n.attr("direction", "") in ("LEFT", "RIGHT")
    else f"direction must be LEFT or RIGHT, got {n.attr('direction', '')!r}")
def bit_shift(node: Node, a: Tensor, b: Tensor) -> Tensor:
    if node.attr("direction") == "LEFT":
        return wrap_unsigned(a << b, node.in_type(0))
    return a >> b


@op(("IsNaN",), since=9)
def isnan(node: Node, x: Tensor) -> Tensor:
    return x.isnan()


@op("IsInf", since=10, attrs=("detect_negative", "detect_positive"))
def isinf(node: Node, x: Tensor) -> Tensor:
    neg_ok, pos_ok = node.attr("detect_negative", 1), node.attr("detect_positive", 1)
    inf = x.isinf()
    if neg_ok and pos_ok:
        return inf
    if neg_ok:
        return inf.logical_and(x.lt(0))
    if pos_ok:
        return inf.logical_and(x.gt(0))
    return inf.logical_and(x.ne(x))  # neither: all false


@op("Where", since=9, fold=lambda node, c, a, b: np.where(c, a, b))
def where_(node: Node, c: Tensor, a: Tensor, b: Tensor) -> Tensor:
    return where(c, a, b)


# ---- casts --------------------------------------------------------------------------------------
def _check_cast(node: Node) -> str | None:
    to = node.attr("to", None)
    if to is not None and not dtypes.supported(to):
        return f"casting to {dtypes.name(to)} is not supported"
    return None


def float_bits(x: Tensor) -> Tensor:
    """The IEEE-754 bits of float32 values as int32, by arithmetic (anygpu has no bit cast):
    sign, exponent from log2 (corrected where log2 rounds), mantissa scaled to an integer;
    subnormals, zeros, infinities and NaN (as the canonical quiet NaN) included."""
    zero_f = const(0.0, (), dt.float32, x.device)
    a = x.abs()
    negative = x.lt(0).logical_or(x.eq(0).logical_and(x.reciprocal().lt(0)))
    e = a.maximum(2.0 ** -126).log2().floor()
    e = where((e + 1).exp2().le(a), e + 1, e)
    e = where(e.exp2().gt(a), e - 1, e).clip(-126.0, 127.0)
    normal = a.ge(2.0 ** -126)
    mantissa = where(normal, (a / e.exp2() - 1) * 2.0 ** 23, a * 2.0 ** 126 * 2.0 ** 23)
    biased = where(normal, e + 127, zero_f)
    special = a.isinf().logical_or(a.isnan())
    biased = where(special, const(255.0, (), dt.float32, x.device), biased)
    mantissa = where(a.isnan(), const(2.0 ** 22, (), dt.float32, x.device),
                     where(a.isinf(), zero_f, mantissa))
    bits = biased.cast(dt.int64) * (1 << 23) + mantissa.round().cast(dt.int64)
    bits = where(negative.logical_and(a.isnan().logical_not()), bits - (1 << 31), bits)
    return bits.cast(dt.int32)


def bits_float(bits: Tensor) -> Tensor:
    """float32 values from their IEEE-754 bits (int32), by arithmetic."""
    b = bits.cast(dt.int64) & 0xFFFFFFFF
    negative = b.ge(1 << 31)
    biased = (b >> 23) & 0xFF
    mantissa = (b & 0x7FFFFF).cast(dt.float32)
    scale = (biased - 127).cast(dt.float32).exp2()
    normal = (1 + mantissa * 2.0 ** -23) * scale
    tiny = mantissa * 2.0 ** -23 * 2.0 ** -126
    inf = const(float("inf"), (), dt.float32, bits.device)
    nan = const(float("nan"), (), dt.float32, bits.device)
    value = where(biased.eq(0), tiny, where(biased.eq(255), where(mantissa.eq(0), inf, nan),
                                            normal))
    return where(negative, -value, value)


def round_to_e8m0(x: Tensor, saturate: bool, mode: str) -> Tensor:
    """float32 values as FLOAT8E8M0 (a power of two, its exponent rounded from the float's bits
    by ``mode``: "up", "down" or "nearest"), held as float32; NaN for NaN, infinities and an
    exponent rounded past the largest (without ``saturate``)."""
    bits = float_bits(x).cast(dt.int64) & 0xFFFFFFFF
    exponent = (bits >> 23) & 0xFF
    fraction = bits & 0x7FFFFF
    if mode == "nearest":
        guard, round_bit = (fraction & 0x400000).gt(0), (fraction & 0x200000).gt(0)
        sticky = (fraction & 0x1FFFFF).gt(0)
        up = guard.logical_and(round_bit.logical_or(sticky).logical_or(exponent.gt(0)))
    elif mode == "up":
        up = fraction.gt(0)
    else:
        up = fraction.lt(0)  # never
    special = exponent.eq(255)
    up = up.logical_and(special.logical_not())
    if saturate:
        up = up.logical_and(exponent.ne(254))
    exponent = exponent + up.cast(dt.int64)
    value = (exponent - 127).cast(dt.float32).exp2()
    return where(exponent.eq(255), scalar_like(value, float("nan")), value)


def round_to_format(x: Tensor, fmt: dtypes.FloatFormat, saturate: bool) -> Tensor:
    """float32 values rounded (to nearest, ties to even) onto a narrow float format's grid;
    beyond its largest value: that value (saturating), else infinity or NaN."""
    a = x.abs()
    if saturate or not fmt.has_nan:
        a = a.minimum(fmt.max_value)  # also maps inf to the largest value; NaN stays
    # the exponent of the quantum: floor(log2 a), no smaller than the smallest normal's
    e = a.maximum(2.0 ** (fmt.min_exponent - 1)).log2().floor()
    e = where((e + 1).exp2().le(a), e + 1, e)  # log2 may round up just below a power of 2
    e = e.maximum(fmt.min_exponent)
    quantum = (e - fmt.mantissa).exp2()
    r = (a / quantum).round() * quantum
    if not (saturate or not fmt.has_nan):
        over = r.gt(fmt.max_value).logical_or(a.isinf())
        big = scalar_like(r, float("inf") if fmt.has_inf else float("nan"))
        r = where(over, big, r)
    r = where(a.isnan(), a, r)
    return where(x.lt(0), -r, r)


def cast_to(x: Tensor, to: int, saturate: bool = True, round_mode: str = "up") -> Tensor:
    """``x`` cast to ONNX element type ``to`` (in its storage dtype, wrapped into its range;
    narrow floats rounded onto their grid, narrow integers wrapped to their bits)."""
    want = dtypes.storage(to)
    if to == dtypes.FLOAT8E8M0:
        return round_to_e8m0(float_of(x).cast(dt.float32), saturate, round_mode)
    if to in dtypes.FLOAT_FORMATS:
        return round_to_format(float_of(x).cast(dt.float32), dtypes.FLOAT_FORMATS[to],
                               saturate)
    if to in dtypes.INT_FORMATS:
        bits, signed = dtypes.INT_FORMATS[to]
        v = (x.trunc() if x.dtype.is_float else x).cast(dt.int32) & ((1 << bits) - 1)
        if signed:
            v = where(v.ge(1 << (bits - 1)), v - (1 << bits), v)
        return v.cast(want)
    if x.dtype.is_float and want.is_int:
        x = x.trunc()
    out = x.cast(want)
    if to == TensorProto.INT16:
        return wrap_int16(out)
    return wrap_unsigned(out, to)


def _fold_cast(node: Node, x: np.ndarray) -> np.ndarray | None:
    to = node.attr("to")
    if not dtypes.supported(to) or x.dtype.kind not in "biuf" or \
            to in dtypes.FLOAT_FORMATS or to in dtypes.INT_FORMATS or \
            to == dtypes.FLOAT8E8M0:
        return None
    with np.errstate(all="ignore"):
        return x.astype(dtypes.numpy_dtype(to))


@op("Cast", since=6, attrs=("to", "saturate", "round_mode"), check=_check_cast, fold=_fold_cast)
def cast(node: Node, x: Tensor) -> Tensor:
    return cast_to(x, node.attr("to"), bool(node.attr("saturate", 1)),
                   node.attr("round_mode", "up"))


@op("CastLike", since=15, attrs=("saturate", "round_mode"))
def cast_like(node: Node, x: Tensor, like: Tensor) -> Tensor:
    to = node.in_type(1)
    if to is None:
        return x.cast(like.dtype)
    return cast_to(x, to, bool(node.attr("saturate", 1)), node.attr("round_mode", "up"))


# ---- activations --------------------------------------------------------------------------------
@op("Relu", since=6)
def relu(node: Node, x: Tensor) -> Tensor:
    return x.relu()


@op("Sigmoid", since=6)
def sigmoid(node: Node, x: Tensor) -> Tensor:
    return x.sigmoid()


@op("Tanh", since=6)
def tanh(node: Node, x: Tensor) -> Tensor:
    return x.tanh()


@op("LeakyRelu", since=6, attrs=("alpha",))
def leaky_relu(node: Node, x: Tensor) -> Tensor:
    return x.leaky_relu(node.attr("alpha", 0.01))


@op("PRelu", since=7)
def prelu(node: Node, x: Tensor, slope: Tensor) -> Tensor:
    return where(x.lt(0), x * slope, x)


@op("Elu", since=6, attrs=("alpha",))
def elu(node: Node, x: Tensor) -> Tensor:
    return where(x.gt(0), x, x.expm1() * node.attr("alpha", 1.0))


@op("Celu", since=12, attrs=("alpha",))
def celu(node: Node, x: Tensor) -> Tensor:
    alpha = node.attr("alpha", 1.0)
    return x.maximum(0) + ((x / alpha).expm1() * alpha).minimum(0)


@op("Selu", since=6, attrs=("alpha", "gamma"))
def selu(node: Node, x: Tensor) -> Tensor:
    alpha = node.attr("alpha", 1.67326319217681884765625)
    gamma = node.attr("gamma", 1.05070102214813232421875)
    return where(x.gt(0), x * gamma, x.expm1() * (alpha * gamma))


@op("ThresholdedRelu", since=10, attrs=("alpha",))
def thresholded_relu(node: Node, x: Tensor) -> Tensor:
    return where(x.gt(node.attr("alpha", 1.0)), x, scalar_like(x, 0))


@op("HardSigmoid", since=6, attrs=("alpha", "beta"))
def hard_sigmoid(node: Node, x: Tensor) -> Tensor:
    return (x * node.attr("alpha", 0.2) + node.attr("beta", 0.5)).clip(0, 1)


@op("HardSwish", since=14)
def hard_swish(node: Node, x: Tensor) -> Tensor:
    return x * (x * (1 / 6) + 0.5).clip(0, 1)


@op("Softsign", since=1)
def softsign(node: Node, x: Tensor) -> Tensor:
    return x / (x.abs() + 1)


@op("Softplus", since=1)
def softplus(node: Node, x: Tensor) -> Tensor:
    # log(1 + exp(x)) without overflow: max(x, 0) + log1p(exp(-|x|))
    return x.maximum(0) + (-x.abs()).exp().log1p()


@op("Mish", since=18)
def mish(node: Node, x: Tensor) -> Tensor:
    return x * softplus(node, x).tanh()


@op("Swish", since=24, attrs=("alpha",))
def swish(node: Node, x: Tensor) -> Tensor:
    return x * (x * node.attr("alpha", 1.0)).sigmoid()


@op("Gelu", since=20, attrs=("approximate",),
    check=lambda n: None if n.attr("approximate", "none") in ("none", "tanh")
    else f"approximate must be 'none' or 'tanh', got {n.attr('approximate')!r}")
def gelu(node: Node, x: Tensor) -> Tensor:
    return float_of(x).gelu(node.attr("approximate", "none")).cast(x.dtype)


@op("Shrink", since=9, attrs=("bias", "lambd"))
def shrink(node: Node, x: Tensor) -> Tensor:
    bias, lambd = node.attr("bias", 0.0), node.attr("lambd", 0.5)
    zero = scalar_like(x, 0)
    return where(x.lt(-lambd), x + bias, where(x.gt(lambd), x - bias, zero)).cast(x.dtype)


@op("Clip", since=6, until=10, attrs=("min", "max"))
def clip_attrs(node: Node, x: Tensor) -> Tensor:
    return x.clip(node.attr("min", -3.4028234663852886e38), node.attr("max", 3.4028234663852886e38))


@op("Clip", since=11)
def clip(node: Node, x: Tensor, low: Tensor | None = None, high: Tensor | None = None) -> Tensor:
    out = x
    if low is not None:
        out = out.maximum(low.reshape(()).cast(x.dtype))
    if high is not None:
        out = out.minimum(high.reshape(()).cast(x.dtype))
    return out


# ---- identity, constants --------------------------------------------------------------------
@op("Identity", since=1, fold=lambda node, a: a)
def identity(node: Node, x: Tensor) -> Tensor:
    return x


def _constant_value(node: Node) -> np.ndarray:
    for key, kind in (("value", None), ("value_float", np.float32), ("value_floats", np.float32),
                      ("value_int", np.int64), ("value_ints", np.int64)):
        if node.has(key):
            v = node.attr(key)
            return np.asarray(v) if kind is None else np.asarray(v, dtype=kind)
    node.fail("has none of the attributes value, value_float(s), value_int(s)")


def _check_constant(node: Node) -> str | None:
    if node.has("sparse_value") or node.has("value_string") or node.has("value_strings"):
        return "sparse and string constants are not supported"
    value = node.attrs.get("value")
    if value is not None and value.dtype.kind not in "biuf" and \
            value.dtype.name != "bfloat16":
        return f"constants of NumPy type {value.dtype} are not supported"
    return None


@op("Constant", since=1, attrs=("value", "value_float", "value_floats", "value_int",
                                "value_ints", "sparse_value", "value_string", "value_strings"),
    check=_check_constant, fold=lambda node: _constant_value(node))
def constant(node: Node) -> np.ndarray:
    return _constant_value(node)


__all__ = ["cast_to", "atan", "float_bits", "bits_float", "round_to_format", "round_to_e8m0"]
