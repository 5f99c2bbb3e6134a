"""anygpu.device objects and the per-backend namespaces (anygpu.cuda.is_available(), ...)."""

from __future__ import annotations

import pickle

import pytest

import anygpu as ag
from anygpu import nn


def test_device_object() -> None:
    d = ag.device("cuda:1")
    assert (d.type, d.index, str(d)) == ("cuda", 1, "cuda:1")
    assert repr(d) == "device(type='cuda', index=1)"
    assert d == "cuda:1" and d == ag.device("cuda", 1) and hash(d) == hash("cuda:1")
    plain = ag.device("OpenCL")
    assert (plain.type, plain.index, str(plain)) == ("opencl", None, "opencl")
    assert ag.device(plain) == plain and ag.device(ag.device("hip:2")).index == 2
    assert pickle.loads(pickle.dumps(d)) == d and pickle.loads(pickle.dumps(d)).index == 1
    with pytest.raises(ValueError, match="unknown device"):
        ag.device("tpu")
    with pytest.raises(ValueError, match="bad device index"):
        ag.device("cuda:x")
    with pytest.raises(RuntimeError, match="index"):
        ag.device("cuda:0", 1)


def test_device_object_where_strings_go(device: str) -> None:
    d = ag.device(device)
    assert ag.tensor([1.0, 2.0], device=d).device == device
    assert ag.zeros(2).to(d).device == device
    assert ag.zeros(2).to(d, ag.float16, non_blocking=True).dtype == ag.float16
    assert ag.zeros(2).to(device=ag.device(d.type)).device == device
    assert ag.rand(3, device=d).device == device
    model = nn.Linear(2, 2).to(d)
    assert model.weight.device == device
    back = ag.ones(3, device=d).to(ag.device("cpu"), non_blocking=True)
    assert back.device == "cpu:0" and back.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("name", ["cpu", "opencl", "cuda", "webgpu", "hip"])
def test_backend_namespaces(name: str) -> None:
    backend = getattr(ag, name)
    count = backend.device_count()
    assert isinstance(count, int) and count >= 0
    assert backend.is_available() == (count > 0)
    if count:
        assert ag.zeros(1, device=ag.device(name, count - 1)).device == f"{name}:{count - 1}"
    assert ag.cpu.is_available()
