"""The processor's loops (``lower._cpu_body`` and the pass after it): loop-invariant costly work
moves before its loop, loads never leave a select's branch or the kernel's own output, and the
results stay NumPy's on fresh random data."""

from __future__ import annotations

import numpy as np

import anygpu as ag
from anygpu.codegen import ir, lower
from anygpu.codegen.render.cstyle import render
from anygpu.dtype import float32
from anygpu.graph.schedule import KernelItem, schedule


def _source(t: ag.Tensor) -> str:
    items = [i for i in schedule([t.lazy]) if isinstance(i, KernelItem)]
    return render(lower.to_ir(items[-1].ast, "c"), "c")


def _depth(source: str, needle: str) -> int:
    """How many loops enclose the first line holding ``needle``."""
    depth = 0
    for line in source.splitlines():
        if needle in line:
            return depth
        depth += line.count("{") - line.count("}")
    raise AssertionError(f"{needle!r} is not in the source")


def test_a_per_channel_square_root_leaves_the_element_loops() -> None:
    rng = np.random.default_rng(11)
    x = rng.standard_normal((4, 6, 5, 7)).astype(np.float32)
    var = rng.uniform(0.5, 2.0, (1, 6, 1, 1)).astype(np.float32)
    out = (ag.tensor(x) / (ag.tensor(var) + 1e-5).sqrt()).relu()
    source = _source(out)
    # the loop over channels holds the square root; the element loops inside it do not
    assert _depth(source, "sqrtf") < _depth(source, "b0[")
    np.testing.assert_allclose(out.numpy(), np.maximum(x / np.sqrt(var + 1e-5), 0), rtol=1e-6)


def test_loads_stay_in_a_select_branch_and_in_place_reads() -> None:
    body = [ir.For("i", ir.const(0, ag.int32), ir.const(8, ag.int32), ir.const(1, ag.int32), [
        ir.Store("b0", ir.var("i"), ir.alu(
            "where", ir.alu("lt", ir.var("i"), ir.const(4, ag.int32)),
            ir.load("b1", float32, ir.const(100, ag.int32)),  # guarded by the select
            ir.alu("sqrt", ir.load("b0", float32, ir.const(0, ag.int32)))))])]  # its output
    hoisted = lower.hoist_invariants(body)
    assert len(hoisted) == 1 and isinstance(hoisted[0], ir.For)
    # a square root of a load that stays is no reason to move: nothing was declared before
    store = hoisted[0].body[0]
    assert isinstance(store, ir.Store) and store.value.srcs[1].op == "load"
