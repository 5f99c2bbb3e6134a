"""The decoder against transformers: the same greedy tokens for 32 steps and logits within
float32's tolerance, for each model family and option the loader reads; the captured decode
step compiles nothing after its first steps."""

from __future__ import annotations

import copy
import functools
from typing import Any

import numpy as np
import pytest

import anygpu as ag
from anygpu import llm
from anygpu.runtime.registry import get_device

from .conftest import PROMPT, STEPS, greedy_reference

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")



@functools.lru_cache(maxsize=None)
def _reference(model: Any) -> tuple[list[int], np.ndarray]:
    return greedy_reference(model)


def _recorder() -> tuple[list[np.ndarray], Any]:
    seen: list[np.ndarray] = []

    def record(ids: Any, logits: np.ndarray) -> np.ndarray:
        seen.append(logits.copy())
        return logits

    return seen, record


@pytest.mark.parametrize("variant", ["llama", "llama3_rope", "linear_rope", "tied", "mistral",
                                     "qwen2"])
def test_greedy_tokens_and_logits_match_transformers(device, variant, tiny, loaded):
    _, model = tiny(variant)
    want_tokens, want_logits = _reference(model)
    # the reference is usable: no step is a near tie that rounding could flip
    top2 = np.sort(want_logits, axis=1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0]).min() > 1e-3
    lm = loaded(variant, device)
    seen, record = _recorder()
    tokens = lm.generate(PROMPT, max_new_tokens=STEPS, ignore_eos=True, logits_processor=record)
    assert tokens == want_tokens
    np.testing.assert_allclose(np.stack(seen), want_logits, rtol=1e-4, atol=1e-4)


def test_the_decode_step_compiles_nothing_after_its_first_steps(device, loaded):
    lm = loaded("llama", device)
    programs = get_device(device)._programs
    counts: list[int] = []

    def count(ids: Any, logits: np.ndarray) -> np.ndarray:
        counts.append(len(programs))
        return logits

    lm.reset()
    lm._decode.reset()  # capture anew within this test
    tokens = lm.generate(PROMPT, max_new_tokens=12, ignore_eos=True, logits_processor=count)
    assert len(tokens) == 12
    # logits 0 come from prefill, 1 from the step's plain run, 2 from its capture: replays after
    assert counts[3:] == [counts[3]] * (len(counts) - 3), counts
    assert lm._decode.captured, "the decode step was never captured"
    assert lm.stats.decode_tokens == 11 and lm.stats.prefill_tokens == len(PROMPT)


@pytest.mark.parametrize("dtype", [ag.float16, ag.bfloat16])
def test_half_precision_compute_stays_near_float32(device, dtype, tiny, tmp_path):
    _, model = tiny("llama")
    _, want = _reference(model)
    # the weights stored in that dtype: the default compute dtype is the files'
    half = copy.deepcopy(model).to(getattr(torch, dtype.name))
    half.save_pretrained(tmp_path)
    lm = llm.load(tmp_path, device=device, max_seq_len=16)
    assert lm.dtype == dtype
    seen, record = _recorder()
    lm.generate(PROMPT, max_new_tokens=3, ignore_eos=True, logits_processor=record)
    # one rounding of the weights and of each stored activation: about 2 ** -8 (bfloat16) or
    # 2 ** -11 (float16) of logits that reach 3
    tol = 0.1 if dtype == ag.bfloat16 else 0.02
    np.testing.assert_allclose(seen[0], want[0], atol=tol)
    assert lm.tokenizer is None  # that folder has none: ids only
