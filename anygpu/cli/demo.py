"""``anygpu demo``: train a small CNN on handwritten digits (shipped with the package).

1797 8x8 grey images of the digits 0-9; 80% train, 20% test. The training step (forward,
backward, Adam update) is captured once with ``anygpu.jit`` and replayed for every batch.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import numpy as np

import anygpu as ag
from anygpu import nn
from anygpu.graph.jit import JitFunction
from anygpu.nn import functional as F


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The images scaled to [-1, 1] as (1797, 1, 8, 8) float32, and the labels as int64: the
    data set ships inside the package (anygpu/data/README.md says where it comes from)."""
    path = Path(__file__).resolve().parents[1] / "data" / "digits.npz"
    try:
        with np.load(path) as data:
            raw, labels = data["images"], data["labels"]
    except (OSError, KeyError, ValueError) as err:
        raise SystemExit(f"anygpu demo: its data set {path} is missing or damaged ({err}); "
                         "reinstall anygpu") from err
    images = (raw.astype(np.float32) / 16.0 - 0.5) / 0.5
    return images[:, None, :, :], labels.astype(np.int64)


def make_train_step(model: nn.Module, opt: ag.optim.Optimizer) -> JitFunction:
    """One training step (forward, cross-entropy, backward, the optimizer's update), captured
    with ``anygpu.jit``: the loss of a batch ``(x, y)``."""

    @ag.jit
    def train_step(x: ag.Tensor, y: ag.Tensor) -> ag.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return train_step


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 32), nn.ReLU(),
        nn.Linear(32, 10),
    )


def best_device() -> str:
    """The first working GPU backend, else the cpu."""
    from anygpu.runtime.registry import get_device

    for name in ("cuda", "hip", "opencl", "webgpu"):
        try:
            dev = get_device(name)
        except Exception:
            continue
        if dev.info.is_cpu:
            continue  # OpenCL or Vulkan on the processor is slower than the cpu backend
        return dev.name
    return "cpu"


def _progress(epoch: int, epochs: int, done: int, total: int, loss: float) -> None:
    width = 24
    filled = int(width * done / total)
    bar = "#" * filled + "." * (width - filled)
    sys.stdout.write(f"\repoch {epoch + 1:2d}/{epochs} [{bar}] {done:4d}/{total} "
                     f"loss {loss:.4f}")
    sys.stdout.flush()


def run(device: str | None = None, epochs: int = 6, batch_size: int = 64, lr: float = 3e-3,
        seed: int = 0) -> float:
    """Train and return the test accuracy."""
    device = device or best_device()
    ag.manual_seed(seed)
    images, labels = load_digits()
    order = np.random.default_rng(seed).permutation(len(images))
    split = int(0.8 * len(images))
    train_idx, test_idx = order[:split], order[split:]
    model = make_model().to(device)
    opt = ag.optim.Adam(model.parameters(), lr=lr)
    sched = ag.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs)
    print(f"device: {ag.get_device(device).name} ({ag.get_device(device).info.name})")
    print(f"data: {len(train_idx)} training and {len(test_idx)} test images of 8x8 digits")

    train_step = make_train_step(model, opt)

    steps = len(train_idx) // batch_size  # full batches only: one captured shape
    rng = np.random.default_rng(seed + 1)
    seen, train_time = 0, 0.0
    for epoch in range(epochs):
        model.train()
        perm = rng.permutation(train_idx)
        start = time.perf_counter()
        losses = []
        for s in range(steps):
            idx = perm[s * batch_size:(s + 1) * batch_size]
            x = ag.tensor(images[idx], device=device)
            y = ag.tensor(labels[idx], device=device)
            loss = train_step(x, y)  # a replay reuses its output buffer: read it now
            if s % 4 == 3 or s == steps - 1:
                losses.append(loss.item())
                _progress(epoch, epochs, (s + 1) * batch_size, steps * batch_size, losses[-1])
        mean_loss = float(np.mean(losses[-3:]))
        train_time += time.perf_counter() - start
        seen += steps * batch_size
        sched.step()
        sys.stdout.write(f"\repoch {epoch + 1:2d}/{epochs} loss {mean_loss:.4f} "
                         f"({seen / train_time:.0f} images/s)" + " " * 30 + "\n")
    model.eval()
    correct = 0
    with ag.no_grad():
        for s in range(0, len(test_idx), 256):
            idx = test_idx[s:s + 256]
            pred = model(ag.tensor(images[idx], device=device)).argmax(1).numpy()
            correct += int((pred == labels[idx]).sum())
    accuracy = correct / len(test_idx)
    print(f"training: {seen / train_time:.0f} images/s on {ag.get_device(device).name}")
    print(f"test accuracy {math.floor(accuracy * 1000) / 1000:.3f}")
    return accuracy
