"""The Llama-family decoder in anygpu ops, with a key/value cache of fixed size.

``Transformer.forward(tokens, start)`` runs ``L`` tokens that sit at positions ``start ..
start + L - 1``: it writes their keys and values into each layer's cache (preallocated,
``(kv_heads, max_seq_len, head_dim)``) and returns the logits of the last token. Both inputs are
device tensors, so one captured decode step (``L == 1``) replays for every position: the
position enters the kernels as data (the rows of the RoPE tables it gathers, the cache rows it
writes, the keys it masks), never as a constant of their source. Prefill is the same function
over the prompt.

Attention runs over the whole cache with a mask of the positions written so far (keys after the
query's position, and before its window where a layer has one, are left out); grouped-query
attention folds each key/value head's group of query heads into its rows instead of repeating
the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from anygpu import dtype as dt
from anygpu.llm.config import ModelConfig
from anygpu.nn import functional as F
from anygpu.tensor import Tensor, arange, where, zeros


@dataclass
class Layer:
    """One decoder layer's weights (Hugging Face's layout: projections are (out, in)) and its
    slice of the cache."""

    attn_norm: Tensor
    q: tuple[Tensor, Tensor | None]
    k: tuple[Tensor, Tensor | None]
    v: tuple[Tensor, Tensor | None]
    o: tuple[Tensor, Tensor | None]
    mlp_norm: Tensor
    gate: tuple[Tensor, Tensor | None]
    up: tuple[Tensor, Tensor | None]
    down: tuple[Tensor, Tensor | None]
    windowed: bool
    k_cache: Tensor
    v_cache: Tensor


def _linear(x: Tensor, weight: tuple[Tensor, Tensor | None]) -> Tensor:
    return F.linear(x, weight[0], weight[1])


class Transformer:
    """A decoder-only model of the Llama family on one device, in one compute dtype.

    >>> import numpy as np, anygpu as ag
    >>> from anygpu.llm.config import ModelConfig
    >>> from anygpu.llm.weights import expected_shapes
    >>> cfg = ModelConfig.from_dict({"model_type": "llama", "vocab_size": 16, "hidden_size": 8,
    ...     "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2})
    >>> rng = np.random.default_rng(0)
    >>> w = {k: ag.tensor(rng.standard_normal(s).astype(np.float32))
    ...      for k, s in expected_shapes(cfg).items()}
    >>> model = Transformer(cfg, w, "cpu:0", ag.float32, max_seq_len=8)
    >>> tokens, start, last = (ag.tensor(v, dtype=ag.int32) for v in ([1, 2, 3], [0], [2]))
    >>> model.forward(tokens, start, last).shape
    (1, 16)
    """

    def __init__(self, cfg: ModelConfig, weights: dict[str, Tensor], device: str,
                 dtype: dt.DType, max_seq_len: int) -> None:
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be at least 1, got {max_seq_len}")
        self.cfg, self.device, self.dtype, self.max_seq_len = cfg, device, dtype, max_seq_len
        cos, sin = cfg.rope_tables(max_seq_len)
        self.cos = Tensor(cos, device=device, dtype=dtype).realize()
        self.sin = Tensor(sin, device=device, dtype=dtype).realize()
        self.embed = weights["model.embed_tokens.weight"]
        self.norm = weights["model.norm.weight"]
        self.lm_head = self.embed if cfg.tie_word_embeddings else weights["lm_head.weight"]
        cache_shape = (cfg.num_kv_heads, max_seq_len, cfg.head_dim)
        window = cfg.sliding_window
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."

            def pair(name: str, p: str = p) -> tuple[Tensor, Tensor | None]:
                return weights[p + name + ".weight"], weights.get(p + name + ".bias")

            self.layers.append(Layer(
                attn_norm=weights[p + "input_layernorm.weight"],
                q=pair("self_attn.q_proj"), k=pair("self_attn.k_proj"),
                v=pair("self_attn.v_proj"), o=pair("self_attn.o_proj"),
                mlp_norm=weights[p + "post_attention_layernorm.weight"],
                gate=pair("mlp.gate_proj"), up=pair("mlp.up_proj"), down=pair("mlp.down_proj"),
                # a window no shorter than the cache leaves nothing out
                windowed=bool(cfg.sliding_layers[i]) and window is not None
                and window < max_seq_len,
                k_cache=zeros(cache_shape, dtype=dtype, device=device).realize(),
                v_cache=zeros(cache_shape, dtype=dtype, device=device).realize()))

    def _rms_norm(self, x: Tensor, weight: Tensor) -> Tensor:
        # float32 statistics whatever the compute dtype, the weight applied after rounding back
        xf = x.cast(dt.float32)
        normed = xf * (xf.square().mean(-1, keepdim=True) + self.cfg.rms_norm_eps).rsqrt()
        return weight * normed.cast(x.dtype)

    def _rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """``x`` (heads, L, head_dim) rotated: the halves swapped by a flip (a view), the
        sine's sign folded into its table."""
        heads, length, dim = x.shape
        swapped = x.reshape(heads, length, 2, dim // 2).flip((2,)).reshape(heads, length, dim)
        return x * cos + swapped * sin

    def _write_cache(self, cache: Tensor, new: Tensor, written: Tensor, source: Tensor) -> None:
        """Rows ``start .. start + L - 1`` of ``cache`` become ``new``'s rows: one in-place
        kernel over the cache that picks, per row, the new value or the old."""
        length = new.shape[1]
        rows = new.expand(cache.shape) if length == 1 else new.index_select(1, source)
        cache.assign(where(written.reshape(1, -1, 1), rows, cache))

    def forward(self, tokens: Tensor, start: Tensor, last: Tensor) -> Tensor:
        """Logits (1, vocab) in float32 of ``tokens[last[0]]``, where ``tokens`` (L,) int32 sit
        at positions ``start[0] ..``; their keys and values go into the cache.

        Tokens after ``last`` may be padding (a prompt padded to a length whose kernels exist
        already): their cache rows lie past the real tokens, where no query looks before a
        later token overwrites them, and rows past the cache's end are not written."""
        cfg = self.cfg
        length, total = tokens.shape[0], self.max_seq_len
        heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        group = heads // kv_heads
        positions = start + arange(length, dtype=dt.int32, device=self.device)  # (L,)
        table_rows = positions.clip(max=total - 1)  # padding may run past the cache
        cos, sin = self.cos.index_select(0, table_rows), self.sin.index_select(0, table_rows)
        columns = arange(total, dtype=dt.int32, device=self.device)  # cache rows
        causal = columns.reshape(1, total) <= positions.reshape(length, 1)  # (L, S)
        windowed = causal
        if cfg.sliding_window is not None:
            windowed = causal & (columns.reshape(1, total)
                                 > positions.reshape(length, 1) - cfg.sliding_window)
        written = (columns >= start) & (columns < start + length)
        source = (columns - start).clip(0, length - 1)

        def group_rows(mask: Tensor) -> Tensor:
            # query rows are (group member, token): the mask repeats for each member
            return mask.reshape(1, length, total).expand(group, length, total) \
                .reshape(group * length, total)

        masks = (group_rows(causal), group_rows(windowed))
        x = self.embed.index_select(0, tokens)  # (L, hidden)
        for layer in self.layers:
            h = self._rms_norm(x, layer.attn_norm)
            q = _linear(h, layer.q).reshape(length, heads, dim).permute(1, 0, 2)
            k = _linear(h, layer.k).reshape(length, kv_heads, dim).permute(1, 0, 2)
            v = _linear(h, layer.v).reshape(length, kv_heads, dim).permute(1, 0, 2)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            self._write_cache(layer.k_cache, k, written, source)
            self._write_cache(layer.v_cache, v, written, source)
            # query head kv * group + g reads key/value head kv (Hugging Face's repeat_kv)
            grouped = q.reshape(kv_heads, group * length, dim)
            out = F.scaled_dot_product_attention(grouped, layer.k_cache, layer.v_cache,
                                                 attn_mask=masks[layer.windowed])
            out = out.reshape(heads, length, dim).permute(1, 0, 2).reshape(length, heads * dim)
            x = x + _linear(out, layer.o)
            h = self._rms_norm(x, layer.mlp_norm)
            x = x + _linear(_linear(h, layer.gate).silu() * _linear(h, layer.up), layer.down)
        final = self._rms_norm(x.index_select(0, last), self.norm)
        return F.linear(final, self.lm_head).cast(dt.float32)
