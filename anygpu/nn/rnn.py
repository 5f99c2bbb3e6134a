"""Recurrent layers (RNN, LSTM, GRU) and their cells, with PyTorch's arguments, defaults,
parameter names, shapes, initialization and gate orders, so torch checkpoints load one to one.

A layer runs a whole sequence as one recorded op per layer and direction (``_Sequence``): the
input projections of every step are one matmul; each step adds ``h @ W_hh^T`` and computes its
gates in one fused elementwise kernel; the outputs are stacked once at the end. Each step's
state is stored (``contiguous``), so that the next step reads it as a buffer rather than
recomputing the chain of every step before it, and the backward pass through time is written
out by hand, as cuDNN's is (autograd's chain would fuse every step's gradient into the next
one's kernels): each step's gate gradients are stored, and the weight gradients are one matmul
over the whole sequence each. Its rule is registered in ``ops/grad.py``'s table from here.

The projections (forward) and the incoming gradient (backward) are computed when the layer
runs (``_stored``), so that a step's kernels read their time slice as a buffer of its own
(``schedule.row_slice``) and every step runs the same kernels; a slice of a tensor not yet
computed would put its offset into the kernel, one compile per step.

>>> import anygpu as ag
>>> from anygpu import nn
>>> lstm = nn.LSTM(10, 20, num_layers=2)
>>> output, (h_n, c_n) = lstm(ag.randn(5, 3, 10))
>>> output.shape, h_n.shape, c_n.shape
((5, 3, 20), (2, 3, 20), (2, 3, 20))
>>> list(lstm.state_dict())[:4]
['weight_ih_l0', 'weight_hh_l0', 'bias_ih_l0', 'bias_hh_l0']
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Any, Sequence

from anygpu.nn import functional as F
from anygpu.nn import init
from anygpu.nn.module import Module, Parameter
from anygpu.ops import grad as autograd
from anygpu.tensor import Tensor, cat, zeros

# WebGPU's default limit is 8 storage buffers per kernel, the output included: steps are joined
# in groups of at most this many, each stored, rather than in one kernel reading every step
# (one binding is left for a last state joined to them)
_FAN_IN = 6
_GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}  # gates stacked in each weight


def _join(steps: Sequence[Tensor]) -> Tensor:
    """``stack(steps)``, built as kernels that each read at most ``_FAN_IN`` inputs."""
    parts = [s.unsqueeze(0) for s in steps]
    while len(parts) > _FAN_IN:
        parts = [cat(parts[i:i + _FAN_IN]).contiguous() if len(parts[i:i + _FAN_IN]) > 1
                 else parts[i] for i in range(0, len(parts), _FAN_IN)]
    return cat(parts) if len(parts) > 1 else parts[0]


def _stored(t: Tensor) -> Tensor:
    """``t`` computed now into a buffer of its own, so that its rows ``t[i]`` are read by
    kernels as buffers (one kernel for every ``i``, not a kernel compiled per offset)."""
    return t.contiguous().realize()


# ---- one step of each cell (shared by the cells and the layers) --------------------------------
def _columns(t: Tensor, start: int, stop: int) -> Tensor:
    return t[:, start:stop]


def _rnn_step(xp: Tensor, gh: Tensor, nonlinearity: str) -> Tensor:
    """``act(x W_ih^T + b_ih + h W_hh^T + b_hh)``; ``xp`` and ``gh`` are the two products."""
    pre = xp + gh
    return pre.tanh() if nonlinearity == "tanh" else pre.relu()


def _lstm_step(gates: Tensor, c: Tensor) -> tuple[Tensor, ...]:
    """(i, f, g, o, c', tanh(c'), h' = o * tanh(c')) from the gates' pre-activations
    (PyTorch's order i, f, g, o) and the cell state: ``c' = f * c + i * g``."""
    hidden = c.shape[1]
    gate = gates.sigmoid()  # one sigmoid for i, f and o (each element computes only its own)
    i, f, o = _columns(gate, 0, hidden), _columns(gate, hidden, 2 * hidden), \
        _columns(gate, 3 * hidden, 4 * hidden)
    g = _columns(gates, 2 * hidden, 3 * hidden).tanh()
    c = f * c + i * g
    tanh_c = c.tanh()
    return i, f, g, o, c, tanh_c, o * tanh_c


def _gru_step(xp: Tensor, gh: Tensor, h: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(r, z, n, h') with PyTorch's ``n = tanh(W_in x + b_in + r * (W_hn h + b_hn))`` and
    ``h' = (1 - z) * n + z * h``; ``xp`` and ``gh`` are the two products with their biases."""
    hidden = h.shape[1]
    gate = (_columns(xp, 0, 2 * hidden) + _columns(gh, 0, 2 * hidden)).sigmoid()
    r, z = _columns(gate, 0, hidden), _columns(gate, hidden, 2 * hidden)
    n = (_columns(xp, 2 * hidden, 3 * hidden) + r * _columns(gh, 2 * hidden, 3 * hidden)).tanh()
    return r, z, n, (1 - z) * n + z * h


# ---- a whole sequence through one layer and direction ------------------------------------------
class _Sequence:
    """One layer and direction run over a sequence: the forward pass (no history recorded),
    the values its backward pass reads, and that backward pass through time.

    Each step is a product ``h @ W_hh^T`` and one elementwise kernel that stores everything the
    step computes side by side (LSTM: i, f, g, o, c, tanh(c), o * tanh(c); GRU: r, z, n, h;
    RNN: h), so the backward pass reads the activations rather than recomputing them. The
    backward step is likewise a product and one kernel (the gate gradients and the state
    gradient carried to the step before). The recorded output is flat: the outputs (L, N, P)
    then, for LSTM, the last cell state (N, H); ``h_n`` and ``c_n`` are views of it, so that
    their gradients arrive in one tensor."""

    def __init__(self, mode: str, reverse: bool, bias: bool, proj: bool) -> None:
        self.mode, self.reverse, self.bias, self.proj = mode, reverse, bias, proj
        self.xp: Tensor | None = None  # (L, N, G): x W_ih^T + biases, stored
        self.state: list[Tensor] = []  # per step, in processing order: what the step stored
        self.h: list[Tensor] = []  # per step: the output
        self.gh: list[Tensor] = []  # GRU, per step: h W_hh^T + b_hh (b_hn is read back)

    def order(self, length: int) -> list[int]:
        """The time index of each step, in processing order."""
        return list(range(length - 1, -1, -1)) if self.reverse else list(range(length))

    def forward(self, x: Tensor, h0: Tensor, c0: Tensor | None, w_ih: Tensor, w_hh: Tensor,
                b_ih: Tensor | None, b_hh: Tensor | None, w_hr: Tensor | None) -> Tensor:
        mode = self.mode
        bias = b_ih
        if b_ih is not None and b_hh is not None and mode != "GRU":
            bias = b_ih + b_hh  # GRU keeps b_hn inside r * (W_hn h + b_hn)
        self.xp = _stored(F.linear(x, w_ih, bias))
        hidden = w_hh.shape[0] // _GATES[mode]
        h, c = h0, c0
        for t in self.order(x.shape[0]):
            gh = h.matmul(w_hh.T)
            xp = self.xp[t]
            if mode == "LSTM":
                assert c is not None
                state = cat(_lstm_step(xp + gh, c), 1).contiguous()
                c = _columns(state, 4 * hidden, 5 * hidden)
                h = _columns(state, 6 * hidden, 7 * hidden)
                if w_hr is not None:
                    h = h.matmul(w_hr.T)
            elif mode == "GRU":
                if b_hh is not None:
                    gh = gh + b_hh
                state = cat(_gru_step(xp, gh, h), 1).contiguous()
                h = _columns(state, 3 * hidden, 4 * hidden)
                self.gh.append(gh)
            else:
                state = h = _rnn_step(xp, gh, "relu" if mode == "RNN_RELU" else "tanh"
                                      ).contiguous()
            self.state.append(state)
            self.h.append(h)
        outputs = self.h[::-1] if self.reverse else self.h
        flat = _join(outputs).reshape(-1)
        if c is not None:
            flat = cat([flat, c.reshape(-1)])
        return flat.contiguous()

    def backward(self, out: Tensor, parents: tuple[Tensor, ...], g: Tensor
                 ) -> tuple[Tensor | None, ...]:
        mode = self.mode
        x, h0 = parents[0], parents[1]
        c0 = parents[2] if mode == "LSTM" else None
        weights = parents[3:] if mode == "LSTM" else parents[2:]
        w_ih, w_hh = weights[0], weights[1]
        w_hr = weights[-1] if self.proj else None
        assert self.xp is not None
        length, batch = x.shape[0], x.shape[1]
        size = h0.shape[1]
        hidden = w_hh.shape[0] // _GATES[mode]
        rows = length * batch * size
        g_out = _stored(g[:rows].reshape(length, batch, size))
        order = self.order(length)
        d_pre: list[Tensor | None] = [None] * length  # by time: d(x W_ih^T + b_ih)
        d_gh: list[Tensor | None] = [None] * length  # by time: d(h W_hh^T + b_hh)
        d_out: list[Tensor | None] = [None] * length  # LSTM with projections: d(output)
        d_c = g[rows:].reshape(batch, hidden) if mode == "LSTM" else None
        d_h_prev: Tensor | None = None  # d(the state before the step just done)
        for k in range(length - 1, -1, -1):
            t = order[k]
            dh = g_out[t] if d_h_prev is None else g_out[t] + d_h_prev
            state = self.state[k]
            if mode == "LSTM":
                assert d_c is not None
                if w_hr is not None:
                    dh = dh.contiguous()
                    d_out[t] = dh
                    dh = dh.matmul(w_hr)
                i, f, gg, o, _, tanh_c = (_columns(state, n * hidden, (n + 1) * hidden)
                                          for n in range(6))
                c_prev = _columns(self.state[k - 1], 4 * hidden, 5 * hidden) if k else c0
                assert c_prev is not None
                d_c = d_c + dh * o * (1 - tanh_c * tanh_c)
                back = cat([d_c * gg * i * (1 - i), d_c * c_prev * f * (1 - f),
                            d_c * i * (1 - gg * gg), dh * tanh_c * o * (1 - o), d_c * f],
                           1).contiguous()
                d_pre[t] = d_gh[t] = _columns(back, 0, 4 * hidden)
                d_c = _columns(back, 4 * hidden, 5 * hidden)
                d_h_prev = _columns(back, 0, 4 * hidden).matmul(w_hh)
            elif mode == "GRU":
                r, z, n = (_columns(state, j * hidden, (j + 1) * hidden) for j in range(3))
                h_prev = self.h[k - 1] if k else h0
                hn = _columns(self.gh[k], 2 * hidden, 3 * hidden)
                dn = dh * (1 - z) * (1 - n * n)
                dr = dn * hn * r * (1 - r)
                dz = dh * (h_prev - n) * z * (1 - z)
                back = cat([dr, dz, dn * r, dn, dh * z], 1).contiguous()
                d_gh[t] = _columns(back, 0, 3 * hidden)
                d_pre[t] = cat([_columns(back, 0, 2 * hidden),
                                _columns(back, 3 * hidden, 4 * hidden)], 1)
                d_h_prev = (_columns(back, 0, 3 * hidden).matmul(w_hh)
                            + _columns(back, 4 * hidden, 5 * hidden))
            else:
                h = self.h[k]
                if mode == "RNN_TANH":
                    pre = (dh * (1 - h * h)).contiguous()
                else:
                    pre = h.gt(0)._select(dh, dh._const_like(0)).contiguous()
                d_pre[t] = d_gh[t] = pre
                d_h_prev = pre.matmul(w_hh)
        assert d_h_prev is not None

        def joined(steps: list[Tensor | None]) -> Tensor:
            return _join([s for s in steps if s is not None]).contiguous()

        dxp = joined(d_pre)
        dgh = dxp if mode != "GRU" else joined(d_gh)
        outputs = out[:rows].reshape(length, batch, size)
        first = h0.unsqueeze(0)  # the state before the first step, then each step's output
        if length == 1:
            h_prev_all = first
        elif self.reverse:
            h_prev_all = cat([outputs[1:], first])
        else:
            h_prev_all = cat([first, outputs[:length - 1]])
        gate = dxp.shape[-1]
        flat_dxp, flat_dgh = dxp.reshape(-1, gate), dgh.reshape(-1, gate)
        grads: list[Tensor | None] = [
            dxp.matmul(w_ih) if x.requires_grad else None,
            d_h_prev if h0.requires_grad else None]
        if c0 is not None:
            grads.append(d_c if c0.requires_grad else None)
        grads.append(flat_dxp.T.matmul(x.reshape(-1, x.shape[-1])) if w_ih.requires_grad
                     else None)
        grads.append(flat_dgh.T.matmul(h_prev_all.reshape(-1, size)) if w_hh.requires_grad
                     else None)
        if self.bias:
            grads += [flat_dxp.sum(0), flat_dgh.sum(0)]
        if w_hr is not None:
            m = [_columns(state, 6 * hidden, 7 * hidden) for state in self.state]
            m_all = _join(m[::-1] if self.reverse else m).reshape(-1, hidden)
            grads.append(joined(d_out).reshape(-1, size).T.matmul(m_all))
        return tuple(grads)


def _sequence_grad(out: Tensor, parents: tuple[Tensor, ...], run: _Sequence, g: Tensor
                   ) -> tuple[Tensor | None, ...]:
    return run.backward(out, parents, g)


# the gradient rule of the one op this module records, kept beside it (ops/grad.py's table)
autograd.RULES["rnn_sequence"] = _sequence_grad


def _run_sequence(mode: str, reverse: bool, x: Tensor, h0: Tensor, c0: Tensor | None,
                  weights: Sequence[Tensor], bias: bool, proj: bool
                  ) -> tuple[Tensor, Tensor, Tensor | None]:
    """(output (L, N, P), h_n, c_n) of one layer and direction over the time-major ``x``."""
    w_ih, w_hh = weights[0], weights[1]
    b_ih, b_hh = (weights[2], weights[3]) if bias else (None, None)
    w_hr = weights[-1] if proj else None
    run = _Sequence(mode, reverse, bias, proj)
    with autograd.no_grad():
        flat = run.forward(x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr)
    parents = (x, h0) + ((c0,) if c0 is not None else ()) + tuple(weights)
    out = Tensor._make(flat.lazy, parents, "rnn_sequence", run)
    length, batch, size = x.shape[0], x.shape[1], h0.shape[1]
    rows = length * batch * size
    output = out[:rows].reshape(length, batch, size)
    h_n = output[0] if reverse else output[length - 1]
    c_n = out[rows:].reshape(batch, -1) if c0 is not None else None
    return output, h_n, c_n


def _check_input_tensor(input: Any, name: str) -> None:
    if isinstance(input, Tensor):
        return
    if hasattr(input, "batch_sizes"):
        raise TypeError(f"{name} does not support PackedSequence inputs "
                        "(nn.utils.rnn.pack_padded_sequence): pass the padded tensor (a reverse "
                        "direction then also reads the padding)")
    raise TypeError(f"{name}: expected an anygpu Tensor as input, got {type(input).__name__}")


class RNNBase(Module):
    """The base of ``RNN``, ``LSTM`` and ``GRU``: their parameters (PyTorch's names, shapes and
    ``uniform(-1/sqrt(hidden_size), 1/sqrt(hidden_size))`` initialization) and the run of the
    layers; ``mode`` is "RNN_TANH", "RNN_RELU", "LSTM" or "GRU".

    >>> m = RNNBase("GRU", 4, 8, num_layers=2)
    >>> [tuple(p.shape) for p in m.all_weights[1]]
    [(24, 8), (24, 8), (24,), (24,)]
    """

    def __init__(self, mode: str, input_size: int, hidden_size: int, num_layers: int = 1,
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0,
                 bidirectional: bool = False, proj_size: int = 0, device: str | None = None,
                 dtype: Any = None) -> None:
        super().__init__()
        if (not isinstance(dropout, numbers.Number) or isinstance(dropout, bool)
                or not 0 <= dropout <= 1):  # type: ignore[operator]
            raise ValueError("dropout should be a number in range [0, 1] representing the "
                             "probability of an element being zeroed")
        if dropout > 0 and num_layers == 1:
            warnings.warn("dropout option adds dropout after all but last recurrent layer, so "
                          "non-zero dropout expects num_layers greater than 1, but got "
                          f"dropout={dropout} and num_layers={num_layers}", stacklevel=2)
        flags: tuple[tuple[str, Any], ...] = (("bias", bias), ("batch_first", batch_first))
        for name, flag in flags:
            if not isinstance(flag, bool):
                raise TypeError(f"{name} should be of type bool, got: {type(flag).__name__}")
        sizes: tuple[tuple[str, Any], ...] = (("input_size", input_size),
                                              ("hidden_size", hidden_size))
        for name, size in sizes:
            if not isinstance(size, int):
                raise TypeError(f"{name} should be of type int, got: {type(size).__name__}")
            if size <= 0:
                raise ValueError(f"{name} must be greater than zero")
        if num_layers <= 0:
            raise ValueError("num_layers must be greater than zero")
        if proj_size < 0:
            raise ValueError("proj_size should be a positive integer or zero to disable "
                             "projections")
        if proj_size >= hidden_size:
            raise ValueError("proj_size has to be smaller than hidden_size")
        gates = _GATES.get(mode)
        if gates is None:
            raise ValueError("Unrecognized RNN mode: " + mode)
        self.mode = mode
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.bias, self.batch_first = bias, batch_first
        self.dropout = float(dropout)  # type: ignore[arg-type]
        self.bidirectional, self.proj_size = bidirectional, proj_size
        directions = 2 if bidirectional else 1
        out_size = proj_size if proj_size > 0 else hidden_size
        self._flat_weights_names: list[str] = []
        self._all_weights: list[list[str]] = []
        for layer in range(num_layers):
            for direction in range(directions):
                layer_input = input_size if layer == 0 else out_size * directions
                shapes: list[tuple[int, ...]] = [(gates * hidden_size, layer_input),
                                                 (gates * hidden_size, out_size)]
                names = ["weight_ih_l{}{}", "weight_hh_l{}{}"]
                if bias:
                    shapes += [(gates * hidden_size,), (gates * hidden_size,)]
                    names += ["bias_ih_l{}{}", "bias_hh_l{}{}"]
                if proj_size > 0:
                    shapes.append((proj_size, hidden_size))
                    names.append("weight_hr_l{}{}")
                suffix = "_reverse" if direction == 1 else ""
                names = [n.format(layer, suffix) for n in names]
                for name, shape in zip(names, shapes):
                    setattr(self, name, Parameter(init._empty(shape, device, dtype)))
                self._flat_weights_names.extend(names)
                self._all_weights.append(names)
        self.reset_parameters()

    @property
    def all_weights(self) -> list[list[Parameter]]:
        """Each layer's and direction's parameters, in PyTorch's order."""
        return [[getattr(self, name) for name in names] for names in self._all_weights]

    @property
    def _flat_weights(self) -> list[Parameter]:
        return [getattr(self, name) for name in self._flat_weights_names]

    def flatten_parameters(self) -> None:
        """A no-op, as PyTorch's off cuDNN: the weights are always used where they are."""

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.hidden_size) if self.hidden_size > 0 else 0
        for weight in self.parameters():
            init.uniform_(weight, -bound, bound)

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}"
        if self.proj_size != 0:
            s += f", proj_size={self.proj_size}"
        if self.num_layers != 1:
            s += f", num_layers={self.num_layers}"
        if self.bias is not True:
            s += f", bias={self.bias}"
        if self.batch_first is not False:
            s += f", batch_first={self.batch_first}"
        if self.dropout != 0:
            s += f", dropout={self.dropout}"
        if self.bidirectional is not False:
            s += f", bidirectional={self.bidirectional}"
        return s

    # ---- checks with PyTorch's messages ------------------------------------------------------
    def _check_input(self, input: Tensor) -> None:
        weight_dtype = self._flat_weights[0].dtype
        if input.dtype != weight_dtype:
            raise ValueError(f"RNN input dtype ({input.dtype.name}) does not match weight dtype "
                             f"({weight_dtype.name}). Convert input: input.to("
                             f"{weight_dtype.name}), or convert model: model.to("
                             f"{input.dtype.name})")
        if input.ndim != 3:
            raise RuntimeError(f"input must have 3 dimensions, got {input.ndim}")
        if self.input_size != input.shape[-1]:
            raise RuntimeError(f"input.size(-1) must be equal to input_size. Expected "
                               f"{self.input_size}, got {input.shape[-1]}")
        if input.shape[0 if not self.batch_first else 1] == 0:
            raise RuntimeError("Expected sequence length to be larger than 0 in RNN")

    def _expected_hidden(self, input: Tensor, size: int) -> tuple[int, int, int]:
        batch = input.shape[0] if self.batch_first else input.shape[1]
        return (self.num_layers * (2 if self.bidirectional else 1), batch, size)

    @staticmethod
    def _check_hidden(hx: Tensor, expected: tuple[int, int, int],
                      msg: str = "Expected hidden size {}, got {}") -> None:
        if tuple(hx.shape) != expected:
            raise RuntimeError(msg.format(expected, list(hx.shape)))

    def _zeros(self, input: Tensor, size: int) -> Tensor:
        return zeros(self._expected_hidden(input, size), dtype=input.dtype, device=input.device)

    # ---- the run -----------------------------------------------------------------------------
    def _run(self, input: Tensor, hx: Tensor, cx: Tensor | None
             ) -> tuple[Tensor, Tensor, Tensor | None]:
        """(output, h_n, c_n) for a batched input and full initial states."""
        x = input.transpose(0, 1) if self.batch_first else input
        directions = 2 if self.bidirectional else 1
        h_n: list[Tensor] = []
        c_n: list[Tensor] = []
        for layer in range(self.num_layers):
            if layer > 0 and self.dropout > 0 and self.training:
                x = F.dropout(x, self.dropout, True)
            outputs = []
            for direction in range(directions):
                k = layer * directions + direction
                output, h, c = _run_sequence(
                    self.mode, direction == 1, x, hx[k], cx[k] if cx is not None else None,
                    self.all_weights[k], self.bias, self.proj_size > 0)
                outputs.append(output)
                h_n.append(h)
                if c is not None:
                    c_n.append(c)
            x = outputs[0] if directions == 1 else cat(outputs, 2)
        output = x.transpose(0, 1) if self.batch_first else x
        return output, _join(h_n), _join(c_n) if c_n else None

    def _batched(self, input: Any, name: str) -> tuple[Tensor, bool]:
        _check_input_tensor(input, name)
        if input.ndim not in (2, 3):
            tail = " tensor" if name == "RNN" else ""
            raise ValueError(f"{name}: Expected input to be 2D or 3D, got {input.ndim}D{tail} "
                             "instead")
        if input.ndim == 2:
            return input.unsqueeze(0 if self.batch_first else 1), False
        return input, True

    def _unbatch(self, output: Tensor) -> Tensor:
        return output.squeeze(0 if self.batch_first else 1)

    def _forward_one_state(self, input: Tensor, hx: Tensor | None,
                           name: str) -> tuple[Tensor, Tensor]:
        """RNN's and GRU's forward: one hidden state in and out."""
        input, batched = self._batched(input, name)
        h0 = self._single_state(input, hx, batched)
        output, h_n, _ = self._run(input, h0, None)
        if not batched:
            return self._unbatch(output), h_n.squeeze(1)
        return output, h_n

    def _single_state(self, input: Tensor, hx: Tensor | None, batched: bool) -> Tensor:
        """RNN's and GRU's ``hx``: checked, made batched, zeros where None."""
        if hx is not None:
            if not batched and hx.ndim != 2:
                raise RuntimeError(f"For unbatched 2-D input, hx should also be 2-D but got "
                                   f"{hx.ndim}-D tensor")
            if batched and hx.ndim != 3:
                raise RuntimeError(f"For batched 3-D input, hx should also be 3-D but got "
                                   f"{hx.ndim}-D tensor")
            hx = hx if batched else hx.unsqueeze(1)
        else:
            hx = self._zeros(input, self.hidden_size)
        self._check_input(input)
        self._check_hidden(hx, self._expected_hidden(input, self.hidden_size))
        return hx

    def forward(self, input: Tensor, hx: Any = None) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no forward of its own")


class RNN(RNNBase):
    """An Elman RNN: ``h_t = act(x_t W_ih^T + b_ih + h_{t-1} W_hh^T + b_hh)`` with act tanh
    or relu, stacked ``num_layers`` deep (``dropout`` between layers in training), optionally
    bidirectional. ``forward(input, hx=None)`` takes (L, N, H_in), (N, L, H_in) with
    ``batch_first`` or unbatched (L, H_in), and ``hx`` (D * num_layers, N, H_out), and returns
    ``(output, h_n)``.

    >>> import anygpu as ag
    >>> rnn = RNN(10, 20, 2)
    >>> output, h_n = rnn(ag.randn(5, 3, 10), ag.zeros(2, 3, 20))
    >>> output.shape, h_n.shape
    ((5, 3, 20), (2, 3, 20))
    """

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1,
                 nonlinearity: str = "tanh", bias: bool = True, batch_first: bool = False,
                 dropout: float = 0.0, bidirectional: bool = False, device: str | None = None,
                 dtype: Any = None) -> None:
        modes = {"tanh": "RNN_TANH", "relu": "RNN_RELU"}
        if nonlinearity not in modes:
            raise ValueError(f"Unknown nonlinearity '{nonlinearity}'. Select from 'tanh' or "
                             "'relu'.")
        super().__init__(modes[nonlinearity], input_size, hidden_size, num_layers, bias,
                         batch_first, dropout, bidirectional, 0, device, dtype)
        self.nonlinearity = nonlinearity

    def forward(self, input: Tensor, hx: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return self._forward_one_state(input, hx, "RNN")


class GRU(RNNBase):
    """A gated recurrent unit layer, gates in PyTorch's order r, z, n:
    ``n = tanh(W_in x + b_in + r * (W_hn h + b_hn))``, ``h' = (1 - z) * n + z * h``.
    Arguments, shapes and the result ``(output, h_n)`` as ``RNN``.

    >>> import anygpu as ag
    >>> gru = GRU(10, 20, batch_first=True, bidirectional=True)
    >>> output, h_n = gru(ag.randn(3, 5, 10))
    >>> output.shape, h_n.shape
    ((3, 5, 40), (2, 3, 20))
    """

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1,
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0,
                 bidirectional: bool = False, device: str | None = None,
                 dtype: Any = None) -> None:
        super().__init__("GRU", input_size, hidden_size, num_layers, bias, batch_first,
                         dropout, bidirectional, 0, device, dtype)

    def forward(self, input: Tensor, hx: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return self._forward_one_state(input, hx, "GRU")


class LSTM(RNNBase):
    """A long short-term memory layer, gates in PyTorch's order i, f, g, o:
    ``c' = f * c + i * g``, ``h' = o * tanh(c')``, then ``h' W_hr^T`` where ``proj_size > 0``.
    ``forward(input, (h_0, c_0)=None)`` returns ``(output, (h_n, c_n))``; h has
    ``proj_size`` features where there are projections, c always ``hidden_size``.

    >>> import anygpu as ag
    >>> lstm = LSTM(10, 20, proj_size=8)
    >>> output, (h_n, c_n) = lstm(ag.randn(7, 10))
    >>> output.shape, h_n.shape, c_n.shape
    ((7, 8), (1, 8), (1, 20))
    """

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1,
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0,
                 bidirectional: bool = False, proj_size: int = 0, device: str | None = None,
                 dtype: Any = None) -> None:
        super().__init__("LSTM", input_size, hidden_size, num_layers, bias, batch_first,
                         dropout, bidirectional, proj_size, device, dtype)

    def forward(self, input: Tensor, hx: tuple[Tensor, Tensor] | None = None
                ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        input, batched = self._batched(input, "LSTM")
        out_size = self.proj_size if self.proj_size > 0 else self.hidden_size
        if hx is None:
            h0, c0 = self._zeros(input, out_size), self._zeros(input, self.hidden_size)
        else:
            h0, c0 = hx[0], hx[1]
            want = 3 if batched else 2
            if h0.ndim != want or c0.ndim != want:
                kind = "batched 3-D" if batched else "unbatched 2-D"
                raise RuntimeError(f"For {kind} input, hx and cx should also be {want}-D but "
                                   f"got ({h0.ndim}-D, {c0.ndim}-D) tensors")
            if not batched:
                h0, c0 = h0.unsqueeze(1), c0.unsqueeze(1)
        self._check_input(input)
        self._check_hidden(h0, self._expected_hidden(input, out_size),
                           "Expected hidden[0] size {}, got {}")
        self._check_hidden(c0, self._expected_hidden(input, self.hidden_size),
                           "Expected hidden[1] size {}, got {}")
        output, h_n, c_n = self._run(input, h0, c0)
        assert c_n is not None
        if not batched:
            return self._unbatch(output), (h_n.squeeze(1), c_n.squeeze(1))
        return output, (h_n, c_n)


# ---- cells ---------------------------------------------------------------------------------
class RNNCellBase(Module):
    """The base of the cells: ``weight_ih`` (chunks * hidden, input), ``weight_hh``
    (chunks * hidden, hidden) and the biases, PyTorch's names and initialization.

    >>> RNNCellBase(4, 8, True, num_chunks=3).weight_hh.shape
    (24, 8)
    """

    def __init__(self, input_size: int, hidden_size: int, bias: bool, num_chunks: int,
                 device: str | None = None, dtype: Any = None) -> None:
        super().__init__()
        self.input_size, self.hidden_size, self.bias = input_size, hidden_size, bias
        rows = num_chunks * hidden_size
        self.weight_ih = Parameter(init._empty((rows, input_size), device, dtype))
        self.weight_hh = Parameter(init._empty((rows, hidden_size), device, dtype))
        if bias:
            self.bias_ih = Parameter(init._empty((rows,), device, dtype))
            self.bias_hh = Parameter(init._empty((rows,), device, dtype))
        else:
            self.register_parameter("bias_ih", None)
            self.register_parameter("bias_hh", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.hidden_size) if self.hidden_size > 0 else 0
        for weight in self.parameters():
            init.uniform_(weight, -bound, bound)

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}"
        if self.bias is not True:
            s += f", bias={self.bias}"
        nonlinearity = self.__dict__.get("nonlinearity", "tanh")
        if nonlinearity != "tanh":
            s += f", nonlinearity={nonlinearity}"
        return s

    def _batched(self, input: Tensor, states: Sequence[Tensor | None], name: str
                 ) -> tuple[Tensor, list[Tensor], bool]:
        """The input and states as (N, features), zeros for missing states, checked with
        PyTorch's messages; and whether the input was batched."""
        _check_input_tensor(input, name)
        if input.ndim not in (1, 2):
            raise ValueError(f"{name}: Expected input to be 1D or 2D, got {input.ndim}D "
                             "instead")
        for k, state in enumerate(states):
            if state is not None and state.ndim not in (1, 2):
                what = "hidden" if len(states) == 1 else f"hx[{k}]"
                raise ValueError(f"{name}: Expected {what} to be 1D or 2D, got {state.ndim}D "
                                 "instead")
        batched = input.ndim == 2
        if not batched:
            input = input.unsqueeze(0)
        if input.shape[1] != self.input_size:
            raise RuntimeError(f"input has inconsistent input_size: got {input.shape[1]} "
                               f"expected {self.input_size}")
        out: list[Tensor] = []
        for k, state in enumerate(states):
            if state is None:
                state = zeros(input.shape[0], self.hidden_size, dtype=input.dtype,
                              device=input.device)
            elif not batched:
                state = state.unsqueeze(0)
            if state.shape[0] != input.shape[0]:
                raise RuntimeError(f"Input batch size {input.shape[0]} doesn't match hidden{k} "
                                   f"batch size {state.shape[0]}")
            if state.shape[1] != self.hidden_size:
                raise RuntimeError(f"hidden{k} has inconsistent hidden_size: got "
                                   f"{state.shape[1]}, expected {self.hidden_size}")
            out.append(state)
        return input, out, batched

    def _products(self, input: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
        return (F.linear(input, self.weight_ih, self.bias_ih),
                F.linear(h, self.weight_hh, self.bias_hh))


class RNNCell(RNNCellBase):
    """One step of an Elman RNN: ``h' = act(x W_ih^T + b_ih + h W_hh^T + b_hh)``, act tanh or
    relu. ``forward(input, hx=None)``: (N, H_in) or (H_in,), hx (N, H) or (H,); returns h'.

    >>> import anygpu as ag
    >>> cell = RNNCell(10, 20)
    >>> h = ag.zeros(3, 20)
    >>> for x in ag.randn(6, 3, 10):
    ...     h = cell(x, h)
    >>> h.shape
    (3, 20)
    """

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True,
                 nonlinearity: str = "tanh", device: str | None = None,
                 dtype: Any = None) -> None:
        super().__init__(input_size, hidden_size, bias, 1, device, dtype)
        self.nonlinearity = nonlinearity

    def forward(self, input: Tensor, hx: Tensor | None = None) -> Tensor:
        input, (h,), batched = self._batched(input, [hx], "RNNCell")
        if self.nonlinearity not in ("tanh", "relu"):
            raise RuntimeError(f"Unknown nonlinearity: {self.nonlinearity}")
        out = _rnn_step(*self._products(input, h), self.nonlinearity)
        return out if batched else out.squeeze(0)


class LSTMCell(RNNCellBase):
    """One LSTM step (gates i, f, g, o): ``forward(input, (h, c)=None)`` returns (h', c').

    >>> import anygpu as ag
    >>> cell = LSTMCell(10, 20)
    >>> h, c = cell(ag.randn(3, 10))
    >>> h.shape, c.shape
    ((3, 20), (3, 20))
    """

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True,
                 device: str | None = None, dtype: Any = None) -> None:
        super().__init__(input_size, hidden_size, bias, 4, device, dtype)

    def forward(self, input: Tensor, hx: tuple[Tensor, Tensor] | None = None
                ) -> tuple[Tensor, Tensor]:
        states = [None, None] if hx is None else [hx[0], hx[1]]
        input, (h, c), batched = self._batched(input, states, "LSTMCell")
        xp, gh = self._products(input, h)
        *_, c, _, h = _lstm_step(xp + gh, c)
        return (h, c) if batched else (h.squeeze(0), c.squeeze(0))


class GRUCell(RNNCellBase):
    """One GRU step (gates r, z, n, PyTorch's formula): ``forward(input, hx=None)`` returns h'.

    >>> import anygpu as ag
    >>> cell = GRUCell(10, 20)
    >>> cell(ag.randn(10), ag.zeros(20)).shape
    (20,)
    """

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True,
                 device: str | None = None, dtype: Any = None) -> None:
        super().__init__(input_size, hidden_size, bias, 3, device, dtype)

    def forward(self, input: Tensor, hx: Tensor | None = None) -> Tensor:
        input, (h,), batched = self._batched(input, [hx], "GRUCell")
        out = _gru_step(*self._products(input, h), h)[3]
        return out if batched else out.squeeze(0)


__all__ = ["RNNBase", "RNN", "LSTM", "GRU", "RNNCellBase", "RNNCell", "LSTMCell", "GRUCell"]
