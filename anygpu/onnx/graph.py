"""An ONNX graph ready to run: its nodes matched to the operator table, checked at load, and
run over an environment of values.

A value lives on the device (a Tensor), on the host (a NumPy array: initializers, constants,
``Shape``'s output and the small arithmetic on them), or both; each form is made from the
other when an operator asks for it. A value of the device read on the host (a ``Reshape``
whose target shape is computed from the data) marks the run as data-dependent, which keeps the
model from replaying recorded launches (``anygpu.jit``) whose host decisions would be stale.

>>> import numpy as np
>>> from onnx import helper, TensorProto
>>> g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
...                       [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
...                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
>>> program = Program(g, {"": 17}, "cpu:0", {"x": 1, "y": 1})
>>> env = Env(None, RunState(), program.types, "cpu:0")
>>> env.set("x", np.array([-1.0, 2.0], np.float32))
>>> program.run(env)
>>> env.host("y").tolist()
[0.0, 2.0]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from onnx import AttributeProto, GraphProto, NodeProto, numpy_helper

from anygpu.onnx import dtypes
from anygpu.onnx.errors import ModelError, NodeError, OnnxError, UnsupportedOpError
from anygpu.onnx.ops import lookup, versions
from anygpu.onnx.ops.table import Node, OpRule
from anygpu.tensor import Tensor

FOLD_LIMIT = 4096  # elements: values up to this size known on the host are folded there


class RunState:
    """What one run (or the load-time folding) learned: whether a value computed on the device
    was read on the host."""

    def __init__(self) -> None:
        self.dynamic = False
        self.reads: list[str] = []


class Env:
    """The values of one run of a graph: name -> Tensor and/or host array, falling back to the
    enclosing graph's environment (a subgraph sees its parent's values)."""

    def __init__(self, parent: Env | None, state: RunState, types: dict[str, int], device: str,
                 static: set[str] | None = None):
        self.parent = parent
        self.state = state
        self.types = types
        self.device = device
        self.tensors: dict[str, Tensor] = {}
        self.hosts: dict[str, np.ndarray] = {}
        self.absent: set[str] = set()  # optional values given as "no value"
        self.static = static if static is not None else set()  # values that never change

    def _owner(self, name: str) -> Env:
        env: Env | None = self
        while env is not None:
            if name in env.tensors or name in env.hosts:
                return env
            env = env.parent
        raise ModelError(f"value {name!r} is used before it is computed (or was never given)")

    def is_absent(self, name: str) -> bool:
        """Whether ``name`` is an optional value without a value."""
        env: Env | None = self
        while env is not None:
            if name in env.tensors or name in env.hosts:
                return False
            if name in env.absent:
                return True
            env = env.parent
        return False

    def has(self, name: str) -> bool:
        try:
            self._owner(name)
        except ModelError:
            return False
        return True

    def on_host(self, name: str) -> bool:
        return name in self._owner(name).hosts

    def value(self, name: str) -> Tensor | np.ndarray | None:
        """The Tensor of a value if the device holds it, else its host array (None for an
        optional value without one)."""
        if self.is_absent(name):
            return None
        env = self._owner(name)
        return env.tensors[name] if name in env.tensors else env.hosts[name]

    def set(self, name: str, value: Tensor | np.ndarray | None) -> None:
        if value is None:
            self.absent.add(name)
            self.tensors.pop(name, None)
            self.hosts.pop(name, None)
        elif isinstance(value, Tensor):
            self.tensors[name] = value
            self.hosts.pop(name, None)
        else:
            self.hosts[name] = np.asarray(value)
            self.tensors.pop(name, None)

    def tensor(self, name: str) -> Tensor:
        env = self._owner(name)
        if name not in env.tensors:
            arr = env.hosts[name]
            elem = dtypes.elem_type_of(arr)
            env.tensors[name] = Tensor(dtypes.to_storage(arr, elem), device=self.device,
                                       dtype=dtypes.storage(elem))
        return env.tensors[name]

    def host(self, name: str) -> np.ndarray:
        env = self._owner(name)
        if name not in env.hosts:
            if not env.is_static(name):
                self.state.dynamic = True
                self.state.reads.append(name)
            arr = env.tensors[name].numpy()
            elem = self.types.get(name)
            env.hosts[name] = dtypes.from_storage(arr, elem) if elem is not None else arr
        return env.hosts[name]

    def is_static(self, name: str) -> bool:
        env: Env | None = self
        while env is not None:
            if name in env.tensors or name in env.hosts:
                return name in env.static
            env = env.parent
        return False


@dataclass
class Step:
    """One node: its rule, what the handler sees of it, its input and output names."""

    rule: OpRule
    node: Node
    inputs: list[str]
    outputs: list[str]
    optional_outputs: list[bool]  # whose type is optional: they may have no value


def _attribute(a: AttributeProto, subgraph: Callable[[GraphProto], Program], where: str) -> Any:
    kind = a.type
    if a.ref_attr_name:
        raise UnsupportedOpError(f"{where}: attribute {a.name!r} refers to a function attribute; "
                                 "model-local functions are not supported")
    if kind == AttributeProto.FLOAT:
        return float(a.f)
    if kind == AttributeProto.INT:
        return int(a.i)
    if kind == AttributeProto.STRING:
        return a.s.decode("utf-8", errors="replace")
    if kind == AttributeProto.TENSOR:
        return numpy_helper.to_array(a.t)
    if kind == AttributeProto.GRAPH:
        return subgraph(a.g)
    if kind == AttributeProto.FLOATS:
        return [float(v) for v in a.floats]
    if kind == AttributeProto.INTS:
        return [int(v) for v in a.ints]
    if kind == AttributeProto.STRINGS:
        return [s.decode("utf-8", errors="replace") for s in a.strings]
    if kind == AttributeProto.TENSORS:
        return [numpy_helper.to_array(t) for t in a.tensors]
    if kind == AttributeProto.GRAPHS:
        return [subgraph(g) for g in a.graphs]
    if kind == AttributeProto.TYPE_PROTO:
        return a.tp
    raise UnsupportedOpError(f"{where}: attribute {a.name!r} of type "
                             f"{AttributeProto.AttributeType.Name(kind)} is not supported")


def _describe(node: NodeProto, opset: int) -> str:
    domain = f" (domain {node.domain})" if node.domain not in ("", "ai.onnx") else ""
    return f"node {node.name or node.output[0]!r} ({node.op_type}{domain}, opset {opset})"


class Program:
    """A graph's nodes matched to rules, in order, with the element type of every value."""

    def __init__(self, graph: GraphProto, opsets: dict[str, int], device: str,
                 types: dict[str, int], optional: set[str] | None = None,
                 subgraph: bool = False):
        self.optional = optional if optional is not None else set()
        self.opsets = opsets
        self.device = device
        self.types = types
        self.input_names = [v.name for v in graph.input]
        self.output_names = [v.name for v in graph.output]
        # a subgraph's own initializers, set at each run of it (the main graph's are the
        # model's, made device tensors once at load)
        self.initializers = {t.name: t for t in graph.initializer} if subgraph else {}
        self.steps = [self._step(n) for n in graph.node]

    def _step(self, n: NodeProto) -> Step:
        domain = "" if n.domain == "ai.onnx" else n.domain
        if domain not in self.opsets:
            raise ModelError(f"{_describe(n, 0)}: the model imports no opset of domain "
                             f"{domain or 'ai.onnx'!r}")
        opset = self.opsets[domain]
        where = _describe(n, opset)
        rule = lookup(domain, n.op_type, opset)
        if rule is None:
            have = versions(domain, n.op_type)
            if have:
                spans = ", ".join(f"{a}-{b}" for a, b in have)
                raise UnsupportedOpError(f"{where}: this opset of {n.op_type} is not supported "
                                         f"(supported: opsets {spans})")
            raise UnsupportedOpError(f"{where}: operator {n.op_type} is not supported")
        attrs = {a.name: _attribute(a, self._subgraph, where) for a in n.attribute}
        extra = sorted(set(attrs) - rule.attrs)
        if extra:
            raise UnsupportedOpError(f"{where}: attribute{'s' if len(extra) > 1 else ''} "
                                     f"{', '.join(extra)} not supported")
        node = Node(n.op_type, n.name or n.output[0], domain, opset, self.device, attrs,
                    [self.types.get(i) if i else None for i in n.input],
                    [self.types.get(o) if o else None for o in n.output], len(n.output))
        if rule.check is not None:
            problem = rule.check(node)
            if problem:
                raise UnsupportedOpError(f"{where}: {problem}")
        return Step(rule, node, list(n.input), list(n.output),
                    [o in self.optional for o in n.output])

    def _subgraph(self, g: GraphProto) -> Program:
        return Program(g, self.opsets, self.device, self.types, self.optional, subgraph=True)

    def run(self, env: Env, steps: list[Step] | None = None) -> None:
        """Run ``steps`` (all of them by default) over ``env``."""
        for name, t in self.initializers.items():
            env.set(name, numpy_helper.to_array(t))
        for step in self.steps if steps is None else steps:
            run_step(step, env)

    def outputs(self, env: Env) -> list[Tensor | np.ndarray | None]:
        """The graph's outputs: each a Tensor where the device holds it, else a host array."""
        return [env.value(n) for n in self.output_names]


def _host_size(env: Env, names: list[str]) -> int | None:
    """Total elements of the inputs if all are known on the host, else None."""
    total = 0
    for n in names:
        if not n or env.is_absent(n):
            continue
        if not env.on_host(n):
            return None
        total += env.host(n).size
    return total


def run_step(step: Step, env: Env) -> None:
    """Run one node: fold it on the host where it can, else call its handler."""
    rule, node = step.rule, step.node
    try:
        out: Any = None
        if rule.fold is not None:
            size = _host_size(env, step.inputs)
            if size is not None and size <= FOLD_LIMIT:
                out = rule.fold(node, *[env.host(n) if n and not env.is_absent(n) else None
                                        for n in step.inputs])
        if out is None:
            args: list[Any] = []
            for i, n in enumerate(step.inputs):
                if not n or env.is_absent(n):
                    args.append(None)
                elif rule.wants_host(i):
                    args.append(env.host(n))
                else:
                    args.append(env.tensor(n))
            if rule.needs_env:
                out = rule.handler(node, env, *args)
            else:
                out = rule.handler(node, *args)
    except OnnxError:
        raise
    except Exception as err:
        raise NodeError(f"{node}: {type(err).__name__}: {err}") from err
    results = out if isinstance(out, (tuple, list)) else (out,)
    for k, name in enumerate(step.outputs):
        if not name:
            continue
        if k >= len(results) or results[k] is None:
            if k < len(results) and step.optional_outputs[k]:
                env.set(name, None)  # an optional output without a value
                continue
            raise ModelError(f"{node}: output {k} ({name!r}) was asked for but not computed")
        env.set(name, _typed(results[k], node.out_type(k)))


def _typed(value: Any, elem: int | None) -> Tensor | np.ndarray:
    """A handler's result in the storage of its declared element type."""
    if isinstance(value, Tensor):
        if elem is not None and dtypes.supported(elem):
            want = dtypes.storage(elem)
            if value.dtype != want:
                value = value.cast(want)
        return value
    arr = np.asarray(value)
    if elem is not None and dtypes.supported(elem) and arr.dtype != dtypes.numpy_dtype(elem):
        arr = arr.astype(dtypes.numpy_dtype(elem))
    return arr


__all__ = ["Program", "Env", "RunState", "Step", "run_step", "FOLD_LIMIT"]
