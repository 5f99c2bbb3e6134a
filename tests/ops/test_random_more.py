"""Generators, randint's forms, randperm, multinomial, bernoulli and normal: determinism per
seed, the same numbers on every backend, statistics, and PyTorch's errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import anygpu as ag

SEED = 1234  # the seed is part of the kernels: few seeds keep the compiles few


@pytest.fixture(autouse=True)
def _restore_seed():
    yield
    ag.manual_seed(0)


def test_generator_is_deterministic_and_independent_of_the_global_seed(device: str) -> None:
    g = ag.Generator().manual_seed(SEED)
    ag.manual_seed(7)
    first = ag.rand(8, generator=g, device=device).numpy()
    second = ag.rand(8, generator=g, device=device).numpy()
    assert not np.array_equal(first, second)
    ag.manual_seed(8)  # the global seed changes nothing in g's stream
    g.manual_seed(SEED)
    np.testing.assert_array_equal(ag.rand(8, generator=g, device=device).numpy(), first)
    # and drawing from g leaves the global stream where it was
    ag.manual_seed(SEED)
    plain = ag.rand(8, device=device).numpy()
    ag.manual_seed(SEED)
    _ = ag.rand(8, generator=ag.Generator().manual_seed(3), device=device)
    np.testing.assert_array_equal(ag.rand(8, device=device).numpy(), plain)


def test_generator_seed_state(device: str) -> None:
    g = ag.Generator(device=device)
    assert g.initial_seed() == 67280421310721
    assert g.manual_seed(2**40 + 5) is g and g.initial_seed() == 2**40 + 5
    assert g.manual_seed(-1).initial_seed() == 2**64 - 1
    drawn = g.seed()
    assert g.initial_seed() == drawn
    g.manual_seed(SEED)
    ag.rand(5, generator=g, device=device)
    state = g.get_state()
    assert state.dtype == ag.uint8 and state.ndim == 1
    after = ag.rand(5, generator=g, device=device).numpy()
    ag.rand(3, generator=g, device=device)
    g.set_state(state)
    np.testing.assert_array_equal(ag.rand(5, generator=g, device=device).numpy(), after)
    with pytest.raises(RuntimeError, match="get_state"):
        g.set_state(ag.tensor([1, 2, 3], dtype=ag.uint8))


def test_global_generator_functions() -> None:
    assert ag.manual_seed(SEED) is ag.default_generator
    assert ag.initial_seed() == SEED
    state = ag.get_rng_state()
    a = ag.rand(4).numpy()
    ag.set_rng_state(state)
    np.testing.assert_array_equal(ag.rand(4).numpy(), a)
    assert ag.seed() == ag.initial_seed()
    with pytest.raises(TypeError, match="anygpu.Generator"):
        ag.rand(2, generator=torch.Generator())


def test_generator_keyword_everywhere(device: str) -> None:
    def draw() -> list[np.ndarray]:
        g = ag.Generator().manual_seed(SEED)
        x = ag.zeros(6, device=device)
        return [ag.randn(4, generator=g, device=device).numpy(),
                ag.randint(0, 9, (4,), generator=g, device=device).numpy(),
                ag.randperm(6, generator=g, device=device).numpy(),
                ag.multinomial(ag.ones(5, device=device), 3, generator=g).numpy(),
                ag.bernoulli(ag.full((6,), 0.5, device=device), generator=g).numpy(),
                ag.normal(1.0, 2.0, (3,), generator=g, device=device).numpy(),
                x.uniform_(-1, 1, generator=g).numpy(), x.normal_(0, 1, generator=g).numpy(),
                x.bernoulli_(0.5, generator=g).numpy()]

    for got, ref in zip(draw(), draw()):
        np.testing.assert_array_equal(got, ref)


def test_randint_forms(device: str) -> None:
    ag.manual_seed(SEED)
    t = ag.randint(10, (3, 4), device=device)
    assert t.shape == (3, 4) and t.dtype == ag.int64 and t.device == device
    assert 0 <= t.numpy().min() and t.numpy().max() < 10
    t = ag.randint(-3, 3, (50,), dtype=ag.int32, device=device)
    assert t.dtype == ag.int32 and -3 <= t.numpy().min() and t.numpy().max() < 3
    assert ag.randint(5, size=(2,), device=device).shape == (2,)
    assert ag.randint(high=5, size=[2, 2], device=device).shape == (2, 2)
    assert ag.randint(4, 5, 3, device=device).tolist() == [4, 4, 4]


def test_randperm(device: str) -> None:
    ag.manual_seed(SEED)
    for n in (0, 1, 7, 1000):
        p = ag.randperm(n, device=device)
        assert p.dtype == ag.int64 and p.shape == (n,) and p.device == device
        assert sorted(p.tolist()) == list(range(n))
    assert ag.randperm(1000, device=device).tolist() != list(range(1000))
    assert ag.randperm(5, dtype=ag.int32, device=device).dtype == ag.int32
    with pytest.raises(RuntimeError, match="negative dimension"):
        ag.randperm(-1, device=device)


def test_same_numbers_on_every_backend(devices: list[str]) -> None:
    if not devices:
        pytest.skip("no selected device is available")
    results = {}
    for d in devices:
        g = ag.Generator().manual_seed(SEED)
        w = ag.tensor([[1.0, 2.0, 0.0, 4.0], [0.5, 0.5, 3.0, 0.0]], device=d)
        results[d] = [ag.rand(9, generator=g, device=d).numpy(),
                      ag.randint(3, 90, (9,), generator=g, device=d).numpy(),
                      ag.randperm(50, generator=g, device=d).numpy(),
                      ag.multinomial(w, 3, generator=g).numpy(),
                      ag.multinomial(w, 20, True, generator=g).numpy(),
                      ag.bernoulli(ag.full((9,), 0.3, device=d), generator=g).numpy()]
    for d in devices[1:]:
        for got, ref in zip(results[d], results[devices[0]]):
            np.testing.assert_array_equal(got, ref, err_msg=d)


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = counts.sum() * probs / probs.sum()
    keep = expected > 0
    assert np.all(counts[~keep] == 0), "a zero-probability category was drawn"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_multinomial_with_replacement_frequencies(device: str) -> None:
    weights = np.array([[1.0, 2.0, 0.0, 5.0, 2.0], [0.0, 0.0, 3.0, 1.0, 0.0]])
    g = ag.Generator().manual_seed(SEED)
    draws = ag.multinomial(ag.tensor(weights, device=device), 20000, replacement=True,
                           generator=g)
    assert draws.shape == (2, 20000) and draws.dtype == ag.int64 and draws.device == device
    for row, w in zip(draws.numpy(), weights):
        counts = np.bincount(row, minlength=5)
        # 4 and 1 degrees of freedom: the 0.999 quantiles are 18.5 and 10.8
        assert _chi_square(counts, w) < (18.5 if (w > 0).sum() == 4 else 10.8), counts


def test_multinomial_without_replacement(device: str) -> None:
    ag.manual_seed(SEED)
    weights = np.array([1.0, 2.0, 3.0, 4.0])
    draws = ag.multinomial(ag.tensor(np.tile(weights, (4000, 1)), device=device), 3).numpy()
    assert draws.shape == (4000, 3)
    assert all(len(set(r)) == 3 for r in draws.tolist())
    # the first pick follows the weights; each pair's order follows sequential sampling
    assert _chi_square(np.bincount(draws[:, 0], minlength=4), weights) < 16.3
    every = ag.multinomial(ag.tensor(weights, device=device), 4).numpy()
    assert sorted(every.tolist()) == [0, 1, 2, 3]
    # as torch: zero weights come last when there are more samples than positive weights
    assert sorted(ag.multinomial(ag.tensor([0.5, 0.0, 0.0], device=device), 2).tolist()[1:]) \
        in ([1], [2])
    assert ag.tensor([0.0, 1.0], device=device).multinomial(1).tolist() == [1]


@pytest.mark.parametrize("weights, num_samples, replacement", [
    ([0.5, -0.1], 1, False), ([0.0, 0.0], 1, True), ([[1.0, 0.0], [0.0, 0.0]], 1, True),
    ([0.5, 0.5], 3, False), ([[[1.0]]], 1, False), ([1.0, 1.0], 0, True),
    ([1.0, float("inf")], 1, False), ([1.0, float("nan")], 1, True),
])
def test_multinomial_errors_as_torch(device: str, weights: list, num_samples: int,
                                     replacement: bool) -> None:
    with pytest.raises(RuntimeError) as expected:
        torch.multinomial(torch.tensor(weights), num_samples, replacement)
    with pytest.raises(RuntimeError) as got:
        ag.multinomial(ag.tensor(weights, device=device), num_samples, replacement)
    assert str(got.value) == str(expected.value)


def test_multinomial_needs_floats(device: str) -> None:
    with pytest.raises(RuntimeError, match="floating-point dtypes for input, got: Long"):
        ag.multinomial(ag.tensor([1, 2], device=device), 1)


def test_bernoulli_and_normal(device: str) -> None:
    ag.manual_seed(SEED)
    p = ag.tensor(np.linspace(0, 1, 5, dtype=np.float32), device=device)
    assert ag.bernoulli(p).tolist()[0] == 0.0 and p.bernoulli().tolist()[-1] == 1.0
    x = ag.full((20000,), 0.3, device=device)
    frac = x.bernoulli().numpy().mean()
    assert abs(frac - 0.3) < 5 * np.sqrt(0.21 / 20000)
    y = ag.zeros(20000, device=device).bernoulli_(0.8).numpy()
    assert set(np.unique(y)) <= {0.0, 1.0} and abs(y.mean() - 0.8) < 0.02
    z = ag.normal(3.0, 2.0, size=(20000,), device=device).numpy()
    assert abs(z.mean() - 3.0) < 0.1 and abs(z.std() - 2.0) < 0.1
    m = ag.normal(ag.tensor([0.0, 100.0], device=device), 0.5)
    assert m.shape == (2,) and m.device == device and abs(m.tolist()[1] - 100) < 5
    with pytest.raises(TypeError, match="size"):
        ag.normal(0.0, 1.0)
