"""Partition a lazy graph into kernels and transfers, and run them.

``schedule`` walks from the nodes to realize down to realized buffers. Each kernel is built by
``codegen.lower``, which fuses everything it can and names the nodes it needs as inputs; those are
scheduled first. ``run`` lowers each kernel for its device, renders, compiles (cached), allocates
the output from the device's caching allocator and launches without waiting, dropping each
item once it ran (its inputs are freed as soon as nothing else reads them). ``plans`` keeps
whole schedules by graph structure.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import sys
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import numpy as np

from anygpu import config, tune
from anygpu.codegen import ir, lower
from anygpu.codegen.templates import gemm
from anygpu.codegen.render.cstyle import render
from anygpu.codegen.render.wgsl import launch_groups
from anygpu.dtype import DType, bfloat16, float16, float32
from anygpu.dtype import int32 as dt_int32
from anygpu.graph import check, disk, plans
from anygpu.graph.lazy import (Lazy, contiguous_run, is_boundary, is_view_of_buffer,
                               pending_readers)
from anygpu.ops.linalg import get_float32_matmul_precision
from anygpu.ops.primitives import ELEMENTWISE, MOVEMENT, REDUCE, Op
from anygpu.runtime.base import Buffer, Device, Program
from anygpu.runtime.registry import get_device

if TYPE_CHECKING:
    from anygpu.profile.record import Recorder


@dataclass
class KernelItem:
    ast: lower.KernelAST
    signature: tuple = ()
    fused: list[Lazy] = dataclasses.field(default_factory=list)  # nodes it computes unstored
    sid: int | None = None  # the signature's number (``signature_id``), once looked up

    @property
    def output(self) -> Lazy:
        return self.ast.output


@dataclass
class CopyItem:
    output: Lazy  # a COPY node; its source is realized on another device


Item = KernelItem | CopyItem


def schedule(outputs: Sequence[Lazy], plan_order: Sequence[Lazy] | None = None) -> list[Item]:
    """The kernels and copies that realize ``outputs``, dependencies first: planned once per
    graph structure (``plans``), then replayed for every graph of that structure. With
    ``plan_order`` (the same nodes in another order) the kernels are planned in that order and
    run in the order of ``outputs``: which values a kernel stores for others, or computes
    again, depends on the order it is planned in (see ``_run_order``)."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20000))
    try:
        if recording is not None:  # jit records once (and reads rows otherwise, see row_slice)
            return _plan_items(outputs, plan_order)
        at = {id(n): i for i, n in enumerate(outputs)}
        order = None if plan_order is None else tuple(at[id(n)] for n in plan_order)
        walk = plans.walk(outputs, (config.get(), get_float32_matmul_precision(), order))
        plan = plans.find(walk)
        if plan is not None:
            return [CopyItem(out) if step.ast is None else
                    KernelItem(_with_nodes(step.ast, out, inputs), step.signature, fused,
                               _item_id(step))
                    for step, out, inputs, fused in plans.replay(plan, walk)]
        items = _plan_items(outputs, plan_order)
        plans.store(walk, [(item.output, [], [], None, ()) if isinstance(item, CopyItem) else
                           (item.output, item.ast.inputs, item.fused, _template(item.ast),
                            item.signature) for item in items])
        return items
    finally:
        sys.setrecursionlimit(limit)


def _plan_items(outputs: Sequence[Lazy], plan_order: Sequence[Lazy] | None = None
                ) -> list[Item]:
    items: list[Item] = []
    planned: set[int] = set()
    _store_product_epilogues(outputs)
    for out in plan_order if plan_order is not None else outputs:
        _visit(out, items, planned)
    return _sink_weight_work(items if plan_order is None else _run_order(items, outputs))


def _producers_of(items: list[Item]) -> Callable[[Lazy], list[Item]]:
    """For ``items``: a function from a node to the items whose outputs it is, or views (a row
    slice read as a buffer)."""
    producer = {id(item.output): item for item in items}

    def producers(node: Lazy) -> list[Item]:
        found, stack, seen = [], [node], set()
        while stack:
            n = stack.pop()
            if id(n) in seen:
                continue
            seen.add(id(n))
            item = producer.get(id(n))
            if item is not None:
                found.append(item)
            elif not n.realized:
                stack.extend(n.srcs)
        return found

    return producers


def _reads(item: Item) -> list[Lazy]:
    return [item.output.srcs[0]] if isinstance(item, CopyItem) else item.ast.inputs


def _sink_weight_work(items: list[Item]) -> list[Item]:
    """``items`` with each kernel that reads only memory realized before the schedule (work on
    weights: a convolution's Winograd-transformed filters) moved to just before the first
    kernel that reads it. Planned depth first from the output, such kernels came first, each
    output then held from the step's start to its layer (VGG-16's inference at 64 x 64, batch
    2, under jit: 107 MiB of transformed filters alive at once beside activations of 2 MiB).
    Nothing a schedule runs writes memory realized before it (in-place updates are schedules of
    their own), so such a kernel reads the same values wherever it runs."""
    producers = _producers_of(items)
    first_reader: dict[int, int] = {}
    leaves: list[Item] = []
    for i, item in enumerate(items):
        deps = [dep for node in _reads(item) for dep in producers(node)]
        if isinstance(item, KernelItem) and not deps:
            leaves.append(item)
        for dep in deps:
            first_reader.setdefault(id(dep), i)
    before: dict[int, list[Item]] = {}  # a reader's index -> the leaves moved in front of it
    for item in leaves:
        if id(item) in first_reader:
            before.setdefault(first_reader[id(item)], []).append(item)
    if not before:
        return items
    moved = {id(item) for group in before.values() for item in group}
    return [item for i, reader in enumerate(items)
            for item in before.get(i, []) + ([] if id(reader) in moved else [reader])]


def _run_order(items: list[Item], outputs: Sequence[Lazy]) -> list[Item]:
    """``items`` reordered so that each of ``outputs`` in turn runs as soon as what it reads
    has, dependencies still first. backward plans the leaves' gradients in the order its pass
    reaches them and runs them nearest the output first (each layer's weight gradient right
    after its output gradient, which then dies): planned nearest first, a bias's gradient sum
    was planned before the product that stores the output gradient it sums, fused that
    gradient's computation and computed it again (the demo's step on the processor, 3.8 ->
    12.9 ms)."""
    producers = _producers_of(items)
    emitted: set[int] = set()
    ordered: list[Item] = []

    def emit(item: Item) -> None:
        if id(item) in emitted:
            return
        emitted.add(id(item))
        for node in _reads(item):
            for dep in producers(node):
                emit(dep)
        ordered.append(item)

    for out in outputs:
        for item in producers(out):
            emit(item)
    for item in items:
        emit(item)
    return ordered


def _visit(node: Lazy, items: list[Item], planned: set[int]) -> None:
    if node.realized or id(node) in planned:
        return
    rows = row_slice(node)
    if rows is not None:  # read as a buffer of its own: what it cuts from comes first
        _visit(rows[0], items, planned)
        return
    planned.add(id(node))
    if node.op is Op.COPY:
        _visit(node.srcs[0], items, planned)
        items.append(CopyItem(node))
        return
    _split_reduction(node)
    spec = _plan_kernel(node)
    if _split_epilogue_sum(node, spec):
        spec = _plan_kernel(node)
    signature, walk, leaves = _signature(node, spec)
    if _keep_product_operands(node, walk, spec.reduction) | _store_broadcast_work(node, walk) | \
            _store_shared_product(node, walk, spec.reduction) | \
            _store_shared_work(node, walk, spec.reduction):
        spec = _plan_kernel(node)
        signature, walk, leaves = _signature(node, spec)
    while _cut_nested_conditions(node, walk):
        spec = _plan_kernel(node)
        signature, walk, leaves = _signature(node, spec)
    cached = _ast_cache.get(signature)
    if cached is None:
        cached = disk.load("ast", signature)
        if cached is None:
            ast = lower.build_kernel(spec, leaves)
            position = {id(n): i for i, n in enumerate(walk)}
            # the template keeps no graph nodes alive: they are filled in from each new walk
            cached = (_template(ast), [position[id(n)] for n in ast.inputs])
            disk.save("ast", signature, cached)
        _ast_cache[signature] = cached
        if len(_ast_cache) > 4096:
            _ast_cache.pop(next(iter(_ast_cache)))
    template, positions = cached
    ast = _with_nodes(template, node, [walk[i] for i in positions])
    # 8 buffers every device binds (WebGPU's guaranteed minimum): only then ask the device
    if len(ast.inputs) >= 8 and len(ast.inputs) + 1 > get_device(node.device).max_kernel_buffers:
        _cut_to_buffer_limit(node, ast.inputs, get_device(node.device).max_kernel_buffers)
        planned.discard(id(node))
        _visit(node, items, planned)
        return
    read = {id(n) for n in ast.inputs}
    inner = [n for n in walk if n is not node and id(n) not in read and not n.realized]
    ahead = [n for n in inner if id(n) in planned and not n.keep]
    if ahead:
        # planned as a kernel of its own already (another output of the same schedule: batch
        # norm's mean, realized with its variance, whose kernel reads it): read it, without
        # planning what it reads first (the mean's sum had been split and computed once more)
        _plan_again(node, ahead, items, planned)
        return
    stored = {id(n) for n in inner if n.keep}
    for dep in ast.inputs:
        _visit(dep, items, planned)
    again = [n for n in inner if id(n) not in stored and (n.keep or id(n) in planned)]
    if again:
        # what this kernel computes is stored by a kernel of its own, planned (or marked to be)
        # while what this one reads was: a convolution's output, which the next layer's
        # unfolded windows read stored, fused here into the backward pass's ReLU mask. Planned
        # again, this kernel reads it rather than computing the convolution once more
        _plan_again(node, again, items, planned)
        return
    items.append(KernelItem(ast, signature, walk))


def _plan_again(node: Lazy, stored: list[Lazy], items: list[Item], planned: set[int]) -> None:
    """Plan the kernel computing ``node`` again, reading the nodes ``stored`` (marked
    ``keep``) rather than computing them."""
    for n in stored:
        n.keep = True
    planned.discard(id(node))
    _visit(node, items, planned)


def _plan_kernel(node: Lazy) -> lower.KernelSpec:
    """The spec of the kernel computing ``node``, after the rewrites and ``keep`` marks that
    shape it (unfolded windows, stored padding, stored operands)."""
    spec = _choose_spec(node)
    if spec.reduction is not None:
        shape = spec.reduction.srcs[0].shape
        _unfold_windows(spec.reduction)
        if spec.reduction.srcs[0].shape != shape:  # its summed axes reordered
            spec = _choose_spec(node)
    _store_padded_windows(spec)
    _store_costly_operands(spec)
    return spec


def _cut_to_buffer_limit(root: Lazy, inputs: Sequence[Lazy], limit: int) -> None:
    """Mark ``keep`` the node fused into ``root``'s kernel that reads the most of its
    ``inputs`` while its own kernel still fits the device's ``limit`` of buffers: it is stored
    by a kernel of its own and read as one buffer. The caller schedules ``root`` again, which
    cuts once more until the kernel fits (a fused gradient of many parameters, a cat of 40
    tensors on a WebGPU adapter that binds 32 buffers)."""
    wanted = {id(n) for n in inputs}
    below: dict[int, frozenset[int]] = {}
    nodes: dict[int, Lazy] = {}

    def visit(node: Lazy) -> frozenset[int]:
        hit = below.get(id(node))
        if hit is None:
            if id(node) in wanted:
                hit = frozenset((id(node),))
            else:
                hit = frozenset().union(*(visit(s) for s in node.srcs))
            below[id(node)], nodes[id(node)] = hit, node
        return hit

    visit(root)
    sizes = [(len(reads), key) for key, reads in below.items()
             if key not in wanted and nodes[key] is not root and nodes[key].op not in MOVEMENT
             and 2 <= len(reads) < limit]
    if not sizes:
        raise RuntimeError(f"a kernel computing {root} reads {len(inputs)} buffers and no part "
                           f"of it fits the device's limit of {limit} buffers per kernel")
    nodes[max(sizes)[1]].keep = True


# A sum is split in two kernels where it has too few outputs to fill a GPU: a convolution's
# weight gradient (64 x 147 outputs, each over 200,704 products), batch-norm statistics, a loss.
_SPLIT_GROUPS = 256  # work-groups the first kernel should have at least
# ... where each is one output of a sum that is not a product: rows summed by a warp each
# (lower._segment_per_output) fill a GPU from some thousands of rows. With 1024 rows, batch
# norm's gradients over 256 to 1024 channels of 16 x 56 x 56 to 14 x 14 ran on 8 warps an SM
# (H200: 2.1 ms of 28 such sums in ResNet-50's step at 16 x 1024 x 14 x 14, 76 us each); with
# 8192 rows from 2048 elements per output, in partial sums of 512 or more, ResNet-50's fp32
# training step went from 31.5 to 29.0 ms, ResNet-18's from 11.2 to 10.6, MobileNet-V2's from
# 17.5 to 16.0.
_SPLIT_ROWS = 8192
_SPLIT_ROW_FROM, _SPLIT_ROW_MIN = 2048, 512  # _SPLIT_FROM and _SPLIT_MIN for such sums
# A sum of trailing axes (a norm's rows) splits under 1024 rows, from _SPLIT_FROM elements
# (RMSNorm's sum of squares over a decode step's rows of 4,096 stays whole: split, it was a
# kernel more in every norm)
_SPLIT_WHOLE_ROWS = 1024
_SPLIT_FROM = 8192  # elements per output from which a sum splits (a 3x3 convolution of 512
# channels, 4608 products per output, ran 1.9x slower split in two)
_SPLIT_MIN = 2048  # elements each partial sum keeps at least
_SPLIT_MAX = 64  # partial sums per output at most
# A product with so few outputs that it fills fewer work-groups than this splits from fewer
# elements per output, into shorter partial sums: the weight gradient of ResNet-18's 1x1
# downsampling convolution (256 x 128 outputs over 3,136 products each) ran as 16 work-groups
# at 0.44 TFLOP/s on an H100.
_FEW_GROUPS = 32
_FEW_FROM, _FEW_MIN = 2048, 256
# ... and where _SPLIT_MAX slices leave it under _SPLIT_GROUPS work-groups, into up to this many:
# the weight gradient of VGG-16's first convolution (64 x 27 outputs over 16 x 224 x 224
# products) ran as 56 partial sums, 112 work-groups, at 3.7 TFLOP/s on an H100 (0.76 ms a step)
_FEW_SPLIT_MAX = 256


def _sum_below(node: Lazy) -> Lazy | None:
    """The unrealized sum ``node`` is, or is a view or a cast of; None if it is something else.
    (Under autocast a weight's gradient is the float32 cast of a bfloat16 sum: a kernel whose
    reduction is its output, cast, and so never stored apart and split.)"""
    while (node.op in MOVEMENT or node.op is Op.CAST) and not node.realized:
        node = node.srcs[0]
    return node if node.op is Op.SUM and not node.realized else None


def _split_plan(node: Lazy) -> tuple[int, int] | None:
    """(slices, axis) into which the unrealized sum ``node`` splits on a GPU: ``n`` elements
    per output over too few outputs to fill the device; None where it stays whole. On the
    processor the kernels' loops parallelize on their own."""
    if node.op is not Op.SUM or _dialect(node.device) == "c":
        return None
    src, axes = node.srcs[0], node.arg
    total = node.numel
    per_output = src.numel // max(total, 1)
    # a product's sum (a contraction) runs 64 x 64 outputs per work-group, other sums one (a
    # sum of squares too: RMSNorm's over one row of 4,096 had split into 16 partials, a kernel
    # more in every norm of a decode step)
    product = src.op is Op.MUL and src.srcs[0] is not src.srcs[1]
    if product and _rows_on_tensor_cores(node):
        return None
    groups = -(-total // 4096) if product else total
    few = product and groups < _FEW_GROUPS
    # a sum over axes around a kept one (batch norm's over the batch and the pixels of each
    # channel), not over rows of trailing axes (a norm's, a softmax's: those stay one kernel
    # of a row each, fused with what they normalize)
    ndim = len(src.shape)
    strided = not product and sorted(axes) != list(range(ndim - len(axes), ndim))
    least = _FEW_MIN if few else _SPLIT_ROW_MIN if strided else _SPLIT_MIN
    goal = _SPLIT_GROUPS if product else _SPLIT_ROWS if strided else _SPLIT_WHOLE_ROWS
    start = _FEW_FROM if few else _SPLIT_ROW_FROM if strided else _SPLIT_FROM
    if groups >= goal or per_output < start:
        return None
    # the first axis (outermost) whose slices reach the goal with the fewest of them, else the
    # most slices any axis allows
    most = _FEW_SPLIT_MAX if few and groups * _SPLIT_MAX < goal else _SPLIT_MAX
    options = [(d, axis) for axis in axes for d in range(2, min(src.shape[axis], most) + 1)
               if src.shape[axis] % d == 0 and per_output // d >= least]
    if not options:
        return None
    enough = [o for o in options if groups * o[0] >= goal]
    return min(enough) if enough else max(options, key=lambda o: (o[0], -o[1]))


def _split_reduction(root: Lazy) -> None:
    """Rewrite the sum ``root`` is (or views), where ``_split_plan`` splits it, as partial
    sums of ``S`` slices of one reduced axis (their own kernel, with ``S`` times the
    work-groups), then the sum of the partials: the sum node stays the one that gives the
    result, of the same shape (a 16-bit one becomes the cast of a float32 sum)."""
    node = _sum_below(root)
    plan = _split_plan(node) if node is not None else None
    if node is None or plan is None:
        return
    parts, axis = plan
    shape = node.srcs[0].shape
    _unfold_windows(node)  # before the split reshapes the product (a weight gradient on a GPU)
    if node.srcs[0].shape != shape:  # its summed axes reordered: the split planned again
        plan = _split_plan(node)
        if plan is None:
            return
        parts, axis = plan
    src, axes = node.srcs[0], node.arg
    narrow = node.dtype in (float16, bfloat16)
    if narrow:
        # a float16 or bfloat16 sum accumulates in float32 within a kernel; its partials are
        # float32 too (stored in 16 bits they would round), a product's factors widened first
        # so that the partial products stay a contraction for the templates. (Whole, bf16
        # weight gradients with few outputs ran on a few SMs: ResNet-18's stem 13 ms on an
        # H100, 0.29 TFLOP/s.)
        src = src.srcs[0].alu(Op.CAST, arg=float32).alu(Op.MUL, src.srcs[1].alu(
            Op.CAST, arg=float32)) if src.op is Op.MUL else src.alu(Op.CAST, arg=float32)
    n = src.shape[axis]
    shape = src.shape[:axis] + (parts, n // parts) + src.shape[axis + 1:]
    inner = tuple(a if a < axis else a + 1 for a in axes)  # the slice's part of the axis
    partial = src.movement(Op.RESHAPE, shape).reduce(Op.SUM, inner).contiguous()
    partial = partial.movement(Op.RESHAPE, node.shape[:axis] + (parts,) + node.shape[axis + 1:])
    if narrow:  # the node becomes the sum of the partials, rounded to its type
        total = partial.reduce(Op.SUM, (axis,))
        node.op, node.srcs, node.arg = Op.CAST, (total,), node.dtype
        total.consumers.append(weakref.ref(node))
    else:
        node.srcs, node.arg = (partial,), (axis,)
        partial.consumers.append(weakref.ref(node))


def _split_epilogue_sum(root: Lazy, spec: lower.KernelSpec) -> bool:
    """Split (``_split_reduction``) the sum of the kernel computing ``root`` where ``root``
    is computed from it over the same outputs (a mean: the sum times a constant) and it does
    not sum a product (the rules for products decide those): its partial sums run as a kernel
    of their own and this kernel sums them under its epilogue. Whether it was split. (Whole, the
    mean of batch norm's statistics ran a warp per channel: ResNet-50's 256 channels of 16 x
    56 x 56 at 390 GB/s on an H200.)"""
    node = spec.reduction
    # (not a split's partial sums, stored behind a CONTIGUOUS: they split once)
    if not spec.reduced_output or node is None or node is root or node.op is not Op.SUM or \
            root.op is Op.CONTIGUOUS or \
            _sums_product(node) or _split_plan(node) is None:
        return False
    _split_reduction(node)
    return True


def _sums_product(node: Lazy) -> bool:
    """Whether the sum ``node`` sums a product of two factors (not a square: a variance's)."""
    found = _summed_product(node)
    return found is not None and found[0].srcs[0] is not found[0].srcs[1]


def _choose_spec(root: Lazy) -> lower.KernelSpec:
    """``lower.choose_spec``, except that a sum broadcast back over what it sums (a
    normalization) which would split (``_split_plan``) is not taken as the kernel's epilogue
    but stored by a kernel of its own, which splits it: as an epilogue it ran one work-group
    per row (batch norm's gradient over ResNet's stem, 64 rows of 200,704: 6.5 ms of a 24 ms
    training step on an H100). So is a product that would split under an epilogue of its own
    outputs in float32 (a linear layer's bias and activation; 16-bit ones of few rows stay whole
    for the tensor cores' rows template): whole, VGG-16's first classifier layer (16
    x 4096 outputs over 25,088 products each) ran as 64 work-groups at 245 GB/s, 1.7 ms on an
    H200; stored, it splits, and the epilogue runs after the partial sums are added."""
    spec = lower.choose_spec(root)
    kept = []
    while spec.reduction is not None and spec.reduction is not root and \
            (not spec.reduced_output or spec.reduction.dtype == float32 and
             _sums_product(spec.reduction)) and \
            _split_plan(spec.reduction) is not None:
        spec.reduction.keep = True
        kept.append(spec.reduction)
        spec = lower.choose_spec(root)
    # a reduction that a kept sum reads too (RMSNorm's sum of the squares of h + x @ W.T: the
    # product) is stored once for both: as this kernel's own reduction it was computed twice
    # (a Llama-2-7B decode step in 4-bit weights read each output projection's and down
    # projection's weights twice, 33 of 147 MB a layer)
    if spec.reduction is not None and spec.reduction is not root and \
            any(_computes(sum_, spec.reduction) for sum_ in kept):
        spec.reduction.keep = True
        spec = lower.choose_spec(root)
    return spec


def _computes(root: Lazy, node: Lazy) -> bool:
    """Whether the kernel that computes ``root`` computes ``node`` in it (reaches it without
    crossing a buffer or another kernel's output)."""
    stack, seen = [root], set()
    while stack:
        at = stack.pop()
        if at is node:
            return True
        if id(at) in seen or is_boundary(at, root):
            continue
        seen.add(id(at))
        stack.extend(at.srcs)
    return False


# multiply-adds from which an unfolded convolution pays on the processor: the demo's (64 x 8 x
# 8 x 8 in, 16 out, 3 x 3: 4.7M) ran 3x slower unfolded, a ResNet layer at 56 x 56 9x faster
_UNFOLD_MIN = 1 << 24
_UNFOLD_MAX = 1 << 28  # bytes an unfolded operand may take at most
# On GPUs, a float16 or bfloat16 convolution's windows are written out for the tensor cores,
# which stream only operands that are plain buffers (staged through registers, computed 16-bit
# windows ran at 11.7 TFLOP/s on an H100, and on the SIMT template VGG-16's at 6-15)
_UNFOLD_MIN_GPU = 1 << 26
_UNFOLD_MAX_GPU = 1 << 30


def channels_last_windows(device: str, dtype: DType) -> bool:
    """Whether a convolution's padded input on ``device`` in ``dtype`` is stored with its
    channels innermost for the tensor cores (``_channels_last_windows``): the weight gradient
    then sums over windows ordered (row, column, channel) as well (``conv2d_grad``)."""
    return config.get().conv_unfold >= 1 and _on_tensor_cores(device, dtype)


def _on_tensor_cores(device: str, dtype: DType, exact: bool = False) -> bool:
    """Whether products in ``dtype`` on ``device`` may run on tensor cores: CUDA from compute
    capability 8.0, 16-bit factors, or float32 ones where products may run as tf32 (``exact``:
    any float32 ones)."""
    tf32 = dtype == float32 and (exact or get_float32_matmul_precision() != "highest")
    return (dtype in (float16, bfloat16) or tf32) and _dialect(device) == "cuda" and \
        get_device(device).info.extra.get("cc", (0, 0)) >= (8, 0)


def unfolds_on_gpu(product: int, windows_bytes: int) -> bool:
    """Whether a 16-bit or tf32 convolution whose product has ``product`` elements (multiplies)
    has its windows of ``windows_bytes`` written out for the tensor cores on a GPU
    (``_unfold_windows``; ``config.conv_unfold``), where its operands' sizes allow."""
    return config.get().conv_unfold >= 1 and product >= _UNFOLD_MIN_GPU and \
        windows_bytes <= _UNFOLD_MAX_GPU


def _inner_run(shape: tuple[int, ...], group: list[int]) -> int:
    """The elements of the trailing axes of ``group`` (ascending) that lie next to each other in
    ``shape``, only axes of size 1 between: what a kernel's index merges into its innermost
    axis along them (a convolution's pixels 14 x 14 = 196, its channels and window 64 x 3 x 3)."""
    run = shape[group[-1]]
    for a, b in zip(group[-2::-1], group[:0:-1]):
        if any(shape[c] != 1 for c in range(a + 1, b)):
            break
        run *= shape[a]
    return run


def _tensor_core_windows(node: Lazy) -> bool:
    """Whether the sum ``node`` of a product (of a convolution's rank) is one that the device's
    tensor cores compute once its windows are written out (``_sizes_on_tensor_cores``: 16-bit,
    or tf32): 64 or more rows, columns and summed elements, these a multiple of 8 (a tile's
    16-byte copies; a depthwise convolution's 9, the 27 of a first layer's 3 channels,
    stay with the SIMT template, whose windows need no copy)."""
    unfold = config.get().conv_unfold
    sizes = _sizes_on_tensor_cores(node, exact=unfold >= 2) if unfold else None
    return sizes is not None and sizes[2] % 8 == 0 and min(sizes) >= 64


def _sizes_on_tensor_cores(node: Lazy, exact: bool = False) -> tuple[int, int, int] | None:
    """(rows, columns, summed elements) of the sum of a product ``node`` where the device's
    tensor cores may compute it (``_on_tensor_cores``), else None."""
    product = node.srcs[0]
    if product.op is not Op.MUL or any(s.op is not Op.EXPAND for s in product.srcs) or \
            not _on_tensor_cores(product.device, product.dtype, exact):
        return None
    summed = set(node.arg)
    own = [{a for a, n in enumerate(side.srcs[0].shape) if n != 1} for side in product.srcs]
    rows, cols = (own[i] - own[1 - i] - summed for i in (0, 1))
    return (math.prod(product.shape[a] for a in rows), math.prod(product.shape[a] for a in cols),
            math.prod(product.shape[a] for a in summed))


def _rows_on_tensor_cores(node: Lazy) -> bool:
    """Whether the sum ``node`` is a 16-bit product of 16 or fewer rows against 256 or more
    columns, summing a multiple of 32 elements (256 or more): ``templates.mma_rows`` computes
    it on tensor cores, each weight read once, which a split into partial sums would keep from
    it (VGG-16's first classifier layer under bf16 autocast, split in 16, ran as a generic
    reduction at 24 GB/s: 8.7 ms a step on an H200)."""
    sizes = _sizes_on_tensor_cores(node)
    if sizes is None or node.dtype == float32:
        return False
    rows, cols, k = sizes
    return min(rows, cols) <= 16 and max(rows, cols) >= 256 and k % 32 == 0 and k >= 256


def _unfold_windows(node: Lazy | None) -> None:
    """On the processor, a large product goes through BLAS: a convolution (forward, data and
    weight gradients alike) and a batched matrix product whose operand is a view BLAS cannot
    read (attention's heads: the output projection reads the heads' output with its head and
    feature axes swapped; computed as a reduction it took 61 ms of BERT-base's 123 tokens). On
    a GPU, a 16-bit or tf32 convolution goes to the tensor cores (``_tensor_core_windows``;
    ``_split_reduction`` unfolds before it splits), whose templates take any strides of plain
    buffers. An operand whose reads are linear, its rows and its summed axes each stepping as
    one (on a GPU: its memory running along a group of a multiple of 8), is read where it lies
    (stored first if it is computed; on a GPU, a window over a padded input whose channels it
    sums is made such an operand by ``_channels_last_windows``); any other (a window over
    padding, a strided window, a batch that does not nest with the pixels, axes merged out of
    order) is written
    out first (im2col, one copy kernel each): axes both operands have, then its own rows and
    the summed axes, in the order that reads the source in runs. Below _UNFOLD_MIN products,
    and for products of fewer axes than a convolution's, only stored memory read out of order
    is written out (the copy then moves each element once)."""
    if node is None or node.op is not Op.SUM:
        return
    product = node.srcs[0]
    gpu = _dialect(node.device) != "c"
    if gpu and not (product.op is Op.MUL and len(product.shape) >= 5 and
                    product.numel >= _UNFOLD_MIN_GPU and _tensor_core_windows(node)):
        return
    if product.op is not Op.MUL or product.numel < 1 << 21 or len(product.shape) < 3 or \
            any(s.op is not Op.EXPAND or s.realized for s in product.srcs):
        return
    if gpu:
        product = _channels_last_windows(node)
    views = [s.srcs[0] for s in product.srcs]
    reduced = set(node.arg)
    own = [{a for a, n in enumerate(v.shape) if n != 1} for v in views]
    shared = own[0] & own[1] - reduced
    operands = list(product.srcs)
    for i, (side, view) in enumerate(zip(product.srcs, views)):
        rest = [a for a in range(len(view.shape)) if a not in own[i]]  # size 1 here
        if view.numel * view.dtype.itemsize > (_UNFOLD_MAX_GPU if gpu else _UNFOLD_MAX):
            continue
        rows, summed = sorted(own[i] - shared - reduced), sorted(own[i] & reduced)
        # the group whose last axis is the longer contiguous run in the source goes last, so
        # that the copy reads runs (NCHW windows: channels and window offsets outer, pixels
        # inner, 2.2 -> 4.7 GB/s on 2 cores; a weight gradient's windows already end in pixels)
        middle = _middle_strides(view)
        runs = [view.shape[g[-1]] if g and middle[g[-1]] == 1 else 0 for g in (rows, summed)]
        outer, inner = (summed, rows) if runs[0] > runs[1] else (rows, summed)

        def aligned(group: list[int]) -> bool:
            return bool(group) and _inner_run(product.shape, group) % 8 == 0

        if gpu and not aligned(inner) and aligned(outer):
            # the tensor cores' tiles copy runs of 16 bytes: pixels of 14 x 14 or 7 x 7 go
            # outer, the window's channels and offsets (a multiple of 8) inner
            outer, inner = inner, outer
        order = rest + sorted(shared) + outer + inner
        walk = _under_movement(view)
        strides = _linear_strides(view, middle)
        # (the GPU's templates split rows and k back into their axes: any strides will do,
        # where the axis along which memory runs ends a group of 16-byte runs)
        linear = strides is not None and (
            any(g and middle[g[-1]] == 1 and aligned(g) for g in (rows, summed)) if gpu else
            _nests(view, strides, rows) and _nests(view, strides, summed))
        if product.numel < _UNFOLD_MIN or len(product.shape) < 5:
            # a small convolution's compiled reduction beats its unfolded copy; a smaller
            # product only has a view of stored memory written out in order (a computed
            # operand is left to _store_costly_operands, which stores the smaller side for
            # BLAS: 4-bit weights are unpacked in the product's loads, never stored)
            if linear or view.numel > walk.numel or not (
                    walk.realized or walk.keep or walk.op in REDUCE):
                continue
        elif linear:
            # BLAS reads it where it lies (transposed or not) once it is stored: a computed
            # value is kept, one kernel for all its readers (ResNet's max pooling feeds two
            # convolutions, and a copy for each had computed it twice)
            walk.keep = walk.keep or not walk.realized
            continue
        # a reduction is stored before its copy, not computed again in each reader's copy
        walk.keep = walk.keep or (walk.op in REDUCE and not walk.realized)
        operands[i] = _stored_in_order(view, order).movement(Op.EXPAND, side.arg)
    if any(a is not b for a, b in zip(operands, product.srcs)):
        _new_product(node, operands)


def _stored_in_order(node: Lazy, order: list[int]) -> Lazy:
    """``node`` stored with its axes laid out in ``order`` (outermost first), seen in its own
    axes' order."""
    back = [order.index(a) for a in range(len(order))]
    return node.movement(Op.PERMUTE, order).contiguous().movement(Op.PERMUTE, back)


def _new_product(node: Lazy, operands: Sequence[Lazy]) -> Lazy:
    """The product of ``operands``, made the source of the sum ``node`` (rewritten in place)."""
    product = operands[0].alu(Op.MUL, operands[1])
    node.srcs = (product,)
    product.consumers.append(weakref.ref(node))
    return product


def _channels_last_windows(node: Lazy) -> Lazy:
    """On a GPU, a convolution whose windows run over a padded input, summed over its channels
    (a forward product, or a data gradient over the output's padded gradient): the padded
    input is stored once with its channels innermost (one copy of about its own size, where
    its windows written out took nine: 925 MB for a 64-channel layer at 224 x 224, batch 16,
    in 16 bits), and the summed axes are reordered so that the channels come last. Each
    window's run of channels is then a plain 16-byte-aligned run of memory that the tensor
    cores' templates copy as they copy any operand (an implicit GEMM); the weights, whose
    summed axes no longer run in memory's order, are written out in it by ``_unfold_windows``
    (a small copy). The product (rewritten in place under ``node``) is returned."""
    product = node.srcs[0]
    summed = set(node.arg)
    run = 16 // product.dtype.itemsize
    for i, side in enumerate(product.srcs):
        chain, pad = [], side.srcs[0]
        while pad.op in MOVEMENT and pad.op is not Op.PAD and not pad.realized:
            chain.append(pad)
            pad = pad.srcs[0]
        if pad.op is not Op.PAD or pad.realized or len(pad.shape) < 3:
            continue
        unpadded = [a for a, (lo, hi) in enumerate(pad.arg) if lo == hi == 0]
        if not unpadded or unpadded[-1] == len(pad.shape) - 1 or \
                pad.shape[unpadded[-1]] % run:
            continue
        channel = unpadded[-1]
        view = _stored_in_order(pad, [a for a in range(len(pad.shape)) if a != channel] +
                                [channel])
        for above in reversed(chain):
            view = view.movement(above.op, above.arg)
        middle = _middle_strides(view)
        strides = _linear_strides(view, middle)
        if strides is None:
            continue
        inner = [a for a in sorted(summed) if middle[a] == 1 and view.shape[a] % run == 0]
        rows = [a for a in range(len(view.shape)) if view.shape[a] > 1 and a not in summed]
        if not inner and rows and middle[rows[-1]] == 1 and view.shape[rows[-1]] % run == 0 \
                and product.shape[max(summed)] % run == 0:
            # the channels are the last of its rows (a weight gradient summed over pixels,
            # ``nn.convolution.conv2d_grad``'s order on such devices): read where they lie.
            # The padded rows no longer merge with the pixels, so the other operand's rows of
            # pixels must hold whole 16-byte runs: at 28 x 28 in 16 bits they do not, and its
            # product fell to the SIMT template (VGG-16: 3.1 ms, against 0.13 on tensor cores
            # with the windows written out)
            return _new_product(node, [view.movement(Op.EXPAND, side.arg) if j == i else other
                                       for j, other in enumerate(product.srcs)])
        if len(inner) != 1:
            continue
        # the channels last among the summed axes (the sum's shape keeps its axes: they are 1)
        rest = sorted(summed - set(inner))
        slots = sorted(summed)
        perm = list(range(len(product.shape)))
        for slot, axis in zip(slots, rest + inner):
            perm[slot] = axis
        shape = tuple(product.shape[a] for a in perm)
        sides = [view if j == i else other.srcs[0] for j, other in enumerate(product.srcs)]
        return _new_product(node, [v.movement(Op.PERMUTE, perm).movement(Op.EXPAND, shape)
                                   for v in sides])
    return product


_PADDED_MIN = 1 << 16  # elements of a padded input from which it is stored (a kernel more)


def _store_padded_windows(spec: lower.KernelSpec) -> None:
    """On the processor, a reduction over windows of a padded input that is computed (max
    pooling of a convolution's bias and ReLU) stores the padded input first: its loops then read
    plain memory, not a bounds check per element of every window (ResNet-50's stem pooling at
    batch 1 on 2 cores: 5.2-5.5 ms with the checks, 4.3 with the padding stored by a kernel of
    0.7). Products are handled by ``_unfold_windows`` and ``_store_costly_operands``."""
    node = spec.reduction
    if node is None or _dialect(node.device) != "c" or \
            (node.op is Op.SUM and node.srcs[0].op is Op.MUL):
        return
    top = _under_movement(node.srcs[0])
    if top.op not in ELEMENTWISE or is_boundary(top, spec.root) or top.numel < _PADDED_MIN:
        return
    # the padding under the windows' view: a padded computed node (max pooling pads by a
    # ``where`` over a padded mask, its input padded beside it)
    stack, seen = [top], set()
    while stack:
        at = stack.pop()
        if id(at) in seen or is_boundary(at, spec.root):
            continue
        seen.add(id(at))
        if at.op is Op.PAD and any(a or b for a, b in at.arg) and \
                at.srcs[0].op in ELEMENTWISE and not is_boundary(at.srcs[0], spec.root):
            top.keep = True
            return
        if at.op in ELEMENTWISE or at.op is Op.PAD:
            stack.extend(at.srcs)


def _source_offset(view: Lazy, index: list[int]) -> int | None:
    """The element of ``view``'s source (the node under its movement ops, in its own shape's
    order) that ``index`` reads, or None where it reads padding."""
    node, idx = view, list(index)
    while node.op in MOVEMENT and not node.realized:
        op, arg, src = node.op, node.arg, node.srcs[0]
        if op is Op.RESHAPE:
            flat = _flat(idx, node.shape)
            idx = []
            for n in reversed(src.shape):
                flat, i = divmod(flat, n)
                idx.append(i)
            idx.reverse()
        elif op is Op.PERMUTE:
            inv = [0] * len(idx)
            for i, a in enumerate(arg):
                inv[a] = idx[i]
            idx = inv
        elif op is Op.EXPAND:
            idx = [0 if s == 1 else i for i, s in zip(idx, src.shape)]
        elif op is Op.SHRINK:
            idx = [i + lo for i, (lo, _) in zip(idx, arg)]
        elif op is Op.FLIP:
            idx = [n - 1 - i if a in arg else i for a, (i, n) in enumerate(zip(idx, node.shape))]
        else:  # PAD
            idx = [i - lo for i, (lo, _) in zip(idx, arg)]
            if any(not 0 <= i < n for i, n in zip(idx, src.shape)):
                return None
        node = src
    return _flat(idx, node.shape)


def _flat(index: list[int], shape: tuple[int, ...]) -> int:
    flat = 0
    for i, n in zip(index, shape):
        flat = flat * n + i
    return flat


def _middle_strides(view: Lazy) -> list[int | None]:
    """Each axis's step through ``view``'s source, probed at the middle of the view (None
    where the probe reads padding)."""
    at = [(n - 1) // 2 for n in view.shape]
    base = _source_offset(view, at)
    strides: list[int | None] = []
    for axis, n in enumerate(view.shape):
        step = list(at)
        step[axis] += 1
        after = _source_offset(view, step) if n > 1 else base
        strides.append(None if base is None or after is None else after - base)
    return strides


def _linear_strides(view: Lazy, middle: list[int | None]) -> list[int] | None:
    """The ``middle`` strides where ``view``'s reads are a linear function of its indices (a
    transposed or reshaped value, however the movement ops built it), else None (a window over
    padding, a flip). Checked at the origin, the middle, the far corner and each axis's end."""
    strides = [s for s in middle if s is not None]
    origin = _source_offset(view, [0] * len(middle))
    if len(strides) != len(middle) or origin is None:
        return None
    for point in [[(n - 1) // 2 for n in view.shape], [n - 1 for n in view.shape]] + \
            [[n - 1 if a == axis else 0 for a, n in enumerate(view.shape)]
             for axis in range(len(middle))]:
        if _source_offset(view, point) != origin + sum(s * p for s, p in zip(strides, point)):
            return None
    return strides


def _nests(view: Lazy, strides: list[int], axes: list[int]) -> bool:
    """Whether ``axes`` of ``view`` (outermost first) step through its source as one flat axis
    would: each one's stride the next one's times its size (so BLAS reads them as one)."""
    steps = [(strides[a], view.shape[a]) for a in axes if view.shape[a] > 1]
    return all(outer == inner * size for (outer, _), (inner, size) in zip(steps, steps[1:]))


# A product's operand that is an elementwise computation is fused into the product's loads and
# so computed again for each row or column tile that reads it: cheap work (a bias and an
# activation, batch norm's scale and shift) costs less there than a store and a load, but above
# this cost (ops, transcendental ones four each) the operand is stored first. Erf's GELU
# (about 40) before a transformer's second linear layer ran 60x slower fused.
_FUSED_OPERAND_COST = 12
# The processor's compiled products have no tiles: an operand fused in is computed again for
# every output that reads it (a convolution's input, once per output channel), so less work
# already costs more than storing it (the demo's batch norm and ReLU before its second
# convolution, computed 16 times per element, took half the training step).
_FUSED_OPERAND_COST_CPU = 3
# The GPU's tiled products recompute a fused operand for each tile that reads it, with its
# loads: batch norm's gradient (cost 8 to 10) fused into a convolution's data and weight
# gradients left them stalled on those loads (9.6 TFLOP/s on an H100, ResNet-18's first
# layer). A bias, batch norm's scale and shift and an activation stay fused (5 or less).
_TILED_OPERAND_COST = 8
# ... or whose work reads this many times its own elements (two tensors of its size: batch
# norm's gradient from a stored gradient and the layer's input, once the chain of a residual
# stream's gradients is stored: _store_shared_work)
_TILED_OPERAND_READS = 2
# An untiled 16-bit product on a GPU computes a fused operand again for every output that
# reads it: where the operand's smaller side has this many rows or more (a decode step's
# sequences, or a step's query heads against their cached keys), elementwise work costing 2 or
# more is stored first. A Llama-2-7B step of 16 sequences on an H200 read its query/key/value
# weights at 1.2 TB/s with RMSNorm fused in (2.7 stored first), the feed-forward ones (two
# products sharing it) at 1.9, and its cached keys at 1.0 with RoPE fused into the queries (2.1).
_FUSED_ROWS = 8
_FUSED_ROWS_COST = 2
# The same where the product's larger operand is computed with this much work per element
# (4-bit weights unpacked and scaled): such a product is bound by arithmetic, not memory, and a
# decode step's one row recomputed per output doubled it (a Llama-2-7B step in 4-bit weights
# on an H200: the query/key/value product with RMSNorm fused in took 99 us, the feed-forward
# pair with the residual sum and RMSNorm 106).
_DEQUANTIZED_COST = 4
_COSTLY = frozenset({Op.EXP2, Op.LOG2, Op.SIN, Op.SQRT, Op.RECIP, Op.DIV, Op.IDIV, Op.MOD})


@functools.lru_cache(maxsize=None)
def _dialect(device: str) -> str:
    """The device's code dialect (asked once per device name: this runs for every product
    a step schedules)."""
    return get_device(device).dialect


def _summed_product(node: Lazy) -> tuple[Lazy, set[int]] | None:
    """(the product the sum ``node`` sums, its summed axes), also where the product is seen
    through the reshape of ``_split_reduction``, which splits one of its axes in two (a
    convolution's weight gradient sums slices of its batch or its rows); None if ``node`` sums
    something else."""
    below = node.srcs[0]
    if below.op is Op.MUL:
        return below, set(node.arg)
    if below.op is not Op.RESHAPE or below.realized or below.srcs[0].op is not Op.MUL:
        return None
    product = below.srcs[0]
    outer, inner = product.shape, below.shape
    if len(inner) != len(outer) + 1:
        return None
    for axis in range(len(outer)):
        if inner[:axis] == outer[:axis] and inner[axis + 2:] == outer[axis + 1:] and \
                inner[axis] * inner[axis + 1] == outer[axis]:
            # the reshaped axis j is the product's j, the split pair its ``axis``, then j - 1
            return product, {j if j <= axis else j - 1 for j in node.arg}
    return None


def _tiled_product(node: Lazy) -> bool:
    """Whether the sum ``node`` of a product is a matrix product the GPU's GEMM templates tile:
    32 or more rows and columns (a decode step's matrix-vector products have one row per
    sequence; a convolution's rows are its batch and pixels) and at least 2M multiply-adds;
    in float32 16 rows from 4M multiply-adds."""
    found = _summed_product(node)
    if found is None:
        return False
    product, summed = found
    if product.numel < 1 << 21 or len(product.srcs) != 2:
        return False
    extent = [1, 1]  # rows (the axes the second factor is broadcast along), columns
    for a, size in enumerate(product.shape):
        if a in summed or size == 1:
            continue
        for i, side in enumerate(product.srcs):
            if side.op is Op.EXPAND and side.srcs[0].shape[a] == 1:
                extent[1 - i] *= size
    if product.dtype == float32 and max(extent) >= 32 and product.numel >= 1 << 22:
        return min(extent) >= gemm.FEW_ROWS  # (gemm.choose's float32 tiles of 16 rows)
    return min(extent) >= 32


def _operand_cost(node: Lazy, root: Lazy, limit: int) -> int:
    """The elementwise work a kernel computing ``root`` would fuse under ``node``, per element
    (up to ``limit``: the walk stops there). Work on fewer elements broadcast to the operand's
    shape (batch norm's per-channel scale, say) does not count."""
    cost, seen, stack = 0, set(), [node]
    while stack and cost < limit:
        n = stack.pop()
        if id(n) in seen or is_boundary(n, root) or n.op in REDUCE or n.op is Op.GATHER or \
                n.op is Op.EXPAND:
            continue
        seen.add(id(n))
        if n.op in ELEMENTWISE:
            cost += 4 if n.op in _COSTLY else 1
        stack.extend(n.srcs)
    return cost


def _reads_many(operand: Lazy, root: Lazy) -> bool:
    """Whether a kernel computing ``root`` reads _TILED_OPERAND_READS times the elements of
    ``operand`` or more to compute it."""
    read = _elements_read(operand, root, operand=True)
    return read is not None and read >= _TILED_OPERAND_READS * operand.numel


def _store_product_epilogues(outputs: Sequence[Lazy]) -> None:
    """Mark ``keep``, before any kernel is planned, each operand of a GPU's tiled product that
    is elementwise work on another tiled product of its size that nothing else reads
    (``_epilogue_of_lone_product``): a convolution's bias and ReLU before the next
    convolution. The first product's kernel then stores it in its epilogue, in the place of
    its own output (the same bytes, no kernel more), and every kernel that reads it (the next
    layer's product through its windows, that layer's weight gradient, ReLU's gradient) loads
    it rather than computing the bias and the ReLU again for each element it reads (on an
    H200, VGG-16's 64-channel weight gradient at 224 x 224, batch 16, ran 3.74 ms with them in
    its loads; the same product of a plain input, 2.84 ms). Done before planning: the first
    kernel planned that meets the product marks it to be stored by a kernel of its own."""
    if all(_dialect(out.device) == "c" for out in outputs):
        return  # (the processor's products have rules of their own: no walk of the graph)
    seen: set[int] = set()
    stack = list(outputs)
    while stack:
        n = stack.pop()
        if id(n) in seen or n.realized:
            continue
        seen.add(id(n))
        stack.extend(n.srcs)
        if n.op is not Op.SUM or _dialect(n.device) == "c" or not _tiled_product(n):
            continue
        found = _summed_product(n)
        assert found is not None
        for side in found[0].srcs:
            if side.op is not Op.EXPAND or side.realized:
                continue
            below = _under_movement(side.srcs[0])
            if below.op in ELEMENTWISE and not below.realized and not below.keep and \
                    _epilogue_of_lone_product(below, n):
                below.keep = True


def _epilogue_of_lone_product(operand: Lazy, root: Lazy) -> bool:
    """Whether ``operand`` (read by the kernel computing ``root``) is computed elementwise from
    a tiled product of its own size (``_lone_product``) that stays whole under an epilogue,
    with constants and broadcast vectors, and nothing between them is read from elsewhere."""
    inside: dict[int, Lazy] = {id(operand): operand}
    products: list[Lazy] = []
    stack = list(operand.srcs)
    while stack:
        n = stack.pop()
        if id(n) in inside or is_boundary(n, root):
            continue
        if n.op is Op.CONST or n.op is Op.EXPAND and n.numel != n.srcs[0].numel:
            continue  # a constant or a broadcast vector (the bias), whoever else reads it
        inside[id(n)] = n
        if n.op in REDUCE:
            # (a float32 product that splits is stored by kernels of its own: _choose_spec)
            if not (_lone_product(n) and n.numel == operand.numel) or \
                    n.dtype == float32 and _split_plan(n) is not None:
                return False
            products.append(n)
        elif n.op in ELEMENTWISE or n.op in MOVEMENT:
            stack.extend(n.srcs)
        else:
            return False
    # nothing under it is read from outside (storing ``operand`` would not store that)
    return bool(products) and all(id(user) in inside for n in inside.values()
                                  if n is not operand for user in n.readers())


def _under_movement(node: Lazy) -> Lazy:
    """The first node under ``node``'s chain of unrealized movement ops."""
    while node.op in MOVEMENT and not node.realized:
        node = node.srcs[0]
    return node


def _blas_product(product: Lazy, summed: set[int]) -> bool:
    """Whether the processor sums ``product`` over its ``summed`` axes through BLAS rather than
    as a compiled reduction: 2M multiply-adds in all and 64K or more in each product of a batch
    (``lower.to_ir``'s rule), and 16M (_UNFOLD_MIN) where an operand repeats its source (a
    convolution's overlapping windows, which _unfold_windows writes out)."""
    if product.numel < lower.BLAS_MIN_MACS or len(product.srcs) != 2:
        return False
    views = [side.srcs[0] if side.op is Op.EXPAND else side for side in product.srcs]
    own = [{a for a, n in enumerate(v.shape) if n != 1} for v in views]
    batch = math.prod(product.shape[a] for a in own[0] & own[1] - summed)
    repeats = any(v.numel > _under_movement(v).numel for v in views)
    return product.numel // batch >= lower.BLAS_MIN_EACH and \
        (not repeats or product.numel >= _UNFOLD_MIN)


# BLAS reads its operands as buffers: a computed operand of a BLAS product is stored where it is
# the smaller one or where each of its elements takes part in this many multiply-adds (BERT-base's
# activations at 8 x 128 tokens outnumber its weights; left computed, each linear layer summed
# them as a compiled reduction at 0.03 GB/s, 14 s a call). A larger operand used only a few times
# an element (weights dequantized for a decode step of a few rows) stays in a compiled loop.
_BLAS_REUSE = 32


def _blas_stores(product: Lazy, numel: int) -> bool:
    """Whether a computed operand of ``numel`` elements of the BLAS product ``product`` is
    stored for BLAS to read."""
    return all(numel <= _under_movement(side).numel for side in product.srcs) or \
        product.numel // max(numel, 1) >= _BLAS_REUSE


def _store_costly_operands(spec: lower.KernelSpec) -> None:
    """Mark ``keep`` each operand of the product a kernel sums whose elementwise work is too
    costly to repeat per tile (see _FUSED_OPERAND_COST)."""
    node, root = spec.reduction, spec.root
    # (a split product's partial sums too: a convolution's weight gradient, whose operand
    # under batch norm's gradient had been computed again for each of its tiles)
    if node is None or node.op is not Op.SUM:
        return
    found = _summed_product(node)
    if found is None:
        return
    # the processor's products small enough to stay compiled (larger ones go to BLAS, whose
    # operands are laid out by kernels of their own anyway: _unfold_windows, lower.to_ir)
    product = found[0]
    on_cpu = _dialect(root.device) == "c"
    # a matrix product large enough for BLAS reads its operands as plain buffers: an operand
    # computed inside the product keeps it a compiled reduction (a decode step of 8 sequences
    # summed TinyLlama's down projection at 0.8 GB/s, its SiLU recomputed for every output;
    # attention's values with their bias before the heads' products of BERT-base, at 2.5
    # GFLOP/s); a convolution's too (_unfold_windows writes its operands out)
    blas = on_cpu and _blas_product(product, found[1])
    cpu = on_cpu and not blas
    # on GPUs, a product with rows and columns enough for the GEMM templates' tiles
    tiled = not on_cpu and _tiled_product(node)
    # the tensor-core template streams operands that are plain buffers from memory; a computed
    # one (RMSNorm's output before the query, key and value projections) left an f16 product
    # on the SIMT template at 20 TFLOP/s (a Llama-2-7B prefill of 512 tokens on an H200). Not
    # a convolution's: its operand is the input's windows, which storing would unfold
    streamed = tiled and len(product.shape) < 5 and _dialect(root.device) == "cuda" and (
        product.dtype in (float16, bfloat16) or
        product.dtype == float32 and get_float32_matmul_precision() != "highest")
    operands: list[Lazy] = []
    for side in product.srcs:
        if side.op is not Op.EXPAND or side.realized:
            continue
        below = side.srcs[0]
        while below.op in MOVEMENT and not below.realized:
            if cpu and below.op is Op.PAD and any(a or b for a, b in below.arg) and \
                    not is_boundary(below, root):
                # the processor's loops read a padded operand stored once without a bounds
                # check per element, which kept them from becoming vector operations
                below.keep = True
                break
            below = below.srcs[0]
        operands.append(below)
    if blas or tiled:
        # other products summed beside this one in the same loop (SwiGLU's gate and up, the
        # last convolutions of residual blocks in a chain) are stored by kernels of their
        # own: each is then one BLAS call or one tiled GEMM, not a stage of a compiled
        # reduction (on an H200 SwiGLU's pair ran as one such reduction at 1 GB/s, 98% of a
        # Llama-2-7B prefill, and ResNet-50's chained 1x1 convolutions took 96% of its time)
        for other in lower.first_reduces(root):
            if other is not node and other.op is Op.SUM and other.srcs[0].op is Op.MUL and \
                    other.srcs[0].numel >= 1 << 21 and not is_boundary(other, root) and \
                    (blas or _tiled_product(other)):
                other.keep = True
    summed = max(product.numel // max(node.numel, 1), 1)  # elements summed into each output
    # an untiled GPU product whose larger operand is computed (weights dequantized in its
    # loads) spends its arithmetic units on that operand, not its memory
    least = min((below.numel for below in operands), default=0)
    dequantized = not on_cpu and not tiled and any(
        side.numel > least and
        _operand_cost(side, root, _DEQUANTIZED_COST) >= _DEQUANTIZED_COST
        for side in map(_under_movement, product.srcs))
    for below in operands:
        limit = _FUSED_OPERAND_COST if not cpu else _FUSED_OPERAND_COST_CPU
        smaller = all(below.numel <= other.numel for other in operands)
        if blas and _blas_stores(product, below.numel) or streamed and smaller:
            limit = 1  # streamed: the smaller side, not weights dequantized in its loads
        elif not on_cpu and not tiled and smaller and (dequantized or (
                below.numel // summed >= _FUSED_ROWS and product.dtype in (float16, bfloat16))):
            limit = _FUSED_ROWS_COST
        elif tiled:
            limit = _TILED_OPERAND_COST
        if below.op in ELEMENTWISE and not is_boundary(below, root) and (
                _operand_cost(below, root, limit) >= limit or
                tiled and _reads_many(below, root)):
            below.keep = True


def _computed_from(node: Lazy) -> Iterator[Lazy]:
    """The unrealized nodes that compute from ``node``, its views followed (each once)."""
    stack, seen = [node], set()
    while stack:
        at = stack.pop()
        for user in at.readers():
            if id(user) in seen:
                continue
            seen.add(id(user))
            if user.op in MOVEMENT:
                stack.append(user)
            else:
                yield user


def _products_reading(node: Lazy) -> list[Lazy]:
    """The sums of products that take ``node`` (through views) as a factor."""
    out: list[Lazy] = []
    for user in _computed_from(node):
        if user.op is Op.MUL:
            for sum_ in user.readers():
                if sum_.op is not Op.SUM:
                    continue
                found = _summed_product(sum_)
                if found is not None and found[0] is user:
                    out.append(sum_)
    return out


def _keep_product_operands(root: Lazy, walk: list[Lazy], reduction: Lazy | None) -> bool:
    """Mark ``keep`` each elementwise node of the kernel computing ``root`` (``walk``: the nodes
    its signature walked) that a product other than its own ``reduction`` stores as its operand
    (as ``_store_costly_operands`` decides once that product's kernel is planned: a GPU's tiled
    product, a costly operand; the processor's BLAS product, its computed activations):
    planned later, it would be stored for the product after this kernel had computed it again
    from its inputs. Whether any was marked (the kernel is then planned again). (A
    transformer's residual stream: each LayerNorm's output, an operand of the next linear
    layer, is added back after it; the kernel of the last LayerNorm computed every earlier one
    of its row again, 24 chained statistics in BERT-base's last layer.)"""
    on_cpu = _dialect(root.device) == "c"
    marked = False
    # consumers before what they read (``walk`` lists sources first): a node's cost counts the
    # work below it, which a node below marked first would cut short
    for at in reversed(walk):
        # read by this kernel alone, or not computed in it
        if at is root or at.op not in ELEMENTWISE or len(at.readers()) < 2 or \
                is_boundary(at, root):
            continue
        for sum_ in _products_reading(at):
            if sum_ is reduction:
                continue
            if on_cpu:  # BLAS's products store their computed operands (_blas_stores)
                product = sum_.srcs[0]
                limit = 1 if _blas_product(product, set(sum_.arg)) and \
                    _blas_stores(product, at.numel) else 0
            else:
                limit = _TILED_OPERAND_COST if _tiled_product(sum_) else 0
            if limit and (_operand_cost(at, sum_, limit) >= limit or
                          not on_cpu and _reads_many(at, sum_)):
                at.keep = marked = True
                break
    return marked


def _store_shared_product(root: Lazy, walk: list[Lazy], reduction: Lazy | None) -> bool:
    """Mark ``keep`` the first value that the kernel computing ``root`` (``walk``: the nodes
    its signature walked) derives from its product ``reduction`` and that another kernel reads
    too: that kernel would compute the product again. Whether one was marked (the kernel is
    then planned again). (A linear layer's ReLU output, which its dropout reads in the forward
    pass and ReLU's gradient in the backward pass: VGG-16's first classifier layer, 16 x 25088
    x 4096, ran twice in every training step.)"""
    if reduction is None or reduction.op is not Op.SUM or _summed_product(reduction) is None:
        return False
    inside = {id(n) for n in walk}
    derived = {id(reduction)}
    for at in walk:
        if at is root or is_boundary(at, root):
            continue
        if at is not reduction:
            if not any(id(src) in derived for src in at.srcs):
                continue
            derived.add(id(at))
        # (a view nothing computes from is no reader)
        if any(id(user) not in inside for user in _computed_from(at)):
            at.keep = True
            return True
    return False


# A value that another kernel computes from too is stored where computing it reads this many
# times its own elements or more: each kernel reading it would read all of that again, where
# stored it costs one write and a read a kernel. (ResNet-50's backward pass: the gradient of
# each stage's residual stream is a chain over its blocks, ReLU's mask of each block times the
# sum of the next one's gradients; fused into every reader, each of the blocks' batch norm
# gradients read up to 7 tensors of the stream's size to sum one, 14 of a 36 ms training
# step in reductions on an H200.)
_SHARED_READS = 3
# ... and it has this many elements or more: a smaller one costs its reads less than a launch
# (a decode step's residual stream, the embedding plus two products' outputs, stays fused)
_SHARED_MIN = 1 << 18
_SHARED_WALK = 256  # nodes the walk below a value visits at most (planning stays linear)


def _store_shared_work(root: Lazy, walk: list[Lazy], reduction: Lazy | None) -> bool:
    """Mark ``keep`` the first elementwise value of the kernel computing ``root`` (``walk``:
    the nodes its signature walked, consumers first; ``reduction``: the sum of its loop) that
    a node of another kernel computes from too, of _SHARED_MIN elements or more, and whose
    computation reads _SHARED_READS times its elements or more (``_elements_read``), or, where
    it is computed from a product no other kernel reads (``_lone_product``), more than its
    readers would read stored. Whether one was marked (the kernel is then planned again)."""
    inside = {id(n) for n in walk}
    for at in reversed(walk):
        if at is root or at.op not in ELEMENTWISE or at.numel < _SHARED_MIN or \
                is_boundary(at, root) or len(readers := at.readers()) < 2 and not any(
                    c.op in MOVEMENT for c in readers):
            continue
        outside = sum(1 for user in _computed_from(at) if id(user) not in inside)
        if not outside:
            continue
        inputs: list[Lazy] = []
        read = _elements_read(at, root, reduction, inputs=inputs)
        if read is None:
            continue
        # computed from a product of its own (a convolution's data gradient under ReLU's
        # mask), the value is stored by the product's epilogue in the product's place: each of
        # its readers then reads it once instead of what computing it reads, and the kernels
        # read `read` once and write it once (counted without the product's own store, which it
        # saves: a conservative count). Batch norm's gradient: its two sums and its data
        # gradient each read the mask and the convolution's output.
        kernels = outside + 1
        if read >= _SHARED_READS * at.numel or any(map(_lone_product, inputs)) and \
                kernels * read > read + kernels * at.numel:
            at.keep = True
            return True
    return False


# Conditions nested in a kernel at most: selections (``where``) and padding, each of which a
# kernel evaluates by branching around what only one side reads. NVIDIA's compiler (ptxas of
# CUDA 13.0, driver 580, through both CUDA and OpenCL) computes wrong values where 16 such
# branches nest and a barrier or warp shuffle follows, while 15 compute right (on an H200; -O0
# right at every depth): ResNet-101's backward pass at batch 2, 64 x 64, fused the gradient of
# its 23-block stage under every block's ReLU mask into each block's batch norm gradients, and
# 50 of 1,024 channels came out wrong. Stored every 8 conditions, such a chain also stops being
# computed again in each of its readers.
_NESTED_CONDITIONS = 8


def _cut_nested_conditions(root: Lazy, walk: list[Lazy]) -> bool:
    """Mark ``keep`` a value of the kernel computing ``root`` (``walk``: the nodes its
    signature walked, sources first) under which _NESTED_CONDITIONS conditions nest, on the
    path of the most, where more nest in the kernel. Whether one was marked (the kernel is then
    planned again)."""
    depth: dict[int, int] = {}
    for n in walk:
        if n is not root and is_boundary(n, root):
            depth[id(n)] = 0
            continue
        below = max((depth.get(id(s), 0) for s in n.srcs), default=0)
        depth[id(n)] = below + (n.op is Op.WHERE or n.op is Op.PAD)
    if depth[id(root)] <= _NESTED_CONDITIONS:
        return False
    at = root
    while depth[id(at)] > _NESTED_CONDITIONS or at.op in MOVEMENT:
        at = max(at.srcs, key=lambda s: depth.get(id(s), 0))
        if id(at) not in depth or is_boundary(at, root):
            return False
    if depth[id(at)] == 0:
        return False
    at.keep = True
    return True


def _lone_product(node: Lazy) -> bool:
    """Whether ``node`` is a tiled product (``_tiled_product``), not yet computed or marked,
    that one node alone reads."""
    return node.op is Op.SUM and not node.realized and not node.keep and \
        len(node.readers()) == 1 and _tiled_product(node)


def _elements_read(node: Lazy, root: Lazy, reduction: Lazy | None = None,
                   operand: bool = False, inputs: list[Lazy] | None = None) -> int | None:
    """The elements the kernel computing ``root`` (its loop summing ``reduction``) reads to
    compute ``node``: of each input below it (a buffer, a stored value, a reduction that
    another kernel computes, each appended to ``inputs`` where given), as many as ``node`` has
    at most (a broadcast vector counts its own). None where that loop's reduction is below it
    (the rules for reductions decide those), unless ``node`` is a product's ``operand`` (whose
    reductions other kernels compute)."""
    total, stack = 0, [node]
    seen: set[int] = set()
    while stack and len(seen) <= _SHARED_WALK:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if n.op in REDUCE and not operand and reduction is not None and \
                n.arg == reduction.arg and n.srcs[0].shape == reduction.srcs[0].shape:
            return None  # summed in this kernel's loop (its reduction or a stage beside it)
        if n is not node and (n.realized or is_boundary(n, root) or n.op in REDUCE):
            total += min(n.numel, node.numel)
            if inputs is not None:
                inputs.append(n)
            continue
        stack.extend(n.srcs)
    return total


# The processor stores gathered values that a kernel broadcasts this many times or more where
# computing one costs this much (elementwise ops, gathers 4): BERT's attention mask from its
# token mask (gathers, int64 index arithmetic) was computed again for each of 12 heads x 128
# queries in each of softmax's three passes, 15% of the model's time at batch 1. (Values
# computed without a gather stay fused: weights dequantized inside a product, an optimizer's
# bias corrections.)
_BROADCAST_FACTOR, _BROADCAST_COST, _BROADCAST_WALK = 8, 6, 64


def _store_broadcast_work(root: Lazy, walk: list[Lazy]) -> bool:
    """Mark ``keep`` each value that the processor's kernel computing ``root`` (``walk``: the
    nodes its signature walked) would compute again for every element it is broadcast to
    (see _BROADCAST_FACTOR). Whether any was marked (the kernel is then planned again)."""
    if _dialect(root.device) != "c":
        return False
    marked = False
    for at in walk:
        if at.op is not Op.EXPAND or at.realized or is_boundary(at, root):
            continue
        below = _under_movement(at.srcs[0])
        if below is root or below.realized or is_boundary(below, root) or \
                below.op not in ELEMENTWISE or at.numel < _BROADCAST_FACTOR * below.numel:
            continue
        # (the walk gives up past _BROADCAST_WALK nodes: planning stays linear in the kernel)
        seen: set[int] = set()
        cost, stack, reduced, gathers = 0, [below], False, False
        while stack and not reduced and len(seen) <= _BROADCAST_WALK:
            n = stack.pop()
            if id(n) in seen or n.realized or is_boundary(n, root):
                continue
            seen.add(id(n))
            # a statistic of this kernel's own reduction (a norm's scale) stays in it
            reduced = n.op in REDUCE
            gathers |= n.op is Op.GATHER
            if n.op in ELEMENTWISE or n.op is Op.GATHER:
                cost += 4 if n.op in _COSTLY or n.op is Op.GATHER else 1
            stack.extend(n.srcs)
        if not stack and not reduced and gathers and cost >= _BROADCAST_COST:
            below.keep = marked = True
    return marked


# Lowering is pure in the graph's structure, so kernels of the same structure (every step of a
# training loop, every call of the same expression) reuse it: the key is the graph down to the
# nodes lowering stops at, with buffers replaced by their shapes and dtypes.
_ast_cache: dict[tuple, tuple[lower.KernelAST, list[int]]] = {}


def _template(ast: lower.KernelAST) -> lower.KernelAST:
    """``ast`` without its graph nodes, to cache: users fill ``output`` and ``inputs`` back in
    with ``dataclasses.replace`` before the template is used."""
    # output=None breaks the field's type on purpose, only for as long as the template is cached
    return dataclasses.replace(ast, output=None, inputs=[], lins=[])  # type: ignore[arg-type]


def _with_nodes(template: lower.KernelAST, output: Lazy, inputs: list[Lazy]) -> lower.KernelAST:
    """A cached template with a graph's nodes filled in (``dataclasses.replace``, faster)."""
    ast = object.__new__(lower.KernelAST)
    ast.__dict__.update(template.__dict__)
    ast.output, ast.inputs, ast.lins = output, inputs, []
    return ast


def row_slice(node: Lazy) -> tuple[Lazy, int, int, int] | None:
    """(buffer node, byte offset, bytes, skip) where ``node`` is a shrink that reads one
    contiguous run of realized memory (``lazy.contiguous_run``: rows ``x[i:i + n]``, rows of
    rows ``x[:m][i:i + n]``, a crop ``idx[:, -k:]`` of a one-row ``idx``), which kernels read
    as a buffer of its own. The sub-buffer starts at the nearest offset below the run where
    the device can start one, and kernels skip the ``skip`` elements before the run, so a
    kernel depends on where its slice starts only through that remainder: a batch cut from a
    data set each step compiles at most a few kernels, none once every remainder was seen.
    Not while jit records (its replay substitutes whole buffers)."""
    if node.op is not Op.SHRINK or node.realized or recording is not None or node.numel == 0:
        return None
    run = contiguous_run(node)
    if run is None:
        return None
    base, first = run
    device = get_device(base.device)
    align = device.sub_buffer_align
    if not align:
        return None
    itemsize = device.storage_dtype(base.dtype).itemsize
    start = first * itemsize - (first * itemsize) % align
    skip = (first * itemsize - start) // itemsize
    return base, start, node.numel * itemsize + skip * itemsize, skip


def input_buffer(node: Lazy) -> Buffer:
    """The buffer a kernel reads for its input ``node`` (realized, or a row slice)."""
    if node.buffer is not None:
        return node.buffer
    rows = row_slice(node)
    assert rows is not None, f"input {node} is neither realized nor a row slice"
    base, offset, nbytes, _ = rows
    assert base.buffer is not None
    return get_device(base.device).sub_buffer(base.buffer, offset, nbytes)


def _signature(root: Lazy, spec: lower.KernelSpec) -> tuple[tuple, list[Lazy], dict[int, int]]:
    """The kernel's structure as a hashable key, the nodes walked (the key's positions refer
    to them) and the row slices read as buffers (their ids, each with the elements to skip).

    The walk stops where the kernel must read an input: realized memory, a copy, a
    ``contiguous``, and a reduction over another shape or other axes than ``spec``'s (the
    kernel of its own that computes it is keyed by its own walk). So a kernel's key is the
    same wherever in a graph it sits, and keying all kernels of a graph takes time linear in
    the graph, not in the graph times the kernels."""
    walk: list[Lazy] = []
    index: dict[int, int] = {}
    buffer_first: dict[int, int] = {}
    parts: list[tuple] = []
    leaves: dict[int, int] = {}

    def visit(node: Lazy) -> int:
        hit = index.get(id(node))
        if hit is not None:
            return hit
        stop = is_boundary(node, root)
        rows = row_slice(node) if not stop and node is not root else None
        if not stop and node.op in REDUCE and node is not root and (
                node.srcs[0].shape != spec.shape or node.arg != spec.reduce_axes):
            # choose_spec reads these fields of the reductions it meets
            part: tuple = ("reduced", node.op, node.shape, node.dtype.name,
                           node.srcs[0].shape, node.arg)
        elif rows is not None:
            leaves[id(node)] = rows[3]
            part = ("rows", node.shape, node.dtype.name, rows[3])
        elif stop:
            part = ("leaf", node.shape, node.dtype.name, node.op is Op.COPY,
                           buffer_first.setdefault(id(node.buffer), len(walk))
                           if node.buffer is not None else -1)
        else:
            srcs = tuple(visit(s) for s in node.srcs)
            part = (node.op, node.shape, node.dtype.name, plans.key_arg(node.arg), srcs)
        index[id(node)] = len(walk)
        walk.append(node)
        parts.append(part)
        return index[id(node)]

    visit(root)
    visit = None  # type: ignore[assignment]  # break the closure's cycle: walk's nodes die now
    return tuple(parts), walk, leaves


def count_kernels(outputs: Sequence[Lazy]) -> int:
    """How many kernels realizing ``outputs`` takes (no device needed)."""
    return sum(isinstance(i, KernelItem) for i in schedule(outputs))


# ---- running -----------------------------------------------------------------------------------
def alloc_for(device: Device, numel: int, dtype: DType) -> Buffer:
    device.check_dtype(dtype)
    return device.alloc(max(numel, 1) * device.storage_dtype(dtype).itemsize)


def to_storage(host: np.ndarray, dtype: DType, device: Device) -> np.ndarray:
    """A host array in the layout the device stores ``dtype`` in."""
    if dtype == bfloat16 and host.dtype != np.uint16:
        f = np.ascontiguousarray(host, dtype=np.float32).view(np.uint32)
        rounded = ((f + 0x7FFF + ((f >> 16) & 1)) >> 16).astype(np.uint16)
        host = np.where(np.isnan(host.astype(np.float32)), np.uint16(0x7FC0), rounded)
    store = device.storage_dtype(dtype)
    return np.ascontiguousarray(host, dtype=store.np)


def from_storage(raw: np.ndarray, dtype: DType) -> np.ndarray:
    if dtype == bfloat16:
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(dtype.np, copy=False)


def read_buffer(node: Lazy) -> np.ndarray:
    """The node's contents as a host array of its logical shape."""
    if node.buffer is None:  # a view: read it through a temporary contiguous copy
        temp = node.contiguous()
        realize(temp)
        return read_buffer(temp)
    host = buffer_to_host(node.buffer, get_device(node.device), node.numel, node.dtype)
    return host.reshape(node.shape)


def buffer_to_host(buffer: Buffer, device: Device, numel: int, dtype: DType) -> np.ndarray:
    """The first ``numel`` elements of a buffer of ``device`` as a flat host array."""
    raw: np.ndarray = np.empty(max(numel, 1), dtype=device.storage_dtype(dtype).np)
    buffer.copy_out(raw)
    return from_storage(raw[:numel], dtype)


# while a jit capture is running, every launch and device copy is appended here
recording: list[Callable[[], object]] | None = None

# while an anygpu.profile block runs, its recorder: launches go through it (copies, transfers
# and compiles report to it from runtime/base.py)
profiling: "Recorder | None" = None


# Set in a DataLoader worker started by fork (utils/data): why it must compute nothing (the
# parent's OpenMP threads and GPU drivers do not survive fork; a kernel there would hang).
refuse_reason: str | None = None


def run(items: list[Item]) -> None:
    """Run ``items`` in order. The list is consumed: each item is dropped from it once it ran,
    so that the buffers it read are freed as soon as nothing else reads them (a backward pass
    realized as one schedule had kept every layer's output gradient until its last kernel:
    MobileNet-V2's step without jit, batch 4 at 64 x 64 on the processor, peaked at 145 MiB
    rather than 81)."""
    if refuse_reason and any(not item.output.realized for item in items):
        raise RuntimeError(refuse_reason)
    _prebuild(items)
    for i, item in enumerate(items):
        items[i] = None  # type: ignore[call-overload]  # consumed (see the docstring)
        if item.output.realized:
            continue
        if isinstance(item, CopyItem):
            _run_copy(item.output)
        else:
            _run_kernel(item)


def _run_copy(node: Lazy) -> None:
    src = node.srcs[0]
    if src.buffer is None:  # a view: copy its elements through a contiguous temporary
        src = src.contiguous()
        realize(src)
    assert src.buffer is not None
    device = get_device(node.device)
    buf = alloc_for(device, node.numel, node.dtype)
    copy = TransferCopy(device, get_device(src.device), node.numel, node.dtype, [buf, src.buffer])
    copy()
    _record(copy)
    node.set_buffer(buf)


@dataclass
class Launch:
    """One kernel launch, ready to run: what ``jit`` records and benchmarks time."""

    program: Program
    buffers: list[Buffer]
    groups: tuple[int, ...]
    local: tuple[int, ...]
    name: str
    nbytes: int
    template: str = ""  # the hot-kernel template and its options, for ANYGPU_DEBUG
    flops: int = 0  # floating-point operations where a template knows them (anygpu.profile)

    def __call__(self, wait: bool = False) -> float | None:
        if profiling is not None:
            return profiling.launch(self, wait)
        return self.program(self.buffers, self.groups, self.local, wait=wait)


@dataclass
class DeviceCopy:
    """A copy within one device, recorded by jit like a launch: ``buffers`` is [dst, src]."""

    device: Device
    buffers: list[Buffer]

    def __call__(self, wait: bool = False) -> None:
        self.device.copy(self.buffers[0], self.buffers[1])


@dataclass
class TransferCopy:
    """A copy between devices (through the host), recorded by jit like a launch: ``buffers``
    is [dst, src]."""

    dst_device: Device
    src_device: Device
    numel: int
    dtype: DType
    buffers: list[Buffer]

    def __call__(self, wait: bool = False) -> None:
        dst, src = self.buffers
        host = buffer_to_host(src, self.src_device, self.numel, self.dtype)
        dst.copy_in(to_storage(host, self.dtype, self.dst_device).reshape(-1))


def _record(step: Launch | DeviceCopy | TransferCopy) -> None:
    if recording is not None:
        recording.append(step)


_compiled: dict[tuple, tuple[Program, ir.Kernel]] = {}


_features: dict[str, tuple[object, str, dict, tuple]] = {}


def _features_of(device: Device) -> tuple[dict, tuple]:
    """``device_features`` and their key, computed again only when the settings change."""
    settings, precision = config.get(), get_float32_matmul_precision()
    hit = _features.get(device.name)
    if hit is None or hit[0] is not settings or hit[1] != precision:
        features = device_features(device)
        hit = _features[device.name] = (settings, precision, features,
                                        tuple(sorted(features.items())))
    return hit[2], hit[3]


def device_features(device: Device) -> dict:
    """What ``lower.to_ir`` may use of ``device`` beyond its dialect (see its docstring)."""
    extra = device.info.extra
    features = {"cc": extra.get("cc", (0, 0)), "units": device.info.compute_units,
                "tf32": get_float32_matmul_precision() != "highest",
                "max_shared": extra.get("max_shared", 48 * 1024),
                "local_memory": device.info.local_memory}
    if extra.get("wgmma") and config.get().wgmma:
        features["wgmma"] = True
    if extra.get("subgroup") and config.get().subgroups:
        features["subgroup"] = extra["subgroup"]
    if device.dialect == "wgsl" and device.info.is_cpu:
        # processor adapters divide as IEEE does (see render.wgsl.DIV_HELPER)
        features["exact_division"] = True
    return features


# Kernels lowered and rendered ahead by _prebuild (their programs compiled in parallel), by the
# key of _compiled; prepare takes them from here.
_rendered: dict[tuple, tuple[ir.Kernel, str]] = {}


def _key(item: KernelItem, device: Device, features: tuple) -> tuple:
    return (_item_id(item), device.name, features)


def _item_id(item: KernelItem | plans.Step) -> int:
    """The signature number of a kernel item, or of a plan's step (replayed every step), looked
    up once and kept on it."""
    if item.sid is None:
        item.sid = signature_id(item.signature)
    return item.sid


_signature_ids: dict[tuple, int] = {}
_next_id = itertools.count()


def signature_id(signature: tuple) -> int:
    """A number for a kernel's signature, the same for equal signatures in this process (never
    reused): the caches of compiled kernels are keyed by it, as hashing a signature walks all
    of it (about 3 us; a step looked each of its kernels up three times)."""
    sid = _signature_ids.get(signature)
    if sid is None:
        sid = _signature_ids[signature] = next(_next_id)
    return sid


def _lower(item: KernelItem, device: Device, features: dict, feature_key: tuple,
           inputs: Sequence[Buffer] | None) -> tuple[ir.Kernel, str]:
    """The item's kernel and its source for ``device``, in a tuned configuration where one is
    stored (``inputs``: the buffers to tune on, None where they are not computed yet;
    ``feature_key``: ``features`` as ``_features_of`` keys them)."""
    ast = item.ast
    for p in [ast.output, *ast.inputs]:
        device.check_dtype(p.dtype)
    lowering = time.perf_counter()
    # what lowering reads of the device (see to_ir), not its name: another process's device
    key = (item.signature, device.dialect, device.info.max_local_size, feature_key)
    kept = disk.load("kernel", key) if item.signature else None
    if kept is None:
        kernel = lower.to_ir(ast, device.dialect, device.info.max_local_size, features)
        source = render(kernel, device.dialect, features)
        if item.signature:
            disk.save("kernel", key, (_for_launch(kernel), source))
    else:
        kernel, source = kept
    if "options" in kernel.meta:  # a template kernel: a tuned configuration may replace it
        kernel, source = tune.choose(device, ast, kernel, source, features, inputs or [])
    if config.get().debug >= 2:
        print(source, file=sys.stderr)
    if profiling is not None:
        profiling.lowered(device, kernel.name, lowering)
    return kernel, source


def _for_launch(kernel: ir.Kernel) -> ir.Kernel:
    """What a launch reads of ``kernel`` (its name, sizes and notes; its source compiles): the
    kernel without its statements, whose expressions were most of the time a warm first step
    spends reading its kernels back from disk. A template kernel keeps them: the tuner may
    read them."""
    return kernel if "options" in kernel.meta else dataclasses.replace(kernel, body=[])


def _prebuild(items: Sequence[Item]) -> None:
    """Lower the kernels of ``items`` that no earlier step compiled and compile their programs
    on several threads at once (a cold first step of a network compiles hundreds, one after
    another otherwise). Templates that the tuner would time on their inputs are left to
    ``prepare``, as is any kernel whose lowering fails here (it reports the error there)."""
    if len(items) < 2:
        return
    todo: dict[Device, list[tuple[str, str]]] = {}
    devices: dict[str, tuple[Device, dict, tuple]] = {}
    for item in items:
        if not isinstance(item, KernelItem) or item.output.realized or not item.signature:
            continue
        name = item.ast.output.device
        if name not in devices:
            device = get_device(name)
            devices[name] = (device, *_features_of(device))
        device, features, feature_key = devices[name]
        key = _key(item, device, feature_key)
        if key in _compiled or key in _rendered:
            continue
        if tune.level() > 0 and gemm.match(item.ast) is not None:
            continue
        try:
            kernel, source = _lower(item, device, features, feature_key, None)
        except Exception:  # noqa: BLE001 (prepare lowers it again and raises)
            continue
        if len(_rendered) > 4096:  # left by steps that failed before running them
            _rendered.clear()
        _rendered[key] = (kernel, source)
        if not device._disk_cached(source):
            todo.setdefault(device, []).append((source, kernel.name))
    for device, kernels in todo.items():
        if len(kernels) > 1:
            device.prebuild(kernels)


def prepare(item: KernelItem, out: Buffer | None = None) -> Launch:
    """Compile (cached) the item's kernel for its device; allocate its output unless given."""
    ast = item.ast
    node = ast.output
    device = get_device(node.device)
    features, feature_key = _features_of(device)
    key = _key(item, device, feature_key)
    hit = _compiled.get(key) if item.signature else None
    if hit is None:
        ready = _rendered.pop(key, None)
        kernel, source = ready if ready is not None else \
            _lower(item, device, features, feature_key,
                   [input_buffer(inp) for inp in ast.inputs])
        program = device.program(source, kernel.name)
        if "host_contraction" in kernel.meta:
            program = device.contraction_program(program, kernel.meta["host_contraction"])
        hit = (program, kernel)
        if item.signature:
            _compiled[key] = hit
    program, kernel = hit
    if out is None:
        out = alloc_for(device, node.numel, node.dtype)
    # inputs are scheduled, so realized, before the kernels that read them
    buffers = [out] + [input_buffer(inp) for inp in ast.inputs]
    groups: tuple[int, ...] = (kernel.groups,)
    if device.dialect == "wgsl":
        groups = launch_groups(kernel.groups)
    return Launch(program, buffers, groups, (kernel.local,), kernel.name,
                  kernel.meta.get("bytes", 0), kernel.meta.get("template", ""),
                  kernel.meta.get("flops", 0))


def _launch(item: KernelItem, launch: Launch) -> None:
    """Run ``launch``, the kernel of ``item``; checked against the processor's while kernels
    are (``anygpu.graph.check``)."""
    if config.get().check and launch.program.device.backend != "cpu":
        check.run(item, launch)
    else:
        launch()


def _run_kernel(item: KernelItem) -> None:
    launch = prepare(item)
    if config.get().debug >= 1:
        start = time.perf_counter()
        seconds = launch(wait=True) or 0.0
        host = time.perf_counter() - start
        device = launch.program.device
        print(f"{device.name:10s} {launch.name:32s} {seconds * 1e6:9.1f} us  "
              f"{launch.nbytes / 2**20:9.2f} MiB  "
              f"{launch.nbytes / max(seconds, 1e-12) / 1e9:8.1f} GB/s  "
              f"(host {host * 1e6:.0f} us)"
              f"{'  [' + launch.template + ']' if launch.template else ''}", file=sys.stderr)
    else:
        _launch(item, launch)
    _record(launch)
    for node in item.fused:
        node.computed = True
    item.ast.output.set_buffer(launch.buffers[0])


def realize(*nodes: Lazy, plan_order: Sequence[Lazy] | None = None) -> None:
    """Compute ``nodes`` into device buffers (launches are queued; this does not wait), in
    their order; ``plan_order``: the order to plan their kernels in (``schedule``).

    A view of realized memory stays a view: giving it a copy of its own would cut it off from
    the memory it shows (a parameter living in an optimizer's flat buffer)."""
    pending = [n for n in nodes if not n.realized and not is_view_of_buffer(n)]
    if pending:
        if plan_order is not None:  # the pending nodes by their place in it (others last)
            rank: dict[int, int] = {}
            for i, n in enumerate(plan_order):
                rank.setdefault(id(n), i)
            plan_order = sorted(pending, key=lambda n: rank.get(id(n), len(rank)))
        run(schedule(pending, plan_order))


def _reads_only_at(ast: lower.KernelAST, buf_name: str, index: ir.Expr) -> bool:
    """Whether every load of ``buf_name`` in the kernel reads at ``index`` (the store index)."""
    seen: set[int] = set()
    stack = [ast.out_value, *(s.value for s in ast.stages)]
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if e.op == "load" and e.arg == buf_name and (e.srcs[0] is not index or len(e.srcs) > 1):
            return False
        stack.extend(e.srcs)
    return True


# (signature number, k) -> the kernel writing input k in place: template, signature, number
_in_place: dict[tuple[int, int], tuple[lower.KernelAST, tuple, int]] = {}
_reads_own: dict[tuple[int, int], bool] = {}  # -> whether input k is read only in place


def _in_place_item(item: KernelItem, k: int, value: Lazy) -> KernelItem:
    """``item``'s kernel writing into its input ``k`` (computing ``value``)."""
    inputs = item.ast.inputs[:k] + item.ast.inputs[k + 1:]
    if not item.signature:  # a kernel no cache keeps
        return KernelItem(dataclasses.replace(lower.write_in_place(item.ast, k), output=value,
                                              inputs=inputs))
    cached = _in_place.get((_item_id(item), k))
    if cached is None:  # cached without graph nodes, like _ast_cache
        signature = (item.signature, "in place", k)
        cached = _in_place[(_item_id(item), k)] = (_template(lower.write_in_place(item.ast, k)),
                                             signature, signature_id(signature))
    template, signature, sid = cached
    return KernelItem(dataclasses.replace(template, output=value, inputs=inputs), signature,
                      sid=sid)


def _writes_in_place(item: KernelItem, ast: lower.KernelAST, k: int) -> bool:
    """Whether the kernel reads its input ``k`` only at the position it writes (kept by the
    kernel's signature: an optimizer's update asks again every step)."""
    if not item.signature:
        return _reads_only_at(ast, f"b{k + 1}", ast.out_index)
    key = (_item_id(item), k)
    hit = _reads_own.get(key)
    if hit is None:
        hit = _reads_only_at(ast, f"b{k + 1}", ast.out_index)
        if len(_reads_own) > 4096:
            _reads_own.clear()
        _reads_own[key] = hit
    return hit

# A value written in place shares the target's buffer. Before the next write into that buffer,
# the values still alive get a copy of their own, so they keep what they were (PyTorch's copy_
# leaves its source alone). Keyed by id(buffer); each entry is checked against the buffer.
_aliases: dict[int, list[weakref.ref]] = {}


def _detach_aliases(target: Lazy, device: Device) -> None:
    assert target.buffer is not None
    for ref in _aliases.pop(id(target.buffer), []):
        node = ref()
        if node is None or node is target or node.buffer is not target.buffer:
            continue
        own = alloc_for(device, node.numel, node.dtype)
        copy = DeviceCopy(device, [own, target.buffer])
        copy()
        _record(copy)
        node.buffer = own


def _keep_old_values(target: Lazy, device: Device) -> None:
    """Point the computations still pending on ``target`` (through its views) at a copy of
    its memory as it is now, before a write changes it: intermediate values such as
    ``out = (w * 3).exp()``, fused into a loss computed earlier but not stored, keep reading
    the old values when read after an optimizer step. The views themselves (a parameter is a
    view of its optimizer's flat buffer) keep showing the target."""
    chain = {id(target)}
    pending: list[tuple[Lazy, Lazy]] = []  # (computation, the view of target it reads)
    stack = [target]
    while stack:
        node = stack.pop()
        for ref in node.consumers:
            c = ref()
            if c is None or c.realized or not any(s is node for s in c.srcs):
                continue
            if c.op in MOVEMENT:
                if id(c) not in chain:
                    chain.add(id(c))
                    stack.append(c)
            else:
                pending.append((c, node))
    if not pending:
        return
    assert target.buffer is not None
    own = alloc_for(device, target.numel, target.dtype)
    copy = DeviceCopy(device, [own, target.buffer])
    copy()
    _record(copy)
    mirrors = {id(target): Lazy.from_buffer(own, target.shape, target.dtype, target.device)}

    def mirror(node: Lazy) -> Lazy:
        hit = mirrors.get(id(node))
        if hit is None:
            hit = mirrors[id(node)] = Lazy(node.op, (mirror(node.srcs[0]),), node.arg,
                                           node.shape, node.dtype, node.device)
        return hit

    for c, view in pending:
        old = mirror(view)
        c.srcs = tuple(old if s is view else s for s in c.srcs)
        old.consumers.append(weakref.ref(c))


def realize_into(value: Lazy, target: Lazy) -> None:
    """Compute ``value`` into ``target``'s buffer, in place where every element only reads
    its own position of the target (an optimizer update), else through a temporary.

    Computations built before the write read the old values, as in eager PyTorch: those still
    alive (held by a tensor, not only fused into ``value``) are computed first."""
    if target.buffer is None or target.op is not Op.BUFFER:
        raise ValueError("assign needs a realized tensor that owns its memory, not a view")
    if value.shape != target.shape or value.dtype != target.dtype:
        raise ValueError(f"assign of {value.shape} {value.dtype.name} into {target.shape} "
                         f"{target.dtype.name}")
    device = get_device(target.device)
    _detach_aliases(target, device)
    if not value.realized and row_slice(value) is not None:
        value = value.contiguous()  # rows of memory read as a buffer have no kernel of their own
    items = [] if value.realized else schedule([value])
    if items and isinstance(items[-1], KernelItem) and items[-1].output is value:
        # the last kernel holds what it needs; cut loose, the nodes value fused in stay alive
        # only where something else holds them, and those are computed before the write (the
        # item's own list of them let go too: it had kept Adam's ``m * beta1`` alive, which
        # then ran as a kernel of its own before the update, a pass over the moments more)
        value.srcs = ()
        items[-1].fused = []
    readers = pending_readers(target, value)
    if readers:
        run(schedule(readers))
    _keep_old_values(target, device)
    if value.realized:
        if value.buffer is not target.buffer:
            assert value.buffer is not None
            copy = DeviceCopy(device, [target.buffer, value.buffer])
            copy()
            _record(copy)
        return
    run(items[:-1])
    last = items[-1]
    if isinstance(last, KernelItem):
        ast = last.ast
        names = {id(n.buffer): i for i, n in enumerate(ast.inputs)}
        k = names.get(id(target.buffer))
        # rows of the target read as a buffer of their own alias it: write through a temporary
        aliased = any(n.buffer is None and (rows := row_slice(n)) is not None and
                      rows[0].buffer is target.buffer for n in ast.inputs)
        if not aliased and (k is None or (not ast.stages and
                                          _writes_in_place(last, ast, k))):
            item = last if k is None else _in_place_item(last, k, value)
            launch = prepare(item, out=target.buffer)
            _launch(item, launch)
            _record(launch)
            value.set_buffer(target.buffer)
            _aliases.setdefault(id(target.buffer), []).append(weakref.ref(value))
            return
    run([last])
    assert value.buffer is not None
    copy = DeviceCopy(device, [target.buffer, value.buffer])
    copy()
    _record(copy)


_row_writes: dict[tuple, lower.KernelAST] = {}


def write_rows(target: Lazy, dim: int, index: Lazy, value: Lazy) -> None:
    """Rows of ``target`` along ``dim`` become ``value``'s, in place: row ``index[r]`` (an
    integer vector) takes ``value``'s row ``r``. One kernel over ``value``'s elements, with
    ``value`` computed inside it where it is elementwise, so a write costs the rows written,
    not the whole target (a KV cache taking its new tokens). A negative index counts from the
    end; one outside ``target``'s rows writes nothing; where two indices name one row, one of
    the two values stays.

    As with ``realize_into``, computations built before the write read the old values."""
    if target.buffer is None or target.op is not Op.BUFFER:
        raise ValueError("write_rows needs a realized tensor that owns its memory, not a view")
    device = get_device(target.device)
    _detach_aliases(target, device)
    if index.buffer is None and row_slice(index) is None:
        if is_view_of_buffer(index):
            index = index.contiguous()
        realize(index)  # once: the next write with the same index reads this buffer
    if value.realized or row_slice(value) is not None:
        value = value.contiguous()  # a kernel that reads it, made to store rows below
    items = schedule([value])
    if not isinstance(items[-1], KernelItem):  # a copy from another device: it lands first
        run(items)
        value = value.contiguous()
        items = schedule([value])
    last = items[-1]
    assert isinstance(last, KernelItem) and last.output is value
    ast = last.ast
    fused = not ast.reduce and not ast.stages and not any(
        n.buffer is target.buffer or n.buffer is None and (rows := row_slice(n)) is not None
        and rows[0].buffer is target.buffer for n in ast.inputs) and (
        ast.index_dtype != dt_int32 or target.numel < 2**31 - 1)
    if fused:
        run(items[:-1])
    else:  # computed into a buffer of its own first (it reads the target, or reduces)
        run(items)
        value = value.contiguous()
        last = schedule([value])[-1]
        assert isinstance(last, KernelItem)
        ast = last.ast
    readers = pending_readers(target, value)
    if readers:
        run(schedule(readers))
    _keep_old_values(target, device)
    key = (last.signature, "rows", dim, target.shape, index.dtype, index.numel)
    template = _row_writes.get(key)
    if template is None:
        template = _template(lower.rows_written(ast, index, dim, target))
        _row_writes[key] = template
        if len(_row_writes) > 1024:
            _row_writes.pop(next(iter(_row_writes)))
    written = dataclasses.replace(template, output=target, inputs=[*ast.inputs, index])
    item = KernelItem(written, key)
    launch = prepare(item, out=target.buffer)
    _launch(item, launch)
    _record(launch)
