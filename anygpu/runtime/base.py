"""The protocols every backend implements, and the machinery they share.

A backend is one subclass of :class:`Device` in ``runtime/<name>.py``. It supplies raw memory
(``_alloc``/``_free``), transfers, a compiler from source text to a binary, and a loader from a
binary to a :class:`Program`. Everything else here is shared: the caching allocator with its
out-of-memory retry, the on-disk binary cache, and :class:`Buffer` lifetimes.

>>> from anygpu.runtime.registry import get_device
>>> dev = get_device("cpu")
>>> buf = dev.alloc(16)
>>> buf.nbytes
16
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from anygpu import config
from anygpu.dtype import DType

if TYPE_CHECKING:
    from anygpu.profile.record import Recorder

# While an ``anygpu.profile`` block runs, its recorder (None otherwise): told here of copies,
# transfers between host and device and programs built; graph/schedule.py tells it of launches.
profiling: "Recorder | None" = None

# A kernel compiled in one library with others (see Device.prebuild) is cached as a note of that
# library's file and the kernel's symbol in it, not as a binary of its own
SHARED_MARK = b"anygpu-shared-library\n"
# kernels compiled together at most: one compiler run for many small kernels is several times
# faster than one run each (a compiler's start, its libraries and the link cost more than a
# small kernel)
CHUNK = 64


class DeviceError(RuntimeError):
    """A device failed (driver error, compile error, unsupported feature)."""


class OutOfMemoryError(DeviceError, MemoryError):
    """A device could not allocate the memory asked for, even after freeing its cache."""


class UnsupportedError(DeviceError, TypeError):
    """The device cannot run this (a dtype, an op, a feature); the message says which."""


class KernelMismatchError(DeviceError):
    """A kernel's output on a device differs from the processor's on the same inputs (raised
    only while kernels are checked: ``ANYGPU_CHECK``)."""


@dataclass
class DeviceInfo:
    name: str  # the product name the driver reports
    memory: int  # bytes of global memory
    compute_units: int  # SMs, CUs, EUs or cores
    driver: str  # driver / runtime version, part of the program cache key
    max_local_size: int = 1024  # threads per work-group
    local_memory: int = 48 * 1024  # bytes of local (shared) memory per work-group
    is_cpu: bool = False  # the processor itself (the cpu backend, PoCL, lavapipe)
    extra: dict[str, Any] = field(default_factory=dict)


class Program:
    """A compiled kernel. Calling it launches on the device queue without waiting.

    ``groups`` is the number of work-groups in each of up to three dimensions and ``local`` the
    threads in each work-group (CUDA's grid and block). With ``wait=True`` the call blocks until the
    kernel finishes and returns its run time in seconds, measured by device timers where the
    backend has them.
    """

    def __init__(self, device: "Device", name: str):
        self.device, self.name = device, name

    def __call__(self, buffers: Sequence["Buffer"], groups: Sequence[int] = (1,),
                 local: Sequence[int] = (1,), wait: bool = False) -> float | None:
        raise NotImplementedError


class Buffer:
    """Device memory of ``nbytes`` bytes. Returned to its device's cache when collected."""

    __slots__ = ("device", "nbytes", "handle", "__weakref__")

    def __init__(self, device: "Device", nbytes: int, handle: Any):
        self.device, self.nbytes, self.handle = device, nbytes, handle

    def __del__(self) -> None:
        try:
            self.device.allocator.release(self.nbytes, self.handle)
        except Exception:  # interpreter shutdown: the driver may be gone already
            pass

    def copy_in(self, host: np.ndarray) -> None:
        """Copy a contiguous host array (exactly ``nbytes``) into this buffer."""
        data = np.ascontiguousarray(host)
        if data.nbytes != self.nbytes:
            raise ValueError(f"copy_in of {data.nbytes} bytes into a buffer of {self.nbytes}")
        if profiling is not None:
            profiling.transfer(self.device, "upload", data.nbytes,
                               lambda: self.device._copy_in(self.handle, data))
            return
        self.device._copy_in(self.handle, data)

    def copy_out(self, host: np.ndarray) -> np.ndarray:
        """Copy this buffer into a contiguous host array of ``nbytes`` (waits for the device)."""
        if host.nbytes != self.nbytes or not host.flags.c_contiguous:
            raise ValueError(f"copy_out into {host.nbytes} bytes from a buffer of {self.nbytes}")
        if profiling is not None:
            profiling.transfer(self.device, "download", host.nbytes,
                               lambda: self.device._copy_out(host, self.handle))
            return host
        self.device._copy_out(host, self.handle)
        return host


class SubBuffer(Buffer):
    """Bytes ``offset`` to ``offset + nbytes`` of another buffer, bound to kernels as a buffer of
    its own (a slice of a tensor's rows, so that kernels reading it do not depend on where the
    slice starts). It keeps its base alive and frees nothing."""

    __slots__ = ("base", "offset")

    def __init__(self, base: Buffer, offset: int, nbytes: int, handle: Any):
        self.device, self.nbytes, self.handle = base.device, nbytes, handle
        self.base, self.offset = base, offset

    def __del__(self) -> None:
        pass


class QueueTimer:
    """Times of work queued on one device, read once the work is done.

    ``launch`` and ``around`` queue work between two timestamps and return its index;
    ``times`` waits for the device and gives every (start, end) so far, in seconds of the
    timer's clock, in the order queued. Backends with device timers (CUDA and HIP events,
    OpenCL profiling, WebGPU timestamps) return without waiting and set ``device_clock``:
    their clock has an origin of its own, which ``anygpu.profile`` aligns to the host's.

    This default waits for the device before and after each piece of work and reads the host
    clock (``time.perf_counter``): the run time itself on the cpu backend, whose work runs
    synchronously, and a stand-in for devices without timers.

    >>> from anygpu.runtime.registry import get_device
    >>> dev = get_device("cpu")
    >>> timer = dev.queue_timer()
    >>> a, b = dev.alloc(64), dev.alloc(64)
    >>> timer.around(lambda: dev.copy(a, b))
    0
    >>> start, end = timer.times()[0]
    >>> end >= start
    True
    """

    device_clock = False

    def __init__(self, device: "Device"):
        self.device = device
        self._times: list[tuple[float, float]] = []

    def launch(self, program: "Program", buffers: Sequence["Buffer"], groups: Sequence[int],
               local: Sequence[int]) -> int:
        """Queue ``program`` on ``buffers`` (as ``Program.__call__`` does), timed."""
        return self.around(lambda: program(buffers, groups, local))

    def around(self, fn: Callable[[], object]) -> int:
        """Run ``fn``, which queues work on the device (a copy, a graph), timed."""
        self.device.synchronize()
        start = time.perf_counter()
        fn()
        self.device.synchronize()
        self._times.append((start, time.perf_counter()))
        return len(self._times) - 1

    def times(self) -> list[tuple[float, float]]:
        """(start, end) of everything timed so far, in order; waits for the device."""
        return self._times

    def close(self) -> None:
        """Free what the timer holds on the device (events, query sets)."""


class CachingAllocator:
    """Keeps freed buffers by size and hands them out again, so steady-state loops allocate nothing.

    When the device reports out of memory, the cache is freed and the allocation tried once more;
    a second failure raises :class:`OutOfMemoryError` naming the device and the size.
    """

    def __init__(self, device: "Device"):
        self.device = device
        self.free_lists: dict[int, list[Any]] = defaultdict(list)
        # reentrant: Buffer.__del__ releases into the cache, and the cycle collector may run it
        # on this thread while alloc or release already holds the lock
        self.lock = threading.RLock()
        self.in_use = 0
        self.cached = 0
        self.peak = 0

    def alloc(self, nbytes: int) -> Any:
        size = max(int(nbytes), 1)
        with self.lock:
            if self.free_lists[size]:
                self.cached -= size
                handle = self.free_lists[size].pop()
                self._count(size)
                return handle
        try:
            handle = self.device._alloc(size)
        except MemoryError:
            self.empty_cache()
            try:
                handle = self.device._alloc(size)
            except MemoryError as err:
                raise OutOfMemoryError(
                    f"{self.device.name}: out of memory allocating {size} bytes "
                    f"({size / 2**20:.1f} MiB); {self.in_use / 2**20:.1f} MiB in use") from err
        with self.lock:
            self._count(size)
        return handle

    def _count(self, size: int) -> None:
        self.in_use += size
        self.peak = max(self.peak, self.in_use)

    def release(self, nbytes: int, handle: Any) -> None:
        size = max(int(nbytes), 1)
        with self.lock:
            self.in_use -= size
            # collected in a reference cycle, the driver's own wrapper may have been finalized
            # first: such a handle is gone and must not be handed out again
            if not self.device._reusable(handle):
                return
            self.free_lists[size].append(handle)
            self.cached += size

    def empty_cache(self) -> None:
        """Give every cached buffer back to the driver."""
        with self.lock:
            lists, self.free_lists, self.cached = self.free_lists, defaultdict(list), 0
        self.device.synchronize()
        for handles in lists.values():
            for handle in handles:
                self.device._free(handle)


class Device:
    """One device of one backend, named like ``"cuda:0"``.

    Subclasses set ``backend`` and ``dialect`` (the renderer that writes its kernels: "c",
    "opencl", "cuda", "hip" or "wgsl") and implement the underscored methods.
    """

    backend: str = ""
    dialect: str = ""

    def __init__(self, index: int = 0):
        self.index = index
        self.name = f"{self.backend}:{index}"
        self.allocator = CachingAllocator(self)
        self._programs: dict[tuple[str, str], Program] = {}
        self._libraries: dict[str, Any] = {}  # shared libraries loaded, by path
        self._capture = threading.local()  # see recorded()

    def __repr__(self) -> str:
        return f"<Device {self.name} {self.info.name!r}>"

    # ---- jit's replays on devices without graphs ------------------------------------------------
    def recorded(self, steps: Sequence[Callable[[], object]]) -> list[Any]:
        """Run ``steps`` (jit's launches and copies) with this thread's work recorded instead of
        queued: what the backend's launch and copy paths append while ``recording`` is not None
        (WebGPU's replays; CUDA captures a graph instead)."""
        calls: list[Any] = []
        self._capture.calls = calls
        try:
            for step in steps:
                step()
        finally:
            self._capture.calls = None
        return calls

    @property
    def recording(self) -> list[Any] | None:
        """The list this thread's launches and copies go to instead of the queue, or None."""
        return getattr(self._capture, "calls", None)

    # ---- what a backend implements ------------------------------------------------------------
    @property
    def info(self) -> DeviceInfo:
        raise NotImplementedError

    def supports(self, dtype: DType) -> bool:
        """Whether kernels on this device can compute in ``dtype``."""
        return True

    def storage_dtype(self, dtype: DType) -> DType:
        """The element type buffers of ``dtype`` hold on this device (WebGPU widens 8-bit types)."""
        return dtype

    def _alloc(self, nbytes: int) -> Any:
        """Raw device memory; raise MemoryError when the device is out of memory."""
        raise NotImplementedError

    def _free(self, handle: Any) -> None:
        raise NotImplementedError

    def _reusable(self, handle: Any) -> bool:
        """Whether a released handle still refers to live memory (see CachingAllocator)."""
        return True

    def _copy_in(self, handle: Any, host: np.ndarray) -> None:
        raise NotImplementedError

    def _copy_out(self, host: np.ndarray, handle: Any) -> None:
        raise NotImplementedError

    # the most buffers one kernel may bind, its output included (the scheduler splits kernels
    # that would bind more: WebGPU adapters allow as few as 8)
    max_kernel_buffers: int = 1 << 16

    # the byte offsets at which sub_buffer can start a buffer inside another (0: it cannot);
    # the GPUs' 256 keeps every buffer as aligned as the kernels' vector accesses expect
    sub_buffer_align: int = 0

    # whether jit may place a step's buffers as sub-buffers of one allocation (kernels then bind
    # several ranges of one buffer, written and read): WebGPU validates a buffer bound writable
    # as used by nothing else in the same dispatch, so its steps keep buffers of their own
    arena_sub_buffers: bool = True

    def _sub_handle(self, handle: Any, offset: int, nbytes: int) -> Any:
        """A handle for ``nbytes`` bytes at ``offset`` inside ``handle``'s memory."""
        raise NotImplementedError

    def _copy(self, dst: Any, src: Any, nbytes: int) -> None:
        """Device-to-device copy on the queue (no host round trip)."""
        raise NotImplementedError

    def compile(self, source: str, name: str) -> bytes:
        """Source text -> a binary the device loads (PTX, an OpenCL binary, a shared library)."""
        raise NotImplementedError

    def load(self, binary: bytes, name: str, source: str) -> Program:
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait until every queued launch and transfer has finished."""
        raise NotImplementedError

    # ---- shared ---------------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> Buffer:
        return Buffer(self, nbytes, self.allocator.alloc(nbytes))

    def sub_buffer(self, base: Buffer, offset: int, nbytes: int) -> SubBuffer:
        """Bytes ``offset`` to ``offset + nbytes`` of ``base`` as a buffer (same memory)."""
        if not self.sub_buffer_align or offset % self.sub_buffer_align or \
                offset + nbytes > base.nbytes:
            raise ValueError(f"{self.name}: no sub-buffer of {nbytes} bytes at {offset} in a "
                             f"buffer of {base.nbytes}")
        if isinstance(base, SubBuffer):  # bases are never sub-buffers themselves
            offset += base.offset
            base = base.base
        return SubBuffer(base, offset, nbytes, self._sub_handle(base.handle, offset, nbytes))

    def copy(self, dst: Buffer, src: Buffer) -> None:
        if dst.nbytes != src.nbytes:
            raise ValueError(f"copy of {src.nbytes} bytes into a buffer of {dst.nbytes}")
        if profiling is not None:
            profiling.transfer(self, "copy", src.nbytes,
                               lambda: self._copy(dst.handle, src.handle, src.nbytes))
            return
        self._copy(dst.handle, src.handle, src.nbytes)

    def check_dtype(self, dtype: DType) -> None:
        if not self.supports(dtype):
            raise UnsupportedError(f"dtype {dtype.name} is not supported on {self.name} "
                                   f"({self.info.name})")

    def contraction_program(self, epilogue: Program, plan: Any) -> Program:
        """A program that computes a contraction with the device's own library first
        (``plan``: codegen.templates.gemm.HostPlan) and then runs ``epilogue`` on it."""
        raise UnsupportedError(f"{self.name}: contractions through a host library are not "
                               "available on this device")

    def program(self, source: str, name: str) -> Program:
        """Compile (or fetch from the memory and disk caches) and load a kernel."""
        key = (name, source)
        prog = self._programs.get(key)
        if prog is None:
            start = time.perf_counter()
            cached = profiling is not None and self._disk_cached(source)
            binary = self._compile_cached(source, name)
            if binary.startswith(SHARED_MARK):
                prog = self._load_shared(binary, name, source)
            else:
                prog = self.load(binary, name, source)
            self._programs[key] = prog
            if profiling is not None:
                profiling.built(self, name, start, "load" if cached else "compile")
        return prog

    # ---- many kernels compiled at once ---------------------------------------------------------
    # Backends whose compiler compiles many kernels in one run (``compile_library``) set
    # ``shared_libraries`` and load such a library with ``load_library`` and a kernel of it with
    # ``program_in``.
    shared_libraries = False

    def compile_library(self, source: str, name: str) -> tuple[bytes, Any]:
        """Compile ``source`` holding many kernels: its binary and, where the compiler gives
        one, the loaded library (else None)."""
        raise NotImplementedError

    def load_library(self, path: str, source: str) -> Any:
        """Load the library at ``path``, which holds the kernel of ``source`` among others."""
        raise NotImplementedError

    def program_in(self, library: Any, name: str, symbol: str) -> Program:
        """The kernel ``name``, under ``symbol`` in ``library``, as a program."""
        raise NotImplementedError

    def build_group(self, source: str) -> Any:
        """Kernels that can share a library have the same group (their build options)."""
        return ()

    def prebuild(self, kernels: Sequence[tuple[str, str]]) -> None:
        """Compile (source, name) pairs that the disk cache lacks into it, on several threads
        at once (a step's new kernels, the tuner's candidates); ``program`` then loads each. A
        backend with shared libraries compiles them as a few libraries of many kernels each
        (at least one per core, so the cores compile in parallel), with their symbols renamed
        apart, and each kernel's cache entry notes its library and symbol. A kernel that fails
        to compile is left out here and reports its error when ``program`` is called for it."""
        if not config.get().disk_cache or len(kernels) < 2:
            return
        todo: dict[str, str] = {}  # source -> name, each source once
        for source, name in kernels:
            if source not in todo and not self._disk_cached(source):
                todo[source] = name
        if len(todo) < 2:
            return
        workers = min(len(todo), os.cpu_count() or 1, 8)
        if not self.shared_libraries:
            def build(kernel: tuple[str, str]) -> None:
                start = time.perf_counter()
                try:
                    self._compile_cached(*kernel)
                except Exception:  # noqa: BLE001 (reported again by program())
                    return
                if profiling is not None:
                    profiling.built(self, kernel[1], start, "compile")

            with ThreadPoolExecutor(workers) as pool:
                list(pool.map(build, todo.items()))
            return
        groups: dict[Any, list[tuple[str, str]]] = defaultdict(list)
        for source, name in todo.items():
            groups[self.build_group(source)].append((source, name))
        batches: list[list[tuple[str, str]]] = []
        for items in groups.values():
            count = max(min(workers, len(items)), -(-len(items) // CHUNK))
            batches += [items[i::count] for i in range(count)]
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(self._build_shared, batches))

    def _build_shared(self, items: list[tuple[str, str]]) -> None:
        start = time.perf_counter()
        if len(items) == 1:
            try:
                self._compile_cached(*items[0])
            except Exception:  # noqa: BLE001 (reported again by program())
                return
            if profiling is not None:
                profiling.built(self, items[0][1], start, "compile")
            return
        parts, symbols = [], []
        for i, (source, name) in enumerate(items):
            symbol = f"{name}__{i}"
            parts += [f"#define {name} {symbol}", source, f"#undef {name}"]
            symbols.append(symbol)
        text = "\n".join(parts)
        path = self._cache_file(text) + ".lib"
        try:
            binary, library = self.compile_library(text, items[0][1])
        except Exception:  # noqa: BLE001 (program() compiles each alone and reports its error)
            return
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path))
            with os.fdopen(fd, "wb") as f:
                f.write(binary)
            os.replace(tmp, path)
        except OSError:
            return
        if library is not None:
            self._libraries[path] = library
        for (source, name), symbol in zip(items, symbols):
            note = SHARED_MARK + f"{os.path.basename(path)}\n{symbol}\n".encode()
            self._store_cached(source, note)
            if profiling is not None:
                profiling.built(self, name, start, "compile")

    def _load_shared(self, note: bytes, name: str, source: str) -> Program:
        file, symbol = note[len(SHARED_MARK):].decode().split()
        path = os.path.join(os.path.dirname(self._cache_file(source)), file)
        library = self._libraries.get(path)
        if library is None:
            if not os.path.isfile(path):  # the library was deleted: compile the kernel anew
                return self.load(self.compile(source, name), name, source)
            library = self._libraries[path] = self.load_library(path, source)
        return self.program_in(library, name, symbol)

    def _cache_file(self, source: str) -> str:
        info = self.info
        key = "\0".join([self.backend, info.name, info.driver, source])
        digest = hashlib.sha256(key.encode()).hexdigest()
        return os.path.join(config.get().cache_path, "programs", self.backend, digest)

    def _disk_cached(self, source: str) -> bool:
        """Whether the disk cache holds a binary of ``source`` (no compile needed)."""
        return bool(config.get().disk_cache) and os.path.isfile(self._cache_file(source))

    def _compile_cached(self, source: str, name: str) -> bytes:
        if not config.get().disk_cache:
            return self.compile(source, name)
        path = self._cache_file(source)
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError:
            pass
        binary = self.compile(source, name)
        self._store_cached(source, binary)
        return binary

    def _store_cached(self, source: str, binary: bytes) -> None:
        path = self._cache_file(source)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path))
            with os.fdopen(fd, "wb") as f:
                f.write(binary)
            os.replace(tmp, path)  # atomic: concurrent processes never see half a file
        except OSError:
            pass  # a read-only cache directory only costs compile time

    def queue_timer(self) -> "QueueTimer":
        """A timer of the work queued on this device (``anygpu.profile`` uses one per device).
        This default synchronizes around each piece of work; backends with device timers
        override it."""
        return QueueTimer(self)

    def timed(self, fn: Callable[[], object]) -> float:
        """Host wall time of ``fn`` including the device work it queued, in seconds."""
        self.synchronize()
        start = time.perf_counter()
        fn()
        self.synchronize()
        return time.perf_counter() - start
