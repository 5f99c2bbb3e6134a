"""Continuous batching: sequences decoded together, joining and leaving between steps, give
what each gives decoded alone (greedy and seeded sampling, ids and text with stop strings), on
every backend; one captured step serves every mix of sequences."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from anygpu.llm.batch import Batch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

# more prompts than slots (4), of different lengths and token limits: they join as others end
PROMPTS = [[1, 9, 23, 14, 40, 7], [1, 5], [1, 30, 31, 32, 33, 34, 35, 36, 37, 38], [1, 12, 12],
           [1, 7, 8, 9, 10], [1, 20, 21]]
LIMITS = [12, 3, 8, 5, 10, 6]


def _alone(lm: Any, **kwargs: Any) -> list[list[int]]:
    out = []
    for prompt, limit in zip(PROMPTS, LIMITS):
        lm.reset()
        out.append(lm.generate(prompt, max_new_tokens=limit, ignore_eos=True, **kwargs))
    lm.reset()
    return out


def _together(lm: Any, **kwargs: Any) -> list[Any]:
    generations = [lm.generation(p, max_new_tokens=n, ignore_eos=True, **kwargs)
                   for p, n in zip(PROMPTS, LIMITS)]
    return Batch(lm).run(generations)


def test_greedy_tokens_decoded_together_equal_each_decoded_alone(device, loaded):
    lm = loaded("llama", device)
    assert lm.max_batch == 4
    lm.warm_up()
    captured = dict(lm._decode.captured)
    assert len(captured) == 3  # steps of 1, 2 and 4 rows
    alone = _alone(lm)
    done = _together(lm)
    assert [g.tokens for g in done] == alone
    assert [g.finish_reason for g in done] == ["length"] * len(PROMPTS)
    # the same captured steps, whichever slots ran in them
    assert lm._decode.captured == captured


def test_seeded_sampling_decoded_together_equals_each_decoded_alone(device, loaded):
    lm = loaded("llama", device)
    settings = dict(temperature=1.3, top_p=0.9, seed=7)
    assert [g.tokens for g in _together(lm, **settings)] == _alone(lm, **settings)


def test_text_and_stop_strings_in_a_batch(device, loaded):
    lm = loaded("llama", device)
    prompts = ["hello there, ", "the end. ", "in our"]
    alone = [lm.generate(p, max_new_tokens=10, ignore_eos=True) for p in prompts]
    lm.reset()
    assert lm.generate_batch(prompts, max_new_tokens=10, ignore_eos=True) == alone
    stop = alone[0][4:6]
    cut = [lm.generate(p, max_new_tokens=10, ignore_eos=True, stop=stop) for p in prompts]
    assert cut[0] == alone[0][:alone[0].index(stop)]
    lm.reset()
    assert lm.generate_batch(prompts, max_new_tokens=10, ignore_eos=True, stop=stop) == cut


def test_a_cancelled_sequence_frees_its_slot_and_the_others_go_on(device, loaded):
    lm = loaded("llama", device)
    alone = _alone(lm)
    batch = Batch(lm)
    generations = [lm.generation(p, max_new_tokens=n, ignore_eos=True)
                   for p, n in zip(PROMPTS[:4], LIMITS[:4])]
    for g in generations:
        batch.add(g)
    assert batch.free_slots == 0
    batch.step()
    generations[0].cancelled = True
    ended = batch.step()
    assert generations[0] in ended and generations[0].finish_reason == "cancelled"
    assert len(generations[0].tokens) == 2 and batch.free_slots >= 1
    late = lm.generation(PROMPTS[4], max_new_tokens=LIMITS[4], ignore_eos=True)
    batch.add(late)  # joins the running batch in the freed slot
    batch.run([])
    assert [g.tokens for g in generations[1:]] == alone[1:4] and late.tokens == alone[4]


def test_a_follow_up_reuses_its_slot_and_bad_input_is_refused(device, loaded):
    lm = loaded("llama", device)
    batch = Batch(lm)
    first = lm.generation(PROMPTS[0], max_new_tokens=4, ignore_eos=True)
    batch.run([first])
    follow = lm.generation(PROMPTS[0] + first.tokens + [9, 9], max_new_tokens=4,
                           ignore_eos=True)
    before = lm.stats.prefill_tokens
    batch.run([follow])
    assert follow.slot == first.slot
    # the prompt and all but the last generated token were in the slot already
    assert lm.stats.prefill_tokens - before == 3
    with pytest.raises(ValueError, match="max_seq_len"):
        batch.add(lm.generation(list(range(3, 70)), max_new_tokens=2))
    assert batch.free_slots == lm.max_batch
    with pytest.raises(ValueError, match="slot 4 is outside"):
        lm.decode_batch({4: 1})
    with pytest.raises(ValueError, match="outside the vocabulary"):
        lm.decode_batch({0: 5000})


def test_a_step_of_every_slot_matches_the_model_run_per_slot(device, loaded):
    """The model itself: a decode step's rows are each slot's own continuation, and a slot
    that sits the step out keeps its cache."""
    lm = loaded("llama", device)
    for slot, prompt in enumerate(PROMPTS[:3]):
        lm.prefill(prompt, slot)
    together = lm.decode_batch({0: 3, 2: 4})
    for slot, prompt, token in ((0, PROMPTS[0], 3), (2, PROMPTS[2], 4)):
        lm.reset(3)
        lm.prefill(prompt, 3)
        np.testing.assert_allclose(lm.decode(token, 3), together[slot], rtol=1e-5, atol=1e-5)
    assert lm.cached(1) == PROMPTS[1]


def test_prompts_prefilled_together_match_each_alone(device, loaded):
    """Several slots' prompts in one pass (padded to the longest, a row sitting it out), one
    of them continuing what its slot holds, give each prompt's own logits and cache."""
    lm = loaded("llama", device)
    lm.prefill(PROMPTS[2][:4], 1)  # slot 1 holds the start of its next prompt
    prompts = {0: PROMPTS[0], 1: PROMPTS[2], 3: PROMPTS[1]}
    before = lm.stats.prefill_tokens
    together = lm.prefill_batch(prompts)
    # slot 1 ran only what followed the four tokens it held
    assert lm.stats.prefill_tokens - before == len(PROMPTS[0]) + len(PROMPTS[2]) - 4 + \
        len(PROMPTS[1])
    nexts = lm.decode_batch({0: 5, 1: 6, 3: 7})
    for slot, prompt in prompts.items():
        assert lm.cached(slot) == prompt + [{0: 5, 1: 6, 3: 7}[slot]]
    for slot, prompt in prompts.items():
        lm.reset(2)
        alone = lm.prefill(prompt, 2)
        np.testing.assert_allclose(together[slot], alone, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(nexts[slot], lm.decode({0: 5, 1: 6, 3: 7}[slot], 2),
                                   rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="no tokens"):
        lm.prefill_batch({0: []})


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_half_precision_step_of_sixteen_matches_each_alone(device, dtype):
    """A float16 or bfloat16 model wide enough for the products of many rows (on CUDA, the
    tensor cores' rows: normalized activations rounded into the fragments, SwiGLU's two
    products in one loop): a decode step of 16 sequences gives each the logits it gets decoded
    alone (one row: the segments), to the dtype's tolerance."""
    from anygpu import dtype as dt
    from anygpu.llm.bench import CONFIGS, random_weights
    from anygpu.llm.config import ModelConfig
    from anygpu.llm.engine import LanguageModel
    from anygpu.llm.model import Transformer
    from anygpu.runtime.registry import get_device

    half = getattr(dt, dtype)
    if not get_device(device).supports(half):
        pytest.skip(f"{dtype} is not supported on {device}")
    raw = dict(CONFIGS["llama-2-7b"], hidden_size=512, intermediate_size=1024,
               num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8, vocab_size=512)
    cfg = ModelConfig.from_dict(raw, "wide")
    model = Transformer(cfg, random_weights(cfg, device, half, seed=5), device, half, 64,
                        max_batch=16)
    lm = LanguageModel(model, None, cfg, "wide")
    rng = np.random.default_rng()
    prompts = {slot: rng.integers(0, 512, 3 + slot % 4).tolist() for slot in range(16)}
    for slot, prompt in prompts.items():
        lm.prefill(prompt, slot)
    tokens = {slot: int(rng.integers(0, 512)) for slot in range(16)}
    together = lm.decode_batch(tokens)
    tol = 2e-2 if dtype == "float16" else 8e-2
    for slot in (0, 9, 15):
        lm.reset(slot)
        lm.prefill(prompts[slot], slot)
        alone = lm.decode(tokens[slot], slot)
        scale = max(float(np.abs(alone).max()), 1.0)
        np.testing.assert_allclose(together[slot], alone, rtol=tol, atol=tol * scale)
