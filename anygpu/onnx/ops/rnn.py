"""Recurrent layers: RNN, GRU and LSTM, forward, reverse or both, with sequence lengths,
initial states, peepholes, clipping, the batch-first layout and any of ONNX's activations.

The input projections of all steps are one product; the recurrence is unrolled over the
sequence (its length is known when the graph is built), each step a product with the
recurrent weights and the gate arithmetic. A batch entry past its sequence length keeps its
state and outputs zeros.

>>> import numpy as np
>>> from anygpu.onnx.ops.table import Node
>>> node = Node("RNN", "r", "", 14, "cpu", {"hidden_size": 2}, [1] * 3, [1, 1], 2)
>>> x, w, r = (Tensor(np.full(s, 0.1, np.float32)) for s in ((3, 1, 2), (1, 2, 2), (1, 2, 2)))
>>> [t.shape for t in rnn(node, x, w, r)]
[(3, 1, 1, 2), (1, 1, 2)]
"""

from __future__ import annotations

from typing import Callable

from anygpu import dtype as dt
from anygpu.onnx.ops.common import const
from anygpu.onnx.ops.table import Node, op
from anygpu.tensor import Tensor, stack, where

Activation = Callable[[Tensor], Tensor]


def _activation(name: str, alpha: float | None, beta: float | None) -> Activation:
    key = name.lower()
    if key == "tanh":
        return lambda x: x.tanh()
    if key == "sigmoid":
        return lambda x: x.sigmoid()
    if key == "relu":
        return lambda x: x.relu()
    if key == "affine":
        return lambda x: x * (1.0 if alpha is None else alpha) + (0.0 if beta is None else beta)
    if key == "leakyrelu":
        a = 0.01 if alpha is None else alpha
        return lambda x: x.leaky_relu(a)
    if key == "thresholdedrelu":
        a = 1.0 if alpha is None else alpha
        return lambda x: where(x.gt(a), x, const(0, (), x.dtype, x.device))
    if key == "scaledtanh":
        a, b = (1.0 if alpha is None else alpha), (1.0 if beta is None else beta)
        return lambda x: (x * b).tanh() * a
    if key == "hardsigmoid":
        a, b = (0.2 if alpha is None else alpha), (0.5 if beta is None else beta)
        return lambda x: (x * a + b).clip(0, 1)
    if key == "elu":
        a = 1.0 if alpha is None else alpha
        return lambda x: where(x.gt(0), x, x.expm1() * a)
    if key == "softsign":
        return lambda x: x / (x.abs() + 1)
    if key == "softplus":
        return lambda x: x.maximum(0) + (-x.abs()).exp().log1p()
    raise NotImplementedError(f"activation {name!r} is not supported")


_KNOWN = {"tanh", "sigmoid", "relu", "affine", "leakyrelu", "thresholdedrelu", "scaledtanh",
          "hardsigmoid", "elu", "softsign", "softplus"}


def _check(node: Node) -> str | None:
    bad = [a for a in node.attr("activations", []) if a.lower() not in _KNOWN]
    if bad:
        return f"activation {bad[0]!r} is not supported"
    if node.attr("direction", "forward") not in ("forward", "reverse", "bidirectional"):
        return f"direction {node.attr('direction')!r} is not supported"
    return None


def _activations(node: Node, defaults: list[str], directions: int) -> list[list[Activation]]:
    names = node.attr("activations", None) or defaults * directions
    alphas = list(node.attr("activation_alpha", []))
    betas = list(node.attr("activation_beta", []))
    funcs = [_activation(n, alphas[i] if i < len(alphas) else None,
                         betas[i] if i < len(betas) else None) for i, n in enumerate(names)]
    per = len(defaults)
    return [funcs[d * per:(d + 1) * per] for d in range(directions)]


def _clip(node: Node, x: Tensor) -> Tensor:
    limit = node.attr("clip", None)
    return x.clip(-limit, limit) if limit is not None else x


StepFn = Callable[[Tensor, list[Tensor], int], list[Tensor]]


def _run(node: Node, x: Tensor, states: list[Tensor], step: StepFn, lengths: Tensor | None,
         reverse: bool) -> tuple[Tensor, list[Tensor]]:
    """Unroll one direction: ``step(x_t, states, t) -> new states``; the first state is the
    output. Returns the outputs (T, B, H) and the final states."""
    steps = x.shape[0]
    outs: list[Tensor | None] = [None] * steps
    order = range(steps - 1, -1, -1) if reverse else range(steps)
    for t in order:
        new = step(x[t], states, t)
        if lengths is not None:
            live = lengths.gt(t).reshape(-1, 1)
            new = [where(live, n, s) for n, s in zip(new, states)]
            outs[t] = where(live, new[0], const(0, (), new[0].dtype, x.device))
        else:
            outs[t] = new[0]
        states = new
    return stack([o for o in outs if o is not None], 0), states


def _recurrent(node: Node, x: Tensor, w: Tensor, r: Tensor, b: Tensor | None,
               lengths: Tensor | None, initial: list[Tensor | None], gates: int,
               defaults: list[str], make_step: Callable[..., StepFn]) -> tuple[Tensor, ...]:
    layout = node.attr("layout", 0)
    if layout:
        x = x.transpose(0, 1)  # (B, T, I) -> (T, B, I)
        initial = [s.transpose(0, 1) if s is not None else None for s in initial]
    hidden = node.attr("hidden_size", r.shape[-1])
    direction = node.attr("direction", "forward")
    directions = 2 if direction == "bidirectional" else 1
    acts = _activations(node, defaults, directions)
    batch = x.shape[1]
    if lengths is not None:
        lengths = lengths.cast(dt.int64)
    ys, finals = [], []
    for d in range(directions):
        wd, rd = w[d], r[d]  # (G*H, I), (G*H, H)
        projected = x.matmul(wd.T)  # all steps at once: (T, B, G*H)
        if b is not None:
            projected = projected + b[d, :gates * hidden] + b[d, gates * hidden:]
        states = [s[d] if s is not None else const(0, (batch, hidden), x.dtype, x.device)
                  for s in initial]
        step = make_step(node, rd, b[d] if b is not None else None, acts[d], hidden, d)
        reverse = direction == "reverse" or d == 1
        y, last = _run(node, projected, states, step, lengths, reverse)
        ys.append(y)
        finals.append(last)
    y = stack(ys, 1)  # (T, D, B, H)
    out_states = [stack([f[k] for f in finals], 0) for k in range(len(finals[0]))]
    if layout:
        y = y.permute(2, 0, 1, 3)  # (B, T, D, H)
        out_states = [s.transpose(0, 1) for s in out_states]
    return (y, *out_states)


_COMMON = ("activation_alpha", "activation_beta", "activations", "clip", "direction",
           "hidden_size", "layout")


def _rnn_step(node: Node, r: Tensor, b: Tensor | None, acts: list[Activation], hidden: int,
              d: int) -> StepFn:
    def step(xt: Tensor, states: list[Tensor], t: int) -> list[Tensor]:
        return [acts[0](_clip(node, xt + states[0].matmul(r.T)))]
    return step


@op("RNN", since=7, attrs=_COMMON, check=_check)
def rnn(node: Node, x: Tensor, w: Tensor, r: Tensor, b: Tensor | None = None,
        lengths: Tensor | None = None, h0: Tensor | None = None) -> tuple[Tensor, ...]:
    return _recurrent(node, x, w, r, b, lengths, [h0], 1, ["Tanh"], _rnn_step)


def _gru_step(node: Node, r: Tensor, b: Tensor | None, acts: list[Activation], hidden: int,
              d: int) -> StepFn:
    f, g = acts
    before_reset = node.attr("linear_before_reset", 0)
    rz, rr, rh = r[:hidden], r[hidden:2 * hidden], r[2 * hidden:]
    rbh = b[5 * hidden:] if b is not None else None

    def step(xt: Tensor, states: list[Tensor], t: int) -> list[Tensor]:
        h = states[0]
        # xt holds X W^T + Wb + Rb for all three gates; with linear_before_reset the
        # candidate's Rb is scaled by the reset gate, so it moves inside
        xz, xr, xh = xt[:, :hidden], xt[:, hidden:2 * hidden], xt[:, 2 * hidden:]
        z = f(_clip(node, xz + h.matmul(rz.T)))
        reset = f(_clip(node, xr + h.matmul(rr.T)))
        if before_reset:
            inner = h.matmul(rh.T)
            if rbh is not None:
                xh = xh - rbh
                inner = inner + rbh
            cand = g(_clip(node, xh + reset * inner))
        else:
            cand = g(_clip(node, xh + (reset * h).matmul(rh.T)))
        return [(1 - z) * cand + z * h]
    return step


@op("GRU", since=7, attrs=_COMMON + ("linear_before_reset",), check=_check)
def gru(node: Node, x: Tensor, w: Tensor, r: Tensor, b: Tensor | None = None,
        lengths: Tensor | None = None, h0: Tensor | None = None) -> tuple[Tensor, ...]:
    return _recurrent(node, x, w, r, b, lengths, [h0], 3, ["Sigmoid", "Tanh"], _gru_step)


def _lstm_factory(peepholes: Tensor | None) -> Callable[..., StepFn]:
    def make(node: Node, r: Tensor, b: Tensor | None, acts: list[Activation], hidden: int,
             d: int) -> StepFn:
        f, g, h_act = acts
        couple = node.attr("input_forget", 0)
        p = peepholes[d] if peepholes is not None else None

        def step(xt: Tensor, states: list[Tensor], t: int) -> list[Tensor]:
            h, c = states
            gates = xt + h.matmul(r.T)
            gi, go, gf, gc = (gates[:, k * hidden:(k + 1) * hidden] for k in range(4))
            if p is not None:
                gi = gi + p[:hidden] * c
                gf = gf + p[2 * hidden:] * c
            i = f(_clip(node, gi))
            forget = 1 - i if couple else f(_clip(node, gf))
            c_new = forget * c + i * g(_clip(node, gc))
            if p is not None:
                go = go + p[hidden:2 * hidden] * c_new
            o = f(_clip(node, go))
            return [o * h_act(c_new), c_new]
        return step
    return make


@op("LSTM", since=7, attrs=_COMMON + ("input_forget",), check=_check)
def lstm(node: Node, x: Tensor, w: Tensor, r: Tensor, b: Tensor | None = None,
         lengths: Tensor | None = None, h0: Tensor | None = None, c0: Tensor | None = None,
         peepholes: Tensor | None = None) -> tuple[Tensor, ...]:
    return _recurrent(node, x, w, r, b, lengths, [h0, c0], 4, ["Sigmoid", "Tanh", "Tanh"],
                      _lstm_factory(peepholes))
