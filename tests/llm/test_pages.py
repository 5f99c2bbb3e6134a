"""The paged key/value cache: sequences take pages of a shared pool as they grow, give the same
tokens as in a cache of whole slots, wait for pages held by running sequences, end with
"length" when none is left, and give their pages back when they end."""

from __future__ import annotations

import pytest

from anygpu.llm.batch import Batch
from anygpu.llm.engine import CacheFull

from .test_batch import LIMITS, PROMPTS, _alone, _together

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")


def test_pages_give_the_tokens_of_whole_slots(device, loaded):
    whole = _alone(loaded("llama", device))
    # pages of 4 tokens, 80 tokens in all (less than the 4 slots of 64 would take): room for
    # any 4 of the sequences at once
    lm = loaded("llama", device, page_size=4, cache_tokens=80)
    assert lm.cache_pages == 20 and lm.free_pages() == 20
    assert _alone(lm) == whole
    assert [g.tokens for g in _together(lm)] == whole
    assert lm.free_pages() == 20  # the ended sequences' pages may all be taken again
    lm.reset()
    assert sorted(lm._free) == list(range(20))


def test_prompts_wait_for_pages_and_a_full_cache_ends_a_sequence(device, loaded):
    whole = loaded("llama", device)
    full = whole.generate(PROMPTS[0], max_new_tokens=30, ignore_eos=True)
    # 16 tokens in all: one sequence of 6 prompt tokens takes the pool after 10 steps
    lm = loaded("llama", device, page_size=4, cache_tokens=16)
    alone = lm.generate(PROMPTS[0], max_new_tokens=30, ignore_eos=True)
    assert alone == full[:len(alone)] and len(PROMPTS[0]) + len(alone) == 16 + 1
    lm.reset()
    generations = [lm.generation(p, max_new_tokens=n, ignore_eos=True)
                   for p, n in zip(PROMPTS, LIMITS)]
    done = Batch(lm).run(generations)
    # each sequence runs when the pages it needs are free; the longest ones fill the pool
    for g, prompt, limit, want in zip(done, PROMPTS, LIMITS, _alone(whole)):
        assert g.tokens == want[:len(g.tokens)]
        assert g.finish_reason == "length"
        assert len(g.tokens) == limit or len(prompt) + len(g.tokens) == 16 + 1
    with pytest.raises(CacheFull, match="no room for 20 tokens"):
        lm.prefill(list(range(1, 21)))


def test_page_options_are_checked(device, loaded, tiny):
    from anygpu import llm

    with pytest.raises(ValueError, match="page_size must be at least 1"):
        llm.load(tiny("llama")[0], device=device, max_seq_len=16, page_size=0)
