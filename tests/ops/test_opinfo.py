"""Differential tests against PyTorch (CPU), op by op, in the manner of PyTorch's OpInfo.

Each entry of ``OPS`` names an op, says how to call it (a function of the library namespace
``L`` -- ``AG`` or ``TORCH`` -- and the inputs, or a method name; ``ref`` where PyTorch is
called differently), the dtypes it is tested in, a generator of samples, whether its gradient
is checked and per-dtype tolerances. Every sample runs in anygpu on the device and in PyTorch;
the test compares the result's dtype, shape and values (NaN positions included, as
``assert_close(equal_nan=True)``), and for differentiable ops in float32 the gradients of the
float inputs under a random upstream gradient. Where PyTorch raises, anygpu must raise too (any
exception type, when the op is built or when its value is read).

Samples: fresh random values (seeded per test, never all zeros), transposed, sliced and expanded
views, 0-d and empty tensors, broadcasting, Python scalars and tensors of every other dtype
(type promotion), and the edge values nan, +-inf, -0.0, huge, tiny and the integer extremes.
Layouts do not depend on the dtype, so they are sampled in float32; every dtype gets random and
edge values. PyTorch's vectorized CPU kernels disagree with its own scalar path at a few edge
values (gelu(inf), fmod with an overflowing quotient): edge values of elementwise ops are
referenced one element at a time, through the scalar path.

``CASES`` holds single named cases, known divergences among them: they stay, failing, until the
library matches. ``ISOLATED`` holds cases that crash (integer division traps on processors) or
hang the process: each runs in a child process with a time limit. The deliberate differences of
``docs/from-pytorch.md`` are tested like the rest: PyTorch's semantics are the reference.

A device that lacks a dtype raises ``UnsupportedError`` (or ``TypeError``) naming it; the test
turns that into a skip for that (op, dtype, device) and nothing else.

Every new kernel is a compile (slow on PoCL), so the ops of a group are computed together and
their results and gradients read through a few fused kernels, floats as float32 and integers
and bools as int64 (both lossless); one that fails is found by halving. Empty results are
checked by shape and dtype only: reading one compiles a kernel of its own.

``ANYGPU_OPINFO_SAMPLES=full`` (read by this module only) runs every sample in every dtype, with
three random seeds, for a longer run than CI's.
"""

from __future__ import annotations

import json
import operator
import os
import re
import subprocess
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from conftest import Overtime, deadline

import anygpu as ag
from anygpu import dtype as dt
from anygpu.dtype import DType
from anygpu.nn import functional as agF
from anygpu.runtime.registry import get_device

torch = pytest.importorskip("torch")
tF = torch.nn.functional

FULL = os.environ.get("ANYGPU_OPINFO_SAMPLES", "") == "full"

F32, F16, BF16 = dt.float32, dt.float16, dt.bfloat16
I8, U8, I32, I64, BOOL = dt.int8, dt.uint8, dt.int32, dt.int64, dt.bool_
FLOATS = (F32, F16, BF16)
INTS = (I8, U8, I32, I64)
ALL = FLOATS + INTS + (BOOL,)
NUMERIC = FLOATS + INTS
# several ops take floats only in PyTorch: one integer dtype checks that anygpu raises too
FLOATS_AND_LONG = FLOATS + (I64,)

TORCH_DTYPE = {
    F32: torch.float32,
    F16: torch.float16,
    BF16: torch.bfloat16,
    I8: torch.int8,
    U8: torch.uint8,
    I32: torch.int32,
    I64: torch.int64,
    BOOL: torch.bool,
}
FROM_TORCH = {v: k for k, v in TORCH_DTYPE.items()}
# (rtol, atol) of one rounding to the dtype; integers and bools are exact
TOLERANCE = {F32: (1e-5, 1e-5), F16: (1e-3, 1e-3), BF16: (1e-2, 1e-2)}
GRAD_TOLERANCE = (1e-5, 1e-5)

# the two libraries under one set of names, so most ops need a single call
AG = SimpleNamespace(
    name="anygpu",
    where=ag.where,
    cat=ag.cat,
    stack=ag.stack,
    F=agF,
    float16=ag.float16,
    float32=ag.float32,
    int32=ag.int32,
    int64=ag.int64,
)
TORCH = SimpleNamespace(
    name="torch",
    where=torch.where,
    cat=torch.cat,
    stack=torch.stack,
    F=tF,
    float16=torch.float16,
    float32=torch.float32,
    int32=torch.int32,
    int64=torch.int64,
)

NAN, INF = float("nan"), float("inf")
# clamp with a NaN bound gives NaN in current PyTorch; older releases returned the input
TORCH_CLAMP_PROPAGATES_NAN = bool(torch.clamp(torch.tensor([1.0]), min=NAN).isnan().item())
FLOAT_EDGES = [
    NAN,
    INF,
    -INF,
    -0.0,
    0.0,
    1.0,
    -1.0,
    2.5,
    -2.5,
    0.5,
    3.0,
    1e20,
    -3e38,
    3e38,
    1e-30,
    -1e-8,
]
INT_EDGES = {
    I8: [-128, 127, -127, 126, 0, 1, -1, 2, -2, 3, 7, -7, 100, -100, 64, -64],
    U8: [0, 255, 1, 254, 2, 3, 7, 100, 128, 127, 64, 200, 5, 9, 17, 250],
    I32: [
        -(2**31),
        2**31 - 1,
        -(2**31) + 1,
        2**31 - 2,
        0,
        1,
        -1,
        2,
        -2,
        3,
        7,
        -7,
        2**16,
        -(2**16),
        65535,
        100,
    ],
    I64: [
        -(2**63),
        2**63 - 1,
        -(2**63) + 1,
        2**63 - 2,
        0,
        1,
        -1,
        2,
        -2,
        3,
        7,
        -7,
        -(2**31),
        2**31 - 1,
        2**32,
        2**53 + 1,
    ],
    BOOL: [
        True,
        False,
        False,
        True,
        True,
        True,
        False,
        False,
        True,
        False,
        True,
        False,
        False,
        True,
        False,
        True,
    ],
}


# ---- inputs and samples --------------------------------------------------------------------
def host_values(values: Any, d: DType) -> np.ndarray:
    """``values`` as a host array of ``d`` (bfloat16 as float32 rounded the way a store rounds)."""
    if d == BF16:
        return torch.tensor(np.asarray(values, dtype=np.float64)).to(torch.bfloat16).float().numpy()
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(values, dtype=np.float64 if d.is_float else None).astype(d.np)


@dataclass
class In:
    """A tensor input: host values of ``dtype``, and a view (called the same way in both
    libraries) applied after upload. ``grad``: whether its gradient is checked."""

    host: np.ndarray
    dtype: DType
    view: Callable[[Any], Any] | None = None
    grad: bool = True


def I(  # noqa: E743  (short: the sample tables call it on nearly every line)
    values: Any,
    dtype: DType,
    view: Callable[[Any], Any] | None = None,
    grad: bool = True,
) -> In:
    return In(host_values(values, dtype), dtype, view, grad)


@dataclass
class Sample:
    name: str
    args: tuple
    kwargs: dict = field(default_factory=dict)
    grad: bool = True  # check gradients for this sample (float32, differentiable ops)


class Gen:
    """Sample data for one test: every draw has its own seed derived from the test's."""

    def __init__(self, dtype: DType, seed: int, host: Callable[..., np.ndarray]):
        self.dtype, self.seed, self._host, self._count = dtype, seed, host, 0
        # layouts (views, broadcasting, empty tensors) do not depend on the dtype: they are
        # sampled in float32; every dtype gets random values, 0-d tensors, scalars and edges
        self.full = FULL or dtype == F32

    def rand(
        self,
        shape: tuple[int, ...],
        dtype: DType | None = None,
        low: float = -3.0,
        high: float = 3.0,
        away: float = 0.0,
    ) -> np.ndarray:
        d = dtype or self.dtype
        self._count += 1
        if d == U8:
            low = max(low, 0)
        return self._host(
            tuple(shape), d, self.seed * 7919 + self._count, low=low, high=high, away_from_zero=away
        )

    def x(
        self,
        shape: tuple[int, ...],
        view: Callable | None = None,
        dtype: DType | None = None,
        **kwargs: Any,
    ) -> In:
        d = dtype or self.dtype
        if d == BOOL and kwargs.get("away"):  # a divisor: no zeros (False)
            return In(np.ones(shape, dtype=bool), d, view)
        return In(self.rand(shape, d, **kwargs), d, view)

    def edges(self, dtype: DType | None = None) -> np.ndarray:
        d = dtype or self.dtype
        return host_values(FLOAT_EDGES if d.is_float else INT_EDGES[d], d)


T01 = lambda t: t.transpose(0, 1)  # noqa: E731
EVEN_ROWS = lambda t: t[1::2, ::2]  # noqa: E731
EXPAND = lambda t: t.expand(3, 4)  # noqa: E731


def unary_samples(g: Gen, low: float = -3.0, high: float = 3.0) -> list[Sample]:
    kw = {"low": low, "high": high}
    out = [
        Sample("random", (g.x((3, 4), **kw),)),
        Sample("edges", (In(g.edges().reshape(4, 4), g.dtype),)),
    ]
    if g.full:  # layouts: gradients of the same rule, not checked again
        # (expanded inputs are sampled by binary ops: their gradients are reductions)
        out += [
            Sample("0-d", (g.x((), **kw),), grad=False),
            Sample("transposed", (g.x((4, 3), T01, **kw),), grad=False),
            Sample("sliced", (g.x((6, 8), EVEN_ROWS, **kw),), grad=False),
            Sample("empty", (g.x((0, 4), **kw),), grad=False),
        ]
    return out


def _division_pairs(g: Gen) -> tuple[np.ndarray, np.ndarray]:
    """Every pair of edge values, as two vectors. Integer divisors skip 0 and the pair
    (minimum, -1) of the 32 and 64 bit types: those trap on processors (see ISOLATED)."""
    e = list(g.edges())
    pairs = [(a, b) for a in e for b in e]
    if g.dtype.is_int:
        low = int(np.iinfo(g.dtype.np).min)
        pairs = [
            (a, b)
            for a, b in pairs
            if b != 0 and not (g.dtype in (I32, I64) and int(a) == low and int(b) == -1)
        ]
    a, b = zip(*pairs)
    return host_values(list(a), g.dtype), host_values(list(b), g.dtype)


def binary_samples(
    g: Gen,
    divisor: bool = False,
    rhs_low: float = -3.0,
    rhs_high: float = 3.0,
    scalars: tuple = (2, -4, 0.5, True),
    broadcast_grad: bool = False,
) -> list[Sample]:
    """``divisor``: the right operand is never 0 for integers (torch raises on it).
    ``broadcast_grad``: check the gradients of broadcast samples too (they are sums, one kernel
    each, and one rule shared by every op: a few ops check it)."""
    away = 1.0 if divisor and not g.dtype.is_float else 0.0
    rhs = {"low": rhs_low, "high": rhs_high, "away": away}
    out = [Sample("random", (g.x((3, 4)), g.x((3, 4), **rhs)))]
    if g.full:
        bg = broadcast_grad
        out += [
            Sample("0-d-rhs", (g.x((3, 4)), g.x((), **rhs)), grad=bg),
            Sample("broadcast-row", (g.x((3, 4)), g.x((4,), **rhs)), grad=bg),
            Sample("broadcast-both", (g.x((3, 1)), g.x((1, 4), **rhs)), grad=bg),
            Sample("transposed", (g.x((4, 3), T01), g.x((6, 8), EVEN_ROWS, **rhs)), grad=False),
            Sample("expanded", (g.x((1, 4), EXPAND), g.x((3, 4), **rhs)), grad=bg),
            Sample("0-d-lhs", (g.x(()), g.x((3, 4), **rhs)), grad=bg),
            Sample("0-d-both", (g.x(()), g.x((), **rhs)), grad=False),
            Sample("empty", (g.x((0, 4)), g.x((4,), **rhs)), grad=bg),
        ]
    else:  # the Python scalars that keep the dtype and that promote it
        scalars = tuple(x for x in scalars if x in (2, 0.5)) or scalars[:1]
    for k, x in enumerate(scalars):
        if not (divisor and not g.dtype.is_float and x in (0, False)):
            out.append(Sample(f"scalar-{x!r}", (g.x((3, 4)), x), grad=k == 0))
            if k == 0:
                out.append(Sample(f"scalar-{x!r}-lhs", (x, g.x((3, 4), **rhs)), grad=False))
    if divisor and g.dtype.is_int:
        a, b = _division_pairs(g)
        out.append(Sample("edges", (In(a, g.dtype), In(b, g.dtype))))
    elif not (divisor and g.dtype == BOOL):
        e = g.edges()
        out.append(Sample("edges", (In(e.reshape(16, 1), g.dtype), In(e.reshape(1, 16), g.dtype))))
    return out


def promotion_samples(g: Gen, divisor: bool = False) -> list[Sample]:
    """The left operand in the test's dtype, the right one in every other dtype, as a full
    tensor, a 0-d tensor, and Python scalars."""
    out = []
    for other in ALL:
        if other == g.dtype:
            continue
        kw = {"low": 1, "high": 3} if divisor else {}
        out.append(Sample(f"tensor-{other.name}", (g.x((3, 4)), g.x((3, 4), dtype=other, **kw))))
        out.append(Sample(f"0-d-{other.name}", (g.x((3, 4)), g.x((), dtype=other, **kw))))
        if g.full:
            out.append(Sample(f"0-d-{other.name}-lhs", (g.x((), dtype=other), g.x((3, 4), **kw))))
    for s in (3, -2.5, True, 2**40):
        out.append(Sample(f"scalar-{s!r}", (g.x((3, 4)), s)))
    return out


def reduce_samples(
    g: Gen, needs_dim: bool = False, extra: dict | None = None, **data: Any
) -> list[Sample]:
    """``needs_dim``: the op must be given a dim. ``extra``: more keyword arguments for the
    sample that reduces a view. Every reduction is a kernel of its own: dtypes other than
    float32 get one sample, rows of edge values and of random values reduced along dim 1."""
    if not g.full:
        rows = np.concatenate([g.edges().reshape(4, 4), g.rand((2, 4), **data)])
        return [Sample("edges-and-random-rows", (In(rows, g.dtype), 1))]
    d1 = (1,) if needs_dim else ()
    extra = extra or {}
    view = lambda t: t.permute(0, 2, 1)  # noqa: E731
    out = [
        Sample("dim1" if needs_dim else "all-dims", (g.x((3, 4), **data), *d1)),
        Sample("edges-rows", (In(g.edges().reshape(4, 4), g.dtype), 1)),
        Sample(
            "dim=-1-view-3d",
            (g.x((2, 4, 3), view, **data),),
            {"dim": -1, **({} if needs_dim else {"keepdim": True}), **extra},
        ),
        Sample("0-d-dim0", (g.x((), **data), 0)),
        Sample("empty-kept-axis", (g.x((0, 4), **data), 1)),
        Sample("empty-axis", (g.x((0, 4), **data), 0)),
    ]
    if not needs_dim:
        out.append(Sample("empty", (g.x((0, 4), **data),)))
    return out


# ---- the op table ----------------------------------------------------------------------------
Call = Callable[..., Any] | str


@dataclass
class OpInfo:
    name: str
    call: Call  # f(L, *args, **kwargs), or a method name called on the first argument
    dtypes: tuple[DType, ...]
    samples: Callable[[Gen], list[Sample]]
    differentiable: bool = False
    ref: Call | None = None  # how PyTorch calls it, where that differs from ``call``
    tol: dict[DType, tuple[float, float]] = field(default_factory=dict)
    grad_tol: tuple[float, float] = GRAD_TOLERANCE
    subset: int = 0  # dtypes other than float32 take the first ``subset`` samples (and edges)
    group: str = ""  # ops of a group are computed together (fewer, larger kernels)
    elementwise: bool = False  # edge values are referenced one element at a time (see below)

    def __str__(self) -> str:
        return self.name


def fn(f: Callable[..., Any]) -> Callable[..., Any]:
    """An op that ignores the library namespace (operators, methods with arguments)."""
    return lambda L, *args, **kwargs: f(*args, **kwargs)


def method(name: str) -> Callable[..., Any]:
    return lambda L, x, *args, **kwargs: getattr(x, name)(*args, **kwargs)


def unary(
    name: str,
    dtypes: tuple[DType, ...] = ALL,
    call: Call | None = None,
    differentiable: bool = True,
    low: float = -3.0,
    high: float = 3.0,
    **kwargs: Any,
) -> OpInfo:
    return OpInfo(
        name,
        call or name,
        dtypes,
        lambda g: unary_samples(g, low, high),
        differentiable,
        elementwise=True,
        **kwargs,
    )


def binary(
    name: str,
    call: Call,
    dtypes: tuple[DType, ...] = ALL,
    differentiable: bool = True,
    divisor: bool = False,
    **kwargs: Any,
) -> OpInfo:
    extra = {
        k: kwargs.pop(k)
        for k in ("rhs_low", "rhs_high", "scalars", "broadcast_grad")
        if k in kwargs
    }
    return OpInfo(
        name,
        call,
        dtypes,
        lambda g: binary_samples(g, divisor, **extra),
        differentiable,
        elementwise=True,
        **kwargs,
    )


def _pow_samples(g: Gen) -> list[Sample]:
    if g.dtype.is_float:
        out = binary_samples(g, scalars=(2, 3, -1, 0.5, 2.5, -2.5, 0))
        out.append(Sample("positive-base", (g.x((3, 4), low=0.1, high=3), g.x((3, 4)))))
        out.append(Sample("scalar-base", (2.5, g.x((3, 4)))))
        return out
    # integers to negative powers raise in PyTorch: exponents here are not negative
    exps = host_values([0, 1, 2, 3, 5, 7, 10, 1, 2, 3, 0, 4, 6, 9, 2, 1], g.dtype)
    e = g.edges()
    out = [
        Sample("random", (g.x((3, 4)), g.x((3, 4), low=0, high=3))),
        Sample("broadcast", (g.x((3, 1)), g.x((1, 4), low=0, high=3))),
        Sample("0-d-rhs", (g.x((3, 4)), g.x((), low=0, high=3))),
        Sample("edges", (In(e.reshape(16, 1), g.dtype), In(exps.reshape(1, 16), g.dtype))),
    ]
    for s in (2, 3, 0, 2.0, 0.5, -1.5):
        out.append(Sample(f"scalar-{s!r}", (g.x((3, 4)), s)))
    # (a Python int to the power of an integer tensor is in ISOLATED: it does not finish)
    out.append(Sample("scalar-base-2.0", (2.0, g.x((3, 4)))))
    out.append(Sample("negative-int-scalar", (g.x((3, 4)), -1)))
    return out


def _clamp_samples(g: Gen) -> list[Sample]:
    x = g.x((3, 4))
    out = [
        Sample("min-max", (x,), {"min": -1, "max": 1}),
        Sample("min", (g.x((3, 4)),), {"min": -1}),
        Sample("max", (g.x((3, 4)),), {"max": -2}),
        Sample("min-float", (g.x((3, 4)),), {"min": -0.5}),
        Sample("max-float", (g.x((3, 4)),), {"max": -0.5}),
        Sample("min>max", (g.x((3, 4)),), {"min": 1, "max": -1}),
        Sample("positional", (g.x((4, 3), T01), -2, 2)),
        Sample("tensors", (g.x((3, 4)),), {"min": g.x((4,)), "max": g.x((3, 1), low=1)}),
        Sample("0-d", (g.x(()),), {"min": 0}),
        Sample("empty", (g.x((0, 4)),), {"max": 1}),
        Sample("edges", (In(g.edges(), g.dtype),), {"min": -1, "max": 2}),
    ]
    if g.dtype.is_float:
        out.append(
            Sample(
                "boundary",
                (I([-1.0, -0.5, 0.0, 1.0, 1.5, 2.0, NAN, -INF], g.dtype),),
                {"min": -1.0, "max": 1.0},
            )
        )
        if TORCH_CLAMP_PROPAGATES_NAN:  # older PyTorch releases ignored a NaN bound
            out.append(Sample("nan-bound", (g.x((3, 4)),), {"min": NAN}, grad=False))
    return out


def _where_samples(g: Gen) -> list[Sample]:
    c = lambda shape: g.x(shape, dtype=BOOL)  # noqa: E731
    return [
        Sample("random", (c((3, 4)), g.x((3, 4)), g.x((3, 4)))),
        Sample("broadcast", (c((3, 1)), g.x((4,)), g.x((3, 4)))),
        Sample("views", (c((4, 3)), g.x((6, 8), EVEN_ROWS), g.x((1, 4), EXPAND))),
        Sample("scalar-other", (c((3, 4)), g.x((3, 4)), 0.5)),
        Sample("scalar-int-input", (c((3, 4)), 2, g.x((3, 4)))),
        Sample("0-d", (c(()), g.x(()), g.x(()))),
        Sample("0-d-f32-other", (c((3, 4)), g.x((3, 4)), g.x((), dtype=F32))),
        Sample("int64-other", (c((3, 4)), g.x((3, 4)), g.x((3, 4), dtype=I64))),
        Sample("empty", (c((0, 4)), g.x((0, 4)), g.x((4,)))),
        Sample("edges", (c((4, 4)), In(g.edges().reshape(4, 4), g.dtype), g.x((4, 4)))),
    ]


def _where_call(L: Any, c: Any, x: Any, y: Any) -> Any:
    if L is TORCH and c.dtype != torch.bool:
        c = c.bool()
    return L.where(c, x, y)


def _matmul_samples(g: Gen) -> list[Sample]:
    kw = {"low": -2, "high": 2}
    edges = Sample("edges", (In(g.edges().reshape(4, 4), g.dtype), g.x((4, 2), **kw)))
    if not g.full:
        return [edges]
    return [
        Sample("2d", (g.x((3, 4), **kw), g.x((4, 5), **kw))),
        Sample("batched", (g.x((2, 3, 4), **kw), g.x((4, 5), **kw))),
        Sample("batched-both", (g.x((2, 3, 4), **kw), g.x((2, 4, 2), **kw)), grad=False),
        Sample("vec-mat", (g.x((4,), **kw), g.x((4, 3), **kw)), grad=False),
        Sample("mat-vec", (g.x((3, 4), **kw), g.x((4,), **kw)), grad=False),
        Sample("vec-vec", (g.x((4,), **kw), g.x((4,), **kw))),
        Sample("transposed", (g.x((4, 3), T01, **kw), g.x((5, 4), T01, **kw)), grad=False),
        Sample("empty-inner", (g.x((3, 0)), g.x((0, 4)))),
        Sample("empty-outer", (g.x((0, 4)), g.x((4, 3)))),
        Sample("0-d", (g.x(()), g.x((3,)))),
        edges,
    ]


def _movement(
    name: str,
    call: Call,
    build: Callable[[Gen], list[Sample]],
    dtypes: tuple[DType, ...] = ALL,
    **kwargs: Any,
) -> OpInfo:
    return OpInfo(name, call, dtypes, build, True, subset=2, **kwargs)


def _idx(values: Any) -> In:
    return I(values, I64, grad=False)


T3 = lambda g: g.x((2, 3, 4))  # noqa: E731

MOVEMENT = [
    _movement(
        "reshape",
        method("reshape"),
        lambda g: [
            Sample("flatten", (T3(g), -1)),
            Sample("split-dim", (g.x((3, 4)), 2, 3, 2)),
            Sample("transposed", (g.x((4, 3), T01), (12,))),
            Sample("0-d-to-1", (g.x(()), (1, 1))),
            Sample("to-0-d", (g.x((1,)), ())),
            Sample("empty", (g.x((0, 4)), (2, 0, -1))),
            Sample("bad", (g.x((3, 4)), (5, 3))),
        ],
    ),
    _movement(
        "permute",
        method("permute"),
        lambda g: [
            Sample("3d", (T3(g), 2, 0, 1)),
            Sample("tuple", (T3(g), (1, 2, 0))),
            Sample("negative", (T3(g), -1, 0, 1)),
            Sample("sliced", (g.x((6, 8), EVEN_ROWS), 1, 0)),
            Sample("0-d", (g.x(()), ())),
            Sample("bad", (T3(g), 0, 0, 1)),
        ],
    ),
    _movement(
        "transpose",
        method("transpose"),
        lambda g: [
            Sample("3d", (T3(g), 0, 2)),
            Sample("negative", (T3(g), -1, -2)),
            Sample("empty", (g.x((0, 4)), 0, 1)),
            Sample("out-of-range", (g.x((3, 4)), 0, 2)),
        ],
    ),
    _movement(
        "expand",
        method("expand"),
        lambda g: [
            Sample("row", (g.x((4,)), 3, 4)),
            Sample("keep-dims", (g.x((3, 1)), -1, 4)),
            Sample("new-dims", (g.x((1, 4)), (2, 3, 4))),
            Sample("0-d", (g.x(()), 3, 2)),
            Sample("to-empty", (g.x((1, 4)), 0, 4)),
            Sample("bad", (g.x((3, 4)), 3, 5)),
        ],
    ),
    _movement(
        "flip",
        method("flip"),
        lambda g: [
            Sample("one", (T3(g), 0)),
            Sample("two", (T3(g), (0, 2))),
            Sample("negative", (g.x((4, 3), T01), -1)),
            Sample("0-d", (g.x(()), ())),
            Sample("empty", (g.x((0, 4)), 0)),
        ],
    ),
    _movement(
        "pad",
        lambda L, x, *a, **k: L.F.pad(x, *a, **k),
        lambda g: [
            Sample("last", (g.x((3, 4)), (1, 2))),
            Sample("two-dims", (g.x((3, 4)), (1, 0, 2, 1))),
            Sample(
                "value",
                (g.x((3, 4)), (1, 1)),
                {"value": -1.0} if g.dtype.is_float else {"value": 7},
            ),
            Sample("negative-crops", (g.x((3, 4)), (-1, 2, 0, -1))),
            Sample("transposed", (g.x((4, 3), T01), (0, 2))),
            Sample("empty", (g.x((0, 4)), (1, 1))),
            Sample("reflect", (g.x((1, 3, 4)), (2, 1)), {"mode": "reflect"}),
            Sample("replicate", (g.x((1, 3, 4)), (2, 1)), {"mode": "replicate"}),
            Sample("circular", (g.x((1, 3, 4)), (2, 1)), {"mode": "circular"}),
            Sample("odd-length", (g.x((3, 4)), (1,))),
        ],
    ),
    _movement(
        "repeat",
        method("repeat"),
        lambda g: [
            Sample("2d", (g.x((3, 4)), 2, 1)),
            Sample("new-dims", (g.x((3,)), 2, 2)),
            Sample("0-d", (g.x(()), 3)),
            Sample("zero", (g.x((3, 4)), 0, 2)),
            Sample("too-few", (g.x((3, 4)), 2)),
        ],
    ),
    _movement(
        "cat",
        lambda L, *xs, **k: L.cat(list(xs), **k),
        lambda g: [
            Sample("dim0", (g.x((2, 4)), g.x((3, 4)))),
            Sample("dim1", (g.x((3, 1)), g.x((3, 4))), {"dim": 1}),
            Sample("negative-dim", (g.x((4, 3), T01), g.x((3, 2))), {"dim": -1}),
            Sample("with-empty", (g.x((0, 4)), g.x((3, 4)))),
            Sample("promote", (g.x((2, 4)), g.x((1, 4), dtype=F32))),
            Sample("mismatch", (g.x((2, 4)), g.x((2, 3)))),
        ],
    ),
    _movement(
        "stack",
        lambda L, *xs, **k: L.stack(list(xs), **k),
        lambda g: [
            Sample("dim0", (g.x((3, 4)), g.x((3, 4)))),
            Sample("last", (g.x((3,)), g.x((3,)), g.x((3,))), {"dim": -1}),
            Sample("0-d", (g.x(()), g.x(()))),
            Sample("empty", (g.x((0, 2)), g.x((0, 2))), {"dim": 1}),
            Sample("mismatch", (g.x((3,)), g.x((4,)))),
        ],
    ),
    _movement(
        "split",
        method("split"),
        lambda g: [
            Sample("size", (g.x((5, 4)), 2)),
            Sample("sizes", (g.x((5, 4)), [1, 4])),
            Sample("dim1", (g.x((3, 4)), 3), {"dim": 1}),
            Sample("empty", (g.x((0, 4)), 2)),
            Sample("bad-sizes", (g.x((5, 4)), [1, 2])),
        ],
    ),
    _movement(
        "chunk",
        method("chunk"),
        lambda g: [
            Sample("even", (g.x((4, 3)), 2)),
            Sample("uneven", (g.x((5, 3)), 3)),
            Sample("dim1", (g.x((3, 4)), 3), {"dim": 1}),
            Sample("more-than-size", (g.x((2, 3)), 4)),
            Sample("empty", (g.x((0, 4)), 2)),
            Sample("0-d", (g.x(()), 2)),
        ],
    ),
    _movement(
        "squeeze",
        method("squeeze"),
        lambda g: [
            Sample("all", (g.x((3, 1, 4, 1)),)),
            Sample("dim", (g.x((3, 1, 4)), 1)),
            Sample("not-one", (g.x((3, 1, 4)), 0)),
            Sample("negative", (g.x((3, 1)), -1)),
            Sample("0-d", (g.x(()),)),
            Sample("0-d-dim", (g.x(()), 0)),
            Sample("tuple", (g.x((1, 3, 1)), (0, 2))),
        ],
    ),
    _movement(
        "unsqueeze",
        method("unsqueeze"),
        lambda g: [
            Sample("front", (g.x((3, 4)), 0)),
            Sample("last", (g.x((3, 4)), -1)),
            Sample("middle", (g.x((4, 3), T01), 1)),
            Sample("0-d", (g.x(()), 0)),
            Sample("out-of-range", (g.x((3, 4)), 3)),
        ],
    ),
    _movement(
        "getitem-basic",
        fn(lambda x, index: x[index]),
        lambda g: [
            Sample("int", (T3(g), 1)),
            Sample("negative-int", (T3(g), -1)),
            Sample("slices", (T3(g), (slice(None), slice(1, 3), slice(None, None, 2)))),
            Sample("ellipsis", (T3(g), (Ellipsis, 1))),
            Sample("none", (g.x((3, 4)), (None, 1, slice(None), None))),
            Sample("out-of-range-slice", (g.x((3, 4)), slice(2, 10))),
            Sample("empty-slice", (g.x((3, 4)), slice(2, 1))),
            Sample("of-view", (g.x((4, 3), T01), (slice(1, None), -1))),
            Sample("0-d-ellipsis", (g.x(()), Ellipsis)),
            Sample("0-d-none", (g.x(()), None)),
            Sample("negative-step", (g.x((3, 4)), slice(None, None, -1))),
            Sample("int-out-of-range", (g.x((3, 4)), 3)),
            Sample("too-many", (g.x((3, 4)), (0, 0, 0))),
        ],
    ),
    _movement(
        "getitem-advanced",
        fn(lambda x, index: x[index]),
        lambda g: [
            Sample("list", (g.x((3, 4)), [0, 2, 2, -1])),
            Sample("mixed-int-slice-list", (T3(g), (1, slice(None), [0, 2]))),
            Sample("two-lists", (T3(g), ([0, 1], slice(None), [3, 0]))),
            Sample("adjacent-lists", (T3(g), (slice(None), [0, 2], [1, 3]))),
            Sample("empty-list", (g.x((3, 4)), [])),
            Sample("bool-list", (g.x((3, 4)), [True, False, True])),
            Sample(
                "bool-mask-tensor",
                (
                    g.x((3, 4)),
                    I([[True, False, True, True], [False] * 4, [True, True, False, False]], BOOL),
                ),
            ),
            Sample("index-tensor", (g.x((3, 4)), _idx([[2, 0], [1, 1]]))),
            Sample("index-tensor-and-slice", (g.x((3, 4)), (slice(None), _idx([3, -4])))),
            Sample("out-of-range", (g.x((3, 4)), [0, 3])),
        ],
    ),
    _movement(
        "gather",
        method("gather"),
        lambda g: [
            Sample("dim1", (g.x((3, 4)), 1, _idx([[0, 3], [1, 1], [2, 0]]))),
            Sample("dim0", (g.x((3, 4)), 0, _idx([[2, 1, 0, 0]]))),
            Sample("negative-dim", (T3(g), -1, _idx(np.zeros((2, 3, 1), dtype=np.int64)))),
            Sample("view", (g.x((4, 3), T01), 1, _idx([[3], [0], [1]]))),
            Sample("empty-index", (g.x((3, 4)), 1, _idx(np.zeros((3, 0), dtype=np.int64)))),
            Sample("out-of-range", (g.x((3, 4)), 1, _idx([[4], [0], [0]]))),
        ],
    ),
    _movement(
        "index_select",
        method("index_select"),
        lambda g: [
            Sample("dim0", (g.x((3, 4)), 0, _idx([2, 0, 2]))),
            Sample("dim1-view", (g.x((4, 3), T01), 1, _idx([3]))),
            Sample("empty-index", (g.x((3, 4)), 1, _idx(np.zeros((0,), dtype=np.int64)))),
            Sample("0-d-index", (g.x((3, 4)), 0, _idx(1))),
            Sample("out-of-range", (g.x((3, 4)), 0, _idx([3]))),
        ],
    ),
    _movement(
        "scatter_add",
        method("scatter_add"),
        lambda g: [
            Sample("dim0", (g.x((3, 4)), 0, _idx([[0, 1, 2, 0], [2, 2, 2, 2]]), g.x((2, 4)))),
            Sample("dim1-small-index", (g.x((3, 4)), 1, _idx([[3], [0], [1]]), g.x((3, 2)))),
            Sample("duplicates", (g.x((2, 3)), 1, _idx([[1, 1, 1], [0, 0, 2]]), g.x((2, 3)))),
        ],
        dtypes=NUMERIC,
    ),
    _movement(
        "contiguous-of-views",
        fn(lambda x: x.flip(0)[1:].permute(1, 0).contiguous()),
        lambda g: [Sample("3x4", (g.x((3, 4)),)), Sample("empty", (g.x((0, 4)),))],
    ),
]


def _reduction(
    name: str,
    call: Call,
    dtypes: tuple[DType, ...] = ALL,
    differentiable: bool = True,
    **kwargs: Any,
) -> OpInfo:
    options = {k: kwargs.pop(k) for k in ("needs_dim", "extra", "low", "high") if k in kwargs}
    return OpInfo(
        name, call, dtypes, lambda g: reduce_samples(g, **options), differentiable, **kwargs
    )


def _sum(L: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
    if kwargs.get("dtype") == "float32":
        kwargs["dtype"] = L.float32
    return x.sum(*args, **kwargs)


REDUCTIONS = [
    _reduction("sum", _sum, extra={"dtype": "float32"}),
    _reduction("prod", "prod", low=-2, high=2),
    _reduction("mean", "mean", FLOATS_AND_LONG),
    _reduction("var", "var", FLOATS_AND_LONG, extra={"correction": 0}),
    _reduction("std", "std", FLOATS),
    _reduction("max", "max"),
    _reduction("min", "min"),
    _reduction("amax", "amax"),
    _reduction("amin", "amin"),
    _reduction("argmax", "argmax"),
    _reduction("argmin", "argmin"),
    _reduction("all", "all"),
    _reduction("any", "any"),
    _reduction("logsumexp", "logsumexp", FLOATS_AND_LONG, needs_dim=True),
    _reduction("softmax", "softmax", FLOATS_AND_LONG, needs_dim=True),
    _reduction("log_softmax", "log_softmax", FLOATS_AND_LONG, needs_dim=True),
    _reduction("cumsum", "cumsum", needs_dim=True),
]


def _softplus(L: Any, x: Any, **kwargs: Any) -> Any:
    return x.softplus(**kwargs) if L is AG else tF.softplus(x, **kwargs)


def _functional(name: str) -> Callable[..., Any]:
    return lambda L, x, *args, **kwargs: getattr(L.F, name)(x, *args, **kwargs)


ELEMENTWISE = [
    unary("neg"),
    unary("abs"),
    unary("sign"),
    unary("exp"),
    unary("exp2"),
    unary("log", low=0.05),
    unary("log2", low=0.05),
    unary("log1p", low=-0.9),
    unary("expm1"),
    unary("sqrt", low=0.05),
    unary("rsqrt", low=0.05),
    unary("reciprocal"),
    unary("sin"),
    unary("cos"),
    unary("tan", low=-1.2, high=1.2),
    unary("tanh"),
    unary("sigmoid"),
    unary("relu"),
    unary("leaky_relu", call=_functional("leaky_relu"), dtypes=FLOATS_AND_LONG),
    unary("leaky_relu-slope", call=lambda L, x: L.F.leaky_relu(x, 0.2), dtypes=(F32,)),
    unary("silu", call=_functional("silu"), dtypes=FLOATS_AND_LONG),
    unary("gelu", call=_functional("gelu"), dtypes=FLOATS_AND_LONG),
    unary("gelu-tanh", call=lambda L, x: L.F.gelu(x, approximate="tanh"), dtypes=(F32,)),
    unary("softplus", call=_softplus, dtypes=FLOATS_AND_LONG),
    unary("softplus-beta", call=lambda L, x: _softplus(L, x, beta=2.0), dtypes=(F32,)),
    unary("erf"),
    unary("floor"),
    unary("ceil"),
    unary("round"),
    unary("trunc"),
    unary("square"),
    unary("isnan", differentiable=False),
    unary("isinf", differentiable=False),
    unary("logical_not", differentiable=False),
    unary("bitwise_not", call=fn(operator.invert), differentiable=False),
    binary("add", fn(operator.add), broadcast_grad=True),
    binary(
        "add-alpha",
        lambda L, x, y: x.add(y, alpha=2) if not isinstance(x, (int, float)) else y.add(x, alpha=2),
        dtypes=(F32, I64),
    ),
    binary("sub", fn(operator.sub)),
    binary("mul", fn(operator.mul), broadcast_grad=True),
    binary("div", fn(operator.truediv)),
    binary("div-trunc", lambda L, x, y: _div(L, x, y, "trunc"), divisor=True),
    binary("div-floor", lambda L, x, y: _div(L, x, y, "floor"), divisor=True),
    binary("floor_divide", fn(operator.floordiv), divisor=True),
    binary("remainder", fn(operator.mod), divisor=True),
    binary("fmod", lambda L, x, y: _fmod(L, x, y), divisor=True),
    OpInfo("pow", fn(operator.pow), ALL, _pow_samples, True, elementwise=True),
    binary(
        "maximum",
        lambda L, x, y: _as_tensor_first(L, x, y, "maximum"),
        scalars=(),
        broadcast_grad=True,
    ),
    binary("minimum", lambda L, x, y: _as_tensor_first(L, x, y, "minimum"), scalars=()),
    OpInfo("clamp", "clamp", ALL, _clamp_samples, True, subset=5, elementwise=True),
    OpInfo("clip", "clip", ALL, _clamp_samples, True, subset=2, elementwise=True),
    OpInfo("where", _where_call, ALL, _where_samples, True, subset=4, elementwise=True),
    binary("lt", fn(operator.lt), differentiable=False),
    binary("le", fn(operator.le), differentiable=False),
    binary("gt", fn(operator.gt), differentiable=False),
    binary("ge", fn(operator.ge), differentiable=False),
    binary("eq", fn(operator.eq), differentiable=False),
    binary("ne", fn(operator.ne), differentiable=False),
    binary(
        "logical_and",
        lambda L, x, y: _as_tensor_first(L, x, y, "logical_and"),
        scalars=(),
        differentiable=False,
    ),
    binary(
        "logical_or",
        lambda L, x, y: _as_tensor_first(L, x, y, "logical_or"),
        scalars=(),
        differentiable=False,
    ),
    binary(
        "logical_xor",
        lambda L, x, y: _as_tensor_first(L, x, y, "logical_xor"),
        scalars=(),
        differentiable=False,
    ),
    binary("bitwise_and", fn(operator.and_), differentiable=False),
    binary("bitwise_or", fn(operator.or_), differentiable=False),
    binary("bitwise_xor", fn(operator.xor), differentiable=False),
    binary(
        "lshift", fn(operator.lshift), differentiable=False, rhs_low=0, rhs_high=5, scalars=(2, 0)
    ),
    binary(
        "rshift", fn(operator.rshift), differentiable=False, rhs_low=0, rhs_high=5, scalars=(2, 0)
    ),
]


def _tensor_first(L: Any, x: Any, y: Any) -> Any:
    """Methods take a scalar on the right only: a scalar on the left becomes a 0-d tensor (of
    the scalar's default dtype) in both libraries."""
    if isinstance(x, (bool, int, float)):
        return torch.tensor(x) if L is TORCH else ag.tensor(x, device=y.device)
    return x


def _div(L: Any, x: Any, y: Any, mode: str) -> Any:
    return _tensor_first(L, x, y).div(y, rounding_mode=mode)


def _fmod(L: Any, x: Any, y: Any) -> Any:
    return _tensor_first(L, x, y).fmod(y)


def _as_tensor_first(L: Any, x: Any, y: Any, name: str) -> Any:
    return getattr(_tensor_first(L, x, y), name)(y)


# the rules live in one place (the operands' promotion) with a few paths of their own: an op of
# each path
PROMOTION = [
    OpInfo("promote-add", fn(operator.add), ALL, promotion_samples),
    OpInfo("promote-truediv", fn(operator.truediv), ALL, promotion_samples),
    OpInfo("promote-lt", fn(operator.lt), ALL, promotion_samples),
    OpInfo(
        "promote-where",
        lambda L, x, y: L.where(_tensor_first(L, x, y) != 0, x, y),
        ALL,
        promotion_samples,
    ),
    OpInfo(
        "promote-pow",
        fn(operator.pow),
        ALL,
        lambda g: [
            s
            for s in promotion_samples(g, divisor=True)
            if not any(isinstance(a, (int, float)) and a < 0 for a in s.args)
        ],
    ),
]

LINALG = [
    # float16 sums of products: both libraries accumulate in float32 and round once, but the
    # order of the additions may differ, which can move the result across one rounding step
    OpInfo("matmul", fn(operator.matmul), ALL, _matmul_samples, True, tol={F16: (2e-3, 2e-3)}),
    OpInfo(
        "max_pool2d",
        lambda L, x, *a, **k: L.F.max_pool2d(x, *a, **k),
        FLOATS + (I32,),
        lambda g: [
            Sample("2x2", (g.x((1, 2, 4, 6)), 2)),
            # windows that tile the input but leave its last row and column out
            Sample("2x2-leftover", (g.x((2, 2, 5, 7)), 2)),
            Sample("stride1-pad", (g.x((1, 1, 5, 5)), 3, 1, 1)),
            Sample("unbatched", (g.x((2, 4, 4)), 2)),
            Sample("edges", (In(g.edges().reshape(1, 1, 4, 4), g.dtype), 2)),
        ],
        True,
        subset=1,
    ),
]


# ---- single named cases: known divergences from PyTorch, kept until they match -------------
def case(
    name: str,
    call: Call,
    *args: Any,
    grad: bool = False,
    kwargs: dict | None = None,
    ref: Call | None = None,
    tol: dict | None = None,
) -> OpInfo:
    tensors = [a for a in args if isinstance(a, In)]
    d = tensors[0].dtype if tensors else F32
    sample = Sample(name, args, kwargs or {}, grad)
    return OpInfo(name, call, (d,), lambda g: [sample], grad, ref=ref, tol=tol or {})


def _nan_at(n: int, at: int) -> np.ndarray:
    x = np.random.default_rng(n).uniform(-10, 10, n).astype(np.float32)
    x[at] = np.nan
    return x


CASES = [
    case("int-minus-negative-scalar", fn(lambda x: x - (-4)), I([1, 2], I64)),
    case("clamp-max-negative", fn(lambda x: x.clamp(max=-0.5)), I([-1.0, 0.0, 2.0], F32)),
    case("clamp-min-negative-int", fn(lambda x: x.clamp(min=-3)), I([-5, 0, 4], I32)),
    case("clamp-max-negative-uint8", fn(lambda x: x.clamp(max=-1)), I([0, 5], U8)),
    case("relu-nan", method("relu"), I([NAN, -1.0, 1.0], F32)),
    case("maximum-python-scalar", fn(lambda x: x.maximum(0.5)), I([0.0, 1.0], F32)),
    case("max-40000-one-nan", method("max"), I(_nan_at(40000, 31337), F32)),
    case("min-40000-one-nan", method("min"), I(_nan_at(40000, 7), F32)),
    case("amax-dim-with-nan", fn(lambda x: x.amax(1)), I([[1.0, NAN, 2.0], [3.0, 1.0, NAN]], F32)),
    case("argmax-with-nan", method("argmax"), I([1.0, NAN, 5.0], F32)),
    case("cumsum-inf", fn(lambda x: x.cumsum(0)), I([1.0, INF, 2.0], F32)),
    case("cumsum-nan", fn(lambda x: x.cumsum(0)), I([1.0, NAN, 2.0], F32)),
    case("int64-pow-3-21", fn(lambda x: x**21), I([3], I64)),
    case("int64-pow-tensor", fn(lambda x, y: x**y), I([3, -2, 7], I64), I([21, 33, 22], I64)),
    case("floor-divide-1.0-by-0.1", fn(lambda x: x // 0.1), I([1.0], F32)),
    case("remainder-1.0-by-0.1", fn(lambda x: x % 0.1), I([1.0], F32)),
    case("fmod-1e7+1-by-3.3", fn(lambda x: x.fmod(3.3)), I([1e7 + 1], F32)),
    case("remainder-large", fn(lambda x: x % 3.3), I([1e7 + 1, -1e7 - 1], F32)),
    case("one-pow-nan", fn(lambda x: x**NAN), I([1.0], F32)),
    case("one-pow-nan-tensor", fn(lambda x, y: x**y), I([1.0, 1.0], F32), I([NAN, INF], F32)),
    case("neg-inf-pow-2.5", fn(lambda x: x**2.5), I([-INF], F32)),
    case("neg-zero-pow-neg-1", fn(lambda x: x**-1.0), I([-0.0], F32)),
    case("zero-and-nan-pow", fn(lambda x, y: x**y), I([0.0, -0.0, 0.0, -0.0, -0.0, NAN, NAN], F32),
         I([-1.5, -1.5, -2.0, -3.0, 3.0, 2.5, -1.5], F32)),
    case("zero-pow-neg-1.5", fn(lambda x: x**-1.5), I([0.0, -0.0, NAN], F32)),
    # identities that compilers may fold (WGSL lets them assume finite values): NaN where x is
    # infinite or NaN, and the sign of a zero sum
    case("self-sub-edges", fn(lambda x: x - x), I([INF, NAN, -INF, 1.5, -0.0], F32)),
    case("add-neg-self-edges", fn(lambda x: x + (-x)), I([INF, NAN, -INF, 1.5, -0.0], F32)),
    case("times-one-sub-edges", fn(lambda x: x * 1.0 - x), I([INF, NAN, -INF, 1.5], F32)),
    case("times-zero-edges", fn(lambda x: (x * 0.0, 0.0 * x, x * -0.0)),
         I([INF, NAN, -INF, 1.5, -0.0, -2.0], F32)),
    case("plus-zero-edges", fn(lambda x: (1 / (x + 0.0), 1 / (0.0 + x), 1 / (0.0 - x),
                                          1 / (x - 0.0))),  # (1 / tells the zeros' signs)
         I([-0.0, 0.0, INF, NAN, -2.5], F32)),
    # the divisor's gradient as -g * ((x / y) / y): y * y underflows at 1e-30
    case("div-tiny", fn(lambda x, y: x / y), I([1e-30, 2.0, -3e-20], F32),
         I([1e-30, 1e-25, 7.0], F32), grad=True),
    case("log1p-1e-10", method("log1p"), I([1e-10], F32)),
    case("expm1-1e-10", method("expm1"), I([1e-10], F32)),
    case("std-1e20", method("std"), I([1e20, 2e20, 3e20], F32)),
    case("var-1e20", method("var"), I([1e20, 2e20, 3e20], F32)),
    case("sum-int32-0d-int64", fn(lambda x, y: x + y), I([1, 2], I32), I(5, I64)),
    case("f16-times-0d-f32", fn(lambda x, y: x * y), I([1.5, 2.0], F16), I(3.0, F32)),
    case("int-pow-2.0", fn(lambda x: x**2.0), I([1, 2, 3], I32)),
    case("bool-square", method("square"), I([True, False], BOOL)),
    case("uint8-plus-int8", fn(lambda x, y: x + y), I([200, 1], U8), I([-1, 1], I8)),
    case("int8-plus-1000", fn(lambda x: x + 1000), I([1, 2], I8)),
    case(
        "to-cpu-float16",
        fn(
            lambda x: (
                x.to("cpu", dtype=AG.float16)
                if isinstance(x, ag.Tensor)
                else x.to("cpu", dtype=TORCH.float16)
            )
        ),
        I([1.5, 2.25], F32),
    ),
    # gradients at kinks, ties and saturation
    case("grad-prod-zero-factor", method("prod"), I([2.0, 0.0, 3.0], F32), grad=True),
    case("grad-prod-two-zeros", method("prod"), I([0.0, 4.0, 0.0], F32), grad=True),
    case(
        "grad-prod-dim-zero", fn(lambda x: x.prod(1)), I([[2.0, 0.0], [3.0, 4.0]], F32), grad=True
    ),
    case("grad-sigmoid-minus-100", method("sigmoid"), I([-100.0, 100.0], F32), grad=True),
    case("grad-silu-minus-100", _functional("silu"), I([-100.0, 100.0], F32), grad=True),
    case("grad-tanh-minus-50", method("tanh"), I([-50.0, 50.0], F32), grad=True),
    case("grad-cube-at-0", fn(lambda x: x**3), I([0.0, -0.0], F32), grad=True),
    case("grad-pow-half-at-0", fn(lambda x: x**0.5), I([0.0, 4.0], F32), grad=True),
    case("grad-std-constant", method("std"), I([1.0, 1.0, 1.0], F32), grad=True),
    case("grad-abs-at-0", method("abs"), I([0.0, -0.0], F32), grad=True),
    case("grad-sqrt-at-0", method("sqrt"), I([0.0], F32), grad=True),
    case(
        "grad-clamp-boundary", fn(lambda x: x.clamp(-1.0, 1.0)), I([-1.0, 1.0, 0.5], F32), grad=True
    ),
    case(
        "grad-clamp-min-boundary-tensor",
        fn(lambda x, m: x.clamp(min=m)),
        I([1.0, 2.0], F32),
        I([1.0, 3.0], F32),
        grad=True,
    ),
    case(
        "grad-maximum-tie",
        fn(lambda x, y: x.maximum(y)),
        I([1.0, 2.0], F32),
        I([1.0, 3.0], F32),
        grad=True,
    ),
    case("grad-relu-at-0", method("relu"), I([0.0, -0.0, 1.0], F32), grad=True),
    case(
        "grad-pow-wrt-exponent-at-0",
        fn(lambda x, y: x**y),
        I([2.0, 0.0, -3.0], F32),
        I([0.0, 0.0, 0.0], F32),
        grad=True,
    ),
    case(
        "grad-pow-zero-base",
        fn(lambda x, y: x**y),
        I([0.0, 0.0], F32),
        I([2.0, 0.5], F32),
        grad=True,
    ),
    case(
        "grad-max-dim-tie",
        fn(lambda x: x.max(1).values),
        I([[1.0, 3.0, 3.0], [2.0, 2.0, 1.0]], F32),
        grad=True,
    ),
    case(
        "grad-min-dim-tie",
        fn(lambda x: x.min(0).values),
        I([[1.0, 3.0], [1.0, 2.0]], F32),
        grad=True,
    ),
    case("grad-max-all-tie", method("max"), I([3.0, 1.0, 3.0], F32), grad=True),
    case("grad-amax-tie", fn(lambda x: x.amax(0)), I([3.0, 1.0, 3.0], F32), grad=True),
    case(
        "grad-max_pool2d-tie",
        lambda L, x: L.F.max_pool2d(x, 2),
        I(np.array([[1.0, 1.0, 2.0, 0.0], [1.0, 1.0, 2.0, 2.0]]).reshape(1, 1, 2, 4), F32),
        grad=True,
    ),
    case(
        "grad-max_pool2d-overlap-tie",
        lambda L, x: L.F.max_pool2d(x, 2, 1),
        I(np.ones((1, 1, 3, 3)), F32),
        grad=True,
    ),
    case("grad-logsumexp-inf", fn(lambda x: x.logsumexp(0)), I([-INF, -INF], F32), grad=True),
    # empty axes, 0-d tensors, empty index lists
    case("sum-empty-axis", fn(lambda x: x.sum(0)), I(np.zeros((0, 3)), F32), grad=True),
    case("prod-empty-axis", fn(lambda x: x.prod(0)), I(np.zeros((0, 3)), F32)),
    case("mean-empty", method("mean"), I(np.zeros((0,)), F32)),
    case("amax-empty-axis-raises", fn(lambda x: x.amax(0)), I(np.zeros((0, 3)), F32)),
    case(
        "matmul-empty-inner",
        fn(lambda x, y: x @ y),
        I(np.zeros((2, 0)), F32),
        I(np.zeros((0, 3)), F32),
        grad=True,
    ),
    case("argmax-0d", method("argmax"), I(5.0, F32)),
    case("argmax-0d-dim", fn(lambda x: x.argmax(0)), I(5.0, F32)),
    case("max-0d-dim", fn(lambda x: x.max(0)), I(5.0, F32)),
    case("cumsum-0d", fn(lambda x: x.cumsum(0)), I(5.0, F32)),
    case("softmax-0d", fn(lambda x: x.softmax(0)), I(5.0, F32)),
    case("chunk-0d", fn(lambda x: x.chunk(2)), I(5.0, F32)),
    case("sum-0d-dim", fn(lambda x: x.sum(0)), I(5.0, F32)),
    case("index-empty-list", fn(lambda x: x[[]]), I(np.arange(6.0).reshape(2, 3), F32)),
    case("index-empty-list-int", fn(lambda x: x[[]]), I(np.arange(6).reshape(2, 3), I64)),
    case("flip-0d", fn(lambda x: x.flip(0)), I(5.0, F32)),
    case("transpose-0d", fn(lambda x: x.transpose(0, -1)), I(5.0, F32)),
    # integer and bool inputs of float reductions
    case("logsumexp-uint8", fn(lambda x: x.logsumexp(1)), I([[1, 4, 0, 255]], U8)),
    case("logsumexp-bool", fn(lambda x: x.logsumexp(0)), I([True, False, True], BOOL)),
    case(
        "sum-int8-dtype-float32",
        fn(
            lambda x: (
                x.sum(dtype=AG.float32) if isinstance(x, ag.Tensor) else x.sum(dtype=TORCH.float32)
            )
        ),
        I([100, 100, -7], I8),
    ),
    # a zero gradient (round, floor, ...) stays zero whatever flows into it
    case(
        "grad-pow-rounded-exponent",
        fn(lambda x, y: x ** y.round()),
        I([-2.0, 3.0], F32),
        I([1.2, 2.0], F32),
        grad=True,
    ),
]


def _isolated(
    name: str, expr: str, values: list, dtype: DType, expect: dict[str, Any] | None = None
) -> Any:
    """``expr`` of ``x`` (and ``ag``, which names torch on the reference side); ``expect``
    written out only where PyTorch's processor kernel cannot be asked."""
    return pytest.param(expr, values, dtype, expect, id=name)


# Cases that crash or hang the process today, run in a child process with a time limit.
# PyTorch raises on an integer zero divisor; on (minimum) // -1 its processor kernel traps
# itself, so that result is written out: the two's-complement wrap (as on GPUs and in NumPy),
# with remainder 0.
ISOLATED = [
    _isolated("floordiv-by-zero", "x // 0", [7], I64),
    # a tensor divisor holding zeros gives 0 (docs/from-pytorch.md: no host read to raise)
    _isolated(
        "floordiv-by-zero-tensor",
        "x // ag.zeros_like(x)",
        [7, -7],
        I32,
        {"values": [0, 0], "dtype": "int32"},
    ),
    _isolated("remainder-by-zero", "x % 0", [7], I64),
    _isolated("fmod-by-zero", "x.fmod(0)", [7], I32),
    _isolated("div-trunc-by-zero", "x.div(0, rounding_mode='trunc')", [7], I64),
    _isolated(
        "int32-min-floordiv-minus-1",
        "x // -1",
        [-(2**31)],
        I32,
        {"values": [-(2**31)], "dtype": "int32"},
    ),
    _isolated(
        "int32-min-remainder-minus-1", "x % -1", [-(2**31)], I32, {"values": [0], "dtype": "int32"}
    ),
    _isolated(
        "int32-min-fmod-minus-1", "x.fmod(-1)", [-(2**31)], I32, {"values": [0], "dtype": "int32"}
    ),
    _isolated(
        "int32-min-div-trunc-minus-1",
        "x.div(-1, rounding_mode='trunc')",
        [-(2**31)],
        I32,
        {"values": [-(2**31)], "dtype": "int32"},
    ),
    _isolated(
        "int64-min-floordiv-minus-1",
        "x // -1",
        [-(2**63)],
        I64,
        {"values": [-(2**63)], "dtype": "int64"},
    ),
    _isolated(
        "int64-min-remainder-minus-1", "x % -1", [-(2**63)], I64, {"values": [0], "dtype": "int64"}
    ),
    _isolated("int-scalar-pow-int-tensor", "3 ** x", [[0, 1, 2, 3], [3, 2, 1, 0]], I32),
]
# a fresh interpreter that opens a device: seconds on a loaded machine (a WebGPU device took
# over 8 s under 14 test workers); a trapped division would hang, not take 30 s
ISOLATED_TIMEOUT_S = 30

# Inputs PyTorch refuses (bool or integer inputs to float math, a negative slice step, Python
# scalars in maximum) that anygpu computes by design (docs/from-pytorch.md): for these, a sample
# that PyTorch refuses passes if anygpu computes it without error.
SUPERSET: set[str] = {
    "abs-bool",
    "argmax-bool",
    "argmin-bool",
    "ceil-bool",
    "floor-bool",
    "gelu-int64",
    "getitem-basic-float32",
    "leaky_relu-int64",
    "log_softmax-int64",
    "maximum-python-scalar-float32",
    "pow-bool",
    "relu-bool",
    "round-bool",
    "silu-int64",
    "softmax-int64",
    "softplus-int64",
    "trunc-bool",
}

# Divergences from PyTorch not yet resolved, by "<op>-<dtype>": (what differs, the backends it
# was seen failing on). On the processor devices CI runs (cpu, PoCL, lavapipe) the listed backends
# are expected to fail, strictly: one that starts to match PyTorch fails until it is taken out of
# here. On a GPU an entry may fail or pass. The "superset" entries are inputs PyTorch refuses that
# anygpu computes (docs/from-pytorch.md).
KNOWN: dict[str, tuple[str, tuple[str, ...]]] = {
    "add-alpha-float32": (
        "inf.add(-3e38, alpha=2): PyTorch's cpu kernel fuses the multiply-add",
        ("cpu", "webgpu"),
    ),
    "cos-float32": (
        "cos of huge arguments (1e20, 3e38, integer extremes) is imprecise",
        ("webgpu",),
    ),
    "cos-int32": ("cos of huge arguments (1e20, 3e38, integer extremes) is imprecise", ("webgpu",)),
    "cos-int64": ("cos of huge arguments (1e20, 3e38, integer extremes) is imprecise", ("webgpu",)),
    "gather-float32": (
        "an out-of-range device index reads a clamped element (PyTorch raises)",
        ("cpu", "opencl", "webgpu"),
    ),
    "index_select-float32": (
        "an out-of-range device index reads a clamped element (PyTorch raises)",
        ("cpu", "opencl", "webgpu"),
    ),
    "prod-float32": (
        "prod's gradient with inf and 0 factors (PyTorch: nan)",
        ("cpu", "opencl", "webgpu"),
    ),
    "promote-add-int8": (
        "uint8 with int8 gives int32 (PyTorch: int16, which anygpu does not offer)",
        ("cpu", "opencl", "webgpu"),
    ),
    "promote-add-uint8": (
        "uint8 with int8 gives int32 (PyTorch: int16, which anygpu does not offer)",
        ("cpu", "opencl", "webgpu"),
    ),
    "promote-pow-int8": (
        "uint8 with int8 gives int32 (PyTorch: int16, which anygpu does not offer)",
        ("cpu", "opencl", "webgpu"),
    ),
    "promote-pow-uint8": (
        "uint8 with int8 gives int32 (PyTorch: int16, which anygpu does not offer)",
        ("cpu", "opencl", "webgpu"),
    ),
    "promote-where-int8": (
        "uint8 with int8 gives int32 (PyTorch: int16, which anygpu does not offer)",
        ("cpu", "opencl", "webgpu"),
    ),
    "promote-where-uint8": (
        "uint8 with int8 gives int32 (PyTorch: int16, which anygpu does not offer)",
        ("cpu", "opencl", "webgpu"),
    ),
    "square-float32": (
        "g * (2 * x) at x = 3e38: NVIDIA's Vulkan compiler reorders the product (finite where "
        "PyTorch's 2 * x overflows)",
        (),
    ),
    "sin-float32": (
        "sin of huge arguments (1e20, 3e38, integer extremes) is imprecise",
        ("webgpu",),
    ),
    "sin-int32": ("sin of huge arguments (1e20, 3e38, integer extremes) is imprecise", ("webgpu",)),
    "sin-int64": ("sin of huge arguments (1e20, 3e38, integer extremes) is imprecise", ("webgpu",)),
    "std-float32": (
        "std's gradient over an empty axis raises; NaN at +-3e38",
        ("cpu", "opencl", "webgpu"),
    ),
    "tan-float32": (
        "tan of huge arguments (1e20, 3e38, integer extremes) is imprecise",
        ("webgpu",),
    ),
    "tan-int32": ("tan of huge arguments (1e20, 3e38, integer extremes) is imprecise", ("webgpu",)),
    "tan-int64": ("tan of huge arguments (1e20, 3e38, integer extremes) is imprecise", ("webgpu",)),
    "uint8-plus-int8-uint8": (
        "uint8 with int8 gives int32 (PyTorch: int16, not offered)",
        ("cpu", "opencl", "webgpu"),
    ),
    "var-float32": ("var of a 0-d tensor, and its gradient at +-3e38", ("webgpu",)),
}

OPS = ELEMENTWISE + PROMOTION + REDUCTIONS + MOVEMENT + LINALG + CASES
for _group, _ops in (
    ("elementwise", ELEMENTWISE),
    ("promotion", PROMOTION),
    ("reductions", REDUCTIONS),
    ("movement", MOVEMENT),
    ("linalg", LINALG),
    ("cases", CASES),
):
    for _op in _ops:
        _op.group = _group


# ---- running one op in both libraries -----------------------------------------------------
DEADLINE_S = 60  # one sample, or one fused read; far above what any takes when all is well


def _materialize(value: Any, L: Any, device: str, leaves: list | None) -> Any:
    if isinstance(value, In):
        if L is AG:
            t = ag.tensor(value.host, dtype=value.dtype, device=device)
        else:
            t = torch.from_numpy(np.array(value.host)).to(TORCH_DTYPE[value.dtype])
        if leaves is not None and value.grad and value.dtype == F32:
            t.requires_grad_(True)
            leaves.append(t)
        return value.view(t) if value.view is not None else t
    if isinstance(value, list) and any(isinstance(v, In) for v in value):
        return [_materialize(v, L, device, leaves) for v in value]
    if isinstance(value, tuple):
        return tuple(_materialize(v, L, device, leaves) for v in value)
    return value


def _run(op: OpInfo, L: Any, sample: Sample, device: str, grad: bool) -> tuple[Any, list]:
    leaves: list | None = [] if grad else None
    args = _materialize(sample.args, L, device, leaves)
    kwargs = {k: _materialize(v, L, device, leaves) for k, v in sample.kwargs.items()}
    call = op.ref if L is TORCH and op.ref is not None else op.call
    if isinstance(call, str):
        out = getattr(args[0], call)(*args[1:], **kwargs)
    else:
        out = call(L, *args, **kwargs)
    return out, leaves or []


def _one_at_a_time(op: OpInfo, sample: Sample, ref: Any) -> Any:
    """PyTorch's values of an elementwise op, computed element by element. Its vectorized CPU
    kernels disagree with its own scalar path at a few edge values (gelu(inf) is nan in a long
    tensor and inf in a short one; fmod and remainder are nan where the quotient overflows):
    the scalar path is the reference."""
    args = _materialize(sample.args, TORCH, "", None)
    kwargs = {k: _materialize(v, TORCH, "", None) for k, v in sample.kwargs.items()}
    values = list(args) + list(kwargs.values())
    if not any(isinstance(v, torch.Tensor) for v in values):
        return ref
    flat = {
        id(v): v.broadcast_to(ref.shape).reshape(-1) for v in values if isinstance(v, torch.Tensor)
    }
    pick = lambda v, i: flat[id(v)][i : i + 1] if isinstance(v, torch.Tensor) else v  # noqa: E731
    call = op.ref if op.ref is not None else op.call
    out = []
    for i in range(ref.numel()):
        a = [pick(v, i) for v in args]
        k = {name: pick(v, i) for name, v in kwargs.items()}
        r = getattr(a[0], call)(*a[1:], **k) if isinstance(call, str) else call(TORCH, *a, **k)
        if not isinstance(r, torch.Tensor) or r.dtype != ref.dtype or r.numel() != 1:
            return ref
        out.append(r.reshape(()))
    return torch.stack(out).reshape(ref.shape) if out else ref


def _outputs(out: Any) -> list[Any]:
    if isinstance(out, (tuple, list)):
        return [o for x in out for o in _outputs(x)]
    return [out]


def _backward(L: Any, outs: list[Any], upstream: list[np.ndarray], device: str) -> None:
    if L is AG:
        ups = [ag.tensor(u, device=device) for u in upstream]
    else:
        ups = [torch.from_numpy(u) for u in upstream]
    if len(outs) == 1:
        outs[0].backward(ups[0])
        return
    total = None
    for o, u in zip(outs, ups):
        term = (o * u).sum()
        total = term if total is None else total + term
    total.backward()


def _unsupported(err: BaseException, device: str) -> str | None:
    """The dtype an error says this device lacks, if that is what it says."""
    if not isinstance(err, (ag.UnsupportedError, TypeError)):
        return None
    dev = get_device(device)
    for d in dt.PUBLIC:
        if not dev.supports(d) and re.search(rf"\b{d.name}\b", str(err)):
            return d.name
    return None


def _describe(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:160] if text else ''}"


@dataclass
class Pending:
    """A value to read back from the device and compare."""

    label: str
    tensor: Any  # anygpu
    expected: Any  # torch
    tol: tuple[float, float]
    inputs: list = field(default_factory=list)  # torch inputs, to show where values differ
    owner: Any = None  # the Outcome it belongs to
    raises: str | None = None  # PyTorch raised: the failure to report if this reads fine


def _tolerance(op: OpInfo, torch_dtype: Any) -> tuple[float, float]:
    d = FROM_TORCH.get(torch_dtype, F32)
    return op.tol.get(d, TOLERANCE.get(d, (0.0, 0.0)))


def _mismatch(got: Any, exp: Any, rtol: float, atol: float) -> Any:
    if exp.dtype.is_floating_point or got.dtype.is_floating_point:
        g, e = got.double(), exp.double()
        with np.errstate(invalid="ignore"):
            close = ((g - e).abs() <= atol + rtol * e.abs()) | (g == e)
        # an infinite value matches only itself (rtol * inf had let anything but NaN match it)
        close = torch.where(e.isinf() | g.isinf(), g == e, close)
        close = (close & ~(g.isnan() | e.isnan())) | (g.isnan() & e.isnan())
    else:
        close = got.long() == exp.long()
    return ~close


def _where_values(p: Pending, bad: Any, got: Any) -> str:
    idx = [tuple(int(i) for i in row) for row in bad.nonzero()[:4]]
    lines = []
    for i in idx:
        at = []
        for x in p.inputs:
            try:
                at.append(x.detach().expand(p.expected.shape)[i].item())
            except Exception:
                pass
        where = f" inputs {at}" if at else ""
        lines.append(f"at {i}{where}: anygpu {got[i].item()!r}, torch {p.expected[i].item()!r}")
    return "; ".join(lines)


def _compare(p: Pending, host: np.ndarray) -> str | None:
    exp = p.expected.detach()
    got = torch.from_numpy(np.array(host).reshape(tuple(exp.shape)))
    same_kind = got.dtype.is_floating_point == exp.dtype.is_floating_point
    if same_kind:
        got = got.to(exp.dtype)
    bad = _mismatch(got, exp, *p.tol)
    if not bool(bad.any()):
        return None
    return (
        f"{p.label}: {int(bad.sum())} of {bad.numel()} values differ "
        f"(rtol={p.tol[0]}, atol={p.tol[1]}); {_where_values(p, bad, got)}"
    )


def _transport(t: Any, int_dtype: DType) -> Any:
    return t.detach().cast(F32 if t.dtype.is_float else int_dtype).reshape(-1)


def read_all(pending: list[Pending], device: str) -> list[tuple[Pending, Any]]:
    """Every pending tensor's values (or the error reading it raised): non-empty tensors of a
    kind are read through one fused kernel, a few buffers at a time."""
    dev = get_device(device)
    int_dtype = I64 if dev.supports(I64) else I32
    buffer_limit = max(min(dev.max_kernel_buffers, 124) - 4, 4)
    results: list[tuple[Pending, Any]] = []
    groups: dict[tuple, list[Pending]] = {}
    for p in pending:
        if p.tensor.numel() == 0:
            # an empty result has no values to compare (its shape and dtype are checked), and
            # reading it compiles a kernel of its own: only where it should raise
            results.append((p, _read_one(p.tensor) if p.raises is not None else np.zeros(0)))
        elif int_dtype == I32 and p.tensor.dtype == I64:
            results.append((p, _read_one(p.tensor)))
        else:
            key = (p.tensor.dtype.is_float, p.tensor.device, p.raises is None)
            groups.setdefault(key, []).append(p)
    for items in groups.values():
        chunk: list[Pending] = []
        weight = 0
        for p in items + [None]:  # type: ignore[list-item]
            w = 0 if p is None else len(p.inputs) + 1
            if chunk and (p is None or weight + w > buffer_limit):
                results += _read_chunk(chunk, int_dtype)
                chunk, weight = [], 0
            if p is not None:
                chunk.append(p)
                weight += w
    return results


def _read_one(t: Any) -> Any:
    try:
        with deadline(DEADLINE_S):
            return t.detach().numpy()
    except Exception as err:  # reported by the caller, with the sample's name
        return err


def _read_chunk(chunk: list[Pending], int_dtype: DType) -> list[tuple[Pending, Any]]:
    if len(chunk) == 1:
        return [(chunk[0], _read_one(chunk[0].tensor))]
    try:
        with deadline(DEADLINE_S):
            flat = ag.cat([_transport(p.tensor, int_dtype) for p in chunk]).numpy()
    except Overtime as err:  # no retry in parts: that would wait as long again
        return [(p, err) for p in chunk]
    except Exception:  # find which fail: halves, then halves of the half that fails
        half = len(chunk) // 2
        return _read_chunk(chunk[:half], int_dtype) + _read_chunk(chunk[half:], int_dtype)
    out, start = [], 0
    for p in chunk:
        n = p.tensor.numel()
        out.append((p, flat[start : start + n]))
        start += n
    return out


def _dtype_name(x: Any) -> str:
    if isinstance(x, ag.Tensor):
        return x.dtype.name
    return str(x.dtype).replace("torch.", "")


class Outcome:
    def __init__(self) -> None:
        self.failures: list[str] = []
        self.unsupported: set[str] = set()
        self.pending: list[Pending] = []


def _expect_raise(name: str, out: Any, terr: BaseException, res: Outcome) -> None:
    """PyTorch raised: anygpu must raise too, when building or when computing (its outputs
    are read with the rest; one of them must fail)."""
    outs = _outputs(out)
    what = ", ".join(
        f"{_dtype_name(o)}{tuple(o.shape)}" if isinstance(o, ag.Tensor) else repr(o) for o in outs
    )
    message = f"{name}: torch raises ({_describe(terr)}); anygpu returned {what}"
    tensors = [o for o in outs if isinstance(o, ag.Tensor)]
    if not tensors:
        res.failures.append(message)
    for t in tensors:
        res.pending.append(Pending(name, t, None, (0.0, 0.0), raises=message))


def _check_sample(
    op: OpInfo, sample: Sample, dtype: DType, device: str, seed: int, res: Outcome
) -> None:
    name = f"[{sample.name}]"
    grad = (
        op.differentiable
        and sample.grad
        and dtype == F32
        and any(isinstance(a, In) and a.dtype == F32 for a in _flat_args(sample))
    )
    try:
        ref, tleaves = _run(op, TORCH, sample, device, grad)
        terr = None
    except Exception as err:
        ref, tleaves, terr = None, [], err
    try:
        out, leaves = _run(op, AG, sample, device, grad)
    except Exception as err:
        if terr is None:
            missing = _unsupported(err, device)
            if missing:
                res.unsupported.add(missing)
            else:
                res.failures.append(
                    f"{name}: anygpu raises {_describe(err)}; torch gives {_summary(ref)}"
                )
        return
    if terr is not None:
        if f"{op.name}-{dtype.name}" in SUPERSET:  # computed by design: it must compute
            for o in _outputs(out):
                if isinstance(o, ag.Tensor):
                    res.pending.append(Pending(name, o, None, (0.0, 0.0)))
            return
        _expect_raise(name, out, terr, res)
        return
    outs, refs = _outputs(out), _outputs(ref)
    if len(outs) != len(refs):
        res.failures.append(f"{name}: anygpu returns {len(outs)} values, torch {len(refs)}")
        return
    tinputs = _flat_torch(sample)
    for k, (o, r) in enumerate(zip(outs, refs)):
        label = f"{name} value {k}" if len(outs) > 1 else f"{name} value"
        if not isinstance(r, torch.Tensor):
            if o != r:
                res.failures.append(f"{label}: anygpu {o!r}, torch {r!r}")
            continue
        if not isinstance(o, ag.Tensor):
            res.failures.append(f"{label}: anygpu returns {type(o).__name__}, torch a tensor")
            continue
        meta = []
        if o.dtype.name != _dtype_name(r):
            meta.append(f"dtype {o.dtype.name}, torch {_dtype_name(r)}")
        if tuple(o.shape) != tuple(r.shape):
            meta.append(f"shape {tuple(o.shape)}, torch {tuple(r.shape)}")
        if meta:
            res.failures.append(f"{label}: " + "; ".join(meta))
            if tuple(o.shape) != tuple(r.shape):
                continue
        if op.elementwise and sample.name.startswith("edges") and len(outs) == 1:
            r = _one_at_a_time(op, sample, r.detach())
        res.pending.append(Pending(label, o, r, _tolerance(op, r.dtype), tinputs))
    if grad:
        _check_grads(op, name, outs, refs, leaves, tleaves, device, seed, res)


def _flat_args(sample: Sample) -> list[Any]:
    flat: list[Any] = []
    for a in list(sample.args) + list(sample.kwargs.values()):
        flat += _flat_args(Sample("", tuple(a))) if isinstance(a, (list, tuple)) else [a]
    return flat


def _flat_torch(sample: Sample) -> list:
    """The torch inputs of a sample that are tensors (rebuilt: leaves only exist for grads)."""
    out = []
    for a in _flat_args(sample):
        if isinstance(a, In):
            t = torch.from_numpy(np.array(a.host)).to(TORCH_DTYPE[a.dtype])
            out.append(a.view(t) if a.view is not None else t)
    return out


def _summary(ref: Any) -> str:
    return ", ".join(
        f"{_dtype_name(r)}{tuple(r.shape)}" if isinstance(r, torch.Tensor) else repr(r)
        for r in _outputs(ref)
    )


def _check_grads(
    op: OpInfo,
    name: str,
    outs: list,
    refs: list,
    leaves: list,
    tleaves: list,
    device: str,
    seed: int,
    res: Outcome,
) -> None:
    pairs = [(o, r) for o, r in zip(outs, refs) if isinstance(r, torch.Tensor) and r.requires_grad]
    if not pairs:
        return
    missing = [k for k, (o, _) in enumerate(pairs) if not getattr(o, "requires_grad", False)]
    if missing:
        res.failures.append(f"{name} grad: anygpu output {missing} does not require grad")
        return
    rng = np.random.default_rng(seed)
    upstream = [rng.standard_normal(tuple(r.shape)).astype(np.float32) for _, r in pairs]
    try:
        _backward(TORCH, [r for _, r in pairs], upstream, device)
    except RuntimeError:  # no derivative in PyTorch (floor_divide, ...): nothing to compare
        return
    try:
        _backward(AG, [o for o, _ in pairs], upstream, device)
    except Exception as err:
        res.failures.append(f"{name} grad: anygpu backward raises {_describe(err)}")
        return
    for k, (leaf, tleaf) in enumerate(zip(leaves, tleaves)):
        label = f"{name} grad of input {k}"
        expected = tleaf.grad if tleaf.grad is not None else torch.zeros_like(tleaf)
        if leaf.grad is None:
            if bool((expected != 0).any()):
                res.failures.append(f"{label}: anygpu has no gradient, torch {expected}")
            continue
        if tuple(leaf.grad.shape) != tuple(expected.shape):
            res.failures.append(f"{label}: shape {leaf.grad.shape}, torch {tuple(expected.shape)}")
            continue
        if expected.numel() == 0:
            continue
        res.pending.append(Pending(label, leaf.grad, expected, op.grad_tol, [tleaf]))


def _samples(op: OpInfo, dtype: DType, host: Callable[..., np.ndarray]) -> list[Sample]:
    samples: list[Sample] = []
    for s in range(3 if FULL else 1):
        g = Gen(dtype, _seed(op.name, dtype.name, str(s)), host)
        drawn = op.samples(g)
        if op.subset and not g.full:
            drawn = [x for k, x in enumerate(drawn) if k < op.subset or x.name == "edges"]
        samples += [
            Sample(f"{x.name}#{s}" if s else x.name, x.args, x.kwargs, x.grad) for x in drawn
        ]
    return samples


_evaluated: dict[tuple[str, str], dict[tuple[str, DType], Outcome]] = {}


def evaluate(
    op: OpInfo, device: str, host: Callable[..., np.ndarray]
) -> dict[tuple[str, DType], Outcome]:
    """The outcome of every dtype of ``op`` (and of the ops of its group) on ``device``,
    computed once for all of them: their values are read through a few fused kernels (each
    kernel is a compile, and compiles are what takes the time)."""
    key = (op.group or op.name, device)
    if key not in _evaluated:
        _evaluated.clear()
        ops = [o for o in OPS if o.group == op.group] if op.group else [op]
        _evaluated[key] = _evaluate(ops, device, host)
    return _evaluated[key]


def _evaluate(
    ops: list[OpInfo], device: str, host: Callable[..., np.ndarray]
) -> dict[tuple[str, DType], Outcome]:
    dev = get_device(device)
    outcomes: dict[tuple[str, DType], Outcome] = {}
    pending: list[Pending] = []
    for op in ops:
        for d in op.dtypes:
            res = outcomes[(op.name, d)] = Outcome()
            if not dev.supports(d):
                continue  # the test skips before it asks
            seed = _seed(op.name, d.name)
            for k, sample in enumerate(_samples(op, d, host)):
                try:
                    with deadline(DEADLINE_S):
                        _check_sample(op, sample, d, device, seed + k, res)
                except Overtime as err:
                    res.failures.append(f"[{sample.name}]: {err}")
                except Exception as err:  # anygpu failing where the checks above expect none
                    res.failures.append(f"[{sample.name}]: {_describe(err)}")
            for p in res.pending:
                p.owner = res
            pending += res.pending
    raised: dict[tuple[int, str], bool] = {}
    for p, got in read_all(pending, device):
        res = p.owner
        if p.raises is not None:
            key = (id(res), p.raises)
            raised[key] = raised.get(key, False) or isinstance(got, BaseException)
            continue
        if isinstance(got, BaseException):
            missing = _unsupported(got, device)
            if missing:
                res.unsupported.add(missing)
            else:
                res.failures.append(f"{p.label}: anygpu raises {_describe(got)} computing it")
            continue
        if p.expected is None:  # a superset case: computing it without error is the check
            continue
        problem = _compare(p, got)
        if problem:
            res.failures.append(problem)
    for res in outcomes.values():
        res.failures += [
            p.raises
            for p in res.pending
            if p.raises is not None and not raised.pop((id(res), p.raises), True)
        ]
        res.pending = []
    return outcomes


def _seed(*parts: str) -> int:
    return zlib.crc32("/".join(parts).encode())


@pytest.mark.parametrize(
    "op,dtype", [pytest.param(op, d, id=f"{op.name}-{d.name}") for op in OPS for d in op.dtypes]
)
def test_op(op: OpInfo, dtype: DType, device: str, host: Callable[..., np.ndarray]) -> None:
    res = evaluate(op, device, host)[(op.name, dtype)]
    known = KNOWN.get(f"{op.name}-{dtype.name}")
    backend = device.partition(":")[0]
    # the list was measured on the processor devices (cpu, PoCL, lavapipe) that CI runs; on a
    # GPU an entry may fail or pass
    on_processor = get_device(device).info.is_cpu
    expected = known is not None and (backend in known[1] or not on_processor)
    if res.failures:
        report = f"{op.name} {dtype.name} on {device}:\n  " + "\n  ".join(res.failures)
        if expected:
            assert known is not None
            pytest.xfail(f"known divergence ({known[0]}): {report}")
        pytest.fail(report, pytrace=False)
    if res.unsupported:
        pytest.skip(f"{', '.join(sorted(res.unsupported))} is not supported on {device}")
    if known is not None and backend in known[1] and on_processor:
        pytest.fail(
            f"{op.name} {dtype.name} now matches PyTorch on {device}: take it out of KNOWN",
            pytrace=False,
        )


_CHILD = """
import json, sys
import numpy as np
import anygpu as ag
expr, values, dtype, device = json.loads(sys.argv[1])
x = ag.tensor(np.array(values, dtype=getattr(np, dtype)), device=device)
try:
    out = eval(expr, {"ag": ag, "x": x})
    print(json.dumps({"dtype": out.dtype.name, "values": out.numpy().tolist()}))
except Exception as err:
    print(json.dumps({"error": type(err).__name__ + ": " + str(err)}))
"""


def _torch_expectation(expr: str, values: list, dtype: DType) -> dict[str, Any]:
    x = torch.tensor(values, dtype=TORCH_DTYPE[dtype])
    try:
        out = eval(expr, {"ag": torch, "x": x})
    except Exception as err:
        return {"error": _describe(err)}
    return {"dtype": _dtype_name(out), "values": out.tolist()}


@pytest.mark.parametrize("expr,values,dtype,expect", ISOLATED)
def test_isolated(expr: str, values: list, dtype: DType, expect: dict | None, device: str) -> None:
    """A case that may crash or hang the process runs in a child process: a crash or a hang
    fails this test instead of the session."""
    if not get_device(device).supports(dtype):
        pytest.skip(f"{dtype.name} is not supported on {device}")
    want = expect or _torch_expectation(expr, values, dtype)
    what = f"{expr} with x = {values} ({dtype.name}) on {device}"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps([expr, values, dtype.name, device])],
            capture_output=True,
            text=True,
            timeout=ISOLATED_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(
            f"{what}: did not finish in {ISOLATED_TIMEOUT_S} s; torch gives {want}", pytrace=False
        )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        pytest.fail(
            f"{what}: the process died (exit status {proc.returncode}); torch gives "
            f"{want}; stderr: {proc.stderr.strip()[-300:]}",
            pytrace=False,
        )
    got = json.loads(lines[-1])
    if "error" in want and "error" not in got:
        pytest.fail(f"{what}: torch raises ({want['error']}); anygpu returned {got}", pytrace=False)
    if "error" not in want and got != want:
        pytest.fail(f"{what}: anygpu {got}, expected {want}", pytrace=False)
