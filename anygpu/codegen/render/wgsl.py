"""WGSL for WebGPU. Deltas from the C style: typed declarations (``let``/``var``), ``select``,
casts as constructors, buffers as module-scope bindings, and 32-bit storage for 8-bit types
(WGSL has no 8-bit scalars; see ``WebGPUDevice.storage_dtype``), whose arithmetic wraps explicitly.
"""

from __future__ import annotations

import math

import numpy as np

from anygpu.codegen import ir
from anygpu.codegen.render.cstyle import RENDERERS, CStyleRenderer, uses_dtype
from anygpu.dtype import DType, bfloat16, bool_, float16, float32, int8, int32, int64, uint8, uint32

# WebGPU allows at most 65535 work-groups per dimension: launches fold the rest into y
MAX_GROUPS_X = 65535


# C's fmod, exact: subtract y scaled by powers of two while the remainder is at least y. Each
# subtraction is exact (y * 2^k <= r < y * 2^(k+1), so Sterbenz's lemma holds). NaN and infinity
# are tested on the bits, since compilers may fold x != x away.
# sin with its argument first reduced to [-pi, pi] by 2 pi split in three parts (Cody and Waite; the
# first part has 8 significant bits, so k * 6.28125 is exact for |k| < 2^16): drivers' sin loses
# accuracy as |x| grows (NVIDIA's was off by 5e-5 at x = 255).
SIN_HELPER = """\
fn sin_reduced(x: f32) -> f32 {
  let k = round(x * 0.15915494f);
  return sin(((x - k * 6.28125f) - k * 0.0019353071693331003f) - k * 1.0253376273028358e-11f);
}"""

# a / b as IEEE division gives it. GPU drivers divide through an approximate reciprocal: 3 / 3
# gave 0.99999994 (so the deviation of equal values was not 0), and for |b| > 2^126 the
# reciprocal flushes to 0 (inf / 3e38 was NaN). Huge divisors are scaled down first, and one
# step on the exact residual fma(-q, b, a) corrects the quotient. NVIDIA's Vulkan compiler saw
# through the residual of a quotient it had just computed (x / x stayed 1.0000001): the quotient
# passes through its bits plus ``dz``, a zero the compiler cannot know (set from the invocation's
# id at the kernel's start). A zero divisor gives its IEEE result from the bits (lavapipe folded
# x / 0.0 to 0 inside reductions); infinite and NaN divisors, and infinite or NaN quotients,
# take the plain division. Processor adapters (lavapipe) divide exactly but compute fma as a
# rounded product and sum, which made the step wrong for 1 / x in one case of seven: they take
# DIV_PLAIN_HELPER (the zero-divisor case alone).
DIV_HELPER = """\
var<private> dz: u32;
fn div_exact(x: f32, y: f32) -> f32 {
  let inf = 0x7f800000u;
  let xb = bitcast<u32>(x);
  let yb = bitcast<u32>(y) & 0x7fffffffu;
  if (yb == 0u) {
    if ((xb & 0x7fffffffu) == 0u || (xb & 0x7fffffffu) > inf) { return bitcast<f32>(0x7fc00000u); }
    return bitcast<f32>(inf | ((xb ^ bitcast<u32>(y)) & 0x80000000u));
  }
  if (yb >= inf) { return x / y; }
  let s = select(1.0f, 0.25f, abs(y) > 8.5e37f);
  let a = x * s;
  let b = y * s;
  let q = bitcast<f32>(bitcast<u32>(a / b) + dz);
  if ((bitcast<u32>(q) & inf) == inf) { return q; }
  return q + fma(-q, b, a) / b;
}"""
DIV_PLAIN_HELPER = """\
fn div_exact(x: f32, y: f32) -> f32 {
  let inf = 0x7f800000u;
  let xb = bitcast<u32>(x);
  if ((bitcast<u32>(y) & 0x7fffffffu) == 0u) {
    if ((xb & 0x7fffffffu) == 0u || (xb & 0x7fffffffu) > inf) { return bitcast<f32>(0x7fc00000u); }
    return bitcast<f32>(inf | ((xb ^ bitcast<u32>(y)) & 0x80000000u));
  }
  return x / y;
}"""
# a < b for floats, false where either is NaN (tested on the bits). NVIDIA's Vulkan compiler
# assumes no NaN: it turned select(t, 6.0, 6.0 < t || t == 6.0), ReLU6's upper bound, into a
# minimum, which gave 6 for NaN.
LT_HELPER = """\
fn lt_f32(a: f32, b: f32) -> bool {
  return a < b && (bitcast<u32>(a) & 0x7fffffffu) <= 0x7f800000u &&
    (bitcast<u32>(b) & 0x7fffffffu) <= 0x7f800000u;
}"""

FMOD_HELPER = """\
fn fmod_exact(x: f32, y: f32) -> f32 {
  let xb = bitcast<u32>(x) & 0x7fffffffu;
  let yb = bitcast<u32>(y) & 0x7fffffffu;
  if (xb >= 0x7f800000u || yb == 0u || yb > 0x7f800000u) { return bitcast<f32>(0x7fc00000u); }
  let ay = abs(y);
  var r = abs(x);
  for (var i = 0; i < 300 && r >= ay; i = i + 1) {
    let k = frexp(r).exp - frexp(ay).exp;
    var d = ldexp(ay, k);
    if (d > r) { d = ldexp(ay, k - 1); }
    r = r - d;
  }
  return bitcast<f32>(bitcast<u32>(r) | (bitcast<u32>(x) & 0x80000000u));
}"""


# float32 arithmetic on constants, as the device does it (division exact, NaN kept)
_FOLDED = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
           "neg": np.negative, "recip": np.reciprocal, "exp2": np.exp2, "log2": np.log2,
           "sqrt": np.sqrt, "trunc": np.trunc}


def _folded(e: ir.Expr, memo: dict[int, float | None]) -> float | None:
    """The value of a float32 expression of constants alone, else None. WGSL evaluates such
    an expression when it compiles the shader and rejects one that comes out infinite or NaN
    (``log2(0.0f)``: ONNX's ReduceLogSum over an empty set), so it is written as its value
    (a literal, bit patterns for infinities and NaN)."""
    if id(e) in memo:
        return memo[id(e)]
    value = None
    if e.dtype == float32 and e.op in _FOLDED:
        args = [s.arg if s.op == "const" else _folded(s, memo) for s in e.srcs]
        if all(a is not None for a in args):
            with np.errstate(all="ignore"):
                value = float(np.float32(_FOLDED[e.op](*(np.float32(a) for a in args))))
    memo[id(e)] = value
    return value


def _core(e: ir.Expr) -> ir.Expr:
    """``e`` without factors of one (which a compiler drops before it compares operands)."""
    while e.op == "mul" and any(s.op == "const" and s.arg == 1 for s in e.srcs):
        e = e.srcs[0] if e.srcs[1].op == "const" and e.srcs[1].arg == 1 else e.srcs[1]
    return e


class WGSLRenderer(CStyleRenderer):
    dialect = "wgsl"
    barrier = "workgroupBarrier();"
    types = {bool_: "bool", uint8: "u32", int8: "i32", int32: "i32", uint32: "u32",
             int64: "i64", float32: "f32", float16: "f16"}
    storage = {bool_: "u32", uint8: "u32", int8: "i32", int32: "i32", uint32: "u32",
               int64: "i64", float32: "f32", float16: "f16"}
    math_fns = {"exp2": "exp2({0})", "log2": "log2({0})", "sin": "sin({0})",
                "sqrt": "sqrt({0})", "trunc": "trunc({0})"}
    specials = {"lid": "i32(lidv.x)", "gid": "gidx", "sg_lane": "i32(sg_lane)",
                "sg_id": "i32(sg_id)", "sg_count": "i32(sg_count)", "sg_size": "i32(sg_size)"}
    # subgroupAdd, subgroupMul and subgroupMax take 32-bit numbers (8-bit values live in them):
    # no i64, no bool
    subgroup_ops = {op: frozenset({int8, uint8, int32, uint32, float16, float32})
                    for op in ("add", "max", "mul")}

    def compute_type(self, dtype: DType) -> str:
        if dtype == bfloat16:
            raise TypeError("bfloat16 has no WGSL type")
        return self.types[float32 if dtype == float16 else dtype]

    def storage_type(self, dtype: DType) -> str:
        return self.storage[dtype]

    def literal(self, value: object, dtype: DType) -> str:
        if dtype.is_bool:
            return "true" if value else "false"
        if dtype.is_float:
            v = float(value)  # type: ignore[arg-type]
            if math.isnan(v):
                return "bitcast<f32>(0x7fc00000u)"
            if math.isinf(v):
                return "bitcast<f32>(0x7f800000u)" if v > 0 else "bitcast<f32>(0xff800000u)"
            return f"{float(np.float32(v))!r}f"
        iv = int(value)  # type: ignore[call-overload]
        if dtype in (uint32, uint8):
            return f"{iv % 2**32}u"  # negative constants wrap, as C's unsigned arithmetic
        if dtype == int64:
            return f"{iv}li" if iv != -(2**63) else "(-9223372036854775807li - 1li)"
        return f"{iv}i" if iv != -(2**31) else "(-2147483647i - 1i)"

    def declare_const(self, name: str, dtype: DType, value: str) -> str:
        return f"let {name}: {self.compute_type(dtype)} = {value};"

    def declare_var(self, name: str, dtype: DType, init: str) -> str:
        return f"var {name}: {self.compute_type(dtype)} = {init};"

    def for_header(self, name: str, dtype: DType, start: str, stop: str, step: str) -> str:
        t = self.types[dtype]
        return f"for (var {name}: {t} = {start}; {name} < {stop}; {name} += {step}) {{"

    def stmt(self, st: ir.Stmt) -> None:
        if not isinstance(st, ir.LocalArray):  # those are declared at module scope in render()
            super().stmt(st)

    def select(self, c: str, a: str, b: str) -> str:
        return f"select({b}, {a}, {c})"

    def wrap(self, text: str, dtype: DType) -> str:
        if dtype == int8:
            return f"(({text} << 24u) >> 24u)"
        if dtype == uint8:
            return f"({text} & 255u)"
        return text

    def render_op(self, e: ir.Expr) -> str:
        folded = _folded(e, self.fold_memo)
        if folded is not None:  # (a negative value in parentheses, as a leaf's)
            text = self.literal(folded, e.dtype)
            return f"({text})" if text.startswith("-") else text
        if e.dtype == float32 and e.op in ("add", "sub", "mul"):
            guarded = self.identity_guard(e)
            if guarded is not None:
                return guarded
        if e.op == "max":
            a, b = self.expr(e.srcs[0], True), self.expr(e.srcs[1], True)
            if e.dtype.is_float:  # NaN tested on the bits: compilers may fold a != a away
                nan = f"(bitcast<u32>({a}) & 0x7fffffffu) > 0x7f800000u"
                return f"select({b}, {a}, {a} > {b} || {nan})"
            return f"select({b}, {a}, {a} > {b})"
        if e.op == "eq" and e.srcs[0].dtype.is_float and e.srcs[0] is e.srcs[1]:
            a = self.expr(e.srcs[0], True)  # x == x, i.e. not NaN: on the bits (see max)
            return f"((bitcast<u32>({a}) & 0x7fffffffu) <= 0x7f800000u)"
        if e.op == "div" and e.dtype.is_float:
            self.helpers.add(DIV_PLAIN_HELPER if self.features.get("exact_division")
                             else DIV_HELPER)
            return f"div_exact({self.expr(e.srcs[0])}, {self.expr(e.srcs[1])})"
        if e.op == "lt" and e.srcs[0].dtype.is_float:
            self.helpers.add(LT_HELPER)
            return f"lt_f32({self.expr(e.srcs[0])}, {self.expr(e.srcs[1])})"
        if e.op == "lt" and e.srcs[0].dtype == bool_:  # WGSL orders no bools: false < true
            a, b = self.expr(e.srcs[0]), self.expr(e.srcs[1])
            return f"((!{a}) && {b})"
        if e.op == "neg" and e.dtype.is_unsigned:  # WGSL has no unary minus on u32
            return self.wrap(f"(0u - {self.expr(e.srcs[0])})", e.dtype)
        if e.op == "mod" and e.dtype.is_float:
            # WGSL's float % is e1 - e2 * trunc(e1 / e2), which is not exact
            self.helpers.add(FMOD_HELPER)
            return f"fmod_exact({self.expr(e.srcs[0])}, {self.expr(e.srcs[1])})"
        if e.op == "sin":
            self.helpers.add(SIN_HELPER)
            return f"sin_reduced({self.expr(e.srcs[0])})"
        if e.op == "recip":
            return f"(1.0f / {self.expr(e.srcs[0])})"
        if e.op == "not":
            return f"(!{self.expr(e.srcs[0])})"
        return super().render_op(e)

    def identity_guard(self, e: ir.Expr) -> str | None:
        """``x - x``, ``x + -x``, ``x * 0`` and ``x + 0`` written on the bits. WGSL lets a
        compiler assume that no value is infinite or NaN, and Mesa's folds them to 0, 0, 0 and
        x (PyTorch: NaN where x is infinite or NaN, and +0.0 for -0.0 + 0); other expressions
        it may still reassociate (``x * 2 * 0.5`` to ``x``)."""
        a, b = e.srcs
        nan = self.literal(math.nan, float32)

        def not_finite(x: str) -> str:
            return f"(bitcast<u32>({x}) & 0x7f800000u) == 0x7f800000u"

        if e.op == "sub" and _core(a) is _core(b) or e.op == "add" and (
                b.op == "neg" and _core(b.srcs[0]) is _core(a) or
                a.op == "neg" and _core(a.srcs[0]) is _core(b)):
            x = self.expr(a if e.op == "sub" or a.op != "neg" else b, True)
            return f"select(0.0f, {nan}, {not_finite(x)})"
        zero = b if b.op == "const" and b.arg == 0 else a if a.op == "const" and a.arg == 0 \
            else None
        if zero is None:
            return None
        x = self.expr(a if zero is b else b, True)
        if e.op == "mul":  # +-0 with the product's sign, NaN for an infinite or NaN x
            sign = "0x80000000u" if math.copysign(1.0, float(zero.arg)) < 0 else "0u"
            return (f"select(bitcast<f32>((bitcast<u32>({x}) & 0x80000000u) ^ {sign}), {nan}, "
                    f"{not_finite(x)})")
        if e.op == "add":  # x + 0.0 (the lowering keeps only +0.0): -0.0 becomes +0.0
            return f"select({x}, 0.0f, bitcast<u32>({x}) == 0x80000000u)"
        return None

    def subgroup_reduce(self, op: str, value: ir.Expr, width: int | None) -> str:
        assert width is None, "WebGPU's subgroups are of the size the device picks"
        fn = {"add": "subgroupAdd", "max": "subgroupMax", "mul": "subgroupMul"}[op]
        dtype = value.dtype
        if op == "max" and dtype.is_float:
            # subgroupMax may drop NaN: a NaN anywhere gives NaN (tested on the bits, see max)
            x = self.expr(value, True)
            nan = f"(bitcast<u32>({x}) & 0x7fffffffu) > 0x7f800000u"
            return f"select({fn}({x}), {self.literal(float('nan'), dtype)}, subgroupAny({nan}))"
        text = f"{fn}({self.expr(value)})"
        return text if op == "max" else self.wrap(text, dtype)  # 8-bit sums wrap as they go

    def shift_op(self, op: str, a: str, b: str, amount: ir.Expr) -> str:
        # a constant amount is written as u32 directly: WGSL cannot convert an i64 literal
        count = f"{amount.arg}u" if amount.op == "const" else f"u32({b})"
        return f"({a} {'<<' if op == 'shl' else '>>'} {count})"

    def int_op(self, op: str, a: str, b: str) -> str:
        if op == "mod":
            # spelled out: with NVIDIA's Vulkan driver, % on negative integers gave results
            # with the divisor's sign; WGSL (and the other dialects) truncate
            return f"({a} - ({a} / {b}) * {b})"
        return super().int_op(op, a, b)

    def render_cast(self, x: str, src: DType, dst: DType) -> str:
        if dst == bool_ and src.is_float:  # NaN is true: on the bits (see max)
            return f"((bitcast<u32>({x}) & 0x7fffffffu) != 0u)"
        if dst == bool_:
            return f"({x} != {self.literal(0, src)})"
        if src == bool_:
            return f"select({self.literal(0, dst)}, {self.literal(1, dst)}, {x})"
        if dst == float16:
            return f"f32(f16({x}))"
        if dst in (int8, uint8):
            return self.wrap(f"{self.types[dst]}({x})", dst)
        return f"{self.compute_type(dst)}({x})"

    def load_global(self, buf: str, dtype: DType, index: str) -> str:
        if dtype == bool_:
            return f"({buf}[{index}] != 0u)"
        if dtype == float16:
            return f"f32({buf}[{index}])"
        return f"{buf}[{index}]"

    def store_global(self, buf: str, dtype: DType, index: str, value: str) -> str:
        if dtype == bool_:
            return f"{buf}[{index}] = select(0u, 1u, {value});"
        if dtype == float16:
            return f"{buf}[{index}] = f16({value});"
        return f"{buf}[{index}] = {value};"

    def render(self, kernel: ir.Kernel) -> str:
        if uses_dtype(kernel, bfloat16):
            raise TypeError("bfloat16 is not supported by WGSL")
        self.helpers: set[str] = set()
        self.fold_memo: dict[int, float | None] = {}
        body = super().render(kernel).splitlines()[1:-1]  # drop the C signature and closing brace
        head: list[str] = []
        if uses_dtype(kernel, float16):
            head.append("enable f16;")
        head += sorted(self.helpers)
        for i, p in enumerate(kernel.params):
            access = "read_write" if p.written else "read"
            head.append(f"@group(0) @binding({i}) var<storage, {access}> {p.name}: "
                        f"array<{self.storage_type(p.dtype)}>;")
        for st in kernel.body:
            if isinstance(st, ir.LocalArray):
                head.append(f"var<workgroup> {st.name}: array<{self.compute_type(st.dtype)}, "
                            f"{st.size}>;")
        head.append(f"@compute @workgroup_size({kernel.local})")
        # subgroup builtins come with the device's "subgroup" feature; wgpu's shader compiler
        # (naga) takes them without WGSL's "enable subgroups;", which it rejects, and offers
        # subgroup_id and num_subgroups beside the standard two
        subgroups = ", @builtin(subgroup_invocation_id) sg_lane: u32, " \
            "@builtin(subgroup_size) sg_size: u32, @builtin(subgroup_id) sg_id: u32, " \
            "@builtin(num_subgroups) sg_count: u32" if self.uses_subgroups else ""
        head.append(f"fn {kernel.name}(@builtin(workgroup_id) wid: vec3<u32>, "
                    f"@builtin(local_invocation_id) lidv: vec3<u32>{subgroups}) {{")
        head.append(f"  let gidx: i32 = i32(wid.x + wid.y * {MAX_GROUPS_X}u);")
        if DIV_HELPER in self.helpers:
            head.append("  dz = lidv.x >> 31u;")
        if kernel.groups > MAX_GROUPS_X:
            head.append(f"  if (gidx >= {kernel.groups}i) {{ return; }}")
        return "\n".join(head + body + ["}", ""])

    def signature(self, kernel: ir.Kernel) -> str:
        return "fn placeholder() {"


RENDERERS["wgsl"] = WGSLRenderer


def launch_groups(groups: int) -> tuple[int, int]:
    """Fold a flat work-group count into WebGPU's two dimensions."""
    if groups <= MAX_GROUPS_X:
        return (groups, 1)
    return (MAX_GROUPS_X, -(-groups // MAX_GROUPS_X))
