"""Fused op group -> kernel IR.

A kernel iterates over one shape ``S``. Some axes of ``S`` may be reduce axes ``R``; then the
kernel computes one or more reductions over ``R`` in sequence for each outer index (a *stage*
each: softmax has two, max then sum), and writes either one value per outer index (a reduced
output) or the full ``S`` again with the stage results broadcast (softmax's output).

Building a kernel walks the lazy graph down from its root with symbolic indices (``sym.Lin``):
movement ops only transform indices, elementwise ops become expressions, and anything that cannot
be fused (a realized buffer, a reduction of another shape, a ``contiguous``) becomes a load from
an input buffer that the scheduler realizes first. Adjacent axes whose indices always appear as
one flat index are merged, so a contiguous elementwise chain is a flat 1-D loop.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from anygpu.codegen import ir, sym
from anygpu.codegen.render.cstyle import subgroup_reduces
from anygpu.codegen.templates import gemm, mma, wgmma
from anygpu.dtype import (DType, bfloat16, bool_, float16, float32, int32, int64, min_value,
                           uint32, wrap_int)
from anygpu.graph.lazy import Lazy, is_boundary
from anygpu.ops.primitives import ELEMENTWISE, MOVEMENT, REDUCE, Op

Shape = tuple[int, ...]

ALU = {Op.NEG: "neg", Op.EXP2: "exp2", Op.LOG2: "log2", Op.SIN: "sin", Op.SQRT: "sqrt",
       Op.RECIP: "recip", Op.TRUNC: "trunc", Op.NOT: "not", Op.ADD: "add", Op.MUL: "mul",
       Op.DIV: "div", Op.IDIV: "idiv", Op.MOD: "mod", Op.MAX: "max", Op.CMPLT: "lt",
       Op.CMPEQ: "eq", Op.AND: "and", Op.OR: "or", Op.XOR: "xor", Op.SHL: "shl", Op.SHR: "shr",
       Op.WHERE: "where"}
REDUCE_ALU = {Op.SUM: "add", Op.RMAX: "max", Op.PROD: "mul"}


def reduce_identity(op: Op, dtype: DType) -> ir.Expr:
    identity = {Op.SUM: 0, Op.PROD: 1, Op.RMAX: min_value(dtype)}[op]
    return ir.const(identity, dtype)


@dataclass
class KernelSpec:
    """What one kernel computes: ``root`` over the iteration shape ``shape``."""

    root: Lazy
    shape: Shape
    reduce_axes: tuple[int, ...]
    reduced_output: bool
    reduction: Lazy | None = None  # the reduction the kernel's loop computes


def first_reduces(root: Lazy) -> list[Lazy]:
    """Reductions reachable from root through fusable nodes, nearest first (breadth first: the
    reductions of the root's own loop come before those deep inside its inputs)."""
    found: list[Lazy] = []
    seen: set[int] = set()
    queue = deque([root.srcs[0]] if root.op is Op.CONTIGUOUS else [root])
    while queue:
        node = queue.popleft()
        if id(node) in seen or node.realized or (node.keep and node is not root):
            continue
        seen.add(id(node))
        if node.op in REDUCE:
            found.append(node)
        elif node.op in ELEMENTWISE or node.op in MOVEMENT:
            queue.extend(node.srcs)
    return found


def choose_spec(root: Lazy) -> KernelSpec:
    if root.op in REDUCE:
        return KernelSpec(root, root.srcs[0].shape, root.arg, True, root)
    found = first_reduces(root)
    # a reduction that another one here sums over a different shape is stored by a kernel of
    # its own for that one (it cannot be a stage of it): read, not computed again (RMSNorm of
    # ``h + x @ W.T`` computed the product twice, once stored for the sum of squares and once
    # fused into the normalized output)
    stored = {id(inner) for other in found
              for inner in first_reduces(other.srcs[0])
              if inner.srcs[0].shape != other.srcs[0].shape}
    for red in found:
        if id(red) in stored:
            continue
        if red.numel == root.numel:
            return KernelSpec(root, red.srcs[0].shape, red.arg, True, red)
        if red.srcs[0].shape == root.shape:
            return KernelSpec(root, root.shape, red.arg, False, red)
    return KernelSpec(root, root.shape, (), False)


@dataclass
class Stage:
    op: Op
    dtype: DType
    value: ir.Expr


@dataclass
class KernelAST:
    """A kernel before loops are chosen: merged axes, stages and the output expression."""

    dims: list[tuple[str, int, bool]]  # (variable, size, is reduce axis), outer to inner
    stages: list[Stage]
    out_index: ir.Expr
    out_value: ir.Expr
    reduced_output: bool
    output: Lazy
    inputs: list[Lazy]  # buffer b1, b2, ... (b0 is the output)
    index_dtype: DType
    lins: list[sym.Lin] = field(default_factory=list)
    # a kernel that writes chosen rows of its output (``rows_written``) stores an element only
    # where this holds; its out_index is then computed from loaded indices
    guard: ir.Expr | None = None

    @property
    def outer(self) -> list[tuple[str, int, bool]]:
        return [d for d in self.dims if not d[2]]

    @property
    def reduce(self) -> list[tuple[str, int, bool]]:
        return [d for d in self.dims if d[2]]

    def buffer_names(self) -> list[str]:
        return [f"b{i}" for i in range(len(self.inputs) + 1)]


Cond = tuple[sym.Lin, int, int]  # lo <= lin < hi


class _Builder:
    def __init__(self, spec: KernelSpec, groups: list[list[int]], index_dtype: DType,
                 leaves: dict[int, int] | None = None):
        self.spec, self.index_dtype = spec, index_dtype
        # unrealized nodes read as buffers (rows bound as a buffer of their own): id -> the
        # elements before them in that buffer
        self.leaves = leaves or {}
        S, R = spec.shape, set(spec.reduce_axes)
        self.dims: list[tuple[str, int, bool]] = []
        self.axis_lins: list[sym.Lin] = [sym.const(0)] * len(S)
        for k, group in enumerate(groups):
            is_red = group[0] in R
            size = math.prod(S[a] for a in group)
            name = f"{'r' if is_red else 'o'}{k}"
            self.dims.append((name, size, is_red))
            parts = sym.unflatten(sym.var(name, size), tuple(S[a] for a in group))
            for a, lin in zip(group, parts):
                self.axis_lins[a] = lin
        self.keep_shape = tuple(1 if a in R else n for a, n in enumerate(S))
        self.outer_flat = sym.flat_index(
            [sym.const(0) if a in R else lin for a, lin in enumerate(self.axis_lins)],
            self.keep_shape)
        self.inputs: list[Lazy] = []
        self.input_names: dict[int, str] = {}
        self.stages: list[Stage] = []
        self.stage_of: dict[int, ir.Expr] = {}
        self.memo: dict[tuple, ir.Expr] = {}
        self.lins: list[sym.Lin] = []
        # data-dependent indices (GATHER): a variable in the symbolic index, rendered as its data
        self.dynamic: dict[str, ir.Expr] = {}

    # ---- indices ---------------------------------------------------------------------------------
    def lin_expr(self, lin: sym.Lin) -> ir.Expr:
        self.lins.append(lin)
        dt = self.index_dtype
        out = ir.const(lin.const, dt)
        for atom, c in lin.terms:
            if isinstance(atom, sym.Var):
                term = self.dynamic[atom.name] if atom.name in self.dynamic else \
                    ir.var(atom.name, dt)
            elif isinstance(atom, sym.Assumed):
                term = self.lin_expr(atom.a)
            else:
                inner = self.lin_expr(atom.a)
                term = ir.alu("idiv" if isinstance(atom, sym.Div) else "mod", inner,
                              ir.const(atom.b, dt))
            out = ir.alu("add", out, ir.alu("mul", term, ir.const(c, dt)))
        return out

    def cond_expr(self, conds: tuple[Cond, ...]) -> ir.Expr | None:
        out: ir.Expr | None = None
        for lin, lo, hi in conds:
            e = self.lin_expr(lin)
            lo_lin, hi_lin = lin.bounds
            parts = []
            if lo_lin < lo:
                parts.append(ir.alu("lt", ir.const(lo - 1, e.dtype), e))
            if hi_lin >= hi:
                parts.append(ir.alu("lt", e, ir.const(hi, e.dtype)))
            for p in parts:
                out = p if out is None else ir.alu("and", out, p)
        return out

    # ---- values ----------------------------------------------------------------------------------
    def load(self, node: Lazy, idx: list[sym.Lin], conds: tuple[Cond, ...]) -> ir.Expr:
        name = self.load_base(node)
        flat = sym.flat_index(idx, node.shape) + self.leaves.get(id(node), 0)
        guard = self.cond_expr(conds)
        return ir.load(name, node.dtype, self.lin_expr(flat), guard)

    def value(self, node: Lazy, idx: list[sym.Lin], conds: tuple[Cond, ...] = ()) -> ir.Expr:
        key = (id(node), tuple(idx), conds)
        hit = self.memo.get(key)
        if hit is None:
            hit = self.memo[key] = self._value(node, idx, conds)
        return hit

    def _value(self, node: Lazy, idx: list[sym.Lin], conds: tuple[Cond, ...]) -> ir.Expr:
        op = node.op
        if is_boundary(node, self.spec.root) or id(node) in self.leaves:
            return self.load(node, idx, conds)
        if op is Op.CONTIGUOUS:
            return self.value(node.srcs[0], idx, conds)
        if op is Op.CONST:
            return ir.const(node.arg, node.dtype)
        if op is Op.IOTA:
            return ir.cast(self.lin_expr(idx[0]), node.dtype)
        if op is Op.GATHER:
            return self.gather(node, idx, conds)
        if op in ELEMENTWISE:
            srcs = [self.value(s, idx, conds) for s in node.srcs]
            if op is Op.CAST:
                return ir.cast(srcs[0], node.dtype)
            return ir.alu(ALU[op], *srcs)
        if op in REDUCE:
            return self.reduce_value(node, idx, conds)
        return self.movement(node, idx, conds)

    def gather(self, node: Lazy, idx: list[sym.Lin], conds: tuple[Cond, ...]) -> ir.Expr:
        """A read whose index along ``axis`` is data. The index becomes a variable of the
        symbolic index, so the source is read through its views (an embedding table that is a
        view of an optimizer's flat buffer is read in place, not copied)."""
        src, index_node = node.srcs
        axis = node.arg
        dyn = ir.cast(self.value(index_node, idx, conds), self.index_dtype)
        n = src.shape[axis]
        # an out-of-range index reads a clamped element instead of memory outside the buffer
        zero, top = ir.const(0, self.index_dtype), ir.const(n - 1, self.index_dtype)
        dyn = ir.alu("max", dyn, zero)
        dyn = ir.alu("where", ir.alu("lt", top, dyn), top, dyn)
        name = f"g{len(self.dynamic)}"
        self.dynamic[name] = dyn
        src_idx = [sym.var(name, n) if a == axis else i for a, i in enumerate(idx)]
        return self.value(src, src_idx, conds)

    def load_base(self, node: Lazy) -> str:
        key = id(node.buffer) if node.buffer is not None else id(node)
        if key not in self.input_names:
            self.input_names[key] = f"b{len(self.inputs) + 1}"
            self.inputs.append(node)
        return self.input_names[key]

    def reduce_value(self, node: Lazy, idx: list[sym.Lin], conds: tuple[Cond, ...]) -> ir.Expr:
        spec = self.spec
        fusable = (node.srcs[0].shape == spec.shape and node.arg == spec.reduce_axes
                   and sym.flat_index(idx, node.shape) == self.outer_flat)
        if not fusable:
            return self.load(node, idx, conds)
        if id(node) not in self.stage_of:
            value = self.value(node.srcs[0], self.axis_lins)
            name = f"acc{len(self.stages)}"
            self.stages.append(Stage(node.op, node.dtype, value))
            self.stage_of[id(node)] = ir.var(name, node.dtype)
        return self.stage_of[id(node)]

    def movement(self, node: Lazy, idx: list[sym.Lin], conds: tuple[Cond, ...]) -> ir.Expr:
        op, arg, src = node.op, node.arg, node.srcs[0]
        if op is Op.RESHAPE:
            return self.value(src, sym.unflatten(sym.flat_index(idx, node.shape), src.shape), conds)
        if op is Op.PERMUTE:
            inv = [sym.const(0)] * len(idx)
            for i, a in enumerate(arg):
                inv[a] = idx[i]
            return self.value(src, inv, conds)
        if op is Op.EXPAND:
            return self.value(src, [sym.const(0) if s == 1 and n != 1 else i
                                    for i, s, n in zip(idx, src.shape, node.shape)], conds)
        if op is Op.SHRINK:
            return self.value(src, [i + lo for i, (lo, _) in zip(idx, arg)], conds)
        if op is Op.FLIP:
            return self.value(src, [sym.const(n - 1) - i if a in arg else i
                                    for a, (i, n) in enumerate(zip(idx, node.shape))], conds)
        assert op is Op.PAD
        new: list[Cond] = []
        for lin, (lo, _), n in zip(idx, arg, src.shape):
            ilo, ihi = lin.bounds
            if ihi < lo or ilo >= lo + n:
                return ir.const(0, node.dtype)  # entirely in the padding
            if ilo < lo or ihi >= lo + n:
                new.append((lin, lo, lo + n))
        src_idx = [i - lo for i, (lo, _) in zip(idx, arg)]
        if not new:
            return self.value(src, src_idx, conds)
        # under the guard, each index lies in its source's range
        guarded = {id(lin) for lin, _, _ in new}
        src_idx = [sym.assumed(s, n) if id(i) in guarded else s
                   for i, s, n in zip(idx, src_idx, src.shape)]
        inner = self.value(src, src_idx, conds + tuple(new))
        cond = self.cond_expr(tuple(new))
        assert cond is not None
        return ir.alu("where", cond, inner, ir.const(0, node.dtype))

    # ---- the whole kernel ------------------------------------------------------------------------
    def build(self) -> KernelAST:
        spec, root = self.spec, self.spec.root
        if spec.reduced_output:
            out_flat = self.outer_flat
            root_idx = sym.unflatten(out_flat, root.shape)
        else:
            out_flat = sym.flat_index(self.axis_lins, spec.shape)
            root_idx = self.axis_lins
        value = self.value(root, root_idx)
        out_index = self.lin_expr(out_flat)
        return KernelAST(self.dims, self.stages, out_index, value, spec.reduced_output, root,
                         self.inputs, self.index_dtype, self.lins)


def _index_dtype(spec: KernelSpec) -> DType:
    biggest = max([math.prod(spec.shape), spec.root.numel] +
                  [n.numel for n in first_reduces(spec.root)])
    return int32 if biggest < 2**31 - 1 else int64


def _initial_groups(spec: KernelSpec) -> list[list[int]]:
    # size-1 axes need no loop; a size-0 axis keeps one, so an empty output has no iterations
    return [[a] for a, n in enumerate(spec.shape) if n != 1] or [[0]] if spec.shape else []


def build_kernel(spec: KernelSpec, leaves: dict[int, int] | None = None) -> KernelAST:
    """Lower a kernel spec, merging adjacent axes wherever every index keeps them together.
    ``leaves``: unrealized nodes to read as input buffers (views the runtime binds as buffers of
    their own), by id, each with the elements to skip at that buffer's start."""
    dt = _index_dtype(spec)
    groups = _initial_groups(spec)
    best = _Builder(spec, groups, dt, leaves).build()
    R = set(spec.reduce_axes)
    # try to merge each group with the next one (same kind), innermost first. Each trial is
    # lowered again from the root: the indices then simplify along the same path as the final
    # kernel's (a reshape to (4, 6) of a (2, 3, 4) buffer is a flat index only when built so)
    k = len(groups) - 2
    while k >= 0:
        a, b = groups[k], groups[k + 1]
        if (a[0] in R) == (b[0] in R):
            trial = groups[:k] + [a + b] + groups[k + 2:]
            ast = _Builder(spec, trial, dt, leaves).build()
            name, size, _ = ast.dims[k]
            merged = sym.Var(name, size)
            if not any(sym.has_divmod_of(lin, merged) for lin in ast.lins):
                groups, best = trial, ast
        k -= 1
    if dt == int64 and gemm.match(best) is not None and _fits_int32(best):
        # a contraction's iteration space (M * K * N) may pass 2^31 while every index it computes
        # stays below: 32-bit index arithmetic is faster, and some drivers' 64-bit is fragile
        return _Builder(spec, groups, int32, leaves).build()
    return best


def _fits_int32(ast: KernelAST) -> bool:
    limit = 2**31 - 1
    if any(n.numel >= limit for n in [ast.output, *ast.inputs]) or \
            any(d[1] >= limit for d in ast.dims):
        return False
    for lin in ast.lins:
        lo, hi = lin.bounds
        if lo < -limit or hi >= limit or any(abs(c) >= limit for _, c in lin.terms):
            return False
    return True


def write_in_place(ast: KernelAST, k: int) -> KernelAST:
    """The kernel with input ``k`` being its own output: its loads read b0 and the input is
    dropped, so no buffer is bound twice (WebGPU forbids it, C's restrict assumes it)."""
    names = {f"b{i + 1}": f"b{i}" for i in range(k + 1, len(ast.inputs))}
    names[f"b{k + 1}"] = "b0"
    memo: dict[int, ir.Expr] = {}
    stages = [Stage(s.op, s.dtype, ir.rename_buffers(s.value, names, memo)) for s in ast.stages]
    return KernelAST(ast.dims, stages, ir.rename_buffers(ast.out_index, names, memo),
                     ir.rename_buffers(ast.out_value, names, memo), ast.reduced_output,
                     ast.output, ast.inputs[:k] + ast.inputs[k + 1:], ast.index_dtype)


def rows_written(ast: KernelAST, index: Lazy, dim: int, target: Lazy) -> KernelAST:
    """``ast``, an elementwise kernel computing a tensor ``S`` (its out_index the flat
    row-major index into ``S``), made to store into ``target`` instead: the rows of ``S``
    along ``dim`` go to rows ``index[r]`` of ``target`` (``index`` becomes the last input;
    ``target`` has ``S``'s shape but for ``dim``). A negative index counts from the end; one
    outside ``target``'s rows stores nothing."""
    assert not ast.reduce and not ast.stages and ast.guard is None
    shape = ast.output.shape
    dt = ast.index_dtype
    inner = math.prod(shape[dim + 1:])
    rows, total = shape[dim], target.shape[dim]
    flat = ast.out_index
    row = flat if inner == 1 else ir.alu("idiv", flat, ir.const(inner, dt))
    if math.prod(shape[:dim]) > 1:
        row = ir.alu("mod", row, ir.const(rows, dt))
    loaded = ir.cast(ir.load(f"b{len(ast.inputs) + 1}", index.dtype, row), dt)
    picked = ir.alu("where", ir.alu("lt", loaded, ir.const(0, dt)),
                    ir.alu("add", loaded, ir.const(total, dt)), loaded)
    at = picked if inner == 1 else ir.alu("add", ir.alu("mul", picked, ir.const(inner, dt)),
                                          ir.alu("mod", flat, ir.const(inner, dt)))
    if math.prod(shape[:dim]) > 1:
        outer = ir.alu("idiv", flat, ir.const(rows * inner, dt))
        at = ir.alu("add", ir.alu("mul", outer, ir.const(total * inner, dt)), at)
    inside = ir.alu("and", ir.alu("not", ir.alu("lt", picked, ir.const(0, dt))),
                    ir.alu("lt", picked, ir.const(total, dt)))
    return dataclasses.replace(ast, out_index=at, output=target, inputs=[*ast.inputs, index],
                               guard=inside, lins=[])


def kernel_bytes(ast: KernelAST) -> int:
    """The fewest bytes the kernel moves: each input read once and the output written once
    (the elements it stores, where it writes chosen rows)."""
    written = math.prod(d[1] for d in ast.dims) if ast.guard is not None else ast.output.numel
    return sum(n.numel * n.dtype.itemsize for n in ast.inputs) + \
        written * ast.output.dtype.itemsize


# ---- loops ------------------------------------------------------------------------------------
def _decompose(flat: ir.Expr, dims: list[tuple[str, int, bool]]) -> list[ir.Stmt]:
    """Declare each dim's variable from a flat index over ``dims`` (row-major)."""
    out: list[ir.Stmt] = []
    strides = sym.strides_of(tuple(d[1] for d in dims))
    for (name, size, _), st in zip(dims, strides):
        e = flat
        if st != 1:
            e = ir.alu("idiv", e, ir.const(st, flat.dtype))
        if st * size != math.prod(d[1] for d in dims):
            e = ir.alu("mod", e, ir.const(size, flat.dtype))
        out.append(ir.Decl(name, flat.dtype, e))
    return out


def _accumulate(stage: Stage, name: str) -> ir.Stmt:
    return ir.Assign(name, ir.alu(REDUCE_ALU[stage.op], ir.var(name, stage.dtype), stage.value))


TemplateOptions = gemm.GemmOptions | mma.MmaOptions

# the processor's products through BLAS (to_ir): multiply-adds in all, and in each product of a
# batch (schedule._blas_product plans operands by the same rule)
BLAS_MIN_MACS, BLAS_MIN_EACH = 1 << 21, 1 << 16


def template_options(ast: KernelAST, dialect: str, max_local: int, features: dict,
                     level: int) -> list[TemplateOptions]:
    """The configurations of the GEMM templates that may compute ``ast`` on a GPU, the one
    ``to_ir`` picks by itself first; empty where no template applies. ``level`` (the tuner's):
    1 a few tile shapes of the chosen template, 2 a wider search across both templates."""
    contraction = gemm.match(ast) if dialect != "c" else None
    if contraction is None:
        return []
    tensor = mma.candidates(contraction, dialect, features, max_local, level)
    simt = gemm.candidates(contraction, max_local, level, features.get("units", 0),
                           features.get("local_memory", 48 * 1024))
    default = mma.choose(contraction, dialect, features, max_local)
    if default is None:
        # the SIMT template's choice (or none: the product is too small for a template)
        return simt + tensor if simt else []
    pipelined = default.stages > 0
    return tensor + (simt if level >= 2 or not pipelined else [])


def to_ir(ast: KernelAST, dialect: str, max_local: int = 256,
          features: dict | None = None, options: TemplateOptions | None = None) -> ir.Kernel:
    """Choose loops for the kernel on a device: plain loops on cpu, work-groups on GPUs.
    ``features`` describes the device beyond its dialect: "cc" (CUDA compute capability),
    "units" (its compute units: SMs, CUs),
    "tf32" (whether float32 products may use tf32 tensor cores), "max_shared" (the local
    memory a work-group may take, in bytes, where a kernel asks for more than the static
    amount), "local_memory" (the static amount: CUDA's 48 KiB, WebGPU's 16 KiB by default)
    and "subgroup" (absent: none; an int: the lanes of
    a warp, exchanged by shuffles; "varying": subgroup operations of a size the device picks).
    ``options`` (one of ``template_options``) forces a template configuration where the tuner
    found a better one."""
    params = [ir.Param("b0", ast.output.dtype, True)] + \
        [ir.Param(f"b{i + 1}", n.dtype, False) for i, n in enumerate(ast.inputs)]
    outer_total = math.prod(d[1] for d in ast.outer)
    red_total = math.prod(d[1] for d in ast.reduce)
    dt = ast.index_dtype
    sizes = "_".join(str(d[1]) for d in ast.dims) or "1"
    name = ("r_" if ast.reduce else "w_" if ast.guard is not None else "e_") + sizes
    store = ir.Store("b0", ast.out_index, ast.out_value)
    # a kernel writing chosen rows is elementwise: only the plain loops below take it
    stored: ir.Stmt = store if ast.guard is None else ir.If(ast.guard, [store])
    if dialect == "c":
        contraction = gemm.match(ast)
        # below ~2M multiply-adds the compiled kernel beats the BLAS call and its scratch (the
        # demo's small layers trained 10% slower through BLAS); a batch of products counts in
        # all where each has 64K or more (attention's heads: 12 of 128 x 128 x 64 in BERT-base
        # ran as a compiled reduction at 2.5 GFLOP/s)
        if contraction is not None and contraction.flops >= 2 * BLAS_MIN_MACS and \
                contraction.M * contraction.N * contraction.K >= BLAS_MIN_EACH:
            plan = gemm.host_plan(ast, contraction)
            if plan is not None:
                return _host_contraction(ast, plan, params, "gemm_" + sizes, contraction.flops)
        body = hoist_invariants(_cpu_body(ast, stored, outer_total))
        return ir.Kernel(name, params, body, 1, 1, {"bytes": kernel_bytes(ast)})
    contraction = gemm.match(ast)
    features = features or {}
    if contraction is not None:
        mma_opts = mma.choose(contraction, dialect, features, max_local) \
            if options is None else options if isinstance(options, mma.MmaOptions) else None
        if mma_opts is not None:
            build = wgmma.build if mma_opts.wgmma else \
                mma.build_pipelined if mma_opts.stages else mma.build
            return build(ast, contraction, mma_opts, params, "gemm_" + sizes,
                         {"bytes": kernel_bytes(ast), "flops": contraction.flops,
                          "options": mma_opts})
    opts = options if isinstance(options, gemm.GemmOptions) else \
        gemm.choose(contraction, max_local, features.get("units", 0)) \
        if contraction is not None else None
    if contraction is not None and opts is not None:
        if opts.double_buffer and opts.local_bytes() > features.get("local_memory", 48 * 1024):
            opts = dataclasses.replace(opts, double_buffer=False)  # (WebGPU's 16 KiB)
        return gemm.build(ast, contraction, opts, params, "gemm_" + sizes,
                          {"bytes": kernel_bytes(ast), "flops": contraction.flops,
                           "options": opts})
    if not ast.reduce and not ast.stages:  # stages over size-1 axes still need their loops
        tiles = _tiled_transpose(ast, name, params, max_local)
        if tiles is not None:
            return tiles
        runs = _elementwise_runs(ast, name, params, outer_total, max_local, dialect) \
            if dialect in VECTOR_DIALECTS and ast.guard is None else None
        if runs is not None:
            return runs
        local = min(256, max_local)
        per_thread = 4 if outer_total >= (1 << 20) else 1
        # an empty output still launches one group (its threads all fail the bound check):
        # CUDA refuses a launch of no blocks
        groups = max(-(-outer_total // (local * per_thread)), 1)
        base = ir.alu("add", ir.alu("mul", ir.special("gid"), ir.const(local * per_thread, dt)),
                      ir.special("lid"))
        body = []
        for e in range(per_thread):
            flat = ir.alu("add", base, ir.const(e * local, dt))
            inner = _decompose(flat, ast.dims) + [stored]
            body.append(ir.If(ir.alu("lt", flat, ir.const(outer_total, dt)), inner))
        return ir.Kernel(name, params, body, groups, local, {"bytes": kernel_bytes(ast)})
    # many short rows (a pooling window of 9, a small softmax) take a thread each: a work-group
    # per 9-element row ran max pooling at 26 GB/s
    short_rows = red_total <= 32 and outer_total >= 8192
    contiguous = ast.dims[-1][2] or reduce_is_contiguous(ast)
    if contiguous and dialect == "cuda":
        from anygpu.codegen.templates import mma_rows  # (it builds on this module)
        how = mma_rows.plan(ast, _shared_rows(ast, outer_total), dialect, features)
        if how is not None:
            return mma_rows.build(ast, how, params, name)
    if contiguous and _segments_fit(ast, outer_total, red_total, max_local, dialect,
                                    features.get("subgroup")):
        return _segment_per_output(ast, name, params, store, outer_total, red_total, max_local,
                                   dialect, features.get("subgroup"))
    if (contiguous and not short_rows or outer_total < 2048) and outer_total > 0:
        return _group_per_output(ast, name, params, store, outer_total, red_total, max_local,
                                 dialect, features.get("subgroup"))
    splits = 1 if contiguous else _column_splits(ast, outer_total, red_total, max_local)
    if splits > 1:
        return _split_columns(ast, name, params, store, outer_total, red_total, splits)
    return _thread_per_output(ast, name, params, store, outer_total, red_total, max_local)


def _host_contraction(ast: KernelAST, plan: gemm.HostPlan, params: list[ir.Param],
                      name: str, flops: int) -> ir.Kernel:
    """The processor's contraction: the product comes from its BLAS (``meta["host_contraction"]``:
    the runtime computes it into a scratch buffer, the kernel's last parameter, laid out as the
    outer dims), and the kernel is the epilogue alone, reading the product where the sum was."""
    dt = ast.index_dtype
    outer = ast.outer
    flat: ir.Expr = ir.const(0, dt)
    for (var, _, _), stride in zip(outer, sym.strides_of(tuple(d[1] for d in outer))):
        flat = ir.alu("add", flat, ir.alu("mul", ir.var(var, dt), ir.const(stride, dt)))
    scratch = f"b{len(params)}"
    product = ir.cast(ir.load(scratch, float32, flat), ast.stages[0].dtype)
    value = ir.substitute(ast.out_value, {"acc0": product})
    epilogue = dataclasses.replace(ast, dims=list(outer), stages=[], out_value=value)
    store = ir.Store("b0", ast.out_index, value)
    # one thread: OpenMP's threads waiting after the epilogue fought the BLAS threads of the next
    # product (a 256^3 product took 7.6 ms instead of 0.3)
    body = hoist_invariants(_cpu_body(epilogue, store, math.prod(d[1] for d in outer),
                                      threads=False))
    return ir.Kernel(name, params + [ir.Param(scratch, float32, False)], body, 1, 1,
                     {"bytes": kernel_bytes(ast), "flops": flops, "host_contraction": plan})


def _reduce_loop(ast: KernelAST, start: ir.Expr, step: ir.Expr, total: int,
                 body: list[ir.Stmt]) -> ir.Stmt:
    dt = ast.index_dtype
    inner = _decompose(ir.var("ridx", dt), ast.reduce) + body
    return ir.For("ridx", start, ir.const(total, dt), step, inner)


def _nested(dims: list[tuple[str, int, bool]], dt: DType, body: list[ir.Stmt]) -> list[ir.Stmt]:
    """One loop per dimension, innermost last: no division to recover the indices (cpu)."""
    for name, size, _ in reversed(dims):
        body = [ir.For(name, ir.const(0, dt), ir.const(size, dt), ir.const(1, dt), body)]
    return body


def _cpu_columns(ast: KernelAST, work: int) -> list[ir.Stmt] | None:
    """A sum along a slow axis (a column sum, a bias gradient), or along a short contiguous
    one (a convolution's window row of 3): W neighbouring outputs at once, each with its own
    accumulator, so the innermost statements read W neighbouring elements (the compiler makes
    them one vector operation) instead of striding through memory, or running a loop too
    short to vectorize, for each output. None where the kernel is not such a reduction."""
    if len(ast.stages) != 1 or not ast.reduced_output or not ast.outer or not ast.reduce:
        return None
    stage = ast.stages[0]
    name, size, _ = ast.outer[-1]
    inner, inner_size, _ = ast.reduce[-1]
    if gemm.stride(stage.value, name) != 1 or gemm.stride(stage.value, inner) is None or (
            gemm.stride(stage.value, inner) == 1 and inner_size >= 8):
        return None
    width = next((w for w in (16, 8, 4) if size % w == 0 and size >= w), 0)
    if not width:
        return None
    dt = ast.index_dtype
    lanes = [ir.alu("add", ir.var(name, dt), ir.const(j, dt)) for j in range(width)]
    accs = [f"acc0_{j}" for j in range(width)]
    body: list[ir.Stmt] = [ir.Decl(a, stage.dtype, reduce_identity(stage.op, stage.dtype))
                           for a in accs]
    body += _nested(ast.reduce, dt, [
        ir.Assign(a, ir.alu(REDUCE_ALU[stage.op], ir.var(a, stage.dtype),
                            ir.substitute(stage.value, {name: lane})))
        for a, lane in zip(accs, lanes)])
    for a, lane in zip(accs, lanes):
        env = {name: lane, "acc0": ir.var(a, stage.dtype)}
        body.append(ir.Store("b0", ir.substitute(ast.out_index, env),
                             ir.substitute(ast.out_value, env)))
    one = ir.const(1, dt)
    loop: ir.Stmt = ir.For(name, ir.const(0, dt), ir.const(size, dt), ir.const(width, dt), body)
    for other, other_size, _ in reversed(ast.outer[:-1]):
        loop = ir.For(other, ir.const(0, dt), ir.const(other_size, dt), one, [loop])
    assert isinstance(loop, ir.For)
    loop.parallel = work >= 1 << 15
    return [loop]


def _interleaved(ast: KernelAST, k: int) -> list[ir.Stmt] | None:
    """Stage ``k``'s reduction with 8 accumulators over interleaved elements of the contiguous
    innermost reduce axis, so that the innermost statements read 8 neighbours (one vector
    operation; a single accumulator is a chain the compiler may not reorder), combined into
    ``acc{k}`` at the end. None where that axis is not contiguous or 8 does not divide it."""
    if not ast.reduce:
        return None
    stage = ast.stages[k]
    name, size, _ = ast.reduce[-1]
    width = 8
    if size % width or gemm.stride(stage.value, name) != 1 or not stage.dtype.is_float:
        return None
    dt = ast.index_dtype
    accs = [f"acc{k}_{j}" for j in range(width)]
    alu = REDUCE_ALU[stage.op]
    lanes = [ir.alu("add", ir.var(name, dt), ir.const(j, dt)) for j in range(width)]
    step: list[ir.Stmt] = [
        ir.Assign(a, ir.alu(alu, ir.var(a, stage.dtype), ir.substitute(stage.value, {name: lane})))
        for a, lane in zip(accs, lanes)]
    loop: list[ir.Stmt] = [ir.For(name, ir.const(0, dt), ir.const(size, dt), ir.const(width, dt),
                                  step)]
    body: list[ir.Stmt] = [ir.Decl(a, stage.dtype, reduce_identity(stage.op, stage.dtype))
                           for a in accs]
    body += _nested(ast.reduce[:-1], dt, loop)
    total = ir.var(accs[0], stage.dtype)
    for a in accs[1:]:
        total = ir.alu(alu, total, ir.var(a, stage.dtype))
    body.append(ir.Decl(f"acc{k}", stage.dtype, total))
    return body


def _cpu_rows(ast: KernelAST, work: int) -> list[ir.Stmt] | None:
    """A sum or max along the contiguous axis (a row sum) by ``_interleaved``. None where the
    kernel is not such a reduction."""
    if len(ast.stages) != 1 or not ast.reduced_output or not ast.reduce:
        return None
    body = _interleaved(ast, 0)
    if body is None:
        return None
    body.append(ir.Store("b0", ast.out_index, ast.out_value))
    if not ast.outer:
        return body
    out = _nested(ast.outer, ast.index_dtype, body)
    first = out[0]
    assert isinstance(first, ir.For)
    first.parallel = work >= 1 << 15
    return out


def _cpu_body(ast: KernelAST, store: ir.Stmt, outer_total: int,
              threads: bool = True) -> list[ir.Stmt]:
    dt = ast.index_dtype
    red_total = math.prod(d[1] for d in ast.reduce)
    work = outer_total * max(red_total, 1)
    special = (_cpu_columns(ast, work) or _cpu_rows(ast, work)) if threads and outer_total > 1 \
        else None
    if special is not None:
        return special
    inner: list[ir.Stmt] = []
    for k, stage in enumerate(ast.stages):
        acc = f"acc{k}"
        split = _interleaved(ast, k) if threads and outer_total > 1 else None
        if split is not None:  # one of several stages (a normalization's sums, say)
            inner += split
            continue
        inner.append(ir.Decl(acc, stage.dtype, reduce_identity(stage.op, stage.dtype)))
        loops = _nested(ast.reduce, dt, [_accumulate(stage, acc)])
        if outer_total == 1 and len(ast.stages) == 1 and work >= 1 << 15:
            loop = loops[0]
            assert isinstance(loop, ir.For)
            loop.parallel, loop.reduction = True, (REDUCE_ALU[stage.op], acc)
        inner += loops
    if ast.reduce and not ast.reduced_output:
        inner += _nested(ast.reduce, dt, [store])
    else:
        inner.append(store)
    if not ast.outer:
        return inner
    # the outermost loop is split across threads when there is enough work for it
    one = ir.const(1, dt)
    first = ast.outer[0]
    body = _nested(ast.outer[1:], dt, inner)
    outer = ir.For(first[0], ir.const(0, dt), ir.const(first[1], dt), one, body,
                   parallel=threads and work >= 1 << 15)
    return [outer]


# Work a loop computes the same way in every iteration is computed once before it where it
# costs something: a load, or a transcendental or a division (batch norm's per-channel
# 1 / sqrt(var + eps), fused into every element of a convolution's input, ran in the innermost
# loop; the C compiler does not move it out of loops on its own when a select guards its use).
_HOISTED = frozenset({"sqrt", "recip", "div", "exp2", "log2", "sin", "load"})


def hoist_invariants(body: list[ir.Stmt]) -> list[ir.Stmt]:
    """``body`` (the processor's loops) with each loop's invariant costly subexpressions
    declared before the loop. A load moves only from where it runs unconditionally (not from
    a select's branch or an ``If``), so no load runs that did not run before; loops of no
    iterations keep everything inside."""
    counter = [0]
    return _hoist(body, counter)


def _assigned(stmts: list[ir.Stmt], names: set[str]) -> set[str]:
    for st in stmts:
        if isinstance(st, (ir.Decl, ir.Assign)):
            names.add(st.name)
        elif isinstance(st, ir.For):
            names.add(st.name)
            _assigned(st.body, names)
        elif isinstance(st, ir.If):
            _assigned(st.body, names)
    return names


def _free_vars(e: ir.Expr, memo: dict[int, frozenset[str]]) -> frozenset[str]:
    hit = memo.get(id(e))
    if hit is None:
        if e.op == "var":
            hit = frozenset((e.arg,))
        elif e.op == "special":
            hit = frozenset(("<special>",))  # a thread's index: never hoisted
        else:
            hit = frozenset().union(*(_free_vars(s, memo) for s in e.srcs))
        memo[id(e)] = hit
    return hit


def _hoist(stmts: list[ir.Stmt], counter: list[int]) -> list[ir.Stmt]:
    out: list[ir.Stmt] = []
    for st in stmts:
        if isinstance(st, ir.If):
            st.body = _hoist(st.body, counter)
        if isinstance(st, ir.For):
            st.body = _hoist(st.body, counter)
            if st.stop.op == "const" and st.start.op == "const" and st.stop.arg > st.start.arg:
                out += _Hoister(st, counter).decls.values()
        out.append(st)
    return out


class _Hoister:
    """The invariant costly subexpressions of loop ``loop``'s body, replaced there by
    variables and declared (``decls``) for before the loop."""

    def __init__(self, loop: ir.For, counter: list[int]) -> None:
        self.variant = _assigned(loop.body, {loop.name, "<special>"})
        self.counter = counter
        self.free: dict[int, frozenset[str]] = {}
        self.costly: dict[int, bool] = {}
        self.loads: dict[int, bool] = {}
        self.memo: dict[tuple[int, bool], ir.Expr] = {}
        self.decls: dict[int, ir.Decl] = {}
        # loads of what the loop writes (an in-place kernel reads its output) stay in it
        self.written = {st.buf for st in _walk_stmts(loop.body) if isinstance(st, ir.Store)}
        self.reads_written: dict[int, bool] = {}
        loop.body = _rewrite_stmts(loop.body, self.rewrite, False)

    def reads_output(self, e: ir.Expr) -> bool:
        hit = self.reads_written.get(id(e))
        if hit is None:
            hit = self.reads_written[id(e)] = e.op == "load" and e.arg in self.written or any(
                self.reads_output(s) for s in e.srcs)
        return hit

    def is_costly(self, e: ir.Expr) -> bool:
        hit = self.costly.get(id(e))
        if hit is None:
            hit = self.costly[id(e)] = e.op in _HOISTED or any(self.is_costly(s) for s in e.srcs)
        return hit

    def has_load(self, e: ir.Expr) -> bool:
        hit = self.loads.get(id(e))
        if hit is None:
            hit = self.loads[id(e)] = e.op == "load" or any(self.has_load(s) for s in e.srcs)
        return hit

    def rewrite(self, e: ir.Expr, lazy: bool) -> ir.Expr:
        """``e`` with its hoisted parts replaced; ``lazy``: inside a select's branch or an
        ``If``, where loads stay."""
        key = (id(e), lazy)
        hit = self.memo.get(key)
        if hit is not None:
            return hit
        if e.op in ("var", "const", "special", "subgroup_reduce"):
            out = e
        elif not _free_vars(e, self.free) & self.variant and self.is_costly(e) and \
                not (lazy and self.has_load(e)) and not self.reads_output(e):
            decl = self.decls.get(id(e))
            if decl is None:
                self.counter[0] += 1
                decl = self.decls[id(e)] = ir.Decl(f"h{self.counter[0]}", e.dtype, e)
            out = ir.var(decl.name, e.dtype)
        else:
            branches = e.op == "where"
            srcs = tuple(self.rewrite(s, lazy or (branches and i > 0))
                         for i, s in enumerate(e.srcs))
            out = e if all(a is b for a, b in zip(srcs, e.srcs)) else \
                ir.Expr(e.op, e.dtype, srcs, e.arg)
        self.memo[key] = out
        return out


def _walk_stmts(stmts: list[ir.Stmt]) -> list[ir.Stmt]:
    out: list[ir.Stmt] = []
    for st in stmts:
        out.append(st)
        if isinstance(st, (ir.For, ir.If)):
            out += _walk_stmts(st.body)
    return out


def _rewrite_stmts(stmts: list[ir.Stmt], rewrite: Callable[[ir.Expr, bool], ir.Expr],
                   lazy: bool) -> list[ir.Stmt]:
    for st in stmts:
        if isinstance(st, ir.Decl):
            st.init = rewrite(st.init, lazy)
        elif isinstance(st, ir.Assign):
            st.value = rewrite(st.value, lazy)
        elif isinstance(st, ir.Store):
            st.index, st.value = rewrite(st.index, lazy), rewrite(st.value, lazy)
        elif isinstance(st, ir.For):
            st.body = _rewrite_stmts(st.body, rewrite, lazy)
        elif isinstance(st, ir.If):
            st.cond = rewrite(st.cond, lazy)
            st.body = _rewrite_stmts(st.body, rewrite, True)
    return stmts


def _pow2_at_most(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _reduce_index(ast: KernelAST, flat: ir.Expr) -> dict[str, ir.Expr]:
    """Each reduce variable as an expression of the flat reduce index."""
    dims = ast.reduce
    strides = sym.strides_of(tuple(d[1] for d in dims))
    total = math.prod(d[1] for d in dims)
    out = {}
    for (name, size, _), st in zip(dims, strides):
        e = flat if st == 1 else ir.alu("idiv", flat, ir.const(st, flat.dtype))
        if st * size != total:
            e = ir.alu("mod", e, ir.const(size, flat.dtype))
        out[name] = e
    return out


# rows of at most this many elements per thread are held in registers across the stages
MAX_ROW_PER_THREAD = 32


def reduce_is_contiguous(ast: KernelAST) -> bool:
    """Whether most of the bytes a reduction loads lie along its innermost reduce axis in
    memory (neighbouring elements summed together) rather than along its innermost output axis,
    so that a work-group per output reads them in coalesced runs. A matrix-vector product
    ``x @ W.T`` sums each row of ``W``, though its axes put the outputs innermost: with a
    thread per output, a Llama-2-7B decode step read its weights at 56 GB/s on an H200."""
    red = [name for name, _, is_red in ast.dims if is_red]
    out = [name for name, _, is_red in ast.dims if not is_red]
    if not red or not out:
        return False
    sizes = {f"b{i + 1}": n.numel * n.dtype.itemsize for i, n in enumerate(ast.inputs)}
    along = {True: 0, False: 0}  # bytes whose loads run along the reduce axis, the output axis
    seen: set[int] = set()
    for stage in ast.stages:
        for load in gemm.loads(stage.value, seen):
            steps = [_index_step(load.srcs[0], red[-1]), _index_step(load.srcs[0], out[-1])]
            for is_red, step in zip((True, False), steps):
                # within an element per step on average: packed words (a 4-bit weight's
                # index moves once per 8 elements) count as contiguous
                if step is not None and 0 < step <= 1:
                    along[is_red] += sizes.get(load.arg, 0)
                    break
    return along[True] > along[False]


def _index_step(index: ir.Expr, var: str, span: int = 64) -> float | None:
    """How far ``index`` moves per step of ``var``, on average over ``span`` steps. Loads
    within the index that do not read ``var`` (a sequence's slot in a paged cache) count as 0:
    they move nothing along it."""
    table = {id(ld): ir.const(0, ld.dtype) for ld in gemm.loads(index) if var not in _names(ld)}
    if table:
        index = _replace(index, table, {})
    at0, at1 = gemm.evaluate(index, {}), gemm.evaluate(index, {var: span})
    return None if at0 is None or at1 is None else abs(at1 - at0) / span


def _group_per_output(ast: KernelAST, name: str, params: list[ir.Param], store: ir.Store,
                      outer_total: int, red_total: int, max_local: int, dialect: str,
                      subgroup: int | str | None) -> ir.Kernel:
    """One work-group per output row; its threads stride over the row, then combine in local
    memory, or through subgroups where the device has them (``_combine_subgroups``). When each
    thread's share of the row is small and fixed, the row is unrolled: every element is loaded
    once and kept in registers for all the stages (softmax reads its input once instead of
    three times). Rows that read the same large operand (``_shared_rows``: a decode step's
    sequences, each a matrix-vector product with the same weights) share a work-group, each
    element of the operand loaded once for all of them."""
    dt = ast.index_dtype
    local = min(256, _pow2_at_most(max_local), 1 << max(red_total - 1, 1).bit_length())
    lid, step = ir.special("lid"), ir.const(local, dt)
    per_thread = red_total // local if red_total % local == 0 else 0
    unrolled = 0 < per_thread <= MAX_ROW_PER_THREAD
    subs = []
    if unrolled:
        for j in range(per_thread):
            flat = ir.alu("add", ir.const(j * local, dt), lid)
            subs.append(_reduce_index(ast, flat))
    # each accumulator's combine takes an array of ``local`` values, except through a warp's
    # shuffles (an array of a value per warp)
    full_arrays = not isinstance(subgroup, int)
    shared = _shared_rows(ast, outer_total, _row_limit(ast, local, full_arrays))
    rows, outer = _rows_of(ast, shared, dt)
    body: list[ir.Stmt] = _decompose(ir.special("gid"), outer)
    renames: list[dict[str, ir.Expr]] = [dict(row) for row in rows]  # for the store
    for k, stage in enumerate(ast.stages):
        op = REDUCE_ALU[stage.op]
        numbers, values = _row_accumulators(stage, k, rows, renames, body)
        if unrolled:
            for mapping in subs:
                for n, value in zip(numbers, values):
                    accv = ir.var(f"acc{n}", stage.dtype)
                    body.append(ir.Assign(f"acc{n}", ir.alu(op, accv,
                                                            ir.substitute(value, mapping))))
        else:
            body.append(_reduce_loop(ast, lid, step, red_total, [
                ir.Assign(f"acc{n}", ir.alu(op, ir.var(f"acc{n}", stage.dtype), value))
                for n, value in zip(numbers, values)]))
        for n in numbers:
            acc, lmem = f"acc{n}", f"lmem{n}"
            combine = _combine_subgroups(stage, n, local, subgroup) \
                if subgroup and subgroup_reduces(dialect, op, stage.dtype) else None
            if combine is not None:
                body += combine
                continue
            body += _local_combine(acc, lmem, stage.dtype, op, local, lid, ir.const(0, dt), dt)
    if ast.reduced_output:
        stores: list[ir.Stmt] = _row_stores(store, renames) if shared is not None else [store]
        body.append(ir.If(ir.alu("eq", lid, ir.const(0, dt)), stores))
    elif unrolled:
        for mapping in subs:
            body.append(ir.Store("b0", ir.substitute(store.index, mapping),
                                 ir.substitute(store.value, mapping)))
    else:
        body.append(_reduce_loop(ast, lid, step, red_total, [store]))
    # local arrays are declared at the top of the kernel (OpenCL and WGSL need that)
    arrays = [s for s in body if isinstance(s, ir.LocalArray)]
    rest = [s for s in body if not isinstance(s, ir.LocalArray)]
    groups = outer_total // (1 if shared is None else shared[1])
    return ir.Kernel(name, params, arrays + rest, groups, local, {"bytes": kernel_bytes(ast)})


# threads that sum one output's row in _segment_per_output (a warp on NVIDIA's GPUs)
SEGMENT = 32


# a segment's thread loads this many of a row's elements (SEGMENT apart) per step of its loop
# where it reads no vectors (on an H200, unrolling 1 to 16 times changed a 4096 x 4096 product
# by less than 15%: the bytes per load decide, see SEGMENT_VECTOR_BYTES)
SEGMENT_UNROLL = 8
# and at most this many sums per step (the accumulators of every row and stage)
SEGMENT_SUMS = 32


def _segment_unroll(red_total: int, sums: int, most: int = SEGMENT_UNROLL,
                    lanes: int = SEGMENT) -> int:
    """How many of a row's elements (or chunks of elements) each segment thread sums per step
    of its loop: a power of two at most ``most``, SEGMENT_SUMS over ``sums`` (accumulators per
    element), that divides the row (``red_total`` elements or chunks) into whole steps of the
    segment's ``lanes``."""
    unroll = 1
    while (unroll * 2 <= most and unroll * 2 * sums <= SEGMENT_SUMS and
           red_total % (lanes * unroll * 2) == 0):
        unroll *= 2
    return unroll


# bytes of a row's largest operand that a segment's thread reads as one vector (where the
# dialect loads vectors from memory): with one float16 per load, the 4096 x 4096 products of a
# Llama-2-7B decode step read their weights at 1.2 TB/s on an H200
SEGMENT_VECTOR_BYTES = 16
# chunks a segment's thread reads per step of its loop, at most
SEGMENT_VECTOR_UNROLL = 2
# the dtypes read as vectors (their elements 4 to 16 bytes together)
VECTOR_DTYPES = frozenset({float32, float16, bfloat16, int32, uint32})
VECTOR_DIALECTS = frozenset({"cuda", "hip", "opencl"})


# the fewest lanes of a segment (rows of few chunks: 128 float16 elements, one attention
# head's query times a cached key)
MIN_SEGMENT = 4


def _segment_lanes(chunks: int) -> int:
    """The lanes of a segment whose row has ``chunks`` chunks: SEGMENT, halved while each lane
    would get fewer than two chunks and the chunks still divide evenly (a decode step of 16
    sequences read its cached keys at 0.7 TB/s on an H200 with 32 lanes to each 256-byte
    row)."""
    lanes = SEGMENT
    while lanes > MIN_SEGMENT and chunks < 2 * lanes and chunks % (lanes // 2) == 0:
        lanes //= 2
    return lanes


def _lanes_even(chunks: int) -> bool:
    """Whether ``chunks`` spread well over a segment's lanes: evenly, or four or more to each
    lane, the last step of some lanes empty (a 4-bit row of 11008 weights is 344 chunks of 32:
    in chunks of 8 to divide evenly, each lane read 4 bytes of weights per load)."""
    lanes = _segment_lanes(chunks)
    return chunks % lanes == 0 or chunks >= 4 * lanes


def _segment_steps(ast: KernelAST, red_total: int, dialect: str, sums: int
                   ) -> tuple[int, int, int]:
    """How a segment's threads walk their row, where each element adds to ``sums``
    accumulators (the rows' and stages'): chunks of how many neighbouring elements, how many
    chunks per step of each thread's loop, and how many lanes (``_segment_lanes``). A
    chunk spans SEGMENT_VECTOR_BYTES of the largest operand that runs along the row (a weight
    matrix's row; 32 elements of 4-bit weights, one int32 word per 8), so that it is read as
    one vector; chunks of one element where the dialect has no vector loads, or the row does
    not split into such chunks."""
    sizes = {f"b{i + 1}": n.numel * n.dtype.itemsize for i, n in enumerate(ast.inputs)}
    inner = ast.reduce[-1][0]
    values = [stage.value for stage in ast.stages]
    steps = {id(ld): _index_step(ld.srcs[0], inner) or 0 for value in values
             for ld in gemm.loads(value) if ld.dtype in VECTOR_DTYPES and len(ld.srcs) == 1}
    runs = [ld for value in values for ld in gemm.loads(value) if 0 < steps.get(id(ld), 0) <= 1]
    if dialect not in VECTOR_DIALECTS or not runs:
        return 1, _segment_unroll(red_total, sums), SEGMENT
    main = max(runs, key=lambda ld: sizes.get(ld.arg, 0))
    per_index = round(1 / steps[id(main)])  # elements per element read
    width = SEGMENT_VECTOR_BYTES // main.dtype.itemsize * per_index
    while width > per_index and (red_total % width or ast.reduce[-1][1] % width or
                                 not _lanes_even(red_total // width)):
        width //= 2
    # less than a word of it per chunk, or a row that no chunk of a word divides (a partial
    # sum of 262 4-bit weights: chunks of 8 had left its last 6 out)
    if width * main.dtype.itemsize < 4 * per_index or red_total % width or \
            ast.reduce[-1][1] % width:
        return 1, _segment_unroll(red_total, sums), SEGMENT
    lanes = _segment_lanes(red_total // width)
    return width, _segment_unroll(red_total // width, sums * width,
                                  SEGMENT_VECTOR_UNROLL, lanes), lanes


def _vector_reads(copies: list[list[ir.Expr]], axes: list[tuple[str, int]], prefix: str
                  ) -> tuple[list[ir.Stmt], list[list[ir.Expr]]]:
    """Vector loads for a thread's chunk: ``copies[v]`` are the values it sums for the chunk's
    element ``v``. Loads at neighbouring addresses across the elements (each element its own:
    a float16 weight; or every ``k`` elements one: a word of eight 4-bit weights), linear in
    ``axes`` (the output axes, then the chunk) and aligned to the vector, become ``VecLoad``s
    of at most SEGMENT_VECTOR_BYTES, read before the sums; returns them and the copies reading
    their names instead. An index may read memory where that moves it by whole vectors (a
    sequence's slot in a paged cache: ``_without_indirection``)."""
    width = len(copies)
    chunk = axes[-1][0]  # the variable whose step is a chunk
    per_copy = []
    for copy in copies:
        seen: set[int] = set()
        per_copy.append([ld for value in copy for ld in gemm.loads(value, seen)])
    if any(len(found) != len(per_copy[0]) for found in per_copy):
        return [], copies
    reads: list[ir.Stmt] = []
    tables: list[dict[int, ir.Expr]] = [{} for _ in copies]
    for i, first in enumerate(per_copy[0]):
        group = [found[i] for found in per_copy]
        if first.dtype not in VECTOR_DTYPES or any(
                len(ld.srcs) != 1 or ld.arg != first.arg for ld in group):
            continue
        multiple = max(SEGMENT_VECTOR_BYTES // first.dtype.itemsize, 1)
        ops = [op for op in (gemm.linear_operand(_without_indirection(ld, multiple, chunk),
                                                 axes, ld.dtype) for ld in group)
               if op is not None]
        if len(ops) != width or any(op.strides != ops[0].strides for op in ops):
            continue
        low = min(range(width), key=lambda v: ops[v].offset)
        deltas = [op.offset - ops[low].offset for op in ops]
        span = max(deltas) + 1
        # every element of the span read by some element of the chunk (4-bit weights are
        # stored in an order of their own within a group)
        if span < 2 or width % span or set(deltas) != set(range(span)):
            continue
        size = min(span, SEGMENT_VECTOR_BYTES // first.dtype.itemsize)
        if size * first.dtype.itemsize < 4 or span % size or \
                ops[low].offset % size or any(st % size for st in ops[0].strides):
            continue
        names = [f"{prefix}{i}_{j}" for j in range(span)]
        start_index = group[low].srcs[0]
        for start in range(0, span, size):
            reads.append(ir.VecLoad(names[start:start + size], first.dtype, first.arg,
                                    ir.alu("add", start_index,
                                           ir.const(start, start_index.dtype))))
        for table, ld, d in zip(tables, group, deltas):
            table[id(ld)] = ir.var(names[d], first.dtype)
    return reads, [[_replace(value, table, {}) for value in copy]
                   for copy, table in zip(copies, tables)]


def _without_indirection(load: ir.Expr, multiple: int, chunk: str) -> ir.Expr:
    """``load`` with the loads inside its index (a sequence's slot in a paged cache) read as
    0, where each is a factor of a term that a constant multiple of ``multiple`` scales and
    that does not move with the ``chunk`` variable, so that whatever it reads moves a chunk's
    address by whole vectors; else ``load`` as it is (and the index stays nonlinear)."""
    if load.op != "load" or len(load.srcs) != 1:
        return load
    table: dict[int, ir.Expr] = {}
    stack, seen = [load.srcs[0]], set()
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if e.op == "mul" and not e.dtype.is_float:
            a, b = e.srcs
            scaled = b if a.op == "const" else a if b.op == "const" else None
            factor = a if b is scaled else b
            if scaled is not None and factor.op == "const" and factor.arg % multiple == 0 and \
                    gemm.loads(scaled) and chunk not in _names(scaled):
                table[id(scaled)] = ir.const(0, scaled.dtype)
                continue
        if e.op == "load":
            return load  # an address read from memory at no known multiple
        stack.extend(e.srcs)
    if not table:
        return load
    return ir.load(load.arg, load.dtype, _replace(load.srcs[0], table, {}))


def _fold(e: ir.Expr, known: frozenset[str], memo: dict[int, ir.Expr]) -> ir.Expr:
    """``e`` with integer arithmetic on constants folded, and remainders and quotients by a
    constant ``m`` of ``B + k`` simplified where ``B`` is a multiple of ``m`` built from
    variables in ``known`` (all at least 0) and ``k >= 0``: ``(ridx * 32 + 5) % 4`` is 1."""
    hit = memo.get(id(e))
    if hit is not None:
        return hit
    out = e
    if e.srcs and e.op != "subgroup_reduce":
        srcs = [_fold(x, known, memo) for x in e.srcs]
        integral = not e.dtype.is_float and all(not x.dtype.is_float for x in srcs)
        fold = ir.INT_FOLDS.get(e.op)
        if integral and fold is not None and e.op != "cast" and \
                all(x.op == "const" for x in srcs) and not (
                    e.op in ("idiv", "mod") and srcs[1].arg == 0) and not (
                    e.op in ("shl", "shr") and not 0 <= srcs[1].arg < 8 * srcs[0].dtype.itemsize):
            value = int(fold(*(x.arg for x in srcs)))
            out = ir.const(bool(value) if e.dtype == bool_ else wrap_int(value, e.dtype),
                           e.dtype)
        elif e.op in ("idiv", "mod") and integral and srcs[1].op == "const" and srcs[1].arg > 0:
            m = srcs[1].arg
            base, k = _split_const(srcs[0])
            if k >= 0 and _multiple(base, m) and _at_least_zero(base, known):
                out = ir.const(k % m, e.dtype) if e.op == "mod" else \
                    ir.alu("add", _divided(base, m), ir.const(k // m, e.dtype))
            else:
                out = ir.alu(e.op, *srcs)
        elif e.op == "load":
            out = ir.load(e.arg, e.dtype, srcs[0], srcs[1] if len(srcs) > 1 else None)
        elif any(a is not b for a, b in zip(srcs, e.srcs)):
            out = ir.cast(srcs[0], e.dtype) if e.op == "cast" else ir.alu(e.op, *srcs)
    memo[id(e)] = out
    return out


def _split_const(e: ir.Expr) -> tuple[ir.Expr, int]:
    """``e`` as ``B + k`` with ``k`` an integer constant (0 where there is none)."""
    if e.op == "const":
        return ir.const(0, e.dtype), int(e.arg)
    if e.op == "add":
        a, b = e.srcs
        if b.op == "const":
            return a, int(b.arg)
        if a.op == "const":
            return b, int(a.arg)
    return e, 0


def _multiple(e: ir.Expr, m: int) -> bool:
    if e.op == "const":
        return int(e.arg) % m == 0
    if e.op == "mul":
        return any(x.op == "const" and int(x.arg) % m == 0 for x in e.srcs)
    if e.op == "add":
        return all(_multiple(x, m) for x in e.srcs)
    return False


def _divided(e: ir.Expr, m: int) -> ir.Expr:
    """``e / m`` for ``e`` that ``_multiple`` found a multiple of ``m``."""
    if e.op == "const":
        return ir.const(int(e.arg) // m, e.dtype)
    if e.op == "mul":
        a, b = e.srcs
        if b.op == "const" and int(b.arg) % m == 0:
            return ir.alu("mul", a, ir.const(int(b.arg) // m, b.dtype))
        return ir.alu("mul", b, ir.const(int(a.arg) // m, a.dtype))
    return ir.alu("add", _divided(e.srcs[0], m), _divided(e.srcs[1], m))


def _at_least_zero(e: ir.Expr, known: frozenset[str]) -> bool:
    if e.op == "const":
        return int(e.arg) >= 0
    if e.op == "var":
        return e.arg in known
    if e.op in ("add", "mul", "idiv", "mod"):
        return all(_at_least_zero(x, known) for x in e.srcs)
    return False


def _replace(e: ir.Expr, table: dict[int, ir.Expr], memo: dict[int, ir.Expr]) -> ir.Expr:
    """``e`` with the subexpressions in ``table`` (by identity) replaced."""
    hit = table.get(id(e)) or memo.get(id(e))
    if hit is not None:
        return hit
    srcs = tuple(_replace(s, table, memo) for s in e.srcs)
    out = e if all(a is b for a, b in zip(srcs, e.srcs)) else ir.Expr(e.op, e.dtype, srcs, e.arg)
    memo[id(e)] = out
    return out


def _segment_row_limit(ast: KernelAST, local: int, subgroup: int | str | None) -> int:
    """``_row_limit`` for ``_segment_per_output``: its segments combine by shuffles where the
    device has warps of SEGMENT lanes or more, else through an array of ``local`` values."""
    return _row_limit(ast, local, not (isinstance(subgroup, int) and subgroup >= SEGMENT))


def _segments_fit(ast: KernelAST, outer_total: int, red_total: int, max_local: int,
                  dialect: str, subgroup: int | str | None) -> bool:
    """Whether ``_segment_per_output`` computes the kernel: rows of 128 elements or more
    summed into one value each, of outputs enough to fill work-groups of several segments
    evenly, the stages independent of each other."""
    local = min(256, _pow2_at_most(max_local))
    lanes = _segment_steps(ast, red_total, dialect, len(ast.stages))[2]
    per_group = local // lanes
    shared = _shared_rows(ast, outer_total, _segment_row_limit(ast, local, subgroup))
    outputs = outer_total // (shared[1] if shared else 1)
    return (ast.reduced_output and red_total >= 128 and per_group >= 2 and
            outputs % per_group == 0 and outputs >= 64 * per_group and
            not any(_names(stage.value) & {f"acc{k}" for k in range(len(ast.stages))}
                    for stage in ast.stages))


def _segment_per_output(ast: KernelAST, name: str, params: list[ir.Param], store: ir.Store,
                        outer_total: int, red_total: int, max_local: int, dialect: str,
                        subgroup: int | str | None) -> ir.Kernel:
    """Each output's row summed by a segment of neighbouring threads (SEGMENT, fewer for rows
    of few chunks), a work-group
    computing several outputs: a matrix-vector product's weights read in coalesced runs, its
    partial sums combined within the segment alone (by warp shuffles where the device has
    them, else through local memory), no work-group-wide barrier. Rows that read the same
    large operand (``_shared_rows``: a decode step's sequences) are computed together by each
    segment, and the segments of a work-group read the small operand (the activations) at the
    same time, from the cache. A Llama-2-7B decode step on an H200 spent 60% of its time in
    such products with a work-group per output."""
    dt = ast.index_dtype
    local = min(256, _pow2_at_most(max_local))
    lid = ir.special("lid")
    shared = _shared_rows(ast, outer_total, _segment_row_limit(ast, local, subgroup))
    rows, outer = _rows_of(ast, shared, dt)
    width, unroll, lanes = _segment_steps(ast, red_total, dialect, len(ast.stages) * len(rows))
    per_group = local // lanes
    outputs = outer_total // len(rows)
    lane = ir.var("lane", dt)
    body: list[ir.Stmt] = [
        ir.Decl("lane", dt, ir.alu("mod", lid, ir.const(lanes, dt))),
        ir.Decl("oflat", dt, ir.alu("add", ir.alu("mul", ir.special("gid"),
                                                  ir.const(per_group, dt)),
                                    ir.alu("idiv", lid, ir.const(lanes, dt))))]
    body += _decompose(ir.var("oflat", dt), outer)
    renames: list[dict[str, ir.Expr]] = [dict(row) for row in rows]
    # the stages are independent: one loop sums them all, their common terms (a normalized
    # activation) computed once
    sums = [(stage, n, value) for k, stage in enumerate(ast.stages)
            for n, value in zip(*_row_accumulators(stage, k, rows, renames, body))]
    values = [value for _, _, value in sums]
    chunks = red_total // width
    axes = [(name, size) for name, size, _ in outer] + [("ridx", chunks)]
    known = frozenset({"ridx", *(name for name, _ in axes)})  # indices, none negative
    step: list[ir.Stmt] = []
    for u in range(unroll):
        # the thread's chunk: ``width`` neighbouring elements, read as vectors where they can be
        chunk = ir.alu("add", ir.var("ridx", dt), ir.const(u * lanes, dt))
        copies = []
        for v in range(width):
            at = _reduce_index(ast, ir.alu("add", ir.alu("mul", chunk, ir.const(width, dt)),
                                           ir.const(v, dt)))
            memo: dict[int, ir.Expr] = {}  # the stages' common terms stay shared
            copies.append([ir.substitute(value, at, memo) for value in values])
        if width > 1:
            # the chunk's element v is ``chunk * width + v``: fold what that makes constant (a
            # 4-bit weight's shift within its word, the group of its scale)
            folded = []
            for copy in copies:
                fmemo: dict[int, ir.Expr] = {}
                folded.append([_fold(value, known, fmemo) for value in copy])
            copies = folded
            reads, copies = _vector_reads(copies, axes, f"x{u}_")
            step += reads
        for copy in copies:
            step += [ir.Assign(f"acc{n}", ir.alu(REDUCE_ALU[stage.op],
                                                 ir.var(f"acc{n}", stage.dtype), value))
                     for (stage, n, _), value in zip(sums, copy)]
    body.append(ir.For("ridx", lane, ir.const(chunks, dt), ir.const(lanes * unroll, dt),
                       step))
    for stage in ast.stages:
        op = REDUCE_ALU[stage.op]
        numbers = [n for st, n, _ in sums if st is stage]
        shuffles = isinstance(subgroup, int) and subgroup >= SEGMENT and \
            subgroup_reduces(dialect, op, stage.dtype)
        for n in numbers:
            acc, lmem = f"acc{n}", f"lmem{n}"
            accv = ir.var(acc, stage.dtype)
            if shuffles:
                body.append(ir.Assign(acc, ir.subgroup_reduce(op, accv, lanes)))
                continue
            body += _local_combine(acc, lmem, stage.dtype, op, local, lane,
                                   ir.alu("sub", lid, lane), dt, lanes)
    body.append(ir.If(ir.alu("eq", lane, ir.const(0, dt)), _row_stores(store, renames)))
    arrays = [st for st in body if isinstance(st, ir.LocalArray)]
    rest = [st for st in body if not isinstance(st, ir.LocalArray)]
    return ir.Kernel(name, params, arrays + rest, outputs // per_group, local,
                     {"bytes": kernel_bytes(ast)})


def _rows_of(ast: KernelAST, shared: tuple[str, int] | None, dt: DType
             ) -> tuple[list[dict[str, ir.Expr]], list[tuple[str, int, bool]]]:
    """The rows a work-group computes (each a mapping of the shared axis to its index; one
    empty mapping where no rows are shared) and the output axes left to the work-groups."""
    if shared is None:
        return [{}], list(ast.outer)
    return ([{shared[0]: ir.const(i, dt)} for i in range(shared[1])],
            [d for d in ast.outer if d[0] != shared[0]])


def _row_accumulators(stage: Stage, k: int, rows: list[dict[str, ir.Expr]],
                      renames: list[dict[str, ir.Expr]], body: list[ir.Stmt]
                      ) -> tuple[list[int], list[ir.Expr]]:
    """Stage ``k``'s accumulator for each row, numbered ``k * len(rows) + i`` and declared in
    ``body``, and the stage's value for each row; ``renames[i]`` learns that row ``i``'s
    ``acc{k}`` is its accumulator (for the store)."""
    numbers = [k * len(rows) + i for i in range(len(rows))]
    for i, n in enumerate(numbers):
        renames[i][f"acc{k}"] = ir.var(f"acc{n}", stage.dtype)
        body.append(ir.Decl(f"acc{n}", stage.dtype, reduce_identity(stage.op, stage.dtype)))
    return numbers, [ir.substitute(stage.value, row) for row in rows]


def _row_stores(store: ir.Store, renames: list[dict[str, ir.Expr]]) -> list[ir.Stmt]:
    """The kernel's store for each row, its index and value read through the row's names."""
    return [ir.Store("b0", ir.substitute(store.index, r), ir.substitute(store.value, r))
            for r in renames]


# at most this many rows share a work-group's loads of a large operand (each its own
# accumulators and combine)
MAX_SHARED_ROWS = 16
# local memory that the combines of shared rows may take, where each accumulator combines
# through an array of a float per thread (WebGPU guarantees 16 KiB in all)
SHARED_ROWS_LOCAL_BYTES = 8192


def _row_limit(ast: KernelAST, local: int, arrays: bool) -> int:
    """The most rows a work-group of ``local`` threads may share: MAX_SHARED_ROWS, fewer where
    each of its accumulators (a row's, per stage) combines through an array of ``local``
    values (``arrays``), so that they fit SHARED_ROWS_LOCAL_BYTES."""
    if not arrays:
        return MAX_SHARED_ROWS
    per_row = sum(local * stage.dtype.itemsize for stage in ast.stages)
    return min(MAX_SHARED_ROWS, SHARED_ROWS_LOCAL_BYTES // max(per_row, 1))


def _shared_rows(ast: KernelAST, outer_total: int,
                 most: int = MAX_SHARED_ROWS) -> tuple[str, int] | None:
    """An output axis (name, size) whose rows a work-group computes together: of at most
    ``most`` rows, the inputs each row reads alone (those whose loads use the axis) a quarter or
    less of the bytes of those the rows share, and enough work-groups left for the device.
    None where there is none."""
    if not ast.reduced_output:
        return None
    sizes = {f"b{i + 1}": n.numel * n.dtype.itemsize for i, n in enumerate(ast.inputs)}
    loads = [ld for stage in ast.stages for ld in gemm.loads(stage.value)]
    if not loads or any(_names(stage.value) & {f"acc{k}" for k in range(len(ast.stages))}
                        for stage in ast.stages):
        return None  # (a stage reading another's result: softmax's sum of exp(x - max))
    for name, size, _ in ast.outer:
        if not 2 <= size <= most or outer_total // size < 256:
            continue
        # the inputs each row reads on its own must be small beside those the rows share
        own = {ld.arg for ld in loads if name in _names(ld.srcs[0])}
        mine = sum(sizes.get(b, 0) for b in own)
        shared = sum(sizes.get(b, 0) for b in {ld.arg for ld in loads} - own)
        if shared >= 4 * mine:
            return name, size
    return None


def _names(e: ir.Expr) -> frozenset[str]:
    """The variables ``e`` reads."""
    found: set[str] = set()
    stack, seen = [e], set()
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if x.op == "var":
            found.add(x.arg)
        stack.extend(x.srcs)
    return frozenset(found)


def _local_combine(acc: str, lmem: str, dtype: DType, op: str, local: int, lane: ir.Expr,
                   first: ir.Expr, dt: DType, width: int | None = None,
                   stride: int = 1) -> list[ir.Stmt]:
    """Statements that leave in ``acc`` the combination of the ``acc`` of each run of
    ``width`` threads ``stride`` apart (aligned; the whole work-group where None), through the
    local array ``lmem``: halving steps of the threads whose ``lane`` (position in the run) is
    in the lower half, then each thread reads its run's first slot, ``first`` (``dt``: the
    index type)."""
    lid = ir.special("lid")
    out: list[ir.Stmt] = [ir.LocalArray(lmem, dtype, local),
                          ir.Store(lmem, lid, ir.var(acc, dtype)), ir.Barrier()]
    s = (width or local) // 2
    while s > 0:
        partner = ir.load(lmem, dtype, ir.alu("add", lid, ir.const(s * stride, dt)))
        mine = ir.load(lmem, dtype, lid)
        out += [ir.If(ir.alu("lt", lane, ir.const(s, dt)),
                      [ir.Store(lmem, lid, ir.alu(op, mine, partner))]), ir.Barrier()]
        s //= 2
    return out + [ir.Assign(acc, ir.load(lmem, dtype, first)), ir.Barrier()]


def _combine_subgroups(stage: Stage, k: int, local: int,
                       subgroup: int | str) -> list[ir.Stmt] | None:
    """Statements that leave in every thread's ``acc{k}`` the combination of all the work-group's
    ``acc{k}``, through subgroups: each subgroup combines its lanes, its first lane writes the
    result to local memory, and after one barrier every subgroup combines those partial results
    (each computes the same total, so no second barrier hands it round). ``subgroup``: the
    lanes of a warp (an int: CUDA, HIP), or "varying": a size the device picks, which may be
    any (OpenCL, WebGPU). None where a warp is too narrow to combine the warps' results."""
    acc, lmem = f"acc{k}", f"lmem{k}"
    accv = ir.var(acc, stage.dtype)
    op = REDUCE_ALU[stage.op]
    lid = ir.special("lid")
    if isinstance(subgroup, int):
        if local <= subgroup:  # one warp (partly filled when local is smaller)
            return [ir.Assign(acc, ir.subgroup_reduce(op, accv, local))]
        warps = local // subgroup
        if warps > subgroup:
            return None
        lane = ir.alu("and", lid, subgroup - 1)
        warp = ir.alu("shr", lid, subgroup.bit_length() - 1)
        # lane i of every warp reads warp i % warps's result: width-``warps`` groups hold them all
        partial = ir.load(lmem, stage.dtype, ir.alu("and", lid, warps - 1))
        return [ir.LocalArray(lmem, stage.dtype, warps),
                ir.Assign(acc, ir.subgroup_reduce(op, accv, subgroup)),
                ir.If(ir.alu("eq", lane, 0), [ir.Store(lmem, warp, accv)]),
                ir.Barrier(),
                ir.Assign(acc, ir.subgroup_reduce(op, partial, warps))]
    lane, group, count, size = (ir.special(n) for n in ir.SUBGROUP_SPECIALS)
    part = f"part{k}"
    partv = ir.var(part, stage.dtype)
    gather = ir.Assign(part, ir.alu(op, partv, ir.load(lmem, stage.dtype, ir.var("sgi", int32))))
    return [ir.LocalArray(lmem, stage.dtype, local),  # subgroups may be of any size
            ir.Assign(acc, ir.subgroup_reduce(op, accv)),
            ir.If(ir.alu("eq", lane, 0), [ir.Store(lmem, group, accv)]),
            ir.Barrier(),
            ir.Decl(part, stage.dtype, reduce_identity(stage.op, stage.dtype)),
            ir.For("sgi", lane, count, size, [gather]),
            ir.Assign(acc, ir.subgroup_reduce(op, partv))]


# neighbouring outputs that a work-group of _split_columns computes (a warp's coalesced run)
SPLIT_COLUMNS = 32
# threads enough to keep a GPU's memory busy: _split_columns splits rows until there are (a
# decode step of 16 sequences read its value cache at 460 GB/s on an H200 with a thread per
# output, 65536 of them)
SPLIT_THREADS = 1 << 20
# threads sharing an output's sum, at most
SPLIT_MOST = 16
# elements each thread of _split_columns sums at the least
SPLIT_MIN_ELEMENTS = 16


def _column_splits(ast: KernelAST, outer_total: int, red_total: int, max_local: int) -> int:
    """How many threads share each output's sum in ``_split_columns``: 1 (a thread per output)
    where the outputs alone give threads enough, the rows are short, or the outputs do not
    fill whole runs of SPLIT_COLUMNS."""
    if not ast.reduced_output or outer_total % SPLIT_COLUMNS or \
            not 0 < outer_total < SPLIT_THREADS:
        return 1
    most = min(_pow2_at_most(min(max_local, 1024)) // SPLIT_COLUMNS, SPLIT_MOST,
               SPLIT_THREADS // outer_total, red_total // SPLIT_MIN_ELEMENTS)
    return _pow2_at_most(most) if most >= 2 else 1


def _split_columns(ast: KernelAST, name: str, params: list[ir.Param], store: ir.Store,
                   outer_total: int, red_total: int, splits: int) -> ir.Kernel:
    """Few outputs, each a sum along a strided axis (attention's weighted sum of the cached
    values at decode, a bias's gradient): a work-group computes SPLIT_COLUMNS neighbouring
    outputs, ``splits`` threads each, every thread summing every ``splits``-th element of its
    output's row (a warp reads a coalesced run of the neighbouring outputs' elements), the
    partial sums combined in local memory. A thread per output read a Llama-2-7B decode step's
    value cache at 200 GB/s on an H200."""
    dt = ast.index_dtype
    cols = SPLIT_COLUMNS
    local = cols * splits
    lid = ir.special("lid")
    col = ir.alu("mod", lid, ir.const(cols, dt))
    part = ir.var("part", dt)
    body: list[ir.Stmt] = [
        ir.Decl("part", dt, ir.alu("idiv", lid, ir.const(cols, dt))),
        ir.Decl("oidx", dt, ir.alu("add", ir.alu("mul", ir.special("gid"), ir.const(cols, dt)),
                                   col))]
    body += _decompose(ir.var("oidx", dt), ast.outer)
    for k, stage in enumerate(ast.stages):
        acc, lmem = f"acc{k}", f"lmem{k}"
        op = REDUCE_ALU[stage.op]
        body.append(ir.Decl(acc, stage.dtype, reduce_identity(stage.op, stage.dtype)))
        body.append(_reduce_loop(ast, part, ir.const(splits, dt), red_total,
                                 [_accumulate(stage, acc)]))
        # every thread reads its output's total (a later stage may use it)
        body += _local_combine(acc, lmem, stage.dtype, op, local, part, col, dt, splits, cols)
    body.append(ir.If(ir.alu("eq", part, ir.const(0, dt)), [store]))
    arrays = [st for st in body if isinstance(st, ir.LocalArray)]
    rest = [st for st in body if not isinstance(st, ir.LocalArray)]
    return ir.Kernel(name, params, arrays + rest, outer_total // cols, local,
                     {"bytes": kernel_bytes(ast)})


# elements of an elementwise kernel from which each thread computes a run of neighbours along its
# innermost axis (``_elementwise_runs``)
RUNS_MIN = 1 << 16


def _run_shape(dims: list[tuple[str, int, bool]], itemsize: int, across: bool
               ) -> tuple[int, int] | None:
    """(elements of a run, trailing axes it spans) for ``_elementwise_runs``: 16 bytes of the
    innermost axis, else 8 or 4 where it is no multiple; else (``across``) 16 bytes over the
    fewest trailing axes whose elements are a multiple (a convolution's windows with the
    channels and the 3x3 offsets inner: 576 to a pixel). None where no run of 4 bytes or more
    fits."""
    full = SEGMENT_VECTOR_BYTES // itemsize
    width = full
    while width >= 2 and width * itemsize >= 4:
        if dims[-1][1] % width == 0:
            return width, 1
        width //= 2
    size = 1
    for j in range(1, len(dims) + 1 if across else 1):
        size *= dims[-j][1]
        if full >= 2 and size % full == 0:
            return full, j
    return None


def _elementwise_runs(ast: KernelAST, name: str, params: list[ir.Param], outer_total: int,
                      max_local: int, dialect: str) -> ir.Kernel | None:
    """Each thread computes a run of 16 bytes of the output (``_run_shape``): the index is split
    into the outer axes once a run, not once an element, inputs read at neighbouring aligned
    addresses come in one vector load, and the run is stored as one. A 16-bit convolution's
    unfolded windows (six axes, a bounds check for the padding) had spent more time splitting
    indices than moving memory: 800 GB/s on an H200 with a thread an element (5.6 TB/s of
    windows read with runs). Through NVIDIA's OpenCL compiler, runs of 16-bit elements and runs
    across axes took 1.1-1.6x the time (float32 windows with the pixels inner 0.8x, other
    float32 kernels 0.7-1.0x): there, only runs of 32-bit elements within the innermost axis.
    None where the output's elements do not come in runs."""
    dtype = ast.output.dtype
    shape = _run_shape(ast.dims, dtype.itemsize, dialect == "cuda") \
        if dtype in VECTOR_DTYPES and outer_total >= RUNS_MIN and (
            dialect == "cuda" or dtype.itemsize == 4) else None
    if shape is None:
        return None
    # the runs are stored at the flat index over the axes, which the output's index must be
    # (``_Builder.build`` writes outputs in their axes' row-major order)
    dims_only = [(d[0], d[1]) for d in ast.dims]
    written = gemm.linear_operand(ir.load("b0", dtype, ast.out_index), dims_only, dtype)
    if written is None or written.offset != 0 or \
            written.strides != sym.strides_of(tuple(d[1] for d in ast.dims)):
        return None
    width, spanned = shape
    dt = ast.index_dtype
    local = min(256, max_local)
    inside = ast.dims[-spanned:]
    size = math.prod(d[1] for d in inside)
    dims = ast.dims[:-spanned] + [("orun", size // width, False)]
    flat = ir.alu("add", ir.alu("mul", ir.special("gid"), ir.const(local, dt)),
                  ir.special("lid"))
    body: list[ir.Stmt] = [ir.Decl("oidx", dt, flat)]
    body += _decompose(ir.var("oidx", dt), dims)
    known = frozenset(d[0] for d in dims)
    start = ir.alu("mul", ir.var("orun", dt), ir.const(width, dt))
    copies = []
    for e in range(width):
        at = ir.alu("add", start, ir.const(e, dt))
        element = {st.name: st.init for st in _decompose(at, inside)  # type: ignore[union-attr]
                   } if spanned > 1 else {inside[0][0]: at}
        copies.append([_fold(ir.substitute(ast.out_value, element, {}), known, {})])
    if spanned == 1:  # (across axes, an element's index divides: no linear reads to find)
        reads, copies = _vector_reads(copies, [(d[0], d[1]) for d in dims], "x")
        body += reads
    body.append(ir.VecStore("b0", dtype, ir.alu("mul", ir.var("oidx", dt), ir.const(width, dt)),
                            [copy[0] for copy in copies]))
    total = outer_total // width
    return ir.Kernel(name, params, [ir.If(ir.alu("lt", flat, ir.const(total, dt)), body)],
                     -(-total // local), local, {"bytes": kernel_bytes(ast)})


TILE = 32  # a transposing copy's tile: 32 x 32 elements, 256 threads of 4 each
TRANSPOSE_MIN = 128  # elements of the output's last axis from which its copy goes by tiles


def _tiled_transpose(ast: KernelAST, name: str, params: list[ir.Param], max_local: int
                     ) -> ir.Kernel | None:
    """An elementwise kernel whose output runs along its last axis while its inputs run along
    another (a padded NCHW input written channels-last for the tensor cores' convolutions),
    through tiles of 32 x 32 in local memory: the work-group reads a tile with the threads
    along the inputs' axis and writes it with the threads along the output's, both in
    neighbouring addresses. A thread per element (or per run of 16 bytes) read elements a
    whole plane apart: VGG-16's channels-last copies of 256 and 512 channels ran at 740-830
    GB/s on an H100, those of 64 channels at 2.4 TB/s. None where the kernel is not such a
    copy: the output's last axis under TRANSPOSE_MIN elements, or no axis along which every
    input steps by one element or not at all while one of them steps by a tile or more
    along the last axis."""
    dims, dtype = ast.dims, ast.output.dtype
    if ast.guard is not None or len(dims) < 2 or dims[-1][1] < TRANSPOSE_MIN or \
            max_local < TILE * TILE // 4 or dtype not in (float16, bfloat16, float32):
        return None
    loads = gemm.loads(ast.out_value)
    last = dims[-1][0]
    across = None
    for axis in range(len(dims) - 2, -1, -1):
        var, size = dims[axis][0], dims[axis][1]
        if size < TILE // 2:
            continue
        steps = [(_index_step(ld.srcs[0], var, min(size, 64)),
                  _index_step(ld.srcs[0], last, 64)) for ld in loads]
        if all(a in (0, 1) for a, _ in steps) and \
                any(a == 1 and b is not None and b >= TILE for a, b in steps):
            across = axis
            break
    if across is None:
        return None
    dims_only = [(d[0], d[1]) for d in dims]
    written = gemm.linear_operand(ir.load("b0", dtype, ast.out_index), dims_only, dtype)
    if written is None or written.offset != 0 or \
            written.strides != sym.strides_of(tuple(d[1] for d in dims)):
        return None
    dt = ast.index_dtype

    def const(v: int) -> ir.Expr:
        return ir.const(v, dt)

    rows = TILE // 4  # thread rows: each thread moves 4 elements a phase
    (a_var, a_size), (l_var, l_size) = dims_only[across], dims_only[-1]
    others = [d for i, d in enumerate(dims) if i not in (across, len(dims) - 1)]
    grid = others + [("ta", -(-a_size // TILE), False), ("tl", -(-l_size // TILE), False)]
    lid = ir.special("lid")
    tx, ty = ir.var("tx", dt), ir.var("ty", dt)
    body: list[ir.Stmt] = [ir.LocalArray("tile", dtype, TILE * (TILE + 1)),
                           ir.Decl("tx", dt, ir.alu("mod", lid, const(TILE))),
                           ir.Decl("ty", dt, ir.alu("idiv", lid, const(TILE)))]
    body += _decompose(ir.special("gid"), grid)
    a0, l0 = (ir.alu("mul", ir.var(v, dt), const(TILE)) for v in ("ta", "tl"))

    def element(a: ir.Expr, c: ir.Expr) -> tuple[dict[str, ir.Expr], ir.Expr]:
        inside = ir.alu("and", ir.alu("lt", a, const(a_size)), ir.alu("lt", c, const(l_size)))
        return {a_var: a, l_var: c}, inside

    for r in range(4):  # read: the threads along the inputs' axis
        row = ir.alu("add", ty, const(r * rows))
        env, inside = element(ir.alu("add", a0, tx), ir.alu("add", l0, row))
        at = ir.alu("add", ir.alu("mul", row, const(TILE + 1)), tx)
        body.append(ir.If(inside, [ir.Store("tile", at, ir.substitute(ast.out_value, env))]))
    body.append(ir.Barrier())
    for r in range(4):  # write: the threads along the output's last axis
        row = ir.alu("add", ty, const(r * rows))
        env, inside = element(ir.alu("add", a0, row), ir.alu("add", l0, tx))
        value = ir.load("tile", dtype, ir.alu("add", ir.alu("mul", tx, const(TILE + 1)), row))
        body.append(ir.If(inside, [ir.Store("b0", ir.substitute(ast.out_index, env), value)]))
    groups = math.prod(d[1] for d in grid)
    return ir.Kernel(name, params, body, groups, TILE * rows, {"bytes": kernel_bytes(ast),
                                                              "template": "tiled transpose"})


def _thread_per_output(ast: KernelAST, name: str, params: list[ir.Param], store: ir.Store,
                       outer_total: int, red_total: int, max_local: int) -> ir.Kernel:
    """One thread per output; neighbouring threads read neighbouring addresses each step."""
    dt = ast.index_dtype
    local = min(256, max_local)
    one = ir.const(1, dt)
    flat = ir.alu("add", ir.alu("mul", ir.special("gid"), ir.const(local, dt)), ir.special("lid"))
    inner: list[ir.Stmt] = [ir.Decl("oidx", dt, flat)]
    inner += _decompose(ir.var("oidx", dt), ast.outer)
    for k, stage in enumerate(ast.stages):
        acc = f"acc{k}"
        inner.append(ir.Decl(acc, stage.dtype, reduce_identity(stage.op, stage.dtype)))
        inner.append(_reduce_loop(ast, ir.const(0, dt), one, red_total, [_accumulate(stage, acc)]))
    if ast.reduced_output:
        inner.append(store)
    else:
        inner.append(_reduce_loop(ast, ir.const(0, dt), one, red_total, [store]))
    body: list[ir.Stmt] = [ir.If(ir.alu("lt", flat, ir.const(outer_total, dt)), inner)]
    return ir.Kernel(name, params, body, max(-(-outer_total // local), 1), local,
                     {"bytes": kernel_bytes(ast)})


__all__ = ["KernelSpec", "KernelAST", "choose_spec", "build_kernel", "to_ir", "write_in_place",
           "rows_written"]
