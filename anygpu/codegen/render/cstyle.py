"""The shared renderer: kernel IR -> C-like source text. Dialects override small tables and hooks.

Shared subexpressions (an :class:`~anygpu.codegen.ir.Expr` used more than once) are declared
once as constants, in the innermost block that uses them first; a later block sees only what its
enclosing blocks declared, so loop-variant values are never used outside their loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from anygpu.codegen import ir
from anygpu.dtype import (DType, bfloat16, bool_, float16, float32, int8, int32, int64, min_value,
                          uint8, uint32)

BINARY_INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/", "idiv": "/", "mod": "%",
                "lt": "<", "eq": "==", "ne": "!=", "shl": "<<", "shr": ">>"}
BOOL_LOGIC = {"and": "&&", "or": "||", "xor": "!="}
INT_LOGIC = {"and": "&", "or": "|", "xor": "^"}


class _Scope:
    def __init__(self, parent: "_Scope | None"):
        self.parent = parent
        self.names: dict[int, str] = {}

    def lookup(self, e: ir.Expr) -> str | None:
        scope: _Scope | None = self
        while scope is not None:
            if id(e) in scope.names:
                return scope.names[id(e)]
            scope = scope.parent
        return None


class CStyleRenderer:
    """Renders a kernel for a C-family dialect. Subclasses set the tables and the few hooks."""

    dialect = "c-style"
    kernel_prefix = ""
    buffer_qualifier = ""
    restrict = "restrict"
    barrier = ""
    local_qualifier = ""
    types: dict[DType, str] = {}
    math_fns: dict[str, str] = {}
    specials: dict[str, str] = {}
    # the reductions ``subgroup_reduce`` renders, op -> accumulator dtypes (the lowering combines
    # the others through local memory)
    subgroup_ops: dict[str, frozenset[DType]] = {}
    indent_unit = "  "

    def __init__(self, features: dict | None = None) -> None:
        # what the device adds to its dialect (see schedule.device_features)
        self.features: dict = features or {}
        self.lines: list[str] = []
        self.counter = 0
        self.refs: dict[int, int] = {}
        self.scope = _Scope(None)
        self.depth = 1
        self.locals: set[str] = set()
        self.stored_locals: dict[str, DType] = {}
        self.params: dict[str, ir.Param] = {}
        self.kernel: ir.Kernel | None = None
        self.uses_subgroups = False  # set while rendering: a prelude may need to say so

    # ---- types and literals ----------------------------------------------------------------------
    def compute_type(self, dtype: DType) -> str:
        return self.types[float32 if dtype in (float16, bfloat16) else dtype]

    def storage_type(self, dtype: DType) -> str:
        return self.types[dtype]

    def literal(self, value: object, dtype: DType) -> str:
        if dtype.is_bool:
            return "1" if value else "0"
        if dtype.is_float:
            v = float(value)  # type: ignore[arg-type]
            if math.isnan(v):
                return "NAN"
            if math.isinf(v):
                return "INFINITY" if v > 0 else "(-INFINITY)"
            return f"{v!r}f" if ("e" in repr(v) or "." in repr(v)) else f"{v!r}.0f"
        iv = int(value)  # type: ignore[call-overload]
        if dtype == int64:
            return f"{iv}LL" if iv != -(2**63) else "(-9223372036854775807LL-1)"
        if dtype == uint32:
            return f"{iv}u"
        return str(iv) if iv != -(2**31) else "(-2147483647-1)"

    # ---- expressions -----------------------------------------------------------------------------
    def count_refs(self, stmts: list[ir.Stmt]) -> None:
        seen: set[int] = set()

        def visit(e: ir.Expr) -> None:
            self.refs[id(e)] = self.refs.get(id(e), 0) + 1
            if id(e) in seen:
                return
            seen.add(id(e))
            for s in e.srcs:
                visit(s)

        for st in walk(stmts):
            for e in _stmt_exprs(st):
                visit(e)

    def fresh(self, prefix: str = "t") -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def emit(self, line: str) -> None:
        self.lines.append(self.indent_unit * self.depth + line)

    def declare_const(self, name: str, dtype: DType, value: str) -> str:
        return f"const {self.compute_type(dtype)} {name} = {value};"

    def expr(self, e: ir.Expr, force_name: bool = False) -> str:
        """The text of ``e``; shared (or forced) values become named constants."""
        known = self.scope.lookup(e)
        if known is not None:
            return known
        if e.op in ("const", "var", "special"):
            return self.leaf(e)
        text = self.render_op(e)
        if force_name or self.refs.get(id(e), 0) > 1:
            name = self.fresh()
            self.emit(self.declare_const(name, e.dtype, text))
            self.scope.names[id(e)] = name
            return name
        return text

    def leaf(self, e: ir.Expr) -> str:
        if e.op == "const":
            text = self.literal(e.arg, e.dtype)
            # a negative literal in parentheses: "-" before it must not make "--4" (a decrement)
            return f"({text})" if text.startswith("-") else text
        if e.op == "special":
            return self.specials[e.arg]
        return str(e.arg)

    def render_op(self, e: ir.Expr) -> str:
        op = e.op
        if op == "load":
            return self.render_load(e)
        if op == "cast":
            return self.render_cast(self.expr(e.srcs[0]), e.srcs[0].dtype, e.dtype)
        if op == "max":
            a, b = self.expr(e.srcs[0], True), self.expr(e.srcs[1], True)
            if e.dtype.is_float:  # NaN-propagating, as PyTorch's max
                return self.wrap(f"(({a} > {b} || {a} != {a}) ? {a} : {b})", e.dtype)
            return f"(({a} > {b}) ? {a} : {b})"
        if op == "where":
            c, a, b = (self.expr(s) for s in e.srcs)
            return self.select(c, a, b)
        if op == "pack_halves":
            return self.pack_halves(self.expr(e.srcs[0]), self.expr(e.srcs[1]), e.arg)
        if op == "halves2":
            return self.halves2(e.arg[0], self.expr(e.srcs[0]), self.expr(e.srcs[1]), e.arg[1])
        if op == "subgroup_reduce":
            self.uses_subgroups = True
            return self.subgroup_reduce(e.arg[0], e.srcs[0], e.arg[1])
        if op in ("idiv", "mod") and not e.dtype.is_float:
            return self.int_division(e)
        if op in ("shl", "shr"):
            return self.shift(e)
        args = [self.expr(s) for s in e.srcs]
        if op == "mod":  # a float remainder: exact, with the dividend's sign (C's fmod)
            return self.math_fns["fmod"].format(*args)
        if op in self.math_fns:
            return self.math_fns[op].format(*args)
        if op == "neg":
            return self.wrap(f"(-{args[0]})", e.dtype)
        if op == "not":
            return f"(!{args[0]})"
        if op == "recip":
            return f"(1.0f/{args[0]})"
        src = e.srcs[0].dtype
        if op in BOOL_LOGIC and src == bool_:
            return f"({args[0]} {BOOL_LOGIC[op]} {args[1]})"
        if op in INT_LOGIC:
            return self.wrap(f"({args[0]} {INT_LOGIC[op]} {args[1]})", e.dtype)
        return self.wrap(f"({args[0]} {BINARY_INFIX[op]} {args[1]})", e.dtype)

    def int_division(self, e: ir.Expr) -> str:
        """Integer division and remainder that never trap: C truncates, a zero divisor gives 0
        (quotient and remainder), and MIN / -1 wraps to MIN with remainder 0. Lanes masked out by
        a pad or a guard load zeros and still divide, so zero is checked even there."""
        a, divisor, dtype = e.srcs[0], e.srcs[1], e.dtype
        if divisor.op == "const" and divisor.arg not in (0, -1):
            # the dividend is named for a remainder: a dialect may spell it a - (a / b) * b
            text = self.int_op(e.op, self.expr(a, e.op == "mod"), self.expr(divisor))
            return self.wrap(text, dtype)
        a_text, b = self.expr(a, True), self.expr(divisor, True)
        zero = self.literal(0, dtype)
        is_zero = f"({b} == {zero})"
        bad = is_zero
        if dtype in (int32, int64):  # the one quotient that overflows the type
            low, minus_one = self.literal(min_value(dtype), dtype), self.literal(-1, dtype)
            bad = f"({is_zero} || ({a_text} == {low} && {b} == {minus_one}))"
        safe = self.select(bad, self.literal(1, dtype), b)
        result = self.wrap(self.int_op(e.op, a_text, safe), dtype)
        return self.select(is_zero, zero, result)

    def pack_halves(self, low: str, high: str, dtype: DType) -> str:
        raise NotImplementedError(f"packed halves are not available in {self.dialect}")

    def halves2(self, op: str, a: str, b: str, dtype: DType) -> str:
        raise NotImplementedError(f"packed halves are not available in {self.dialect}")

    def subgroup_reduce(self, op: str, value: ir.Expr, width: int | None) -> str:
        raise NotImplementedError(f"subgroup reductions are not available in {self.dialect}")

    def combine(self, op: str, a: str, b: str, dtype: DType) -> str:
        """``op`` of two named values of ``dtype``, as the dialect renders it (NaN-keeping max,
        8-bit wrap-around)."""
        return self.render_op(ir.alu(op, ir.var(a, dtype), ir.var(b, dtype)))

    def shift(self, e: ir.Expr) -> str:
        """Shifts by an amount outside [0, bits) give what PyTorch gives (0, or -1 for a
        negative value shifted right) instead of C's undefined behaviour."""
        a, amount, dtype = e.srcs[0], e.srcs[1], e.dtype
        bits = 8 * dtype.itemsize
        if amount.op == "const" and 0 <= amount.arg < bits:
            return self.wrap(self.shift_op(e.op, self.expr(a), self.expr(amount), amount), dtype)
        a_text, b = self.expr(a, True), self.expr(amount, True)
        zero = self.literal(0, dtype)
        outside = f"(({b} < {self.literal(0, amount.dtype)}) || " \
                  f"({b} >= {self.literal(bits, amount.dtype)}))"
        fill = zero
        if e.op == "shr" and not dtype.is_unsigned:
            fill = self.select(f"({a_text} < {zero})", self.literal(-1, dtype), zero)
        shifted = self.wrap(self.shift_op(e.op, a_text, b, amount), dtype)
        return self.select(outside, fill, shifted)

    def shift_op(self, op: str, a: str, b: str, amount: ir.Expr) -> str:
        return f"({a} {BINARY_INFIX[op]} {b})"

    def int_op(self, op: str, a: str, b: str) -> str:
        return f"({a} {BINARY_INFIX[op]} {b})"

    def wrap(self, text: str, dtype: DType) -> str:
        """8-bit results wrap around as in PyTorch (C computes them in int)."""
        if dtype in (int8, uint8):
            return f"(({self.types[dtype]}){text})"
        return text

    def select(self, c: str, a: str, b: str) -> str:
        return f"({c} ? {a} : {b})"

    def render_cast(self, x: str, src: DType, dst: DType) -> str:
        if dst == bool_:
            return f"({x} != 0)"
        if dst == float16:
            return self.round_f16(f"(float)({x})")
        if dst == bfloat16:
            return f"bf16_round((float)({x}))"
        return f"(({self.compute_type(dst)})({x}))"

    def round_f16(self, x: str) -> str:
        raise NotImplementedError

    def render_load(self, e: ir.Expr) -> str:
        buf = e.arg
        index = self.expr(e.srcs[0])
        if buf in self.locals:
            text = f"{buf}[{index}]"
        else:
            text = self.load_global(buf, self.params[buf].dtype, index)
        if len(e.srcs) == 2:
            guard = self.expr(e.srcs[1])
            return self.select(guard, text, self.literal(0, e.dtype))
        return text

    def load_global(self, buf: str, dtype: DType, index: str) -> str:
        if dtype == bfloat16:
            return f"bf16_to_f32({buf}[{index}])"
        if dtype == bool_:
            return f"({buf}[{index}] != 0)"
        if dtype == float16:
            return f"((float){buf}[{index}])"
        return f"{buf}[{index}]"

    def store_global(self, buf: str, dtype: DType, index: str, value: str) -> str:
        if dtype == bfloat16:
            return f"{buf}[{index}] = f32_to_bf16({value});"
        if dtype == float16:
            return f"{buf}[{index}] = ({self.types[float16]})({value});"
        if dtype == bool_:
            return f"{buf}[{index}] = ({self.types[bool_]})({value});"
        return f"{buf}[{index}] = {value};"

    # ---- statements ------------------------------------------------------------------------------
    def block(self, stmts: list[ir.Stmt]) -> None:
        self.scope = _Scope(self.scope)
        self.depth += 1
        for st in stmts:
            self.stmt(st)
        self.depth -= 1
        assert self.scope.parent is not None
        self.scope = self.scope.parent

    def stmt(self, st: ir.Stmt) -> None:
        if isinstance(st, ir.Decl):
            self.emit(self.declare_var(st.name, st.dtype, self.expr(st.init)))
        elif isinstance(st, ir.Assign):
            self.emit(f"{st.name} = {self.expr(st.value)};")
        elif isinstance(st, ir.Store):
            index, value = self.expr(st.index), self.expr(st.value)
            if st.buf in self.stored_locals:
                self.emit(self.store_global(st.buf, self.stored_locals[st.buf], index, value))
            elif st.buf in self.locals:
                self.emit(f"{st.buf}[{index}] = {value};")
            else:
                self.emit(self.store_global(st.buf, self.params[st.buf].dtype, index, value))
        elif isinstance(st, ir.For):
            start, stop, step = self.expr(st.start), self.expr(st.stop), self.expr(st.step)
            if st.parallel:
                self.emit_parallel(st)
            self.emit(self.for_header(st.name, st.start.dtype, start, stop, step))
            self.block(st.body)
            self.emit("}")
        elif isinstance(st, ir.If):
            self.emit(f"if ({self.expr(st.cond)}) {{")
            self.block(st.body)
            self.emit("}")
        elif isinstance(st, ir.Barrier):
            self.emit(self.barrier)
        elif isinstance(st, ir.LocalArray):
            self.emit(self.local_array(st))
        elif isinstance(st, ir.VecLoad):
            for line in self.vector_load(st, self.expr(st.index, True)):
                self.emit(line)
        elif isinstance(st, ir.VecStore):
            for line in self.vector_store(st, self.expr(st.index, True),
                                          [self.expr(v) for v in st.values]):
                self.emit(line)
        elif isinstance(st, ir.Mma):
            self.emit(self.mma(st, [self.fragment(f) for f in st.a],
                               [self.fragment(f) for f in st.b]))
        elif isinstance(st, (ir.LdMatrix, ir.AsyncCopy, ir.AsyncCommit, ir.AsyncWait,
                             ir.Wgmma, ir.WgmmaSync)):
            self.emit(self.async_stmt(st))
        else:
            raise AssertionError(st)

    def fragment(self, f: tuple[str, ir.Expr] | str) -> str:
        """An mma fragment register: a local-array element or a register variable."""
        return f if isinstance(f, str) else f"{f[0]}[{self.expr(f[1])}]"

    def async_stmt(self, st: ir.AsyncStmt) -> str:
        raise NotImplementedError(f"{type(st).__name__} is not available in {self.dialect}")

    def declare_var(self, name: str, dtype: DType, init: str) -> str:
        return f"{self.compute_type(dtype)} {name} = {init};"

    def mma(self, st: ir.Mma, a: list[str], b: list[str]) -> str:
        raise NotImplementedError(f"tensor-core mma is not available in {self.dialect}")

    def vector_read(self, buf: str, index: str, n: int) -> str | None:
        """A read of ``n`` floats of a local array as one vector value, where the dialect has
        vector types (CUDA, OpenCL); None: scalar reads."""
        return None

    def vector_load(self, st: ir.VecLoad, index: str) -> list[str]:
        n = len(st.names)
        if st.buf in self.params:
            return self.global_vector_load(st, index)
        read = self.vector_read(st.buf, index, n) if n in (2, 4) and \
            self.compute_type(st.dtype) == "float" else None
        if read is None:
            return [self.declare_var(name, st.dtype, f"{st.buf}[{index} + {i}]")
                    for i, name in enumerate(st.names)]
        v = self.fresh("v")
        return [f"const float{n} {v} = {read};"] + \
            [f"float {name} = {v}.{'xyzw'[i]};" for i, name in enumerate(st.names)]

    def vector_store(self, st: ir.VecStore, index: str, values: list[str]) -> list[str]:
        """``st``'s values stored: one store each, where the dialect has no vector store of
        memory (C, WGSL)."""
        return [self.store_global(st.buf, st.dtype, f"{index} + {i}", v)
                for i, v in enumerate(values)]

    def global_vector_load(self, st: ir.VecLoad, index: str) -> list[str]:
        """``st``'s elements of a kernel parameter: scalar loads, where the dialect has no
        vector load of memory (C, where the compiler vectorizes loops itself; WGSL)."""
        return [self.declare_var(name, st.dtype,
                                 self.load_global(st.buf, st.dtype, f"{index} + {i}"))
                for i, name in enumerate(st.names)]

    def for_header(self, name: str, dtype: DType, start: str, stop: str, step: str) -> str:
        return f"for ({self.types[dtype]} {name} = {start}; {name} < {stop}; {name} += {step}) {{"

    def emit_parallel(self, st: ir.For) -> None:
        pass

    def local_array(self, st: ir.LocalArray) -> str:
        return f"{self.local_qualifier} {self.compute_type(st.dtype)} {st.name}[{st.size}];"

    # ---- the kernel ------------------------------------------------------------------------------
    def param(self, p: ir.Param) -> str:
        const = "" if p.written else "const "
        q = f"{self.buffer_qualifier} " if self.buffer_qualifier else ""
        return f"{q}{const}{self.storage_type(p.dtype)}* {self.restrict} {p.name}"

    def prelude(self, kernel: ir.Kernel) -> list[str]:
        return []

    def signature(self, kernel: ir.Kernel) -> str:
        params = ", ".join(self.param(p) for p in kernel.params)
        return f"{self.kernel_prefix}void {kernel.name}({params})"

    def render(self, kernel: ir.Kernel) -> str:
        self.kernel = kernel
        self.params = {p.name: p for p in kernel.params}
        self.locals = kernel.local_names
        self.stored_locals = {s.name: s.dtype for s in kernel.body
                              if isinstance(s, ir.LocalArray) and s.stored}
        self.count_refs(kernel.body)
        self.lines = []
        self.depth = 0
        self.block(kernel.body)
        head = self.prelude(kernel) + [self.signature(kernel) + " {"]
        return "\n".join(head + self.lines + ["}", ""])


def walk(stmts: list[ir.Stmt]):
    for st in stmts:
        yield st
        if isinstance(st, (ir.For, ir.If)):
            yield from walk(st.body)


def _stmt_exprs(st: ir.Stmt) -> list[ir.Expr]:
    if isinstance(st, ir.Decl):
        return [st.init]
    if isinstance(st, ir.Assign):
        return [st.value]
    if isinstance(st, ir.Store):
        return [st.index, st.value]
    if isinstance(st, ir.For):
        return [st.start, st.stop, st.step]
    if isinstance(st, ir.If):
        return [st.cond]
    if isinstance(st, ir.VecLoad):
        return [st.index]
    if isinstance(st, ir.VecStore):
        return [st.index, *st.values]
    if isinstance(st, ir.Mma):
        return [f[1] for f in [*st.a, *st.b] if not isinstance(f, str)]
    if isinstance(st, ir.LdMatrix):
        return [st.index]
    if isinstance(st, ir.AsyncCopy):
        return [st.dst_index, st.src_index, st.valid]
    if isinstance(st, ir.Wgmma):
        return [st.a[1], st.b[1]]
    return []


def any_expr(kernel: ir.Kernel, test: Callable[[ir.Expr], bool]) -> bool:
    """Whether ``test`` holds for an expression of ``kernel`` (each shared one visited once)."""
    seen: set[int] = set()

    def visit(e: ir.Expr) -> bool:
        if id(e) in seen:
            return False
        seen.add(id(e))
        return test(e) or any(visit(s) for s in e.srcs)

    return any(visit(e) for st in walk(kernel.body) for e in _stmt_exprs(st))


def uses_dtype(kernel: ir.Kernel, dtype: DType) -> bool:
    return any(p.dtype == dtype for p in kernel.params) or any_expr(
        kernel, lambda e: e.dtype == dtype or (e.op == "pack_halves" and e.arg == dtype) or
        (e.op == "halves2" and e.arg[1] == dtype))


RENDERERS: dict[str, type[CStyleRenderer]] = {}


def _renderer(dialect: str) -> type[CStyleRenderer]:
    if dialect not in RENDERERS:
        from anygpu.codegen.render import c, cuda, opencl, wgsl  # noqa: F401 (they register)
    if dialect not in RENDERERS:
        raise ValueError(f"no renderer for dialect {dialect!r}")
    return RENDERERS[dialect]


def render(kernel: ir.Kernel, dialect: str, features: dict | None = None) -> str:
    """Source text of ``kernel`` in ``dialect`` ("c", "opencl", "cuda", "hip" or "wgsl") for a
    device with ``features`` (see ``schedule.device_features``)."""
    return _renderer(dialect)(features).render(kernel)


def subgroup_reduces(dialect: str, op: str, dtype: DType) -> bool:
    """Whether ``dialect`` renders ``ir.subgroup_reduce`` of ``op`` for accumulators of
    ``dtype``."""
    return dtype in _renderer(dialect).subgroup_ops.get(op, frozenset())


BASE_TYPES = {bool_: "unsigned char", uint8: "unsigned char", int8: "signed char",
              int32: "int", uint32: "unsigned int", int64: "long long", float32: "float"}
