"""``onnx.backend.base.Backend`` over ``anygpu.onnx``: the interface ONNX's backend tests
(``onnx.backend.test``) and other tools drive.

Devices are anygpu's ("cpu", "cuda", "opencl", "webgpu", with an optional ":index") or ONNX's
("CPU", "CUDA").

>>> import numpy as np
>>> from onnx import helper
>>> node = helper.make_node("Mul", ["a", "b"], ["c"])
>>> Backend.run_node(node, [np.float32([2.0]), np.float32([3.0])], device="cpu")[0].tolist()
[6.0]
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import onnx
from onnx import ModelProto, NodeProto, helper, numpy_helper
from onnx.backend.base import Backend as OnnxBackend
from onnx.backend.base import BackendRep as OnnxBackendRep

from anygpu.onnx import dtypes
from anygpu.onnx.model import Model, device_name, load
from anygpu.runtime.registry import BackendUnavailable


class BackendRep(OnnxBackendRep):
    """A prepared model: ``run(inputs)`` with inputs in graph order (a list), by name (a dict)
    or a single array; returns the outputs as a tuple of NumPy arrays."""

    def __init__(self, model: Model):
        self.model = model

    def run(self, inputs: Any, **kwargs: Any) -> tuple[Any, ...]:
        if isinstance(inputs, dict):
            return tuple(self.model.run(None, {k: _array(v) for k, v in inputs.items()}))
        if isinstance(inputs, np.ndarray) or not isinstance(inputs, (list, tuple)):
            inputs = [inputs]
        inputs = [_array(v) for v in inputs]
        feed = dict(zip(self.model.input_names, inputs))
        if len(inputs) > len(self.model.input_names):  # overridable initializers follow
            extra = [i.name for i in self.model.overridable]
            feed.update(zip(extra, inputs[len(self.model.input_names):]))
        return tuple(self.model.run(None, feed))


def _array(value: Any) -> Any:
    """A TensorProto as a NumPy array; anything else as it is."""
    return numpy_helper.to_array(value) if isinstance(value, onnx.TensorProto) else value


class Backend(OnnxBackend):
    """anygpu as an ONNX backend."""

    @classmethod
    def is_compatible(cls, model: ModelProto, device: str = "CPU", **kwargs: Any) -> bool:
        return cls.supports_device(device)

    @classmethod
    def prepare(cls, model: Any, device: str = "CPU", **kwargs: Any) -> BackendRep:
        """Load ``model`` (a ModelProto, a path or bytes) onto ``device``."""
        return BackendRep(load(model, device_name(device), jit=kwargs.get("jit", True)))

    @classmethod
    def run_model(cls, model: Any, inputs: Any, device: str = "CPU",
                  **kwargs: Any) -> tuple[Any, ...]:
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(cls, node: NodeProto, inputs: Any, device: str = "CPU",
                 outputs_info: Sequence[tuple[Any, tuple[int, ...]]] | None = None,
                 **kwargs: Any) -> tuple[Any, ...]:
        """Run one node on ``inputs`` (in the order of ``node.input``)."""
        arrays = [np.asarray(a) for a in (inputs.values() if isinstance(inputs, dict)
                                          else inputs)]
        names = [n for n in node.input if n]
        graph_inputs = [helper.make_tensor_value_info(n, dtypes.elem_type_of(a), a.shape)
                        for n, a in zip(names, arrays)]
        outputs = []
        for k, name in enumerate(o for o in node.output if o):
            if outputs_info is not None and k < len(outputs_info):
                np_type, shape = outputs_info[k]
                elem = int(helper.np_dtype_to_tensor_dtype(np.dtype(np_type)))
                outputs.append(helper.make_tensor_value_info(name, elem, shape))
            else:
                outputs.append(onnx.ValueInfoProto(name=name))
        opset = kwargs.get("opset_version", onnx.defs.onnx_opset_version())
        graph = helper.make_graph([node], "run_node", graph_inputs, outputs)
        domain = node.domain if node.domain not in ("", "ai.onnx") else ""
        imports = [helper.make_opsetid("", opset)]
        if domain:
            imports.append(helper.make_opsetid(domain, 1))
        model = helper.make_model(graph, opset_imports=imports)
        if outputs_info is None:  # the outputs' types from shape inference
            inferred = onnx.shape_inference.infer_shapes(model)
            known = {v.name: v for v in inferred.graph.value_info}
            for out in model.graph.output:
                if out.name in known:
                    out.CopyFrom(known[out.name])
        return cls.prepare(model, device, **kwargs).run(arrays)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        try:
            device_name(device)
        except (BackendUnavailable, ValueError, KeyError):
            return False
        return True


prepare = Backend.prepare
run_model = Backend.run_model
run_node = Backend.run_node
supports_device = Backend.supports_device

__all__ = ["Backend", "BackendRep", "prepare", "run_model", "run_node", "supports_device"]
