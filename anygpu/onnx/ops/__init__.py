"""ONNX operators as anygpu composites: one table keyed by (domain, op type), each rule with
the opsets it covers (``table.OPS``); the modules below fill it by group.

>>> from anygpu.onnx.ops import lookup
>>> lookup("", "Squeeze", 11).until, lookup("", "Squeeze", 13).since
(12, 13)
"""

from anygpu.onnx.ops.table import OPS, VERIFIED_OPSET, Node, OpRule, lookup, op, versions

from anygpu.onnx.ops import (attention, control, conv, elementwise, indexing,  # noqa: F401,E402
                             losses, nn, quantize, reductions, resize,
                             misc, rnn, sampling, shapes, spectral)


def supported_ops() -> list[str]:
    """The op types the table covers (domain-qualified outside the default domain)."""
    return sorted(f"{d}.{n}" if d else n for d, n in OPS)


__all__ = ["OPS", "OpRule", "Node", "op", "lookup", "versions", "supported_ops", "VERIFIED_OPSET"]
