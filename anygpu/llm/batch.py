"""Continuous batching: several sequences decoded together, joining and leaving between steps.

A ``Generation`` is one sequence: its prompt, how to choose its tokens (a ``Sampler``), when
to stop, and the tokens and text so far. A ``Batch`` runs generations on a ``LanguageModel``
with one slot of the cache each: ``add`` prefills a generation's prompt into a free slot
(the one whose cached tokens share the longest start with the prompt, so a conversation's
follow-up only runs its new tokens) and chooses its first token (``add_many`` prefills several
prompts in one pass); ``step`` runs one decode step for every running generation at once and
chooses each one's next token; a generation that ends (EOS, a stop string, its token limit, a
full cache, or ``cancel``) leaves its slot at once, free for the next.

The cache is paged (``LanguageModel``): a sequence takes pages as it grows, and a sequence
that finds none free ends with "length"; one that has ended keeps its pages for a follow-up
until others want them. ``run`` keeps a prompt waiting while the pages it needs are held by
running sequences.

>>> # batch = Batch(lm)
>>> # done = batch.run([lm.generation([1, 5, 9], max_new_tokens=8) for _ in range(16)])
>>> # [g.tokens for g in done]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import numpy as np

from anygpu.llm.engine import CacheFull, TextStream, common_prefix
from anygpu.llm.sampling import Sampler

if TYPE_CHECKING:
    from anygpu.llm.engine import LanguageModel

# the reasons a generation ends, as OpenAI's finish_reason names them (and "cancelled")
STOP, LENGTH, CANCELLED = "stop", "length", "cancelled"


class Generation:
    """One sequence being generated: ``prompt`` (token ids), the ``sampler``, at most
    ``max_new_tokens`` new tokens; it ends at an EOS token (unless ``ignore_eos``), at a stop
    string of ``text`` (a ``TextStream`` that turns the tokens into text; None: ids only)
    or when the cache is full.

    ``tokens`` are the new ids (the one that completed a stop string included, an EOS not),
    ``output`` the text so far (before any stop string), ``finish_reason`` None while it runs,
    then "stop", "length" or "cancelled". ``on_token(generation, piece)``, when set, is called
    after each token with the text it settled ("" when held back); ``finish_reason`` is set
    on the call that ends the generation, which comes exactly once."""

    def __init__(self, prompt: Sequence[int], sampler: Sampler, max_new_tokens: int,
                 eos_token_ids: Iterable[int] = (), ignore_eos: bool = False,
                 text: TextStream | None = None) -> None:
        self.prompt = [int(i) for i in prompt]
        if not self.prompt:
            raise ValueError("the prompt has no tokens")
        self.sampler, self.max_new_tokens, self.text = sampler, max_new_tokens, text
        self.eos_token_ids = frozenset(eos_token_ids) if not ignore_eos else frozenset()
        self.tokens: list[int] = []
        self.output = ""
        self.finish_reason: str | None = None
        self.error: str | None = None  # why it ended, where the model failed on it
        self.slot: int | None = None
        self.cancelled = False  # set from any thread: the batch drops it before its next step
        self.on_token: Callable[[Generation, str], None] | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def accept(self, logits: np.ndarray, max_seq_len: int) -> str:
        """Choose the next token from ``logits``; the text it settles."""
        token = self.sampler.next_token(logits, self.prompt + self.tokens)
        piece = ""
        if token in self.eos_token_ids:
            self.finish_reason = STOP
        else:
            self.tokens.append(token)
            if self.text is not None:
                piece = self.text.push(token)
                if self.text.stopped:
                    self.finish_reason = STOP
            # the next token needs this one's keys and values in the cache
            if self.finish_reason is None and (len(self.tokens) >= self.max_new_tokens or
                                               len(self.prompt) + len(self.tokens) > max_seq_len):
                self.finish_reason = LENGTH
        if self.done and self.text is not None:
            piece += self.text.finish()
        self.output += piece
        return piece

    def finish(self, reason: str) -> None:
        if not self.done:
            self.finish_reason = reason
            self._tell("")

    def _tell(self, piece: str) -> None:
        if self.on_token is not None:
            self.on_token(self, piece)

    def __repr__(self) -> str:
        return (f"Generation(prompt {len(self.prompt)} tokens, {len(self.tokens)} new, "
                f"slot {self.slot}, finish_reason {self.finish_reason})")


class Batch:
    """The generations running on ``lm``, one slot of its cache each (see the module's
    docstring). Not thread-safe: one thread drives it (the server's scheduler)."""

    def __init__(self, lm: LanguageModel) -> None:
        self.lm = lm
        self.running: dict[int, Generation] = {}  # slot -> generation

    @property
    def free_slots(self) -> int:
        return self.lm.max_batch - len(self.running)

    def add(self, generation: Generation) -> None:
        """Prefill ``generation``'s prompt into a free slot and choose its first token (it may
        end there). Raises ValueError for a prompt the model cannot take (too long, ids
        outside the vocabulary), and CacheFull where running sequences hold the pages it
        needs, leaving the slot free."""
        if generation.done:
            return
        if generation.max_new_tokens <= 0:
            generation.finish(LENGTH)
            return
        free = [s for s in range(self.lm.max_batch) if s not in self.running]
        if not free:
            raise RuntimeError(f"all {self.lm.max_batch} slots are running")
        slot = self._slot_for(generation, free)
        logits = self.lm.prefill(generation.prompt, slot)
        generation.slot = slot
        self.running[slot] = generation
        self._accept(generation, logits)

    def add_many(self, generations: Sequence[Generation]) -> list[Generation]:
        """``add`` for several generations, their prompts prefilled together in one pass.
        Returns those that must wait, in order: past the free slots, or needing pages that
        running sequences hold. Raises ValueError for a prompt the model cannot take (none is
        added then: check each with ``lm.check_prompt`` first to keep the others)."""
        todo = []
        for generation in generations:
            if generation.done:
                continue
            if generation.max_new_tokens <= 0:
                generation.finish(LENGTH)
                continue
            self.lm.check_prompt(generation.prompt)
            todo.append(generation)
        free = [s for s in range(self.lm.max_batch) if s not in self.running]
        joining, waiting = todo[:len(free)], todo[len(free):]
        if len(joining) < 2:
            return self._add_each(joining) + waiting
        slots: dict[int, Generation] = {}
        for generation in joining:
            slot = self._slot_for(generation, free)
            free.remove(slot)
            slots[slot] = generation
        try:
            logits = self.lm.prefill_batch({s: g.prompt for s, g in slots.items()})
        except CacheFull:  # together they do not fit: one at a time, as many as do
            return self._add_each(joining) + waiting
        for slot, generation in slots.items():
            generation.slot = slot
            self.running[slot] = generation
            self._accept(generation, logits[slot])
        return waiting

    def _slot_for(self, generation: Generation, free: list[int]) -> int:
        """The free slot whose cached tokens share the longest start with the prompt."""
        return max(free, key=lambda s: common_prefix(self.lm.cached(s), generation.prompt))

    def _add_each(self, generations: list[Generation]) -> list[Generation]:
        """``add`` each in turn; those from the first that finds no pages on wait (CacheFull
        where nothing runs that could free them)."""
        for i, generation in enumerate(generations):
            try:
                self.add(generation)
            except CacheFull:
                if not self.running:
                    raise
                return generations[i:]
        return []

    def step(self) -> list[Generation]:
        """One decode step of every running generation (cancelled ones leave first); the
        generations that ended in it, whose slots are free again."""
        ended = [g for g in self.running.values() if g.cancelled]
        for g in ended:
            self._leave(g, CANCELLED)
        if not self.running:
            return ended
        for slot, generation in list(self.running.items()):
            if not self.lm.can_hold(slot, len(self.lm.cached(slot)) + 1):
                self._leave(generation, LENGTH)  # no page left for its next token
                ended.append(generation)
        if not self.running:
            return ended
        tokens = {slot: g.tokens[-1] for slot, g in self.running.items()}
        logits = self.lm.decode_batch(tokens)
        for slot in tokens:
            generation = self.running[slot]
            self._accept(generation, logits[slot])
            if generation.done:
                ended.append(generation)
        return ended

    def cancel(self, generation: Generation) -> None:
        """End ``generation`` now and free its slot."""
        if generation.slot is not None and self.running.get(generation.slot) is generation:
            self._leave(generation, CANCELLED)
        else:
            generation.finish(CANCELLED)

    def run(self, generations: Iterable[Generation]) -> list[Generation]:
        """Run ``generations`` to their ends, ``max_batch`` at a time: each joins when a slot
        is free, between steps. Returns them, in the order given."""
        waiting = list(generations)
        order = list(waiting)
        while waiting or self.running:
            if self.free_slots:  # those that fit join together; the rest wait
                waiting = self.add_many(waiting)
            if self.running:
                self.step()
        return order

    def _accept(self, generation: Generation, logits: np.ndarray) -> None:
        piece = generation.accept(logits, self.lm.max_seq_len)
        if generation.done:
            self._leave(generation, generation.finish_reason or STOP)
        generation._tell(piece)

    def _leave(self, generation: Generation, reason: str) -> None:
        if generation.slot is not None:
            self.running.pop(generation.slot, None)
            # the slot keeps the keys and values of the tokens that went in, for a follow-up,
            # until other sequences want its pages
            self.lm.release(generation.slot)
        if not generation.done:
            generation.finish_reason = reason
            generation._tell("")


__all__ = ["Batch", "Generation", "STOP", "LENGTH", "CANCELLED"]
