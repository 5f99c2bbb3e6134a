"""``sort`` end to end (building the graph, scheduling, the kernels, waiting for them) against
PyTorch's on the same device, for each algorithm: ranks over the whole axis ("rank"), the bitonic
network from sorted blocks of B elements ("B=64", ...), and the cost model's choice ("auto").
These are the figures ``ops/sorting.py``'s costs come from; then ``topk`` of a few elements.

    python benchmarks/bench_sort.py --device cpu [--shapes 64x1000 1x50000] [--blocks 64 512]

Times are the best of several rounds after a warm-up round (compiles excluded); float32 input of
random normal values, sorted along the last axis.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anygpu as ag  # noqa: E402
from anygpu.ops import sorting  # noqa: E402
from anygpu.runtime.registry import get_device  # noqa: E402


def best_ms(run: Callable[[], Any], rounds: int) -> float:
    run()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shapes", nargs="+", default=["64x1000", "1x50000", "1024x128",
                                                        "1x2000", "16x8192"])
    parser.add_argument("--blocks", nargs="+", type=int, default=[64, 512, 2048])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--topk", type=int, default=10, help="also time topk(K) (0: no)")
    args = parser.parse_args()
    device = get_device(args.device)
    try:
        import torch
    except ImportError:
        torch = None
    choose = sorting._block_size
    for text in args.shapes:
        shape = tuple(int(s) for s in text.split("x"))
        rows, n = int(np.prod(shape[:-1])), shape[-1]
        x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        t = ag.tensor(x, device=device.name).realize()
        row = {}
        for name, block in [("auto", 0), ("rank", n)] + [(f"B={b}", b) for b in args.blocks]:
            if block > n or (name == "rank" and rows * n * n > 2**33):
                continue
            sorting._block_size = (lambda r, m, d="cpu", b=block: b) if block else choose

            def run(t: ag.Tensor = t) -> None:
                values, indices = ag.sort(t)
                ag.realize(values, indices)
                device.synchronize()
            label = name if block else f"auto({choose(rows, n, device.name)})"
            row[label] = best_ms(run, args.rounds)
        sorting._block_size = choose
        if args.topk:
            def run_topk(t: ag.Tensor = t) -> None:
                ag.realize(*ag.topk(t, args.topk))
                device.synchronize()
            row[f"topk({args.topk})"] = best_ms(run_topk, args.rounds)
        if torch is not None:
            where = "cuda" if device.name.startswith("cuda") else "cpu"
            tt = torch.tensor(x, device=where)

            def run_torch(tt: Any = tt, where: str = where, k: int = 0) -> None:
                torch.topk(tt, k) if k else torch.sort(tt)
                if where == "cuda":
                    torch.cuda.synchronize()
            row["torch"] = best_ms(run_torch, args.rounds)
            if args.topk:
                row[f"torch topk({args.topk})"] = best_ms(
                    lambda: run_torch(k=args.topk), args.rounds)
        print(f"{text:>10s}  " + "  ".join(f"{k} {v:8.2f} ms" for k, v in row.items()),
              flush=True)


if __name__ == "__main__":
    main()
