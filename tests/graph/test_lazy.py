"""Graph nodes: shapes, folding at build time, and the checks on every primitive."""

from __future__ import annotations

import pytest

from anygpu import dtype as dt
from anygpu.graph.lazy import Lazy, movement_shape
from anygpu.ops.primitives import Op, result_dtype


def const(shape: tuple[int, ...], value: float = 1.0, dtype: dt.DType = dt.float32) -> Lazy:
    return Lazy.const(value, shape, dtype, "cpu:0")


def node(shape: tuple[int, ...], dtype: dt.DType = dt.float32) -> Lazy:
    """A non-constant leaf (an iota reshaped) that movement ops do not fold."""
    n = 1
    for s in shape:
        n *= s
    return Lazy.iota(n, dt.int32, "cpu:0").alu(Op.CAST, arg=dtype).movement(Op.RESHAPE, shape)


def test_const_values_take_the_dtype() -> None:
    assert const((2,), 2.7, dt.int32).arg == 2
    assert const((2,), 0, dt.bool_).arg is False
    assert isinstance(const((2,), 3, dt.float16).arg, float)


def test_movement_of_constants_folds() -> None:
    c = const((3, 1))
    for op, arg in [(Op.EXPAND, (3, 4)), (Op.RESHAPE, (1, 3)), (Op.PERMUTE, (1, 0)),
                    (Op.SHRINK, ((1, 2), (0, 1))), (Op.FLIP, (0,))]:
        out = c.movement(op, arg)
        assert out.op is Op.CONST and out.arg == 1.0
    assert c.movement(Op.PAD, ((1, 0), (0, 0))).op is Op.PAD  # padding makes zeros: no fold


def test_identity_movements_return_the_node() -> None:
    x = node((2, 3))
    assert x.movement(Op.RESHAPE, (2, 3)) is x
    assert x.movement(Op.PERMUTE, (0, 1)) is x
    assert x.movement(Op.PAD, ((0, 0), (0, 0))) is x
    assert x.movement(Op.SHRINK, ((0, 2), (0, 3))) is x
    assert x.movement(Op.FLIP, ()) is x
    assert x.alu(Op.CAST, arg=dt.float32) is x


def test_chains_of_reshapes_collapse() -> None:
    x = node((2, 3))
    y = x.movement(Op.RESHAPE, (6,)).movement(Op.RESHAPE, (3, 2))
    assert y.op is Op.RESHAPE and y.srcs[0] is x.srcs[0]  # not a reshape of a reshape
    assert x.movement(Op.RESHAPE, (6,)) is x.srcs[0]  # back to the flat source itself
    e = x.movement(Op.RESHAPE, (2, 1, 3)).movement(Op.EXPAND, (2, 4, 3))
    assert e.movement(Op.EXPAND, (2, 4, 3)) is e


@pytest.mark.parametrize("shape,op,arg,want", [
    ((2, 3), Op.RESHAPE, (3, 2), (3, 2)), ((2, 3), Op.PERMUTE, (1, 0), (3, 2)),
    ((1, 3), Op.EXPAND, (4, 3), (4, 3)), ((2, 3), Op.PAD, ((1, 2), (0, 1)), (5, 4)),
    ((5, 4), Op.SHRINK, ((1, 3), (0, 4)), (2, 4)), ((2, 3), Op.FLIP, (1,), (2, 3)),
])
def test_movement_shape(shape: tuple, op: Op, arg: tuple, want: tuple) -> None:
    assert movement_shape(shape, op, arg) == want


@pytest.mark.parametrize("shape,op,arg,message", [
    ((2, 3), Op.RESHAPE, (4, 2), r"cannot reshape \(2, 3\) to \(4, 2\)"),
    ((2, 3), Op.RESHAPE, (-6,), "cannot reshape"),
    ((2, 3), Op.PERMUTE, (0, 0), "not an order of 2 axes"),
    ((2, 3), Op.EXPAND, (2, 4), "cannot expand"),
    ((2, 3), Op.EXPAND, (2, 3, 1), "cannot expand"),
    ((2, 3), Op.PAD, ((0, -1), (0, 0)), "bad padding"),
    ((2, 3), Op.SHRINK, ((0, 3), (0, 3)), "bad shrink"),
    ((2, 3), Op.SHRINK, ((2, 1), (0, 3)), "bad shrink"),
    ((2, 3), Op.FLIP, (2,), "bad flip axes"),
])
def test_movement_shape_errors(shape: tuple, op: Op, arg: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        movement_shape(shape, op, arg)


def test_alu_checks() -> None:
    a, b = node((2, 3)), node((3, 2))
    with pytest.raises(ValueError, match="shapes differ"):
        a.alu(Op.ADD, b)
    c = Lazy.const(1.0, (2, 3), dt.float32, "webgpu:0")
    with pytest.raises(ValueError, match="different devices"):
        a.alu(Op.ADD, c)
    assert a.alu(Op.CMPLT, a).dtype == dt.bool_


@pytest.mark.parametrize("op,dtypes,message", [
    (Op.ADD, [dt.float32, dt.int32], "operand dtypes differ"),
    (Op.EXP2, [dt.int32], "needs a floating-point operand, got int32"),
    (Op.DIV, [dt.int64, dt.int64], "floating-point"),
    (Op.IDIV, [dt.float32, dt.float32], "needs an integer operand, got float32"),
    (Op.SHL, [dt.float16, dt.float16], "integer operand"),
    (Op.NOT, [dt.int8], "needs a bool operand"),
    (Op.WHERE, [dt.int8, dt.float32, dt.float32], "condition must be bool"),
    (Op.WHERE, [dt.bool_, dt.float32, dt.int32], "branches differ"),
])
def test_result_dtype_errors(op: Op, dtypes: list, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        result_dtype(op, dtypes)


def test_result_dtypes() -> None:
    assert result_dtype(Op.CMPEQ, [dt.int8, dt.int8]) == dt.bool_
    assert result_dtype(Op.CAST, [dt.int8], dt.float16) == dt.float16
    assert result_dtype(Op.WHERE, [dt.bool_, dt.uint8, dt.uint8]) == dt.uint8
    assert result_dtype(Op.MAX, [dt.bfloat16, dt.bfloat16]) == dt.bfloat16


def test_reduce() -> None:
    x = node((2, 3, 4))
    r = x.reduce(Op.SUM, (2, 0, 2))
    assert r.shape == (1, 3, 1) and r.arg == (0, 2)
    assert x.reduce(Op.SUM, ()) is x
    assert node((2, 0)).reduce(Op.RMAX, (1,)).arg == float("-inf")
    empty_sum = node((2, 0)).reduce(Op.SUM, (1,))
    assert empty_sum.op is Op.CONST and empty_sum.arg == 0 and empty_sum.shape == (2, 1)
    assert node((2, 0)).reduce(Op.PROD, (1,)).arg == 1


def test_gather_checks() -> None:
    x, idx = node((4, 5)), node((2, 5), dt.int32)
    assert x.gather(0, idx).shape == (2, 5)
    with pytest.raises(TypeError, match="integer tensor, got float32"):
        x.gather(0, node((2, 5)))
    with pytest.raises(ValueError, match="does not fit"):
        x.gather(0, node((2, 6), dt.int32))


def test_repr_and_realized() -> None:
    x = node((2, 3))
    assert repr(x) == "<Lazy reshape (2, 3) float32 cpu:0>"
    assert not x.realized and x.numel == 6


def test_readers_are_the_consumers_that_still_read_a_node() -> None:
    """A rewrite that gives a node new sources (a sum split into partial sums) leaves its link
    in the old source's consumers: ``readers`` leaves it out, so the scheduler does not count
    the old source as read by another kernel."""
    a, b = node((4, 8)), node((4, 8))
    product = a.alu(Op.MUL, b)
    total = product.reduce(Op.SUM, (1,))
    other = a.alu(Op.ADD, b)
    assert product.readers() == [total]
    assert set(map(id, a.readers())) == {id(product), id(other)}
    total.srcs = (other.alu(Op.MUL, b),)
    assert product.readers() == [] and len(product.consumers) == 1
