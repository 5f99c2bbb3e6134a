"""C for the cpu backend: one function per kernel, OpenMP on the outer loop."""

from __future__ import annotations

from anygpu.codegen import ir
from anygpu.codegen.render.cstyle import BASE_TYPES, RENDERERS, CStyleRenderer, walk, uses_dtype
from anygpu.dtype import bfloat16, float16

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
        return super().render_op(e)

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
        self.needs_nanmax = False
        return super().render(kernel)

    def prelude(self, kernel: ir.Kernel) -> list[str]:
        lines = ["#include <math.h>", "#include <string.h>"]
        if self.needs_nanmax:
            lines.append(NANMAX)
        if uses_dtype(kernel, bfloat16):
            lines.append(BF16_HELPERS)
        return lines


RENDERERS["c"] = CRenderer
