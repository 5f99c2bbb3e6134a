"""A decoder-only language model's shape, read from a Hugging Face ``config.json``.

The families read here share one architecture: token embeddings, layers of grouped-query
attention with rotary position embeddings (RoPE, applied as Hugging Face applies it: the two
halves of each head rotated against each other) and a SwiGLU feed-forward block, each behind an
RMSNorm, then a final RMSNorm and the output projection (or the embeddings again when
``tie_word_embeddings``). They differ in details this module reads: Qwen2's attention biases,
Mistral's sliding window, the RoPE scalings of Llama 3 ("llama3") and of linear interpolation.

>>> cfg = ModelConfig.from_dict({"model_type": "llama", "vocab_size": 32, "hidden_size": 64,
...     "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
...     "num_key_value_heads": 2})
>>> cfg.head_dim, cfg.rope_type
(16, 'default')
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")


class ModelFolderError(ValueError):
    """A model folder that cannot be loaded: the message names the file and what is wrong."""


@dataclass
class ModelConfig:
    """The numbers that fix a model's shape and its position encoding."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_params: dict[str, Any] = field(default_factory=dict)
    qkv_bias: bool = False  # biases of the query, key and value projections
    o_bias: bool = False  # bias of the attention's output projection
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()  # per layer: whether it attends through the window
    torch_dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """Read a ``config.json`` dict; a missing key or an unsupported model raises
        ``ModelFolderError`` naming ``source``."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_TYPES:
            raise ModelFolderError(f"{source}: model_type {model_type!r} is not supported "
                                   f"(supported: {', '.join(SUPPORTED_TYPES)})")

        def need(key: str) -> Any:
            if raw.get(key) is None:
                raise ModelFolderError(f"{source}: the key {key!r} is missing")
            return raw[key]

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ModelFolderError(f"{source}: num_attention_heads ({heads}) is not a multiple "
                                   f"of num_key_value_heads ({kv_heads})")
        if head_dim % 2:
            raise ModelFolderError(f"{source}: head_dim {head_dim} is odd; RoPE needs pairs")
        act = raw.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ModelFolderError(f"{source}: hidden_act {act!r} is not supported (silu only)")
        layers = int(need("num_hidden_layers"))
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
        if rope_type not in ("default", "linear", "llama3"):
            raise ModelFolderError(f"{source}: RoPE scaling {rope_type!r} is not supported "
                                   "(default, linear and llama3 are)")
        theta = float(rope.get("rope_theta") or raw.get("rope_theta") or 10000.0)
        if rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ModelFolderError(f"{source}: partial_rotary_factor is not supported")
        for key in {"linear": ("factor",),
                    "llama3": ("factor", "low_freq_factor", "high_freq_factor")}.get(rope_type, ()):
            if key not in rope:
                raise ModelFolderError(f"{source}: RoPE scaling {rope_type!r} lacks {key!r}")
        window, sliding = cls._window(raw, model_type, layers)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos])
                        if e is not None)
        return cls(
            model_type=model_type, vocab_size=int(need("vocab_size")), hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")), num_layers=layers,
            num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=theta,
            rope_type=rope_type, rope_params=rope,
            # Qwen2 always has biases on q, k and v (not on o); Llama's attention_bias is all four
            qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            o_bias=model_type != "qwen2" and bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            max_position_embeddings=int(raw.get("max_position_embeddings") or 2048),
            sliding_window=window, sliding_layers=sliding,
            torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            eos_token_ids=eos_ids, bos_token_id=raw.get("bos_token_id"))

    @staticmethod
    def _window(raw: dict[str, Any], model_type: str, layers: int
                ) -> tuple[int | None, tuple[bool, ...]]:
        """The sliding window and which layers use it: Mistral's applies to every layer;
        Qwen2's only with ``use_sliding_window``, from layer ``max_window_layers`` on, or as
        ``layer_types`` lists."""
        window = raw.get("sliding_window")
        if model_type == "qwen2" and not raw.get("use_sliding_window", False):
            window = None
        if window is None:
            return None, (False,) * layers
        types = raw.get("layer_types")
        if types:
            return int(window), tuple(t == "sliding_attention" for t in types)
        if model_type == "qwen2":
            first = int(raw.get("max_window_layers", 0))
            return int(window), tuple(i >= first for i in range(layers))
        return int(window), (True,) * layers

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> "ModelConfig":
        """Read ``folder/config.json`` (and the EOS tokens of ``generation_config.json``)."""
        path = os.path.join(folder, "config.json")
        raw = read_json(path, "the model's configuration")
        cfg = cls.from_dict(raw, path)
        gen_path = os.path.join(folder, "generation_config.json")
        if os.path.exists(gen_path):
            gen = read_json(gen_path, "the generation defaults")
            eos = gen.get("eos_token_id")
            if eos is not None:
                cfg.eos_token_ids = tuple(int(e) for e in (eos if isinstance(eos, list)
                                                           else [eos]))
        return cfg

    def inverse_frequencies(self) -> np.ndarray:
        """RoPE's frequency of each pair of features (float32), with the configured scaling."""
        dim = self.head_dim
        inv = (1.0 / (self.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64)
                                          .astype(np.float32) / dim))).astype(np.float32)
        p = self.rope_params
        if p.get("freq_factors") is not None:  # GGUF's rope_freqs: a divisor per frequency
            inv = (inv / np.asarray(p["freq_factors"], np.float32)).astype(np.float32)
        if self.rope_type == "linear":
            return (inv / np.float32(p["factor"])).astype(np.float32)
        if self.rope_type == "llama3":
            # long wavelengths are divided by the factor, short ones kept, the band between
            # interpolated (Llama 3.1's context extension)
            factor, low, high = (float(p[k]) for k in
                                 ("factor", "low_freq_factor", "high_freq_factor"))
            old = float(p.get("original_max_position_embeddings")
                        or self.max_position_embeddings)
            wavelen = 2 * math.pi / inv.astype(np.float64)
            scaled = np.where(wavelen > old / low, inv / factor, inv)
            smooth = (old / wavelen - low) / (high - low)
            blended = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= old / high) & (wavelen <= old / low)
            return np.where(medium, blended, scaled).astype(np.float32)
        return inv

    def rope_tables(self, length: int) -> tuple[np.ndarray, np.ndarray]:
        """(cos, signed sin), each (length, head_dim) float32: position ``p`` of a head ``x``
        becomes ``x * cos[p] + swap_halves(x) * sin[p]``, the sine's first half negated (that
        is Hugging Face's ``rotate_half``)."""
        freqs = np.arange(length, dtype=np.float32)[:, None] * self.inverse_frequencies()[None]
        angles = np.concatenate([freqs, freqs], axis=1).astype(np.float32)
        sin = np.sin(angles)
        sin[:, :self.head_dim // 2] *= -1
        return np.cos(angles).astype(np.float32), sin.astype(np.float32)


def read_json(path: str, what: str) -> dict[str, Any]:
    """A JSON object from ``path``; a missing or malformed file raises ``ModelFolderError``."""
    if not os.path.isfile(path):
        raise ModelFolderError(f"{path}: not found ({what})")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelFolderError(f"{path}: cannot be read as JSON ({err})") from err
    if not isinstance(data, dict):
        raise ModelFolderError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
