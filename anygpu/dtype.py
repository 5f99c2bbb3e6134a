"""Data types and the promotion rules between them (PyTorch's rules where they differ from NumPy's).

>>> from anygpu.dtype import float32, int32, promote
>>> promote(int32, float32).name
'float32'
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, eq=False)
class DType:
    """One instance per type (the module's constants; copies and pickles give them back), so
    equality and hashing are by identity, in C: graph building and the kernel caches compare
    and hash dtypes at every node."""

    name: str
    itemsize: int
    kind: str  # "b" bool, "u" unsigned int, "i" signed int, "f" float
    priority: int  # position in the promotion order within a kind's family
    np: type

    def __repr__(self) -> str:
        return f"anygpu.{self.name}"

    # the kind's tests as plain attributes (read at every graph node)
    is_float: bool = field(init=False)
    is_int: bool = field(init=False)
    is_bool: bool = field(init=False)
    is_unsigned: bool = field(init=False)

    def __post_init__(self) -> None:
        for name, value in (("is_float", self.kind == "f"), ("is_int", self.kind in ("i", "u")),
                            ("is_bool", self.kind == "b"), ("is_unsigned", self.kind == "u")):
            object.__setattr__(self, name, value)

    def __reduce__(self) -> tuple:
        return (_by_name, (self.name,))


bool_ = DType("bool", 1, "b", 0, np.bool_)
uint8 = DType("uint8", 1, "u", 1, np.uint8)
int8 = DType("int8", 1, "i", 2, np.int8)
int32 = DType("int32", 4, "i", 4, np.int32)
uint32 = DType("uint32", 4, "u", 5, np.uint32)  # internal: random bits, hashing
int64 = DType("int64", 8, "i", 6, np.int64)
float16 = DType("float16", 2, "f", 10, np.float16)
bfloat16 = DType("bfloat16", 2, "f", 11, np.uint16)  # host arrays hold the raw bits
float32 = DType("float32", 4, "f", 12, np.float32)


ALL: tuple[DType, ...] = (bool_, uint8, int8, int32, uint32, int64, float16, bfloat16, float32)
PUBLIC: tuple[DType, ...] = (bool_, uint8, int8, int32, int64, float16, bfloat16, float32)
_BY_NAME = {d.name: d for d in ALL} | {"half": float16, "float": float32, "int": int32,
                                       "long": int64, "bf16": bfloat16, "f32": float32,
                                       "f16": float16, "i32": int32, "i64": int64, "i8": int8,
                                       "u8": uint8}


def _by_name(name: str) -> DType:
    return _BY_NAME[name]


default_float = float32
default_int = int64


def to_dtype(x: object) -> DType:
    """A DType from a DType, its name, a NumPy dtype, or a PyTorch dtype."""
    if isinstance(x, DType):
        return x
    if isinstance(x, str):
        key = x.replace("torch.", "").replace("anygpu.", "")
        if key in _BY_NAME:
            return _BY_NAME[key]
        raise TypeError(f"unknown dtype {x!r}; known: {', '.join(d.name for d in PUBLIC)}")
    if hasattr(x, "is_floating_point") or type(x).__module__.startswith("torch"):
        return to_dtype(str(x))
    try:
        npd = np.dtype(x)  # type: ignore[call-overload]
    except TypeError as err:
        raise TypeError(f"cannot interpret {x!r} as a dtype") from err
    return from_numpy(npd)


def from_numpy(npd: np.dtype) -> DType:
    """The dtype a NumPy array of ``npd`` becomes (float64 -> float32, as PyTorch's default)."""
    table = {np.dtype(np.bool_): bool_, np.dtype(np.uint8): uint8, np.dtype(np.int8): int8,
             np.dtype(np.int16): int32, np.dtype(np.int32): int32, np.dtype(np.uint32): uint32,
             np.dtype(np.int64): int64, np.dtype(np.uint16): int32, np.dtype(np.uint64): int64,
             np.dtype(np.float16): float16, np.dtype(np.float32): float32,
             np.dtype(np.float64): float32}
    if npd in table:
        return table[npd]
    raise TypeError(f"NumPy dtype {npd} has no anygpu equivalent")


def promote(a: DType, b: DType) -> DType:
    """The dtype of a binary op on tensors of dtypes a and b (PyTorch's type promotion)."""
    if a == b:
        return a
    if a.kind == "f" and b.kind == "f":
        if {a, b} == {float16, bfloat16}:
            return float32
        return a if a.priority > b.priority else b
    if a.kind == "f" or b.kind == "f":
        return a if a.kind == "f" else b
    if a.is_bool or b.is_bool:
        return b if a.is_bool else a
    # two integer types: the wider; mixed signedness of equal width widens (u8+i8 -> int32 here,
    # since int16 is not offered)
    if a.itemsize == b.itemsize:
        return int32 if a.itemsize == 1 else int64
    return a if a.itemsize > b.itemsize else b


def _category(d: DType) -> int:
    return 0 if d.is_bool else 2 if d.is_float else 1


def promote_tensors(a: DType, a_is_0d: bool, b: DType, b_is_0d: bool) -> DType:
    """PyTorch's promotion between tensors: a 0-d tensor takes part only when it is of a higher
    category (bool < integer < float) than the tensor with dimensions (int32 + 0-d int64 is
    int32; float16 * 0-d float32 is float16; int32 * 0-d float32 is float32)."""
    if a_is_0d != b_is_0d:
        dim, zero = (b, a) if a_is_0d else (a, b)
        return dim if _category(zero) <= _category(dim) else zero
    return promote(a, b)


def scalar_dtype(value: object, other: DType) -> DType:
    """The dtype a Python scalar takes when combined with a tensor of dtype ``other``."""
    if isinstance(value, (bool, np.bool_)):
        return other
    if isinstance(value, (int, np.integer)):
        return other if not other.is_bool else default_int
    if isinstance(value, (float, np.floating)):
        return other if other.is_float else default_float
    raise TypeError(f"unsupported scalar {value!r} of type {type(value).__name__}")


def wrap_int(value: int, dtype: DType) -> int:
    """``value`` wrapped into an integer dtype, as two's-complement arithmetic would (a bool
    stays as it is)."""
    if dtype.is_bool:
        return value
    bits = 8 * dtype.itemsize
    value &= (1 << bits) - 1
    return value - (1 << bits) if not dtype.is_unsigned and value >= 1 << (bits - 1) else value


def min_value(d: DType) -> float | int | bool:
    if d.is_float:
        return float("-inf")
    if d.is_bool:
        return False
    return int(np.iinfo(d.np).min)


def max_value(d: DType) -> float | int | bool:
    if d.is_float:
        return float("inf")
    if d.is_bool:
        return True
    return int(np.iinfo(d.np).max)
