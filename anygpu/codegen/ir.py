"""The loop-level kernel IR: expressions, statements and a kernel, close to C.

Expressions are hash-consed (building the same expression twice gives the same object), so the
renderer sees shared subexpressions as shared objects and declares each once.

Expression ops:
  const (arg value), var (arg name), special (arg "lid" | "gid" | "ngroups", or one of
  ``SUBGROUP_SPECIALS``), load (arg buffer name; srcs (index,) or (index, guard): a guarded load
  reads 0 when the guard is false), cast (to the expression's dtype), where (cond, a, b),
  subgroup_reduce (see :func:`subgroup_reduce`), pack_halves (see :func:`pack_halves`), halves2
  (see :func:`halves2`), and the arithmetic of ``ALU_OPS``. Values of
  dtype float16/bfloat16 are computed in float32 by the renderers and rounded where they are cast
  or stored.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Any, Callable, ClassVar

from anygpu.dtype import DType, bool_, int32, int64, uint32, wrap_int

ALU_OPS = {"neg", "exp2", "log2", "sin", "sqrt", "recip", "trunc", "not", "add", "sub", "mul",
           "div", "idiv", "mod", "max", "min", "lt", "eq", "ne", "and", "or", "xor", "shl",
           "shr", "where", "cast"}
# a thread's place among the subgroups of a device whose subgroup size is its own choice
# (OpenCL, WebGPU): its lane, its subgroup's index, the number of subgroups in the work-group and
# the lanes of its subgroup
SUBGROUP_SPECIALS = ("sg_lane", "sg_id", "sg_count", "sg_size")


class Expr:
    __slots__ = ("op", "dtype", "srcs", "arg", "__weakref__")
    # set once in __new__; annotations only, so the slots stay the storage
    op: str
    dtype: DType
    srcs: tuple[Expr, ...]
    arg: Any
    # hash-consing table; weak, so kernels that are done with their expressions free them
    _table: ClassVar[weakref.WeakValueDictionary[tuple, Expr]] = weakref.WeakValueDictionary()

    def __new__(cls, op: str, dtype: DType, srcs: tuple[Expr, ...] = (), arg: Any = None) -> Expr:
        # floats are keyed by their text: NaN != NaN would never share, and -0.0 == 0.0 would
        # share a zero of the wrong sign (x / -0.0 is -inf)
        key_arg = repr(arg) if isinstance(arg, float) else arg
        key = (op, dtype, tuple(id(s) for s in srcs), key_arg)
        hit = cls._table.get(key)
        if hit is not None:
            return hit
        self = object.__new__(cls)
        self.op, self.dtype, self.srcs, self.arg = op, dtype, srcs, arg
        cls._table[key] = self
        return self

    def __reduce__(self) -> tuple:
        # unpickled through __new__, so the copy is the table's own expression
        return Expr, (self.op, self.dtype, self.srcs, self.arg)

    def __repr__(self) -> str:
        if self.op in ("const", "var", "special"):
            return f"{self.op}({self.arg!r}:{self.dtype.name})"
        return f"{self.op}({', '.join(map(repr, self.srcs))})"

    # small builders that fold constants, used by the lowering
    def __add__(self, other: "Expr | int") -> "Expr":
        return alu("add", self, other)

    def __mul__(self, other: "Expr | int") -> "Expr":
        return alu("mul", self, other)

    def __lt__(self, other: "Expr | int") -> "Expr":
        return alu("lt", self, other)


def const(value: Any, dtype: DType) -> Expr:
    if dtype.is_bool:
        value = bool(value)
    elif dtype.is_float:
        value = float(value)
    else:
        value = int(value)
    return Expr("const", dtype, (), value)


def var(name: str, dtype: DType = int32) -> Expr:
    return Expr("var", dtype, (), name)


def special(name: str) -> Expr:
    return Expr("special", int32, (), name)


def _as_expr(x: "Expr | int | float | bool", like: Expr) -> Expr:
    return x if isinstance(x, Expr) else const(x, like.dtype)


# integer operators on constants as C computes them (truncating division, a remainder with the
# dividend's sign; 0 for a division by zero, which callers that fold code leave alone)
INT_FOLDS: dict[str, Callable[..., int]] = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "idiv": lambda a, b: int(a / b) if b else 0,
    "mod": lambda a, b: a - int(a / b) * b if b else 0,
    "lt": lambda a, b: int(a < b), "eq": lambda a, b: int(a == b), "ne": lambda a, b: int(a != b),
    "shl": lambda a, b: a << b, "shr": lambda a, b: a >> b, "and": lambda a, b: a & b,
    "or": lambda a, b: a | b, "xor": lambda a, b: a ^ b, "max": max,
    "not": lambda a: int(not a), "neg": lambda a: -a, "where": lambda c, a, b: a if c else b}


# integer operators whose operands C would bring to a common type; an int32 operand (a
# work-group or thread id) beside an int64 one (the index of a kernel past 2**31 elements) is
# widened, so that the result is int64 in every dialect (WGSL has no implicit conversion, and
# C's declared int would truncate it)
_WIDENED = frozenset({"add", "sub", "mul", "idiv", "mod", "max", "lt", "eq", "ne"})


def alu(op: str, a: Expr, *rest: "Expr | int | float") -> Expr:
    srcs = (a, *[_as_expr(r, a) for r in rest])
    if op in _WIDENED and len(srcs) == 2 and {srcs[0].dtype, srcs[1].dtype} == {int32, int64}:
        srcs = tuple(s if s.dtype == int64 else cast(s, int64) for s in srcs)
        a = srcs[0]
    dtype = bool_ if op in ("lt", "eq", "ne") else srcs[-1].dtype if op == "where" else a.dtype
    if op in ("add", "mul", "sub") and all(s.op == "const" for s in srcs) and not dtype.is_float:
        x, y = srcs[0].arg, srcs[1].arg
        value = x + y if op == "add" else x * y if op == "mul" else x - y
        return const(wrap_int(value, dtype), dtype)
    if op == "add":  # x + 0 is x; for floats only x + -0.0 (-0.0 + 0.0 is +0.0)
        if srcs[1].op == "const" and _additive_identity(srcs[1].arg, dtype):
            return a
        if a.op == "const" and _additive_identity(a.arg, dtype):
            return srcs[1]
    if op == "mul" and not dtype.is_float:
        if srcs[1].op == "const" and srcs[1].arg == 1:
            return a
        if a.op == "const" and a.arg == 1:
            return srcs[1]
        if srcs[1].op == "const" and srcs[1].arg == 0:
            return srcs[1]
    if op == "and" and dtype == bool_:
        if srcs[1].op == "const":
            return a if srcs[1].arg else srcs[1]
        if a.op == "const":
            return srcs[1] if a.arg else a
    if op == "where" and a.op == "const":
        return srcs[1] if a.arg else srcs[2]
    if op in ("eq", "lt") and srcs[1] is a and not a.dtype.is_float:  # exact without NaN
        return const(op == "eq", bool_)
    if op == "not" and a.op == "const":
        return const(not a.arg, bool_)
    return Expr(op, dtype, srcs)


def _additive_identity(value: Any, dtype: DType) -> bool:
    if not dtype.is_float:
        return value == 0
    return isinstance(value, (int, float)) and value == 0 and math.copysign(1.0, value) < 0


def cast(x: Expr, dtype: DType) -> Expr:
    if x.dtype == dtype:
        return x
    if x.op == "const":
        return const(x.arg, dtype)
    return Expr("cast", dtype, (x,))


def load(buf: str, dtype: DType, index: Expr, guard: Expr | None = None) -> Expr:
    return Expr("load", dtype, (index,) if guard is None else (index, guard), buf)


def pack_halves(low: Expr, high: Expr, dtype: DType) -> Expr:
    """One 32-bit word (uint32) holding ``low`` and ``high`` rounded to ``dtype`` (float16 or
    bfloat16), ``low`` in its low half: a tensor-core fragment register (CUDA only)."""
    return Expr("pack_halves", uint32, (low, high), dtype)


def halves2(op: str, a: Expr, b: Expr, dtype: DType) -> Expr:
    """``op`` ("sub" or "mul") of the two 16-bit floats of ``dtype`` (float16 or bfloat16)
    packed in each of the words ``a`` and ``b`` (uint32, as ``pack_halves`` makes them), pair
    by pair, rounded to ``dtype``: one word (CUDA only)."""
    return Expr("halves2", uint32, (a, b), (op, dtype))


def subgroup_reduce(op: str, value: Expr, width: int | None = None) -> Expr:
    """``op`` ("add", "max" or "mul", as ``alu``) of ``value`` over lanes of a subgroup, every
    lane receiving the result: over each aligned group of ``width`` neighbouring lanes (a power
    of two, at most the warp's size: the lanes of a CUDA or HIP warp exchanged by shuffles), or
    over the whole subgroup where ``width`` is None (whatever its size: OpenCL's and WebGPU's
    subgroup operations). Every lane of the subgroup must reach it (no divergent branch around
    it); the lowering uses it only for the dtypes a dialect lists in its ``subgroup_ops``."""
    return Expr("subgroup_reduce", value.dtype, (value,), (op, width))


def substitute(e: Expr, mapping: dict[str, Expr], memo: dict[int, Expr] | None = None) -> Expr:
    """``e`` with the variables named in ``mapping`` replaced (constants fold again)."""
    memo = {} if memo is None else memo
    hit = memo.get(id(e))
    if hit is not None:
        return hit
    if e.op == "var":
        out = mapping.get(e.arg, e)
    elif not e.srcs:
        out = e
    else:
        srcs = tuple(substitute(s, mapping, memo) for s in e.srcs)
        if all(a is b for a, b in zip(srcs, e.srcs)):
            out = e
        elif e.op == "cast":
            out = cast(srcs[0], e.dtype)
        elif e.op == "load":
            out = load(e.arg, e.dtype, srcs[0], srcs[1] if len(srcs) > 1 else None)
        elif e.op == "subgroup_reduce":
            out = subgroup_reduce(e.arg[0], srcs[0], e.arg[1])
        elif e.op in ("pack_halves", "halves2"):
            out = Expr(e.op, e.dtype, srcs, e.arg)
        else:
            out = alu(e.op, *srcs)
    memo[id(e)] = out
    return out


def rename_buffers(e: Expr, names: dict[str, str], memo: dict[int, Expr] | None = None) -> Expr:
    """``e`` with loads from the buffers in ``names`` reading the renamed buffers."""
    memo = {} if memo is None else memo
    hit = memo.get(id(e))
    if hit is not None:
        return hit
    srcs = tuple(rename_buffers(s, names, memo) for s in e.srcs)
    arg = names.get(e.arg, e.arg) if e.op == "load" else e.arg
    out = e if arg == e.arg and all(a is b for a, b in zip(srcs, e.srcs)) else \
        Expr(e.op, e.dtype, srcs, arg)
    memo[id(e)] = out
    return out


# ---- statements -------------------------------------------------------------------------------
@dataclass
class Decl:
    name: str
    dtype: DType
    init: Expr


@dataclass
class Assign:
    name: str
    value: Expr


@dataclass
class Store:
    buf: str
    index: Expr
    value: Expr


@dataclass
class For:
    name: str
    start: Expr
    stop: Expr
    step: Expr
    body: list["Stmt"]
    parallel: bool = False  # iterations may run on separate threads (cpu)
    reduction: tuple[str, str] | None = None  # (op, accumulator) combined across threads (cpu)


@dataclass
class If:
    cond: Expr
    body: list["Stmt"]


@dataclass
class Barrier:
    pass


@dataclass
class LocalArray:
    name: str
    dtype: DType
    size: int
    stored: bool = False  # elements kept in the dtype's storage type (half for float16), not
    # its compute type: what tensor-core operands read


@dataclass
class VecLoad:
    """Declares ``names`` from consecutive elements ``buf[index + i]`` of a local array, or of
    a kernel parameter (``dtype``: its stored dtype), in one vector load where the dialect has
    one (``index`` is a multiple of ``len(names)``). ``dtype`` uint32 on a parameter of 16-bit
    elements (CUDA) declares the raw 32-bit words, two elements each, from element ``index``
    on: tensor-core fragment registers."""

    names: list[str]
    dtype: DType
    buf: str
    index: Expr


@dataclass
class VecStore:
    """Stores ``values`` into consecutive elements ``buf[index + i]`` of a kernel parameter
    (``dtype``: its stored dtype) in one vector store where the dialect has one: ``index`` is a
    multiple of ``len(values)``, which span 4, 8 or 16 bytes."""

    buf: str
    dtype: DType
    index: Expr
    values: list[Expr]


@dataclass
class Mma:
    """A warp's matrix multiply-accumulate on tensor cores (CUDA's ``mma.sync``): ``acc`` (four
    float32 variables per thread) += A (16 x k) @ B (k x 8), with ``shape`` "m16n8k16" (float16,
    bfloat16) or "m16n8k8" (tf32 from float32). ``a`` and ``b`` give each thread's fragment
    registers (32 bits each: two halves, or one float32): a local-array element ``(buf,
    index)``, or the name of a register that :class:`LdMatrix` declared."""

    shape: str
    dtype: DType
    acc: list[str]
    a: Sequence[tuple[str, Expr] | str]
    b: Sequence[tuple[str, Expr] | str]


@dataclass
class LdMatrix:
    """Declares ``names`` (four 32-bit registers) from four 8 x 8 matrices of 16-bit elements in
    local array ``buf`` (CUDA's ``ldmatrix``): a warp's lanes 8q to 8q+7 each give in ``index``
    the first element of one row of matrix q, and each lane receives two neighbouring elements
    of each matrix, in the layout of an ``Mma`` fragment; ``trans`` transposes the matrices."""

    names: list[str]
    buf: str
    index: Expr
    trans: bool = False


@dataclass
class AsyncCopy:
    """Starts copying 16 bytes from ``src[src_index]`` on (a kernel parameter) to
    ``dst[dst_index]`` on (a local array), bypassing registers (CUDA's ``cp.async``); the bytes
    are zeros where ``valid`` is false. The copy is complete after the :class:`AsyncWait` that
    follows the :class:`AsyncCommit` closing its group."""

    dst: str
    dst_index: Expr
    src: str
    src_index: Expr
    valid: Expr


@dataclass
class AsyncCommit:
    """Closes the group of async copies this thread started since the last commit."""


@dataclass
class AsyncWait:
    """Waits until at most ``pending`` of this thread's committed groups are in flight (a
    barrier then makes every thread's finished copies visible to the group)."""

    pending: int


@dataclass
class Wgmma:
    """A warpgroup's (4 consecutive warps') asynchronous matrix multiply-accumulate on Hopper's
    tensor cores (CUDA's ``wgmma.mma_async``, sm_90a): ``acc`` (``n / 2`` float32 variables per
    thread) += A (64 x 16) @ B (16 x ``n``) of float16 or bfloat16 (64 x 8 and 8 x ``n`` of
    float32 as tf32). Both operands are read from local memory, from tiles of lines of 128
    bytes (64 halves, 32 floats) swizzled by 128 bytes in atoms
    of 8 lines (16-byte chunk c of line r stored at chunk c ^ (r % 8); tiles start on
    1024-byte boundaries). A line runs along k, or with ``trans`` along the operand's rows
    (A's m, B's n), the next 64 of them ``lbo`` bytes further. ``a`` and ``b`` give the element
    (local array, index) where the fragment begins. ``acc`` holds the result after a
    ``WgmmaSync("wait")``."""

    n: int
    dtype: DType
    acc: list[str]
    a: tuple[str, Expr]
    b: tuple[str, Expr]
    trans: tuple[bool, bool] = (False, False)
    lbo: tuple[int, int] = (16, 16)


@dataclass
class WgmmaSync:
    """Ordering around :class:`Wgmma`. ``op``: "fence" before a warpgroup's first wgmma (its
    accumulators written otherwise); "commit" closes the group of wgmmas issued since the last;
    "wait" waits until at most ``pending`` groups are in flight, after which ``acc`` may be
    read; "proxy" makes this thread's completed writes to local memory (``AsyncCopy`` included)
    visible to the tensor cores' reads, before the barrier that publishes them."""

    op: str
    pending: int = 0
    acc: list[str] = field(default_factory=list)


Stmt = (Decl | Assign | Store | For | If | Barrier | LocalArray | VecLoad | VecStore | Mma
        | LdMatrix | AsyncCopy | AsyncCommit | AsyncWait | Wgmma | WgmmaSync)
# the statements only some dialects render (``async_stmt`` of the renderers)
AsyncStmt = LdMatrix | AsyncCopy | AsyncCommit | AsyncWait | Wgmma | WgmmaSync


@dataclass
class Param:
    name: str
    dtype: DType  # element dtype as stored
    written: bool


@dataclass
class Kernel:
    name: str
    params: list[Param]
    body: list[Stmt]
    groups: int = 1  # number of work-groups (flat; renderers/launchers fold it to 2-D if needed)
    local: int = 1  # threads per work-group
    meta: dict[str, Any] = field(default_factory=dict)  # bytes moved etc., for ANYGPU_DEBUG

    @property
    def local_names(self) -> set[str]:
        return {s.name for s in self.body if isinstance(s, LocalArray)}

