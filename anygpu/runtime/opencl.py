"""The opencl backend: OpenCL C through PyOpenCL, on any platform's GPU or CPU device.

Devices of all platforms are numbered GPUs first, so ``opencl:0`` is a GPU when there is one
(PoCL, from ``pip install pocl-binary-distribution``, supplies a CPU device anywhere). Each device
has one context and one in-order, profiling command queue; launches and host-to-device copies
return without waiting.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from anygpu.dtype import DType, float16
from anygpu.runtime.base import Buffer, Device, DeviceError, DeviceInfo, Program, QueueTimer
from anygpu.runtime.registry import BackendUnavailable

try:
    import pyopencl as cl
except (ImportError, OSError) as _err:  # OSError: the package is there but libOpenCL is not
    cl = None  # type: ignore[assignment]
    _IMPORT_ERROR: BaseException | None = _err
else:
    _IMPORT_ERROR = None

# The first line of a kernel's source that uses subgroup operations (render/opencl.py).
_SUBGROUPS = "#pragma OPENCL EXTENSION cl_khr_subgroups : enable"

_NO_PLATFORM = ("opencl: no OpenCL platform found (install pocl-binary-distribution for a CPU "
                "device, or a GPU driver)")


# Devices a platform lists but that cannot compile a kernel, with the reason each (``anygpu
# devices`` shows them); filled when the devices are first listed.
LEFT_OUT: list[str] = []


@functools.cache
def _cl_devices() -> tuple[Any, ...]:
    """Every OpenCL device of every platform, GPUs first, in platform order otherwise."""
    if cl is None:
        raise BackendUnavailable(f"opencl: pyopencl cannot be imported ({_IMPORT_ERROR}); "
                                 "install it with pip install 'anygpu[opencl]'")
    try:
        platforms = cl.get_platforms()
    except cl.Error as err:  # the ICD loader reports "no platform" as an error
        raise BackendUnavailable(f"{_NO_PLATFORM}: {err}") from err
    devices = []
    for platform in platforms:
        try:
            devices.extend(platform.get_devices())
        except cl.Error:  # a platform without devices (DEVICE_NOT_FOUND)
            continue
    if not devices:
        raise BackendUnavailable(_NO_PLATFORM)
    broken = {d: reason for d in devices if (reason := _cannot_compile(d))}
    devices = [d for d in devices if d not in broken]
    LEFT_OUT[:] = [f"{_describe(d)}: {reason}" for d, reason in broken.items()]
    if not devices:
        raise BackendUnavailable("opencl: no device can compile a kernel: " + "; ".join(
            f"{_describe(d)}: {reason}" for d, reason in broken.items()))
    gpus = [d for d in devices if d.type & cl.device_type.GPU]
    return tuple(gpus + [d for d in devices if not d.type & cl.device_type.GPU])


def _describe(device: Any) -> str:
    return f"{device.name.strip()} ({device.platform.version.strip()})"


def _cannot_compile(device: Any) -> str | None:
    """Why the device's compiler fails on a trivial kernel, or None when it builds. A driver
    can list a device it cannot compile for: PoCL 3.0 from pip (LLVM 14) names processors newer
    than its LLVM "generic" and then rejects that name as a target."""
    source = "__kernel void probe(__global float* a) { a[get_global_id(0)] += 1.0f; }"
    try:
        cl.Program(cl.Context([device]), source).build()
    except cl.Error as err:
        lines = [ln.strip() for ln in str(err).splitlines() if "error" in ln.lower()]
        detail = next((ln for ln in lines if "clBuildProgram" not in ln), str(err).strip())
        hint = ""
        if "unknown target CPU" in detail:
            hint = (" (its LLVM does not know this processor; a newer PoCL, such as the "
                    "distribution's package pocl-opencl-icd, or another OpenCL driver works)")
        return f"its compiler fails on a trivial kernel: {detail}{hint}"
    return None


def device_count() -> int:
    return len(_cl_devices())


_OOM_CODES = ("MEM_OBJECT_ALLOCATION_FAILURE", "OUT_OF_RESOURCES", "OUT_OF_HOST_MEMORY")


def _is_oom(err: Exception) -> bool:
    return isinstance(err, cl.MemoryError) or any(
        getattr(err, "code", None) == getattr(cl.status_code, name) for name in _OOM_CODES)


# a disk cache entry that holds a kernel's source, built again when loaded (see _keep_source)
SOURCE_MARK = b"anygpu-opencl-source\n"


class OpenCLProgram(Program):
    def __init__(self, device: OpenCLDevice, name: str, program: Any, symbol: str | None = None):
        super().__init__(device, name)
        self.program = program
        with device._errors(f"creating kernel {name}"):
            self.kernel = cl.Kernel(program, symbol or name)
        # Kernel arguments are state on the kernel object: set them and enqueue as one step.
        self._lock = threading.Lock()

    def __call__(self, buffers: Sequence[Buffer], groups: Sequence[int] = (1,),
                 local: Sequence[int] = (1,), wait: bool = False) -> float | None:
        event = self.enqueue(buffers, groups, local)
        if not wait:
            return None
        if event is None:
            return 0.0
        device: OpenCLDevice = self.device  # type: ignore[assignment]
        with device._errors(f"running kernel {self.name}"):
            event.wait()
            return (event.profile.end - event.profile.start) * 1e-9

    def enqueue(self, buffers: Sequence[Buffer], groups: Sequence[int],
                local: Sequence[int]) -> Any:
        """Queue the kernel without waiting and return its event (None for an empty grid,
        which runs nothing)."""
        dims = max(len(groups), len(local))
        groups = tuple(groups) + (1,) * (dims - len(groups))
        local = tuple(local) + (1,) * (dims - len(local))
        if 0 in groups:
            return None
        global_size = tuple(n_groups * n_local for n_groups, n_local in zip(groups, local))
        device: OpenCLDevice = self.device  # type: ignore[assignment]
        try:
            with self._lock:
                self.kernel.set_args(*(b.handle for b in buffers))
                return cl.enqueue_nd_range_kernel(device.queue, self.kernel, global_size, local)
        except cl.Error as err:
            raise DeviceError(f"{device.name}: launching kernel {self.name} with "
                              f"groups={groups} local={local} on {len(buffers)} buffers "
                              f"failed: {err}") from err


class ProfilingTimer(QueueTimer):
    """The queue's profiling timestamps (device nanoseconds): a kernel's own event, and for
    other work (copies, transfers) markers queued before and after it, whose completion on
    the in-order queue brackets it. Nothing waits until ``times``."""

    device_clock = True

    def __init__(self, device: "OpenCLDevice"):
        super().__init__(device)
        self.opencl, self.queue = device, device.queue
        self._events: list[tuple[Any, Any]] = []  # (kernel, kernel) or (before, after) markers

    def launch(self, program: Program, buffers: Sequence[Buffer], groups: Sequence[int],
               local: Sequence[int]) -> int:
        assert isinstance(program, OpenCLProgram)
        event = program.enqueue(buffers, groups, local)
        if event is None:  # an empty grid runs nothing: a marker stands for it
            event = cl.enqueue_marker(self.queue)
        self._events.append((event, event))
        return len(self._events) - 1

    def around(self, fn: Callable[[], object]) -> int:
        before = cl.enqueue_marker(self.queue)
        fn()
        self._events.append((before, cl.enqueue_marker(self.queue)))
        return len(self._events) - 1

    def times(self) -> list[tuple[float, float]]:
        with self.opencl._errors("reading profiling timestamps"):
            for first, last in self._events[len(self._times):]:
                last.wait()
                if first is last:
                    start, end = first.profile.start, first.profile.end
                else:  # the markers complete as the work before and the work itself end
                    start, end = first.profile.end, max(first.profile.end, last.profile.start)
                self._times.append((start * 1e-9, end * 1e-9))
        return self._times


class OpenCLDevice(Device):
    backend = "opencl"
    dialect = "opencl"

    def __init__(self, index: int = 0):
        super().__init__(index)
        devices = _cl_devices()
        if index >= len(devices):
            raise BackendUnavailable(f"{self.name}: no such device (opencl has {len(devices)})")
        self.cl_device = devices[index]
        with self._errors("creating the context and command queue"):
            self.context = cl.Context([self.cl_device])
            self.queue = cl.CommandQueue(
                self.context, self.cl_device,
                properties=cl.command_queue_properties.PROFILING_ENABLE)
        self.build_options = self._build_options()
        self._info: DeviceInfo | None = None
        self._extensions = set(self.cl_device.extensions.split())
        self._subgroup_std = self._subgroup_language()
        # Many drivers (PoCL among them) reserve memory only when a buffer is first used, so
        # creating buffers past the device's memory succeeds and fails later, outside the
        # allocator. Counting the bytes held here turns that into a MemoryError at alloc time,
        # which lets the caching allocator free its cache and retry.
        self._lock = threading.Lock()
        self._mem_held = 0
        # Host arrays of copies still in flight, with their events (see _copy_in).
        self._staged: list[tuple[Any, np.ndarray]] = []
        self._just_built: dict[str, Any] = {}  # programs compile() built, for load()
        # PoCL compiles a program's every kernel again to give its binary (about 80 ms a
        # kernel) and keeps compiled kernels in a cache of its own, which a later build of the
        # same source hits: there the disk cache keeps the source, not a binary
        self._keep_source = "Portable Computing Language" in self.cl_device.platform.name

    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        """Turn OpenCL errors into DeviceError naming this device and the operation."""
        try:
            yield
        except cl.Error as err:
            raise DeviceError(f"{self.name}: {what} failed: {err}") from err

    def _build_options(self) -> list[str]:
        return [*self._language(), *self._exact_division()]

    def _language(self) -> list[str]:
        match = re.search(r"OpenCL C (\d+)\.(\d+)", self.cl_device.opencl_c_version)
        if match and (int(match.group(1)), int(match.group(2))) >= (1, 2):
            return ["-cl-std=CL1.2"]
        return []

    def _exact_division(self) -> list[str]:
        """Correctly rounded float32 division and square root where the device offers them:
        OpenCL C allows 2.5 ulp otherwise, and NVIDIA's driver then gave 0.99999994 for a / a,
        so ``div(a, a, rounding_mode="trunc")`` was 0 where PyTorch gives 1."""
        try:
            config = self.cl_device.single_fp_config
        except cl.Error:
            return []
        exact = getattr(cl.device_fp_config, "CORRECTLY_ROUNDED_DIVIDE_SQRT", 0)
        return ["-cl-fp32-correctly-rounded-divide-sqrt"] if config & exact else []

    def _subgroup_language(self) -> str | None:
        """The -cl-std under which the device's compiler offers subgroup operations, or None
        where it has none: OpenCL C 3.0 with the __opencl_c_subgroups feature, or OpenCL C 2.0
        and later with cl_khr_subgroups (OpenCL C 1.2, the default here, declares neither)."""
        try:
            features = {f.name for f in self.cl_device.opencl_c_features}
        except (cl.Error, AttributeError):  # a device older than OpenCL 3.0
            features = set()
        if "__opencl_c_subgroups" in features:
            return "-cl-std=CL3.0"
        match = re.search(r"OpenCL C (\d+)\.(\d+)", self.cl_device.opencl_c_version)
        version = (int(match.group(1)), int(match.group(2))) if match else (1, 0)
        if "cl_khr_subgroups" in self._extensions and version >= (2, 0):
            return "-cl-std=CL2.0"
        return None

    def _options(self, source: str) -> list[str]:
        """Build options for ``source``: kernels that use subgroups (the renderer's pragma on
        their first line) are built in the OpenCL C version that declares them."""
        if self._subgroup_std is not None and source.startswith(_SUBGROUPS):
            return [self._subgroup_std, *self._exact_division()]
        return self.build_options

    @property
    def info(self) -> DeviceInfo:
        if self._info is None:
            d = self.cl_device
            platform = d.platform.name.strip()
            driver = " ".join([platform, d.driver_version.strip(), d.version.strip(),
                               *self.build_options])
            self._info = DeviceInfo(
                name=d.name.strip(), memory=d.global_mem_size,
                compute_units=d.max_compute_units, driver=driver,
                max_local_size=d.max_work_group_size, local_memory=d.local_mem_size,
                is_cpu=bool(d.type & cl.device_type.CPU),
                extra={"fp16": "cl_khr_fp16" in self._extensions,
                       "fp64": "cl_khr_fp64" in self._extensions,
                       # subgroup operations, of a size the compiler picks per kernel
                       **({"subgroup": "varying"} if self._subgroup_std else {}),
                       "platform": platform, "max_alloc": d.max_mem_alloc_size})
        return self._info

    def supports(self, dtype: DType) -> bool:
        # bfloat16 is stored as ushort and computed as float by the generated source
        if dtype == float16:
            return "cl_khr_fp16" in self._extensions
        return True

    # ---- memory ---------------------------------------------------------------------------------
    @property
    def sub_buffer_align(self) -> int:  # type: ignore[override]
        # sub-buffers must start at the device's base address alignment (given in bits)
        return max(256, self.cl_device.mem_base_addr_align // 8)

    def _sub_handle(self, handle: Any, offset: int, nbytes: int) -> Any:
        return handle.get_sub_region(offset, nbytes)

    def _alloc(self, nbytes: int) -> Any:
        limit = self.cl_device.max_mem_alloc_size
        if nbytes > limit:
            raise MemoryError(f"{self.name}: {nbytes} bytes exceeds the largest single "
                              f"allocation the device allows ({limit} bytes)")
        with self._lock:
            total = self.cl_device.global_mem_size
            if self._mem_held + nbytes > total:
                raise MemoryError(f"{self.name}: {nbytes} more bytes exceeds the device's "
                                  f"{total} bytes ({self._mem_held} held)")
            self._mem_held += nbytes
        try:
            return cl.Buffer(self.context, cl.mem_flags.READ_WRITE, nbytes)
        except cl.Error as err:
            with self._lock:
                self._mem_held -= nbytes
            if _is_oom(err):
                raise MemoryError(f"{self.name}: allocating {nbytes} bytes failed: {err}") from err
            raise DeviceError(f"{self.name}: allocating {nbytes} bytes failed: {err}") from err

    def _free(self, handle: Any) -> None:
        with self._lock:
            self._mem_held -= handle.size
        handle.release()

    def _copy_in(self, handle: Any, host: np.ndarray) -> None:
        if host.nbytes == 0:
            return
        # The caller may change or drop ``host`` as soon as this returns, so the queue reads a
        # private copy, kept alive (with its event) until the transfer has finished.
        staged = host.copy()
        with self._errors(f"copying {host.nbytes} bytes to the device"):
            event = cl.enqueue_copy(self.queue, handle, staged, is_blocking=False)
        with self._lock:
            self._drop_finished_copies()
            self._staged.append((event, staged))

    def _drop_finished_copies(self) -> None:
        complete = cl.command_execution_status.COMPLETE
        self._staged = [(e, a) for e, a in self._staged if e.command_execution_status != complete]

    def _copy_out(self, host: np.ndarray, handle: Any) -> None:
        if host.nbytes == 0:
            return
        with self._errors(f"copying {host.nbytes} bytes from the device"):
            cl.enqueue_copy(self.queue, host, handle, is_blocking=True)

    def _copy(self, dst: Any, src: Any, nbytes: int) -> None:
        if nbytes == 0:
            return
        with self._errors(f"copying {nbytes} bytes on the device"):
            cl.enqueue_copy(self.queue, dst, src, byte_count=nbytes)

    # ---- programs -------------------------------------------------------------------------------
    def _build(self, program: Any, name: str, source: str) -> Any:
        """Build ``program`` for this device; DeviceError with the build log on failure."""
        try:
            with warnings.catch_warnings():
                # a successful build's log (warnings, "compilation started") is not news
                warnings.simplefilter("ignore", cl.CompilerWarning)
                return program.build(options=self._options(source), devices=[self.cl_device],
                                     cache_dir=False)
        except cl.Error as err:
            raise DeviceError(f"{self.name}: compiling kernel {name} failed "
                              f"(options {' '.join(self._options(source)) or 'none'}):\n{err}\n"
                              f"--- source ---\n{source}") from err

    def compile(self, source: str, name: str) -> bytes:
        program = self._build(cl.Program(self.context, source), name, source)
        self._just_built[source] = program  # load() takes it instead of building it again
        return self._binary(program, name, source)

    def _binary(self, program: Any, name: str, source: str) -> bytes:
        if self._keep_source:
            return SOURCE_MARK + source.encode()
        with self._errors(f"reading the binary of kernel {name}"):
            return bytes(program.binaries[0])

    def load(self, binary: bytes, name: str, source: str) -> Program:
        program = self._just_built.pop(source, None)
        if program is None:
            program = self._from_binary(binary, name, source)
        return OpenCLProgram(self, name, program)

    def _from_binary(self, binary: bytes, name: str, source: str) -> Any:
        if binary.startswith(SOURCE_MARK):
            text = binary[len(SOURCE_MARK):].decode()
            return self._build(cl.Program(self.context, text), name, source)
        try:
            program = cl.Program(self.context, [self.cl_device], [binary])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", cl.CompilerWarning)
                program.build(options=self._options(source), devices=[self.cl_device])
        except cl.Error:
            # A binary from another driver version (or an empty one): build from source instead.
            program = self._build(cl.Program(self.context, source), name, source)
        return program

    # many kernels built as one program (see Device.prebuild): one build costs about as much as
    # ten small kernels' code (PoCL: 166 ms for sixteen kernels, 1.6 s built one by one)
    shared_libraries = True

    def build_group(self, source: str) -> Any:
        return tuple(self._options(source))

    def compile_library(self, source: str, name: str) -> tuple[bytes, Any]:
        first = source.split("\n", 1)[1]  # after the first kernel's renaming line
        program = self._build(cl.Program(self.context, source), name, first)
        return self._binary(program, name, source), program

    def load_library(self, path: str, source: str) -> Any:
        with open(path, "rb") as f:
            binary = f.read()
        if binary.startswith(SOURCE_MARK):
            text = binary[len(SOURCE_MARK):].decode()
            return self._build(cl.Program(self.context, text), os.path.basename(path), source)
        program = cl.Program(self.context, [self.cl_device], [binary])
        with self._errors(f"loading the program {os.path.basename(path)}"), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore", cl.CompilerWarning)
            program.build(options=self._options(source), devices=[self.cl_device])
        return program

    def program_in(self, library: Any, name: str, symbol: str) -> Program:
        return OpenCLProgram(self, name, library, symbol)

    def synchronize(self) -> None:
        with self._errors("waiting for the queue"):
            self.queue.finish()
        with self._lock:
            self._drop_finished_copies()

    def queue_timer(self) -> QueueTimer:
        return ProfilingTimer(self)


DEVICE = OpenCLDevice
