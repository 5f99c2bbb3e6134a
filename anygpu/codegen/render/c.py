"""C for the cpu backend: one function per kernel, OpenMP on the outer loop."""

from __future__ import annotations

from anygpu.codegen import ir
from anygpu.codegen.render.cstyle import BASE_TYPES, RENDERERS, CStyleRenderer, uses_dtype
from anygpu.dtype import bfloat16, float16

BF16_HELPERS = """\
static inline float bf16_to_f32(unsigned short x) {
  unsigned int u = ((unsigned int)x) << 16; float f; memcpy(&f, &u, 4); return f; }
static inline unsigned short f32_to_bf16(float f) {
  unsigned int u; memcpy(&u, &f, 4);
  if (f != f) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u); return (unsigned short)(u >> 16); }
static inline float bf16_round(float f) { return bf16_to_f32(f32_to_bf16(f)); }"""


class CRenderer(CStyleRenderer):
    dialect = "c"
    restrict = "restrict"
    types = {**BASE_TYPES, float16: "_Float16", bfloat16: "unsigned short"}
    math_fns = {"exp2": "exp2f({0})", "log2": "log2f({0})", "sin": "sinf({0})",
                "sqrt": "sqrtf({0})", "trunc": "truncf({0})"}

    def round_f16(self, x: str) -> str:
        return f"((float)(_Float16)({x}))"

    def emit_parallel(self, st: ir.For) -> None:
        clause = ""
        if st.reduction is not None:
            op, acc = st.reduction
            clause = f" reduction({ {'add': '+', 'mul': '*', 'max': 'max'}[op]}:{acc})"
        self.emit(f"#pragma omp parallel for schedule(static){clause}")

    def prelude(self, kernel: ir.Kernel) -> list[str]:
        lines = ["#include <math.h>", "#include <string.h>"]
        if uses_dtype(kernel, bfloat16):
            lines.append(BF16_HELPERS)
        return lines


RENDERERS["c"] = CRenderer
