"""Multi-head attention with PyTorch's arguments, mask conventions and state_dict keys."""

from __future__ import annotations

import math
from typing import Any

from anygpu.nn import functional as F
from anygpu.nn import init
from anygpu.nn.layers import Linear
from anygpu.nn.module import Module, Parameter
from anygpu.tensor import Tensor


def _additive(mask: Tensor | None, dtype: Any) -> Tensor | None:
    """A mask as a float bias: PyTorch's MultiheadAttention masks out bool True entries."""
    if mask is None:
        return None
    if mask.dtype.is_bool:
        zeros = mask._const_like(0.0).cast(dtype)
        return zeros.masked_fill(mask, float("-inf"))
    return mask.cast(dtype)


class MultiheadAttention(Module):
    """Attention from ``num_heads`` heads of ``embed_dim // num_heads`` features each.

    ``forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
    average_attn_weights=True, is_causal=False)`` takes (L, N, E) inputs, or (N, L, E) with
    ``batch_first``, or unbatched (L, E), and returns ``(output, weights)``; weights are None
    unless ``need_weights``. As in PyTorch, True in a bool mask marks a pair that is left out,
    ``attn_mask`` is (L, S) or (N * num_heads, L, S), ``key_padding_mask`` is (N, S), and
    ``is_causal`` is only a hint that ``attn_mask`` is causal (it must be given).

    >>> import anygpu as ag
    >>> m = MultiheadAttention(16, 4, batch_first=True)
    >>> out, weights = m(ag.randn(2, 5, 16), ag.randn(2, 7, 16), ag.randn(2, 7, 16))
    >>> out.shape, weights.shape
    ((2, 5, 16), (2, 5, 7))
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False,
                 kdim: int | None = None, vdim: int | None = None, batch_first: bool = False,
                 device: str | None = None, dtype: Any = None) -> None:
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(f"embed_dim and num_heads must be greater than 0, got "
                             f"embed_dim={embed_dim} and num_heads={num_heads} instead")
        if embed_dim % num_heads:
            raise AssertionError("embed_dim must be divisible by num_heads")
        if add_bias_kv or add_zero_attn:
            raise NotImplementedError("MultiheadAttention: add_bias_kv and add_zero_attn are "
                                      "not supported")
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.dropout, self.batch_first = dropout, batch_first
        self.head_dim = embed_dim // num_heads
        if self._qkv_same_embed_dim:
            self.in_proj_weight = Parameter(init._empty((3 * embed_dim, embed_dim), device,
                                                        dtype))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = Parameter(init._empty((embed_dim, embed_dim), device, dtype))
            self.k_proj_weight = Parameter(init._empty((embed_dim, self.kdim), device, dtype))
            self.v_proj_weight = Parameter(init._empty((embed_dim, self.vdim), device, dtype))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = Parameter(init._empty((3 * embed_dim,), device, dtype))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = Linear(embed_dim, embed_dim, bias=bias, device=device, dtype=dtype)
        self.bias_k = self.bias_v = None
        self.add_zero_attn = False
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        if self._qkv_same_embed_dim:
            init.xavier_uniform_(self.in_proj_weight)
        else:
            init.xavier_uniform_(self.q_proj_weight)
            init.xavier_uniform_(self.k_proj_weight)
            init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            init.constant_(self.in_proj_bias, 0.0)
            init.constant_(self.out_proj.bias, 0.0)

    def _project(self, query: Tensor, key: Tensor, value: Tensor
                 ) -> tuple[Tensor, Tensor, Tensor]:
        e = self.embed_dim
        if self._qkv_same_embed_dim:
            weights = self.in_proj_weight.split(e, 0)
        else:
            weights = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
        biases: tuple[Tensor | None, ...] = (
            self.in_proj_bias.split(e, 0) if self.in_proj_bias is not None else (None,) * 3)
        return (F.linear(query, weights[0], biases[0]), F.linear(key, weights[1], biases[1]),
                F.linear(value, weights[2], biases[2]))

    def forward(self, query: Tensor, key: Tensor, value: Tensor,
                key_padding_mask: Tensor | None = None, need_weights: bool = True,
                attn_mask: Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use "
                               "the Transformer module method `generate_square_subsequent_mask`"
                               " to create this mask.")
        batched = query.ndim == 3
        if not batched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        length, batch, _ = query.shape
        source = key.shape[0]
        heads, head_dim = self.num_heads, self.head_dim
        q, k, v = self._project(query, key, value)
        # (L, N, E) -> (N, heads, L, head_dim)
        q = q.reshape(length, batch, heads, head_dim).permute(1, 2, 0, 3)
        k = k.reshape(source, batch, heads, head_dim).permute(1, 2, 0, 3)
        v = v.reshape(source, batch, heads, head_dim).permute(1, 2, 0, 3)

        mask = _additive(attn_mask, q.dtype)
        if mask is not None and mask.ndim == 3:
            mask = mask.reshape(batch, heads, length, source)
        padding = _additive(key_padding_mask, q.dtype)
        if padding is not None:
            padding = padding.reshape(batch, 1, 1, source)
            mask = padding if mask is None else mask + padding
        dropout_p = self.dropout if self.training else 0.0

        weights: Tensor | None = None
        if need_weights:
            scores = q.matmul(k.transpose(-2, -1)) * (1.0 / math.sqrt(head_dim))
            if mask is not None:
                scores = scores + mask
            weights = scores.softmax(-1)
            if dropout_p > 0.0:
                weights = F.dropout(weights, dropout_p, True)
            out = weights.matmul(v)
        else:
            out = F.scaled_dot_product_attention(q, k, v, mask, dropout_p)
        # (N, heads, L, head_dim) -> (L, N, E)
        out = self.out_proj(out.permute(2, 0, 1, 3).reshape(length, batch, self.embed_dim))
        if weights is not None and average_attn_weights:
            weights = weights.mean(1)
        if not batched:
            out = out.squeeze(1)
            weights = weights.squeeze(0) if weights is not None else None
        elif self.batch_first:
            out = out.transpose(0, 1)
        return out, weights
