"""safetensors files: round trips, bfloat16 bits, interop with the safetensors package, errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

import anygpu as ag
from anygpu import nn
from anygpu.nn import state

torch = pytest.importorskip("torch")


def cnn():
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 4 * 4, 2))


def test_module_round_trip(tmp_path, device, close, randn):
    ag.manual_seed(0)
    src = cnn().to(device)
    src(ag.tensor(randn((3, 3, 6, 6), 0), device=device))  # non-default running stats
    path = tmp_path / "model.safetensors"
    state.save(src, path, metadata={"format": "pt"})
    assert state.load_metadata(path) == {"format": "pt"}
    ag.manual_seed(1)
    dst = cnn().to(device)
    assert repr(state.load(dst, path)) == "<All keys matched successfully>"
    for (k, a), (k2, b) in zip(src.state_dict().items(), dst.state_dict().items()):
        assert k == k2 and b.device == device and a.dtype == b.dtype
        close(b, a.numpy(), rtol=0, atol=0)
    x = ag.tensor(randn((1, 3, 6, 6), 1), device=device)
    close(dst.eval()(x), src.eval()(x).numpy(), rtol=0, atol=0)


def test_dtypes_round_trip(tmp_path):
    rng = np.random.default_rng(2)
    values = {
        "f32": ag.tensor(rng.standard_normal((2, 3)).astype(np.float32)),
        "bf16": ag.tensor(rng.standard_normal((4,)).astype(np.float32), dtype=ag.bfloat16),
        "f16": ag.tensor(rng.standard_normal((3,)).astype(np.float16)),
        "i64": ag.tensor(np.array([1, -2, 3 << 40])),
        "i32": ag.tensor(np.array([[5, -6]], np.int32)),
        "u8": ag.tensor(np.array([0, 255], np.uint8)),
        "bool": ag.tensor(np.array([True, False])),
        "scalar": ag.tensor(np.array(7, np.int64)),
    }
    path = tmp_path / "t.safetensors"
    state.save_file(values, path)
    back = state.load_file(path)
    assert list(back) == list(values)
    for k, v in values.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape, k
        np.testing.assert_array_equal(back[k].numpy(), v.numpy())


def test_bfloat16_bits_are_stored_exactly(tmp_path):
    bits = np.array([0x3F80, 0xC049, 0x0001, 0x7F7F, 0xFF80], np.uint16)  # 1, -pi, tiny, max, -inf
    values = (bits.astype(np.uint32) << 16).view(np.float32)
    path = tmp_path / "bf16.safetensors"
    state.save_file({"x": ag.tensor(values, dtype=ag.bfloat16)}, path)
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    assert header["x"] == {"dtype": "BF16", "shape": [5], "data_offsets": [0, 10]}
    assert n % 8 == 0
    np.testing.assert_array_equal(np.frombuffer(raw[8 + n:], "<u2"), bits)
    np.testing.assert_array_equal(state.load_file(path)["x"].numpy(), values)


def test_interop_with_safetensors_torch(tmp_path, device):
    st = pytest.importorskip("safetensors.torch")
    ref = {"w": torch.randn(3, 4, dtype=torch.bfloat16), "b": torch.randn(4),
           "h": torch.randn(2, dtype=torch.float16), "n": torch.tensor(9)}
    ref = {k: v for k, v in ref.items()
           if ag.get_device(device).supports(ag.dtype.to_dtype(v.dtype))}
    path = tmp_path / "torch.safetensors"
    st.save_file(ref, str(path), metadata={"k": "v"})
    ours = state.load_file(path, device=device)
    assert state.load_metadata(path) == {"k": "v"}
    for k, v in ref.items():
        assert ours[k].device == device and ours[k].dtype == ag.dtype.to_dtype(v.dtype)
        np.testing.assert_array_equal(ours[k].numpy(), v.float().numpy() if v.is_floating_point()
                                      else v.numpy())
    path2 = tmp_path / "ours.safetensors"
    state.save_file(ours, path2)
    back = st.load_file(str(path2))
    for k, v in ref.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def test_torch_checkpoint_loads_into_module(tmp_path, close, randn):
    st = pytest.importorskip("safetensors.torch")
    theirs = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4),
                                 torch.nn.ReLU(), torch.nn.Flatten(),
                                 torch.nn.Linear(4 * 4 * 4, 2)).eval()
    path = tmp_path / "ckpt.safetensors"
    st.save_file(theirs.state_dict(), str(path))
    ours = cnn().eval()
    state.load(ours, path)
    x = randn((2, 3, 6, 6), 3)
    close(ours(ag.tensor(x)), theirs(torch.tensor(x)), atol=1e-5)


def test_load_errors(tmp_path):
    path = tmp_path / "m.safetensors"
    state.save(nn.Linear(3, 2), path)
    with pytest.raises(RuntimeError, match="size mismatch for weight"):
        state.load(nn.Linear(4, 2), path)
    with pytest.raises(RuntimeError, match='Missing key\\(s\\) in state_dict: "0.weight"'):
        state.load(nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2)), path)
    res = state.load(nn.Linear(3, 2, bias=False), path, strict=False)
    assert res.unexpected_keys == ["bias"]

    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x04")
    with pytest.raises(ValueError, match="too short"):
        state.load_file(bad)
    bad.write_bytes((100).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="runs past the end"):
        state.load_file(bad)
    header = json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    bad.write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    with pytest.raises(ValueError, match="bad data offsets"):
        state.load_file(bad)
    header = json.dumps({"x": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}).encode()
    bad.write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    with pytest.raises(ValueError, match="unsupported dtype"):
        state.load_file(bad)
    with pytest.raises(TypeError, match="metadata must map str to str"):
        state.save_file({"x": ag.ones(1)}, tmp_path / "x.safetensors", metadata={"a": 1})
