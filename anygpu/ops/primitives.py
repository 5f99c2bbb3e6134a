"""The closed set of primitive ops. Everything else in anygpu is a composite of these.

Each primitive has a kind (what the scheduler and code generator do with it) and a rule for its
result dtype. Shapes follow from the kind: elementwise ops keep the (broadcast) shape of their
sources, reductions keep the reduced axes with size 1, movement ops say their new shape in ``arg``.
"""

from __future__ import annotations

from enum import Enum

from anygpu.dtype import DType, bool_


class Op(Enum):
    # members are singletons: identity hashing (in C) instead of Enum's hash of the name (a
    # Python call), which the scheduler's set and dict lookups paid for every graph node
    __hash__ = object.__hash__

    # leaves
    BUFFER = "buffer"  # realized device memory
    CONST = "const"  # one value broadcast to a shape; arg = the value
    IOTA = "iota"  # 0, 1, 2, ... along a 1-D shape (integer dtype)
    GATHER = "gather"  # out[o] = src[o with o[axis] := index[o]]; arg = axis
    # unary elementwise
    NEG = "neg"
    EXP2 = "exp2"
    LOG2 = "log2"
    SIN = "sin"
    SQRT = "sqrt"
    RECIP = "recip"
    TRUNC = "trunc"  # round toward zero, keeps float dtype
    NOT = "not"  # logical not of a bool
    CAST = "cast"  # arg = target dtype
    # binary elementwise
    ADD = "add"
    MUL = "mul"
    DIV = "div"  # true division (floats)
    IDIV = "idiv"  # integer division toward zero; x / 0 is 0, MIN / -1 wraps (never traps)
    MOD = "mod"  # remainder with the dividend's sign (C's % and fmod); see IDIV for ints
    MAX = "max"
    CMPLT = "cmplt"
    CMPEQ = "cmpeq"
    AND = "and"
    OR = "or"
    XOR = "xor"
    SHL = "shl"
    SHR = "shr"
    # ternary
    WHERE = "where"
    # reductions over axes (arg = tuple of axes, kept with size 1)
    SUM = "sum"
    RMAX = "rmax"
    PROD = "prod"
    # movement (views: no kernel of their own)
    RESHAPE = "reshape"  # arg = new shape
    PERMUTE = "permute"  # arg = axis order
    EXPAND = "expand"  # arg = new shape (size-1 axes grow)
    PAD = "pad"  # arg = ((before, after), ...) zeros outside
    SHRINK = "shrink"  # arg = ((start, stop), ...)
    FLIP = "flip"  # arg = tuple of axes
    # scheduling boundaries
    CONTIGUOUS = "contiguous"  # materialize into a buffer of its own
    COPY = "copy"  # transfer to another device; arg = device name


UNARY = {Op.NEG, Op.EXP2, Op.LOG2, Op.SIN, Op.SQRT, Op.RECIP, Op.TRUNC, Op.NOT, Op.CAST}
BINARY = {Op.ADD, Op.MUL, Op.DIV, Op.IDIV, Op.MOD, Op.MAX, Op.CMPLT, Op.CMPEQ, Op.AND, Op.OR,
          Op.XOR, Op.SHL, Op.SHR}
TERNARY = {Op.WHERE}
ELEMENTWISE = UNARY | BINARY | TERNARY
REDUCE = {Op.SUM, Op.RMAX, Op.PROD}
MOVEMENT = {Op.RESHAPE, Op.PERMUTE, Op.EXPAND, Op.PAD, Op.SHRINK, Op.FLIP}
COMPARISON = {Op.CMPLT, Op.CMPEQ}
FLOAT_ONLY = {Op.EXP2, Op.LOG2, Op.SIN, Op.SQRT, Op.RECIP, Op.TRUNC, Op.DIV}
INT_ONLY = {Op.IDIV, Op.XOR, Op.SHL, Op.SHR}


def result_dtype(op: Op, src_dtypes: list[DType], arg: object = None) -> DType:
    """The dtype of an elementwise primitive, after checking its operands."""
    if op is Op.CAST:
        assert isinstance(arg, DType)
        return arg
    if op in COMPARISON:
        return bool_
    if op is Op.WHERE:
        if src_dtypes[0] != bool_:
            raise TypeError(f"where: condition must be bool, got {src_dtypes[0].name}")
        if src_dtypes[1] != src_dtypes[2]:
            raise TypeError(f"where: branches differ ({src_dtypes[1].name}, {src_dtypes[2].name})")
        return src_dtypes[1]
    first = src_dtypes[0]
    if any(d != first for d in src_dtypes):
        raise TypeError(f"{op.value}: operand dtypes differ: {[d.name for d in src_dtypes]}")
    if op in FLOAT_ONLY and not first.is_float:
        raise TypeError(f"{op.value} needs a floating-point operand, got {first.name}")
    if op in INT_ONLY and first.is_float:
        raise TypeError(f"{op.value} needs an integer operand, got {first.name}")
    if op is Op.NOT and first != bool_:
        raise TypeError(f"not needs a bool operand, got {first.name}")
    return first
