"""The webgpu backend: adapter choice, memory, transfers, WGSL kernels and their errors.

The adapter tests need no GPU; the rest skip where the backend is unavailable.
"""

from __future__ import annotations

import gc
import math
import types

import numpy as np
import pytest

from anygpu import config
from anygpu import dtype as dt
from anygpu.runtime import webgpu
from anygpu.runtime.base import DeviceError, OutOfMemoryError
from anygpu.runtime.registry import BackendUnavailable, get_device

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


LLVMPIPE_GL = {"device": "llvmpipe (LLVM 15.0.6, 256 bits)", "backend_type": "OpenGL",
               "adapter_type": "CPU"}
LAVAPIPE = {"device": "llvmpipe (LLVM 15.0.6, 256 bits)", "backend_type": "Vulkan",
            "adapter_type": "CPU"}
GPU_GL = {"device": "Some GPU", "backend_type": "OpenGLES", "adapter_type": "DiscreteGPU"}
GPU_VULKAN = {"device": "Some GPU", "backend_type": "Vulkan", "adapter_type": "DiscreteGPU"}


# ---- adapter choice (no GPU needed) ------------------------------------------------------------
def test_opengl_adapter_is_refused_unless_asked_for() -> None:
    with pytest.raises(BackendUnavailable) as info:
        webgpu._choose_adapter([LLVMPIPE_GL], allow_opengl=False)
    message = str(info.value)
    assert "llvmpipe (LLVM 15.0.6, 256 bits) (OpenGL)" in message  # names what it found
    assert "ANYGPU_WEBGPU_OPENGL=1" in message and "mesa-vulkan-drivers" in message
    assert webgpu._choose_adapter([LLVMPIPE_GL], allow_opengl=True) == 0


def test_adapter_preference() -> None:
    choose = webgpu._choose_adapter
    # Vulkan before OpenGL even when OpenGL is allowed, and whatever the order found
    assert choose([LLVMPIPE_GL, LAVAPIPE], allow_opengl=True) == 1
    assert choose([GPU_GL, LAVAPIPE], allow_opengl=True) == 1
    assert choose([GPU_GL, LAVAPIPE], allow_opengl=False) == 1
    # a GPU before the processor; among equals, the first found
    assert choose([LAVAPIPE, GPU_VULKAN, GPU_GL], allow_opengl=False) == 1
    assert choose([GPU_VULKAN, dict(GPU_VULKAN)], allow_opengl=False) == 0
    with pytest.raises(BackendUnavailable, match="no adapter found.*mesa-vulkan-drivers"):
        choose([], allow_opengl=True)


def test_setting_opts_in_to_opengl(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_adapter`` reads ANYGPU_WEBGPU_OPENGL and returns the adapter it chose."""
    found = [types.SimpleNamespace(info=LLVMPIPE_GL)]
    fake_gpu = types.SimpleNamespace(enumerate_adapters_sync=lambda: found)
    monkeypatch.setattr(webgpu, "wgpu", types.SimpleNamespace(gpu=fake_gpu))
    webgpu._adapter.cache_clear()
    try:
        monkeypatch.delenv("ANYGPU_WEBGPU_OPENGL", raising=False)
        config.reload()
        with pytest.raises(BackendUnavailable, match=r"\(OpenGL\).*ANYGPU_WEBGPU_OPENGL=1"):
            webgpu.device_count()
        webgpu._adapter.cache_clear()
        monkeypatch.setenv("ANYGPU_WEBGPU_OPENGL", "1")
        config.reload()
        assert webgpu._adapter() is found[0]
    finally:
        monkeypatch.undo()
        config.reload()
        webgpu._adapter.cache_clear()


# ---- the device ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dev() -> webgpu.WebGPUDevice:
    try:
        return get_device("webgpu")  # type: ignore[return-value]
    except BackendUnavailable as err:
        pytest.skip(str(err))


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(13)


def upload(dev: webgpu.WebGPUDevice, host: np.ndarray):
    buf = dev.alloc(host.nbytes)
    buf.copy_in(host)
    return buf


def download(buf, like: np.ndarray) -> np.ndarray:
    return buf.copy_out(np.empty_like(like))


def add_program(dev: webgpu.WebGPUDevice, n: int) -> webgpu.WebGPUProgram:
    prog = dev.program(ADD.replace("{n}", str(n)), "add")
    assert isinstance(prog, webgpu.WebGPUProgram)
    return prog


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
    prog = add_program(dev, n)
    acc, step = upload(dev, x), upload(dev, x)
    tmp = dev.alloc(x.nbytes)
    created = prog.bind_groups_created
    for _ in range(3):
        prog([tmp, acc, step], groups=(3,), local=(64,))
        dev.copy(acc, tmp)
    assert prog.bind_groups_created == created + 1  # one bind group for three launches
    np.testing.assert_allclose(download(acc, x), 4 * x, rtol=1e-6)
    prog([acc, tmp, step], groups=(3,), local=(64,))  # the same buffers in other roles
    assert prog.bind_groups_created == created + 2
    np.testing.assert_allclose(download(acc, x), 5 * x, rtol=1e-6)


def test_bind_group_cache_is_bounded(dev: webgpu.WebGPUDevice, rng: np.random.Generator,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Evicted bind groups are released while launches that used them may still be queued."""
    monkeypatch.setattr(webgpu, "_BIND_GROUP_CACHE", 2)
    n = 64
    x = rng.uniform(0.5, 2.0, size=n).astype(np.float32)
    prog = add_program(dev, n)
    outs = [dev.alloc(x.nbytes) for _ in range(5)]
    a, b = upload(dev, x), upload(dev, x)
    for _ in range(3):
        for out in outs:
            prog([out, a, b], groups=(1,), local=(64,))
        gc.collect()
    assert len(prog._bind_groups) == 2
    for out in outs:
        np.testing.assert_array_equal(download(out, x), 2 * x)


def test_buffers_freed_in_reference_cycles_stay_usable(dev: webgpu.WebGPUDevice,
                                                        rng: np.random.Generator) -> None:
    """A buffer collected in a reference cycle goes back to the allocator still alive.

    The collector finalizes everything a cycle alone kept alive, in the order of its object
    list. A collection that finds a buffer alive moves its wgpu handle behind it in that list;
    when the buffer later dies in a cycle, its finalizer returned the handle to the free list
    before the handle's own finalizer released it, and the next launch that bound the released
    handle aborted the process inside wgpu-native."""
    n = 96
    x = rng.uniform(0.5, 2.0, size=n).astype(np.float32)
    prog = dev.program(ADD.replace("{n}", str(n)), "add")
    holders: list[dict[str, object]] = [{"buffer": dev.alloc(x.nbytes)} for _ in range(8)]
    gc.collect()  # finds the buffers alive: each handle now comes after its buffer
    for holder in holders:
        holder["self"] = holder  # a cycle: only the collector frees it
    del holders, holder
    gc.collect()
    for _ in range(8):
        out, a, b = (dev.alloc(x.nbytes) for _ in range(3))
        assert all(buf.handle._internal is not None for buf in (out, a, b))
        a.copy_in(x)
        b.copy_in(x)
        prog([out, a, b], groups=(2,), local=(64,))
        np.testing.assert_array_equal(download(out, x), 2 * x)


def test_released_buffer_raises_instead_of_aborting(dev: webgpu.WebGPUDevice,
                                                    rng: np.random.Generator) -> None:
    x = rng.uniform(0.5, 2.0, size=64).astype(np.float32)
    prog = add_program(dev, 64)
    gone = types.SimpleNamespace(_internal=None, size=256)
    bufs = [dev.alloc(x.nbytes), upload(dev, x), upload(dev, x)]
    with pytest.raises(DeviceError, match="buffer 2 of kernel add was released"):
        prog._bind_group((bufs[0].handle, bufs[1].handle, gone))


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


BUSY = """
@group(0) @binding(0) var<storage, read_write> b0: array<f32>;

@compute @workgroup_size(64)
fn busy(@builtin(workgroup_id) gid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
  let i = gid.x * 64u + lid.x;
  var x = b0[i];
  for (var k = 0u; k < {iterations}u; k = k + 1u) {
    x = x * 0.999 + 0.001;
  }
  b0[i] = x;
}
"""


def test_synchronize_waits_for_queued_work(dev: webgpu.WebGPUDevice) -> None:
    """After synchronize the device reports its queue empty (asked without waiting)."""
    out = upload(dev, np.zeros(64 * 64, np.float32))
    dev.synchronize()
    assert dev._idle()
    # a kernel long enough to be seen still running right after it was queued
    for iterations in (1 << 10, 1 << 13, 1 << 16, 1 << 19):
        dev.program(BUSY.replace("{iterations}", str(iterations)), "busy")([out], groups=(64,),
                                                                           local=(64,))
        if not dev._idle():
            break
    else:
        pytest.skip("every kernel finished before the queue could be seen busy")
    dev.synchronize()
    assert dev._idle()
