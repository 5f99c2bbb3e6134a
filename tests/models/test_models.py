"""anygpu.models against torchvision's models: the same state_dict keys, shapes and order, and,
with the reference's weights loaded through ``weights=`` as a user would load them, the same
logits and the same losses over five Adam steps, on every device.

The reference is torchvision where it is installed, else tests/models/torch_reference.py (the
same architectures in plain torch.nn). Reference weights are PyTorch's initialization with
batch norms made non-trivial: random affine parameters and running statistics taken from a
batch, so that eval mode neither blows up nor reduces to the identity.

Training is compared where float32 training is reproducible at all. With batch-norm weights
near 1 at the end of every residual branch, and with Adam's first steps moving every weight by
the learning rate whatever its gradient, the losses of deep ResNets and MobileNetV2 after a few
steps change by percents when the input changes by 1e-6, in PyTorch itself (its float32 and
float64 runs differ as much). So the norm closing each residual branch gets weights in
[0, 0.2] (trained networks have small ones there; zero_init_residual starts them at 0) and the
learning rate is 1e-5: then a 1e-6 change of the input moves the losses by at most 2e-4
(ResNet-152), and still every model's loss falls over the five steps."""

from __future__ import annotations

import gc
import math
import os
import pickle
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import anygpu as ag
from anygpu import models, nn
from anygpu.nn import state
from anygpu.runtime.registry import get_device

torch = pytest.importorskip("torch")

try:  # the real models where they are installed (the GPU machine), else the plain torch.nn ones
    import torchvision.models as reference
except ImportError:
    from . import torch_reference as reference

CLASSES = 10
STEPS = 5
LR = 1e-5

# name, constructor keywords (both libraries), input side, weights file format. Inputs are the
# smallest that keep training well conditioned: AlexNet takes 63x63 at least and VGG 32x32;
# ResNet and MobileNetV2 take 32x32 too, but batch norm over their last 1x1 maps of a batch of
# 2 normalizes pairs of values, which turns rounding into differences of order 1, so they get
# 64x64 (2x2 maps: 8 values per channel)
CASES = [
    ("alexnet", {"dropout": 0.0}, 64, "pth"),
    ("resnet18", {}, 64, "safetensors"),
    ("resnet34", {}, 64, "pth"),
    ("resnet50", {}, 64, "safetensors"),
    ("resnet101", {}, 64, "pth"),
    ("resnet152", {}, 64, "safetensors"),
    ("resnext50_32x4d", {}, 64, "pth"),
    ("vgg11", {"dropout": 0.0}, 32, "safetensors"),
    ("vgg11_bn", {"dropout": 0.0}, 32, "pth"),
    ("vgg13", {"dropout": 0.0}, 32, "pth"),
    ("vgg13_bn", {"dropout": 0.0}, 32, "safetensors"),
    ("vgg16", {"dropout": 0.0}, 32, "safetensors"),
    ("vgg16_bn", {"dropout": 0.0}, 32, "pth"),
    ("vgg19", {"dropout": 0.0}, 32, "pth"),
    ("vgg19_bn", {"dropout": 0.0}, 32, "safetensors"),
    ("mobilenet_v2", {"dropout": 0.0}, 64, "pth"),
    ("mobilenet_v2", {"dropout": 0.0, "width_mult": 0.75}, 64, "safetensors"),
]
SLOW = {"resnet101", "resnet152", "resnext50_32x4d", "vgg13", "vgg13_bn", "vgg16", "vgg16_bn",
        "vgg19", "vgg19_bn"}


def case_id(case: tuple[Any, ...]) -> str:
    name, kwargs = case[0], case[1]
    extra = [f"{k}={v}" for k, v in kwargs.items() if k != "dropout"]
    return "-".join([name, *extra])


# Every model, depth and width on every backend runs with ANYGPU_TEST_ALL_MODELS=1 (the GPU
# check: 8 minutes and 11 GB on a 2-core processor for five of them on the cpu alone, a VGG
# holding gigabytes of weights, gradients and Adam state per library); by default these two,
# on the cpu
EVERYWHERE = {"resnet18", "mobilenet_v2"}
ALL_MODELS = os.environ.get("ANYGPU_TEST_ALL_MODELS", "") == "1"


def marked(cases: list[tuple[Any, ...]]) -> list[Any]:
    return [pytest.param(*c, id=case_id(c), marks=[pytest.mark.slow] if c[0] in SLOW else [])
            for c in cases if ALL_MODELS or (c[0] in EVERYWHERE and "width_mult" not in c[1])]


def residual_branch_ends(model: Any) -> list[Any]:
    """The batch norm that closes each residual branch: a ResNet block's last one, and the
    projection's in a MobileNetV2 block that adds its input."""
    ends = []
    for m in model.modules():
        if hasattr(m, "conv1") and hasattr(m, "bn2"):
            ends.append(m.bn3 if hasattr(m, "bn3") else m.bn2)
        elif getattr(m, "use_res_connect", False):
            ends.append(m.conv[-1])
    return ends


def make_reference(name: str, kwargs: dict[str, Any], seed: int, side: int) -> Any:
    """The reference model with its weights: PyTorch's initialization, then every batch norm
    given random affine parameters (small weights where it closes a residual branch) and the
    running statistics of one random batch."""
    torch.manual_seed(seed)
    model = getattr(reference, name)(num_classes=CLASSES, **kwargs)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in norms:
            m.weight.copy_(torch.rand(m.weight.shape, generator=gen) + 0.5)
            m.bias.copy_(torch.randn(m.bias.shape, generator=gen) * 0.1)
            m.momentum = None  # cumulative average: one batch sets the statistics
        for m in residual_branch_ends(model):
            m.weight.copy_(torch.rand(m.weight.shape, generator=gen) * 0.2)
        model.train()
        model(torch.randn(4, 3, side, side, generator=gen))
        for m in norms:
            m.momentum = 0.1
    return model.eval()


def save_weights(model: Any, path: Path) -> Path:
    """The reference's state_dict as a user would hold it: torch.save's file, or safetensors."""
    if path.suffix == ".pth":
        torch.save(model.state_dict(), path)
    else:
        state.save_file(model.state_dict(), path)
    return path


def train(model: Any, lib: Any, optim: Any, x: Any, y: Any) -> list[float]:
    """The losses of ``STEPS`` Adam steps on one batch, in train mode (batch statistics)."""
    model.train()
    opt = optim.Adam(model.parameters(), lr=LR)
    loss_fn = lib.nn.CrossEntropyLoss()
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
    return losses


def assert_logits(got: np.ndarray, ref: np.ndarray, rtol: float, what: str) -> None:
    """Within ``rtol`` of the reference's largest magnitude (logits near zero carry the
    absolute error of the large ones)."""
    scale = float(np.abs(ref).max())
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=rtol * scale, err_msg=what)


# ---- the architectures ---------------------------------------------------------------------------
KEY_CASES = [("alexnet", {}), ("vgg11", {}), ("vgg11_bn", {}), ("vgg13", {}), ("vgg13_bn", {}),
             ("vgg16", {}), ("vgg16_bn", {}), ("vgg19", {}), ("vgg19_bn", {}),
             ("resnet18", {}), ("resnet34", {}), ("resnet50", {}), ("resnet101", {}),
             ("resnet152", {}), ("resnext50_32x4d", {}), ("resnext101_32x8d", {}),
             ("resnext101_64x4d", {}), ("wide_resnet50_2", {}), ("wide_resnet101_2", {}),
             ("mobilenet_v2", {}), ("mobilenet_v2", {"width_mult": 0.5}),
             ("mobilenet_v2", {"width_mult": 1.4}), ("mobilenet_v2", {"width_mult": 0.35}),
             ("resnet50", {"replace_stride_with_dilation": [False, True, True]})]


@pytest.mark.parametrize("name,kwargs", [pytest.param(*c, id=case_id(c)) for c in KEY_CASES])
def test_state_dict_matches_reference(name, kwargs):
    """Names, order, shapes and dtypes of every parameter and buffer, default num_classes."""
    ours = getattr(models, name)(**kwargs).state_dict()
    theirs = getattr(reference, name)(**kwargs).state_dict()
    assert list(ours) == list(theirs)
    for key, value in theirs.items():
        assert ours[key].shape == tuple(value.shape), key
        assert ours[key].dtype.name == str(value.dtype).removeprefix("torch."), key


@pytest.fixture
def release_memory(device):
    """Give the devices' cached buffers back after each model. The caching allocator keeps
    every freed buffer for reuse at its exact size, so the buffers of one model (VGG's weights,
    gradients and Adam states take 2 GB) stay cached through the next ones; on OpenCL on the
    processor (PoCL) they filled the host's 24 GB by ResNet-101."""
    yield
    gc.collect()
    for name in {device, "cpu"}:
        get_device(name).allocator.empty_cache()


@pytest.mark.parametrize("name,kwargs,side,fmt", marked(CASES))
@pytest.mark.usefixtures("release_memory")
def test_logits_and_training_match_reference(device, tmp_path, name, kwargs, side, fmt):
    """Reference weights through ``weights=``: eval-mode logits, the losses of five Adam steps
    in train mode, and eval-mode logits again (updated weights and running statistics)."""
    if not ALL_MODELS and not device.startswith("cpu"):
        pytest.skip("whole models train on this backend with ANYGPU_TEST_ALL_MODELS=1")
    theirs = make_reference(name, kwargs, seed=len(name) + side, side=side)
    path = save_weights(theirs, tmp_path / f"{name}.{fmt}")
    ours = getattr(models, name)(weights=path, **kwargs).to(device).eval()
    path.unlink()  # VGG's weights take half a gigabyte

    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 3, side, side)).astype(np.float32)
    y = rng.integers(0, CLASSES, 2)
    x_ours, y_ours = ag.tensor(x, device=device), ag.tensor(y, device=device)
    x_theirs, y_theirs = torch.tensor(x), torch.tensor(y)

    with torch.no_grad():
        ref = theirs(x_theirs).numpy()
    with ag.no_grad():
        got = ours(x_ours).numpy()
    assert_logits(got, ref, 1e-4, "eval logits before training")

    got_losses = train(ours, ag, ag.optim, x_ours, y_ours)
    ref_losses = train(theirs, torch, torch.optim, x_theirs, y_theirs)
    np.testing.assert_allclose(got_losses, ref_losses, rtol=2e-3, atol=5e-4,
                               err_msg="training losses")

    theirs.eval()
    ours.eval()
    with torch.no_grad():
        ref = theirs(x_theirs).numpy()
    with ag.no_grad():
        got = ours(x_ours).numpy()
    assert_logits(got, ref, 1e-2, "eval logits after training")


# ---- weights files -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_reference():
    """A MobileNetV2 of quarter width: small enough to save and load often."""
    return make_reference("mobilenet_v2", {"width_mult": 0.25}, seed=3, side=32).eval()


def small(**kwargs: Any) -> Any:
    return models.mobilenet_v2(width_mult=0.25, **kwargs)


def assert_same_state(model: Any, torch_state: dict[str, Any]) -> None:
    ours = model.state_dict()
    assert list(ours) == list(torch_state)
    for key, value in torch_state.items():
        np.testing.assert_array_equal(ours[key].numpy(), value.numpy(), err_msg=key)


def test_missing_weights_file(tmp_path):
    missing = tmp_path / "nowhere" / "resnet18.safetensors"
    with pytest.raises(FileNotFoundError, match="resnet18.safetensors"):
        models.resnet18(weights=missing)
    with pytest.raises(FileNotFoundError, match="IMAGENET1K_V1.*nothing is downloaded"):
        models.resnet18(weights="IMAGENET1K_V1")
    with pytest.raises(IsADirectoryError, match="directory"):
        models.resnet18(weights=tmp_path)
    with pytest.raises(TypeError, match="never"):
        models.resnet18(pretrained=True)


@pytest.mark.parametrize("fmt", ["pth", "safetensors"])
def test_mismatched_state_dict(tmp_path, small_reference, fmt):
    """Missing, unexpected and misshapen entries are all named, with the file's name."""
    sd = dict(small_reference.state_dict())
    del sd["features.1.conv.0.1.running_var"]
    sd["features.99.weight"] = torch.zeros(3)
    sd["classifier.1.bias"] = torch.zeros(CLASSES + 1)
    path = tmp_path / f"bad.{fmt}"
    if fmt == "pth":
        torch.save(sd, path)
    else:
        state.save_file(sd, path)
    with pytest.raises(RuntimeError) as info:
        small(weights=path)
    text = str(info.value)
    for expected in ("bad." + fmt, "Missing key(s)", "features.1.conv.0.1.running_var",
                     "Unexpected key(s)", "features.99.weight", "size mismatch",
                     "classifier.1.bias"):
        assert expected in text, f"{expected!r} not in {text!r}"
    with pytest.raises(RuntimeError, match="size mismatch for fc.weight"):
        models.resnet18(weights=save_weights(make_reference(
            "resnet18", {}, seed=0, side=32), tmp_path / "r18.pth"), num_classes=CLASSES + 1)


def test_weights_set_num_classes_and_load_exactly(tmp_path, small_reference):
    """num_classes comes from the weights unless given; values arrive bit for bit."""
    path = save_weights(small_reference, tmp_path / "small.pth")
    model = small(weights=path)
    assert model.classifier[1].out_features == CLASSES
    assert_same_state(model, small_reference.state_dict())


def test_training_checkpoints_and_wrapped_keys(tmp_path, small_reference):
    """A checkpoint dict with the state_dict under "model" or "state_dict", and the keys of a
    data-parallel wrapper ("module." first), load as the plain state_dict does."""
    sd = small_reference.state_dict()
    path = tmp_path / "ckpt.pth"
    torch.save({"epoch": 3, "model": sd, "optimizer": {"lr": 0.1}}, path)
    assert_same_state(small(weights=path), sd)
    torch.save({"state_dict": {"module." + k: v for k, v in sd.items()}}, path)
    assert_same_state(small(weights=path), sd)
    torch.save({"epoch": 3}, path)
    with pytest.raises(TypeError, match="'epoch'"):
        small(weights=path)


def test_anygpu_checkpoint_loads(tmp_path):
    """A state_dict written by ``anygpu.save`` is a weights file too."""
    source = models.resnet18(num_classes=4)
    path = tmp_path / "resnet18.pt"
    ag.save(source.state_dict(), path)
    model = models.resnet18(weights=path)
    for (key, a), b in zip(source.state_dict().items(), model.state_dict().values()):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=key)


def test_pytorch_file_needs_torch(tmp_path, small_reference, monkeypatch):
    path = save_weights(small_reference, tmp_path / "small.pth")
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    with pytest.raises(ImportError, match="needs PyTorch"):
        small(weights=path)


def test_convert_weights_round_trip(tmp_path, small_reference):
    """.pth -> safetensors keeps names, order, dtypes (int64 counters, bfloat16) and values;
    the file loads with weights=; a pickled whole model converts only with weights_only=False
    and is refused, with a pointer to the converter, by weights=."""
    sd = small_reference.state_dict()
    src, dst = tmp_path / "small.pth", tmp_path / "small.safetensors"
    torch.save(sd, src)
    assert models.convert_weights(src, dst) == list(sd)
    loaded = state.load_file(dst)
    assert list(loaded) == list(sd)
    for key, value in sd.items():
        assert loaded[key].dtype.name == str(value.dtype).removeprefix("torch."), key
        np.testing.assert_array_equal(loaded[key].numpy(), value.numpy(), err_msg=key)
    assert state.load_metadata(dst) == {"format": "pt"}
    assert_same_state(small(weights=dst), sd)

    half = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in sd.items()}
    torch.save(half, src)
    models.convert_weights(src, dst)
    loaded = state.load_file(dst)
    for key, value in half.items():
        assert loaded[key].dtype.name == str(value.dtype).removeprefix("torch."), key
        np.testing.assert_array_equal(loaded[key].float().numpy(), value.float().numpy(),
                                      err_msg=key)

    whole = tmp_path / "whole.pth"
    torch.save(small_reference, whole)
    with pytest.raises(pickle.UnpicklingError, match="convert_weights"):
        small(weights=whole)
    with pytest.raises(pickle.UnpicklingError, match="convert_weights"):
        models.convert_weights(whole, dst)
    assert models.convert_weights(whole, dst, weights_only=False) == list(sd)
    assert_same_state(small(weights=dst), sd)


# ---- construction --------------------------------------------------------------------------------
def test_initialization_follows_torchvision():
    """He-normal (fan_out) convolutions, unit/zero norms, N(0, 0.01) linear layers where
    torchvision sets them, PyTorch's defaults elsewhere; zero_init_residual."""
    def std(t: Any) -> float:
        return float(t.numpy().std())

    resnet = models.resnet50(zero_init_residual=True)
    w = resnet.layer3[0].conv2.weight  # 256 x 256 x 3 x 3: fan_out 2304
    assert std(w) == pytest.approx(math.sqrt(2 / 2304), rel=0.05)
    assert not resnet.layer1[0].bn3.weight.numpy().any()
    assert (resnet.layer1[0].bn2.weight.numpy() == 1).all()
    assert (resnet.bn1.bias.numpy() == 0).all()
    bound = 1 / math.sqrt(2048)  # the classifier keeps nn.Linear's default
    assert 0.9 * bound < float(np.abs(resnet.fc.weight.numpy()).max()) <= bound * 1.000001
    assert not models.resnet18(zero_init_residual=True).layer4[1].bn2.weight.numpy().any()

    vgg = models.vgg11_bn()
    assert std(vgg.classifier[6].weight) == pytest.approx(0.01, rel=0.05)
    assert not vgg.classifier[0].bias.numpy().any() and not vgg.features[0].bias.numpy().any()
    assert std(vgg.features[4].weight) == pytest.approx(math.sqrt(2 / (128 * 9)), rel=0.05)

    mobile = models.mobilenet_v2()
    assert std(mobile.classifier[1].weight) == pytest.approx(0.01, rel=0.05)
    depthwise = mobile.features[2].conv[1][0].weight  # 96 x 1 x 3 x 3: fan_out 96 * 9
    assert std(depthwise) == pytest.approx(math.sqrt(2 / (96 * 9)), rel=0.1)

    alex = models.alexnet()  # PyTorch's default initialization throughout
    bound = 1 / math.sqrt(9216)
    assert 0.9 * bound < float(np.abs(alex.classifier[1].weight.numpy()).max()) <= bound * 1.000001


def test_constructor_arguments():
    with pytest.raises(ValueError, match="groups=1 and base_width=64"):
        models.resnet18(groups=2)
    with pytest.raises(NotImplementedError, match="Dilation"):
        models.resnet18(replace_stride_with_dilation=[False, False, True])
    with pytest.raises(ValueError, match="3-element"):
        models.resnet50(replace_stride_with_dilation=[True])
    with pytest.raises(ValueError, match="inverted_residual_setting"):
        models.mobilenet_v2(inverted_residual_setting=[[1, 16, 1]])
    with pytest.raises(ValueError, match="stride should be 1 or 2"):
        models.mobilenetv2.InvertedResidual(8, 8, 3, 6)
    dilated = models.resnet50(replace_stride_with_dilation=[False, True, True], num_classes=3)
    assert dilated.layer4[0].conv2.dilation == (2, 2) and dilated.layer4[1].conv2.dilation == (4, 4)
    assert dilated.eval()(ag.randn(1, 3, 32, 32)).shape == (1, 3)
    gn = models.resnet18(norm_layer=lambda c: nn.GroupNorm(4, c), num_classes=3)
    assert "bn1.running_mean" not in gn.state_dict()
    assert isinstance(models.vgg11(init_weights=False).classifier[6], nn.Linear)
    assert models.alexnet(dropout=0.25).classifier[0].p == 0.25
    assert models.mobilenet_v2(width_mult=0.5).features[0][0].out_channels == 16
