"""``ANYGPU_CHECK``: kernels of a device checked against the processor's on the same inputs."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

import anygpu as ag
from anygpu import config
from anygpu.graph import check
from anygpu.graph import schedule as sched


@pytest.fixture
def checking(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Kernels checked (``ANYGPU_CHECK=1``) while the test runs: the names of those that ran."""
    monkeypatch.setenv("ANYGPU_CHECK", "1")
    config.reload()
    ran: list[str] = []
    real = check.run

    def counted(item, launch) -> None:  # type: ignore[no-untyped-def]
        ran.append(launch.name)
        real(item, launch)

    monkeypatch.setattr(check, "run", counted)
    yield ran
    monkeypatch.delenv("ANYGPU_CHECK")
    config.reload()


def _step(device: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """One SGD step of a small convolutional network on ``device``: its gradients and weights."""
    ag.manual_seed(3)
    net = ag.nn.Sequential(ag.nn.Conv2d(3, 8, 3, padding=1), ag.nn.BatchNorm2d(8), ag.nn.ReLU(),
                           ag.nn.MaxPool2d(2), ag.nn.Flatten(), ag.nn.Linear(8 * 4 * 4, 5))
    net.to(device)
    opt = ag.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    rng = np.random.default_rng(4)
    x = ag.tensor(rng.standard_normal((4, 3, 8, 8)).astype(np.float32), device=device)
    y = ag.tensor(rng.integers(0, 5, 4), device=device)
    ag.nn.CrossEntropyLoss()(net(x), y).backward()
    grads = [p.grad.numpy() for p in net.parameters()]
    opt.step()
    return grads, [p.numpy() for p in net.parameters()]


def test_a_training_step_checks_every_kernel(device: str, checking: list[str]) -> None:
    """A training step (forward, backward, an optimizer's in-place update) with every kernel
    checked: all agree with the processor's, and the step's numbers are the processor's
    step's."""
    if device.startswith("cpu"):
        pytest.skip("the processor's kernels are what the others are checked against")
    grads, weights = _step(device)
    assert len(checking) >= 10
    ran = len(checking)
    want_grads, want_weights = _step("cpu")  # (the processor's kernels are not checked)
    assert len(checking) == ran
    for got, want in zip(grads + weights, want_grads + want_weights):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def _wrong_by_one(monkeypatch: pytest.MonkeyPatch, name_part: str) -> None:
    """Make the device's kernels whose name holds ``name_part`` add one to their output, as a
    miscompiled kernel would compute something else."""
    real = sched.prepare

    def prepared(item, out=None):  # type: ignore[no-untyped-def]
        launch = real(item, out)
        if name_part not in launch.name:
            return launch
        program = launch.program

        class Wrong:
            device = program.device

            def __call__(self, buffers, groups, local, wait=False):  # type: ignore[no-untyped-def]
                program(buffers, groups, local, wait=True)
                host = np.empty(buffers[0].nbytes // 4, np.float32)
                buffers[0].copy_out(host)
                buffers[0].copy_in(host + 1)

        launch.program = Wrong()  # type: ignore[assignment]
        return launch

    monkeypatch.setattr(sched, "prepare", prepared)


def test_a_wrong_kernel_is_named(device: str, checking: list[str],
                                 monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A kernel whose output differs from the processor's raises KernelMismatchError naming it
    and where its sources are; under ANYGPU_CHECK=2 it warns and the processor's output is
    used."""
    if device.startswith("cpu"):
        pytest.skip("the processor's kernels are what the others are checked against")
    monkeypatch.setenv("ANYGPU_CACHE_DIR", str(tmp_path))
    config.reload()
    _wrong_by_one(monkeypatch, "e_")
    rng = np.random.default_rng(5)
    a = rng.standard_normal((6, 7)).astype(np.float32)
    b = rng.standard_normal((6, 7)).astype(np.float32)
    x, y = ag.tensor(a, device=device), ag.tensor(b, device=device)
    with pytest.raises(ag.KernelMismatchError, match=r"kernel e_\w+ computed 42 of 42 elements"):
        (x * y + 2).numpy()
    assert list(tmp_path.glob("mismatches/e_*.c.txt"))
    monkeypatch.setenv("ANYGPU_CHECK", "2")
    config.reload()
    check._warned.clear()
    with pytest.warns(RuntimeWarning, match="the processor's output is used"):
        got = (x * y + 3).numpy()
    np.testing.assert_allclose(got, a * b + 3, rtol=1e-6)
