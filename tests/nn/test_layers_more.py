"""1-D convolutions, PReLU, interpolate and the Upsample layers, one_hot, normalize, cosine
similarity, pairwise distance and the parameter containers against torch (CPU) with the same
weights: forward values and the gradients of inputs and weights, on every device."""

from __future__ import annotations

import math

import numpy as np
import pytest

import anygpu as ag
from anygpu import nn
from anygpu.nn import functional as F

torch = pytest.importorskip("torch")
tnn = torch.nn
TF = torch.nn.functional


def both(x, device, grad=False):
    """(our tensor, torch's tensor) holding ``x``."""
    return (ag.tensor(x, device=device, requires_grad=grad),
            torch.tensor(x, requires_grad=grad))


def backward(got, ref, device, randn, seed):
    """Backpropagate the same random upstream gradient through both outputs."""
    upstream = randn(tuple(ref.shape), seed)
    (got * ag.tensor(upstream, device=device)).sum().backward()
    (ref * torch.tensor(upstream)).sum().backward()


def close_grads(ours, theirs, close, rtol=1e-4, atol=1e-5):
    """Every parameter gradient of module ``ours`` against ``theirs``, by name."""
    grads = dict(ours.named_parameters())
    for name, param in theirs.named_parameters():
        close(grads[name].grad, param.grad, rtol=rtol, atol=atol)


# ---- 1-D convolutions --------------------------------------------------------------------------
CONV1D = [
    dict(name="plain", args=(3, 4, 3), x=(2, 3, 13)),
    dict(name="stride-pad-groups", args=(4, 6, 3), kw=dict(stride=2, padding=1, groups=2),
         x=(1, 4, 17)),
    dict(name="dilation-no-bias", args=(2, 5, 4), kw=dict(dilation=3, bias=False), x=(3, 2, 19)),
    dict(name="same", args=(3, 3, 4), kw=dict(padding="same", dilation=2), x=(2, 3, 11)),
    dict(name="valid-depthwise", args=(4, 8, 5), kw=dict(padding="valid", groups=4),
         x=(1, 4, 9)),
    dict(name="reflect", args=(2, 3, 3), kw=dict(padding=2, padding_mode="reflect", stride=2),
         x=(2, 2, 10)),
    dict(name="circular", args=(3, 2, 3), kw=dict(padding=1, padding_mode="circular"),
         x=(1, 3, 7)),
    dict(name="replicate-same", args=(2, 2, 6), kw=dict(padding="same",
                                                        padding_mode="replicate"), x=(2, 2, 9)),
    dict(name="unbatched", args=(3, 4, 2), kw=dict(stride=3, padding=(1,)), x=(3, 14)),
]


@pytest.mark.parametrize("case", CONV1D, ids=[c["name"] for c in CONV1D])
def test_conv1d(device, port, close, randn, case):
    torch.manual_seed(1)
    kw = case.get("kw", {})
    theirs = tnn.Conv1d(*case["args"], **kw)
    ours = port(nn.Conv1d(*case["args"], **kw), theirs, device)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    ox, tx = both(randn(case["x"], 2), device, grad=True)
    got, ref = ours(ox), theirs(tx)
    close(got, ref)
    backward(got, ref, device, randn, 3)
    close(ox.grad, tx.grad)
    close_grads(ours, theirs, close)


def test_conv1d_functional(device, close, randn):
    (ox, tx), (ow, tw), (ob, tb) = (both(randn(s, k), device, grad=True)
                                    for k, s in enumerate([(2, 6, 15), (4, 3, 3), (4,)]))
    got = F.conv1d(ox, ow, ob, stride=2, padding=2, dilation=2, groups=2)
    ref = TF.conv1d(tx, tw, tb, stride=2, padding=2, dilation=2, groups=2)
    close(got, ref)
    backward(got, ref, device, randn, 4)
    for ours, theirs in ((ox, tx), (ow, tw), (ob, tb)):
        close(ours.grad, theirs.grad)


def test_conv1d_init_and_repr():
    m, t = nn.Conv1d(6, 4, 5, stride=2, groups=2), tnn.Conv1d(6, 4, 5, stride=2, groups=2)
    assert (m.kernel_size, m.stride, m.padding, m.dilation) == (t.kernel_size, t.stride,
                                                                t.padding, t.dilation)
    assert m.weight.shape == tuple(t.weight.shape) and repr(m) == repr(t)
    bound = 1 / math.sqrt(3 * 5)  # kaiming_uniform(a=sqrt(5)) and the bias: 1/sqrt(fan_in)
    values = np.concatenate([m.weight.numpy().ravel(), m.bias.numpy()])
    assert np.abs(values).max() <= bound
    # spread over all 64 values (the 4 of the bias alone fall below now and then)
    assert values.std() > bound / 4


def test_conv1d_errors():
    x, w = ag.randn(2, 3, 8), ag.randn(4, 3, 3)
    with pytest.raises(ValueError, match="Expected 2D .unbatched. or 3D .batched. input"):
        F.conv1d(ag.randn(2, 3, 4, 5), w)
    with pytest.raises(ValueError, match="3-D weight"):
        F.conv1d(x, w.unsqueeze(2))
    with pytest.raises(ValueError, match="stride"):
        F.conv1d(x, w, padding="same", stride=2)
    with pytest.raises(ValueError, match="groups"):
        F.conv1d(x, ag.randn(4, 1, 3), groups=2)
    with pytest.raises(ValueError, match="not supported for strided convolutions"):
        nn.Conv1d(3, 4, 3, stride=2, padding="same")
    with pytest.raises(ValueError, match="1-tuple"):
        F.conv1d(x, w, stride=(1, 1))


TCONV1D = [
    dict(name="plain", args=(3, 2, 3), x=(2, 3, 7)),
    dict(name="stride-output-padding", args=(4, 6, 3),
         kw=dict(stride=2, padding=1, output_padding=1, groups=2), x=(1, 4, 9)),
    dict(name="dilation-no-bias", args=(2, 3, 4), kw=dict(stride=3, dilation=2, bias=False,
                                                         output_padding=2), x=(3, 2, 5)),
    dict(name="unbatched", args=(3, 5, 2), kw=dict(stride=2, padding=1), x=(3, 11)),
]


@pytest.mark.parametrize("case", TCONV1D, ids=[c["name"] for c in TCONV1D])
def test_conv_transpose1d(device, port, close, randn, case):
    torch.manual_seed(5)
    kw = case.get("kw", {})
    theirs = tnn.ConvTranspose1d(*case["args"], **kw)
    ours = port(nn.ConvTranspose1d(*case["args"], **kw), theirs, device)
    assert list(ours.state_dict()) == list(theirs.state_dict()) and repr(ours) == repr(theirs)
    ox, tx = both(randn(case["x"], 6), device, grad=True)
    got, ref = ours(ox), theirs(tx)
    close(got, ref)
    backward(got, ref, device, randn, 7)
    close(ox.grad, tx.grad)
    close_grads(ours, theirs, close)


def test_conv_transpose1d_output_size(device, port, close, randn):
    torch.manual_seed(8)
    theirs = tnn.ConvTranspose1d(2, 3, 3, stride=3, padding=1)
    ours = port(nn.ConvTranspose1d(2, 3, 3, stride=3, padding=1), theirs, device)
    x = randn((2, 2, 5), 9)
    for size in ([13], [15], (2, 3, 14)):
        close(ours(ag.tensor(x, device=device), output_size=size),
              theirs(torch.tensor(x), output_size=size))
    with pytest.raises(ValueError, match="valid sizes range from 13 to 15"):
        ours(ag.tensor(x, device=device), output_size=[16])
    with pytest.raises(ValueError, match="output_size must have 1 or 3 elements"):
        ours(ag.tensor(x, device=device), output_size=[3, 14])
    with pytest.raises(ValueError, match="zeros"):
        nn.ConvTranspose1d(2, 3, 3, padding_mode="reflect")


def test_conv_transpose1d_functional(device, close, randn):
    (ox, tx), (ow, tw) = (both(randn(s, k), device, grad=True)
                          for k, s in enumerate([(1, 6, 8), (6, 2, 4)]))
    got = F.conv_transpose1d(ox, ow, stride=2, padding=1, output_padding=1, groups=3,
                             dilation=2)
    ref = TF.conv_transpose1d(tx, tw, stride=2, padding=1, output_padding=1, groups=3,
                              dilation=2)
    close(got, ref)
    backward(got, ref, device, randn, 10)
    close(ox.grad, tx.grad)
    close(ow.grad, tw.grad)


# ---- Hardtanh and ReLU6 --------------------------------------------------------------------------
def test_hardtanh_and_relu6(device, close):
    """Values and gradients at and beyond the bounds (0 at the bounds themselves, unlike
    clamp's), and NaN, as PyTorch's hardtanh."""
    x = np.array([-7.0, -2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 3.0, 6.0, 8.0, np.nan], np.float32)
    cases = [(nn.ReLU6(), tnn.ReLU6()), (nn.Hardtanh(), tnn.Hardtanh()),
             (nn.Hardtanh(-2.0, 6.0), tnn.Hardtanh(-2.0, 6.0)),
             (lambda t: F.relu6(t), lambda t: TF.relu6(t)),
             (lambda t: F.hardtanh(t, 0.5, 3.0), lambda t: TF.hardtanh(t, 0.5, 3.0))]
    for ours, theirs in cases:
        a, b = both(x, device, grad=True)
        got, ref = ours(a), theirs(b)
        close(got, ref)
        got.sum().backward()
        ref.sum().backward()
        close(a.grad, b.grad)
    assert repr(nn.ReLU6(inplace=True)) == "ReLU6(inplace=True)"
    assert repr(nn.Hardtanh(-2.0, 6.0)) == "Hardtanh(min_val=-2.0, max_val=6.0)"
    with pytest.raises(ValueError, match="min_val cannot be greater than max_val"):
        nn.Hardtanh(1.0, -1.0)


# ---- PReLU -------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_parameters,shape", [(1, (2, 3, 5, 4)), (3, (2, 3, 5, 4)),
                                                  (5, (4, 5)), (1, (7,)), (6, (1, 6, 9))],
                         ids=["shared-4d", "channels-4d", "channels-2d", "shared-1d",
                              "channels-3d"])
def test_prelu(device, port, close, randn, num_parameters, shape):
    theirs = tnn.PReLU(num_parameters, init=0.1)
    with torch.no_grad():
        theirs.weight.copy_(torch.tensor(randn((num_parameters,), 11) * 0.3))
    ours = port(nn.PReLU(num_parameters), theirs, device)
    assert list(ours.state_dict()) == ["weight"] and repr(ours) == repr(theirs)
    ox, tx = both(randn(shape, 12), device, grad=True)
    got, ref = ours(ox), theirs(tx)
    close(got, ref)
    backward(got, ref, device, randn, 13)
    close(ox.grad, tx.grad)
    close(ours.weight.grad, theirs.weight.grad)


def test_prelu_init_and_errors():
    np.testing.assert_array_equal(nn.PReLU(4, init=0.3).weight.numpy(), np.full(4, 0.3,
                                                                                 np.float32))
    assert nn.PReLU().weight.shape == (1,)
    with pytest.raises(RuntimeError, match="Mismatch of parameter numbers and input channel"):
        F.prelu(ag.randn(2, 3), ag.randn(2))
    with pytest.raises(RuntimeError, match="scalar or 1D tensor"):
        F.prelu(ag.randn(2, 3), ag.randn(1, 1))
    with pytest.raises(RuntimeError, match="Type promoting not supported"):
        F.prelu(ag.randn(2, 3), ag.randn(3).half())


# ---- interpolate -------------------------------------------------------------------------------
INTERP = [
    # nearest: integer scale (views), fractional scale and sizes (gathers), downsampling
    dict(shape=(2, 3, 7), size=17, mode="nearest"),
    dict(shape=(1, 2, 5, 6), scale_factor=2, mode="nearest"),
    dict(shape=(2, 1, 9, 7), scale_factor=(0.5, 1.7), mode="nearest"),
    dict(shape=(1, 2, 6, 9), size=(3, 3), mode="nearest"),
    dict(shape=(1, 2, 3, 4, 5), scale_factor=(1.5, 2, 0.6), mode="nearest"),
    dict(shape=(2, 3, 7), size=17, mode="nearest-exact"),
    dict(shape=(1, 2, 5, 6), scale_factor=(2.5, 0.5), mode="nearest-exact"),
    dict(shape=(2, 2, 8, 5), size=(3, 11), mode="nearest-exact"),
    dict(shape=(1, 2, 9, 7), scale_factor=1.3, mode="nearest", recompute_scale_factor=True),
    # linear and bilinear, both corner conventions
    dict(shape=(2, 3, 7), size=18, mode="linear"),
    dict(shape=(2, 3, 7), size=18, mode="linear", align_corners=True),
    dict(shape=(1, 2, 13), scale_factor=0.4, mode="linear"),
    dict(shape=(2, 3, 5, 7), scale_factor=2, mode="bilinear"),
    dict(shape=(2, 3, 5, 7), size=(9, 4), mode="bilinear", align_corners=True),
    dict(shape=(1, 2, 11, 6), scale_factor=(0.7, 2.3), mode="bilinear"),
    dict(shape=(1, 2, 11, 6), scale_factor=(0.7, 2.3), mode="bilinear",
         recompute_scale_factor=True),
    dict(shape=(1, 1, 6, 5), size=(1, 1), mode="bilinear", align_corners=True),
    dict(shape=(1, 2, 3, 4, 5), size=(5, 3, 8), mode="trilinear"),
    # taps that repeat with a period: slices of the edge-padded input instead of gathers
    dict(shape=(2, 3, 5), scale_factor=4, mode="linear"),
    dict(shape=(1, 2, 10, 9), scale_factor=0.5, mode="bilinear"),
    dict(shape=(1, 2, 3, 4, 5), scale_factor=2, mode="trilinear"),
    dict(shape=(1, 2, 6, 5), scale_factor=2, mode="bicubic"),
    # bicubic and area
    dict(shape=(2, 2, 5, 6), size=(9, 13), mode="bicubic"),
    dict(shape=(1, 3, 7, 4), scale_factor=(1.6, 0.75), mode="bicubic", align_corners=True),
    dict(shape=(2, 3, 9, 10), size=(4, 3), mode="area"),
    dict(shape=(2, 3, 11), scale_factor=0.5, mode="area"),
    dict(shape=(1, 2, 4, 6, 5), size=(3, 4, 2), mode="area"),
]


def _interp_id(case):
    parts = [case["mode"], "x".join(map(str, case["shape"]))]
    if "size" in case:
        parts.append(f"size{case['size']}")
    else:
        parts.append(f"scale{case['scale_factor']}")
    parts += [k for k in ("align_corners", "recompute_scale_factor") if case.get(k)]
    return "-".join(parts).replace(" ", "")


@pytest.mark.parametrize("case", INTERP, ids=[_interp_id(c) for c in INTERP])
def test_interpolate(device, close, randn, case):
    kw = {k: v for k, v in case.items() if k != "shape"}
    ox, tx = both(randn(case["shape"], 20), device, grad=True)
    got, ref = F.interpolate(ox, **kw), TF.interpolate(tx, **kw)
    close(got, ref)
    backward(got, ref, device, randn, 21)
    close(ox.grad, tx.grad)


def test_interpolate_plans():
    """Which axes run as views, periodic slices or gathers (no device needed)."""
    from anygpu.nn.upsampling import _axis_plan

    assert _axis_plan("nearest", 5, 10, False, 2.0)[0] == "repeat"
    assert _axis_plan("nearest", 9, 3, False, None)[0] == "repeat"
    assert _axis_plan("nearest", 5, 3, False, 0.6)[0] == "periodic"
    assert _axis_plan("bilinear", 7, 14, False, 2.0)[0] == "periodic"
    assert _axis_plan("bilinear", 9, 4, False, 0.5)[0] == "periodic"
    assert _axis_plan("bicubic", 6, 12, False, 2.0)[0] == "periodic"
    assert _axis_plan("linear", 7, 18, False, None)[0] == "gather"
    assert _axis_plan("bilinear", 5, 9, True, None)[0] == "gather"


def test_interpolate_nearest_integers(device, close):
    x = np.random.default_rng(22).integers(-50, 50, (2, 3, 5, 4)).astype(np.uint8)
    for kw in (dict(scale_factor=(1.5, 3)), dict(size=(3, 7), mode="nearest-exact")):
        close(F.interpolate(ag.tensor(x, device=device), **kw),
              TF.interpolate(torch.tensor(x), **kw))


def test_upsample_layers(device, close, randn):
    x = randn((1, 2, 5, 3), 23)
    pairs = [(nn.Upsample(scale_factor=2.5, mode="bilinear"),
              tnn.Upsample(scale_factor=2.5, mode="bilinear")),
             (nn.Upsample(size=(4, 7), mode="nearest-exact"),
              tnn.Upsample(size=(4, 7), mode="nearest-exact")),
             (nn.Upsample(scale_factor=(2, 3), mode="bicubic", align_corners=True),
              tnn.Upsample(scale_factor=(2, 3), mode="bicubic", align_corners=True)),
             (nn.UpsamplingNearest2d(scale_factor=3), tnn.UpsamplingNearest2d(scale_factor=3)),
             (nn.UpsamplingBilinear2d(size=(8, 4)), tnn.UpsamplingBilinear2d(size=(8, 4)))]
    for ours, theirs in pairs:
        assert repr(ours) == repr(theirs) and not list(ours.state_dict())
        ox, tx = both(x, device, grad=True)
        got, ref = ours(ox), theirs(tx)
        close(got, ref)
        got.sum().backward()
        ref.sum().backward()
        close(ox.grad, tx.grad)


ERRORS = [
    (dict(size=4, scale_factor=2), ValueError, "only one of size or scale_factor"),
    (dict(), ValueError, "either size or scale_factor"),
    (dict(size=4, align_corners=True), ValueError, "align_corners option can only be set"),
    (dict(size=(4, 4, 4)), ValueError, "same number of spatial dimensions"),
    (dict(scale_factor=(2.0,)), ValueError, "scale_factor must have the same number"),
    (dict(size=(4, 4.0)), TypeError, "expected size to be one of int"),
    (dict(size=4, recompute_scale_factor=True), ValueError, "not meaningful with an explicit"),
    (dict(size=4, mode="linear"), NotImplementedError, "Got 4D input, but linear mode needs 3D"),
    (dict(size=4, mode="trilinear"), NotImplementedError, "trilinear mode needs 5D"),
    (dict(size=4, mode="bogus"), NotImplementedError, "Only 3D, 4D and 5D"),
    (dict(size=4, mode="nearest", antialias=True), ValueError, "Anti-alias option"),
    (dict(scale_factor=0.1), RuntimeError, "sizes should be greater than 0"),
]


@pytest.mark.parametrize("kw,error,match", ERRORS, ids=[m for _, _, m in ERRORS])
def test_interpolate_errors(kw, error, match):
    x = np.random.default_rng(24).standard_normal((1, 2, 5, 6)).astype(np.float32)
    with pytest.raises(error, match=match):  # torch's own error, to keep the two in step
        TF.interpolate(torch.tensor(x), **kw)
    with pytest.raises(error, match=match):
        F.interpolate(ag.tensor(x), **kw)


def test_interpolate_rank_errors():
    with pytest.raises(NotImplementedError, match="Got 3D input, but bilinear mode needs 4D"):
        F.interpolate(ag.randn(1, 2, 5), size=3, mode="bilinear")
    with pytest.raises(NotImplementedError, match=r"Only 3D, 4D and 5D .* \(got 2D\)"):
        F.interpolate(ag.randn(2, 5), size=3)
    with pytest.raises(NotImplementedError, match="bicubic"):
        F.interpolate(ag.randn(1, 1, 2, 3, 4), size=3, mode="bicubic")
    with pytest.raises(NotImplementedError, match="upsample_bilinear"):
        F.interpolate(ag.tensor(np.ones((1, 1, 2, 2), np.int64)), size=3, mode="bilinear")
    with pytest.raises(NotImplementedError, match="antialias"):
        F.interpolate(ag.randn(1, 1, 4, 4), size=3, mode="bilinear", antialias=True)


# ---- one_hot -----------------------------------------------------------------------------------
def test_one_hot(device, close):
    x = np.random.default_rng(25).integers(0, 7, (3, 5)).astype(np.int64)
    for num_classes in (-1, 7, 11):
        got = F.one_hot(ag.tensor(x, device=device), num_classes)
        assert got.dtype == ag.int64
        close(got, TF.one_hot(torch.tensor(x), num_classes))
    close(F.one_hot(ag.tensor(3, device=device), 5), TF.one_hot(torch.tensor(3), 5))
    empty = np.zeros((0, 2), np.int64)
    close(F.one_hot(ag.tensor(empty, device=device), 4), TF.one_hot(torch.tensor(empty), 4))


@pytest.mark.parametrize("x,num_classes,match", [
    (np.array([1, 2], np.int32), -1, "LongTensor"),
    (np.array([1, -2]), -1, "non-negative"),
    (np.zeros(0, np.int64), -1, "Can not infer"),
    (np.array([1, 2]), 0, "smaller than num_classes"),
])
def test_one_hot_errors(x, num_classes, match):
    with pytest.raises(RuntimeError, match=match):
        TF.one_hot(torch.tensor(x), num_classes)
    with pytest.raises(RuntimeError, match=match):
        F.one_hot(ag.tensor(x), num_classes)


# ---- norms -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [dict(), dict(p=1.0, dim=0), dict(p=3.0, dim=-1),
                                dict(p=math.inf, dim=2), dict(dim=(1, 2), eps=0.5)],
                         ids=["default", "p1-dim0", "p3-last", "inf", "dims-eps"])
def test_normalize(device, close, randn, kw):
    x = randn((3, 4, 5), 26)
    x[1, :, 2] = 0.0  # a zero vector along dim 1: the output stays 0, the gradient finite
    ox, tx = both(x, device, grad=True)
    got, ref = F.normalize(ox, **kw), TF.normalize(tx, **kw)
    close(got, ref)
    backward(got, ref, device, randn, 27)
    close(ox.grad, tx.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shapes,dim,eps", [(((4, 7), (4, 7)), 1, 1e-8),
                                            (((3, 1, 5), (2, 5)), -1, 1e-8),
                                            (((2, 6, 3), (2, 6, 3)), 1, 2.0)],
                         ids=["rows", "broadcast", "large-eps"])
def test_cosine_similarity(device, close, randn, shapes, dim, eps):
    (o1, t1), (o2, t2) = (both(randn(s, 28 + k), device, grad=True)
                          for k, s in enumerate(shapes))
    got, ref = F.cosine_similarity(o1, o2, dim, eps), TF.cosine_similarity(t1, t2, dim, eps)
    close(got, ref)
    backward(got, ref, device, randn, 30)
    close(o1.grad, t1.grad)
    close(o2.grad, t2.grad)
    module = nn.CosineSimilarity(dim, eps)
    close(module(o1, o2), tnn.CosineSimilarity(dim, eps)(t1, t2))


def test_cosine_similarity_integer_error():
    with pytest.raises(RuntimeError, match="floating point"):
        F.cosine_similarity(ag.tensor([[1, 2]]), ag.tensor([[1, 0]]))


@pytest.mark.parametrize("p,keepdim,shapes", [(2.0, False, ((5, 9), (5, 9))),
                                              (1.0, True, ((3, 4, 6), (4, 6))),
                                              (3.0, False, ((7,), (2, 7))),
                                              (math.inf, True, ((4, 5), (4, 5)))],
                         ids=["p2", "p1-broadcast-keepdim", "p3-broadcast", "inf-keepdim"])
def test_pairwise_distance(device, close, randn, p, keepdim, shapes):
    (o1, t1), (o2, t2) = (both(randn(s, 31 + k), device, grad=True)
                          for k, s in enumerate(shapes))
    got = F.pairwise_distance(o1, o2, p, keepdim=keepdim)
    ref = TF.pairwise_distance(t1, t2, p, keepdim=keepdim)
    close(got, ref)
    backward(got, ref, device, randn, 33)
    close(o1.grad, t1.grad)
    close(o2.grad, t2.grad)
    module = nn.PairwiseDistance(p, eps=1e-3, keepdim=keepdim)
    close(module(o1, o2), tnn.PairwiseDistance(p, eps=1e-3, keepdim=keepdim)(t1, t2))


# ---- parameter containers ----------------------------------------------------------------------
class _Mixer(nn.Module):
    """Uses a ParameterList and a ParameterDict, as the torch twin below does."""

    def __init__(self, lib, params):
        super().__init__()
        self.scales = params.ParameterList([lib.zeros(3, 4), lib.zeros(4)])
        self.extra = params.ParameterDict({"shift": lib.zeros(4), "gain": lib.zeros(1)})

    def forward(self, x):
        h = x @ self.scales[0] + self.scales[1]
        return h * self.extra["gain"] + self.extra["shift"]


class _TorchMixer(tnn.Module):
    def __init__(self):
        super().__init__()
        self.scales = tnn.ParameterList([torch.zeros(3, 4), torch.zeros(4)])
        self.extra = tnn.ParameterDict({"shift": torch.zeros(4), "gain": torch.zeros(1)})

    forward = _Mixer.forward


def test_parameter_containers(device, port, close, randn):
    theirs = _TorchMixer()
    with torch.no_grad():
        for k, p in enumerate(theirs.parameters()):
            p.copy_(torch.tensor(randn(tuple(p.shape), 40 + k)))
    ours = port(_Mixer(ag, nn), theirs, device)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert list(ours.state_dict()) == ["scales.0", "scales.1", "extra.gain", "extra.shift"]
    ox, tx = both(randn((5, 3), 45), device, grad=True)
    got, ref = ours(ox), theirs(tx)
    close(got, ref)
    backward(got, ref, device, randn, 46)
    close(ox.grad, tx.grad)
    close_grads(ours, theirs, close)


def test_parameter_list_behaviour():
    ours, theirs = nn.ParameterList(), tnn.ParameterList()
    for lib, params in ((ag, ours), (torch, theirs)):
        params.append(lib.ones(2))
        params.extend([lib.zeros(3), "note"])
        params += [lib.ones(1, 2)]
        params[1] = lib.ones(5)
    assert len(ours) == len(theirs) == 4
    assert list(ours.state_dict()) == list(theirs.state_dict()) == ["0", "1", "3"]
    assert [type(p).__name__ for p in ours] == ["Parameter", "Parameter", "str", "Parameter"]
    assert ours[1].shape == (5,) and ours[-1].shape == (1, 2) and ours[2] == "note"
    assert len(ours[1:3]) == 2 and ours[1:3][0] is ours[1]
    assert len(list(ours.parameters())) == 3 and "0" not in dir(ours)
    with pytest.raises(IndexError, match="out of range"):
        ours[4]
    with pytest.raises(TypeError, match="iterable"):
        ours.extend(ag.ones(2))
    with pytest.raises(RuntimeError, match="should not be called"):
        ours(ag.ones(2))
    assert repr(ours).startswith("ParameterList(\n    (0): Parameter containing: [")


def test_parameter_dict_behaviour():
    ours = nn.ParameterDict({"b": ag.ones(2), "a": ag.zeros(3)})
    theirs = tnn.ParameterDict({"b": torch.ones(2), "a": torch.zeros(3)})
    assert list(ours) == list(theirs) == ["a", "b"]  # a plain dict goes in sorted, as in torch
    ours.update([("z", ag.ones(1)), ("c", ag.ones(1))])
    assert list(ours.keys()) == ["a", "b", "z", "c"]
    assert isinstance(ours["z"], nn.Parameter) and "c" in ours and ours.get("y") is None
    assert ours.pop("z").shape == (1,) and list(ours.state_dict()) == ["a", "b", "c"]
    assert ours.setdefault("d", ag.ones(4)).shape == (4,)
    assert list((ours | nn.ParameterDict({"e": ag.ones(1)}))) == ["a", "b", "c", "d", "e"]
    key, value = ours.popitem()
    assert key == "d" and value.shape == (4,) and len(ours) == 3
    del ours["a"]
    assert list(ours.state_dict()) == ["b", "c"]
    with pytest.raises(TypeError, match="not a string"):
        ours[1] = ag.ones(1)
    with pytest.raises(KeyError, match="already exists"):
        ours["keys"] = ag.ones(1)
    with pytest.raises(RuntimeError, match="should not be called"):
        ours(ag.ones(1))
    ours.clear()
    assert len(ours) == 0 and not list(ours.parameters())
