"""anygpu.onnx against ONNX Runtime: small models exported from PyTorch (a CNN, an MLP, a
transformer encoder with a dynamic sequence length), the model API (names, positions, Tensors,
``run``, repeated calls replayed by jit, data-dependent models), external data, the
``onnx.backend`` interface, and the errors for bad models and inputs."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import anygpu as ag  # noqa: E402
import anygpu.onnx as agx  # noqa: E402
from anygpu.onnx.errors import InputError, ModelError, UnsupportedOpError  # noqa: E402


def export(module: torch.nn.Module, args: tuple, names: list[str], outputs: list[str],
           dynamic: dict[str, dict[int, str]]) -> bytes:
    """``module`` exported by PyTorch's TorchScript exporter (no onnxscript needed). Gradients
    stay enabled: under no_grad PyTorch's transformer layers take a fused path that exports as
    an ATen operator rather than ONNX."""
    module.eval()
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter's notice
        torch.onnx.export(module, args, buf, input_names=names, output_names=outputs,
                          dynamic_axes=dynamic, opset_version=17, dynamo=False)
    return buf.getvalue()


def reference(model: bytes, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    return session.run(None, feed)


def close(got: list, want: list, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)


# ---- models exported from PyTorch --------------------------------------------------------------
class SmallCNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2), torch.nn.Hardswish(),
            torch.nn.AvgPool2d(2, ceil_mode=True, count_include_pad=False),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
        self.head = torch.nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x)).log_softmax(-1)


def test_cnn_matches_onnxruntime(device: str) -> None:
    """Conv (padding, stride, groups), batch norm, max and average pooling (ceil mode, pads not
    counted), global pooling, Gemm and LogSoftmax, at two batch sizes of a dynamic axis."""
    torch.manual_seed(0)
    net = SmallCNN()
    with torch.no_grad():  # non-trivial running statistics
        net.features[1].running_mean.uniform_(-0.5, 0.5)
        net.features[1].running_var.uniform_(0.5, 2.0)
    model = export(net, (torch.randn(2, 3, 12, 12),), ["image"], ["logp"],
                   {"image": {0: "batch"}, "logp": {0: "batch"}})
    m = agx.load(model, device=device)
    for batch in (2, 3, 3, 3):
        x = np.random.default_rng(batch).standard_normal((batch, 3, 12, 12)).astype(np.float32)
        close(list(m(x)), reference(model, {"image": x}))
    assert not m.dynamic


def test_mlp_matches_onnxruntime(device: str) -> None:
    """MatMul/Gemm, GELU (as Erf), LayerNormalization, Softmax; inputs by name and position;
    ``run`` as ONNX Runtime's; outputs by name."""
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                              torch.nn.Linear(16, 4), torch.nn.Softmax(-1))
    model = export(net, (torch.randn(3, 6),), ["x"], ["probs"],
                   {"x": {0: "n"}, "probs": {0: "n"}})
    x = np.random.default_rng(0).standard_normal((5, 6)).astype(np.float32)
    want = reference(model, {"x": x})
    m = agx.load(model, device=device)
    close(list(m(x)), want)
    close([m(x=x)["probs"]], want)
    close(m.run(None, {"x": x}), want)
    close(m.run(["probs"], {"x": x}), want)
    assert m.input_names == ["x"] and m.output_names == ["probs"]


class Block(torch.nn.Module):
    """A pre-norm transformer encoder block with causal self-attention. (PyTorch's own
    TransformerEncoderLayer traced by the TorchScript exporter keeps the traced sequence length
    in constant Reshape targets; reshaping by -1 keeps the length symbolic.)"""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.d, self.heads = d, heads
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.norm1, self.norm2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.ff = torch.nn.Sequential(torch.nn.Linear(d, 32), torch.nn.GELU(),
                                      torch.nn.Linear(32, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(b, -1, self.heads, self.d // self.heads).transpose(1, 2)

        att = torch.nn.functional.scaled_dot_product_attention(split(q), split(k), split(v),
                                                               is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, -1, self.d))
        return x + self.ff(self.norm2(x))


class Encoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(20, 16)
        self.pos = torch.nn.Parameter(torch.randn(32, 16) * 0.1)
        self.blocks = torch.nn.Sequential(Block(), Block())
        self.out = torch.nn.Linear(16, 20)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.out(self.blocks(x))


def test_transformer_encoder_dynamic_sequence(device: str) -> None:
    """A two-block transformer encoder (embedding, positions sliced to the length, causal
    attention with a Trilu mask, LayerNormalization, Erf GELU) exported with symbolic batch and
    sequence lengths: each new length compiles once; repeating a length replays (jit) and gives
    the same values."""
    torch.manual_seed(2)
    net = Encoder()
    model = export(net, (torch.randint(0, 20, (2, 7)),), ["tokens"], ["logits"],
                   {"tokens": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}})
    m = agx.load(model, device=device)
    rng = np.random.default_rng(3)
    for length in (5, 9, 5, 5):
        tokens = rng.integers(0, 20, (2, length)).astype(np.int64)
        close(list(m(tokens)), reference(model, {"tokens": tokens}), rtol=1e-4, atol=1e-4)
    assert not m.dynamic  # shapes are computed on the host from the input's shape: replayable


# ---- the model API -------------------------------------------------------------------------
def _graph_model(nodes: list, inputs: list, outputs: list, initializers: list | None = None,
                 opset: int = 17) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs, initializers or [])
    # IR version 10: what ONNX Runtime releases from 1.20 on read (newer onnx writes a newer one)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _affine() -> onnx.ModelProto:
    w = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(3, 2), "w")
    b = numpy_helper.from_array(np.array([0.5, -1.0], np.float32), "b")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Add",
                                                                              ["xw", "b"], ["y"])]
    return _graph_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                              ["n", 3])],
                        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 2])], [w, b])


def test_model_local_functions_are_inlined() -> None:
    twice = helper.make_function("my.fn", "Twice", ["a"], ["b"],
                                 [helper.make_node("Add", ["a", "a"], ["b"])],
                                 [helper.make_opsetid("", 17)])
    g = helper.make_graph([helper.make_node("Twice", ["x"], ["y"], domain="my.fn")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                                helper.make_opsetid("my.fn", 1)],
                              functions=[twice], ir_version=10)
    y, = agx.load(model)(np.array([1.5, -2.0], np.float32))
    np.testing.assert_array_equal(y, [3.0, -4.0])


def test_tensor_inputs_give_tensor_outputs(device: str) -> None:
    """anygpu Tensors in, Tensors out (on the model's device); repeated calls replay and each
    result keeps its own values."""
    m = agx.load(_affine(), device=device)
    xs = [np.full((2, 3), k, np.float32) for k in range(4)]
    outs = [m(ag.tensor(x, device=device))[0] for x in xs]
    for x, out in zip(xs, outs):
        assert isinstance(out, ag.Tensor) and out.device == device
        np.testing.assert_allclose(out.numpy(), x @ np.arange(6).reshape(3, 2) + [0.5, -1.0])


def test_data_dependent_model_runs_lazily(device: str) -> None:
    """A Reshape whose target comes from the input data: each call uses its own data (no
    replay of a shape decided for other data)."""
    model = _graph_model(
        [helper.make_node("Reshape", ["x", "shape"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6]),
         helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b"])])
    m = agx.load(model, device=device)
    x = np.arange(6, dtype=np.float32)
    for shape in ([2, 3], [3, 2], [2, 3], [6, 1]):
        y, = m(x, np.array(shape, np.int64))
        np.testing.assert_array_equal(y, x.reshape(shape))
    assert m.dynamic


def test_double_and_int16_use_wider_storage(device: str) -> None:
    """float64 computes in float32 and int16 in int32; outputs come back in their types."""
    model = _graph_model(
        [helper.make_node("Mul", ["a", "a"], ["sq"]), helper.make_node("Add", ["i", "i"], ["s"])],
        [helper.make_tensor_value_info("a", TensorProto.DOUBLE, [3]),
         helper.make_tensor_value_info("i", TensorProto.INT16, [2])],
        [helper.make_tensor_value_info("sq", TensorProto.DOUBLE, [3]),
         helper.make_tensor_value_info("s", TensorProto.INT16, [2])])
    sq, s = agx.load(model, device=device)(np.array([1.5, -2.0, 3.0]),
                                           np.array([20000, -3], np.int16))
    assert sq.dtype == np.float64 and s.dtype == np.int16
    np.testing.assert_allclose(sq, [2.25, 4.0, 9.0])
    np.testing.assert_array_equal(s, np.array([40000, -6]).astype(np.int16))  # wraps


def test_external_data(tmp_path: Path, device: str) -> None:
    """Initializers stored in a file beside the model are read from there; a missing file is
    an error naming it."""
    proto = _affine()
    path = tmp_path / "affine.onnx"
    onnx.save_model(proto, str(path), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="weights.bin", size_threshold=0)
    assert (tmp_path / "weights.bin").exists()
    x = np.ones((1, 3), np.float32)
    want = reference(_affine().SerializeToString(), {"x": x})[0]
    np.testing.assert_allclose(agx.load(path, device=device)(x)[0], want)
    data = path.read_bytes()  # the file's bytes: the data's folder must be named
    np.testing.assert_allclose(agx.load(data, device=device, base_dir=str(tmp_path))(x)[0], want)
    with pytest.raises(ModelError, match="base_dir"):
        agx.load(data, device=device)
    (tmp_path / "weights.bin").unlink()
    with pytest.raises(ModelError, match="weights.bin"):
        agx.load(path, device=device)


def test_backend_interface() -> None:
    """onnx.backend's Backend: devices, prepare, run_model, run_node."""
    assert agx.Backend.supports_device("CPU") and agx.Backend.supports_device("cpu")
    assert not agx.Backend.supports_device("TPU")
    rep = agx.Backend.prepare(_affine(), "CPU")
    (y,) = rep.run([np.zeros((2, 3), np.float32)])
    np.testing.assert_allclose(y, [[0.5, -1.0], [0.5, -1.0]])
    node = helper.make_node("Transpose", ["x"], ["y"], perm=[1, 0])
    (t,) = agx.Backend.run_node(node, [np.arange(6, dtype=np.float32).reshape(2, 3)])
    np.testing.assert_array_equal(t, np.arange(6).reshape(2, 3).T)


# ---- errors --------------------------------------------------------------------------------
def test_bad_files(tmp_path: Path) -> None:
    data = _affine().SerializeToString()
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError, match="not a valid ONNX model"):
        agx.load(truncated)
    text = tmp_path / "notes.onnx"
    text.write_text("this is not a model\n" * 5)
    with pytest.raises(ModelError, match="ONNX model"):
        agx.load(text)
    with pytest.raises(ModelError, match="no ONNX model file"):
        agx.load(tmp_path / "missing.onnx")
    with pytest.raises(ModelError, match="empty"):
        agx.load(b"")


def test_bad_models() -> None:
    """A node reading a value nobody defines fails the checker; a type mismatch fails shape
    inference; both before anything is built."""
    undefined = _graph_model([helper.make_node("Relu", ["nowhere"], ["y"])],
                             [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                             [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    with pytest.raises(ModelError, match="nowhere"):
        agx.load(undefined)
    mismatch = _graph_model([helper.make_node("Add", ["x", "i"], ["y"])],
                            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
                             helper.make_tensor_value_info("i", TensorProto.INT64, [2])],
                            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    with pytest.raises(ModelError, match="shape inference"):
        agx.load(mismatch)


def test_unsupported_is_an_error_at_load() -> None:
    """Unsupported operators, opsets, attribute values and element types are named at load."""
    info = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4]),
            helper.make_tensor_value_info("g", TensorProto.FLOAT, [1, 2, 2, 2]),
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b", "c", "d"])]
    image = _graph_model([helper.make_node("ImageDecoder", ["data"], ["pixels"], name="decode")],
                         [helper.make_tensor_value_info("data", TensorProto.UINT8, [100])],
                         [helper.make_tensor_value_info("pixels", TensorProto.UINT8,
                                                        ["h", "w", 3])], opset=20)
    with pytest.raises(UnsupportedOpError, match=r"'decode' \(ImageDecoder, opset 20\): "
                                                 r"operator ImageDecoder is not supported"):
        agx.load(image)
    old = _graph_model([helper.make_node("Upsample", ["x"], ["y"], name="up", mode="nearest",
                                         height_scale=2.0, width_scale=2.0)], info[:1],
                       info[2:], opset=1)
    with pytest.raises(UnsupportedOpError, match=r"'up' \(Upsample, opset 1\): this opset"):
        agx.load(old)
    pad = _graph_model([helper.make_node("Pad", ["x", "p"], ["y"], name="pad", mode="mirror")],
                       [info[0], helper.make_tensor_value_info("p", TensorProto.INT64, [8])],
                       info[2:])
    with pytest.raises(UnsupportedOpError, match="'pad'.*pad mode 'mirror'"):
        agx.load(pad)
    text = _graph_model([helper.make_node("Cast", ["x"], ["y"], to=TensorProto.STRING)],
                        info[:1], [helper.make_tensor_value_info("y", TensorProto.STRING,
                                                                 [1, 1, 4, 4])])
    with pytest.raises(UnsupportedOpError, match="'y' has element type STRING"):
        agx.load(text)


def test_bad_inputs() -> None:
    m = agx.load(_affine())
    with pytest.raises(InputError, match=r"'x' expects rank 2"):
        m(np.zeros(3, np.float32))
    with pytest.raises(InputError, match=r"'x' expects \[n, 3\], got \(2, 4\)"):
        m(np.zeros((2, 4), np.float32))
    with pytest.raises(InputError, match="expects FLOAT .*float64"):
        m(np.zeros((2, 3)))
    with pytest.raises(InputError, match="missing input: x"):
        m()
    with pytest.raises(InputError, match="no input 'z'"):
        m(z=np.zeros((2, 3), np.float32))
    with pytest.raises(InputError, match="no output 'nope'"):
        m.run(["nope"], {"x": np.zeros((2, 3), np.float32)})
