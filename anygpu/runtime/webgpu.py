"""The webgpu backend: WGSL kernels run through wgpu-native (Vulkan, Metal or D3D12 underneath).

Buffers are storage buffers; a kernel is a WGSL compute entry point whose ``@group(0)
@binding(i)`` is the i-th buffer of the launch. Launches are queued without waiting.

wgpu also drives OpenGL, which it falls back to where no Vulkan driver is installed (Mesa's
llvmpipe on a machine without a GPU). That adapter lacks int64 and runs compute through a
translation layer, so it is used only when ``ANYGPU_WEBGPU_OPENGL=1`` asks for it; otherwise the
backend is unavailable and says why.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import re
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from anygpu import config
from anygpu import dtype as dt
from anygpu.runtime.base import Buffer, Device, DeviceError, DeviceInfo, Program, QueueTimer
from anygpu.runtime.registry import BackendUnavailable

try:
    import wgpu
except ImportError as _err:  # the registry must still be able to import this module
    wgpu = None
    _IMPORT_ERROR: ImportError | None = _err
else:
    _IMPORT_ERROR = None

# The limits a compute backend needs; the device is requested with each at the adapter's maximum
# (WebGPU otherwise grants only the portable defaults, e.g. 8 storage buffers and 128 MiB buffers).
_COMPUTE_LIMITS = (
    "max_storage_buffers_per_shader_stage",
    "max_storage_buffer_binding_size",
    "max_buffer_size",
    "max_compute_workgroup_storage_size",
    "max_compute_invocations_per_workgroup",
    "max_compute_workgroup_size_x",
    "max_compute_workgroups_per_dimension",
)
_OPTIONAL_FEATURES = ("shader-f16", "shader-int64", "timestamp-query", "subgroup")

# wgpu's GL backend reports itself as one of these (GPUAdapterInfo's backend_type)
_OPENGL_BACKENDS = ("OpenGL", "OpenGLES")
# adapter types in the order of preference (WebGPU's "high-performance" power preference)
_ADAPTER_TYPES = ("DiscreteGPU", "IntegratedGPU", "VirtualGPU", "CPU")
_NO_VULKAN_HINT = ("install a Vulkan/Metal/D3D12 driver; on Linux without a GPU, Mesa's "
                   "lavapipe: apt install mesa-vulkan-drivers")

# Bind groups each program keeps for reuse, least recently used dropped first
_BIND_GROUP_CACHE = 64

# `@group(g) @binding(b) var<storage[, access]> name` (the two attributes in either order)
_BINDING = re.compile(r"((?:@\s*(?:group|binding)\s*\(\s*\d+\s*\)\s*)+)"
                      r"var\s*<\s*storage\s*(?:,\s*(read_write|read)\s*)?>")
_ATTR = re.compile(r"@\s*(group|binding)\s*\(\s*(\d+)\s*\)")
_WORKGROUP_SIZE = re.compile(r"@\s*workgroup_size\s*\(\s*(\d+)\s*(?:,\s*(\d+)\s*)?"
                             r"(?:,\s*(\d+)\s*)?,?\s*\)")


def _round4(nbytes: int) -> int:
    return (nbytes + 3) & ~3


def _limit(limits: Any, name: str) -> int:
    return int(limits[name.replace("_", "-")])


def _adapter_name(info: Mapping[str, Any]) -> str:
    """The device and the API wgpu drives it with, e.g. "llvmpipe (LLVM 15.0.6) (OpenGL)"."""
    return (f"{info.get('device') or info.get('vendor') or 'unknown'} "
            f"({info.get('backend_type') or 'unknown'})")


def _choose_adapter(infos: Sequence[Mapping[str, Any]], allow_opengl: bool) -> int:
    """The index of the adapter to use among ``infos`` (each a GPUAdapterInfo).

    Vulkan, Metal and D3D12 adapters come first, a GPU before the processor; an OpenGL adapter
    only with ``allow_opengl`` and only when there is nothing else. Raises
    :class:`BackendUnavailable` naming what was found when no adapter qualifies.

    >>> _choose_adapter([{"device": "llvmpipe", "backend_type": "OpenGL"},
    ...                  {"device": "llvmpipe", "backend_type": "Vulkan"}], allow_opengl=True)
    1
    """
    def rank(i: int) -> tuple[bool, int, int]:
        kind = str(infos[i].get("adapter_type", ""))
        order = _ADAPTER_TYPES.index(kind) if kind in _ADAPTER_TYPES else len(_ADAPTER_TYPES)
        return (infos[i].get("backend_type") in _OPENGL_BACKENDS, order, i)

    usable = [i for i in range(len(infos))
              if allow_opengl or infos[i].get("backend_type") not in _OPENGL_BACKENDS]
    if usable:
        return min(usable, key=rank)
    if not infos:
        raise BackendUnavailable(f"webgpu: no adapter found ({_NO_VULKAN_HINT})")
    found = ", ".join(_adapter_name(info) for info in infos)
    raise BackendUnavailable(
        f"webgpu: only an OpenGL adapter was found ({found}); wgpu's OpenGL backend lacks int64 "
        f"and is used only with ANYGPU_WEBGPU_OPENGL=1. For a full device, {_NO_VULKAN_HINT}")


@functools.lru_cache(maxsize=None)
def _adapter() -> Any:
    if wgpu is None:
        raise BackendUnavailable(f"webgpu: missing Python package wgpu ({_IMPORT_ERROR}); install "
                                 "it with pip install 'anygpu[webgpu]'")
    try:
        adapters = list(wgpu.gpu.enumerate_adapters_sync())
        if not adapters:  # some drivers (NVIDIA's Vulkan) answer only a request
            adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
            adapters = [adapter] if adapter is not None else []
    except RuntimeError as err:  # how wgpu reports an instance that finds nothing
        raise BackendUnavailable(f"webgpu: no adapter found ({err}); {_NO_VULKAN_HINT}") from err
    index = _choose_adapter([adapter.info for adapter in adapters],
                            allow_opengl=bool(config.get().webgpu_opengl))
    return adapters[index]


def device_count() -> int:
    _adapter()
    return 1


def _wgpu_version() -> str:
    native = getattr(getattr(wgpu, "backends", None), "wgpu_native", None)
    native_version = getattr(native, "__version__", "")
    return f"wgpu-py {wgpu.__version__}" + (f" wgpu-native {native_version}" if native_version
                                            else "")


def _bindings(source: str) -> dict[int, str]:
    """Binding index -> "storage" (read_write) or "read-only-storage", from the WGSL source."""
    found: dict[int, str] = {}
    for match in _BINDING.finditer(source):
        attrs = dict(_ATTR.findall(match.group(1)))
        if "binding" not in attrs:
            continue
        if int(attrs.get("group", 0)) != 0:
            raise DeviceError("webgpu: kernels must declare their buffers in @group(0)")
        # var<storage> without an access mode is read-only in WGSL
        access = match.group(2) or "read"
        found[int(attrs["binding"])] = "storage" if access == "read_write" else "read-only-storage"
    return found


def _workgroup_size(source: str, name: str) -> tuple[int, int, int] | None:
    """The entry point's literal @workgroup_size, or None when it is not plain integers."""
    entry = re.search(r"\bfn\s+" + re.escape(name) + r"\s*\(", source)
    if entry is None:
        return None
    # the attributes sit between the previous declaration's end and `fn name(`
    head = source[:entry.start()]
    attributes = head[max(head.rfind(";"), head.rfind("}")) + 1:]
    size = _WORKGROUP_SIZE.search(attributes)
    if size is None:
        return None
    x, y, z = (int(v) if v else 1 for v in size.groups())
    return (x, y, z)


def _pad3(values: Sequence[int], what: str) -> tuple[int, int, int]:
    values = tuple(int(v) for v in values)
    if not 1 <= len(values) <= 3:
        raise ValueError(f"{what} needs one to three dimensions, got {values}")
    return values + (1,) * (3 - len(values))  # type: ignore[return-value]


def _timestamp_period_ns(gpu: Any) -> float:
    """Nanoseconds per timestamp tick: wgpu-native resolves raw ticks."""
    try:
        from wgpu.backends.wgpu_native import lib
        return float(lib.wgpuQueueGetTimestampPeriod(gpu.queue._internal)) or 1.0
    except (ImportError, AttributeError, TypeError):
        return 1.0  # the period of most drivers


class _Timer:
    """GPU timestamps at the start and end of one compute pass (the timestamp-query feature)."""

    def __init__(self, gpu: Any):
        self.query_set = gpu.create_query_set(type="timestamp", count=2)
        usage = wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC
        self.resolved = gpu.create_buffer(size=16, usage=usage)
        self.lock = threading.Lock()  # one query set: one timed launch at a time
        self.period_ns = _timestamp_period_ns(gpu)

    def writes(self) -> dict[str, Any]:
        return {"query_set": self.query_set, "beginning_of_pass_write_index": 0,
                "end_of_pass_write_index": 1}

    def resolve(self, encoder: Any) -> None:
        encoder.resolve_query_set(self.query_set, 0, 2, self.resolved, 0)

    def seconds(self, queue: Any) -> float:
        start, end = np.frombuffer(queue.read_buffer(self.resolved), dtype=np.uint64)[:2]
        return (int(end) - int(start)) * self.period_ns * 1e-9


class WebGPUProgram(Program):
    """A compute pipeline with an explicit layout of one storage buffer per binding."""

    device: WebGPUDevice

    def __init__(self, device: WebGPUDevice, name: str, pipeline: Any, layout: Any,
                 nbuffers: int, workgroup_size: tuple[int, int, int] | None):
        super().__init__(device, name)
        self.pipeline, self.layout, self.nbuffers = pipeline, layout, nbuffers
        self.workgroup_size = workgroup_size
        # Keyed by the handles' ids; each entry keeps its handles alive so no id is reused while
        # its bind group is cached. Handles come back from the caching allocator unchanged, so
        # steady-state loops hit this cache.
        self._bind_groups: collections.OrderedDict[tuple[int, ...], tuple[Any, tuple[Any, ...]]]
        self._bind_groups = collections.OrderedDict()
        self.bind_groups_created = 0

    def _bind_group(self, handles: tuple[Any, ...]) -> Any:
        key = tuple(id(h) for h in handles)
        hit = self._bind_groups.get(key)
        if hit is not None:
            self._bind_groups.move_to_end(key)
            return hit[0]
        for i, h in enumerate(handles):
            # wgpu-py passes a released buffer to wgpu-native as a null pointer, and
            # wgpuDeviceCreateBindGroup then panics across the C boundary, aborting the process
            if getattr(h.buffer if isinstance(h, _Range) else h, "_internal", None) is None:
                raise DeviceError(f"{self.device.name}: buffer {i} of kernel {self.name} was "
                                  "released before the launch")
        entries = [{"binding": i, "resource": {"buffer": h.buffer, "offset": h.offset,
                                                "size": h.size} if isinstance(h, _Range) else
                    {"buffer": h, "offset": 0, "size": h.size}}
                   for i, h in enumerate(handles)]
        group = self.device.gpu.create_bind_group(layout=self.layout, entries=entries)
        self.bind_groups_created += 1
        self._bind_groups[key] = (group, handles)
        if len(self._bind_groups) > _BIND_GROUP_CACHE:
            # wgpu keeps a bind group that queued work still uses until that work has finished
            self._bind_groups.popitem(last=False)
        return group

    def _check(self, buffers: Sequence[Buffer], groups: tuple[int, int, int],
               local: Sequence[int]) -> None:
        dev = self.device
        if len(buffers) != self.nbuffers:
            raise ValueError(f"{dev.name}: kernel {self.name} declares {self.nbuffers} buffers, "
                             f"got {len(buffers)}")
        seen: dict[int, int] = {}
        for i, buf in enumerate(buffers):
            if isinstance(buf.handle, _Range):  # rows of a buffer, only ever read
                continue
            j = seen.setdefault(id(buf.handle), i)
            if j != i:
                # wgpu-native accepts two writable bindings of one buffer, but the kernels treat
                # each binding as separate memory: reads through one race with writes through
                # the other, so the caller must pass each buffer once.
                raise ValueError(f"{dev.name}: kernel {self.name} got the same buffer "
                                 f"({buf.nbytes} bytes) as arguments {j} and {i}; WebGPU binds "
                                 "each buffer once per launch")
            if buf.handle.size > dev.max_binding_size:
                raise DeviceError(f"{dev.name}: buffer {i} of kernel {self.name} has "
                                  f"{buf.nbytes} bytes, more than one binding may address "
                                  f"({dev.max_binding_size}, max_storage_buffer_binding_size)")
        most = dev.max_groups
        for axis, count in enumerate(groups):
            if count < 0 or count > most:
                raise ValueError(f"{dev.name}: kernel {self.name} launched with {count} "
                                 f"work-groups in dimension {axis}; WebGPU allows at most {most} "
                                 "per dimension (fold the rest into the next dimension)")
        want = self.workgroup_size
        if want is not None and tuple(local) != (1,) and _pad3(local, "local") != want:
            raise ValueError(f"{dev.name}: kernel {self.name} has @workgroup_size{want}, "
                             f"launched with local={tuple(local)}")

    def __call__(self, buffers: Sequence[Buffer], groups: Sequence[int] = (1,),
                 local: Sequence[int] = (1,), wait: bool = False) -> float | None:
        dev = self.device
        timer = dev._timer if wait else None
        lock = timer.lock if timer is not None else contextlib.nullcontext()
        with lock:
            start = time.perf_counter()
            self.submit(buffers, groups, local, timer.writes() if timer is not None else None,
                        timer.resolve if timer is not None else None)
            if not wait:
                return None
            if timer is not None:
                elapsed = timer.seconds(dev.gpu.queue)  # reading the result waits
                if elapsed > 0:
                    return elapsed
            # no timestamps (or a driver that reports none): host time around submit + wait
            dev.synchronize()
            return time.perf_counter() - start

    def submit(self, buffers: Sequence[Buffer], groups: Sequence[int], local: Sequence[int],
               timestamp_writes: dict[str, Any] | None = None,
               then: Callable[[Any], None] | None = None) -> None:
        """Queue the kernel in a compute pass of its own, which writes ``timestamp_writes``
        (WebGPU's ComputePassTimestampWrites); ``then`` adds to the same command encoder
        (resolving the queries)."""
        dev = self.device
        grid = _pad3(groups, "groups")
        self._check(buffers, grid, local)
        try:
            bind_group = self._bind_group(tuple(b.handle for b in buffers))
            recording = dev.recording
            if recording is not None:  # the bind group kept by the replay, not the cache
                recording.append((self.pipeline, bind_group, grid))
                return
            encoder = dev.gpu.create_command_encoder()
            compute = encoder.begin_compute_pass(timestamp_writes=timestamp_writes)
            compute.set_pipeline(self.pipeline)
            compute.set_bind_group(0, bind_group)
            compute.dispatch_workgroups(*grid)
            compute.end()
            if then is not None:
                then(encoder)
            dev.gpu.queue.submit([encoder.finish()])
        except wgpu.GPUError as err:
            raise DeviceError(f"{dev.name}: launching kernel {self.name} with groups={grid} "
                              f"failed:\n{err}") from err


# Queries per query set of a TimestampTimer (WebGPU allows at most 4096 per set); every piece
# of work takes two, so pairs never straddle two sets
_QUERY_SET_SIZE = 4096


class WebGPUReplay:
    """jit's replay of a captured step on one device: its dispatches with their bind groups
    made once, encoded in a few compute passes (a copy ends one) and submitted in command
    buffers of ``_REPLAY_CHUNK`` dispatches, where a launch alone takes an encoder, a pass and
    a submit of its own (and a bind group, as the cache holds fewer than a step uses). WebGPU
    orders the dispatches of a pass that write and read one buffer, as separate submits do."""

    timed_by_step = True  # under anygpu.profile, jit runs the steps one by one, each timed

    def __init__(self, device: "WebGPUDevice", items: list[tuple[Any, Any, Any]]):
        # (pipeline, bind group, grid) for a dispatch; (source, destination, bytes) for a copy
        self.device, self.items = device, items

    def __call__(self) -> None:
        gpu = self.device.gpu
        try:
            encoder, compute, pipeline, queued = gpu.create_command_encoder(), None, None, 0
            for item in self.items:
                if isinstance(item[2], tuple):
                    if compute is None:
                        compute, pipeline = encoder.begin_compute_pass(), None
                    if item[0] is not pipeline:
                        pipeline = item[0]
                        compute.set_pipeline(pipeline)
                    compute.set_bind_group(0, item[1])
                    compute.dispatch_workgroups(*item[2])
                    queued += 1
                    if queued % _REPLAY_CHUNK:
                        continue
                    compute.end()  # the device starts on these while the rest is encoded
                    gpu.queue.submit([encoder.finish()])
                    encoder, compute = gpu.create_command_encoder(), None
                    continue
                if compute is not None:
                    compute.end()
                    compute = None
                encoder.copy_buffer_to_buffer(item[0], 0, item[1], 0, item[2])
            if compute is not None:
                compute.end()
            gpu.queue.submit([encoder.finish()])
        except wgpu.GPUError as err:
            raise DeviceError(f"{self.device.name}: replaying a captured step failed:\n{err}") \
                from err


# dispatches per command buffer of a replay
_REPLAY_CHUNK = 128


class TimestampTimer(QueueTimer):
    """Timestamps written by the device (the timestamp-query feature): at the start and end of
    each launch's own compute pass, and for other work (copies, transfers), which WebGPU cannot
    time inside a pass, by empty compute passes queued before and after it. The queries are
    resolved and read in ``times``; nothing waits before."""

    device_clock = True

    def __init__(self, device: "WebGPUDevice"):
        super().__init__(device)
        self.gpu = device.gpu
        self.period_ns = _timestamp_period_ns(self.gpu)
        self._sets: list[Any] = []
        self._used = 0  # queries handed out, over all sets
        self._pairs: list[tuple[int, int]] = []  # the start and end query of each piece of work
        self._ticks: list[int] = []  # the queries resolved so far, in order

    def _writes(self) -> tuple[dict[str, Any], int]:
        """Timestamp writes of a compute pass into the next two queries, and the first's
        number over all sets."""
        if self._used == len(self._sets) * _QUERY_SET_SIZE:
            self._sets.append(self.gpu.create_query_set(type="timestamp",
                                                        count=_QUERY_SET_SIZE))
        first = self._used
        self._used += 2
        index = first % _QUERY_SET_SIZE
        return ({"query_set": self._sets[-1], "beginning_of_pass_write_index": index,
                 "end_of_pass_write_index": index + 1}, first)

    def launch(self, program: Program, buffers: Sequence[Buffer], groups: Sequence[int],
               local: Sequence[int]) -> int:
        assert isinstance(program, WebGPUProgram)
        writes, first = self._writes()
        program.submit(buffers, groups, local, writes)
        self._pairs.append((first, first + 1))
        return len(self._pairs) - 1

    def _mark(self) -> int:
        """An empty compute pass that writes two timestamps as the queue reaches it."""
        writes, first = self._writes()
        encoder = self.gpu.create_command_encoder()
        encoder.begin_compute_pass(timestamp_writes=writes).end()
        self.gpu.queue.submit([encoder.finish()])
        return first

    def around(self, fn: Callable[[], object]) -> int:
        before = self._mark()
        fn()
        # from the end of the pass before to the start of the pass after
        self._pairs.append((before + 1, self._mark()))
        return len(self._pairs) - 1

    def times(self) -> list[tuple[float, float]]:
        usage = wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC
        while len(self._ticks) < self._used:  # resolve what is new, a set at a time
            k, first = divmod(len(self._ticks), _QUERY_SET_SIZE)
            count = min(self._used - len(self._ticks), _QUERY_SET_SIZE - first)
            resolved = self.gpu.create_buffer(size=8 * count, usage=usage)
            encoder = self.gpu.create_command_encoder()
            encoder.resolve_query_set(self._sets[k], first, count, resolved, 0)
            self.gpu.queue.submit([encoder.finish()])
            data = self.gpu.queue.read_buffer(resolved)  # waits for the queue
            self._ticks.extend(int(t) for t in np.frombuffer(data, dtype=np.uint64))
            resolved.destroy()
        scale = self.period_ns * 1e-9
        for a, b in self._pairs[len(self._times):]:
            start, end = self._ticks[a], self._ticks[b]
            self._times.append((start * scale, max(start, end) * scale))
        return self._times

    def close(self) -> None:
        for query_set in self._sets:
            query_set.destroy()
        self._sets, self._pairs, self._ticks, self._times, self._used = [], [], [], [], 0


class _Range:
    """Bytes ``offset`` to ``offset + size`` of a GPUBuffer, bound to a kernel as its own
    binding (a sub-buffer: rows of a tensor read as a buffer). Kernels only read these, and
    WebGPU allows read-only bindings to overlap."""

    __slots__ = ("buffer", "offset", "size")

    def __init__(self, buffer: Any, offset: int, size: int):
        self.buffer, self.offset, self.size = buffer, offset, size


class WebGPUDevice(Device):
    """A WebGPU adapter's device. Kernels are WGSL compute shaders.

    WGSL has only 32-bit scalars (plus f16 with shader-f16 and i64 with shader-int64), so 8-bit
    types and bool live widened: :meth:`storage_dtype` gives the element type a buffer holds
    (int8 -> int32, uint8 and bool -> uint32, bool as 0/1). ``_copy_in`` takes and ``_copy_out``
    fills host arrays already in the storage dtype; the caller converts. Buffer sizes are rounded
    up to a multiple of 4 bytes on the device, while :class:`Buffer` keeps the size asked for.
    """

    backend = "webgpu"
    dialect = "wgsl"

    def __init__(self, index: int = 0):
        super().__init__(index)
        self.adapter = _adapter()
        if index != 0:
            raise BackendUnavailable(f"webgpu:{index}: no such device (webgpu has 1)")
        limits = {name: _limit(self.adapter.limits, name) for name in _COMPUTE_LIMITS}
        features = [f for f in _OPTIONAL_FEATURES if f in self.adapter.features]
        try:
            self.gpu = self.adapter.request_device_sync(required_features=features,
                                                        required_limits=limits)
        except (RuntimeError, wgpu.GPUError) as err:
            raise DeviceError(f"{self.name}: requesting the device failed: {err}") from err
        self.features = frozenset(self.gpu.features)
        self.max_buffer_size = _limit(self.gpu.limits, "max_buffer_size")
        self.max_binding_size = _limit(self.gpu.limits, "max_storage_buffer_binding_size")
        self.max_groups = _limit(self.gpu.limits, "max_compute_workgroups_per_dimension")
        self.max_kernel_buffers = _limit(self.gpu.limits, "max_storage_buffers_per_shader_stage")
        self._timer = _Timer(self.gpu) if "timestamp-query" in self.features else None
        # Every buffer this device allocated and has not freed, by id. wgpu-py releases a
        # GPUBuffer's memory in its finalizer; a Buffer that dies in a reference cycle gives its
        # handle back to the allocator's free list, yet the collector may then run the handle's
        # finalizer too (it finalizes everything the cycle alone kept alive), leaving a released
        # buffer to be handed out again. Holding every handle here keeps it out of such cycles,
        # so only _free ends a buffer.
        self._handles: dict[int, Any] = {}
        self._fence: Any = None
        self._validated: tuple[str, Any] | None = None  # the module compile() just built
        self._info: DeviceInfo | None = None

    @property
    def info(self) -> DeviceInfo:
        if self._info is None:
            adapter = self.adapter.info
            limits = self.gpu.limits
            self._info = DeviceInfo(
                name=f"{adapter.get('device') or adapter.get('vendor') or 'unknown'} "
                     f"({adapter.get('backend_type', 'unknown')})",
                # WebGPU does not report memory; the largest buffer is the closest it offers
                memory=self.max_buffer_size,
                compute_units=0,  # not reported by WebGPU
                driver=f"{adapter.get('description', '')} {_wgpu_version()}".strip(),
                max_local_size=_limit(limits, "max_compute_invocations_per_workgroup"),
                local_memory=_limit(limits, "max_compute_workgroup_storage_size"),
                is_cpu=str(adapter.get("adapter_type", "")).lower() == "cpu",
                extra={"features": sorted(self.features),
                       # subgroup operations, of a size the driver picks per pipeline
                       **({"subgroup": "varying"} if "subgroup" in self.features else {}),
                       "adapter_type": adapter.get("adapter_type", "unknown"),
                       "limits": {name: _limit(limits, name) for name in _COMPUTE_LIMITS}})
        return self._info

    def supports(self, dtype: dt.DType) -> bool:
        if dtype == dt.float16:
            return "shader-f16" in self.features
        if dtype == dt.int64:
            return "shader-int64" in self.features
        return dtype != dt.bfloat16

    def storage_dtype(self, dtype: dt.DType) -> dt.DType:
        if dtype == dt.int8:
            return dt.int32
        if dtype in (dt.uint8, dt.bool_):
            return dt.uint32
        return dtype

    def _alloc(self, nbytes: int) -> Any:
        size = _round4(nbytes)  # WebGPU buffer sizes and copies are multiples of 4 bytes
        if size > self.max_buffer_size:
            raise MemoryError(f"{self.name}: {size} bytes exceeds max_buffer_size "
                              f"({self.max_buffer_size})")
        usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
        try:
            handle = self.gpu.create_buffer(size=size, usage=usage)
        except wgpu.GPUOutOfMemoryError as err:
            raise MemoryError(f"{self.name}: {err}") from err
        except wgpu.GPUError as err:
            raise DeviceError(f"{self.name}: allocating {size} bytes failed: {err}") from err
        self._handles[id(handle)] = handle
        return handle

    @property
    def sub_buffer_align(self) -> int:  # type: ignore[override]
        return max(256, _limit(self.gpu.limits, "min_storage_buffer_offset_alignment"))

    arena_sub_buffers = False  # (see Device)

    def _sub_handle(self, handle: Any, offset: int, nbytes: int) -> Any:
        return _Range(handle, offset, _round4(nbytes))

    def _reusable(self, handle: Any) -> bool:
        return getattr(handle, "_internal", None) is not None

    def _free(self, handle: Any) -> None:
        self._handles.pop(id(handle), None)
        handle.destroy()  # frees the memory now; queued work that uses it still completes

    def _copy_in(self, handle: Any, host: np.ndarray) -> None:
        data = np.ascontiguousarray(host).reshape(-1).view(np.uint8)
        if data.nbytes == 0:
            return
        if data.nbytes % 4:
            data = np.concatenate([data, np.zeros(_round4(data.nbytes) - data.nbytes, np.uint8)])
        self.gpu.queue.write_buffer(handle, 0, data)

    def _copy_out(self, host: np.ndarray, handle: Any) -> None:
        nbytes = host.nbytes
        if nbytes == 0:
            return
        data = self.gpu.queue.read_buffer(handle, 0, _round4(nbytes))  # waits for the queue
        host.reshape(-1).view(np.uint8)[:] = np.frombuffer(data, np.uint8, nbytes)

    def _copy(self, dst: Any, src: Any, nbytes: int) -> None:
        if nbytes == 0:
            return
        recording = self.recording
        if recording is not None:
            recording.append((src, dst, _round4(nbytes)))
            return
        encoder = self.gpu.create_command_encoder()
        # both handles hold at least the padded size: the allocator pads every buffer alike
        encoder.copy_buffer_to_buffer(src, 0, dst, 0, _round4(nbytes))
        self.gpu.queue.submit([encoder.finish()])

    def compile(self, source: str, name: str) -> bytes:
        """Validate the WGSL (WebGPU has no portable binary: the "binary" is the source)."""
        module = self._shader_module(source, name)
        self._validated = (source, module)
        return source.encode()

    def prebuild(self, kernels: Sequence[tuple[str, str]]) -> None:
        """Nothing to do ahead: validating WGSL is quick and the pipeline is built at load."""

    def _compile_cached(self, source: str, name: str) -> bytes:
        # The disk cache would store the source itself and save no work (the pipeline is built
        # at load either way), so it is skipped.
        return self.compile(source, name)

    def _shader_module(self, source: str, name: str) -> Any:
        try:
            return self.gpu.create_shader_module(label=name, code=source)
        except (wgpu.GPUError, RuntimeError) as err:
            raise DeviceError(f"{self.name}: compiling kernel {name} failed:\n{err}\n"
                              f"--- source ---\n{source}") from err

    def load(self, binary: bytes, name: str, source: str) -> Program:
        code = binary.decode()
        module = None
        if self._validated is not None and self._validated[0] == code:
            module = self._validated[1]
        self._validated = None
        if module is None:
            module = self._shader_module(code, name)
        kinds = _bindings(code)
        nbuffers = max(kinds, default=-1) + 1
        if nbuffers > self.max_kernel_buffers:
            raise DeviceError(f"{self.name}: kernel {name} binds {nbuffers} buffers; this device "
                              f"allows {self.max_kernel_buffers} (max_storage_buffers_per_shader"
                              "_stage)")
        # An explicit layout binds every buffer; layout="auto" would drop unused bindings and make
        # the bind group depend on what the shader happens to read.
        entries = [{"binding": i, "visibility": wgpu.ShaderStage.COMPUTE,
                    "buffer": {"type": kinds.get(i, "storage")}} for i in range(nbuffers)]
        try:
            layout = self.gpu.create_bind_group_layout(entries=entries)
            pipeline = self.gpu.create_compute_pipeline(
                label=name, layout=self.gpu.create_pipeline_layout(bind_group_layouts=[layout]),
                compute={"module": module, "entry_point": name})
        except wgpu.GPUError as err:
            raise DeviceError(f"{self.name}: building the pipeline of kernel {name} failed:\n"
                              f"{err}\n--- source ---\n{code}") from err
        return WebGPUProgram(self, name, pipeline, layout, nbuffers, _workgroup_size(code, name))

    def capture_graph(self, steps: Sequence[Callable[[], object]]) -> "WebGPUReplay":
        """``steps`` (jit's launches and copies) ready to be encoded again and again."""
        return WebGPUReplay(self, self.recorded(steps))

    def queue_timer(self) -> QueueTimer:
        # without timestamps: the default, which waits for the queue around each launch
        return TimestampTimer(self) if "timestamp-query" in self.features else QueueTimer(self)

    def synchronize(self) -> None:
        # queue.on_submitted_work_done_sync() fails in wgpu-py 0.32 (its callback signature does
        # not match wgpu-native's), so wait by reading a tiny buffer: the queue runs in order,
        # and the read returns once everything submitted before it has finished.
        if self._fence is None:
            usage = wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
            self._fence = self.gpu.create_buffer(size=4, usage=usage)
        self.gpu.queue.read_buffer(self._fence, 0, 4)

    def _idle(self) -> bool:
        """Whether every submitted command has finished, asked without waiting."""
        from wgpu.backends.wgpu_native import ffi, lib

        # wgpuDevicePoll returns whether the queue is empty; wait=False only looks. wgpu-native
        # 29 sets only the low byte of the 32-bit WGPUBool it returns, the rest is garbage.
        return bool(lib.wgpuDevicePoll(self.gpu._internal, False, ffi.NULL) & 0xFF)


DEVICE = WebGPUDevice
