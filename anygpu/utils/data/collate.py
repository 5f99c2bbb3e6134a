"""Turning a list of samples into a batch: ``default_collate`` and ``default_convert``, as
``torch.utils.data``'s.

Host data is stacked on the host with NumPy and becomes one tensor (one upload per tensor
of the batch, never a lazy op per sample): Python ints become int64, floats float32 (anygpu
has no float64), bools bool; NumPy arrays keep their dtype (float64 becomes float32).
Samples that are anygpu Tensors are stacked on their device. Tuples, lists, dicts and
namedtuples are collated field by field; strings are kept as lists.

In a DataLoader worker process, the stacked arrays stay NumPy arrays (a subclass marked to
become tensors): they are sent to the main process, which makes each one a tensor when it
receives it. Workers never touch a device.

>>> from anygpu.utils.data import default_collate
>>> batch = default_collate([(1, 0.5, {"a": [1, 2]}), (2, 1.5, {"a": [3, 4]})])
>>> [batch[0].dtype.name, batch[1].dtype.name, batch[2]["a"][1].tolist()]
['int64', 'float32', [2, 4]]
"""

from __future__ import annotations

import collections.abc
import copy
from typing import Any, Sequence

import numpy as np

from anygpu import dtype as dt
from anygpu.graph.lazy import Lazy
from anygpu.ops.primitives import Op
from anygpu.tensor import Tensor, stack, tensor
from anygpu.utils.data.dataset import StackedSamples
from anygpu.utils.data.worker import get_worker_info

COLLATE_ERROR = ("default_collate: batch must contain tensors, numpy arrays, numbers, dicts or "
                 "lists; found {}")


class HostBatch(np.ndarray):
    """A batch collated in a worker process: a NumPy array that arrives in the main process
    as an anygpu Tensor (pickling it sends the array; unpickling makes the tensor)."""

    def __reduce__(self) -> tuple[Any, tuple[np.ndarray]]:
        return (_arrive, (self.view(np.ndarray),))


def _arrive(array: np.ndarray) -> Any:
    return emit(array)


def emit(array: np.ndarray) -> Any:
    """A collated host array as the batch holds it: a Tensor made with one upload in the
    main process; a ``HostBatch`` in a worker, already in the dtype the tensor will have (so
    float64 data travels as float32)."""
    if get_worker_info() is None:
        return tensor(array)
    target = dt.from_numpy(array.dtype)
    if target.np != array.dtype:
        array = array.astype(target.np)
    return np.ascontiguousarray(array).view(HostBatch)


def _is_text(array: np.ndarray) -> bool:
    return array.dtype.kind in "SUOV"


def _stack_host(batch: Sequence[Any]) -> np.ndarray:
    arrays = [np.asarray(b) for b in batch]
    first = arrays[0].shape
    for i, a in enumerate(arrays):
        if a.shape != first:
            raise RuntimeError(f"stack expects each tensor to be equal size, but got "
                               f"{list(first)} at entry 0 and {list(a.shape)} at entry {i}")
    return np.stack(arrays)


def _collate_numbers(batch: Sequence[Any]) -> Any:
    array = np.asarray(batch)
    kind = array.dtype.kind
    if kind == "b":
        return emit(array)
    if kind in "iu":
        return emit(array.astype(np.int64))
    if kind == "f":
        return emit(array.astype(np.float32))
    raise TypeError(f"default_collate: cannot collate numbers of types "
                    f"{sorted({type(b).__name__ for b in batch})}")


def _collate_tensors(batch: Sequence[Any]) -> Any:
    for i, t in enumerate(batch):
        if not isinstance(t, Tensor):
            raise TypeError(f"default_collate: entry 0 is a Tensor but entry {i} is a "
                            f"{type(t).__name__}")
        if t.shape != batch[0].shape:
            raise RuntimeError(f"stack expects each tensor to be equal size, but got "
                               f"{list(batch[0].shape)} at entry 0 and {list(t.shape)} at "
                               f"entry {i}")
        if t.device != batch[0].device:
            raise RuntimeError(f"stack expects all tensors on the same device, but got "
                               f"{batch[0].device} at entry 0 and {t.device} at entry {i}")
    if get_worker_info() is not None:
        # workers compute nothing: the samples' values are read and stacked on the host
        return emit(np.stack([t.numpy() for t in batch]))
    rows = _rows_of_one_tensor(batch)
    if rows is not None:
        return Tensor(rows[0])[np.asarray(rows[1])]
    if batch[0].device.startswith("cpu") and \
            all(t.lazy.realized and not t.requires_grad for t in batch):
        return tensor(np.stack([t.numpy() for t in batch]), dtype=batch[0].dtype)
    return stack(list(batch))


def _rows_of_one_tensor(batch: Sequence[Tensor]) -> tuple[Lazy, list[int]] | None:
    """(tensor, rows) when every sample is a row ``tensor[i]`` of the same tensor (what a
    dataset that indexes a tensor returns): the batch is then one gather of those rows. A
    stack of the rows would be a kernel whose source depends on the rows: compiled anew for
    every batch."""
    base: Lazy | None = None
    rows = []
    for t in batch:
        node = t.lazy
        if t.requires_grad or node.op is not Op.RESHAPE or not node.srcs:
            return None
        shrink = node.srcs[0]
        if shrink.op is not Op.SHRINK or not shrink.srcs:
            return None
        source = shrink.srcs[0]
        if base is None:
            base = source
        (start, stop), rest = shrink.arg[0], shrink.arg[1:]
        if source is not base or stop != start + 1 or node.shape != source.shape[1:] or \
                any(tuple(b) != (0, n) for b, n in zip(rest, source.shape[1:])):
            return None
        rows.append(start)
    return (base, rows) if base is not None else None


def _collate_column(column: Any) -> Any:
    return column if isinstance(column, Tensor) else emit(column)


def default_collate(batch: Sequence[Any]) -> Any:
    """Stack a list of samples into a batch, recursing into tuples (which give lists, as in
    PyTorch), lists, dicts and namedtuples: numbers, NumPy arrays and anygpu Tensors at the
    leaves become one tensor each with a leading batch dimension; strings stay a list.

    >>> import numpy as np
    >>> x, y = default_collate([(np.ones(3), 0), (np.zeros(3), 1)])
    >>> x.shape, x.dtype.name, y.tolist()
    ((2, 3), 'float32', [0, 1])
    """
    if isinstance(batch, StackedSamples):
        return [_collate_column(c) for c in batch.columns]
    if len(batch) == 0:
        raise ValueError("default_collate needs a non-empty batch")
    elem = batch[0]
    if isinstance(elem, Tensor):
        return _collate_tensors(batch)
    if isinstance(elem, np.ndarray):
        if _is_text(elem):
            raise TypeError(COLLATE_ERROR.format(elem.dtype))
        return emit(_stack_host(batch))
    if isinstance(elem, (str, bytes)):
        return batch
    if isinstance(elem, np.generic):
        if _is_text(np.asarray(elem)):
            raise TypeError(COLLATE_ERROR.format(np.asarray(elem).dtype))
        return emit(np.asarray(batch))
    if isinstance(elem, (bool, int, float)):
        return _collate_numbers(batch)
    if isinstance(elem, collections.abc.Mapping):
        collated = {key: default_collate([d[key] for d in batch]) for key in elem}
        return _rebuild_mapping(elem, collated)
    if isinstance(elem, tuple) and hasattr(elem, "_fields"):  # a namedtuple
        return type(elem)(*(default_collate(list(s)) for s in zip(*batch)))
    if isinstance(elem, collections.abc.Sequence):
        size = len(elem)
        if any(len(sample) != size for sample in batch):
            raise RuntimeError("each element in list of batch should be of equal size")
        columns = [default_collate(list(s)) for s in zip(*batch)]
        if isinstance(elem, tuple):
            return columns
        return _rebuild_sequence(elem, columns)
    raise TypeError(COLLATE_ERROR.format(type(elem)))


def _rebuild_mapping(like: Any, values: dict[Any, Any]) -> Any:
    """``values`` in a mapping of the type of ``like`` where it can be built, else a dict."""
    try:
        if isinstance(like, collections.abc.MutableMapping):
            clone = copy.copy(like)
            clone.update(values)
            return clone
        return type(like)(values)
    except TypeError:
        return values


def _rebuild_sequence(like: Any, values: list[Any]) -> Any:
    try:
        if isinstance(like, collections.abc.MutableSequence):
            clone = copy.copy(like)
            for i, v in enumerate(values):
                clone[i] = v
            return clone
        return type(like)(values)
    except TypeError:
        return values


def default_convert(data: Any) -> Any:
    """What ``DataLoader`` does to each sample when ``batch_size=None``: NumPy arrays and
    NumPy scalars become tensors, recursing into tuples (which give lists), lists, dicts and
    namedtuples; Tensors, Python numbers and anything else stay as they are.

    >>> import numpy as np
    >>> out = default_convert({"x": np.arange(3), "n": 1})
    >>> type(out["x"]).__name__, out["n"]
    ('Tensor', 1)
    """
    if isinstance(data, (Tensor, HostBatch)):
        return data
    if isinstance(data, np.ndarray):
        return data if _is_text(data) else emit(data)
    if isinstance(data, np.generic):
        array = np.asarray(data)
        return data if _is_text(array) else emit(array)
    if isinstance(data, collections.abc.Mapping):
        return _rebuild_mapping(data, {key: default_convert(data[key]) for key in data})
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(default_convert(d) for d in data))
    if isinstance(data, tuple):
        return [default_convert(d) for d in data]
    if isinstance(data, collections.abc.Sequence) and not isinstance(data, (str, bytes)):
        return _rebuild_sequence(data, [default_convert(d) for d in data])
    return data
