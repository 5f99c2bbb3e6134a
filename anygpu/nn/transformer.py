"""Transformer encoder and decoder layers with PyTorch's arguments and state_dict keys."""

from __future__ import annotations

import copy
from typing import Any, Callable

from anygpu.nn import functional as F
from anygpu.nn.attention import MultiheadAttention
from anygpu.nn.containers import ModuleList
from anygpu.nn.layers import Dropout, Linear
from anygpu.nn.module import Module
from anygpu.nn.norm import LayerNorm
from anygpu.tensor import Tensor

Activation = str | Callable[[Tensor], Tensor]


def _activation(activation: Activation) -> Callable[[Tensor], Tensor]:
    if activation == "relu":
        return F.relu
    if activation == "gelu":
        return F.gelu
    if isinstance(activation, str):
        raise RuntimeError(f"activation should be relu/gelu, not {activation}")
    return activation


class _TransformerLayer(Module):
    """What encoder and decoder layers share: self-attention, the feed-forward block, a
    LayerNorm and a Dropout per block (``blocks``: 2 for the encoder, 3 for the decoder, whose
    second block attends over ``memory``), registered in PyTorch's order of state_dict keys."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int, dropout: float,
                 activation: Activation, layer_norm_eps: float, batch_first: bool,
                 norm_first: bool, bias: bool, device: str | None, dtype: Any,
                 blocks: int) -> None:
        super().__init__()
        attention = dict(dropout=dropout, bias=bias, batch_first=batch_first, device=device,
                         dtype=dtype)
        self.self_attn = MultiheadAttention(d_model, nhead, **attention)
        if blocks == 3:
            self.multihead_attn = MultiheadAttention(d_model, nhead, **attention)
        self.linear1 = Linear(d_model, dim_feedforward, bias=bias, device=device, dtype=dtype)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(dim_feedforward, d_model, bias=bias, device=device, dtype=dtype)
        self.norm_first = norm_first
        for i in range(1, blocks + 1):
            setattr(self, f"norm{i}", LayerNorm(d_model, eps=layer_norm_eps, bias=bias,
                                                device=device, dtype=dtype))
        for i in range(1, blocks + 1):
            setattr(self, f"dropout{i}", Dropout(dropout))
        self.activation = _activation(activation)
        self._last_dropout = f"dropout{blocks}"

    def _sa_block(self, x: Tensor, attn_mask: Tensor | None, key_padding_mask: Tensor | None,
                  is_causal: bool) -> Tensor:
        x = self.self_attn(x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                           need_weights=False, is_causal=is_causal)[0]
        return self.dropout1(x)

    def _ff_block(self, x: Tensor) -> Tensor:
        x = self.linear2(self.dropout(self.activation(self.linear1(x))))
        return getattr(self, self._last_dropout)(x)


class TransformerEncoderLayer(_TransformerLayer):
    """Self-attention then a feed-forward block, each with a residual connection and a
    LayerNorm after it (before it with ``norm_first``).

    ``forward(src, src_mask=None, src_key_padding_mask=None, is_causal=False)``; masks follow
    MultiheadAttention's conventions.

    >>> import anygpu as ag
    >>> layer = TransformerEncoderLayer(16, 4, dim_feedforward=32, batch_first=True)
    >>> layer(ag.randn(2, 5, 16)).shape
    (2, 5, 16)
    """

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048,
                 dropout: float = 0.1, activation: Activation = "relu",
                 layer_norm_eps: float = 1e-5, batch_first: bool = False,
                 norm_first: bool = False, bias: bool = True, device: str | None = None,
                 dtype: Any = None) -> None:
        super().__init__(d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps,
                         batch_first, norm_first, bias, device, dtype, blocks=2)

    def forward(self, src: Tensor, src_mask: Tensor | None = None,
                src_key_padding_mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal)
            return x + self._ff_block(self.norm2(x))
        x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal))
        return self.norm2(x + self._ff_block(x))


class TransformerDecoderLayer(_TransformerLayer):
    """Self-attention, attention over ``memory``, then a feed-forward block, each with a
    residual connection and a LayerNorm after it (before it with ``norm_first``).

    ``forward(tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
    memory_key_padding_mask=None, tgt_is_causal=False, memory_is_causal=False)``.

    >>> import anygpu as ag
    >>> layer = TransformerDecoderLayer(16, 4, dim_feedforward=32, batch_first=True)
    >>> layer(ag.randn(2, 5, 16), ag.randn(2, 7, 16)).shape
    (2, 5, 16)
    """

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048,
                 dropout: float = 0.1, activation: Activation = "relu",
                 layer_norm_eps: float = 1e-5, batch_first: bool = False,
                 norm_first: bool = False, bias: bool = True, device: str | None = None,
                 dtype: Any = None) -> None:
        super().__init__(d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps,
                         batch_first, norm_first, bias, device, dtype, blocks=3)

    def _mha_block(self, x: Tensor, memory: Tensor, attn_mask: Tensor | None,
                   key_padding_mask: Tensor | None, is_causal: bool) -> Tensor:
        x = self.multihead_attn(x, memory, memory, attn_mask=attn_mask,
                                key_padding_mask=key_padding_mask, is_causal=is_causal,
                                need_weights=False)[0]
        return self.dropout2(x)

    def forward(self, tgt: Tensor, memory: Tensor, tgt_mask: Tensor | None = None,
                memory_mask: Tensor | None = None, tgt_key_padding_mask: Tensor | None = None,
                memory_key_padding_mask: Tensor | None = None, tgt_is_causal: bool = False,
                memory_is_causal: bool = False) -> Tensor:
        x = tgt
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), tgt_mask, tgt_key_padding_mask, tgt_is_causal)
            x = x + self._mha_block(self.norm2(x), memory, memory_mask,
                                    memory_key_padding_mask, memory_is_causal)
            return x + self._ff_block(self.norm3(x))
        x = self.norm1(x + self._sa_block(x, tgt_mask, tgt_key_padding_mask, tgt_is_causal))
        x = self.norm2(x + self._mha_block(x, memory, memory_mask, memory_key_padding_mask,
                                           memory_is_causal))
        return self.norm3(x + self._ff_block(x))


class TransformerEncoder(Module):
    """``num_layers`` copies of ``encoder_layer`` (state_dict keys ``layers.0.…``), then
    ``norm`` if given. ``forward(src, mask=None, src_key_padding_mask=None, is_causal=None)``.

    >>> import anygpu as ag
    >>> layer = TransformerEncoderLayer(16, 4, dim_feedforward=32)
    >>> TransformerEncoder(layer, 2)(ag.randn(5, 2, 16)).shape
    (5, 2, 16)
    """

    def __init__(self, encoder_layer: Module, num_layers: int, norm: Module | None = None,
                 enable_nested_tensor: bool = True, mask_check: bool = True) -> None:
        super().__init__()
        self.layers = ModuleList([copy.deepcopy(encoder_layer) for _ in range(num_layers)])
        self.num_layers = num_layers
        self.norm = norm
        # accepted for PyTorch's signature: padded positions are computed, not skipped
        self.enable_nested_tensor, self.mask_check = enable_nested_tensor, mask_check

    def forward(self, src: Tensor, mask: Tensor | None = None,
                src_key_padding_mask: Tensor | None = None,
                is_causal: bool | None = None) -> Tensor:
        x = src
        for layer in self.layers:
            x = layer(x, src_mask=mask, src_key_padding_mask=src_key_padding_mask,
                      is_causal=bool(is_causal))
        return self.norm(x) if self.norm is not None else x
