"""The kernels of one training step of a model, counted by phase (forward, backward, optimizer)
and by kind (products, reductions, elementwise), with the bytes their buffers hold: what a change
to the scheduler or to a layer's gradient does to a step, on any backend, without timing it.

    python benchmarks/step_kernels.py --model resnet18 --device opencl --batch 8 --size 64
    python benchmarks/step_kernels.py --model resnet50 --device cuda --batch 16 --size 224 --top 20

Each launch is recorded by ``anygpu.profile``: its device time and the bytes it reads and
writes at the least (each input once, the output); a kernel is "tiny" below 64 KiB of them.
``--top N`` lists the N kernels with the most bytes and the tiny kernels seen most often.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anygpu as ag  # noqa: E402
from anygpu import models  # noqa: E402
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
    dev = ag.get_device(args.device)

    def phases() -> list[tuple[str, Callable[[], Any]]]:
        loss: list[Any] = []

        def forward() -> None:
            opt.zero_grad()
            loss.append(F.cross_entropy(model(x), y).realize())
        return [("forward", forward), ("backward", lambda: loss[0].backward()),
                ("optimizer", opt.step)]

    for _, run in phases():  # compiles; the counted step is the second
        run()
    launches: list[tuple[str, str, int, float]] = []
    for phase, run in phases():
        with ag.profile() as prof:
            run()
            dev.synchronize()
        launches += [(phase, e.name, e.nbytes, e.duration) for e in prof.events
                     if e.kind == "kernel"]

    print(f"{args.model} on {args.device}, batch {args.batch}, {args.size}x{args.size}: "
          f"{len(launches)} kernels, {sum(r[2] for r in launches) / 1e6:.1f} MB, "
          f"{sum(r[3] for r in launches) * 1e3:.2f} ms of device time")
    table: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0, 0, 0.0])
    for ph, name, nbytes, seconds in launches:
        row = table[(ph, kind(name))]
        row[0] += 1
        row[1] += nbytes
        row[2] += nbytes < TINY
        row[3] += seconds
    print(f"{'phase':10s} {'kind':12s} {'kernels':>8s} {'tiny':>6s} {'MB':>10s} {'ms':>9s}")
    for (ph, k), (n, nbytes, tiny, seconds) in sorted(table.items()):
        print(f"{ph:10s} {k:12s} {n:8.0f} {tiny:6.0f} {nbytes / 1e6:10.1f} {seconds * 1e3:9.2f}")
    if args.top:
        print("most bytes:")
        for ph, name, nbytes, _ in sorted(launches, key=lambda r: -r[2])[:args.top]:
            print(f"  {nbytes / 1e6:10.1f} MB  {ph:9s} {name}")
        print("tiny kernels seen most often:")
        tiny = collections.Counter((ph, name) for ph, name, nbytes, _ in launches
                                   if nbytes < TINY)
        for (ph, name), n in tiny.most_common(args.top):
            print(f"  {n:5d}x  {ph:9s} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
