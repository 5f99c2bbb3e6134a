"""Shared fixtures: the ``device`` parametrization over every backend, value checks with
per-dtype tolerances, host data generation, and the hypothesis profile.

``ANYGPU_TEST_DEVICES`` (a comma list such as ``"cuda,opencl,webgpu"``) restricts the backends
the device-parametrized tests run on; by default every backend that is available runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

import anygpu as ag
from anygpu import dtype as dt
from anygpu.dtype import DType
from anygpu.runtime.registry import BackendUnavailable, get_device

BACKENDS = ("cpu", "opencl", "webgpu", "cuda")


def _test_devices() -> list[str]:
    text = os.environ.get("ANYGPU_TEST_DEVICES", "")
    names = [n.strip().lower() for n in text.split(",") if n.strip()] or list(BACKENDS)
    unknown = [n for n in names if n.partition(":")[0] not in BACKENDS]
    if unknown:
        raise pytest.UsageError(f"ANYGPU_TEST_DEVICES names unknown backends {unknown}; "
                                f"known: {', '.join(BACKENDS)}")
    return names


DEVICES = _test_devices()

# compiles are cached per kernel source, and every new shape is a new source: a modest number of
# examples over small pools of shapes keeps the suite quick on slow compilers (PoCL)
settings.register_profile("anygpu", max_examples=15, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=200, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "anygpu"))


def available(name: str) -> tuple[bool, str]:
    """Whether the device ``name`` can be used here, and if not, why."""
    try:
        get_device(name)
    except BackendUnavailable as err:
        return False, str(err)
    return True, ""


def available_devices() -> list[str]:
    """The canonical names of the selected devices that are available here."""
    return [get_device(n).name for n in DEVICES if available(n)[0]]


@pytest.fixture(name="devices", scope="session")
def devices_fixture() -> list[str]:
    """Every selected device that is available, for tests that move data between them."""
    return available_devices()


@pytest.fixture(scope="session", params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """The canonical name of a device ("cpu:0", "opencl:0", ...); skips unavailable ones."""
    ok, why = available(request.param)
    if not ok:
        pytest.skip(why)
    return get_device(request.param).name


def pytest_make_parametrize_id(config: pytest.Config, val: object, argname: str) -> str | None:
    if isinstance(val, DType):
        return val.name
    return None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fails_on(backend, reason): a known failure of the "
                            "library on that backend, run as a strict xfail there")
    config.addinivalue_line("markers", "slow: minutes on a 2-core machine with a cold kernel "
                            "cache (whole training programs); -m 'not slow' leaves them out")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With ``ANYGPU_TEST_FAILURES`` set to a file, each failure is appended to it as it happens
    (its test, its phase, its message's first lines), so that a run cut off by a time limit
    still names what failed. Under xdist only the controlling process writes."""
    path = os.environ.get("ANYGPU_TEST_FAILURES")
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    lines = report.longreprtext.strip().splitlines()
    message = [line for line in lines if line.startswith("E ")][:6] or lines[-6:]
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"FAILED {report.nodeid} ({report.when})\n")
        f.writelines(f"    {line}\n" for line in message)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tests parametrized over both ``device`` and ``dtype`` skip dtypes the device lacks;
    ``fails_on`` marks become strict xfails on their backend."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    for mark in item.iter_markers("fails_on"):
        if str(params.get("device", "")).startswith(mark.args[0]):
            item.add_marker(pytest.mark.xfail(strict=True, reason=mark.kwargs["reason"]))
    dtypes = [params[k] for k in ("dtype", "src", "dst") if isinstance(params.get(k), DType)]
    if "device" not in params or not dtypes or not available(params["device"])[0]:
        return
    dev = get_device(params["device"])
    for d in dtypes:
        if not dev.supports(d):
            pytest.skip(f"{d.name} is not supported on {dev.name}")


# ---- values -----------------------------------------------------------------------------------
# (rtol, atol) of a value that went through one rounding to the dtype after float32 math
TOLERANCE = {dt.float32: (1e-5, 1e-5), dt.float16: (1e-3, 1e-3), dt.bfloat16: (1e-2, 1e-2)}


def tolerance(d: DType) -> tuple[float, float]:
    return TOLERANCE.get(d, (0.0, 0.0))


def compare(got: np.ndarray, ref: Any, d: DType, rtol: float | None = None,
            atol: float | None = None, name: str = "") -> None:
    """Host values ``got`` of dtype ``d`` against ``ref``: within the tolerance of ``d``,
    exact for integers and bool."""
    ref = np.asarray(ref)
    where = f"{name}: " if name else ""
    assert got.shape == ref.shape, f"{where}numpy() shape {got.shape}, expected {ref.shape}"
    if d.is_float:
        r, a = tolerance(d)
        np.testing.assert_allclose(got.astype(np.float64), ref.astype(np.float64),
                                   rtol=r if rtol is None else rtol,
                                   atol=a if atol is None else atol, err_msg=name)
    else:
        if ref.dtype.kind == "f":
            assert np.all(np.isfinite(ref)), f"{where}an exact comparison with a non-finite ref"
        np.testing.assert_array_equal(got, ref.astype(d.np), err_msg=name)


def _check_meta(out: ag.Tensor, ref: np.ndarray, dtype: DType | None, name: str = "") -> None:
    where = f"{name}: " if name else ""
    assert isinstance(out, ag.Tensor), f"{where}expected a Tensor, got {type(out).__name__}"
    assert out.shape == ref.shape, f"{where}shape {out.shape}, expected {ref.shape}"
    if dtype is not None:
        assert out.dtype == dtype, f"{where}dtype {out.dtype.name}, expected {dtype.name}"


def check(out: ag.Tensor, ref: Any, dtype: DType | None = None, rtol: float | None = None,
          atol: float | None = None) -> None:
    """``out`` has the shape of ``ref``, the dtype ``dtype`` (if given) and its values, within
    the tolerance of its dtype (exact for integers and bool)."""
    ref = np.asarray(ref)
    _check_meta(out, ref, dtype)
    compare(out.numpy(), ref, out.dtype, rtol, atol)


def check_all(cases: list[tuple], chunk: int = 12) -> None:
    """``check`` for each case ``(name, out, ref, dtype[, {"rtol": ..., "atol": ...}])``.

    Outputs of the same dtype, shape and device are stacked and read in one kernel (up to
    ``chunk`` at a time): every new kernel is a compile, and on slow compilers those dominate.
    Every op still runs on the device; the stack only adds a copy into its slice."""
    groups: dict[tuple, list[tuple]] = {}
    for case in cases:
        name, out, ref, dtype = case[:4]
        tol = case[4] if len(case) > 4 else {}
        ref = np.asarray(ref)
        _check_meta(out, ref, dtype, name)
        groups.setdefault((out.dtype, out.shape, out.device), []).append((name, out, ref, tol))
    for (d, _, _), items in groups.items():
        for start in range(0, len(items), chunk):
            part = items[start:start + chunk]
            outs = [o for _, o, _, _ in part]
            got = ag.stack(outs).numpy() if len(outs) > 1 else outs[0].numpy()[None]
            for k, (name, _, ref, tol) in enumerate(part):
                compare(got[k], ref, d, name=name, **tol)


@pytest.fixture(name="check", scope="session")
def check_fixture() -> Callable[..., None]:
    return check


@pytest.fixture(name="check_all", scope="session")
def check_all_fixture() -> Callable[..., None]:
    return check_all


def host(shape: tuple[int, ...], dtype: DType, seed: int, low: float = -3.0,
         high: float = 3.0, away_from_zero: float = 0.0) -> np.ndarray:
    """Random host data exactly representable in ``dtype`` (bfloat16 as rounded float32),
    never all zeros. Values lie in [low, high) (integers: [low, high]); with
    ``away_from_zero``, no value is nearer to zero than that."""
    rng = np.random.default_rng(seed)
    if dtype == dt.bool_:
        out = rng.random(shape) < 0.5
        if not out.any():
            out.reshape(-1)[:1] = True
        return out
    if dtype.is_float:
        x = rng.uniform(low, high, shape).astype(np.float32)
        if away_from_zero:
            x = np.where(np.abs(x) < away_from_zero, np.copysign(away_from_zero, x) + x, x)
        x = np.asarray(x, dtype=np.float32)
        if dtype == dt.float16:
            return x.astype(np.float16)
        if dtype == dt.bfloat16:
            return round_bf16(x)
        return x
    info = np.iinfo(dtype.np)
    lo, hi = max(int(low), info.min), min(int(high), info.max)
    x = rng.integers(lo, hi + 1, shape).astype(dtype.np)
    if away_from_zero:
        x = np.where(x == 0, np.asarray(1 if hi >= 1 else -1, dtype=dtype.np), x)
    if not np.any(x):
        x.reshape(-1)[:1] = 1 if hi >= 1 else -1
    return np.asarray(x, dtype=dtype.np)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), as float32."""
    f = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((f + 0x7FFF + ((f >> 16) & 1)) >> 16) << 16
    return r.astype(np.uint32).view(np.float32).reshape(np.shape(x))


def as_dtype(x: np.ndarray, d: DType) -> np.ndarray:
    """A reference computed in float32 rounded to ``d`` (the rounding a store does)."""
    if d == dt.bfloat16:
        return round_bf16(np.asarray(x, dtype=np.float32))
    return np.asarray(x).astype(d.np)


@pytest.fixture(name="host", scope="session")
def host_fixture() -> Callable[..., np.ndarray]:
    return host


@pytest.fixture(name="make", scope="session")
def make_fixture() -> Callable[..., tuple[np.ndarray, ag.Tensor]]:
    """``make(shape, dtype, seed, device, **host_kwargs) -> (host array, tensor)``."""

    def make(shape: tuple[int, ...], dtype: DType, seed: int, device: str,
             **kwargs: Any) -> tuple[np.ndarray, ag.Tensor]:
        x = host(tuple(shape), dtype, seed, **kwargs)
        return x, ag.tensor(x, dtype=dtype, device=device)

    return make


class Overtime(Exception):
    """A computation ran past its ``deadline``."""


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise ``Overtime`` in this (main) thread after ``seconds``: a graph that grows without
    end fails its test instead of stalling the session and eating its memory."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise Overtime(f"did not finish in {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
