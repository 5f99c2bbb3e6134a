"""The tensor-core GEMM template (CUDA ``mma.sync``, compute capability 8.0 and newer): the same
contractions as ``gemm.py``, in float32 as tf32 when the user allows it
(``anygpu.set_float32_matmul_precision("high")``); float16 and bfloat16 build too, but are not
chosen yet (see ``choose``).

A work-group of 8 warps computes a 128 x 128 tile; each warp a 64 x 32 part of it as 4 x 4
fragments of 16 x 8, accumulating in float32 registers. Per step of ``block_k`` the group stages
the operand tiles in local memory in their storage type, both laid out [row][k] (x as [m][k], y
as [n][k]) so that a thread's fragment register is one 32-bit word, with rows padded so that a
warp's fragment reads fall in distinct banks. The next step's elements are loaded into registers
while the tensor cores work on the current one, and the epilogue (the kernel's output
expression) runs on each accumulator before the store, as in the SIMT template.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from anygpu.codegen import ir
from anygpu.codegen.templates.gemm import Contraction, Tiling
from anygpu.dtype import float32


@dataclass(frozen=True)
class MmaOptions:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 32  # elements of k per step (a multiple of the mma's k: 16, or 8 for tf32)
    warps_m: int = 2
    warps_n: int = 4
    tf32: bool = False

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    def describe(self) -> str:
        kind = "tf32" if self.tf32 else "f16/bf16"
        return (f"tensor cores ({kind}), {self.block_m}x{self.block_n}x{self.block_k} tiles, "
                f"{self.warps_m}x{self.warps_n} warps")


def choose(c: Contraction, dialect: str, cc: tuple[int, int], tf32_allowed: bool,
           max_local: int) -> MmaOptions | None:
    """Options for a contraction on tensor cores, or None where they do not apply."""
    if dialect != "cuda" or cc < (8, 0) or c.x.dtype != c.y.dtype:
        return None
    dtype = c.x.dtype
    m, n, k = c.M, c.N, c.K
    if m < 64 or n < 64 or k < 32 or m * n * k < 1 << 21:
        return None
    if dtype == float32 and tf32_allowed:
        opts = MmaOptions(block_k=8, tf32=True)
    else:
        # float16 and bfloat16 build and compute correctly here, but ran at 11.7 TFLOP/s on an
        # H100 (4096^3), below the SIMT template's 20: 77% of the warps' cycles waited on the
        # staging loads (Nsight Compute: L1TEX scoreboard). They stay with the SIMT template
        # until the staging copies through cp.async without registers or conversions.
        return None
    return opts if opts.threads <= max_local else None


def build(ast: Any, c: Contraction, opts: MmaOptions, params: list[ir.Param], name: str,
          meta: dict) -> ir.Kernel:
    BM, BN, BK = opts.block_m, opts.block_n, opts.block_k
    WM, WN = BM // opts.warps_m, BN // opts.warps_n  # a warp's tile
    MI, NI = WM // 16, WN // 8  # fragments per warp
    KS = 8 if opts.tf32 else 16  # k per mma
    shape = "m16n8k8" if opts.tf32 else "m16n8k16"
    store_dtype = c.x.dtype  # float16, bfloat16, or float32 for tf32
    LD = BK + (4 if opts.tf32 else 8)  # padded row length of the local tiles
    tiling = Tiling(ast, c, BM, BN, BK, opts.threads)
    dt, const = tiling.dt, tiling.const

    def add(*xs: ir.Expr) -> ir.Expr:
        out = xs[0]
        for x in xs[1:]:
            out = ir.alu("add", out, x)
        return out

    def mul(a: ir.Expr, b: int) -> ir.Expr:
        return ir.alu("mul", a, const(b))

    body: list[ir.Stmt] = [ir.LocalArray("xs", store_dtype, BM * LD, stored=True),
                           ir.LocalArray("ys", store_dtype, BN * LD, stored=True)]
    body += tiling.tile_decls()
    body += [ir.Decl("warp", dt, ir.alu("idiv", tiling.lid, const(32))),
             ir.Decl("lane", dt, ir.alu("mod", tiling.lid, const(32)))]
    warp, lane = ir.var("warp", dt), ir.var("lane", dt)
    body += [ir.Decl("wm", dt, ir.alu("idiv", warp, const(opts.warps_n))),
             ir.Decl("wn", dt, ir.alu("mod", warp, const(opts.warps_n))),
             ir.Decl("g", dt, ir.alu("idiv", lane, const(4))),
             ir.Decl("t", dt, ir.alu("mod", lane, const(4)))]
    wm, wn, g, t = (ir.var(v, dt) for v in ("wm", "wn", "g", "t"))
    accs = [[[f"c{i}_{j}_{r}" for r in range(4)] for j in range(NI)] for i in range(MI)]
    body += [ir.Decl(nm, float32, ir.const(0, float32))
             for frag_row in accs for names in frag_row for nm in names]

    compute: list[ir.Stmt] = []
    for ks in range(BK // KS):
        kb = ks * KS
        for i in range(MI):
            r0 = add(mul(wm, WM), const(i * 16), g)  # fragment rows g and g + 8
            if opts.tf32:
                cols = [add(t, const(kb)), add(t, const(kb + 4))]
            else:
                cols = [add(mul(t, 2), const(kb)), add(mul(t, 2), const(kb + 8))]
            a = [("xs", add(mul(add(r0, const(8 * h)), LD), cols[q]))
                 for q in range(2) for h in range(2)]
            for j in range(NI):
                n0 = add(mul(wn, WN), const(j * 8), g)
                b = [("ys", add(mul(n0, LD), cols[q])) for q in range(2)]
                compute.append(ir.Mma(shape, store_dtype, accs[i][j], a, b))

    # both tiles [row][k], so that a thread's fragment register is one 32-bit word
    def row_major(kk: ir.Expr, oo: ir.Expr) -> ir.Expr:
        return add(mul(oo, LD), kk)

    body += tiling.k_loop(row_major, row_major, compute, prefetch=True)
    tm, tn = tiling.tm, tiling.tn
    body += [tiling.store(add(mul(tm, BM), mul(wm, WM), const(i * 16 + 8 * (r // 2)), g),
                          add(mul(tn, BN), mul(wn, WN), const(j * 8 + r % 2), mul(t, 2)),
                          ir.var(accs[i][j][r], float32))
             for i in range(MI) for j in range(NI) for r in range(4)]
    return tiling.kernel(name, params, body, dict(meta, template=f"gemm {opts.describe()}"))
