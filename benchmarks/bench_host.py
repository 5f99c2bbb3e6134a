"""Host time per kernel of a plain training loop (no jit): what building the graph, scheduling it
and launching its kernels costs in Python, each step.

    python benchmarks/bench_host.py --device cpu --model resnet18 --batch 2 --size 32
    python benchmarks/bench_host.py --device cuda --model resnet18 resnet50 --batch 16 --size 224

A step is ``zero_grad``, the model, cross-entropy, ``backward`` and Adam's ``step``, with the
loss realized. On a GPU the launches are queued without waiting, so the host time is the step's
time until it returns, before the device is synchronized; on the processor the kernels run in
the calling thread, so the host time is the step's time less the time spent in the kernels'
calls. Printed: the kernels of a step, the median host time of a step and per kernel, and the
step with its synchronize.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anygpu as ag  # noqa: E402
from anygpu import models  # noqa: E402
from anygpu.graph import schedule  # noqa: E402
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
    in_kernels = [0.0, 0]  # seconds inside kernel calls, calls
    launch = schedule.Launch.__call__

    def counted(self: schedule.Launch, wait: bool = False) -> float | None:
        start = time.perf_counter()
        try:
            return launch(self, wait)
        finally:
            in_kernels[0] += time.perf_counter() - start
            in_kernels[1] += 1

    def step() -> None:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        loss.realize()

    schedule.Launch.__call__ = counted  # type: ignore[method-assign]
    try:
        for _ in range(4):  # compiles, then the steady state
            step()
            dev.synchronize()
        host, wall = [], []
        for _ in range(steps):
            in_kernels[:] = [0.0, 0]
            dev.synchronize()
            start = time.perf_counter()
            step()
            returned = time.perf_counter() - start
            dev.synchronize()
            wall.append(time.perf_counter() - start)
            host.append(returned - in_kernels[0] if dev.info.is_cpu else returned)
    finally:
        schedule.Launch.__call__ = launch  # type: ignore[method-assign]
    kernels = in_kernels[1]
    ms = statistics.median(host) * 1e3
    print(f"{name:12s} {dev.name:8s} batch {batch:3d} size {size:3d}  {kernels:5d} kernels  "
          f"host {ms:7.1f} ms ({ms / max(kernels, 1) * 1e3:5.0f} us/kernel)  "
          f"step {statistics.median(wall) * 1e3:7.1f} ms", flush=True)


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
