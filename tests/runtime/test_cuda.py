"""The cuda backend against NumPy. Skipped where cuda-python, a driver or a GPU is missing."""

from __future__ import annotations

import os
import threading
import uuid

import numpy as np
import pytest

from anygpu.dtype import bfloat16, float16, float32
from anygpu.runtime import cuda
from anygpu.runtime.base import DeviceError, OutOfMemoryError
from anygpu.runtime.registry import BackendUnavailable, get_device

try:
    cuda.device_count()
except BackendUnavailable as err:
    pytest.skip(str(err), allow_module_level=True)

ADD = """
#define N %d
extern "C" __global__ void add(float* out, const float* a, const float* b) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) out[i] = a[i] + b[i];
}
"""


@pytest.fixture
def dev() -> cuda.CUDADevice:
    return get_device("cuda")  # type: ignore[return-value]


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def upload(dev: cuda.CUDADevice, host: np.ndarray):
    buf = dev.alloc(host.nbytes)
    buf.copy_in(host)
    return buf


def download(buf, like: np.ndarray) -> np.ndarray:
    return buf.copy_out(np.empty_like(like))


def test_info(dev: cuda.CUDADevice) -> None:
    info = dev.info
    assert info.name and info.memory > 2**30 and info.compute_units > 0
    assert "CUDA driver" in info.driver and "NVRTC" in info.driver and " sm_" in info.driver
    assert info.max_local_size >= 1024 and info.local_memory >= 48 * 1024
    assert info.extra["cc"] == dev.compute_capability
    assert dev.supports(float32)
    assert dev.supports(bfloat16) == (dev.compute_capability >= (8, 0))
    assert dev.supports(float16) == (dev.compute_capability >= (5, 3))


@pytest.mark.parametrize("n", [1, 1000, (1 << 20) + 3])
def test_round_trip(dev: cuda.CUDADevice, rng: np.random.Generator, n: int) -> None:
    host = rng.standard_normal(n).astype(np.float32) + 3.0
    assert np.all(host != 0)
    np.testing.assert_array_equal(download(upload(dev, host), host), host)


def test_copy_in_of_temporaries(dev: cuda.CUDADevice, rng: np.random.Generator) -> None:
    # the host arrays die right after copy_in returns; the queued copies must still see them
    bufs = [upload(dev, rng.standard_normal(4096).astype(np.float32) + i) for i in range(300)]
    expect = np.random.default_rng(1234).standard_normal((300, 4096)).astype(np.float32)
    for i, buf in enumerate(bufs):
        host = np.empty(4096, np.float32)
        np.testing.assert_array_equal(buf.copy_out(host), expect[i] + i)


def test_device_to_device_copy(dev: cuda.CUDADevice, rng: np.random.Generator) -> None:
    host = rng.standard_normal(12345).astype(np.float32) + 3.0
    src = upload(dev, host)
    dst = dev.alloc(host.nbytes)
    dst.copy_in(np.zeros_like(host))
    dev.copy(dst, src)
    np.testing.assert_array_equal(download(dst, host), host)


def test_add_kernel(dev: cuda.CUDADevice, rng: np.random.Generator) -> None:
    n, block = 1000, 256
    a = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    # the output has a tail past n: the kernel's bounds guard must leave it alone
    sentinel = np.full(n + block, 7.5, np.float32)
    out = upload(dev, sentinel)
    prog = dev.program(ADD % n, "add")
    groups = (n + block - 1) // block
    assert prog([out, upload(dev, a), upload(dev, b)], (groups,), (block,)) is None
    result = download(out, sentinel)
    np.testing.assert_array_equal(result[:n], a + b)
    np.testing.assert_array_equal(result[n:], sentinel[n:])


def test_launches_follow_their_buffers(dev: cuda.CUDADevice, rng: np.random.Generator) -> None:
    n = 300
    prog = dev.program(ADD % n, "add")
    sets = []
    for _ in range(3):
        a = rng.standard_normal(n).astype(np.float32)
        b = rng.standard_normal(n).astype(np.float32)
        sets.append((dev.alloc(4 * n), upload(dev, a), upload(dev, b), a + b))
    for out, a, b, expect in sets + sets[::-1] + sets:  # the same buffer sets again and again
        out.copy_in(np.zeros(n, np.float32))
        prog([out, a, b], (2,), (256,))
        np.testing.assert_array_equal(download(out, expect), expect)


def test_three_dimensional_grid(dev: cuda.CUDADevice) -> None:
    source = """
extern "C" __global__ void where(int* out) {
    int block = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    int thread = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
    out[block * blockDim.x * blockDim.y * blockDim.z + thread] = block * 1000 + thread;
}
"""
    groups, local = (3, 2, 2), (8, 4)
    count = 12 * 32
    out = upload(dev, np.full(count, -1, np.int32))
    dev.program(source, "where")([out], groups, local)
    result = download(out, np.empty(count, np.int32))
    expect = np.arange(12)[:, None] * 1000 + np.arange(32)[None, :]
    np.testing.assert_array_equal(result, expect.reshape(-1))


def test_half_precision_headers(dev: cuda.CUDADevice, rng: np.random.Generator) -> None:
    if not dev.supports(bfloat16):
        pytest.skip("bfloat16 needs compute capability 8.0")
    source = """
#include <cuda_fp16.h>
#include <cuda_bf16.h>
extern "C" __global__ void twice(__half* h, __nv_bfloat16* b) {
    int i = threadIdx.x;
    h[i] = __float2half(__half2float(h[i]) * 2.0f);
    b[i] = __float2bfloat16(__bfloat162float(b[i]) * 2.0f);
}
"""
    h = rng.standard_normal(64).astype(np.float16)
    b = np.full(64, 0x3FC0, np.uint16)  # bfloat16 1.5
    hbuf, bbuf = upload(dev, h), upload(dev, b)
    dev.program(source, "twice")([hbuf, bbuf], (1,), (64,))
    np.testing.assert_array_equal(download(hbuf, h), h * np.float16(2))
    np.testing.assert_array_equal(download(bbuf, b), np.full(64, 0x4040, np.uint16))  # 3.0


def test_wait_returns_seconds(dev: cuda.CUDADevice) -> None:
    n = 1 << 22
    a = upload(dev, np.ones(n, np.float32))
    prog = dev.program(ADD % n, "add")
    seconds = prog([dev.alloc(4 * n), a, a], ((n + 255) // 256,), (256,), wait=True)
    assert isinstance(seconds, float) and 0 < seconds < 1


def test_bad_source_raises_with_log(dev: cuda.CUDADevice) -> None:
    source = 'extern "C" __global__ void bad(float* x) { x[0] = undefined_name; }'
    with pytest.raises(DeviceError) as info:
        dev.compile(source, "bad")
    message = str(info.value)
    assert "cuda:0" in message and "bad" in message
    assert 'identifier "undefined_name" is undefined' in message  # the NVRTC log
    assert source in message


def test_missing_kernel_name_raises(dev: cuda.CUDADevice) -> None:
    with pytest.raises(DeviceError, match="cuModuleGetFunction"):
        dev.program(ADD % 4, "not_add")


def test_out_of_memory(dev: cuda.CUDADevice) -> None:
    size = 1 << 50
    with pytest.raises(OutOfMemoryError) as info:
        dev.alloc(size)
    assert isinstance(info.value, MemoryError)
    assert "cuda:0" in str(info.value) and str(size) in str(info.value)
    buf = dev.alloc(1024)  # the device still works
    assert buf.nbytes == 1024


def test_other_thread(dev: cuda.CUDADevice, rng: np.random.Generator) -> None:
    host = rng.standard_normal(999).astype(np.float32) + 3.0
    results: list[np.ndarray] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            results.append(download(upload(dev, host), host))
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            errors.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert not errors, errors
    np.testing.assert_array_equal(results[0], host)


def test_disk_cache(dev: cuda.CUDADevice, cache_dir, monkeypatch) -> None:
    source = ADD % 100 + f"// {uuid.uuid4()}\n"  # new to every cache
    dev.program(source, "add")
    folder = cache_dir / "programs" / "cuda"
    files = os.listdir(folder)
    assert len(files) == 1
    binary = (folder / files[0]).read_bytes()
    if dev._target[1]:
        assert binary.startswith(b"\x7fELF")  # a CUBIN: nothing left for the driver to compile
    # a second process would load the file without compiling
    del dev._programs[("add", source)]

    def no_compile(source: str, name: str) -> bytes:
        raise AssertionError("compiled again despite the disk cache")

    monkeypatch.setattr(dev, "compile", no_compile)
    prog = dev.program(source, "add")
    a = upload(dev, np.arange(100, dtype=np.float32) + 1)
    out = dev.alloc(400)
    prog([out, a, a], (1,), (128,))
    np.testing.assert_array_equal(download(out, np.empty(100, np.float32)),
                                  2 * (np.arange(100, dtype=np.float32) + 1))
