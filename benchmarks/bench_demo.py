"""The training step of ``anygpu demo`` beside PyTorch's, in one run.

    python benchmarks/bench_demo.py --device cpu [--steps 50] [--profile]

The demo's CNN (two 3x3 convolutions with batch norm and ReLU, max pooling, two linear layers)
at its batch of 64 8x8 images: one step is forward, cross-entropy, backward and Adam, captured
with ``anygpu.jit`` as the demo runs it. PyTorch runs the same architecture eagerly on the same
data, on the processor (or on CUDA when the device is ``cuda``). Printed: the median
milliseconds per step of each and the ratio; ``--profile`` adds anygpu's kernel summary.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anygpu as ag  # noqa: E402
from anygpu.cli.demo import load_digits, make_model, make_train_step  # noqa: E402
from timing import median_time  # noqa: E402  (benchmarks/timing.py)

BATCH = 64


def bench_anygpu(device: str, steps: int, profile: bool) -> float:
    images, labels = load_digits()
    ag.manual_seed(0)
    model = make_model().to(device)
    opt = ag.optim.Adam(model.parameters(), lr=3e-3)
    dev = ag.get_device(device)
    x = ag.tensor(images[:BATCH], device=device)
    y = ag.tensor(labels[:BATCH], device=device)

    step = make_train_step(model, opt)
    for _ in range(3):  # run, capture, replay
        step(x, y).item()
    seconds = median_time(lambda: step(x, y), dev.synchronize, steps)
    if profile:
        with ag.profile() as prof:
            for _ in range(10):
                step(x, y)
            dev.synchronize()
        print(prof.summary())
    return seconds


def bench_torch(device: str, steps: int) -> float | None:
    try:
        import torch
    except ImportError:
        return None
    target = "cuda" if device.startswith("cuda") else "cpu"
    images, labels = load_digits()
    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(16 * 4 * 4, 32), nn.ReLU(), nn.Linear(32, 10)).to(target)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    x = torch.from_numpy(images[:BATCH]).to(target)
    y = torch.from_numpy(labels[:BATCH]).to(target)

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    sync = torch.cuda.synchronize if target == "cuda" else (lambda: None)
    return median_time(step, sync, steps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    ours = bench_anygpu(args.device, args.steps, args.profile)
    theirs = bench_torch(args.device, args.steps)
    line = f"demo step on {args.device}: anygpu {ours * 1e3:.2f} ms ({BATCH / ours:,.0f} images/s)"
    if theirs is not None:
        line += (f", PyTorch {theirs * 1e3:.2f} ms ({BATCH / theirs:,.0f} images/s): "
                 f"{ours / theirs:.2f}x PyTorch's time")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
