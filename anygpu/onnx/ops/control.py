"""Control flow: If, Loop and Scan run their subgraphs over an environment that sees the
enclosing graph's values.

A condition or a trip count computed on the device is read on the host to decide what to run,
so a model with data-dependent control flow runs lazily on every call (no replay).

>>> from anygpu.onnx.ops import lookup
>>> lookup("", "Loop", 16).needs_env
True
"""

from __future__ import annotations

from typing import Any

import numpy as np

from anygpu import dtype as dt
from anygpu.onnx.ops.common import axis as norm_axis
from anygpu.onnx.ops.common import const
from anygpu.onnx.ops.table import Node, op
from anygpu.tensor import Tensor, stack


def run_subgraph(program: Any, env: Any, values: list[Any]) -> list[Any]:
    """Run a subgraph with its inputs bound to ``values``; its outputs."""
    from anygpu.onnx.graph import Env

    child = Env(env, env.state, env.types, env.device)
    for name, value in zip(program.input_names, values):
        if value is not None:
            child.set(name, value)
    program.run(child)
    return program.outputs(child)


@op("If", since=1, attrs=("then_branch", "else_branch"), host=0, needs_env=True)
def if_(node: Node, env: Any, cond: np.ndarray) -> tuple[Any, ...]:
    branch = node.attr("then_branch") if bool(np.asarray(cond).reshape(-1)[0]) else \
        node.attr("else_branch")
    return tuple(run_subgraph(branch, env, []))


def _as_tensor(value: Any, device: str) -> Tensor:
    if isinstance(value, Tensor):
        return value
    from anygpu.onnx import dtypes

    arr = np.asarray(value)
    elem = dtypes.elem_type_of(arr)
    return Tensor(dtypes.to_storage(arr, elem), device=device, dtype=dtypes.storage(elem))


@op("Loop", since=1, attrs=("body",), host=(0, 1), needs_env=True)
def loop(node: Node, env: Any, trip: np.ndarray | None, cond: np.ndarray | None,
         *carried: Any) -> tuple[Any, ...]:
    body = node.attr("body")
    limit = int(np.asarray(trip).reshape(-1)[0]) if trip is not None else None
    keep_going = bool(np.asarray(cond).reshape(-1)[0]) if cond is not None else True
    state = list(carried)
    n_state = len(state)
    scans: list[list[Any]] = []
    i = 0
    while keep_going and (limit is None or i < limit):
        counters = [np.asarray(i, dtype=np.int64), np.asarray(keep_going)]
        outs = run_subgraph(body, env, [*counters, *state])
        flag = outs[0]
        keep_going = bool(np.asarray(flag.numpy() if isinstance(flag, Tensor) else flag)
                          .reshape(-1)[0])
        if isinstance(flag, Tensor):
            env.state.dynamic = True
        state = list(outs[1:1 + n_state])
        scans.append(list(outs[1 + n_state:]))
        i += 1
    n_scan = len(body.output_names) - 1 - n_state
    results: list[Any] = list(state)
    for k in range(n_scan):
        parts = [_as_tensor(s[k], node.device) for s in scans]
        if parts:
            results.append(stack(parts, 0))
        else:  # no iteration: an empty stack of the body output's type
            from anygpu.onnx import dtypes

            elem = node.out_type(n_state + k) or 1
            results.append(const(0, (0,), dtypes.storage(elem), node.device))
    return tuple(results)


@op("Scan", since=9, attrs=("body", "num_scan_inputs", "scan_input_axes",
                            "scan_input_directions", "scan_output_axes",
                            "scan_output_directions"), needs_env=True)
def scan(node: Node, env: Any, *inputs: Tensor) -> tuple[Any, ...]:
    m = node.attr("num_scan_inputs")
    n_state = len(inputs) - m
    in_axes = node.attr("scan_input_axes", [0] * m)
    in_dirs = node.attr("scan_input_directions", [0] * m)
    n_out = len(node.attr("body").output_names) - n_state
    return _scan(node, env, list(inputs[:n_state]), list(inputs[n_state:]), in_axes, in_dirs,
                 node.attr("scan_output_axes", [0] * n_out),
                 node.attr("scan_output_directions", [0] * n_out))


@op("Scan", since=8, until=8, attrs=("body", "num_scan_inputs", "directions"), needs_env=True)
def scan_8(node: Node, env: Any, lengths: Tensor | None, *inputs: Tensor) -> tuple[Any, ...]:
    """Scan-8: inputs and outputs carry a batch axis first; each batch element is scanned on
    its own (up to its sequence length, when given)."""
    m = node.attr("num_scan_inputs")
    n_state = len(inputs) - m
    batch = inputs[0].shape[0]
    n_out = len(node.attr("body").output_names) - n_state
    dirs = node.attr("directions", [0] * m)
    limits = [int(v) for v in lengths.numpy().reshape(-1)] if lengths is not None else None
    per: list[tuple[Any, ...]] = []
    for b in range(batch):
        xs = [x[b] for x in inputs[n_state:]]
        if limits is not None:
            xs = [x[:limits[b]] for x in xs]
        per.append(_scan(node, env, [s[b] for s in inputs[:n_state]], xs, [0] * m, dirs,
                         [0] * n_out, [0] * n_out))
    return tuple(stack([_as_tensor(p[k], node.device) for p in per], 0)
                 for k in range(len(per[0])))


def _scan(node: Node, env: Any, state: list[Any], xs: list[Tensor], in_axes: list[int],
          in_dirs: list[int], out_axes: list[int], out_dirs: list[int]) -> tuple[Any, ...]:
    """Run ``body`` along the scan axis of ``xs``, carrying ``state``; the final states and
    the stacked scan outputs."""
    body = node.attr("body")
    n_state = len(state)
    axes = [norm_axis(a, x.ndim, node) for a, x in zip(in_axes, xs)]
    length = xs[0].shape[axes[0]] if xs else 0
    n_out = len(body.output_names) - n_state
    collected: list[list[Tensor]] = [[] for _ in range(n_out)]
    for t in range(length):
        slices = []
        for x, a, d in zip(xs, axes, in_dirs):
            k = length - 1 - t if d else t
            bounds = [(0, s) for s in x.shape]
            bounds[a] = (k, k + 1)
            slices.append(x.shrink(bounds).squeeze(a))
        outs = run_subgraph(body, env, [*state, *slices])
        state = [_as_tensor(o, node.device) for o in outs[:n_state]]
        for j, o in enumerate(outs[n_state:]):
            collected[j].append(_as_tensor(o, node.device))
    results: list[Any] = list(state)
    for j, parts in enumerate(collected):
        if out_dirs[j]:
            parts = parts[::-1]
        if not parts:
            results.append(const(0, (0,), dt.float32, node.device))
            continue
        a = norm_axis(out_axes[j], parts[0].ndim + 1, node)
        results.append(stack(parts, a))
    return tuple(results)


# ---- optional values ----------------------------------------------------------------------------
@op("Optional", since=15, attrs=("type",))
def optional(node: Node, x: Any = None) -> Any:
    return x  # a value, or None: no value


@op("OptionalHasElement", since=18, host=0)
def optional_has_element(node: Node, x: Any = None) -> np.ndarray:
    return np.asarray(x is not None)


@op("OptionalGetElement", since=18, host=0)
def optional_get_element(node: Node, x: Any = None) -> Any:
    if x is None:
        node.fail("the optional input has no value")
    return x


__all__ = ["if_", "loop", "scan", "run_subgraph", "optional", "optional_has_element",
           "optional_get_element"]
