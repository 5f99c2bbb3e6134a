"""anygpu.save / anygpu.load: round trips of every dtype on every device, views, nested
structures, paths and file objects, map_location, weights_only, damaged and foreign files, and
files written by torch.save."""

from __future__ import annotations

import copy
import io
import json
import pickle
import struct
import sys
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import anygpu as ag
from anygpu import dtype as dt
from anygpu import nn, serialization
from anygpu.runtime.registry import BackendUnavailable

from conftest import host


def _round_trip(obj: Any, **load_kwargs: Any) -> Any:
    f = io.BytesIO()
    ag.save(obj, f)
    f.seek(0)
    return ag.load(f, **load_kwargs)


def _same(got: ag.Tensor, want: np.ndarray, dtype: dt.DType, device: str) -> None:
    assert type(got) is ag.Tensor
    assert (got.dtype, got.shape, got.device) == (dtype, want.shape, device)
    np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize("dtype", dt.PUBLIC)
def test_every_dtype_round_trips_exactly(device: str, dtype: dt.DType) -> None:
    seed = dt.PUBLIC.index(dtype)
    full = host((3, 5), dtype, seed, low=-100, high=100)
    scalar = host((), dtype, seed + 10, low=-100, high=100)
    values = {"full": full, "scalar": scalar, "empty": np.zeros((0, 4), dtype=full.dtype)}
    tensors = {k: ag.tensor(v, dtype=dtype, device=device) for k, v in values.items()}
    out = _round_trip(tensors)
    for key, want in values.items():
        _same(out[key], want, dtype, device)
        assert not out[key].requires_grad


def test_bfloat16_bits_and_special_values_are_kept(device: str) -> None:
    bits = np.array([0x7F80, 0xFF80, 0x7FC0, 0x0001, 0x8000, 0x3F81], dtype=np.uint16)
    values = (bits.astype(np.uint32) << 16).view(np.float32)  # inf, -inf, NaN, tiny, -0, 1.0078
    if not ag.get_device(device).supports(ag.bfloat16):
        pytest.skip(f"bfloat16 is not supported on {device}")
    t = ag.tensor(values, dtype=ag.bfloat16, device=device)
    got = _round_trip(t).numpy()
    np.testing.assert_array_equal(got.view(np.uint32) >> 16, bits)


def test_views_and_non_contiguous_tensors(device: str) -> None:
    base = host((4, 6), dt.float32, 1)
    x = ag.tensor(base, device=device)
    views = {"t": (x.t(), base.T), "strided": (x[1:3, ::2], base[1:3, ::2]),
             "flip": (x[::-1], base[::-1]), "row": (x[2], base[2]),
             "expanded": (x[0].expand(3, 6), np.broadcast_to(base[0], (3, 6))),
             "reshaped": (x.reshape(3, 8), base.reshape(3, 8))}
    out = _round_trip({k: v for k, (v, _) in views.items()})
    for key, (_, want) in views.items():
        _same(out[key], np.ascontiguousarray(want), dt.float32, device)


def test_nested_structures_keep_types_and_sharing(device: str) -> None:
    w = ag.tensor(host((2, 3), dt.float32, 2), device=device)
    p = nn.Parameter(ag.tensor(host((3,), dt.float32, 3), device=device))
    ids = ag.tensor(host((4,), dt.int64, 4, low=0, high=50), device=device)
    obj = {"model": OrderedDict([("w", w), ("tied", w)]), "param": p,
           "batches": [ids, (ids, "label", None)], "epoch": 7, "loss": 0.25,
           "metrics": np.array([0.5, 0.75]), "best": np.float32(0.125), "ok": True,
           "names": {"a", "b"}, "dtype": ag.bfloat16, "flags": frozenset({1}),
           "nested": {"deep": {"deeper": [w]}}, "bytes": b"\x00\x01", "complex": 1 + 2j}
    out = _round_trip(obj)
    assert type(out["model"]) is OrderedDict and list(out["model"]) == ["w", "tied"]
    assert out["model"]["w"] is out["model"]["tied"] is out["nested"]["deep"]["deeper"][0]
    np.testing.assert_array_equal(out["model"]["w"].numpy(), w.numpy())
    assert type(out["param"]) is nn.Parameter and out["param"].requires_grad
    assert out["param"].device == device
    np.testing.assert_array_equal(out["param"].numpy(), p.numpy())
    assert out["batches"][0] is out["batches"][1][0] and out["batches"][1][1:] == ("label", None)
    assert out["dtype"] is ag.bfloat16
    for key in ("epoch", "loss", "ok", "names", "flags", "bytes", "complex", "best"):
        assert out[key] == obj[key] and type(out[key]) is type(obj[key])
    np.testing.assert_array_equal(out["metrics"], obj["metrics"])


def test_paths_and_file_objects(tmp_path: Path) -> None:
    x = ag.tensor(host((3, 2), dt.float32, 5))
    ag.save({"x": x}, str(tmp_path / "a.pt"))
    ag.save([x, 1], tmp_path / "b.pt")
    np.testing.assert_array_equal(ag.load(str(tmp_path / "a.pt"))["x"].numpy(), x.numpy())
    assert ag.load(tmp_path / "b.pt")[1] == 1
    with open(tmp_path / "c.pt", "wb") as f:  # two checkpoints one after the other
        ag.save(x, f)
        ag.save({"step": 2}, f)
    with open(tmp_path / "c.pt", "rb") as f:
        np.testing.assert_array_equal(ag.load(f).numpy(), x.numpy())
        assert ag.load(f) == {"step": 2}

    class Stream:  # a pipe: read() only, no seek
        def __init__(self, data: bytes):
            self.data = io.BytesIO(data)

        def read(self, n: int = -1) -> bytes:
            return self.data.read(min(n, 7) if n > 0 else n)  # short reads too

    np.testing.assert_array_equal(ag.load(Stream((tmp_path / "a.pt").read_bytes()))["x"].numpy(),
                                  x.numpy())
    with pytest.raises(TypeError, match="path or a binary file"):
        ag.save(x, 42)  # type: ignore[arg-type]


def test_pickle_copy_and_deepcopy(device: str) -> None:
    x = ag.tensor(host((2, 3), dt.float32, 6), device=device, requires_grad=True)
    for protocol in (2, 4, 5):
        y = pickle.loads(pickle.dumps(x, protocol=protocol))
        assert (y.device, y.dtype, y.requires_grad) == (device, ag.float32, True)
        np.testing.assert_array_equal(y.numpy(), x.numpy())
    deep = copy.deepcopy(nn.Parameter(x.detach()))
    assert type(deep) is nn.Parameter and deep.device == device
    history = _round_trip(x * 2)  # saved values only: a leaf that requires gradients
    assert history.requires_grad and history._ctx is None
    np.testing.assert_array_equal(history.numpy(), x.numpy() * 2)


def _model(device: str) -> nn.Module:
    """The model of the module tests, torch's file included (shared kernels compile once)."""
    return nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.ReLU(),
                         nn.Linear(5, 2)).to(device).eval()


def test_module_state_dict_and_whole_module(device: str) -> None:
    ag.manual_seed(3)
    model = _model(device)
    model[1].running_mean.copy_(ag.tensor(host((5,), dt.float32, 12), device=device))
    x = ag.tensor(host((4, 6), dt.float32, 7), device=device)
    twin = _model(device)
    twin.load_state_dict(_round_trip(model.state_dict()))
    np.testing.assert_array_equal(twin(x).numpy(), model(x).numpy())
    with pytest.raises(pickle.UnpicklingError, match="Sequential"):
        _round_trip(model)
    whole = _round_trip(model, weights_only=False)
    np.testing.assert_array_equal(whole(x).numpy(), model(x).numpy())


def test_map_location_forms(devices: list[str]) -> None:
    if not devices:
        pytest.skip("none of the selected devices is available")
    values = host((2, 4), dt.float32, 8)
    for src in devices:
        f = io.BytesIO()
        ag.save({"w": ag.tensor(values, device=src)}, f)
        data = f.getvalue()
        for dst in devices:
            forms = [dst, ag.get_device(dst), {src: dst}, {src.partition(":")[0]: dst},
                     lambda t, loc, dst=dst: t.to(dst), lambda t, loc, dst=dst: dst]
            for form in forms:
                w = ag.load(io.BytesIO(data), map_location=form)["w"]
                _same(w, values, dt.float32, dst)
        assert ag.load(io.BytesIO(data), map_location={"other:0": "cpu"})["w"].device == src
        assert ag.load(io.BytesIO(data), map_location=lambda t, loc: None)["w"].device == src
        assert ag.load(io.BytesIO(data), map_location=lambda t, loc: t)["w"].device == "cpu:0"
    with pytest.raises(TypeError, match="map_location"):
        ag.load(io.BytesIO(data), map_location=3)  # type: ignore[arg-type]


def test_unavailable_device_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    real = serialization.reduce_tensor

    def on_missing_gpu(t: ag.Tensor, protocol: int) -> tuple:
        rebuild, (cls, state) = real(t, protocol)
        return rebuild, (cls, {**state, "device": "cuda:99"})

    values = host((3,), dt.float32, 9)
    with monkeypatch.context() as m:
        m.setattr(serialization, "reduce_tensor", on_missing_gpu)
        f = io.BytesIO()
        ag.save({"w": ag.tensor(values)}, f)
    data = f.getvalue()
    with pytest.raises(BackendUnavailable, match=r"cuda:99.*map_location"):
        ag.load(io.BytesIO(data))
    with pytest.raises(BackendUnavailable, match="sends tensors saved on cuda:99 to hip:99"):
        ag.load(io.BytesIO(data), map_location="hip:99")
    for form in ("cpu", {"cuda:99": "cpu"}):
        _same(ag.load(io.BytesIO(data), map_location=form)["w"], values, dt.float32, "cpu:0")


_calls: list[str] = []


def _record(what: str) -> str:
    _calls.append(what)
    return what


class Payload:
    """Runs code when unpickled, as a malicious checkpoint would."""

    def __reduce__(self) -> tuple:
        return _record, ("ran",)


class Config:
    def __init__(self, depth: int):
        self.depth = depth


def test_weights_only_refuses_code_and_foreign_classes() -> None:
    f = io.BytesIO()
    ag.save({"w": ag.ones(2), "payload": Payload()}, f)
    _calls.clear()
    with pytest.raises(pickle.UnpicklingError, match=r"refused the global .*_record"):
        ag.load(io.BytesIO(f.getvalue()))
    assert _calls == []
    assert ag.load(io.BytesIO(f.getvalue()), weights_only=False)["payload"] == "ran"
    assert _calls == ["ran"]

    g = io.BytesIO()
    ag.save({"config": Config(3)}, g)
    with pytest.raises(pickle.UnpicklingError, match="Config"):
        ag.load(io.BytesIO(g.getvalue()))
    with serialization.safe_globals([Config]):
        assert ag.load(io.BytesIO(g.getvalue()))["config"].depth == 3
    with pytest.raises(pickle.UnpicklingError, match="Config"):
        ag.load(io.BytesIO(g.getvalue()))


def test_truncated_and_damaged_files(tmp_path: Path) -> None:
    f = io.BytesIO()
    ag.save({"w": ag.tensor(host((16,), dt.float32, 10)), "epoch": 1}, f)
    data = f.getvalue()
    for cut in (3, 8, 20, 40, len(data) // 2, len(data) - 1):
        (tmp_path / "cut.pt").write_bytes(data[:cut])
        with pytest.raises(serialization.CheckpointError, match="truncated"):
            ag.load(tmp_path / "cut.pt")
        with pytest.raises(serialization.CheckpointError, match="truncated"):
            ag.load(io.BytesIO(data[:cut]))
    damaged = bytearray(data)
    damaged[-20] ^= 0x40  # a bit of the tensor's data
    with pytest.raises(serialization.CheckpointError, match="damaged"):
        ag.load(io.BytesIO(bytes(damaged)))
    huge = data[:20] + struct.pack("<Q", 1 << 60) + data[28:]  # a damaged buffer count
    with pytest.raises(serialization.CheckpointError, match="truncated"):
        ag.load(io.BytesIO(huge))


def test_files_that_are_not_checkpoints(tmp_path: Path) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    npy = io.BytesIO()
    np.save(npy, np.arange(3))
    cases = {"empty": (b"", "empty"), "text": (b"epoch,loss\n1,0.5\n", "not an anygpu"),
             "pickle": (pickle.dumps({"w": [1.0]}), "plain pickle"),
             "npy": (npy.getvalue(), "numpy.load"),
             "safetensors": (struct.pack("<Q", len(header)) + header + b"\0" * 4,
                             "safetensors")}
    for name, (content, message) in cases.items():
        path = tmp_path / f"{name}.pt"
        path.write_bytes(content)
        with pytest.raises(serialization.CheckpointError, match=message):
            ag.load(path)
    with pytest.raises(FileNotFoundError):
        ag.load(tmp_path / "missing.pt")


def test_torch_file_without_torch_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "model.pt"
    with zipfile.ZipFile(path, "w") as z:  # torch.save's layout; its content is never read here
        z.writestr("model/data.pkl", pickle.dumps({}))
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    with pytest.raises(ImportError, match=r"torch\.save.*pip install torch"):
        ag.load(path)


# ---- files written by torch.save ---------------------------------------------------------------
def test_torch_state_dict_gives_the_same_model(device: str, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    theirs = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5),
                                 torch.nn.ReLU(), torch.nn.Linear(5, 2))
    with torch.no_grad():  # statistics of their own, not the defaults
        theirs[1].running_mean.uniform_(-1, 1)
        theirs[1].running_var.uniform_(0.5, 2)
        theirs[1].num_batches_tracked.fill_(7)
    theirs.eval()
    torch.save(theirs.state_dict(), tmp_path / "model.pt")
    ours = _model(device)
    sd = ag.load(tmp_path / "model.pt", map_location=device)
    assert list(sd) == list(theirs.state_dict())
    assert sd["1.num_batches_tracked"].dtype == ag.int64
    assert all(v.device == device for v in sd.values())
    assert repr(ours.load_state_dict(sd)) == "<All keys matched successfully>"
    assert ours[1].num_batches_tracked.item() == 7
    x = host((4, 6), dt.float32, 11)
    np.testing.assert_allclose(ours(ag.tensor(x, device=device)).numpy(),
                               theirs(torch.tensor(x)).detach().numpy(), rtol=1e-5, atol=1e-5)


def test_torch_dtypes_and_formats(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(12)
    floats = rng.standard_normal((3, 4)).astype(np.float32)
    ints = rng.integers(-1000, 1000, (5,))
    bf16 = torch.tensor(floats).bfloat16()
    saved = {
        "float32": torch.tensor(floats), "float16": torch.tensor(floats).half(), "bf16": bf16,
        "int8": torch.tensor(ints % 100, dtype=torch.int8),
        "uint8": torch.tensor(ints % 200, dtype=torch.uint8),
        "int32": torch.tensor(ints, dtype=torch.int32), "int64": torch.tensor(ints),
        "bool": torch.tensor(ints > 0),
        "float64": torch.tensor(floats, dtype=torch.float64),
        "int16": torch.tensor(ints, dtype=torch.int16),
        "uint16": torch.tensor(ints + 1000, dtype=torch.int32).to(torch.uint16),
        "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3),
        "view": torch.tensor(floats).t()[1:], "param": torch.nn.Parameter(torch.tensor(floats)),
        "meta": {"epoch": 4, "names": ["a", "b"]},
    }
    want = {
        "float32": (floats, ag.float32), "float16": (floats.astype(np.float16), ag.float16),
        "bf16": (bf16.float().numpy(), ag.bfloat16), "int8": (ints % 100, ag.int8),
        "uint8": (ints % 200, ag.uint8), "int32": (ints, ag.int32), "int64": (ints, ag.int64),
        "bool": (ints > 0, ag.bool_), "float64": (floats, ag.float32),
        "int16": (ints, ag.int32), "uint16": (ints + 1000, ag.int32),
        "scalar": (np.float32(2.5), ag.float32), "empty": (np.zeros((0, 3)), ag.float32),
        "view": (floats.T[1:], ag.float32), "param": (floats, ag.float32),
    }
    for legacy in (False, True):
        path = tmp_path / f"legacy{legacy}.bin"  # the name says nothing: the content does
        # torch's legacy format cannot read back its own uint16 tensors
        keys = [k for k in want if not (legacy and k == "uint16")]
        torch.save({k: saved[k] for k in [*keys, "meta"]}, path,
                   _use_new_zipfile_serialization=not legacy)
        out = ag.load(path)
        for key in keys:
            values, dtype = want[key]
            assert out[key].dtype == dtype, key
            assert out[key].device == "cpu:0"
            np.testing.assert_array_equal(out[key].numpy(), np.asarray(values).astype(dtype.np)
                                          if dtype != ag.bfloat16 else values, err_msg=key)
        assert type(out["param"]) is nn.Parameter and out["param"].requires_grad
        assert out["meta"] == {"epoch": 4, "names": ["a", "b"]}
    with open(tmp_path / "legacyFalse.bin", "rb") as f:  # a file object, map_location too
        assert ag.load(f, map_location="cpu")["int64"].dtype == ag.int64


def test_torch_weights_only_and_tied_tensors(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import argparse

    w = torch.randn(3, 2)
    torch.save({"a": w, "b": w, "args": argparse.Namespace(lr=0.1)}, tmp_path / "t.pt")
    with pytest.raises(pickle.UnpicklingError):
        ag.load(tmp_path / "t.pt")
    out = ag.load(tmp_path / "t.pt", weights_only=False)
    assert out["a"] is out["b"] and out["args"].lr == 0.1
    np.testing.assert_array_equal(out["a"].numpy(), w.numpy())


def test_public_names() -> None:
    assert ag.save is serialization.save and ag.load is serialization.load
    assert {"save", "load"} <= set(ag.__all__)
