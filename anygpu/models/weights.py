"""Weights for the models: read from a file the caller names, never downloaded.

``weights=`` of every model constructor takes the path of a safetensors file or of a PyTorch
checkpoint (``.pt``/``.pth``, read with PyTorch, which must then be installed); an anygpu
checkpoint written by ``anygpu.save`` works too. The state_dict must fit the model exactly: a
missing, unexpected or differently shaped entry raises an error naming it. ``convert_weights``
turns a PyTorch checkpoint into safetensors once, so that loading needs no PyTorch after that.

>>> import os, tempfile
>>> import anygpu as ag
>>> from anygpu import models
>>> path = os.path.join(tempfile.mkdtemp(), "tiny.safetensors")
>>> ag.nn.state.save(models.mobilenet_v2(num_classes=4, width_mult=0.25), path)
>>> models.mobilenet_v2(weights=path, width_mult=0.25).classifier[1].out_features
4
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, Union

import numpy as np

from anygpu import serialization
from anygpu.nn import state
from anygpu.nn.module import Module
from anygpu.tensor import Tensor

WeightsPath = Union[str, "os.PathLike[str]"]
ModelT = TypeVar("ModelT", bound=Module)

# entries of a training checkpoint that hold the model's state_dict, in the order looked at
_WRAPPER_KEYS = ("state_dict", "model_state_dict", "model")


def _existing_file(path: WeightsPath) -> str:
    name = os.fspath(path)
    if not isinstance(name, str):
        raise TypeError(f"weights must be a path (str or os.PathLike), got {type(path).__name__}")
    if not os.path.exists(name):
        raise FileNotFoundError(f"weights file not found: {name} (weights= takes the path of a "
                                ".safetensors file or a PyTorch .pt/.pth checkpoint; nothing is "
                                "downloaded)")
    if os.path.isdir(name):
        raise IsADirectoryError(f"weights path is a directory, not a file: {name}")
    return name


def _is_safetensors(name: str) -> bool:
    """A ``.safetensors`` name, or a file that starts as one does (a header length, then the
    JSON header's opening brace)."""
    if name.endswith(".safetensors"):
        return True
    with open(name, "rb") as f:
        head = f.read(9)
    return len(head) == 9 and head[8:9] == b"{"


def _is_tensor(value: Any) -> bool:
    return isinstance(value, (Tensor, np.ndarray)) or (
        hasattr(value, "detach") and hasattr(value, "shape"))  # a torch tensor


def _state_dict_of(obj: Any, name: str) -> dict[str, Any]:
    """The state_dict inside what a checkpoint file held: a state_dict itself, a training
    checkpoint's ``state_dict``/``model_state_dict``/``model`` entry, or a pickled model. The
    ``module.`` prefix that data-parallel wrappers add to every key is removed."""
    if not isinstance(obj, Mapping) and callable(getattr(obj, "state_dict", None)):
        obj = obj.state_dict()
    if not isinstance(obj, Mapping):
        raise TypeError(f"{name} holds a {type(obj).__name__}, not a state_dict (a dict of "
                        "names to tensors)")
    if obj and all(_is_tensor(v) for v in obj.values()):
        sd = {str(k): v for k, v in obj.items()}
        if all(k.startswith("module.") for k in sd):
            sd = {k[len("module."):]: v for k, v in sd.items()}
        return sd
    for key in _WRAPPER_KEYS:
        inner = obj.get(key)
        if isinstance(inner, Mapping) or callable(getattr(inner, "state_dict", None)):
            return _state_dict_of(inner, f"{name}[{key!r}]")
    keys = ", ".join(repr(k) for k in list(obj)[:8]) + (", ..." if len(obj) > 8 else "")
    raise TypeError(f"{name} holds a dict without a state_dict: its keys are {keys}; expected "
                    "names of tensors, or a checkpoint with a 'state_dict' or 'model' entry")


def read_weights(path: WeightsPath, *, weights_only: bool = True) -> dict[str, Any]:
    """The state_dict stored in ``path``: {name: tensor} on the cpu, in the file's order.

    A safetensors file is read directly; any other file is read with ``anygpu.load`` (PyTorch
    checkpoints through PyTorch). ``weights_only=False`` lets a PyTorch file hold a whole
    pickled model (its classes must be importable); that runs the file's code, so use it only
    for files you trust.
    """
    name = _existing_file(path)
    if _is_safetensors(name):
        return dict(state.load_file(name, device="cpu"))
    try:
        obj = serialization.load(name, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as err:
        if not weights_only:
            raise
        raise pickle.UnpicklingError(
            f"{name} holds more than tensors (a whole pickled model?), which a weights-only "
            "load refuses. If you trust the file, convert it once with "
            "anygpu.models.convert_weights(src, dst, weights_only=False) and load the "
            f"safetensors file it writes. ({err})") from err
    return _state_dict_of(obj, name)


def convert_weights(src: WeightsPath, dst: WeightsPath, *,
                    weights_only: bool = True) -> list[str]:
    """Write the state_dict of the PyTorch checkpoint ``src`` to the safetensors file ``dst``
    and return its keys. ``src`` may hold a state_dict, a training checkpoint with a
    ``state_dict`` or ``model`` entry, or (with ``weights_only=False``, for files you trust) a
    whole pickled model; dtypes are kept (bfloat16 stays bfloat16). Reading ``src`` needs
    PyTorch; loading ``dst`` afterwards does not.

    >>> import os, tempfile
    >>> import torch
    >>> from anygpu import models
    >>> folder = tempfile.mkdtemp()
    >>> src, dst = os.path.join(folder, "fc.pth"), os.path.join(folder, "fc.safetensors")
    >>> torch.save(torch.nn.Linear(3, 2).state_dict(), src)
    >>> models.convert_weights(src, dst)
    ['weight', 'bias']

    A torchvision checkpoint converts the same way and then loads without PyTorch::

        convert_weights("resnet18-f37072fd.pth", "resnet18.safetensors")
        model = anygpu.models.resnet18(weights="resnet18.safetensors")
    """
    sd = read_weights(src, weights_only=weights_only)
    state.save_file(sd, dst, metadata={"format": "pt"})
    return list(sd)


def build(factory: Callable[..., ModelT], weights: WeightsPath | None, kwargs: dict[str, Any],
          classifier: str) -> ModelT:
    """``factory(**kwargs)`` with the state_dict of ``weights`` loaded, if given. Unless the
    caller chose ``num_classes``, it is read from the rows of the ``classifier`` entry, as
    torchvision takes it from the weights' categories."""
    if "pretrained" in kwargs:
        raise TypeError("pretrained= downloads weights, which anygpu never does: pass "
                        "weights='path/to/file.safetensors' (or a PyTorch .pth file)")
    if weights is None:
        return factory(**kwargs)
    sd = read_weights(weights)
    if "num_classes" not in kwargs and classifier in sd:
        kwargs = {**kwargs, "num_classes": int(sd[classifier].shape[0])}
    model = factory(**kwargs)
    try:
        model.load_state_dict(sd)
    except RuntimeError as err:
        raise RuntimeError(f"the weights in {os.fspath(weights)} do not fit this "
                           f"{type(model).__name__}: {err}") from None
    return model


__all__ = ["convert_weights", "read_weights"]
