"""Generation end to end on the tiny models: text and ids in and out, EOS and stop strings,
streaming, seeded sampling within the filters' support, chat templates, and the cache reused
across turns."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

PROMPT = "hello there, "


def test_text_in_text_out_and_stream_gives_the_same_text(device, loaded):
    lm = loaded("llama", device)
    text = lm.generate(PROMPT, max_new_tokens=20, ignore_eos=True)
    ids = lm.tokenizer.encode(PROMPT)
    assert ids[0] == 1  # the tokenizer's BOS
    new_ids = lm.generate(ids, max_new_tokens=20, ignore_eos=True)
    assert len(new_ids) == 20 and text == lm.tokenizer.decode(new_ids)
    pieces = list(lm.generate(PROMPT, max_new_tokens=20, ignore_eos=True, stream=True))
    assert len(pieces) > 1 and "".join(pieces) == text
    assert list(lm.generate(ids, max_new_tokens=20, ignore_eos=True, stream=True)) == new_ids


def test_eos_and_stop_strings_end_generation(device, loaded):
    lm = loaded("llama", device)
    ids = lm.tokenizer.encode(PROMPT)
    free = lm.generate(ids, max_new_tokens=24, ignore_eos=True)
    # a token of the greedy run made EOS: generation ends before its first appearance
    eos = free[5]
    lm.eos_token_ids = (eos,)
    assert lm.generate(ids, max_new_tokens=24) == free[:free.index(eos)]
    assert lm.generate(ids, max_new_tokens=24, ignore_eos=True) == free
    lm.eos_token_ids = ()
    text = lm.tokenizer.decode(free)
    stop = text[6:9]
    cut = text.index(stop)
    assert lm.generate(PROMPT, max_new_tokens=24, stop=[stop, "#never#"]) == text[:cut]
    streamed = list(lm.generate(PROMPT, max_new_tokens=24, stop=stop, stream=True))
    assert "".join(streamed) == text[:cut]
    # ids end with the token that completed the stop string
    got = lm.generate(ids, max_new_tokens=24, stop=stop)
    assert stop in lm.tokenizer.decode(got) and stop not in lm.tokenizer.decode(got[:-1])


def _sampled(lm: Any, **kwargs: Any) -> tuple[list[int], list[np.ndarray]]:
    seen: list[np.ndarray] = []

    def record(ids: Any, logits: np.ndarray) -> np.ndarray:
        seen.append(logits.copy())
        return logits

    out = lm.generate([1, 9, 23, 14], max_new_tokens=10, ignore_eos=True,
                      logits_processor=record, **kwargs)
    return out, seen


def test_sampling_is_reproducible_and_stays_in_the_support(device, loaded):
    lm = loaded("llama", device)
    first, _ = _sampled(lm, temperature=1.5, seed=11)
    again, _ = _sampled(lm, temperature=1.5, seed=11)
    other, _ = _sampled(lm, temperature=1.5, seed=12)
    assert first == again and first != other
    for kwargs in (dict(top_k=3), dict(top_p=0.3), dict(min_p=0.5)):
        tokens, logits = _sampled(lm, temperature=1.5, seed=5, **kwargs)
        for token, row in zip(tokens, logits):
            probs = np.exp((row - row.max()) / 1.5)
            probs /= probs.sum()
            order = np.argsort(-probs)
            if "top_k" in kwargs:
                assert token in order[:3]
            elif "top_p" in kwargs:
                assert probs[order][:list(order).index(token)].sum() < 0.3
            else:
                assert probs[token] >= 0.5 * probs.max()


def test_chat_renders_the_template_and_reuses_the_cache(device, loaded):
    lm = loaded("llama", device)
    messages = [{"role": "user", "content": "hello!"}]
    rendered = lm.tokenizer.apply_chat_template(messages)
    assert rendered == "<|user|>\nhello!</s>\n<|assistant|>\n"
    reply = lm.chat(messages, max_new_tokens=8, ignore_eos=True)
    assert isinstance(reply, str) and reply
    assert "".join(lm.chat(messages, max_new_tokens=8, ignore_eos=True, stream=True)) == reply
    prompt_tokens = len(lm.tokenizer.encode(rendered, add_special_tokens=False))
    follow = messages + [{"role": "assistant", "content": reply},
                         {"role": "user", "content": "the end."}]
    second = lm.chat(follow, max_new_tokens=8, ignore_eos=True)
    full = len(lm.tokenizer.encode(lm.tokenizer.apply_chat_template(follow),
                                   add_special_tokens=False))
    # only what follows the tokens already in the cache ran
    assert lm.stats.prefill_tokens <= full - prompt_tokens
    lm.reset()
    assert lm.chat(follow, max_new_tokens=8, ignore_eos=True) == second
    assert lm.stats.prefill_tokens == full
    assert lm.stats.decode_tokens == 7 and lm.stats.decode_tokens_per_s > 0


def test_the_cache_bounds_the_generation(device, loaded):
    lm = loaded("llama", device)
    out = lm.generate([1, 9, 23], max_new_tokens=100, ignore_eos=True)
    assert len(out) == 64 - 3 + 1  # the last token is chosen from the last cache row
    with pytest.raises(ValueError, match="max_seq_len"):
        lm.generate(list(range(3, 68)), max_new_tokens=1)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        lm.generate([1, 5000], max_new_tokens=1)


def test_generated_text_keeps_the_space_a_word_starts_with():
    """SentencePiece's decoder drops the space of a text's first word: the new text is read
    after the prompt's last tokens, so " there" keeps its space after "hello"."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers

    from anygpu.llm.engine import LanguageModel
    from anygpu.llm.tokenizer import Tokenizer

    words = ["<unk>", "\u2581hello", "\u2581there", "\u2581friend"]
    backend = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)},
                                                    unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    holder = LanguageModel.__new__(LanguageModel)
    holder.tokenizer = Tokenizer(backend, {}, None, "tiny")
    assert holder.tokenizer.decode([2]) == "there"  # alone, the space is gone
    assert holder._decoder([1])([2, 3]) == " there friend"
