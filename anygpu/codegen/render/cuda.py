"""CUDA C (compiled by NVRTC) and HIP, which shares the dialect."""

from __future__ import annotations

from anygpu.codegen import ir
from anygpu.codegen.render.cstyle import BASE_TYPES, RENDERERS, CStyleRenderer, any_expr, \
    uses_dtype, walk
from anygpu.dtype import ALL, DType, bfloat16, bool_, float16, int8, uint8


# two 16-bit floats in a word, as the tensor cores' fragment registers hold them, combined pair
# by pair (``ir.halves2``): one instruction for both
HALVES2 = """template <typename P>
__device__ __forceinline__ unsigned halves2_sub(unsigned a, unsigned b) {
  const P r = __hsub2(*reinterpret_cast<const P*>(&a), *reinterpret_cast<const P*>(&b));
  return *reinterpret_cast<const unsigned*>(&r);
}
template <typename P>
__device__ __forceinline__ unsigned halves2_mul(unsigned a, unsigned b) {
  const P r = __hmul2(*reinterpret_cast<const P*>(&a), *reinterpret_cast<const P*>(&b));
  return *reinterpret_cast<const unsigned*>(&r);
}"""


# a wgmma operand's shared-memory descriptor: its address (bits 0-13, in units of 16 bytes),
# the leading byte offset (16-29: between blocks of 64 lines' elements where lines run along
# the operand's rows; unused where they run along k), the stride between groups of 8 lines
# (32-45: 1024 bytes) and the swizzle (62-63: 1, 128 bytes)
WGMMA_DESC = """__device__ __forceinline__ unsigned long long wgmma_desc(const void* p,
                                                         unsigned lbo) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(p);
  return (unsigned long long)((a & 0x3FFFF) >> 4) | ((unsigned long long)lbo << 16) |
         (64ull << 32) | (1ull << 62);
}"""


class CUDARenderer(CStyleRenderer):
    dialect = "cuda"
    kernel_prefix = 'extern "C" __global__ '
    restrict = "__restrict__"
    barrier = "__syncthreads();"
    local_qualifier = "__shared__"
    types = {**BASE_TYPES, float16: "__half", bfloat16: "__nv_bfloat16"}
    math_fns = {"exp2": "exp2f({0})", "log2": "log2f({0})", "sin": "sinf({0})",
                "sqrt": "sqrtf({0})", "trunc": "truncf({0})",
                "fmod": "fmodf({0}, {1})"}
    specials = {"lid": "((int)threadIdx.x)", "gid": "((int)blockIdx.x)"}
    fp16_header = "#include <cuda_fp16.h>"
    bf16_header = "#include <cuda_bf16.h>"
    # shuffles move any value, and the combining step is the dialect's own operator
    subgroup_ops = {op: frozenset(ALL) for op in ("add", "max", "mul")}

    def literal(self, value: object, dtype: DType) -> str:
        if dtype.is_float:
            v = float(value)  # type: ignore[arg-type]
            if v != v:
                return "__int_as_float(0x7fc00000)"
            if v in (float("inf"), float("-inf")):
                return "__int_as_float(0x7f800000)" if v > 0 else "__int_as_float(0xff800000)"
        return super().literal(value, dtype)

    def round_f16(self, x: str) -> str:
        return f"__half2float(__float2half_rn({x}))"

    def render_cast(self, x: str, src: DType, dst: DType) -> str:
        if dst == bfloat16:
            return f"__bfloat162float(__float2bfloat16_rn((float)({x})))"
        return super().render_cast(x, src, dst)

    def load_global(self, buf: str, dtype: DType, index: str) -> str:
        if dtype == float16:
            return f"__half2float({buf}[{index}])"
        if dtype == bfloat16:
            return f"__bfloat162float({buf}[{index}])"
        return super().load_global(buf, dtype, index)

    def store_global(self, buf: str, dtype: DType, index: str, value: str) -> str:
        if dtype == float16:
            return f"{buf}[{index}] = __float2half_rn({value});"
        if dtype == bfloat16:
            return f"{buf}[{index}] = __float2bfloat16_rn({value});"
        return super().store_global(buf, dtype, index, value)

    def local_array(self, st: ir.LocalArray) -> str:  # aligned for vector loads
        t = self.storage_type(st.dtype) if st.stored else self.compute_type(st.dtype)
        offset = self.shared_offsets.get(st.name)
        if offset is not None:  # a part of the dynamic shared memory
            # 1024 bytes: the alignment of wgmma's swizzled tiles
            head = "extern __shared__ __align__(1024) unsigned char dynamic_shared[]; " \
                if offset == 0 else ""
            return f"{head}{t}* {st.name} = reinterpret_cast<{t}*>(dynamic_shared + {offset});"
        return f"__shared__ __align__(16) {t} {st.name}[{st.size}];"

    def mma(self, st: ir.Mma, a: list[str], b: list[str]) -> str:
        kind = {float16: "f16", bfloat16: "bf16"}.get(st.dtype, "tf32")
        ops = ", ".join(f'"+f"({c})' for c in st.acc)
        regs = [f'"r"({r})' if isinstance(f, str) else
                f'"r"(*reinterpret_cast<const unsigned*>(&{r}))'
                for f, r in zip([*st.a, *st.b], a + b)]
        na = len(st.a)
        a_list = ",".join(f"%{4 + i}" for i in range(na))
        b_list = ",".join(f"%{4 + na + i}" for i in range(len(st.b)))
        return (f'asm volatile("mma.sync.aligned.{st.shape}.row.col.f32.{kind}.{kind}.f32 '
                f'{{%0,%1,%2,%3}}, {{{a_list}}}, {{{b_list}}}, {{%0,%1,%2,%3}};" : {ops} : '
                f'{", ".join(regs)});')

    def wgmma(self, st: ir.Wgmma) -> str:
        kind = {float16: "f16", bfloat16: "bf16"}.get(st.dtype, "tf32")
        n = len(st.acc)
        accs = ",".join(f"%{i}" for i in range(n))
        ops = ", ".join(f'"+f"({c})' for c in st.acc)
        descs = ", ".join(f'"l"(wgmma_desc(&{buf}[{self.expr(index)}], {lbo >> 4}))'
                          for (buf, index), lbo in zip((st.a, st.b), st.lbo))
        # scale-d 1 (accumulate), A and B unscaled, 16-bit ones transposed where their lines
        # run along m, n (tf32 tiles run along k: the instruction takes no transpose)
        k = 32 // st.dtype.itemsize
        trans = "" if kind == "tf32" else "".join(f", {int(t)}" for t in st.trans)
        return (f'asm volatile("{{.reg .pred p; setp.ne.b32 p, %{n + 2}, 0; '
                f'wgmma.mma_async.sync.aligned.m64n{st.n}k{k}.f32.{kind}.{kind} '
                f'{{{accs}}}, %{n}, %{n + 1}, p, 1, 1{trans};}}" : {ops} : {descs}, '
                f'"r"(1));')

    def pack_halves(self, low: str, high: str, dtype: DType) -> str:
        if dtype == bfloat16:
            bits, rn = "__bfloat16_as_ushort", "__float2bfloat16_rn"
        else:
            bits, rn = "__half_as_ushort", "__float2half_rn"
        return f"((unsigned int){bits}({rn}({low})) | ((unsigned int){bits}({rn}({high})) << 16))"

    def halves2(self, op: str, a: str, b: str, dtype: DType) -> str:
        pair = "__nv_bfloat162" if dtype == bfloat16 else "__half2"
        return f"halves2_{op}<{pair}>({a}, {b})"

    def async_stmt(self, st: ir.AsyncStmt) -> str:
        if isinstance(st, ir.Wgmma):
            return self.wgmma(st)
        if isinstance(st, ir.WgmmaSync):
            if st.op == "proxy":
                return 'asm volatile("fence.proxy.async.shared::cta;" ::: "memory");'
            if st.op == "fence":
                return 'asm volatile("wgmma.fence.sync.aligned;" ::: "memory");'
            if st.op == "commit":
                return 'asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");'
            # the accumulators as operands, so that no read of them moves above the wait
            ops = ", ".join(f'"+f"({c})' for c in st.acc)
            return (f'asm volatile("wgmma.wait_group.sync.aligned {st.pending};" : {ops} :: '
                    f'"memory");')
        if isinstance(st, ir.LdMatrix):
            regs = ", ".join(f'"=r"({n})' for n in st.names)
            trans = ".trans" if st.trans else ""
            return (f"unsigned {', '.join(st.names)}; "
                    f'asm volatile("ldmatrix.sync.aligned.m8n8.x4{trans}.shared.b16 '
                    f'{{%0,%1,%2,%3}}, [%4];" : {regs} : '
                    f'"r"((unsigned)__cvta_generic_to_shared(&{st.buf}[{self.expr(st.index)}])));')
        if isinstance(st, ir.AsyncCopy):
            dst = f"(unsigned)__cvta_generic_to_shared(&{st.dst}[{self.expr(st.dst_index)}])"
            return (f'asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: '
                    f'"r"({dst}), "l"(&{st.src}[{self.expr(st.src_index)}]), '
                    f'"r"(({self.expr(st.valid)}) ? 16 : 0));')
        if isinstance(st, ir.AsyncCommit):
            return 'asm volatile("cp.async.commit_group;");'
        return f'asm volatile("cp.async.wait_group {st.pending};" ::: "memory");'

    def global_vector_load(self, st: ir.VecLoad, index: str) -> list[str]:
        """One load of 4, 8 or 16 bytes (the elements are aligned to their whole size), its
        elements read from registers."""
        size = len(st.names) * st.dtype.itemsize
        word = {4: "unsigned", 8: "uint2", 16: "uint4"}[size]
        v, e = self.fresh("v"), self.fresh("v")
        t = self.storage_type(st.dtype)
        return [f"const {word} {v} = *reinterpret_cast<const {word}*>(&{st.buf}[{index}]);",
                f"const {t}* {e} = reinterpret_cast<const {t}*>(&{v});"] + \
            [self.declare_var(name, st.dtype, self.load_global(e, st.dtype, str(i)))
             for i, name in enumerate(st.names)]

    def vector_store(self, st: ir.VecStore, index: str, values: list[str]) -> list[str]:
        """The values rounded to the stored type in an aligned array of registers, written as
        one store of 4, 8 or 16 bytes."""
        size = len(values) * st.dtype.itemsize
        word = {4: "unsigned", 8: "uint2", 16: "uint4"}[size]
        s = self.fresh("s")
        return [f"__align__(16) {self.storage_type(st.dtype)} {s}[{len(values)}];"] + \
            [self.store_global(s, st.dtype, str(i), v) for i, v in enumerate(values)] + \
            [f"*reinterpret_cast<{word}*>(&{st.buf}[{index}]) = "
             f"*reinterpret_cast<const {word}*>({s});"]

    def vector_read(self, buf: str, index: str, n: int) -> str | None:
        return f"*reinterpret_cast<const float{n}*>(&{buf}[{index}])"

    def subgroup_reduce(self, op: str, value: ir.Expr, width: int | None) -> str:
        """A butterfly of shuffles: at each step a lane combines its value with that of the lane
        whose index differs in one bit, so after log2(width) steps every lane of each group of
        ``width`` holds the group's result."""
        assert width is not None, "warps have a fixed width"
        dtype = value.dtype
        t = self.compute_type(dtype)
        v, off = self.fresh("w"), self.fresh("o")
        self.emit(f"{t} {v} = {self.expr(value)};")
        self.emit("#pragma unroll")
        self.emit(f"for (int {off} = {width // 2}; {off} > 0; {off} >>= 1) {{")
        self.depth += 1
        partner = self.fresh("w")
        self.emit(f"const {t} {partner} = {self.shuffle_xor(v, off, dtype)};")
        self.emit(f"{v} = {self.combine(op, v, partner, dtype)};")
        self.depth -= 1
        self.emit("}")
        return v

    def shuffle_xor(self, value: str, offset: str, dtype: DType) -> str:
        # the lanes a warp's shuffles name: every lane, or those of a work-group smaller than it
        assert self.kernel is not None
        lanes = self.kernel.local
        mask = "0xffffffffu" if lanes >= 32 else f"{(1 << lanes) - 1:#x}u"
        if dtype in (bool_, int8, uint8):  # no 8-bit shuffles: through int
            return f"(({self.compute_type(dtype)})__shfl_xor_sync({mask}, (int){value}, {offset}))"
        return f"__shfl_xor_sync({mask}, {value}, {offset})"

    def render(self, kernel: ir.Kernel) -> str:
        # a kernel that asks for more than the 48 KiB of static shared memory gets its local
        # arrays as parts of one dynamic allocation; the comment on the first line tells the
        # runtime how much to request at launch (see runtime/cuda.py)
        self.shared_offsets: dict[str, int] = {}
        total = 0
        if kernel.meta.get("dynamic_shared"):
            for st in kernel.body:
                if isinstance(st, ir.LocalArray):
                    self.shared_offsets[st.name] = total
                    total += -(-st.size * st.dtype.itemsize // 16) * 16
        source = super().render(kernel)
        return f"/* dynamic shared memory: {total} bytes */\n{source}" if total else source

    def signature(self, kernel: ir.Kernel) -> str:
        sig = super().signature(kernel)
        # a kernel may ask for several resident work-groups per SM (registers are capped to fit)
        blocks = kernel.meta.get("min_blocks")
        bounds = f"{kernel.local}, {blocks}" if blocks else f"{kernel.local}"
        return sig.replace("void ", f"void __launch_bounds__({bounds}) ", 1)

    def prelude(self, kernel: ir.Kernel) -> list[str]:
        lines = []
        if uses_dtype(kernel, float16):
            lines.append(self.fp16_header)
        if uses_dtype(kernel, bfloat16):
            lines.append(self.bf16_header)
        if any_expr(kernel, lambda e: e.op == "halves2"):
            lines.append(HALVES2)
        if any(isinstance(st, ir.Wgmma) for st in walk(kernel.body)):
            lines.append(WGMMA_DESC)
        return lines


class HIPRenderer(CUDARenderer):
    dialect = "hip"
    fp16_header = "#include <hip/hip_fp16.h>"
    bf16_header = "#include <hip/hip_bf16.h>"

    def shuffle_xor(self, value: str, offset: str, dtype: DType) -> str:
        # HIP's unsynchronized shuffle: a wavefront's lanes run in lockstep (32 or 64 of them)
        if dtype in (bool_, int8, uint8):
            return f"(({self.compute_type(dtype)})__shfl_xor((int){value}, {offset}))"
        return f"__shfl_xor({value}, {offset})"


RENDERERS["cuda"] = CUDARenderer
RENDERERS["hip"] = HIPRenderer
