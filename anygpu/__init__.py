"""anygpu: deep learning on any GPU through open, vendor-neutral APIs.

>>> import anygpu as ag
>>> ag.tensor([1.0, 2.0, 3.0]).softmax(0).sum().item()  # doctest: +ELLIPSIS
1.0...
"""

from typing import Any

from anygpu.dtype import (DType, bfloat16, bool_, float16, float32, int8, int32, int64, uint8)
from anygpu.graph.jit import jit
from anygpu.ops.grad import enable_grad, inference_mode, is_grad_enabled, no_grad, set_grad_enabled
from anygpu.ops.einsum import einsum
from anygpu.ops.linalg import cdist, get_float32_matmul_precision, set_float32_matmul_precision
from anygpu.ops.sorting import bucketize, searchsorted
from anygpu.runtime.base import (DeviceError, KernelMismatchError, OutOfMemoryError,
                                 UnsupportedError)
from anygpu.runtime.registry import BackendUnavailable, get_device
from anygpu.tensor import (Tensor, arange, cat, eye, full, full_like, linspace, manual_seed, ones,
                           ones_like, rand, randint, randn, realize, stack, tensor, where, zeros,
                           zeros_like)

from anygpu.device import cpu, cuda, device, hip, opencl, webgpu

from anygpu.ops.random import (Generator, bernoulli, default_generator, get_rng_state,
                               initial_seed, multinomial, normal, randperm, seed, set_rng_state)

from anygpu import amp, nn, optim, utils  # noqa: E402  (they use the names above)
from anygpu.amp import autocast
from anygpu.profile import profile  # the function (the module stays importable by its path)
from anygpu.serialization import load, save


def from_numpy(array: Any) -> Tensor:
    """A tensor with ``array``'s values (a copy: later writes into the array are not seen, unlike
    PyTorch's shared memory; float64 becomes float32)."""
    return tensor(array)


def as_tensor(data: Any, dtype: Any = None, device: Any = None) -> Tensor:
    """``data`` as a tensor: a Tensor already of that dtype and device is returned as it is,
    anything else is copied, as ``tensor`` does."""
    if isinstance(data, Tensor):
        out = data if dtype is None else data.cast(dtype)
        return out if device is None else out.to(device)
    return tensor(data, dtype=dtype, device=device)


__version__ = "0.1.0"


def _mirror_methods() -> list[str]:
    """Top-level functions that are the method of their first argument (``anygpu.flatten(x)``),
    and ``rand_like``, ``randn_like``, ``empty``, ``empty_like``, as in PyTorch."""
    from anygpu.ops import composites
    from anygpu.tensor import zeros as _zeros

    names = []
    for name in composites.FUNCTIONS:
        if name not in globals():
            globals()[name] = composites.function(name)
            names.append(name)
    for name in ("rand", "randn", "empty"):
        globals()[name + "_like"] = composites.like(name)
        names.append(name + "_like")
    globals()["empty"] = _zeros
    globals()["is_tensor"] = lambda obj: isinstance(obj, Tensor)
    return names + ["empty", "is_tensor"]


_mirrored = _mirror_methods()

float = float32
half = float16
long = int64
int = int32
bool = bool_

__all__ = ["Tensor", "tensor", "zeros", "ones", "full", "zeros_like", "ones_like", "full_like",
           "arange", "linspace", "eye", "rand", "randn", "randint", "manual_seed", "where", "cat",
           "stack", "realize", "no_grad", "enable_grad", "jit", "DType", "float32", "float16",
           "bfloat16", "int8", "uint8",
           "int32", "int64", "bool_", "float", "half", "long", "int", "bool", "get_device",
           "DeviceError", "KernelMismatchError", "OutOfMemoryError", "UnsupportedError",
           "BackendUnavailable",
           "nn", "optim", "utils", "set_float32_matmul_precision", "get_float32_matmul_precision",
           "save", "load", "__version__", "Generator", "default_generator", "seed",
           "initial_seed", "get_rng_state", "set_rng_state", "randperm", "multinomial",
           "bernoulli", "normal", "device", "from_numpy", "as_tensor", "set_grad_enabled",
           "is_grad_enabled", "inference_mode", "cpu", "cuda", "opencl", "webgpu", "hip", "einsum",
           "cdist", "searchsorted", "bucketize", "amp", "autocast", "profile", *_mirrored]
