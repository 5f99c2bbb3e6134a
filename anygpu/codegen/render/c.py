"""C for the cpu backend: one function per kernel, OpenMP on the outer loop."""

from __future__ import annotations

from anygpu.codegen import ir
from anygpu.codegen.render.cstyle import (BASE_TYPES, BOOL_LOGIC, INT_LOGIC, RENDERERS,
                                          CStyleRenderer, uses_dtype, walk)
from anygpu.dtype import bfloat16, bool_, float16, float32

# Helpers sit inside include guards, so that several kernels' sources can be compiled as one
# file (runtime/cpu.py compiles the new kernels of a step together)
BF16_HELPERS = """\
#ifndef ANYGPU_BF16_HELPERS
#define ANYGPU_BF16_HELPERS
static inline float bf16_to_f32(unsigned short x) {
  unsigned int u = ((unsigned int)x) << 16; float f; memcpy(&f, &u, 4); return f; }
static inline unsigned short f32_to_bf16(float f) {
  unsigned int u; memcpy(&u, &f, 4);
  if (f != f) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u); return (unsigned short)(u >> 16); }
static inline float bf16_round(float f) { return bf16_to_f32(f32_to_bf16(f)); }
#endif"""


# the threads' partial maxima merge keeping NaN, as PyTorch's max does
NANMAX = ("#ifndef ANYGPU_NANMAX\n#define ANYGPU_NANMAX\n"
          "#pragma omp declare reduction(nanmax : float : omp_out = "
          "(omp_in > omp_out || omp_in != omp_in) ? omp_in : omp_out) "
          "initializer(omp_priv = -INFINITY)\n#endif")


# the math functions that glibc's vector math library (libmvec) has in 8 and 16 lanes, declared
# so that GCC calls those in vectorized loops; runtime/cpu.py defines ANYGPU_VECTOR_MATH and
# links libmvec where it compiles and links
VECTOR_MATH_OPS = {"exp2": "exp2f", "log2": "log2f", "sin": "sinf"}
VECTOR_MATH = ("#if defined(ANYGPU_VECTOR_MATH) && !defined(ANYGPU_VECTOR_MATH_DECLARED)\n"
               "#define ANYGPU_VECTOR_MATH_DECLARED\n"
               + "".join(f"#pragma omp declare simd notinbranch\nfloat {fn}(float);\n"
                         for fn in VECTOR_MATH_OPS.values())
               + "#endif")

# a float select whose arms read no memory beyond what its path has read already, as a blend of
# the two values' bits: both are evaluated, and the loop vectorizes (kernels compile without
# GCC's if-conversion, which leaves loops with branches scalar; see runtime/cpu.py). An arm
# with a read of its own stays behind the branch: the condition may be what keeps it in range.
BLEND = """\
#ifndef ANYGPU_BLEND
#define ANYGPU_BLEND
static inline float anygpu_blend(int c, float a, float b) {
  unsigned int ua, ub, m = 0u - (unsigned int)(c != 0);
  memcpy(&ua, &a, 4); memcpy(&ub, &b, 4); ua = (ua & m) | (ub & ~m);
  memcpy(&a, &ua, 4); return a; }
#endif"""


class CRenderer(CStyleRenderer):
    dialect = "c"
    restrict = "restrict"
    types = {**BASE_TYPES, float16: "_Float16", bfloat16: "unsigned short"}
    math_fns = {"exp2": "exp2f({0})", "log2": "log2f({0})", "sin": "sinf({0})",
                "sqrt": "sqrtf({0})", "trunc": "truncf({0})",
                "fmod": "fmodf({0}, {1})"}

    def round_f16(self, x: str) -> str:
        return f"((float)(_Float16)({x}))"

    def render_op(self, e: ir.Expr) -> str:
        if e.op == "max" and e.dtype.is_float:
            # NaN-propagating as PyTorch's max, both tests evaluated (``|``, not ``||``) so that
            # the compiler selects without a branch: the short-circuit branched on every
            # element of random data (ResNet-50's stem pooling at batch 1: 4.3 -> 3.5 ms)
            a, b = self.expr(e.srcs[0], True), self.expr(e.srcs[1], True)
            return self.wrap(f"((({a} > {b}) | ({a} != {a})) ? {a} : {b})", e.dtype)
        if e.op == "where" and e.dtype == float32:
            c = self.expr(e.srcs[0])
            if not any(map(self.reads_memory, e.srcs[1:])):
                a, b = self.expr(e.srcs[1]), self.expr(e.srcs[2])
                self.needs_blend = True
                return f"anygpu_blend({c}, {a}, {b})"
            return self.select(c, self.expr(e.srcs[1]), self.expr(e.srcs[2]))
        if e.op in VECTOR_MATH_OPS:
            self.needs_vector_math = True
        if e.op in ("and", "or") and e.srcs[0].dtype == bool_:
            # both sides evaluated, so that the compiler selects without a branch; a right side
            # with a read of its own keeps C's short circuit (the left may guard its index)
            a = self.expr(e.srcs[0])
            short = self.reads_memory(e.srcs[1])
            b = self.expr(e.srcs[1])
            op = (BOOL_LOGIC if short else INT_LOGIC)[e.op]
            return f"({a} {op} {b})"
        return super().render_op(e)

    def reads_memory(self, e: ir.Expr) -> bool:
        """Whether evaluating ``e`` would read memory not read already on this path (a
        select's arm that its condition may be what keeps in range)."""
        if self.scope.lookup(e) is not None or not self.has_load(e):
            return False
        return e.op == "load" or any(map(self.reads_memory, e.srcs))

    def has_load(self, e: ir.Expr) -> bool:
        known = self.loads.get(id(e))
        if known is None:
            known = e.op == "load" or any(map(self.has_load, e.srcs))
            self.loads[id(e)] = known
        return known

    def emit_parallel(self, st: ir.For) -> None:
        clause = ""
        if st.reduction is not None:
            op, acc = st.reduction
            name = {'add': '+', 'mul': '*', 'max': 'max'}[op]
            if op == "max" and self.float_accumulator(acc):
                name, self.needs_nanmax = "nanmax", True  # OpenMP's max drops NaN
            clause = f" reduction({name}:{acc})"
        self.emit(f"#pragma omp parallel for schedule(static){clause}")

    def float_accumulator(self, name: str) -> bool:
        assert self.kernel is not None
        return any(isinstance(st, ir.Decl) and st.name == name and st.dtype.is_float
                   for st in walk(self.kernel.body))

    def render(self, kernel: ir.Kernel) -> str:
        self.needs_nanmax = self.needs_blend = self.needs_vector_math = False
        self.loads: dict[int, bool] = {}
        return super().render(kernel)

    def prelude(self, kernel: ir.Kernel) -> list[str]:
        lines = ["#include <math.h>", "#include <string.h>"]
        if self.needs_vector_math:
            lines.append(VECTOR_MATH)
        if self.needs_blend:
            lines.append(BLEND)
        if self.needs_nanmax:
            lines.append(NANMAX)
        if uses_dtype(kernel, bfloat16):
            lines.append(BF16_HELPERS)
        return lines


RENDERERS["c"] = CRenderer
