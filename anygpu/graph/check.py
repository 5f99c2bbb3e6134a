"""Kernels checked against the processor (``ANYGPU_CHECK``).

Each kernel that a device other than the processor runs is run again by the processor's backend,
lowered from the same kernel description, on the same input bytes, and the two outputs are
compared. It finds a driver's or a compiler's wrong results and names the kernel: NVIDIA's
compiler got ResNet-101's batch norm gradients wrong on an H200 (see
``schedule._NESTED_CONDITIONS``), which a checked step names at once.

``ANYGPU_CHECK=1`` raises :class:`~anygpu.KernelMismatchError` at the first output that differs;
``ANYGPU_CHECK=2`` warns once per kernel and carries on with the processor's output, so that
a run on a device that computes some kernel wrong still computes right. Slow: every kernel
waits for the device and copies its buffers to the host. jit's replays are not checked (the
kernels they replay were, when jit recorded them).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from anygpu import config
from anygpu.codegen import lower
from anygpu.codegen.render.cstyle import render
from anygpu.dtype import DType, float32
from anygpu.runtime.base import Buffer, Device, KernelMismatchError, SubBuffer
from anygpu.runtime.registry import get_device

if TYPE_CHECKING:
    from anygpu.graph.schedule import KernelItem, Launch

# how far a float output may lie from the processor's, relative to its largest value: sums in
# another order, other rounding of transcendental functions; tf32 products and kernels that
# read or write 16-bit floats round far more
EXACT_TOLERANCE = 1e-3
ROUNDED_TOLERANCE = 2e-2

_warned: set[str] = set()


def run(item: "KernelItem", launch: "Launch") -> None:
    """Run ``launch`` (the kernel of ``item``), then the processor's kernel on the bytes its
    buffers held before it ran (an in-place write reads what it overwrites), and compare."""
    from anygpu.graph import schedule as sched

    device = launch.program.device
    ast = item.ast
    nodes = [ast.output, *ast.inputs]
    before = [_read(b) for b in launch.buffers]
    launch(wait=True)
    cpu = get_device("cpu")
    features, _ = sched._features_of(cpu)
    try:
        kernel = lower.to_ir(ast, "c", cpu.info.max_local_size, features)
        source = render(kernel, "c", features)
        program = cpu.program(source, kernel.name)
        if "host_contraction" in kernel.meta:
            program = cpu.contraction_program(program, kernel.meta["host_contraction"])
        buffers = [_to_processor(data, node.dtype, device, cpu)
                   for data, node in zip(before, nodes)]
    except Exception as err:  # noqa: BLE001 (a kernel the processor cannot run is not checked)
        _warn_once(launch.name, f"{device.name}: kernel {launch.name} is not checked: the "
                                f"processor cannot run it ({err})")
        return
    program(buffers, (kernel.groups,), (kernel.local,), wait=True)
    dtype, numel = ast.output.dtype, ast.output.numel
    got = _values(_read(launch.buffers[0]), dtype, device, numel)
    want = _values(_read(buffers[0]), dtype, cpu, numel)
    rounded = sched._features_of(device)[0].get("tf32") or any(
        node.dtype != float32 for node in nodes if node.dtype.is_float)
    tolerance = ROUNDED_TOLERANCE if rounded else EXACT_TOLERANCE
    # a sum that cancels (a bias's gradient under batch norm: about 1e-8) differs by the
    # rounding of what it sums, so differences count against the inputs' size too
    size = max((_largest(_values(data, node.dtype, device)) for data, node in
                zip(before[1:], ast.inputs) if node.dtype.is_float), default=0.0)
    found = _differences(got, want, tolerance, size)
    if found is None:
        return
    wrong, largest, scale = found
    first = int(wrong[0])
    where = _keep_sources(item, device, launch.name, source)
    message = (f"{device.name}: kernel {launch.name}"
               f"{' [' + launch.template + ']' if launch.template else ''} computed {len(wrong)} "
               f"of {numel} elements unlike the processor (largest difference {largest:.2e}, "
               f"the largest value {scale:.2e}; element {first}: {got[first]!r} against "
               f"{want[first]!r}). The two kernels' sources: {where}")
    if config.get().check < 2:
        raise KernelMismatchError(message)
    _warn_once(launch.name, message + "; the processor's output is used")
    fixed = sched.to_storage(want.astype(dtype.np, copy=False), dtype, device).reshape(-1)
    if fixed.nbytes == launch.buffers[0].nbytes:
        launch.buffers[0].copy_in(fixed)


def _read(buffer: Buffer) -> np.ndarray:
    if isinstance(buffer, SubBuffer):  # (a WebGPU range cannot be read on its own)
        return _read(buffer.base)[buffer.offset:buffer.offset + buffer.nbytes]
    host = np.empty(buffer.nbytes, np.uint8)
    buffer.copy_out(host)
    return host


def _to_processor(data: np.ndarray, dtype: DType, device: Device, cpu: Device) -> Buffer:
    """A processor buffer holding the elements ``data`` (a buffer of ``device``) holds."""
    from anygpu.graph.schedule import from_storage, to_storage

    theirs, ours = device.storage_dtype(dtype).np, cpu.storage_dtype(dtype).np
    if theirs != ours:
        count = data.nbytes // np.dtype(theirs).itemsize
        elements = from_storage(data[:count * np.dtype(theirs).itemsize].view(theirs), dtype)
        data = to_storage(elements, dtype, cpu).reshape(-1).view(np.uint8)
    buffer = cpu.alloc(max(data.nbytes, 1))
    if data.nbytes:
        buffer.copy_in(data)
    return buffer


def _values(data: np.ndarray, dtype: DType, device: Device,
            numel: int | None = None) -> np.ndarray:
    """The first ``numel`` elements (all where None) of a buffer's bytes ``data``."""
    from anygpu.graph.schedule import from_storage

    storage = np.dtype(device.storage_dtype(dtype).np)
    count = data.nbytes // storage.itemsize if numel is None else numel
    return from_storage(data[:count * storage.itemsize].view(storage), dtype)


def _largest(values: np.ndarray) -> float:
    finite = np.abs(values[np.isfinite(values)].astype(np.float64))
    return float(finite.max()) if finite.size else 0.0


def _differences(got: np.ndarray, want: np.ndarray, tolerance: float,
                 inputs: float = 0.0) -> tuple[np.ndarray, float, float] | None:
    """(the flat indices that differ, the largest difference, the largest value), or None.
    Floats differ by more than ``tolerance`` of the largest finite value (or of ``inputs``, the
    largest input, where larger), or in where they are NaN or infinite (but for values both
    within 2^10 of the range's end); other types differ at all."""
    if not np.issubdtype(want.dtype, np.floating):
        wrong = np.flatnonzero(got != want)
        largest = float(np.abs(got.astype(np.float64) - want).max()) if wrong.size else 0.0
        scale = float(np.abs(want.astype(np.float64)).max()) if want.size else 0.0
        return (wrong, largest, scale) if wrong.size else None
    g, w = got.astype(np.float64), want.astype(np.float64)
    finite = np.isfinite(w)
    scale = _largest(w)
    # both near the end of the range, one past it (a sum fused into a multiply-add there, apart
    # elsewhere; a product of three reassociated, 2 * x * g): not a difference
    edge = float(np.finfo(want.dtype).max) / 1024
    with np.errstate(invalid="ignore"):
        off = np.abs(g - w)
        overflowed = (np.sign(g) == np.sign(w)) & (np.minimum(np.abs(g), np.abs(w)) > edge)
        wrong = np.flatnonzero(~overflowed & np.where(
            finite, ~(off <= tolerance * max(scale, inputs)),
            ~((g == w) | (np.isnan(g) & np.isnan(w)))))
    if not wrong.size:
        return None
    largest = float(np.nanmax(np.where(finite & np.isfinite(g), off, np.inf)[wrong]))
    return wrong, largest, scale


def _keep_sources(item: "KernelItem", device: Device, name: str, processor: str) -> str:
    """Write the device's and the processor's sources of the kernel to the cache folder; the
    folder, or why they are not there."""
    from anygpu.graph import schedule as sched

    folder = config.get().cache_path / "mismatches"
    try:
        features, key = sched._features_of(device)
        _, source = sched._lower(item, device, features, key, None)
        folder.mkdir(parents=True, exist_ok=True)
        Path(folder, f"{name}.{device.dialect}.txt").write_text(source)
        Path(folder, f"{name}.c.txt").write_text(processor)
    except Exception as err:  # noqa: BLE001 (the message says so)
        return f"not written ({err})"
    return f"{folder}/{name}.{device.dialect}.txt and {name}.c.txt"


def _warn_once(name: str, message: str) -> None:
    if name not in _warned:
        _warned.add(name)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
