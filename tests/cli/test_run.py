"""``anygpu run``: a small ONNX model run with random and file inputs, saved outputs, and the
comparison with ONNX Runtime."""

from __future__ import annotations

import argparse
import re
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
                          "--save", str(tmp_path / "out.npz")))
    assert code == 0
    saved = np.load(tmp_path / "out.npz")["y"]
    np.testing.assert_allclose(saved, np.maximum(x @ [[1.0, -1.0], [2.0, 0.5]], 0))
    out = capsys.readouterr().out
    assert "output y: float32 (2, 2)" in out and "input x: float32 (2, 2)\n" in out


def test_run_random_inputs_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("onnxruntime")
    _model(tmp_path / "m.onnx")
    assert run.main(_args(str(tmp_path / "m.onnx"), "--dim", "n=5", "--compare", "ort",
                          "--bench", "4")) == 0
    out = capsys.readouterr().out
    assert "output y: float32 (5, 2)" in out and "(random)" in out
    assert "largest |difference| from ONNX Runtime" in out
    # percentiles of both, ordered, and the ratio of the medians
    for label in ("anygpu cpu", "ONNX Runtime CPUExecutionProvider"):
        line = next(x for x in out.splitlines() if x.startswith(label + ": p50"))
        p50, p90, p99 = (float(v) for v in re.findall(r"p\d\d ([0-9.]+) ms", line))
        assert 0 < p50 <= p90 <= p99
    assert re.search(r"anygpu / ONNX Runtime \(p50\): [0-9.]+x", out)


def test_run_bad_arguments(tmp_path: Path) -> None:
    _model(tmp_path / "m.onnx")
    with pytest.raises(SystemExit, match="NAME=VALUE"):
        run.main(_args(str(tmp_path / "m.onnx"), "--dim", "n"))
    with pytest.raises(SystemExit, match="integers"):
        run.main(_args(str(tmp_path / "m.onnx"), "--dim", "n=big"))
    with pytest.raises(SystemExit, match="no input 'z'"):
        np.save(tmp_path / "z.npy", np.ones((1, 2), np.float32))
        run.main(_args(str(tmp_path / "m.onnx"), "--input", f"z={tmp_path / 'z.npy'}"))
