"""The cuda backend: NVRTC compiles kernels to CUBIN, the CUDA driver API loads and launches them.

Each device works in its primary context (the one the CUDA runtime, and so PyTorch or CuPy in the
same process, also uses) on one non-blocking stream, so launches and transfers run in the order
they were queued. Buffers are plain ``cuMemAlloc`` memory whose handle is the device address as an
``int``; a kernel takes one pointer per buffer.

:class:`GPUDevice` and :class:`GPUProgram` hold everything that does not depend on the vendor and
call the driver through the CUDA driver API's names; the hip backend reuses them with hip-python
supplying those names.
"""

from __future__ import annotations

import functools
import os
import re
import threading
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from anygpu import config
from anygpu.dtype import DType, bfloat16, float16
from anygpu.runtime.base import Buffer, Device, DeviceError, DeviceInfo, Program, QueueTimer
from anygpu.runtime.registry import BackendUnavailable

try:
    from cuda.bindings import driver, nvrtc
except ImportError:
    try:  # cuda-python before 12.6
        from cuda import cuda as driver  # type: ignore[no-redef]
        from cuda import nvrtc
    except ImportError:
        driver = nvrtc = None  # type: ignore[assignment]

# Transfers whose host arrays are kept alive before the queue is drained (see _copy_in).
_MAX_PENDING_COPIES = 256
# Packed kernel-parameter sets each program keeps (see GPUProgram._pack).
_MAX_PARAM_SETS = 256

# The first line of a kernel's source that takes dynamic shared memory.
_DYNAMIC_SHARED = re.compile(r"/\* dynamic shared memory: (\d+) bytes \*/")

# The device whose context each thread last made current, so driver calls skip that step.
_current = threading.local()


def _error_name(err: Any) -> str:
    return getattr(err, "name", None) or str(err)


class GPUProgram(Program):
    """A kernel of a loaded module; its parameters are the buffers' device addresses, in order."""

    device: GPUDevice

    def __init__(self, device: GPUDevice, name: str, module: Any, function: Any,
                 shared_bytes: int = 0):
        super().__init__(device, name)
        self.module, self.function = module, function
        self.shared_bytes = shared_bytes  # dynamic shared memory per work-group
        self._launch = device.drv.cuLaunchKernel
        # buffer addresses -> (the void** cuLaunchKernel takes, the arrays behind it)
        self._params: dict[tuple[int, ...], tuple[int | None, array, array]] = {}

    def __del__(self) -> None:
        try:
            self.device._activate()
            self.device.drv.cuModuleUnload(self.module)
        except Exception:  # interpreter shutdown: the driver may be gone already
            pass

    def _pack(self, handles: tuple[int, ...]) -> tuple[int | None, array, array]:
        """kernelParams for these addresses: an array of pointers, each to one argument.

        Passed as a plain address, the fastest form the bindings take: their (values, types)
        tuple form costs about a microsecond more per launch. Steady-state loops launch on the
        same cached buffers, so a packed set is usually reused.
        """
        if len(self._params) >= _MAX_PARAM_SETS:
            self._params.clear()
        values = array("Q", handles)
        base = values.buffer_info()[0]
        pointers = array("Q", range(base, base + 8 * len(handles), 8))
        packed = (pointers.buffer_info()[0] if handles else None, values, pointers)
        self._params[handles] = packed
        return packed

    def __call__(self, buffers: Sequence[Buffer], groups: Sequence[int] = (1,),
                 local: Sequence[int] = (1,), wait: bool = False) -> float | None:
        dev = self.device
        dev._activate()
        gx, gy, gz = (*groups, 1, 1)[:3]
        lx, ly, lz = (*local, 1, 1)[:3]
        handles = tuple([b.handle for b in buffers])
        packed = self._params.get(handles) or self._pack(handles)
        if wait:  # the two timing events are shared by the device's launches
            dev._timing_lock.acquire()
        try:
            if wait:
                dev._check(dev.drv.cuEventRecord, dev._start, dev._stream)
            (err,) = self._launch(self.function, gx, gy, gz, lx, ly, lz, self.shared_bytes,
                                  dev._stream, packed[0], 0)
            if err:
                raise dev._error(err, self._launch, f" of kernel {self.name} with grid "
                                 f"{(gx, gy, gz)}, block {(lx, ly, lz)}")
            if not wait:
                return None
            dev._check(dev.drv.cuEventRecord, dev._end, dev._stream)
            dev._check(dev.drv.cuEventSynchronize, dev._end)
            return dev._check(dev.drv.cuEventElapsedTime, dev._start, dev._end) / 1000.0
        finally:
            if wait:
                dev._timing_lock.release()


class EventTimer(QueueTimer):
    """Events recorded on the device's stream before and after each piece of work; nothing
    waits until ``times`` reads them. The clock's origin is an event recorded when the timer
    is made. A captured CUDA graph replays as one piece of work: its kernels are not timed
    one by one."""

    device_clock = True

    def __init__(self, device: "GPUDevice"):
        super().__init__(device)
        self.gpu = device
        self._events: list[tuple[Any, Any]] = []  # (before, after) of each piece of work
        self._read: list[tuple[float, float]] = []
        self._last: tuple[Any, float] | None = None  # the last start read, on the clock
        device._activate()
        self._origin = self._record()

    def _record(self) -> Any:
        dev = self.gpu
        event = dev._check(dev.drv.cuEventCreate, 0)  # flags 0: with timing
        dev._check(dev.drv.cuEventRecord, event, dev._stream)
        return event

    def around(self, fn: Callable[[], object]) -> int:
        self.gpu._activate()
        before = self._record()
        fn()
        self._events.append((before, self._record()))
        return len(self._events) - 1

    def _ms(self, start: Any, end: Any) -> float:
        dev = self.gpu
        return float(dev._check(dev.drv.cuEventElapsedTime, start, end))

    def times(self) -> list[tuple[float, float]]:
        if len(self._read) == len(self._events):
            return self._read
        dev = self.gpu
        dev._activate()
        dev._check(dev.drv.cuEventSynchronize, self._events[-1][1])
        # elapsed times are single-precision milliseconds: each start is placed from the one
        # before it, so positions late in a long profile keep sub-microsecond resolution
        last, clock = self._last or (self._origin, 0.0)
        for before, after in self._events[len(self._read):]:
            clock += self._ms(last, before) * 1e-3
            self._read.append((clock, clock + self._ms(before, after) * 1e-3))
            last = before
        self._last = (last, clock)
        return self._read

    def close(self) -> None:
        dev = self.gpu
        dev._activate()
        for event in [self._origin, *(e for pair in self._events for e in pair)]:
            dev.drv.cuEventDestroy(event)
        self._events, self._read, self._last = [], [], None


class GPUDevice(Device):
    """A device driven through the CUDA driver API's calls (or a stand-in with the same names).

    A subclass sets ``drv`` and ``rtc`` (the driver and runtime-compiler modules), the constants
    below, and supplies the parts that differ between vendors: contexts, device properties and
    compiler options.
    """

    drv: Any = None  # the driver API: cuInit, cuMemAlloc, cuLaunchKernel, ...
    rtc: Any = None  # the runtime compiler: nvrtcCreateProgram, nvrtcCompileProgram, ...
    missing: str = ""  # why drv is None
    vendor_driver: str = ""  # the driver's name in messages ("NVIDIA driver")
    out_of_memory: Any = None  # the driver's out-of-memory error code
    stream_flags: int = 1  # CU_STREAM_NON_BLOCKING / hipStreamNonBlocking
    max_dynamic_shared: Any = None  # the function attribute that raises the shared memory limit

    @classmethod
    def count(cls) -> int:
        """How many devices the driver reports; raises BackendUnavailable with the reason."""
        if cls.drv is None:
            raise BackendUnavailable(cls.missing)
        init = cls.drv.cuInit
        try:
            (err,) = init(0)
        except Exception as exc:  # the bindings raise when the driver library cannot be loaded
            raise BackendUnavailable(f"{cls.backend}: no {cls.vendor_driver} "
                                     f"({init.__name__}: {exc})") from exc
        if err:
            raise BackendUnavailable(f"{cls.backend}: no {cls.vendor_driver} "
                                     f"({init.__name__}: {_error_name(err)})")
        err, count = cls.drv.cuDeviceGetCount()
        if err or not count:
            reason = _error_name(err) if err else "0 devices"
            raise BackendUnavailable(f"{cls.backend}: the {cls.vendor_driver} reports no devices "
                                     f"({reason})")
        return int(count)

    def __init__(self, index: int = 0):
        super().__init__(index)
        if self.drv is None:
            raise BackendUnavailable(self.missing)
        self._info: DeviceInfo | None = None
        self._timing_lock = threading.Lock()
        self._pending: list[np.ndarray] = []
        self._include_options: list[bytes] = []  # set once a kernel needed header directories
        self._open_context()
        self._activate()
        self._stream = self._check(self.drv.cuStreamCreate, self.stream_flags)
        self._start = self._check(self.drv.cuEventCreate, 0)
        self._end = self._check(self.drv.cuEventCreate, 0)

    # ---- what a vendor supplies ---------------------------------------------------------------
    def _open_context(self) -> None:
        """Look the device up and get the context its work runs in."""
        raise NotImplementedError

    def _make_current(self) -> None:
        """Make this device's context current on the calling thread."""
        raise NotImplementedError

    def _query_info(self) -> DeviceInfo:
        raise NotImplementedError

    def _compile_options(self, source: str = "") -> list[bytes]:
        """The compiler's options for ``source``."""
        raise NotImplementedError

    def _binary_calls(self) -> tuple[Callable, Callable]:
        """The compiler's (size, copy) pair for the binary that ``load`` takes."""
        raise NotImplementedError

    def _header_options(self) -> list[bytes]:
        """Include options for kernels whose headers the compiler cannot find on its own."""
        return []

    def _address(self, ptr: Any) -> int:
        """The device address an allocation call returned, as an ``int``."""
        return int(ptr)

    # ---- errors and contexts --------------------------------------------------------------------
    def _error(self, err: Any, fn: Callable, detail: str = "") -> DeviceError:
        name = getattr(fn, "__name__", str(fn))
        return DeviceError(f"{self.name}: {name}{detail} failed: {_error_name(err)}")

    def _check(self, fn: Callable, *args: Any) -> Any:
        """Call a driver or compiler function; raise DeviceError naming it when it fails."""
        err, *out = fn(*args)
        if err:
            raise self._error(err, fn)
        if not out:
            return None
        return out[0] if len(out) == 1 else tuple(out)

    def _activate(self) -> None:
        # Other libraries on the same thread may switch contexts; they use the same primary
        # context per device, so the per-thread record only matters between our own devices.
        if getattr(_current, "device", None) is not self:
            self._make_current()
            _current.device = self

    # ---- Device ---------------------------------------------------------------------------------
    @property
    def info(self) -> DeviceInfo:
        if self._info is None:
            self._info = self._query_info()
        return self._info

    sub_buffer_align = 256

    def _sub_handle(self, handle: Any, offset: int, nbytes: int) -> Any:
        return handle + offset

    def _alloc(self, nbytes: int) -> Any:
        self._activate()
        alloc = self.drv.cuMemAlloc
        err, ptr = alloc(nbytes)
        if err == self.out_of_memory:
            raise MemoryError(f"{self.name}: out of memory allocating {nbytes} bytes")
        if err:
            raise self._error(err, alloc, f"({nbytes})")
        return self._address(ptr)

    def _free(self, handle: Any) -> None:
        self._activate()
        self._check(self.drv.cuMemFree, handle)

    def _copy_in(self, handle: Any, host: np.ndarray) -> None:
        if not host.nbytes:
            return
        self._activate()
        self._check(self.drv.cuMemcpyHtoDAsync, handle, host.ctypes.data, host.nbytes, self._stream)
        # The copy may still read the host array after this returns: keep it alive until the
        # queue is drained, and drain it now and then so a loop of uploads holds little memory.
        self._pending.append(host)
        if len(self._pending) >= _MAX_PENDING_COPIES:
            self.synchronize()

    def _copy_out(self, host: np.ndarray, handle: Any) -> None:
        if not host.nbytes:
            return
        self._activate()
        self._check(self.drv.cuMemcpyDtoHAsync, host.ctypes.data, handle, host.nbytes, self._stream)
        self.synchronize()

    def _copy(self, dst: Any, src: Any, nbytes: int) -> None:
        if not nbytes:
            return
        self._activate()
        self._check(self.drv.cuMemcpyDtoDAsync, dst, src, nbytes, self._stream)

    def synchronize(self) -> None:
        self._activate()
        self._check(self.drv.cuStreamSynchronize, self._stream)
        self._pending.clear()

    def queue_timer(self) -> QueueTimer:
        return EventTimer(self)

    def compile(self, source: str, name: str) -> bytes:
        options = self._compile_options(source)
        ok, log, binary = self._run_compiler(source, name, options + self._include_options)
        if not ok and not self._include_options and _missing_header(log):
            headers = self._header_options()
            if headers:
                ok, log, binary = self._run_compiler(source, name, options + headers)
                if ok:  # later kernels go straight to the directories that worked
                    self._include_options = headers
        if not ok:
            raise DeviceError(f"{self.name}: compiling kernel {name} failed:\n{log}\n"
                              f"--- source ---\n{source}")
        return binary

    def _run_compiler(self, source: str, name: str,
                      options: list[bytes]) -> tuple[bool, str, bytes]:
        """Compile once: (succeeded, the compiler's log, the binary or b"")."""
        rtc = self.rtc
        prog = self._check(rtc.nvrtcCreateProgram, source.encode(), f"{name}.cu".encode(),
                           0, [], [])
        try:
            (err,) = rtc.nvrtcCompileProgram(prog, len(options), options)
            size = self._check(rtc.nvrtcGetProgramLogSize, prog)
            log = bytearray(size)
            if size > 1:
                self._check(rtc.nvrtcGetProgramLog, prog, log)
            text = log.rstrip(b"\0").decode(errors="replace")
            if err:
                return False, f"{_error_name(err)}\n{text}", b""
            get_size, get_binary = self._binary_calls()
            binary = bytearray(self._check(get_size, prog))
            self._check(get_binary, prog, binary)
            return True, text, bytes(binary)
        finally:
            rtc.nvrtcDestroyProgram(prog)

    def load(self, binary: bytes, name: str, source: str) -> Program:
        self._activate()
        module = self._check(self.drv.cuModuleLoadData, binary)
        try:
            function = self._check(self.drv.cuModuleGetFunction, module, name.encode())
            # a kernel with more than 48 KiB of shared memory takes it dynamically and says how
            # much on its first line (codegen/render/cuda.py); the function must opt in
            found = _DYNAMIC_SHARED.match(source)
            shared = int(found.group(1)) if found else 0
            if shared > 48 * 1024:
                self._check(self.drv.cuFuncSetAttribute, function, self.max_dynamic_shared,
                            shared)
        except DeviceError:
            self.drv.cuModuleUnload(module)
            raise
        return GPUProgram(self, name, module, function, shared)


def _missing_header(log: str) -> bool:
    return "cannot open source file" in log or "could not open source file" in log \
        or "file not found" in log


@functools.cache
def _include_dirs() -> tuple[str, ...]:
    """Directories with ``cuda_fp16.h`` and ``cuda_bf16.h`` for NVRTC, which may not find them.

    Preferred: the headers NVRTC 13.2+ carries, unpacked once into the cache directory (they match
    the compiler exactly). Otherwise the first toolkit found: ``CUDA_HOME``, ``CUDA_PATH``,
    ``/usr/local/cuda``, then the pip ``nvidia-*`` packages. Headers of two toolkits never mix.
    """
    bundled = _bundled_headers()
    if bundled:
        return bundled
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    candidates = [os.path.join(root, "include") for root in roots if root]
    try:
        import nvidia  # the namespace package of NVIDIA's pip wheels

        for base in nvidia.__path__:
            for sub in ("cu13", "cuda_runtime", "cuda_nvrtc"):
                candidates.append(os.path.join(base, sub, "include"))
    except ImportError:
        pass
    for include in candidates:
        if os.path.isfile(os.path.join(include, "cuda_fp16.h")):
            cccl = os.path.join(include, "cccl")  # CUDA 13 keeps <nv/target> there
            return (include, cccl) if os.path.isdir(cccl) else (include,)
    return ()


def _bundled_headers() -> tuple[str, ...]:
    try:
        major, minor = _nvrtc_version()
        path = os.path.join(config.get().cache_path, "nvrtc-headers", f"{major}.{minor}")
        err, *_ = nvrtc.nvrtcInstallBundledHeaders(
            path.encode(), nvrtc.NVRTC_INSTALL_HEADERS_SKIP_IF_EXISTS)
    except Exception:  # an NVRTC without bundled headers, or a cache directory we cannot write
        return ()
    if err or not os.path.isfile(os.path.join(path, "cuda_fp16.h")):
        return ()
    cccl = os.path.join(path, "cccl")
    return (path, cccl) if os.path.isdir(cccl) else (path,)


@functools.cache
def _nvrtc_version() -> tuple[int, int]:
    try:
        err, major, minor = nvrtc.nvrtcVersion()
    except Exception as exc:  # the bindings raise when libnvrtc cannot be loaded
        raise DeviceError(f"cuda: the NVRTC library could not be loaded ({exc}); install it with "
                          "pip install 'cuda-python[all]' or a CUDA toolkit") from exc
    if err:
        raise DeviceError(f"cuda: nvrtcVersion failed: {_error_name(err)}")
    return int(major), int(minor)


class CUDAGraph:
    """A captured sequence of launches; calling it replays them with one driver call."""

    def __init__(self, device: "CUDADevice", graph: Any, executable: Any):
        self.device, self.graph, self.executable = device, graph, executable

    def __call__(self) -> None:
        dev = self.device
        dev._activate()
        dev._check(dev.drv.cuGraphLaunch, self.executable, dev._stream)

    def __del__(self) -> None:
        try:
            self.device.drv.cuGraphExecDestroy(self.executable)
            self.device.drv.cuGraphDestroy(self.graph)
        except Exception:  # interpreter shutdown: the driver may be gone already
            pass


class CUDADevice(GPUDevice):
    backend = "cuda"
    dialect = "cuda"
    drv = driver
    rtc = nvrtc
    missing = "cuda: cuda-python is not installed (pip install 'anygpu[cuda]')"
    vendor_driver = "NVIDIA driver"
    out_of_memory = driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY if driver else None
    stream_flags = int(driver.CUstream_flags.CU_STREAM_NON_BLOCKING) if driver else 1
    max_dynamic_shared = (driver.CUfunction_attribute
                          .CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES if driver else None)

    def _open_context(self) -> None:
        self._device = self._check(self.drv.cuDeviceGet, self.index)
        self._context = self._check(self.drv.cuDevicePrimaryCtxRetain, self._device)
        attr = driver.CUdevice_attribute
        self.compute_capability: tuple[int, int] = (
            self._attribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
            self._attribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR))

    def _make_current(self) -> None:
        self._check(self.drv.cuCtxSetCurrent, self._context)

    def capture_graph(self, steps: Sequence[Callable[[], object]]) -> "CUDAGraph":
        """Record ``steps`` (launches and copies on this device's stream) as one CUDA graph."""
        self._activate()
        self.synchronize()
        mode = self.drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        self._check(self.drv.cuStreamBeginCapture, self._stream, mode)
        try:
            for step in steps:
                step()
        finally:
            graph = self._check(self.drv.cuStreamEndCapture, self._stream)
        executable = self._check(self.drv.cuGraphInstantiate, graph, 0)
        return CUDAGraph(self, graph, executable)

    def _attribute(self, attribute: Any) -> int:
        return int(self._check(self.drv.cuDeviceGetAttribute, attribute, self._device))

    def _query_info(self) -> DeviceInfo:
        raw = self._check(self.drv.cuDeviceGetName, 256, self._device)
        version = self._check(self.drv.cuDriverGetVersion)
        major, minor = self.compute_capability
        rtc_major, rtc_minor = _nvrtc_version()
        attr = driver.CUdevice_attribute
        return DeviceInfo(
            name=raw.split(b"\0", 1)[0].decode(errors="replace").strip(),
            memory=int(self._check(self.drv.cuDeviceTotalMem, self._device)),
            compute_units=self._attribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
            driver=(f"CUDA driver {version // 1000}.{version % 1000 // 10} "
                    f"NVRTC {rtc_major}.{rtc_minor} sm_{major}{minor}"),
            max_local_size=self._attribute(attr.CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK),
            local_memory=self._attribute(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK),
            extra={"cc": self.compute_capability, "max_shared": self._attribute(
                attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
                "clock_khz": self._attribute(attr.CU_DEVICE_ATTRIBUTE_CLOCK_RATE),
                "wgmma": self.has_wgmma,
                "subgroup": self._attribute(attr.CU_DEVICE_ATTRIBUTE_WARP_SIZE)})

    def supports(self, dtype: DType) -> bool:
        if dtype == float16:
            return self.compute_capability >= (5, 3)
        if dtype == bfloat16:
            return self.compute_capability >= (8, 0)
        return True

    @functools.cached_property
    def _target(self) -> tuple[str, bool]:
        """NVRTC's architecture option, and whether it yields a CUBIN (a real ``sm_``).

        A device newer than this NVRTC knows gets PTX for the newest architecture NVRTC has,
        which the driver compiles at load.
        """
        _nvrtc_version()  # a clear error when libnvrtc is missing
        major, minor = self.compute_capability
        cc = major * 10 + minor
        try:
            err, archs = nvrtc.nvrtcGetSupportedArchs()
            archs = [] if err else [int(a) for a in archs]
        except Exception:
            archs = []
        if not archs or cc in archs:
            return f"--gpu-architecture=sm_{cc}", True
        older = [a for a in archs if a <= cc]
        return f"--gpu-architecture=compute_{max(older) if older else min(archs)}", False

    def _compile_options(self, source: str = "") -> list[bytes]:
        arch, _ = self._target
        if arch.endswith("sm_90") and "wgmma." in source:
            arch += "a"  # wgmma is an sm_90a instruction: such a cubin runs on sm_90 alone
        return [arch.encode(), b"-default-device", b"--std=c++17", b"-DNDEBUG"]

    @property
    def has_wgmma(self) -> bool:
        """Whether kernels may use Hopper's warpgroup instructions (compiled for sm_90a)."""
        return self.compute_capability == (9, 0) and self._target == ("--gpu-architecture=sm_90",
                                                                      True)

    def _binary_calls(self) -> tuple[Callable, Callable]:
        if self._target[1]:
            return nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN
        return nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX  # NUL-terminated, as loading needs

    def _header_options(self) -> list[bytes]:
        return [b"-I" + d.encode() for d in _include_dirs()]


def device_count() -> int:
    return CUDADevice.count()


DEVICE = CUDADevice
