"""Samplers: which indices of a map-style dataset an epoch visits, and in what order, as
``torch.utils.data``'s samplers.

Random orders come from a NumPy ``np.random.Generator`` on the host. A sampler given no
``generator`` draws a fresh seed from anygpu's global generator at each epoch, so
``anygpu.manual_seed`` makes the orders reproducible and successive epochs differ, as in
PyTorch. ``generator=`` takes an int seed or a ``np.random.Generator`` (anygpu has no
``Generator`` class): the sampler then owns that stream and advances it epoch after epoch.

>>> from anygpu.utils.data import BatchSampler, RandomSampler, SequentialSampler
>>> list(BatchSampler(SequentialSampler(range(5)), batch_size=2, drop_last=False))
[[0, 1], [2, 3], [4]]
>>> sorted(RandomSampler(range(4), generator=0))
[0, 1, 2, 3]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, Iterable, Iterator, Sequence, Sized, TypeVar, Union

import numpy as np

if TYPE_CHECKING:
    from anygpu.ops.random import Generator

T_co = TypeVar("T_co", covariant=True)

GeneratorLike = Union[int, np.random.Generator, np.random.SeedSequence, "Generator", None]


# ---- random streams --------------------------------------------------------------------------
def as_generator(generator: GeneratorLike, who: str = "generator") -> np.random.Generator | None:
    """The NumPy generator for a ``generator=`` argument: None stays None (draw a fresh seed
    from anygpu's global generator when needed); an int, a SeedSequence or an anygpu.Generator
    (its next 64 bits) seeds a new one."""
    if generator is None or isinstance(generator, np.random.Generator):
        return generator
    if isinstance(generator, np.random.SeedSequence):
        return np.random.default_rng(generator)
    from anygpu.ops.random import Generator, random_bits

    if isinstance(generator, Generator):  # a NumPy stream seeded from its next 64 bits
        high, low = (int(b) for b in random_bits(2, "cpu", generator).numpy())
        return np.random.default_rng((high << 32) | low)
    if isinstance(generator, (int, np.integer)) and not isinstance(generator, bool):
        if generator < 0:
            raise ValueError(f"{who}: a seed must be non-negative, got {generator}")
        return np.random.default_rng(int(generator))
    raise TypeError(f"{who} must be None, an int seed, an anygpu.Generator or a "
                    f"numpy.random.Generator, got {type(generator).__name__}")


def fresh_seed() -> int:
    """A 63-bit seed drawn from anygpu's global generator (``anygpu.manual_seed`` restarts it),
    computed on the cpu device (on the default device where the cpu backend is unavailable),
    so that orders do not depend on ``ANYGPU_DEVICE``. In a DataLoader worker, drawn from
    NumPy's global generator instead, which the worker seeded: workers never run kernels."""
    from anygpu.ops.random import random_bits
    from anygpu.runtime.base import DeviceError
    from anygpu.utils.data.worker import get_worker_info

    if get_worker_info() is not None:
        return int(np.random.randint(0, 2**63 - 1, dtype=np.int64))
    try:
        bits = random_bits(2, "cpu").numpy()
    except DeviceError:
        bits = random_bits(2, None).numpy()
    high, low = (int(b) for b in bits)
    return ((high << 32) | low) & (2**63 - 1)


def draw_seed(generator: np.random.Generator | None) -> int:
    """A 63-bit seed from ``generator``, or from anygpu's global generator if None."""
    if generator is None:
        return fresh_seed()
    return int(generator.integers(0, 2**63 - 1))


def epoch_generator(generator: np.random.Generator | None) -> np.random.Generator:
    return generator if generator is not None else np.random.default_rng(fresh_seed())


def _length(data_source: Any, who: str) -> int:
    """``len(data_source)``, with an error that says what to do when it has none."""
    if not hasattr(type(data_source), "__len__"):
        raise TypeError(f"{who} needs len(dataset), but {type(data_source).__name__} has no "
                        f"__len__: define __len__, pass a sampler that needs no length, or "
                        f"make the dataset an IterableDataset")
    return len(data_source)


def _positive_int(value: Any, name: str) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} should be a positive integer value, but got {name}={value}")
    return int(value)


# ---- samplers --------------------------------------------------------------------------------
class Sampler(Generic[T_co]):
    """Base class of samplers: ``__iter__`` yields the indices (or keys) of one epoch;
    ``__len__``, where defined, says how many.

    >>> class Evens(Sampler[int]):
    ...     def __init__(self, n: int): self.n = n
    ...     def __iter__(self): return iter(range(0, self.n, 2))
    >>> list(Evens(5))
    [0, 2, 4]
    """

    def __init__(self, data_source: Sized | None = None) -> None:
        pass  # accepted for PyTorch compatibility; samplers keep what they need themselves

    def __iter__(self) -> Iterator[T_co]:
        raise NotImplementedError("Subclasses of Sampler should implement __iter__")


def epoch_indices(sampler: Any) -> np.ndarray | None:
    """A whole epoch's indices as one array, where ``sampler`` is one of the samplers here
    (or a subclass that keeps their ``__iter__``): ``BatchSampler`` then slices the array
    instead of collecting indices one by one. None for any other sampler."""
    for cls in type(sampler).__mro__:
        if "__iter__" in vars(cls):
            return sampler._indices() if "_indices" in vars(cls) else None
    return None


class SequentialSampler(Sampler[int]):
    """0, 1, ..., len(data_source) - 1.

    >>> list(SequentialSampler(range(3)))
    [0, 1, 2]
    """

    def __init__(self, data_source: Sized) -> None:
        _length(data_source, "SequentialSampler")
        self.data_source = data_source

    def _indices(self) -> np.ndarray:
        return np.arange(len(self.data_source))

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.data_source)))

    def __len__(self) -> int:
        return len(self.data_source)


class RandomSampler(Sampler[int]):
    """A random order of the dataset's indices (a permutation, repeated if ``num_samples``
    exceeds the length), or ``num_samples`` draws with replacement.

    >>> sorted(RandomSampler(range(5), generator=1))
    [0, 1, 2, 3, 4]
    >>> len(list(RandomSampler(range(5), replacement=True, num_samples=8, generator=1)))
    8
    """

    def __init__(self, data_source: Sized, replacement: bool = False,
                 num_samples: int | None = None, generator: GeneratorLike = None) -> None:
        if not isinstance(replacement, bool):
            raise TypeError(f"replacement should be a boolean value, but got "
                            f"replacement={replacement}")
        self.data_source = data_source
        self.replacement = replacement
        self._num_samples = num_samples
        self.generator = as_generator(generator)
        _length(data_source, "RandomSampler")
        _positive_int(self.num_samples, "num_samples")

    @property
    def num_samples(self) -> int:
        return len(self.data_source) if self._num_samples is None else self._num_samples

    def _indices(self) -> np.ndarray:
        n, k = len(self.data_source), self.num_samples
        rng = epoch_generator(self.generator)
        if self.replacement:
            return rng.integers(0, n, size=k)
        whole, rest = divmod(k, n)
        parts = [rng.permutation(n) for _ in range(whole)]
        if rest:
            parts.append(rng.permutation(n)[:rest])
        return np.concatenate(parts)

    def __iter__(self) -> Iterator[int]:
        yield from self._indices().tolist()

    def __len__(self) -> int:
        return self.num_samples


class SubsetRandomSampler(Sampler[int]):
    """The given indices in a random order, without replacement.

    >>> sorted(SubsetRandomSampler([7, 3, 5], generator=0))
    [3, 5, 7]
    """

    def __init__(self, indices: Sequence[int], generator: GeneratorLike = None) -> None:
        self.indices = indices
        self.generator = as_generator(generator)

    def _indices(self) -> np.ndarray:
        order = epoch_generator(self.generator).permutation(len(self.indices))
        return np.asarray(self.indices)[order]

    def __iter__(self) -> Iterator[int]:
        order = epoch_generator(self.generator).permutation(len(self.indices))
        for i in order.tolist():
            yield self.indices[i]

    def __len__(self) -> int:
        return len(self.indices)


class WeightedRandomSampler(Sampler[int]):
    """``num_samples`` indices in ``[0, len(weights))``, each drawn with probability
    proportional to its weight (with or without replacement).

    >>> s = WeightedRandomSampler([0.0, 1.0, 0.0, 3.0], num_samples=6, generator=0)
    >>> sorted(set(s))
    [1, 3]
    """

    def __init__(self, weights: Sequence[float] | np.ndarray | Any, num_samples: int,
                 replacement: bool = True, generator: GeneratorLike = None) -> None:
        _positive_int(num_samples, "num_samples")
        if not isinstance(replacement, bool):
            raise ValueError(f"replacement should be a boolean value, but got "
                             f"replacement={replacement}")
        w = np.asarray(weights, dtype=np.float64)
        if w.ndim != 1:
            raise ValueError(f"weights should be a 1d sequence but given weights have shape "
                             f"{tuple(w.shape)}")
        if not np.all(np.isfinite(w)) or np.any(w < 0):
            raise ValueError("weights must be finite and non-negative")
        if w.sum() <= 0:
            raise ValueError("weights must not all be zero")
        if not replacement and num_samples > np.count_nonzero(w):
            raise ValueError(f"cannot draw {num_samples} samples without replacement from "
                             f"{np.count_nonzero(w)} non-zero weights")
        self.weights = w
        self.num_samples = int(num_samples)
        self.replacement = replacement
        self.generator = as_generator(generator)

    def _indices(self) -> np.ndarray:
        rng = epoch_generator(self.generator)
        return rng.choice(len(self.weights), size=self.num_samples, replace=self.replacement,
                          p=self.weights / self.weights.sum())

    def __iter__(self) -> Iterator[int]:
        yield from self._indices().tolist()

    def __len__(self) -> int:
        return self.num_samples


class BatchSampler(Sampler[list[Any]]):
    """Groups another sampler's indices into lists of ``batch_size`` (the last one shorter
    unless ``drop_last``).

    >>> list(BatchSampler(range(7), batch_size=3, drop_last=True))
    [[0, 1, 2], [3, 4, 5]]
    """

    def __init__(self, sampler: Sampler[Any] | Iterable[Any], batch_size: int,
                 drop_last: bool) -> None:
        if not isinstance(batch_size, (int, np.integer)) or isinstance(batch_size, bool) or \
                batch_size <= 0:
            raise ValueError(f"batch_size should be a positive integer value, but got "
                             f"batch_size={batch_size}")
        if not isinstance(drop_last, bool):
            raise ValueError(f"drop_last should be a boolean value, but got "
                             f"drop_last={drop_last}")
        if not hasattr(sampler, "__iter__"):
            raise TypeError(f"sampler must be iterable, got {type(sampler).__name__}")
        self.sampler = sampler
        self.batch_size = int(batch_size)
        self.drop_last = drop_last

    def __iter__(self) -> Iterator[list[Any]]:
        size = self.batch_size
        whole = epoch_indices(self.sampler)
        if whole is not None:
            stop = len(whole) - len(whole) % size if self.drop_last else len(whole)
            for start in range(0, stop, size):
                yield whole[start:start + size].tolist()
            return
        batch: list[Any] = []
        for index in self.sampler:
            batch.append(index)
            if len(batch) == size:
                yield batch
                batch = []
        if batch and not self.drop_last:
            yield batch

    def __len__(self) -> int:
        n = _length(self.sampler, "BatchSampler")
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)


class InfiniteConstantSampler(Sampler[None]):
    """None forever: the index sampler of an IterableDataset, which ignores its indices."""

    def __iter__(self) -> Iterator[None]:
        while True:
            yield None
