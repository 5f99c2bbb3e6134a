"""Host time per kernel of a plain training loop (no jit): what building the graph, scheduling it
and launching its kernels costs in Python, each step.

    python benchmarks/bench_host.py --device cpu --model resnet18 --batch 2 --size 32
    python benchmarks/bench_host.py --device cuda --model resnet18 resnet50 --batch 16 --size 224

A step is ``zero_grad``, the model, cross-entropy, ``backward`` and Adam's ``step``, with the
loss realized. On a GPU the launches are queued without waiting, so the host time is the step's
time until it returns, before the device is synchronized; on the processor the kernels run in
the calling thread, so the host time is the step's time less the time spent in the kernels'
calls (``anygpu.cli.bench.host_per_kernel``, which ``anygpu bench --no-jit`` prints too).
Printed: the kernels of a step, the median host time of a step and per kernel, and the step
with its synchronize.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anygpu as ag  # noqa: E402
from anygpu import models  # noqa: E402
from anygpu.cli.bench import host_per_kernel  # noqa: E402
from anygpu.nn import functional as F  # noqa: E402


def measure(name: str, device: str, batch: int, size: int, steps: int) -> None:
    dev = ag.get_device(device)
    ag.manual_seed(0)
    model = getattr(models, name)(num_classes=10).to(dev.name)
    model.train()
    opt = ag.optim.Adam(model.parameters(), lr=1e-4)
    rng = np.random.default_rng(0)
    x = ag.tensor(rng.standard_normal((batch, 3, size, size), np.float32), device=dev.name)
    y = ag.tensor(rng.integers(0, 10, batch), device=dev.name)

    def step() -> None:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        loss.realize()

    for _ in range(4):  # compiles, then the steady state
        step()
        dev.synchronize()
    start = time.perf_counter()
    for _ in range(3):
        step()
    dev.synchronize()
    wall = (time.perf_counter() - start) / 3
    host, kernels = host_per_kernel(step, dev, steps)
    print(f"{name:12s} {dev.name:8s} batch {batch:3d} size {size:3d}  {kernels:5d} kernels  "
          f"host {host * 1e3:7.1f} ms ({host / max(kernels, 1) * 1e6:5.0f} us/kernel)  "
          f"step {wall * 1e3:7.1f} ms", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", nargs="+", default=["resnet18"])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--steps", type=int, default=15)
    args = p.parse_args()
    for name in args.model:
        measure(name, args.device, args.batch, args.size, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
