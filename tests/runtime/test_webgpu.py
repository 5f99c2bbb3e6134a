"""The webgpu backend: memory, transfers, WGSL kernels and their errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

from anygpu import dtype as dt
from anygpu.runtime import webgpu
from anygpu.runtime.base import DeviceError, OutOfMemoryError
from anygpu.runtime.registry import BackendUnavailable, get_device

try:
    webgpu.device_count()
except BackendUnavailable as err:
    pytest.skip(str(err), allow_module_level=True)

ADD = """
@group(0) @binding(0) var<storage, read_write> b0: array<f32>;
@group(0) @binding(1) var<storage, read_write> b1: array<f32>;
@group(0) @binding(2) var<storage, read_write> b2: array<f32>;

@compute @workgroup_size(64)
fn add(@builtin(workgroup_id) gid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
  let i = gid.x * 64u + lid.x;
  if (i < {n}u) {
    b0[i] = b1[i] + b2[i];
  }
}
"""

# binding 1 is declared but never read: it must still be bound
SKIP_MIDDLE = """
@group(0) @binding(0) var<storage, read_write> b0: array<f32>;
@group(0) @binding(1) var<storage, read_write> b1: array<f32>;
@group(0) @binding(2) var<storage, read_write> b2: array<f32>;

@compute @workgroup_size(32)
fn twice(@builtin(workgroup_id) gid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
  let i = gid.x * 32u + lid.x;
  if (i < {n}u) {
    b0[i] = 2.0 * b2[i];
  }
}
"""


@pytest.fixture(scope="module")
def dev() -> webgpu.WebGPUDevice:
    return get_device("webgpu")  # type: ignore[return-value]


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng()


def upload(dev: webgpu.WebGPUDevice, host: np.ndarray):
    buf = dev.alloc(host.nbytes)
    buf.copy_in(host)
    return buf


def download(buf, like: np.ndarray) -> np.ndarray:
    return buf.copy_out(np.empty_like(like))


def test_info(dev: webgpu.WebGPUDevice) -> None:
    info = dev.info
    assert dev.name == "webgpu:0" and dev.dialect == "wgsl"
    assert info.name and info.memory == dev.max_buffer_size > 0
    assert info.max_local_size >= 64 and info.local_memory >= 1024
    assert "wgpu" in info.driver
    assert info.extra["features"] == sorted(info.extra["features"])
    assert "adapter_type" in info.extra


def test_round_trip_float32(dev: webgpu.WebGPUDevice, rng: np.random.Generator) -> None:
    host = rng.uniform(-2.0, 2.0, size=1001).astype(np.float32)
    buf = upload(dev, host)
    assert buf.nbytes == host.nbytes
    np.testing.assert_array_equal(download(buf, host), host)


@pytest.mark.parametrize("nbytes", [1, 5, 7, 4099])
def test_round_trip_unaligned_bytes(dev: webgpu.WebGPUDevice, rng: np.random.Generator,
                                    nbytes: int) -> None:
    host = rng.integers(1, 256, size=nbytes, dtype=np.uint8)
    buf = upload(dev, host)
    assert buf.nbytes == nbytes
    np.testing.assert_array_equal(download(buf, host), host)


def test_round_trip_float16_six_bytes(dev: webgpu.WebGPUDevice,
                                      rng: np.random.Generator) -> None:
    if not dev.supports(dt.float16):
        pytest.skip("adapter has no shader-f16")
    host = rng.uniform(0.5, 2.0, size=3).astype(np.float16)
    buf = upload(dev, host)
    assert buf.nbytes == 6
    np.testing.assert_array_equal(download(buf, host), host)


@pytest.mark.parametrize("nbytes", [6, 4096])
def test_device_copy(dev: webgpu.WebGPUDevice, rng: np.random.Generator, nbytes: int) -> None:
    host = rng.integers(1, 256, size=nbytes, dtype=np.uint8)
    src = upload(dev, host)
    dst = dev.alloc(nbytes)
    dst.copy_in(rng.integers(1, 256, size=nbytes, dtype=np.uint8))
    dev.copy(dst, src)
    np.testing.assert_array_equal(download(dst, host), host)


def run_add(dev: webgpu.WebGPUDevice, rng: np.random.Generator, n: int, wait: bool):
    a = rng.uniform(-4.0, 4.0, size=n).astype(np.float32)
    b = rng.uniform(-4.0, 4.0, size=n).astype(np.float32)
    out = dev.alloc(a.nbytes)
    prog = dev.program(ADD.replace("{n}", str(n)), "add")
    elapsed = prog([out, upload(dev, a), upload(dev, b)], groups=(math.ceil(n / 64),),
                   local=(64,), wait=wait)
    return elapsed, download(out, a), a + b


def test_add_kernel(dev: webgpu.WebGPUDevice, rng: np.random.Generator) -> None:
    n = 1000  # not a multiple of the work-group size: the guard keeps the tail in bounds
    elapsed, got, want = run_add(dev, rng, n, wait=False)
    assert elapsed is None
    np.testing.assert_array_equal(got, want)


def test_wait_returns_seconds(dev: webgpu.WebGPUDevice, rng: np.random.Generator) -> None:
    elapsed, got, want = run_add(dev, rng, 100_003, wait=True)
    assert isinstance(elapsed, float) and 0 < elapsed < 60
    np.testing.assert_array_equal(got, want)


def test_unused_binding_is_still_bound(dev: webgpu.WebGPUDevice,
                                       rng: np.random.Generator) -> None:
    n = 77
    x = rng.uniform(0.5, 2.0, size=n).astype(np.float32)
    out, unused = dev.alloc(x.nbytes), upload(dev, x)
    prog = dev.program(SKIP_MIDDLE.replace("{n}", str(n)), "twice")
    prog([out, unused, upload(dev, x)], groups=(math.ceil(n / 32),), local=(32,))
    np.testing.assert_array_equal(download(out, x), 2 * x)


def test_repeated_launches_reuse_bind_groups(dev: webgpu.WebGPUDevice,
                                             rng: np.random.Generator) -> None:
    n = 130
    x = rng.uniform(0.5, 2.0, size=n).astype(np.float32)
    prog = dev.program(ADD.replace("{n}", str(n)), "add")
    acc, step = upload(dev, x), upload(dev, x)
    tmp = dev.alloc(x.nbytes)
    for _ in range(3):
        prog([tmp, acc, step], groups=(3,), local=(64,))
        dev.copy(acc, tmp)
    dev.synchronize()
    np.testing.assert_allclose(download(acc, x), 4 * x, rtol=1e-6)


def test_invalid_wgsl_raises(dev: webgpu.WebGPUDevice) -> None:
    source = "@compute @workgroup_size(1) fn broken() { let x: f32 = ; }"
    with pytest.raises(DeviceError, match="compiling kernel broken") as info:
        dev.program(source, "broken")
    assert "expected expression" in str(info.value)
    assert source in str(info.value)


def test_missing_entry_point_raises(dev: webgpu.WebGPUDevice) -> None:
    with pytest.raises(DeviceError, match="nothere"):
        dev.program(ADD.replace("{n}", "4"), "nothere")


def test_compile_returns_source(dev: webgpu.WebGPUDevice) -> None:
    source = ADD.replace("{n}", "8")
    assert dev.compile(source, "add") == source.encode()


def test_launch_errors(dev: webgpu.WebGPUDevice, rng: np.random.Generator) -> None:
    x = rng.uniform(0.5, 2.0, size=64).astype(np.float32)
    a, b = upload(dev, x), upload(dev, x)
    prog = dev.program(ADD.replace("{n}", "64"), "add")
    with pytest.raises(ValueError, match="same buffer"):
        prog([a, b, b], groups=(1,), local=(64,))
    with pytest.raises(ValueError, match="declares 3 buffers"):
        prog([a, b], groups=(1,), local=(64,))
    with pytest.raises(ValueError, match="at most"):
        prog([a, b, dev.alloc(x.nbytes)], groups=(dev.max_groups + 1,), local=(64,))
    with pytest.raises(ValueError, match="workgroup_size"):
        prog([a, b, dev.alloc(x.nbytes)], groups=(1,), local=(128,))


def test_storage_dtype_and_supports(dev: webgpu.WebGPUDevice) -> None:
    assert dev.storage_dtype(dt.int8) == dt.int32
    assert dev.storage_dtype(dt.uint8) == dt.uint32
    assert dev.storage_dtype(dt.bool_) == dt.uint32
    assert dev.storage_dtype(dt.float32) == dt.float32
    assert not dev.supports(dt.bfloat16)
    assert dev.supports(dt.float32) and dev.supports(dt.int32)
    assert dev.supports(dt.float16) == ("shader-f16" in dev.features)
    assert dev.supports(dt.int64) == ("shader-int64" in dev.features)


def test_out_of_memory(dev: webgpu.WebGPUDevice) -> None:
    size = 1 << 44
    with pytest.raises(OutOfMemoryError) as info:
        dev.alloc(size)
    assert "webgpu:0" in str(info.value) and str(size) in str(info.value)


def test_synchronize(dev: webgpu.WebGPUDevice, rng: np.random.Generator) -> None:
    n = 4096
    a = rng.uniform(0.5, 2.0, size=n).astype(np.float32)
    out = dev.alloc(a.nbytes)
    prog = dev.program(ADD.replace("{n}", str(n)), "add")
    prog([out, upload(dev, a), upload(dev, a)], groups=(n // 64,), local=(64,))
    dev.synchronize()
    np.testing.assert_array_equal(download(out, a), 2 * a)
