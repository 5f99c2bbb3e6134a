"""Layers against torch.nn with the same weights, on every available device."""

from __future__ import annotations

import math

import numpy as np
import pytest

import anygpu as ag
from anygpu import nn

torch = pytest.importorskip("torch")
tnn = torch.nn


def run(ours, theirs, x, device, port):
    """(our output, torch's output) for input ``x`` after porting the weights."""
    ours = port(ours, theirs, device)
    return ours(ag.tensor(x, device=device)), theirs(torch.tensor(x))


@pytest.mark.parametrize("bias", [True, False])
def test_linear(device, port, close, randn, bias):
    torch.manual_seed(0)
    got, ref = run(nn.Linear(5, 3, bias=bias), tnn.Linear(5, 3, bias=bias), randn((2, 4, 5), 1),
                   device, port)
    close(got, ref)


CONVS = [
    dict(in_channels=3, out_channels=4, kernel_size=3),
    dict(in_channels=4, out_channels=6, kernel_size=(3, 2), stride=2, padding=(1, 0),
         groups=2, bias=False),
    dict(in_channels=2, out_channels=4, kernel_size=3, padding="same", dilation=2),
    dict(in_channels=4, out_channels=4, kernel_size=3, groups=4, padding=1,
         padding_mode="reflect"),
    dict(in_channels=3, out_channels=2, kernel_size=2, padding="valid", padding_mode="circular"),
]


@pytest.mark.parametrize("kw", CONVS, ids=range(len(CONVS)))
def test_conv2d(device, port, close, randn, kw):
    torch.manual_seed(1)
    x = randn((2, kw["in_channels"], 7, 6), 2)
    got, ref = run(nn.Conv2d(**kw), tnn.Conv2d(**kw), x, device, port)
    close(got, ref)


TCONVS = [
    dict(in_channels=3, out_channels=2, kernel_size=3),
    dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=1, output_padding=1,
         groups=2),
    dict(in_channels=2, out_channels=3, kernel_size=(2, 3), stride=(3, 1), dilation=2,
         bias=False),
]


@pytest.mark.parametrize("kw", TCONVS, ids=range(len(TCONVS)))
def test_conv_transpose2d(device, port, close, randn, kw):
    torch.manual_seed(2)
    x = randn((2, kw["in_channels"], 4, 5), 3)
    got, ref = run(nn.ConvTranspose2d(**kw), tnn.ConvTranspose2d(**kw), x, device, port)
    close(got, ref)


def test_conv_transpose2d_output_size(port, close, randn):
    torch.manual_seed(3)
    theirs = tnn.ConvTranspose2d(2, 2, 3, stride=2, padding=1)
    ours = port(nn.ConvTranspose2d(2, 2, 3, stride=2, padding=1), theirs, "cpu")
    x = randn((1, 2, 4, 4), 4)
    for size in [(7, 7), (8, 7), [1, 2, 8, 8]]:
        close(ours(ag.tensor(x), output_size=size), theirs(torch.tensor(x), output_size=size))
    with pytest.raises(ValueError, match="valid sizes range from 7 to 8"):
        ours(ag.tensor(x), output_size=(9, 9))


@pytest.mark.parametrize("kw", [dict(), dict(momentum=None), dict(affine=False),
                                dict(track_running_stats=False)],
                         ids=["default", "cumulative", "no-affine", "no-running"])
def test_batchnorm2d(device, port, close, randn, kw):
    torch.manual_seed(4)
    theirs, ours = tnn.BatchNorm2d(3, **kw), nn.BatchNorm2d(3, **kw)
    if kw.get("affine", True):
        with torch.no_grad():
            theirs.weight.uniform_(0.5, 1.5)
            theirs.bias.uniform_(-1, 1)
    ours = port(ours, theirs, device)
    for step in range(2):
        x = randn((3, 3, 4, 5), 5 + step, scale=1.5) + 0.5
        close(ours(ag.tensor(x, device=device)), theirs(torch.tensor(x)), atol=1e-4)
    ours.eval()
    theirs.eval()
    x = randn((2, 3, 4, 5), 9)
    close(ours(ag.tensor(x, device=device)), theirs(torch.tensor(x)), atol=1e-4)
    for key, value in theirs.state_dict().items():
        close(ours.state_dict()[key], value)


@pytest.mark.parametrize("shape", [(6, 4), (3, 4, 5)])
def test_batchnorm1d(device, port, close, randn, shape):
    torch.manual_seed(5)
    theirs, ours = tnn.BatchNorm1d(4), port(nn.BatchNorm1d(4), tnn.BatchNorm1d(4), device)
    x = randn(shape, 6, scale=2.0)
    close(ours(ag.tensor(x, device=device)), theirs(torch.tensor(x)), atol=1e-4)
    close(ours.running_var, theirs.running_var)
    with pytest.raises(ValueError, match="expected 2D or 3D input"):
        ours(ag.ones(2, 4, 1, 1, device=device))


def test_batchnorm_single_value_per_channel_in_training():
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        nn.BatchNorm1d(3)(ag.ones(1, 3))


def test_batchnorm_updates_running_stats_in_place(port, close, randn):
    torch.manual_seed(4)
    theirs = tnn.BatchNorm2d(2, momentum=None)
    ours = port(nn.BatchNorm2d(2, momentum=None), theirs, "cpu")
    buffers = [b.lazy.buffer for b in ours.buffers()]
    step = ag.jit(ours)  # captured on the second call, replayed after: updates must replay too
    for i in range(4):
        x = randn((2, 2, 3, 3), 20 + i, scale=1 + i)
        close(step(ag.tensor(x)), theirs(torch.tensor(x)), atol=1e-5)
    assert [b.lazy.buffer for b in ours.buffers()] == buffers
    for key, value in theirs.state_dict().items():
        close(ours.state_dict()[key], value)


def test_layer_rms_group_norm(device, port, close, randn):
    torch.manual_seed(6)
    x = randn((2, 4, 3, 5), 7, scale=2.0) + 1
    pairs = [(nn.LayerNorm(5), tnn.LayerNorm(5)),
             (nn.LayerNorm((3, 5), bias=False), tnn.LayerNorm((3, 5), bias=False)),
             (nn.RMSNorm([5]), tnn.RMSNorm([5])),
             (nn.RMSNorm(5, eps=1e-3, elementwise_affine=False),
              tnn.RMSNorm(5, eps=1e-3, elementwise_affine=False)),
             (nn.GroupNorm(2, 4), tnn.GroupNorm(2, 4)),
             (nn.GroupNorm(4, 4, affine=False), tnn.GroupNorm(4, 4, affine=False))]
    for ours, theirs in pairs:
        with torch.no_grad():
            for p in theirs.parameters():
                p.uniform_(0.5, 1.5)
        got, ref = run(ours, theirs, x, device, port)
        close(got, ref, atol=1e-4)


def test_embedding(device, port, close):
    torch.manual_seed(7)
    theirs = tnn.Embedding(10, 4, padding_idx=-2)
    ours = port(nn.Embedding(10, 4, padding_idx=-2), theirs, device)
    assert ours.padding_idx == 8
    idx = np.random.default_rng(8).integers(0, 10, (3, 5))
    idx[0, 0] = 8
    close(ours(ag.tensor(idx, device=device)), theirs(torch.tensor(idx)))
    close(ours(ag.tensor(idx.astype(np.int32), device=device)), theirs(torch.tensor(idx)))
    frozen = nn.Embedding.from_pretrained(ag.tensor(theirs.weight.detach().numpy()))
    assert not frozen.weight.requires_grad and frozen.weight.shape == (10, 4)


def test_embedding_default_init():
    ag.manual_seed(0)
    w = nn.Embedding(200, 50, padding_idx=3).weight.numpy()
    assert np.all(w[3] == 0)
    assert abs(w.mean()) < 0.05 and abs(w.std() - 1) < 0.05


def test_default_init_matches_torch_distribution():
    ag.manual_seed(1)
    for layer, fan_in in [(nn.Linear(40, 300), 40), (nn.Conv2d(6, 40, 3, groups=2), 27),
                          (nn.ConvTranspose2d(4, 50, 3), 450)]:
        w, b = layer.weight.numpy(), layer.bias.numpy()
        bound = 1 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)) gives this bound too
        assert np.abs(w).max() <= bound and np.abs(w).max() > 0.9 * bound
        assert abs(w.std() - bound / math.sqrt(3)) < 0.1 * bound
        assert np.abs(b).max() <= bound
    bn = nn.BatchNorm2d(3)
    assert bn.weight.tolist() == [1.0] * 3 and bn.bias.tolist() == [0.0] * 3
    assert bn.running_var.tolist() == [1.0] * 3 and int(bn.num_batches_tracked) == 0


def test_dropout(device, randn):
    x = ag.tensor(np.abs(randn((64, 64), 9)) + 0.5, device=device)
    ag.manual_seed(3)
    drop = nn.Dropout(0.25)
    y = drop(x).numpy()
    zero = y == 0
    assert 0.2 < zero.mean() < 0.3
    np.testing.assert_allclose(y[~zero], x.numpy()[~zero] / 0.75, rtol=1e-6)
    assert not np.array_equal(zero, drop(x).numpy() == 0)  # a fresh mask each call
    assert drop.eval()(x) is x
    assert nn.Dropout(1.0)(x).numpy().sum() == 0
    with pytest.raises(ValueError, match="between 0 and 1"):
        nn.Dropout(1.5)


POOLS = [
    (nn.MaxPool2d, tnn.MaxPool2d, dict(kernel_size=2)),
    (nn.MaxPool2d, tnn.MaxPool2d, dict(kernel_size=3, stride=2, padding=1, ceil_mode=True)),
    (nn.MaxPool2d, tnn.MaxPool2d, dict(kernel_size=(2, 3), stride=1, dilation=(2, 1))),
    (nn.AvgPool2d, tnn.AvgPool2d, dict(kernel_size=2)),
    (nn.AvgPool2d, tnn.AvgPool2d, dict(kernel_size=3, stride=2, padding=1, ceil_mode=True)),
    (nn.AvgPool2d, tnn.AvgPool2d, dict(kernel_size=3, stride=2, padding=1,
                                       count_include_pad=False)),
    (nn.AdaptiveAvgPool2d, tnn.AdaptiveAvgPool2d, dict(output_size=1)),
    (nn.AdaptiveAvgPool2d, tnn.AdaptiveAvgPool2d, dict(output_size=(3, 4))),
    (nn.AdaptiveAvgPool2d, tnn.AdaptiveAvgPool2d, dict(output_size=(None, 3))),
]


@pytest.mark.parametrize("ours,theirs,kw", POOLS, ids=range(len(POOLS)))
def test_pooling(device, port, close, randn, ours, theirs, kw):
    got, ref = run(ours(**kw), theirs(**kw), randn((2, 3, 7, 8), 10), device, port)
    close(got, ref)


def test_pooling_unbatched_and_indices(device, close, randn):
    x = randn((3, 6, 5), 11)
    got = nn.MaxPool2d(2, return_indices=True)(ag.tensor(x, device=device))
    ref = tnn.MaxPool2d(2, return_indices=True)(torch.tensor(x))
    close(got[0], ref[0])
    close(got[1], ref[1])


ACTIVATIONS = [(nn.ReLU(), tnn.ReLU()), (nn.GELU(), tnn.GELU()),
               (nn.GELU("tanh"), tnn.GELU("tanh")), (nn.SiLU(), tnn.SiLU()),
               (nn.Sigmoid(), tnn.Sigmoid()), (nn.Tanh(), tnn.Tanh()),
               (nn.LeakyReLU(0.1), tnn.LeakyReLU(0.1)), (nn.Softmax(dim=1), tnn.Softmax(dim=1)),
               (nn.LogSoftmax(dim=-1), tnn.LogSoftmax(dim=-1)), (nn.Identity(3), tnn.Identity(3)),
               (nn.Flatten(), tnn.Flatten()), (nn.Flatten(0, 1), tnn.Flatten(0, 1)),
               (nn.Unflatten(1, (2, -1)), tnn.Unflatten(1, (2, -1)))]


def test_activations_and_reshapes(device, close, randn):
    x = randn((2, 4, 3), 12, scale=3.0)
    for ours, theirs in ACTIVATIONS:
        close(ours(ag.tensor(x, device=device)), theirs(torch.tensor(x)), rtol=1e-4, atol=1e-5)


def test_softmax_legacy_dim(close, randn):
    x = randn((2, 3), 13)
    with pytest.warns(UserWarning):
        ref = tnn.Softmax()(torch.tensor(x))
    close(nn.Softmax()(ag.tensor(x)), ref)


def test_conv_argument_errors():
    with pytest.raises(ValueError, match="in_channels must be divisible by groups"):
        nn.Conv2d(3, 4, 3, groups=2)
    with pytest.raises(ValueError, match="not supported for strided convolutions"):
        nn.Conv2d(3, 4, 3, stride=2, padding="same")
    with pytest.raises(ValueError, match="padding_mode"):
        nn.Conv2d(3, 4, 3, padding_mode="mirror")
    with pytest.raises(ValueError, match="num_channels must be divisible by num_groups"):
        nn.GroupNorm(3, 4)


def gradient_net(lib):
    return lib.Sequential(
        lib.Conv2d(3, 4, 3, padding=1, bias=False), lib.BatchNorm2d(4), lib.ReLU(),
        lib.MaxPool2d(2), lib.Conv2d(4, 6, 3, stride=2, groups=2), lib.GroupNorm(2, 6),
        lib.GELU(), lib.ConvTranspose2d(6, 4, 3, stride=2, padding=1, output_padding=1),
        lib.SiLU(), lib.AvgPool2d(2), lib.AdaptiveAvgPool2d(1), lib.Flatten(), lib.Linear(4, 5))


def test_gradients_match_torch(port, randn):
    # one device: the backward graph compiles many kernels, and each op's gradient is checked
    # on every device by the op tests
    device = "cpu"
    torch.manual_seed(8)
    theirs = gradient_net(tnn)
    ours = port(gradient_net(nn), theirs, device)
    x, t = randn((3, 3, 13, 13), 30), np.array([1, 4, 0])
    loss = nn.functional.cross_entropy(ours(ag.tensor(x, device=device)),
                                       ag.tensor(t, device=device), label_smoothing=0.1)
    loss.backward()
    ref = torch.nn.functional.cross_entropy(theirs(torch.tensor(x)), torch.tensor(t),
                                            label_smoothing=0.1)
    ref.backward()
    np.testing.assert_allclose(loss.item(), ref.item(), rtol=1e-5)
    for (name, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters()):
        scale = q.grad.abs().max().item()
        np.testing.assert_allclose(p.grad.numpy(), q.grad.numpy(), rtol=0, atol=1e-4 * scale,
                                   err_msg=name)
