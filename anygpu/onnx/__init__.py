"""ONNX models on anygpu: ``load`` a model onto any device and run it, or drive it through the
standard ``onnx.backend`` interface (``Backend``).

Every ONNX operator is a composite of anygpu Tensor ops (``anygpu/onnx/ops``: one table keyed
by op type and opset), so a model fuses and compiles like any anygpu program, on every backend.
Needs the ``onnx`` package.

>>> import numpy as np
>>> import anygpu.onnx
>>> from onnx import helper, TensorProto
>>> node = helper.make_node("Softmax", ["x"], ["y"], axis=-1)
>>> g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
...                       ["batch", 3])], [helper.make_tensor_value_info("y", TensorProto.FLOAT,
...                       ["batch", 3])])
>>> model = anygpu.onnx.load(helper.make_model(g), device="cpu")
>>> y, = model(np.zeros((2, 3), np.float32))
>>> print(y.round(4))
[[0.3333 0.3333 0.3333]
 [0.3333 0.3333 0.3333]]
"""

from anygpu.onnx.errors import (InputError, ModelError, NodeError, OnnxError,
                                UnsupportedOpError)
from anygpu.onnx.model import InputInfo, Model, Outputs, load
from anygpu.onnx.backend import Backend, BackendRep
from anygpu.onnx.ops import supported_ops

__all__ = ["load", "Model", "Outputs", "InputInfo", "Backend", "BackendRep", "supported_ops",
           "OnnxError", "ModelError", "InputError", "NodeError", "UnsupportedOpError"]
