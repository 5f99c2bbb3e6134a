"""PyTorch's device idioms: ``anygpu.device("cuda:0")`` and ``anygpu.cuda.is_available()``.

A :class:`device` is a string (``"cuda:0"``), so it goes wherever a device string does
(``Tensor.to``, ``tensor(..., device=)``, ``Module.to``), with PyTorch's ``type`` and ``index``.

>>> import anygpu as ag
>>> d = ag.device("cpu:0")
>>> d.type, d.index, str(d)
('cpu', 0, 'cpu:0')
>>> ag.cpu.is_available()
True
"""

from __future__ import annotations

from typing import Any

from anygpu.runtime.base import DeviceError
from anygpu.runtime.registry import BACKENDS, parse_device
from anygpu.runtime.registry import device_count as _device_count


class device(str):  # noqa: N801  (PyTorch's name)
    """``device("cuda")``, ``device("cuda:1")``, ``device("cuda", 1)`` or ``device(other)``.

    ``index`` is None where none was given, as in PyTorch; ``str()`` gives ``"cuda"`` or
    ``"cuda:1"``. Equal to the string it prints as.

    >>> import anygpu as ag
    >>> ag.device("opencl", 1)
    device(type='opencl', index=1)
    """

    type: str
    # PyTorch's attribute hides str.index on device objects; the text is str(d) where needed
    index: int | None  # type: ignore[assignment]

    def __new__(cls, type: Any, index: int | None = None) -> "device":  # noqa: A002
        text = str(type).strip().lower()
        backend, _ = parse_device(text)  # rejects unknown backends and bad indices
        given = text.partition(":")[2]
        if given and index is not None:
            raise RuntimeError(f"type (string) must not include an index because index was "
                               f"passed explicitly: {text}")
        if index is None and given:
            index = int(given)
        if index is not None and int(index) < 0:
            raise RuntimeError(f"Device index must not be negative, got {index}")
        name = backend if index is None else f"{backend}:{int(index)}"
        out = super().__new__(cls, name)
        out.type, out.index = backend, (None if index is None else int(index))
        return out

    def __repr__(self) -> str:
        index = "" if self.index is None else f", index={self.index}"
        return f"device(type='{self.type}'{index})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (device, (self.type, self.index))


class Backend:
    """``anygpu.cuda``, ``anygpu.opencl``, ``anygpu.webgpu``, ``anygpu.hip``, ``anygpu.cpu``:
    ``is_available()`` and ``device_count()`` for one backend.

    >>> import anygpu as ag
    >>> ag.cpu.device_count() >= 1
    True
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def device_count(self) -> int:
        """How many devices this backend has here (0 where its library or driver is missing)."""
        try:
            return int(_device_count(self.name))
        except DeviceError:
            return 0

    def is_available(self) -> bool:
        """Whether this backend has a device here."""
        return self.device_count() > 0

    def __repr__(self) -> str:
        return f"<anygpu.{self.name}>"


BACKEND_NAMESPACES: dict[str, Backend] = {name: Backend(name) for name in BACKENDS}
cpu, opencl, cuda, webgpu, hip = (BACKEND_NAMESPACES[n]
                                  for n in ("cpu", "opencl", "cuda", "webgpu", "hip"))

__all__ = ["device", "Backend", "cpu", "opencl", "cuda", "webgpu", "hip"]
