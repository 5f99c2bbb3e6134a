"""Module, Parameter and the containers: registration, state_dict keys and loading, devices,
modes and printing, against torch.nn."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

import anygpu as ag
from anygpu import nn

torch = pytest.importorskip("torch")
tnn = torch.nn


def small_cnn(lib):
    """The same small CNN written against torch.nn or anygpu.nn."""

    class Block(lib.Module):
        def __init__(self, cin, cout):
            super().__init__()
            self.conv = lib.Conv2d(cin, cout, 3, padding=1, bias=False)
            self.bn = lib.BatchNorm2d(cout)
            self.act = lib.ReLU()

        def forward(self, x):
            return self.act(self.bn(self.conv(x)))

    class Net(lib.Module):
        def __init__(self):
            super().__init__()
            self.stem = lib.Sequential(Block(3, 4), lib.MaxPool2d(2))
            self.blocks = lib.ModuleList([Block(4, 6), Block(6, 6)])
            self.heads = lib.ModuleDict({"cls": lib.Linear(6, 5), "aux": lib.Linear(6, 2)})
            self.pool = lib.AdaptiveAvgPool2d(1)
            self.drop = lib.Dropout(0.2)

        def forward(self, x):
            x = self.stem(x)
            for b in self.blocks:
                x = b(x)
            x = self.drop(self.pool(x).flatten(1))
            return self.heads["cls"](x), self.heads["aux"](x)

    return Net()


def test_state_dict_keys_match_torch():
    torch.manual_seed(0)
    theirs, ours = small_cnn(tnn), small_cnn(nn)
    ref = theirs.state_dict()
    got = ours.state_dict()
    assert list(got) == list(ref)
    for k in ref:
        assert got[k].shape == tuple(ref[k].shape), k
        assert got[k].dtype == ag.dtype.to_dtype(ref[k].dtype), k
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    assert [n for n, _ in ours.named_buffers()] == [n for n, _ in theirs.named_buffers()]
    assert [n for n, _ in ours.named_modules()] == [n for n, _ in theirs.named_modules()]
    assert [n for n, _ in ours.named_children()] == [n for n, _ in theirs.named_children()]
    # torch 2.13 prints the bias flag of norm layers; older releases print less
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13):
        assert repr(ours) == repr(theirs)


def test_forward_matches_torch_after_loading(device, port, close, randn):
    torch.manual_seed(1)
    theirs = small_cnn(tnn)
    # non-trivial running statistics, so eval mode really uses them
    with torch.no_grad():
        for _ in range(2):
            theirs(torch.randn(4, 3, 8, 8) * 2 + 0.5)
    theirs.eval()
    ours = port(small_cnn(nn), theirs, device)
    x = randn((2, 3, 8, 8), 2)
    got = ours(ag.tensor(x, device=device))
    ref = theirs(torch.tensor(x))
    close(got[0], ref[0], atol=1e-4)
    close(got[1], ref[1], atol=1e-4)


def test_train_mode_updates_running_stats_like_torch(device, port, close, randn):
    torch.manual_seed(2)
    theirs = tnn.Sequential(tnn.Conv2d(2, 3, 3), tnn.BatchNorm2d(3, momentum=0.3), tnn.ReLU())
    ours = port(nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3, momentum=0.3), nn.ReLU()),
                theirs, device)
    for step in range(3):
        x = randn((4, 2, 6, 6), 10 + step, scale=2.0) + step
        close(ours(ag.tensor(x, device=device)), theirs(torch.tensor(x)), atol=1e-4)
    for key, value in theirs.state_dict().items():
        close(ours.state_dict()[key], value, atol=1e-5)
    assert int(ours[1].num_batches_tracked) == 3


def test_registration_and_iteration():
    m = nn.Module()
    m.w = nn.Parameter(ag.ones(2))
    m.register_buffer("stat", ag.zeros(3))
    m.register_buffer("scratch", ag.zeros(1), persistent=False)
    m.child = nn.Linear(2, 2)
    m.plain = 5
    assert list(m._parameters) == ["w"] and list(m._buffers) == ["stat", "scratch"]
    assert list(m.state_dict()) == ["w", "stat", "child.weight", "child.bias"]
    assert [n for n, _ in m.named_buffers()] == ["stat", "scratch"]
    assert list(m.children()) == [m.child] and list(m.modules()) == [m, m.child]
    assert len(list(m.parameters())) == 3 and len(list(m.parameters(recurse=False))) == 1
    with pytest.raises(TypeError, match="cannot assign 'Tensor' as parameter 'w'"):
        m.w = ag.ones(2)
    with pytest.raises(TypeError, match="cannot assign 'int' as child module 'child'"):
        m.child = 3
    m.w = None
    assert m.w is None and "w" not in m.state_dict()
    del m.child
    assert not hasattr(m, "child")
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        _ = m.nothing
    with pytest.raises(KeyError, match="already exists"):
        m.register_buffer("plain", ag.zeros(1))


def test_tied_parameters_count_once():
    a = nn.Linear(3, 3)
    m = nn.Sequential(a, nn.ReLU(), a)
    assert len(list(m.parameters())) == 2
    assert list(m.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    m.load_state_dict(m.state_dict())


def test_parameter():
    p = nn.Parameter(ag.ones(2, 3))
    assert isinstance(p, ag.Tensor) and p.requires_grad and p.shape == (2, 3)
    assert not nn.Parameter(ag.ones(1), requires_grad=False).requires_grad
    assert repr(p).startswith("Parameter containing:\ntensor(")
    assert type(p * 2) is ag.Tensor
    assert type(p.detach()) is ag.Tensor


def test_train_eval_apply_zero_grad():
    m = small_cnn(nn)
    assert m.training and all(x.training for x in m.modules())
    assert m.eval() is m and not any(x.training for x in m.modules())
    m.train()
    assert all(x.training for x in m.modules())
    order = []
    m.stem.apply(lambda mod: order.append(type(mod).__name__))
    assert order == ["Conv2d", "BatchNorm2d", "ReLU", "Block", "MaxPool2d", "Sequential"]
    for p in m.parameters():
        p.grad = ag.ones(p.shape)
    m.zero_grad(set_to_none=False)
    assert all(p.grad is not None and p.grad.numpy().sum() == 0 for p in m.parameters())
    m.zero_grad()
    assert all(p.grad is None for p in m.parameters())
    m.requires_grad_(False)
    assert not any(p.requires_grad for p in m.parameters())


def test_to_device_keeps_parameter_objects(device, randn):
    m = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    params, buffers = list(m.parameters()), list(m.buffers())
    before = {k: v.numpy() for k, v in m.state_dict().items()}
    assert m.to(device) is m
    assert all(a is b for a, b in zip(params, m.parameters()))
    assert all(a is b for a, b in zip(buffers, m.buffers()))
    for k, v in m.state_dict().items():
        assert v.device == device
        np.testing.assert_array_equal(v.numpy(), before[k])
    assert m(ag.tensor(randn((5, 4), 3), device=device)).device == device
    m.to(ag.float16 if ag.get_device(device).supports(ag.float16) else ag.bfloat16)
    assert m[0].weight.dtype.is_float and m[0].weight.dtype != ag.float32
    assert m[1].num_batches_tracked.dtype == ag.int64  # only floating tensors change dtype
    m.float().cpu()
    assert m[0].weight.dtype == ag.float32 and m[0].weight.device == "cpu:0"


def test_load_state_dict_accepts_numpy_torch_and_anygpu():
    m = nn.Linear(3, 2)
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    m.load_state_dict({"weight": w, "bias": torch.tensor([1.0, 2.0], dtype=torch.bfloat16)})
    np.testing.assert_array_equal(m.weight.numpy(), w)
    np.testing.assert_array_equal(m.bias.numpy(), [1.0, 2.0])
    assert m.bias.dtype == ag.float32  # cast to the parameter's dtype, as torch copies
    src = ag.tensor(w * 2)
    m.load_state_dict({"weight": src, "bias": ag.zeros(2)})
    np.testing.assert_array_equal(m.weight.numpy(), w * 2)
    assert m.weight is not src and m.weight.lazy is not src.lazy


def test_load_state_dict_errors():
    m = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    good = m.state_dict()
    old = m[0].weight.numpy()
    bad = OrderedDict(good)
    del bad["0.bias"]
    bad["extra.weight"] = np.zeros(1, np.float32)
    bad["0.weight"] = np.zeros((3, 3), np.float32)
    with pytest.raises(RuntimeError) as err:
        m.load_state_dict(bad)
    text = str(err.value)
    assert "Error(s) in loading state_dict for Sequential" in text
    assert 'Missing key(s) in state_dict: "0.bias"' in text
    assert 'Unexpected key(s) in state_dict: "extra.weight"' in text
    assert ("size mismatch for 0.weight: copying a param with shape torch.Size([3, 3]) from "
            "checkpoint, the shape in current model is torch.Size([2, 3])") in text
    np.testing.assert_array_equal(m[0].weight.numpy(), old)  # nothing was loaded
    bad["0.weight"] = good["0.weight"]
    result = m.load_state_dict(bad, strict=False)
    assert result.missing_keys == ["0.bias"] and result.unexpected_keys == ["extra.weight"]
    with pytest.raises(RuntimeError, match="size mismatch for 1.running_mean"):
        m.load_state_dict({**good, "1.running_mean": np.zeros(3, np.float32)}, strict=False)
    # checkpoints from before num_batches_tracked existed still load strictly
    legacy = {k: v for k, v in good.items() if not k.endswith("num_batches_tracked")}
    assert repr(m.load_state_dict(legacy)) == "<All keys matched successfully>"
    with pytest.raises(TypeError, match="dict-like"):
        m.load_state_dict([("0.weight", old)])


def test_containers():
    seq = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    assert len(seq) == 3 and isinstance(seq[-1], nn.Linear)
    assert isinstance(seq[1:], nn.Sequential) and len(seq[1:]) == 2
    seq.append(nn.Sigmoid())
    assert list(seq._modules) == ["0", "1", "2", "3"]
    del seq[1]
    assert list(seq._modules) == ["0", "1", "2"] and isinstance(seq[1], nn.Linear)
    named = nn.Sequential(OrderedDict([("fc", nn.Linear(2, 2)), ("act", nn.Tanh())]))
    assert list(named.state_dict()) == ["fc.weight", "fc.bias"]
    assert named(ag.ones(1, 2)).shape == (1, 2)

    layers = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])
    layers.append(nn.ReLU())
    layers.insert(0, nn.Identity())
    assert [type(x).__name__ for x in layers] == ["Identity", "Linear", "Linear", "Linear",
                                                   "ReLU"]
    assert list(layers.state_dict())[:2] == ["1.weight", "1.bias"]
    assert repr(nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])) == repr(
        tnn.ModuleList([tnn.Linear(2, 2) for _ in range(3)]))

    d = nn.ModuleDict({"a": nn.Linear(1, 1)})
    d["b"] = nn.Linear(1, 2)
    d.update([("c", nn.ReLU())])
    assert list(d.keys()) == ["a", "b", "c"] and "b" in d and len(d) == 3
    assert list(d.state_dict()) == ["a.weight", "a.bias", "b.weight", "b.bias"]
    d.pop("a")
    assert list(d) == ["b", "c"]


def test_forward_hooks():
    m = nn.Linear(2, 2)
    seen = []
    h1 = m.register_forward_pre_hook(lambda mod, args: seen.append("pre"))
    h2 = m.register_forward_hook(lambda mod, args, out: out * 0)
    assert m(ag.ones(1, 2)).numpy().sum() == 0 and seen == ["pre"]
    h1.remove()
    h2.remove()
    assert m(ag.ones(1, 2)).numpy().any() and seen == ["pre"]


def test_repr_matches_torch():
    pairs = [
        (nn.Conv2d(3, 8, (3, 5), stride=2, padding=1, bias=False),
         tnn.Conv2d(3, 8, (3, 5), stride=2, padding=1, bias=False)),
        (nn.Conv2d(4, 8, 3, padding="same", dilation=2, groups=2, padding_mode="reflect"),
         tnn.Conv2d(4, 8, 3, padding="same", dilation=2, groups=2, padding_mode="reflect")),
        (nn.ConvTranspose2d(4, 2, 3, stride=2, output_padding=1),
         tnn.ConvTranspose2d(4, 2, 3, stride=2, output_padding=1)),
        (nn.BatchNorm1d(3, momentum=None, affine=False), tnn.BatchNorm1d(3, momentum=None,
                                                                         affine=False)),
        (nn.LayerNorm([4, 5], elementwise_affine=False), tnn.LayerNorm([4, 5],
                                                                       elementwise_affine=False)),
        (nn.RMSNorm(6, eps=1e-6), tnn.RMSNorm(6, eps=1e-6)),
        (nn.GroupNorm(2, 4), tnn.GroupNorm(2, 4)),
        (nn.Embedding(10, 3, padding_idx=1), tnn.Embedding(10, 3, padding_idx=1)),
        (nn.MaxPool2d(3, 2, 1, ceil_mode=True), tnn.MaxPool2d(3, 2, 1, ceil_mode=True)),
        (nn.AvgPool2d(2), tnn.AvgPool2d(2)),
        (nn.AdaptiveAvgPool2d((2, None)), tnn.AdaptiveAvgPool2d((2, None))),
        (nn.Sequential(nn.GELU("tanh"), nn.SiLU(), nn.LeakyReLU(0.2), nn.Softmax(-1),
                       nn.LogSoftmax(1), nn.Sigmoid(), nn.Tanh(), nn.Flatten(), nn.Identity(),
                       nn.Dropout(0.1), nn.ReLU(inplace=True)),
         tnn.Sequential(tnn.GELU("tanh"), tnn.SiLU(), tnn.LeakyReLU(0.2), tnn.Softmax(-1),
                        tnn.LogSoftmax(1), tnn.Sigmoid(), tnn.Tanh(), tnn.Flatten(),
                        tnn.Identity(), tnn.Dropout(0.1), tnn.ReLU(inplace=True))),
    ]
    for ours, theirs in pairs:
        # torch 2.13 prints the bias flag of norm layers; older releases print less
        if tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13):
            assert repr(ours) == repr(theirs)


def test_training_with_checkpoint_reads_matches_torch(device, port, close, randn):
    torch.manual_seed(5)
    theirs = tnn.Sequential(tnn.Linear(3, 4), tnn.Tanh(), tnn.Linear(4, 2))
    ours = port(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), theirs, device)
    opt = ag.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    topt = torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x, y = randn((5, 3), 30 + step), randn((5, 2), 40 + step)
        opt.zero_grad()
        nn.functional.mse_loss(ours(ag.tensor(x, device=device)),
                               ag.tensor(y, device=device)).backward()
        opt.step()
        topt.zero_grad()
        torch.nn.functional.mse_loss(theirs(torch.tensor(x)), torch.tensor(y)).backward()
        topt.step()
        # reading a checkpoint between steps must not detach parameters from the optimizer
        for key, value in theirs.state_dict().items():
            close(ours.state_dict()[key], value, atol=1e-5)
    # loading new values after the optimizer exists: the next step starts from them
    ours.load_state_dict(theirs.state_dict())
    x, y = randn((5, 3), 50), randn((5, 2), 51)
    opt.zero_grad()
    nn.functional.mse_loss(ours(ag.tensor(x, device=device)), ag.tensor(y, device=device)
                           ).backward()
    opt.step()
    topt.zero_grad()
    torch.nn.functional.mse_loss(theirs(torch.tensor(x)), torch.tensor(y)).backward()
    topt.step()
    for key, value in theirs.state_dict().items():
        close(ours.state_dict()[key], value, atol=1e-5)


def test_replacing_a_parameter_or_submodule_keeps_its_place():
    """A replaced entry stays where it was, as in torch: ``seq[0] = m`` once moved the layer
    to the end of the Sequential (it ran last) and of state_dict."""

    def build(lib, tensor):
        seq = lib.Sequential(lib.Linear(2, 3), lib.ReLU(), lib.Linear(3, 1))
        seq[0] = lib.Linear(2, 3)
        seq.extra = lib.Parameter(tensor([1.0]))
        seq.later = lib.Parameter(tensor([2.0]))
        seq.extra = lib.Parameter(tensor([3.0]))
        return seq

    ours, theirs = build(nn, ag.tensor), build(tnn, torch.tensor)
    assert [type(m).__name__ for m in ours] == ["Linear", "ReLU", "Linear"]
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert list(ours.state_dict())[:2] == ["extra", "later"]
