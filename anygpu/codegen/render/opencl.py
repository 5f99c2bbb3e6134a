"""OpenCL C: work-groups, __local memory, barriers; half through vload_half/vstore_half, so
float16 buffers work on devices without cl_khr_fp16."""

from __future__ import annotations

from anygpu.codegen import ir
from anygpu.codegen.render.cstyle import RENDERERS, CStyleRenderer, uses_dtype
from anygpu.dtype import DType, bfloat16, bool_, float16, float32, int8, int32, int64, uint8, uint32

# helpers sit inside include guards, so that several kernels' sources can be built as one
# program (the runtime builds the new kernels of a step together)
BF16_HELPERS = """\
#ifndef ANYGPU_BF16_HELPERS
#define ANYGPU_BF16_HELPERS
inline float bf16_to_f32(ushort x) { return as_float(((uint)x) << 16); }
inline ushort f32_to_bf16(float f) {
  uint u = as_uint(f);
  if (f != f) return (ushort)0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u); return (ushort)(u >> 16); }
inline float bf16_round(float f) { return bf16_to_f32(f32_to_bf16(f)); }
#endif"""

SUBGROUPS_PRAGMA = "#pragma OPENCL EXTENSION cl_khr_subgroups : enable"

# round a float to the nearest half and back, without needing the half type
F16_HELPERS = """\
#ifndef ANYGPU_F16_HELPERS
#define ANYGPU_F16_HELPERS
inline float f16_round(float f) {
  __private half h[1]; vstore_half_rte(f, 0, h); return vload_half(0, h); }
#endif"""


class OpenCLRenderer(CStyleRenderer):
    dialect = "opencl"
    kernel_prefix = "__kernel "
    buffer_qualifier = "__global"
    restrict = "restrict"
    barrier = "barrier(CLK_LOCAL_MEM_FENCE);"
    local_qualifier = "__local"
    types = {bool_: "uchar", uint8: "uchar", int8: "char", int32: "int", uint32: "uint",
             int64: "long", float32: "float", float16: "half", bfloat16: "ushort"}
    math_fns = {"exp2": "exp2({0})", "log2": "log2({0})", "sin": "sin({0})",
                "sqrt": "sqrt({0})", "trunc": "trunc({0})",
                "fmod": "fmod({0}, {1})"}
    specials = {"lid": "((int)get_local_id(0))", "gid": "((int)get_group_id(0))",
                "sg_lane": "((int)get_sub_group_local_id())", "sg_id": "((int)get_sub_group_id())",
                "sg_count": "((int)get_num_sub_groups())", "sg_size": "((int)get_sub_group_size())"}
    # cl_khr_subgroups reduces 32- and 64-bit numbers (8-bit ones go through int), and has no
    # product
    subgroup_ops = {op: frozenset({int8, uint8, int32, uint32, int64, float16, bfloat16, float32})
                    for op in ("add", "max")}

    def literal(self, value: object, dtype: DType) -> str:
        if dtype == int64:
            iv = int(value)  # type: ignore[call-overload]
            return f"{iv}L" if iv != -(2**63) else "(-9223372036854775807L-1)"
        return super().literal(value, dtype)

    def round_f16(self, x: str) -> str:
        return f"f16_round({x})"

    def load_global(self, buf: str, dtype: DType, index: str) -> str:
        if dtype == float16:
            return f"vload_half({index}, {buf})"
        return super().load_global(buf, dtype, index)

    def store_global(self, buf: str, dtype: DType, index: str, value: str) -> str:
        if dtype == float16:
            return f"vstore_half_rte({value}, {index}, {buf});"
        return super().store_global(buf, dtype, index, value)

    def local_array(self, st: ir.LocalArray) -> str:  # aligned for vector loads
        return (f"__local {self.compute_type(st.dtype)} {st.name}[{st.size}] "
                f"__attribute__((aligned(16)));")

    def global_vector_load(self, st: ir.VecLoad, index: str) -> list[str]:
        """One ``vloadn`` (``vload_halfn`` for float16, which gives floats)."""
        n = len(st.names)
        v = self.fresh("v")
        if st.dtype == float16:
            head = f"const float{n} {v} = vload_half{n}(({index}) / {n}, {st.buf});"
        else:
            t = self.storage_type(st.dtype)
            head = f"const {t}{n} {v} = vload{n}(({index}) / {n}, {st.buf});"
        return [head] + [self.declare_var(name, st.dtype,
                                          self.load_global_value(f"{v}.s{i:x}", st.dtype))
                         for i, name in enumerate(st.names)]

    def vector_store(self, st: ir.VecStore, index: str, values: list[str]) -> list[str]:
        """One ``vstoren`` of a vector built from the values (``vstore_halfn_rte`` for
        float16, from floats)."""
        n = len(values)
        if st.dtype == float16:
            return [f"vstore_half{n}_rte((float{n})({', '.join(values)}), ({index}) / {n}, "
                    f"{st.buf});"]
        if st.dtype == bfloat16:
            values = [f"f32_to_bf16({v})" for v in values]
        t = self.storage_type(st.dtype)
        return [f"vstore{n}(({t}{n})({', '.join(values)}), ({index}) / {n}, {st.buf});"]

    def load_global_value(self, text: str, dtype: DType) -> str:
        """An element already read from memory (a vector's), as its compute type."""
        if dtype == bfloat16:
            return f"bf16_to_f32({text})"
        return text

    def vector_read(self, buf: str, index: str, n: int) -> str | None:
        return f"*((__local const float{n}*)({buf} + {index}))"

    def subgroup_reduce(self, op: str, value: ir.Expr, width: int | None) -> str:
        assert width is None, "OpenCL's subgroups are of the size the compiler picks"
        fn, dtype = f"sub_group_reduce_{op}", value.dtype
        if dtype in (int8, uint8):
            return self.wrap(f"{fn}((int)({self.expr(value)}))", dtype)
        if op == "max" and dtype.is_float:
            # sub_group_reduce_max may drop NaN (as fmax does): a NaN anywhere gives NaN
            x = self.expr(value, True)
            return f"(sub_group_any(isnan({x})) ? {self.literal(float('nan'), dtype)} : {fn}({x}))"
        return f"{fn}({self.expr(value)})"

    def signature(self, kernel: ir.Kernel) -> str:
        attr = f"__attribute__((reqd_work_group_size({kernel.local}, 1, 1))) "
        return self.kernel_prefix + attr + super().signature(kernel)[len(self.kernel_prefix):]

    def prelude(self, kernel: ir.Kernel) -> list[str]:
        lines = []
        if self.uses_subgroups:  # first: the runtime reads it to build with OpenCL C 2.0 or 3.0
            lines.append(SUBGROUPS_PRAGMA)
        if uses_dtype(kernel, bfloat16):
            lines.append(BF16_HELPERS)
        if uses_dtype(kernel, float16):
            lines.append(F16_HELPERS)
        return lines


RENDERERS["opencl"] = OpenCLRenderer
