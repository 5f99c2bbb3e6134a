"""The cpu backend: C from the system compiler, loaded with ctypes, threads through OpenMP.

Buffers are NumPy byte arrays; a kernel is a C function taking one pointer per buffer. Launches run
synchronously on the calling thread (OpenMP spreads each kernel's outer loop over the cores).
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import platform
import subprocess
import tempfile
import time
from typing import Any, Sequence

import numpy as np

from anygpu import config
from anygpu.codegen.render.c import VECTOR_MATH
from anygpu.dtype import bfloat16, float16, float32
from anygpu.runtime.base import Buffer, Device, DeviceError, DeviceInfo, Program


def device_count() -> int:
    return 1


@functools.lru_cache(maxsize=None)
def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=None)
def _compiler_flags() -> tuple[str, ...]:
    """The flags kernels compile with: -fopenmp where the compiler has it (Apple clang does
    not: then one thread), and GCC's -fno-tree-loop-if-convert. GCC 12 at -O3 vectorized a
    sum whose terms select between a load and zero (a ReLU's gradient inside a convolution's
    weight gradient) with masked loads that read the wrong elements: the result was silently
    wrong. Without if-conversion such loops stay scalar; the others still vectorize.
    -fno-math-errno: kernels never read errno, and with it set sqrtf was a library call in
    every element's loop (a batch norm's scale computed per element) instead of one
    instruction that vectorizes. -DANYGPU_VECTOR_MATH where glibc's vector math library links
    (see _libraries)."""
    base = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared",
            "-x", "c")
    optional = ("-fopenmp", "-fno-tree-loop-if-convert")
    taken: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for flag in optional:
            probe = subprocess.run([config.get().cc, *base, *taken, flag, "-Werror", "-", "-o",
                                    os.path.join(tmp, "probe.so")],
                                   input=b"int probe(void){return 0;}", capture_output=True)
            if probe.returncode == 0:
                taken.append(flag)
        if "-fopenmp" in taken:
            flags = (*base, *taken, "-DANYGPU_VECTOR_MATH")
            probe = subprocess.run([config.get().cc, *flags, "-Werror", "-", "-o",
                                    os.path.join(tmp, "probe.so"), *VECTOR_MATH_LIBRARIES],
                                   input=VECTOR_MATH_PROBE.encode(), capture_output=True)
            if probe.returncode == 0:
                return flags
    return (*base, *taken)


# glibc's vector math library (libmvec, glibc 2.35 and later for exp2f and log2f): with the
# functions declared `omp declare simd` (render/c.py's prelude, under ANYGPU_VECTOR_MATH), GCC
# vectorizes loops that call them, 8 or 16 lanes a call instead of one (BERT's GELU and softmax
# on the processor spent most of their time in scalar exp2f)
VECTOR_MATH_LIBRARIES = ("-lmvec", "-lm")
VECTOR_MATH_PROBE = """\
#include <math.h>
#include <string.h>
%s
void probe(float* restrict o, const float* restrict a, int n) {
  for (int i = 0; i < n; i++) o[i] = exp2f(a[i]) + log2f(a[i]) + sinf(a[i]);
}
""" % VECTOR_MATH


def _libraries() -> tuple[str, ...]:
    return VECTOR_MATH_LIBRARIES if "-DANYGPU_VECTOR_MATH" in _compiler_flags() else ("-lm",)


@functools.lru_cache(maxsize=None)
def _compiler_version() -> str:
    try:
        out = subprocess.run([config.get().cc, "--version"], capture_output=True, text=True)
        return out.stdout.splitlines()[0] if out.stdout else "unknown"
    except OSError as err:
        raise DeviceError(f"cpu: the C compiler {config.get().cc!r} was not found; set ANYGPU_CC "
                          "to a C compiler") from err


class CPUProgram(Program):
    def __init__(self, device: "CPUDevice", name: str, lib: ctypes.CDLL, path: str,
                 symbol: str | None = None):
        super().__init__(device, name)
        self.lib, self.path = lib, path  # keep the library loaded as long as the program lives
        self.fn = getattr(lib, symbol or name)
        self.fn.restype = None

    def __call__(self, buffers: Sequence[Buffer], groups: Sequence[int] = (1,),
                 local: Sequence[int] = (1,), wait: bool = False) -> float | None:
        args = [ctypes.c_void_p(b.handle.ctypes.data) for b in buffers]
        start = time.perf_counter()
        self.fn(*args)
        return time.perf_counter() - start if wait else None


class _Scratch:
    """A host array passed to a kernel as a buffer."""

    def __init__(self, array: np.ndarray):
        self.handle = array


class HostContraction(Program):
    """A contraction on the processor: the product through NumPy's BLAS (``plan``: a
    codegen.templates.gemm.HostPlan) on strided views of the input buffers, in float32, then the
    compiled epilogue kernel, which reads the product as its last buffer."""

    def __init__(self, device: "CPUDevice", epilogue: CPUProgram, plan: Any):
        super().__init__(device, epilogue.name)
        self.epilogue, self.plan = epilogue, plan
        # the output runs along M within N (a convolution's channels by pixels): the product
        # transposed, y.T @ x.T, comes out in its order (a transposing copy of ResNet-50's
        # 3136 x 256 products took 4 ms of a 5 ms 1x1 convolution)
        batch = {name for name, _ in plan.batch}
        self.transposed = [o for o in plan.order if o not in batch] == \
            [name for name, _ in plan.n + plan.m]
        self.dims = plan.batch + (plan.n + plan.m if self.transposed else plan.m + plan.n)
        names = [name for name, _ in self.dims]
        self.order = [names.index(o) for o in plan.order]  # the product's axes, output's order
        batch_sizes = tuple(size for _, size in plan.batch)
        m, n, k = (math.prod(size for _, size in dims) for dims in (plan.m, plan.n, plan.k))
        self.x_shape, self.y_shape = batch_sizes + (m, k), batch_sizes + (k, n)
        self.product_shape = [size for _, size in self.dims]  # M and N as their variables

    def _view(self, buffers: Sequence[Buffer], operand: Any, shape: tuple[int, ...]) -> np.ndarray:
        """The operand as a float32 array: a strided view of its buffer, widened from float16
        or bfloat16 (a copy) where it is stored narrower."""
        stored = {float32: np.float32, float16: np.float16, bfloat16: np.uint16}[operand.dtype]
        data = buffers[int(operand.param[1:])].handle.view(stored)
        itemsize = data.itemsize
        view = np.lib.stride_tricks.as_strided(
            data[operand.offset:], shape=shape,
            strides=tuple(s * itemsize for s in operand.strides), writeable=False)
        if operand.dtype == bfloat16:  # the upper half of a float32's bits
            return (view.astype(np.uint32) << 16).view(np.float32)
        return view if operand.dtype == float32 else view.astype(np.float32)

    def __call__(self, buffers: Sequence[Buffer], groups: Sequence[int] = (1,),
                 local: Sequence[int] = (1,), wait: bool = False) -> float | None:
        start = time.perf_counter()
        x = self._view(buffers, self.plan.x, self.x_shape)
        y = self._view(buffers, self.plan.y, self.y_shape)
        if self.transposed:
            product = np.matmul(np.swapaxes(y, -1, -2), np.swapaxes(x, -1, -2))
        else:
            product = np.matmul(x, y)
        product = np.ascontiguousarray(product.reshape(self.product_shape).transpose(self.order))
        self.epilogue([*buffers, _Scratch(product.reshape(-1))])  # type: ignore[list-item]
        return time.perf_counter() - start if wait else None


class CPUDevice(Device):
    backend = "cpu"
    dialect = "c"

    def __init__(self, index: int = 0):
        super().__init__(index)
        threads = config.get().cpu_threads
        if threads:
            os.environ["OMP_NUM_THREADS"] = str(threads)
        # Threads that finish a kernel spin briefly, then sleep (GNU OpenMP reads this when it
        # loads, with the first kernel, unless PyTorch loaded it before; a setting of the
        # user's stays). Spinning for long, they took the cores that BLAS's threads wanted
        # after them: ResNet-50's inference on 2 cores took 480 ms, now 120. PyTorch's own
        # OpenMP work keeps its speed at this count (sleeping at once cost it 1.5x).
        if "OMP_WAIT_POLICY" not in os.environ:
            os.environ.setdefault("GOMP_SPINCOUNT", "3000")
        self._info: DeviceInfo | None = None

    @property
    def info(self) -> DeviceInfo:
        if self._info is None:
            try:
                pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            except (ValueError, OSError):
                pages = 0
            self._info = DeviceInfo(name=_cpu_name(), memory=pages,
                                    compute_units=os.cpu_count() or 1,
                                    driver=_compiler_version() + " " + " ".join(_compiler_flags()),
                                    max_local_size=1, local_memory=0, is_cpu=True)
        return self._info

    def _alloc(self, nbytes: int) -> Any:
        # 64-byte alignment lets the compiler use aligned vector loads
        raw = np.empty(nbytes + 64, dtype=np.uint8)
        offset = (-raw.ctypes.data) % 64
        return raw[offset:offset + nbytes]

    def _free(self, handle: Any) -> None:
        pass  # NumPy memory goes back when the last reference does

    sub_buffer_align = 64  # as _alloc aligns

    def _sub_handle(self, handle: Any, offset: int, nbytes: int) -> Any:
        return handle[offset:offset + nbytes]

    def _copy_in(self, handle: Any, host: np.ndarray) -> None:
        handle[:] = host.reshape(-1).view(np.uint8)

    def _copy_out(self, host: np.ndarray, handle: Any) -> None:
        host.reshape(-1).view(np.uint8)[:] = handle

    def _copy(self, dst: Any, src: Any, nbytes: int) -> None:
        dst[:nbytes] = src[:nbytes]

    def compile(self, source: str, name: str) -> bytes:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, f"{name}.so")
            proc = subprocess.run([config.get().cc, *_compiler_flags(), "-", "-o", out,
                                   *_libraries()], input=source.encode(), capture_output=True)
            if proc.returncode != 0:
                errors = proc.stderr.decode(errors="replace")
                raise DeviceError(f"cpu: compiling kernel {name} failed:\n"
                                  f"{errors}\n--- source ---\n{source}")
            with open(out, "rb") as f:
                return f.read()

    # many kernels compiled as one shared library (see Device.prebuild)
    shared_libraries = True

    def compile_library(self, source: str, name: str) -> tuple[bytes, Any]:
        return self.compile(source, name), None

    def load_library(self, path: str, source: str) -> Any:
        return ctypes.CDLL(path)  # mapped once however many of its kernels are loaded

    def program_in(self, library: Any, name: str, symbol: str) -> Program:
        return CPUProgram(self, name, library, library._name, symbol)

    def load(self, binary: bytes, name: str, source: str) -> Program:
        fd, path = tempfile.mkstemp(suffix=".so", prefix=f"anygpu_{name}_")
        with os.fdopen(fd, "wb") as f:
            f.write(binary)
        try:
            lib = ctypes.CDLL(path)
        finally:
            os.unlink(path)  # the mapping stays valid after the file is gone
        return CPUProgram(self, name, lib, path)

    def contraction_program(self, epilogue: Program, plan: Any) -> Program:
        assert isinstance(epilogue, CPUProgram)
        return HostContraction(self, epilogue, plan)

    def synchronize(self) -> None:
        pass


DEVICE = CPUDevice
