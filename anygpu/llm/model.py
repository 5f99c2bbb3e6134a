"""The Llama-family decoder in anygpu ops, with a key/value cache of fixed size.

The cache holds ``max_batch`` sequences, one slot each, in pages of ``page_size`` tokens from
one pool: per layer ``(cache_pages * kv_heads * page_size, head_dim)``, a row per page,
key/value head and position in the page, preallocated, and a page table ``(max_batch,
pages_per_seq)`` on the device that names each slot's pages (``LanguageModel`` hands them out).
A step writes only the rows of its new tokens (one kernel that stores those rows,
``schedule.write_rows``), and attention reads a slot's pages through the table as ``(kv_heads,
pages_per_seq * page_size, head_dim)``.
``Transformer.forward(tokens, start, last, slot)`` runs either one sequence's ``L`` tokens at
positions ``start .. start + L - 1`` into slot ``slot`` (prefill), or one token for each of
several sequences at once (decode: ``tokens`` (rows, 1), ``start`` the position of each, -1 for
a row that sits the step out; the rows are the slots, or ``slot`` says the slot of each row).
It writes the new keys and values into the cache and returns the logits of one token per row.
Every input is a device tensor, so a captured decode step replays for every position and
every mix of running sequences: positions and slots enter the kernels as data (the rows of the
RoPE tables gathered, the slots read, the cache rows written, the keys masked), never as
constants of their source. Prefill is the same function over the prompt.

Attention runs over the slot's whole cache with a mask of the positions written so far (keys
after the query's position, and before its window where a layer has one, are left out);
grouped-query attention folds each key/value head's group of query heads into its rows instead
of repeating the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from anygpu import dtype as dt
from anygpu.graph import schedule as sched
from anygpu.llm.config import ModelConfig
from anygpu.llm.quant import QuantizedWeight
from anygpu.nn import functional as F
from anygpu.tensor import Tensor, arange, cat, where, zeros


@dataclass
class Layer:
    """One decoder layer's weights (Hugging Face's layout: projections are (out, in)) and its
    slice of the cache."""

    attn_norm: Tensor
    # the query, key and value projections: one product of their weights stacked by rows
    # (its output split in the widths of ``qkv_widths``), or three where they cannot stack
    # (GGUF files store them in different formats)
    qkv: list[tuple[Tensor, Tensor | None]]
    qkv_widths: tuple[int, int, int]
    o: tuple[Tensor, Tensor | None]
    mlp_norm: Tensor
    gate: tuple[Tensor, Tensor | None]
    up: tuple[Tensor, Tensor | None]
    down: tuple[Tensor, Tensor | None]
    windowed: bool
    k_cache: Tensor
    v_cache: Tensor


def _stacked(pairs: list[tuple[Tensor, Tensor | None]]
             ) -> tuple[Tensor, Tensor | None] | None:
    """Projections of the same input as one: their (out, in) weights stacked by rows, and
    their biases (all or none); None where their formats differ. Alone, Llama-2-7B's three
    decode products of 4096 x 4096 took 3 x 17 µs on an H200, their stack of 12288 x 4096
    36 µs; its 512-token prefill gained 9%."""
    weights, biases = [w for w, _ in pairs], [b for _, b in pairs]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        return None
    first = weights[0]
    stacked: Tensor | QuantizedWeight
    if all(isinstance(w, Tensor) for w in weights):
        if any(w.dtype != first.dtype or w.shape[1:] != first.shape[1:] for w in weights):
            return None
        stacked = cat(weights, 0).realize()
    elif all(isinstance(w, QuantizedWeight) for w in weights):
        packed: list[QuantizedWeight] = weights  # type: ignore[assignment]
        one = packed[0]
        if any(w.kind != one.kind or w.group != one.group or w.dtype != one.dtype or
               w.shape[1] != one.shape[1] or w.parts.keys() != one.parts.keys() or
               any(t.shape[0] != w.shape[0] for t in w.parts.values()) for w in packed):
            return None  # (a part not laid out by rows cannot stack)
        parts = {k: cat([w.parts[k] for w in packed], 0).realize() for k in one.parts}
        stacked = QuantizedWeight(one.kind, (sum(w.shape[0] for w in packed), one.shape[1]),
                                  parts, one.dtype, one.group)
    else:
        return None
    bias = None if biases[0] is None else cat(biases).realize()  # type: ignore[arg-type]
    return stacked, bias  # type: ignore[return-value]


def _linear(x: Tensor, weight: tuple[Tensor, Tensor | None]) -> Tensor:
    if isinstance(weight[0], QuantizedWeight):  # dequantized inside the product that reads it
        return weight[0].linear(x, weight[1])
    return F.linear(x, weight[0], weight[1])


class Transformer:
    """A decoder-only model of the Llama family on one device, in one compute dtype, with a
    cache of ``max_batch`` sequences of ``max_seq_len`` tokens. Each layer's query, key and
    value weights are stacked into one (``_stacked``) and taken out of ``weights``.

    >>> import numpy as np, anygpu as ag
    >>> from anygpu.llm.config import ModelConfig
    >>> from anygpu.llm.weights import expected_shapes
    >>> cfg = ModelConfig.from_dict({"model_type": "llama", "vocab_size": 16, "hidden_size": 8,
    ...     "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2})
    >>> rng = np.random.default_rng(0)
    >>> w = {k: ag.tensor(rng.standard_normal(s).astype(np.float32))
    ...      for k, s in expected_shapes(cfg).items()}
    >>> model = Transformer(cfg, w, "cpu:0", ag.float32, max_seq_len=8, max_batch=2)
    >>> tokens, start, last, slot = (ag.tensor(v, dtype=ag.int32)
    ...                              for v in ([1, 2, 3], [0], [2], [1]))
    >>> model.forward(tokens, start, last, slot).shape  # a prompt into slot 1
    (1, 16)
    >>> step = [ag.tensor(v, dtype=ag.int32) for v in ([[0], [4]], [-1, 3], [0, 0])]
    >>> model.forward(*step).shape  # one token for each slot; slot 0 sits it out
    (2, 16)
    """

    def __init__(self, cfg: ModelConfig, weights: dict[str, Tensor], device: str,
                 dtype: dt.DType, max_seq_len: int, max_batch: int = 1,
                 page_size: int | None = None, cache_tokens: int | None = None) -> None:
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be at least 1, got {max_seq_len}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        page_size = max_seq_len if page_size is None else page_size
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {page_size}")
        self.cfg, self.device, self.dtype, self.max_seq_len = cfg, device, dtype, max_seq_len
        self.max_batch, self.page_size = max_batch, page_size
        self.pages_per_seq = -(-max_seq_len // page_size)
        if cache_tokens is not None and cache_tokens < 1:
            raise ValueError(f"cache_tokens must be at least 1, got {cache_tokens}")
        # the pool: room for every slot's max_seq_len tokens unless cache_tokens says less
        self.cache_pages = max_batch * self.pages_per_seq if cache_tokens is None else \
            -(-cache_tokens // page_size)
        # each slot's pages, in order; an entry past the pages a slot holds names no page
        # (cache_pages), so nothing is written there. A cache with room for every slot's
        # max_seq_len tokens gives slot s pages s * pages_per_seq onwards, for good.
        table = np.full((max_batch, self.pages_per_seq), self.cache_pages, np.int32)
        if self.fixed_pages:
            table[:] = np.arange(table.size, dtype=np.int32).reshape(table.shape)
        self.page_table = Tensor(table, device=device, dtype=dt.int32).realize()
        cos, sin = cfg.rope_tables(max_seq_len)
        self.cos = Tensor(cos, device=device, dtype=dtype).realize()
        self.sin = Tensor(sin, device=device, dtype=dtype).realize()
        self.embed = weights["model.embed_tokens.weight"]
        self.norm = weights["model.norm.weight"]
        self.lm_head = self.embed if cfg.tie_word_embeddings else weights["lm_head.weight"]
        # (page, key/value head, position in the page) rows of head_dim: attention reads a
        # slot's pages as (kv_heads, pages * page_size, head_dim), and a step writes its new
        # tokens' rows
        cache_shape = (self.cache_pages * cfg.num_kv_heads * page_size, cfg.head_dim)
        window = cfg.sliding_window
        heads = cfg.num_heads
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."

            def pair(name: str, p: str = p) -> tuple[Tensor, Tensor | None]:
                return weights[p + name + ".weight"], weights.get(p + name + ".bias")

            names = [f"self_attn.{x}_proj" for x in "qkv"]
            projections = [pair(name) for name in names]
            stacked = _stacked(projections)
            if stacked is not None:  # the separate weights go (a 7B model's would take 3 GB)
                for name in names:
                    weights.pop(p + name + ".weight")
                    weights.pop(p + name + ".bias", None)
            self.layers.append(Layer(
                attn_norm=weights[p + "input_layernorm.weight"],
                qkv=projections if stacked is None else [stacked],
                qkv_widths=(heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
                            cfg.num_kv_heads * cfg.head_dim),
                o=pair("self_attn.o_proj"),
                mlp_norm=weights[p + "post_attention_layernorm.weight"],
                gate=pair("mlp.gate_proj"), up=pair("mlp.up_proj"), down=pair("mlp.down_proj"),
                # a window no shorter than the cache leaves nothing out
                windowed=bool(cfg.sliding_layers[i]) and window is not None
                and window < max_seq_len,
                k_cache=zeros(cache_shape, dtype=dtype, device=device).realize(),
                v_cache=zeros(cache_shape, dtype=dtype, device=device).realize()))

    @property
    def fixed_pages(self) -> bool:
        """Whether every slot owns the pages of max_seq_len tokens (the cache has room for
        all), so that no page changes hands."""
        return self.cache_pages >= self.max_batch * self.pages_per_seq

    def _rms_norm(self, x: Tensor, weight: Tensor) -> Tensor:
        # float32 statistics whatever the compute dtype, the weight applied after rounding back
        xf = x.cast(dt.float32)
        normed = xf * (xf.square().mean(-1, keepdim=True) + self.cfg.rms_norm_eps).rsqrt()
        return weight * normed.cast(x.dtype)

    def _rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """``x`` (rows, heads, L, head_dim) rotated: the halves swapped by a flip (a view),
        the sine's sign folded into its table."""
        rows, heads, length, dim = x.shape
        swapped = x.reshape(rows, heads, length, 2, dim // 2).flip((3,)) \
            .reshape(rows, heads, length, dim)
        return x * cos + swapped * sin

    def _write_cache(self, cache: Tensor, new: Tensor, rows: Tensor) -> None:
        """Cache rows ``rows`` (n,) become ``new`` (n, head_dim), in place: one kernel that
        stores only those rows (an index past the cache stores nothing)."""
        sched.write_rows(cache.lazy, 0, rows.lazy, new.cast(cache.dtype).lazy)

    def forward(self, tokens: Tensor, start: Tensor, last: Tensor,
                slot: Tensor | None = None) -> Tensor:
        """Logits (rows, vocab) in float32 of token ``last[r]`` of each row of ``tokens``
        (rows, L) int32 (or (L,): one row), whose tokens sit at positions ``start[r] ..``;
        their keys and values go into the cache.

        With ``slot`` (rows,) each row is a sequence in that slot of the cache (a prompt, or
        prompts prefilled together, or a decode step of fewer rows than slots). Without it the
        rows are the slots, all ``max_batch`` of them, one token each (a decode step); a row
        whose ``start`` is negative sits the step out: it writes nothing and its logits are
        meaningless.

        Tokens after ``last`` may be padding (a prompt padded to a length whose kernels exist
        already): their cache rows lie past the real tokens, where no query looks before a
        later token overwrites them, and rows past the cache's end are not written."""
        cfg, device = self.cfg, self.device
        if len(tokens.shape) == 1:
            tokens = tokens.reshape(1, tokens.shape[0])
        rows, length = tokens.shape
        slots, total, page = self.max_batch, self.max_seq_len, self.page_size
        span = self.pages_per_seq * page  # the positions a slot's pages hold
        if slot is None and rows != slots:
            raise ValueError(f"without a slot, forward runs every slot of the cache: {slots} "
                             f"rows, got {rows}")
        if slot is None and length > 1 and rows > 1:
            raise ValueError(f"a step of every slot runs one token each, got {length}")
        heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        group = heads // kv_heads
        offsets = arange(length, dtype=dt.int32, device=device).reshape(1, length)
        positions = start.reshape(rows, 1) + offsets  # (rows, L)
        # padding may run past the cache, and a row sitting the step out starts before it
        clipped = positions.clip(0, total - 1)
        cos = self.cos.index_select(0, clipped.reshape(-1)).reshape(rows, 1, length, dim)
        sin = self.sin.index_select(0, clipped.reshape(-1)).reshape(rows, 1, length, dim)
        columns = arange(span, dtype=dt.int32, device=device)  # positions of a slot's pages
        seen = positions.clip(min=0).reshape(rows, length, 1)
        causal = columns.reshape(1, 1, span) <= seen  # (rows, L, span)
        windowed = causal
        if cfg.sliding_window is not None:
            windowed = causal & (columns.reshape(1, 1, span) > seen - cfg.sliding_window)
        # each row's pages, and the cache row of each new token's key/value head: in the
        # page holding its position, that head's rows, at its place in the page. A row sitting
        # the step out, padding past the cache's end and a position whose page the slot does
        # not hold go past the cache (no write)
        slot_of_row = slot if slot is not None else arange(rows, dtype=dt.int32, device=device)
        pages = self.page_table.index_select(0, slot_of_row)  # (rows, pages_per_seq)
        held = pages.gather(1, clipped // page)  # (rows, L)
        fits = ((start.reshape(rows, 1) >= 0) & (positions < total)
                & (held < self.cache_pages)).reshape(rows, 1, length)
        heads_at = arange(kv_heads, dtype=dt.int32, device=device).reshape(1, kv_heads, 1)
        targets = where(fits, (held.reshape(rows, 1, length) * kv_heads + heads_at) * page
                        + (clipped % page).reshape(rows, 1, length),
                        self.cache_pages * kv_heads * page)
        targets = targets.reshape(rows * kv_heads * length)
        # the pages a row reads (a page it does not hold reads some page: masked out, as its
        # positions lie past the row's tokens)
        read = pages.clip(max=self.cache_pages - 1).reshape(-1)

        def group_rows(mask: Tensor) -> Tensor:
            # query rows are (group member, token): the mask repeats for each member
            return mask.reshape(rows, 1, 1, length, span) \
                .expand(rows, 1, group, length, span).reshape(rows, 1, group * length, span)

        masks = (group_rows(causal), group_rows(windowed))
        x = self.embed.index_select(0, tokens.reshape(-1))  # (rows * L, hidden)
        for layer in self.layers:
            h = self._rms_norm(x, layer.attn_norm)
            if len(layer.qkv) == 1:
                # one product for the three (stored: its parts are read by several kernels)
                qkv = _linear(h, layer.qkv[0]).contiguous()
                wq, wk, _ = layer.qkv_widths
                q, k, v = qkv[:, :wq], qkv[:, wq:wq + wk], qkv[:, wq + wk:]
            else:
                q, k, v = (_linear(h, proj) for proj in layer.qkv)
                # stored before its rotation, which the cache write then computes in its kernel
                k = k.contiguous()
            q = q.reshape(rows, length, heads, dim).permute(0, 2, 1, 3)
            k = k.reshape(rows, length, kv_heads, dim).permute(0, 2, 1, 3)
            v = v.reshape(rows, length, kv_heads, dim).permute(0, 2, 1, 3)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            for cache, new in ((layer.k_cache, k), (layer.v_cache, v)):
                self._write_cache(cache, new.reshape(rows * kv_heads * length, dim), targets)
            k_cache, v_cache = (
                c.reshape(self.cache_pages, kv_heads, page, dim).index_select(0, read)
                .reshape(rows, self.pages_per_seq, kv_heads, page, dim)
                .permute(0, 2, 1, 3, 4).reshape(rows, kv_heads, span, dim)
                for c in (layer.k_cache, layer.v_cache))
            # query head kv * group + g reads key/value head kv (Hugging Face's repeat_kv)
            grouped = q.reshape(rows, kv_heads, group * length, dim)
            out = F.scaled_dot_product_attention(grouped, k_cache, v_cache,
                                                 attn_mask=masks[layer.windowed])
            out = out.reshape(rows, heads, length, dim).permute(0, 2, 1, 3)
            if length > 1:
                # stored in rows of tokens, so that the output projection streams it from
                # memory into the tensor cores (read through the transpose, it ran on the SIMT
                # template, 3x slower)
                out = out.contiguous()
            x = x + _linear(out.reshape(rows * length, heads * dim), layer.o)
            h = self._rms_norm(x, layer.mlp_norm)
            x = x + _linear(_linear(h, layer.gate).silu() * _linear(h, layer.up), layer.down)
        picks = last if rows == 1 else arange(rows, dtype=dt.int32, device=device) * length + last
        final = self._rms_norm(x.index_select(0, picks), self.norm)
        return _linear(final, (self.lm_head, None)).cast(dt.float32)
