"""DataLoader: batches of a dataset, fetched in the main process or by worker processes, with
``torch.utils.data.DataLoader``'s arguments, checks and order of batches.

With ``num_workers > 0``, each worker (started by the platform's default multiprocessing
method, or ``multiprocessing_context``) fetches and collates whole batches on the host and
sends them back as NumPy arrays; the main process makes them tensors on the default device
and yields them in the sampler's order. Workers never touch a GPU device: a ``TensorDataset``
of device tensors reaches them as NumPy arrays, and under fork any anygpu computation in a
worker raises instead of hanging. Workers stop when the epoch ends, when the iterator is
dropped, or when the main process dies.

>>> import numpy as np
>>> from anygpu.utils.data import DataLoader, TensorDataset
>>> ds = TensorDataset(np.arange(10.0).reshape(5, 2), np.arange(5))
>>> [(x.shape, y.tolist()) for x, y in DataLoader(ds, batch_size=2)]
[((2, 2), [0, 1]), ((2, 2), [2, 3]), ((1, 2), [4])]
"""

from __future__ import annotations

import atexit
import itertools
import multiprocessing
import os
import pickle
import queue
import warnings
from typing import Any, Callable, Generic, Iterable, Iterator, TypeVar

from anygpu.utils.data.collate import default_collate, default_convert
from anygpu.utils.data.dataset import IterableDataset, host_view
from anygpu.utils.data.sampler import (BatchSampler, GeneratorLike, InfiniteConstantSampler,
                                       RandomSampler, Sampler, SequentialSampler, as_generator,
                                       draw_seed)
from anygpu.utils.data.worker import (ExceptionWrapper, IterableDatasetStopIteration,
                                      ResumeIteration, make_fetcher, worker_loop)

T_co = TypeVar("T_co", covariant=True)

# seconds the main process waits for a batch before it checks that the workers are alive
_STATUS_CHECK_INTERVAL = 1.0
# seconds a stopping worker gets to exit before it is terminated
_JOIN_TIMEOUT = 5.0


def _context(value: Any) -> Any:
    """A multiprocessing context from ``multiprocessing_context`` (a start method's name or a
    context); None keeps the platform's default."""
    if value is None or isinstance(value, multiprocessing.context.BaseContext):
        return value
    if isinstance(value, str):
        methods = multiprocessing.get_all_start_methods()
        if value not in methods:
            raise ValueError(f"multiprocessing_context option should specify a valid start "
                             f"method in {methods!r}, but got multiprocessing_context={value!r}")
        return multiprocessing.get_context(value)
    raise TypeError(f"multiprocessing_context option should be a valid context object or a "
                    f"string specifying the start method, but got "
                    f"multiprocessing_context={value!r}")


class DataLoader(Generic[T_co]):
    """Iterate over ``dataset`` in batches, with PyTorch's arguments and their meaning.

    ``batch_size`` samples a batch (None: samples one by one, through ``default_convert``),
    ``shuffle`` draws a new order each epoch (``generator``: an int seed or a
    ``np.random.Generator``; None follows ``anygpu.manual_seed``), ``sampler`` or
    ``batch_sampler`` choose the indices instead, ``drop_last`` drops a last short batch,
    ``collate_fn`` makes a batch from a list of samples (``default_collate``).
    ``num_workers`` worker processes fetch batches ahead (``prefetch_factor`` each),
    ``worker_init_fn(worker_id)`` runs first in each, ``timeout`` bounds the wait for a batch,
    ``persistent_workers`` keeps them between epochs and ``in_order=False`` yields batches as
    they come. ``pin_memory`` and ``pin_memory_device`` are accepted and change nothing:
    batches are uploaded from NumPy memory directly.

    >>> loader = DataLoader(list(range(10)), batch_size=4, shuffle=True, generator=0)
    >>> len(loader), sorted(i for batch in loader for i in batch.tolist()) == list(range(10))
    (3, True)
    """

    dataset: Any
    batch_size: int | None
    num_workers: int
    pin_memory: bool
    drop_last: bool
    timeout: float
    sampler: Sampler[Any] | Iterable[Any]
    batch_sampler: Sampler[Any] | Iterable[Any] | None
    prefetch_factor: int | None
    _iterator: Any = None
    __initialized = False

    def __init__(self, dataset: Any, batch_size: int | None = 1, shuffle: bool | None = None,
                 sampler: Sampler[Any] | Iterable[Any] | None = None,
                 batch_sampler: Sampler[Any] | Iterable[Any] | None = None,
                 num_workers: int = 0, collate_fn: Callable[[Any], Any] | None = None,
                 pin_memory: bool = False, drop_last: bool = False, timeout: float = 0,
                 worker_init_fn: Callable[[int], None] | None = None,
                 multiprocessing_context: Any = None, generator: GeneratorLike = None, *,
                 prefetch_factor: int | None = None, persistent_workers: bool = False,
                 pin_memory_device: str = "", in_order: bool = True) -> None:
        if not isinstance(num_workers, int) or isinstance(num_workers, bool):
            raise TypeError(f"num_workers should be an int, got {type(num_workers).__name__}")
        if num_workers < 0:
            raise ValueError("num_workers option should be non-negative; use num_workers=0 to "
                             "disable multiprocessing.")
        if not isinstance(timeout, (int, float)) or timeout < 0:
            raise ValueError(f"timeout option should be a non-negative number, got {timeout!r}")
        if num_workers == 0 and prefetch_factor is not None:
            raise ValueError("prefetch_factor option could only be specified in "
                             "multiprocessing. Let num_workers > 0 to enable multiprocessing, "
                             "otherwise set prefetch_factor to None.")
        if num_workers > 0 and prefetch_factor is None:
            prefetch_factor = 2
        if prefetch_factor is not None and (not isinstance(prefetch_factor, int)
                                            or prefetch_factor <= 0):
            raise ValueError(f"prefetch_factor option should be a positive int, got "
                             f"{prefetch_factor!r}")
        if persistent_workers and num_workers == 0:
            raise ValueError("persistent_workers option needs num_workers > 0")
        for name, fn in (("collate_fn", collate_fn), ("worker_init_fn", worker_init_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} should be callable, got {type(fn).__name__}")

        iterable = isinstance(dataset, IterableDataset)
        if iterable:
            if shuffle:
                raise ValueError(f"DataLoader with IterableDataset: expected unspecified shuffle "
                                 f"option, but got shuffle={shuffle}")
            if sampler is not None:
                raise ValueError(f"DataLoader with IterableDataset: expected unspecified sampler "
                                 f"option, but got sampler={sampler}")
            if batch_sampler is not None:
                raise ValueError(f"DataLoader with IterableDataset: expected unspecified "
                                 f"batch_sampler option, but got batch_sampler={batch_sampler}")
        else:
            if not hasattr(type(dataset), "__getitem__"):
                raise TypeError(f"DataLoader needs a map-style dataset (with __getitem__ and "
                                f"__len__) or an IterableDataset, got {type(dataset).__name__}")
            shuffle = bool(shuffle)
        for name, s in (("sampler", sampler), ("batch_sampler", batch_sampler)):
            if s is not None and not hasattr(s, "__iter__"):
                raise TypeError(f"{name} should be iterable, got {type(s).__name__}")
        if sampler is not None and shuffle:
            raise ValueError("sampler option is mutually exclusive with shuffle")
        if batch_sampler is not None:
            if batch_size != 1 or shuffle or sampler is not None or drop_last:
                raise ValueError("batch_sampler option is mutually exclusive with batch_size, "
                                 "shuffle, sampler, and drop_last")
            batch_size = None
            drop_last = False
        elif batch_size is None and drop_last:
            raise ValueError("batch_size=None option disables auto-batching and is mutually "
                             "exclusive with drop_last")

        self._rng = as_generator(generator)
        if sampler is None:
            if iterable:
                sampler = InfiniteConstantSampler()
            elif shuffle:
                sampler = RandomSampler(dataset, generator=self._rng)
            else:
                sampler = SequentialSampler(dataset)
        if batch_size is not None and batch_sampler is None:
            batch_sampler = BatchSampler(sampler, batch_size, drop_last)

        self.dataset = dataset
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.pin_memory = pin_memory
        self.pin_memory_device = pin_memory_device
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        self.multiprocessing_context = multiprocessing_context
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.sampler = sampler
        self.batch_sampler = batch_sampler
        self.generator = generator
        self.in_order = in_order
        self._iterable = iterable
        if collate_fn is None:
            collate_fn = default_collate if batch_sampler is not None else default_convert
        self.collate_fn = collate_fn
        self.persistent_workers = persistent_workers
        self.__initialized = True
        self._check_worker_number()

    # ---- attributes ------------------------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        if self.__initialized and name in ("batch_size", "batch_sampler", "sampler",
                                           "drop_last", "dataset", "persistent_workers"):
            raise ValueError(f"{name} attribute should not be set after "
                             f"{type(self).__name__} is initialized")
        super().__setattr__(name, value)

    @property
    def multiprocessing_context(self) -> Any:
        return self.__multiprocessing_context

    @multiprocessing_context.setter
    def multiprocessing_context(self, value: Any) -> None:
        if value is not None and self.num_workers == 0:
            raise ValueError(f"multiprocessing_context can only be used with multi-process "
                             f"loading (num_workers > 0), but got num_workers={self.num_workers}")
        self.__multiprocessing_context = _context(value)

    @property
    def _auto_collation(self) -> bool:
        return self.batch_sampler is not None

    @property
    def _index_sampler(self) -> Any:
        return self.batch_sampler if self._auto_collation else self.sampler

    def _check_worker_number(self) -> None:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:
            cores = os.cpu_count() or 1
        if self.num_workers > cores:
            warnings.warn(f"This DataLoader will create {self.num_workers} worker processes in "
                          f"total, more than the {cores} this machine offers: that may make "
                          f"loading slow or freeze it", stacklevel=3)

    # ---- iterating -------------------------------------------------------------------------
    def __len__(self) -> int:
        if self._iterable:
            if not hasattr(type(self.dataset), "__len__"):
                raise TypeError(f"len() of a DataLoader over an IterableDataset needs "
                                f"len(dataset); {type(self.dataset).__name__} has no __len__")
            length = len(self.dataset)
            if self.batch_size is not None:
                length = length // self.batch_size if self.drop_last \
                    else -(-length // self.batch_size)
            return length
        return len(self._index_sampler)

    def __iter__(self) -> Iterator[Any]:
        if self.persistent_workers and self.num_workers > 0:
            if self._iterator is None:
                self._iterator = self._get_iterator()
            else:
                self._iterator._reset(first=False)
            return self._iterator
        return self._get_iterator()

    def _get_iterator(self) -> "_BaseIterator":
        if self.num_workers == 0:
            return _SingleProcessIterator(self)
        return _MultiProcessingIterator(self)


class _BaseIterator:
    def __init__(self, loader: DataLoader[Any]) -> None:
        # the loader's settings, not the loader: a dropped iterator dies (and stops its
        # workers) as soon as nothing refers to it
        self._dataset = loader.dataset
        self._iterable = loader._iterable
        self._auto_collation = loader._auto_collation
        self._drop_last = loader.drop_last
        self._index_sampler = loader._index_sampler
        self._collate_fn = loader.collate_fn
        self._num_workers = loader.num_workers
        self._base_seed = draw_seed(loader._rng)  # drawn first, as PyTorch does
        self._sampler_iter: Iterator[Any] = iter(self._index_sampler)
        self._num_yielded = 0

    def __iter__(self) -> "_BaseIterator":
        return self

    def __next__(self) -> Any:
        data = self._next_data()
        self._num_yielded += 1
        return data

    def __len__(self) -> int:
        return len(self._index_sampler)

    def _next_data(self) -> Any:
        raise NotImplementedError

    def _reset(self, first: bool) -> None:
        self._sampler_iter = iter(self._index_sampler)
        self._num_yielded = 0


class _SingleProcessIterator(_BaseIterator):
    def __init__(self, loader: DataLoader[Any]) -> None:
        super().__init__(loader)
        self._fetcher = make_fetcher(self._iterable, self._dataset, self._auto_collation,
                                     self._collate_fn, self._drop_last)

    def _next_data(self) -> Any:
        return self._fetcher.fetch(next(self._sampler_iter))


class _MultiProcessingIterator(_BaseIterator):
    """Tasks (a task index and a batch's indices) go round-robin to the workers' index
    queues, at most ``prefetch_factor`` per worker ahead; batches come back on one result
    queue in any order and are yielded in task order."""

    def __init__(self, loader: DataLoader[Any]) -> None:
        super().__init__(loader)
        self._shutdown = True  # until the workers exist
        self._prefetch_factor = loader.prefetch_factor or 2
        self._timeout = loader.timeout
        self._in_order = loader.in_order
        self._persistent_workers = loader.persistent_workers
        context = loader.multiprocessing_context or multiprocessing.get_context()
        method = context.get_start_method()
        self._result_queue = context.Queue()
        self._done_event = context.Event()
        self._workers: list[Any] = []
        self._index_queues: list[Any] = []
        self._workers_status: list[bool] = []
        dataset = host_view(self._dataset)
        self._shutdown = False
        for worker_id in range(self._num_workers):
            index_queue = context.Queue()
            index_queue.cancel_join_thread()  # never block the main process's exit
            worker = context.Process(
                target=worker_loop, daemon=True,
                args=(self._iterable, dataset, index_queue, self._result_queue,
                      self._done_event, self._auto_collation, self._collate_fn,
                      self._drop_last, self._base_seed, loader.worker_init_fn, worker_id,
                      self._num_workers, method == "fork"))
            try:
                worker.start()
            except (pickle.PicklingError, TypeError, AttributeError) as err:
                self._shutdown_workers()
                raise TypeError(f"DataLoader workers started by {method!r} receive the dataset, "
                                f"collate_fn and worker_init_fn pickled, which failed: {err}. "
                                f"Define them at module level (no lambdas or local functions) "
                                f"and keep anygpu Tensors out of the dataset (TensorDataset's "
                                f"are sent as NumPy arrays)") from err
            self._index_queues.append(index_queue)
            self._workers.append(worker)
            self._workers_status.append(True)
        self._reset(first=True)

    def _reset(self, first: bool) -> None:
        super()._reset(first)
        self._send_idx = 0  # the next task to send
        self._rcvd_idx = 0  # the next task to yield
        self._task_info: dict[int, tuple[Any, ...]] = {}  # (worker,) or (worker, data)
        self._workers_status = [True] * self._num_workers
        self._worker_cycle = itertools.cycle(range(self._num_workers))
        if not first:  # persistent workers: each acknowledges the new epoch
            for index_queue in self._index_queues:
                index_queue.put(ResumeIteration())
            waiting = self._num_workers
            while waiting:
                idx, _ = self._get_data()
                if isinstance(idx, ResumeIteration):
                    waiting -= 1
        for _ in range(self._prefetch_factor * self._num_workers):
            self._try_put_index()

    def _try_put_index(self) -> None:
        try:
            index = next(self._sampler_iter)
        except StopIteration:
            return
        for _ in range(self._num_workers):  # the next worker still running
            worker_id = next(self._worker_cycle)
            if self._workers_status[worker_id]:
                break
        else:
            return
        self._index_queues[worker_id].put((self._send_idx, index))
        self._task_info[self._send_idx] = (worker_id,)
        self._send_idx += 1

    def _try_get_data(self, timeout: float) -> tuple[bool, Any]:
        try:
            payload = self._result_queue.get(timeout=timeout)
        except queue.Empty:
            failed = [w for w, alive in zip(self._workers, self._workers_status)
                      if alive and not w.is_alive()]
            if failed:
                self._shutdown_workers()
                pids = ", ".join(str(w.pid) for w in failed)
                raise RuntimeError(f"DataLoader worker (pid(s) {pids}) exited "
                                   f"unexpectedly") from None
            return False, None
        try:
            return True, pickle.loads(payload)
        except Exception as err:
            raise RuntimeError(f"DataLoader: a batch from a worker could not be unpickled in "
                               f"the main process: {err}") from err

    def _get_data(self) -> Any:
        if self._timeout > 0:
            ok, data = self._try_get_data(self._timeout)
            if ok:
                return data
            raise RuntimeError(f"DataLoader timed out after {self._timeout} seconds")
        while True:
            ok, data = self._try_get_data(_STATUS_CHECK_INTERVAL)
            if ok:
                return data

    def _next_data(self) -> Any:
        while True:
            # skip tasks already yielded (out of order) or of workers that have stopped
            while self._rcvd_idx < self._send_idx:
                info = self._task_info.get(self._rcvd_idx)
                if info is not None and (len(info) == 2 or self._workers_status[info[0]]):
                    break
                self._task_info.pop(self._rcvd_idx, None)
                self._rcvd_idx += 1
            else:
                if not self._persistent_workers:
                    self._shutdown_workers()
                raise StopIteration
            info = self._task_info[self._rcvd_idx]
            if len(info) == 2:
                del self._task_info[self._rcvd_idx]
                self._rcvd_idx += 1
                return self._process(info[1])
            idx, data = self._get_data()
            if isinstance(idx, ResumeIteration):
                continue
            if isinstance(data, IterableDatasetStopIteration):
                self._mark_stopped(data.worker_id)
                self._try_put_index()
                continue
            if idx == self._rcvd_idx:
                del self._task_info[idx]
                self._rcvd_idx += 1
                return self._process(data)
            if not self._in_order:
                del self._task_info[idx]
                return self._process(data)
            self._task_info[idx] += (data,)

    def _process(self, data: Any) -> Any:
        self._try_put_index()
        if isinstance(data, ExceptionWrapper):
            data.reraise()
        return data

    def _mark_stopped(self, worker_id: int) -> None:
        """A worker whose iterable dataset is exhausted gets no more tasks (and, unless
        persistent, is told to exit)."""
        self._workers_status[worker_id] = False
        if not self._persistent_workers:
            self._index_queues[worker_id].put(None)

    def _shutdown_workers(self) -> None:
        if getattr(self, "_shutdown", True):  # done already, or no worker was started
            return
        self._shutdown = True
        try:
            self._done_event.set()
            for index_queue in self._index_queues:
                index_queue.put(None)
            for worker in self._workers:
                worker.join(timeout=_JOIN_TIMEOUT)
            for index_queue in self._index_queues:
                index_queue.cancel_join_thread()
                index_queue.close()
            self._result_queue.cancel_join_thread()
            self._result_queue.close()
        finally:
            for worker in self._workers:
                if worker.is_alive():
                    worker.terminate()
                    worker.join(timeout=_JOIN_TIMEOUT)

    def __del__(self) -> None:
        if not _exiting:  # at exit, multiprocessing terminates the (daemonic) workers itself
            self._shutdown_workers()


_exiting = False


@atexit.register
def _at_exit() -> None:
    global _exiting
    _exiting = True
