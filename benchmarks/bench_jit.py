"""jit replay overhead per kernel: a captured step of many tiny kernels, replayed.

    python benchmarks/bench_jit.py --device cuda opencl [--kernels 200]

The step chains N tiny elementwise kernels (each realized on its own, 1024 floats), so the time of
one replay divided by N is what the runtime adds per kernel. The same chain run eagerly (graph
building, scheduling and launching every time) and in PyTorch eager on the same GPU are printed
beside it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anygpu as ag  # noqa: E402
from anygpu.runtime.registry import get_device  # noqa: E402
from timing import median_time  # noqa: E402  (benchmarks/timing.py)


def chain(x: ag.Tensor, n: int) -> ag.Tensor:
    for _ in range(n):
        x = (x * 0.999 + 0.001).contiguous().realize()
    return x


def bench(device: str, n: int) -> None:
    dev = get_device(device)
    x = ag.tensor(np.random.default_rng(0).standard_normal(1024).astype(np.float32),
                  device=device)
    step = ag.jit(lambda t: chain(t, n))
    for _ in range(3):  # run, capture, first replay
        out = step(x)
    ref = chain(x, n).numpy()
    if not np.allclose(out.numpy(), ref, rtol=1e-5, atol=1e-6):
        raise AssertionError("replay differs from the eager run")
    replay = median_time(lambda: step(x), dev.synchronize, 20)
    eager = median_time(lambda: chain(x, n), dev.synchronize, 3)
    line = (f"{dev.name:10s} {n} kernels: replay {replay * 1e6 / n:6.2f} us/kernel   "
            f"eager {eager * 1e6 / n:7.1f} us/kernel")
    if dev.backend == "cuda":
        try:
            import torch
            tx = torch.from_numpy(x.numpy()).cuda()

            def torch_chain() -> None:
                t = tx
                for _ in range(n):
                    t = t * 0.999 + 0.001
            torch_s = median_time(torch_chain, torch.cuda.synchronize, 20)
            line += (f"   PyTorch eager {torch_s * 1e6 / n:5.2f}"
                     " us/kernel (2 kernels per step of the chain)")
        except ImportError:
            pass
    print(line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", nargs="+", default=["cpu"])
    parser.add_argument("--kernels", type=int, default=200)
    args = parser.parse_args()
    for device in args.device:
        try:
            bench(device, args.kernels)
        except (ag.BackendUnavailable, ag.DeviceError) as err:
            print(f"{device}: not measured: {err}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
