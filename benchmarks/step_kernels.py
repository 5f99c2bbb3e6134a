"""The kernels of one training step of a model, counted by phase (forward, backward, optimizer)
and by kind (products, reductions, elementwise), with the bytes their buffers hold: what a change
to the scheduler or to a layer's gradient does to a step, on any backend, without timing it.

    python benchmarks/step_kernels.py --model resnet18 --device opencl --batch 8 --size 64
    python benchmarks/step_kernels.py --model resnet50 --device cuda --batch 16 --size 224 --top 20

Bytes are the sizes of each launch's buffers (its output and inputs, each counted once per
launch), an upper bound on what it moves; a kernel is "tiny" below 64 KiB of them. ``--top N``
lists the N kernels with the most bytes and the tiny kernels seen most often.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anygpu as ag  # noqa: E402
from anygpu import models  # noqa: E402
from anygpu.graph import schedule  # noqa: E402
from anygpu.nn import functional as F  # noqa: E402

TINY = 1 << 16


def kind(name: str) -> str:
    return "product" if name.startswith("gemm") else {"r": "reduction", "e": "elementwise"}.get(
        name[:1], "other")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = [n for n in models.__all__ if n[0].islower()]
    p.add_argument("--model", default="resnet18", choices=names)
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--top", type=int, default=0)
    args = p.parse_args(argv)
    if args.batch < 2:
        p.error("--batch must be 2 or more (batch norm's statistics need two values a channel)")

    ag.manual_seed(0)
    model = getattr(models, args.model)().to(args.device)
    model.train()
    rng = np.random.default_rng(0)
    x = ag.tensor(rng.standard_normal((args.batch, 3, args.size, args.size), np.float32),
                  device=args.device)
    y = ag.tensor(rng.integers(0, 1000, args.batch), device=args.device)
    opt = ag.optim.Adam(model.parameters(), lr=1e-4)
    phase = ["forward"]
    launches: list[tuple[str, str, int]] = []

    def step() -> None:
        phase[0] = "forward"
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.realize()
        phase[0] = "backward"
        loss.backward()
        phase[0] = "optimizer"
        opt.step()
        ag.get_device(args.device).synchronize()

    step()  # compiles; the counted step is the second
    real = schedule.Launch.__call__

    def counted(self: Any, wait: bool = False) -> Any:
        launches.append((phase[0], self.name, sum(b.nbytes for b in self.buffers)))
        return real(self, wait)

    schedule.Launch.__call__ = counted  # type: ignore[method-assign]
    try:
        step()
    finally:
        schedule.Launch.__call__ = real  # type: ignore[method-assign]

    print(f"{args.model} on {args.device}, batch {args.batch}, {args.size}x{args.size}: "
          f"{len(launches)} kernels, {sum(b for _, _, b in launches) / 1e6:.1f} MB of buffers")
    table: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    for ph, name, nbytes in launches:
        row = table[(ph, kind(name))]
        row[0] += 1
        row[1] += nbytes
        row[2] += nbytes < TINY
    print(f"{'phase':10s} {'kind':12s} {'kernels':>8s} {'tiny':>6s} {'MB':>10s}")
    for (ph, k), (n, nbytes, tiny) in sorted(table.items()):
        print(f"{ph:10s} {k:12s} {n:8d} {tiny:6d} {nbytes / 1e6:10.1f}")
    if args.top:
        print("most bytes:")
        for ph, name, nbytes in sorted(launches, key=lambda r: -r[2])[:args.top]:
            print(f"  {nbytes / 1e6:10.1f} MB  {ph:9s} {name}")
        print("tiny kernels seen most often:")
        tiny = collections.Counter((ph, name) for ph, name, nbytes in launches if nbytes < TINY)
        for (ph, name), n in tiny.most_common(args.top):
            print(f"  {n:5d}x  {ph:9s} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
