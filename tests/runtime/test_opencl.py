"""The opencl backend on whatever OpenCL device is present (PoCL's CPU device in CI)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pyopencl")

from anygpu.dtype import bfloat16, float16, float32, int64
from anygpu.runtime import opencl
from anygpu.runtime.base import SHARED_MARK, DeviceError, OutOfMemoryError
from anygpu.runtime.registry import BackendUnavailable, get_device

try:
    opencl.device_count()
except BackendUnavailable as err:
    pytest.skip(str(err), allow_module_level=True)

ADD = """
__kernel void add(__global float* out, __global const float* a, __global const float* b) {
    int i = get_global_id(0);
    out[i] = a[i] + b[i];
}
"""


# every test compiles into its own program cache (conftest.py), never the user's
pytestmark = pytest.mark.usefixtures("cache_dir")


@pytest.fixture
def dev() -> opencl.OpenCLDevice:
    return get_device("opencl:0")


_RNG = np.random.default_rng(11)


def _random(n: int) -> np.ndarray:
    return _RNG.standard_normal(n).astype(np.float32)


def test_device_and_info(dev):
    assert dev.name == "opencl:0" and dev.backend == "opencl" and dev.dialect == "opencl"
    info = dev.info
    assert info.memory > 0 and info.compute_units > 0 and info.max_local_size > 0
    assert info.extra["platform"] in info.driver
    assert dev.supports(float32) and dev.supports(bfloat16) and dev.supports(int64)
    assert dev.supports(float16) == info.extra["fp16"]


def test_gpus_come_first():
    import pyopencl as cl

    types = [d.type & cl.device_type.GPU for d in opencl._cl_devices()]
    assert types == sorted(types, reverse=True)


def test_round_trip(dev):
    host = _random(1000)
    buf = dev.alloc(host.nbytes)
    buf.copy_in(host)
    np.testing.assert_array_equal(buf.copy_out(np.empty_like(host)), host)


def test_copy_in_does_not_alias_the_host_array(dev):
    host = _random(1 << 16)
    expected = host.copy()
    buf = dev.alloc(host.nbytes)
    buf.copy_in(host)
    host[:] = 0  # changing the source right after copy_in must not reach the device
    np.testing.assert_array_equal(buf.copy_out(np.empty_like(host)), expected)


def test_device_to_device_copy(dev):
    host = _random(4096)
    src, dst = dev.alloc(host.nbytes), dev.alloc(host.nbytes)
    src.copy_in(host)
    dev.copy(dst, src)
    np.testing.assert_array_equal(dst.copy_out(np.empty_like(host)), host)


def test_launch_add(dev):
    n = 64 * 256
    a, b = _random(n), _random(n)
    bufs = [dev.alloc(a.nbytes) for _ in range(3)]
    bufs[1].copy_in(a)
    bufs[2].copy_in(b)
    prog = dev.load(dev.compile(ADD, "add"), "add", ADD)
    assert prog([bufs[0], bufs[1], bufs[2]], groups=(n // 64,), local=(64,)) is None
    np.testing.assert_array_equal(bufs[0].copy_out(np.empty_like(a)), a + b)
    assert prog.kernel is prog.kernel  # created once


def test_two_dimensional_launch(dev):
    src = """
    __kernel void scale2d(__global float* out, __global const float* a) {
        int i = get_global_id(1) * get_global_size(0) + get_global_id(0);
        out[i] = 2.0f * a[i];
    }
    """
    a = _random(32 * 6)
    out, inp = dev.alloc(a.nbytes), dev.alloc(a.nbytes)
    inp.copy_in(a)
    dev.program(src, "scale2d")([out, inp], groups=(2, 6), local=(16,))  # local padded to 1
    np.testing.assert_array_equal(out.copy_out(np.empty_like(a)), 2 * a)


def test_wait_returns_kernel_time(dev):
    n = 64 * 1024
    bufs = [dev.alloc(4 * n) for _ in range(3)]
    for buf in bufs[1:]:
        buf.copy_in(_random(n))
    prog = dev.program(ADD, "add")
    seconds = prog(bufs, groups=(n // 64,), local=(64,), wait=True)
    assert isinstance(seconds, float) and 0 < seconds < 10


def test_load_falls_back_to_source(dev):
    n = 128
    a, b = _random(n), _random(n)
    bufs = [dev.alloc(a.nbytes) for _ in range(3)]
    bufs[1].copy_in(a)
    bufs[2].copy_in(b)
    prog = dev.load(b"not a binary", "add", ADD)
    prog(bufs, groups=(2,), local=(64,))
    np.testing.assert_array_equal(bufs[0].copy_out(np.empty_like(a)), a + b)


def test_compile_error_has_build_log(dev):
    bad = "__kernel void broken(__global float* out) { out[0] = undefined_name + ; }"
    with pytest.raises(DeviceError) as err:
        dev.compile(bad, "broken")
    message = str(err.value)
    assert "opencl:0" in message and "broken" in message
    assert "undefined_name" in message.split("--- source ---")[0]  # the log, not just the source
    assert bad in message


def test_launch_error_names_device_and_kernel(dev):
    prog = dev.program(ADD, "add")
    bufs = [dev.alloc(256) for _ in range(3)]
    too_big = dev.info.max_local_size * 2
    with pytest.raises(DeviceError, match=r"opencl:0.*add"):
        prog(bufs, groups=(1,), local=(too_big,))


def test_disk_cache(dev, cache_dir, monkeypatch):
    src = ADD.replace("add(", "add_cached(")
    prog = dev.program(src, "add_cached")
    files = list((cache_dir / "programs" / "opencl").iterdir())
    assert len(files) == 1 and files[0].stat().st_size > 0
    # PoCL keeps compiled kernels in its own cache, so the entry is the source; else a binary
    assert files[0].read_bytes().startswith(opencl.SOURCE_MARK) == dev._keep_source
    assert dev.program(src, "add_cached") is prog

    dev._programs.clear()  # the next load must come from the file, without compiling
    calls = []
    monkeypatch.setattr(dev, "compile", lambda *args: calls.append(args))
    n = 64
    a, b = _random(n), _random(n)
    bufs = [dev.alloc(a.nbytes) for _ in range(3)]
    bufs[1].copy_in(a)
    bufs[2].copy_in(b)
    dev.program(src, "add_cached")(bufs, groups=(1,), local=(64,))
    np.testing.assert_array_equal(bufs[0].copy_out(np.empty_like(a)), a + b)
    assert calls == []


def test_allocator_reuses_freed_buffers(dev):
    nbytes = 12345
    buf = dev.alloc(nbytes)
    handle = buf.handle
    del buf
    again = dev.alloc(nbytes)
    assert again.handle is handle


def test_out_of_memory_names_device_and_size(dev):
    size = 1 << 50
    with pytest.raises(OutOfMemoryError) as err:
        dev.alloc(size)
    assert "opencl:0" in str(err.value) and str(size) in str(err.value)
    assert isinstance(err.value, MemoryError)


def test_total_memory_is_accounted(dev):
    # Buffers that each fit but together exceed the device raise instead of failing at first use.
    chunk = min(dev.info.extra["max_alloc"], dev.info.memory)
    held = []
    with pytest.raises(OutOfMemoryError):
        for _ in range(dev.info.memory // chunk + 2):
            held.append(dev.alloc(chunk))
    del held
    dev.allocator.empty_cache()
    assert dev._mem_held == dev.allocator.in_use  # freed buffers are given back to the count


def test_zero_sized_buffers(dev):
    buf, other = dev.alloc(0), dev.alloc(0)
    assert buf.nbytes == 0 and buf.handle.size == 1  # OpenCL has no zero-sized buffers
    queued = len(dev._staged)
    buf.copy_in(np.empty(0, np.float32))
    assert len(dev._staged) == queued  # nothing to transfer, nothing queued
    dev.copy(other, buf)
    host = np.empty(0, np.float32)
    assert buf.copy_out(host) is host and host.shape == (0,)
    with pytest.raises(ValueError, match="copy_in of 4 bytes into a buffer of 0"):
        buf.copy_in(np.zeros(1, np.float32))
    dev.synchronize()


def test_missing_pyopencl_is_backend_unavailable(monkeypatch):
    monkeypatch.setattr(opencl, "cl", None)
    monkeypatch.setattr(opencl, "_IMPORT_ERROR", ImportError("No module named 'pyopencl'"))
    opencl._cl_devices.cache_clear()
    try:
        with pytest.raises(BackendUnavailable, match="pyopencl"):
            opencl.device_count()
    finally:
        monkeypatch.undo()
        opencl._cl_devices.cache_clear()
    assert opencl.device_count() >= 1


SCALE = """
__kernel void scale(__global float* out, __global const float* a) {
    int i = get_global_id(0);
    out[i] = a[i] * FACTOR;
}
"""


def test_prebuilt_kernels_share_programs(dev, cache_dir, monkeypatch):
    """A step's new kernels build as one program (same names, other bodies, renamed apart);
    each kernel's cache entry notes it, and loading them builds nothing from source."""
    # more kernels than twice the compile threads (at most 8), so that programs share kernels
    # on a machine of any number of cores
    kernels = [(SCALE.replace("FACTOR", f"{k + 2}.0f"), "scale") for k in range(17)]
    dev._programs.clear()
    dev.prebuild(kernels)
    folder = cache_dir / "programs" / "opencl"
    assert len(list(folder.glob("*.lib"))) >= 1
    notes = [p for p in folder.iterdir() if p.suffix != ".lib"]
    assert len(notes) == len(kernels) and all(p.read_bytes().startswith(SHARED_MARK) for p in notes)
    calls = []
    monkeypatch.setattr(dev, "compile", lambda *args: calls.append(args))
    n = 64
    a = _random(n)
    for k, (source, name) in enumerate(kernels):
        bufs = [dev.alloc(a.nbytes) for _ in range(2)]
        bufs[1].copy_in(a)
        dev.program(source, name)(bufs, groups=(1,), local=(64,))
        np.testing.assert_array_equal(bufs[0].copy_out(np.empty_like(a)), a * np.float32(k + 2))
    assert calls == []

    dev._programs.clear()  # and from the cache alone, in a new process's way
    dev._libraries.clear()
    source, name = kernels[3]
    bufs = [dev.alloc(a.nbytes) for _ in range(2)]
    bufs[1].copy_in(a)
    dev.program(source, name)(bufs, groups=(1,), local=(64,))
    np.testing.assert_array_equal(bufs[0].copy_out(np.empty_like(a)), a * np.float32(5))
    assert calls == []
