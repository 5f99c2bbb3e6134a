"""Generation: a loaded model, its tokenizer and the loop that feeds it one token at a time.

``LanguageModel.generate`` runs the prompt through the model once (prefill), then one token per
step (decode) through a captured ``anygpu.jit`` step whose inputs are the token and its position
as device tensors, so every step replays the same kernels. Tokens whose keys and values are
already in the cache (the conversation so far, in a chat) are not run again: a new prompt that
starts with them only runs what follows, padded to a power of two in length so that
prompts of many lengths share a few sets of kernels.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from anygpu import dtype as dt
from anygpu.graph.jit import jit
from anygpu.llm.config import ModelConfig
from anygpu.llm.model import Transformer
from anygpu.llm.sampling import LogitsProcessor, Sampler
from anygpu.llm.tokenizer import Tokenizer
from anygpu.tensor import Tensor


@dataclass
class Stats:
    """Timings of the last generation: prefill (the prompt's new tokens, up to its logits on
    the host) and decode (the steps after it, each up to its token on the host)."""

    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    def __str__(self) -> str:
        return (f"prefill: {self.prefill_tokens} tokens in {self.prefill_seconds:.3f} s "
                f"({self.prefill_tokens_per_s:.1f} tokens/s); decode: {self.decode_tokens} "
                f"tokens in {self.decode_seconds:.3f} s ({self.decode_tokens_per_s:.1f} tokens/s)")


class LanguageModel:
    """A causal language model ready to generate on one device (see ``anygpu.llm.load``)."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer | None, config: ModelConfig,
                 folder: str) -> None:
        self.model, self.tokenizer, self.config, self.folder = model, tokenizer, config, folder
        self.device, self.dtype, self.max_seq_len = model.device, model.dtype, model.max_seq_len
        eos = list(config.eos_token_ids)
        if not eos and tokenizer is not None:
            eos_id = tokenizer.token_id(tokenizer.eos_token)
            eos = [eos_id] if eos_id is not None else []
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        self.stats = Stats()
        self._decode = jit(model.forward)
        self._cached: list[int] = []  # tokens whose keys and values sit in the cache, in order

    def reset(self) -> None:
        """Forget the tokens in the cache (the next prompt runs from its start)."""
        self._cached = []

    # ---- the model on tokens -----------------------------------------------------------------
    def _tensor(self, values: Sequence[int]) -> Tensor:
        return Tensor(np.asarray(values, dtype=np.int32), device=self.device, dtype=dt.int32)

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        """Logits (vocab,) after ``ids``; only the tokens after the longest prefix already in the
        cache run."""
        ids = [int(i) for i in ids]
        if not ids:
            raise ValueError("the prompt has no tokens")
        if len(ids) > self.max_seq_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, more than max_seq_len "
                             f"{self.max_seq_len}")
        vocab = self.config.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})")
        same = 0
        for a, b in zip(self._cached, ids[:-1]):  # the last token always runs: its logits
            if a != b:
                break
            same += 1
        start = time.perf_counter()
        new = ids[same:]
        padded = new + [0] * (_bucket(len(new)) - len(new))
        logits = self.model.forward(self._tensor(padded), self._tensor([same]),
                                    self._tensor([len(new) - 1])).numpy()
        self.stats.prefill_seconds += time.perf_counter() - start
        self.stats.prefill_tokens += len(new)
        self._cached = ids
        return logits[0]

    def decode(self, token: int) -> np.ndarray:
        """Logits (vocab,) after feeding ``token`` at the next position of the cache."""
        position = len(self._cached)
        if position >= self.max_seq_len:
            raise ValueError(f"the cache is full (max_seq_len {self.max_seq_len})")
        logits = self._decode(self._tensor([token]), self._tensor([position]),
                              self._tensor([0])).numpy()
        self._cached.append(int(token))
        return logits[0]

    # ---- generation --------------------------------------------------------------------------
    def _tokens(self, ids: list[int], max_new_tokens: int, sampler: Sampler,
                ignore_eos: bool) -> Iterator[int]:
        """The new tokens, one by one, until ``max_new_tokens``, EOS or a full cache."""
        self.stats = Stats()
        if max_new_tokens <= 0:
            return
        seen = list(ids)
        logits = self.prefill(ids)
        for n in range(max_new_tokens):
            token = sampler.next_token(logits, seen)
            if token in self.eos_token_ids and not ignore_eos:
                return
            seen.append(token)
            yield token
            if n + 1 == max_new_tokens or len(self._cached) >= self.max_seq_len:
                return
            start = time.perf_counter()
            logits = self.decode(token)
            self.stats.decode_seconds += time.perf_counter() - start
            self.stats.decode_tokens += 1

    def _decoder(self, context: list[int]) -> Any:
        """A function of the generated ids giving their text as it reads after ``context`` (the
        prompt's last tokens): decoders that drop a word's leading space at the start of a
        text (SentencePiece's) would drop it from the first generated word otherwise."""
        assert self.tokenizer is not None
        decode = self.tokenizer.decode
        tail = context[-3:]
        before = decode(tail)

        def text(generated: list[int]) -> str:
            full = decode(tail + generated)
            return full[len(before):] if full.startswith(before) else decode(generated)

        return text

    def _text(self, tokens: Iterator[int], stop: Sequence[str], context: list[int]
              ) -> Iterator[str]:
        """The text of ``tokens`` in pieces as they come, ending before the first stop string.
        Text that may be the start of a stop string, or an incomplete character, is held back
        until the next token settles it."""
        decode = self._decoder(context)
        generated: list[int] = []
        emitted = 0
        text = ""
        for token in tokens:
            generated.append(token)
            text = decode(generated)
            found = [i for i in (text.find(s) for s in stop) if i >= 0]
            if found:
                yield text[emitted:min(found)]
                return
            if text.endswith("\ufffd"):  # a character split across tokens
                continue
            safe = len(text) - _held_back(text, stop)
            if safe > emitted:
                yield text[emitted:safe]
                emitted = safe
        if len(text) > emitted:
            yield text[emitted:]

    def _ids_until_stop(self, tokens: Iterator[int], stop: Sequence[str], context: list[int]
                        ) -> Iterator[int]:
        """``tokens`` up to and including the one that completes a stop string."""
        decode = self._decoder(context)
        generated: list[int] = []
        for token in tokens:
            generated.append(token)
            yield token
            text = decode(generated)
            if any(s in text for s in stop):
                return

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 128,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 min_p: float = 0.0, repetition_penalty: float = 1.0, seed: int | None = None,
                 stop: str | Sequence[str] | None = None, stream: bool = False,
                 logits_processor: LogitsProcessor | None = None,
                 ignore_eos: bool = False) -> Any:
        """Continue ``prompt``: text in gives the new text (the tokenizer adds its special
        tokens, such as BOS), token ids in give the new token ids.

        Generation ends after ``max_new_tokens``, at an EOS token (left out of the result;
        ``ignore_eos`` goes on past it), when the cache is full, or at a stop string: text
        ends before it, ids end with the token that completed it. ``temperature`` 0 is greedy
        choice; the other settings are ``Sampler``'s. ``stream=True`` returns an iterator of
        the pieces (text pieces, or single ids) as they come.
        """
        if isinstance(prompt, str):
            ids = self._need_tokenizer().encode(prompt)
        else:
            ids = [int(i) for i in prompt]
        sampler = Sampler(temperature, top_k, top_p, min_p, repetition_penalty, seed,
                          logits_processor)
        return self._generate(ids, isinstance(prompt, str), max_new_tokens, sampler, stop,
                              stream, ignore_eos)

    def chat(self, messages: list[dict[str, Any]], max_new_tokens: int = 256,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
             repetition_penalty: float = 1.0, seed: int | None = None,
             stop: str | Sequence[str] | None = None, stream: bool = False,
             logits_processor: LogitsProcessor | None = None, ignore_eos: bool = False) -> Any:
        """The assistant's reply to ``messages`` ([{"role": ..., "content": ...}, ...]) as text
        (or an iterator of its pieces with ``stream=True``), the conversation rendered with the
        model's chat template; the other arguments are ``generate``'s. The conversation so far
        stays in the cache, so a follow-up only runs its new tokens."""
        tokenizer = self._need_tokenizer()
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)  # the template wrote them
        sampler = Sampler(temperature, top_k, top_p, min_p, repetition_penalty, seed,
                          logits_processor)
        return self._generate(ids, True, max_new_tokens, sampler, stop, stream, ignore_eos)

    def _generate(self, ids: list[int], as_text: bool, max_new_tokens: int, sampler: Sampler,
                  stop: str | Sequence[str] | None, stream: bool, ignore_eos: bool) -> Any:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if stops:
            self._need_tokenizer()
        tokens = self._tokens(ids, max_new_tokens, sampler, ignore_eos)
        if as_text:
            text = self._text(tokens, stops, ids)
            return text if stream else "".join(text)
        pieces = self._ids_until_stop(tokens, stops, ids) if stops else tokens
        return pieces if stream else list(pieces)

    def _need_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError(f"{self.folder}: no tokenizer.json, so only token ids can be "
                             "given (and no stop strings)")
        return self.tokenizer

    def __repr__(self) -> str:
        c = self.config
        return (f"LanguageModel({c.model_type}, {c.num_layers} layers, hidden {c.hidden_size}, "
                f"{self.device}, {self.dtype.name}, max_seq_len {self.max_seq_len})")


def _bucket(length: int) -> int:
    """The length a prompt of ``length`` new tokens is padded to: a power of two, so that
    prompts of many lengths share a few sets of compiled kernels (at most twice the work)."""
    return 1 << max(length - 1, 0).bit_length()


def _held_back(text: str, stops: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that begins some stop string."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if s.startswith(text[-n:]):
                longest = n
                break
    return longest
