"""Partition a lazy graph into kernels and transfers, and run them.

``schedule`` walks from the nodes to realize down to realized buffers. Each kernel is built by
``codegen.lower``, which fuses everything it can and names the nodes it needs as inputs; those are
scheduled first. ``run`` lowers each kernel for its device, renders, compiles (cached), allocates
the output from the device's caching allocator and launches without waiting.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from anygpu import config
from anygpu.codegen import lower
from anygpu.codegen.render.cstyle import render
from anygpu.dtype import DType, bfloat16
from anygpu.graph.lazy import Lazy
from anygpu.ops.primitives import Op
from anygpu.runtime.base import Buffer, Device
from anygpu.runtime.registry import get_device


@dataclass
class KernelItem:
    ast: lower.KernelAST

    @property
    def output(self) -> Lazy:
        return self.ast.output


@dataclass
class CopyItem:
    output: Lazy  # a COPY node; its source is realized on another device


Item = KernelItem | CopyItem


def schedule(outputs: Sequence[Lazy]) -> list[Item]:
    """The kernels and copies that realize ``outputs``, dependencies first."""
    items: list[Item] = []
    planned: set[int] = set()
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20000))
    try:
        for out in outputs:
            _visit(out, items, planned)
    finally:
        sys.setrecursionlimit(limit)
    return items


def _visit(node: Lazy, items: list[Item], planned: set[int]) -> None:
    if node.realized or id(node) in planned:
        return
    planned.add(id(node))
    if node.op is Op.COPY:
        _visit(node.srcs[0], items, planned)
        items.append(CopyItem(node))
        return
    ast = lower.build_kernel(lower.choose_spec(node))
    for dep in ast.inputs:
        _visit(dep, items, planned)
    items.append(KernelItem(ast))


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
    """The realized node's contents as a host array of its logical shape."""
    assert node.buffer is not None
    device = get_device(node.device)
    store = device.storage_dtype(node.dtype)
    raw = np.empty(max(node.numel, 1), dtype=store.np)
    node.buffer.copy_out(raw)
    return from_storage(raw[:node.numel], node.dtype).reshape(node.shape)


def run(items: list[Item]) -> None:
    for item in items:
        if item.output.realized:
            continue
        if isinstance(item, CopyItem):
            _run_copy(item.output)
        else:
            _run_kernel(item.ast)


def _run_copy(node: Lazy) -> None:
    host = read_buffer(node.srcs[0])
    device = get_device(node.device)
    buf = alloc_for(device, node.numel, node.dtype)
    buf.copy_in(to_storage(host, node.dtype, device).reshape(-1))
    node.set_buffer(buf)


_lowered: dict[tuple, tuple] = {}


def _run_kernel(ast: lower.KernelAST) -> None:
    node = ast.output
    device = get_device(node.device)
    for p in [node, *ast.inputs]:
        device.check_dtype(p.dtype)
    kernel = lower.to_ir(ast, device.dialect, device.info.max_local_size)
    source = render(kernel, device.dialect)
    program = device.program(source, kernel.name)
    out = alloc_for(device, node.numel, node.dtype)
    buffers = [out] + [inp.buffer for inp in ast.inputs]  # type: ignore[list-item]
    groups = (kernel.groups,)
    if device.dialect == "wgsl":
        from anygpu.codegen.render.wgsl import launch_groups
        groups = launch_groups(kernel.groups)
    debug = config.get().debug
    if debug >= 2:
        print(source, file=sys.stderr)
    if debug >= 1:
        start = time.perf_counter()
        seconds = program(buffers, groups, (kernel.local,), wait=True) or 0.0
        host = time.perf_counter() - start
        nbytes = kernel.meta.get("bytes", 0)
        print(f"{device.name:10s} {kernel.name:32s} {seconds * 1e6:9.1f} us  "
              f"{nbytes / 2**20:9.2f} MiB  {nbytes / max(seconds, 1e-12) / 1e9:8.1f} GB/s  "
              f"(host {host * 1e6:.0f} us)", file=sys.stderr)
    else:
        program(buffers, groups, (kernel.local,))
    node.set_buffer(out)


def realize(*nodes: Lazy) -> None:
    """Compute ``nodes`` into device buffers (launches are queued; this does not wait)."""
    pending = [n for n in nodes if not n.realized]
    if pending:
        run(schedule(pending))
