"""Tiny model folders for the llm tests: random weights made by ``transformers`` on the CPU and
saved with ``save_pretrained``, a character-level BPE tokenizer with a few merges, and a chat
template. Each variant is made once per session, when a test first asks for it."""

from __future__ import annotations

import json
import os
import string
from typing import Any, Callable

import pytest

SPECIALS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
CHARS = list(string.ascii_lowercase) + list(" .,!?'\n")
MERGES = [("t", "h"), ("th", "e"), ("l", "l"), ("e", "r"), ("i", "n"), ("o", "u")]
VOCAB = SPECIALS + CHARS + ["".join(m) for m in MERGES]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

SHAPE = dict(vocab_size=len(VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
             bos_token_id=1, eos_token_id=2, max_position_embeddings=256)

# variant -> (transformers class names, extra config)
VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3_rope": ("LlamaConfig", "LlamaForCausalLM", {
        "rope_theta": 500000.0, "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    "linear_rope": ("LlamaConfig", "LlamaForCausalLM", {
        "rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 16}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
}


def write_tokenizer(folder: str) -> None:
    """tokenizer.json (a BPE over single characters with a few merges, BOS added in front) and
    tokenizer_config.json with the chat template."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, processors

    vocab = {tok: i for i, tok in enumerate(VOCAB)}
    tok = tokenizers.Tokenizer(models.BPE(vocab, MERGES, unk_token="<unk>"))
    tok.add_special_tokens(SPECIALS)
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                       special_tokens=[("<s>", 1)])
    tok.save(os.path.join(folder, "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
              "chat_template": TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"}
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)


def make_model(folder: str, variant: str, seed: int = 0) -> Any:
    """The variant's random-weight transformers model (eval mode), saved into ``folder``."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    config_name, model_name, extra = VARIANTS[variant]
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**{**SHAPE, **extra})
    model = getattr(transformers, model_name)(config).eval()
    if variant == "qwen2":  # its biases start at zero: give them values
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0.0, 0.3)
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return model


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[str, Any]]:
    """``tiny(variant) -> (folder, transformers model)``, made once per session."""
    made: dict[str, tuple[str, Any]] = {}

    def get(variant: str) -> tuple[str, Any]:
        if variant not in made:
            folder = str(tmp_path_factory.mktemp(variant))
            made[variant] = (folder, make_model(folder, variant))
        return made[variant]

    return get


MAX_BATCH = 4  # the slots of the models ``loaded`` gives: every test decodes through them


@pytest.fixture(scope="session")
def loaded(tiny: Callable[[str], tuple[str, Any]]) -> Callable[..., Any]:
    """``loaded(variant, device, **load_options) -> LanguageModel`` with ``MAX_BATCH`` slots,
    loaded once per session, device and options (the cache is shared, so each test starts
    with ``reset()``)."""
    from anygpu import llm

    made: dict[tuple[str, str], Any] = {}

    def get(variant: str, device: str, **options: Any) -> Any:
        key = (variant, device, tuple(sorted(options.items())))
        if key not in made:
            made[key] = llm.load(tiny(variant)[0], device=device, max_seq_len=64,
                                 max_batch=MAX_BATCH, **options)
        lm = made[key]
        lm.reset()
        lm.eos_token_ids = (2,)
        return lm

    return get


PROMPT = [1, 9, 23, 14, 40, 7]
STEPS = 32


def greedy_reference(model: Any) -> tuple[list[int], Any]:
    """transformers' greedy tokens after PROMPT for STEPS steps and the logits each was chosen
    from (the whole sequence run again for each step: no cache of its own to trust)."""
    import numpy as np
    import torch

    seq, logits = list(PROMPT), []
    with torch.no_grad():
        for _ in range(STEPS):
            out = model(torch.tensor([seq])).logits[0, -1].float().numpy()
            logits.append(out)
            seq.append(int(out.argmax()))
    return seq[len(PROMPT):], np.stack(logits)
