"""Rows cut from realized memory (``x[i:i + n]``) are read by kernels as buffers of their own, so
a step that slices a new batch each time compiles nothing new; values and aliasing stay
PyTorch's."""

from __future__ import annotations

import numpy as np

import anygpu as ag
from anygpu.graph import schedule as sched
from anygpu.runtime.registry import get_device


def _programs(device: str) -> int:
    return len(get_device(device)._programs)


def test_batches_cut_from_a_data_set_compile_once(device):
    rng = np.random.default_rng(3)
    data = rng.standard_normal((300, 7)).astype(np.float32)
    labels = rng.integers(0, 5, 300)
    x_all = ag.tensor(data, device=device)
    y_all = ag.tensor(labels, device=device)
    w = ag.tensor(rng.standard_normal((7, 5)).astype(np.float32), device=device)
    counts = []
    # the starts are no multiple of any alignment: the remainder repeats every 64 rows
    for start in [3 + 64 * k for k in range(4)]:
        xb, yb = x_all[start:start + 16], y_all[start:start + 16]
        logits = (xb @ w).relu() + 1
        picked = logits.gather(1, yb.reshape(16, 1)).sum()
        np.testing.assert_allclose(
            picked.item(),
            np.maximum(data[start:start + 16] @ w.numpy(), 0)[np.arange(16),
                                                              labels[start:start + 16]].sum()
            + 16, rtol=1e-4)
        counts.append(_programs(device))
    assert counts[1] == counts[2] == counts[3], counts


def test_rows_stay_views(device):
    rng = np.random.default_rng(4)
    host = rng.standard_normal((64, 8)).astype(np.float32)
    x = ag.tensor(host, device=device)
    rows = x[32:48]
    doubled = rows * 2             # computed before the write: the old values
    x.add_(1.0)                    # the rows show the new values
    np.testing.assert_allclose(rows.numpy(), host[32:48] + 1, rtol=1e-6)
    np.testing.assert_allclose(doubled.numpy(), host[32:48] * 2, rtol=1e-6)
    rows[0] = -5.0                 # a write through the rows reaches x
    assert x[32].numpy().tolist() == [-5.0] * 8
    # a write into x that reads other rows of x goes through a temporary
    x.assign(ag.cat([x[16:64], x[0:16]]))
    expect = np.concatenate([host[16:64], host[0:16]]) + 1
    expect[16] = -5.0
    np.testing.assert_allclose(x.numpy(), expect, rtol=1e-6)


def test_jit_replays_slices_of_its_inputs(device):
    # jit substitutes whole input buffers: rows of an input stay ordinary views while it records
    @ag.jit
    def head(t):
        return t[8:16] * 3

    rng = np.random.default_rng(5)
    for _ in range(4):
        host = rng.standard_normal((32, 4)).astype(np.float32)
        np.testing.assert_allclose(head(ag.tensor(host, device=device)).numpy(),
                                   host[8:16] * 3, rtol=1e-6)
    assert sched.recording is None


def test_rows_of_rows_and_crops_compile_once(device):
    # nanoGPT: train_data = data[:n], then windows train_data[i:i + block] stacked into a batch;
    # generation crops its growing context, idx[:, -block:]
    rng = np.random.default_rng(6)
    host = rng.integers(0, 50, 1000)
    data = ag.tensor(host, device=device)
    train = data[:900]
    table = rng.standard_normal((50, 4)).astype(np.float32)
    w = ag.tensor(table, device=device)
    counts = []
    for step in range(12):
        ix = rng.integers(0, 800, 4) if step else np.array([0, 1, 2, 3])
        xb = ag.stack([train[i:i + 8] for i in ix])
        got = w[xb].sum(-1)
        np.testing.assert_allclose(got.numpy(), table[np.stack([host[i:i + 8] for i in ix])]
                                   .sum(-1), rtol=1e-5, atol=1e-6)
        window = train[int(ix[0]) + 1:int(ix[0]) + 9]
        assert (window * 2).tolist() == (host[ix[0] + 1:ix[0] + 9] * 2).tolist()
        counts.append(_programs(device))
    # a new program at most for each new remainder of a start below the device's alignment
    align = max(get_device(device).sub_buffer_align // 8, 1)
    assert counts[-1] - counts[0] <= align, counts
    idx = ag.tensor([list(range(40))], device=device)
    table_t = ag.tensor(table[:, 0].copy(), device=device)
    before = None
    for t in range(40, 40 + 2 * align + 4):
        crop = idx[:, -16:]
        assert table_t[crop].tolist()[0] == table[np.arange(t - 16, t) % 50, 0].tolist()
        idx = ag.cat((idx, ag.tensor([[t % 50]], device=device)), dim=1)
        if t == 40 + align + 2:
            before = _programs(device)
    # after every remainder was seen, each token compiles only its new-length cat
    assert _programs(device) - before <= align + 2, (before, _programs(device))
