"""Helpers for comparing anygpu.nn against torch.nn with the same weights."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

import anygpu as ag


def port(ours: Any, theirs: Any, device: str) -> Any:
    """``ours`` with ``theirs``'s state_dict loaded (torch tensors, as a checkpoint would be),
    moved to ``device``, in the same train/eval mode."""
    ours.load_state_dict(theirs.state_dict())
    ours.train(theirs.training)
    return ours.to(device)


def randn(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> np.ndarray:
    """Random float32 data (never all zeros)."""
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def close(out: Any, ref: Any, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """``out`` (anygpu) has the shape and values of ``ref`` (torch or NumPy)."""
    if hasattr(ref, "detach"):
        ref = ref.detach().numpy()
    ref = np.asarray(ref)
    assert isinstance(out, ag.Tensor), f"expected a Tensor, got {type(out).__name__}"
    assert out.shape == ref.shape, f"shape {out.shape}, expected {ref.shape}"
    got = out.numpy()
    if ref.dtype.kind in "iub":
        np.testing.assert_array_equal(got, ref)
    else:
        np.testing.assert_allclose(got, ref, rtol=rtol, atol=atol)


@pytest.fixture(name="port", scope="session")
def port_fixture() -> Callable[..., Any]:
    return port


@pytest.fixture(name="close", scope="session")
def close_fixture() -> Callable[..., None]:
    return close


@pytest.fixture(name="randn", scope="session")
def randn_fixture() -> Callable[..., np.ndarray]:
    return randn
