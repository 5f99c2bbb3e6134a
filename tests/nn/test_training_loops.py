"""Every layer with parameters, trained for a few steps of an ordinary PyTorch-style loop (the
loss kept in a variable, ``zero_grad``/``backward``/``step``), ends each step with the same
parameters as the same layer in PyTorch, with and without ``jit``."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

import anygpu as ag
from anygpu import nn

torch = pytest.importorskip("torch")

STEPS = 4

# (name, build the layer in a library, make an input batch from a NumPy generator)
LAYERS: list[tuple[str, Callable[[Any], Any], Callable[[np.random.Generator], np.ndarray]]] = [
    ("linear", lambda m: m.Linear(5, 3), lambda r: r.standard_normal((4, 5))),
    ("embedding", lambda m: m.Embedding(7, 3), lambda r: r.integers(0, 7, (4, 2))),
    ("embedding_padding", lambda m: m.Embedding(7, 3, padding_idx=1),
     lambda r: np.array([[1, 2], [3, 1], [5, 6], [2, 2]])),
    ("conv2d", lambda m: m.Conv2d(2, 3, 3, padding=1), lambda r: r.standard_normal((2, 2, 5, 5))),
    ("conv_transpose2d", lambda m: m.ConvTranspose2d(2, 3, 3, stride=2),
     lambda r: r.standard_normal((2, 2, 3, 3))),
    ("batchnorm2d", lambda m: m.BatchNorm2d(3), lambda r: r.standard_normal((4, 3, 2, 2))),
    ("batchnorm1d", lambda m: m.BatchNorm1d(3), lambda r: r.standard_normal((6, 3))),
    ("layernorm", lambda m: m.LayerNorm(4), lambda r: r.standard_normal((3, 4))),
    ("groupnorm", lambda m: m.GroupNorm(2, 4), lambda r: r.standard_normal((2, 4, 3))),
    ("rmsnorm", lambda m: m.RMSNorm(4), lambda r: r.standard_normal((3, 4))),
]

OPTIMIZERS = {
    "sgd": lambda lib, ps: lib.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adamw": lambda lib, ps: lib.optim.AdamW(ps, lr=0.05),
}


def _data(make: Callable[[np.random.Generator], np.ndarray], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(STEPS):
        x = np.asarray(make(rng))
        out.append(x.astype(np.float32) if x.dtype.kind == "f" else x.astype(np.int64))
    return out


@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("name,build,make", LAYERS, ids=[n for n, _, _ in LAYERS])
def test_parameters_follow_pytorch(device: str, name: str, build: Callable[[Any], Any],
                                   make: Callable[[np.random.Generator], np.ndarray],
                                   opt_name: str, use_jit: bool) -> None:
    seed = 1234
    torch.manual_seed(seed)
    theirs = build(torch.nn)
    with torch.no_grad():  # affine norms start at ones/zeros: move them off so every term shows
        for p in theirs.parameters():
            p.add_(torch.randn(p.shape) * 0.1)
    ours = build(nn)
    ours.load_state_dict(theirs.state_dict())
    ours = ours.to(device)
    topt = OPTIMIZERS[opt_name](torch, list(theirs.parameters()))
    opt = OPTIMIZERS[opt_name](ag, list(ours.parameters()))
    weights = np.random.default_rng(seed + 1).standard_normal(512).astype(np.float32)

    def loss_of(lib: Any, out: Any) -> Any:
        w = lib.tensor(weights[:out.numel()].reshape(out.shape))
        if lib is ag:
            w = w.to(device)
        return (out * w).sum()  # a loss whose gradient differs per element

    def step(x: Any) -> Any:
        opt.zero_grad()
        loss = loss_of(ag, ours(x))
        loss.backward()
        opt.step()
        return loss

    run = ag.jit(step) if use_jit else step
    # Adam divides by sqrt(v): float32 rounding of tiny gradients shows up magnified, in the
    # parameters and in the next losses, hence tolerances of 1e-3
    for i, x in enumerate(_data(make, seed)):
        topt.zero_grad()
        tloss = loss_of(torch, theirs(torch.tensor(x)))
        tloss.backward()
        topt.step()
        loss = run(ag.tensor(x, device=device))
        np.testing.assert_allclose(loss.item(), tloss.item(), rtol=1e-3, atol=1e-4,
                                   err_msg=f"{name}: loss of step {i}")
        ref = {k: v.detach().numpy() for k, v in theirs.state_dict().items()}
        for key, value in ours.state_dict().items():
            np.testing.assert_allclose(value.numpy(), ref[key], rtol=1e-3, atol=1e-4,
                                       err_msg=f"{name}: {key} after step {i}")
