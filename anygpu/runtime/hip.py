"""The hip backend: HIPRTC compiles kernels to code objects that the HIP runtime loads and runs.

This is the cuda backend's code (:class:`anygpu.runtime.cuda.GPUDevice`) with hip-python answering
to the CUDA driver API's names; only contexts, device properties and compiler options differ. The
kernels are the cuda dialect's with HIP's spelling ("hip").
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from anygpu.runtime.base import DeviceInfo
from anygpu.runtime.cuda import GPUDevice

try:
    from hip import hip, hiprtc
except ImportError:
    hip = hiprtc = None  # type: ignore[assignment]


def _driver_api() -> Any:
    def hipModuleLaunchKernel(function: Any, gx: int, gy: int, gz: int, bx: int, by: int,
                              bz: int, shared: int, stream: Any, params: Any, extra: Any) -> Any:
        # hip-python takes None, not 0, for "no extra launch options"
        return hip.hipModuleLaunchKernel(function, gx, gy, gz, bx, by, bz, shared, stream,
                                         params, None)

    return SimpleNamespace(
        cuInit=hip.hipInit, cuDeviceGetCount=hip.hipGetDeviceCount,
        cuStreamCreate=hip.hipStreamCreateWithFlags, cuStreamSynchronize=hip.hipStreamSynchronize,
        cuEventCreate=hip.hipEventCreateWithFlags, cuEventRecord=hip.hipEventRecord,
        cuEventSynchronize=hip.hipEventSynchronize, cuEventElapsedTime=hip.hipEventElapsedTime,
        cuEventDestroy=hip.hipEventDestroy,
        cuMemAlloc=hip.hipMalloc, cuMemFree=hip.hipFree,
        cuMemcpyHtoDAsync=hip.hipMemcpyHtoDAsync, cuMemcpyDtoHAsync=hip.hipMemcpyDtoHAsync,
        cuMemcpyDtoDAsync=hip.hipMemcpyDtoDAsync,
        cuModuleLoadData=hip.hipModuleLoadData, cuModuleGetFunction=hip.hipModuleGetFunction,
        cuModuleUnload=hip.hipModuleUnload, cuLaunchKernel=hipModuleLaunchKernel)


def _compiler_api() -> Any:
    def hiprtcDestroyProgram(prog: Any) -> Any:
        return hiprtc.hiprtcDestroyProgram(prog.createRef())  # it takes hiprtcProgram*

    return SimpleNamespace(
        nvrtcCreateProgram=hiprtc.hiprtcCreateProgram,
        nvrtcCompileProgram=hiprtc.hiprtcCompileProgram,
        nvrtcGetProgramLogSize=hiprtc.hiprtcGetProgramLogSize,
        nvrtcGetProgramLog=hiprtc.hiprtcGetProgramLog,
        nvrtcDestroyProgram=hiprtcDestroyProgram)


class HIPDevice(GPUDevice):
    backend = "hip"
    dialect = "hip"
    drv = _driver_api() if hip else None
    rtc = _compiler_api() if hiprtc else None
    missing = "hip: hip-python is not installed (pip install 'anygpu[hip]')"
    vendor_driver = "AMD GPU driver"
    out_of_memory = hip.hipError_t.hipErrorOutOfMemory if hip else None
    stream_flags = hip.hipStreamNonBlocking if hip else 1

    def _open_context(self) -> None:
        # HIP has no contexts to hold: setting the device selects its primary context.
        self._properties = hip.hipDeviceProp_t()
        self._check(hip.hipGetDeviceProperties, self._properties, self.index)

    def _make_current(self) -> None:
        self._check(hip.hipSetDevice, self.index)

    @property
    def _arch(self) -> str:
        return self._properties.gcnArchName.decode(errors="replace")

    def _query_info(self) -> DeviceInfo:
        props = self._properties
        version = self._check(hip.hipDriverGetVersion)
        rtc_major, rtc_minor = self._check(hiprtc.hiprtcVersion)
        return DeviceInfo(
            name=props.name.decode(errors="replace").strip("\0 "),
            memory=int(props.totalGlobalMem),
            compute_units=int(props.multiProcessorCount),
            driver=f"HIP driver {version} HIPRTC {rtc_major}.{rtc_minor} {self._arch}",
            max_local_size=int(props.maxThreadsPerBlock),
            local_memory=int(props.sharedMemPerBlock),
            # the wavefront's lanes (32 or 64); 0 where not reported: no shuffles then
            extra={"arch": self._arch, "subgroup": int(getattr(props, "warpSize", 0))})

    def _compile_options(self, source: str = "") -> list[bytes]:
        return [b"--offload-arch=" + self._arch.encode(), b"-std=c++17", b"-DNDEBUG"]

    def _binary_calls(self) -> tuple[Callable, Callable]:
        return hiprtc.hiprtcGetCodeSize, hiprtc.hiprtcGetCode

    def _address(self, ptr: Any) -> int:
        try:
            return int(ptr)
        except TypeError:  # hipMalloc's DeviceArray publishes its address this way
            return int(ptr.__cuda_array_interface__["data"][0])


def device_count() -> int:
    return HIPDevice.count()


DEVICE = HIPDevice
