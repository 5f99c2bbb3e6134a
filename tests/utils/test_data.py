"""anygpu.utils.data against torch.utils.data: batches, collation, samplers, splits and argument
checks where PyTorch is deterministic; seeded shuffles; worker processes giving the batches
of the main process, failing loudly and stopping cleanly; TensorDatasets on every device; a
training loop fed by a DataLoader, step for step beside PyTorch's."""

from __future__ import annotations

import collections
import multiprocessing
import os
import time
from typing import Any

import numpy as np
import pytest

import anygpu as ag
from anygpu import nn
from anygpu.graph.schedule import count_kernels
from anygpu.nn import functional as F
from anygpu.utils import data
from anygpu.utils.data import (BatchSampler, ConcatDataset, DataLoader, Dataset,
                               IterableDataset, RandomSampler, SequentialSampler, Subset,
                               SubsetRandomSampler, TensorDataset, WeightedRandomSampler,
                               default_collate, get_worker_info, random_split)

torch = pytest.importorskip("torch")
tdata = torch.utils.data

FORK = "fork" in multiprocessing.get_all_start_methods()
needs_fork = pytest.mark.skipif(not FORK, reason="the fork start method is not offered here")

Point = collections.namedtuple("Point", ["x", "y"])


def _rows(n: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-2, 2, (n, width)).astype(np.float32)


def same(ours: Any, theirs: Any, where: str = "batch") -> None:
    """``ours`` (anygpu) has the structure, dtypes and values of ``theirs`` (PyTorch); Python
    floats collate to float32 in anygpu where PyTorch makes float64."""
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, ag.Tensor), f"{where}: {type(ours).__name__}, expected a Tensor"
        name = str(theirs.dtype).replace("torch.", "")
        assert ours.dtype.name == {"float64": "float32"}.get(name, name), where
        assert ours.shape == tuple(theirs.shape), where
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy().astype(ours.dtype.np),
                                      err_msg=where)
    elif isinstance(theirs, dict):
        assert type(ours) is type(theirs) and list(ours) == list(theirs), where
        for key in theirs:
            same(ours[key], theirs[key], f"{where}[{key!r}]")
    elif isinstance(theirs, (list, tuple)):
        assert type(ours) is type(theirs), f"{where}: {type(ours)} vs {type(theirs)}"
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            same(a, b, f"{where}[{i}]")
    else:
        assert ours == theirs, where


def same_batches(ours: list[Any], theirs: list[Any]) -> None:
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        same(a, b, f"batch {i}")


def host_batches(loader: Any) -> list[list[np.ndarray]]:
    return [[t.numpy() for t in batch] for batch in loader]


# ---- datasets shared by the tests (module level: workers started by spawn import them) ------
class Records(Dataset):
    """Samples of every kind default_collate handles (values never all zero)."""

    def __init__(self, n: int = 11) -> None:
        self.n = n
        self.x = _rows(n, 3, 1)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return {"x": self.x[i], "label": i % 3 + 1, "weight": 0.5 * i + 0.25, "flag": i % 2 == 0,
                "point": Point(np.float32(i + 0.5), np.int64(-i - 1)),
                "pair": (i + 1, [self.x[i, 0], 2 * i + 1]), "name": f"s{i}"}


class Failing(Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> np.ndarray:
        if i == 7:
            raise ValueError(f"bad sample {i}")
        return np.full(2, i + 1, np.float32)


class Slow(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        time.sleep(0.3)
        return i + 1


class Computes(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        return (ag.tensor(np.full(2, i + 1, np.float32)) * 2).numpy()


class Stream(IterableDataset):
    """1..n, each worker yielding its own interleaved share."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(start + 1, self.n + 1, step))


class TorchStream(tdata.IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        info = tdata.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(start + 1, self.n + 1, step))


class NoLen(Dataset):
    def __getitem__(self, i: int) -> int:
        return i + 1


def _init_fail(worker_id: int) -> None:
    raise KeyError(f"init of worker {worker_id}")


# ---- batches and collation against PyTorch ---------------------------------------------------
@pytest.mark.parametrize("batch_size,drop_last", [(1, False), (4, False), (4, True), (11, True),
                                                  (16, False), (16, True), (None, False)])
def test_batches_like_torch(batch_size: int | None, drop_last: bool) -> None:
    ours = DataLoader(Records(), batch_size=batch_size, drop_last=drop_last)
    theirs = tdata.DataLoader(Records(), batch_size=batch_size, drop_last=drop_last)
    assert len(ours) == len(theirs)
    same_batches(list(ours), list(theirs))


@pytest.mark.parametrize("batch_size,drop_last", [(3, False), (3, True), (7, False)])
def test_tensor_dataset_like_torch(batch_size: int, drop_last: bool) -> None:
    x, y = _rows(10, 4, 2), np.arange(10) * 3 + 1
    ours = DataLoader(TensorDataset(x, y), batch_size=batch_size, drop_last=drop_last)
    theirs = tdata.DataLoader(tdata.TensorDataset(torch.tensor(x), torch.tensor(y)),
                              batch_size=batch_size, drop_last=drop_last)
    assert len(ours) == len(theirs)
    same_batches(list(ours), list(theirs))
    sample = TensorDataset(x, y)[-2]
    np.testing.assert_array_equal(sample[0], x[-2])
    assert sample[1] == y[-2]


def test_collate_like_torch() -> None:
    samples = [Records()[i] for i in range(3)]
    same(default_collate(samples), tdata.default_collate(samples))
    numbers = [np.float64(1.5), np.float64(-2.25)]
    same(default_collate(numbers), tdata.default_collate(numbers))
    same(default_collate([[1, 2.5], [3, 4.5]]), tdata.default_collate([[1, 2.5], [3, 4.5]]))
    tensors = [ag.tensor([1.5, 2.0]), ag.tensor([3.0, -4.0])]
    same(default_collate(tensors), tdata.default_collate([torch.tensor(t.numpy())
                                                          for t in tensors]))
    same(data.default_convert(Records()[4]), tdata.default_convert(Records()[4]))


@pytest.mark.parametrize("batch", [
    [np.ones(2), np.ones(3)],                     # unequal shapes
    [ag.tensor([1.0, 2.0]), ag.tensor([1.0])],
    [(1, 2), (3,)],                               # unequal lengths
    [None, None],                                 # not collatable
    [np.array(["a"]), np.array(["b"])],          # text arrays
], ids=["shapes", "tensor_shapes", "lengths", "none", "text"])
def test_collate_errors_like_torch(batch: list[Any]) -> None:
    theirs = [torch.tensor(b.numpy()) if isinstance(b, ag.Tensor) else b for b in batch]
    with pytest.raises(Exception) as expected:
        tdata.default_collate(theirs)
    with pytest.raises(type(expected.value)):
        default_collate(batch)


# ---- samplers and splits against PyTorch ---------------------------------------------------
def test_samplers_like_torch() -> None:
    items = list(range(1, 11))
    assert list(SequentialSampler(items)) == list(tdata.SequentialSampler(items))
    for size, drop in [(3, False), (3, True), (5, True), (20, False)]:
        ours = BatchSampler(SequentialSampler(items), size, drop)
        theirs = tdata.BatchSampler(tdata.SequentialSampler(items), size, drop)
        assert list(ours) == list(theirs) and len(ours) == len(theirs)
        assert list(BatchSampler(range(10), size, drop)) == list(theirs)  # any iterable
    for kw in [{}, {"num_samples": 25}, {"replacement": True, "num_samples": 7}]:
        ours_r = RandomSampler(items, generator=3, **kw)
        assert len(ours_r) == len(tdata.RandomSampler(items, **kw))
        drawn = list(ours_r)
        assert len(drawn) == len(ours_r) and set(drawn) <= set(range(10))
        if not kw.get("replacement"):
            assert sorted(drawn[:10]) == list(range(10))  # each pass is a permutation
    assert sorted(SubsetRandomSampler([8, 2, 5], generator=1)) == [2, 5, 8]
    weighted = WeightedRandomSampler([0.5, 0.0, 2.0, 1.0], 40, generator=2)
    assert len(weighted) == 40 and set(weighted) == {0, 2, 3}
    unique = list(WeightedRandomSampler([0.5, 0.0, 2.0, 1.0], 3, replacement=False, generator=2))
    assert sorted(unique) == [0, 2, 3]


@pytest.mark.parametrize("make", [
    lambda m: m.BatchSampler(range(4), 0, False),
    lambda m: m.BatchSampler(range(4), 2, 1),
    lambda m: m.RandomSampler(range(4), num_samples=0),
    lambda m: m.RandomSampler([]),
    lambda m: m.WeightedRandomSampler([1.0, 2.0], 0),
    lambda m: m.WeightedRandomSampler([[1.0], [2.0]], 2),
], ids=["batch_size_0", "drop_last_int", "num_samples_0", "empty", "weighted_0", "weighted_2d"])
def test_sampler_errors_like_torch(make: Any) -> None:
    with pytest.raises(ValueError):
        make(tdata)
    with pytest.raises(ValueError):
        make(data)


@pytest.mark.parametrize("n,lengths", [(10, [3, 7]), (11, [0.3, 0.3, 0.4]), (5, [0.5, 0.5]),
                                       (7, [0.1, 0.9]), (3, [1, 1, 1])])
def test_random_split_like_torch(n: int, lengths: list[Any]) -> None:
    ours = random_split(range(n), lengths, generator=4)
    theirs = tdata.random_split(range(n), lengths)
    assert [len(s) for s in ours] == [len(s) for s in theirs]
    assert sorted(i for s in ours for i in s) == list(range(n))
    again = random_split(range(n), lengths, generator=4)
    assert [list(s) for s in again] == [list(s) for s in ours]


@pytest.mark.parametrize("lengths", [[3, 3], [0.5, 0.6], [1.5, -0.5], [0.2, 0.2]])
def test_random_split_errors_like_torch(lengths: list[Any]) -> None:
    with pytest.raises(ValueError):
        tdata.random_split(range(10), lengths)
    with pytest.raises(ValueError):
        random_split(range(10), lengths)


# ---- the loader's arguments --------------------------------------------------------------
@pytest.mark.parametrize("kw", [
    {"shuffle": True, "sampler": [0, 1]},
    {"batch_sampler": [[0, 1]], "batch_size": 2},
    {"batch_sampler": [[0, 1]], "shuffle": True},
    {"batch_sampler": [[0, 1]], "drop_last": True},
    {"batch_size": None, "drop_last": True},
    {"batch_size": 0},
    {"batch_size": -2},
    {"num_workers": -1},
    {"prefetch_factor": 2},
    {"persistent_workers": True},
    {"timeout": -1},
    {"multiprocessing_context": "fork"},
    {"num_workers": 1, "multiprocessing_context": "teleport"},
], ids=lambda kw: "-".join(kw))
def test_argument_errors_like_torch(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        tdata.DataLoader(list(range(4)), **kw)
    with pytest.raises(ValueError):
        DataLoader(list(range(4)), **kw)


@pytest.mark.parametrize("kw", [{"shuffle": True}, {"sampler": [0]}, {"batch_sampler": [[0]]}])
def test_iterable_dataset_refuses_sampling_like_torch(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        tdata.DataLoader(TorchStream(4), **kw)
    with pytest.raises(ValueError):
        DataLoader(Stream(4), **kw)


def test_clear_errors() -> None:
    with pytest.raises(ValueError, match="Size mismatch.*\\[4, 3\\]"):
        TensorDataset(np.ones((4, 2)), ag.tensor([1, 2, 3]))
    with pytest.raises(TypeError, match="anygpu.tensor"):
        TensorDataset([1, 2, 3])
    with pytest.raises(TypeError, match="__len__"):
        DataLoader(NoLen(), shuffle=True)
    with pytest.raises(TypeError, match="__len__"):
        DataLoader(NoLen())
    assert next(iter(DataLoader(NoLen(), sampler=[3, 5], batch_size=2))).tolist() == [4, 6]
    with pytest.raises(TypeError, match="map-style dataset"):
        DataLoader(iter(range(3)))
    with pytest.raises(TypeError, match="generator"):
        DataLoader(list(range(4)), shuffle=True, generator="seed")
    with pytest.raises(TypeError, match="__len__"):
        len(DataLoader(Stream(4)))
    with pytest.raises(IndexError, match="out of range"):
        TensorDataset(np.ones((3, 2))).__getitems__([0, 3])
    with pytest.raises(ValueError, match="non-negative"):  # PyTorch makes odd subsets
        random_split(range(10), [-1, 11])
    loader = DataLoader(list(range(4)))
    with pytest.raises(ValueError, match="should not be set"):
        loader.batch_size = 2


# ---- shuffling -------------------------------------------------------------------------------
def test_shuffle_is_seeded() -> None:
    items = list(range(1, 41))

    def epochs(loader: Any, count: int = 2) -> list[list[int]]:
        return [[i for b in loader for i in b.tolist()] for _ in range(count)]

    first = epochs(DataLoader(items, batch_size=8, shuffle=True, generator=5))
    assert first == epochs(DataLoader(items, batch_size=8, shuffle=True, generator=5))
    assert first != epochs(DataLoader(items, batch_size=8, shuffle=True, generator=6))
    assert first[0] != first[1] and sorted(first[0]) == sorted(first[1]) == items
    numpy_gen = DataLoader(items, batch_size=8, shuffle=True,
                           generator=np.random.default_rng(5))
    assert epochs(numpy_gen) == first
    ag.manual_seed(11)
    global_a = epochs(DataLoader(items, batch_size=8, shuffle=True))
    ag.manual_seed(11)
    global_b = epochs(DataLoader(items, batch_size=8, shuffle=True))
    assert global_a == global_b and global_a[0] != global_a[1]


# ---- TensorDataset on the devices ------------------------------------------------------------
def test_tensor_dataset_on_device(device: str) -> None:
    x, y = _rows(20, 3, 5), np.arange(20) + 1
    ds = TensorDataset(ag.tensor(x, device=device), ag.tensor(y, device=device))
    order = []
    # batches of 8 rows only, here and below: each new shape is a compile on the device
    for xb, yb in DataLoader(ds, batch_size=8, shuffle=True, generator=2, drop_last=True):
        assert xb.device == yb.device == device
        # each column is one gather on the device, never a slice per sample
        assert count_kernels([xb.lazy]) == count_kernels([yb.lazy]) == 1
        rows = yb.numpy() - 1
        np.testing.assert_array_equal(xb.numpy(), x[rows])
        order += rows.tolist()
    assert len(order) == 16 and len(set(order)) == 16
    train, test = random_split(ds, [0.8, 0.2], generator=1)
    batches = list(DataLoader(train, batch_size=8))
    assert [len(b[1]) for b in batches] == [8, 8] and len(test) == 4
    np.testing.assert_array_equal(np.concatenate([b[1].numpy() for b in batches]),
                                  y[train.indices])
    np.testing.assert_array_equal(np.concatenate([b[0].numpy() for b in batches]),
                                  x[train.indices])


def test_rows_of_a_tensor_are_one_gather(device: str) -> None:
    x = ag.tensor(_rows(9, 4, 6), device=device)

    class Rows(Dataset):
        def __len__(self) -> int:
            return 9

        def __getitem__(self, i: int) -> Any:
            return x[i]

    batch = next(iter(DataLoader(Rows(), batch_size=4, sampler=[7, 0, 3, 8])))
    assert batch.device == device and count_kernels([batch.lazy]) == 1
    np.testing.assert_array_equal(batch.numpy(), x.numpy()[[7, 0, 3, 8]])


def test_concat_and_subset_fetch_whole_batches() -> None:
    a = TensorDataset(_rows(5, 2, 7), np.arange(5) + 1)
    b = TensorDataset(_rows(4, 2, 8), np.arange(4) + 101)
    joined = a + b
    assert isinstance(joined, ConcatDataset) and len(joined) == 9
    indices = [8, 0, 5, 2, 6]
    xs, ys = default_collate(joined.__getitems__(indices))
    assert ys.tolist() == [joined[i][1] for i in indices]
    np.testing.assert_array_equal(xs.numpy(), np.stack([joined[i][0] for i in indices]))
    sub = Subset(joined, [3, 7, 1])
    assert [y.tolist() for _, y in DataLoader(sub, batch_size=2)] == [[4, 103], [2]]


# ---- worker processes ------------------------------------------------------------------------
@needs_fork
def test_workers_give_the_batches_of_one_process() -> None:
    x, y = _rows(30, 3, 9), np.arange(30) + 1
    for ds in (TensorDataset(x, y), TensorDataset(ag.tensor(x), ag.tensor(y))):
        one = host_batches(DataLoader(ds, batch_size=4, shuffle=True, generator=3))
        two = host_batches(DataLoader(ds, batch_size=4, shuffle=True, generator=3,
                                      num_workers=2))
        assert len(one) == len(two) == 8
        for a, b in zip(one, two):
            for p, q in zip(a, b):
                np.testing.assert_array_equal(p, q)
    records = list(DataLoader(Records(), batch_size=3, num_workers=2,
                              multiprocessing_context="fork"))
    same_batches(records, list(tdata.DataLoader(Records(), batch_size=3)))
    unordered = DataLoader(Records(), batch_size=3, num_workers=2, in_order=False)
    assert sorted(b["label"].tolist() for b in unordered) == \
        sorted(b["label"].tolist() for b in records)


@needs_fork
def test_iterable_dataset_with_workers_like_torch() -> None:
    def plain(batches: Any) -> list[Any]:
        return [b.tolist() if hasattr(b, "tolist") else b for b in batches]

    for kw in [{"batch_size": 3}, {"batch_size": 3, "drop_last": True}, {"batch_size": None}]:
        ours = plain(DataLoader(Stream(13), num_workers=2, **kw))
        assert ours == plain(tdata.DataLoader(TorchStream(13), num_workers=2, **kw))
        assert plain(DataLoader(Stream(13), **kw)) == \
            plain(tdata.DataLoader(TorchStream(13), **kw))


@needs_fork
def test_worker_info_and_init() -> None:
    class WhoAmI(Dataset):
        def __len__(self) -> int:
            return 6

        def __getitem__(self, i: int) -> Any:
            info = get_worker_info()
            return info.id, info.num_workers, info.seed, os.environ["INIT_BY"]

    def init(worker_id: int) -> None:
        os.environ["INIT_BY"] = f"init {worker_id}"

    batches = list(DataLoader(WhoAmI(), batch_size=2, num_workers=2, worker_init_fn=init,
                              generator=1))
    ids = [b[0].tolist() for b in batches]
    assert ids == [[0, 0], [1, 1], [0, 0]] and batches[1][3] == ["init 1", "init 1"]
    seeds = {b[2][0].item() for b in batches}
    assert len(seeds) == 2 and max(seeds) - min(seeds) == 1
    assert get_worker_info() is None


@needs_fork
def test_worker_exception_reraised_with_its_traceback() -> None:
    loader = DataLoader(Failing(), batch_size=2, num_workers=2)
    with pytest.raises(ValueError) as caught:
        list(loader)
    text = str(caught.value)
    del caught  # its traceback holds the iterator, and so the workers
    assert "in DataLoader worker process 1" in text and "bad sample 7" in text
    assert "__getitem__" in text  # the worker's traceback
    with pytest.raises(KeyError, match="init of worker"):
        list(DataLoader(Failing(), batch_size=2, num_workers=2, worker_init_fn=_init_fail))
    _no_workers_left()


class Exits(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        if i == 5:
            os._exit(3)
        return i + 1


@needs_fork
def test_worker_that_dies_is_reported() -> None:
    with pytest.raises(RuntimeError, match="exited unexpectedly"):
        list(DataLoader(Exits(), batch_size=2, num_workers=2))
    _no_workers_left()


def test_workers_need_picklable_arguments_under_spawn() -> None:
    with pytest.raises(TypeError, match="module level"):
        iter(DataLoader(list(range(4)), num_workers=1, multiprocessing_context="spawn",
                        collate_fn=lambda batch: batch))
    _no_workers_left()


@needs_fork
def test_forked_worker_refuses_to_compute() -> None:
    with pytest.raises(RuntimeError, match="fork"):
        list(DataLoader(Computes(), batch_size=2, num_workers=1))
    _no_workers_left()


@needs_fork
def test_dropped_iterator_stops_its_workers() -> None:
    it = iter(DataLoader(Records(40), batch_size=2, num_workers=2))
    next(it)
    workers = list(it._workers)
    start = time.monotonic()
    del it
    assert time.monotonic() - start < 3
    assert not any(w.is_alive() for w in workers)
    _no_workers_left()


@needs_fork
def test_timeout() -> None:
    with pytest.raises(RuntimeError, match="timed out after 0.1 seconds"):
        list(DataLoader(Slow(), batch_size=2, num_workers=1, timeout=0.1))
    _no_workers_left()


@needs_fork
def test_persistent_workers_keep_their_processes() -> None:
    loader = DataLoader(Records(), batch_size=4, num_workers=2, persistent_workers=True)
    first = [b["label"].tolist() for b in loader]
    workers = list(loader._iterator._workers)
    second = [b["label"].tolist() for b in loader]
    partial = next(iter(loader))["label"].tolist()  # an epoch dropped early, then a whole one
    third = [b["label"].tolist() for b in loader]
    assert first == second == third and partial == first[0]
    assert list(loader._iterator._workers) == workers and all(w.is_alive() for w in workers)
    del loader
    _no_workers_left()


def test_workers_started_by_spawn() -> None:
    """spawn pickles the dataset: a TensorDataset of device tensors travels as NumPy."""
    x, y = _rows(12, 2, 10), np.arange(12) + 1
    ds = TensorDataset(ag.tensor(x), ag.tensor(y))
    loader = DataLoader(ds, batch_size=5, num_workers=2, multiprocessing_context="spawn",
                        shuffle=True, generator=8)
    for a, b in zip(host_batches(loader), host_batches(DataLoader(ds, batch_size=5,
                                                                  shuffle=True, generator=8))):
        for p, q in zip(a, b):
            np.testing.assert_array_equal(p, q)
    _no_workers_left()


def _no_workers_left() -> None:
    deadline = time.monotonic() + 5
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not multiprocessing.active_children()


# ---- training ------------------------------------------------------------------------------
def test_training_loop_like_torch() -> None:
    device = "cpu"  # the loop's compiles would dominate the file's time on slow compilers
    rng = np.random.default_rng(0)
    x = rng.standard_normal((48, 4)).astype(np.float32)
    y = (x @ np.array([[1.5], [-2.0], [0.5], [3.0]], np.float32) + 0.3).astype(np.float32)
    torch.manual_seed(0)
    theirs = torch.nn.Linear(4, 1)
    ours = nn.Linear(4, 1)
    ours.load_state_dict(theirs.state_dict())
    ours = ours.to(device)
    their_opt = torch.optim.SGD(theirs.parameters(), lr=0.2)
    opt = ag.optim.SGD(ours.parameters(), lr=0.2)
    ds = TensorDataset(ag.tensor(x, device=device), ag.tensor(y, device=device),
                       ag.tensor(np.arange(48), device=device))
    loader = DataLoader(ds, batch_size=16, shuffle=True, generator=7)
    losses, their_losses = [], []
    for _ in range(4):
        for xb, yb, ib in loader:
            opt.zero_grad()
            loss = F.mse_loss(ours(xb), yb)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            rows = torch.as_tensor(ib.numpy())  # PyTorch gets the same batches
            their_opt.zero_grad()
            their_loss = torch.nn.functional.mse_loss(theirs(torch.as_tensor(x)[rows]),
                                                      torch.as_tensor(y)[rows])
            their_loss.backward()
            their_opt.step()
            their_losses.append(their_loss.item())
    np.testing.assert_allclose(losses, their_losses, rtol=1e-4, atol=1e-5)
    assert np.mean(losses[-3:]) < 0.05 * np.mean(losses[:3])


def test_anygpu_generator_seeds_the_order() -> None:
    def order(seed: int) -> list[int]:
        return list(RandomSampler(range(20), generator=ag.Generator().manual_seed(seed)))

    assert order(9) == order(9) and sorted(order(9)) == list(range(20))
    assert order(9) != order(10)
    parts = random_split(range(10), [4, 6], generator=ag.Generator().manual_seed(9))
    assert sorted(i for p in parts for i in p) == list(range(10))
