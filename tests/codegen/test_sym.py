"""The index simplifier: golden forms, floor semantics checked by evaluation, and axis merging."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import anygpu as ag
from anygpu.codegen import lower, sym
from anygpu.codegen.sym import (
    Div,
    Lin,
    Var,
    add,
    const,
    div,
    flat_index,
    mod,
    mul,
    substitute,
    unflatten,
    var,
)


def evaluate(x: Lin, env: dict[str, int]) -> int:
    total = x.const
    for atom, c in x.terms:
        if isinstance(atom, Var):
            v = env[atom.name]
        elif isinstance(atom, Div):
            v = evaluate(atom.a, env) // atom.b
        elif isinstance(atom, sym.Assumed):
            v = evaluate(atom.a, env)
        else:
            v = evaluate(atom.a, env) % atom.b
        total += c * v
    return total


def assignments(*xs: Lin):
    """Every assignment of the variables of ``xs`` within their ranges."""
    vs = sorted(set().union(*(x.vars() for x in xs)), key=lambda v: v.name)
    for values in itertools.product(*(range(v.size) for v in vs)):
        yield {v.name: n for v, n in zip(vs, values)}


i, j, k = var("i", 12), var("j", 4), var("k", 3)


# ---- golden forms -----------------------------------------------------------------------------
@pytest.mark.parametrize("expr,text", [
    (div(i * 4 + 3, 4), "i"),
    (mod(i * 4 + 3, 4), "3"),
    (mod(div(i * 4 + 3, 4), 12), "i"),
    (div(i * 4 + j, 4), "i"),
    (mod(i * 4 + j, 4), "j"),
    (div(i, 1), "i"),
    (mod(i, 1), "0"),
    (div(j, 4), "0"),  # bounds 0..3
    (mod(j, 4), "j"),
    (div(i * 2 + j * 2, 4), "((i+j)//2)"),
    (div(div(i, 2), 3), "(i//6)"),
    (mod(mod(i, 12), 4), "(i%4)"),
    (mod(mod(i, 6), 4), "((i%6)%4)"),
    (div(i * 6 + j, 18), "(i//3)"),  # a merged axis: (6*i + j)//18 with j < 6
    (mod(i * 6 + j, 18), "(i%3)*6+j"),
    (div(i + 12, 4), "(i//4)+3"),
    (mod(i * 3 + 7, 3), "1"),
    (add(i, mul(i, -1)), "0"),
    (i * 2 + 5 - 5, "i*2"),
    (var("z", 1) + 4, "4"),
])
def test_golden(expr: Lin, text: str) -> None:
    assert str(expr) == text


def test_div_and_mod_recombine() -> None:
    """k*b*(a//b) + k*(a%b) is k*a: what undoes a reshape."""
    assert div(i, 3) * 3 + mod(i, 3) == i
    assert div(i, 4) * 8 + mod(i, 4) * 2 == i * 2
    assert div(i + 1, 3) * 3 + mod(i + 1, 3) == i + 1


@pytest.mark.parametrize("shape", [(2, 3, 4), (24,), (1, 24), (4, 1, 6), (3, 8), (2, 2, 2, 3)])
def test_reshape_round_trip(shape: tuple[int, ...]) -> None:
    flat = var("f", 24)
    assert flat_index(unflatten(flat, shape), shape) == flat
    idx = [var(f"a{n}", s) for n, s in enumerate(shape)]
    back = unflatten(flat_index(idx, shape), shape)
    assert back == idx


def test_reshape_through_other_shapes() -> None:
    """(24,) -> (2, 12) -> (6, 4) -> (2, 3, 4) indexes memory with the flat variable again."""
    f = var("f", 24)
    idx, prev = [f], (24,)
    for shape in ((2, 12), (6, 4), (2, 3, 4)):
        idx, prev = unflatten(flat_index(idx, prev), shape), shape
    assert [str(x) for x in idx] == ["(f//12)", "((f//4)%3)", "(f%4)"]
    assert flat_index(idx, prev) == f


def test_bounds() -> None:
    assert (i * 2 - j + 3).bounds == (0, 25)
    assert div(i, 5).bounds == (0, 2)
    assert mod(i + 5, 7).bounds == (0, 6)
    assert const(-4).bounds == (-4, -4)
    assert (i * -1).bounds == (-11, 0)


def test_substitute() -> None:
    a, b = var("a", 4), var("b", 3)
    iv = Var("i", 12)
    assert substitute(div(i, 3), {iv: a * 3 + b}) == a
    assert substitute(mod(i, 3), {iv: a * 3 + b}) == b
    assert substitute(i * 2 + 1, {iv: a + 1}) == a * 2 + 3
    assert substitute(div(i, 3), {}) == div(i, 3)


def test_an_assumed_range_cancels_a_padded_reshape() -> None:
    """A padded tensor's source index (``o - 1``, guarded to 0 .. 11) flattened with a row and
    split again leaves no division where its range is taken as given; without it the split
    borrows across rows. Where the index is in range anyway, nothing changes; the assumed
    index evaluates to the index itself, and substitution keeps the assumption."""
    o, r = var("o", 14), var("r", 3)
    padded = o - 1  # bounds -1 .. 12: reads of the padding are guarded
    plain = unflatten(flat_index([r, padded], (3, 12)), (3, 12))
    assert any(isinstance(a, (sym.Div, sym.Mod)) for x in plain for a, _ in x.terms)
    kept = sym.assumed(padded, 12)
    assert kept.bounds == (0, 11)
    assert unflatten(flat_index([r, kept], (3, 12)), (3, 12)) == [r, kept]
    assert sym.assumed(r, 3) == r
    assert [evaluate(kept, {"o": v}) for v in (0, 5, 13)] == [-1, 4, 12]  # its own value
    moved = substitute(kept, {Var("o", 14): var("p", 13) + 1})
    assert str(moved) == "assumed(p<12)"
    assert substitute(kept, {Var("o", 14): var("q", 12) + 1}) == var("q", 12)  # in range


def test_has_divmod_and_strides() -> None:
    iv = Var("i", 12)
    assert sym.has_divmod_of(div(i, 3) + j, iv)
    assert not sym.has_divmod_of(i * 3 + div(j, 2), iv)
    assert sym.strides_of((2, 3, 4)) == (12, 4, 1)
    assert sym.strides_of(()) == ()
    assert flat_index([], ()) == const(0)


# ---- semantics by evaluation ------------------------------------------------------------------
lins = st.builds(
    lambda cs, c0, sizes: Lin((), 0) + c0 + sum(
        (var(f"v{n}", s) * c for n, (c, s) in enumerate(zip(cs, sizes))), const(0)),
    st.lists(st.integers(-7, 9), min_size=1, max_size=3), st.integers(-20, 20),
    st.lists(st.integers(1, 7), min_size=3, max_size=3))


@given(x=lins, b=st.integers(1, 24), c=st.integers(1, 6))
def test_div_mod_match_floor_semantics(x: Lin, b: int, c: int) -> None:
    outs = [div(x, b), mod(x, b), div(div(x, b), c), mod(mod(x, b * c), b), mod(div(x, b), c),
            div(mod(x, b * c), b), div(x, b) * b + mod(x, b)]
    for env in assignments(x):
        v = evaluate(x, env)
        want = [v // b, v % b, v // b // c, v % (b * c) % b, (v // b) % c, v % (b * c) // b, v]
        assert [evaluate(o, env) for o in outs] == want, env
    for o in outs[:2]:
        lo, hi = o.bounds
        assert all(lo <= evaluate(o, env) <= hi for env in assignments(x))


@given(n=st.integers(1, 5), m=st.integers(1, 5), b=st.integers(1, 30), c=st.integers(0, 4))
def test_merged_axis_rules_are_exact(n: int, m: int, b: int, c: int) -> None:
    """The (c*y + r) // b rules the axis merger relies on, against brute force."""
    y, r = var("y", n * 3), var("r", m)
    x = y * m + r + c
    for env in assignments(x):
        v = evaluate(x, env)
        assert evaluate(div(x, b), env) == v // b
        assert evaluate(mod(x, b), env) == v % b


@given(x=lins, y=st.integers(1, 4))
def test_substitute_matches_evaluation(x: Lin, y: int) -> None:
    vs = sorted(x.vars(), key=lambda v: v.name)
    if not vs:
        return
    first = vs[0]
    a, b = var("sa", -(-first.size // y) if y > 1 else first.size), var("sb", y)
    expr = mod(div(x, 3), 5) + div(x, 2)
    sub = substitute(expr, {first: a * y + b})
    for env in assignments(sub):
        inner = dict(env)
        inner[first.name] = env.get("sa", 0) * y + env.get("sb", 0)
        if inner[first.name] >= first.size:
            continue
        full = {v.name: inner.get(v.name, 0) for v in vs}
        assert evaluate(sub, env) == evaluate(expr, full)


# ---- axis merging in build_kernel --------------------------------------------------------------
def dims(out: ag.Tensor) -> list[tuple[str, int, bool]]:
    ast = lower.build_kernel(lower.choose_spec(out.lazy))
    return [(name[0], size, red) for name, size, red in ast.dims]


def t(*shape: int) -> ag.Tensor:
    return ag.tensor(np.ones(shape, np.float32))


def test_contiguous_elementwise_chain_is_one_flat_dim() -> None:
    a, b = t(2, 3, 4), t(2, 3, 4)
    assert dims(((a * b) + 1).relu().exp()) == [("o", 24, False)]
    assert dims(a.reshape(6, 4) * b.reshape(6, 4)) == [("o", 24, False)]
    assert dims(a.reshape(4, 6) * 2) == [("o", 24, False)]


def test_broadcast_and_permute_keep_their_axes() -> None:
    a = t(2, 3, 4)
    assert dims(a * t(4)) == [("o", 6, False), ("o", 4, False)]
    assert dims(a * t(3, 1)) == [("o", 2, False), ("o", 3, False), ("o", 4, False)]
    assert dims(a.permute(2, 0, 1) + 1) == [("o", 4, False), ("o", 6, False)]
    assert dims(a.transpose(0, 1) + 1) == [("o", 3, False), ("o", 2, False), ("o", 4, False)]


def test_reduce_dims() -> None:
    a = t(2, 3, 4)
    assert dims(a.sum(2)) == [("o", 6, False), ("r", 4, True)]
    assert dims(a.sum(1)) == [("o", 2, False), ("r", 3, True), ("o", 4, False)]
    assert dims(a.sum()) == [("r", 24, True)]
    assert dims(a.sum((1, 2))) == [("o", 2, False), ("r", 12, True)]
    assert dims(a.softmax(-1)) == [("o", 6, False), ("r", 4, True)]
    assert dims(a.reshape(2, 12).sum(1)) == [("o", 2, False), ("r", 12, True)]


def test_size_one_axes_are_dropped() -> None:
    assert dims(t(1, 5, 1) * 2) == [("o", 5, False)]
    assert dims(t(1, 1) + 1) == [("o", 1, False)]
    assert dims(t(3, 1).sum(1)) == [("o", 3, False)]


def test_expressions_keep_what_they_computed_but_pickle_without_it() -> None:
    import pickle

    from anygpu.codegen.sym import div, mod, var

    i, j = var("i", 12), var("j", 4)
    e = mod(div(i * 4 + j + 3, 5), 7)
    assert hash(e) == hash(e) and str(e) == "(((i*4+j+3)//5)%7)" and e.bounds == (0, 6)
    assert div(i * 4 + j + 3, 5) is div(i * 4 + j + 3, 5)  # memoized
    state = e.__getstate__()
    assert set(state) == {"terms", "const"}  # a string's hash differs between processes
    back = pickle.loads(pickle.dumps(e))
    assert back == e and hash(back) == hash(e) and str(back) == str(e)
