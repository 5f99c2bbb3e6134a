"""The tensor-core GEMM templates (CUDA ``mma.sync``, compute capability 8.0 and newer): the
same contractions as ``gemm.py``, on float16 and bfloat16, and on float32 as tf32 when the user
allows it (``anygpu.set_float32_matmul_precision("high")``). Every variant accumulates in float32
registers, and the epilogue (the kernel's output expression) runs on each accumulator before the
store, as in the SIMT template.

- **Pipelined** (``build_pipelined``; operands that are plain loads from memory, contiguous
  along k or along their rows or columns in runs of 16 bytes): each step's operand tiles go
  from global to local memory through ``cp.async`` (no registers, no conversions), in a ring of
  ``stages`` buffers, so that the copies of the next steps overlap the tensor cores' work on
  the current one; warps read their fragments with ``ldmatrix`` (transposed where a 16-bit
  operand's contiguous axis is not k; such float32 operands are read element by element). Local
  tiles keep the operand's layout, rows padded so that a warp's fragment reads fall in distinct
  banks.
- **Staged through registers** (``build``; tf32 operands that are computed, such as a
  convolution's padded windows): 8 warps on a 128 x 128 tile, each a 64 x 32 part as 4 x 4
  fragments of 16 x 8. Per step of ``block_k`` the group stages the operand tiles in local
  memory in their storage type, both laid out [row][k] so that a thread's fragment register is
  one 32-bit word; the next step's elements are loaded into registers while the tensor cores
  work on the current one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from anygpu.codegen import ir
from anygpu.codegen.templates import wgmma
from anygpu.codegen.templates.gemm import (Contraction, Dims, Tiling, add, clamped,
                                           element_env, linear_operand, mul, row_and_column)
from anygpu.dtype import DType, bfloat16, bool_, float16, float32


@dataclass(frozen=True)
class MmaOptions:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 32  # elements of k per step (a multiple of the mma's k: 16, or 8 for tf32)
    warps_m: int = 2
    warps_n: int = 4
    tf32: bool = False
    stages: int = 0  # cp.async ring buffers (pipelined template); 0: staged through registers
    wgmma: bool = False  # Hopper's warpgroup template (wgmma.py): warps_m / 4 warpgroups

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    def describe(self) -> str:
        if self.wgmma:
            kind = " (tf32)" if self.tf32 else ""
            return (f"wgmma tensor cores{kind}, {self.block_m}x{self.block_n}x{self.block_k} "
                    f"tiles, "
                    f"{self.warps_m // 4} warpgroups, {self.stages}-stage cp.async")
        kind = "tf32" if self.tf32 else "f16/bf16"
        staging = f"{self.stages}-stage cp.async" if self.stages else "register staging"
        return (f"tensor cores ({kind}), {self.block_m}x{self.block_n}x{self.block_k} tiles, "
                f"{self.warps_m}x{self.warps_n} warps, {staging}")


def choose(c: Contraction, dialect: str, features: dict, max_local: int) -> MmaOptions | None:
    """Options for a contraction on tensor cores, or None where they do not apply. ``features``:
    "cc" (compute capability), "tf32" (whether float32 may run as tf32), "max_shared" (local
    memory a work-group may take, in bytes), "wgmma" (Hopper's warpgroup instructions)."""
    if wgmma.eligible(c, dialect, features):
        warpgroups = _wgmma_choice(c, features)
        if warpgroups is not None:
            return warpgroups
    if not eligible(c, dialect, features):
        return None
    dtype = c.x.dtype
    m, n = c.M, c.N
    tf32 = dtype == float32
    operands = async_operands(c)
    opts: MmaOptions | None = None
    if operands is not None:
        # 4096^3 float16 on an H100: 128x128x64 in 3 stages 293 TFLOP/s, 256x128x64 298,
        # 128x256x32 277; fewer output tiles than SMs take 64x64 tiles, and so does a side of
        # 64 or fewer (a convolution of 64 channels, whose 128-wide tiles were half nothing:
        # VGG-16's at 224 x 224 ran at 45 TFLOP/s in tf32 on an H100)
        few = m * n < 128 * 128 * 132
        bm, bn = (64 if few or side <= 64 else 128 for side in (m, n))
        # the same bytes per step for float32: half the elements of k
        steps = ((32, 3), (16, 3), (16, 2)) if tf32 else ((64, 3), (32, 3), (32, 2))
        for bk, stages in steps:
            candidate = MmaOptions(bm, bn, bk, 2, 2, tf32=tf32, stages=stages)
            if shared_bytes(candidate, operands, dtype) <= features.get("max_shared", 48 * 1024):
                opts = candidate
                break
    elif tf32 and math.prod(d[1] for d in c.batch) * m * n >= 1 << 20:
        # computed operands (a convolution's padded windows): staged through registers, on
        # 128x128 tiles; with fewer tiles the SIMT template's 64x64 ones do better (a 3x3
        # convolution of 512 channels at 7x7, batch 16: 0.378 ms here, 0.254 there). A side
        # of 64 or fewer (VGG-16's 64-channel layers at 224 x 224, whose windows are too large
        # to write out) takes 64 x 64 tiles (on 128 x 128 ones half of each was nothing: 28
        # TFLOP/s on an H100); a batch of such products (the layer's weight gradient in
        # partial sums, 32 x 64 x 576) counts all its outputs (on the SIMT template's tiles it
        # ran at 15 TFLOP/s, on staged 64 x 128 ones at 20)
        opts = _narrow_staged(m, n) or MmaOptions(block_k=8, tf32=True)
    # float16 and bfloat16 operands that are computed (a convolution's padded windows) are left
    # to the SIMT template: staged through registers here they ran at 11.7 TFLOP/s on an H100
    # (4096^3), below its 20 (77% of the cycles waited on the staging loads)
    return opts if opts is not None and opts.threads <= max_local else None


def _narrow_staged(m: int, n: int) -> MmaOptions | None:
    """Register-staged tf32 tiles for a product with a side of 64 or fewer (None where neither
    side is): 64 x 64 on 4 warps, the tuner's choice for VGG-16's 64-channel convolution at 224
    x 224 on an H100 (1.16 ms as the tuner timed it, 1.67 on 256 x 64 tiles of 8 warps; 128 x
    128 tiles averaged 2.08 ms over its forward product and input gradient in a step)."""
    return MmaOptions(64, 64, 8, 2, 2, tf32=True) if min(m, n) <= 64 else None


def _wgmma_options(block_m: int, block_n: int, stages: int, dtype: DType) -> MmaOptions:
    return MmaOptions(block_m, block_n, wgmma.row_elements(dtype),
                      4 * (block_m // 64) if block_m < 128 else 8, 1, tf32=dtype == float32,
                      stages=stages, wgmma=True)


def _wgmma_choice(c: Contraction, features: dict) -> MmaOptions | None:
    """128 x 128 tiles of two warpgroups (128 x 64 where fewer than half the device's SMs
    would get a tile, or the product has 64 or fewer columns), as many stages as fit up to 6:
    on an H100, float16 512 x 4096 x 4096 ran at 261, 380, 409 and 403 TFLOP/s in 3, 4, 5 and
    6 stages, 512 x 11008 x 4096 at 299, 312, 345 and 355, 512 x 4096 x 11008 at 456, 463,
    511 and 513."""
    units = features.get("units", 132)
    # (64 or fewer columns, a convolution of 64 channels: 128 would compute half a tile of
    # nothing)
    block_n = 64 if c.N <= 64 else 128 if -(-c.M // 128) * -(-c.N // 128) * 2 >= units else 64
    for stages in (6, 5, 4, 3):
        if wgmma.shared_bytes(128, block_n, stages) <= features.get("max_shared", 48 * 1024):
            return _wgmma_options(128, block_n, stages, c.x.dtype)
    return None


def eligible(c: Contraction, dialect: str, features: dict) -> bool:
    """Whether tensor cores may compute ``c``: CUDA from compute capability 8.0, float16 or
    bfloat16 operands (float32 ones as tf32 where allowed), and a product large enough."""
    cc = features.get("cc", (0, 0))
    if dialect != "cuda" or cc < (8, 0) or c.x.dtype != c.y.dtype:
        return False
    if c.M < 64 or c.N < 64 or c.K < 32 or c.M * c.N * c.K < 1 << 21:
        return False
    return c.x.dtype in (float16, bfloat16) or \
        (c.x.dtype == float32 and features.get("tf32", False))


def candidates(c: Contraction, dialect: str, features: dict, max_local: int,
               level: int) -> list[MmaOptions]:
    """The tensor-core configurations the tuner times for ``c`` (``choose``'s first where it
    picks tensor cores): tile shapes and warp layouts, k-steps and, at level 2, pipeline
    depths."""
    default = choose(c, dialect, features, max_local)
    out = [default] if default is not None else []
    if wgmma.eligible(c, dialect, features):
        limit = features.get("max_shared", 48 * 1024)
        shapes = [(128, 128), (128, 64), (128, 256), (256, 128), (64, 128)]
        for bm, bn in shapes:
            # level 1: the deepest ring that fits; level 2: every depth from 3
            rings = [d for d in (6, 5, 4, 3) if wgmma.shared_bytes(bm, bn, d) <= limit]
            for stages in rings if level >= 2 else rings[:1]:
                o = _wgmma_options(bm, bn, stages, c.x.dtype)
                if o not in out and o.threads <= max_local:
                    out.append(o)
    if not eligible(c, dialect, features):
        return out
    dtype = c.x.dtype
    tf32 = dtype == float32
    operands = async_operands(c)
    if operands is not None:
        tiles = [(128, 128, 2, 2), (64, 64, 2, 2), (128, 64, 2, 2), (64, 128, 2, 2),
                 (128, 128, 2, 4), (256, 128, 4, 2), (128, 256, 2, 4)]
        steps = (16, 32) if tf32 else (32, 64)
        depths = (2, 3, 4) if level >= 2 else (3,)
        for bm, bn, wm, wn in tiles:
            for bk in steps:
                for stages in depths:
                    o = MmaOptions(bm, bn, bk, wm, wn, tf32=tf32, stages=stages)
                    if o not in out and o.threads <= max_local and \
                            shared_bytes(o, operands, dtype) <= features.get("max_shared",
                                                                             48 * 1024):
                        out.append(o)
    elif tf32:  # computed operands: staged through registers
        staged = [(128, 128, 8, 2, 4), (128, 128, 16, 2, 4), (64, 64, 8, 2, 2), (64, 64, 16, 2, 2),
                  (64, 256, 8, 2, 4), (256, 64, 8, 4, 2), (64, 128, 8, 2, 4), (128, 64, 8, 4, 2),
                  (64, 128, 16, 2, 2), (128, 64, 16, 2, 2)]
        for o in [MmaOptions(*shape, tf32=True) for shape in staged]:
            if o not in out and o.threads <= max_local:
                out.append(o)
    return out


@dataclass(frozen=True)
class AsyncOperand:
    """An operand that copies to local memory in 16-byte runs: a plain load whose elements are
    consecutive along ``contiguous`` ("k", or "outer": its rows for x, its columns for y) in
    runs of 16 bytes (8 halves, 4 floats) that start at multiples of 16 bytes."""

    contiguous: str


def _async_operand(e: ir.Expr, outer: Dims, ks: Dims, batch: Dims) -> AsyncOperand | None:
    if e.dtype not in (float16, bfloat16, float32):
        return None
    run = 16 // e.dtype.itemsize
    op = linear_operand(e, batch + outer + ks, e.dtype)
    if op is None or op.offset % run:
        return None
    axes = batch + outer + ks
    for along, inner in (("k", ks[-1]), ("outer", outer[-1])):
        others = [s for s, d in zip(op.strides, axes) if d != inner]
        if op.strides[axes.index(inner)] == 1 and inner[1] % run == 0 and \
                all(s % run == 0 for s in others):
            return AsyncOperand(along)
    return None


def async_operands(c: Contraction) -> tuple[AsyncOperand, AsyncOperand] | None:
    """How x and y copy asynchronously, or None where either cannot."""
    x = _async_operand(c.x, c.ms, c.ks, c.batch)
    y = _async_operand(c.y, c.ns, c.ks, c.batch)
    return None if x is None or y is None else (x, y)


class Warps:
    """What both tensor-core templates share: each warp's place in the work-group's tile
    (``wm``, ``wn``), a lane's fragment row and column (``g``, ``t``), the float32 accumulators
    of the warp's MI x NI fragments of 16 x 8 (``decls`` declares them all), and the epilogue
    that stores them."""

    def __init__(self, tiling: Tiling, opts: MmaOptions):
        self.tiling, dt, const = tiling, tiling.dt, tiling.const
        self.WM, self.WN = tiling.BM // opts.warps_m, tiling.BN // opts.warps_n  # a warp's tile
        self.MI, self.NI = self.WM // 16, self.WN // 8  # fragments per warp
        self.lane = ir.var("lane", dt)
        warp = ir.var("warp", dt)
        self.decls: list[ir.Stmt] = [
            ir.Decl("warp", dt, ir.alu("idiv", tiling.lid, const(32))),
            ir.Decl("lane", dt, ir.alu("mod", tiling.lid, const(32))),
            ir.Decl("wm", dt, ir.alu("idiv", warp, const(opts.warps_n))),
            ir.Decl("wn", dt, ir.alu("mod", warp, const(opts.warps_n))),
            ir.Decl("g", dt, ir.alu("idiv", self.lane, const(4))),
            ir.Decl("t", dt, ir.alu("mod", self.lane, const(4)))]
        self.wm, self.wn, self.g, self.t = (ir.var(v, dt) for v in ("wm", "wn", "g", "t"))
        self.accs = [[[f"c{i}_{j}_{e}" for e in range(4)] for j in range(self.NI)]
                     for i in range(self.MI)]
        self.decls += [ir.Decl(nm, float32, ir.const(0, float32))
                       for row in self.accs for names in row for nm in names]

    def store(self) -> list[ir.Stmt]:
        """The epilogue of every accumulator: c0, c1 at row g, columns 2t and 2t + 1 of its
        fragment; c2, c3 at row g + 8."""
        tiling, const = self.tiling, self.tiling.const
        row0 = add(mul(tiling.tm, tiling.BM), mul(self.wm, self.WM), self.g)
        col0 = add(mul(tiling.tn, tiling.BN), mul(self.wn, self.WN), mul(self.t, 2))
        return [tiling.store(add(row0, const(i * 16 + 8 * (e // 2))),
                             add(col0, const(j * 8 + e % 2)),
                             ir.var(self.accs[i][j][e], float32))
                for i in range(self.MI) for j in range(self.NI) for e in range(4)]


def build(ast: Any, c: Contraction, opts: MmaOptions, params: list[ir.Param], name: str,
          meta: dict) -> ir.Kernel:
    BM, BN, BK = opts.block_m, opts.block_n, opts.block_k
    KS = 8 if opts.tf32 else 16  # k per mma
    shape = "m16n8k8" if opts.tf32 else "m16n8k16"
    store_dtype = c.x.dtype  # float16, bfloat16, or float32 for tf32
    LD = BK + (4 if opts.tf32 else 8)  # padded row length of the local tiles
    tiling = Tiling(ast, c, BM, BN, BK, opts.threads)
    const = tiling.const
    warps = Warps(tiling, opts)
    WM, WN, MI, NI, accs = warps.WM, warps.WN, warps.MI, warps.NI, warps.accs
    wm, wn, g, t = warps.wm, warps.wn, warps.g, warps.t

    body: list[ir.Stmt] = [ir.LocalArray("xs", store_dtype, BM * LD, stored=True),
                           ir.LocalArray("ys", store_dtype, BN * LD, stored=True)]
    body += tiling.tile_decls() + warps.decls

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

    body += tiling.k_loop(row_major, row_major, compute, prefetch=True) + warps.store()
    return tiling.kernel(name, params, body, dict(meta, template=f"gemm {opts.describe()}"))


class Layout:
    """One operand's local tiles in the pipelined template: ``rows`` of ``width`` elements (its
    contiguous axis), one tile per stage. Rows are padded so that the fragment reads of a warp
    fall in distinct banks: by 16 bytes where ldmatrix reads 8 rows of 16 bytes at once, by 8
    floats where float32 fragments are read one element per lane (lanes t * row + g, t < 4,
    g < 8)."""

    def __init__(self, buf: str, how: AsyncOperand, block: int, block_k: int, dtype: DType):
        self.buf, self.block = buf, block
        self.run = 16 // dtype.itemsize  # elements per 16-byte copy
        self.k_rows = how.contiguous == "k"  # a row per element of the operand's block
        self.width = block_k if self.k_rows else block
        self.rows = block if self.k_rows else block_k
        # ldmatrix reads 32-bit elements only untransposed, so float32 tiles whose rows are
        # not along k give their fragments element by element
        self.ldmatrix = self.k_rows or dtype.itemsize == 2
        self.ld = self.width + (self.run if self.ldmatrix else 8)
        self.size = self.rows * self.ld

    def index(self, stage: ir.Expr, oo: ir.Expr, kk: ir.Expr) -> ir.Expr:
        row, col = (oo, kk) if self.k_rows else (kk, oo)
        return add(mul(stage, self.size), mul(row, self.ld), col)


def shared_bytes(opts: MmaOptions, operands: tuple[AsyncOperand, AsyncOperand],
                 dtype: DType) -> int:
    """Local memory the pipelined template takes with these options."""
    x = Layout("xs", operands[0], opts.block_m, opts.block_k, dtype)
    y = Layout("ys", operands[1], opts.block_n, opts.block_k, dtype)
    return opts.stages * (x.size + y.size) * dtype.itemsize


def build_pipelined(ast: Any, c: Contraction, opts: MmaOptions, params: list[ir.Param],
                    name: str, meta: dict) -> ir.Kernel:
    """The kernel IR of ``ast`` through the pipelined template (see the module's docstring)."""
    operands = async_operands(c)
    dtype = c.x.dtype
    run = 16 // dtype.itemsize  # elements per 16-byte copy, and per ldmatrix row
    KS = 2 * run  # k per mma: 16 halves, or 8 floats as tf32
    assert operands is not None and opts.block_k % KS == 0
    BM, BN, BK, S = opts.block_m, opts.block_n, opts.block_k, opts.stages
    tiling = Tiling(ast, c, BM, BN, BK, opts.threads)
    dt, const = tiling.dt, tiling.const
    warps = Warps(tiling, opts)
    WM, WN, MI, NI, accs = warps.WM, warps.WN, warps.MI, warps.NI, warps.accs
    wm, wn, g, t = warps.wm, warps.wn, warps.g, warps.t
    assert NI % 2 == 0  # ldmatrix.x4 reads two fragments of y at once
    lx = Layout("xs", operands[0], BM, BK, dtype)
    ly = Layout("ys", operands[1], BN, BK, dtype)
    body: list[ir.Stmt] = [ir.LocalArray("xs", dtype, S * lx.size, stored=True),
                           ir.LocalArray("ys", dtype, S * ly.size, stored=True)]
    body += tiling.tile_decls() + warps.decls
    body += [ir.Decl("q", dt, ir.alu("idiv", warps.lane, const(8))),  # the ldmatrix matrix a
             ir.Decl("r", dt, ir.alu("mod", warps.lane, const(8)))]  # lane addresses, its row
    q, r = ir.var("q", dt), ir.var("r", dt)

    def copies(step: ir.Expr) -> list[ir.Stmt]:
        """This thread's cp.async of both operands' tiles at k-step ``step`` (an index, not
        an offset) into stage buffer ``step % stages``."""
        stage = ir.alu("mod", step, const(S))
        k0 = mul(step, BK)
        out: list[ir.Stmt] = []
        for lay, e, outer, tile in ((lx, c.x, c.ms, tiling.tm), (ly, c.y, c.ns, tiling.tn)):
            size = math.prod(s for _, s in outer)
            per_row = lay.width // run
            chunks = lay.rows * per_row
            for j in range(-(-chunks // opts.threads)):
                ch = add(tiling.lid, const(opts.threads * j))
                row, col = row_and_column(tiling.lid, opts.threads * j, per_row)
                col = mul(col, run)
                oo, kk = (row, col) if lay.k_rows else (col, row)
                o, kg = add(mul(tile, lay.block), oo), add(k0, kk)
                # an out-of-range run reads nothing, but its address must still be valid and
                # aligned; where the tiles divide the sizes, no run is out of range
                o_ragged, k_ragged = size % lay.block != 0, c.K % BK != 0
                valid = ir.const(True, bool_)
                if o_ragged:
                    valid = ir.alu("lt", o, const(size))
                    o = clamped(o, size - run + 1) if not lay.k_rows else clamped(o, size)
                if k_ragged:
                    valid = ir.alu("and", valid, ir.alu("lt", kg, const(c.K)))
                    kg = clamped(kg, c.K - run + 1) if lay.k_rows else clamped(kg, c.K)
                env = element_env(tiling.batch_env, outer, o, c.ks, kg)
                src = ir.substitute(e.srcs[0], env)
                st: ir.Stmt = ir.AsyncCopy(lay.buf, lay.index(stage, oo, kk), e.arg, src, valid)
                if chunks % opts.threads:
                    st = ir.If(ir.alu("lt", ch, const(chunks)), [st])
                out.append(st)
        return out

    def fragments(stage: ir.Expr) -> list[ir.Stmt]:
        """The warp's mma over one stage buffer, per ``KS`` of k: the fragments of the next
        step are read before the mma of the current one, so the reads overlap the tensor
        cores' work (the asm statements keep their order)."""
        reads, products = [], []
        shape = "m16n8k16" if KS == 16 else "m16n8k8"
        half = ir.alu("idiv", q, const(2))  # ldmatrix matrix q: one 16-byte half of k or not
        odd = ir.alu("mod", q, const(2))
        for kb in range(0, BK, KS):
            out: list[ir.Stmt] = []
            reads.append(out)
            a_regs: list[list[tuple[str, ir.Expr] | str]] = []
            for i in range(MI):
                m0 = add(mul(wm, WM), const(i * 16))
                names = [f"a{kb}_{i}_{e}" for e in range(4)]
                if not lx.ldmatrix:  # float32 [k][m]: (g, t), (g + 8, t), (g, t + 4), ...
                    a_regs.append([("xs", lx.index(stage, add(m0, g, const(8 * (e % 2))),
                                                   add(const(kb + 4 * (e // 2)), t)))
                                   for e in range(4)])
                    continue
                a_regs.append(list(names))
                # matrix q: rows + 8 (q % 2), k + one run (q / 2)
                if lx.k_rows:
                    idx = lx.index(stage, add(m0, mul(odd, 8), r), add(const(kb), mul(half, run)))
                else:
                    idx = lx.index(stage, add(m0, mul(odd, 8)), add(const(kb), mul(half, run), r))
                out.append(ir.LdMatrix(names, "xs", idx, trans=not lx.k_rows))
            b_regs: list[list[tuple[str, ir.Expr] | str]] = []
            for j in range(0, NI, 2):
                n0 = add(mul(wn, WN), const(j * 8))
                names = [f"b{kb}_{j}_{e}" for e in range(4)]
                if not ly.ldmatrix:  # float32 [k][n]: (k = t, n = g), (t + 4, g)
                    b_regs += [[("ys", ly.index(stage, add(n0, g, const(8 * f)),
                                               add(const(kb + 4 * h), t))) for h in range(2)]
                               for f in range(2)]
                    continue
                first: list[tuple[str, ir.Expr] | str] = [*names[:2]]
                second: list[tuple[str, ir.Expr] | str] = [*names[2:]]
                b_regs += [first, second]
                # matrix q: columns + 8 (q / 2), k + one run (q % 2)
                if ly.k_rows:
                    idx = ly.index(stage, add(n0, mul(half, 8), r), add(const(kb), mul(odd, run)))
                else:
                    idx = ly.index(stage, add(n0, mul(half, 8)), add(const(kb), mul(odd, run), r))
                out.append(ir.LdMatrix(names, "ys", idx, trans=not ly.k_rows))
            mmas: list[ir.Stmt] = []
            products.append(mmas)
            for i in range(MI):
                for j in range(NI):
                    mmas.append(ir.Mma(shape, dtype, accs[i][j], a_regs[i], b_regs[j]))
        order = reads[0]
        for step, mmas in enumerate(products):
            order += (reads[step + 1] if step + 1 < len(reads) else []) + mmas
        return order

    steps = -(-c.K // BK)
    for s in range(S - 1):  # the first stages in flight before the loop
        if s < steps:
            body += copies(const(s))
        body.append(ir.AsyncCommit())
    kt = ir.var("kt", dt)
    ahead = add(kt, const(S - 1))
    loop: list[ir.Stmt] = [ir.AsyncWait(S - 2), ir.Barrier(),
                           ir.If(ir.alu("lt", ahead, const(steps)), copies(ahead)),
                           ir.AsyncCommit()]
    loop += fragments(ir.alu("mod", kt, const(S)))
    body.append(ir.For("kt", const(0), const(steps), const(1), loop))
    body += [ir.AsyncWait(0)] + warps.store()
    meta = dict(meta, template=f"gemm {opts.describe()}",
                dynamic_shared=shared_bytes(opts, operands, dtype) > 48 * 1024)
    return tiling.kernel(name, params, body, meta)
