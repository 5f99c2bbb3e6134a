"""Lowered kernels kept on disk: a process whose memory caches are empty reads the kernels an
earlier one lowered (no lowering at all) and computes the same numbers; entries of other code,
other keys, half-written files and a cache turned off are never read."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from test_plans import _train

from anygpu import config
from anygpu.codegen import ir, lower
from anygpu.graph import disk, plans
from anygpu.graph import schedule as sched


@pytest.fixture
def cache(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """A cache directory of the test's own, the disk cache on, the memory caches empty."""
    monkeypatch.setenv("ANYGPU_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("ANYGPU_DISK_CACHE", "1")
    config.reload()
    _forget(monkeypatch)
    monkeypatch.setattr(disk, "_made", set())
    yield tmp_path
    monkeypatch.undo()
    config.reload()


def _forget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Empty what a new process would not have in memory."""
    for name in ("_ast_cache", "_compiled", "_rendered"):
        monkeypatch.setattr(sched, name, {})
    monkeypatch.setattr(plans, "_plans", {})


def _entries(root, kind: str) -> list:
    return list(root.glob(f"lowered/*/{kind}/*"))


def test_a_new_process_reads_the_kernels_lowered_before(
        device: str, cache, monkeypatch: pytest.MonkeyPatch) -> None:
    losses, params = _train(device, 3)
    assert np.isfinite(losses).all() and losses[-1] != losses[0]
    asts, kernels = _entries(cache, "ast"), _entries(cache, "kernel")
    assert len(asts) > 10 and len(kernels) > 10
    for path in kernels:  # what a launch needs: statements only where the tuner may read them
        _, (kernel, source) = pickle.loads(path.read_bytes())
        assert kernel.name in source and kernel.groups >= 1 and kernel.local >= 1
        assert bool(kernel.body) == ("options" in kernel.meta)

    _forget(monkeypatch)

    def no_lowering(*args, **kwargs):
        raise AssertionError("lowered again although the disk cache holds the kernel")

    monkeypatch.setattr(lower, "build_kernel", no_lowering)
    monkeypatch.setattr(lower, "to_ir", no_lowering)
    again, params_again = _train(device, 3)
    np.testing.assert_array_equal(again, losses)
    for a, b in zip(params_again, params):
        np.testing.assert_array_equal(a, b)
    assert len(_entries(cache, "ast")) == len(asts)  # nothing new written


def test_entries_of_other_code_are_not_read_and_are_removed(
        cache, monkeypatch: pytest.MonkeyPatch) -> None:
    key = ("sum", (4, 5), "float32")
    disk.save("ast", key, [1, 2, 3])
    assert disk.load("ast", key) == [1, 2, 3]
    monkeypatch.setattr(disk, "_code", "another-code")
    assert disk.load("ast", key) is None
    disk.save("ast", key, [4])
    assert disk.load("ast", key) == [4]
    assert [p.name for p in (cache / "lowered").iterdir()] == ["another-code"]


def test_only_the_key_written_is_read(cache, monkeypatch: pytest.MonkeyPatch) -> None:
    key, other = ("a", 1), ("a", 2)
    disk.save("kernel", key, "value of a 1")
    path = disk._path("kernel", key)
    monkeypatch.setattr(disk, "_path", lambda kind, k: path)  # two keys, one file
    assert disk.load("kernel", key) == "value of a 1"
    assert disk.load("kernel", other) is None


def test_half_written_entries_and_a_cache_turned_off(cache, monkeypatch) -> None:
    key = ("half", 3)
    disk.save("ast", key, list(range(1000)))
    path = disk._path("ast", key)
    path.write_bytes(path.read_bytes()[:100])
    assert disk.load("ast", key) is None
    monkeypatch.setenv("ANYGPU_DISK_CACHE", "0")
    config.reload()
    disk.save("ast", ("off", 1), 5)
    assert disk.load("ast", ("off", 1)) is None
    assert not disk._path("ast", ("off", 1)).exists()


def test_values_that_cannot_be_pickled_are_not_kept(cache) -> None:
    disk.save("ast", ("lambda",), lambda: 1)
    assert disk.load("ast", ("lambda",)) is None
    assert list(disk._path("ast", ("lambda",)).parent.iterdir()) == []  # no temporary left


def test_expressions_unpickle_to_the_shared_instances() -> None:
    i = ir.var("i")
    e = ir.alu("add", ir.alu("mul", i, 4), 3)
    copy = pickle.loads(pickle.dumps(e))
    assert copy is e and copy.srcs[0] is e.srcs[0]
