"""anygpu.nn.functional against torch.nn.functional, on every available device."""

from __future__ import annotations

import numpy as np
import pytest

import anygpu as ag
from anygpu.nn import convolution
from anygpu.nn import functional as F
from anygpu.runtime.registry import get_device

torch = pytest.importorskip("torch")
TF = torch.nn.functional


def both(x, device):
    """(anygpu tensor on device, torch tensor) of the same host data, or (None, None)."""
    if x is None:
        return None, None
    return ag.tensor(x, device=device), torch.tensor(x)


LOGITS = (6, 5)
TARGET = np.array([0, 4, -100, 2, 1, 4])
CE_CASES = [dict(), dict(weight=True), dict(label_smoothing=0.2),
            dict(weight=True, label_smoothing=0.1), dict(reduction="sum", weight=True),
            dict(reduction="none", label_smoothing=0.3), dict(ignore_index=4)]


@pytest.mark.parametrize("kw", CE_CASES, ids=range(len(CE_CASES)))
def test_cross_entropy_class_indices(device, close, randn, kw):
    kw = dict(kw)
    w = np.random.default_rng(1).uniform(0.5, 2, LOGITS[1]).astype(np.float32) \
        if kw.pop("weight", False) else None
    target = np.where(TARGET < 0, 3, TARGET) if "ignore_index" in kw else TARGET
    (x, tx), (t, tt), (wa, wt) = both(randn(LOGITS, 0, 2.0), device), both(target, device), \
        both(w, device)
    close(F.cross_entropy(x, t, weight=wa, **kw), TF.cross_entropy(tx, tt, weight=wt, **kw))
    if not kw.get("label_smoothing"):
        close(F.nll_loss(x.log_softmax(1), t, weight=wa, **kw),
              TF.nll_loss(tx.log_softmax(1), tt, weight=wt, **kw))


@pytest.mark.parametrize("kw", [dict(), dict(weight=True, label_smoothing=0.1),
                                dict(reduction="none"), dict(reduction="sum")])
def test_cross_entropy_probabilities(device, close, randn, kw):
    kw = dict(kw)
    w = np.linspace(0.5, 2, LOGITS[1]).astype(np.float32) if kw.pop("weight", False) else None
    p = np.random.default_rng(2).dirichlet(np.ones(LOGITS[1]), LOGITS[0]).astype(np.float32)
    (x, tx), (t, tt), (wa, wt) = both(randn(LOGITS, 3), device), both(p, device), both(w, device)
    close(F.cross_entropy(x, t, weight=wa, **kw), TF.cross_entropy(tx, tt, weight=wt, **kw))


def test_cross_entropy_spatial_and_unbatched(device, close, randn):
    x, tx = both(randn((2, 3, 4, 5), 4), device)
    t = np.random.default_rng(5).integers(0, 3, (2, 4, 5))
    t[0, 0, :2] = -100
    a, tt = both(t, device)
    for kw in [dict(), dict(label_smoothing=0.1, reduction="none")]:
        close(F.cross_entropy(x, a, **kw), TF.cross_entropy(tx, tt, **kw))
    v, tv = both(randn((5,), 6), device)
    close(F.cross_entropy(v, ag.tensor(3, device=device)), TF.cross_entropy(tv, torch.tensor(3)))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_regression_losses(device, close, randn, reduction):
    (x, tx), (y, ty) = both(randn((4, 3), 7), device), both(randn((4, 3), 8), device)
    (w, tw) = both(np.abs(randn((4, 3), 9)) + 0.1, device)
    close(F.mse_loss(x, y, reduction=reduction), TF.mse_loss(tx, ty, reduction=reduction))
    close(F.l1_loss(x, y, reduction=reduction), TF.l1_loss(tx, ty, reduction=reduction))
    close(F.mse_loss(x, y, reduction=reduction, weight=w),
          TF.mse_loss(tx, ty, reduction=reduction, weight=tw))


@pytest.mark.parametrize("kw", [dict(), dict(pos_weight=True), dict(weight=True,
                                                                    reduction="sum"),
                                dict(reduction="none", pos_weight=True)])
def test_binary_cross_entropy_with_logits(device, close, randn, kw):
    kw = dict(kw)
    pw = np.array([0.5, 1.0, 3.0], np.float32) if kw.pop("pos_weight", False) else None
    w = np.abs(randn((4, 3), 10)) if kw.pop("weight", False) else None
    t = np.random.default_rng(11).uniform(0, 1, (4, 3)).astype(np.float32)
    (x, tx), (a, ta) = both(randn((4, 3), 12, 8.0), device), both(t, device)
    (p, tp), (wa, wt) = both(pw, device), both(w, device)
    close(F.binary_cross_entropy_with_logits(x, a, weight=wa, pos_weight=p, **kw),
          TF.binary_cross_entropy_with_logits(tx, ta, weight=wt, pos_weight=tp, **kw))


def test_loss_modules(close, randn):
    from anygpu import nn
    x, t = randn((4, 3), 13), np.array([0, 2, 1, 2])
    w = np.array([1.0, 2.0, 0.5], np.float32)
    ours = nn.CrossEntropyLoss(weight=ag.tensor(w), label_smoothing=0.1)
    theirs = torch.nn.CrossEntropyLoss(weight=torch.tensor(w), label_smoothing=0.1)
    assert list(ours.state_dict()) == list(theirs.state_dict()) == ["weight"]
    close(ours(ag.tensor(x), ag.tensor(t)), theirs(torch.tensor(x), torch.tensor(t)))
    close(nn.NLLLoss(reduction="sum")(ag.tensor(x), ag.tensor(t)),
          torch.nn.NLLLoss(reduction="sum")(torch.tensor(x), torch.tensor(t)))
    y = randn((4, 3), 14)
    close(nn.MSELoss()(ag.tensor(x), ag.tensor(y)), torch.nn.MSELoss()(torch.tensor(x),
                                                                        torch.tensor(y)))
    close(nn.L1Loss(reduction="none")(ag.tensor(x), ag.tensor(y)),
          torch.nn.L1Loss(reduction="none")(torch.tensor(x), torch.tensor(y)))
    s = (y > 0).astype(np.float32)
    close(nn.BCEWithLogitsLoss(pos_weight=ag.tensor(w))(ag.tensor(x), ag.tensor(s)),
          torch.nn.BCEWithLogitsLoss(pos_weight=torch.tensor(w))(torch.tensor(x),
                                                                 torch.tensor(s)))
    with pytest.raises(ValueError, match="not a valid value for reduction"):
        F.mse_loss(ag.tensor(x), ag.tensor(y), reduction="avg")


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular", "constant"])
def test_pad_modes(device, close, randn, mode):
    x, tx = both(randn((1, 2, 4, 5), 15), device)
    close(F.pad(x, [2, 1, 3, 0], mode=mode), TF.pad(tx, [2, 1, 3, 0], mode=mode))


def test_conv_transpose2d_matches_conv2d_gradient(device, close, randn):
    # conv_transpose2d is the adjoint of conv2d: <conv2d(x, w), y> == <x, conv_transpose2d(y, w)>
    x, w = randn((1, 2, 7, 7), 16), randn((3, 2, 3, 3), 17)
    y = randn((1, 3, 4, 4), 18)
    kw = dict(stride=2, padding=1)
    lhs = (F.conv2d(ag.tensor(x, device=device), ag.tensor(w, device=device), **kw).numpy()
           * y).sum()
    rhs = (F.conv_transpose2d(ag.tensor(y, device=device), ag.tensor(w, device=device),
                              **kw).numpy() * x).sum()
    np.testing.assert_allclose(lhs, rhs, rtol=1e-4)
    close(F.conv_transpose2d(ag.tensor(y, device=device), ag.tensor(w, device=device), **kw),
          TF.conv_transpose2d(torch.tensor(y), torch.tensor(w), **kw))


# gradients through an activation after a convolution: the weight gradient's terms select
# between the upstream gradient and zero (GCC 12 at -O3 vectorized such sums wrongly)
CONV_ACT_CASES = [((4, 3, 8, 8), 5, 3, 1, 0, "relu"), ((2, 4, 9, 7), 6, 3, 2, 1, "relu"),
                  ((3, 2, 6, 6), 4, 1, 1, 0, "leaky_relu"), ((2, 3, 7, 7), 3, 5, 1, 2, "hardtanh")]


@pytest.mark.parametrize("shape,out,k,stride,padding,act", CONV_ACT_CASES,
                         ids=range(len(CONV_ACT_CASES)))
def test_conv2d_activation_gradients(device, close, randn, shape, out, k, stride, padding, act):
    x, w = randn(shape, 40), randn((out, shape[1], k, k), 41, 0.3)
    b, up = randn((out,), 42), None
    grads = []
    for lib, fn in ((ag, F), (torch, TF)):
        kw = dict(device=device) if lib is ag else {}
        tx, tw, tb = (lib.tensor(v, requires_grad=True, **kw) for v in (x, w, b))
        y = getattr(fn, act)(fn.conv2d(tx, tw, tb, stride=stride, padding=padding))
        if up is None:
            up = randn(tuple(y.shape), 43)
        (y * lib.tensor(up, **kw)).sum().backward()
        grads.append((tx.grad, tw.grad, tb.grad))
    for got, want in zip(*grads):
        close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("k,padding,dtype", [(3, 1, "float32"), (5, 2, "float32"),
                                             (3, 0, "bfloat16"), ((3, 1), (1, 0), "float32"),
                                             (4, "same", "float32"), (3, (2, 1), "bfloat16")])
def test_conv2d_data_gradient_is_a_convolution(device, close, randn, k, padding, dtype):
    # a stride-1 convolution's input gradient on a GPU: the convolution of the padded output
    # gradient with the flipped weight, one product written in place; no kernel sums the
    # overlapping windows of a product nine (k x k) times the input's size; the padding's
    # gradient is not computed (the product's pixels are the input's). Against PyTorch,
    # square and rectangular kernels, with and without padding (uneven for "same" with an even
    # kernel), float32 and bfloat16
    if not get_device(device).supports(getattr(ag, dtype)):
        pytest.skip(f"{dtype} is not supported on {device}")
    kh, kw = (k, k) if isinstance(k, int) else k
    xh, wh, gh = randn((2, 32, 14, 12), 50), randn((24, 32, kh, kw), 51, 0.1), None
    x = ag.tensor(xh, device=device, requires_grad=True)
    w = ag.tensor(wh, device=device, requires_grad=True)
    with ag.profile() as prof:
        y = F.conv2d(x.cast(dtype), w.cast(dtype), padding=padding).float()
        gh = randn(tuple(y.shape), 52)
        (y * ag.tensor(gh, device=device)).sum().backward()
    tx, tw = torch.tensor(xh, requires_grad=True), torch.tensor(wh, requires_grad=True)
    tdtype = getattr(torch, dtype)
    ty = TF.conv2d(tx.to(tdtype), tw.to(tdtype), padding=padding)
    (ty.float() * torch.tensor(gh)).sum().backward()
    tol = 1e-4 if dtype == "float32" else 3e-2
    close(x.grad, tx.grad, rtol=tol, atol=tol * float(tx.grad.abs().max()))
    close(w.grad, tw.grad, rtol=tol, atol=tol * float(tw.grad.abs().max()))
    if not device.startswith("cpu"):
        window_sums = [e for e in prof.events if e.kind == "kernel" and not e.flops and
                       e.nbytes > 3 * xh.nbytes]
        assert not window_sums, [e.name for e in window_sums]
        # the data gradient's product covers the input's pixels, not the padding's
        ph, pw = (kh - 1, kw - 1) if padding == "same" else \
            (2 * padding, 2 * padding) if isinstance(padding, int) else \
            (2 * padding[0], 2 * padding[1])
        n, c, h, w = xh.shape
        padded = 2 * n * c * (h + ph) * (w + pw) * wh.shape[0] * kh * kw
        products = [e.flops for e in prof.events if e.kind == "kernel" and e.flops]
        assert (ph, pw) == (0, 0) or padded not in products, (padded, products)
        assert 2 * n * c * h * w * wh.shape[0] * kh * kw in products, products


WINOGRAD_CASES = [((1, 3, 8, 8), 4, 1, True), ((2, 5, 9, 7), 6, 1, False),
                  ((1, 4, 5, 6), 3, 0, True), ((3, 2, 4, 3), 5, "same", True)]


@pytest.mark.parametrize("held", [False, True], ids=["tiles computed again", "tiles held"])
@pytest.mark.parametrize("shape,out,padding,bias", WINOGRAD_CASES,
                         ids=range(len(WINOGRAD_CASES)))
def test_conv2d_winograd(device, close, randn, monkeypatch, shape, out, padding, bias, held):
    # F(2x2, 3x3) forced on: odd and even output sizes (a last half tile), batch 1, no padding,
    # with and without bias; forward and both gradients against PyTorch's direct convolution,
    # the input's transformed tiles computed again in the backward pass or held from the forward
    monkeypatch.setattr(convolution, "WINOGRAD", True)
    if held:
        monkeypatch.setattr(convolution, "WINOGRAD_RECOMPUTE", 0)
    xh, wh = randn(shape, 30), randn((out, shape[1], 3, 3), 31)
    bh = randn((out,), 32) if bias else None
    x = ag.tensor(xh, device=device, requires_grad=True)
    w = ag.tensor(wh, device=device, requires_grad=True)
    b = ag.tensor(bh, device=device, requires_grad=True) if bias else None
    tx, tw = torch.tensor(xh, requires_grad=True), torch.tensor(wh, requires_grad=True)
    tb = torch.tensor(bh, requires_grad=True) if bias else None
    y, ty = F.conv2d(x, w, b, padding=padding), TF.conv2d(tx, tw, tb, padding=padding)
    close(y, ty, rtol=1e-4, atol=1e-4)
    gh = randn(tuple(ty.shape), 33)
    (y * ag.tensor(gh, device=device)).sum().backward()
    (ty * torch.tensor(gh)).sum().backward()
    close(x.grad, tx.grad, rtol=1e-4, atol=1e-4)
    close(w.grad, tw.grad, rtol=1e-4, atol=1e-4)
    if bias:
        close(b.grad, tb.grad, rtol=1e-4, atol=1e-4)


def test_winograd_holds_no_transforms(monkeypatch):
    # the tensors the backward pass keeps from a Winograd convolution: the filters and the input
    # as they are, not their transforms (16 x O x C, and 16 x C x tiles), which the product's
    # own rule computes again
    monkeypatch.setattr(convolution, "WINOGRAD", True)
    x = ag.randn(2, 8, 10, 10, requires_grad=True)
    w = ag.randn(32, 8, 3, 3, requires_grad=True)
    held = _held_shapes(F.conv2d(x, w, padding=1))
    assert w.shape in held and (2, 8, 12, 12) in held  # the weight, the padded input
    assert not held & {(16, 32, 8), (4, 4, 32, 8), (16, 8, 50)}  # 5 x 5 tiles of 2 images
    # above WINOGRAD_RECOMPUTE bytes the tiles are held, the filters' transform still not
    monkeypatch.setattr(convolution, "WINOGRAD_RECOMPUTE", 16 * 8 * 50 * 4 - 1)
    assert _held_shapes(F.conv2d(x, w, padding=1)) & {(16, 32, 8), (16, 8, 50)} == {(16, 8, 50)}


def _held_shapes(y):
    held, stack, seen = set(), [y], set()
    while stack:
        t = stack.pop()
        if id(t) in seen or t._ctx is None:
            continue
        seen.add(id(t))
        for p in t._ctx[1]:
            held.add(p.shape)
            stack.append(p)
    return held


def test_winograd_choice(monkeypatch):
    # where it runs: float32 on GPUs from 128 channels on; never on the processor or for
    # 16-bit floats; the module switch overrides
    monkeypatch.setattr(convolution, "WINOGRAD", None)
    big, w = ag.randn(1, 128, 6, 6), ag.randn(128, 128, 3, 3)
    assert not convolution._winograd_wins(big, w)  # cpu
    monkeypatch.setattr(convolution, "WINOGRAD", True)
    assert convolution._winograd_wins(big, w)
    monkeypatch.setattr(convolution, "WINOGRAD", False)
    assert not convolution._winograd_wins(big, w)


def test_winograd_choice_on_gpus(device, monkeypatch):
    # exact float32 on a GPU from 128 channels on; where products may run as tf32 and the device
    # has tf32 tensor cores (CUDA from compute capability 8.0), the direct convolution where its
    # windows are written out for them (a large product), Winograd for a small one
    if device.startswith("cpu"):
        pytest.skip("the processor never runs it")
    monkeypatch.setattr(convolution, "WINOGRAD", None)
    x, w = ag.randn(1, 128, 6, 6, device=device), ag.randn(128, 128, 3, 3, device=device)
    big = ag.zeros(16, 128, 58, 58, device=device)  # (its shape alone is read)
    assert convolution._winograd_wins(x, w) and convolution._winograd_wins(big, w)
    assert not convolution._winograd_wins(x[:, :64], w[:64, :64])
    dev = get_device(device)
    tf32 = dev.dialect == "cuda" and dev.info.extra.get("cc", (0, 0)) >= (8, 0)
    before = ag.get_float32_matmul_precision()
    try:
        ag.set_float32_matmul_precision("high")
        assert convolution._winograd_wins(x, w)
        assert convolution._winograd_wins(big, w) == (not tf32)
    finally:
        ag.set_float32_matmul_precision(before)


def test_pooling_functional(device, close, randn):
    x, tx = both(randn((2, 2, 9, 7), 19), device)
    for kw in [dict(kernel_size=3, stride=2, padding=1, ceil_mode=True),
               dict(kernel_size=(3, 2), stride=(2, 3), padding=(1, 0))]:
        close(F.avg_pool2d(x, **kw), TF.avg_pool2d(tx, **kw))
        got, idx = F.max_pool2d(x, return_indices=True, **kw)
        ref, tidx = TF.max_pool2d(tx, return_indices=True, **kw)
        close(got, ref)
        close(idx, tidx)
    close(F.avg_pool2d(x, 2, divisor_override=3), TF.avg_pool2d(tx, 2, divisor_override=3))
    close(F.adaptive_avg_pool2d(x, (4, 5)), TF.adaptive_avg_pool2d(tx, (4, 5)))
    with pytest.raises(ValueError, match="pad should be at most half"):
        F.max_pool2d(x, 2, padding=2)


def test_batch_norm_functional_updates_in_place(device, close, randn):
    x, tx = both(randn((5, 3), 20, 2.0), device)
    rm, rv = ag.zeros(3, device=device), ag.ones(3, device=device)
    trm, trv = torch.zeros(3), torch.ones(3)
    out = F.batch_norm(x, rm, rv, training=True, momentum=0.2)
    ref = TF.batch_norm(tx, trm, trv, training=True, momentum=0.2)
    close(out, ref, atol=1e-5)
    close(rm, trm)
    close(rv, trv)
    close(F.batch_norm(x, rm, rv, eps=1e-3), TF.batch_norm(tx, trm, trv, eps=1e-3), atol=1e-5)


def test_norms_functional(device, close, randn):
    x, tx = both(randn((2, 6, 4), 21, 3.0), device)
    (w, tw), (b, tb) = both(randn((4,), 22), device), both(randn((4,), 23), device)
    close(F.layer_norm(x, (4,), w, b, 1e-3), TF.layer_norm(tx, (4,), tw, tb, 1e-3), atol=1e-4)
    close(F.rms_norm(x, [4], w), TF.rms_norm(tx, [4], tw), atol=1e-4)
    (gw, tgw), (gb, tgb) = both(randn((6,), 24), device), both(randn((6,), 25), device)
    close(F.group_norm(x, 3, gw, gb), TF.group_norm(tx, 3, tgw, tgb), atol=1e-4)
    with pytest.raises(ValueError, match="does not end with"):
        F.layer_norm(x, (3,))


def test_embedding_and_dropout_functional(device, close, randn):
    (w, tw) = both(randn((7, 3), 26), device)
    idx = np.array([[1, 6, 0], [-1, 2, 2]])
    close(F.embedding(ag.tensor(idx, device=device), w),
          TF.embedding(torch.tensor(idx % 7), tw))
    x = ag.tensor(randn((4, 4), 27), device=device)
    assert F.dropout(x, 0.5, training=False) is x
    assert F.dropout(x, 0.0) is x
