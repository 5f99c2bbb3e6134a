"""Fetching batches, in the main process or in a DataLoader worker process, and the worker's
loop: seeded, guarded so that it never touches a GPU device, sending each batch (or the
exception that stopped it) back through a queue.

>>> from anygpu.utils.data import get_worker_info
>>> get_worker_info() is None  # the main process
True
"""

from __future__ import annotations

import io
import os
import pickle
import queue
import random
import sys
import traceback
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable

import numpy as np

# seconds a worker waits for work before it checks that its parent is still alive
MP_STATUS_CHECK_INTERVAL = 5.0


class WorkerInfo:
    """What ``get_worker_info()`` returns in a worker: ``id`` (0 to ``num_workers`` - 1),
    ``num_workers``, ``seed`` (the worker's seed for ``random``, NumPy and anygpu) and
    ``dataset`` (the worker's own copy). Read-only."""

    id: int
    num_workers: int
    seed: int
    dataset: Any

    def __init__(self, **fields: Any) -> None:
        for name, value in fields.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_frozen", True)

    def __setattr__(self, name: str, value: Any) -> None:
        raise RuntimeError(f"Cannot assign attributes to {type(self).__name__} objects")

    def __repr__(self) -> str:
        return (f"WorkerInfo(id={self.id}, num_workers={self.num_workers}, seed={self.seed}, "
                f"dataset={type(self.dataset).__name__})")


_worker_info: WorkerInfo | None = None


def get_worker_info() -> WorkerInfo | None:
    """In a DataLoader worker process, its ``WorkerInfo``; None in the main process. An
    ``IterableDataset`` reads it to yield only its worker's share.

    >>> get_worker_info() is None
    True
    """
    return _worker_info


# ---- fetching --------------------------------------------------------------------------------
class MapFetcher:
    """Fetches a batch of a map-style dataset: one ``__getitems__`` call where the dataset
    has it, else one ``dataset[i]`` per index; then ``collate_fn``."""

    def __init__(self, dataset: Any, auto_collation: bool, collate_fn: Callable[[Any], Any],
                 drop_last: bool) -> None:
        self.dataset, self.auto_collation, self.collate_fn = dataset, auto_collation, collate_fn
        self.drop_last = drop_last

    def fetch(self, index: Any) -> Any:
        if self.auto_collation:
            fetch_many = getattr(self.dataset, "__getitems__", None)
            if callable(fetch_many):
                data = fetch_many(index)
            else:
                data = [self.dataset[i] for i in index]
        else:
            data = self.dataset[index]
        return self.collate_fn(data)


class IterableFetcher:
    """Fetches the next batch of an iterable dataset (``len(index)`` items, fewer at its
    end); raises StopIteration once it is exhausted."""

    def __init__(self, dataset: Any, auto_collation: bool, collate_fn: Callable[[Any], Any],
                 drop_last: bool) -> None:
        self.dataset_iter = iter(dataset)
        self.auto_collation = auto_collation
        self.collate_fn = collate_fn
        self.drop_last = drop_last
        self.ended = False

    def fetch(self, index: Any) -> Any:
        if self.ended:
            raise StopIteration
        if self.auto_collation:
            data = []
            for _ in index:
                try:
                    data.append(next(self.dataset_iter))
                except StopIteration:
                    self.ended = True
                    break
            if not data or (self.drop_last and len(data) < len(index)):
                raise StopIteration
        else:
            data = next(self.dataset_iter)
        return self.collate_fn(data)


def make_fetcher(iterable: bool, dataset: Any, auto_collation: bool,
                 collate_fn: Callable[[Any], Any], drop_last: bool) -> Any:
    kind = IterableFetcher if iterable else MapFetcher
    return kind(dataset, auto_collation, collate_fn, drop_last)


# ---- messages between the processes ----------------------------------------------------------
class IterableDatasetStopIteration:
    """A worker's iterable dataset is exhausted."""

    def __init__(self, worker_id: int) -> None:
        self.worker_id = worker_id


class ResumeIteration:
    """A persistent worker starts a new epoch (and acknowledges with this message)."""


class ExceptionWrapper:
    """An exception with its traceback text, raised again in the main process."""

    def __init__(self, where: str) -> None:
        exc_type, exc, tb = sys.exc_info()
        assert exc_type is not None
        self.exc_msg = "".join(traceback.format_exception(exc_type, exc, tb))
        self.where = where
        try:  # an exception class the main process cannot import arrives as a RuntimeError
            pickle.dumps(exc_type)
            self.exc_type: type[BaseException] = exc_type
        except Exception:
            self.exc_type = RuntimeError

    def reraise(self) -> None:
        msg = f"Caught {self.exc_type.__name__} {self.where}.\nOriginal {self.exc_msg}"
        if self.exc_type is KeyError:  # KeyError shows its argument's repr: keep lines apart
            raise KeyError(_KeyErrorMessage(msg))
        try:
            exception = self.exc_type(msg)
        except Exception:  # the exception type needs other arguments
            raise RuntimeError(msg) from None
        try:
            raise exception
        finally:
            del exception  # no cycle through this frame keeps the iterator (and workers) alive


class _KeyErrorMessage(str):
    def __repr__(self) -> str:
        return str(self)


def dumps(obj: Any) -> bytes:
    """``obj`` pickled as multiprocessing pickles (with its reducers), here and now: an error
    is caught by the caller instead of being lost in a queue's feeder thread."""
    buffer = io.BytesIO()
    ForkingPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


# ---- the worker process ----------------------------------------------------------------------
def _reduce_tensor(t: Any) -> tuple[Any, tuple[Any, ...]]:
    return (_tensor_arrives, (t.numpy(), t.dtype.name))


def _tensor_arrives(array: np.ndarray, dtype: str) -> Any:
    from anygpu.tensor import tensor
    return tensor(array, dtype=dtype)


def _guard_devices(worker_id: int, forked: bool) -> None:
    """Make this worker refuse GPU devices, and under fork refuse any anygpu computation,
    with an error that says why: a forked child inherits the parent's OpenMP thread pool
    and GPU driver state in a state it cannot use, and would hang or crash instead."""
    from anygpu.graph import schedule
    from anygpu.runtime import registry

    where = f"DataLoader worker {worker_id}"
    registry.cpu_only_reason = where  # new tensors in a worker live on the cpu device
    if forked:
        schedule.refuse_reason = (
            f"{where}: anygpu cannot compute in a worker process started by fork (the "
            f"parent's OpenMP threads and GPU drivers do not survive fork). Return NumPy "
            f"arrays from the dataset and collate_fn, or pass multiprocessing_context='spawn'")


def _seed_worker(base_seed: int, worker_id: int) -> int:
    from anygpu.tensor import manual_seed

    seed = base_seed + worker_id
    random.seed(seed)
    manual_seed(seed)
    np.random.seed(np.random.SeedSequence([worker_id, base_seed]).generate_state(4))
    return seed


def worker_loop(iterable: bool, dataset: Any, index_queue: Any, data_queue: Any,
                done_event: Any, auto_collation: bool, collate_fn: Callable[[Any], Any],
                drop_last: bool, base_seed: int, init_fn: Callable[[int], None] | None,
                worker_id: int, num_workers: int, forked: bool) -> None:
    """The body of a worker process: take ``(task index, batch indices)`` from
    ``index_queue``, fetch and collate the batch, put ``(task index, batch)`` pickled on
    ``data_queue``; None ends the loop, as does the parent's death."""
    global _worker_info
    try:
        _guard_devices(worker_id, forked)
        from anygpu.tensor import Tensor
        ForkingPickler.register(Tensor, _reduce_tensor)
        seed = _seed_worker(base_seed, worker_id)
        _worker_info = WorkerInfo(id=worker_id, num_workers=num_workers, seed=seed,
                                  dataset=dataset)
        where = f"in DataLoader worker process {worker_id}"
        init_error: ExceptionWrapper | None = None
        fetcher: Any = None
        try:
            if init_fn is not None:
                init_fn(worker_id)
            fetcher = make_fetcher(iterable, dataset, auto_collation, collate_fn, drop_last)
        except Exception:
            init_error = ExceptionWrapper(where)
        iteration_end = False
        parent = os.getppid()
        while os.getppid() == parent:
            try:
                task = index_queue.get(timeout=MP_STATUS_CHECK_INTERVAL)
            except queue.Empty:
                continue
            if isinstance(task, ResumeIteration):
                data_queue.put(dumps((task, None)))
                iteration_end = False
                try:
                    fetcher = make_fetcher(iterable, dataset, auto_collation, collate_fn,
                                           drop_last)
                except Exception:
                    init_error = ExceptionWrapper(where)
                continue
            if task is None:
                break
            if done_event.is_set() or iteration_end:
                continue
            idx, index = task
            data: Any
            if init_error is not None:
                data, init_error = init_error, None
            else:
                try:
                    data = fetcher.fetch(index)
                except StopIteration:
                    if not iterable:
                        data = ExceptionWrapper(where)
                    else:
                        data = IterableDatasetStopIteration(worker_id)
                        iteration_end = True
                except Exception:
                    data = ExceptionWrapper(where)
            try:
                payload = dumps((idx, data))
            except Exception:
                payload = dumps((idx, ExceptionWrapper(where + " while sending its batch to "
                                                       "the main process")))
            data_queue.put(payload)
            del data
    except KeyboardInterrupt:
        pass  # the main process decides what a Ctrl-C means
    if done_event.is_set():
        data_queue.cancel_join_thread()  # exit now, without flushing what nobody will read
        data_queue.close()
