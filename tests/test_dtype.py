"""Dtypes: names, conversions and PyTorch's promotion rules."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from anygpu import dtype as dt

TORCH = {dt.bool_: torch.bool, dt.uint8: torch.uint8, dt.int8: torch.int8, dt.int32: torch.int32,
         dt.int64: torch.int64, dt.float16: torch.float16, dt.bfloat16: torch.bfloat16,
         dt.float32: torch.float32}


@pytest.mark.parametrize("a,b", list(itertools.product(dt.PUBLIC, repeat=2)))
def test_promote_matches_torch(a: dt.DType, b: dt.DType) -> None:
    got = dt.promote(a, b)
    assert got == dt.promote(b, a)
    if {a, b} == {dt.uint8, dt.int8}:
        assert got == dt.int32  # PyTorch says int16, which anygpu does not offer
        return
    want = torch.promote_types(TORCH[a], TORCH[b])
    assert TORCH[got] == want


@pytest.mark.parametrize("name,want", [
    ("float32", dt.float32), ("float", dt.float32), ("half", dt.float16), ("bf16", dt.bfloat16),
    ("torch.int64", dt.int64), ("anygpu.uint8", dt.uint8), ("long", dt.int64), ("bool", dt.bool_),
    ("i8", dt.int8), ("int", dt.int32)])
def test_to_dtype_from_names(name: str, want: dt.DType) -> None:
    assert dt.to_dtype(name) is want


def test_to_dtype_from_other_libraries() -> None:
    assert dt.to_dtype(np.float16) == dt.float16
    assert dt.to_dtype(np.dtype("int8")) == dt.int8
    assert dt.to_dtype(torch.bfloat16) == dt.bfloat16
    assert dt.to_dtype(torch.int32) == dt.int32
    assert dt.to_dtype(dt.uint8) is dt.uint8


def test_to_dtype_errors() -> None:
    with pytest.raises(TypeError, match="unknown dtype 'complex64'"):
        dt.to_dtype("complex64")
    with pytest.raises(TypeError):
        dt.to_dtype(object())
    with pytest.raises(TypeError, match="no anygpu equivalent"):
        dt.to_dtype(np.complex64)


def test_from_numpy() -> None:
    assert dt.from_numpy(np.dtype(np.float64)) == dt.float32
    assert dt.from_numpy(np.dtype(np.int16)) == dt.int32
    assert dt.from_numpy(np.dtype(np.bool_)) == dt.bool_
    assert dt.from_numpy(np.dtype(np.uint8)) == dt.uint8


@pytest.mark.parametrize("value,other,want", [
    (True, dt.int8, dt.int8), (3, dt.bool_, dt.int64), (3, dt.uint8, dt.uint8),
    (3, dt.float16, dt.float16), (2.5, dt.int32, dt.float32), (2.5, dt.bfloat16, dt.bfloat16),
    (np.float32(1), dt.int64, dt.float32), (np.int64(1), dt.int8, dt.int8)])
def test_scalar_dtype(value: object, other: dt.DType, want: dt.DType) -> None:
    assert dt.scalar_dtype(value, other) == want


def test_scalar_dtype_rejects_other_types() -> None:
    with pytest.raises(TypeError, match="unsupported scalar"):
        dt.scalar_dtype("1", dt.float32)


def test_limits() -> None:
    assert dt.min_value(dt.int8) == -128 and dt.max_value(dt.uint8) == 255
    assert dt.min_value(dt.float16) == float("-inf") and dt.max_value(dt.float32) == float("inf")
    assert dt.min_value(dt.bool_) is False and dt.max_value(dt.bool_) is True
    assert dt.max_value(dt.int64) == 2**63 - 1


def test_properties() -> None:
    assert dt.float16.is_float and not dt.float16.is_int
    assert dt.uint8.is_int and dt.uint8.is_unsigned and not dt.int8.is_unsigned
    assert dt.bool_.is_bool and not dt.bool_.is_int
    assert repr(dt.bfloat16) == "anygpu.bfloat16"
    assert [d.itemsize for d in dt.PUBLIC] == [1, 1, 1, 4, 8, 2, 2, 4]


def test_dtypes_are_single_instances_through_copies_and_pickles() -> None:
    """Equality and hashing of dtypes are by identity (graph building and the kernel caches
    compare them at every node), so copies and pickles must give the module's instances."""
    import copy
    import pickle

    from anygpu import dtype as dt

    for d in dt.ALL:
        assert copy.copy(d) is d and copy.deepcopy(d) is d
        assert pickle.loads(pickle.dumps(d)) is d
        assert dt.to_dtype(d.name) is d and {d: 1}[dt.to_dtype(d.name)] == 1
    assert dt.float16 != dt.bfloat16 and len(set(dt.ALL)) == len(dt.ALL)
