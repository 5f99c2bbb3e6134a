"""Attention (opsets 23-25), RotaryEmbedding and SwiGLU as composites.

Attention builds one additive bias (the mask padded to the keys' length, the causal frontier
aligned to the bottom right, the sliding window, the padding of ``nonpad_kv_seqlen``), scales
Q and K by the square root of the scale each (as ONNX's function body does, which matters in
float16), repeats key and value heads for grouped queries, and softmaxes with fully masked rows
giving zeros rather than NaN.

>>> import numpy as np
>>> from anygpu.onnx.ops.table import Node
>>> node = Node("Attention", "a", "", 23, "cpu", {}, [1, 1, 1], [1], 1)
>>> q = Tensor(np.ones((1, 1, 2, 4), np.float32))
>>> attention(node, q, q, q)[0].shape
(1, 1, 2, 4)
"""

from __future__ import annotations

import math
from typing import Any

from anygpu import dtype as dt
from anygpu.onnx.ops.common import const
from anygpu.onnx.ops.table import Node, op
from anygpu.tensor import Tensor, arange, cat, stack, where


def _heads(x: Tensor, heads: int) -> Tensor:
    """(B, S, H*D) -> (B, H, S, D)."""
    b, s, hidden = x.shape
    return x.reshape(b, s, heads, hidden // heads).permute(0, 2, 1, 3)


def _repeat_heads(x: Tensor, times: int) -> Tensor:
    """Each head repeated ``times`` times in place: [h0, h0, h1, h1, ...]."""
    if times == 1:
        return x
    b, h, s, d = x.shape
    return x.unsqueeze(2).expand(b, h, times, s, d).reshape(b, h * times, s, d)


def _softmax_masked(x: Tensor) -> Tensor:
    """Softmax along the last axis; a row of -inf gives zeros."""
    m = x.amax(-1, keepdim=True)
    m = where(m.isinf().logical_and(m.lt(0)), const(0, (), m.dtype, m.device), m)
    e = (x - m).exp()
    total = e.sum(-1, keepdim=True)
    total = where(total.eq(0), const(1, (), total.dtype, total.device), total)
    return e / total


def _attention_bias(node: Node, q_len: int, kv_len: int, mask: Tensor | None, past: int,
                    nonpad: Tensor | None, dtype: dt.DType, device: str) -> Tensor | None:
    """The additive bias (broadcastable to (B, H, q, kv)), or None when nothing is masked."""
    neg_inf = const(float("-inf"), (), dtype, device)
    zero = const(0.0, (), dtype, device)
    bias: Tensor | None = None
    if mask is not None:
        short = kv_len - mask.shape[-1]
        if short > 0:  # a mask shorter than the keys: the rest is masked
            pads = [0, short]
            mask = mask.pad(pads, False if mask.dtype.is_bool else float("-inf"))
        bias = where(mask, zero, neg_inf) if mask.dtype.is_bool else mask.cast(dtype)
    rows = arange(q_len, device=device, dtype=dt.int64).reshape(q_len, 1)
    cols = arange(kv_len, device=device, dtype=dt.int64).reshape(1, kv_len)
    if nonpad is not None and past == 0:  # the external cache: a frontier per batch
        offset: Any = (nonpad.cast(dt.int64) - q_len).reshape(-1, 1, 1, 1)
    else:
        offset = past
    position = rows + offset
    if node.attr("is_causal", 0):
        allowed = cols.le(position)
        part = where(allowed, zero, neg_inf)
        bias = part if bias is None else bias + part
    left, right = node.attr("left_window_size", -1), node.attr("right_window_size", -1)
    if left >= 0 or right >= 0:
        diff = position - cols
        allowed = const(True, (), dt.bool_, device)
        if left >= 0:
            allowed = allowed.logical_and(diff.le(left))
        if right >= 0:
            allowed = allowed.logical_and((-diff).le(right))
        part = where(allowed, zero, neg_inf)
        bias = part if bias is None else bias + part
    if nonpad is not None:
        valid = cols.reshape(1, 1, 1, kv_len).lt(nonpad.cast(dt.int64).reshape(-1, 1, 1, 1))
        part = where(valid, zero, neg_inf)
        bias = part if bias is None else bias + part
    return bias


_ATTRS = ("is_causal", "kv_num_heads", "q_num_heads", "qk_matmul_output_mode", "scale",
          "softcap", "softmax_precision", "left_window_size", "right_window_size")


@op("Attention", since=23, attrs=_ATTRS)
def attention(node: Node, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
              past_key: Tensor | None = None, past_value: Tensor | None = None,
              nonpad: Tensor | None = None) -> tuple[Tensor, ...]:
    three_d = q.ndim == 3
    if three_d:
        q = _heads(q, node.attr("q_num_heads"))
        k = _heads(k, node.attr("kv_num_heads"))
        v = _heads(v, node.attr("kv_num_heads"))
    scale = node.attr("scale", None)
    if scale is None:
        scale = 1 / math.sqrt(q.shape[3])
    root = const(math.sqrt(scale), (), q.dtype, q.device)  # rounded to Q's type, as ONNX
    present_k = cat([past_key, k], 2) if past_key is not None else k
    present_v = cat([past_value, v], 2) if past_value is not None else v
    q_len, kv_len = q.shape[2], present_k.shape[2]
    past = past_key.shape[2] if past_key is not None else 0
    bias = _attention_bias(node, q_len, kv_len, mask, past, nonpad, q.dtype, q.device)
    heads = q.shape[1]
    keys = _repeat_heads(present_k, heads // present_k.shape[1])
    values = _repeat_heads(present_v, heads // present_v.shape[1])
    scores = (q * root).matmul((keys * root).transpose(-1, -2))
    softcap = node.attr("softcap", 0.0)
    if softcap > 0:
        scores = (scores / softcap).tanh() * softcap
    mode = node.attr("qk_matmul_output_mode", 0)
    qk_out = scores
    biased = scores + bias if bias is not None else scores
    if mode == 2:
        qk_out = biased
    precision = node.attr("softmax_precision", None)
    work = biased.cast(dt.float32) if precision is not None and q.dtype != dt.float32 else \
        biased
    probs = _softmax_masked(work)
    if bias is not None:
        dead = bias.amax(-1, keepdim=True).isinf().logical_and(bias.amax(-1, keepdim=True).lt(0))
        probs = where(dead, const(0, (), probs.dtype, probs.device), probs)
    if mode == 3:
        qk_out = probs
    y = probs.cast(q.dtype).matmul(values)
    if three_d:
        b, h, s, d = y.shape
        y = y.permute(0, 2, 1, 3).reshape(b, s, h * d)
    return y, present_k, present_v, qk_out.cast(q.dtype)


@op("RotaryEmbedding", since=23, attrs=("interleaved", "num_heads", "rotary_embedding_dim"))
def rotary_embedding(node: Node, x: Tensor, cos: Tensor, sin: Tensor,
                     position_ids: Tensor | None = None) -> Tensor:
    shape = x.shape
    if x.ndim == 4:  # (B, H, S, D) -> (B, S, H, D)
        y = x.permute(0, 2, 1, 3)
    else:
        heads = node.attr("num_heads")
        b, s, hidden = x.shape
        y = x.reshape(b, s, heads, hidden // heads)
    head = y.shape[3]
    dim = node.attr("rotary_embedding_dim", 0) or head
    if position_ids is not None:
        ids = position_ids.cast(dt.int64)
        cos = cos.index_select(0, ids.reshape(-1)).reshape(ids.shape + (cos.shape[-1],))
        sin = sin.index_select(0, ids.reshape(-1)).reshape(ids.shape + (sin.shape[-1],))
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    rot = y.shrink([(0, n) for n in y.shape[:3]] + [(0, dim)])
    half = dim // 2
    if node.attr("interleaved", 0):
        pairs = rot.reshape(rot.shape[:3] + (half, 2))
        x1, x2 = pairs[..., 0], pairs[..., 1]
    else:
        x1 = rot.shrink([(0, n) for n in rot.shape[:3]] + [(0, half)])
        x2 = rot.shrink([(0, n) for n in rot.shape[:3]] + [(half, dim)])
    real = cos * x1 - sin * x2
    imag = sin * x1 + cos * x2
    if node.attr("interleaved", 0):
        turned = cat([real.unsqueeze(-1), imag.unsqueeze(-1)], -1).reshape(rot.shape)
    else:
        turned = cat([real, imag], -1)
    if dim < head:
        turned = cat([turned, y.shrink([(0, n) for n in y.shape[:3]] + [(dim, head)])], -1)
    if len(shape) == 4:
        return turned.permute(0, 2, 1, 3).cast(x.dtype)
    return turned.reshape(shape).cast(x.dtype)


@op("SwiGLU", since=28, attrs=("alpha",))
def swiglu(node: Node, a: Tensor, b: Tensor) -> Tensor:
    gate = (a * node.attr("alpha", 1.0)).sigmoid().cast(a.dtype)
    return (a * gate * b).cast(a.dtype)




# ---- recurrent attention and causal convolution (opset 27) --------------------------------------
_RULES = ("linear", "gated", "delta", "gated_delta")


@op("LinearAttention", since=27, attrs=("chunk_size", "kv_num_heads", "q_num_heads", "scale",
                                        "update_rule"),
    check=lambda n: None if n.attr("update_rule", "gated_delta") in _RULES
    else f"update_rule {n.attr('update_rule')!r} is not supported")
def linear_attention(node: Node, q: Tensor, k: Tensor, v: Tensor, past: Tensor | None = None,
                     decay: Tensor | None = None, beta: Tensor | None = None
                     ) -> tuple[Tensor, Tensor]:
    """A linear-attention recurrence over the sequence: the state (B, H, dk, dv) decays by
    exp(decay), is corrected toward the value by the delta rule, gains k v^T, and is read by q;
    computed in float32."""
    rule = node.attr("update_rule", "gated_delta")
    hq, hkv = node.attr("q_num_heads"), node.attr("kv_num_heads")
    b, steps, _ = q.shape
    q4 = _heads(q.cast(dt.float32), hq)
    k4 = _heads(k.cast(dt.float32), hkv)
    v4 = _heads(v.cast(dt.float32), hkv)
    dk, dv = q4.shape[3], v4.shape[3]
    scale = node.attr("scale", 0.0) or 1 / math.sqrt(dk)
    gates = None
    if rule in ("gated", "gated_delta") and decay is not None:
        if decay.shape[-1] == hkv:
            gates = decay.cast(dt.float32).reshape(b, steps, hkv, 1).permute(0, 2, 1, 3)
        else:
            gates = _heads(decay.cast(dt.float32), hkv)
    betas = None
    if beta is not None:
        betas = beta.cast(dt.float32).reshape(b, steps, beta.shape[-1], 1).permute(0, 2, 1, 3)
    state = past.cast(dt.float32) if past is not None else \
        const(0.0, (b, hkv, dk, dv), dt.float32, q.device)
    outs = []
    for t in range(steps):
        kt, vt = k4[:, :, t], v4[:, :, t]  # (B, Hkv, dk), (B, Hkv, dv)
        if gates is not None:
            state = state * gates[:, :, t].exp().unsqueeze(-1)
        if betas is not None and rule in ("delta", "gated_delta"):
            retrieved = (state * kt.unsqueeze(-1)).sum(2)  # (B, Hkv, dv)
            vt = betas[:, :, t] * (vt - retrieved)
        state = state + kt.unsqueeze(-1) * vt.unsqueeze(-2)
        read = _repeat_heads(state, hq // hkv)  # (B, Hq, dk, dv)
        outs.append((q4[:, :, t].unsqueeze(-1) * read).sum(2) * scale)  # (B, Hq, dv)
    y = stack(outs, 2).permute(0, 2, 1, 3).reshape(b, steps, hq * dv)
    return y.cast(q.dtype), state.cast(past.dtype if past is not None else q.dtype)


@op("CausalConvWithState", since=27, attrs=("activation",),
    check=lambda n: None if n.attr("activation", "none") in ("none", "silu", "swish")
    else f"activation {n.attr('activation')!r} is not supported")
def causal_conv_with_state(node: Node, x: Tensor, w: Tensor, bias: Tensor | None = None,
                           past: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """A depthwise 1-D convolution over the past state followed by the input (causal), its
    optional SiLU, and the new state (the last k - 1 positions)."""
    from anygpu.onnx.ops.conv import convolve

    b, c, _ = x.shape
    k = w.shape[2]
    state = past if past is not None else const(0.0, (b, c, k - 1), x.dtype, x.device)
    padded = cat([state, x], 2) if k > 1 else x
    y = convolve(padded, w, bias, [1], [1], c)
    if node.attr("activation", "none") in ("silu", "swish"):
        yf = y.cast(dt.float32)
        y = (yf * yf.sigmoid()).cast(x.dtype)
    total = padded.shape[2]
    return y, padded.shrink([(0, b), (0, c), (total - (k - 1), total)])




@op("FlexAttention", since=1, domain="ai.onnx.preview",
    attrs=("scale", "score_mod", "prob_mod", "softmax_precision"), needs_env=True)
def flex_attention(node: Node, env: Any, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Attention whose scores and probabilities pass through the model's own subgraphs
    (``score_mod``, ``prob_mod``); the softmax runs in float32 for 16-bit inputs."""
    from anygpu.onnx.ops.control import run_subgraph

    scale = node.attr("scale", None)
    if scale is None:
        scale = 1 / math.sqrt(q.shape[3])
    root = const(math.sqrt(scale), (), q.dtype, q.device)
    heads = q.shape[1]
    keys = _repeat_heads(k, heads // k.shape[1])
    values = _repeat_heads(v, heads // v.shape[1])
    scores = (q * root).matmul((keys * root).transpose(-1, -2))
    precision = node.attr("softmax_precision", None)
    work = dt.float32 if precision is None or q.dtype.itemsize < 4 else scores.dtype
    scores = scores.cast(work)
    if node.has("score_mod"):
        scores = _as_tensor(run_subgraph(node.attr("score_mod"), env, [scores])[0], work)
    probs = scores.softmax(-1)
    if node.has("prob_mod"):
        probs = _as_tensor(run_subgraph(node.attr("prob_mod"), env, [probs])[0], work)
    return probs.matmul(values.cast(work)).cast(v.dtype)


def _as_tensor(value: Any, dtype: dt.DType) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError("a score or probability subgraph must compute a tensor")
    return value.cast(dtype)


__all__ = ["attention", "rotary_embedding", "swiglu", "linear_attention",
           "causal_conv_with_state", "flex_attention"]
