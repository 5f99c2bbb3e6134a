"""Hopper's warpgroup GEMM template (CUDA ``wgmma.mma_async``; compute capability 9.0, kernels
built for sm_90a): float16 and bfloat16 contractions whose operands are plain loads that copy
in 16-byte runs, along k (``x @ w.T`` with ``w`` stored [n][k], as a linear layer's weights
are) or along their rows or columns (``x @ w`` with ``w`` stored [k][n]), such as an LLM's
prefill.

``mma.sync`` (``mma.py``) keeps a warp's fragments in registers, so every 16 x 8 x 16 step reads
its operands from shared memory through ``ldmatrix`` and issues one instruction per fragment;
on Hopper it stopped at 40% of cuBLAS's rate. A warpgroup (4 warps) instead issues one
instruction for a 64 x n x 16 product (n up to 256) that reads both operands from shared
memory itself, asynchronously, while the warps go on issuing copies. The operands' tiles are
stored in the layout the instruction reads: lines of 64 elements (128 bytes), the 16-byte
chunks of each line permuted by the line's place in its group of 8 (chunk c of line r at
chunk c ^ (r % 8)), so that the tensor cores' reads of 8 lines fall in distinct banks; a
descriptor (the tile's address, 1024 bytes between groups of 8 lines, the 128-byte swizzle,
and for lines along m or n the distance between blocks of 64) tells the instruction where
each operand starts (``Layout``).

Per step of 64 along k, a ring of ``stages`` buffers: every thread copies its chunks of the
step ``stages - 2`` ahead with ``cp.async`` (16 bytes each, straight into the swizzled place),
waits for the current step's copies, fences them for the tensor cores' reads and meets the
work-group at a barrier; then each warpgroup issues its products over the current step, closes
them as a group and waits only for the previous step's group, so the tensor cores always have
one step queued. A buffer is refilled two steps after its products were issued, once every
warpgroup has waited for them (the barrier of the step between says so).
"""

from __future__ import annotations

import math
from typing import Any

from anygpu.codegen import ir
from anygpu.codegen.templates.gemm import Contraction, Tiling, add, clamped, element_env, mul
from anygpu.dtype import DType, bfloat16, bool_, float16, float32

ROW_BYTES = 128  # a tile row: one swizzle atom's width


def row_elements(dtype: DType) -> int:
    """Elements of k per tile row (one wgmma k-step of 32 bytes is a quarter of it)."""
    return ROW_BYTES // dtype.itemsize


def eligible(c: Contraction, dialect: str, features: dict) -> bool:
    """Whether the warpgroup template may compute ``c``: CUDA on a device with wgmma (the
    feature "wgmma"), float16 or bfloat16 operands that copy in 16-byte runs (along k or along
    their rows or columns), or float32 ones as tf32 where allowed ("tf32") that run along k
    (wgmma reads tf32 tiles only along k), and a product of at least one 128-row tile."""
    from anygpu.codegen.templates.mma import async_operands

    if dialect != "cuda" or not features.get("wgmma") or c.x.dtype != c.y.dtype:
        return False
    tf32 = c.x.dtype == float32 and features.get("tf32", False)
    if c.x.dtype not in (float16, bfloat16) and not tf32:
        return False
    operands = async_operands(c)
    if operands is None or tf32 and any(o.contiguous != "k" for o in operands):
        return False
    return c.M >= 128 and c.N >= 64 and c.K >= row_elements(c.x.dtype)


def shared_bytes(block_m: int, block_n: int, stages: int) -> int:
    return stages * (block_m + block_n) * ROW_BYTES


class Layout:
    """One operand's tile of ``block`` rows (x's m, or y's n) by 128 bytes of k in local memory,
    one per stage, in the swizzled layout wgmma reads. An operand contiguous along k
    (``k_rows``; "K-major" in wgmma's terms): line o holds row o's 64 elements of k, chunk c at
    c ^ (o % 8). One contiguous along its rows ("MN-major"): blocks of 64 rows one after
    another, each of 64 lines (one per element of k) holding the block's 64 rows, chunk c of
    line kk at c ^ (kk % 8); the descriptor gives the distance between blocks (its leading
    byte offset) and the instruction transposes."""

    def __init__(self, buf: str, k_rows: bool, block: int, dtype: DType):
        self.buf, self.k_rows, self.block = buf, k_rows, block
        self.row, self.chunk = row_elements(dtype), 16 // dtype.itemsize  # elements
        self.size = block * self.row  # elements per stage
        self.lbo = 16 if k_rows else 64 * ROW_BYTES  # bytes between 64-element blocks

    def chunks(self) -> int:
        return self.size // self.chunk

    def place(self, ch: ir.Expr, const: Any) -> tuple[ir.Expr, ir.Expr, ir.Expr]:
        """Chunk number ``ch`` of a stage: (its element offset in the stage, its row within
        the block, its element of k within the step)."""
        ROW, CHUNK = self.row, self.chunk
        per_line = (ROW if self.k_rows else self.block) // CHUNK
        line, part = ir.alu("idiv", ch, const(per_line)), ir.alu("mod", ch, const(per_line))
        if self.k_rows:  # line: the operand's row o; part: a chunk of k
            swz = ir.alu("xor", part, ir.alu("mod", line, const(8)))
            return add(mul(line, ROW), mul(swz, CHUNK)), line, mul(part, CHUNK)
        # line: an element of k; part: a chunk of rows, in block part / 8 (16-bit only)
        swz = ir.alu("xor", ir.alu("mod", part, const(8)), ir.alu("mod", line, const(8)))
        offset = add(mul(ir.alu("idiv", part, const(8)), 64 * ROW), mul(line, ROW),
                     mul(swz, CHUNK))
        return offset, mul(part, CHUNK), line

    def start(self, stage: ir.Expr, row: ir.Expr, kb: int, const: Any) -> ir.Expr:
        """The element where a product's fragment begins: rows from ``row`` (a multiple of
        64), k from ``kb`` (a multiple of the instruction's k) within the step."""
        base = mul(stage, self.size)
        if self.k_rows:
            return add(base, mul(row, self.row), const(kb))
        return add(base, mul(row, self.row), const(kb * 64))


def build(ast: Any, c: Contraction, opts: Any, params: list[ir.Param], name: str,
          meta: dict) -> ir.Kernel:
    """The kernel IR of ``ast`` through the warpgroup template; ``opts`` is an ``MmaOptions``
    with ``wgmma`` set: ``warps_m / 4`` warpgroups, stacked along m, each computing
    ``block_m / groups`` rows by ``block_n`` columns."""
    from anygpu.codegen.templates.mma import async_operands

    BM, BN, S = opts.block_m, opts.block_n, opts.stages
    groups = opts.warps_m // 4
    WM = BM // groups  # rows per warpgroup: MI products of 64 rows each
    MI = WM // 64
    dtype = c.x.dtype
    ROW, CHUNK = row_elements(dtype), 16 // dtype.itemsize
    KS = 32 // dtype.itemsize  # k per instruction: 16 halves, or 8 floats as tf32
    assert opts.block_k == ROW and opts.warps_n == 1 and WM % 64 == 0 and S >= 3
    assert BN % 64 == 0 and BN <= 256
    operands = async_operands(c)
    assert operands is not None
    tiling = Tiling(ast, c, BM, BN, ROW, opts.threads)
    dt, const = tiling.dt, tiling.const
    lx = Layout("xs", operands[0].contiguous == "k", BM, dtype)
    ly = Layout("ys", operands[1].contiguous == "k", BN, dtype)
    assert dtype != float32 or lx.k_rows and ly.k_rows

    lane, warp = ir.var("lane", dt), ir.var("warp", dt)
    accs = [[f"c{i}_{r}" for r in range(BN // 2)] for i in range(MI)]
    every = [a for row in accs for a in row]
    body: list[ir.Stmt] = [ir.LocalArray("xs", dtype, S * lx.size, stored=True),
                           ir.LocalArray("ys", dtype, S * ly.size, stored=True)]
    body += tiling.tile_decls()
    body += [ir.Decl("warp", dt, ir.alu("idiv", tiling.lid, const(32))),
             ir.Decl("lane", dt, ir.alu("mod", tiling.lid, const(32))),
             ir.Decl("wg", dt, ir.alu("idiv", warp, const(4)))]
    body += [ir.Decl(a, float32, ir.const(0, float32)) for a in every]
    wg = ir.var("wg", dt)

    def copies(step: ir.Expr) -> list[ir.Stmt]:
        """This thread's cp.async of both operands' chunks at k-step ``step`` into stage
        buffer ``step % stages``, each chunk at its swizzled place."""
        stage = ir.alu("mod", step, const(S))
        k0 = mul(step, ROW)
        out: list[ir.Stmt] = []
        for lay, e, outer, tile in ((lx, c.x, c.ms, tiling.tm), (ly, c.y, c.ns, tiling.tn)):
            rows = math.prod(s for _, s in outer)
            chunks = lay.chunks()
            for j in range(-(-chunks // opts.threads)):
                ch = add(tiling.lid, const(opts.threads * j))
                offset, oo, kk = lay.place(ch, const)
                o, kg = add(mul(tile, lay.block), oo), add(k0, kk)
                # out-of-range chunks are zeros, read from a valid, aligned address
                valid: ir.Expr = ir.const(True, bool_)
                if rows % lay.block:
                    valid = ir.alu("lt", o, const(rows))
                    o = clamped(o, rows if lay.k_rows else rows - CHUNK + 1)
                if c.K % ROW:
                    valid = ir.alu("and", valid, ir.alu("lt", kg, const(c.K)))
                    kg = clamped(kg, c.K - CHUNK + 1 if lay.k_rows else c.K)
                env = element_env(tiling.batch_env, outer, o, c.ks, kg)
                st: ir.Stmt = ir.AsyncCopy(lay.buf, add(mul(stage, lay.size), offset), e.arg,
                                           ir.substitute(e.srcs[0], env), valid)
                if chunks % opts.threads:
                    st = ir.If(ir.alu("lt", ch, const(chunks)), [st])
                out.append(st)
        return out

    def products(stage: ir.Expr) -> list[ir.Stmt]:
        """The warpgroup's products over one stage: per instruction's k, one wgmma per 64
        rows."""
        out: list[ir.Stmt] = [ir.WgmmaSync("fence")]
        for kb in range(0, ROW, KS):
            for i in range(MI):
                a = lx.start(stage, add(mul(wg, WM), const(i * 64)), kb, const)
                b = ly.start(stage, const(0), kb, const)
                out.append(ir.Wgmma(BN, dtype, accs[i], ("xs", a), ("ys", b),
                                    (not lx.k_rows, not ly.k_rows), (lx.lbo, ly.lbo)))
        return out + [ir.WgmmaSync("commit")]

    steps = -(-c.K // ROW)
    ahead = S - 2  # steps copied ahead of the one computed
    for s in range(ahead):
        if s < steps:
            body += copies(const(s))
        body.append(ir.AsyncCommit())
    kt = ir.var("kt", dt)
    nxt = add(kt, const(ahead))
    loop: list[ir.Stmt] = [ir.AsyncWait(ahead - 1), ir.WgmmaSync("proxy"), ir.Barrier(),
                           ir.If(ir.alu("lt", nxt, const(steps)), copies(nxt)),
                           ir.AsyncCommit()]
    loop += products(ir.alu("mod", kt, const(S)))
    loop.append(ir.WgmmaSync("wait", 1, every))
    body.append(ir.For("kt", const(0), const(steps), const(1), loop))
    body += [ir.AsyncWait(0), ir.WgmmaSync("wait", 0, every)]

    # accumulator r of a 64-row product: row 16 * (warp % 4) + g (+ 8 for r % 4 >= 2), column
    # 8 * (r / 4) + 2t (+ 1 for odd r), with g = lane / 4 and t = lane % 4
    g, t = ir.alu("idiv", lane, const(4)), ir.alu("mod", lane, const(4))
    row0 = add(mul(tiling.tm, BM), mul(wg, WM), mul(ir.alu("mod", warp, const(4)), 16), g)
    col0 = add(mul(tiling.tn, BN), mul(t, 2))
    for i in range(MI):
        for r, acc in enumerate(accs[i]):
            row = add(row0, const(i * 64 + 8 * (r % 4 // 2)))
            col = add(col0, const(8 * (r // 4) + r % 2))
            body.append(tiling.store(row, col, ir.var(acc, float32)))
    meta = dict(meta, template=f"gemm {opts.describe()}", dynamic_shared=True,
                min_blocks=1)
    return tiling.kernel(name, params, body, meta)
