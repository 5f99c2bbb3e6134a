"""Datasets, as ``torch.utils.data``'s: map-style ones (``__getitem__`` and ``__len__``),
iterable ones (``__iter__``), and those built from others (concatenations, subsets, random
splits).

A map-style dataset may also define ``__getitems__(indices)``, returning the samples of a whole
batch at once; ``DataLoader`` then fetches each batch with one call. ``TensorDataset`` does: a
batch of its rows is one indexing of each array with all of the batch's indices.

>>> import numpy as np
>>> from anygpu.utils.data import TensorDataset, random_split
>>> ds = TensorDataset(np.arange(10.0).reshape(5, 2), np.arange(5))
>>> len(ds), ds[1][0].tolist()
(5, [2.0, 3.0])
>>> [len(part) for part in random_split(ds, [0.6, 0.4], generator=0)]
[3, 2]
"""

from __future__ import annotations

import bisect
import copy
import itertools
import math
import warnings
from typing import Any, Generic, Iterable, Iterator, Sequence, TypeVar

import numpy as np

from anygpu.tensor import Tensor, tensor
from anygpu.utils.data.sampler import GeneratorLike, as_generator, epoch_generator

T_co = TypeVar("T_co", covariant=True)


class Dataset(Generic[T_co]):
    """A map-style dataset: ``ds[i]`` is sample i; subclasses define ``__getitem__`` and
    usually ``__len__``. ``a + b`` concatenates two datasets.

    >>> class Squares(Dataset):
    ...     def __getitem__(self, i): return i * i
    ...     def __len__(self): return 4
    >>> ds = Squares() + Squares()
    >>> len(ds), ds[5]
    (8, 1)
    """

    def __getitem__(self, index: Any) -> T_co:
        raise NotImplementedError("Subclasses of Dataset should implement __getitem__")

    def __add__(self, other: "Dataset[T_co]") -> "ConcatDataset[T_co]":
        return ConcatDataset([self, other])


class IterableDataset(Dataset[T_co]):
    """A dataset read as a stream: subclasses define ``__iter__``. With worker processes,
    each worker iterates its own copy; ``get_worker_info()`` tells it which share to yield.

    >>> class Count(IterableDataset):
    ...     def __iter__(self): return iter(range(3))
    >>> list(Count() + Count())
    [0, 1, 2, 0, 1, 2]
    """

    def __iter__(self) -> Iterator[T_co]:
        raise NotImplementedError("Subclasses of IterableDataset should implement __iter__")

    def __add__(self, other: Any) -> Any:  # a ChainDataset (Dataset's gives a ConcatDataset)
        return ChainDataset([self, other])


class StackedSamples(Sequence[tuple[Any, ...]]):
    """The samples of one batch of a ``TensorDataset``, kept as one array or tensor per column
    (the rows of each of its tensors): ``default_collate`` returns the columns as they are, and
    any other ``collate_fn`` sees an ordinary sequence of samples (tuples of rows).

    >>> batch = TensorDataset(np.arange(6).reshape(3, 2)).__getitems__([2, 0])
    >>> len(batch), batch[0][0].tolist()
    (2, [4, 5])
    """

    __slots__ = ("columns",)

    def __init__(self, columns: tuple[Any, ...]) -> None:
        self.columns = columns

    def __len__(self) -> int:
        return len(self.columns[0])

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return StackedSamples(tuple(c[index] for c in self.columns))
        return tuple(c[index] for c in self.columns)

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:
        return f"StackedSamples({len(self)} samples of {len(self.columns)} columns)"


def _check_column(data: Any, position: int) -> None:
    if isinstance(data, Tensor):
        pass
    elif isinstance(data, np.ndarray):
        if data.dtype.kind not in "biuf":
            raise TypeError(f"TensorDataset: argument {position} has NumPy dtype {data.dtype}; "
                            f"only numbers and bools can become tensors")
    else:
        raise TypeError(f"TensorDataset takes anygpu Tensors or NumPy arrays, but argument "
                        f"{position} is a {type(data).__name__}: convert it with "
                        f"anygpu.tensor(...) or numpy.asarray(...)")
    if data.ndim == 0:
        raise ValueError(f"TensorDataset: argument {position} is 0-d; every tensor needs a "
                         f"first dimension to index")


class TensorDataset(Dataset[tuple[Any, ...]]):
    """Rows of tensors that share their first dimension: ``ds[i]`` is
    ``tuple(t[i] for t in tensors)``. Each may be an anygpu Tensor (on any device) or a NumPy
    array; its rows are of the same kind.

    A batch (``__getitems__``, which ``DataLoader`` calls) indexes each of them once with all of
    the batch's indices: a NumPy array on the host, so that ``default_collate`` uploads the
    batch as one tensor; a Tensor by one gather on its device (the indices uploaded once per
    device), never a slice per sample.

    >>> import anygpu as ag
    >>> ds = TensorDataset(ag.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]), np.array([7, 8, 9]))
    >>> x, y = ds.__getitems__([2, 0]).columns
    >>> x.tolist(), y.tolist()
    ([[5.0, 6.0], [1.0, 2.0]], [9, 7])
    """

    tensors: tuple[Any, ...]

    def __init__(self, *tensors: Tensor | np.ndarray) -> None:
        if not tensors:
            raise ValueError("TensorDataset needs at least one tensor")
        for position, data in enumerate(tensors):
            _check_column(data, position)
        sizes = [int(t.shape[0]) for t in tensors]
        if len(set(sizes)) > 1:
            raise ValueError(f"Size mismatch between tensors: TensorDataset needs the same "
                             f"first dimension in all of them, got {sizes}")
        self.tensors = tuple(tensors)

    def __getitem__(self, index: Any) -> tuple[Any, ...]:
        return tuple(t[index] for t in self.tensors)

    def __getitems__(self, indices: Sequence[int]) -> StackedSamples:
        n = len(self)
        idx = np.asarray(indices)
        if idx.size == 0:
            idx = idx.astype(np.int64)
        if idx.ndim != 1 or idx.dtype.kind not in "iu":
            raise TypeError(f"TensorDataset.__getitems__ needs a sequence of integer indices, "
                            f"got {type(indices).__name__} of {idx.dtype}")
        bad = (idx >= n) | (idx < -n)
        if bad.any():
            raise IndexError(f"index {int(idx[bad][0])} is out of range for a dataset of {n}")
        idx = np.where(idx < 0, idx + n, idx).astype(np.int32 if n < 2**31 else np.int64)
        on_device: dict[str, Tensor] = {}
        columns = []
        for t in self.tensors:
            if isinstance(t, np.ndarray):
                columns.append(t[idx])
            else:
                if t.device not in on_device:
                    on_device[t.device] = tensor(idx, device=t.device)
                columns.append(t[on_device[t.device]])
        return StackedSamples(tuple(columns))

    def __len__(self) -> int:
        return int(self.tensors[0].shape[0])


class ConcatDataset(Dataset[T_co]):
    """Map-style datasets one after the other: index ``len(a) + i`` is ``b[i]``.

    >>> ds = ConcatDataset([range(3), range(10, 12)])
    >>> len(ds), ds[3], ds.cumulative_sizes
    (5, 10, [3, 5])
    """

    datasets: list[Any]
    cumulative_sizes: list[int]

    @staticmethod
    def cumsum(sequence: Iterable[Any]) -> list[int]:
        out, total = [], 0
        for item in sequence:
            total += len(item)
            out.append(total)
        return out

    def __init__(self, datasets: Iterable[Any]) -> None:
        self.datasets = list(datasets)
        if not self.datasets:
            raise ValueError("datasets should not be an empty iterable")
        for d in self.datasets:
            if isinstance(d, IterableDataset):
                raise TypeError("ConcatDataset does not support IterableDataset "
                                "(ChainDataset chains those)")
            if not hasattr(type(d), "__len__"):
                raise TypeError(f"ConcatDataset needs datasets with __len__, "
                                f"{type(d).__name__} has none")
        self.cumulative_sizes = self.cumsum(self.datasets)

    def __len__(self) -> int:
        return self.cumulative_sizes[-1]

    def _locate(self, index: int) -> tuple[int, int]:
        """(which dataset, which sample of it) for a global index."""
        if index < 0:
            if -index > len(self):
                raise ValueError("absolute value of index should not exceed dataset length")
            index += len(self)
        which = bisect.bisect_right(self.cumulative_sizes, index)
        if which == len(self.datasets):
            raise IndexError(f"index {index} is out of range for a dataset of {len(self)}")
        return which, index - (self.cumulative_sizes[which - 1] if which else 0)

    def __getitem__(self, index: int) -> T_co:
        which, sample = self._locate(index)
        return self.datasets[which][sample]

    def __getitems__(self, indices: Sequence[int]) -> Sequence[Any]:
        """The batch, fetched with one ``__getitems__`` per dataset where they have one; when
        all parts are host ``StackedSamples``, their columns are joined into one batch."""
        groups: dict[int, tuple[list[int], list[int]]] = {}
        for position, index in enumerate(indices):
            which, sample = self._locate(index)
            positions, samples = groups.setdefault(which, ([], []))
            positions.append(position)
            samples.append(sample)
        parts = {}
        for which, (_, samples) in groups.items():
            dataset = self.datasets[which]
            fetch = getattr(dataset, "__getitems__", None)
            parts[which] = fetch(samples) if callable(fetch) else [dataset[s] for s in samples]
        stacked = [p for p in parts.values() if isinstance(p, StackedSamples)]
        if len(stacked) == len(parts) and len({len(p.columns) for p in stacked}) == 1 and \
                all(isinstance(c, np.ndarray) for p in stacked for c in p.columns):
            order = np.argsort(np.concatenate([groups[w][0] for w in parts]), kind="stable")
            columns = tuple(np.concatenate(cs)[order]
                            for cs in zip(*(p.columns for p in stacked)))
            return StackedSamples(columns)
        out: list[Any] = [None] * len(indices)
        for which, part in parts.items():
            for position, item in zip(groups[which][0], part):
                out[position] = item
        return out


class ChainDataset(IterableDataset[Any]):
    """Iterable datasets one after the other.

    >>> list(ChainDataset([range(2), range(5, 7)]))
    [0, 1, 5, 6]
    """

    def __init__(self, datasets: Iterable[Any]) -> None:
        self.datasets = datasets

    def __iter__(self) -> Iterator[Any]:
        for d in self.datasets:
            yield from d

    def __len__(self) -> int:
        return sum(len(d) for d in self.datasets)


class Subset(Dataset[T_co]):
    """The samples of ``dataset`` at ``indices``, in that order.

    >>> ds = Subset(range(10, 20), [4, 0, 2])
    >>> len(ds), ds[0], ds.__getitems__([1, 2])
    (3, 14, [10, 12])
    """

    def __init__(self, dataset: Any, indices: Sequence[int]) -> None:
        self.dataset = dataset
        self.indices = indices

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, list):
            return self.dataset[[self.indices[i] for i in index]]
        return self.dataset[self.indices[index]]

    def __getitems__(self, indices: Sequence[int]) -> Any:
        mapped = [self.indices[i] for i in indices]
        fetch = getattr(self.dataset, "__getitems__", None)
        if callable(fetch):
            return fetch(mapped)
        return [self.dataset[i] for i in mapped]

    def __len__(self) -> int:
        return len(self.indices)


def random_split(dataset: Any, lengths: Sequence[int | float],
                 generator: GeneratorLike = None) -> list[Subset[Any]]:
    """Split ``dataset`` into non-overlapping random subsets of the given lengths: counts that
    add up to ``len(dataset)``, or fractions that add up to 1 (the rounding remainder goes
    one by one to the first subsets, as in PyTorch). ``generator`` is an int seed or a
    ``np.random.Generator``; None draws from anygpu's global generator.

    >>> parts = random_split(range(10), [3, 7], generator=0)
    >>> [len(p) for p in parts], sorted(list(parts[0]) + list(parts[1])) == list(range(10))
    ([3, 7], True)
    """
    lengths = list(lengths)
    if not lengths:
        raise ValueError("random_split needs at least one length")
    n = len(dataset)
    total = sum(lengths)
    if math.isclose(total, 1) and total <= 1:
        counts = []
        for i, fraction in enumerate(lengths):
            if fraction < 0 or fraction > 1:
                raise ValueError(f"Fraction at index {i} is not between 0 and 1")
            counts.append(int(math.floor(n * fraction)))
        for i in range(n - sum(counts)):
            counts[i % len(counts)] += 1
        for i, count in enumerate(counts):
            if count == 0:
                warnings.warn(f"Length of split at index {i} is 0. This might result in an "
                              f"empty dataset.", stacklevel=2)
        lengths = counts
    for i, length in enumerate(lengths):
        if not isinstance(length, (int, np.integer)) or isinstance(length, bool) or length < 0:
            raise ValueError(f"random_split: length at index {i} must be a non-negative int "
                             f"(or all lengths fractions summing to 1), got {length!r}")
    if sum(lengths) != n:
        raise ValueError(f"Sum of input lengths ({sum(lengths)}) does not equal the length of "
                         f"the input dataset ({n})!")
    order = epoch_generator(as_generator(generator, "random_split")).permutation(n).tolist()
    return [Subset(dataset, order[end - length:end])
            for end, length in zip(itertools.accumulate(lengths), lengths)]


def host_view(dataset: Any) -> Any:
    """``dataset`` as worker processes receive it: a ``TensorDataset`` holding anygpu Tensors
    becomes a copy holding their values as NumPy arrays (read here, in the main process:
    workers never touch a device), also inside the ``Subset``, ``ConcatDataset`` and
    ``ChainDataset`` that hold it. Anything else is sent as it is."""
    if isinstance(dataset, TensorDataset):
        if not any(isinstance(t, Tensor) for t in dataset.tensors):
            return dataset
        host = copy.copy(dataset)
        host.tensors = tuple(t.numpy() if isinstance(t, Tensor) else t for t in dataset.tensors)
        return host
    if isinstance(dataset, Subset):
        inner = host_view(dataset.dataset)
        if inner is dataset.dataset:
            return dataset
        subset = copy.copy(dataset)
        subset.dataset = inner
        return subset
    if isinstance(dataset, (ConcatDataset, ChainDataset)):
        parts = list(dataset.datasets)
        views = [host_view(d) for d in parts]
        if all(v is d for v, d in zip(views, parts)):
            return dataset
        joined = copy.copy(dataset)
        joined.datasets = views
        return joined
    return dataset
