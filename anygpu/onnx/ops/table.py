"""The table of ONNX operators: one ``OpRule`` per (domain, op type) and opset range.

A rule's handler builds the operator from anygpu Tensor ops. It is called as
``handler(node, *inputs)``: ``node`` holds the attributes, the opset and the device, and each
input is a Tensor on the model's device, ``None`` for an optional input left out, or, at the
positions the rule lists in ``host``, a NumPy array of the value (shapes, axes, pads: values
that decide the structure of the computation). It returns a Tensor, a NumPy array (a value
known on the host, such as ``Shape``'s) or a tuple of them, one per output.

A rule may also have a ``fold``: the same operator on NumPy arrays, used for small values
known on the host (shape arithmetic on ``Shape``'s output and on constants), so that such
subgraphs never reach the device.

>>> from anygpu.onnx.ops import OPS
>>> rule = lookup("", "Relu", 14)
>>> rule.op_type, rule.since
('Relu', 6)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NoReturn

from anygpu.onnx.errors import UnsupportedOpError

# the newest opset whose operator definitions the handlers were written against: a model of a
# newer opset whose operator changed after it is refused at load
VERIFIED_OPSET = 28

ALL = -1  # ``host=ALL``: every input on the host (variadic shape ops)


@dataclass(frozen=True)
class OpRule:
    """How one operator runs for opsets ``since`` to ``until`` (both included)."""

    op_type: str
    since: int
    until: int
    handler: Callable[..., Any]
    domain: str = ""
    attrs: frozenset[str] = frozenset()  # the attributes the handler reads
    host: tuple[int, ...] = ()  # input positions given as NumPy arrays (or ALL)
    fold: Callable[..., Any] | None = None
    check: Callable[["Node"], str | None] | None = None  # unsupported attribute values
    pure: bool = True  # False: random; never folded at load time
    needs_env: bool = False  # control flow: the handler also gets the environment

    def wants_host(self, position: int) -> bool:
        return self.host == (ALL,) or position in self.host


OPS: dict[tuple[str, str], list[OpRule]] = {}


def op(op_type: str | tuple[str, ...], since: int = 1, until: int = VERIFIED_OPSET,
       attrs: tuple[str, ...] = (), host: tuple[int, ...] | int = (),
       fold: Callable[..., Any] | None = None, check: Callable[["Node"], str | None] | None = None,
       domain: str = "", pure: bool = True, needs_env: bool = False
       ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register a handler for one or several op types in the table."""
    names = (op_type,) if isinstance(op_type, str) else op_type
    hosts = (host,) if isinstance(host, int) else tuple(host)

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        for name in names:
            rule = OpRule(name, since, until, fn, domain, frozenset(attrs), hosts, fold, check,
                          pure, needs_env)
            OPS.setdefault((domain, name), []).append(rule)
        return fn
    return register


def lookup(domain: str, op_type: str, opset: int) -> OpRule | None:
    """The rule covering ``op_type`` at ``opset`` of its domain, or None."""
    for rule in OPS.get((domain, op_type), []):
        if rule.since <= opset <= rule.until or (rule.since <= opset and
                                                 _unchanged_since(rule, opset)):
            return rule
    return None


def _unchanged_since(rule: OpRule, opset: int) -> bool:
    """Whether the operator's definition at ``opset`` is one the rule covers: a model of a
    newer opset than ``until`` is fine as long as the operator did not change after it."""
    from onnx import defs

    try:
        schema = defs.get_schema(rule.op_type, opset, rule.domain)
    except Exception:  # an operator unknown to the installed onnx package
        return False
    return schema.since_version <= rule.until


def versions(domain: str, op_type: str) -> list[tuple[int, int]]:
    """The opset ranges the table covers for an operator."""
    return [(r.since, r.until) for r in OPS.get((domain, op_type), [])]


class Node:
    """What a handler sees of its node: attributes, opset, device, element types."""

    def __init__(self, op_type: str, name: str, domain: str, opset: int, device: str,
                 attrs: dict[str, Any], input_types: list[int | None],
                 output_types: list[int | None], num_outputs: int):
        self.op_type = op_type
        self.name = name
        self.domain = domain
        self.opset = opset
        self.device = device
        self.attrs = attrs
        self.input_types = input_types
        self.output_types = output_types
        self.num_outputs = num_outputs
        self.run_graph: Callable[..., Any] | None = None  # control flow: runs a subgraph

    def __repr__(self) -> str:
        return f"node {self.name!r} ({self.op_type}, opset {self.opset})"

    def attr(self, key: str, default: Any = ...) -> Any:
        """An attribute's value (ints, floats, str, lists, NumPy arrays, subgraphs)."""
        if key in self.attrs:
            return self.attrs[key]
        if default is ...:
            self.fail(f"needs attribute {key!r}")
        return default

    def has(self, key: str) -> bool:
        return key in self.attrs

    def in_type(self, i: int) -> int | None:
        return self.input_types[i] if i < len(self.input_types) else None

    def out_type(self, i: int = 0) -> int | None:
        return self.output_types[i] if i < len(self.output_types) else None

    def fail(self, message: str) -> NoReturn:
        raise UnsupportedOpError(f"{self}: {message}")


__all__ = ["OpRule", "OPS", "op", "lookup", "versions", "Node", "VERIFIED_OPSET", "ALL"]
