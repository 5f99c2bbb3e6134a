"""``anygpu run``: a small ONNX model run with random and file inputs, saved outputs, and the
comparison with ONNX Runtime."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from anygpu.cli import run  # noqa: E402


def _model(path: Path) -> None:
    w = numpy_helper.from_array(np.array([[1.0, -1.0], [2.0, 0.5]], np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["h"]),
                           helper.make_node("Relu", ["h"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 2])], [w])
    onnx.save_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)],
                                      ir_version=10), str(path))


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    run.add_parser(parser.add_subparsers())
    return parser.parse_args(["run", *argv])


def test_run_with_inputs_and_save(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _model(tmp_path / "m.onnx")
    x = np.array([[1.0, 2.0], [-1.0, 0.0]], np.float32)
    np.save(tmp_path / "x.npy", x)
    code = run.main(_args(str(tmp_path / "m.onnx"), "--input", f"x={tmp_path / 'x.npy'}",
                          "--save", str(tmp_path / "out.npz"), "--repeat", "3"))
    assert code == 0
    saved = np.load(tmp_path / "out.npz")["y"]
    np.testing.assert_allclose(saved, np.maximum(x @ [[1.0, -1.0], [2.0, 0.5]], 0))
    assert "y: float32 (2, 2)" in capsys.readouterr().out


def test_run_random_inputs_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("onnxruntime")
    _model(tmp_path / "m.onnx")
    assert run.main(_args(str(tmp_path / "m.onnx"), "--dim", "n=5", "--check")) == 0
    out = capsys.readouterr().out
    assert "y: float32 (5, 2)" in out and "from ONNX Runtime" in out
