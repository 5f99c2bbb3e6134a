"""Gradient clipping and batch-norm folding against torch.nn.utils; deep copies of models."""

from __future__ import annotations

import numpy as np
import pytest

import anygpu as ag

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_grad_norm_matches_torch(device: str, norm_type: float) -> None:
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s).astype(np.float32) * 3 for s in [(4, 3), (5,), (2, 2, 2)]]
    ours = [ag.tensor(a, device=device, requires_grad=True) for a in arrays]
    theirs = [torch.tensor(a, requires_grad=True) for a in arrays]
    sum(((p * p).sum() for p in ours), ag.tensor(0.0, device=device)).backward()
    sum((p * p).sum() for p in theirs).backward()
    total = ag.nn.utils.clip_grad_norm_(ours, 1.5, norm_type)
    ref = torch.nn.utils.clip_grad_norm_(theirs, 1.5, norm_type)
    assert total.item() == pytest.approx(ref.item(), rel=1e-5)
    for p, t in zip(ours, theirs):
        np.testing.assert_allclose(p.grad.numpy(), t.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_clip_grad_value(device: str) -> None:
    w = ag.tensor([1.0, -2.0, 3.0], device=device, requires_grad=True)
    (w * w).sum().backward()
    ag.nn.utils.clip_grad_value_([w], 3.0)
    np.testing.assert_allclose(w.grad.numpy(), [2.0, -3.0, 3.0])


def _conv_bn(device: str, seed: int) -> tuple[object, object, object, object]:
    """A convolution and a batch norm with random weights and running statistics, in anygpu
    and in torch."""
    rng = np.random.default_rng(seed)
    tconv = torch.nn.Conv2d(6, 10, 3, padding=1, groups=2)
    tbn = torch.nn.BatchNorm2d(10, eps=1e-3)
    with torch.no_grad():
        tbn.running_mean.copy_(torch.from_numpy(rng.standard_normal(10).astype(np.float32)))
        tbn.running_var.copy_(torch.from_numpy(rng.uniform(0.5, 2, 10).astype(np.float32)))
        tbn.weight.copy_(torch.from_numpy(rng.standard_normal(10).astype(np.float32)))
        tbn.bias.copy_(torch.from_numpy(rng.standard_normal(10).astype(np.float32)))
    conv = ag.nn.Conv2d(6, 10, 3, padding=1, groups=2, device=device)
    bn = ag.nn.BatchNorm2d(10, eps=1e-3, device=device)
    conv.load_state_dict({k: v.numpy() for k, v in tconv.state_dict().items()})
    bn.load_state_dict({k: v.numpy() for k, v in tbn.state_dict().items()})
    return conv.eval(), bn.eval(), tconv.eval(), tbn.eval()


def test_fuse_conv_bn_eval_matches_torch(device: str) -> None:
    from anygpu.graph.schedule import count_kernels

    conv, bn, tconv, tbn = _conv_bn(device, 0)
    x = np.random.default_rng(1).standard_normal((2, 6, 9, 11)).astype(np.float32)
    fused = ag.nn.utils.fuse_conv_bn_eval(conv, bn)
    tfused = torch.nn.utils.fuse_conv_bn_eval(tconv, tbn)
    out = fused(ag.tensor(x, device=device)).relu()
    # convolution, bias and activation: one kernel (the processor stores the padded input
    # first, which its compiled convolution then reads without bounds checks)
    assert count_kernels([out.lazy]) == (2 if device.startswith("cpu") else 1)
    want = tfused(torch.from_numpy(x)).relu().detach().numpy()
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(fused.weight.numpy(), tfused.weight.detach().numpy(),
                               rtol=1e-5, atol=1e-6)
    # the originals are untouched, and still compute conv then batch norm
    unfused = bn(conv(ag.tensor(x, device=device))).relu().numpy()
    np.testing.assert_allclose(unfused, want, rtol=1e-4, atol=1e-4)


def test_fuse_conv_bn_eval_refuses_training_modules(device: str) -> None:
    conv, bn, _, _ = _conv_bn(device, 2)
    with pytest.raises(ValueError, match="eval mode"):
        ag.nn.utils.fuse_conv_bn_eval(conv, bn.train())


def test_deepcopy_owns_its_memory(device: str) -> None:
    import copy

    model = ag.nn.Sequential(ag.nn.Linear(4, 3), ag.nn.BatchNorm1d(3)).to(device)
    twin = copy.deepcopy(model)
    before = model[0].weight.numpy().copy()
    with ag.no_grad():
        twin[0].weight.assign(twin[0].weight * 2)
    assert isinstance(twin[0].weight, ag.nn.Parameter) and twin[0].weight.requires_grad
    np.testing.assert_array_equal(model[0].weight.numpy(), before)
    np.testing.assert_allclose(twin[0].weight.numpy(), 2 * before, rtol=1e-6)
    assert list(twin.state_dict()) == list(model.state_dict())
    with pytest.raises(RuntimeError, match="leaves"):
        copy.deepcopy(model[0].weight * 2)
