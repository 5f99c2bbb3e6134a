"""Counter-based random numbers: the same seed gives the same numbers on every backend.

Each value is a hash of (seed, position) computed in the kernel with 32-bit integer arithmetic
that every dialect wraps the same way, so nothing is generated on the host.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np

from anygpu import config
from anygpu import dtype as dt
from anygpu.graph.lazy import Lazy

_MASK64 = (1 << 64) - 1
# PyTorch's initial seed for a new torch.Generator
_DEFAULT_SEED = 67280421310721


class Generator:
    """A random-number generator: a seed and, per device, the position of the next value.

    ``Generator(device="cpu")`` as PyTorch's; pass it as ``generator=`` to the random functions.
    The numbers depend on the seed and position only, so a generator gives the same values on
    every device (it keeps one position per device it has drawn on; ``device`` is informational).

    >>> import anygpu as ag
    >>> g = ag.Generator().manual_seed(3)
    >>> a = ag.rand(4, generator=g)
    >>> _ = g.manual_seed(3)
    >>> bool((ag.rand(4, generator=g) == a).all())
    True
    """

    def __init__(self, device: Any = "cpu") -> None:
        self.device = str(device)
        self._seed = _DEFAULT_SEED
        # the position of the next value, per device, in device memory: kernels read it and
        # advance it, so a jit-captured step draws new numbers on every replay
        self._counters: dict[str, Any] = {}

    def manual_seed(self, seed: int) -> "Generator":
        """Restart from ``seed`` (any integer, taken modulo 2**64); returns the generator."""
        self._seed = int(seed) & _MASK64
        self._counters.clear()
        return self

    def seed(self) -> int:
        """Restart from a non-deterministic seed, and return it."""
        return self.manual_seed(int.from_bytes(os.urandom(8), "little") >> 1).initial_seed()

    def initial_seed(self) -> int:
        """The seed the generator was last started from."""
        return self._seed

    def get_state(self) -> Any:
        """The state as a uint8 tensor (the seed and each device's position); it reads the
        positions back from the devices."""
        from anygpu.tensor import Tensor

        offsets = {dev: int(c.numpy()[0]) for dev, c in self._counters.items()}
        text = json.dumps({"seed": self._seed, "offsets": offsets}).encode()
        return Tensor(np.frombuffer(text, np.uint8).copy(), device="cpu")

    def set_state(self, new_state: Any) -> "Generator":
        """Restore a state from :meth:`get_state`; returns the generator."""
        from anygpu.tensor import Tensor

        data = new_state.numpy() if isinstance(new_state, Tensor) else np.asarray(new_state)
        try:
            state = json.loads(np.asarray(data, np.uint8).tobytes().decode())
            seed, offsets = int(state["seed"]), dict(state["offsets"])
        except (ValueError, KeyError, TypeError) as err:
            raise RuntimeError("set_state: not a state from Generator.get_state") from err
        self._seed = seed & _MASK64
        self._counters = {dev: Tensor(np.array([int(v) & 0xFFFFFFFF], np.uint32), device=dev)
                          for dev, v in offsets.items()}
        return self

    def _key(self) -> int:
        low, high = self._seed & 0xFFFFFFFF, self._seed >> 32
        return _mix32(low ^ 0x9E3779B9 ^ (_mix32(high) if high else 0))

    def __repr__(self) -> str:
        return f"<anygpu.Generator device={self.device!r} seed={self._seed}>"


default_generator = Generator()
default_generator.manual_seed(config.get().seed)


def manual_seed(seed: int) -> Generator:
    """Restart the global generator: the same seed gives the same sequence of tensors.

    >>> import anygpu as ag
    >>> _ = ag.manual_seed(0); a = ag.rand(3)
    >>> _ = ag.manual_seed(0); bool((ag.rand(3) == a).all())
    True
    """
    return default_generator.manual_seed(seed)


def seed() -> int:
    """Seed the global generator non-deterministically; returns the seed."""
    return default_generator.seed()


def initial_seed() -> int:
    """The seed the global generator was last started from."""
    return default_generator.initial_seed()


def get_rng_state() -> Any:
    """The global generator's state, as a uint8 tensor."""
    return default_generator.get_state()


def set_rng_state(new_state: Any) -> None:
    """Restore the global generator's state from :func:`get_rng_state`."""
    default_generator.set_state(new_state)


def _generator(generator: Generator | None) -> Generator:
    if generator is None:
        return default_generator
    if not isinstance(generator, Generator):
        raise TypeError(f"generator must be an anygpu.Generator, got {type(generator).__name__}")
    return generator


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


def random_bits(n: int, device: str | None, generator: Generator | None = None) -> Any:
    """n uint32 values, advancing the generator's counter on ``device`` by n."""
    from anygpu.tensor import Tensor, canonical

    from anygpu.ops.grad import no_grad

    gen = _generator(generator)
    dev = canonical(device)
    if dev not in gen._counters:
        gen._counters[dev] = Tensor(np.zeros(1, np.uint32), device=dev)
    position = gen._counters[dev]
    key = gen._key()
    with no_grad():
        idx = Tensor(Lazy.iota(n, dt.int32, dev)).cast(dt.uint32)
        bits = _hash(_hash(idx + position) ^ Tensor(Lazy.const(key, (), dt.uint32, dev)))
        bits = bits.contiguous().realize()
        position.assign(position + n)  # wraps around after 2**32 values
    return bits


def _uniform(n: int, device: str | None, bits: int = 24, generator: Generator | None = None
             ) -> Any:
    """k / 2**bits for uniform k < 2**bits: exact in a float of ``bits`` significand bits, so
    rounding to one never reaches 1.0 (float32 has 24, float16 11, bfloat16 8)."""
    raw = random_bits(n, device, generator)
    return (raw >> (32 - bits)).cast(dt.float32) * (1.0 / (1 << bits))


def rand(shape: tuple[int, ...], dtype: Any, device: str | None,
         generator: Generator | None = None) -> Any:
    """Uniform on [0, 1)."""
    d = dt.to_dtype(dtype) if dtype is not None else dt.float32
    if not d.is_float:
        raise TypeError(f"rand needs a floating-point dtype, got {d.name}")
    n = math.prod(shape)
    bits = {dt.float16: 11, dt.bfloat16: 8}.get(d, 24)
    out = _uniform(n, device, bits, generator).reshape(shape).cast(d)
    return out.contiguous().realize().detach()


def randn(shape: tuple[int, ...], dtype: Any, device: str | None,
          generator: Generator | None = None) -> Any:
    """Standard normal, by the Box-Muller transform of two uniform streams."""
    d = dt.to_dtype(dtype) if dtype is not None else dt.float32
    if not d.is_float:
        raise TypeError(f"randn needs a floating-point dtype, got {d.name}")
    n = math.prod(shape)
    u = _uniform(2 * n, device, generator=generator)
    u1, u2 = u[:n], u[n:]
    z = (-2.0 * (1.0 - u1).log()).sqrt() * (u2 * (2 * math.pi)).cos()
    return z.reshape(shape).cast(d).contiguous().realize().detach()


def randint(low: int, high: int, shape: tuple[int, ...], dtype: Any, device: str | None,
            generator: Generator | None = None) -> Any:
    """Uniform integers in [low, high)."""
    if high <= low:
        raise ValueError(f"randint: empty range [{low}, {high})")
    d = dt.to_dtype(dtype) if dtype is not None else dt.int64
    n = math.prod(shape)
    span = high - low
    if span > 2**31:
        raise ValueError("randint: the range must be below 2**31")
    bits = random_bits(n, device, generator)
    # the top bits scaled into the range; (bits * span) >> 32 without 64-bit arithmetic
    val = ((bits >> 8).cast(dt.float32) * (span / (1 << 24))).floor().cast(dt.int32)
    val = val.minimum(span - 1)
    return (val.cast(d) + low).reshape(shape).contiguous().realize().detach()


def _host_bits(n: int, device: str | None, generator: Generator | None) -> np.ndarray:
    """n uint64 values made of two draws each, read back to the host: the same on every
    device, so what the host computes from them is too."""
    if n == 0:
        return np.zeros(0, np.uint64)
    raw = random_bits(2 * n, device, generator).numpy().astype(np.uint64)
    return (raw[:n] << np.uint64(32)) | raw[n:]


def randperm(n: int, generator: Generator | None = None, dtype: Any = None,
             device: Any = None, requires_grad: bool = False) -> Any:
    """A random permutation of ``0 .. n-1`` (int64 by default), as ``torch.randperm``.

    Each index gets a 64-bit random key drawn from the generator on ``device``; the host sorts
    the keys (stably, so the result is a permutation even where keys tie) and uploads the order.

    >>> import anygpu as ag
    >>> sorted(ag.randperm(5).tolist())
    [0, 1, 2, 3, 4]
    """
    from anygpu.tensor import Tensor

    n = int(n)
    if n < 0:
        raise RuntimeError(f"Trying to create tensor with negative dimension {n}: [{n}]")
    d = dt.to_dtype(dtype) if dtype is not None else dt.int64
    dev = str(device) if device is not None else None
    order = np.argsort(_host_bits(n, dev, generator), kind="stable")
    out = Tensor(order.astype(np.int64), device=dev).cast(d).contiguous().realize().detach()
    return out.requires_grad_(requires_grad)


def multinomial(input: Any, num_samples: int, replacement: bool = False,
                generator: Generator | None = None) -> Any:
    """Indices drawn from the categories of each row of ``input`` (1-D or 2-D non-negative
    weights, not necessarily normalized), as ``torch.multinomial``: int64, shape
    ``(num_samples,)`` or ``(rows, num_samples)``, on ``input``'s device.

    With replacement each draw inverts the row's cumulative sum at a uniform point; without
    replacement the ``num_samples`` smallest exponential-race keys ``E / p`` win (the Gumbel-max
    trick), which draws in the order of sampling without replacement. The weights are read back
    to the host, which checks them as PyTorch does and computes the indices from random bits
    drawn on the device, so every device gives the same indices.

    >>> import anygpu as ag
    >>> ag.multinomial(ag.tensor([0.0, 1.0, 0.0]), 2, replacement=True).tolist()
    [1, 1]
    """
    if not input.dtype.is_float:
        torch_name = {"int64": "Long", "int32": "Int", "int8": "Char", "uint8": "Byte",
                      "bool": "Bool"}.get(input.dtype.name, input.dtype.name)
        raise RuntimeError(f"multinomial only supports floating-point dtypes for input, got: "
                           f"{torch_name}")
    probs = np.asarray(input.numpy(), np.float64)
    if probs.ndim not in (1, 2):
        raise RuntimeError("prob_dist must be 1 or 2 dim")
    num_samples = int(num_samples)
    rows = probs.reshape(-1, probs.shape[-1])
    categories = rows.shape[1]
    if num_samples <= 0:
        raise RuntimeError("cannot sample n_sample <= 0 samples")
    if not replacement and num_samples > categories:
        raise RuntimeError("cannot sample n_sample > prob_dist.size(-1) samples without "
                           "replacement")
    if not np.all(np.isfinite(rows)) or np.any(rows < 0):
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
    if rows.size == 0 or np.any(rows.sum(1) <= 0):
        raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
    bits = _host_bits(rows.shape[0] * num_samples if replacement else rows.size,
                      input.device, generator)
    # 53 random bits, centered: uniform on (0, 1), never 0 or 1
    uniform = ((bits >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)
    if replacement:
        cdf = np.cumsum(rows, 1)
        points = uniform.reshape(rows.shape[0], num_samples) * cdf[:, -1:]
        last = categories - 1 - np.argmax(rows[:, ::-1] > 0, 1)  # the last positive category
        index = np.stack([np.searchsorted(c, x, side="right") for c, x in zip(cdf, points)])
        index = np.minimum(index, last[:, None])
    else:
        with np.errstate(divide="ignore"):
            keys = -np.log(uniform.reshape(rows.shape)) / rows  # a zero weight never wins
        index = np.argsort(keys, 1, kind="stable")[:, :num_samples]
    from anygpu.tensor import Tensor

    out = index.astype(np.int64).reshape(probs.shape[:-1] + (num_samples,))
    return Tensor(out, device=input.device)


def bernoulli(input: Any, p: Any = None, generator: Generator | None = None) -> Any:
    """Ones with probability ``input`` (or ``p`` where given), zeros otherwise, in ``input``'s
    shape, dtype and device, as ``torch.bernoulli``; computed on the device.

    >>> import anygpu as ag
    >>> ag.bernoulli(ag.tensor([0.0, 1.0])).tolist()
    [0.0, 1.0]
    """
    prob = input if p is None else p
    u = rand(tuple(input.shape), dt.float32, input.device, generator)
    return (u < prob).cast(input.dtype).contiguous().realize().detach()


def normal(mean: Any = 0.0, std: Any = 1.0, size: Any = None, *,
           generator: Generator | None = None, dtype: Any = None, device: Any = None,
           requires_grad: bool = False) -> Any:
    """Normal values of mean ``mean`` and standard deviation ``std``, as ``torch.normal``:
    tensors broadcast to their shape, Python numbers need ``size``.

    >>> import anygpu as ag
    >>> ag.normal(2.0, 0.0, size=(2,)).tolist()
    [2.0, 2.0]
    """
    from anygpu.tensor import Tensor

    tensors = [t for t in (mean, std) if isinstance(t, Tensor)]
    if size is not None:
        shape = (int(size),) if isinstance(size, int) else tuple(int(s) for s in size)
    elif tensors:
        shape = tuple(np.broadcast_shapes(*(tuple(t.shape) for t in tensors)))
    else:
        raise TypeError("normal() with a Python-number mean and std needs a size")
    if tensors:
        device = device or tensors[0].device
        dtype = dtype or tensors[0].dtype
    dev = str(device) if device is not None else None
    z = randn(shape, dt.float32, dev, generator)
    out = (z * std + mean).cast(dt.to_dtype(dtype) if dtype is not None else dt.float32)
    return out.contiguous().realize().detach().requires_grad_(requires_grad)


def methods() -> dict[str, Any]:
    """The methods this module adds to ``Tensor`` (the in-place ones are in ops/inplace.py)."""
    return {"multinomial": multinomial, "bernoulli": bernoulli}


__all__ = ["Generator", "default_generator", "manual_seed", "seed", "initial_seed",
           "get_rng_state", "set_rng_state", "random_bits", "rand", "randn", "randint",
           "randperm", "multinomial", "bernoulli", "normal", "methods"]
