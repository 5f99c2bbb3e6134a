"""Every differentiable op's gradient against PyTorch autograd, on every device, with random
inputs from a seeded generator (float32). Gradients at ties, kinks and edge values are compared
in tests/ops/test_opinfo.py (the grad-*-tie cases)."""

from __future__ import annotations

from typing import Callable

import numpy as np
import pytest

import anygpu as ag
from anygpu.nn import functional as F

torch = pytest.importorskip("torch")


# seeded, so a failure reproduces; one generator, so no two inputs are equal by construction
_RNG = np.random.default_rng(20261123)


def _positive(shape: tuple[int, ...]) -> np.ndarray:
    return (_RNG.random(shape) + 0.5).astype(np.float32)


def _normal(shape: tuple[int, ...]) -> np.ndarray:
    return _RNG.standard_normal(shape).astype(np.float32)


def _distinct(shape: tuple[int, ...]) -> np.ndarray:
    """Values far apart, so max/min/relu have no ties or kinks near the inputs."""
    n = int(np.prod(shape))
    vals = _RNG.permutation(n).astype(np.float32) * 0.37 - n * 0.18
    return vals.reshape(shape)


# name -> (inputs, function applied to both libraries)
CASES: dict[str, tuple[list[np.ndarray], Callable]] = {
    "add": ([_normal((3, 4)), _normal((4,))], lambda a, b: a + b),
    "sub": ([_normal((3, 4)), _normal((3, 1))], lambda a, b: a - b),
    "mul": ([_normal((2, 3, 4)), _normal((3, 1))], lambda a, b: a * b),
    "div": ([_normal((3, 4)), _positive((3, 4))], lambda a, b: a / b),
    "pow": ([_positive((3, 4)), _normal((3, 4))], lambda a, b: a ** b),
    "pow_scalar": ([_normal((3, 4))], lambda a: a ** 3),
    "neg_abs": ([_distinct((3, 4))], lambda a: (-a).abs()),
    "exp_log": ([_positive((5,))], lambda a: a.exp() + a.log()),
    "sqrt_rsqrt": ([_positive((5,))], lambda a: a.sqrt() + a.rsqrt()),
    "sin_cos": ([_normal((6,))], lambda a: a.sin() * a.cos()),
    "tanh_sigmoid": ([_normal((6,))], lambda a: a.tanh() + a.sigmoid()),
    "relu_gelu_silu": ([_distinct((8,))], lambda a: a.relu() + F.gelu(a) + F.silu(a)
                       if not isinstance(a, torch.Tensor) else
                       a.relu() + torch.nn.functional.gelu(a) + torch.nn.functional.silu(a)),
    "erf": ([_normal((6,))], lambda a: a.erf() if not isinstance(a, torch.Tensor)
            else torch.erf(a)),
    "maximum_minimum": ([_distinct((4, 3)), _distinct((4, 3)) + 0.1],
                        lambda a, b: a.maximum(b) + a.minimum(b) * 2),
    "clip": ([_distinct((10,))], lambda a: a.clip(-1.0, 1.0)),
    "where": ([_normal((3, 4)), _normal((3, 4))], lambda a, b: ag.where(a > b, a, b * 2)
              if not isinstance(a, torch.Tensor) else torch.where(a > b, a, b * 2)),
    "sum_mean": ([_normal((3, 4, 5))], lambda a: a.sum(1) * 2 + a.mean((0, 2), keepdim=True).sum()),
    "max_min": ([_distinct((3, 5))], lambda a: a.amax(1) + a.amin(0).sum()),
    "prod": ([_positive((3, 4))], lambda a: a.prod(1)),
    "var_std": ([_normal((4, 6))], lambda a: a.var(1) + a.std(0).sum()),
    "logsumexp": ([_normal((4, 6))], lambda a: a.logsumexp(1)),
    "softmax": ([_normal((4, 6))], lambda a: a.softmax(-1) * a),
    "log_softmax": ([_normal((4, 6))], lambda a: a.log_softmax(0)),
    "reshape_permute": ([_normal((2, 3, 4))], lambda a: a.reshape(6, 4).T.reshape(2, 2, 6)
                        .permute(2, 0, 1)),
    "expand_squeeze": ([_normal((3, 1))], lambda a: a.expand(3, 5).unsqueeze(0).squeeze(0)),
    "flip_pad": ([_normal((3, 4))], lambda a: F.pad(a.flip(1), (1, 2, 0, 1))
                 if not isinstance(a, torch.Tensor)
                 else torch.nn.functional.pad(a.flip(1), (1, 2, 0, 1))),
    "slice_index": ([_normal((6, 5))], lambda a: a[1:5:2, 1:4] * 3 + a[[0, 2, 2]].sum()),
    "cat_stack_split": ([_normal((2, 3)), _normal((4, 3))],
                        lambda a, b: (ag.cat([a, b], 0) if isinstance(a, ag.Tensor)
                                      else torch.cat([a, b], 0)).split(3, 0)[1] * 2),
    "gather": ([_normal((4, 5))], lambda a: a.gather(1, ag.tensor([[0, 4], [1, 1], [3, 2], [0, 0]],
                                                                  device=a.device)
                                                   if isinstance(a, ag.Tensor) else
                                                   torch.tensor([[0, 4], [1, 1], [3, 2], [0, 0]]))),
    "matmul": ([_normal((2, 3, 4)), _normal((4, 5))], lambda a, b: a @ b),
    "conv2d": ([_normal((2, 4, 7, 6)), _normal((6, 2, 3, 3)), _normal((6,))],
               lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1, groups=2)
               if isinstance(x, ag.Tensor) else
               torch.nn.functional.conv2d(x, w, b, stride=2, padding=1, groups=2)),
    "repeat": ([_normal((2, 3))], lambda a: a.repeat(2, 2)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_gradient_matches_torch(device: str, name: str) -> None:
    make, fn = CASES[name]
    # fresh inputs per run: rebuild them with the same generator shapes
    arrays = [a if name in ("relu_gelu_silu", "max_min", "clip", "neg_abs", "maximum_minimum")
              else a + _RNG.standard_normal(a.shape).astype(np.float32) * 1e-3
              for a in make]
    ours = [ag.tensor(a, device=device, requires_grad=True) for a in arrays]
    theirs = [torch.tensor(a, requires_grad=True) for a in arrays]
    out, ref = fn(*ours), fn(*theirs)
    weight = _RNG.standard_normal(tuple(ref.shape)).astype(np.float32)
    (out * ag.tensor(weight, device=device)).sum().backward()
    (ref * torch.tensor(weight)).sum().backward()
    np.testing.assert_allclose(out.numpy(), ref.detach().numpy(), rtol=2e-4, atol=2e-5)
    for a, t in zip(ours, theirs):
        assert a.grad is not None, f"{name}: no gradient reached an input"
        np.testing.assert_allclose(a.grad.numpy(), t.grad.numpy(), rtol=2e-4, atol=5e-5)


def test_gradient_accumulates(device: str) -> None:
    x = ag.tensor(_normal((4,)), device=device, requires_grad=True)
    (x * 2).sum().backward()
    (x * 3).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), np.full(4, 5.0, np.float32))


def test_no_grad_and_detach(device: str) -> None:
    x = ag.tensor(_normal((4,)), device=device, requires_grad=True)
    with ag.no_grad():
        y = x * 2
    assert not y.requires_grad
    assert not x.detach().requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        y.sum().backward()


def test_errors() -> None:
    with pytest.raises(RuntimeError, match="floating-point"):
        ag.tensor([1, 2, 3], requires_grad=True)
    x = ag.tensor([1.0, 2.0], requires_grad=True)
    with pytest.raises(RuntimeError, match="scalar"):
        (x * 2).backward()
    # integer results cut the graph: argmax has no gradient to give
    assert not x.argmax().requires_grad


def _gradient_order(model: "ag.nn.Module", x: np.ndarray, device: str,
                    monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The parameters' names in the order backward realizes their gradients."""
    from anygpu.graph import schedule as sched

    names = {id(p): name for name, p in model.named_parameters()}
    orders: list[list[str]] = []
    real = sched.realize

    def recorded(*nodes, **kwargs):
        by_node = {id(p.grad.lazy): names[id(p)] for p in model.parameters()
                   if p.grad is not None}
        if len(nodes) > 1:
            orders.append([by_node.get(id(n), "?") for n in nodes])
        return real(*nodes, **kwargs)

    monkeypatch.setattr(sched, "realize", recorded)
    F.cross_entropy(model(ag.tensor(x, device=device)), ag.tensor([0, 2, 1, 1, 0][:len(x)],
                                                                  device=device)).backward()
    monkeypatch.setattr(sched, "realize", real)
    return orders


def test_leaf_gradients_are_computed_nearest_the_output_first(
        device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """backward realizes the leaves' gradients in one schedule, the last layer's first (as
    PyTorch's pass reaches them), so each layer's weight gradient runs once its output gradient
    is there and frees it; they had come first layer first, after the whole chain of input
    gradients. The gradients themselves stay PyTorch's."""
    model = ag.nn.Sequential(ag.nn.Linear(6, 7), ag.nn.ReLU(), ag.nn.Linear(7, 8), ag.nn.Tanh(),
                             ag.nn.Linear(8, 3)).to(device)
    x = _normal((5, 6))
    assert _gradient_order(model, x, device, monkeypatch) == \
        [["4.bias", "4.weight", "2.bias", "2.weight", "0.bias", "0.weight"]]
    tm = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.ReLU(), torch.nn.Linear(7, 8),
                             torch.nn.Tanh(), torch.nn.Linear(8, 3))
    with torch.no_grad():
        for (_, tp), p in zip(tm.named_parameters(), model.parameters()):
            tp.copy_(torch.from_numpy(p.numpy()))
    torch.nn.functional.cross_entropy(tm(torch.from_numpy(x)),
                                      torch.tensor([0, 2, 1, 1, 0])).backward()
    for (name, tp), p in zip(tm.named_parameters(), model.parameters()):
        np.testing.assert_allclose(p.grad.numpy(), tp.grad.numpy(), rtol=2e-4, atol=5e-5,
                                   err_msg=name)


class _Residual(ag.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.branch = ag.nn.Linear(6, 8), ag.nn.Linear(8, 8)
        self.last = ag.nn.Linear(8, 3)

    def forward(self, x: ag.Tensor) -> ag.Tensor:
        h = self.first(x)
        return self.last(h + self.branch(h.relu()).tanh())


def test_a_shortcut_does_not_bring_the_first_layer_forward(
        device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nearest the output is counted along the longest way back: through a residual block's
    shortcut the first layer is fewer steps from the output than the block's own layer, yet
    its gradient needs the block's; counted along the shortest way, ResNet-18's stem gradients
    ran before its first blocks' weight gradients, their 112 x 112 maps alive beside those
    blocks' unfolded windows (its fp32 step at batch 16, 224 x 224: 837 MiB, 688 before)."""
    model = _Residual().to(device)
    assert _gradient_order(model, _normal((4, 6)), device, monkeypatch) == \
        [["last.bias", "last.weight", "branch.bias", "branch.weight", "first.bias",
          "first.weight"]]


def test_a_bias_gradient_reads_the_stored_output_gradient(device: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Run nearest the output first, the leaves' gradients are still planned in the order the
    pass reached them: the last layer's bias gradient (a sum over the batch) reads the output
    gradient that the weight's and the input's products store, rather than computing the
    softmax's gradient again in its own kernel (planned first, it had: the demo's step on the
    processor took 3.4x as long)."""
    from anygpu.graph import schedule as sched

    ran: list = []
    real = sched._run_kernel
    monkeypatch.setattr(sched, "_run_kernel", lambda item: (ran.append(item), real(item))[1])
    model = ag.nn.Sequential(ag.nn.Linear(6, 7), ag.nn.ReLU(), ag.nn.Linear(7, 3)).to(device)
    x = ag.tensor(_normal((5, 6)), device=device)
    loss = F.cross_entropy(model(x), ag.tensor([0, 2, 1, 1, 0], device=device))
    ran.clear()  # (the parameters' initialization)
    loss.backward()
    bias = [item for item in ran if item.ast.output.shape == (3,)]
    assert len(bias) == 1 and [n.shape for n in bias[0].ast.inputs] == [(5, 3)], \
        [[n.shape for n in item.ast.inputs] for item in bias]
