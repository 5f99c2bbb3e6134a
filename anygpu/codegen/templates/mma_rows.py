"""Few rows against a large matrix on tensor cores: the products of a decode step.

A decode step of 2 to 16 sequences multiplies each layer's weight matrix by as many rows of
activations (``x @ W.T``, x of M <= 16 rows). The segment lowering computes such rows together
(``lower._shared_rows``), each weight read once, but on SIMT units it spends 16 multiply-adds
and 16 conversions per weight: a Llama-2-7B step of 16 sequences on an H200 ran its 11008-row
products at 0.1 TB/s, compute-bound. Here the rows are the 16 rows of an ``mma.sync`` m16n8k16
fragment and the weights its columns, so the tensor cores do the arithmetic and the weights
stream at the memory's rate. One row against packed weights (4-bit or 8-bit) comes here too:
on SIMT units their unpacking and multiply-adds, not the memory, bound the product.

A work-group of WARPS warps computes ``8 * ni`` columns (outputs along the weight's rows) of
every row and stage; its warps split k, warp ``w`` taking the units (blocks of 32 elements, or
of 32 * RUN_BLOCKS) ``w``, ``w + WARPS``, ..., and combine their float32 partial sums through
local memory at the end.

Each lane reads its fragments straight from memory, without local tiles: the sum over k does
not depend on the order of its terms, so the lane that an mma gives k-slots 2t, 2t + 1, 2t + 8
and 2t + 9 of a block of 16 is handed the 8 consecutive elements 8t .. 8t + 7 of a block of 32,
the first four for one mma and the last four for the next, in the A fragment (the activations)
and the B fragment (the weights) alike. So every lane reads 16 consecutive bytes of a weight
row per block: one vector load, the raw words of a float16 or bfloat16 matrix going straight
into the fragment registers. Where the weights are packed, lane t of a quad takes instead the
run of 32 consecutive elements ``unit * 128 + 32 t ..`` over RUN_BLOCKS blocks: one group of
4-bit weights, one 16-byte load, each weight's shift within its word a constant; of every four
elements the first and third share a register, then the second and fourth, so that a pair of
4-bit weights is one shift and one mask of a word (``_pair``), the activations' halves moved
to match. Computed operands (a fused normalization's output) are evaluated in float32 and
rounded into the fragment's dtype, as a framework rounds a model's activations to its dtype
between layers; small integers times a 16-bit scale (4-bit and 8-bit weights) are made in
16-bit arithmetic two at a time, to the same values.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from anygpu.codegen import ir, lower
from anygpu.codegen.templates import gemm
from anygpu.dtype import DType, bfloat16, float16, float32, int8, int32, uint32

WARPS = 8
# columns of each work-group, in fragments of 8: at most this many accumulators of 16 x 8 per
# stage and lane
MAX_FRAGMENTS = 4
# fewer work-groups than this take fewer columns each (on an H200, a Llama-2-7B step of 16
# sequences: 256 groups of 16 columns read the 4096 x 4096 weights at 2.0 TB/s, 512 groups of 8
# at 1.7)
MIN_GROUPS = 256
# k-blocks of 32 each warp reads per step of its loop, at most (its fragments' loads in flight)
MAX_UNROLL = 4
# weight loads per lane and step the unrolling aims at
LOADS_PER_STEP = 4
# the same for one row against packed weights, whose fragments hold no other rows' loads: more
# groups, so that more warps have loads in flight, and twice the unrolling (on an H100, 4-bit
# weights in a captured step: 4096 x 4096 7.6 -> 6.8 us, 4096 x 11008 17.5 -> 15.1, the gate
# and up pair 27.5 -> 26.4)
ONE_ROW_MIN_GROUPS = 512
ONE_ROW_LOADS_PER_STEP = 8
# blocks of 32 over which a lane reading packed weights takes a run of consecutive elements (8
# per block): 32 4-bit weights, one 16-byte load, their shifts within the words constants
RUN_BLOCKS = 4


def _factors(value: ir.Expr, shared: str | None, columns: set[str]
             ) -> tuple[ir.Expr, ir.Expr] | None:
    """(x, w) of a stage's ``x * w``: x reads no column axis (it reads the shared axis, the
    rows, where there is one), w reads no row."""
    if value.op != "mul":
        return None
    for x, w in (value.srcs, value.srcs[::-1]):
        vx, vw = lower._names(x), lower._names(w)
        if not vx & columns and (shared is None or shared in vx and shared not in vw):
            return x, w
    return None


def _packed(w: ir.Expr, inner: str) -> bool:
    """Whether ``w`` reads integer words holding several of its elements each (4-bit or 8-bit
    weights), along the innermost summed axis ``inner``."""
    for ld in gemm.loads(w):
        step = lower._index_step(ld.srcs[0], inner)
        if not ld.dtype.is_float and step is not None and 0 < step < 1:
            return True
    return False


def _fragment_dtype(pairs: list[tuple[ir.Expr, ir.Expr]]) -> DType | None:
    """The dtype of the fragments: that of every stage's operands where it is the same 16-bit
    float (a float16 or bfloat16 model's activations and weights, 4-bit weights scaled to
    float16), else None (a float32 model keeps its precision on the SIMT path)."""
    dtypes = {v.dtype for pair in pairs for v in pair}
    return dtypes.pop() if len(dtypes) == 1 and dtypes <= {float16, bfloat16} else None


@dataclass(frozen=True)
class RowsPlan:
    """How ``build`` computes a kernel: its ``rows`` along the ``shared`` axis (one row where
    there is none), ``columns`` (the other outputs, flattened) and ``red_total`` elements
    summed into each; each stage's (x, w) factors, the fragments' dtype, ``ni`` fragments of 8
    columns per work-group, ``span`` blocks of 32 each lane's run of consecutive elements
    covers (1 or RUN_BLOCKS) and ``unroll`` such units per step of a warp's loop."""

    shared: str | None
    rows: int
    columns: int
    red_total: int
    pairs: list[tuple[ir.Expr, ir.Expr]]
    dtype: DType
    ni: int
    span: int
    unroll: int


def plan(ast: Any, shared: tuple[str, int] | None, dialect: str, features: dict
         ) -> RowsPlan | None:
    """How the tensor cores compute ``ast``, else None: CUDA from compute capability 8.0, rows
    shared by a work-group (``lower._shared_rows``) or one row against packed weights (4-bit
    or 8-bit: on SIMT units their unpacking and multiply-adds, not the memory, bound a decode
    step's products), every stage a float sum of ``x * w`` over a row of a multiple of 32
    elements (256 or more), x and w of the same 16-bit float dtype, and 256 or more columns."""
    if dialect != "cuda" or features.get("cc", (0, 0)) < (8, 0) or not ast.reduce:
        return None
    rows = shared[1] if shared is not None else 1
    name = shared[0] if shared is not None else None
    red_total = math.prod(d[1] for d in ast.reduce)
    columns = math.prod(d[1] for d in ast.outer) // rows
    if red_total % 32 or red_total < 256 or columns < 256 or len(ast.stages) > MAX_FRAGMENTS:
        return None
    pairs = []
    others = {n for n, _, _ in ast.outer if n != name}
    for stage in ast.stages:
        if stage.op.name != "SUM" or not stage.dtype.is_float:
            return None
        pair = _factors(stage.value, name, others)
        if pair is None:
            return None
        pairs.append(gemm.narrowed(*pair))
    dtype = _fragment_dtype(pairs)
    if dtype is None:
        return None
    packed = all(_packed(w, ast.reduce[-1][0]) for _, w in pairs)
    if shared is None and not packed:
        # one row of 16-bit weights: the segment lowering reads them at the memory's rate
        return None
    # packed weights: each lane reads a run of RUN_BLOCKS * 8 elements, whole words
    span = RUN_BLOCKS if packed and red_total % (32 * RUN_BLOCKS) == 0 else 1
    stages = len(ast.stages)
    least, loads = (ONE_ROW_MIN_GROUPS, ONE_ROW_LOADS_PER_STEP) if shared is None else \
        (MIN_GROUPS, LOADS_PER_STEP)
    ni = max(MAX_FRAGMENTS // stages, 1)
    while ni > 1 and -(-columns // (8 * ni)) < least:
        ni //= 2
    units = red_total // (32 * span)
    unroll = 1
    while unroll * 2 <= MAX_UNROLL and stages * ni * unroll * 2 <= loads and \
            units >= WARPS * unroll * 2:
        unroll *= 2
    return RowsPlan(name, rows, columns, red_total, pairs, dtype, ni, span, unroll)


def _words(values: list[ir.Expr], axes: list[tuple[str, int]], dtype: DType, prefix: str
           ) -> tuple[list[ir.Stmt], list[str]]:
    """Fragment registers, two elements each, from consecutive elements ``values`` of an
    operand (8 per block of 32): the raw words of vector loads where the elements are a plain
    16-bit load of ``dtype``, aligned and contiguous; else each evaluated (its loads read as
    vectors where they can) and rounded in pairs."""
    memo: dict[int, ir.Expr] = {}
    known = frozenset(name for name, _ in axes)
    folded = [lower._fold(v, known, memo) for v in values]
    reads, copies = lower._vector_reads([[v] for v in folded], axes, prefix)
    names = [f"{prefix}w{q}" for q in range(len(values) // 2)]
    flat = [n for r in reads if isinstance(r, ir.VecLoad) for n in r.names]
    if reads and all(isinstance(r, ir.VecLoad) and r.dtype == dtype and len(r.names) == 8
                     for r in reads) and len(flat) == len(values):
        raw: list[ir.Stmt] = [
            ir.VecLoad([f"{prefix}r{4 * i + q}" for q in range(4)], uint32, r.buf, r.index)
            for i, r in enumerate(reads) if isinstance(r, ir.VecLoad)]
        if all(c[0] is ir.var(n, dtype) for c, n in zip(copies, flat)):  # in memory's order
            return [dataclasses.replace(r, names=names[4 * i:4 * i + 4])
                    for i, r in enumerate(raw) if isinstance(r, ir.VecLoad)], names
        where = {id(ir.var(n, dtype)): i for i, n in enumerate(flat)}
        if all(id(c[0]) in where for c in copies):  # in another order: halves moved
            def half(e: ir.Expr) -> ir.Expr:
                i = where[id(e)]
                word = ir.var(f"{prefix}r{i // 2}", uint32)
                if i % 2:
                    return ir.alu("shr", word, ir.const(16, uint32))
                return ir.alu("and", word, ir.const(0xFFFF, uint32))
            return raw + [ir.Decl(names[q], uint32, ir.alu(
                "or", half(copies[2 * q][0]), ir.alu("shl", half(copies[2 * q + 1][0]),
                                                     ir.const(16, uint32))))
                for q in range(len(names))], names
    stmts = reads + [ir.Decl(names[q], uint32, _pair(copies[2 * q][0], copies[2 * q + 1][0],
                                                     dtype))
                     for q in range(len(names))]
    return stmts, names


# the largest span of integers a 16-bit float's mantissa holds above its power of two (1024 +
# n for float16, 128 + n for bfloat16), and the bits of that power
_MANTISSA = {float16: (1024, 0x6400), bfloat16: (128, 0x4300)}


def _int_range(e: ir.Expr) -> tuple[int, int] | None:
    """The least and greatest value of an integer expression (a 4-bit field ``(w >> s) & 15``
    less 8, a byte read as int8), or None where it is not evident."""
    if e.dtype.is_float:
        return None
    if e.op == "const":
        return int(e.arg), int(e.arg)
    if e.op == "and":
        for m in e.srcs:
            if m.op == "const" and int(m.arg) >= 0:
                return 0, int(m.arg)
        return None
    if e.op in ("add", "neg"):
        parts = [p for p in (_int_range(x) for x in e.srcs) if p is not None]
        if len(parts) != len(e.srcs):
            return None
        if e.op == "neg":
            return -parts[0][1], -parts[0][0]
        return sum(p[0] for p in parts), sum(p[1] for p in parts)
    if e.op == "cast":
        src = e.srcs[0].dtype
        if e.dtype.itemsize == 1:  # a byte, whatever it was cut from
            return (-128, 127) if e.dtype == int8 else (0, 255)
        if src.is_float or src.itemsize > e.dtype.itemsize:
            return None
        return _int_range(e.srcs[0])
    return None


def _scaled_int(v: ir.Expr, dtype: DType) -> tuple[ir.Expr, ir.Expr, int] | None:
    """(n, scale, least n) where ``v`` is ``dtype(float32(n) * float32(scale))``: a small
    integer ``n`` (a 4-bit or 8-bit weight) times a ``dtype`` scale, rounded to ``dtype``. The
    float32 product of the two is exact, so the product in ``dtype`` arithmetic rounds to the
    same value."""
    if v.op != "cast" or v.dtype != dtype or v.srcs[0].op != "mul" or \
            v.srcs[0].dtype != float32:
        return None
    a, b = v.srcs[0].srcs
    for n, scale in ((a, b), (b, a)):
        if n.op == "cast" and scale.op == "cast" and scale.srcs[0].dtype == dtype:
            span = _int_range(n.srcs[0])
            if span is not None and span[1] - span[0] < _MANTISSA[dtype][0] and \
                    max(-span[0], span[1]) <= _MANTISSA[dtype][0]:
                return n.srcs[0], scale.srcs[0], span[0]
    return None


def _half_bits(value: float, dtype: DType) -> int:
    """The 16 bits of ``value`` in ``dtype`` (float16 or bfloat16, rounded toward zero)."""
    if dtype == float16:
        return int(np.array(value, np.float16).view(np.uint16))
    return int(np.array(value, np.float32).view(np.uint32)) >> 16


def _exact(value: float, dtype: DType) -> bool:
    """Whether ``dtype`` holds ``value`` exactly."""
    if dtype == float16:
        return float(np.float16(value)) == value
    return int(np.array(value, np.float32).view(np.uint32)) & 0xFFFF == 0 and \
        float(np.float32(value)) == value


def _fields(low: ir.Expr, high: ir.Expr, least: int) -> ir.Expr | None:
    """``low - least`` and ``high - least`` in the two halves of one word with one shift and
    one mask, where they are the fields ``(w >> s) & m`` and ``(w >> (s + 16)) & m`` of one
    word (each less ``least``, if that is not 0); else None."""
    def field(n: ir.Expr) -> tuple[ir.Expr, int, int] | None:
        if least:
            if n.op != "add" or not any(x.op == "const" and x.arg == least for x in n.srcs):
                return None
            n = next(x for x in n.srcs if not (x.op == "const" and x.arg == least))
        if n.op != "and" or n.srcs[1].op != "const" or not 0 <= int(n.srcs[1].arg) < 1 << 16:
            return None
        inner, mask = n.srcs[0], int(n.srcs[1].arg)
        if inner.op == "shr" and inner.srcs[1].op == "const":
            return inner.srcs[0], int(inner.srcs[1].arg), mask
        return inner, 0, mask

    a, b = field(low), field(high)
    # (the high field's bits below the word's top: a signed word's shift fills the top with
    # its sign, a uint32's with zeros)
    if a is None or b is None or a[0] is not b[0] or a[2] != b[2] or b[1] != a[1] + 16 or \
            a[0].dtype.itemsize != 4 or b[1] + a[2].bit_length() > 32:
        return None
    word = ir.cast(a[0], uint32)
    if a[1]:
        word = ir.alu("shr", word, ir.const(a[1], uint32))
    return ir.alu("and", word, ir.const(a[2] | a[2] << 16, uint32))


def _pair(low: ir.Expr, high: ir.Expr, dtype: DType) -> ir.Expr:
    """One fragment register holding ``low`` and ``high`` rounded to ``dtype``. Two small
    integers times one scale (a pair of 4-bit weights of a group) are made in 16-bit
    arithmetic, both at once: each integer put in the mantissa of a power of two (float16
    1024 + n), the power less the least integer taken away and the scale multiplied in, pair by
    pair, the same value as the float32 product rounded, in a few instructions instead of a
    conversion, a product and a rounding for each."""
    a, b = _scaled_int(low, dtype), _scaled_int(high, dtype)
    if a is None or b is None or a[1] is not b[1]:
        return ir.pack_halves(low, high, dtype)
    least = min(a[2], b[2])
    top, power = _MANTISSA[dtype]
    offset = float(top - least)
    if not _exact(offset, dtype):
        return ir.pack_halves(low, high, dtype)

    def bits(n: ir.Expr) -> ir.Expr:
        return ir.cast(ir.alu("add", ir.cast(n, int32), ir.const(-least, int32)), uint32)

    both = _fields(a[0], b[0], least)
    if both is None:
        both = ir.alu("or", bits(a[0]), ir.alu("shl", bits(b[0]), ir.const(16, uint32)))
    word = ir.alu("or", both, ir.const(power | power << 16, uint32))
    sub = _half_bits(offset, dtype)
    values = ir.halves2("sub", word, ir.const(sub | sub << 16, uint32), dtype)
    return ir.halves2("mul", values, ir.pack_halves(a[1], a[1], dtype), dtype)


def build(ast: Any, how: RowsPlan, params: list[ir.Param], name: str) -> ir.Kernel:
    """The kernel of ``ast`` as ``plan`` described it (see the module's docstring)."""
    dt = ast.index_dtype
    pairs, dtype, ni, unroll = how.pairs, how.dtype, how.ni, how.unroll
    rows, columns, shared, red_total = how.rows, how.columns, how.shared, how.red_total
    stages = len(pairs)
    outer = [(n, s) for n, s, _ in ast.outer if n != shared]
    width = 8 * ni  # columns per work-group

    def const(v: int) -> ir.Expr:
        return ir.const(v, dt)

    def var(n: str) -> ir.Expr:
        return ir.var(n, dt)

    lid = ir.special("lid")
    body: list[ir.Stmt] = [
        ir.LocalArray("part", float32, WARPS * stages * ni * 128),
        ir.Decl("warp", dt, ir.alu("idiv", lid, const(32))),
        ir.Decl("lane", dt, ir.alu("mod", lid, const(32))),
        ir.Decl("g", dt, ir.alu("idiv", var("lane"), const(4))),
        ir.Decl("t", dt, ir.alu("mod", var("lane"), const(4))),
        ir.Decl("col0", dt, ir.alu("mul", ir.special("gid"), const(width)))]
    # a lane's rows g and g + 8 and its columns (out of range: a valid row or column read, and
    # its results never stored)
    body.append(ir.Decl("r0", dt, var("g") if rows >= 8 else gemm.clamped(var("g"), rows)))
    if rows > 8:
        body.append(ir.Decl("r1", dt, gemm.clamped(ir.alu("add", var("g"), const(8)), rows)))
    for j in range(ni):
        col = ir.alu("add", ir.alu("add", var("col0"), const(8 * j)), var("g"))
        body.append(ir.Decl(f"n{j}", dt, col if columns % width == 0 else
                            gemm.clamped(col, columns)))
    accs = [[[f"c{s}_{j}_{e}" for e in range(4)] for j in range(ni)] for s in range(stages)]
    body += [ir.Decl(a, float32, ir.const(0, float32)) for s in accs for j in s for a in j]
    if rows <= 8:  # the fragment's rows 8 to 15 are never stored: zeros
        body.append(ir.Decl("zero", uint32, ir.const(0, uint32)))

    # the loop's units: ``span`` blocks of 32, in which lane t of each quad takes the run of
    # 8 * span consecutive elements ``kc = unit * 4 + t`` (8 of them for each block's two mmas)
    span = how.span
    units = red_total // (32 * span)
    run = 8 * span
    # the run's elements in the order of the fragments' k-slots: of each four, the first and
    # third share a register, then the second and fourth, where the weights are packed (a
    # 4-bit weight's neighbour two places on sits 16 bits higher in the same word)
    order = [4 * (v // 4) + (0, 2, 1, 3)[v % 4] if span > 1 else v for v in range(run)]
    step: list[ir.Stmt] = []
    for u in range(unroll):
        kc = f"kc{u}"
        unit = ir.alu("add", var("kb"), const(WARPS * u))
        part: list[ir.Stmt] = [ir.Decl(kc, dt, ir.alu("add", ir.alu("mul", unit, const(4)),
                                                      var("t")))]
        axes = [("r0", rows), ("r1", rows)] + [(f"n{j}", columns) for j in range(ni)] + \
            [(kc, red_total // run)]
        elements = [lower._reduce_index(ast, ir.alu("add", ir.alu("mul", var(kc), const(run)),
                                                     const(v))) for v in order]
        xs: dict[int, tuple[list[str], list[str]]] = {}  # the A words of each distinct x
        for s, (x, w) in enumerate(pairs):
            if id(x) not in xs:
                halves = []
                for h, r in enumerate(("r0", "r1")):
                    if r == "r1" and rows <= 8:
                        halves.append(["zero"] * (run // 2))
                        continue
                    rename = {shared: var(r)} if shared is not None else {}
                    values = [ir.substitute(x, {**rename, **env}) for env in elements]
                    stmts, names = _words(values, axes, dtype, f"a{u}_{len(xs)}_{h}_")
                    part += stmts
                    halves.append(names)
                xs[id(x)] = (halves[0], halves[1])
            top, bottom = xs[id(x)]
            for j in range(ni):
                cols = gemm.split(outer, var(f"n{j}"))
                values = [ir.substitute(w, {**cols, **env}) for env in elements]
                stmts, wn = _words(values, axes, dtype, f"b{u}_{s}_{j}_")
                part += stmts
                # each block's elements 8 b .. 8 b + 3, then 8 b + 4 .. 8 b + 7 of the run
                for q in range(0, run // 2, 2):
                    a = [top[q], bottom[q], top[q + 1], bottom[q + 1]]
                    part.append(ir.Mma("m16n8k16", dtype, accs[s][j], a, wn[q:q + 2]))
        if units % (WARPS * unroll):  # the last steps' units past the row are skipped
            part = [ir.If(ir.alu("lt", unit, const(units)), part)]
        step += part
    body.append(ir.For("kb", var("warp"), const(units), const(WARPS * unroll), step))

    # each warp's partial sums to local memory, [warp][stage][fragment][register][lane]
    def slot(w: ir.Expr, s: int, j: ir.Expr, e: ir.Expr, lane: ir.Expr) -> ir.Expr:
        at = ir.alu("mul", ir.alu("add", ir.alu("mul", w, const(stages)), const(s)), const(ni))
        at = ir.alu("mul", ir.alu("add", at, j), const(4))
        return ir.alu("add", ir.alu("mul", ir.alu("add", at, e), const(32)), lane)

    body += [ir.Store("part", slot(var("warp"), s, const(j), const(e), var("lane")),
                      ir.var(accs[s][j][e], float32))
             for s in range(stages) for j in range(ni) for e in range(4)]
    body.append(ir.Barrier())
    # then each output (fragment j, register e of lane l: row l / 4 + 8 (e / 2), column
    # 8j + 2 (l % 4) + e % 2) summed over the warps by one thread, and stored
    outputs = ni * 128
    store: list[ir.Stmt] = [
        ir.Decl("fj", dt, ir.alu("idiv", var("o"), const(128))),
        ir.Decl("fe", dt, ir.alu("mod", ir.alu("idiv", var("o"), const(32)), const(4))),
        ir.Decl("fl", dt, ir.alu("mod", var("o"), const(32))),
        ir.Decl("row", dt, ir.alu("add", ir.alu("idiv", var("fl"), const(4)),
                                  ir.alu("mul", ir.alu("idiv", var("fe"), const(2)), const(8)))),
        ir.Decl("col", dt, ir.alu("add", ir.alu("add", var("col0"),
                                                ir.alu("mul", var("fj"), const(8))),
                                  ir.alu("add", ir.alu("mul", ir.alu("mod", var("fl"), const(4)),
                                                       const(2)),
                                         ir.alu("mod", var("fe"), const(2)))))]
    env: dict[str, ir.Expr] = gemm.split(outer, var("col"))
    if shared is not None:
        env[shared] = var("row")
    for s, stage in enumerate(ast.stages):
        parts = [ir.load("part", float32, slot(const(other), s, var("fj"), var("fe"), var("fl")))
                 for other in range(WARPS)]
        total = parts[0]
        for p in parts[1:]:
            total = ir.alu("add", total, p)
        # in float32, unrounded, as the other lowerings hand their accumulators to the epilogue
        store.append(ir.Decl(f"sum{s}", stage.dtype, total))
        env[f"acc{s}"] = ir.var(f"sum{s}", stage.dtype)
    inside = ir.alu("and", ir.alu("lt", var("row"), const(rows)),
                    ir.alu("lt", var("col"), const(columns)))
    store.append(ir.If(inside, [ir.Store("b0", ir.substitute(ast.out_index, env),
                                         ir.substitute(ast.out_value, env))]))
    threads = WARPS * 32
    body.append(ir.For("o", lid, const(outputs), const(threads), store))
    arrays = [st for st in body if isinstance(st, ir.LocalArray)]
    rest = [st for st in body if not isinstance(st, ir.LocalArray)]
    groups = -(-columns // width)
    return ir.Kernel(name, params, arrays + rest, groups, threads,
                     {"bytes": lower.kernel_bytes(ast),
                      "template": f"tensor-core rows ({rows} rows, {width} columns a group)"})
