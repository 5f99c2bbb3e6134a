"""The explicit table of backends, and device strings like ``"cuda:0"``, ``"opencl:1"``, ``"cpu"``.

Each backend module exposes ``device_count() -> int`` (raising :class:`BackendUnavailable` with the
reason when its library or driver is missing) and a ``Device`` subclass named ``DEVICE``.

>>> from anygpu.runtime.registry import get_device
>>> get_device("cpu").name
'cpu:0'
"""

from __future__ import annotations

import atexit
import importlib
import threading
from types import ModuleType

from anygpu import config
from anygpu.runtime.base import Device, DeviceError

BACKENDS: dict[str, str] = {
    "cpu": "anygpu.runtime.cpu",
    "opencl": "anygpu.runtime.opencl",
    "cuda": "anygpu.runtime.cuda",
    "webgpu": "anygpu.runtime.webgpu",
    "hip": "anygpu.runtime.hip",
}


class BackendUnavailable(DeviceError):
    """A backend cannot be used here; the message says why (missing package, no driver)."""


_devices: dict[str, Device] = {}
_named: dict[str, Device] = {}  # each name asked for, as given ("cuda", "cuda:0")
_lock = threading.RLock()


@atexit.register
def _shutdown() -> None:
    """Finish queued work and drop compiled programs while the drivers are still loaded:
    left to interpreter teardown, their destructors may run after the driver libraries'."""
    for dev in list(_devices.values()):
        try:
            dev.synchronize()
            dev._programs.clear()
        except Exception:
            pass


def backend_module(backend: str) -> ModuleType:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
    try:
        return importlib.import_module(BACKENDS[backend])
    except ImportError as err:
        raise BackendUnavailable(f"{backend}: missing Python package ({err}); install it with "
                                 f"pip install 'anygpu[{backend}]'") from err


def parse_device(name: str) -> tuple[str, int]:
    """``"cuda:1"`` -> ``("cuda", 1)``; ``"opencl"`` -> ``("opencl", 0)``."""
    backend, _, index = str(name).strip().lower().partition(":")
    if backend not in BACKENDS:
        raise ValueError(f"unknown device {name!r}; backends: {', '.join(BACKENDS)}")
    if index and not index.isdigit():
        raise ValueError(f"bad device index in {name!r}")
    return backend, int(index or 0)


def is_device_name(name: str) -> bool:
    """Whether ``name`` names a device ("cuda", "opencl:1", ...) rather than something else."""
    return name.partition(":")[0].lower() in BACKENDS


def device_count(backend: str) -> int:
    return backend_module(backend).device_count()


# Set in a DataLoader worker process (utils/data): why it may use the cpu device alone. A
# worker must not touch a GPU: its driver state does not survive fork, and the batches go to
# the device from the main process.
cpu_only_reason: str | None = None


def get_device(name: "str | Device | None" = None) -> Device:
    """The :class:`Device` for a device string (default: ``ANYGPU_DEVICE``, else ``"cpu"``)."""
    if not cpu_only_reason and type(name) is str:
        hit = _named.get(name)  # every graph node names its device: asked once per kernel
        if hit is not None:
            return hit
    if isinstance(name, Device):
        if not cpu_only_reason:
            return name
        name = name.name
    if name is None:
        name = "cpu" if cpu_only_reason else config.get().device or "cpu"
    backend, index = parse_device(name)
    if cpu_only_reason and backend != "cpu":
        raise RuntimeError(f"{cpu_only_reason} asked for device {name!r}: data-loading "
                           "workers never use a GPU. Return NumPy arrays from the dataset and "
                           "collate_fn and move the batch to the device in the main process")
    key = f"{backend}:{index}"
    with _lock:
        if key not in _devices:
            module = backend_module(backend)
            count = module.device_count()
            if index >= count:
                raise BackendUnavailable(f"{key}: no such device ({backend} has {count})")
            _devices[key] = module.DEVICE(index)
        if type(name) is str:
            _named[name] = _devices[key]
        return _devices[key]


def canonical(name: "str | Device | None") -> str:
    return get_device(name).name
