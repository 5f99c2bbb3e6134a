"""RNN, LSTM, GRU and their cells against torch with the same weights, on every device:
outputs, final states and the gradients of the input, the initial states and every weight."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import anygpu as ag
from anygpu import nn
from anygpu.runtime.registry import get_device

torch = pytest.importorskip("torch")
tnn = torch.nn

# small sizes shared by every case, so that the cases reuse each other's kernels; a step's rows
# are 256 bytes (unbatched) or a multiple of it, so that every step's slice starts where a
# device can start a buffer, and the steps share one kernel on every backend
LENGTH, BATCH, INPUT, HIDDEN = 5, 2, 3, 64


def ported(ours, theirs, device):
    """``ours`` with ``theirs``'s weights (through NumPy), on ``device``, in the same mode."""
    result = ours.load_state_dict({k: v.detach().numpy() for k, v in theirs.state_dict().items()})
    assert not result.missing_keys and not result.unexpected_keys
    assert list(ours.state_dict()) == list(theirs.state_dict())
    ours.train(theirs.training)
    return ours.to(device)


def both(x, device):
    """(our tensor, torch's tensor) holding ``x``, both requiring gradients."""
    return (ag.tensor(x, device=device, requires_grad=True),
            torch.tensor(x, requires_grad=True))


def backward_both(pairs, device, randn, seed):
    """Backpropagate ``sum(out * r)`` over (ours, theirs) output pairs, r random per pair."""
    ours_loss = theirs_loss = None
    for k, (ours, theirs) in enumerate(pairs):
        r = randn(tuple(theirs.shape), seed + k)
        a = (ours * ag.tensor(r, device=device)).sum()
        b = (theirs * torch.tensor(r)).sum()
        ours_loss = a if ours_loss is None else ours_loss + a
        theirs_loss = b if theirs_loss is None else theirs_loss + b
    ours_loss.backward()
    theirs_loss.backward()


def check_grads(close, ours_module, theirs_module, leaves):
    """The gradients of the (ours, theirs) leaves and of every parameter agree."""
    for ours, theirs in leaves:
        close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-5)
    theirs_params = dict(theirs_module.named_parameters())
    for name, p in ours_module.named_parameters():
        assert p.grad is not None, name
        close(p.grad, theirs_params[name].grad, rtol=1e-4, atol=1e-5)


LAYER_CASES = [
    dict(name="rnn", kind="RNN", h0=True),
    dict(name="rnn-relu-2-layers-bidirectional-no-bias-no-h0", kind="RNN", nonlinearity="relu",
         num_layers=2, bidirectional=True, bias=False),
    dict(name="rnn-unbatched-batch-first", kind="RNN", batch_first=True, unbatched=True,
         h0=True),
    dict(name="lstm", kind="LSTM", h0=True),
    dict(name="lstm-2-layers-bidirectional-batch-first-no-h0", kind="LSTM", num_layers=2,
         bidirectional=True, batch_first=True),
    dict(name="lstm-unbatched-no-bias", kind="LSTM", unbatched=True, bias=False, h0=True),
    dict(name="lstm-proj-bidirectional", kind="LSTM", proj_size=32, bidirectional=True,
         h0=True),
    dict(name="gru", kind="GRU", h0=True),
    dict(name="gru-2-layers-bidirectional-batch-first-no-bias", kind="GRU", num_layers=2,
         bidirectional=True, batch_first=True, bias=False, h0=True),
    dict(name="gru-unbatched-no-h0", kind="GRU", unbatched=True),
]


@pytest.mark.parametrize("case", LAYER_CASES, ids=[c["name"] for c in LAYER_CASES])
def test_layer(device, close, randn, case):
    kw = {k: v for k, v in case.items() if k not in ("name", "kind", "h0", "unbatched")}
    kind, unbatched, batch_first = case["kind"], case.get("unbatched", False), \
        kw.get("batch_first", False)
    torch.manual_seed(10)
    theirs = getattr(tnn, kind)(INPUT, HIDDEN, **kw)
    ours = ported(getattr(nn, kind)(INPUT, HIDDEN, **kw), theirs, device)
    directions = 2 if kw.get("bidirectional") else 1
    states = directions * kw.get("num_layers", 1)
    out_size = kw.get("proj_size") or HIDDEN
    if unbatched:
        shape, state_batch = (LENGTH, INPUT), ()
    else:
        shape = (BATCH, LENGTH, INPUT) if batch_first else (LENGTH, BATCH, INPUT)
        state_batch = (BATCH,)
    ox, tx = both(randn(shape, 11), device)
    leaves = [(ox, tx)]
    ours_hx = theirs_hx = None
    if case.get("h0"):
        oh, th = both(randn((states, *state_batch, out_size), 12), device)
        leaves.append((oh, th))
        ours_hx, theirs_hx = oh, th
        if kind == "LSTM":
            oc, tc = both(randn((states, *state_batch, HIDDEN), 13), device)
            leaves.append((oc, tc))
            ours_hx, theirs_hx = (oh, oc), (th, tc)
    with warnings.catch_warnings():  # torch: "LSTM with projections is not supported with oneDNN"
        warnings.simplefilter("ignore")
        ref, ref_state = theirs(tx, theirs_hx)
    got, got_state = ours(ox, ours_hx)
    close(got, ref)
    pairs = [(got, ref)]
    if kind == "LSTM":
        close(got_state[0], ref_state[0])
        close(got_state[1], ref_state[1])
        pairs += [(got_state[0], ref_state[0]), (got_state[1], ref_state[1])]
    else:
        close(got_state, ref_state)
        pairs.append((got_state, ref_state))
    backward_both(pairs, device, randn, 20)
    check_grads(close, ours, theirs, leaves)


CELL_CASES = [
    dict(name="rnn-cell", kind="RNNCell", state=True),
    dict(name="rnn-cell-relu-unbatched-no-bias", kind="RNNCell", nonlinearity="relu",
         unbatched=True, bias=False, state=True),
    dict(name="lstm-cell", kind="LSTMCell", state=True),
    dict(name="lstm-cell-unbatched-no-state-no-bias", kind="LSTMCell", unbatched=True,
         bias=False),
    dict(name="gru-cell-no-state", kind="GRUCell"),
    dict(name="gru-cell-unbatched-no-bias", kind="GRUCell", unbatched=True, bias=False,
         state=True),
]


@pytest.mark.parametrize("case", CELL_CASES, ids=[c["name"] for c in CELL_CASES])
def test_cell(device, close, randn, case):
    kw = {k: v for k, v in case.items() if k not in ("name", "kind", "state", "unbatched")}
    kind = case["kind"]
    torch.manual_seed(30)
    theirs = getattr(tnn, kind)(INPUT, HIDDEN, **kw)
    ours = ported(getattr(nn, kind)(INPUT, HIDDEN, **kw), theirs, device)
    batch = () if case.get("unbatched") else (BATCH,)
    ox, tx = both(randn((*batch, INPUT), 31), device)
    leaves = [(ox, tx)]
    ours_hx = theirs_hx = None
    if case.get("state"):
        oh, th = both(randn((*batch, HIDDEN), 32), device)
        leaves.append((oh, th))
        ours_hx, theirs_hx = oh, th
        if kind == "LSTMCell":
            oc, tc = both(randn((*batch, HIDDEN), 33), device)
            leaves.append((oc, tc))
            ours_hx, theirs_hx = (oh, oc), (th, tc)
    # two steps, the second from the first's state, as a loop over a sequence runs them
    got, ref = ours(ox, ours_hx), theirs(tx, theirs_hx)
    got, ref = ours(ox * 0.5, got), theirs(tx * 0.5, ref)
    pairs = list(zip(got, ref)) if kind == "LSTMCell" else [(got, ref)]
    for g, r in pairs:
        close(g, r)
    backward_both(pairs, device, randn, 40)
    check_grads(close, ours, theirs, leaves)


def _programs(device: str) -> int:
    return len(get_device(device)._programs)


def test_steps_share_kernels(device):
    """Every step of a sequence runs the same kernels, forward and backward: a longer sequence
    compiles only the few kernels whose sizes follow its length (projections, stacking,
    weight gradients), not kernels for each new step."""
    lstm = nn.LSTM(INPUT, HIDDEN).to(device)

    def step(length: int) -> None:
        x = ag.randn(length, BATCH, INPUT, device=device, requires_grad=True)
        out, (h_n, c_n) = lstm(x)
        (out.sum() + h_n.sum() + c_n.sum()).backward()
        ag.realize(x.grad, *(p.grad for p in lstm.parameters()))
        for p in lstm.parameters():
            p.grad = None

    step(12)
    before = _programs(device)
    step(36)  # 24 more steps: kernels compiled per step would be 2 to 4 times as many
    assert _programs(device) - before <= 24


def test_state_dict_init_and_repr():
    for kw in (dict(), dict(num_layers=2, bidirectional=True, bias=False),
               dict(proj_size=3, num_layers=2, bidirectional=True)):
        theirs, ours = tnn.LSTM(INPUT, HIDDEN, **kw), nn.LSTM(INPUT, HIDDEN, **kw)
        assert [(k, tuple(v.shape)) for k, v in ours.state_dict().items()] == \
            [(k, tuple(v.shape)) for k, v in theirs.state_dict().items()]
        assert repr(ours) == repr(theirs)
        assert [[p.shape for p in w] for w in ours.all_weights] == \
            [[tuple(p.shape) for p in w] for w in theirs.all_weights]
    for kind in ("RNN", "GRU", "RNNCell", "LSTMCell", "GRUCell"):
        theirs, ours = getattr(tnn, kind)(INPUT, HIDDEN), getattr(nn, kind)(INPUT, HIDDEN)
        assert [(k, tuple(v.shape)) for k, v in ours.state_dict().items()] == \
            [(k, tuple(v.shape)) for k, v in theirs.state_dict().items()]
        assert repr(ours) == repr(theirs)
    assert repr(nn.RNNCell(3, 4, False, "relu")) == repr(tnn.RNNCell(3, 4, False, "relu"))
    assert repr(nn.RNN(3, 4, 2, "relu")) == repr(tnn.RNN(3, 4, 2, "relu"))
    # every weight from U(-1/sqrt(hidden), 1/sqrt(hidden))
    bound = 1 / np.sqrt(64)
    for m in (nn.GRU(16, 64), nn.LSTMCell(16, 64), nn.LSTM(16, 64, proj_size=8)):
        for name, p in m.named_parameters():
            values = p.numpy()
            assert np.abs(values).max() <= bound, name
            assert values.std() > bound / 2, name  # spread over the interval (std bound/sqrt 3)


def test_dropout_between_layers(device):
    lstm = nn.LSTM(INPUT, HIDDEN, num_layers=2, dropout=0.5).to(device)
    x = ag.randn(LENGTH, BATCH, INPUT, device=device)
    a, b = lstm(x)[0].numpy(), lstm(x)[0].numpy()
    assert not np.allclose(a, b)
    lstm.eval()
    np.testing.assert_array_equal(lstm(x)[0].numpy(), lstm(x)[0].numpy())
    with pytest.warns(UserWarning, match="num_layers greater than 1"):
        nn.GRU(INPUT, HIDDEN, dropout=0.5)


def _error(fn, *args):
    """(type, message) of what ``fn(*args)`` raises."""
    with pytest.raises(Exception) as info:
        fn(*args)
    return type(info.value), str(info.value)


def _same_error(ours, theirs, *shapes):
    """``ours`` and ``theirs`` raise the same for zero inputs of ``shapes`` (a pair of shapes
    is an (h, c) tuple)."""
    def inputs(make):
        return [(make(*s[0]), make(*s[1])) if isinstance(s[0], tuple) else make(*s)
                for s in shapes]

    assert _error(ours, *inputs(ag.zeros)) == _error(theirs, *inputs(torch.zeros))


def test_errors_match_torch():
    """Wrong shapes raise PyTorch's exception types and messages."""
    for kind in ("RNN", "LSTM", "GRU"):
        ours, theirs = getattr(nn, kind)(4, 5, 2), getattr(tnn, kind)(4, 5, 2)
        for shape in [(7, 3, 6), (7, 3, 4, 1), (4,), (0, 3, 4)]:
            _same_error(ours, theirs, shape)
        for h in [(1, 3, 5), (2, 2, 5), (2, 3, 6), (2, 5)]:
            if kind == "LSTM":
                _same_error(ours, theirs, (7, 3, 4), (h, (2, 3, 5)))
                _same_error(ours, theirs, (7, 3, 4), ((2, 3, 5), h))
            else:
                _same_error(ours, theirs, (7, 3, 4), h)
        state = ((2, 3, 5), (2, 3, 5)) if kind == "LSTM" else (2, 3, 5)
        _same_error(ours, theirs, (7, 4), state)  # unbatched input, batched state
    for kind in ("RNNCell", "LSTMCell", "GRUCell"):
        ours, theirs = getattr(nn, kind)(4, 5), getattr(tnn, kind)(4, 5)
        for x, h in [((3, 6), (3, 5)), ((3, 4), (2, 5)), ((3, 4), (3, 6)), ((3, 4, 1), (3, 5)),
                     ((3, 4), (3, 5, 1))]:
            if kind == "LSTMCell":
                _same_error(ours, theirs, x, (h, (3, 5)))
                _same_error(ours, theirs, x, ((3, 5), h))
            else:
                _same_error(ours, theirs, x, h)


CONSTRUCTOR_ERRORS = [("RNN", (4, 5), dict(nonlinearity="sigmoid")),
                      ("LSTM", (4, 5), dict(proj_size=5)), ("LSTM", (4, 5), dict(proj_size=-1)),
                      ("GRU", (4, 5), dict(dropout=1.5)), ("GRU", (4, 0), {}),
                      ("LSTM", (4.0, 5), {}), ("RNN", (4, 5), dict(num_layers=0)),
                      ("GRU", (4, 5), dict(bias=1))]


@pytest.mark.parametrize("kind, args, kw", CONSTRUCTOR_ERRORS)
def test_constructor_errors_match_torch(kind, args, kw):
    assert _error(lambda: getattr(nn, kind)(*args, **kw)) == \
        _error(lambda: getattr(tnn, kind)(*args, **kw))


def test_cell_nonlinearity_error():
    with pytest.raises(RuntimeError, match="Unknown nonlinearity: sigmoid"):
        nn.RNNCell(4, 5, nonlinearity="sigmoid")(ag.zeros(2, 4))


def test_packed_sequence_is_refused():
    packed = tnn.utils.rnn.pack_padded_sequence(torch.zeros(5, 2, 4), [5, 3])
    with pytest.raises(TypeError, match="PackedSequence"):
        nn.LSTM(4, 5)(packed)
    with pytest.raises(TypeError, match="anygpu Tensor"):
        nn.GRU(4, 5)(np.zeros((5, 2, 4), np.float32))
    with pytest.raises(ValueError, match="dtype"):
        nn.RNN(4, 5)(ag.zeros(5, 2, 4, dtype=ag.float16))
