"""The tiled GEMM template: a contraction kernel built in the loop IR, so every GPU dialect renders
it (CUDA, HIP, OpenCL C, WGSL).

A kernel whose single stage sums a product ``x * y`` over one reduce variable ``k``, where ``x``
varies with an outer variable ``m`` that ``y`` ignores and ``y`` with an outer variable ``n`` that
``x`` ignores, is a (batched) matrix product; every other outer variable is a batch index. The
lowering already built the loads of ``x`` and ``y`` through their views (transposes, broadcasts,
casts) and the epilogue (the elementwise graph that consumes the sum: bias, activation, residual,
cast), so the template only chooses the loops:

- a work-group computes a ``block_m`` x ``block_n`` tile of one batch entry; each thread a
  ``thread_m`` x ``thread_n`` sub-tile held in registers: rows in groups of 4 neighbours (one
  vector load from local memory each; the loads, not the multiply-adds, bound a SIMT GEMM with
  scalar loads), groups ``4 * rows`` apart, and columns likewise;
- per step of ``block_k``, the group stages the ``x`` and ``y`` tiles in local memory, each
  thread loading a few elements, neighbouring threads along the operand's contiguous axis
  (coalesced), and out-of-range elements reading a clamped address and counting as 0;
- the next step's elements are loaded into registers before the current step is computed
  (``prefetch``), so global latency overlaps the arithmetic;
- the epilogue runs on each accumulator and stores straight to the output.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

from anygpu.codegen import ir
from anygpu.dtype import DType, bfloat16, float16, float32


VEC = 4  # local-memory reads of 4 neighbouring values at once (one instruction where it can)
PAD = 4  # extra elements per local tile row (a multiple of VEC keeps vector reads aligned)


@dataclass(frozen=True)
class GemmOptions:
    """The template's tunable parameters (the tuner varies them; ``choose`` picks defaults)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 8
    thread_m: int = 8
    thread_n: int = 8
    prefetch: bool = True
    min_blocks: int = 2  # work-groups resident per SM that the compiler must leave room for
    slices: int = 1  # groups of threads that each sum a share of every k-step (sliced k)
    # two local tiles of each operand, staged in turn: one barrier a k-step instead of two
    double_buffer: bool = True
    # which way neighbouring threads stage an operand whose elements are neighbours in memory
    # both along k and along its outer side (a 3x3 convolution's windows: along the filter's
    # row and along the image's): "k", or "outer", or "" (x along k, y along n: the default)
    x_along: str = ""
    y_along: str = ""

    @property
    def threads(self) -> int:
        return (self.block_m // self.thread_m) * (self.block_n // self.thread_n) * self.slices

    def describe(self) -> str:
        sliced = f", k in {self.slices} slices" if self.slices > 1 else ""
        along = "".join(f", {name} staged along {way}" for name, way in
                        (("x", self.x_along), ("y", self.y_along)) if way)
        return (f"{self.block_m}x{self.block_n}x{self.block_k} tiles, {self.thread_m}x"
                f"{self.thread_n} per thread{', prefetch' if self.prefetch else ''}{sliced}"
                f"{', double-buffered' if self.double_buffer else ''}, "
                f"{self.min_blocks} groups per SM{along}")

    def local_bytes(self, element: int = 4) -> int:
        """Local memory a work-group uses (``element``: bytes of the accumulator's type)."""
        tiles = self.block_k * (self.block_m + self.block_n + 2 * PAD)
        sums = self.block_m * self.block_n if self.slices > 1 else 0
        return element * (tiles * (2 if self.double_buffer else 1) + sums)


Dims = list[tuple[str, int]]


@dataclass
class Contraction:
    """A kernel recognized as a batched matrix product. Its rows, columns and k may each be
    several of the AST's variables (a convolution's rows are batch, height and width; its k is
    channels and the filter's height and width): the template walks their flattened index and
    splits it back into the variables (an implicit GEMM)."""

    ms: Dims  # outer variables only x depends on, outermost first
    ns: Dims  # outer variables only y depends on
    ks: Dims  # the reduce variables
    batch: Dims  # outer variables both depend on
    x: ir.Expr  # the factor that varies with m and k
    y: ir.Expr  # the factor that varies with k and n
    x_contiguous_k: bool  # whether x's neighbouring elements in memory are along k (else m)
    y_contiguous_n: bool  # whether y's are along n (else k)
    # whether x's (y's) neighbours in memory run along both k and m (n): a window's
    x_both: bool = False
    y_both: bool = False

    @property
    def M(self) -> int:
        return math.prod(s for _, s in self.ms)

    @property
    def N(self) -> int:
        return math.prod(s for _, s in self.ns)

    @property
    def K(self) -> int:
        return math.prod(s for _, s in self.ks)

    @property
    def flops(self) -> int:
        """Floating-point operations of the product: a multiply and an add per term."""
        return 2 * math.prod(s for _, s in self.batch) * self.M * self.N * self.K


def _vars(e: ir.Expr, memo: dict[int, frozenset[str]]) -> frozenset[str]:
    hit = memo.get(id(e))
    if hit is None:
        if e.op == "var":
            hit = frozenset([e.arg])
        else:
            hit = frozenset().union(*(_vars(s, memo) for s in e.srcs)) if e.srcs else frozenset()
        memo[id(e)] = hit
    return hit


def _loads(e: ir.Expr, out: list[ir.Expr], seen: set[int]) -> list[ir.Expr]:
    if id(e) not in seen:
        seen.add(id(e))
        if e.op == "load":
            out.append(e)
        for s in e.srcs:
            _loads(s, out, seen)
    return out


# the operators index expressions are evaluated through
_INT_OPS = {op: ir.INT_FOLDS[op] for op in ("add", "mul", "sub", "idiv", "mod", "lt", "max")}


def loads(e: ir.Expr, seen: set[int] | None = None) -> list[ir.Expr]:
    """The loads in ``e`` (each once; ``seen`` skips those of expressions visited before)."""
    return _loads(e, [], set() if seen is None else seen)


def evaluate(e: ir.Expr, env: dict[str, int]) -> int | None:
    """An integer index expression at a point (variables not in ``env`` at 0), or None if it
    uses anything else."""
    return _evaluate(e, env)


def _evaluate(e: ir.Expr, env: dict[str, int]) -> int | None:
    """An integer index expression at a point, or None if it uses anything else."""
    if e.op == "const":
        return int(e.arg)
    if e.op == "var":
        return env.get(e.arg, 0)
    if e.op == "cast" and not e.dtype.is_float:
        return _evaluate(e.srcs[0], env)
    if e.op == "where":
        c = _evaluate(e.srcs[0], env)
        return None if c is None else _evaluate(e.srcs[1] if c else e.srcs[2], env)
    fn = _INT_OPS.get(e.op)
    if fn is None or len(e.srcs) != 2:
        return None
    a, b = _evaluate(e.srcs[0], env), _evaluate(e.srcs[1], env)
    return None if a is None or b is None else int(fn(a, b))


def stride(e: ir.Expr, var: str) -> int | None:
    """How far the first load of ``e`` moves in memory when ``var`` goes from 0 to 1."""
    loads = _loads(e, [], set())
    if not loads:
        return None
    index = loads[0].srcs[0]
    at0, at1 = _evaluate(index, {}), _evaluate(index, {var: 1})
    return None if at0 is None or at1 is None else abs(at1 - at0)


def narrowed(x: ir.Expr, y: ir.Expr) -> tuple[ir.Expr, ir.Expr]:
    """The factors of a product ``x * y``, 16-bit ones that were widened to float32 (a split
    sum's float32 partials) taken before their casts: their products are exact in float32, as
    the tensor cores' are, which accumulate in float32 too."""
    if x.op == y.op == "cast" and x.dtype == y.dtype == float32 and \
            x.srcs[0].dtype == y.srcs[0].dtype and x.srcs[0].dtype in (float16, bfloat16):
        return x.srcs[0], y.srcs[0]
    return x, y


def match(ast) -> Contraction | None:  # ast: lower.KernelAST (not imported: lower imports us)
    """The contraction in ``ast``, or None if it is not a (batched) matrix product."""
    if len(ast.stages) != 1 or not ast.reduced_output or not ast.reduce:
        return None
    stage = ast.stages[0]
    if stage.op.name != "SUM" or stage.value.op != "mul" or not stage.dtype.is_float:
        return None
    x, y = narrowed(*stage.value.srcs)
    memo: dict[int, frozenset[str]] = {}
    vx, vy = _vars(x, memo), _vars(y, memo)
    ks = [(name, size) for name, size, _ in ast.reduce]
    if any(name not in vx or name not in vy for name, _ in ks):
        return None
    outer = [(name, size) for name, size, _ in ast.outer]
    ms = [d for d in outer if d[0] in vx and d[0] not in vy]
    ns = [d for d in outer if d[0] in vy and d[0] not in vx]
    both = [d for d in outer if d[0] in vx and d[0] in vy]
    if not ms or not ns or len(both) + len(ms) + len(ns) != len(outer):
        return None
    k_inner = ks[-1][0]
    sxk, sxm = stride(x, k_inner), stride(x, ms[-1][0])
    syn, syk = stride(y, ns[-1][0]), stride(y, k_inner)
    return Contraction(ms, ns, ks, both, x, y,
                       x_contiguous_k=sxk == 1 or sxm != 1, y_contiguous_n=syn == 1 or syk != 1,
                       x_both=sxk == 1 and sxm == 1, y_both=syn == 1 and syk == 1)


def oriented(c: Contraction, opts: GemmOptions) -> Contraction:
    """``c`` with its operands staged as ``opts`` says, where an operand runs in memory along
    both of its sides (the ways it does not, it is staged along its neighbours regardless)."""
    x_k = c.x_contiguous_k if not (opts.x_along and c.x_both) else opts.x_along == "k"
    y_n = c.y_contiguous_n if not (opts.y_along and c.y_both) else opts.y_along == "outer"
    return dataclasses.replace(c, x_contiguous_k=x_k, y_contiguous_n=y_n)


# rows or columns at most this many take tiles of 64 along them
NARROW = 64
# the fewest rows (or columns) of a float32 product that the template tiles (below: the generic
# reduction, a matrix-vector product per row)
FEW_ROWS = 16
# tiles per compute unit below which a product's tiles are made smaller
WAVE_TILES = 2


def choose(c: Contraction, max_local: int, units: int = 0) -> GemmOptions | None:
    """Default options for a contraction on a device of ``units`` compute units (SMs; 0 where
    the device does not say), or None where the template does not pay (small products stay
    with the generic reduction)."""
    opts = _tiles_for(c, max_local, units)
    return None if opts is None else buffered(opts)


def buffered(opts: GemmOptions) -> GemmOptions:
    """``opts`` double-buffered or not, as measured on an H200 (each of the five seed CNNs'
    245 fp32 training products and a 4096^3 one timed both ways, `double_buffer` the only
    difference): tiles with 16-element k-steps, and 128 x 128 ones, ran faster double-buffered
    in 109 products and slower in 81; the other tiles with 8-element k-steps (128 x 64,
    64 x 128, 64 x 64) faster in 14 and slower in 42. Either way by a few percent mostly;
    VGG-16's products took 2% less time in all."""
    return dataclasses.replace(opts, double_buffer=opts.block_k >= 16 or
                               (opts.block_m, opts.block_n) == (128, 128))


def _tiles_for(c: Contraction, max_local: int, units: int) -> GemmOptions | None:
    m, n, k = c.M, c.N, c.K
    # outputs of the whole product: a batch of products (Winograd's 16 transformed ones, a
    # split weight gradient's partials) fills the device as one product of as many outputs
    outputs = math.prod(d[1] for d in c.batch) * m * n
    if FEW_ROWS <= min(m, n) < 32 and max(m, n) >= 1 << 16 and k <= THIN_K:
        thin = _thin(c)
        return thin if thin.threads <= max_local else None
    if FEW_ROWS <= min(m, n) < 32 and max(m, n) >= 32 and c.flops >= 1 << 23 and (
            all(ld.dtype == float32 for ld in loads(c.x) + loads(c.y)) or
            not _weights_along_k(c)):
        # a linear layer of a batch of 16 to 31 rows: one tile of 16 rows (a thread 4 x 4 of
        # them) against 64 columns, k in 4 slices, so that each weight is read once; the
        # generic reduction read the weights once per row (AlexNet's first classifier layer,
        # 16 x 9216 x 4096, 3.5 ms on an H200). In 16 bits, where the long side is weights
        # read along k, the tensor cores' rows template (``mma_rows``) reads them instead;
        # elsewhere (VGG-16's first classifier layer's input gradient under bf16 autocast, 16
        # x 25,088 over 4,096, and its first convolution's weight gradient, 64 x 27 over
        # 802,816) these tiles: the generic reduction ran them at 163 and 117 GB/s on an H100,
        # 1.26 and 0.92 ms a step. Where the weights run along k (a layer's forward product),
        # 32-element k-steps and four groups an SM (64 registers a thread on sm_90, no spills)
        # keep more loads in flight: AlexNet's classifier layers at batch 16 on an H200, 105 ->
        # 72 us (16 x 9216 x 4096) and 53 -> 40 (16 x 4096 x 4096), the best of the tuner's
        # 64 configurations each (level 2)
        rows = GemmOptions(block_m=16, block_n=64, block_k=16, thread_m=4, thread_n=4,
                           slices=4) if m < n else \
            GemmOptions(block_m=64, block_n=16, block_k=16, thread_m=4, thread_n=4, slices=4)
        if _weights_along_k(c):
            rows = dataclasses.replace(rows, block_k=32, min_blocks=4)
        return rows if rows.threads <= max_local else None
    if m < 32 or n < 32 or k < 8 or m * n * k < 1 << 18:
        return None
    batched = len(c.batch) > 0
    narrow = min(m, n) <= NARROW
    if not c.x_contiguous_k or narrow and outputs >= 1 << 20 and not batched:
        # a convolution's rows (pixels, contiguous in memory), or a side of 64 or fewer (a
        # convolution of 64 channels): tiles of 64 along it, not half a tile of nothing (on an
        # H200, ResNet-18's 3x3 convolutions of 64 channels at 56 x 56, batch 16: 550-580 us
        # on 128 x 128 tiles, 290-320 on 64-wide ones); with fewer than WAVE_TILES tiles per
        # compute unit, the longer side of the tile halved (down to 64 x 32: the ladder below
        # ran ResNet-50's 1x1 convolutions up to 2.3x slower)
        if outputs < 1 << 20:
            opts = GemmOptions(block_m=64, block_n=64, block_k=16, thread_m=4, thread_n=4)
        else:
            opts = GemmOptions(block_m=128 if m > NARROW else 64,
                               block_n=128 if n > NARROW else 64,
                               thread_m=8 if m > NARROW else 4, thread_n=8 if n > NARROW else 4)
        while units and _tiles(c, opts) < WAVE_TILES * units and \
                opts.block_m * opts.block_n > 2048:
            if opts.block_m >= opts.block_n:
                opts = dataclasses.replace(opts, block_m=opts.block_m // 2,
                                           thread_m=max(opts.thread_m // 2, 4))
            else:
                opts = dataclasses.replace(opts, block_n=opts.block_n // 2,
                                           thread_n=max(opts.thread_n // 2, 4))
            if opts.block_m * opts.block_n <= 2048:
                opts = dataclasses.replace(opts, block_k=16)
        return opts if opts.threads <= max_local else None
    # rows along k (a linear layer's activations). Fewer output tiles: smaller tiles keep more
    # work-groups busy. Below WAVE_TILES tiles per compute unit, the ladder's next tiles, each
    # taken where it makes LADDER_TILES tiles per unit: 128 x 64 with 8 x 8 per thread, then
    # tiles whose k-steps are split between two slices of threads (twice the threads per tile,
    # the slices' sums added through local memory at the end). On an H200, float32, BERT-base's
    # products from the previous ladder (128 x 64, then 64 x 32 with 4 x 4 per thread) to this
    # one: 1024 x 3072 x 768 150 -> 130 us (128 x 64), 1024 x 2304 x 768 150 -> 112 (64 x 64 in
    # two slices), 1024 x 768 x 768 57 -> 47 and 1024 x 768 x 3072 196 -> 160 (64 x 32 in two
    # slices), bounds checks dropped too. Batched products count all their outputs: Winograd's
    # 16 products of 512 x 784 x 512 (VGG-16's 14 x 14 layers, batch 16) ran 1.3-1.5x slower on
    # the 64 x 64 tiles of 4 x 4 a thread that one product of their size takes.
    # A batch of products with a side of 64 or fewer (a split weight gradient of a 64-channel
    # convolution) starts on the ladder's tiles that are 64 wide along that side: on an H200,
    # VGG-16's first one (32 partial products of 64 x 576 x 25088) ran 1.17x faster on 64 x 32
    # tiles in two slices than on 64 x 64 ones of 4 x 4 a thread.
    wide = outputs >= 1 << 20 and narrow and batched
    opts = GemmOptions(64, 64, 16, 4, 4) if outputs < 1 << 20 else GemmOptions()
    if not wide and (not units or _tiles(c, opts) >= WAVE_TILES * units):
        return opts if opts.threads <= max_local else None
    ladder = [o for o in _LADDER if not wide or (o.block_m <= NARROW or m > NARROW) and
              (o.block_n <= NARROW or n > NARROW)]
    if batched and not c.y_contiguous_n:
        # a batch whose operands both run along k (Winograd's weight gradients) skips the
        # ladder's 128 x 64 tiles (8-element runs of k for 64 columns): on an H200 16 products
        # of 512 x 512 over 3,136 ran 1.6 ms on them, 1.5 on 64 x 64 tiles of 4 x 4 a thread,
        # and over 784 0.43, 0.36 and 0.26 on 64 x 64 tiles in two slices; along a long k the
        # ladder stops at those (16 products of 256 x 256 over 12,544 tiles: 1.57x faster than
        # on 64 x 32 ones, even at half a tile per compute unit)
        ladder = [o for o in ladder if o.slices > 1]
        if k >= LONG_K:
            ladder = ladder[:1]
    for smaller in ladder:
        opts = smaller
        if _tiles(c, opts) >= LADDER_TILES * units:
            break
    return opts if opts.threads <= max_local else None


def _weights_along_k(c: Contraction) -> bool:
    """Whether a product of few rows reads a long side of 256 or more whose operand runs along
    k (a linear layer's weights in its forward product): 16-bit ones of these stay with the
    tensor cores' rows template (``mma_rows``, 16 rows or fewer) or the generic reduction that
    shares a work-group's loads among the rows."""
    k = c.ks[-1][0]
    along = stride(c.x, k) == 1 if c.M >= c.N else stride(c.y, k) == 1
    return along and max(c.M, c.N) >= 256


# summed elements up to which a product with a side of FEW_ROWS to 31 and another of 64K or more
# is a transform rather than a layer (Winograd's tiles: 16 x 16 or 16 x 4 constants against
# millions of rows), which ``_thin`` tiles
THIN_K = 32


def _thin(c: Contraction) -> GemmOptions:
    """Tiles for a transform-like product (see THIN_K), as the tuner found them on an H200
    for the Winograd transforms of VGG-16 at batch 16 (each 1.2-1.5x faster than the
    16-row tiles of a linear layer, which read their weights once but store in short runs):
    four summed elements 128 x 64 with 8 x 8 a thread; sixteen, 64 x 64 with 4 x 4 where the
    long side's operand runs along k, else 64 x 32 with 8 x 4 in two slices. The long side
    is always the tile's first."""
    if c.K <= 4:
        opts = GemmOptions(128, 64, 8, 8, 8)
    elif c.x_contiguous_k if c.M >= c.N else not c.y_contiguous_n:
        opts = GemmOptions(64, 64, 16, 4, 4)
    else:
        opts = GemmOptions(64, 32, 16, 8, 4, slices=2)
    if c.M < c.N:
        opts = dataclasses.replace(opts, block_m=opts.block_n, block_n=opts.block_m,
                                   thread_m=opts.thread_n, thread_n=opts.thread_m)
    return opts


# tiles per compute unit that a tile of the ladder below must make to be taken
LADDER_TILES = 2.5
LONG_K = 4096  # summed elements from which a batch's ladder keeps 64 x 64 tiles (see choose)
_LADDER = [GemmOptions(128, 64, 8, 8, 8), GemmOptions(64, 64, 16, 8, 8, min_blocks=1, slices=2),
           GemmOptions(64, 32, 16, 8, 4, slices=2)]


def _all_of(checks: list[ir.Expr]) -> ir.Expr:
    """The conjunction of one or two bounds checks."""
    return checks[0] if len(checks) == 1 else ir.alu("and", *checks)


def _tiles(c: Contraction, opts: GemmOptions) -> int:
    return math.prod(d[1] for d in c.batch) * -(-c.M // opts.block_m) * -(-c.N // opts.block_n)


# (block_m, block_n, block_k, thread_m, thread_n) the tuner tries; the second list at level 2
_SHAPES = [(128, 128, 8, 8, 8), (64, 64, 16, 4, 4), (128, 64, 8, 8, 4), (64, 128, 8, 4, 8),
           (64, 64, 8, 4, 4)]
_MORE_SHAPES = [(128, 128, 16, 8, 8), (64, 64, 32, 4, 4), (128, 64, 16, 8, 4),
                (64, 128, 16, 4, 8), (32, 64, 16, 4, 4), (64, 32, 16, 4, 4)]
# tiles with k-steps in slices beyond the ladder's, at level 2
_MORE_SLICED = [GemmOptions(64, 64, 16, 8, 8, min_blocks=1, slices=4),
                GemmOptions(64, 32, 16, 8, 4, min_blocks=1, slices=4),
                GemmOptions(128, 64, 8, 8, 8, slices=2), GemmOptions(64, 64, 8, 8, 8, slices=2)]


def candidates(c: Contraction, max_local: int, level: int, units: int,
               local_memory: int) -> list[GemmOptions]:
    """The configurations the tuner times for ``c`` (``choose``'s first): tile shapes and
    sliced k-steps, and at level 2 longer k-steps, no prefetch, one local tile of each
    operand (two barriers a step), one group per SM (three for tiles of 256 threads) and
    windows staged the other way too. A product of few rows (a linear layer at a small batch)
    also gets its tile with longer k-steps and four groups an SM, those whose local tiles fit
    in ``local_memory`` bytes."""
    default = choose(c, max_local, units)
    if default is None:
        return []
    out = [default]
    for bm, bn, bk, tm, tn in _SHAPES + (_MORE_SHAPES if level >= 2 else []):
        variants = [GemmOptions(bm, bn, bk, tm, tn)]
        if level >= 2:
            variants += [GemmOptions(bm, bn, bk, tm, tn, min_blocks=1),
                         GemmOptions(bm, bn, bk, tm, tn, prefetch=False),
                         GemmOptions(bm, bn, bk, tm, tn, double_buffer=False)]
            if (bm // tm) * (bn // tn) == 256 and tm * tn <= 32:
                # three groups of 256 threads resident on an SM leave 80 registers a thread
                # (a 128 x 64 tile of 8 x 4 a thread took 95 on sm_90, two groups; in 80 it
                # spills nothing, where 8 x 8 a thread spills)
                variants.append(GemmOptions(bm, bn, bk, tm, tn, min_blocks=3))
        out += [o for o in variants if o not in out and o.threads <= max_local]
    sliced = _LADDER + (_MORE_SLICED if level >= 2 else [])
    out += [o for o in sliced if o not in out and o.threads <= max_local]
    if min(default.block_m, default.block_n) == FEW_ROWS and default.slices > 1:
        # a linear layer of few rows reads its weights once: its k-steps are round trips to
        # memory one after another (AlexNet's first classifier layer at batch 16 on an H200:
        # 16-element steps, 72 registers, 3 groups an SM, the weights read at 1.1 TB/s), so
        # longer steps (more loads in flight a round trip) and more groups an SM
        out += [o for o in (dataclasses.replace(default, block_k=bk, min_blocks=mb)
                            for bk in (16, 32, 64) for mb in (2, 4))
                if o not in out and dataclasses.replace(o, double_buffer=False).local_bytes()
                <= local_memory]  # (to_ir single-buffers a tile whose two copies do not fit)
    if level >= 2 and (c.x_both or c.y_both):
        # a window's operands staged the other way round too: neighbouring threads along the
        # image's row (coalesced reads of 32 pixels) rather than the filter's (runs of 3),
        # their channel and tap then worked out for each element
        x_along, y_along = "outer" if c.x_both else "", "k" if c.y_both else ""
        out += [dataclasses.replace(o, x_along=x_along, y_along=y_along) for o in out[:8]]
    return out


def add(*xs: ir.Expr) -> ir.Expr:
    """The sum of index expressions (the tensor-core templates' index arithmetic)."""
    out = xs[0]
    for x in xs[1:]:
        out = ir.alu("add", out, x)
    return out


def mul(a: ir.Expr, b: int) -> ir.Expr:
    return ir.alu("mul", a, ir.const(b, a.dtype))


def clamped(v: ir.Expr, size: int) -> ir.Expr:
    """``v`` limited to [0, size): staging reads a valid address, then discards the value."""
    top = ir.const(size - 1, v.dtype)
    return ir.alu("where", ir.alu("lt", top, v), top, v)


def row_and_column(lid: ir.Expr, offset: int, width: int) -> tuple[ir.Expr, ir.Expr]:
    """Element ``lid + offset`` of rows ``width`` long: (its row, its column). Where the offset
    is whole rows, the column is the thread's own for every offset, written so that the index
    arithmetic built on it (an implicit convolution's channel and tap: divisions and
    remainders) is shared by all of a thread's elements rather than computed for each."""
    w = ir.const(width, lid.dtype)
    if offset % width == 0:
        return add(ir.alu("idiv", lid, w), ir.const(offset // width, lid.dtype)), \
            ir.alu("mod", lid, w)
    e = add(lid, ir.const(offset, lid.dtype))
    return ir.alu("idiv", e, w), ir.alu("mod", e, w)


def split(dims: Dims, flat: ir.Expr) -> dict[str, ir.Expr]:
    """Each variable of ``dims`` (row-major, outermost first) from their flattened index."""
    env: dict[str, ir.Expr] = {}
    for i, (name, size) in enumerate(reversed(dims)):
        env[name] = flat if i == len(dims) - 1 else ir.alu("mod", flat, ir.const(size, flat.dtype))
        flat = ir.alu("idiv", flat, ir.const(size, flat.dtype))
    return env


def element_env(batch: dict[str, ir.Expr], outer: Dims, outer_value: ir.Expr, ks: Dims,
                k_value: ir.Expr) -> dict[str, ir.Expr]:
    """The variables of an operand's expression at one element of its tile."""
    env = dict(batch)
    env.update(split(outer, outer_value))
    env.update(split(ks, k_value))
    return env


class Tiling:
    """What the GEMM templates share: a work-group computes a ``block_m`` x ``block_n`` tile of
    one batch entry; per step of ``block_k`` its threads stage the operand tiles in local memory
    (through registers, the next step's loaded while the current one is computed), and the
    epilogue stores each accumulator through the kernel's output expression."""

    def __init__(self, ast: Any, c: Contraction, block_m: int, block_n: int, block_k: int,
                 threads: int):
        self.ast, self.c, self.dt = ast, c, ast.index_dtype
        self.BM, self.BN, self.BK, self.threads = block_m, block_n, block_k, threads
        self.acc_dtype = ast.stages[0].dtype
        self.tiles_m, self.tiles_n = -(-c.M // block_m), -(-c.N // block_n)
        self.groups = self.tiles_m * self.tiles_n * math.prod(s for _, s in c.batch)
        self.lid = ir.cast(ir.special("lid"), self.dt)
        self.tm, self.tn = ir.var("tm", self.dt), ir.var("tn", self.dt)
        self.batch_env = {name: ir.var(name, self.dt) for name, _ in c.batch}

    def const(self, v: int) -> ir.Expr:
        return ir.const(v, self.dt)

    def tile_decls(self) -> list[ir.Stmt]:
        """Work-group -> (batch..., tile along m, tile along n); n fastest, so neighbouring
        groups share the x tile."""
        rest = ir.cast(ir.special("gid"), self.dt)
        out: list[ir.Stmt] = []
        for name, size in [("tn", self.tiles_n), ("tm", self.tiles_m)] + self.c.batch[::-1]:
            out.append(ir.Decl(name, self.dt, ir.alu("mod", rest, self.const(size))))
            rest = ir.alu("idiv", rest, self.const(size))
        return out

    def staged(self, value: ir.Expr, outer: Dims, block: int, tile: ir.Expr,
               contiguous_k: bool, k_step: ir.Expr,
               local_index: Callable[[ir.Expr, ir.Expr], ir.Expr]
               ) -> list[tuple[ir.Expr, ir.Expr, ir.Expr]]:
        """(local index, value, element number) for each element this thread stages of one
        operand tile: element e = lid + threads * j, laid out so that neighbouring threads read
        neighbouring addresses of the operand; out-of-range elements read a clamped address and
        count as 0 (checked only along a side that the tiles do not divide)."""
        const, BK, K = self.const, self.BK, self.c.K
        total = BK * block
        size = math.prod(s for _, s in outer)
        out = []
        for j in range(-(-total // self.threads)):
            e = ir.alu("add", self.lid, const(self.threads * j))
            row, along = row_and_column(self.lid, self.threads * j, BK if contiguous_k else block)
            kk, oo = (along, row) if contiguous_k else (row, along)
            o = ir.alu("add", ir.alu("mul", tile, const(block)), oo)
            kg = ir.alu("add", k_step, kk)
            checks = [ir.alu("lt", o, const(size))] if size % block else []
            checks += [ir.alu("lt", kg, const(K))] if K % BK else []
            env = element_env(self.batch_env, outer, clamped(o, size) if size % block else o,
                              self.c.ks, clamped(kg, K) if K % BK else kg)
            v = ir.cast(ir.substitute(value, env), self.acc_dtype)
            if checks:
                v = ir.alu("where", _all_of(checks), v, ir.const(0, self.acc_dtype))
            if total % self.threads:
                v = ir.alu("where", ir.alu("lt", e, const(total)), v, ir.const(0, self.acc_dtype))
            out.append((local_index(kk, oo), v, e))
        return out

    def stage_tile(self, k_step: ir.Expr, x_index: Callable[[ir.Expr, ir.Expr], ir.Expr],
                   y_index: Callable[[ir.Expr, ir.Expr], ir.Expr]
                   ) -> list[tuple[str, ir.Expr, ir.Expr, ir.Expr]]:
        """(local array, index, value, element number) of both operands' tiles at ``k_step``."""
        c = self.c
        parts = [("xs", *t) for t in self.staged(c.x, c.ms, self.BM, self.tm, c.x_contiguous_k,
                                                 k_step, x_index)]
        parts += [("ys", *t) for t in self.staged(c.y, c.ns, self.BN, self.tn,
                                                  not c.y_contiguous_n, k_step, y_index)]
        return parts

    def _store(self, buf: str, index: ir.Expr, value: ir.Expr, e: ir.Expr) -> ir.Stmt:
        size = self.BK * (self.BM if buf == "xs" else self.BN)
        st = ir.Store(buf, index, value)
        return st if size % self.threads == 0 else ir.If(ir.alu("lt", e, self.const(size)), [st])

    def k_loop(self, x_index: Callable[[ir.Expr, ir.Expr], ir.Expr],
               y_index: Callable[[ir.Expr, ir.Expr], ir.Expr], compute: list[ir.Stmt],
               prefetch: bool, double: tuple[int, int] | None = None) -> list[ir.Stmt]:
        """The loop over k: stage, barrier, compute, barrier; with ``prefetch`` the next step's
        elements are loaded into registers p0, p1, ... between the two. ``double`` (the x and
        y tiles' sizes): the local arrays hold two tiles each, a step staging into the one
        the previous step did not read (at offsets ``xo`` and ``yo``, which ``compute`` adds),
        so that one barrier a step is enough: a thread stages into a tile again only after
        the next step's barrier, which every thread reaches once it computed from that tile."""
        const, BK, K, acc = self.const, self.BK, self.c.K, self.acc_dtype
        k0 = ir.var("k0", self.dt)
        offsets: list[ir.Stmt] = []
        if double is not None:
            half = ir.alu("mod", ir.alu("idiv", k0, const(BK)), const(2))
            offsets = [ir.Decl("xo", self.dt, mul(half, double[0])),
                       ir.Decl("yo", self.dt, mul(half, double[1]))]
            xo, yo = ir.var("xo", self.dt), ir.var("yo", self.dt)
            x_index = (lambda f: lambda kk, oo: ir.alu("add", xo, f(kk, oo)))(x_index)
            y_index = (lambda f: lambda kk, oo: ir.alu("add", yo, f(kk, oo)))(y_index)
        before: list[ir.Stmt] = []
        if prefetch:
            first = self.stage_tile(const(0), x_index, y_index)
            regs = [f"p{q}" for q in range(len(first))]
            before = [ir.Decl(r, acc, v) for r, (_, _, v, _) in zip(regs, first)]
            nxt = self.stage_tile(ir.alu("add", k0, const(BK)), x_index, y_index)
            loop = offsets + [self._store(buf, idx, ir.var(r, acc), e)
                              for r, (buf, idx, _, e) in zip(regs, first)]
            loop += [ir.Barrier(), ir.If(ir.alu("lt", ir.alu("add", k0, const(BK)), const(K)),
                                         [ir.Assign(r, v) for r, (_, _, v, _) in zip(regs, nxt)])]
        else:
            loop = offsets + [self._store(buf, idx, v, e)
                              for buf, idx, v, e in self.stage_tile(k0, x_index, y_index)]
            loop.append(ir.Barrier())
        loop += compute if double is not None else compute + [ir.Barrier()]
        steps = -(-K // BK)
        return before + [ir.For("k0", const(0), const(steps * BK), const(BK), loop)]

    def store(self, row: ir.Expr, col: ir.Expr, acc: ir.Expr) -> ir.Stmt:
        """The epilogue at output ``row`` and ``col`` (flattened m and n, inside the group's
        tile): the AST's output expression with acc0 = ``acc``, stored where the element
        exists."""
        env = dict(self.batch_env)
        env.update(split(self.c.ms, row))
        env.update(split(self.c.ns, col))
        env["acc0"] = ir.cast(acc, self.acc_dtype)
        value = ir.substitute(self.ast.out_value, env)
        index = ir.substitute(self.ast.out_index, env)
        checks = [ir.alu("lt", row, self.const(self.c.M))] if self.c.M % self.BM else []
        checks += [ir.alu("lt", col, self.const(self.c.N))] if self.c.N % self.BN else []
        if not checks:  # the tiles divide the output
            return ir.Store("b0", index, value)
        return ir.If(_all_of(checks), [ir.Store("b0", index, value)])

    def kernel(self, name: str, params: list[ir.Param], body: list[ir.Stmt],
               meta: dict) -> ir.Kernel:
        """The kernel, local arrays first (OpenCL and WGSL declare them at the top)."""
        arrays = [s for s in body if isinstance(s, ir.LocalArray)]
        rest = [s for s in body if not isinstance(s, ir.LocalArray)]
        return ir.Kernel(name, params, arrays + rest, self.groups, self.threads, meta)


def _rows_contiguous(ast: Any, c: Contraction) -> bool:
    """Whether the output's elements are consecutive in memory along m rather than along n."""
    at0 = _evaluate(ast.out_index, {})
    along_m = _evaluate(ast.out_index, {c.ms[-1][0]: 1})
    along_n = _evaluate(ast.out_index, {c.ns[-1][0]: 1})
    if at0 is None or along_m is None or along_n is None:
        return False
    return along_m - at0 == 1 and along_n - at0 != 1


def build(ast: Any, c: Contraction, opts: GemmOptions, params: list[ir.Param], name: str,
          meta: dict) -> ir.Kernel:
    """The kernel IR of ``ast`` through the SIMT template."""
    BM, BN, BK, TM, TN = opts.block_m, opts.block_n, opts.block_k, opts.thread_m, opts.thread_n
    S = opts.slices
    if BK % S:
        raise ValueError(f"block_k {BK} is not a multiple of {S} slices")
    c = oriented(c, opts)
    cols, rows = BN // TN, BM // TM  # threads along n and along m
    tiling = Tiling(ast, c, BM, BN, BK, rows * cols * S)
    const, acc_dtype, dt = tiling.const, tiling.acc_dtype, tiling.dt
    # local tiles [k][m] and [k][n], rows padded by PAD so that staging a k-contiguous operand
    # (neighbouring threads at neighbouring k) spreads over the memory banks
    XW, YW = BM + PAD, BN + PAD
    copies = 2 if opts.double_buffer else 1
    body: list[ir.Stmt] = [ir.LocalArray("xs", acc_dtype, copies * BK * XW),
                           ir.LocalArray("ys", acc_dtype, copies * BK * YW)]
    if S > 1:  # the slices' partial sums, added up through local memory after the k loop
        body.append(ir.LocalArray("zs", acc_dtype, BM * BN))
    body += tiling.tile_decls()
    # with slices, thread lid computes k-offsets [slice * BK / S, (slice + 1) * BK / S) of each
    # step for the sub-tile of lid % (rows * cols)
    lid = ir.alu("mod", tiling.lid, const(rows * cols)) if S > 1 else tiling.lid
    if _rows_contiguous(ast, c):
        # an output whose neighbouring rows are neighbours in memory (a convolution's NCHW
        # output: rows are batch, height, width) is stored coalesced by threads that are
        # neighbours along m
        body.append(ir.Decl("ty", dt, ir.alu("mod", lid, const(rows))))
        body.append(ir.Decl("tx", dt, ir.alu("idiv", lid, const(rows))))
    else:
        body.append(ir.Decl("tx", dt, ir.alu("mod", lid, const(cols))))
        body.append(ir.Decl("ty", dt, ir.alu("idiv", lid, const(cols))))
    tx, ty = ir.var("tx", dt), ir.var("ty", dt)
    if S > 1:
        body.append(ir.Decl("ks", dt, ir.alu("idiv", tiling.lid, const(rows * cols))))
        body.append(ir.Decl("kx", dt, ir.alu("mul", ir.var("ks", dt), const(BK // S * XW))))
        body.append(ir.Decl("ky", dt, ir.alu("mul", ir.var("ks", dt), const(BK // S * YW))))
    for i in range(TM):
        for j in range(TN):
            body.append(ir.Decl(f"c{i}_{j}", acc_dtype, ir.const(0, acc_dtype)))

    # a thread's rows: groups of VEC neighbours (read from local memory in one vector load),
    # the groups rows * VEC apart; columns likewise
    vm, vn = (VEC if TM % VEC == 0 else 1), (VEC if TN % VEC == 0 else 1)

    def row_of(i: int) -> ir.Expr:
        return ir.alu("add", ir.alu("mul", ty, const(vm)), const((i // vm) * rows * vm + i % vm))

    def col_of(j: int) -> ir.Expr:
        return ir.alu("add", ir.alu("mul", tx, const(vn)), const((j // vn) * cols * vn + j % vn))

    def at(buf: str, offset: ir.Expr) -> ir.Expr:
        # the step's tile of a double buffer; with slices, this slice's k-offsets
        if opts.double_buffer:
            offset = ir.alu("add", ir.var("xo" if buf == "xs" else "yo", dt), offset)
        if S > 1:
            offset = ir.alu("add", ir.var("kx" if buf == "xs" else "ky", dt), offset)
        return offset

    compute: list[ir.Stmt] = []
    for kk in range(BK // S):
        for g in range(TM // vm):
            base = at("xs", ir.alu("add", const(kk * XW), row_of(g * vm)))
            compute.append(ir.VecLoad([f"x{kk}_{g * vm + r}" for r in range(vm)], acc_dtype,
                                      "xs", base))
        for g in range(TN // vn):
            base = at("ys", ir.alu("add", const(kk * YW), col_of(g * vn)))
            compute.append(ir.VecLoad([f"y{kk}_{g * vn + r}" for r in range(vn)], acc_dtype,
                                      "ys", base))
        for i in range(TM):
            for j in range(TN):
                acc = ir.var(f"c{i}_{j}", acc_dtype)
                prod = ir.alu("mul", ir.var(f"x{kk}_{i}", acc_dtype), ir.var(f"y{kk}_{j}",
                                                                            acc_dtype))
                compute.append(ir.Assign(f"c{i}_{j}", ir.alu("add", acc, prod)))
    body += tiling.k_loop(lambda kk, oo: ir.alu("add", ir.alu("mul", kk, const(XW)), oo),
                          lambda kk, oo: ir.alu("add", ir.alu("mul", kk, const(YW)), oo),
                          compute, opts.prefetch,
                          (BK * XW, BK * YW) if opts.double_buffer else None)
    cells = [(i, j) for i in range(TM) for j in range(TN)]
    if S > 1:
        # slice by slice, the partial sums go through zs to slice 0's threads
        def cell(i: int, j: int) -> ir.Expr:
            return ir.alu("add", ir.alu("mul", row_of(i), const(BN)), col_of(j))

        ks = ir.var("ks", dt)
        for s_ in range(1, S):
            body.append(ir.If(ir.alu("eq", ks, const(s_)),
                              [ir.Store("zs", cell(i, j), ir.var(f"c{i}_{j}", acc_dtype))
                               for i, j in cells]))
            body.append(ir.Barrier())
            body.append(ir.If(ir.alu("eq", ks, const(0)), [
                ir.Assign(f"c{i}_{j}", ir.alu("add", ir.var(f"c{i}_{j}", acc_dtype),
                                              ir.load("zs", acc_dtype, cell(i, j))))
                for i, j in cells]))
            if s_ < S - 1:
                body.append(ir.Barrier())
    row0 = ir.alu("mul", tiling.tm, const(BM))
    col0 = ir.alu("mul", tiling.tn, const(BN))
    stores: list[ir.Stmt] = [
        tiling.store(ir.alu("add", row0, row_of(i)), ir.alu("add", col0, col_of(j)),
                     ir.var(f"c{i}_{j}", acc_dtype)) for i, j in cells]
    body += [ir.If(ir.alu("eq", ir.var("ks", dt), const(0)), stores)] if S > 1 else stores
    meta = dict(meta, template=f"gemm {opts.describe()}", min_blocks=opts.min_blocks)
    return tiling.kernel(name, params, body, meta)


@dataclass
class Operand:
    """A contraction operand read straight from an input buffer: ``param`` (b1, b2, ...), the
    element offset, and the element strides along (batch..., rows, k) or (batch..., k, cols)."""

    param: str
    offset: int
    strides: tuple[int, ...]
    dtype: DType = float32  # as stored: float32, float16 or bfloat16


@dataclass
class HostPlan:
    """A contraction the processor hands to its BLAS: ``x`` (batch..., M, K) @ ``y``
    (batch..., K, N) into a float32 scratch laid out as the kernel's outer dims (``order``, names
    of batch, m and n variables), which the epilogue kernel reads as its last parameter. M, N
    and K may each be several variables (``m``, ``n``, ``k``, outermost first) whose strides
    merge into one (a convolution's rows: batch, height and width of contiguous windows)."""

    x: Operand
    y: Operand
    batch: Dims
    m: Dims
    n: Dims
    k: Dims
    order: list[str]


def linear_operand(e: ir.Expr, axes: Dims, dtype: DType = float32) -> Operand | None:
    """``e`` as a plain (unguarded) load of ``dtype`` whose index is exactly linear in
    ``axes``, else None."""
    if e.op != "load" or len(e.srcs) != 1 or e.dtype != dtype:
        return None
    index = e.srcs[0]
    base = _evaluate(index, {})
    if base is None or base < 0:
        return None
    strides = []
    for name, _ in axes:
        at = _evaluate(index, {name: 1})
        if at is None or at - base < 0:
            return None
        strides.append(at - base)
    # the linear model must hold at the far corner and along each axis's end too
    points = [{name: size - 1 for name, size in axes}] + [{name: size - 1} for name, size in axes]
    for env in points:
        want = base + sum(s * env.get(name, 0) for s, (name, _) in zip(strides, axes))
        if _evaluate(index, env) != want:
            return None
    return Operand(e.arg, base, tuple(strides), dtype)


def _merged(op: Operand | None, groups: list[Dims]) -> Operand | None:
    """``op`` (strides along the variables of ``groups``, in order) with each group's strides
    merged into one, or None where a group's variables do not nest in memory."""
    if op is None:
        return None
    strides, at = [], 0
    for group in groups:
        mine = op.strides[at:at + len(group)]
        at += len(group)
        for (_, inner), outer_stride, inner_stride in zip(group[1:], mine, mine[1:]):
            if outer_stride != inner_stride * inner:
                return None
        strides.append(mine[-1] if group else 0)
    return dataclasses.replace(op, strides=tuple(strides))


def host_plan(ast, c: Contraction) -> HostPlan | None:
    """The contraction as a BLAS call on the processor, where both operands are plain loads
    with linear indices (a transposed or broadcast view is fine; a padded or computed operand
    is not) and the product accumulates in float32: float32 operands as they are, float16 and
    bfloat16 ones widened to float32 first (as PyTorch's processor kernels do)."""
    if ast.stages[0].dtype not in (float32, float16, bfloat16):
        return None
    batch = [[d] for d in c.batch]
    x = _merged(linear_operand(c.x, c.batch + c.ms + c.ks, c.x.dtype), batch + [c.ms, c.ks])
    y = _merged(linear_operand(c.y, c.batch + c.ks + c.ns, c.y.dtype), batch + [c.ks, c.ns])
    if x is None or y is None:
        return None
    return HostPlan(x, y, c.batch, c.ms, c.ns, c.ks, [name for name, _, _ in ast.outer])
