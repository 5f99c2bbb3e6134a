"""Generation: a loaded model, its tokenizer and the loop that feeds it one token at a time.

``LanguageModel.generate`` runs the prompt through the model once (prefill), then one token per
step (decode) through a captured ``anygpu.jit`` step whose inputs are the tokens and their
positions as device tensors, so every step replays the same kernels. The cache has
``max_batch`` slots, one sequence each, in pages of a shared pool that this class hands out
as sequences grow (a page table on the device says which): ``generate`` and ``chat`` use slot
0, and ``decode_batch`` runs one token for each of several slots in the same step (a step of
1, 2, 4, ... rows, each size captured once), which is what ``generate_batch`` and the server
(continuous batching, ``anygpu.llm.batch``) build on; ``prefill_batch`` runs several prompts
in one pass. Tokens whose keys and values are already in a slot (the conversation so far, in a
chat) are not run again: a new prompt that starts with them only runs what follows, padded to
a power of two in length so that prompts of many lengths share a few sets of kernels; a
prompt of up to PREFILL_CAPTURED tokens runs as a captured step of its shape too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from anygpu import dtype as dt
from anygpu.graph.jit import jit
from anygpu.llm.config import ModelConfig
from anygpu.llm.model import Transformer
from anygpu.llm.sampling import LogitsProcessor, Sampler
from anygpu.llm.tokenizer import Tokenizer
from anygpu.tensor import Tensor


# prefills of at most this many tokens (rows times padded length) run as captured steps, of
# at most PREFILL_SHAPES shapes at once (each holds the memory of its intermediate values)
PREFILL_CAPTURED = 2048
PREFILL_SHAPES = 4


class CacheFull(RuntimeError):
    """The key/value cache has no free page for a sequence (its pages are held by running
    sequences)."""


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
        self.max_batch = model.max_batch
        eos = list(config.eos_token_ids)
        if not eos and tokenizer is not None:
            eos_id = tokenizer.token_id(tokenizer.eos_token)
            eos = [eos_id] if eos_id is not None else []
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        self.stats = Stats()
        self._decode = jit(model.forward)
        # prompts of up to PREFILL_CAPTURED tokens in all prefill through captured steps too,
        # one per shape (rows, padded length), the last few kept: the host's work for every
        # kernel took more than half of a 512-token prefill's time on an H200
        self._prefill = jit(model.forward, keep=PREFILL_SHAPES)
        # per slot: the tokens whose keys and values sit in its cache, in order
        self._cached: list[list[int]] = [[] for _ in range(self.max_batch)]
        # the cache's pages: each slot's, in order, and the free ones (the lowest first)
        self.page_size, self.cache_pages = model.page_size, model.cache_pages
        self._table = np.array(model.page_table.numpy(), dtype=np.int32)  # uploaded on change
        self._fixed = model.fixed_pages  # every slot owns its pages for good
        self._pages: list[list[int]] = [list(row) if self._fixed else []
                                        for row in self._table.tolist()]
        self._free = [] if self._fixed else list(range(self.cache_pages - 1, -1, -1))
        self._table_changed = False
        # slots whose sequences ended (``release``): their tokens stay for a prompt that
        # continues them, until their pages are wanted; the longest released first
        self._released: dict[int, None] = {}

    def reset(self, slot: int | None = None) -> None:
        """Forget the tokens in the cache, of one slot or of all (the next prompt runs from
        its start), and free their pages."""
        for s in range(self.max_batch) if slot is None else [self._slot(slot)]:
            self._cached[s] = []
            self._drop_pages(s)

    def release(self, slot: int) -> None:
        """``slot``'s sequence has ended: its tokens stay in the cache for a prompt that
        continues them (``prefill``), but its pages go to other slots that need them."""
        self._released[self._slot(slot)] = None

    def free_pages(self, slot: int | None = None) -> int:
        """The pages a sequence in ``slot`` could still take: the free ones and those of
        released slots (other than ``slot``)."""
        return len(self._free) + sum(len(self._pages[s]) for s in self._released if s != slot)

    def can_hold(self, slot: int, tokens: int) -> bool:
        """Whether ``slot`` can hold ``tokens`` tokens: within ``max_seq_len``, with pages for
        them (its own, free ones, or released slots')."""
        need = -(-tokens // self.page_size) - len(self._pages[self._slot(slot)])
        return tokens <= self.max_seq_len and need <= self.free_pages(slot)

    def _drop_pages(self, slot: int) -> None:
        self._released.pop(slot, None)
        if self._pages[slot] and not self._fixed:
            self._free += reversed(self._pages[slot])
            self._pages[slot] = []
            self._table[slot] = self.cache_pages
            self._table_changed = True

    def _hold(self, slot: int, tokens: int) -> None:
        """Give ``slot`` the pages for ``tokens`` tokens, taking those of released slots (the
        longest released first, which forget their tokens) when too few are free."""
        need = -(-tokens // self.page_size) - len(self._pages[slot])
        if need > self.free_pages(slot):
            raise CacheFull(f"the key/value cache has no room for {tokens} tokens in slot "
                            f"{slot}: {self.cache_pages} pages of {self.page_size} tokens, "
                            f"{self.cache_pages - self.free_pages(slot)} held by running "
                            "sequences (raise cache_tokens)")
        self._released.pop(slot, None)
        while need > len(self._free):
            victim = next(iter(self._released))
            self._cached[victim] = []
            self._drop_pages(victim)
        for _ in range(max(need, 0)):
            page = self._free.pop()
            self._table[slot, len(self._pages[slot])] = page
            self._pages[slot].append(page)
            self._table_changed = True

    def _sync_table(self) -> None:
        if self._table_changed:
            self.model.page_table.assign(Tensor(self._table, device=self.device,
                                                dtype=dt.int32))
            self._table_changed = False

    def cached(self, slot: int = 0) -> list[int]:
        """The tokens whose keys and values sit in ``slot``, in order."""
        return list(self._cached[self._slot(slot)])

    def _slot(self, slot: int) -> int:
        if not 0 <= slot < self.max_batch:
            raise ValueError(f"slot {slot} is outside the cache's 0..{self.max_batch - 1} "
                             f"(max_batch {self.max_batch})")
        return slot

    # ---- the model on tokens -----------------------------------------------------------------
    def _tensor(self, values: Sequence[int] | np.ndarray) -> Tensor:
        return Tensor(np.asarray(values, dtype=np.int32), device=self.device, dtype=dt.int32)

    def check_prompt(self, ids: Sequence[int]) -> list[int]:
        """``ids`` as a list of ints, or ValueError saying why the model cannot take them
        (empty, longer than ``max_seq_len``, ids outside the vocabulary)."""
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
        return ids

    def prefill(self, ids: Sequence[int], slot: int = 0) -> np.ndarray:
        """Logits (vocab,) after ``ids``, whose keys and values go into ``slot``; only the
        tokens after the longest prefix already in that slot run."""
        return self.prefill_batch({slot: ids})[self._slot(slot)]

    def prefill_batch(self, prompts: Mapping[int, Sequence[int]]) -> dict[int, np.ndarray]:
        """``prefill`` of several slots' prompts in one pass: ``{slot: ids}`` in, ``{slot:
        logits (vocab,)}`` out. The pass has a row per prompt (1, 2, 4, ... rows, as a decode
        step; rows left over sit it out), each prompt's new tokens padded to the longest's
        length, rounded up to a power of two."""
        if not prompts:
            raise ValueError("prefill_batch needs at least one slot's prompt")
        checked = {self._slot(slot): self.check_prompt(ids) for slot, ids in prompts.items()}
        order = sorted(checked)
        # the last token runs whatever the slot holds: its logits are the answer
        same = {s: common_prefix(self._cached[s], checked[s][:-1]) for s in order}
        start = time.perf_counter()
        for slot in order:
            self._cached[slot] = self._cached[slot][:same[slot]]  # the rest is overwritten
            self._hold(slot, len(checked[slot]))
        self._sync_table()
        rows = self._rows(len(order))
        news = [checked[s][same[s]:] for s in order]
        length = _bucket(max(len(n) for n in news))
        tokens = np.zeros((rows, length), dtype=np.int32)
        starts = np.full(rows, -1, dtype=np.int32)  # rows past the prompts write nothing
        lasts = np.zeros(rows, dtype=np.int32)
        slots = np.zeros(rows, dtype=np.int32)
        for r, (slot, new) in enumerate(zip(order, news)):
            tokens[r, :len(new)] = new
            starts[r], lasts[r], slots[r] = same[slot], len(new) - 1, slot
        forward = self._prefill if rows * length <= PREFILL_CAPTURED else self.model.forward
        logits = forward(self._tensor(tokens), self._tensor(starts), self._tensor(lasts),
                         self._tensor(slots)).numpy()
        self.stats.prefill_seconds += time.perf_counter() - start
        self.stats.prefill_tokens += sum(len(n) for n in news)
        for slot in order:
            self._cached[slot] = checked[slot]
        return {slot: logits[r] for r, slot in enumerate(order)}

    def decode(self, token: int, slot: int = 0) -> np.ndarray:
        """Logits (vocab,) after feeding ``token`` at the next position of ``slot``."""
        return self.decode_batch({slot: token})[slot]

    def decode_batch(self, tokens: Mapping[int, int]) -> dict[int, np.ndarray]:
        """One decode step for several sequences at once: ``{slot: token}`` in, ``{slot:
        logits (vocab,)}`` out, each token fed at the next position of its slot.

        The step has a row for each of 1, 2, 4, ... sequences (the fewest that hold them, up
        to ``max_batch``: one captured step each), the unused rows sitting it out; its inputs
        (tokens, positions, slots) are device tensors, so the kernels are the same whichever
        sequences run (``warm_up`` compiles them all)."""
        if not tokens:
            raise ValueError("decode_batch needs at least one slot's token")
        vocab = self.config.vocab_size
        for slot, token in tokens.items():
            if len(self._cached[self._slot(slot)]) >= self.max_seq_len:
                raise ValueError(f"the cache of slot {slot} is full (max_seq_len "
                                 f"{self.max_seq_len})")
            if not 0 <= int(token) < vocab:
                raise ValueError(f"token id {token} is outside the vocabulary (0..{vocab - 1})")
        for slot in tokens:
            self._hold(slot, len(self._cached[slot]) + 1)
        self._sync_table()
        order = sorted(tokens)
        logits = self._step(order, [int(tokens[s]) for s in order],
                            [len(self._cached[s]) for s in order])
        for slot in order:
            self._cached[slot].append(int(tokens[slot]))
        return {slot: logits[row] for row, slot in enumerate(order)}

    def _rows(self, count: int) -> int:
        """The rows of the decode step that runs ``count`` sequences."""
        return min(_bucket(count), self.max_batch)

    def _step(self, slots: list[int], ids: list[int], positions: list[int]) -> np.ndarray:
        """Logits (rows, vocab) of one decode step: row ``r`` feeds ``ids[r]`` at
        ``positions[r]`` of slot ``slots[r]`` (a position of -1 writes nothing)."""
        rows, full = self._rows(len(slots)), self.max_batch
        tokens = np.zeros((rows, 1), dtype=np.int32)
        starts = np.full(rows, -1, dtype=np.int32)
        last = self._tensor(np.zeros(rows, np.int32))
        if rows == full:  # the rows are the slots
            tokens[slots, 0], starts[slots] = ids, positions
            out = self._decode(self._tensor(tokens), self._tensor(starts), last).numpy()
            return out[slots]
        n = len(slots)
        tokens[:n, 0], starts[:n] = ids, positions
        read = np.zeros(rows, dtype=np.int32)  # the unused rows read slot 0 and write nothing
        read[:n] = slots
        out = self._decode(self._tensor(tokens), self._tensor(starts), last,
                           self._tensor(read)).numpy()
        return out[:n]

    def warm_up(self) -> None:
        """Compile and capture the decode step of every size (its plain run, its capture and
        a replay each), with every row sitting it out: the cache is left as it was."""
        rows = 1
        while True:
            for _ in range(3):
                self._step(list(range(rows)), [0] * rows, [-1] * rows)
            if rows >= self.max_batch:
                return
            rows = self._rows(rows + 1)

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
            if n + 1 == max_new_tokens or not self.can_hold(0, len(self._cached[0]) + 1):
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
        text = TextStream(self._decoder(context), stop)
        for token in tokens:
            piece = text.push(token)
            if piece:
                yield piece
            if text.stopped:
                return
        piece = text.finish()
        if piece:
            yield piece

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

    def generation(self, prompt: str | Sequence[int], max_new_tokens: int = 128,
                   temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                   min_p: float = 0.0, repetition_penalty: float = 1.0, seed: int | None = None,
                   stop: str | Sequence[str] | None = None,
                   logits_processor: LogitsProcessor | None = None, ignore_eos: bool = False,
                   as_text: bool | None = None) -> Any:
        """A ``anygpu.llm.batch.Generation`` of ``prompt`` with ``generate``'s settings, for a
        ``Batch`` to run. Text is followed (``generation.output``) when the prompt is text or
        ``as_text`` is set; a string prompt gets the tokenizer's special tokens."""
        from anygpu.llm.batch import Generation

        if isinstance(prompt, str):
            ids = self._need_tokenizer().encode(prompt)
        else:
            ids = [int(i) for i in prompt]
        if as_text is None:
            as_text = isinstance(prompt, str)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        text = None
        if as_text or stops:
            text = TextStream(self._decoder(ids), stops)
        sampler = Sampler(temperature, top_k, top_p, min_p, repetition_penalty, seed,
                          logits_processor)
        return Generation(ids, sampler, max_new_tokens, self.eos_token_ids, ignore_eos, text)

    def generate_batch(self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int = 128,
                       temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                       min_p: float = 0.0, repetition_penalty: float = 1.0,
                       seed: int | None = None, stop: str | Sequence[str] | None = None,
                       logits_processor: LogitsProcessor | None = None,
                       ignore_eos: bool = False) -> list[Any]:
        """``generate`` for each of ``prompts``, decoded together: up to ``max_batch`` at a
        time share each decode step, and a prompt joins as soon as another one ends (each
        gets its own sampler, seeded with ``seed``). The results, in order, are what
        ``generate`` gives for each alone: new text for a text prompt, new ids for ids.

        >>> # lm = anygpu.llm.load(folder, max_batch=8)
        >>> # lm.generate_batch(["Once upon", "The capital of"], max_new_tokens=16)
        """
        from anygpu.llm.batch import Batch

        generations = [self.generation(p, max_new_tokens, temperature, top_k, top_p, min_p,
                                       repetition_penalty, seed, stop, logits_processor,
                                       ignore_eos) for p in prompts]
        Batch(self).run(generations)
        return [g.output if isinstance(p, str) else g.tokens
                for g, p in zip(generations, prompts)]

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
                f"{self.device}, {self.dtype.name}, max_seq_len {self.max_seq_len}, "
                f"max_batch {self.max_batch})")


class TextStream:
    """The text of generated tokens, in pieces as they come, ending before the first stop
    string. Text that may be the start of a stop string, or an incomplete character, is held
    back until a later token settles it.

    >>> text = TextStream(lambda ids: "".join("ab!c"[i] for i in ids), ["!"])
    >>> [text.push(0), text.push(1), text.push(2), text.stopped]
    ['a', 'b', '', True]
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()) -> None:
        self.decode, self.stop = decode, list(stop)
        self.generated: list[int] = []
        self.text = ""  # all the text so far, stop string and what follows it included
        self.emitted = 0  # characters handed out
        self.stopped = False  # a stop string has appeared

    def push(self, token: int) -> str:
        """The new text that ``token`` settles ("" when it is held back)."""
        if self.stopped:
            raise ValueError("the text has ended at a stop string")
        self.generated.append(int(token))
        text = self.text = self.decode(self.generated)
        found = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if found:
            self.stopped = True
            return self._emit(min(found))
        if text.endswith("\ufffd"):  # a character split across tokens
            return ""
        return self._emit(len(text) - _held_back(text, self.stop))

    def finish(self) -> str:
        """The text held back, at the end of the generation (none after a stop string)."""
        return "" if self.stopped else self._emit(len(self.text))

    def _emit(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        piece, self.emitted = self.text[self.emitted:end], end
        return piece


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common start of ``a`` and ``b``."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


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
