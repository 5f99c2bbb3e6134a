"""Loading an ONNX model and running it: ``load`` checks the model (``onnx.checker`` and
shape inference), matches every node to the operator table (an unsupported operator, opset,
attribute or element type is an error here, naming the node), makes the initializers device
tensors once and folds what depends on them alone. ``Model`` runs it.

Each call builds the lazy graph of the model over the inputs and realizes the outputs; kernels
are compiled once per shape and reused. With ``jit=True`` (the default) the launches of one input
signature are captured by ``anygpu.jit`` and replayed on later calls with the same shapes, so a
steady stream of inputs pays no graph work at all; a model that reads computed values on the
host (a reshape target computed from the data, ``NonZero``, a loop's condition) runs lazily
on every call instead, since a replay would repeat decisions made for other data.

>>> import numpy as np
>>> from onnx import helper, TensorProto
>>> g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
...                       [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
...                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])])
>>> model = load(helper.make_model(g), device="cpu")
>>> model(np.array([-1.0, 2.0], np.float32))["y"].tolist()
[0.0, 2.0]
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import ModelProto, TensorProto, ValueInfoProto, numpy_helper
from onnx.external_data_helper import _get_all_tensors, uses_external_data

from anygpu.graph.jit import jit as make_jit
from anygpu.onnx import dtypes
from anygpu.onnx.errors import InputError, ModelError, UnsupportedOpError
from anygpu.onnx.graph import FOLD_LIMIT, Env, Program, RunState, run_step
from anygpu.runtime.registry import BackendUnavailable, get_device
from anygpu.tensor import Tensor, realize

ModelLike = str | os.PathLike | bytes | ModelProto

# ONNX Runtime's and onnx.backend's device names, and anygpu's own
_DEVICE_ALIASES = {"CPU": "cpu", "CUDA": "cuda", "GPU": "cuda"}


def device_name(device: str | None) -> str:
    """anygpu's canonical device for ``device`` ("cpu", "cuda:1", ONNX's "CPU", "CUDA:0")."""
    text = device or "cpu"
    kind, sep, index = text.partition(":")
    kind = _DEVICE_ALIASES.get(kind, kind.lower())
    try:
        return get_device(kind + sep + index).name
    except BackendUnavailable:
        raise
    except (KeyError, ValueError) as err:
        raise InputError(f"unknown device {device!r}: {err}") from err


@dataclass(frozen=True)
class InputInfo:
    """A graph input: its name, element type and shape (ints, symbolic names or None)."""

    name: str
    elem_type: int
    shape: tuple[int | str | None, ...] | None
    optional: bool = False  # an optional tensor: None is a value

    @property
    def dtype(self) -> np.dtype:
        return dtypes.numpy_dtype(self.elem_type)


def _tensor_type(t: onnx.TypeProto) -> tuple[onnx.TypeProto.Tensor | None, bool]:
    """The tensor type of a value (inside an optional), and whether it is optional."""
    kind = t.WhichOneof("value")
    if kind == "tensor_type":
        return t.tensor_type, False
    if kind == "optional_type" and t.optional_type.elem_type.WhichOneof("value") == \
            "tensor_type":
        return t.optional_type.elem_type.tensor_type, True
    return None, False


def _value_shape(v: ValueInfoProto) -> tuple[int | str | None, ...] | None:
    t, _ = _tensor_type(v.type)
    assert t is not None
    if not t.HasField("shape"):
        return None
    return tuple(d.dim_value if d.HasField("dim_value") else
                 (d.dim_param or None) for d in t.shape.dim)


def _info(v: ValueInfoProto, what: str) -> InputInfo:
    t, optional = _tensor_type(v.type)
    if t is None:
        kind = v.type.WhichOneof("value")
        raise UnsupportedOpError(f"{what} {v.name!r} is of type {kind or 'unknown'}; only tensors "
                                 "and optional tensors are supported")
    return InputInfo(v.name, t.elem_type, _value_shape(v), optional)


class Outputs(tuple):
    """A model's outputs in graph order, also readable by name (``out["logits"]``)."""

    names: tuple[str, ...]

    def __new__(cls, values: Sequence[Any], names: Sequence[str]) -> "Outputs":
        out = super().__new__(cls, values)
        out.names = tuple(names)
        return out

    def __getitem__(self, key: Any) -> Any:  # type: ignore[override]
        if isinstance(key, str):
            if key not in self.names:
                raise KeyError(f"no output {key!r}; outputs: {', '.join(self.names)}")
            return tuple.__getitem__(self, self.names.index(key))
        return tuple.__getitem__(self, key)

    def as_dict(self) -> dict[str, Any]:
        return dict(zip(self.names, self))


def _read_model(model: ModelLike, base_dir: str | None
                ) -> tuple[ModelProto, str | None, str | None]:
    """The ModelProto, the directory its external data lives in, and the file's path."""
    path_text = None
    if isinstance(model, ModelProto):
        return model, base_dir, None
    if isinstance(model, (bytes, bytearray, memoryview)):
        data, where = bytes(model), "the given bytes"
    else:
        path = Path(model)
        if not path.is_file():
            raise ModelError(f"no ONNX model file at {str(path)!r}")
        data, where = path.read_bytes(), repr(str(path))
        base_dir = base_dir or str(path.parent)
        path_text = str(path)
    if not data:
        raise ModelError(f"{where} is empty, not an ONNX model")
    proto = ModelProto()
    try:
        proto.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as err:
        raise ModelError(f"{where} is not a valid ONNX model (truncated or another format): "
                         f"{err}") from err
    if proto.ir_version <= 0 or not proto.HasField("graph"):
        raise ModelError(f"{where} is not an ONNX model (no IR version or no graph)")
    return proto, base_dir, path_text


def _load_external(proto: ModelProto, base_dir: str | None) -> None:
    """Read initializers stored in files beside the model into the proto."""
    for t in _get_all_tensors(proto):
        if not uses_external_data(t):
            continue
        info = {e.key: e.value for e in t.external_data}
        location = info.get("location", "")
        if base_dir is None:
            raise ModelError(f"initializer {t.name!r} is stored in the external file "
                             f"{location!r}; load the model from its path or pass base_dir")
        full = Path(base_dir) / location
        if not full.is_file():
            raise ModelError(f"initializer {t.name!r}: external data file {str(full)!r} not "
                             f"found beside the model")
        offset = int(info.get("offset", 0) or 0)
        length = int(info.get("length", 0) or 0)
        with open(full, "rb") as f:
            f.seek(offset)
            raw = f.read(length) if length else f.read()
        if length and len(raw) != length:
            raise ModelError(f"initializer {t.name!r}: external data file {str(full)!r} holds "
                             f"{len(raw)} bytes at offset {offset}, {length} expected")
        t.raw_data = raw
        t.data_location = TensorProto.DEFAULT
        del t.external_data[:]


def _check(proto: ModelProto, path: str | None = None) -> ModelProto:
    """Run the ONNX checker and shape inference; the inferred model carries every value's type.
    A model file is checked by its path, which finds its external data (and any size)."""
    try:
        onnx.checker.check_model(path if path is not None else proto)
    except onnx.checker.ValidationError as err:
        raise ModelError(f"the model fails onnx.checker: {err}") from err
    try:
        return onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True,
                                                 data_prop=True)
    except onnx.shape_inference.InferenceError as err:
        if not _inside_function(str(err), proto):
            raise ModelError(f"shape inference fails on the model: {err}") from err
    # onnx fails on the body of some operators defined as functions (attributes referenced
    # from the body); the lenient pass still types every value the model itself defines
    return onnx.shape_inference.infer_shapes(proto, check_type=True, data_prop=True)


def _inside_function(message: str, proto: ModelProto) -> bool:
    """Whether a shape-inference error arose inside the function body of a standard operator
    (an error of onnx's inference, not of the model)."""
    match = re.search(r"op_type:([A-Za-z0-9_]+)", message)
    if match is None or message.count("Inference error(s)") < 2:
        return False
    opsets = {o.domain: o.version for o in proto.opset_import}
    try:
        schema = onnx.defs.get_schema(match.group(1), opsets.get("", 1))
    except Exception:
        return False
    return bool(getattr(schema, "has_function", False) or
                getattr(schema, "has_context_dependent_function", False))


def _types(proto: ModelProto) -> tuple[dict[str, int], set[str]]:
    """The element type of every tensor value in the model and its subgraphs, and the names of
    the optional ones."""
    types: dict[str, int] = {}
    optional: set[str] = set()

    def visit(g: onnx.GraphProto) -> None:
        for v in list(g.input) + list(g.output) + list(g.value_info):
            t, is_optional = _tensor_type(v.type)
            if t is not None and t.elem_type:
                types[v.name] = t.elem_type
            if is_optional:
                optional.add(v.name)
        for t in g.initializer:
            types[t.name] = t.data_type
        for n in g.node:
            for a in n.attribute:
                if a.HasField("g"):
                    visit(a.g)
                for sub in a.graphs:
                    visit(sub)
    visit(proto.graph)
    return types, optional


def _check_types(types: dict[str, int], device: str) -> None:
    dev = get_device(device)
    for name, elem in types.items():
        if not dtypes.supported(elem):
            raise UnsupportedOpError(f"value {name!r} has element type {dtypes.name(elem)}, "
                                     "which is not supported")
        d = dtypes.storage(elem)
        if not dev.supports(d):
            raise UnsupportedOpError(f"value {name!r} of element type {dtypes.name(elem)} needs "
                                     f"{d.name}, which {device} does not support")


class Model:
    """A loaded ONNX model on one device; call it like a function or like ONNX Runtime's
    ``InferenceSession.run``.

    ``model(x, y)`` or ``model(input_name=x)`` returns ``Outputs`` (a tuple in graph order that
    is also indexable by output name). NumPy inputs give NumPy outputs of the declared types;
    anygpu Tensor inputs (on the model's device, in the dtype anygpu holds the type in) give
    Tensor outputs. ``model.run(output_names, feed)`` returns a list of NumPy arrays.
    """

    def __init__(self, proto: ModelProto, device: str, use_jit: bool = True):
        self.device = device
        # (the proto is not kept: once the initializers are device tensors its data can go)
        self.opsets = {("" if o.domain == "ai.onnx" else o.domain): int(o.version)
                       for o in proto.opset_import}
        graph = proto.graph
        self.types, optional = _types(proto)
        _check_types(self.types, device)
        init_names = {t.name for t in graph.initializer}
        self.inputs = [_info(v, "input") for v in graph.input if v.name not in init_names]
        self.overridable = [_info(v, "input") for v in graph.input if v.name in init_names]
        self.outputs = [_info(v, "output") for v in graph.output]
        self.input_names = [i.name for i in self.inputs]
        self.output_names = [o.name for o in self.outputs]
        self.program = Program(graph, self.opsets, device, self.types, optional)
        self.state = RunState()
        self.static_env = Env(None, self.state, self.types, device)
        self._load_initializers(graph, {i.name for i in self.overridable})
        self.steps = self._fold_static()
        self.use_jit = use_jit
        self.dynamic = False  # set when a run reads computed values on the host
        self._jitted = make_jit(self._compute)

    # ---- load time ------------------------------------------------------------------------------
    def _load_initializers(self, graph: onnx.GraphProto, overridable: set[str]) -> None:
        env = self.static_env
        for t in graph.initializer:
            try:
                arr = numpy_helper.to_array(t)
            except Exception as err:
                raise ModelError(f"initializer {t.name!r} cannot be read: {err}") from err
            if arr.size <= FOLD_LIMIT:
                env.hosts[t.name] = arr
            env.tensors[t.name] = Tensor(dtypes.to_storage(arr, t.data_type), device=self.device,
                                         dtype=dtypes.storage(t.data_type)).realize()
            if t.name not in overridable:
                env.static.add(t.name)

    def _fold_static(self) -> list[Any]:
        """Run the nodes that depend on initializers and constants alone, once; return the
        steps left for each call."""
        env = self.static_env
        left = []
        for step in self.program.steps:
            if step.rule.pure and not step.rule.needs_env and all(
                    not n or n in env.static for n in step.inputs):
                run_step(step, env)
                env.static.update(n for n in step.outputs if n)
            else:
                left.append(step)
        needed = _referenced(left) | set(self.output_names)
        for name in list(env.tensors):
            if name not in needed and name in env.static:
                del env.tensors[name]
        kept = [t for n, t in env.tensors.items() if n in needed]
        if kept:
            realize(*kept)
        for name in list(env.hosts):
            if name not in needed and name in env.static:
                del env.hosts[name]
        self.state.dynamic = False
        return left

    # ---- running --------------------------------------------------------------------------------
    def _compute(self, names: tuple[str, ...], absent: tuple[str, ...],
                 *tensors: Tensor) -> list[Tensor | np.ndarray | None]:
        env = Env(self.static_env, self.state, self.types, self.device)
        for name, t in zip(names, tensors):
            env.tensors[name] = t
        env.absent.update(absent)
        self.program.run(env, self.steps)
        outs = self.program.outputs(env)
        fed = {id(t.lazy) for t in tensors} | {id(t.lazy) for t in
                                                self.static_env.tensors.values()}
        if any(isinstance(o, Tensor) and id(o.lazy) in fed for o in outs):
            self.dynamic = True  # a replay hands back its own buffers, never the inputs'
        return outs

    def _feed(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        if len(args) == 1 and isinstance(args[0], Mapping) and not kwargs:
            kwargs, args = args[0], ()
        if len(args) > len(self.inputs):
            raise InputError(f"the model takes {len(self.inputs)} inputs "
                             f"({', '.join(self.input_names)}), {len(args)} were given")
        feed = dict(zip(self.input_names, args))
        known = {i.name for i in self.inputs + self.overridable}
        for name, value in kwargs.items():
            if name not in known:
                raise InputError(f"the model has no input {name!r}; inputs: "
                                 f"{', '.join(self.input_names)}")
            if name in feed:
                raise InputError(f"input {name!r} is given twice")
            feed[name] = value
        missing = [i.name for i in self.inputs if i.name not in feed and not i.optional]
        if missing:
            raise InputError(f"missing input{'s' if len(missing) > 1 else ''}: "
                             f"{', '.join(missing)}")
        for i in self.inputs:  # an optional input left out has no value
            feed.setdefault(i.name, None)
        return feed

    def _to_tensor(self, info: InputInfo, value: Any, dims: dict[str, int]) -> Tensor:
        want = dtypes.storage(info.elem_type)
        if isinstance(value, Tensor):
            if value.dtype != want:
                raise InputError(f"input {info.name!r} expects {dtypes.name(info.elem_type)} "
                                 f"(anygpu {want.name}), got a tensor of {value.dtype.name}")
            if value.device != self.device:
                raise InputError(f"input {info.name!r} is on {value.device}, the model on "
                                 f"{self.device}; move it with .to()")
            tensor, shape = value, value.shape
        else:
            arr = value if isinstance(value, np.ndarray) else np.asarray(value,
                                                                          dtype=info.dtype)
            if arr.dtype != info.dtype:
                raise InputError(f"input {info.name!r} expects {dtypes.name(info.elem_type)} "
                                 f"({info.dtype}), got an array of {arr.dtype}")
            tensor, shape = None, arr.shape
        if info.shape is not None:
            if len(shape) != len(info.shape):
                raise InputError(f"input {info.name!r} expects rank {len(info.shape)} "
                                 f"{_show(info.shape)}, got shape {tuple(shape)}")
            for k, (want_dim, got) in enumerate(zip(info.shape, shape)):
                if isinstance(want_dim, int) and want_dim != got:
                    raise InputError(f"input {info.name!r} expects {_show(info.shape)}, got "
                                     f"{tuple(shape)} (dimension {k})")
                if isinstance(want_dim, str):
                    if dims.setdefault(want_dim, got) != got:
                        raise InputError(f"input {info.name!r}: dimension {want_dim!r} is "
                                         f"{got} here and {dims[want_dim]} in another input")
        if tensor is None:
            tensor = Tensor(dtypes.to_storage(arr, info.elem_type), device=self.device,
                            dtype=want)
        return tensor

    def _execute(self, feed: dict[str, Any]) -> tuple[list[Tensor | np.ndarray | None], bool]:
        dims: dict[str, int] = {}
        # a fixed order (the graph's), so that one jit signature always means one feed
        order = [i for i in self.inputs + self.overridable if i.name in feed]
        absent = tuple(i.name for i in order if feed[i.name] is None)
        for name in absent:
            if not next(i for i in order if i.name == name).optional:
                raise InputError(f"input {name!r} is not optional; None is no value for it")
        names = tuple(i.name for i in order if feed[i.name] is not None)
        by_name = {i.name: i for i in self.inputs + self.overridable}
        tensors = [self._to_tensor(by_name[n], feed[n], dims) for n in names]
        as_tensors = any(isinstance(v, Tensor) for v in feed.values())
        if self.use_jit and not self.dynamic:
            self.state.dynamic = False
            outs = self._jitted(names, absent, *tensors)
            if self.state.dynamic:
                self.dynamic = True
                self._jitted.reset()
        else:
            outs = self._compute(names, absent, *tensors)
            realize(*[o for o in outs if isinstance(o, Tensor)])
        return list(outs), as_tensors

    def _finish(self, value: Tensor | np.ndarray | None, info: InputInfo,
                as_tensor: bool) -> Any:
        if value is None:  # an optional output without a value
            return None
        if as_tensor:
            if isinstance(value, Tensor):
                return value.contiguous().realize() if self.use_jit else value
            return Tensor(dtypes.to_storage(np.asarray(value), info.elem_type),
                          device=self.device, dtype=dtypes.storage(info.elem_type))
        if isinstance(value, Tensor):
            return dtypes.from_storage(value.numpy(), info.elem_type)
        return np.asarray(value).astype(info.dtype, copy=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Outputs:
        outs, as_tensors = self._execute(self._feed(args, kwargs))
        return Outputs([self._finish(v, info, as_tensors) for v, info in
                        zip(outs, self.outputs)], self.output_names)

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
            run_options: Any = None) -> list[np.ndarray]:
        """ONNX Runtime's ``InferenceSession.run``: the named outputs (all for None) as NumPy
        arrays, from a dict of inputs."""
        names = list(output_names) if output_names else self.output_names
        unknown = [n for n in names if n not in self.output_names]
        if unknown:
            raise InputError(f"the model has no output {unknown[0]!r}; outputs: "
                             f"{', '.join(self.output_names)}")
        outs, _ = self._execute(self._feed((), input_feed))
        by_name = dict(zip(self.output_names, zip(outs, self.outputs)))
        return [self._finish(*by_name[n], False) for n in names]

    def get_inputs(self) -> list[InputInfo]:
        return list(self.inputs)

    def get_outputs(self) -> list[InputInfo]:
        return list(self.outputs)

    def __repr__(self) -> str:
        ins = ", ".join(f"{i.name}: {dtypes.name(i.elem_type)}{_show(i.shape)}"
                        for i in self.inputs)
        return f"onnx.Model({ins}) on {self.device}"


def _referenced(steps: Sequence[Any]) -> set[str]:
    """Every value name the steps read, their subgraphs' reads of outer values included."""
    names: set[str] = set()
    for step in steps:
        names.update(n for n in step.inputs if n)
        for value in step.node.attrs.values():
            for sub in value if isinstance(value, list) else [value]:
                if isinstance(sub, Program):
                    names |= _referenced(sub.steps) | set(sub.output_names)
    return names


def _show(shape: tuple[int | str | None, ...] | None) -> str:
    if shape is None:
        return "[?]"
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def load(model: ModelLike, device: str | None = None, *, base_dir: str | None = None,
         jit: bool = True) -> Model:
    """Load an ONNX model (a path, the file's bytes or a ``ModelProto``) onto ``device``.

    External data files are read from the model file's directory (or ``base_dir``). The model is
    checked and shape-inferred first; every node must match a supported operator.

    >>> import numpy as np
    >>> from onnx import helper, TensorProto
    >>> node = helper.make_node("Add", ["a", "b"], ["c"])
    >>> info = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in "abc"]
    >>> m = load(helper.make_model(helper.make_graph([node], "add", info[:2], info[2:])))
    >>> m.run(None, {"a": np.ones(2, np.float32), "b": np.ones(2, np.float32)})[0].tolist()
    [2.0, 2.0]
    """
    name = device_name(device)
    proto, folder, path = _read_model(model, base_dir)
    if proto.functions:  # model-local functions (exporters emit them): their bodies inlined
        import onnx.inliner

        proto = onnx.inliner.inline_local_functions(proto)
    if path is None:  # bytes or a proto: the checker reads data in memory, so read it first
        if any(uses_external_data(t) for t in _get_all_tensors(proto)):
            copy = ModelProto()
            copy.CopyFrom(proto)  # not into the caller's proto
            proto = copy
        _load_external(proto, folder)
        return Model(_check(proto), name, use_jit=jit)
    # a file: checked by its path and inferred before its external data is read in, so that a
    # model over protobuf's 2 GiB (only that large with its data) loads too
    inferred = _check(proto, path)
    _load_external(inferred, folder)
    return Model(inferred, name, use_jit=jit)


__all__ = ["load", "Model", "Outputs", "InputInfo", "device_name"]
