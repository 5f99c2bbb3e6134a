"""Counter-based random numbers: the same seed gives the same numbers on every backend.

Each value is a hash of (seed, position) computed in the kernel with 32-bit integer arithmetic
that every dialect wraps the same way, so nothing is generated on the host.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from anygpu import config
from anygpu import dtype as dt
from anygpu.graph.lazy import Lazy

_state = {"seed": config.get().seed, "counter": 0}
# the position of the next value, per device, in device memory: kernels read it and advance it,
# so a jit-captured step draws new numbers on every replay
_counters: dict[str, Any] = {}


def manual_seed(seed: int) -> None:
    """Restart the generator: the same seed gives the same sequence of tensors."""
    _state["seed"], _state["counter"] = int(seed) & 0xFFFFFFFF, 0
    _counters.clear()


def _mix32(x: int) -> int:
    """The same hash as ``_hash`` below, on the host (for the key)."""
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    x ^= x >> 16
    return x


def _hash(x: Any) -> Any:
    """lowbias32 (Wellons): a fast 32-bit integer hash with good avalanche."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


def random_bits(n: int, device: str | None) -> Any:
    """n uint32 values, advancing the generator's counter by n."""
    from anygpu.tensor import Tensor, canonical

    from anygpu.ops.grad import no_grad

    dev = canonical(device)
    if dev not in _counters:
        _counters[dev] = Tensor(np.zeros(1, np.uint32), device=dev)
    position = _counters[dev]
    key = _mix32(_state["seed"] ^ 0x9E3779B9)
    with no_grad():
        idx = Tensor(Lazy.iota(n, dt.int32, dev)).cast(dt.uint32)
        bits = _hash(_hash(idx + position) ^ Tensor(Lazy.const(key, (), dt.uint32, dev)))
        bits = bits.contiguous().realize()
        position.assign(position + n)  # wraps around after 2**32 values
    return bits


def _uniform(n: int, device: str | None, bits: int = 24) -> Any:
    """k / 2**bits for uniform k < 2**bits: exact in a float of ``bits`` significand bits, so
    rounding to one never reaches 1.0 (float32 has 24, float16 11, bfloat16 8)."""
    raw = random_bits(n, device)
    return (raw >> (32 - bits)).cast(dt.float32) * (1.0 / (1 << bits))


def rand(shape: tuple[int, ...], dtype: Any, device: str | None) -> Any:
    """Uniform on [0, 1)."""
    d = dt.to_dtype(dtype) if dtype is not None else dt.float32
    if not d.is_float:
        raise TypeError(f"rand needs a floating-point dtype, got {d.name}")
    n = math.prod(shape)
    bits = {dt.float16: 11, dt.bfloat16: 8}.get(d, 24)
    return _uniform(n, device, bits).reshape(shape).cast(d).contiguous().realize().detach()


def randn(shape: tuple[int, ...], dtype: Any, device: str | None) -> Any:
    """Standard normal, by the Box-Muller transform of two uniform streams."""
    d = dt.to_dtype(dtype) if dtype is not None else dt.float32
    if not d.is_float:
        raise TypeError(f"randn needs a floating-point dtype, got {d.name}")
    n = math.prod(shape)
    u = _uniform(2 * n, device)
    u1, u2 = u[:n], u[n:]
    z = (-2.0 * (1.0 - u1).log()).sqrt() * (u2 * (2 * math.pi)).cos()
    return z.reshape(shape).cast(d).contiguous().realize().detach()


def randint(low: int, high: int, shape: tuple[int, ...], dtype: Any, device: str | None) -> Any:
    """Uniform integers in [low, high)."""
    if high <= low:
        raise ValueError(f"randint: empty range [{low}, {high})")
    d = dt.to_dtype(dtype) if dtype is not None else dt.int64
    n = math.prod(shape)
    span = high - low
    if span > 2**31:
        raise ValueError("randint: the range must be below 2**31")
    bits = random_bits(n, device)
    # the top bits scaled into the range; (bits * span) >> 32 without 64-bit arithmetic
    val = ((bits >> 8).cast(dt.float32) * (span / (1 << 24))).floor().cast(dt.int32)
    val = val.minimum(span - 1)
    return (val.cast(d) + low).reshape(shape).contiguous().realize().detach()
