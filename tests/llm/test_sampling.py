"""Sampling on the host: each filter keeps exactly the support it defines, draws follow the
seed, the repetition penalty and the hook change the logits as documented."""

from __future__ import annotations

import numpy as np
import pytest

from anygpu.llm.sampling import Sampler

LOGITS = np.log(np.array([0.05, 0.4, 0.1, 0.25, 0.2], np.float32))  # probabilities at T=1


def _support(**kwargs) -> set[int]:
    probs = Sampler(temperature=1.0, **kwargs).probabilities(LOGITS)
    assert probs.sum() == pytest.approx(1.0)
    return set(np.flatnonzero(probs > 0).tolist())


def test_filters_keep_the_support_they_define():
    assert _support() == {0, 1, 2, 3, 4}
    assert _support(top_k=2) == {1, 3}
    assert _support(top_k=1) == {1}
    # 0.4 < 0.5, 0.4 + 0.25 >= 0.5: the two likeliest
    assert _support(top_p=0.5) == {1, 3}
    assert _support(top_p=0.64) == {1, 3}
    assert _support(top_p=0.66) == {1, 3, 4}
    assert _support(top_p=1e-6) == {1}
    # min_p: at least 0.45 * 0.4 = 0.18, then 0.55 * 0.4 = 0.22
    assert _support(min_p=0.45) == {1, 3, 4}
    assert _support(min_p=0.55) == {1, 3}
    assert _support(min_p=1.0) == {1}
    assert _support(top_k=3, min_p=0.6) == {1, 3}


def test_temperature_sharpens_and_flattens():
    probs = [Sampler(temperature=t).probabilities(LOGITS) for t in (0.5, 1.0, 2.0)]
    np.testing.assert_allclose(probs[1], np.exp(LOGITS) / np.exp(LOGITS).sum(), rtol=1e-5)
    assert probs[0][1] > probs[1][1] > probs[2][1]


def test_draws_follow_the_seed_and_the_distribution():
    def draws(seed: int, n: int = 400) -> list[int]:
        s = Sampler(temperature=1.0, seed=seed)
        return [s.next_token(LOGITS, []) for _ in range(n)]

    assert draws(3) == draws(3)
    assert draws(3) != draws(4)
    freq = np.bincount(draws(5, 4000), minlength=5) / 4000
    np.testing.assert_allclose(freq, np.exp(LOGITS), atol=0.03)
    restricted = Sampler(temperature=1.0, top_k=2, seed=1)
    assert {restricted.next_token(LOGITS, []) for _ in range(200)} == {1, 3}


def test_greedy_repetition_penalty_and_hook():
    assert Sampler().next_token(LOGITS, []) == 1
    logits = np.array([2.0, -1.0, 1.5, 0.5], np.float32)
    s = Sampler(repetition_penalty=2.0)
    np.testing.assert_allclose(s.process(logits, [0, 1, 0]), [1.0, -2.0, 1.5, 0.5])
    assert s.next_token(logits, [0]) == 2
    hooked = Sampler(logits_processor=lambda ids, lg: lg - 10.0 * (np.arange(lg.size) == 1))
    assert hooked.next_token(LOGITS, []) == 3


@pytest.mark.parametrize("bad", [dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5),
                                 dict(min_p=-0.1), dict(repetition_penalty=0.0)])
def test_bad_settings_raise(bad):
    with pytest.raises(ValueError):
        Sampler(**bad)
