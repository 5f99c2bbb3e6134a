"""Parameter initializations with PyTorch's names, formulas and defaults.

Each function replaces the tensor's values in place (the Tensor object stays, so a Parameter
stays registered) and returns it. Random values come from ``anygpu.rand``/``anygpu.randn``, the
counter-based generator, so ``anygpu.manual_seed`` makes them the same on every backend.

>>> import anygpu as ag
>>> from anygpu.nn import init
>>> w = ag.zeros(16, 8)
>>> _ = init.kaiming_uniform_(w, a=5 ** 0.5)
>>> bool((w.abs() <= 1 / 8 ** 0.5).all())
True
"""

from __future__ import annotations

import math
from typing import Any

from anygpu import dtype as dt
from anygpu.graph.lazy import Lazy
from anygpu.runtime.registry import canonical
from anygpu.tensor import Tensor, arange, full, rand, randn


def _empty(shape: tuple[int, ...], device: str | None = None, dtype: Any = None) -> Tensor:
    """A placeholder of the right shape, dtype and device that holds no memory until a value
    is assigned (as ``torch.empty``, its values are not meant to be read)."""
    d = dt.to_dtype(dtype) if dtype is not None else dt.float32
    return Tensor(Lazy.const(0, tuple(shape), d, canonical(device)))


def _assign(tensor: Tensor, value: Tensor) -> Tensor:
    tensor.lazy = value.cast(tensor.dtype).realize().lazy
    return tensor


def calculate_gain(nonlinearity: str, param: float | None = None) -> float:
    """The recommended gain for a nonlinearity (PyTorch's table)."""
    linear_fns = ["linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                  "conv_transpose3d"]
    if nonlinearity in linear_fns or nonlinearity == "sigmoid":
        return 1.0
    if nonlinearity == "tanh":
        return 5.0 / 3
    if nonlinearity == "relu":
        return math.sqrt(2.0)
    if nonlinearity == "leaky_relu":
        if param is None:
            slope = 0.01
        elif isinstance(param, (int, float)) and not isinstance(param, bool):
            slope = param
        else:
            raise ValueError(f"negative_slope {param} not a valid number")
        return math.sqrt(2.0 / (1 + slope ** 2))
    if nonlinearity == "selu":
        return 3.0 / 4
    raise ValueError(f"Unsupported nonlinearity {nonlinearity}")


def _calculate_fan_in_and_fan_out(tensor: Tensor) -> tuple[int, int]:
    if tensor.ndim < 2:
        raise ValueError("Fan in and fan out can not be computed for tensor with fewer than 2 "
                         "dimensions")
    receptive = math.prod(tensor.shape[2:])
    return tensor.shape[1] * receptive, tensor.shape[0] * receptive


def _calculate_correct_fan(tensor: Tensor, mode: str) -> int:
    mode = mode.lower()
    if mode not in ("fan_in", "fan_out"):
        raise ValueError(f"Mode {mode} not supported, please use one of fan_in, fan_out")
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    return fan_in if mode == "fan_in" else fan_out


def uniform_(tensor: Tensor, a: float = 0.0, b: float = 1.0, generator: Any = None) -> Tensor:
    """Values from U(a, b)."""
    if tensor.numel() == 0:
        return tensor
    return _assign(tensor, rand(tensor.shape, device=tensor.device) * (b - a) + a)


def normal_(tensor: Tensor, mean: float = 0.0, std: float = 1.0, generator: Any = None) -> Tensor:
    """Values from N(mean, std**2)."""
    if tensor.numel() == 0:
        return tensor
    return _assign(tensor, randn(tensor.shape, device=tensor.device) * std + mean)


def _erfinv(x: Tensor) -> Tensor:
    """Inverse error function on (-1, 1): Giles' single-precision polynomial approximation."""
    w = -((1 - x) * (1 + x)).log()
    lo = w - 2.5
    p = lo * 0 + 2.81022636e-08
    for c in (3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087, -0.00125372503,
              -0.00417768164, 0.246640727, 1.50140941):
        p = c + p * lo
    hi = w.sqrt() - 3
    q = hi * 0 - 0.000200214257
    for c in (0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773, -0.0076224613,
              0.00943887047, 1.00167406, 2.83297682):
        q = c + q * hi
    return w.lt(5.0)._select(p, q) * x


def trunc_normal_(tensor: Tensor, mean: float = 0.0, std: float = 1.0, a: float = -2.0,
                  b: float = 2.0, generator: Any = None) -> Tensor:
    """N(mean, std**2) truncated to [a, b], by the inverse CDF of a uniform sample."""
    if tensor.numel() == 0:
        return tensor

    def norm_cdf(v: float) -> float:
        return (1.0 + math.erf(v / math.sqrt(2.0))) / 2.0

    lo, hi = norm_cdf((a - mean) / std), norm_cdf((b - mean) / std)
    u = rand(tensor.shape, device=tensor.device) * (2 * hi - 2 * lo) + (2 * lo - 1)
    u = u.clip(-1 + 1e-7, 1 - 1e-7)  # erfinv(+-1) is infinite
    value = _erfinv(u) * (std * math.sqrt(2.0)) + mean
    return _assign(tensor, value.clip(a, b))


def constant_(tensor: Tensor, val: float) -> Tensor:
    return _assign(tensor, full(tensor.shape, val, dtype=tensor.dtype, device=tensor.device))


def ones_(tensor: Tensor) -> Tensor:
    return constant_(tensor, 1.0 if tensor.dtype.is_float else 1)


def zeros_(tensor: Tensor) -> Tensor:
    return constant_(tensor, 0.0 if tensor.dtype.is_float else 0)


def eye_(tensor: Tensor) -> Tensor:
    """The identity matrix (a 2-D tensor)."""
    if tensor.ndim != 2:
        raise ValueError("Only tensors with 2 dimensions are supported")
    n, m = tensor.shape
    r = arange(n, device=tensor.device, dtype=dt.int32).reshape(n, 1)
    c = arange(m, device=tensor.device, dtype=dt.int32).reshape(1, m)
    return _assign(tensor, r.eq(c).cast(tensor.dtype))


def xavier_uniform_(tensor: Tensor, gain: float = 1.0, generator: Any = None) -> Tensor:
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    std = gain * math.sqrt(2.0 / float(fan_in + fan_out))
    bound = math.sqrt(3.0) * std
    return uniform_(tensor, -bound, bound)


def xavier_normal_(tensor: Tensor, gain: float = 1.0, generator: Any = None) -> Tensor:
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    std = gain * math.sqrt(2.0 / float(fan_in + fan_out))
    return normal_(tensor, 0.0, std)


def kaiming_uniform_(tensor: Tensor, a: float = 0, mode: str = "fan_in",
                     nonlinearity: str = "leaky_relu", generator: Any = None) -> Tensor:
    """U(-bound, bound) with ``bound = gain * sqrt(3 / fan)`` (He et al., 2015)."""
    if tensor.numel() == 0:
        return tensor
    fan = _calculate_correct_fan(tensor, mode)
    bound = math.sqrt(3.0) * calculate_gain(nonlinearity, a) / math.sqrt(fan)
    return uniform_(tensor, -bound, bound)


def kaiming_normal_(tensor: Tensor, a: float = 0, mode: str = "fan_in",
                    nonlinearity: str = "leaky_relu", generator: Any = None) -> Tensor:
    """N(0, std**2) with ``std = gain / sqrt(fan)`` (He et al., 2015)."""
    if tensor.numel() == 0:
        return tensor
    fan = _calculate_correct_fan(tensor, mode)
    return normal_(tensor, 0.0, calculate_gain(nonlinearity, a) / math.sqrt(fan))


__all__ = ["calculate_gain", "uniform_", "normal_", "trunc_normal_", "constant_", "ones_",
           "zeros_", "eye_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_",
           "kaiming_normal_"]
