"""GGUF files (llama.cpp's format): the model's shape from the metadata, the tensors under
Hugging Face's names, the tokenizer and the chat template, read with the ``gguf`` package.

Float tensors (F32, F16, BF16) load as safetensors weights do (and ``quant`` quantizes the
projections); the block formats Q8_0, Q4_0, Q4_K and Q6_K stay packed on the device
(``anygpu.llm.quant``). llama.cpp's converter reorders the query and key rows of llama models
for its RoPE; they are put back in Hugging Face's order here.

>>> # cfg, weights, compute, tok = read("model.gguf", get_device("cpu"), None, None, 32)
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from anygpu import dtype as dt
from anygpu.llm import quant
from anygpu.llm.config import ModelConfig, ModelFolderError
from anygpu.llm.tokenizer import Tokenizer
from anygpu.llm.weights import PROJECTIONS, compute_dtype, expected_shapes
from anygpu.tensor import Tensor

MAGIC = b"GGUF"
ARCHITECTURES = ("llama", "qwen2")
FLOATS = ("F32", "F16", "BF16")
# GGUF's names -> Hugging Face's (per layer: blk.N.<key> -> model.layers.N.<value>)
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                "output": "lm_head"}
LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# the pre-tokenizer regular expressions of the byte-level BPE vocabularies (tokenizer.ggml.pre)
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
CONTROL, USER_DEFINED = 3, 4  # gguf.TokenType


def is_gguf(path: str) -> bool:
    """Whether ``path`` is a file that starts with GGUF's magic bytes."""
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(4) == MAGIC


def hf_name(name: str) -> str | None:
    """Hugging Face's name of a GGUF tensor name (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``); None for tensors the model does not read."""
    parts = name.split(".")
    if len(parts) == 2 and parts[0] in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


class _File:
    """The reader and its metadata as plain Python values."""

    def __init__(self, path: str) -> None:
        try:
            import gguf
        except ImportError as err:
            raise ImportError("anygpu.llm reads GGUF files with the 'gguf' package: "
                              "pip install 'anygpu[llm]'") from err
        if not os.path.isfile(path):
            raise ModelFolderError(f"{path}: not found (a GGUF file)")
        if not is_gguf(path):
            raise ModelFolderError(f"{path}: not a GGUF file (it does not start with 'GGUF')")
        try:
            self.reader = gguf.GGUFReader(path)
        except Exception as err:  # the reader raises ValueError, struct and NumPy errors
            raise ModelFolderError(f"{path}: not a GGUF file gguf can read ({err})") from err
        self.path = path
        self.types = gguf.GGMLQuantizationType

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelFolderError(f"{self.path}: the metadata key {key!r} is missing")
        return value


def read_config(f: _File) -> ModelConfig:
    """The model's shape from the metadata, checked as ``config.json`` is."""
    arch = f.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelFolderError(f"{f.path}: architecture {arch!r} is not supported "
                               f"(supported: {', '.join(ARCHITECTURES)})")
    names = {t.name for t in f.reader.tensors}
    heads = int(f.need(f"{arch}.attention.head_count"))
    hidden = int(f.need(f"{arch}.embedding_length"))
    tokens = f.get("tokenizer.ggml.tokens")
    embed = next((t for t in f.reader.tensors if t.name == "token_embd.weight"), None)
    vocab = int(embed.shape[1]) if embed is not None and len(embed.shape) == 2 else \
        len(tokens or [])
    raw: dict[str, Any] = {
        "model_type": arch, "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": f.need(f"{arch}.feed_forward_length"),
        "num_hidden_layers": f.need(f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": f.get(f"{arch}.attention.head_count_kv", heads),
        "head_dim": f.get(f"{arch}.attention.key_length") or hidden // heads,
        "rms_norm_eps": f.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": f.get(f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": f.get(f"{arch}.context_length", 2048),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": "blk.0.ffn_gate.bias" in names,
        "bos_token_id": f.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": [f.get(k) for k in ("tokenizer.ggml.eos_token_id",
                                            "tokenizer.ggml.eot_token_id")
                         if f.get(k) is not None]}
    rope_dims = f.get(f"{arch}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != int(raw["head_dim"]):
        raise ModelFolderError(f"{f.path}: RoPE over {rope_dims} of {raw['head_dim']} features "
                               "of a head is not supported")
    scaling = f.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        factor = f.get(f"{arch}.rope.scaling.factor")
        raw["rope_scaling"] = {"rope_type": scaling, "factor": factor}
    cfg = ModelConfig.from_dict(raw, f.path)
    if "rope_freqs.weight" in names:  # Llama 3.1's scaling, as per-frequency divisors
        tensor = next(t for t in f.reader.tensors if t.name == "rope_freqs.weight")
        cfg.rope_params["freq_factors"] = np.asarray(tensor.data, np.float32).reshape(-1)
    return cfg


def _bfloat16_values(data: np.ndarray) -> np.ndarray:
    """bfloat16 bits -> their float32 values."""
    return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def read_weights(f: _File, cfg: ModelConfig, device: Any, dtype: Any, quant_kind: str | None,
                 group_size: int) -> tuple[dict[str, Any], dt.DType]:
    """The model's tensors on ``device`` (projections in block formats as ``QuantizedWeight``)
    and the compute dtype."""
    want = expected_shapes(cfg)
    found: dict[str, Any] = {}
    for tensor in f.reader.tensors:
        name = hf_name(tensor.name)
        if name in want:
            found[name] = tensor
    stored = None
    for name, shape in want.items():
        if name not in found:
            raise ModelFolderError(f"{f.path}: the tensor {_gguf_name(name)!r} is missing")
        got = tuple(int(n) for n in reversed(found[name].shape))
        if got != shape:
            raise ModelFolderError(f"{f.path}: the tensor {found[name].name!r} has shape "
                                   f"{list(got)}, expected {list(shape)} from the metadata")
        kind = f.types(int(found[name].tensor_type)).name
        if kind not in FLOATS and kind not in quant.BLOCKS:
            raise ModelFolderError(f"{f.path}: the tensor {found[name].name!r} is of type "
                                   f"{kind}, which is not supported (supported: "
                                   f"{', '.join(FLOATS + tuple(quant.BLOCKS))})")
        if stored is None and kind in ("F16", "BF16") and name.endswith("_proj.weight"):
            stored = dt.float16 if kind == "F16" else dt.bfloat16
    # block formats compute in float32 unless asked otherwise
    compute = compute_dtype(dtype, stored, device)
    permute = {}
    if cfg.model_type == "llama":  # see quant.permute_rows
        for i in range(cfg.num_layers):
            for part, heads in (("q_proj", cfg.num_heads), ("k_proj", cfg.num_kv_heads)):
                for end in ("weight", "bias"):
                    permute[f"model.layers.{i}.self_attn.{part}.{end}"] = heads
    out: dict[str, Any] = {}
    for name, shape in want.items():
        tensor = found[name]
        kind = f.types(int(tensor.tensor_type)).name
        data = np.asarray(tensor.data)
        if name in permute:
            data = quant.permute_rows(data, permute[name])
        projection = name.endswith(PROJECTIONS)
        if kind in quant.BLOCKS:
            weight = quant.from_blocks(kind, data, (shape[0], shape[-1]), device.name, compute)
            out[name] = weight if projection else weight.dequantize().realize()
            continue
        values = (_bfloat16_values(data) if kind == "BF16" else data).reshape(shape)
        if projection and quant_kind is not None:
            out[name] = quant.quantize(values, quant_kind, group_size, device.name, compute)
        else:
            out[name] = Tensor(np.ascontiguousarray(values), device=device.name, dtype=compute)
            out[name].realize()
    return out, compute


def _gguf_name(name: str) -> str:
    """GGUF's name of a Hugging Face tensor name (for messages)."""
    for g, h in GLOBAL_NAMES.items():
        if name.startswith(h + "."):
            return g + name[len(h):]
    parts = name.split(".")
    rest = ".".join(parts[3:-1])
    for g, h in LAYER_NAMES.items():
        if h == rest:
            return f"blk.{parts[2]}.{g}.{parts[-1]}"
    return name


# ---- the tokenizer -----------------------------------------------------------------------------
def _spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Merges for a SentencePiece vocabulary run as BPE: every split of a piece into two
    pieces of the vocabulary, likelier merged pieces (higher score) first."""
    index = {t: i for i, t in enumerate(tokens)}
    found = []
    for piece, score in zip(tokens, scores):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in index and right in index:
                found.append((-score, index[left], index[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def read_tokenizer(f: _File) -> Tokenizer | None:
    """A ``Tokenizer`` from the metadata (``tokenizer.ggml.model`` "gpt2": byte-level BPE;
    "llama": SentencePiece pieces and scores, run as BPE with byte fallback); None without a
    vocabulary."""
    model = f.get("tokenizer.ggml.model")
    tokens = f.get("tokenizer.ggml.tokens")
    if model is None or not tokens:
        return None
    try:
        import tokenizers
        from tokenizers import decoders, models, normalizers, pre_tokenizers, processors
    except ImportError as err:
        raise ImportError("anygpu.llm reads tokenizers with the 'tokenizers' package: "
                          "pip install 'anygpu[llm]'") from err
    tokens = [str(t) for t in tokens]
    types = list(f.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    vocab = {t: i for i, t in enumerate(tokens)}
    bos_id, eos_id = f.get("tokenizer.ggml.bos_token_id"), f.get("tokenizer.ggml.eos_token_id")
    unk_id = f.get("tokenizer.ggml.unknown_token_id")
    if model == "gpt2":
        pairs = [str(m).split(" ", 1) for m in f.get("tokenizer.ggml.merges") or []]
        merges = [(p[0], p[1]) for p in pairs if len(p) == 2]
        backend = tokenizers.Tokenizer(models.BPE(vocab, merges, ignore_merges=False))
        split = SPLITS.get(str(f.get("tokenizer.ggml.pre", "")))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None)
        backend.pre_tokenizer = byte_level if split is None else pre_tokenizers.Sequence([
            pre_tokenizers.Split(tokenizers.Regex(split), behavior="isolated"), byte_level])
        backend.decoder = decoders.ByteLevel()
        add_bos = bool(f.get("tokenizer.ggml.add_bos_token", False))
    elif model == "llama":
        scores = [float(s) for s in f.get("tokenizer.ggml.scores") or [0.0] * len(tokens)]
        unk = tokens[unk_id] if unk_id is not None else None
        backend = tokenizers.Tokenizer(models.BPE(vocab, _spm_merges(tokens, scores),
                                                  unk_token=unk, byte_fallback=True,
                                                  fuse_unk=True))
        steps: list[Any] = [normalizers.Replace(" ", "\u2581")]
        if f.get("tokenizer.ggml.add_space_prefix", True):
            steps.insert(0, normalizers.Prepend("\u2581"))
        backend.normalizer = normalizers.Sequence(steps)
        ends = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if f.get("tokenizer.ggml.add_space_prefix", True):
            ends.append(decoders.Strip(content=" ", left=1, right=0))
        backend.decoder = decoders.Sequence(ends)
        add_bos = bool(f.get("tokenizer.ggml.add_bos_token", True))
    else:
        raise ModelFolderError(f"{f.path}: tokenizer.ggml.model {model!r} is not supported "
                               "(gpt2 and llama are; give token ids with tokenizer=False)")
    specials = [tokens[i] for i, t in enumerate(types) if int(t) in (CONTROL, USER_DEFINED)]
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                                for t in specials])
    if add_bos and bos_id is not None:
        bos = tokens[bos_id]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    config = {"bos_token": tokens[bos_id] if bos_id is not None else None,
              "eos_token": tokens[eos_id] if eos_id is not None else None}
    template = f.get("tokenizer.chat_template")
    return Tokenizer(backend, config, template if isinstance(template, str) else None, f.path)


def read(path: str, device: Any, dtype: Any, quant_kind: str | None, group_size: int,
         tokenizer: bool = True) -> tuple[ModelConfig, dict[str, Any], dt.DType,
                                          Tokenizer | None]:
    """(configuration, weights on ``device``, compute dtype, tokenizer or None) of a GGUF
    file."""
    f = _File(path)
    cfg = read_config(f)
    weights, compute = read_weights(f, cfg, device, dtype, quant_kind, group_size)
    return cfg, weights, compute, read_tokenizer(f) if tokenizer else None
