"""The errors of ``anygpu.onnx``: every one names what is wrong and where.

>>> from anygpu.onnx.errors import UnsupportedOpError
>>> issubclass(UnsupportedOpError, NotImplementedError)
True
"""

from __future__ import annotations


class OnnxError(Exception):
    """A model that cannot be loaded or run."""


class ModelError(OnnxError, ValueError):
    """The model itself is bad: not ONNX, truncated, failing the checker or shape inference,
    an initializer or its external data missing."""


class InputError(OnnxError, ValueError):
    """An input fed to the model does not fit it: unknown or missing name, wrong dtype or shape,
    or on another device."""


class NodeError(OnnxError, RuntimeError):
    """An operator failed while the model ran (the message names the node and the cause)."""


class UnsupportedOpError(OnnxError, NotImplementedError):
    """An operator, an opset version, an attribute or an element type that is not supported."""


__all__ = ["OnnxError", "ModelError", "InputError", "NodeError", "UnsupportedOpError"]
