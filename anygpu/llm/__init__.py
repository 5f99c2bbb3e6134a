"""Language-model inference: Hugging Face model folders (Llama 2 and 3, Mistral, Qwen2 and
models of their shape) and GGUF files loaded offline, weights quantized to 8 or 4 bits or kept
in GGUF's block formats, run with anygpu's kernels, a preallocated key/value cache
and a captured decode step; greedy choice and sampling; chat templates. See docs/llm.md.

>>> # import anygpu.llm
>>> # lm = anygpu.llm.load("TinyLlama-1.1B-Chat-v1.0", device="cuda", max_seq_len=2048)
>>> # lm.generate("The capital of France is", max_new_tokens=8)
>>> # lm.chat([{"role": "user", "content": "Hello!"}], temperature=0.7, seed=0)
"""

from __future__ import annotations

import os
from typing import Any

from anygpu.llm.config import ModelConfig, ModelFolderError
from anygpu.llm.engine import LanguageModel, Stats
from anygpu.llm.model import Transformer
from anygpu.llm.quant import QuantizedWeight
from anygpu.llm.sampling import Sampler
from anygpu.llm.tokenizer import Tokenizer
from anygpu.llm.weights import load_weights

DEFAULT_MAX_SEQ_LEN = 4096


def load(path: str | os.PathLike, device: str | None = None, dtype: Any = None,
         max_seq_len: int | None = None, tokenizer: bool = True, quant: str | None = None,
         group_size: int = 32, max_batch: int = 1, page_size: int | None = None,
         cache_tokens: int | None = None) -> LanguageModel:
    """A model folder (``config.json``, safetensors weights, ``tokenizer.json``,
    ``tokenizer_config.json``) or a GGUF file loaded on ``device`` for generation; nothing is
    downloaded.

    ``dtype`` ("float32", "float16", "bfloat16" or an anygpu dtype) is the compute dtype:
    by default the weights' own where the device has it, else float32. ``max_seq_len`` sizes
    the key/value cache (prompt and generated tokens together; default the model's
    ``max_position_embeddings``, at most 4096) and ``max_batch`` its number of slots: the
    sequences that can decode together (``generate_batch``, the server). The cache is in
    pages of ``page_size`` tokens (default ``max_seq_len``: a page per sequence) and holds
    ``cache_tokens`` tokens in all (default: ``max_batch`` full sequences); with smaller pages
    and fewer tokens than that, sequences take pages as they grow and share the memory.
    Without a tokenizer (or with ``tokenizer=False``) the model takes and gives token ids
    only. ``quant`` ("q8" or "q4") quantizes the float weights of the projections at load, in
    groups of ``group_size`` (32 or 128) inputs; a GGUF file's quantized tensors stay in their
    own formats.
    """
    from anygpu.llm import gguf_file
    from anygpu.llm.quant import check_quant
    from anygpu.runtime.registry import get_device

    check_quant(quant, group_size)
    source = os.fspath(path)
    dev = get_device(device)
    if os.path.isfile(source) or source.endswith(".gguf"):
        cfg, weights, compute, tok = gguf_file.read(source, dev, dtype, quant, group_size,
                                                     tokenizer)
    else:
        if not os.path.isdir(source):
            raise ModelFolderError(f"{source}: not a folder (a model folder holds config.json, "
                                   "the safetensors weights and tokenizer.json) nor a GGUF "
                                   "file")
        cfg = ModelConfig.from_folder(source)
        weights, compute = load_weights(source, cfg, dev, dtype, quant, group_size)
        tok = None
        if tokenizer and os.path.isfile(os.path.join(source, "tokenizer.json")):
            tok = Tokenizer.from_folder(source)
    length = max_seq_len or min(cfg.max_position_embeddings, DEFAULT_MAX_SEQ_LEN)
    model = Transformer(cfg, weights, dev.name, compute, length, max_batch=max_batch,
                        page_size=page_size, cache_tokens=cache_tokens)
    return LanguageModel(model, tok, cfg, source)


__all__ = ["load", "LanguageModel", "Stats", "Sampler", "Tokenizer", "Transformer",
           "ModelConfig", "ModelFolderError", "QuantizedWeight"]
