"""Attention and Transformer layers against torch with the same weights, on every device."""

from __future__ import annotations

import numpy as np
import pytest

import anygpu as ag
from anygpu import nn
from anygpu.nn import functional as F

torch = pytest.importorskip("torch")
tnn = torch.nn
TF = torch.nn.functional
# a float attn_mask with a bool key_padding_mask is tested on purpose; torch warns about it
pytestmark = pytest.mark.filterwarnings("ignore:Support for mismatched:UserWarning")


def both(x, device, grad=False):
    """(our tensor, torch's tensor) holding ``x``."""
    return (ag.tensor(x, device=device, requires_grad=grad),
            torch.tensor(x, requires_grad=grad))


def bool_mask(shape, seed):
    """A random bool mask whose last axis always has its first entry True and its last False
    (so every query keeps a key under either convention of True, and with a causal mask)."""
    mask = np.random.default_rng(seed).random(shape) < 0.5
    mask[..., 0], mask[..., -1] = True, False
    return mask


def padding_mask(shape, seed):
    """A key_padding_mask (True leaves a key out) that never leaves out the first key."""
    return ~bool_mask(shape, seed)


SDPA_CASES = ["plain", "causal", "bool", "float", "scale", "broadcast"]


@pytest.mark.parametrize("case", SDPA_CASES)
def test_sdpa(device, close, randn, case):
    q, k, v = randn((2, 3, 4, 8), 1), randn((2, 3, 5, 8), 2), randn((2, 3, 5, 6), 3)
    kw: dict = {}
    ours_mask = theirs_mask = None
    if case == "causal":
        kw["is_causal"] = True
    elif case == "bool":
        ours_mask, theirs_mask = both(bool_mask((2, 1, 4, 5), 4), device)
    elif case == "float":
        ours_mask, theirs_mask = both(randn((4, 5), 5), device)
    elif case == "scale":
        kw["scale"] = 0.3
    elif case == "broadcast":
        q, ours_mask = randn((2, 1, 4, 8), 6), None
        k, v = randn((3, 5, 8), 7), randn((3, 5, 6), 8)
    (oq, tq), (ok, tk), (ov, tv) = (both(t, device, grad=True) for t in (q, k, v))
    got = F.scaled_dot_product_attention(oq, ok, ov, attn_mask=ours_mask, **kw)
    ref = TF.scaled_dot_product_attention(tq, tk, tv, attn_mask=theirs_mask, **kw)
    close(got, ref)
    seed = randn(tuple(ref.shape), 9)
    (got * ag.tensor(seed, device=device)).sum().backward()
    (ref * torch.tensor(seed)).sum().backward()
    for ours, theirs in ((oq, tq), (ok, tk), (ov, tv)):
        close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-5)


def test_sdpa_dropout_and_errors(device):
    q = ag.randn(2, 4, 8, device=device)
    out = F.scaled_dot_product_attention(q, q, ag.ones(2, 4, 3, device=device), dropout_p=0.5)
    # each output row is a sum of kept weights scaled by 2: a mix of values, not all ones
    assert out.shape == (2, 4, 3) and not np.allclose(out.numpy(), 1.0)
    with pytest.raises(RuntimeError, match="attn_mask"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=ag.ones(4, 4, device=device),
                                       is_causal=True)


def mha_inputs(randn, batch_first, batched=True, source=6, kdim=12, vdim=12):
    def shape(length, dim):
        if not batched:
            return (length, dim)
        return (2, length, dim) if batch_first else (length, 2, dim)
    return randn(shape(4, 12), 10), randn(shape(source, kdim), 11), randn(shape(source, vdim), 12)


MHA_CASES = [
    dict(name="plain", batch_first=False),
    dict(name="batch-first", batch_first=True),
    dict(name="no-bias", batch_first=True, bias=False),
    dict(name="kdim-vdim", batch_first=False, kdim=5, vdim=7),
    dict(name="bool-mask", batch_first=True, attn_mask="bool"),
    dict(name="float-mask", batch_first=False, attn_mask="float"),
    dict(name="3d-mask", batch_first=True, attn_mask="3d"),
    dict(name="padding", batch_first=True, key_padding_mask=True),
    dict(name="padding-float-mask", batch_first=False, key_padding_mask=True,
         attn_mask="float"),
    dict(name="per-head", batch_first=True, average_attn_weights=False),
    dict(name="no-weights", batch_first=False, need_weights=False, attn_mask="bool",
         key_padding_mask=True),
    dict(name="unbatched", batch_first=True, batched=False, attn_mask="bool"),
]


@pytest.mark.parametrize("case", MHA_CASES, ids=[c["name"] for c in MHA_CASES])
def test_multihead_attention(device, port, close, randn, case):
    torch.manual_seed(20)
    case = dict(case)
    case.pop("name")
    batch_first, batched = case.pop("batch_first"), case.pop("batched", True)
    kdim, vdim = case.get("kdim", 12), case.get("vdim", 12)
    module_kw = {k: case.pop(k) for k in ("bias", "kdim", "vdim") if k in case}
    theirs = tnn.MultiheadAttention(12, 3, batch_first=batch_first, **module_kw)
    ours = port(nn.MultiheadAttention(12, 3, batch_first=batch_first, **module_kw), theirs,
                device)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    q, k, v = mha_inputs(randn, batch_first, batched, kdim=kdim, vdim=vdim)
    (oq, tq), (ok, tk), (ov, tv) = (both(t, device, grad=True) for t in (q, k, v))
    forward_kw: dict = dict(need_weights=case.pop("need_weights", True),
                            average_attn_weights=case.pop("average_attn_weights", True))
    ours_kw, theirs_kw = dict(forward_kw), dict(forward_kw)
    kind = case.pop("attn_mask", None)
    if kind is not None:
        mask = {"bool": lambda: padding_mask((4, 6), 13), "float": lambda: randn((4, 6), 13),
                "3d": lambda: randn((6, 4, 6), 13)}[kind]()
        ours_kw["attn_mask"], theirs_kw["attn_mask"] = both(mask, device)
    if case.pop("key_padding_mask", False):
        ours_kw["key_padding_mask"], theirs_kw["key_padding_mask"] = both(
            padding_mask((2, 6), 14), device)
    assert not case
    got, got_weights = ours(oq, ok, ov, **ours_kw)
    ref, ref_weights = theirs(tq, tk, tv, **theirs_kw)
    close(got, ref)
    if ref_weights is None:
        assert got_weights is None
    else:
        close(got_weights, ref_weights)
    seed = randn(tuple(ref.shape), 15)
    (got * ag.tensor(seed, device=device)).sum().backward()
    (ref * torch.tensor(seed)).sum().backward()
    for x, y in ((oq, tq), (ok, tk), (ov, tv)):
        close(x.grad, y.grad, rtol=1e-4, atol=1e-5)
    ours_grads = dict(ours.named_parameters())
    for name, param in theirs.named_parameters():
        close(ours_grads[name].grad, param.grad, rtol=1e-4, atol=1e-5)


def test_multihead_attention_causal_and_dropout(device, port, close, randn):
    torch.manual_seed(21)
    theirs = tnn.MultiheadAttention(8, 2, dropout=0.5).eval()
    ours = port(nn.MultiheadAttention(8, 2, dropout=0.5), theirs, device)
    x = randn((5, 2, 8), 16)
    causal = tnn.Transformer.generate_square_subsequent_mask(5)
    got, _ = ours(*(ag.tensor(x, device=device),) * 3, attn_mask=ag.tensor(causal.numpy(),
                                                                            device=device),
                  is_causal=True)
    ref, _ = theirs(*(torch.tensor(x),) * 3, attn_mask=causal, is_causal=True)
    close(got, ref)
    with pytest.raises(RuntimeError, match="Need attn_mask"):
        ours(*(ag.tensor(x, device=device),) * 3, is_causal=True)
    ours.train()
    a = ours(*(ag.tensor(x, device=device),) * 3)[0].numpy()
    b = ours(*(ag.tensor(x, device=device),) * 3)[0].numpy()
    assert not np.allclose(a, b)  # dropout draws a new mask each call in training


def test_multihead_attention_init():
    m = nn.MultiheadAttention(16, 4, kdim=8, vdim=6)
    assert m.in_proj_weight is None and m.k_proj_weight.shape == (16, 8)
    assert m.v_proj_weight.shape == (16, 6) and m.in_proj_bias.shape == (48,)
    assert np.all(m.in_proj_bias.numpy() == 0) and np.all(m.out_proj.bias.numpy() == 0)
    bound = float(np.sqrt(6 / (16 + 8)))
    weight = m.k_proj_weight.numpy()
    assert np.abs(weight).max() <= bound and weight.std() > bound / 4


LAYER_CASES = [
    dict(name="post-norm", batch_first=False),
    dict(name="pre-norm-gelu", batch_first=True, norm_first=True, activation="gelu"),
    dict(name="no-bias", batch_first=True, bias=False, layer_norm_eps=1e-3),
    dict(name="callable", batch_first=False, activation=TF.silu),
]


def _activation(kw):
    """The same keyword arguments with a torch callable replaced by ours."""
    out = dict(kw)
    if out.get("activation") is TF.silu:
        out["activation"] = F.silu
    return out


@pytest.mark.parametrize("case", LAYER_CASES, ids=[c["name"] for c in LAYER_CASES])
def test_transformer_encoder_layer(device, port, close, randn, case):
    torch.manual_seed(30)
    kw = {k: v for k, v in case.items() if k != "name"}
    theirs = tnn.TransformerEncoderLayer(12, 3, dim_feedforward=20, **kw).eval()
    ours = port(nn.TransformerEncoderLayer(12, 3, dim_feedforward=20, **_activation(kw)),
                theirs, device)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    shape = (2, 5, 12) if kw["batch_first"] else (5, 2, 12)
    x = randn(shape, 31)
    causal = tnn.Transformer.generate_square_subsequent_mask(5)
    padding = padding_mask((2, 5), 32)
    (ox, tx) = both(x, device, grad=True)
    got = ours(ox, src_mask=ag.tensor(causal.numpy(), device=device),
               src_key_padding_mask=ag.tensor(padding, device=device))
    ref = theirs(tx, src_mask=causal, src_key_padding_mask=torch.tensor(padding))
    close(got, ref, atol=1e-4)
    got.sum().backward()
    ref.sum().backward()
    close(ox.grad, tx.grad, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("case", LAYER_CASES[:3], ids=[c["name"] for c in LAYER_CASES[:3]])
def test_transformer_decoder_layer(device, port, close, randn, case):
    torch.manual_seed(40)
    kw = {k: v for k, v in case.items() if k != "name"}
    theirs = tnn.TransformerDecoderLayer(12, 3, dim_feedforward=20, **kw).eval()
    ours = port(nn.TransformerDecoderLayer(12, 3, dim_feedforward=20, **kw), theirs, device)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    tgt_shape, mem_shape = ((2, 5, 12), (2, 6, 12)) if kw["batch_first"] else \
        ((5, 2, 12), (6, 2, 12))
    tgt, memory = randn(tgt_shape, 41), randn(mem_shape, 42)
    causal = tnn.Transformer.generate_square_subsequent_mask(5)
    padding = padding_mask((2, 6), 43)
    got = ours(ag.tensor(tgt, device=device), ag.tensor(memory, device=device),
               tgt_mask=ag.tensor(causal.numpy(), device=device), tgt_is_causal=True,
               memory_key_padding_mask=ag.tensor(padding, device=device))
    ref = theirs(torch.tensor(tgt), torch.tensor(memory), tgt_mask=causal, tgt_is_causal=True,
                 memory_key_padding_mask=torch.tensor(padding))
    close(got, ref, atol=1e-4)


def test_transformer_encoder(device, port, close, randn):
    torch.manual_seed(50)
    theirs = tnn.TransformerEncoder(tnn.TransformerEncoderLayer(12, 3, 20), 2,
                                    norm=tnn.LayerNorm(12), enable_nested_tensor=False).eval()
    ours = port(nn.TransformerEncoder(nn.TransformerEncoderLayer(12, 3, 20), 2,
                                      norm=nn.LayerNorm(12)), theirs, device)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    x = randn((5, 2, 12), 51)
    causal = tnn.Transformer.generate_square_subsequent_mask(5)
    got = ours(ag.tensor(x, device=device), mask=ag.tensor(causal.numpy(), device=device),
               is_causal=True)
    ref = theirs(torch.tensor(x), mask=causal, is_causal=True)
    close(got, ref, atol=1e-4)


def test_transformer_dropout_train_eval(device):
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.5).to(device)
    x = ag.randn(4, 2, 8, device=device)
    a, b = layer(x).numpy(), layer(x).numpy()
    assert not np.allclose(a, b)
    layer.eval()
    np.testing.assert_array_equal(layer(x).numpy(), layer(x).numpy())
