"""ONNX element types and how anygpu stores them.

anygpu has no float64, int16, uint16, uint32 or uint64 tensors, so an ONNX value of such a type
lives on the device in the nearest wider (or, for float64, the float) type anygpu has, and is
converted back to its declared type when it leaves the model: DOUBLE computes in float32
(the node tests compare at a relative 1e-3), INT16 and UINT16 in int32, UINT32 in int64,
UINT64 in int64 (values past 2**63 wrap). The 8- and 4-bit floats live in float32 and the
4- and 2-bit integers in int8 or uint8, their values exact there. Strings, complex numbers
and the 6-bit floats are not supported.

>>> from onnx import TensorProto
>>> storage(TensorProto.DOUBLE).name
'float32'
>>> numpy_dtype(TensorProto.UINT16)
dtype('uint16')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from onnx import TensorProto, helper

from anygpu import dtype as dt
from anygpu.dtype import DType

def _code(name: str) -> int:
    """An element type's number, or -1 where the installed onnx predates the type."""
    return int(getattr(TensorProto, name, -1))


FLOAT8E4M3FN, FLOAT8E4M3FNUZ = _code("FLOAT8E4M3FN"), _code("FLOAT8E4M3FNUZ")
FLOAT8E5M2, FLOAT8E5M2FNUZ = _code("FLOAT8E5M2"), _code("FLOAT8E5M2FNUZ")
FLOAT8E8M0, FLOAT4E2M1 = _code("FLOAT8E8M0"), _code("FLOAT4E2M1")
INT4, UINT4, INT2, UINT2 = _code("INT4"), _code("UINT4"), _code("INT2"), _code("UINT2")

_STORAGE: dict[int, DType] = {
    TensorProto.FLOAT: dt.float32,
    TensorProto.DOUBLE: dt.float32,
    TensorProto.FLOAT16: dt.float16,
    TensorProto.BFLOAT16: dt.bfloat16,
    TensorProto.INT8: dt.int8,
    TensorProto.UINT8: dt.uint8,
    TensorProto.INT16: dt.int32,
    TensorProto.UINT16: dt.int32,
    TensorProto.INT32: dt.int32,
    TensorProto.UINT32: dt.int64,
    TensorProto.INT64: dt.int64,
    TensorProto.UINT64: dt.int64,
    TensorProto.BOOL: dt.bool_,
    # narrow formats, held exactly in wider storage: every value of theirs is a float32 (an
    # int8, a uint8); casts round onto their grid (ops/elementwise.py)
    FLOAT8E4M3FN: dt.float32,
    FLOAT8E4M3FNUZ: dt.float32,
    FLOAT8E5M2: dt.float32,
    FLOAT8E5M2FNUZ: dt.float32,
    FLOAT4E2M1: dt.float32,
    FLOAT8E8M0: dt.float32,
    INT4: dt.int8,
    INT2: dt.int8,
    UINT4: dt.uint8,
    UINT2: dt.uint8,
}
_STORAGE.pop(-1, None)  # the types an older onnx does not define


@dataclass(frozen=True)
class FloatFormat:
    """A narrow float format: mantissa bits, smallest normal exponent, largest finite value,
    whether it has infinities, negative zero, and NaN (else it saturates)."""

    mantissa: int
    min_exponent: int
    max_value: float
    has_inf: bool
    has_nan: bool


FLOAT_FORMATS: dict[int, FloatFormat] = {
    FLOAT8E4M3FN: FloatFormat(3, -6, 448.0, False, True),
    FLOAT8E4M3FNUZ: FloatFormat(3, -7, 240.0, False, True),
    FLOAT8E5M2: FloatFormat(2, -14, 57344.0, True, True),
    FLOAT8E5M2FNUZ: FloatFormat(2, -15, 57344.0, False, True),
    FLOAT4E2M1: FloatFormat(1, 0, 6.0, False, False),
}
FLOAT_FORMATS.pop(-1, None)

# narrow integers: their bits and signedness (held in int8 / uint8)
INT_FORMATS: dict[int, tuple[int, bool]] = {
    INT4: (4, True), UINT4: (4, False),
    INT2: (2, True), UINT2: (2, False),
}
INT_FORMATS.pop(-1, None)

# the bits an unsigned type stored in a wider signed one keeps (a cast wraps to them)
UNSIGNED_BITS: dict[int, int] = {TensorProto.UINT16: 16, TensorProto.UINT32: 32}


class UnsupportedTypeError(TypeError):
    """An ONNX element type anygpu cannot hold."""


def name(elem_type: int) -> str:
    """The ONNX name of an element type ("FLOAT", "INT64", ...)."""
    try:
        return TensorProto.DataType.Name(elem_type)
    except ValueError:
        return f"<unknown element type {elem_type}>"


def supported(elem_type: int) -> bool:
    return elem_type in _STORAGE


def storage(elem_type: int) -> DType:
    """The anygpu dtype that holds values of an ONNX element type."""
    if elem_type not in _STORAGE:
        raise UnsupportedTypeError(f"element type {name(elem_type)} is not supported (supported: "
                                   f"{', '.join(name(t) for t in _STORAGE)})")
    return _STORAGE[elem_type]


def numpy_dtype(elem_type: int) -> np.dtype:
    """The NumPy dtype ONNX Runtime uses for an element type (ml_dtypes' for bfloat16)."""
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))


def elem_type_of(array: np.ndarray) -> int:
    """The ONNX element type of a NumPy array (bool, integers, floats, ml_dtypes' bfloat16)."""
    try:
        return int(helper.np_dtype_to_tensor_dtype(array.dtype))
    except (KeyError, ValueError, TypeError) as err:
        raise UnsupportedTypeError(f"no ONNX element type for NumPy dtype {array.dtype}") from err


def elem_type_of_storage(d: DType) -> int:
    """The ONNX element type whose storage is exactly ``d`` (float32 -> FLOAT, ...)."""
    for t, s in _STORAGE.items():
        if s == d and t not in (TensorProto.DOUBLE, TensorProto.INT16, TensorProto.UINT16,
                                TensorProto.UINT32, TensorProto.UINT64):
            return t
    raise UnsupportedTypeError(f"no ONNX element type stored as {d.name}")


def to_storage(array: np.ndarray, elem_type: int) -> np.ndarray:
    """A host array of ``elem_type`` in the NumPy dtype of its storage (bfloat16 as float32
    values, which ``anygpu.tensor(..., dtype=bfloat16)`` rounds exactly)."""
    d = storage(elem_type)
    if d == dt.bfloat16:
        return np.asarray(array).astype(np.float32)
    return np.asarray(array).astype(d.np)


def from_storage(array: np.ndarray, elem_type: int) -> np.ndarray:
    """A host array read from the device (its storage dtype; bfloat16 as float32) as the
    NumPy dtype of ``elem_type``; unsigned values held in wider signed storage wrap back."""
    want = numpy_dtype(elem_type)
    array = np.asarray(array)
    if array.dtype == want:
        return array
    if elem_type in FLOAT_FORMATS or elem_type in INT_FORMATS or elem_type == FLOAT8E8M0:
        return array.astype(want)  # the values already lie on the format's grid
    if want.kind == "u" and array.dtype.kind == "i":
        return array.astype(np.int64).astype(want)
    return array.astype(want)


def host_value(value: Any, elem_type: int) -> np.ndarray:
    """A Python value (a number, a list) as an array of ``elem_type``."""
    return np.asarray(value, dtype=numpy_dtype(elem_type))


__all__ = ["storage", "numpy_dtype", "name", "supported", "elem_type_of", "elem_type_of_storage",
           "to_storage", "from_storage", "host_value", "UnsupportedTypeError", "UNSIGNED_BITS",
           "FLOAT_FORMATS", "INT_FORMATS", "FloatFormat", "FLOAT8E8M0", "FLOAT4E2M1", "INT4",
           "UINT4", "INT2", "UINT2"]
