"""Symbolic integer index expressions, kept in a normal form so that movement ops simplify.

An index is a :class:`Lin`: a linear combination of atoms (loop variables, floor divisions and
modulos by constants) plus a constant. Every constructor simplifies using the value bounds of its
operands, which is what turns a reshape of a contiguous tensor back into plain strides.

>>> i = var("i", 12)
>>> str(mod(div(i * 4 + 3, 4), 12))
'i'
>>> j = var("j", 4)
>>> str(div(i * 4 + j, 4)), str(mod(i * 4 + j, 4))
('i', 'j')
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from math import gcd
from typing import Any, Union


class _Node:
    """Shared by the expression classes: the hash, the text and the bounds of a node are
    computed once (expressions are immutable, and simplification asks for them again and
    again: recomputing them made lowering a network's optimizer step take tens of seconds),
    and equality looks at the hash before the fields."""

    def __hash__(self) -> int:
        return self._hash

    @cached_property
    def _hash(self) -> int:
        return hash((type(self).__name__, *self._fields()))

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if type(other) is not type(self):
            return NotImplemented
        return self._hash == other._hash and self._fields() == other._fields()  # type: ignore

    def _fields(self) -> tuple[Any, ...]:
        raise NotImplementedError

    def __getstate__(self) -> dict[str, Any]:
        # without what was computed: a string's hash differs from one process to the next
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def __str__(self) -> str:
        return self._text

    @cached_property
    def _text(self) -> str:
        raise NotImplementedError

    @property
    def bounds(self) -> tuple[int, int]:
        return self._bounds

    @cached_property
    def _bounds(self) -> tuple[int, int]:
        raise NotImplementedError


@dataclass(frozen=True, eq=False)
class Var(_Node):
    name: str
    size: int  # values 0 .. size-1

    def _fields(self) -> tuple[Any, ...]:
        return self.name, self.size

    @cached_property
    def _bounds(self) -> tuple[int, int]:
        return 0, self.size - 1

    @cached_property
    def _text(self) -> str:
        return self.name


@dataclass(frozen=True, eq=False)
class _ByConstant(_Node):
    """An expression of ``a`` and a positive constant ``b``."""

    a: "Lin"
    b: int

    def _fields(self) -> tuple[Any, ...]:
        return self.a, self.b


class Div(_ByConstant):
    """Floor division."""

    @cached_property
    def _bounds(self) -> tuple[int, int]:
        lo, hi = self.a.bounds
        return lo // self.b, hi // self.b

    @cached_property
    def _text(self) -> str:
        return f"({_operand(self.a)}//{self.b})"


class Mod(_ByConstant):
    """Floor modulo."""

    @cached_property
    def _bounds(self) -> tuple[int, int]:
        lo, hi = self.a.bounds
        if lo >= 0:
            return 0, min(self.b - 1, hi)
        return 0, self.b - 1

    @cached_property
    def _text(self) -> str:
        return f"({_operand(self.a)}%{self.b})"


class Assumed(_ByConstant):
    """``a``, taken to lie in 0 .. b-1 where an expression is simplified: the index into a
    padded tensor's source, whose loads are guarded by that range (outside it nothing is read,
    so whatever the address would be does not matter). A reshape's flattening and splitting of
    such an index then cancel instead of leaving divisions that borrow across rows."""

    @cached_property
    def _bounds(self) -> tuple[int, int]:
        lo, hi = self.a.bounds
        return max(lo, 0), min(hi, self.b - 1)

    @cached_property
    def _text(self) -> str:
        return f"assumed({self.a}<{self.b})"


Atom = Union[Var, Div, Mod, Assumed]


def _operand(x: "Lin") -> str:
    """``x`` as the operand of // or %: a sum in parentheses."""
    return f"({x})" if len(x.terms) + bool(x.const) > 1 else str(x)


def _key(atom: Atom) -> str:
    return f"{type(atom).__name__}:{atom}"


@dataclass(frozen=True, eq=False)
class Lin(_Node):
    """sum(coeff * atom) + const. Build with the functions below, not directly."""

    terms: tuple[tuple[Atom, int], ...]
    const: int

    def _fields(self) -> tuple[Any, ...]:
        return self.terms, self.const

    @cached_property
    def _bounds(self) -> tuple[int, int]:
        lo = hi = self.const
        for atom, c in self.terms:
            alo, ahi = atom.bounds
            lo += c * alo if c > 0 else c * ahi
            hi += c * ahi if c > 0 else c * alo
        return lo, hi

    @property
    def is_const(self) -> bool:
        return not self.terms

    def __add__(self, other: "Lin | int") -> "Lin":
        return add(self, other)

    def __radd__(self, other: int) -> "Lin":
        return add(self, other)

    def __sub__(self, other: "Lin | int") -> "Lin":
        return add(self, mul(lin(other), -1))

    def __mul__(self, c: int) -> "Lin":
        return mul(self, c)

    def __rmul__(self, c: int) -> "Lin":
        return mul(self, c)

    @cached_property
    def _text(self) -> str:
        parts = [str(a) if c == 1 else f"{a}*{c}" for a, c in self.terms]
        if self.const or not parts:
            parts.append(str(self.const))
        return "+".join(parts)

    def vars(self) -> set[Var]:
        out: set[Var] = set()
        for atom, _ in self.terms:
            out |= {atom} if isinstance(atom, Var) else atom.a.vars()
        return out


def const(value: int) -> Lin:
    return Lin((), int(value))


def var(name: str, size: int) -> Lin:
    """A loop variable ranging over 0..size-1 (a size-1 variable is the constant 0)."""
    if size <= 1:
        return const(0)
    return Lin(((Var(name, size), 1),), 0)


def assumed(x: "Lin | int", n: int) -> Lin:
    """``x``, taken to lie in 0 .. n-1 (see Assumed)."""
    x = lin(x)
    lo, hi = x.bounds
    if lo >= 0 and hi < n:
        return x
    return _atom(Assumed(x, n))


def lin(x: "Lin | int") -> Lin:
    return x if isinstance(x, Lin) else const(x)


def _atom(atom: Atom) -> Lin:
    return Lin(((atom, 1),), 0)


def _build(coeffs: dict[Atom, int], c: int) -> Lin:
    # recombine k*b*(a//b) + k*(a%b) -> k*a, which undoes the split that a reshape makes
    changed = True
    while changed:
        changed = False
        for atom, k in list(coeffs.items()):
            if isinstance(atom, Mod) and k:
                partner = _div_atom(atom.a, atom.b)
                if coeffs.get(partner, 0) == k * atom.b:
                    del coeffs[atom], coeffs[partner]
                    for a2, c2 in atom.a.terms:
                        coeffs[a2] = coeffs.get(a2, 0) + c2 * k
                    c += atom.a.const * k
                    changed = True
                    break
    terms = tuple(sorted(((a, k) for a, k in coeffs.items() if k), key=lambda t: _key(t[0])))
    return Lin(terms, c)


def _div_atom(a: Lin, b: int) -> Atom:
    """The atom that ``a // b`` simplifies to, as div() builds it: (f//4)//3 is f//12."""
    q = div(a, b)
    if q.const == 0 and len(q.terms) == 1 and q.terms[0][1] == 1:
        return q.terms[0][0]
    return Div(a, b)


def add(x: "Lin | int", y: "Lin | int") -> Lin:
    x, y = lin(x), lin(y)
    coeffs: dict[Atom, int] = {}
    for atom, c in x.terms + y.terms:
        coeffs[atom] = coeffs.get(atom, 0) + c
    return _build(coeffs, x.const + y.const)


def mul(x: "Lin | int", k: int) -> Lin:
    x = lin(x)
    if k == 0:
        return const(0)
    return Lin(tuple((a, c * k) for a, c in x.terms), x.const * k)


def _split(x: Lin, b: int) -> tuple[Lin, Lin]:
    """x = b*q + rest, with every coefficient of rest in 0..b-1 (floor semantics)."""
    q_terms = {a: c // b for a, c in x.terms if c // b}
    r_terms = {a: c % b for a, c in x.terms if c % b}
    return _build(q_terms, x.const // b), _build(r_terms, x.const % b)


def div(x: "Lin | int", b: int) -> Lin:
    """Floor division by a positive constant."""
    return _div(lin(x), b)


@lru_cache(maxsize=1 << 16)
def _div(x: Lin, b: int) -> Lin:
    if b == 1:
        return x
    lo, hi = x.bounds
    if lo >= 0 and hi < b:
        return const(0)
    q, rest = _split(x, b)
    rlo, rhi = rest.bounds
    if rlo >= 0 and rhi < b:
        return q
    # a common factor of rest and b divides out: (2i+2j)//4 = (i+j)//2
    g = gcd(b, *[c for _, c in rest.terms], rest.const) if rest.terms else b
    if g > 1 and rest.const % g == 0:
        return add(q, div(Lin(tuple((a, c // g) for a, c in rest.terms), rest.const // g), b // g))
    if len(rest.terms) == 1 and rest.const == 0 and rest.terms[0][1] == 1:
        inner = rest.terms[0][0]
        if isinstance(inner, Div):
            return add(q, div(inner.a, inner.b * b))
    split = _split_small(rest, b)
    if split is not None:  # (c*y + r)//b = y//(b/c) for 0 <= r < c, c dividing b
        c, big, _ = split
        return add(q, div(big, b // c))
    return add(q, _atom(Div(rest, b)))


def _split_small(x: Lin, b: int) -> tuple[int, Lin, Lin] | None:
    """``x = c*big + small`` with c > 1 dividing b and 0 <= small < c (for the largest such c),
    or None. Undoes the flat index of a merged axis: (6*i + j)//18 with j < 6 is i//3."""
    for c in sorted({gcd(k, b) for _, k in x.terms} - {1, b}, reverse=True):
        big = [(a, k // c) for a, k in x.terms if k % c == 0]
        small = Lin(tuple((a, k) for a, k in x.terms if k % c), x.const)
        lo, hi = small.bounds
        if big and lo >= 0 and hi < c:
            return c, Lin(tuple(big), 0), small
    return None


def mod(x: "Lin | int", b: int) -> Lin:
    """Floor modulo by a positive constant."""
    return _mod(lin(x), b)


@lru_cache(maxsize=1 << 16)
def _mod(x: Lin, b: int) -> Lin:
    if b == 1:
        return const(0)
    _, rest = _split(x, b)
    lo, hi = rest.bounds
    if lo >= 0 and hi < b:
        return rest
    if len(rest.terms) == 1 and rest.const == 0 and rest.terms[0][1] == 1:
        inner = rest.terms[0][0]
        if isinstance(inner, Mod) and inner.b % b == 0:
            return mod(inner.a, b)
    split = _split_small(rest, b)
    if split is not None:  # (c*y + r) % b = c*(y % (b/c)) + r for 0 <= r < c, c dividing b
        c, big, small = split
        return add(mul(mod(big, b // c), c), small)
    return _atom(Mod(rest, b))


def substitute(x: Lin, mapping: dict[Var, Lin]) -> Lin:
    """Replace variables and simplify again."""
    out = const(x.const)
    for atom, c in x.terms:
        if isinstance(atom, Var):
            term = mapping.get(atom, _atom(atom))
        elif isinstance(atom, Div):
            term = div(substitute(atom.a, mapping), atom.b)
        elif isinstance(atom, Assumed):
            term = assumed(substitute(atom.a, mapping), atom.b)
        else:
            term = mod(substitute(atom.a, mapping), atom.b)
        out = add(out, mul(term, c))
    return out


def has_divmod_of(x: Lin, v: Var) -> bool:
    """Whether ``v`` appears under a division or modulo in ``x``."""
    for atom, _ in x.terms:
        if isinstance(atom, (Div, Mod)) and v in atom.a.vars():
            return True
        if isinstance(atom, Assumed) and has_divmod_of(atom.a, v):
            return True
    return False


def strides_of(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Contiguous (row-major) strides."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def flat_index(idx: list[Lin], shape: tuple[int, ...]) -> Lin:
    out = const(0)
    for i, s in zip(idx, strides_of(shape)):
        out = add(out, mul(i, s))
    return out


def unflatten(flat: Lin, shape: tuple[int, ...]) -> list[Lin]:
    # a stride of 0 comes from a later axis of size 0: an empty shape, which no index reaches
    return [mod(div(flat, s), n) if n > 1 and s else const(0)
            for s, n in zip(strides_of(shape), shape)]
